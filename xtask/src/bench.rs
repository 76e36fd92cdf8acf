//! `cargo xtask bench`: ferry's own benchmark side by side with the peers a user would pick instead.
//!
//! Why this shape: the machines are shared and noisy, so an absolute number from another run says
//! little. Every figure here is measured in the same run as the figure it is compared with, the
//! measurements alternate (ferry, peer, ferry, peer, ...) for `--rounds` rounds so drift hits both
//! sides alike, and the report shows medians and a ratio against a target. The ratio is the median of
//! the rounds' own ratios (a round's ferry figure over the same round's peer figure), not a ratio of
//! medians: this machine's speed moves between rounds (1 MiB writes at 8.2, 7.4 and 6.4 GB/s in one
//! run), and a ratio of medians could pair one round's fast figure with another's slow one. A missed
//! target is a finding, not a failure: the exit status is 0 unless a measurement could not be taken
//! at all.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use serde_json::{Value, json};

use crate::peers::{self, FerryCase, FerryResult, Tls};

mod report;
mod sweep;
use crate::util::{cargo, ensure_debian_packages, parse_duration, run_step};

#[derive(clap::Args)]
pub struct Args {
    /// Rounds of alternating ferry/peer runs; the report uses the median over rounds.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// How long each ferry case and each time-based peer runs (e.g. 3s, 500ms).
    #[arg(long, default_value = "3s")]
    duration: String,
    /// Print one JSON object per comparison on stdout (the table then goes to stderr).
    #[arg(long)]
    json: bool,
    /// Use this ferry binary instead of building `ferry-cli` in release mode.
    #[arg(long, value_name = "PATH")]
    ferry_bin: Option<PathBuf>,
    /// Also sweep transfer sizes (ferry and each peer, per transport) and round-trip percentiles,
    /// and write a page with plots of the whole run to DIR (`DIR/index.html`).
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
    /// Only these rows (their ids, comma-separated: `--rows pc,pe,pd`), and only the measures they
    /// compare: a quick look at a few figures, without the rest of the table.
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    rows: Vec<String>,
}

/// Peer tools and the Debian packages that carry them.
const PEER_PACKAGES: &[(&str, &str)] = &[
    ("iperf3", "iperf3"),
    ("sockperf", "sockperf"),
    ("ucx_perftest", "ucx-utils"),
    // The CPU's own AES-GCM speed, beside the protected data streams.
    ("openssl", "openssl"),
    // `--target-mem vulkan` runs on lavapipe where there is no GPU.
    ("/usr/lib/x86_64-linux-gnu/libvulkan.so.1", "libvulkan1"),
    ("/usr/share/vulkan/icd.d/lvp_icd.x86_64.json", "mesa-vulkan-drivers"),
];

#[derive(Clone, Copy)]
enum Metric {
    GbPerS,
    P50Us,
    /// `peak_rss_bytes - registered_bytes`, in MiB.
    RssOverheadMiB,
    /// The target's flush time over the transfer time (persistent writes).
    PersistShare,
    /// Millions of descriptors per second.
    MDescPerS,
}

#[derive(Clone, Copy)]
enum Probe {
    Ferry(FerryCase, Metric),
    Iperf3 {
        streams: u32,
    },
    Ucx,
    /// ucx_perftest between two processes over UCX's shared-memory transports: a bandwidth test's
    /// overall GB/s, or a latency test's typical latency (one way, as UCX prints it).
    UcxShm {
        test: &'static str,
        size: &'static str,
    },
    /// One core's memory copy of 1 MiB, GB/s.
    Memcpy,
    /// One-way p50 as sockperf prints it.
    Sockperf,
    /// One core's AES-128-GCM, GB/s, as `openssl speed` prints it.
    OpensslAesGcm,
    /// `dd bs=1M oflag=dsync` into the temporary folder's file system, GB/s: durable 1 MiB writes
    /// without a network.
    DdDsync,
    /// 4 KiB writes through ferry-tower's stack over the same writes on the engine directly, both in
    /// one run of the `tower_overhead` example: over the transport the engines pick (shared memory,
    /// on one host), or over TCP only. With `floor`, through the least service any stack can be
    /// (the example's `--floor`) in place of the stack.
    TowerOverHead {
        tcp: bool,
        floor: bool,
    },
    /// CUDA device 0's own device-to-device copies of 1 MiB, GB/s (ferry-cuda's `copy_bandwidth`
    /// example).
    CudaCopy,
    /// The CPU time per request that the stack added in the last `TowerOverHead` run over shared
    /// memory (no run of its own: it must follow that measure in the same round).
    TowerAddedOverShm,
    /// One case of `python -m ferry.bench --case NAME` (the Python binding, over TCP in one
    /// process, as `ferry bench` runs); `blocking` measures `transfer_blocking` instead of `await`.
    Python {
        case: &'static str,
        blocking: bool,
        metric: Metric,
        /// Against a `ferry serve` of its own (`--peer`), not a second engine of the same process.
        two_processes: bool,
    },
}

struct Measure {
    key: &'static str,
    probe: Probe,
}

const fn ferry(key: &'static str, case: FerryCase, metric: Metric) -> Measure {
    Measure {
        key,
        probe: Probe::Ferry(case, metric),
    }
}

const fn write(size: &'static str, batch: u32, streams: Option<u32>, depth: Option<u32>) -> FerryCase {
    FerryCase {
        op: "write",
        size,
        batch,
        streams,
        depth,
        target_mem: None,
        durability: None,
        scatter: false,
        prepared: false,
        tls: Tls::Off,
        transport: None,
        metrics: false,
        integrity: false,
        two_processes: false,
        buffer_pool: None,
        local_mem: None,
    }
}

/// The same case against a `ferry serve` process, as users run ferry.
const fn two_processes(case: FerryCase) -> FerryCase {
    FerryCase {
        two_processes: true,
        ..case
    }
}

/// A case over the same-host transport.
const fn shm(case: FerryCase) -> FerryCase {
    FerryCase {
        transport: Some("shm"),
        ..case
    }
}

/// Writes of KV-cache blocks: `batch` blocks of `size`, scattered over block slots on both sides.
const fn kv_blocks(size: &'static str, batch: u32) -> FerryCase {
    FerryCase {
        scatter: true,
        prepared: false,
        ..write(size, batch, None, None)
    }
}

/// 1 MiB writes on one stream, one at a time, so that a transfer's time is its own: completed, or
/// persistent into a file on the temporary folder's file system.
const fn write_1mib_single(durability: &'static str) -> FerryCase {
    FerryCase {
        durability: Some(durability),
        ..write("1MiB", 1, Some(1), Some(1))
    }
}

const WRITE_1MIB: FerryCase = write("1MiB", 1, None, None);
/// 100,000 descriptors of 64 bytes in one batch, one at a time, through the coalescing pool or with
/// it turned off: what small descriptors cost either way.
const fn small_descriptors(pool: &'static str) -> FerryCase {
    FerryCase {
        buffer_pool: Some(pool),
        ..write("64", 100_000, None, Some(1))
    }
}
const WRITE_64B: FerryCase = write("64", 1, Some(1), Some(1));

