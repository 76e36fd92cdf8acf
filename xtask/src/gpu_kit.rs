//! `cargo xtask gpu-kit`: what a machine with an NVIDIA GPU needs to run ferry's GPU checks, built
//! here, because such a machine may have no Rust toolchain: the `ferry` binary, the CUDA test
//! programs (ferry-cuda's `gpu` tests and ferry-cli's two-process `cuda` tests), ferry-cuda's
//! `copy_bandwidth` example, all stripped, and `run.sh`, which runs them as one script with
//! `FERRY_REQUIRE_CUDA=1` (a missing device fails) and prints the bench figures and their ratios, and
//! the host memory a server of 8 GiB of CUDA memory holds after transfers over TCP.
//!
//! Carry the folder there and run `bash target/gpu-kit/run.sh`; what it writes goes to `$OUT` (or
//! `out/` beside it).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use crate::util::{cargo, run_captured, run_step};

#[derive(clap::Args)]
pub struct Args {
    /// Where to put the kit [default: target/gpu-kit].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

const BUILD_LIMIT: Duration = Duration::from_secs(45 * 60);

pub fn run(args: &Args) -> Result<()> {
    let metadata = crate::util::cargo_metadata()?;
    let target = crate::util::target_dir(&metadata)?;
    let kit = args.out.clone().unwrap_or_else(|| target.join("gpu-kit"));
    if kit.exists() {
        std::fs::remove_dir_all(&kit).with_context(|| format!("emptying {}", kit.display()))?;
    }
    std::fs::create_dir_all(&kit).with_context(|| format!("creating {}", kit.display()))?;

    run_step(cargo().args(["build", "--release", "-p", "ferry-cli"]), BUILD_LIMIT)?;
    run_step(
        cargo().args(["build", "--release", "-p", "ferry-cuda", "--example", "copy_bandwidth"]),
        BUILD_LIMIT,
    )?;
    let release = target.join("release");
    place(&release.join("ferry"), &kit.join("ferry"))?;
    place(
        &release.join("examples").join("copy_bandwidth"),
        &kit.join("copy_bandwidth"),
    )?;
    place(&test_program("ferry-cuda", "gpu")?, &kit.join("gpu-tests"))?;
    place(&test_program("ferry-cli", "cuda")?, &kit.join("cuda-processes-tests"))?;
    let script = kit.join("run.sh");
    std::fs::write(&script, RUN_SH).with_context(|| format!("writing {}", script.display()))?;
    let bytes: u64 = std::fs::read_dir(&kit)?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    eprintln!(
        "xtask gpu-kit: {} ({} MiB); on the GPU machine: bash {}/run.sh",
        kit.display(),
        bytes >> 20,
        kit.strip_prefix(crate::util::workspace_root())
            .unwrap_or(&kit)
            .display()
    );
    Ok(())
}

/// Builds `package`'s integration test `test` in release mode and returns its program's path.
fn test_program(package: &str, test: &str) -> Result<PathBuf> {
    let mut cmd = cargo();
    cmd.args([
        "test",
        "--release",
        "-p",
        package,
        "--test",
        test,
        "--no-run",
        "--message-format=json",
    ]);
    let out = run_captured(&mut cmd, BUILD_LIMIT)?;
    if !out.status.success() {
        bail!("building {package}'s test {test} failed: {}", out.combined());
    }
    executable_of(&out.stdout, test).ok_or_else(|| anyhow!("cargo named no program for {package}'s test {test}"))
}

/// The program of test target `name` in cargo's JSON messages.
fn executable_of(messages: &str, name: &str) -> Option<PathBuf> {
    messages
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
}

/// Copies `from` to `to` and strips it (the kit travels within a size limit).
fn place(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    let status = Command::new("strip")
        .arg(to)
        .status()
        .context("running strip (binutils)")?;
    if !status.success() {
        bail!("strip {} failed ({status})", to.display());
    }
    Ok(())
}

/// The kit's script (see the module's documentation).
const RUN_SH: &str = r#"#!/bin/bash
# ferry's GPU checks, made by `cargo xtask gpu-kit`: CUDA tests (FERRY_REQUIRE_CUDA=1: a missing
# device fails), the two-process tests, and the CUDA bench figures with their ratios.
set -u
kit=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$kit/out}
mkdir -p "$out"
export FERRY_REQUIRE_CUDA=1 FERRY_BIN="$kit/ferry" RUST_BACKTRACE=1
failed=()
step() {
    echo "== $*"
    "$@" 2>&1 | tee -a "$out/log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then echo "FAILED ($rc): $*"; failed+=("$1"); fi
}
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,memory.total --format=csv 2>&1 | tee "$out/gpu"
lsmod 2>/dev/null | grep -E '^(nvidia_peermem|nv_peer_mem|ib_core)' | tee -a "$out/gpu"
step "$kit/ferry" info
step "$kit/gpu-tests" --test-threads=1 --nocapture
step "$kit/cuda-processes-tests" --test-threads=1 --nocapture
errors="$out/bench-errors"
bench() { "$kit/ferry" bench --op "$1" --size 1MiB --batch 1 --duration 3s --json "${@:2}" 2>>"$errors" | tail -1; }
{
    echo "host_write $(bench write)"
    echo "cuda_write $(bench write --target-mem cuda)"
    echo "cuda_read $(bench read --target-mem cuda)"
    # The initiator's own CUDA memory over TCP, through its link's buffers, beside host memory.
    echo "host_write_tcp $(bench write --transport tcp)"
    echo "local_cuda_write $(bench write --transport tcp --local-mem cuda)"
    echo "local_cuda_read $(bench read --transport tcp --local-mem cuda)"
    port=$((20000 + RANDOM % 20000))
    "$kit/ferry" serve --listen 127.0.0.1:$port --region-size 512MiB --mem cuda >"$out/serve.log" 2>&1 &
    serve=$!
    for _ in $(seq 50); do grep -q listening "$out/serve.log" && break; kill -0 $serve 2>/dev/null || break; sleep 0.2; done
    echo "gpu_to_gpu $(bench write --transport shm --local-mem cuda --peer 127.0.0.1:$port)"
    kill $serve 2>/dev/null; wait $serve 2>/dev/null
    echo "device_copy $("$kit/copy_bandwidth" 1048576 3 2>>"$errors")"
    # What serving GPU memory over TCP costs in host memory: an 8 GiB CUDA region, 16 MiB writes and
    # reads into it, then the server's resident set (its transfers go through bounded buffers).
    port=$((20000 + RANDOM % 20000))
    "$kit/ferry" serve --listen 127.0.0.1:$port --region-size 8GiB --mem cuda >"$out/serve-8g.log" 2>&1 &
    serve=$!
    for _ in $(seq 100); do grep -q listening "$out/serve-8g.log" && break; kill -0 $serve 2>/dev/null || break; sleep 0.2; done
    for op in write read; do
        "$kit/ferry" bench --op $op --size 16MiB --batch 4 --duration 3s --transport tcp \
            --peer 127.0.0.1:$port --json 2>>"$errors" | tail -1 | sed "s/^/served_$op /"
    done
    echo "served_rss {\"kib\": $(awk '/^VmRSS/ {print $2}' /proc/$serve/status 2>/dev/null || echo null)}"
    kill $serve 2>/dev/null; wait $serve 2>/dev/null
} | tee "$out/bench"
cat "$errors" 2>/dev/null
python3 - "$out/bench" <<'PY' | tee "$out/ratios"
import json, sys
gb = {}
for line in open(sys.argv[1]):
    name, _, rest = line.partition(" ")
    if name == "served_rss":
        continue
    try:
        gb[name] = json.loads(rest)["gb_per_s"]
    except (ValueError, KeyError):
        print(f"{name}: no figure (see bench-errors)")
