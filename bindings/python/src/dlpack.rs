//! CUDA arrays described by DLPack (`__dlpack_device__`, `__dlpack__`), the exchange protocol of
//! JAX, TensorFlow, PyTorch, CuPy and the Array API: what `register` takes from a framework whose
//! arrays lack `__cuda_array_interface__`.
//!
//! The capsule's tensor is read and not consumed: the capsule keeps its name (`"dltensor"`) and is
//! kept alive with the region, so that the producer's own capsule destructor frees the tensor once
//! the region is deregistered and the capsule dropped, as it does for a capsule nobody took.
//! Memory on any other device than a CUDA GPU is left to the buffer protocol.

use std::ffi::c_void;

use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods};

use crate::errors::{self, IntoPyResult};

/// `kDLCUDA`: memory of a CUDA device.
const DL_CUDA: i32 = 2;

/// DLPack's `DLDevice`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`: `lanes` elements of `bits` bits each.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// DLPack's `DLTensor`; `strides` are in elements, null for a C-contiguous tensor.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// A CUDA array's memory, as its DLPack capsule describes it.
pub(crate) struct CudaArray {
    /// The device pointer of its first byte, and how many bytes it spans.
    pub addr: u64,
    pub len: usize,
    /// The capsule, which keeps the tensor alive as long as it lives.
    pub capsule: Py<PyAny>,
}

/// `obj`'s memory if it says by DLPack that it is a CUDA device's (`None` for any other object): a
/// C-contiguous, non-empty array.
pub(crate) fn cuda_array(obj: &Bound<'_, PyAny>) -> PyResult<Option<CudaArray>> {
    let py = obj.py();
    let Some(device) = obj.getattr_opt("__dlpack_device__")? else {
        return Ok(None);
    };
    let invalid = |what: String| errors::invalid(py, format!("DLPack: {what}"));
    let (device_type, _): (i32, i32) = device
        .call0()?
        .extract()
        .map_err(|_| invalid("__dlpack_device__() is not (device type, device id)".into()))?;
    if device_type != DL_CUDA {
        return Ok(None);
    }
    let capsule = obj.call_method0("__dlpack__")?;
    let tensor = capsule
        .cast::<PyCapsule>()
        .map_err(|_| invalid("__dlpack__() returned no capsule".into()))?
        .pointer_checked(Some(c"dltensor"))
        .map_err(|_| invalid("__dlpack__() returned a capsule that is not an unused \"dltensor\"".into()))?;
    // SAFETY: a capsule named "dltensor" holds a `DLManagedTensor`, whose first member is its
    // `DLTensor`, valid while the capsule lives (DLPack's contract); `capsule` is held here.
    let tensor = unsafe { &*tensor.as_ptr().cast::<DlTensor>() };
    if tensor.device.device_type != DL_CUDA {
        return Err(invalid(format!(
            "__dlpack_device__() said CUDA, the tensor says device type {}",
            tensor.device.device_type
        )));
    }
    let ndim = usize::try_from(tensor.ndim).map_err(|_| invalid(format!("{} dimensions", tensor.ndim)))?;
    if ndim > 0 && tensor.shape.is_null() {
        return Err(invalid("a tensor without a shape".into()));
    }
    // SAFETY: DLPack's `shape` (and non-null `strides`) hold `ndim` values, alive with the capsule.
    let (shape, strides) = unsafe {
        (
            slice_of(tensor.shape, ndim),
            (!tensor.strides.is_null()).then(|| slice_of(tensor.strides, ndim)),
        )
    };
    let bits = u64::from(tensor.dtype.bits) * u64::from(tensor.dtype.lanes);
    if bits == 0 || bits % 8 != 0 {
        return Err(invalid(format!(
            "elements of {} bits in {} lanes are no whole number of bytes",
            tensor.dtype.bits, tensor.dtype.lanes
        )));
    }
    let itemsize = bits / 8;
    let shape: Vec<u64> = shape
        .iter()
        .map(|&d| u64::try_from(d).map_err(|_| invalid(format!("a negative dimension in {shape:?}"))))
        .collect::<PyResult<_>>()?;
    let strides: Option<Vec<i64>> = strides.map(|s| s.iter().map(|&e| e.saturating_mul(itemsize as i64)).collect());
    let bytes = ferry::cuda::array::contiguous_bytes(&shape, itemsize, strides.as_deref()).py(py)?;
    let len = usize::try_from(bytes).map_err(|_| invalid(format!("{bytes} bytes do not fit this machine")))?;
    let addr = (tensor.data as u64)
        .checked_add(tensor.byte_offset)
        .ok_or_else(|| invalid("the tensor's byte offset overflows its pointer".into()))?;
    Ok(Some(CudaArray {
        addr,
        len,
        capsule: capsule.unbind(),
    }))
}

/// The `n` values at `ptr`.
///
/// # Safety
///
/// `ptr` points to `n` initialised values that outlive the slice (if `n > 0`).
unsafe fn slice_of<'a>(ptr: *const i64, n: usize) -> &'a [i64] {
    match n {
        0 => &[],
        // SAFETY: the caller's promise.
        _ => unsafe { std::slice::from_raw_parts(ptr, n) },
    }
}
