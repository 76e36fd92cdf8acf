//! What makes two processes "the same host" for cross-memory attach: the kernel they run on (its boot
//! id), and the PID, user and network namespaces they live in. Two engines on one machine in different
//! containers share a boot id but not a PID namespace: a PID the peer names then means another process
//! here, so nothing may be decided by boot id (let alone IP address) alone.
//!
//! The facts and the rule that compares them are `ferry_proto::shm`'s; this module reads them from
//! `/proc`.

use std::os::unix::fs::MetadataExt;

use ferry_core::{Error, Result};
use ferry_proto::shm::{HostFacts, Namespace};

fn namespace(kind: &str) -> Result<Namespace> {
    let path = format!("/proc/self/ns/{kind}");
    let meta = std::fs::metadata(&path).map_err(|e| Error::io(format_args!("reading {path}"), e))?;
    Ok(Namespace {
        dev: meta.dev(),
        ino: meta.ino(),
    })
}

/// This process's facts, from `/proc`.
pub fn here() -> Result<HostFacts> {
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

#[cfg(test)]
mod tests {

    #[test]
    fn a_process_is_on_its_own_host() {
        let here = super::here().unwrap();
        assert_eq!(here.why_not(&here), None);
        let mut other = here.clone();
        other.pid_ns.ino += 1;
        assert!(here.why_not(&other).unwrap().contains("PID namespace"));
        let mut other = here.clone();
        other.boot_id[0] ^= 1;
        assert!(here.why_not(&other).unwrap().contains("another host"));
    }
}