for name in ("served_write", "served_read"):
    if name in gb:
        print(f"{name}: 16 MiB transfers with a server of an 8 GiB CUDA region, over TCP: {gb[name]:.2f} GB/s")
def ratio(row, a, b, target):
    if a in gb and b in gb and gb[b] > 0:
        r = gb[a] / gb[b]
        print(f"{row}: {a} {gb[a]:.2f} / {b} {gb[b]:.2f} GB/s = {r:.2f} (target >= {target}) {'ok' if r >= target else 'MISSED'}")
ratio("cu", "cuda_write", "host_write", 0.8)
ratio("cu2", "cuda_read", "cuda_write", 0.8)
ratio("cu3", "gpu_to_gpu", "device_copy", 0.8)
ratio("cu4", "local_cuda_write", "host_write_tcp", 0.8)
ratio("cu5", "local_cuda_read", "local_cuda_write", 0.8)
try:
    kib = json.loads(next(l for l in open(sys.argv[1]) if l.startswith("served_rss ")).split(" ", 1)[1])["kib"]
    mib = kib / 1024
    print(f"host memory of a server of 8 GiB of CUDA memory over TCP: {mib:.0f} MiB resident "
          f"(bounded: < 1024) {'ok' if mib < 1024 else 'MISSED'}")
except (StopIteration, ValueError, KeyError, TypeError):
    print("served_rss: no figure (see bench-errors)")
PY
if [ ${#failed[@]} -gt 0 ]; then echo "failed: ${failed[*]}"; exit 1; fi
echo "all GPU checks passed"
"#;

#[cfg(test)]
mod tests {
    use super::*;

    /// The script is only run on a GPU machine, where a syntax error would cost its whole turn:
    /// `bash -n` reads it here.
    #[test]
    fn the_script_parses() {
        let dir = std::env::temp_dir().join(format!("ferry-gpu-kit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("run.sh");
        std::fs::write(&script, RUN_SH).unwrap();
        let checked = Command::new("bash").arg("-n").arg(&script).output().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            checked.status.success(),
            "bash -n: {}",
            String::from_utf8_lossy(&checked.stderr)
        );
    }

    #[test]
    fn the_test_program_is_read_from_cargos_messages() {
        let messages = r#"{"reason":"compiler-artifact","target":{"name":"ferry_cuda"},"executable":null}
{"reason":"compiler-artifact","target":{"name":"gpu"},"executable":"/t/release/deps/gpu-0123"}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            executable_of(messages, "gpu"),
            Some(PathBuf::from("/t/release/deps/gpu-0123"))
        );
        assert_eq!(executable_of(messages, "cuda"), None);
    }
}
