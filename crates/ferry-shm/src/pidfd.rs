//! A process held by a pidfd (`pidfd_open(2)`, Linux 5.3): the target's proof that a process id it
//! copies to or from still names the process it checked at setup.
//!
//! Cross-memory attach takes a process id, which the kernel hands to a new process once the old one
//! has exited and been reaped. A pidfd refers to one process for good and turns readable when that
//! process exits. So the target opens one before it probes the initiator, and checks it before and
//! after every copy: a copy that began and ended with the process alive reached it, since a process id
//! is not reused while its process exists. A copy that ends with the process gone is reported failed
//! (the kernel would have refused it had the id been free; only a reuse within the copy itself could
//! have sent its bytes elsewhere, and then they are reported as not delivered).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use ferry_core::{Error, Result};

/// An open pidfd.
#[derive(Debug)]
pub struct PidFd {
    fd: OwnedFd,
    pid: u32,
}

impl PidFd {
    /// Opens a pidfd for process `pid`.
    pub fn open(pid: u32) -> Result<PidFd> {
        let raw =
            libc::pid_t::try_from(pid).map_err(|_| Error::InvalidArgument(format!("{pid} is not a process id")))?;
        // SAFETY: pidfd_open takes a process id and flags and returns a new descriptor or -1; it
        // touches no memory of ours.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) => Error::PeerClosed(format!("process {pid} has exited")),
                Some(libc::ENOSYS) => Error::Unsupported(
                    "this kernel has no pidfd_open (Linux 5.3 or later): shared memory with cross-memory \
                     attach needs it to tell a process from a later one with the same id"
                        .into(),
                ),
                _ => Error::io(format_args!("opening a pidfd for process {pid}"), e),
            });
        }
        // SAFETY: `fd` is a descriptor the kernel just opened for us, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
        Ok(PidFd { fd, pid })
    }

    /// The process id it holds.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process has exited.
    pub fn exited(&self) -> bool {
        let mut fd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for our open descriptor; a zero timeout never blocks.
        let n = unsafe { libc::poll(&mut fd, 1, 0) };
        // A pidfd is readable once its process exited; an error is taken as gone.
        n != 0
    }

    /// `Ok` while the process lives; the error names `what` was being done.
    pub fn check(&self, what: &str) -> Result<()> {
        match self.exited() {
            false => Ok(()),
            true => Err(Error::PeerClosed(format!(
                "process {} exited {what}: its bytes are not reported as moved",
                self.pid
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pidfd_sees_its_process_exit() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let fd = PidFd::open(child.id()).unwrap();
        assert!(!fd.exited());
        fd.check("during a copy").unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(fd.exited(), "the pidfd did not see its process exit");
        assert!(matches!(fd.check("during a copy"), Err(Error::PeerClosed(_))));
        // A reaped process's id names nothing a new pidfd could open (until reused).
        assert!(PidFd::open(u32::MAX).is_err());
    }

    /// The id of a process that exited, given to another process (as the kernel does once ids wrap;
    /// forced here with `clone3`'s `set_tid`): the pidfd of the first still says it exited, while the
    /// id alone names a live process again.
    #[test]
    fn a_reused_process_id_is_not_taken_for_the_process_checked() {
        let mut first = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = first.id();
        let fd = PidFd::open(pid).unwrap();
        first.kill().unwrap();
        first.wait().unwrap();
        let second = match spawn_with_pid(pid) {
            Ok(second) => second,
            // Choosing a process id needs CAP_SYS_ADMIN: `cargo xtask test` runs as root, where this
            // must work.
            // SAFETY: geteuid has no preconditions.
            Err(e) if unsafe { libc::geteuid() } != 0 => {
                eprintln!("not run: choosing a process id needs root ({e})");
                return;
            }
            Err(e) => panic!("clone3 with set_tid {pid} failed as root: {e}"),
        };
        let live = PidFd::open(pid).expect("the id names a live process again");
        assert!(!live.exited());
        assert!(fd.exited(), "the pidfd took the new process for the one it holds");
        assert!(matches!(fd.check("during a copy"), Err(Error::PeerClosed(_))));
        // SAFETY: `second` is our child; SIGKILL ends it and waitpid reaps it.
        unsafe {
            libc::kill(second, libc::SIGKILL);
            libc::waitpid(second, std::ptr::null_mut(), 0);
        }
    }

    /// `struct clone_args` of `clone3(2)`, up to `set_tid_size`.
    #[repr(C)]
    #[derive(Default)]
    struct CloneArgs {
        flags: u64,
        pidfd: u64,
        child_tid: u64,
        parent_tid: u64,
        exit_signal: u64,
        stack: u64,
        stack_size: u64,
        tls: u64,
        set_tid: u64,
        set_tid_size: u64,
    }

    /// Starts a child with process id `pid` that waits for a signal; its id.
    fn spawn_with_pid(pid: u32) -> std::io::Result<libc::pid_t> {
        let tids = [pid as libc::pid_t];
        let args = CloneArgs {
            exit_signal: libc::SIGCHLD as u64,
            set_tid: tids.as_ptr() as u64,
            set_tid_size: 1,
            ..CloneArgs::default()
        };
        // SAFETY: `args` is a valid clone_args of the size passed, and `tids` outlives the call. With
        // no flags this is a fork: the child runs only `pause`, which is async-signal-safe, until it
        // is killed.
        let r = unsafe {
            libc::syscall(
                libc::SYS_clone3,
                &args as *const CloneArgs,
                std::mem::size_of::<CloneArgs>(),
            )
        };
        if r == 0 {
            loop {
                // SAFETY: pause has no preconditions.
                unsafe { libc::pause() };
            }
        }
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(r as libc::pid_t)
    }

    #[test]
    fn this_process_is_alive() {
        let me = PidFd::open(std::process::id()).unwrap();
        assert!(!me.exited());
        assert_eq!(me.pid(), std::process::id());
    }
}
