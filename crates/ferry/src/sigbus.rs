//! Survives a mapped file that shrinks behind the engine's back.
//!
//! Touching a page of a shared file mapping past the file's end raises `SIGBUS`, which kills the
//! process. The engine cannot stop another process from truncating a file it registered, so it
//! guards its mappings instead: a process-wide `SIGBUS` handler looks the faulting address up in a
//! fixed table of guarded mappings and, when it falls in one, replaces that whole mapping with
//! anonymous zero pages (`mmap(MAP_FIXED)`), marks it lost and returns, so the faulting copy
//! finishes harmlessly. The engine then reports the region's operations as failed. Faults outside
//! every guarded mapping go to the handler that was installed before (Rust's stack-overflow handler,
//! or the default action), so other crashes still crash.
//!
//! Only a fault whose `si_code` is `BUS_ADRERR` (an address past the end of the mapped object) is
//! taken as truncation. Memory poison (`BUS_MCEERR_AR`, `BUS_MCEERR_AO`), alignment and object errors
//! go to the previous handler even inside a guarded mapping: swapping poisoned memory for zeros
//! would hide a hardware error behind a wrong answer.
//!
//! The handler only reads atomics and calls `mmap`, a plain system call, which is what a signal
//! handler may do. Each entry's `(start, len)` pair is published under a sequence counter (a seqlock
//! with one writer, the entry's owner), so the handler never sees the start of one mapping with the
//! length of another: a torn read would map zero pages over an unrelated range. A pair that is being
//! written is not matched; nothing touches a mapping while its guard is being set up or dropped. A
//! entry is cleared before its mapping is unmapped, and nothing accesses a mapping while it is being
//! unmapped (the region's access guard has closed), so the handler never remaps an address range that has
//! been handed to something else.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};

use ferry_core::{Error, Result};

/// How many mappings can be guarded at once (HIXL advises about 4K registrations in all).
const ENTRIES: usize = 4096;

/// How often the handler re-reads a pair that changed under it before passing the entry by.
const READ_RETRIES: usize = 4;

struct GuardedMapping {
    /// Whether a `Guard` owns the entry.
    claimed: AtomicBool,
    /// Odd while the owner rewrites `start`/`len`; bumped twice per rewrite.
    seq: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
    lost: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: GuardedMapping = GuardedMapping {
    claimed: AtomicBool::new(false),
    seq: AtomicUsize::new(0),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    lost: AtomicBool::new(false),
};

static TABLE: [GuardedMapping; ENTRIES] = [EMPTY; ENTRIES];
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

impl GuardedMapping {
    /// Publishes `(start, len)`; only the entry's owner calls this.
    fn publish(&self, start: usize, len: usize) {
        self.seq.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        self.start.store(start, Ordering::Relaxed);
        self.len.store(len, Ordering::Relaxed);
        self.seq.fetch_add(1, Ordering::Release);
    }

    /// The published pair, read consistently; `None` for an empty entry or one being rewritten.
    fn mapping(&self) -> Option<(usize, usize)> {
        for _ in 0..READ_RETRIES {
            let before = self.seq.load(Ordering::Acquire);
            if before % 2 == 1 {
                return None;
            }
            let start = self.start.load(Ordering::Relaxed);
            let len = self.len.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) == before {
                return (start != 0 && len != 0).then_some((start, len));
            }
        }
        None
    }
}

/// A mapping under guard; the entry is released on drop (before the caller unmaps).
#[derive(Debug)]
pub(crate) struct Guard {
    entry: usize,
}

impl Guard {
    /// Guards `[start, start + len)`, installing the handler on first use.
    pub(crate) fn new(start: *mut u8, len: usize) -> Result<Guard> {
        install()?;
        for (i, entry) in TABLE.iter().enumerate() {
            if entry
                .claimed
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                entry.lost.store(false, Ordering::Release);
                entry.publish(start as usize, len);
                return Ok(Guard { entry: i });
            }
        }
        Err(Error::ResourceExhausted(format!(
            "{ENTRIES} file regions are registered already; deregister one first"
        )))
    }

    /// Whether a fault replaced the mapping with zero pages (its file shrank under it).
    pub(crate) fn is_lost(&self) -> bool {
        TABLE[self.entry].lost.load(Ordering::Acquire)
    }

    /// Replaces the mapping with zero pages now, before anything faults on it: for a file found
    /// shorter than the mapping by other means.
    pub(crate) fn abandon(&self) {
        let entry = &TABLE[self.entry];
        if let Some(mapping) = entry.mapping() {
            replace_with_zero_pages(entry, mapping);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let entry = &TABLE[self.entry];
        entry.publish(0, 0);
        entry.claimed.store(false, Ordering::Release);
    }
}

fn replace_with_zero_pages(entry: &GuardedMapping, (start, len): (usize, usize)) -> bool {
    // SAFETY: `[start, start + len)` is a live mapping owned by the entry's `FileMapping`, read as one
    // consistent pair (entries are cleared before unmapping); MAP_FIXED swaps its pages for private zero
    // pages of the same size and protection, so every pointer into it stays valid.
    let p = unsafe {
        libc::mmap(
            start as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return false;
    }
    entry.lost.store(true, Ordering::Release);
    true
}

/// Whether the fault is an access past the end of a guarded mapping's file, which it then repairs.
fn repaired_truncation(code: libc::c_int, addr: usize) -> bool {
    if code != libc::BUS_ADRERR {
        return false;
    }
    TABLE.iter().any(|entry| match entry.mapping() {
        Some((start, len)) if addr >= start && addr - start < len => replace_with_zero_pages(entry, (start, len)),
        _ => false,
    })
}

extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler; `si_addr` is meaningful for
    // SIGBUS, the only signal this handler is installed for.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if repaired_truncation(code, addr) {
        return;
    }
    let Some(previous) = PREVIOUS.get() else { return };
    let handler = previous.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // SAFETY: restores the default action; returning re-runs the faulting access, which now
        // terminates the process the way it would have without this handler.
        unsafe {
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &default, std::ptr::null_mut());
        }
    } else if previous.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler was installed with SA_SIGINFO, so it has this signature.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        f(signal, info, context);
    } else {
        // SAFETY: without SA_SIGINFO the previous handler takes the signal number only.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        f(signal);
    }
}

