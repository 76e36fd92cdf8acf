//! `ferry-chaos`: a fleet of ferry engines on one machine, under faults (`cargo xtask chaos` boots it
//! in the rig's guest, whose kernel has the netem qdisc).
//!
//! - `ferry-chaos run` (root) conducts a run: network namespaces on a bridge, etcd, the engines as
//!   processes, the schedule's faults, the invariants, a summary and a timeline.
//! - `ferry-chaos member` is one engine of the fleet (the conductor starts them).
//! - `ferry-chaos plan` prints the schedule a seed gives, without running it.
//! - `ferry-chaos growth` measures what one engine costs as the cluster around it grows.

mod conduct;
mod event;
mod growth;
mod member;
mod net;
mod pattern;
mod report;
mod rng;
mod schedule;
mod verdict;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ferry-chaos",
    about = "A fleet of ferry engines under faults, and the invariants that must hold"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Conduct a run (as root): the fleet, the faults, the verdict.
    Run(conduct::Args),
    /// One engine of the fleet.
    Member(member::Args),
    /// What one engine costs as the cluster grows: links, adverts of regions to peers, the directory,
    /// notification fan-in.
    Growth(growth::Args),
    /// Print the schedule of a seed.
    Plan {
        #[arg(long, value_enum, default_value = "short")]
        profile: schedule::Profile,
        #[arg(long)]
        seed: u64,
        #[arg(long, default_value_t = 8)]
        engines: usize,
        #[arg(long, default_value_t = 5)]
        ttl: u64,
        #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
        duration: Duration,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Run(args) => conduct::run(args).await,
            Command::Member(args) => member::run(args).await.map(|()| true),
            Command::Growth(args) => growth::run(args).await.map(|()| true),
            Command::Plan {
                profile,
                seed,
                engines,
                ttl,
                duration,
            } => {
                let fleet = schedule::Fleet {
                    prefill: engines / 2,
                    engines,
                    ttl: Duration::from_secs(ttl),
                };
                let plan = schedule::plan(seed, profile, fleet, duration);
                println!("{}", schedule::Shown(&plan, &fleet));
                Ok(true)
            }
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
