//! The guest's initramfs: a static busybox, the kernel modules for rxe, 9p, the emulated NVDIMM and an
//! ext4 disk, and an `/init` that brings `rxe0` and `rxe1` up (two rails, each on a dummy device of its
//! own), runs the command from the host in a chroot of the host's root and powers off.
//!
//! Why so little in it: the guest's user space is the host's own root file system, shared read-only
//! over 9p, so the image only has to get that far. The modules are the ones `rdma_rxe`, RDMA CM and
//! 9p over virtio need, with their dependencies resolved by `modprobe --show-depends` against the
//! unpacked kernel (so a new kernel's new dependency is picked up without a change here); they are
//! stored uncompressed, since decompressing in the guest is slow under TCG, and loaded with `insmod`
//! in that order. The cpio is left uncompressed for the same reason.
//!
//! The image is rebuilt only when what goes into it changes (kernel release, module list, `/init`,
//! busybox), which `key` records.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::host::which;
use super::kernel::Kernel;
use super::{Layout, Timings};
use crate::util::{describe, run_captured, run_step};

/// Modules the guest loads, by name, in this order; their dependencies come first automatically.
const MODULES: &[&str] = &[
    "crc32_generic",
    "crc32-pclmul",
    "udp_tunnel",
    "ip6_udp_tunnel",
    "ib_core",
    "ib_uverbs",
    "rdma_rxe",
    "configfs",
    "ib_cm",
    "iw_cm",
    "rdma_cm",
    "rdma_ucm",
    "dummy",
    // The netem fault tests: namespaces joined by a veth pair, shaped by the netem qdisc.
    "veth",
    "sch_netem",
    // `cargo xtask chaos`: engines' namespaces on a bridge, partitions as a prio band behind a u32 filter.
    "bridge",
    "sch_prio",
    "cls_u32",
    "virtio",
    "virtio_ring",
    "virtio_pci",
    "netfs",
    "9pnet",
    "9pnet_virtio",
    "9p",
    "overlay",
    // Persistent memory: qemu's emulated NVDIMM, as device DAX (`/dev/dax0.0`) for the FLUSH tests.
    "libnvdimm",
    "nfit",
    "nd_btt",
    "nd_pmem",
    "dax_pmem",
    "device_dax",
    // The power-cut trials' ext4 disk.
    "virtio_blk",
    "crc16",
    "crc32c_generic",
    "mbcache",
    "jbd2",
    "ext4",
];

/// Modules a kernel may lack without harm: CPU-specific crypto, helpers that older kernels build in or
/// do not have (9p needs netfs only from 6.x on), and overlay (without it /tmp is a plain tmpfs).
const OPTIONAL: &[&str] = &[
    "crc32-pclmul",
    "crc32_generic",
    "virtio",
    "virtio_ring",
    "virtio_pci",
    "netfs",
    "crc16",
    "crc32c_generic",
    "mbcache",
    "jbd2",
];

/// Module parameters the rig sets itself (host modprobe.d files are deliberately not read).
fn parameters(name: &str) -> &'static str {
    match name {
        // One interface, created by /init with the name the rig wants.
        "dummy" => "numdummies=0",
        _ => "",
    }
}

/// The guest's `/init`. It reads `RIG_DIR` (the run folder's host path) from the `rig` share, runs
/// `$RIG_DIR/cmd.sh` in a chroot of the host's root and reports the status three ways: the file
/// `$RIG_DIR/rc`, a `rig: done rc=N` console line, and the isa-debug-exit port (qemu's own status).
pub const INIT: &str = r#"#!/bin/busybox sh
# /init of the `cargo xtask rig` guest (xtask/src/rig/image.rs).
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts && mount -t devpts devpts /dev/pts
mount -t tmpfs tmp /tmp
# The kernel asks for modules by itself now and then (crc32 on 6.1): let it find them here.
echo /bin/modprobe > /proc/sys/kernel/modprobe

