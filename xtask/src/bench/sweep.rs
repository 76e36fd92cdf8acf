//! The measurements behind `cargo xtask bench --report`: throughput against transfer size, ferry
//! beside each peer on each transport, and round-trip latency percentiles.
//!
//! The table's rows compare one size each; a reader deciding between ferry and a peer wants the
//! curve (where small transfers fall off, where a peer overtakes). The sweep keeps the table's rules:
//! every point is measured in the same run as the peer it is drawn beside, the systems alternate
//! within a round (size by size), and each point is the median over the rounds.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Result;
use serde::Serialize;

use super::{WRITE_64B, median, shm, two_processes, write};
use crate::peers::{self, FerryCase};

/// The transfer sizes of the sweep, as `ferry bench --size` takes them.
pub const SIZES: &[&str] = &["4KiB", "16KiB", "64KiB", "256KiB", "1MiB", "4MiB"];

/// Which plot a system's curve belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    Tcp,
    Shm,
}

/// One system whose throughput is swept over [`SIZES`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum System {
    /// `ferry bench --peer` against a `ferry serve` process, one TCP stream.
    FerryTcpTwoProcesses,
    /// Both engines in one `ferry bench` process, one TCP stream.
    FerryTcp,
    /// iperf3, one stream, writes of the size (`-l`).
    Iperf3,
    /// ucx_perftest `ucp_put_bw` over UCX's TCP transport.
    UcxTcp,
    /// `ferry bench --peer --transport shm` against a `ferry serve` process.
    FerryShm,
    /// ucx_perftest `ucp_put_bw` over UCX's shared-memory transports.
    UcxShm,
    /// One core's `copy_from_slice` of the size: what a copy through shared memory can reach.
    Memcpy,
}

/// iperf3's largest `-l`.
const IPERF3_MAX_LEN: u64 = 1 << 20;

const SYSTEMS: &[System] = &[
    System::FerryTcpTwoProcesses,
    System::Iperf3,
    System::FerryTcp,
    System::UcxTcp,
    System::FerryShm,
    System::UcxShm,
    System::Memcpy,
];

/// A write of `size` on one stream, `depth` 8 (ferry bench's default).
const fn one_stream(size: &'static str) -> FerryCase {
    write(size, 1, Some(1), None)
}

impl System {
    fn name(self) -> &'static str {
        match self {
            System::FerryTcpTwoProcesses => "ferry, two processes",
            System::FerryTcp => "ferry, one process",
            System::Iperf3 => "iperf3",
            System::UcxTcp => "UCX put_bw",
            System::FerryShm => "ferry, two processes",
            System::UcxShm => "UCX put_bw (posix,cma)",
            System::Memcpy => "memcpy, one core",
        }
    }

    /// Whether the system can move transfers of `bytes` at all: iperf3 writes at most 1 MiB per
    /// call (`-l`), and its stream at 1 MiB is the same stream as at more.
    fn takes(self, bytes: u64) -> bool {
        self != System::Iperf3 || bytes <= IPERF3_MAX_LEN
    }

    fn transport(self) -> Transport {
        match self {
            System::FerryShm | System::UcxShm | System::Memcpy => Transport::Shm,
            _ => Transport::Tcp,
        }
    }

    fn ferry_case(self, size: &'static str) -> Option<FerryCase> {
        match self {
            System::FerryTcpTwoProcesses => Some(two_processes(one_stream(size))),
            System::FerryTcp => Some(one_stream(size)),
            System::FerryShm => Some(shm(two_processes(one_stream(size)))),
            _ => None,
        }
    }

    fn command(self, ucx_tls: &str, duration: Duration, duration_arg: &str) -> String {
        if let Some(case) = self.ferry_case("SIZE") {
            return case.describe(duration_arg);
        }
        match self {
            System::Iperf3 => peers::iperf3_describe_len(1, "SIZE", duration),
            System::UcxTcp => peers::ucx_describe(ucx_tls).replace("1048576", "SIZE"),
            System::UcxShm => peers::ucx_shm_describe("ucp_put_bw", "SIZE"),
            _ => "SIZE-byte copy_from_slice in a loop, one thread of xtask".into(),
        }
    }

    fn measure(self, size: &'static str, bytes: u64, ctx: &Context) -> Result<f64> {
        if let Some(case) = self.ferry_case(size) {
            return Ok(peers::ferry(ctx.ferry_bin, &case, ctx.duration_arg, ctx.duration)?.gb_per_s);
        }
        match self {
            System::Iperf3 => peers::iperf3_len(1, &bytes.to_string(), ctx.duration),
            System::UcxTcp => peers::ucx_put_bw_size(ctx.ucx_tls, &bytes.to_string()),
            System::UcxShm => peers::bandwidth_gb_per_s(&peers::ucx_shm("ucp_put_bw", &bytes.to_string())?),
            _ => Ok(peers::memcpy_gb_per_s(bytes as usize, ctx.duration)),
        }
    }
}

/// One round-trip latency measure: 64-byte messages, one at a time.
#[derive(Clone, Copy)]
enum Pinger {
    /// One of ferry's cases (the table's latency cases).
    Ferry(FerryCase),
    /// sockperf ping-pong over TCP (its one-way percentiles, doubled).
    Sockperf,
    /// ucx_perftest `ucp_am_lat` over shared memory (its one-way typical latency, doubled; it
    /// prints no percentiles).
    UcxShm,
}

