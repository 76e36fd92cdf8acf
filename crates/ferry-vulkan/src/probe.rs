//! What each Vulkan device offers, asked without creating a device.
//!
//! The same facts serve two callers: [`probe`] (behind `ferry info` and `ferry::capabilities`), which
//! reports them, and [`VulkanContext`](crate::VulkanContext), which decides from them which extensions
//! to enable and which allocation paths it can serve. Structures of an extension are chained into a
//! query only when the device lists that extension, so a driver never sees a structure it does not know.

use std::ffi::CStr;
use std::fmt;

use ash::vk;
use ferry_core::{PciAddress, Result};
use serde::Serialize;

use crate::error::vk_error;
use crate::loader::{Loaded, version_string};
use crate::memtype::{BufferTypes, MemoryLayout, PathSupport, flag_names};
use crate::select::{Candidate, format_uuid};

/// Device extensions this crate enables where offered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Extensions {
    /// `VK_KHR_external_memory_fd`: export and import opaque fds.
    pub memory_fd: bool,
    /// `VK_EXT_external_memory_host`: import host allocations.
    pub memory_host: bool,
    /// `VK_NV_external_memory_rdma`: RDMA-capable memory with a remote address.
    pub memory_rdma: bool,
    /// `VK_EXT_memory_budget`: per-heap budget and usage.
    pub memory_budget: bool,
    /// `VK_EXT_external_memory_dma_buf`: export memory as a dma-buf (through `vkGetMemoryFdKHR`,
    /// so only with `memory_fd`), which a NIC registers directly.
    pub memory_dma_buf: bool,
}

impl Extensions {
    /// The names to pass to `vkCreateDevice`.
    pub fn names(&self) -> Vec<&'static CStr> {
        let mut v = Vec::new();
        if self.memory_fd {
            v.push(ash::khr::external_memory_fd::NAME);
        }
        if self.memory_host {
            v.push(ash::ext::external_memory_host::NAME);
        }
        if self.memory_rdma {
            v.push(ash::nv::external_memory_rdma::NAME);
        }
        if self.memory_budget {
            v.push(ash::ext::memory_budget::NAME);
        }
        if self.memory_dma_buf {
            v.push(ash::ext::external_memory_dma_buf::NAME);
        }
        v
    }
}

/// Everything this crate needs to know about one physical device.
#[derive(Debug, Clone)]
pub(crate) struct DeviceFacts {
    /// Position in the enumeration.
    pub index: usize,
    /// The handle.
    pub handle: vk::PhysicalDevice,
    /// `deviceName`.
    pub name: String,
    /// Discrete, integrated, CPU…
    pub device_type: vk::PhysicalDeviceType,
    /// The version the device reports.
    pub device_version: u32,
    /// `deviceUUID`.
    pub uuid: [u8; 16],
    /// Driver name and info ("llvmpipe", "Mesa 22.3.6 (LLVM 15.0.6)").
    pub driver: String,
    /// Extensions offered (of those this crate uses).
    pub extensions: Extensions,
    /// `externalMemoryRDMA` feature (only asked where the extension is offered).
    pub rdma_feature: bool,
    /// Memory types and heaps.
    pub layout: MemoryLayout,
    /// `maxMemoryAllocationSize`.
    pub max_allocation_size: u64,
    /// `maxBufferSize` (Vulkan 1.3), if known.
    pub max_buffer_size: Option<u64>,
    /// `minImportedHostPointerAlignment`, where host import is offered.
    pub min_import_alignment: Option<u64>,
    /// `nonCoherentAtomSize`.
    pub non_coherent_atom: u64,
    /// Why this crate cannot use the device, if it cannot.
    pub unusable: Option<String>,
    /// Its PCI function, where the driver tells it (`VK_EXT_pci_bus_info`).
    pub pci_address: Option<PciAddress>,
}

impl DeviceFacts {
    /// The paths this device's memory types allow once it is created with the extensions it offers.
    /// An upper bound: an open [`VulkanContext`](crate::VulkanContext) also asks which types its
    /// buffers may use, and may serve fewer.
    pub fn paths(&self) -> PathSupport {
        if self.unusable.is_some() {
            return PathSupport::default();
        }
        self.layout
            .paths(self.extensions.memory_rdma && self.rdma_feature, &BufferTypes::ANY)
    }

