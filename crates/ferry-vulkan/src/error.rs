//! Vulkan result codes turned into ferry's [`Error`] variants.
//!
//! A caller of ferry acts on the variant, not on the Vulkan code: out-of-memory codes are
//! [`Error::ResourceExhausted`] (free something, ask for less), a missing driver or feature is
//! [`Error::Unsupported`] (use host memory instead), a bad external handle is
//! [`Error::InvalidArgument`]. The Vulkan code itself stays in the message for whoever reads the log.

use ash::vk;
use ferry_core::Error;

/// Maps the failure of the Vulkan call described by `what` to an [`Error`].
pub(crate) fn vk_error(what: &str, result: vk::Result) -> Error {
    let message = format!("{what}: {result:?}");
    match result {
        vk::Result::ERROR_OUT_OF_HOST_MEMORY
        | vk::Result::ERROR_OUT_OF_DEVICE_MEMORY
        | vk::Result::ERROR_TOO_MANY_OBJECTS
        | vk::Result::ERROR_FRAGMENTATION
        | vk::Result::ERROR_OUT_OF_POOL_MEMORY => Error::ResourceExhausted(message),
        vk::Result::ERROR_INCOMPATIBLE_DRIVER
        | vk::Result::ERROR_INITIALIZATION_FAILED
        | vk::Result::ERROR_EXTENSION_NOT_PRESENT
        | vk::Result::ERROR_FEATURE_NOT_PRESENT
        | vk::Result::ERROR_LAYER_NOT_PRESENT
        | vk::Result::ERROR_FORMAT_NOT_SUPPORTED => Error::Unsupported(message),
        vk::Result::ERROR_INVALID_EXTERNAL_HANDLE | vk::Result::ERROR_INVALID_OPAQUE_CAPTURE_ADDRESS => {
            Error::InvalidArgument(message)
        }
        vk::Result::TIMEOUT => Error::Timeout(message),
        _ => Error::Io {
            kind: std::io::ErrorKind::Other,
            message,
        },
    }
}

/// The error for a call that needs a device extension this device was created without.
pub(crate) fn missing_extension(device: &str, extension: &str, why: &str) -> Error {
    Error::Unsupported(format!("{why} needs {extension}, which {device} does not offer"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_what_the_caller_does_next() {
        assert!(matches!(
            vk_error("x", vk::Result::ERROR_OUT_OF_DEVICE_MEMORY),
            Error::ResourceExhausted(_)
        ));
        assert!(matches!(
            vk_error("x", vk::Result::ERROR_INCOMPATIBLE_DRIVER),
            Error::Unsupported(_)
        ));
        assert!(matches!(
            vk_error("x", vk::Result::ERROR_INVALID_EXTERNAL_HANDLE),
            Error::InvalidArgument(_)
        ));
        assert!(matches!(vk_error("x", vk::Result::TIMEOUT), Error::Timeout(_)));
        let lost = vk_error("waiting for a copy", vk::Result::ERROR_DEVICE_LOST);
        assert!(lost.message().contains("waiting for a copy") && lost.message().contains("DEVICE_LOST"));
    }
}
