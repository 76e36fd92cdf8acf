//! The CUDA driver, loaded once at run time, and what it says about its devices.
//!
//! Nothing links against CUDA: the driver library (`libcuda.so.1`, installed with the NVIDIA kernel
//! driver, not with the toolkit) is opened the first time anything here is asked for. A host without
//! it, or whose driver will not initialise, gets [`Error::Unsupported`] with the reason, the same
//! reason every time, and `ferry info` prints it.

use std::ffi::{CStr, c_char, c_int};
use std::sync::OnceLock;

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUdevice_attribute};
use ferry_core::{Error, Result};
use serde::Serialize;

use crate::error::{check, code_name};

/// What to do when the driver library is not found.
pub const INSTALL_HINT: &str = "install the NVIDIA driver, which provides it (the CUDA toolkit alone does not); \
     in a container, run with the NVIDIA container toolkit (--gpus)";

/// The loaded driver: its version and how many devices it sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Driver {
    /// `cuDriverGetVersion`: 1000 × major + 10 × minor (12080 is 12.8).
    pub version: i32,
    /// Devices the driver sees (`CUDA_VISIBLE_DEVICES` applies).
    pub devices: usize,
}

impl Driver {
    /// "12.8".
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version / 1000, (self.version % 1000) / 10)
    }
}

/// The driver, loaded and initialised on the first call; [`Error::Unsupported`] with the reason
/// where there is none or it does not initialise.
pub fn driver() -> Result<&'static Driver> {
    static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();
    DRIVER
        .get_or_init(load)
        .as_ref()
        .map_err(|why| Error::Unsupported(why.clone()))
}

fn load() -> std::result::Result<Driver, String> {
    // SAFETY: `is_culib_present` only tries to open the library under its usual names; opening runs
    // the driver library's own initialisers, as any CUDA program does.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!(
            "no CUDA driver: libcuda.so.1 could not be opened; {INSTALL_HINT}"
        ));
    }
    result::init().map_err(|e| format!("the CUDA driver did not initialise (cuInit: {})", code_name(e.0)))?;
    let mut version: c_int = 0;
    // SAFETY: the driver writes one int through the pointer, which points to `version`.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| format!("cuDriverGetVersion: {}", code_name(e.0)))?;
    let devices = result::device::get_count().map_err(|e| format!("cuDeviceGetCount: {}", code_name(e.0)))?;
    let driver = Driver {
        version,
        devices: usize::try_from(devices).unwrap_or(0),
    };
    tracing::debug!(version = %driver.version_string(), devices = driver.devices, "CUDA driver loaded");
    Ok(driver)
}

/// One CUDA device and the paths to its memory it offers, for `ferry info` and capabilities.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CudaDeviceInfo {
    /// The device's ordinal (as `CUDA_VISIBLE_DEVICES` numbers them).
    pub ordinal: u32,
    /// "NVIDIA H200".
    pub name: String,
    /// Its PCI function, "0000:3b:00.0".
    pub pci_address: String,
    /// Bytes of device memory.
    pub memory_bytes: u64,
    /// "9.0".
    pub compute_capability: String,
    /// Device and host share one virtual address space (a device pointer tells its device).
    pub unified_addressing: bool,
    /// A NIC may read and write this device's memory directly (GPUDirect RDMA).
    pub gpudirect_rdma: bool,
    /// Device memory can be exported as a dma-buf (`cuMemGetHandleForAddressRange`), which
    /// `ibv_reg_dmabuf_mr` registers with a NIC without the peer-memory module.
    pub dma_buf: bool,
    /// Virtual memory management (`cuMemCreate`/`cuMemMap`), whose allocations export shareable
    /// handles.
    pub vmm: bool,
    /// Those handles may be POSIX file descriptors (sent over a Unix socket to another process).
    pub posix_fd_handles: bool,
}

/// The devices the driver sees; [`Error::Unsupported`] with the reason where there is no driver.
pub fn probe() -> Result<Vec<CudaDeviceInfo>> {
    let driver = driver()?;
    (0..driver.devices).map(device_info).collect()
}

fn device_info(ordinal: usize) -> Result<CudaDeviceInfo> {
    let ordinal = c_int::try_from(ordinal).map_err(|_| Error::InvalidArgument(format!("no device {ordinal}")))?;
    let dev = result::device::get(ordinal).map_err(|e| crate::error::cu_error("cuDeviceGet", e))?;
    let name = result::device::get_name(dev).map_err(|e| crate::error::cu_error("cuDeviceGetName", e))?;
    // SAFETY: `dev` is a device handle the driver just returned.
    let memory_bytes =
        unsafe { result::device::total_mem(dev) }.map_err(|e| crate::error::cu_error("cuDeviceTotalMem", e))?;
    let flag = |attribute| attribute_of(dev, attribute).map(|v| v != 0);
    use CUdevice_attribute::*;
    Ok(CudaDeviceInfo {
        ordinal: ordinal as u32,
        name,
        pci_address: pci_address(dev)?,
        memory_bytes: memory_bytes as u64,
        compute_capability: format!(
            "{}.{}",
            attribute_of(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attribute_of(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?
        ),
        unified_addressing: flag(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)?,
        gpudirect_rdma: flag(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)?,
        dma_buf: flag(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)?,
        vmm: flag(CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)?,
        posix_fd_handles: flag(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?,
    })
}

/// One integer attribute of `dev`.
pub(crate) fn attribute_of(dev: sys::CUdevice, attribute: CUdevice_attribute) -> Result<i32> {
    // SAFETY: `dev` is a handle the driver returned; the call only reads it.
    unsafe { result::device::get_attribute(dev, attribute) }
        .map_err(|e| crate::error::cu_error(&format!("cuDeviceGetAttribute({attribute:?})"), e))
}

/// The device's PCI function in the kernel's form, lower case ("0000:3b:00.0").
pub(crate) fn pci_address(dev: sys::CUdevice) -> Result<String> {
    let mut id: [c_char; 32] = [0; 32];
    // SAFETY: the driver writes at most `id.len()` bytes, NUL-terminated, into `id`.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(id.as_mut_ptr(), id.len() as c_int, dev)
    })?;
    // SAFETY: the driver NUL-terminated what it wrote, inside `id` (zeroed before, so a NUL is
    // there in any case).
    let id = unsafe { CStr::from_ptr(id.as_ptr()) };
    Ok(id.to_string_lossy().to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_the_driver_writes_them() {
        let d = Driver {
            version: 12080,
            devices: 1,
        };
        assert_eq!(d.version_string(), "12.8");
        assert_eq!(
            Driver {
                version: 13000,
                devices: 0
            }
            .version_string(),
            "13.0"
        );
    }
}