    /// What device selection needs.
    pub fn candidate(&self) -> Candidate {
        Candidate {
            index: self.index,
            name: self.name.clone(),
            uuid: self.uuid,
            device_type: self.device_type,
            unusable: self.unusable.clone(),
        }
    }

    /// The serialisable report.
    pub fn info(&self) -> VulkanDeviceInfo {
        VulkanDeviceInfo {
            index: self.index,
            name: self.name.clone(),
            device_type: type_name(self.device_type).to_string(),
            uuid: format_uuid(&self.uuid),
            api_version: version_string(self.device_version),
            driver: self.driver.clone(),
            memory_heaps: self
                .layout
                .heaps
                .iter()
                .enumerate()
                .map(|(index, h)| MemoryHeapInfo {
                    index,
                    size: h.size,
                    device_local: h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL),
                })
                .collect(),
            memory_types: self
                .layout
                .types
                .iter()
                .enumerate()
                .map(|(index, t)| MemoryTypeInfo {
                    index,
                    heap: t.heap,
                    flags: flag_names(t.flags).into_iter().map(String::from).collect(),
                })
                .collect(),
            max_allocation_size: self.max_allocation_size,
            paths: self.paths(),
            nv_rdma: self.extensions.memory_rdma && self.rdma_feature,
            external_memory_fd: self.extensions.memory_fd,
            external_memory_host: self.extensions.memory_host,
            external_memory_dma_buf: self.extensions.memory_dma_buf,
            pci_address: self.pci_address.map(|a| a.to_string()),
            unusable: self.unusable.clone(),
        }
    }
}

/// One Vulkan device as `ferry info --json` lists it under `vulkan_devices`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VulkanDeviceInfo {
    /// Position in the driver's enumeration (what [`DeviceSelector::Index`](crate::DeviceSelector) names).
    pub index: usize,
    /// The device name.
    pub name: String,
    /// "discrete-gpu", "integrated-gpu", "virtual-gpu", "cpu" or "other".
    pub device_type: String,
    /// The device UUID, shared with CUDA.
    pub uuid: String,
    /// The Vulkan version the device supports.
    pub api_version: String,
    /// Driver name and version text.
    pub driver: String,
    /// Memory heaps.
    pub memory_heaps: Vec<MemoryHeapInfo>,
    /// Memory types.
    pub memory_types: Vec<MemoryTypeInfo>,
    /// The largest single allocation (`maxMemoryAllocationSize`).
    pub max_allocation_size: u64,
    /// Which allocation paths ferry can use on it.
    pub paths: PathSupport,
    /// Whether `VK_NV_external_memory_rdma` and its feature are available (GPUDirect RDMA).
    pub nv_rdma: bool,
    /// Whether opaque fds can be exported (`VK_KHR_external_memory_fd`).
    pub external_memory_fd: bool,
    /// Whether host memory can be imported (`VK_EXT_external_memory_host`).
    pub external_memory_host: bool,
    /// Whether memory can be exported as a dma-buf (`VK_EXT_external_memory_dma_buf`), which an
    /// RDMA NIC registers directly (GPUDirect RDMA without `VK_NV_external_memory_rdma`).
    pub external_memory_dma_buf: bool,
    /// Its PCI address ("0000:3b:00.0"), where the driver reports one (`VK_EXT_pci_bus_info`): RDMA
    /// rails are ranked by their PCIe path to it.
    pub pci_address: Option<String>,
    /// Why ferry cannot use the device, if it cannot.
    pub unusable: Option<String>,
}

/// One memory heap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryHeapInfo {
    /// Heap index.
    pub index: usize,
    /// Size in bytes.
    pub size: u64,
    /// Whether the heap is device-local.
    pub device_local: bool,
}

/// One memory type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryTypeInfo {
    /// Type index.
    pub index: usize,
    /// The heap it allocates from.
    pub heap: u32,
    /// Its property flags ("device-local", "host-visible", "rdma-capable"…).
    pub flags: Vec<String>,
}