/// One round, in order: each ferry case right before or after the peer it is compared with.
const MEASURES: &[Measure] = &[
    ferry(
        "ferry write 1MiB, 1 stream",
        write("1MiB", 1, Some(1), None),
        Metric::GbPerS,
    ),
    Measure {
        key: "iperf3, 1 stream",
        probe: Probe::Iperf3 { streams: 1 },
    },
    // Against a `ferry serve` process, as users run ferry (iperf3 too runs a client and a server).
    ferry(
        "ferry write 1MiB, 1 stream, two processes",
        two_processes(write("1MiB", 1, Some(1), None)),
        Metric::GbPerS,
    ),
    ferry(
        "ferry write 1MiB, two processes",
        two_processes(WRITE_1MIB),
        Metric::GbPerS,
    ),
    ferry(
        "ferry read 1MiB, 1 stream, two processes",
        two_processes(FerryCase {
            op: "read",
            ..write("1MiB", 1, Some(1), None)
        }),
        Metric::GbPerS,
    ),
    ferry(
        "ferry read 1MiB, two processes",
        two_processes(FerryCase {
            op: "read",
            ..WRITE_1MIB
        }),
        Metric::GbPerS,
    ),
    ferry("ferry write 1MiB", WRITE_1MIB, Metric::GbPerS),
    ferry(
        "ferry write 1MiB, integrity",
        FerryCase {
            integrity: true,
            ..WRITE_1MIB
        },
        Metric::GbPerS,
    ),
    Measure {
        key: "python write 1MiB",
        probe: Probe::Python {
            case: "write-1mib",
            blocking: false,
            metric: Metric::GbPerS,
            two_processes: false,
        },
    },
    Measure {
        key: "ferry.nixl write 1MiB",
        probe: Probe::Python {
            case: "nixl-write-1mib",
            blocking: false,
            metric: Metric::GbPerS,
            two_processes: false,
        },
    },
    ferry("ferry KV 64KiB x256", write("64KiB", 256, None, None), Metric::GbPerS),
    Measure {
        key: "ferry.nixl KV 64KiB x256 prepared",
        probe: Probe::Python {
            case: "nixl-kv-64kib-x256",
            blocking: false,
            metric: Metric::GbPerS,
            two_processes: false,
        },
    },
    ferry(
        "ferry write 1MiB, mutual TLS, plain data",
        FerryCase {
            tls: Tls::On("plain"),
            ..WRITE_1MIB
        },
        Metric::GbPerS,
    ),
    ferry(
        "ferry write 1MiB, mutual TLS, integrity-protected data",
        FerryCase {
            tls: Tls::On("integrity"),
            ..WRITE_1MIB
        },
        Metric::GbPerS,
    ),
    ferry(
        "ferry write 1MiB, mutual TLS, encrypted data",
        FerryCase {
            tls: Tls::On("encrypted"),
            ..WRITE_1MIB
        },
        Metric::GbPerS,
    ),
    Measure {
        key: "openssl speed aes-128-gcm, one core",
        probe: Probe::OpensslAesGcm,
    },
    Measure {
        key: "iperf3 -P 2",
        probe: Probe::Iperf3 { streams: 2 },
    },
    Measure {
        key: "ucx_perftest put_bw 1MiB",
        probe: Probe::Ucx,
    },
    ferry("ferry write 4KiB x256", write("4KiB", 256, None, None), Metric::GbPerS),
    Measure {
        key: "python write 4KiB x256",
        probe: Probe::Python {
            case: "write-4kib-x256",
            blocking: false,
            metric: Metric::GbPerS,
            two_processes: false,
        },
    },
    ferry(
        "ferry write 4KiB x256, metrics",
        FerryCase {
            metrics: true,
            ..write("4KiB", 256, None, None)
        },
        Metric::GbPerS,
    ),
    ferry("ferry write 1MiB x8", write("1MiB", 8, None, None), Metric::GbPerS),
    ferry("ferry KV 64KiB x256 scattered", kv_blocks("64KiB", 256), Metric::GbPerS),
    ferry(
        "ferry write 1MiB x8, two processes",
        two_processes(write("1MiB", 8, None, None)),
        Metric::GbPerS,
    ),
    ferry(
        "ferry write 4KiB x256, two processes",
        two_processes(write("4KiB", 256, None, None)),
        Metric::GbPerS,
    ),
    ferry(
        "ferry KV 64KiB x256 scattered, two processes",
        two_processes(kv_blocks("64KiB", 256)),
        Metric::GbPerS,
    ),
    ferry(
        "ferry KV 64KiB x256 scattered, integrity",
        FerryCase {
            integrity: true,
            ..kv_blocks("64KiB", 256)
        },
        Metric::GbPerS,
    ),
    ferry("ferry KV 16KiB x128 scattered", kv_blocks("16KiB", 128), Metric::GbPerS),
    ferry(
        "ferry write 4KiB x15000",
        write("4KiB", 15000, None, None),
        Metric::GbPerS,
    ),
    ferry(
        "ferry write 4KiB x15000 prepared",
        FerryCase {
            prepared: true,
            ..write("4KiB", 15000, None, None)
        },
        Metric::GbPerS,
    ),
    ferry("ferry 64 B p50", WRITE_64B, Metric::P50Us),
    ferry("ferry 64 B p50, two processes", two_processes(WRITE_64B), Metric::P50Us),
    Measure {
        key: "python 64 B p50, awaited",
        probe: Probe::Python {
            case: "write-64b-p50",
            blocking: false,
            metric: Metric::P50Us,
            two_processes: false,
        },
    },
    Measure {
        key: "python 64 B p50, awaited, two processes",
        probe: Probe::Python {
            case: "write-64b-p50",
            blocking: false,
            metric: Metric::P50Us,
            two_processes: true,
        },
    },
    Measure {
        key: "python 64 B p50, blocking",
        probe: Probe::Python {
            case: "write-64b-p50",
            blocking: true,
            metric: Metric::P50Us,
            two_processes: false,
        },
    },
    ferry(
        "ferry 64 B p50, metrics",
        FerryCase {
            metrics: true,
            ..WRITE_64B
        },
        Metric::P50Us,
    ),
    ferry(
        "ferry 64 B p50, mutual TLS",
        FerryCase {
            tls: Tls::On("integrity"),
            ..WRITE_64B
        },
        Metric::P50Us,
    ),
    Measure {
        key: "sockperf p50 (one-way)",
        probe: Probe::Sockperf,
    },
    ferry(
        "ferry 16MiB RSS overhead",
        write("16MiB", 1, None, None),
        Metric::RssOverheadMiB,
    ),
    ferry(
        "ferry write 1MiB into Vulkan memory",
        FerryCase {
            target_mem: Some("vulkan"),
            ..WRITE_1MIB
        },
        Metric::GbPerS,
    ),
    ferry(
        "ferry write 1MiB into CUDA memory",
        FerryCase {
            target_mem: Some("cuda"),
            ..WRITE_1MIB
        },
        Metric::GbPerS,
    ),
    ferry(
        "ferry read 1MiB from CUDA memory",
        FerryCase {
            op: "read",
            target_mem: Some("cuda"),
            ..WRITE_1MIB
        },
        Metric::GbPerS,
    ),
    ferry(
        "ferry shm write 1MiB GPU to GPU, two processes",
        FerryCase {
            local_mem: Some("cuda"),
            target_mem: Some("cuda"),
            ..two_processes(shm(WRITE_1MIB))
        },
        Metric::GbPerS,
    ),
    Measure {
        key: "CUDA device-to-device copy 1MiB",
        probe: Probe::CudaCopy,
    },
    Measure {
        key: "tower stack / engine over TCP, 4KiB writes",
        probe: Probe::TowerOverHead {
            tcp: true,
            floor: false,
        },
    },
    Measure {
        key: "tower stack / engine over shm, 4KiB writes",
        probe: Probe::TowerOverHead {
            tcp: false,
            floor: false,
        },
    },
    Measure {
        key: "tower stack over shm: CPU added per request",
        probe: Probe::TowerAddedOverShm,
    },
    Measure {
        key: "tower floor service / engine over TCP, 4KiB writes",
        probe: Probe::TowerOverHead { tcp: true, floor: true },
    },
    Measure {
        key: "tower floor service / engine over shm, 4KiB writes",
        probe: Probe::TowerOverHead {
            tcp: false,
            floor: true,
        },
    },
    ferry(
        "ferry read 1MiB",
        FerryCase {
            op: "read",
            ..WRITE_1MIB
        },
        Metric::GbPerS,
    ),
    ferry("ferry shm write 1MiB", shm(WRITE_1MIB), Metric::GbPerS),
    ferry(
        "ferry shm write 1MiB, two processes",
        shm(two_processes(WRITE_1MIB)),
        Metric::GbPerS,
    ),
    ferry(
        "ferry shm 64 B p50, two processes",
        shm(two_processes(WRITE_64B)),
        Metric::P50Us,
    ),
    Measure {
        key: "ucx_perftest put_bw 1MiB, shared memory",
        probe: Probe::UcxShm {
            test: "ucp_put_bw",
            size: "1048576",
        },
    },
    Measure {
        key: "memcpy 1MiB, one core",
        probe: Probe::Memcpy,
    },
    ferry(
        "ferry shm read 1MiB",
        shm(FerryCase {
            op: "read",
            ..WRITE_1MIB
        }),
        Metric::GbPerS,
    ),
    Measure {
        key: "ucx_perftest get_bw 1MiB, shared memory",
        probe: Probe::UcxShm {
            test: "ucp_get",
            size: "1048576",
        },
    },
    ferry(
        "ferry shm write 4KiB x256",
        shm(write("4KiB", 256, None, None)),
        Metric::GbPerS,
    ),
    ferry("ferry shm 64 B p50", shm(WRITE_64B), Metric::P50Us),
    ferry(
        "ferry write 64 B x100000, pool on",
        small_descriptors("4:8"),
        Metric::MDescPerS,
    ),
    ferry(
        "ferry write 64 B x100000, pool off",
        small_descriptors("0:0"),
        Metric::MDescPerS,
    ),
    ferry(
        "ferry shm write 64 B x100000, pool on",
        shm(small_descriptors("4:8")),
        Metric::MDescPerS,
    ),
    ferry(
        "ferry shm write 64 B x100000, pool off",
        shm(small_descriptors("0:0")),
        Metric::MDescPerS,
    ),
    Measure {
        key: "ucx_perftest am_lat 64 B, shared memory (one-way)",
        probe: Probe::UcxShm {
            test: "ucp_am_lat",
            size: "64",
        },
    },
    ferry(
        "ferry write 1MiB completed, 1 stream, depth 1",
        write_1mib_single("completed"),
        Metric::GbPerS,
    ),
    ferry(
        "ferry write 1MiB persistent, 1 stream, depth 1",
        write_1mib_single("persistent"),
        Metric::GbPerS,
    ),
    ferry(
        "ferry persistent 1MiB: flush time / transfer time",
        write_1mib_single("persistent"),
        Metric::PersistShare,
    ),
    ferry(
        "ferry shm write 1MiB persistent, depth 1",
        shm(write_1mib_single("persistent")),
        Metric::GbPerS,
    ),
    Measure {
        key: "dd bs=1M oflag=dsync",
        probe: Probe::DdDsync,
    },
];

