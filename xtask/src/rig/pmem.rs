//! What the persistence tests add to the rig: rdma-core 55 (so that FLUSH can be posted) and an
//! emulated NVDIMM turned into device DAX (so that a persistent FLUSH has persistent memory to land in).
//!
//! Why rdma-core 55 from source, in its own folder: Debian bookworm ships rdma-core 44, whose
//! `libibverbs` has no `ibv_wr_flush`. The registry crate `ibverbs-sys` carries the rdma-core 55
//! sources; only `libibverbs` and the rxe provider are built, into `target/rig/rdma-core-55/`, and a
//! guest command loads them with `LD_LIBRARY_PATH` and `RDMAV_DRIVERS`. They are never installed
//! beside Debian's: the two share a soname and provider ABI, but `struct ibv_qp_ex` grew between
//! them, and a mixed pair crashes.
//!
//! Why device DAX: on the emulated NVDIMM an RDMA memory region registers with the FLUSH access flags
//! only as device DAX (`/dev/dax0.0`), and the bytes of a persistent FLUSH then appear in the host's
//! backing file, which is what the host checks.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::{Layout, Timings};
use crate::util::{run_captured, run_step};

/// The crate that carries the sources, its download address and its SHA-256 (from the crates.io index).
const CRATE: &str = "ibverbs-sys-0.3.2+55.0";
const CRATE_URL: &str = "https://static.crates.io/crates/ibverbs-sys/ibverbs-sys-0.3.2%2B55.0.crate";
const CRATE_SHA256: &str = "8149ab8d940ea7e7073a24ba6e3ec6b0cc8ceab6ea3d562d60a21ca5cc23413a";

/// The rdma-core 55 libraries the guest loads for FLUSH.
pub struct RdmaCore55 {
    pub lib_dir: PathBuf,
}

impl RdmaCore55 {
    /// The environment that makes a guest command use these libraries instead of Debian's.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LD_LIBRARY_PATH", self.lib_dir.display().to_string()),
            // libibverbs appends "-rdmav34.so" to each name it is given.
            ("RDMAV_DRIVERS", self.lib_dir.join("librxe").display().to_string()),
        ]
    }
}

/// Builds (once; cached under `target/rig/rdma-core-55/`) `libibverbs` and the rxe provider of
/// rdma-core 55.
pub fn rdma_core_55(layout: &Layout, timings: &mut Timings) -> Result<RdmaCore55> {
    let start = Instant::now();
    let root = layout.dir.join("rdma-core-55");
    let build = root.join("build");
    let lib_dir = build.join("lib");
    let stamp = root.join("built");
    let built = |lib: &Path| lib.join("libibverbs.so.1").exists() && lib.join("librxe-rdmav34.so").exists();
    if stamp.exists() && built(&lib_dir) {
        timings.record("rdma-core 55", start, "cached");
        return Ok(RdmaCore55 { lib_dir });
    }
    fs::create_dir_all(&build).with_context(|| format!("creating {}", build.display()))?;
    let archive = root.join(format!("{CRATE}.crate"));
    if sha256(&archive).ok().as_deref() != Some(CRATE_SHA256) {
        run_step(
            Command::new("curl")
                .args(["-fsSL", "--retry", "3", "-o"])
                .arg(&archive)
                .arg(CRATE_URL),
            Duration::from_secs(10 * 60),
        )
        .context("downloading the rdma-core 55 sources (the ibverbs-sys crate)")?;
        let got = sha256(&archive)?;
        if got != CRATE_SHA256 {
            bail!("{} has SHA-256 {got}, expected {CRATE_SHA256}", archive.display());
        }
    }
    run_step(
        Command::new("tar").arg("xzf").arg(&archive).arg("-C").arg(&root),
        Duration::from_secs(300),
    )?;
    let source = root.join(CRATE).join("vendor/rdma-core");
    run_step(
        Command::new("cmake")
            .current_dir(&build)
            .args([
                "-GNinja",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DNO_MAN_PAGES=1",
                "-DNO_PYVERBS=1",
            ])
            .args(["-DENABLE_VALGRIND=0", "-DENABLE_STATIC=0"])
            .arg(format!("-DCMAKE_INSTALL_PREFIX={}", root.join("prefix").display()))
            .arg(&source),
        Duration::from_secs(10 * 60),
    )
    .context("configuring rdma-core 55 (needs cmake, ninja-build, gcc, pkg-config, libnl-3-dev, libnl-route-3-dev)")?;
    run_step(
        Command::new("ninja")
            .current_dir(&build)
            .args(["lib/libibverbs.so.1", "lib/librxe-rdmav34.so"]),
        Duration::from_secs(20 * 60),
    )
    .context("building libibverbs and the rxe provider of rdma-core 55")?;
    if !built(&lib_dir) {
        bail!(
            "the rdma-core 55 build left no libibverbs.so.1 and librxe-rdmav34.so in {}",
            lib_dir.display()
        );
    }
    // The configuration folder compiled in: empty (drivers come from RDMAV_DRIVERS), but present, so
    // that libibverbs does not warn about it on every start.
    let config = root.join("prefix/etc/libibverbs.d");
    fs::create_dir_all(&config).with_context(|| format!("creating {}", config.display()))?;
    fs::write(&stamp, CRATE).with_context(|| format!("writing {}", stamp.display()))?;
    timings.record("rdma-core 55", start, "");
    Ok(RdmaCore55 { lib_dir })
}