# Writing N to port 0xf4 makes qemu exit with (N << 1) | 1; poweroff is the fallback.
leave() {
  sync
  printf "\\$(printf %o "$1")" | dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null
  poweroff -f
}
fail() {
  echo "rig: setup failed: $2"
  leave "$1"
}

while read -r module params; do
  insmod "$module" $params || echo "rig: warning: insmod $module failed"
done < /etc/rig/modules

OPTS=trans=virtio,version=9p2000.L,msize=512000
mount -t 9p -o $OPTS,ro,cache=loose hostroot /mnt/root || fail 120 "mounting the host root over 9p"
mount -t 9p -o $OPTS rig /rig || fail 121 "mounting the run folder over 9p"
. /rig/config
R=/mnt/root
mount -t proc proc $R/proc
mount -t sysfs sys $R/sys
mount --bind /dev $R/dev
mount --bind /dev/pts $R/dev/pts
# /tmp: the host's files (a test binary built under /tmp) over a writable tmpfs, or a plain tmpfs.
mkdir -p /overlay && mount -t tmpfs overlay /overlay && mkdir -p /overlay/upper /overlay/work && chmod 1777 /overlay/upper
mount -t overlay overlay -o lowerdir=$R/tmp,upperdir=/overlay/upper,workdir=/overlay/work $R/tmp 2>/dev/null ||
  mount -t tmpfs tmp $R/tmp
mount -t tmpfs run $R/run
mkdir -p "$R$RIG_DIR" 2>/dev/null
mount --bind /rig "$R$RIG_DIR" || fail 122 "mounting the run folder at $RIG_DIR"

chroot $R /usr/bin/env PATH=/usr/sbin:/usr/bin:/sbin:/bin sh -ec '
ip link add eth0 type dummy
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip link set lo up
rdma link add rxe0 type rxe netdev eth0
ip link add eth1 type dummy
ip link set eth1 up
ip addr add 10.0.3.15/24 dev eth1
rdma link add rxe1 type rxe netdev eth1
' || fail 123 "bringing up eth0 and eth1 (dummy) and rxe0 and rxe1"
ulimit -l unlimited

echo "rig: ready"
chroot $R /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin RIG_DIR="$RIG_DIR" /bin/sh "$RIG_DIR/cmd.sh" </dev/null
rc=$?
echo "$rc" > /rig/rc
echo "rig: done rc=$rc"
sync
umount "$R$RIG_DIR" /rig 2>/dev/null
leave "$rc"
"#;

