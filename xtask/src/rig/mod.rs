//! `cargo xtask rig`: real RDMA verbs without an RDMA NIC, inside a small qemu guest.
//!
//! Why a guest: the host kernel has no RDMA modules (and CI cannot load any), but a Debian kernel
//! package booted under qemu runs the kernel's own Soft-RoCE driver, `rdma_rxe`, so the verbs stack
//! that ferry talks to is the real one: rdma-core, the rxe provider, the kernel's QP state machine.
//! Only the wire is missing (rxe on one device loops back internally).
//!
//! Why the guest sees the host's root file system (read-only, over 9p): test binaries built on the
//! host, Debian's rdma-core and perftest, `ip` and `rdma` then run in the guest unchanged, with no list
//! of libraries to copy and keep in step. A second, writable 9p share (a fresh `target/rig/run-*`
//! folder, mounted at the same path in the guest) carries the command script in and the results out.
//!
//! - `rig build`: host packages, kernel, initramfs, cached under `target/rig/` (see [`kernel`], [`image`]).
//! - `rig -- CMD…`: one boot that runs CMD and exits with its status (see [`boot`]).
//! - `rig test`: the `ferry-rdma` integration tests in one boot (see [`test`](mod@test)).
//! - `rig bench`: perftest and `ferry bench` side by side in one boot (see [`bench`](mod@bench)).
//! - `rig powercut`: persistent writes against a simulated power cut (see [`powercut`]).
//!
//! Every phase prints how long it took, so a CI log shows where its 90 minutes went.

mod bench;
mod boot;
pub mod chaos;
mod host;
mod image;
mod kernel;
mod pmem;
mod powercut;
mod test;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::util::{parse_duration, workspace_root};

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    action: Option<Action>,
    /// Wall-clock limit for one guest boot (e.g. 20m, 90s); qemu is killed when it is reached.
    #[arg(long, default_value = "20m", global = true)]
    timeout: String,
    /// Keep the run folder (`target/rig/run-*`: command script, logs, results) even on success.
    #[arg(long, global = true)]
    keep: bool,
    /// The command to run in the guest, after `--` (e.g. `-- ibv_devinfo -d rxe0`).
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(clap::Subcommand)]
enum Action {
    /// Prepare (and cache under target/rig/) the host packages, kernel and initramfs the guest needs.
    Build(BuildArgs),
    /// Build the ferry-rdma integration tests on the host and run them all inside one guest boot.
    Test(test::Args),
    /// ib_write_bw/ib_read_bw and `ferry bench --transport rdma` side by side in one guest boot.
    Bench(bench::Args),
    /// Simulated power cuts: persistent writes must survive qemu being killed, unflushed ones need not.
    Powercut(powercut::Args),
}

#[derive(clap::Args)]
struct BuildArgs {
    /// Look the kernel package up again instead of using the cached name (package versions move).
    #[arg(long)]
    refresh: bool,
}

/// Where everything the rig caches lives: `<target dir>/rig`.
pub struct Layout {
    pub dir: PathBuf,
}

impl Layout {
    fn new() -> Self {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace_root().join("target"));
        Self {
            dir: target.join("rig"),
        }
    }
}

/// Wall-clock time of each phase, printed as it ends and summed up at the end.
#[derive(Default)]
pub struct Timings {
    phases: Vec<(String, Duration, &'static str)>,
}

impl Timings {
    /// Records (and prints) a phase that began at `start`; `note` is e.g. "cached".
    pub fn record(&mut self, name: &str, start: Instant, note: &'static str) {
        let took = start.elapsed();
        let suffix = if note.is_empty() {
            String::new()
        } else {
            format!(" ({note})")
        };
        eprintln!("rig: {name}: {:.1}s{suffix}", took.as_secs_f64());
        self.phases.push((name.to_owned(), took, note));
    }

    /// Records a phase measured elsewhere (the guest's boot and command, seen on its console).
    pub fn add(&mut self, name: &str, took: Duration) {
        self.phases.push((name.to_owned(), took, ""));
    }

    /// One line for the log: `rig: timings: kernel 0.0s (cached), image 0.1s, boot 3.1s, ...`.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self
            .phases
            .iter()
            .map(|(name, took, note)| {
                let note = if note.is_empty() {
                    String::new()
                } else {
                    format!(" ({note})")
                };
                format!("{name} {:.1}s{note}", took.as_secs_f64())
            })
            .collect();
        let total: Duration = self.phases.iter().map(|p| p.1).sum();
        format!("rig: timings: {}; total {:.1}s", parts.join(", "), total.as_secs_f64())
    }
}

