//! A dma-buf of CUDA device memory (`cuMemGetHandleForAddressRange`), for a NIC to register directly
//! (`ibv_reg_dmabuf_mr`): GPUDirect RDMA through the kernel's dma-buf interface, which needs no
//! out-of-tree peer-memory module. The driver exports whole host pages of one allocation, so the
//! span exported is the region's range widened to pages ([`span`]), and the region starts at an
//! offset in it.

use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys;
use ferry_core::{DmaBuf, Error, Result};

use crate::device::CudaDevice;
use crate::error::check;

/// The pages a dma-buf of `[ptr, ptr + len)` covers: its first address, its length, and where `ptr`
/// lies in it. They must lie in the allocation `[start, start + size)`: the driver exports nothing
/// past it.
pub fn span(ptr: u64, len: u64, start: u64, size: u64, page: u64) -> Result<(u64, u64, u64)> {
    let outside = || {
        Error::Unsupported(format!(
            "[{ptr:#x}, +{len}) widened to {page}-byte pages runs past its CUDA allocation [{start:#x}, +{size}), \
             and a dma-buf covers whole pages of one allocation"
        ))
    };
    if len == 0 || !page.is_power_of_two() {
        return Err(Error::InvalidArgument(format!(
            "no dma-buf of {len} bytes in {page}-byte pages"
        )));
    }
    let first = ptr & !(page - 1);
    let end = ptr
        .checked_add(len)
        .and_then(|e| e.checked_add(page - 1))
        .map(|e| e & !(page - 1))
        .ok_or_else(outside)?;
    if first < start || end > start.saturating_add(size) {
        return Err(outside());
    }
    Ok((first, end - first, ptr - first))
}

/// Exports `[ptr, ptr + len)` of `device`'s memory, which lies in the allocation `[start, start +
/// size)`, as a dma-buf.
pub(crate) fn export(device: &CudaDevice, ptr: u64, len: u64, start: u64, size: u64) -> Result<DmaBuf> {
    if !device.offers_dma_buf()? {
        return Err(Error::Unsupported(format!(
            "CUDA device {} ({}) does not export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: it needs \
             driver 515 or later with the open kernel modules, on Linux 5.12 or later)",
            device.ordinal(),
            device.pci_address()
        )));
    }
    let page = ferry_core::memory::page_size() as u64;
    let (first, span_len, offset) = span(ptr, len, start, size, page)?;
    device.bind()?;
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `fd` is valid for writes of an int, which is what a dma-buf handle is; the range is
    // whole pages of one allocation of the device's context, now current.
    check("cuMemGetHandleForAddressRange", unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut std::ffi::c_int).cast(),
            first,
            span_len as usize,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(Error::Internal(
            "the CUDA driver exported a dma-buf without a descriptor".into(),
        ));
    }
    // SAFETY: the driver handed this process a new descriptor, which nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(DmaBuf { fd, offset })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const PAGE: u64 = 4096;

    #[test]
    fn a_range_is_widened_to_pages_of_its_allocation() {
        let start = 0x7f00_0020_0000;
        assert_eq!(span(start, 100, start, 2 << 20, PAGE).unwrap(), (start, PAGE, 0));
        assert_eq!(
            span(start + 5000, 5000, start, 2 << 20, PAGE).unwrap(),
            (start + PAGE, 2 * PAGE, 5000 - PAGE)
        );
        // The allocation's last page is whole: the span may end with it...
        assert!(span(start + (2 << 20) - 10, 10, start, 2 << 20, PAGE).is_ok());
        // ...but not past it, nor start before it.
        let past = span(start + 100, 4096, start, 4096 + 50, PAGE).unwrap_err();
        assert!(matches!(past, Error::Unsupported(_)), "{past}");
        let before = span(start + 8, 8, start + 8, 4096, PAGE).unwrap_err();
        assert!(matches!(before, Error::Unsupported(_)), "{before}");
        assert!(matches!(
            span(start, 0, start, 4096, PAGE),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            span(u64::MAX - 10, 5, 0, u64::MAX, PAGE),
            Err(Error::Unsupported(_))
        ));
    }

    proptest! {
        #[test]
        fn spans_cover_the_range_in_whole_pages_inside_the_allocation(
            start_page in 0u64..1 << 30, pages in 1u64..4096, at in 0u64..1 << 24, len in 1u64..1 << 24,
        ) {
            let (start, size) = (start_page * PAGE, pages * PAGE);
            let ptr = start + at % size;
            let len = 1 + len % (start + size - ptr);
            let (first, span_len, offset) = span(ptr, len, start, size, PAGE).unwrap();
            prop_assert_eq!(first % PAGE, 0);
            prop_assert_eq!(span_len % PAGE, 0);
            prop_assert!(first >= start && first + span_len <= start + size);
            prop_assert_eq!(first + offset, ptr);
            prop_assert!(ptr + len <= first + span_len);
            prop_assert!(span_len - len - offset < PAGE && offset < PAGE);
        }
    }
}