/// Builds `target/rig/image/initramfs.cpio` unless the cached one was made from the same inputs.
pub fn prepare(layout: &Layout, kernel: &Kernel, timings: &mut Timings) -> Result<PathBuf> {
    let start = Instant::now();
    let dir = layout.dir.join("image");
    let cpio = dir.join("initramfs.cpio");
    let busybox = which("busybox").context("busybox is not on PATH")?;
    let busybox_meta = fs::metadata(&busybox).with_context(|| format!("reading {}", busybox.display()))?;
    let modules = resolve_modules(layout, kernel)?;
    let key = format!(
        "release {}\nbusybox {} {} {:?}\nmodules\n{}\ninit\n{INIT}",
        kernel.release,
        busybox.display(),
        busybox_meta.len(),
        busybox_meta.modified().ok(),
        modules.iter().map(|m| m.line()).collect::<Vec<_>>().join("\n"),
    );
    let key_file = dir.join("key");
    if cpio.is_file() && fs::read_to_string(&key_file).is_ok_and(|k| k == key) {
        timings.record("image", start, "cached");
        return Ok(cpio);
    }
    let staging = dir.join("root");
    if staging.exists() {
        fs::remove_dir_all(&staging).with_context(|| format!("removing {}", staging.display()))?;
    }
    let guest_modules = Path::new("lib/modules").join(&kernel.release);
    for d in ["bin", "dev", "proc", "sys", "tmp", "mnt/root", "rig", "etc/rig"] {
        fs::create_dir_all(staging.join(d)).with_context(|| format!("creating {d} in the image"))?;
    }
    fs::create_dir_all(staging.join(&guest_modules)).context("creating the image's module folder")?;
    fs::copy(&busybox, staging.join("bin/busybox")).with_context(|| format!("copying {}", busybox.display()))?;
    for m in &modules {
        let dest = staging.join(&guest_modules).join(&m.relative);
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        decompress_module(&m.source, &dest)?;
    }
    for meta in ["modules.order", "modules.builtin", "modules.builtin.modinfo"] {
        let from = kernel.modules_dir().join(meta);
        if from.is_file() {
            fs::copy(&from, staging.join(&guest_modules).join(meta))
                .with_context(|| format!("copying {}", from.display()))?;
        }
    }
    // modules.dep for busybox's modprobe, which the kernel calls for modules it wants by itself.
    run_step(
        Command::new("depmod").arg("-b").arg(&staging).arg(&kernel.release),
        Duration::from_secs(120),
    )
    .context("generating the image's modules.dep")?;
    let load_order: String = modules
        .iter()
        .map(|m| format!("/{}/{} {}\n", guest_modules.display(), m.relative.display(), m.params))
        .collect();
    fs::write(staging.join("etc/rig/modules"), load_order).context("writing etc/rig/modules")?;
    let init = staging.join("init");
    fs::write(&init, INIT).context("writing init")?;
    set_mode(&init, 0o755)?;
    set_mode(&staging.join("bin/busybox"), 0o755)?;
    write_cpio(&staging, &cpio)?;
    fs::remove_dir_all(&staging).ok();
    fs::write(&key_file, key).with_context(|| format!("writing {}", key_file.display()))?;
    let size = fs::metadata(&cpio).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "rig: initramfs {} ({:.1} MB, {} modules)",
        cpio.display(),
        size as f64 / 1e6,
        modules.len()
    );
    timings.record("image", start, "");
    Ok(cpio)
}

/// One module file to put in the image.
struct Module {
    /// The file in the unpacked kernel (possibly compressed).
    source: PathBuf,
    /// Its path under `lib/modules/<release>/` in the image, without a compression suffix.
    relative: PathBuf,
    params: String,
}

impl Module {
    fn line(&self) -> String {
        format!("{} {}", self.relative.display(), self.params)
    }
}

/// [`MODULES`] with their dependencies, in load order and without duplicates or built-ins.
fn resolve_modules(layout: &Layout, kernel: &Kernel) -> Result<Vec<Module>> {
    // An empty configuration folder, so the host's modprobe.d does not leak options into the guest.
    let empty_config = layout.dir.join("modprobe.d");
    fs::create_dir_all(&empty_config).with_context(|| format!("creating {}", empty_config.display()))?;
    let modules_dir = kernel.modules_dir();
    let mut resolved: Vec<Module> = Vec::new();
    for &name in MODULES {
        let mut cmd = Command::new("modprobe");
        cmd.arg("-C").arg(&empty_config).arg("-d").arg(kernel.root()).args([
            "-S",
            &kernel.release,
            "--show-depends",
            name,
        ]);
        let what = describe(&cmd);
        let out = run_captured(&mut cmd, Duration::from_secs(60))?;
        if !out.status.success() {
            if OPTIONAL.contains(&name) {
                continue;
            }
            bail!(
                "kernel {} has no module {name} (`{what}`: {})",
                kernel.release,
                out.combined().trim()
            );
        }
        for (path, _) in parse_show_depends(&out.stdout) {
            let source = PathBuf::from(path);
            let relative = source
                .strip_prefix(&modules_dir)
                .with_context(|| format!("{} is not under {}", source.display(), modules_dir.display()))?;
            let relative = strip_compression(relative);
            if resolved.iter().any(|m| m.relative == relative) {
                continue;
            }
            let stem = relative
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            resolved.push(Module {
                source,
                relative,
                params: parameters(&stem).to_owned(),
            });
        }
    }
    Ok(resolved)
}

