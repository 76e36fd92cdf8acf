//! `cargo xtask`: the workspace's dev tool (the alias lives in `.cargo/config.toml`).
//!
//! - `cargo xtask test` runs everything CI runs, in CI's order, and stops at the first failure.
//! - `cargo xtask bench` runs `ferry bench` side by side with the peers a user would pick instead
//!   (iperf3, ucx_perftest, sockperf) in one run and prints medians and ratios.
//! - `cargo xtask rig` boots a small qemu guest with Soft-RoCE (`rdma_rxe`) for real RDMA verbs without
//!   an RDMA NIC: `rig build`, `rig -- CMD…`, `rig test`, `rig bench`.
//!
//! Why Rust and not shell scripts: the same toolchain runs it everywhere (CI, a laptop, the bench
//! host), and the parts that are easy to get wrong in shell (timeouts on every process, killing peer
//! servers on every exit path, parsing the peers' output) are ordinary code with unit tests.

mod bench;
mod capi;
mod fuzz;
mod gpu_kit;
mod hostile;
mod peers;
mod python;
mod rig;
mod test;
mod util;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Dev tasks for the ferry workspace")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run everything CI runs (prerequisites, fmt, clippy, deny, tests, example), stopping at the first failure.
    Test(test::Args),
    /// Benchmark ferry against iperf3, ucx_perftest and sockperf in one run and print ratios.
    Bench(bench::Args),
    /// RDMA test rig: a qemu guest with Soft-RoCE (rxe0). `rig build`, `rig -- CMD…`, `rig test`, `rig bench`.
    Rig(rig::Args),
    /// Coverage-guided fuzzing of the frame decoder, the handshake and the protocol state machines.
    Fuzz(fuzz::Args),
    /// An authenticated `ferry serve` under thousands of silent, garbage and reopened connections: an
    /// authenticated peer's connect time, its throughput against a run before, the target's memory.
    Hostile(hostile::Args),
    /// A fleet of engines (separate processes in network namespaces, a real etcd) pulling KV batches
    /// under faults: kills, hangs, netem delay and loss, partitions, etcd restarts; fails when an
    /// invariant breaks. Runs in the RDMA rig's guest, whose kernel has netem.
    Chaos(ChaosArgs),
    /// Builds what a machine with an NVIDIA GPU and no Rust needs to run ferry's GPU checks (the
    /// CUDA tests, two-process included, and the CUDA bench figures), stripped, with `run.sh`, into
    /// one folder to carry there.
    GpuKit(gpu_kit::Args),
}

#[derive(clap::Args)]
struct ChaosArgs {
    #[command(flatten)]
    chaos: rig::chaos::Args,
    /// Wall-clock limit for the guest (qemu is killed when it is reached) [default: the run's length
    /// and 10 minutes].
    #[arg(long)]
    timeout: Option<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Test(args) => test::run(&args),
        Command::Bench(args) => match bench::run(&args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("xtask bench: error: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Fuzz(args) => match fuzz::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("xtask fuzz: error: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Hostile(args) => match hostile::run(&args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("xtask hostile: error: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Chaos(args) => {
            let timeout = match args.timeout.as_deref().map(util::parse_duration).transpose() {
                Ok(t) => t.unwrap_or_else(|| args.chaos.budget() + std::time::Duration::from_secs(600)),
                Err(e) => {
                    eprintln!("xtask chaos: error: {e:#}");
                    return ExitCode::FAILURE;
                }
            };
            match rig::chaos(&args.chaos, timeout) {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("xtask chaos: error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::GpuKit(args) => match gpu_kit::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("xtask gpu-kit: error: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Rig(args) => match rig::run(&args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("xtask rig: error: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}