#[derive(Clone, Copy)]
enum Unit {
    GbPerS,
    Micros,
    MiB,
    Ratio,
    MDescPerS,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Unit::GbPerS => "GB/s",
            Unit::Micros => "us",
            Unit::MiB => "MiB",
            Unit::Ratio => "x",
            Unit::MDescPerS => "M desc/s",
        }
    }

    fn show(self, value: f64) -> String {
        match self {
            Unit::GbPerS => format!("{value:.2} GB/s"),
            Unit::Micros if value < 10.0 => format!("{value:.2} us"),
            Unit::Micros => format!("{value:.1} us"),
            Unit::MiB => format!("{value:.1} MiB"),
            Unit::Ratio => format!("{value:.3}x"),
            Unit::MDescPerS => format!("{value:.2} M desc/s"),
        }
    }
}

#[derive(Clone, Copy)]
enum Target {
    RatioAtLeast(f64),
    RatioAtMost(f64),
    /// The ferry figure itself must not exceed this (no peer).
    FerryAtMost(f64),
    /// The ferry figure itself must reach this (no peer).
    FerryAtLeast(f64),
    Info,
}

impl Target {
    fn show(self, unit: Unit) -> String {
        match self {
            Target::RatioAtLeast(t) => format!(">= {t:.2}"),
            Target::RatioAtMost(t) => format!("<= {t:.2}"),
            // Whole units where the bound is large (MiB), hundredths where it is small (µs).
            Target::FerryAtMost(t) if t >= 10.0 => format!("<= {t:.0} {}", unit.name()),
            Target::FerryAtMost(t) => format!("<= {t:.2} {}", unit.name()),
            Target::FerryAtLeast(t) => format!(">= {t:.2}{}", unit.name()),
            Target::Info => "info".into(),
        }
    }

    fn met(self, ferry: f64, ratio: Option<f64>) -> Option<bool> {
        match self {
            Target::RatioAtLeast(t) => ratio.map(|r| r >= t),
            Target::RatioAtMost(t) => ratio.map(|r| r <= t),
            Target::FerryAtMost(t) => Some(ferry <= t),
            Target::FerryAtLeast(t) => Some(ferry >= t),
            Target::Info => None,
        }
    }
}

struct Comparison {
    id: &'static str,
    name: &'static str,
    ferry: &'static str,
    peer: Option<&'static str>,
    /// Multiplies the peer's median (2 turns sockperf's one-way latency into a round trip).
    peer_scale: f64,
    unit: Unit,
    target: Target,
}