/// The `insmod PATH [options]` lines of `modprobe --show-depends` (`builtin NAME` lines need nothing).
fn parse_show_depends(stdout: &str) -> Vec<(&str, &str)> {
    stdout
        .lines()
        .filter_map(|l| l.trim().strip_prefix("insmod "))
        .map(|rest| rest.split_once(' ').unwrap_or((rest, "")))
        .map(|(path, options)| (path, options.trim()))
        .collect()
}

fn strip_compression(path: &Path) -> PathBuf {
    let text = path.to_string_lossy();
    for suffix in [".xz", ".zst", ".gz"] {
        if let Some(stripped) = text.strip_suffix(suffix) {
            return PathBuf::from(stripped);
        }
    }
    path.to_owned()
}

fn decompress_module(source: &Path, dest: &Path) -> Result<()> {
    let tool = match source.extension().and_then(|e| e.to_str()) {
        Some("xz") => "xz",
        Some("zst") => "zstd",
        Some("gz") => "gzip",
        _ => {
            fs::copy(source, dest).with_context(|| format!("copying {}", source.display()))?;
            return Ok(());
        }
    };
    let out = fs::File::create(dest).with_context(|| format!("creating {}", dest.display()))?;
    let mut cmd = Command::new(tool);
    cmd.arg("-dc").arg(source).stdout(out);
    let status = cmd
        .status()
        .with_context(|| format!("cannot start `{}`", describe(&cmd)))?;
    if !status.success() {
        bail!("`{}` failed ({status})", describe(&cmd));
    }
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).with_context(|| format!("chmod {}", path.display()))
}

/// `cpio -o -H newc` of everything under `staging`, owned by root in the archive.
fn write_cpio(staging: &Path, cpio: &Path) -> Result<()> {
    let mut entries = Vec::new();
    collect(staging, staging, &mut entries)?;
    entries.sort();
    let partial = cpio.with_extension("partial");
    let out = fs::File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let mut child = Command::new("cpio")
        .args(["-o", "-H", "newc", "-R", "0:0", "--quiet"])
        .current_dir(staging)
        .stdin(Stdio::piped())
        .stdout(out)
        .spawn()
        .context("cannot start cpio")?;
    let list: String = entries.iter().map(|e| format!("{e}\n")).collect();
    child
        .stdin
        .take()
        .context("no stdin pipe to cpio")?
        .write_all(list.as_bytes())
        .context("writing the file list to cpio")?;
    let status = child.wait().context("waiting for cpio")?;
    if !status.success() {
        bail!("cpio failed ({status})");
    }
    fs::rename(&partial, cpio).with_context(|| format!("renaming {}", partial.display()))
}

/// Paths relative to `base`, directories before their contents.
fn collect(base: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry.context("reading a directory entry")?.path();
        let relative = path.strip_prefix(base).context("path outside the staging folder")?;
        out.push(relative.display().to_string());
        if path.is_dir() {
            collect(base, &path, out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn show_depends_lines() {
        let out = "insmod /k/lib/modules/6.12/kernel/fs/netfs/netfs.ko.xz \ninsmod /k/lib/modules/6.12/kernel/drivers/net/dummy.ko.xz numdummies=0 \nbuiltin virtio_pci\n";
        assert_eq!(
            parse_show_depends(out),
            [
                ("/k/lib/modules/6.12/kernel/fs/netfs/netfs.ko.xz", ""),
                ("/k/lib/modules/6.12/kernel/drivers/net/dummy.ko.xz", "numdummies=0"),
            ]
        );
        assert_eq!(
            strip_compression(Path::new("kernel/a/b.ko.xz")),
            Path::new("kernel/a/b.ko")
        );
        assert_eq!(
            strip_compression(Path::new("kernel/a/b.ko")),
            Path::new("kernel/a/b.ko")
        );
    }

    #[test]
    fn init_reports_every_way() {
        assert!(INIT.starts_with("#!/bin/busybox sh\n"));
        for needle in [
            "rig: ready",
            "rig: done rc=",
            "/rig/rc",
            "seek=244",
            "rdma link add rxe0",
        ] {
            assert!(INIT.contains(needle), "{needle}");
        }
    }
}
