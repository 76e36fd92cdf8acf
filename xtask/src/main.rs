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
        Command::Rig(args) => match rig::run(&args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("xtask rig: error: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}