/// What a boot needs: the kernel to boot and the initramfs that brings rxe0 up.
pub struct Prepared {
    pub kernel: kernel::Kernel,
    pub initramfs: PathBuf,
}

/// Everything `rig build` does; the other subcommands start with it (fast when cached).
fn prepare(layout: &Layout, refresh: bool, timings: &mut Timings) -> Result<Prepared> {
    let start = Instant::now();
    host::ensure_packages()?;
    timings.record("host packages", start, "");
    std::fs::create_dir_all(&layout.dir).with_context(|| format!("creating {}", layout.dir.display()))?;
    prune_old_runs(layout);
    let kernel = kernel::prepare(layout, refresh, timings)?;
    let initramfs = image::prepare(layout, &kernel, timings)?;
    Ok(Prepared { kernel, initramfs })
}

/// Removes run folders (kept after failures) older than a day; younger ones may belong to a boot that
/// another shell has running right now, or to a failure someone is still reading.
fn prune_old_runs(layout: &Layout) {
    let Ok(entries) = std::fs::read_dir(&layout.dir) else {
        return;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > Duration::from_secs(24 * 3600)));
        if old && entry.file_name().to_string_lossy().starts_with("run-") {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

pub fn run(args: &Args) -> Result<ExitCode> {
    let layout = Layout::new();
    let timeout = parse_duration(&args.timeout)?;
    let mut timings = Timings::default();
    let result = match &args.action {
        Some(Action::Build(build)) => {
            let prepared = prepare(&layout, build.refresh, &mut timings)?;
            eprintln!(
                "rig: ready: kernel {} ({}), {}, initramfs {}",
                prepared.kernel.package,
                prepared.kernel.release,
                prepared.kernel.boot_image().display(),
                prepared.initramfs.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        None if args.command.is_empty() => {
            bail!(
                "nothing to do: give `build`, `test`, `bench`, `powercut`, or a command after `--` \
                 (cargo xtask rig -- CMD…)"
            )
        }
        Some(Action::Test(a)) => with_guest(&layout, timeout, args.keep, &mut timings, |g, t| test::run(a, g, t)),
        Some(Action::Bench(a)) => with_guest(&layout, timeout, args.keep, &mut timings, |g, t| bench::run(a, g, t)),
        Some(Action::Powercut(a)) => {
            with_guest(&layout, timeout, args.keep, &mut timings, |g, t| powercut::run(a, g, t))
        }
        None => with_guest(&layout, timeout, args.keep, &mut timings, |g, t| {
            run_command(&args.command, g, t)
        }),
    };
    eprintln!("{}", timings.summary());
    result
}

/// `rig -- CMD…`: one boot, CMD's output on our stdout, CMD's exit status as ours.
/// Prepares the guest (cached) and runs `f` with it.
fn with_guest(
    layout: &Layout,
    timeout: Duration,
    keep: bool,
    timings: &mut Timings,
    f: impl FnOnce(&boot::Guest<'_>, &mut Timings) -> Result<ExitCode>,
) -> Result<ExitCode> {
    let prepared = prepare(layout, false, timings)?;
    f(&boot::Guest::new(&prepared, layout, timeout, keep), timings)
}

/// `cargo xtask chaos`: one boot of the guest for `ferry-chaos run`.
pub fn chaos(args: &chaos::Args, timeout: Duration) -> Result<ExitCode> {
    let layout = Layout::new();
    let mut timings = Timings::default();
    let result = with_guest(&layout, timeout, false, &mut timings, |g, t| chaos::run(args, g, t));
    eprintln!("{}", timings.summary());
    result
}

fn run_command(command: &[String], guest: &boot::Guest<'_>, timings: &mut Timings) -> Result<ExitCode> {
    let script = boot::shell_words(command);
    let guest = boot::Guest {
        console: boot::Console::Stdout,
        ..guest.clone()
    };
    let outcome = guest.run(&script, &[])?;
    outcome.record(timings);
    let rc = outcome.command_status()?;
    if rc != 0 {
        eprintln!("rig: the command exited with status {rc}");
    }
    Ok(ExitCode::from(u8::try_from(rc).unwrap_or(1)))
}
