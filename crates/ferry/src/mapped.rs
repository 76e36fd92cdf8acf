//! Whether a raw address range is memory this process can register: mapped, readable, and writable
//! where peers may write. `Engine::register_raw` takes the caller's word for it (it is `unsafe`);
//! bindings that hand out raw registration to code that cannot promise (Python's `register_ptr`, given
//! any integer) check first, so that a peer's READ of an unmapped range or of a GPU pointer is refused
//! at registration instead of crashing the process.

use ferry_core::{Access, Error, Result};

/// Checks `[addr, addr + len)` against this process's mappings (`/proc/self/maps`): every byte mapped,
/// readable, and writable if `access` lets peers write.
pub fn check_mapped(addr: u64, len: u64, access: Access) -> Result<()> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| Error::io("reading /proc/self/maps to check a range before registering it", e))?;
    check_in(&maps, addr, len, access.contains(Access::WRITE))
}

/// [`check_mapped`] against the text of a maps file.
fn check_in(maps: &str, addr: u64, len: u64, write: bool) -> Result<()> {
    let end = addr
        .checked_add(len)
        .filter(|_| len > 0)
        .ok_or_else(|| Error::InvalidArgument(format!("{addr:#x} + {len} is no range")))?;
    let mut at = addr;
    for line in maps.lines() {
        let Some((start, stop, perms)) = parse(line) else {
            continue;
        };
        if stop <= at {
            continue;
        }
        if start > at {
            break;
        }
        if perms.starts_with("---") {
            return Err(Error::InvalidArgument(format!(
                "{at:#x} is reserved with no access in this process: device memory (a CUDA or other GPU pointer \
                 looks like this) is not host memory; register GPU memory through the engine's GPU support, or \
                 copy it to host memory first"
            )));
        }
        if !perms.starts_with('r') {
            return Err(Error::InvalidArgument(format!(
                "{at:#x} is mapped without read access in this process; a registered range must be readable"
            )));
        }
        if write && perms.as_bytes().get(1) != Some(&b'w') {
            return Err(Error::InvalidArgument(format!(
                "{at:#x} is mapped read-only in this process; register it for reading only, or register writable memory"
            )));
        }
        at = stop;
        if at >= end {
            return Ok(());
        }
    }
    Err(Error::InvalidArgument(format!(
        "{at:#x} is not mapped in this process: [{addr:#x}, {end:#x}) is not memory this process owns"
    )))
}

/// A maps line's start, end and permissions.
fn parse(line: &str) -> Option<(u64, u64, &str)> {
    let mut fields = line.split_whitespace();
    let (start, stop) = fields.next()?.split_once('-')?;
    let perms = fields.next()?;
    Some((
        u64::from_str_radix(start, 16).ok()?,
        u64::from_str_radix(stop, 16).ok()?,
        perms,
    ))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const MAPS: &str = "\
1000-3000 rw-p 00000000 00:00 0
3000-4000 r--p 00000000 00:00 0
4000-5000 rw-p 00000000 00:00 0          [heap]
7000-9000 ---p 00000000 00:00 0
9000-a000 -w-p 00000000 00:00 0
";

    #[test]
    fn ranges_are_checked_against_the_mappings() {
        check_in(MAPS, 0x1000, 0x2000, true).unwrap();
        check_in(MAPS, 0x1800, 0x2800, false).unwrap(); // across a read-only mapping, for reading
        assert!(
            check_in(MAPS, 0x1800, 0x2800, true).is_err(),
            "writable across a read-only mapping"
        );
        check_in(MAPS, 0x4000, 1, true).unwrap();
        let gap = check_in(MAPS, 0x4800, 0x1000, false).unwrap_err();
        assert!(gap.to_string().contains("0x5000 is not mapped"), "{gap}");
        let device = check_in(MAPS, 0x7000, 16, false).unwrap_err();
        assert!(device.to_string().contains("device memory"), "{device}");
        assert!(check_in(MAPS, 0x9000, 16, false).is_err(), "write-only");
        assert!(check_in(MAPS, 0x0, 16, false).is_err(), "below every mapping");
        assert!(check_in(MAPS, 0x1000, 0, false).is_err(), "empty");
        assert!(check_in(MAPS, u64::MAX, 2, false).is_err(), "overflow");
    }

    #[test]
    fn this_process_memory_passes_and_a_freed_page_does_not() {
        let v = vec![7u8; 1 << 20];
        check_mapped(v.as_ptr() as u64, v.len() as u64, Access::READ_WRITE).unwrap();
        // SAFETY: a fresh anonymous mapping, unmapped right away; only its address is used after.
        let addr = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            libc::munmap(p, 4096);
            p as u64
        };
        assert!(
            check_mapped(addr, 4096, Access::READ).is_err(),
            "an unmapped page passed"
        );
    }

    proptest! {
        /// Whatever the text, no panic; and a range reported fine lies inside mappings.
        #[test]
        fn arbitrary_maps_never_panic(text in "[0-9a-f -]{0,200}", addr in any::<u64>(), len in any::<u64>()) {
            let _ = check_in(&text, addr, len, true);
        }
    }
}