fn install() -> Result<()> {
    static INSTALLED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            // SAFETY: a zeroed sigaction is a valid value to fill in; `on_sigbus` has the SA_SIGINFO
            // signature; the old action is saved before any fault can reach the new handler's chain.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut action.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old);
                let _ = PREVIOUS.set(old);
                if libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) != 0 {
                    return Err(std::io::Error::last_os_error().to_string());
                }
            }
            Ok(())
        })
        .clone()
        .map_err(|e| Error::Io {
            kind: std::io::ErrorKind::Other,
            message: format!("installing the SIGBUS guard for file regions: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// Set in the child process that runs the test body with a handler of its own installed first.
    const CHILD: &str = "FERRY_SIGBUS_TEST_CHILD";
    const NAME: &str = "sigbus::tests::only_truncation_faults_are_repaired";

    static PREVIOUS_CALLS: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn counting_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
        PREVIOUS_CALLS.fetch_add(1, Ordering::SeqCst);
    }

    /// Delivers SIGBUS to this thread with the given `si_code` and fault address, as the kernel would.
    fn raise_sigbus(code: libc::c_int, addr: usize) {
        /// `siginfo_t` for SIGBUS on Linux: three ints, padding, then the `_sigfault` union member.
        #[repr(C)]
        struct BusInfo {
            signo: libc::c_int,
            errno: libc::c_int,
            code: libc::c_int,
            _pad: libc::c_int,
            addr: usize,
            _rest: [u64; 13],
        }
        let info = BusInfo {
            signo: libc::SIGBUS,
            errno: 0,
            code,
            _pad: 0,
            addr,
            _rest: [0; 13],
        };
        // SAFETY: `info` is a complete 128-byte siginfo for this thread of this process; the signal is
        // handled before the system call returns.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_rt_tgsigqueueinfo,
                libc::getpid(),
                libc::gettid(),
                libc::SIGBUS,
                &info as *const BusInfo,
            )
        };
        assert_eq!(rc, 0, "rt_tgsigqueueinfo: {}", std::io::Error::last_os_error());
    }

    /// Memory poison inside a guarded mapping goes to the previous handler and leaves the mapping as
    /// it was; an access past the file's end (`BUS_ADRERR`) is repaired with zero pages. Runs in a
    /// child process, since it installs a handler of its own before the guard's.
    #[test]
    fn only_truncation_faults_are_repaired() {
        if std::env::var_os(CHILD).is_none() {
            let exe = std::env::current_exe().expect("the test binary's path");
            let out = Command::new(exe)
                .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .output()
                .expect("running the child");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                out.status.success() && text.contains("1 passed"),
                "child failed: {text}"
            );
            return;
        }
        // SAFETY: a zeroed sigaction filled with a handler of the SA_SIGINFO signature.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = counting_handler as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut action.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()), 0);
        }
        let len = 2 * 4096;
        // SAFETY: a fresh anonymous mapping; it stands in for a file mapping (the guard sees addresses).
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        let base = map.cast::<u8>();
        // SAFETY: `base` points to `len` writable bytes that nothing else uses.
        unsafe { std::ptr::write_bytes(base, 0xAB, len) };
        let guard = Guard::new(base, len).expect("a free entry");
        // SAFETY: reads one byte of the live mapping.
        let byte = |offset: usize| unsafe { base.add(offset).read_volatile() };

        raise_sigbus(libc::BUS_MCEERR_AR, base as usize + 100);
        assert_eq!(
            PREVIOUS_CALLS.load(Ordering::SeqCst),
            1,
            "poison reaches the previous handler"
        );
        assert!(
            !guard.is_lost() && byte(100) == 0xAB,
            "poison must not be papered over with zeros"
        );

        raise_sigbus(libc::BUS_ADRERR, base as usize + len + 4096 * 16);
        assert_eq!(
            PREVIOUS_CALLS.load(Ordering::SeqCst),
            2,
            "a fault outside every guard is not ours"
        );

        raise_sigbus(libc::BUS_ADRERR, base as usize + 100);
        assert_eq!(PREVIOUS_CALLS.load(Ordering::SeqCst), 2);
        assert!(
            guard.is_lost() && byte(100) == 0 && byte(len - 1) == 0,
            "truncation is repaired"
        );

        drop(guard);
        // SAFETY: the guard is gone; the mapping is ours to unmap.
        unsafe { libc::munmap(map, len) };
    }

    #[test]
    fn an_entry_pair_is_read_whole_or_not_at_all() {
        let entry = GuardedMapping {
            claimed: AtomicBool::new(true),
            seq: AtomicUsize::new(0),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            lost: AtomicBool::new(false),
        };
        assert_eq!(entry.mapping(), None);
        entry.publish(0x1000, 0x2000);
        assert_eq!(entry.mapping(), Some((0x1000, 0x2000)));
        entry.seq.fetch_add(1, Ordering::Relaxed);
        entry.start.store(0x9000, Ordering::Relaxed);
        assert_eq!(entry.mapping(), None, "a pair being rewritten is not matched");
        entry.len.store(0x10, Ordering::Relaxed);
        entry.seq.fetch_add(1, Ordering::Release);
        assert_eq!(entry.mapping(), Some((0x9000, 0x10)));
    }
}