fn sha256(path: &Path) -> Result<String> {
    let out = run_captured(Command::new("sha256sum").arg(path), Duration::from_secs(120))?;
    if !out.status.success() {
        bail!("sha256sum {}: {}", path.display(), out.stderr.trim());
    }
    Ok(out.stdout.split_whitespace().next().unwrap_or_default().to_owned())
}

/// Size of the emulated NVDIMM: room for the device-DAX metadata and a few 2 MiB pages.
pub const NVDIMM_BYTES: u64 = 128 << 20;

/// Creates the NVDIMM's backing file (sparse) in `dir`.
pub fn nvdimm_image(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("pmem.img");
    let f = fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    f.set_len(NVDIMM_BYTES)
        .with_context(|| format!("sizing {}", path.display()))?;
    Ok(path)
}

/// Shell text for the guest: turns the NVDIMM's namespace into device DAX and waits for `/dev/dax0.0`
/// (with sysfs alone; `ndctl` is not needed). Without `mode=pmem` the bind fails with ENXIO.
pub const DEVDAX_SETUP: &str = r#"setup_devdax() {
  nd=/sys/bus/nd/devices
  ns=$(cd $nd && ls -d namespace*.* 2>/dev/null | head -n 1)
  [ -n "$ns" ] || { echo "rig: no NVDIMM namespace under $nd"; return 1; }
  [ -e /sys/bus/nd/drivers/nd_pmem/$ns ] && echo "$ns" > /sys/bus/nd/drivers/nd_pmem/unbind
  seed=$(cat $nd/region0/dax_seed)
  cat /proc/sys/kernel/random/uuid > $nd/$seed/uuid
  echo pmem > $nd/$seed/mode
  echo 2097152 > $nd/$seed/align
  echo "$ns" > $nd/$seed/namespace
  echo "$seed" > /sys/bus/nd/drivers/dax_pmem/bind
  i=0
  while [ ! -c /dev/dax0.0 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  [ -c /dev/dax0.0 ] || { echo "rig: /dev/dax0.0 did not appear"; return 1; }
  echo "rig: /dev/dax0.0 ready ($(cat /sys/bus/dax/devices/dax0.0/size) bytes)"
}
"#;

/// Whether `needle` occurs in the file at `path` (read in chunks that overlap by the needle's length).
pub fn file_contains(path: &Path, needle: &[u8]) -> Result<bool> {
    if needle.is_empty() {
        return Ok(true);
    }
    let mut f = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut window: Vec<u8> = Vec::with_capacity((8 << 20) + needle.len());
    let mut chunk = vec![0u8; 8 << 20];
    loop {
        let n = f
            .read(&mut chunk)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            return Ok(false);
        }
        window.extend_from_slice(&chunk[..n]);
        if window.windows(needle.len()).any(|w| w == needle) {
            return Ok(true);
        }
        let keep = needle.len() - 1;
        let cut = window.len().saturating_sub(keep);
        window.drain(..cut);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_needles_across_chunk_edges() {
        let dir = std::env::temp_dir().join(format!("xtask-pmem-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("img");
        let mut data = vec![0u8; (8 << 20) + 100];
        data[(8 << 20) - 3..(8 << 20) + 3].copy_from_slice(b"MARKER");
        fs::write(&path, &data).unwrap();
        assert!(file_contains(&path, b"MARKER").unwrap());
        assert!(!file_contains(&path, b"MARKEX").unwrap());
        fs::remove_dir_all(&dir).unwrap();
    }
}
