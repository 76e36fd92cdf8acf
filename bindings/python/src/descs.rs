//! Descriptors from Python: a list of `(local_addr, remote_addr, length)` tuples, or, on the fast
//! path, an N×3 array of unsigned 64-bit integers (numpy `uint64`, or any buffer of format `Q`),
//! read in one copy with no Python object per descriptor.
//!
//! The stable ABI of Python 3.9 (the oldest this wheel supports) has no buffer protocol, so arrays
//! are read through numpy's array interface: its C form (`__array_struct__`, a capsule holding a
//! `PyArrayInterface`) first, its dict form (`__array_interface__`) for objects with only that, and
//! other buffers through `memoryview`. The C form is what makes this path cheap: numpy builds the
//! dict (type string, descr list) anew on every access, the largest single cost of the Python
//! thread in a profile of 1 MiB writes; reading the capsule instead took that thread from 35 to 25
//! µs of CPU per transfer.

use std::ffi::{c_char, c_int, c_void};

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule, PyCapsuleMethods, PyDict, PyList, PyString, PyTuple};

use crate::errors;

const SHAPE_HELP: &str = "descriptors are a list of (local_addr, remote_addr, length) tuples or an N×3 \
                          array of dtype uint64";

/// The descriptors `obj` holds.
pub fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Vec<ferry::TransferDesc>> {
    let py = obj.py();
    if let Ok(list) = obj.cast::<PyList>() {
        return list.iter().map(|item| one(&item)).collect();
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple.iter().map(|item| one(&item)).collect();
    }
    if let Ok(capsule) = obj.getattr(intern!(py, "__array_struct__"))
        && let Ok(capsule) = capsule.cast::<PyCapsule>()
    {
        return from_array_struct(obj, capsule);
    }
    if let Ok(interface) = obj.getattr(intern!(py, "__array_interface__")) {
        return from_array_interface(obj, interface.cast::<PyDict>()?);
    }
    from_memoryview(obj)
}

fn rows_of_three(shape: &[usize]) -> bool {
    match shape {
        [_, 3] => true,
        [n] => n % 3 == 0,
        _ => false,
    }
}

fn bad_shape(py: Python<'_>, shape: &[usize]) -> PyErr {
    errors::invalid(py, format!("{SHAPE_HELP}; got an array of shape {shape:?}"))
}

/// numpy's `PyArrayInterface` (the array interface protocol's C form), as its documentation lays it
/// out.
#[repr(C)]
struct ArrayInterface {
    /// Always 2.
    two: c_int,
    nd: c_int,
    /// `b'u'` for unsigned integers.
    typekind: c_char,
    itemsize: c_int,
    flags: c_int,
    shape: *const isize,
    strides: *const isize,
    data: *const c_void,
    descr: *mut c_void,
}

const ARRAY_C_CONTIGUOUS: c_int = 0x0001;
const ARRAY_ALIGNED: c_int = 0x0100;
const ARRAY_NOTSWAPPED: c_int = 0x0200;

/// An array through `__array_struct__`: C-contiguous, aligned, native-order u64, read where it lies.
fn from_array_struct(obj: &Bound<'_, PyAny>, capsule: &Bound<'_, PyCapsule>) -> PyResult<Vec<ferry::TransferDesc>> {
    let py = obj.py();
    let pointer = capsule.pointer_checked(None)?;
    // SAFETY: an `__array_struct__` capsule holds a `PyArrayInterface`, valid while the capsule
    // lives (it holds a reference to the array); `two == 2` is the protocol's own sanity check.
    let interface = unsafe { &*pointer.as_ptr().cast::<ArrayInterface>() };
    if interface.two != 2 {
        return Err(errors::invalid(
            py,
            format!("{SHAPE_HELP}; the array's __array_struct__ is malformed"),
        ));
    }
    if interface.typekind as u8 != b'u' || interface.itemsize != 8 || interface.flags & ARRAY_NOTSWAPPED == 0 {
        return Err(errors::invalid(
            py,
            format!("{SHAPE_HELP}; got an array of another type (convert with .astype(numpy.uint64))"),
        ));
    }
    let nd = usize::try_from(interface.nd).unwrap_or(0);
    if nd == 0 || nd > 2 || interface.shape.is_null() {
        return Err(errors::invalid(
            py,
            format!("{SHAPE_HELP}; got an array of {nd} dimensions"),
        ));
    }
    // SAFETY: `shape` points at `nd` sizes, per the protocol.
    let shape: Vec<usize> = unsafe { std::slice::from_raw_parts(interface.shape, nd) }
        .iter()
        .map(|&n| usize::try_from(n).unwrap_or(0))
        .collect();
    if !rows_of_three(&shape) {
        return Err(bad_shape(py, &shape));
    }
    let count: usize = shape.iter().product();
    if count == 0 {
        return Ok(Vec::new());
    }
    let wanted = ARRAY_C_CONTIGUOUS | ARRAY_ALIGNED;
    if interface.flags & wanted != wanted || interface.data.is_null() {
        return Err(errors::invalid(
            py,
            format!("{SHAPE_HELP}; the array is not C-contiguous and aligned (numpy.ascontiguousarray makes it so)"),
        ));
    }
    // SAFETY: the flags promise `count` contiguous, aligned, native-order u64 at `data`, owned by the
    // array the capsule keeps alive; the GIL is held, so no Python code frees or resizes it while
    // they are copied.
    let flat = unsafe { std::slice::from_raw_parts(interface.data.cast::<u64>(), count) };
    Ok(flat
        .chunks_exact(3)
        .map(|d| ferry::TransferDesc::new(d[0], d[1], d[2]))
        .collect())
}