const PINGERS: &[(&str, Pinger)] = &[
    ("ferry TCP, two processes", Pinger::Ferry(two_processes(WRITE_64B))),
    ("ferry TCP, one process", Pinger::Ferry(WRITE_64B)),
    ("sockperf TCP", Pinger::Sockperf),
    ("ferry shm, two processes", Pinger::Ferry(shm(two_processes(WRITE_64B)))),
    ("UCX am_lat (posix,cma)", Pinger::UcxShm),
];

impl Pinger {
    /// p50 and, where the tool reports it, p99 of the round trip, in microseconds.
    fn measure(self, ctx: &Context) -> Result<(f64, Option<f64>)> {
        match self {
            Pinger::Ferry(case) => {
                let r = peers::ferry(ctx.ferry_bin, &case, ctx.duration_arg, ctx.duration)?;
                Ok((r.p50_us, Some(r.p99_us)))
            }
            Pinger::Sockperf => {
                let p = peers::sockperf_percentiles(ctx.duration, &["50.000", "99.000"])?;
                Ok((2.0 * p[0], Some(2.0 * p[1])))
            }
            Pinger::UcxShm => Ok((
                2.0 * peers::typical_latency_us(&peers::ucx_shm("ucp_am_lat", "64")?)?,
                None,
            )),
        }
    }

    fn command(self, duration: Duration, duration_arg: &str) -> String {
        match self {
            Pinger::Ferry(case) => case.describe(duration_arg),
            Pinger::Sockperf => peers::sockperf_describe(duration),
            Pinger::UcxShm => peers::ucx_shm_describe("ucp_am_lat", "64"),
        }
    }
}

/// What every measurement of the sweep needs.
pub struct Context<'a> {
    pub ferry_bin: &'a std::path::Path,
    pub duration: Duration,
    pub duration_arg: &'a str,
    /// The `UCX_TLS` value for UCX over TCP (the one the table's rows found working).
    pub ucx_tls: &'a str,
}

/// One curve: a system's median throughput at each size it was measured at.
#[derive(Clone, Debug, Serialize)]
pub struct Series {
    pub name: String,
    pub transport: Transport,
    pub command: String,
    /// (bytes per transfer, GB/s).
    pub points: Vec<(u64, f64)>,
}

/// One system's round trip of 64 bytes.
#[derive(Clone, Debug, Serialize)]
pub struct Latency {
    pub name: String,
    pub command: String,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
}

/// Everything the report plots.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sweep {
    pub rounds: u32,
    pub series: Vec<Series>,
    pub latency: Vec<Latency>,
    /// Measurements that failed (what, and why), shown under the plots.
    pub errors: Vec<String>,
}

/// Measures every system at every size, and every latency, `rounds` times.
pub fn run(ctx: &Context, rounds: u32) -> Sweep {
    let mut throughput: BTreeMap<(System, usize), Vec<f64>> = BTreeMap::new();
    let mut latency: BTreeMap<usize, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    let mut errors = Vec::new();
    for round in 1..=rounds {
        for (i, &size) in SIZES.iter().enumerate() {
            let bytes = peers::parse_size(size).unwrap_or(0);
            for &system in SYSTEMS.iter().filter(|s| s.takes(bytes)) {
                let what = format!("{} ({:?}) {size}", system.name(), system.transport());
                match system.measure(size, bytes, ctx) {
                    Ok(gb) => {
                        eprintln!("[sweep {round}/{rounds}] {what}: {gb:.3} GB/s");
                        throughput.entry((system, i)).or_default().push(gb);
                    }
                    Err(e) => {
                        eprintln!("[sweep {round}/{rounds}] {what}: error: {e:#}");
                        errors.push(format!("{what}: {e:#}"));
                    }
                }
            }
        }
        for (i, &(name, pinger)) in PINGERS.iter().enumerate() {
            match pinger.measure(ctx) {
                Ok((p50, p99)) => {
                    eprintln!("[sweep {round}/{rounds}] {name} 64 B round trip: p50 {p50:.1} us, p99 {p99:?} us");
                    let entry = latency.entry(i).or_default();
                    entry.0.push(p50);
                    entry.1.extend(p99);
                }
                Err(e) => {
                    eprintln!("[sweep {round}/{rounds}] {name}: error: {e:#}");
                    errors.push(format!("{name} 64 B round trip: {e:#}"));
                }
            }
        }
    }
    let series = SYSTEMS
        .iter()
        .map(|&system| Series {
            name: system.name().into(),
            transport: system.transport(),
            command: system.command(ctx.ucx_tls, ctx.duration, ctx.duration_arg),
            points: SIZES
                .iter()
                .enumerate()
                .filter_map(|(i, size)| {
                    let gb = median(throughput.get(&(system, i))?)?;
                    Some((peers::parse_size(size).ok()?, gb))
                })
                .collect(),
        })
        .collect();
    let latency = PINGERS
        .iter()
        .enumerate()
        .map(|(i, &(name, pinger))| {
            let (p50, p99) = latency.remove(&i).unwrap_or_default();
            Latency {
                name: name.into(),
                command: pinger.command(ctx.duration, ctx.duration_arg),
                p50_us: median(&p50),
                p99_us: median(&p99),
            }
        })
        .collect();
    Sweep {
        rounds,
        series,
        latency,
        errors,
    }
}
