//! What an address a caller hands over is, asked of the driver: host memory, CUDA device memory
//! (and in which allocation, on which device, in which context), or something ferry cannot use.
//!
//! `tensor.data_ptr()` of a CUDA tensor is a device address in the process's unified address space;
//! taken for host memory, the first copy through it crashes the process. The driver knows every
//! address it handed out (`cuPointerGetAttributes`, which answers "not CUDA's" for any other rather
//! than failing), so a registration asks it before trusting the range.

use std::ffi::{c_uint, c_void};

use cudarc::driver::sys::{self, CUmemorytype, CUpointer_attribute};
use ferry_core::{Error, Result};

use crate::error::check;

/// What the driver says of one address (`cuPointerGetAttributes`), as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PointerAttributes {
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`: 0 for an address the driver did not hand out, else
    /// `CU_MEMORYTYPE_HOST` (1), `_DEVICE` (2), `_ARRAY` (3) or `_UNIFIED` (4).
    pub memory_type: u32,
    /// The device the memory belongs to.
    pub device_ordinal: i32,
    /// The context it was allocated in (a handle, compared, never followed).
    pub context: usize,
    /// The allocation the address lies in: its first address and size.
    pub range_start: u64,
    /// See `range_start`.
    pub range_size: u64,
    /// Managed (unified) memory, which the CPU reaches too.
    pub is_managed: bool,
}

/// The kinds of memory an address can name, as ferry registers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointerKind {
    /// Memory the CPU reaches directly: not the driver's at all, pinned host memory
    /// (`cuMemHostAlloc`, `cudaHostAlloc`) or managed memory. Registered as host memory, after the
    /// host's own check that it is mapped.
    Host,
    /// Device memory, `[start, start + size)` the allocation that holds the range.
    Device {
        /// The device's ordinal.
        ordinal: i32,
        /// The allocation's context; 0 for memory of the virtual memory API (`cuMemMap`), which
        /// belongs to none.
        context: usize,
        /// The allocation's first address.
        start: u64,
        /// The allocation's size.
        size: u64,
    },
}

/// Classifies `[addr, addr + len)` from the driver's answer about `addr`: device memory must lie in
/// one allocation, array memory is refused.
pub fn classify_attributes(attributes: &PointerAttributes, addr: u64, len: u64) -> Result<PointerKind> {
    let end = addr
        .checked_add(len)
        .filter(|_| len > 0)
        .ok_or_else(|| Error::InvalidArgument(format!("{addr:#x} + {len} is no range")))?;
    if attributes.is_managed {
        return Ok(PointerKind::Host);
    }
    match attributes.memory_type {
        0 => Ok(PointerKind::Host),
        t if t == CUmemorytype::CU_MEMORYTYPE_HOST as u32 => Ok(PointerKind::Host),
        t if t == CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 || t == CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32 => {
            let start = attributes.range_start;
            let stop = start.saturating_add(attributes.range_size);
            if addr < start || end > stop {
                return Err(Error::InvalidArgument(format!(
                    "[{addr:#x}, {end:#x}) runs past its CUDA allocation [{start:#x}, {stop:#x}) on device {}: a \
                     region must lie in one allocation (register each tensor's own storage)",
                    attributes.device_ordinal
                )));
            }
            Ok(PointerKind::Device {
                ordinal: attributes.device_ordinal,
                context: attributes.context,
                start,
                size: attributes.range_size,
            })
        }
        t => Err(Error::Unsupported(format!(
            "{addr:#x} is CUDA memory of type {t} (a CUDA array): only linear device memory can be registered"
        ))),
    }
}

/// Asks the driver about `addr` (see the module's documentation). Needs the driver:
/// [`Error::Unsupported`] without one.
pub fn attributes_of(addr: u64) -> Result<PointerAttributes> {
    crate::driver::driver()?;
    let mut memory_type: c_uint = 0;
    let mut device_ordinal: i32 = -1;
    let mut context: sys::CUcontext = std::ptr::null_mut();
    let mut range_start: sys::CUdeviceptr = 0;
    let mut range_size: usize = 0;
    let mut is_managed: c_uint = 0;
    let mut which = [
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
    ];
    let mut data: [*mut c_void; 6] = [
        (&raw mut memory_type).cast(),
        (&raw mut device_ordinal).cast(),
        (&raw mut context).cast(),
        (&raw mut range_start).cast(),
        (&raw mut range_size).cast(),
        (&raw mut is_managed).cast(),
    ];
    // SAFETY: `which` and `data` have the same length, passed as the count; each data pointer points
    // to a local of the type the driver documents for its attribute (unsigned int, int, CUcontext,
    // CUdeviceptr, size_t, unsigned int), live for the call. For an address the driver did not hand
    // out, it writes defaults and returns success.
    check("cuPointerGetAttributes", unsafe {
        sys::cuPointerGetAttributes(which.len() as c_uint, which.as_mut_ptr(), data.as_mut_ptr(), addr)
    })?;
    Ok(PointerAttributes {
        memory_type,
        device_ordinal,
        context: context as usize,
        range_start,
        range_size: range_size as u64,
        is_managed: is_managed != 0,
    })
}

/// [`classify_attributes`] of the driver's answer; [`PointerKind::Host`] without a driver (then
/// no address can be CUDA memory).
pub fn classify(addr: u64, len: u64) -> Result<PointerKind> {
    match attributes_of(addr) {
        Ok(attributes) => classify_attributes(&attributes, addr, len),
        Err(Error::Unsupported(_)) if crate::driver::driver().is_err() => {
            classify_attributes(&PointerAttributes::default(), addr, len)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn device(start: u64, size: u64) -> PointerAttributes {
        PointerAttributes {
            memory_type: CUmemorytype::CU_MEMORYTYPE_DEVICE as u32,
            device_ordinal: 1,
            context: 0xc0,
            range_start: start,
            range_size: size,
            is_managed: false,
        }
    }

    #[test]
    fn host_pinned_and_managed_memory_are_host_memory() {
        let none = PointerAttributes::default();
        assert_eq!(classify_attributes(&none, 0x1000, 64).unwrap(), PointerKind::Host);
        let pinned = PointerAttributes {
            memory_type: CUmemorytype::CU_MEMORYTYPE_HOST as u32,
            ..none
        };
        assert_eq!(classify_attributes(&pinned, 0x1000, 64).unwrap(), PointerKind::Host);
        let managed = PointerAttributes {
            is_managed: true,
            ..device(0x1000, 4096)
        };
        assert_eq!(classify_attributes(&managed, 0x1000, 64).unwrap(), PointerKind::Host);
    }

    #[test]
    fn arrays_and_empty_ranges_are_refused() {
        let array = PointerAttributes {
            memory_type: CUmemorytype::CU_MEMORYTYPE_ARRAY as u32,
            ..Default::default()
        };
        assert!(matches!(
            classify_attributes(&array, 0x1000, 1),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            classify_attributes(&device(0, 1 << 20), 0x1000, 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            classify_attributes(&device(0, u64::MAX), u64::MAX, 2),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn without_a_driver_every_address_is_host_memory() {
        if crate::driver::driver().is_ok() {
            println!("a CUDA driver is loaded here: the driver-less answer is not what this host gives");
            return;
        }
        assert_eq!(classify(0x1000, 64).unwrap(), PointerKind::Host);
        assert!(matches!(attributes_of(0x1000), Err(Error::Unsupported(_))));
    }

    proptest! {
        /// Device memory is accepted exactly when the range lies in the allocation, and then names it.
        #[test]
        fn device_ranges_must_lie_in_their_allocation(
            start in 0u64..1 << 40,
            size in 1u64..1 << 30,
            at in 0u64..1 << 41,
            len in 1u64..1 << 31,
        ) {
            let attributes = device(start, size);
            let inside = at >= start && at + len <= start + size;
            match classify_attributes(&attributes, at, len) {
                Ok(PointerKind::Device { ordinal, context, start: s, size: n }) => {
                    prop_assert!(inside);
                    prop_assert_eq!((ordinal, context, s, n), (1, 0xc0, start, size));
                }
                Ok(other) => prop_assert!(false, "device memory classified as {:?}", other),
                Err(e) => {
                    prop_assert!(!inside);
                    prop_assert!(matches!(e, Error::InvalidArgument(_)));
                    prop_assert!(e.message().contains("runs past its CUDA allocation"), "{}", e);
                }
            }
        }
    }
}
