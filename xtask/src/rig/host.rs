//! The host packages the rig needs: qemu, a static busybox, rdma-core, perftest and the tools that
//! unpack a kernel package.
//!
//! Why these and no more: the guest runs the host's own user space (shared over 9p), so the host needs
//! exactly what a command in the guest needs (libibverbs, the rxe provider, perftest), plus what builds
//! the guest (qemu, busybox, kmod, cpio, xz, zstd). Packages that ship binaries are checked by binary
//! through `ensure_debian_packages`; the library-only ones (no binary to look for) through dpkg.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{ensure_debian_packages, run_captured, run_step};

/// `(binary, Debian package)` for the packages that ship a binary.
const BINARIES: &[(&str, &str)] = &[
    ("qemu-system-x86_64", "qemu-system-x86"),
    ("busybox", "busybox-static"),
    ("ibv_devinfo", "ibverbs-utils"),
    ("rping", "rdmacm-utils"),
    ("ib_write_bw", "perftest"),
    ("ib_read_bw", "perftest"),
    ("ip", "iproute2"),
    ("rdma", "iproute2"),
    ("modprobe", "kmod"),
    ("depmod", "kmod"),
    ("cpio", "cpio"),
    ("xz", "xz-utils"),
    ("zstd", "zstd"),
    ("dpkg-deb", "dpkg"),
    // rdma-core 55 for the FLUSH verb, built from source (see pmem.rs).
    ("curl", "curl"),
    ("cmake", "cmake"),
    ("ninja", "ninja-build"),
    ("cc", "gcc"),
    ("pkg-config", "pkg-config"),
    // The power-cut trials' disk images.
    ("mke2fs", "e2fsprogs"),
    ("e2fsck", "e2fsprogs"),
    ("debugfs", "e2fsprogs"),
];

/// Library-only packages: nothing on `PATH` tells whether they are installed.
const LIBRARIES: &[&str] = &[
    "libibverbs1",
    "ibverbs-providers",
    "librdmacm1",
    "libnl-3-dev",
    "libnl-route-3-dev",
];

/// Makes sure every host package is present (installing as root on Debian, else failing with the
/// command that installs them) and that the busybox found is the static one.
pub fn ensure_packages() -> Result<()> {
    if std::env::consts::ARCH != "x86_64" {
        bail!(
            "the RDMA rig boots an amd64 Debian kernel with the host's user space, so it needs an x86_64 host (this is {})",
            std::env::consts::ARCH
        );
    }
    ensure_debian_packages(BINARIES)?;
    ensure_libraries()?;
    let busybox = which("busybox").context("busybox is not on PATH")?;
    let bytes = std::fs::read(&busybox).with_context(|| format!("reading {}", busybox.display()))?;
    if has_interpreter(&bytes) {
        bail!(
            "{} is dynamically linked, but the initramfs needs a static busybox; install it with: apt-get install busybox-static",
            busybox.display()
        );
    }
    Ok(())
}

fn ensure_libraries() -> Result<()> {
    let missing: Vec<&str> = LIBRARIES.iter().copied().filter(|p| !dpkg_installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let install = format!("apt-get install -y -qq --no-install-recommends {}", missing.join(" "));
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !root {
        bail!(
            "missing Debian packages {}; install them as root with: {install}",
            missing.join(", ")
        );
    }
    let timeout = Duration::from_secs(20 * 60);
    let mut cmd = Command::new("apt-get");
    cmd.env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing);
    if run_step(&mut cmd, timeout).is_err() {
        // The package lists may be stale or absent (a fresh container): refresh them once, retry.
        run_step(Command::new("apt-get").args(["update", "-qq"]), timeout).context("apt-get update")?;
        run_step(&mut cmd, timeout).with_context(|| format!("installing {}", missing.join(", ")))?;
    }
    Ok(())
}

fn dpkg_installed(package: &str) -> bool {
    let mut cmd = Command::new("dpkg-query");
    cmd.args(["-W", "-f", "${db:Status-Abbrev}", package]);
    run_captured(&mut cmd, Duration::from_secs(60)).is_ok_and(|o| o.status.success() && o.stdout.starts_with("ii"))
}

/// The first `name` on `PATH`.
pub fn which(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Whether an ELF file asks for a program interpreter (is dynamically linked).
fn has_interpreter(elf: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    let u16_at = |at: usize| elf.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |at: usize| {
        elf.get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |at: usize| {
        elf.get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    };
    if !elf.starts_with(b"\x7fELF") || elf.get(4) != Some(&2) {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        return false;
    };
    (0..usize::from(phnum)).any(|i| {
        usize::try_from(phoff)
            .ok()
            .and_then(|off| u32_at(off + i * usize::from(phentsize)))
            == Some(PT_INTERP)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpreter_detection() {
        // A dynamically linked system binary has PT_INTERP; a file that is not ELF has none.
        if let Ok(bytes) = std::fs::read("/bin/sh") {
            assert!(has_interpreter(&bytes));
        }
        assert!(!has_interpreter(b"#!/bin/sh\n"));
        assert!(!has_interpreter(b"\x7fELF"));
    }
}
