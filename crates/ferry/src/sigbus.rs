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
//! The handler only reads atomics and calls `mmap`, a plain system call, which is what a signal
//! handler may do. A slot is cleared before its mapping is unmapped, and nothing accesses a mapping
//! while it is being unmapped (the region's fence has closed), so the handler never remaps an address
//! range that has been handed to something else.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ferry_core::{Error, Result};

/// How many mappings can be guarded at once (HIXL advises about 4K registrations in all).
const SLOTS: usize = 4096;

struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    lost: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    lost: AtomicBool::new(false),
};

static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// A mapping under guard; the slot is released on drop (before the caller unmaps).
#[derive(Debug)]
pub(crate) struct Guard {
    slot: usize,
}

impl Guard {
    /// Guards `[start, start + len)`, installing the handler on first use.
    pub(crate) fn new(start: *mut u8, len: usize) -> Result<Guard> {
        install()?;
        for (i, slot) in TABLE.iter().enumerate() {
            if slot
                .start
                .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                slot.lost.store(false, Ordering::Release);
                slot.len.store(len, Ordering::Release);
                slot.start.store(start as usize, Ordering::Release);
                return Ok(Guard { slot: i });
            }
        }
        Err(Error::ResourceExhausted(format!(
            "{SLOTS} file regions are registered already; deregister one first"
        )))
    }

    /// Whether a fault replaced the mapping with zero pages (its file shrank under it).
    pub(crate) fn is_lost(&self) -> bool {
        TABLE[self.slot].lost.load(Ordering::Acquire)
    }

    /// Replaces the mapping with zero pages now, before anything faults on it: for a file found
    /// shorter than the mapping by other means.
    pub(crate) fn abandon(&self) {
        let slot = &TABLE[self.slot];
        replace_with_zero_pages(slot);
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let slot = &TABLE[self.slot];
        slot.start.store(usize::MAX, Ordering::Release);
        slot.len.store(0, Ordering::Release);
        slot.start.store(0, Ordering::Release);
    }
}

fn replace_with_zero_pages(slot: &Slot) -> bool {
    let start = slot.start.load(Ordering::Acquire);
    let len = slot.len.load(Ordering::Acquire);
    if start == 0 || start == usize::MAX || len == 0 {
        return false;
    }
    // SAFETY: `[start, start + len)` is a live mapping owned by the slot's `FileMapping` (slots are
    // cleared before unmapping); MAP_FIXED swaps its pages for private zero pages of the same size and
    // protection, so every pointer into it stays valid.
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
    slot.lost.store(true, Ordering::Release);
    true
}

extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in &TABLE {
        let start = slot.start.load(Ordering::Acquire);
        let len = slot.len.load(Ordering::Acquire);
        if start != 0 && start != usize::MAX && addr >= start && addr - start < len && replace_with_zero_pages(slot) {
            return;
        }
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