const COMPARISONS: &[Comparison] = &[
    Comparison {
        id: "a",
        name: "write 1MiB, 1 stream / iperf3",
        ferry: "ferry write 1MiB, 1 stream",
        peer: Some("iperf3, 1 stream"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.9),
    },
    Comparison {
        id: "b",
        name: "write 1MiB, 2 streams / iperf3 -P 2",
        ferry: "ferry write 1MiB",
        peer: Some("iperf3 -P 2"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.9),
    },
    // Between two processes: `ferry serve` and `ferry bench --peer`, as users run ferry and as the
    // peers run (a client and a server process each).
    Comparison {
        id: "a2",
        name: "two processes: write 1MiB, 1 stream / iperf3",
        ferry: "ferry write 1MiB, 1 stream, two processes",
        peer: Some("iperf3, 1 stream"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(1.0),
    },
    Comparison {
        id: "b2",
        name: "two processes: write 1MiB, 2 streams / iperf3, 1 stream",
        ferry: "ferry write 1MiB, two processes",
        peer: Some("iperf3, 1 stream"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(1.2),
    },
    Comparison {
        id: "g2",
        name: "two processes: read 1MiB, 1 stream / iperf3",
        ferry: "ferry read 1MiB, 1 stream, two processes",
        peer: Some("iperf3, 1 stream"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "g3",
        name: "two processes: read 1MiB, 2 streams / iperf3 -P 2",
        ferry: "ferry read 1MiB, two processes",
        peer: Some("iperf3 -P 2"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "d2",
        name: "two processes: write 4KiB x256 batch / write 1MiB x8",
        ferry: "ferry write 4KiB x256, two processes",
        peer: Some("ferry write 1MiB x8, two processes"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "l2",
        name: "two processes: KV 64KiB x256 scattered / write 1MiB x8",
        ferry: "ferry KV 64KiB x256 scattered, two processes",
        peer: Some("ferry write 1MiB x8, two processes"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "e2",
        name: "two processes: 64 B p50 round trip / sockperf RTT p50",
        ferry: "ferry 64 B p50, two processes",
        peer: Some("sockperf p50 (one-way)"),
        peer_scale: 2.0,
        unit: Unit::Micros,
        target: Target::RatioAtMost(1.2),
    },
    Comparison {
        id: "q2",
        name: "two processes: shm write 1MiB / ucx_perftest put_bw (posix,cma)",
        ferry: "ferry shm write 1MiB, two processes",
        peer: Some("ucx_perftest put_bw 1MiB, shared memory"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "u2",
        name: "two processes: shm 64 B p50 round trip / ucx_perftest am_lat RTT (posix,cma)",
        ferry: "ferry shm 64 B p50, two processes",
        peer: Some("ucx_perftest am_lat 64 B, shared memory (one-way)"),
        peer_scale: 2.0,
        unit: Unit::Micros,
        target: Target::Info,
    },
    Comparison {
        id: "c",
        name: "write 1MiB, 2 streams / ucx_perftest put_bw",
        ferry: "ferry write 1MiB",
        peer: Some("ucx_perftest put_bw 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(2.0),
    },
    Comparison {
        id: "d",
        name: "write 4KiB x256 batch / write 1MiB",
        ferry: "ferry write 4KiB x256",
        peer: Some("ferry write 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.6),
    },
    Comparison {
        id: "l",
        name: "KV cache: write 64KiB x256 scattered / write 1MiB x8",
        ferry: "ferry KV 64KiB x256 scattered",
        peer: Some("ferry write 1MiB x8"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.8),
    },
    Comparison {
        id: "m",
        name: "KV cache: write 16KiB x128 scattered / write 1MiB x8",
        ferry: "ferry KV 16KiB x128 scattered",
        peer: Some("ferry write 1MiB x8"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "pa",
        name: "write 1MiB: Python (await) / Rust",
        ferry: "python write 1MiB",
        peer: Some("ferry write 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.95),
    },
    Comparison {
        id: "pb",
        name: "write 4KiB x256 batch: Python (await) / Rust",
        ferry: "python write 4KiB x256",
        peer: Some("ferry write 4KiB x256"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.7),
    },
    // NIXL's agent API (ferry.nixl) is a layer over the Python binding: it should cost nothing
    // that matters beside it, and the KV shape (prepared block lists) is reported beside Rust's.
    Comparison {
        id: "pn",
        name: "write 1MiB: ferry.nixl (NIXL agent API) / Python native",
        ferry: "ferry.nixl write 1MiB",
        peer: Some("python write 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.9),
    },
    Comparison {
        id: "pn2",
        name: "KV 64KiB x256: ferry.nixl prepared block lists / Rust",
        ferry: "ferry.nixl KV 64KiB x256 prepared",
        peer: Some("ferry KV 64KiB x256"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "pc",
        name: "64 B p50 round trip: Python await / Rust",
        ferry: "python 64 B p50, awaited",
        peer: Some("ferry 64 B p50"),
        peer_scale: 1.0,
        unit: Unit::Micros,
        target: Target::Info,
    },
    // Two processes, as users run it: the Python initiator against `ferry serve`, beside `ferry bench
    // --peer` against the same. Here both sides' waits are thread wake-ups in either language, where
    // the in-process Rust pair of pc runs both engines on one worker thread without any.
    Comparison {
        id: "pe",
        name: "two processes: 64 B p50 round trip: Python await / Rust",
        ferry: "python 64 B p50, awaited, two processes",
        peer: Some("ferry 64 B p50, two processes"),
        peer_scale: 1.0,
        unit: Unit::Micros,
        target: Target::RatioAtMost(2.0),
    },
    Comparison {
        id: "pd",
        name: "64 B p50 round trip: Python transfer_blocking / Rust",
        ferry: "python 64 B p50, blocking",
        peer: Some("ferry 64 B p50"),
        peer_scale: 1.0,
        unit: Unit::Micros,
        target: Target::Info,
    },
    Comparison {
        id: "y",
        name: "write 4KiB x256, metrics on / off",
        ferry: "ferry write 4KiB x256, metrics",
        peer: Some("ferry write 4KiB x256"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.97),
    },
    Comparison {
        id: "z",
        name: "64 B p50 round trip, metrics on / off",
        ferry: "ferry 64 B p50, metrics",
        peer: Some("ferry 64 B p50"),
        peer_scale: 1.0,
        unit: Unit::Micros,
        target: Target::RatioAtMost(1.03),
    },
    Comparison {
        id: "x",
        name: "write 4KiB x15000: prepared once / resolved per transfer",
        ferry: "ferry write 4KiB x15000 prepared",
        peer: Some("ferry write 4KiB x15000"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "e",
        name: "64 B p50 round trip / sockperf RTT p50",
        ferry: "ferry 64 B p50",
        peer: Some("sockperf p50 (one-way)"),
        peer_scale: 2.0,
        unit: Unit::Micros,
        target: Target::RatioAtMost(1.5),
    },
    // Integrity costs a checksum pass at each end (CRC32C folded with carry-less multiplies, about
    // 57 GB/s on one core here, from cache: a batch over TCP is summed frame by frame as it goes, in
    // frames of at most 1 MiB); both ends share this machine's cores.
    Comparison {
        id: "ci",
        name: "write 1MiB with integrity / without",
        ferry: "ferry write 1MiB, integrity",
        peer: Some("ferry write 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.85),
    },
    Comparison {
        id: "ci2",
        name: "KV 64KiB x256 scattered with integrity / without",
        ferry: "ferry KV 64KiB x256 scattered, integrity",
        peer: Some("ferry KV 64KiB x256 scattered"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.8),
    },
    Comparison {
        id: "n",
        name: "write 1MiB, mutual TLS on the control stream (data plain) / without TLS",
        ferry: "ferry write 1MiB, mutual TLS, plain data",
        peer: Some("ferry write 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.97),
    },
    Comparison {
        id: "o",
        name: "64 B p50 round trip, mutual TLS / without",
        ferry: "ferry 64 B p50, mutual TLS",
        peer: Some("ferry 64 B p50"),
        peer_scale: 1.0,
        unit: Unit::Micros,
        target: Target::RatioAtMost(1.1),
    },
    // Protected data pays AES-GCM and a copy on each side; in this benchmark both sides share the
    // machine's cores, so the CPU's own AES-GCM speed (p3) bounds what p and p2 can reach.
    Comparison {
        id: "p",
        name: "write 1MiB, TLS, integrity-protected data / plain data",
        ferry: "ferry write 1MiB, mutual TLS, integrity-protected data",
        peer: Some("ferry write 1MiB, mutual TLS, plain data"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.8),
    },
    Comparison {
        id: "p2",
        name: "write 1MiB, TLS, encrypted data / plain data",
        ferry: "ferry write 1MiB, mutual TLS, encrypted data",
        peer: Some("ferry write 1MiB, mutual TLS, plain data"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.6),
    },
    Comparison {
        id: "p3",
        name: "AES-128-GCM on one core (openssl speed) / write 1MiB, TLS, plain data",
        ferry: "openssl speed aes-128-gcm, one core",
        peer: Some("ferry write 1MiB, mutual TLS, plain data"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "f",
        name: "16MiB write: peak RSS - registered",
        ferry: "ferry 16MiB RSS overhead",
        peer: None,
        peer_scale: 1.0,
        unit: Unit::MiB,
        target: Target::FerryAtMost(64.0),
    },
    Comparison {
        id: "h",
        name: "write 1MiB into Vulkan (host-visible) / into host memory",
        ferry: "ferry write 1MiB into Vulkan memory",
        peer: Some("ferry write 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.9),
    },
    // The stack's target was set when two engines of one host could talk only TCP (the stack then
    // kept 0.846 of the engine's rate over it), and holds there. Shared memory came later: a 4 KiB
    // write over it takes about 0.3 us of CPU here, so the stack's own cost per request shows in the
    // ratio far more than over TCP: 0.7 of the engine's rate (i2) leaves the stack about 0.13 us,
    // and its CPU per request is bounded by itself too (i5).
    Comparison {
        id: "i",
        name: "tower stack (pool+retry+deadlines) / engine directly, 4KiB writes over TCP",
        ferry: "tower stack / engine over TCP, 4KiB writes",
        peer: None,
        peer_scale: 1.0,
        unit: Unit::Ratio,
        target: Target::FerryAtLeast(0.95),
    },
    Comparison {
        id: "i2",
        name: "the same over shared memory (a write of a few hundred ns: the ratio says more of it than of the stack)",
        ferry: "tower stack / engine over shm, 4KiB writes",
        peer: None,
        peer_scale: 1.0,
        unit: Unit::Ratio,
        target: Target::FerryAtLeast(0.7),
    },
    Comparison {
        id: "i5",
        name: "CPU the stack adds per request over shared memory (what i2 is made of)",
        ferry: "tower stack over shm: CPU added per request",
        peer: None,
        peer_scale: 1.0,
        unit: Unit::Micros,
        target: Target::FerryAtMost(0.25),
    },
    Comparison {
        id: "i3",
        name: "least tower service (the engine's own future; no pool, no layers) / engine directly, 4KiB over TCP",
        ferry: "tower floor service / engine over TCP, 4KiB writes",
        peer: None,
        peer_scale: 1.0,
        unit: Unit::Ratio,
        target: Target::Info,
    },
    Comparison {
        id: "i4",
        name: "the same over shared memory",
        ferry: "tower floor service / engine over shm, 4KiB writes",
        peer: None,
        peer_scale: 1.0,
        unit: Unit::Ratio,
        target: Target::Info,
    },
    Comparison {
        id: "j",
        name: "write 1MiB persistent / completed (TCP, msync target, 1 stream, depth 1)",
        ferry: "ferry write 1MiB persistent, 1 stream, depth 1",
        peer: Some("ferry write 1MiB completed, 1 stream, depth 1"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "j2",
        name: "write 1MiB persistent (TCP, msync target, 1 stream, depth 1) / dd bs=1M oflag=dsync, same file system",
        ferry: "ferry write 1MiB persistent, 1 stream, depth 1",
        peer: Some("dd bs=1M oflag=dsync"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.8),
    },
    Comparison {
        id: "j3",
        name: "write 1MiB persistent (shm, msync target, depth 1) / dd bs=1M oflag=dsync, same file system",
        ferry: "ferry shm write 1MiB persistent, depth 1",
        peer: Some("dd bs=1M oflag=dsync"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.8),
    },
    Comparison {
        id: "k",
        name: "persistent 1MiB writes: target's msync time / transfer time",
        ferry: "ferry persistent 1MiB: flush time / transfer time",
        peer: None,
        peer_scale: 1.0,
        unit: Unit::Ratio,
        target: Target::Info,
    },
    Comparison {
        id: "q",
        name: "shm: write 1MiB / ucx_perftest put_bw (posix,cma)",
        ferry: "ferry shm write 1MiB",
        peer: Some("ucx_perftest put_bw 1MiB, shared memory"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(1.0),
    },
    Comparison {
        id: "r",
        name: "shm: read 1MiB / ucx_perftest get_bw (posix,cma)",
        ferry: "ferry shm read 1MiB",
        peer: Some("ucx_perftest get_bw 1MiB, shared memory"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(1.0),
    },
    Comparison {
        id: "s",
        name: "shm: write 1MiB / one core's memcpy of 1MiB",
        ferry: "ferry shm write 1MiB",
        peer: Some("memcpy 1MiB, one core"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.9),
    },
    Comparison {
        id: "t",
        name: "shm: write 4KiB x256 batch / write 1MiB",
        ferry: "ferry shm write 4KiB x256",
        peer: Some("ferry shm write 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.8),
    },
    // The pool exists for small descriptors over TCP (one frame for many); on a transport that copies
    // each descriptor where it goes it must cost nothing. Never slower than off, up to noise.
    Comparison {
        id: "pt",
        name: "64 B x100000 in one batch over TCP: coalescing pool on / off",
        ferry: "ferry write 64 B x100000, pool on",
        peer: Some("ferry write 64 B x100000, pool off"),
        peer_scale: 1.0,
        unit: Unit::MDescPerS,
        target: Target::RatioAtLeast(0.95),
    },
    Comparison {
        id: "ps",
        name: "64 B x100000 in one batch over shm: coalescing pool on / off",
        ferry: "ferry shm write 64 B x100000, pool on",
        peer: Some("ferry shm write 64 B x100000, pool off"),
        peer_scale: 1.0,
        unit: Unit::MDescPerS,
        target: Target::RatioAtLeast(0.95),
    },
    Comparison {
        id: "u",
        name: "shm: 64 B p50 round trip / ucx_perftest am_lat RTT (posix,cma)",
        ferry: "ferry shm 64 B p50",
        peer: Some("ucx_perftest am_lat 64 B, shared memory (one-way)"),
        peer_scale: 2.0,
        unit: Unit::Micros,
        target: Target::RatioAtMost(1.0),
    },
    Comparison {
        id: "v",
        name: "write 1MiB: shm / tcp (what a same-host user gains)",
        ferry: "ferry shm write 1MiB",
        peer: Some("ferry write 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
    Comparison {
        id: "w",
        name: "64 B p50: shm / tcp",
        ferry: "ferry shm 64 B p50",
        peer: Some("ferry 64 B p50"),
        peer_scale: 1.0,
        unit: Unit::Micros,
        target: Target::Info,
    },
    // CUDA device memory, staged: what a GPU region costs over the host
    // memory the same link reaches. Rows of a host without a CUDA device say so and are not run.
    Comparison {
        id: "cu",
        name: "write 1MiB into CUDA memory / into host memory (TCP)",
        ferry: "ferry write 1MiB into CUDA memory",
        peer: Some("ferry write 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.8),
    },
    Comparison {
        id: "cu2",
        name: "read 1MiB from CUDA memory / write 1MiB into it (TCP, staged)",
        ferry: "ferry read 1MiB from CUDA memory",
        peer: Some("ferry write 1MiB into CUDA memory"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.8),
    },
    Comparison {
        id: "cu3",
        name: "two processes, one GPU: shm write 1MiB GPU to GPU (CUDA IPC) / the device's own copy",
        ferry: "ferry shm write 1MiB GPU to GPU, two processes",
        peer: Some("CUDA device-to-device copy 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::RatioAtLeast(0.8),
    },
    Comparison {
        id: "g",
        name: "read 1MiB / write 1MiB",
        ferry: "ferry read 1MiB",
        peer: Some("ferry write 1MiB"),
        peer_scale: 1.0,
        unit: Unit::GbPerS,
        target: Target::Info,
    },
];

/// Samples per measurement, over rounds, and the first error of each.
#[derive(Default)]
struct Samples {
    /// Each measure's figures, with the round each was taken in.
    values: BTreeMap<&'static str, Vec<(u32, f64)>>,
    errors: BTreeMap<&'static str, String>,
    /// Measures this host cannot take (no CUDA device), with why: their rows are not run.
    not_run: BTreeMap<&'static str, String>,
}

/// Why a measure was not taken on this host: it needs a device the host lacks. Not a failure.
#[derive(Debug)]
struct NotRun(String);

impl std::fmt::Display for NotRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "not run: {}", self.0)
    }
}

impl std::error::Error for NotRun {}

struct Bench<'a> {
    args: &'a Args,
    ferry_bin: PathBuf,
    /// ferry-tower's `tower_overhead` example.
    tower_bin: PathBuf,
    duration: Duration,
    /// The `UCX_TLS` value that worked, once one has.
    ucx_tls: Option<&'static str>,
    /// The Python binding's interpreter, once its environment is made (on first use).
    python: Option<PathBuf>,
    /// What the tower stack added per request over shared memory, from this round's run.
    tower_added_over_shm: Option<f64>,
    /// Whether the ferry binary finds a CUDA device here (`Err`: why not), once asked.
    cuda: Option<Result<(), String>>,
}

pub fn run(args: &Args) -> Result<ExitCode> {
    let duration = parse_duration(&args.duration)?;
    let comparisons = chosen_rows(&args.rows)?;
    let measures = measures_for(&comparisons);
    ensure_debian_packages(PEER_PACKAGES)?;
    let ferry_bin = match &args.ferry_bin {
        Some(path) => path.clone(),
        None => build_ferry()?,
    };
    if !ferry_bin.is_file() {
        return Err(anyhow!("the ferry binary {} does not exist", ferry_bin.display()));
    }
    let tower_bin = build_tower_overhead()?;
    let mut bench = Bench {
        args,
        tower_bin,
        ferry_bin,
        duration,
        ucx_tls: None,
        python: None,
        tower_added_over_shm: None,
        cuda: None,
    };
    let mut samples = Samples::default();
    for round in 1..=args.rounds {
        for measure in &measures {
            if samples.not_run.contains_key(measure.key) {
                continue;
            }
            match bench.measure(measure.probe) {
                Ok(value) => {
                    eprintln!("[round {round}/{}] {}: {value:.3}", args.rounds, measure.key);
                    samples.values.entry(measure.key).or_default().push((round, value));
                }
                Err(e) if e.downcast_ref::<NotRun>().is_some() => {
                    eprintln!("[round {round}/{}] {}: {e:#}", args.rounds, measure.key);
                    if let Some(NotRun(why)) = e.downcast_ref::<NotRun>() {
                        samples.not_run.insert(measure.key, why.clone());
                    }
                }
                Err(e) => {
                    eprintln!("[round {round}/{}] {}: error: {e:#}", args.rounds, measure.key);
                    samples.errors.entry(measure.key).or_insert_with(|| format!("{e:#}"));
                }
            }
        }
    }
    let rows: Vec<Row> = comparisons.iter().map(|c| Row::new(c, &samples, &bench)).collect();
    let table = render_table(&rows, &measures, &bench);
    if args.json {
        eprint!("{table}");
        for row in &rows {
            println!("{}", row.json);
        }
    } else {
        print!("{table}");
    }
    if let Some(dir) = &args.report {
        let ctx = sweep::Context {
            ferry_bin: &bench.ferry_bin,
            duration,
            duration_arg: &args.duration,
            ucx_tls: bench.ucx_tls.unwrap_or(peers::UCX_TLS_CHOICES[0]),
        };
        let swept = sweep::run(&ctx, args.rounds);
        let figures: Vec<report::RowFigure> = comparisons.iter().zip(&rows).map(|(c, r)| r.figure(c)).collect();
        let meta = report::Meta::here(args.rounds, &args.duration);
        report::write(dir, &meta, &table, &figures, &swept)?;
        eprintln!("xtask bench: the report is {}", dir.join("index.html").display());
    }
    Ok(if rows.iter().any(|r| r.status == "ERROR") {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The comparisons `ids` name, in the table's order (all of them when `ids` is empty); an error naming
/// the ids that no row has.
fn chosen_rows(ids: &[String]) -> Result<Vec<&'static Comparison>> {
    if ids.is_empty() {
        return Ok(COMPARISONS.iter().collect());
    }
    let unknown: Vec<&str> = ids
        .iter()
        .map(String::as_str)
        .filter(|id| !COMPARISONS.iter().any(|c| c.id == *id))
        .collect();
    if !unknown.is_empty() {
        let known: Vec<&str> = COMPARISONS.iter().map(|c| c.id).collect();
        bail!("no row has the id {} (rows: {})", unknown.join(", "), known.join(", "));
    }
    Ok(COMPARISONS.iter().filter(|c| ids.iter().any(|id| id == c.id)).collect())
}

/// The measures `comparisons` read, in the run's order. The stack's added CPU over shared memory
/// comes from the stack's run over shared memory in the same round, which it then brings along.
fn measures_for(comparisons: &[&Comparison]) -> Vec<&'static Measure> {
    let wanted = |m: &Measure| comparisons.iter().any(|c| c.ferry == m.key || c.peer == Some(m.key));
    let needs_stack_over_shm = MEASURES
        .iter()
        .any(|m| matches!(m.probe, Probe::TowerAddedOverShm) && wanted(m));
    MEASURES
        .iter()
        .filter(|m| {
            wanted(m)
                || (needs_stack_over_shm
                    && matches!(
                        m.probe,
                        Probe::TowerOverHead {
                            tcp: false,
                            floor: false
                        }
                    ))
        })
        .collect()
}

/// Builds ferry-tower's `tower_overhead` example in release mode and returns its path.
fn build_tower_overhead() -> Result<PathBuf> {
    build_example("ferry-tower", "tower_overhead")
}

/// Builds `package`'s example `name` in release mode and returns its path.
fn build_example(package: &str, name: &str) -> Result<PathBuf> {
    run_step(
        cargo().args(["build", "--release", "-p", package, "--example", name]),
        Duration::from_secs(45 * 60),
    )?;
    let bin = target_dir()?.join("release").join("examples").join(name);
    if !bin.is_file() {
        return Err(anyhow!("{} is missing after building the example", bin.display()));
    }
    Ok(bin)
}

fn target_dir() -> Result<PathBuf> {
    crate::util::target_dir(&crate::util::cargo_metadata()?)
}

/// Builds `ferry-cli` in release mode and returns the path of its `ferry` binary.
pub(crate) fn build_ferry() -> Result<PathBuf> {
    run_step(
        cargo().args(["build", "--release", "-p", "ferry-cli", "--features", "vulkan"]),
        Duration::from_secs(45 * 60),
    )?;
    let bin = target_dir()?.join("release").join("ferry");
    if !bin.is_file() {
        return Err(anyhow!(
            "{} is missing after building ferry-cli (is its binary named `ferry`?)",
            bin.display()
        ));
    }
    Ok(bin)
}

impl Bench<'_> {
    fn measure(&mut self, probe: Probe) -> Result<f64> {
        match probe {
            Probe::Ferry(case, metric) => {
                if case.target_mem == Some("cuda") || case.local_mem == Some("cuda") {
                    self.needs_cuda()?;
                }
                let r: FerryResult = peers::ferry(&self.ferry_bin, &case, &self.args.duration, self.duration)?;
                Ok(match metric {
                    Metric::GbPerS => r.gb_per_s,
                    Metric::P50Us => r.p50_us,
                    Metric::RssOverheadMiB => (r.peak_rss_bytes - r.registered_bytes) / f64::from(1u32 << 20),
                    Metric::PersistShare => r.persist_share,
                    Metric::MDescPerS => r.ops_per_s / 1e6,
                })
            }
            Probe::Iperf3 { streams } => peers::iperf3(streams, self.duration),
            Probe::CudaCopy => {
                self.needs_cuda()?;
                let bin = build_example("ferry-cuda", "copy_bandwidth")?;
                peers::cuda_copy_gb_per_s(&bin, self.duration)
            }
            Probe::Sockperf => peers::sockperf_p50(self.duration),
            Probe::OpensslAesGcm => peers::openssl_aes_gcm(self.duration),
            Probe::DdDsync => peers::dd_dsync_gb_per_s(self.duration),
            Probe::Ucx => self.ucx(),
            Probe::UcxShm { test, size } => {
                let fields = peers::ucx_shm(test, size)?;
                match test.ends_with("_lat") {
                    true => peers::typical_latency_us(&fields),
                    false => peers::bandwidth_gb_per_s(&fields),
                }
            }
            Probe::Memcpy => Ok(peers::memcpy_gb_per_s(1 << 20, self.duration)),
            Probe::TowerOverHead { tcp, floor } => {
                let (ratio, added) = peers::tower_overhead(&self.tower_bin, tcp, floor, self.duration)?;
                if !tcp && !floor {
                    self.tower_added_over_shm = added;
                }
                Ok(ratio)
            }
            Probe::TowerAddedOverShm => self
                .tower_added_over_shm
                .take()
                .ok_or_else(|| anyhow!("the stack over shared memory was not measured in this round")),
            Probe::Python {
                case,
                blocking,
                metric,
                two_processes,
            } => {
                let python = self.python()?;
                let serve = two_processes.then_some(self.ferry_bin.as_path());
                let r = peers::python_bench(&python, case, blocking, serve, self.duration)?;
                Ok(match metric {
                    Metric::P50Us => r.p50_us,
                    _ => r.gb_per_s,
                })
            }
        }
    }

    /// `Ok` when the ferry binary finds a CUDA device on this host, else [`NotRun`] with its reason
    /// (`ferry info --json`'s), asked once.
    fn needs_cuda(&mut self) -> Result<()> {
        let cuda = self.cuda.get_or_insert_with(|| peers::cuda_devices(&self.ferry_bin));
        cuda.clone()
            .map_err(|why| NotRun(format!("no CUDA device: {why}")).into())
    }

    /// The Python binding's interpreter: the environment `cargo xtask test` uses, made and the
    /// binding installed afresh on first use.
    fn python(&mut self) -> Result<PathBuf> {
        if let Some(python) = &self.python {
            return Ok(python.clone());
        }
        let python = crate::python::environment()?;
        self.python = Some(python.clone());
        Ok(python)
    }

    /// ucx_perftest with the first `UCX_TLS` choice that works, remembered for later rounds.
    fn ucx(&mut self) -> Result<f64> {
        if let Some(tls) = self.ucx_tls {
            return peers::ucx_put_bw(tls);
        }
        let mut errors = Vec::new();
        for &tls in peers::UCX_TLS_CHOICES {
            match peers::ucx_put_bw(tls) {
                Ok(v) => {
                    self.ucx_tls = Some(tls);
                    return Ok(v);
                }
                Err(e) => errors.push(format!("UCX_TLS={tls}: {e:#}")),
            }
        }
        Err(anyhow!(
            "ucx_perftest failed with every UCX_TLS choice: {}",
            errors.join("; ")
        ))
    }

    fn command_of(&self, key: &str) -> String {
        let Some(measure) = MEASURES.iter().find(|m| m.key == key) else {
            return String::new();
        };
        match measure.probe {
            Probe::Ferry(case, _) => case.describe(&self.args.duration),
            Probe::Iperf3 { streams } => peers::iperf3_describe(streams, self.duration),
            Probe::Ucx => peers::ucx_describe(self.ucx_tls.unwrap_or(peers::UCX_TLS_CHOICES[0])),
            Probe::UcxShm { test, size } => peers::ucx_shm_describe(test, size),
            Probe::Memcpy => "1 MiB copy_from_slice in a loop, one thread of xtask".into(),
            Probe::CudaCopy => format!(
                "copy_bandwidth {} {} (ferry-cuda's example: cuMemcpyDtoDAsync, 16 queued per wait, device 0)",
                1 << 20,
                self.duration.as_secs_f64()
            ),
            Probe::Sockperf => peers::sockperf_describe(self.duration),
            Probe::OpensslAesGcm => peers::openssl_describe(self.duration),
            Probe::DdDsync => peers::dd_describe(self.duration),
            Probe::TowerOverHead { tcp, floor } => format!(
                "{}{}{}",
                self.tower_bin.display(),
                if floor { " --floor" } else { "" },
                if tcp { " --tcp" } else { "" }
            ),
            Probe::TowerAddedOverShm => format!(
                "{} (its added_cpu_us: workers x (1/stack rate - 1/direct rate))",
                self.tower_bin.display()
            ),
            Probe::Python {
                case,
                blocking,
                two_processes,
                ..
            } => format!(
                "{}python -m ferry.bench --case {case}{}{} (bindings/python, in {})",
                if two_processes {
                    peers::serve_description(None)
                } else {
                    String::new()
                },
                if blocking { " --blocking" } else { "" },
                if two_processes { " --peer 127.0.0.1:PORT" } else { "" },
                self.python
                    .as_ref()
                    .map_or_else(|| "its virtual environment".into(), |p| p.display().to_string())
            ),
        }
    }
}

/// The median of `values` (the mean of the middle two for an even count); `None` when empty.
pub(crate) fn median(values: &[f64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// The median of the rounds' ratios: each round's ferry figure over the same round's peer figure
/// (rounds where either side has no figure, or the peer's is zero, are left out); `None` when no
/// round has both.
pub(crate) fn paired_ratio(ferry: &[(u32, f64)], peer: &[(u32, f64)]) -> Option<f64> {
    let ratios: Vec<f64> = ferry
        .iter()
        .filter_map(|&(round, f)| {
            let &(_, p) = peer.iter().find(|&&(r, _)| r == round)?;
            (p > 0.0).then(|| f / p)
        })
        .collect();
    median(&ratios)
}

struct Row {
    cells: [String; 6],
    ratio: Option<f64>,
    status: &'static str,
    json: Value,
}

impl Row {
    fn new(c: &Comparison, samples: &Samples, bench: &Bench) -> Self {
        let ferry_rounds = samples.values.get(c.ferry).cloned().unwrap_or_default();
        let peer_rounds: Vec<(u32, f64)> = c
            .peer
            .and_then(|p| samples.values.get(p))
            .map(|v| v.iter().map(|&(round, x)| (round, x * c.peer_scale)).collect())
            .unwrap_or_default();
        let ferry_samples: Vec<f64> = ferry_rounds.iter().map(|&(_, v)| v).collect();
        let peer_samples: Vec<f64> = peer_rounds.iter().map(|&(_, v)| v).collect();
        let ferry = median(&ferry_samples);
        let peer = median(&peer_samples);
        let ratio = paired_ratio(&ferry_rounds, &peer_rounds);
        let keys = || [Some(c.ferry), c.peer].into_iter().flatten();
        let not_run = keys().find_map(|k| samples.not_run.get(k).cloned());
        let error = not_run
            .clone()
            .or_else(|| keys().find_map(|k| samples.errors.get(k).map(|e| format!("{k}: {e}"))));
        let complete = ferry.is_some() && (c.peer.is_none() || peer.is_some());
        let met = ferry.filter(|_| complete).and_then(|f| c.target.met(f, ratio));
        let status = match (complete, met) {
            (false, _) if not_run.is_some() => "not run",
            (false, _) => "ERROR",
            (true, Some(true)) => "ok",
            (true, Some(false)) => "MISSED",
            (true, None) => "info",
        };
        let show = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| c.unit.show(v));
        let cells = [
            format!("{}. {}", c.id, c.name),
            show(ferry),
            if c.peer.is_some() { show(peer) } else { "-".into() },
            ratio.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}")),
            c.target.show(c.unit),
            status.to_owned(),
        ];
        let json = json!({
            "id": c.id,
            "comparison": c.name,
            "unit": c.unit.name(),
            "ferry": ferry,
            "peer": peer,
            "ratio": ratio,
            "target": c.target.show(c.unit),
            "ok": met,
            "status": status,
            "rounds": bench.args.rounds,
            "ferry_samples": ferry_samples,
            "peer_samples": peer_samples,
            "ferry_command": bench.command_of(c.ferry),
            "peer_command": c.peer.map(|p| bench.command_of(p)),
            "ucx_tls": if c.peer.is_some_and(|p| p.starts_with("ucx")) { bench.ucx_tls } else { None },
            "error": error,
        });
        Row {
            cells,
            ratio,
            status,
            json,
        }
    }
}

impl Row {
    /// The row as the report's ratio plot shows it.
    fn figure(&self, c: &Comparison) -> report::RowFigure {
        report::RowFigure {
            id: c.id.into(),
            name: c.name.into(),
            ratio: self.ratio,
            bound: match c.target {
                Target::RatioAtLeast(t) => Some(report::Bound::AtLeast(t)),
                Target::RatioAtMost(t) => Some(report::Bound::AtMost(t)),
                _ => None,
            },
            status: self.status.into(),
        }
    }
}

fn render_table(rows: &[Row], measures: &[&Measure], bench: &Bench) -> String {
    let header = ["comparison", "ferry", "peer", "ratio", "target", "ok"];
    let cells: Vec<[String; 6]> = rows.iter().map(|r| r.cells.clone()).collect();
    let mut out = format!(
        "\nferry vs peers: medians over {} round(s) of {}, alternating ferry and peer in one run; the ratio is the median\nof the rounds' own ratios (each round's ferry figure over that round's peer figure)\n\n",
        bench.args.rounds, bench.args.duration
    );
    out += &crate::util::columns(header, &cells);
    out += "\nnotes:\n";
    out += "  e. sockperf prints one-way latency (RTT/2); the peer column is 2 x its p50, a round trip, like ferry's p50.\n";
    out += &format!(
        "  c. ucx_perftest ran with UCX_TLS={}; its figure is the Final row's \"overall\" bandwidth (MB = 2^20 B),\n     not the \"average\" column, which covers only the last report interval.\n",
        bench.ucx_tls.unwrap_or("(none worked)")
    );
    out += "  ferry GB/s = 10^9 B/s; iperf3 = end.sum_received.bits_per_second / 8e9.\n";
    out += "commands:\n";
    for m in measures {
        out += &format!("  {:<26} {}\n", m.key, bench.command_of(m.key));
    }
    let missed: Vec<&str> = rows
        .iter()
        .filter(|r| r.status == "MISSED")
        .map(|r| r.cells[0].as_str())
        .collect();
    if !missed.is_empty() {
        out += &format!("\nMISSED targets: {}\n", missed.join("; "));
    }
    for row in rows.iter().filter(|r| r.status == "not run") {
        out += &format!(
            "\nNOT RUN {}: {}\n",
            row.cells[0],
            row.json["error"].as_str().unwrap_or("this host lacks what it needs")
        );
    }
    for row in rows.iter().filter(|r| r.status == "ERROR") {
        out += &format!(
            "\nERROR {}: {}\n",
            row.cells[0],
            row.json["error"].as_str().unwrap_or("no samples")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
    }

    #[test]
    fn ratios_pair_figures_of_the_same_round() {
        // The machine slowed down after round 1: a ratio of medians (3.9 / 7.4) would pair round 3's
        // ferry figure with round 2's peer figure.
        let ferry = [(1, 8.0), (2, 3.7), (3, 3.9)];
        let peer = [(1, 8.2), (2, 7.4), (3, 6.4)];
        let r = paired_ratio(&ferry, &peer).unwrap();
        assert!((r - 3.9 / 6.4).abs() < 1e-12, "{r}");
        // A round without a peer figure, or with a zero one, is left out.
        let peer = [(1, 8.0), (3, 0.0)];
        assert_eq!(paired_ratio(&ferry, &peer), Some(1.0));
        assert_eq!(paired_ratio(&ferry, &[]), None);
        assert_eq!(paired_ratio(&[], &peer), None);
    }

    #[test]
    fn every_comparison_names_measures() {
        for c in COMPARISONS {
            assert!(MEASURES.iter().any(|m| m.key == c.ferry), "{}", c.ferry);
            if let Some(p) = c.peer {
                assert!(MEASURES.iter().any(|m| m.key == p), "{p}");
            }
        }
    }

    #[test]
    fn chosen_rows_run_only_their_measures() {
        let keys = |ids: &[&str]| -> Vec<&str> {
            let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
            let rows = chosen_rows(&ids).expect("known ids");
            measures_for(&rows).iter().map(|m| m.key).collect()
        };
        assert_eq!(
            keys(&["pe"]),
            [
                "ferry 64 B p50, two processes",
                "python 64 B p50, awaited, two processes"
            ]
        );
        // The stack's added CPU is read off the stack's run over shared memory: both run.
        let i5 = keys(&["i5"]);
        assert_eq!(i5.len(), 2, "{i5:?}");
        assert!(i5.contains(&"tower stack over shm: CPU added per request"));
        // No ids: every row and every measure; an unknown id is named.
        assert_eq!(chosen_rows(&[]).map(|r| r.len()).ok(), Some(COMPARISONS.len()));
        assert_eq!(
            measures_for(&chosen_rows(&[]).unwrap_or_default()).len(),
            MEASURES.len()
        );
        let e = chosen_rows(&["pe".into(), "zz".into()]).err().map(|e| e.to_string());
        assert!(
            e.is_some_and(|e| e.starts_with("no row has the id zz (rows: ")),
            "the unknown id alone is named"
        );
    }

    #[test]
    fn targets() {
        assert_eq!(Target::RatioAtLeast(0.9).met(1.0, Some(0.95)), Some(true));
        assert_eq!(Target::RatioAtLeast(0.9).met(1.0, Some(0.85)), Some(false));
        assert_eq!(Target::RatioAtMost(2.0).met(1.0, Some(2.5)), Some(false));
        assert_eq!(Target::FerryAtMost(64.0).met(10.0, None), Some(true));
        assert_eq!(Target::Info.met(1.0, Some(1.0)), None);
    }
}
