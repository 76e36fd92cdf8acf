//! Loading `libvulkan` at run time and creating the instance.
//!
//! ferry builds and runs on hosts without Vulkan: the loader is opened with `dlopen` when a context or
//! a probe is first asked for, never at link time, and each way this can fail (no loader library, no
//! driver behind it, a loader that only speaks Vulkan 1.0) is an [`Error::Unsupported`] that says what
//! to install.

use ash::vk;
use ferry_core::{Error, Result};

use crate::error::vk_error;

/// What to install on Debian-like hosts for a Vulkan driver without a GPU.
pub const INSTALL_HINT: &str = "apt-get install -y mesa-vulkan-drivers libvulkan1";

/// The highest Vulkan version this crate asks for.
const MAX_API: u32 = vk::API_VERSION_1_3;

/// The loader library and one instance of it, destroyed on drop.
pub(crate) struct Loaded {
    /// Keeps the loader library open while the instance lives.
    _entry: ash::Entry,
    /// The instance.
    pub instance: ash::Instance,
    /// The API version the instance was created for.
    pub api_version: u32,
}

impl Loaded {
    /// Loads the Vulkan loader and creates an instance of at least Vulkan 1.1.
    pub fn new() -> Result<Self> {
        // SAFETY: this opens the system's Vulkan loader (libvulkan.so.1) with dlopen and runs its
        // initialisers, which is what every Vulkan application does; the library is kept open in
        // `_entry` for as long as any function pointer taken from it can be called.
        let entry = unsafe { ash::Entry::load() }.map_err(|e| {
            Error::Unsupported(format!(
                "the Vulkan loader (libvulkan.so.1) could not be loaded: {e}; install it: {INSTALL_HINT}"
            ))
        })?;
        // SAFETY: a global query with no arguments, valid on any loader.
        let loader_version = unsafe { entry.try_enumerate_instance_version() }
            .map_err(|e| vk_error("vkEnumerateInstanceVersion", e))?
            .unwrap_or(vk::API_VERSION_1_0);
        if loader_version < vk::API_VERSION_1_1 {
            return Err(Error::Unsupported(format!(
                "the Vulkan loader supports only version {}; ferry needs 1.1",
                version_string(loader_version)
            )));
        }
        let api_version = loader_version.min(MAX_API);
        let app = vk::ApplicationInfo::default()
            .application_name(c"ferry")
            .engine_name(c"ferry")
            .api_version(api_version);
        let info = vk::InstanceCreateInfo::default().application_info(&app);
        // SAFETY: `info` and `app` are valid, fully initialised structures that outlive the call; no
        // layers or extensions are requested.
        let instance = unsafe { entry.create_instance(&info, None) }.map_err(|e| match e {
            vk::Result::ERROR_INCOMPATIBLE_DRIVER => Error::Unsupported(format!(
                "no Vulkan driver found (vkCreateInstance: ERROR_INCOMPATIBLE_DRIVER); install one: {INSTALL_HINT}"
            )),
            other => vk_error("vkCreateInstance", other),
        })?;
        tracing::debug!(api = %version_string(api_version), "Vulkan instance created");
        Ok(Loaded {
            _entry: entry,
            instance,
            api_version,
        })
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        // SAFETY: every object created from the instance (devices) is destroyed before `Loaded` drops:
        // `VulkanContext` destroys its device in its own `Drop`, before its fields drop.
        unsafe { self.instance.destroy_instance(None) };
    }
}

/// "1.3.230".
pub(crate) fn version_string(v: u32) -> String {
    format!(
        "{}.{}.{}",
        vk::api_version_major(v),
        vk::api_version_minor(v),
        vk::api_version_patch(v)
    )
}
