//! Extension entry points, present only where the extension was enabled.
//!
//! ash fills the function table of an extension that was not enabled (or that the driver does not
//! export) with stubs that panic when called. This crate never builds such a table: each entry point is
//! looked up with `vkGetDeviceProcAddr` after the device was created with the extension, and kept as an
//! `Option` that is `None` when the extension is off or the lookup returned null. Callers turn `None`
//! into [`Error::Unsupported`](ferry_core::Error::Unsupported).

use std::ffi::CStr;

use ash::vk;

use crate::probe::Extensions;

/// The extension functions of one device.
pub(crate) struct ExtFns {
    /// `VK_KHR_external_memory_fd` (both of its functions resolved).
    pub memory_fd: Option<ash::khr::external_memory_fd::Device>,
    /// `vkGetMemoryHostPointerPropertiesEXT`.
    pub host_pointer_properties: Option<vk::PFN_vkGetMemoryHostPointerPropertiesEXT>,
    /// `vkGetMemoryRemoteAddressNV`.
    pub remote_address: Option<vk::PFN_vkGetMemoryRemoteAddressNV>,
}

impl ExtFns {
    /// Looks up the functions of the extensions in `enabled` on `device`.
    pub fn load(instance: &ash::Instance, device: &ash::Device, enabled: &Extensions) -> Self {
        let resolves = |name: &CStr| {
            // SAFETY: `device` is a live device of `instance` and `name` is NUL-terminated.
            unsafe { instance.get_device_proc_addr(device.handle(), name.as_ptr()) }.is_some()
        };
        let memory_fd = (enabled.memory_fd && resolves(c"vkGetMemoryFdKHR") && resolves(c"vkGetMemoryFdPropertiesKHR"))
            .then(|| ash::khr::external_memory_fd::Device::new(instance, device));
        let host_pointer_properties = if enabled.memory_host {
            // SAFETY: the returned pointer, when not null, is `vkGetMemoryHostPointerPropertiesEXT` of
            // this device, whose signature is `PFN_vkGetMemoryHostPointerPropertiesEXT`.
            unsafe {
                instance
                    .get_device_proc_addr(device.handle(), c"vkGetMemoryHostPointerPropertiesEXT".as_ptr())
                    .map(|f| std::mem::transmute::<_, vk::PFN_vkGetMemoryHostPointerPropertiesEXT>(f))
            }
        } else {
            None
        };
        let remote_address = if enabled.memory_rdma {
            // SAFETY: the returned pointer, when not null, is `vkGetMemoryRemoteAddressNV` of this device,
            // whose signature is `PFN_vkGetMemoryRemoteAddressNV`.
            unsafe {
                instance
                    .get_device_proc_addr(device.handle(), c"vkGetMemoryRemoteAddressNV".as_ptr())
                    .map(|f| std::mem::transmute::<_, vk::PFN_vkGetMemoryRemoteAddressNV>(f))
            }
        } else {
            None
        };
        ExtFns {
            memory_fd,
            host_pointer_properties,
            remote_address,
        }
    }
}
