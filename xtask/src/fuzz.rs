//! `cargo xtask fuzz`: the coverage-guided fuzz targets of `fuzz/` (libFuzzer through `libfuzzer-sys`),
//! built and run on the stable toolchain.
//!
//! What cargo-fuzz would do, without installing it: build `fuzz/` in release mode with the
//! SanitizerCoverage instrumentation libFuzzer steers by (`-Cpasses=sancov-module` and its LLVM
//! options are stable flags) plus debug assertions and overflow checks, then run each target on its
//! corpus for a bounded time. No AddressSanitizer (that needs `-Z`): the targets are safe Rust over
//! the decoder and the state machines, and what is looked for is a panic or a broken invariant.
//!
//! The corpus in `fuzz/corpus/TARGET` is the repository's; new inputs a run finds go to a folder
//! under the target directory, so a run leaves the repository as it was. A crash is written to
//! `target/fuzz/artifacts/TARGET/` and fails the run; it becomes a regression test in
//! `fuzz/corpus/TARGET` (replayed by every run) once fixed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, cargo_metadata, run_step, target_dir, workspace_root};

/// The fuzz targets, as `fuzz/Cargo.toml` names them.
pub const TARGETS: &[&str] = &["frame_decoder", "handshake", "protocol", "transport_bytes", "records"];

#[derive(clap::Args)]
pub struct Args {
    /// How long each target runs, in seconds.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Only this target (frame_decoder, handshake, protocol, transport_bytes).
    #[arg(long)]
    target: Option<String>,
}

const SANCOV: &str = "-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks";

pub fn run(args: &Args) -> Result<()> {
    let targets: Vec<&str> = match &args.target {
        Some(t) if TARGETS.contains(&t.as_str()) => vec![t.as_str()],
        Some(t) => bail!("no fuzz target {t:?}; the targets are {}", TARGETS.join(", ")),
        None => TARGETS.to_vec(),
    };
    fuzz(&targets, Duration::from_secs(args.seconds))
}

/// Builds the targets and runs each for `each`.
pub fn fuzz(targets: &[&str], each: Duration) -> Result<()> {
    let fuzz_dir = workspace_root().join("fuzz");
    // A target folder of its own: the instrumented build must not invalidate the normal one.
    let target_dir = target_dir(&cargo_metadata()?)?.join("fuzz");
    run_step(
        cargo()
            .args(["build", "--release", "--manifest-path"])
            .arg(fuzz_dir.join("Cargo.toml"))
            .args(["--target", "x86_64-unknown-linux-gnu"])
            .env("RUSTFLAGS", SANCOV)
            .env("CARGO_TARGET_DIR", &target_dir),
        Duration::from_secs(30 * 60),
    )
    .context("building the fuzz targets")?;
    let bin_dir = target_dir.join("x86_64-unknown-linux-gnu").join("release");
    for target in targets {
        run_target(&bin_dir.join(target), &fuzz_dir, &target_dir, target, each)?;
    }
    Ok(())
}

fn run_target(bin: &Path, fuzz_dir: &Path, target_dir: &Path, target: &str, each: Duration) -> Result<()> {
    let corpus = fuzz_dir.join("corpus").join(target);
    let found = target_dir.join("corpus").join(target);
    let artifacts: PathBuf = target_dir.join("artifacts").join(target);
    for dir in [&found, &artifacts] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    eprintln!("fuzzing {target} for {} s", each.as_secs());
    // New inputs go into the first folder (outside the repository); the repository's corpus is read.
    let mut cmd = Command::new(bin);
    cmd.arg(&found)
        .arg(&corpus)
        .arg(format!("-max_total_time={}", each.as_secs()))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg("-max_len=65536")
        .arg("-print_final_stats=1");
    run_step(&mut cmd, each + Duration::from_secs(120))
        .with_context(|| format!("fuzz target {target} found a crash: see {}", artifacts.display()))
}