/// Anything else with `__array_interface__` (version 3): a C-contiguous array of
/// little-endian u64, read where it lies.
fn from_array_interface<'py>(
    obj: &Bound<'py, PyAny>,
    interface: &Bound<'py, PyDict>,
) -> PyResult<Vec<ferry::TransferDesc>> {
    let py = obj.py();
    let field = |name: &Bound<'py, PyString>| -> PyResult<Bound<'py, PyAny>> {
        interface
            .get_item(name)?
            .ok_or_else(|| errors::invalid(py, format!("the array interface has no {name:?}")))
    };
    let typestr = field(intern!(py, "typestr"))?;
    if !typestr.eq(intern!(py, "<u8"))? {
        return Err(errors::invalid(
            py,
            format!("{SHAPE_HELP}; got an array of type {typestr:?} (convert with .astype(numpy.uint64))"),
        ));
    }
    let shape: Vec<usize> = field(intern!(py, "shape"))?.extract()?;
    if !rows_of_three(&shape) {
        return Err(bad_shape(py, &shape));
    }
    let strides = interface.get_item(intern!(py, "strides"))?;
    if strides.is_some_and(|s| !s.is_none()) {
        return Err(errors::invalid(
            py,
            format!("{SHAPE_HELP}; the array is not C-contiguous (numpy.ascontiguousarray makes it so)"),
        ));
    }
    let (ptr, _readonly): (usize, bool) = field(intern!(py, "data"))?.extract()?;
    let count: usize = shape.iter().product();
    if count == 0 {
        return Ok(Vec::new());
    }
    if ptr == 0 || ptr % std::mem::align_of::<u64>() != 0 {
        return Err(errors::invalid(
            py,
            format!("{SHAPE_HELP}; the array's data is not 8-byte aligned"),
        ));
    }
    // SAFETY: the array interface promises `count` contiguous, aligned u64 at `ptr`, owned by `obj`,
    // which the caller holds for the duration of this call; the GIL is held, so no Python code runs
    // that could free or resize the array while they are copied.
    let flat = unsafe { std::slice::from_raw_parts(ptr as *const u64, count) };
    Ok(flat
        .chunks_exact(3)
        .map(|d| ferry::TransferDesc::new(d[0], d[1], d[2]))
        .collect())
}

/// Any other buffer of u64 (`array.array("Q")`, a `memoryview`), copied out through `tobytes()`.
fn from_memoryview(obj: &Bound<'_, PyAny>) -> PyResult<Vec<ferry::TransferDesc>> {
    let py = obj.py();
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))
        .map_err(|e| errors::invalid(py, format!("{SHAPE_HELP}; got {} ({e})", type_name(obj))))?;
    let format: String = view.getattr("format")?.extract()?;
    let itemsize: usize = view.getattr("itemsize")?.extract()?;
    if !matches!(format.as_str(), "Q" | "L" | "<Q" | "=Q" | "@Q") || itemsize != 8 {
        return Err(errors::invalid(
            py,
            format!("{SHAPE_HELP}; got a buffer of format {format:?} (unsigned 64-bit \"Q\" needed)"),
        ));
    }
    let shape: Vec<usize> = view.getattr("shape")?.extract()?;
    if !rows_of_three(&shape) {
        return Err(bad_shape(py, &shape));
    }
    let bytes = view.call_method0("tobytes")?;
    let bytes = bytes.cast::<PyBytes>()?.as_bytes();
    Ok(bytes
        .chunks_exact(24)
        .map(|d| {
            let word = |i: usize| {
                let mut w = [0u8; 8];
                w.copy_from_slice(&d[i * 8..i * 8 + 8]);
                u64::from_ne_bytes(w)
            };
            ferry::TransferDesc::new(word(0), word(1), word(2))
        })
        .collect())
}

fn one(item: &Bound<'_, PyAny>) -> PyResult<ferry::TransferDesc> {
    let (local, remote, len): (u64, u64, u64) = item.extract().map_err(|_| {
        errors::invalid(
            item.py(),
            format!("{SHAPE_HELP}; one element is {} ({})", type_name(item), repr(item)),
        )
    })?;
    Ok(ferry::TransferDesc::new(local, remote, len))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "an object".into())
}

fn repr(obj: &Bound<'_, PyAny>) -> String {
    let text = obj.repr().map(|r| r.to_string()).unwrap_or_default();
    text.chars().take(80).collect()
}
