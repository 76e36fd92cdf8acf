//! CUDA driver results turned into ferry's [`Error`] variants.
//!
//! A caller acts on the variant, not on the CUDA code: out of memory is [`Error::ResourceExhausted`]
//! (free something, ask for less), a missing driver, device or feature is [`Error::Unsupported`]
//! (use host memory instead), a pointer or handle the driver does not know is
//! [`Error::InvalidArgument`]. The CUDA code's name stays in the message for whoever reads the log.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::CUresult;
use ferry_core::Error;

/// Maps the failure of the CUDA call described by `what` to an [`Error`].
pub(crate) fn cu_error(what: &str, error: DriverError) -> Error {
    let message = format!("{what}: {}", code_name(error.0));
    match error.0 {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY | CUresult::CUDA_ERROR_TOO_MANY_PEERS => Error::ResourceExhausted(message),
        CUresult::CUDA_ERROR_NO_DEVICE
        | CUresult::CUDA_ERROR_NOT_SUPPORTED
        | CUresult::CUDA_ERROR_STUB_LIBRARY
        | CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | CUresult::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
        | CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
        | CUresult::CUDA_ERROR_NOT_PERMITTED
        | CUresult::CUDA_ERROR_DEVICE_UNAVAILABLE => Error::Unsupported(message),
        CUresult::CUDA_ERROR_INVALID_VALUE
        | CUresult::CUDA_ERROR_INVALID_DEVICE
        | CUresult::CUDA_ERROR_INVALID_HANDLE
        | CUresult::CUDA_ERROR_INVALID_CONTEXT
        | CUresult::CUDA_ERROR_ALREADY_MAPPED => Error::InvalidArgument(message),
        _ => Error::Io {
            kind: std::io::ErrorKind::Other,
            message,
        },
    }
}

/// `CUDA_ERROR_OUT_OF_MEMORY` and the like: the enum's own name, which needs no driver call (the
/// driver's `cuGetErrorName` is not there when loading it is what failed).
pub(crate) fn code_name(code: CUresult) -> String {
    format!("{code:?}")
}

/// Turns a raw driver result into a `Result`, naming the call.
pub(crate) fn check(what: &str, code: CUresult) -> ferry_core::Result<()> {
    code.result().map_err(|e| cu_error(what, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_what_the_caller_does_next() {
        let e = |code| cu_error("allocating", DriverError(code));
        assert!(matches!(
            e(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            Error::ResourceExhausted(_)
        ));
        assert!(matches!(e(CUresult::CUDA_ERROR_NO_DEVICE), Error::Unsupported(_)));
        assert!(matches!(e(CUresult::CUDA_ERROR_STUB_LIBRARY), Error::Unsupported(_)));
        assert!(matches!(
            e(CUresult::CUDA_ERROR_INVALID_VALUE),
            Error::InvalidArgument(_)
        ));
        let lost = e(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert!(matches!(lost, Error::Io { .. }));
        assert!(lost.message().contains("allocating") && lost.message().contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
        assert!(check("x", CUresult::CUDA_SUCCESS).is_ok());
    }
}