impl fmt::Display for VulkanDeviceInfo {
    /// One line: "llvmpipe (LLVM 15) [cpu, llvmpipe; paths: host-visible, staged; nv-rdma: no]".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut paths = Vec::new();
        for (on, name) in [
            (self.paths.rdma, "rdma"),
            (self.paths.host_visible, "host-visible"),
            (self.paths.staged, "staged"),
        ] {
            if on {
                paths.push(name);
            }
        }
        let paths = if paths.is_empty() {
            "none".to_string()
        } else {
            paths.join(", ")
        };
        write!(
            f,
            "{} [{}, {}; paths: {}; nv-rdma: {}]",
            self.name,
            self.device_type,
            self.driver,
            paths,
            if self.nv_rdma { "yes" } else { "no" }
        )
    }
}

/// Lists every Vulkan device on this host with what ferry can do with it.
///
/// Creates a Vulkan instance (no device), so it costs tens of milliseconds. Without a loader or a
/// driver it returns [`Error::Unsupported`](ferry_core::Error::Unsupported) with the reason; it never
/// panics.
pub fn probe() -> Result<Vec<VulkanDeviceInfo>> {
    let loaded = Loaded::new()?;
    Ok(enumerate(&loaded)?.iter().map(DeviceFacts::info).collect())
}

/// The facts of every physical device of `loaded`'s instance.
pub(crate) fn enumerate(loaded: &Loaded) -> Result<Vec<DeviceFacts>> {
    // SAFETY: the instance is valid for the lifetime of `loaded`.
    let devices = unsafe { loaded.instance.enumerate_physical_devices() }
        .map_err(|e| vk_error("vkEnumeratePhysicalDevices", e))?;
    devices
        .into_iter()
        .enumerate()
        .map(|(index, handle)| gather(loaded, index, handle))
        .collect()
}

fn gather(loaded: &Loaded, index: usize, handle: vk::PhysicalDevice) -> Result<DeviceFacts> {
    let instance = &loaded.instance;
    // SAFETY: `handle` was enumerated from this instance, which is alive.
    let props = unsafe { instance.get_physical_device_properties(handle) };
    let name = c_text(props.device_name_as_c_str());
    let api_version = props.api_version.min(loaded.api_version);
    // SAFETY: as above.
    let memory = unsafe { instance.get_physical_device_memory_properties(handle) };
    let mut facts = DeviceFacts {
        index,
        handle,
        name,
        device_type: props.device_type,
        device_version: props.api_version,
        uuid: [0; 16],
        driver: String::new(),
        extensions: Extensions::default(),
        rdma_feature: false,
        layout: MemoryLayout::from_vk(&memory),
        max_allocation_size: 0,
        max_buffer_size: None,
        min_import_alignment: None,
        non_coherent_atom: props.limits.non_coherent_atom_size.max(1),
        unusable: None,
        pci_address: None,
    };
    if props.api_version < vk::API_VERSION_1_1 {
        facts.unusable = Some(format!(
            "it supports Vulkan {} and ferry needs 1.1",
            version_string(props.api_version)
        ));
        return Ok(facts);
    }
    // SAFETY: as above.
    let offered = unsafe { instance.enumerate_device_extension_properties(handle) }
        .map_err(|e| vk_error("vkEnumerateDeviceExtensionProperties", e))?;
    let has = |name: &CStr| offered.iter().any(|e| e.extension_name_as_c_str() == Ok(name));
    facts.extensions = Extensions {
        memory_fd: has(ash::khr::external_memory_fd::NAME),
        memory_host: has(ash::ext::external_memory_host::NAME),
        memory_rdma: has(ash::nv::external_memory_rdma::NAME),
        memory_budget: has(ash::ext::memory_budget::NAME),
        memory_dma_buf: has(ash::ext::external_memory_dma_buf::NAME) && has(ash::khr::external_memory_fd::NAME),
    };
    let driver_properties = api_version >= vk::API_VERSION_1_2 || has(ash::khr::driver_properties::NAME);
    let pci_bus_info = has(ash::ext::pci_bus_info::NAME);

    let mut id = vk::PhysicalDeviceIDProperties::default();
    let mut m3 = vk::PhysicalDeviceMaintenance3Properties::default();
    let mut m4 = vk::PhysicalDeviceMaintenance4Properties::default();
    let mut drv = vk::PhysicalDeviceDriverProperties::default();
    let mut host = vk::PhysicalDeviceExternalMemoryHostPropertiesEXT::default();
    let mut pci = vk::PhysicalDevicePCIBusInfoPropertiesEXT::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default()
        .push_next(&mut id)
        .push_next(&mut m3);
    if api_version >= vk::API_VERSION_1_3 {
        props2 = props2.push_next(&mut m4);
    }
    if driver_properties {
        props2 = props2.push_next(&mut drv);
    }
    if facts.extensions.memory_host {
        props2 = props2.push_next(&mut host);
    }
    if pci_bus_info {
        props2 = props2.push_next(&mut pci);
    }
    // SAFETY: the chain holds only structures of Vulkan 1.1 (the device supports it) and of versions or
    // extensions checked just above; all live until the call returns.
    unsafe { instance.get_physical_device_properties2(handle, &mut props2) };
    facts.uuid = id.device_uuid;
    facts.max_allocation_size = m3.max_memory_allocation_size;
    if api_version >= vk::API_VERSION_1_3 {
        facts.max_buffer_size = Some(m4.max_buffer_size);
    }
    if driver_properties {
        facts.driver = format!(
            "{} {}",
            c_text(drv.driver_name_as_c_str()),
            c_text(drv.driver_info_as_c_str())
        )
        .trim()
        .to_string();
    }
    if facts.driver.is_empty() {
        facts.driver = format!("driver version {:#x}", props.driver_version);
    }
    if pci_bus_info {
        facts.pci_address = pci_address(&pci);
    }
    if facts.extensions.memory_host {
        facts.min_import_alignment = Some(host.min_imported_host_pointer_alignment.max(1));
    }
    if facts.extensions.memory_rdma {
        let mut rdma = vk::PhysicalDeviceExternalMemoryRDMAFeaturesNV::default();
        let mut features = vk::PhysicalDeviceFeatures2::default().push_next(&mut rdma);
        // SAFETY: the RDMA features structure is chained only because the device lists the extension;
        // both structures live until the call returns.
        unsafe { instance.get_physical_device_features2(handle, &mut features) };
        facts.rdma_feature = rdma.external_memory_rdma == vk::TRUE;
    }
    Ok(facts)
}

