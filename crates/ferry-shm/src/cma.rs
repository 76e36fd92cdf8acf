//! Cross-memory attach: `process_vm_readv` and `process_vm_writev` copy between this process's memory
//! and another's in one system call per up to `IOV_MAX` ranges, with one copy (no socket buffer in
//! between). The kernel allows it where this process may ptrace the other (same user and no Yama
//! restriction, or `CAP_SYS_PTRACE`), and seccomp may forbid the calls: [`probe`] finds out before a
//! link relies on it.

use ferry_core::{Error, Result};

/// Ranges per system call (the kernel's `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Which way bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the other process into this one (`process_vm_readv`).
    In,
    /// From this process into the other (`process_vm_writev`).
    Out,
}

/// One range: `len` bytes at `local` here and at `remote` in the other process.
#[derive(Debug, Clone, Copy)]
pub struct Range {
    /// This process's address.
    pub local: *mut u8,
    /// The other process's address.
    pub remote: u64,
    /// Bytes.
    pub len: usize,
}

fn errno_error(pid: u32, direction: Direction, err: std::io::Error) -> Error {
    let call = match direction {
        Direction::In => "process_vm_readv",
        Direction::Out => "process_vm_writev",
    };
    match err.raw_os_error() {
        Some(libc::EPERM) => Error::PermissionDenied(format!(
            "{call} on process {pid} was denied (EPERM): another user, Yama's ptrace_scope, or a seccomp filter"
        )),
        Some(libc::ENOSYS) => Error::Unsupported(format!("{call} is not available (ENOSYS: seccomp or an old kernel)")),
        Some(libc::ESRCH) => Error::PeerClosed(format!("process {pid} is gone ({call}: ESRCH)")),
        Some(libc::EFAULT) => Error::OutOfBounds(format!("{call} on process {pid}: an address is not mapped (EFAULT)")),
        _ => Error::io(format_args!("{call} on process {pid}"), err),
    }
}

/// Copies every range, in as few system calls as the kernel allows.
///
/// # Safety
///
/// Every `local` range must be valid for the copy's direction (writable for [`Direction::In`]) for
/// the duration of the call, and nothing else may access it meanwhile in a way that conflicts.
pub unsafe fn copy(pid: u32, direction: Direction, ranges: &[Range]) -> Result<()> {
    for chunk in ranges.chunks(IOV_MAX) {
        let mut local: Vec<libc::iovec> = chunk
            .iter()
            .map(|r| libc::iovec {
                iov_base: r.local.cast(),
                iov_len: r.len,
            })
            .collect();
        let mut remote: Vec<libc::iovec> = chunk
            .iter()
            .map(|r| libc::iovec {
                iov_base: r.remote as *mut libc::c_void,
                iov_len: r.len,
            })
            .collect();
        let total: usize = chunk.iter().map(|r| r.len).sum();
        let mut done = 0usize;
        // A partial transfer ends at an iovec boundary of the remote side or at a fault: skip what was
        // done and go on; a call that moves nothing reports why.
        let (mut l, mut r) = (0usize, 0usize);
        while done < total {
            // SAFETY: the iovecs describe the caller's ranges (valid for this direction, as the
            // function's contract says) and addresses in the other process, which the kernel checks.
            let n = unsafe {
                match direction {
                    Direction::In => libc::process_vm_readv(
                        pid as libc::pid_t,
                        local[l..].as_ptr(),
                        (local.len() - l) as libc::c_ulong,
                        remote[r..].as_ptr(),
                        (remote.len() - r) as libc::c_ulong,
                        0,
                    ),
                    Direction::Out => libc::process_vm_writev(
                        pid as libc::pid_t,
                        local[l..].as_ptr(),
                        (local.len() - l) as libc::c_ulong,
                        remote[r..].as_ptr(),
                        (remote.len() - r) as libc::c_ulong,
                        0,
                    ),
                }
            };
            if n < 0 {
                return Err(errno_error(pid, direction, std::io::Error::last_os_error()));
            }
            if n == 0 {
                return Err(Error::OutOfBounds(format!(
                    "cross-memory attach with process {pid} stopped after {done} of {total} bytes"
                )));
            }
            done += n as usize;
            advance(&mut local, &mut l, n as usize);
            advance(&mut remote, &mut r, n as usize);
        }
    }
    Ok(())
}

/// Moves the start of `iovs[*at..]` forward by `n` bytes.
fn advance(iovs: &mut [libc::iovec], at: &mut usize, mut n: usize) {
    while n > 0 && *at < iovs.len() {
        let v = &mut iovs[*at];
        if n >= v.iov_len {
            n -= v.iov_len;
            *at += 1;
        } else {
            v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
            v.iov_len -= n;
            n = 0;
        }
    }
    while *at < iovs.len() && iovs[*at].iov_len == 0 {
        *at += 1;
    }
}

/// Reads the peer's probe buffer (`expected.len()` bytes at `addr` in process `pid`): `Ok` only if
/// cross-memory attach works towards that process and finds exactly what the peer said is there.
pub fn probe(pid: u32, addr: u64, expected: &[u8]) -> Result<()> {
    let mut got = vec![0u8; expected.len()];
    let range = Range {
        local: got.as_mut_ptr(),
        remote: addr,
        len: got.len(),
    };
    // SAFETY: `got` is a writable buffer of `len` bytes that nothing else touches.
    unsafe { copy(pid, Direction::In, &[range])? };
    match got == expected {
        true => Ok(()),
        false => Err(Error::PermissionDenied(format!(
            "process {pid} does not hold the probe its peer described: the peer is not that process"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_into_and_out_of_a_process() {
        // This process is its own peer: the kernel path is the same.
        let pid = std::process::id();
        let src: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; 10_000];
        let ranges: Vec<Range> = (0..10)
            .map(|i| Range {
                local: dst[i * 1000..].as_mut_ptr(),
                remote: src[i * 1000..].as_ptr() as u64,
                len: 1000,
            })
            .collect();
        // SAFETY: `dst` is writable and untouched during the call.
        unsafe { copy(pid, Direction::In, &ranges).unwrap() };
        assert_eq!(dst, src);
        assert!(probe(pid, src.as_ptr() as u64, &src[..32]).is_ok());
        assert!(matches!(
            probe(pid, src.as_ptr() as u64, &[9u8; 32]),
            Err(Error::PermissionDenied(_))
        ));
    }

    #[test]
    fn an_unmapped_address_is_out_of_bounds() {
        let mut dst = [0u8; 16];
        let range = Range {
            local: dst.as_mut_ptr(),
            remote: 16,
            len: 16,
        };
        // SAFETY: `dst` is writable and untouched during the call.
        let err = unsafe { copy(std::process::id(), Direction::In, &[range]) }.unwrap_err();
        assert!(matches!(err, Error::OutOfBounds(_)), "{err:?}");
    }

    #[test]
    fn partial_progress_advances_both_sides() {
        let mut a = [0u8; 8];
        let mut iovs = [
            libc::iovec {
                iov_base: a.as_mut_ptr().cast(),
                iov_len: 3,
            },
            libc::iovec {
                iov_base: a[3..].as_mut_ptr().cast(),
                iov_len: 5,
            },
        ];
        let mut at = 0;
        advance(&mut iovs, &mut at, 4);
        assert_eq!((at, iovs[1].iov_len), (1, 4));
        advance(&mut iovs, &mut at, 4);
        assert_eq!(at, 2);
    }
}
