//! What makes two processes "the same host" for cross-memory attach: the kernel they run on (its boot
//! id), and the PID, user and network namespaces they live in. Two engines on one machine in different
//! containers share a boot id but not a PID namespace: a PID the peer names then means another process
//! here, so nothing may be decided by boot id (let alone IP address) alone.

use std::os::unix::fs::MetadataExt;

use ferry_core::{Error, Result};

/// A namespace, as the kernel names it: the device and inode of `/proc/self/ns/<kind>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Namespace {
    /// Device of the nsfs entry.
    pub dev: u64,
    /// Inode of the nsfs entry.
    pub ino: u64,
}

/// This process's place on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFacts {
    /// `/proc/sys/kernel/random/boot_id`: one per boot of one kernel.
    pub boot_id: [u8; 36],
    /// The process id, in `pid_ns`.
    pub pid: u32,
    /// The real user id.
    pub uid: u32,
    /// PID namespace.
    pub pid_ns: Namespace,
    /// User namespace.
    pub user_ns: Namespace,
    /// Network namespace (the Unix socket the link uses is in the abstract namespace of one).
    pub net_ns: Namespace,
}

fn namespace(kind: &str) -> Result<Namespace> {
    let path = format!("/proc/self/ns/{kind}");
    let meta = std::fs::metadata(&path).map_err(|e| Error::io(format_args!("reading {path}"), e))?;
    Ok(Namespace {
        dev: meta.dev(),
        ino: meta.ino(),
    })
}

impl HostFacts {
    /// This process's facts, from `/proc`.
    pub fn here() -> Result<Self> {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map_err(|e| Error::io("reading /proc/sys/kernel/random/boot_id", e))?;
        let mut boot_id = [0u8; 36];
        let text = text.trim().as_bytes();
        if text.len() != boot_id.len() {
            return Err(Error::Unsupported(format!(
                "the kernel's boot id has {} characters, not 36",
                text.len()
            )));
        }
        boot_id.copy_from_slice(text);
        Ok(HostFacts {
            boot_id,
            pid: std::process::id(),
            // SAFETY: getuid has no preconditions and cannot fail.
            uid: unsafe { libc::getuid() },
            pid_ns: namespace("pid")?,
            user_ns: namespace("user")?,
            net_ns: namespace("net")?,
        })
    }

    /// Why a peer with facts `peer` cannot use this transport with this process, or `None` when it
    /// can (as far as facts go: the kernel still has its say, see `crate::cma::probe`).
    pub fn why_not(&self, peer: &HostFacts) -> Option<String> {
        if self.boot_id != peer.boot_id {
            return Some("the peer runs on another host (another kernel boot id)".into());
        }
        if self.pid_ns != peer.pid_ns {
            return Some("the peer is in another PID namespace (a container without a shared PID namespace)".into());
        }
        if self.user_ns != peer.user_ns {
            return Some("the peer is in another user namespace".into());
        }
        if self.net_ns != peer.net_ns {
            return Some("the peer is in another network namespace (the link's Unix socket is not reachable)".into());
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_on_its_own_host() {
        let here = HostFacts::here().unwrap();
        assert_eq!(here.why_not(&here), None);
        let mut other = here.clone();
        other.pid_ns.ino += 1;
        assert!(here.why_not(&other).unwrap().contains("PID namespace"));
        let mut other = here.clone();
        other.boot_id[0] ^= 1;
        assert!(here.why_not(&other).unwrap().contains("another host"));
    }
}