/// The PCI address `VK_EXT_pci_bus_info` reports; `None` for values no PCI address can have.
fn pci_address(info: &vk::PhysicalDevicePCIBusInfoPropertiesEXT) -> Option<PciAddress> {
    let address = PciAddress {
        domain: info.pci_domain,
        bus: u8::try_from(info.pci_bus).ok()?,
        device: u8::try_from(info.pci_device).ok().filter(|&d| d < 32)?,
        function: u8::try_from(info.pci_function).ok().filter(|&f| f < 8)?,
    };
    Some(address)
}

fn c_text(s: std::result::Result<&CStr, std::ffi::FromBytesUntilNulError>) -> String {
    s.map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
}

fn type_name(t: vk::PhysicalDeviceType) -> &'static str {
    match t {
        vk::PhysicalDeviceType::DISCRETE_GPU => "discrete-gpu",
        vk::PhysicalDeviceType::INTEGRATED_GPU => "integrated-gpu",
        vk::PhysicalDeviceType::VIRTUAL_GPU => "virtual-gpu",
        vk::PhysicalDeviceType::CPU => "cpu",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_drivers_pci_bus_info_becomes_an_address_or_nothing() {
        let info = |domain, bus, device, function| vk::PhysicalDevicePCIBusInfoPropertiesEXT {
            pci_domain: domain,
            pci_bus: bus,
            pci_device: device,
            pci_function: function,
            ..Default::default()
        };
        let address = pci_address(&info(0, 0x3b, 0, 0)).map(|a| a.to_string());
        assert_eq!(address.as_deref(), Some("0000:3b:00.0"));
        assert_eq!(pci_address(&info(0, 256, 0, 0)), None);
        assert_eq!(pci_address(&info(0, 1, 32, 0)), None);
        assert_eq!(pci_address(&info(0, 1, 0, 8)), None);
    }
}
