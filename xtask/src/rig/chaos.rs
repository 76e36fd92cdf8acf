//! `cargo xtask chaos`: `ferry-chaos run` (a fleet of engines in network namespaces, a real etcd,
//! faults, invariants) in one boot of the rig's guest, whose kernel has the netem qdisc, the bridge
//! and the `prio`/`u32` classifier that the faults need (a host kernel may lack them). The summary
//! (`summary.json`), the timeline (`timeline.svg`), every member's events and logs are copied to
//! `target/chaos/<profile>-<seed>/`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::Timings;
use super::boot::{Console, Devices, Guest, sh_quote};
use crate::util::{cargo, cargo_metadata, run_step, target_dir};

#[derive(clap::Args)]
pub struct Args {
    /// `short`: each kind of fault once (about 2.5 minutes, what `cargo xtask test` runs); `long`:
    /// faults drawn at random for --duration.
    #[arg(long, default_value = "short")]
    profile: String,
    /// The schedule's seed [default: from the clock]; the same seed replays the same faults.
    #[arg(long)]
    seed: Option<u64>,
    /// The length of a long run.
    #[arg(long, default_value = "15m")]
    duration: String,
    /// Engines in the fleet.
    #[arg(long, default_value_t = 8)]
    engines: usize,
}

impl Args {
    /// How long the run itself lasts, about.
    pub fn budget(&self) -> Duration {
        match self.profile.as_str() {
            "long" => crate::util::parse_duration(&self.duration).unwrap_or(Duration::from_secs(900)),
            _ => Duration::from_secs(180),
        }
    }
}

/// What the run needs on the host (the guest runs the host's programs): etcd, and protoc to build
/// ferry-etcd.
const PACKAGES: &[(&str, &str)] = &[
    ("etcd", "etcd-server"),
    ("protoc", "protobuf-compiler"),
    ("/usr/include/google/protobuf/descriptor.proto", "libprotobuf-dev"),
    ("ip", "iproute2"),
    ("tc", "iproute2"),
];

/// The guest's memory: eight engines with 32 MiB regions each, etcd, and the conductor's record of
/// every event.
const GUEST_MEMORY_GIB: u64 = 3;

pub fn run(args: &Args, guest: &Guest<'_>, timings: &mut Timings) -> Result<ExitCode> {
    let start = Instant::now();
    crate::util::ensure_debian_packages(PACKAGES)?;
    run_step(
        cargo().args(["build", "--release", "-p", "ferry-chaos"]),
        Duration::from_secs(45 * 60),
    )?;
    let target = target_dir(&cargo_metadata()?)?;
    let exe = target.join("release/ferry-chaos");
    timings.record("build ferry-chaos", start, "");
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs() % 1_000_000)
    });
    let script = format!(
        "{} run --profile {} --seed {seed} --duration {} --engines {} --out \"$RIG_DIR/chaos\"",
        sh_quote(&exe.display().to_string()),
        sh_quote(&args.profile),
        sh_quote(&args.duration),
        args.engines
    );
    let guest = Guest {
        console: Console::Stdout,
        ..guest.with_devices(Devices {
            memory_gib: Some(GUEST_MEMORY_GIB),
            ..Default::default()
        })
    };
    let outcome = guest.run(&script, &[("RUST_BACKTRACE", "1")])?;
    outcome.record(timings);
    let kept = target.join("chaos").join(format!("{}-{seed}", args.profile));
    let copied = copy_dir(&outcome.run_dir.join("chaos"), &kept);
    let rc = outcome.command_status()?;
    match copied {
        Ok(()) => eprintln!("chaos: results in {}", kept.display()),
        Err(e) => eprintln!("chaos: could not copy the results out: {e:#}"),
    }
    if rc != 0 {
        eprintln!(
            "chaos: failed (replay: cargo xtask chaos --profile {} --seed {seed})",
            args.profile
        );
    }
    Ok(ExitCode::from(u8::try_from(rc).unwrap_or(1)))
}

fn copy_dir(from: &Path, to: &PathBuf) -> Result<()> {
    if to.exists() {
        std::fs::remove_dir_all(to).with_context(|| format!("clearing {}", to.display()))?;
    }
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let dest = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            // etcd's data folder is of no use outside the run.
            if entry.file_name() != "etcd-data" {
                copy_dir(&entry.path(), &dest)?;
            }
        } else {
            std::fs::copy(entry.path(), &dest).with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}
