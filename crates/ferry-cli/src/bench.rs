//! `ferry bench`: throughput and latency of batched transfers, in the manner of `ib_write_bw` and
//! `nixlbench`.
//!
//! Each case keeps `depth` batches in flight for `duration` after a short warm-up and reports GB/s
//! (10^9 bytes per second), descriptors per second, and the p50/p99 latency of one batch. Without
//! `--peer`, two engines run in this process and talk over 127.0.0.1.
//!
//! `--durability persistent` (or `both`, side by side) writes into a file the target registered as
//! persistent memory and asks for persistent writes; the in-process target then also reports how
//! long it spent flushing per transfer, and which share of the transfer time that is.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry::{Access, Durability, Engine, Op, Peer, Region, TlsConfig, TransferDesc, TransportKind};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::tls::TlsArgs;
use crate::units::{format_size, parse_duration, parse_size};

const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct Args {
    /// Data path to measure.
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// Operation; both when omitted.
    #[arg(long, value_parser = ["write", "read"])]
    op: Option<String>,
    /// Bytes per descriptor (4KiB, 1MiB…); a sweep of 4KiB, 64KiB, 1MiB, 16MiB when omitted.
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Descriptors per batch; a few batch sizes when omitted.
    #[arg(long)]
    batch: Option<usize>,
    /// TCP streams per link.
    #[arg(long, default_value_t = ferry::DEFAULT_STREAMS)]
    streams: usize,
    /// Batches kept in flight.
    #[arg(long, default_value_t = 8)]
    depth: usize,
    /// How long each case runs (after a warm-up of a tenth of it).
    #[arg(long, value_parser = parse_duration)]
    duration: Option<Duration>,
    /// A `ferry serve` to measure against, "host:port"; two engines in this process when omitted.
    #[arg(long)]
    peer: Option<String>,
    /// The buffer pool small descriptors are coalesced through, "BUFFER_NUM:BUFFER_SIZE_MB".
    #[arg(long, default_value = "4:8")]
    buffer_pool: String,
    /// One JSON object per case and line, instead of a table.
    #[arg(long)]
    json: bool,
    /// Memory of the in-process target: host (memfd), vulkan (GPU memory, the best path the device
    /// offers; `FERRY_VULKAN_DEVICE` picks the device; needs the `vulkan` feature) or cuda (device
    /// memory of CUDA device 0, staged; `CUDA_VISIBLE_DEVICES` picks it).
    #[arg(long, default_value = "host", value_parser = ["host", "vulkan", "cuda"])]
    target_mem: String,
    /// With `--target-mem vulkan`: the allocation path, auto (the best the device offers), rdma
    /// (`VK_NV_external_memory_rdma`), host-visible (mapped device memory) or staged (device-local
    /// memory behind a staging buffer); a path the device does not offer is an error.
    #[arg(long, default_value = "auto", value_parser = ["auto", "rdma", "host-visible", "staged"])]
    vulkan_path: String,
    /// Memory of the initiator's buffer: host, or cuda (device memory of CUDA device 0): with
    /// `--transport shm` against a `ferry serve --mem cuda`, GPU to GPU between two processes.
    #[arg(long, default_value = "host", value_parser = ["host", "cuda"])]
    local_mem: String,
    /// What a write's completion promises: completed (in the target's memory), persistent (in its
    /// persistence domain; the target registers a file), or both, side by side.
    #[arg(long, default_value = "completed", value_parser = ["completed", "persistent", "both"])]
    durability: String,
    /// Place each batch's descriptors in a shuffled order of block positions, a different one on each
    /// side, as the blocks of a paged KV cache lie (no two neighbours are adjacent in memory).
    #[arg(long)]
    scatter: bool,
    /// Resolve each case's batch once (`Engine::prepare`) and post it again and again
    /// (`Engine::transfer_prepared`), instead of resolving its descriptors on every transfer.
    #[arg(long)]
    prepared: bool,
    /// Keep the initiator engine's metrics (`EngineBuilder::metrics`), to measure what they cost.
    #[arg(long)]
    metrics: bool,
    /// Check every transfer's bytes end to end (`EngineBuilder::integrity`: CRC32C at the source and
    /// at the destination after landing), to measure what it costs.
    #[arg(long)]
    integrity: bool,
    /// The file the in-process target registers as persistent memory (created or extended as
    /// needed); a temporary file by default. Only with --durability persistent or both.
    #[arg(long)]
    target_file: Option<std::path::PathBuf>,
    /// Authenticate the link with mutual TLS, both in-process engines holding certificates of a CA
    /// made in memory for the run (against a --peer, give --tls-cert, --tls-key and --tls-ca instead).
    #[arg(long, conflicts_with_all = ["tls_cert", "tls_psk_file"])]
    tls: bool,
    #[command(flatten)]
    tls_files: TlsArgs,
    #[command(flatten)]
    rdma: crate::rdma::RdmaArgs,
}

/// One rail of a multi-rail RDMA link, as `ferry bench --json` reports it.
#[derive(Debug, Clone, Serialize)]
struct Rail {
    name: String,
    bytes: u64,
    errors: u64,
    healthy: bool,
    /// Its measured throughput while busy (GB/s), which spraying weighs it by.
    gb_per_s: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
struct CaseResult {
    transport: String,
    op: String,
    durability: &'static str,
    /// How the link persists ("flush-before-ack", "flush-verb"…), for persistent writes.
    persist_method: Option<String>,
    /// Time the in-process target spent persisting, per transfer (µs).
    persist_us_per_transfer: Option<f64>,
    /// That time over the mean transfer time.
    persist_share: Option<f64>,
    size: u64,
    batch: usize,
    /// Whether the descriptors were scattered over block positions (`--scatter`).
    scatter: bool,
    /// Whether the batch was prepared once and posted again and again (`--prepared`).
    prepared: bool,
    /// Whether every transfer checked its bytes end to end (`--integrity`).
    integrity: bool,
    /// Each RDMA rail's bytes and errors since the link was set up (empty for a link of one path).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    rails: Vec<Rail>,
    streams: usize,
    depth: usize,
    gb_per_s: f64,
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    transfers: u64,
    peak_rss_bytes: u64,
    /// How long connecting to the peer took, before the first case (ms).
    connect_ms: f64,
    registered_bytes: u64,
}

struct Case {
    op: Op,
    size: u64,
    batch: usize,
    durability: Durability,
}

fn durability_name(d: Durability) -> &'static str {
    match d {
        Durability::Completed => "completed",
        Durability::Persistent => "persistent",
    }
}

fn cases(args: &Args) -> Vec<Case> {
    let ops = match args.op.as_deref() {
        Some("read") => vec![Op::Read],
        Some(_) => vec![Op::Write],
        None => vec![Op::Write, Op::Read],
    };
    let sizes = args
        .size
        .map_or_else(|| vec![4 << 10, 64 << 10, 1 << 20, 16 << 20], |s| vec![s]);
    let durabilities = match args.durability.as_str() {
        "persistent" => vec![Durability::Persistent],
        "both" => vec![Durability::Completed, Durability::Persistent],
        _ => vec![Durability::Completed],
    };
    let mut out = Vec::new();
    for &op in &ops {
        for &size in &sizes {
            let batches = match args.batch {
                Some(b) => vec![b],
                None if size <= 64 << 10 => vec![1, 32, 256],
                None if size <= 1 << 20 => vec![1, 8],
                None => vec![1],
            };
            for batch in batches {
                // Durability is a promise about writes; a read is measured once.
                let levels = if op == Op::Write {
                    &durabilities[..]
                } else {
                    &[Durability::Completed][..]
                };
                for &durability in levels {
                    out.push(Case {
                        op,
                        size,
                        batch,
                        durability,
                    });
                }
            }
        }
    }
    out
}

/// The two ends of a bench: the initiator, its peer, and the target memory to aim at.
struct Setup {
    initiator: Engine,
    peer: Peer,
    /// Keeps the in-process target alive (its region counts the time spent persisting).
    target: Option<(Engine, Region)>,
    /// A temporary file made for the target; removed at the end.
    temp_file: Option<std::path::PathBuf>,
    remote_addr: u64,
    remote_len: u64,
    /// How long `connect` took (the TCP, TLS and ferry handshakes, and data-path setup).
    connect_ms: f64,
}

/// The TLS configurations of the initiator and the in-process target, if the run authenticates.
fn tls_configs(args: &Args) -> anyhow::Result<(Option<TlsConfig>, Option<TlsConfig>)> {
    if args.tls {
        // Both ends protect the data streams as --data-protection (or --encrypt) says.
        let ca = ferry::DevelopmentCa::new("ferry bench CA")?;
        let protection = args.tls_files.protection();
        return Ok((
            Some(ca.config("bench-initiator")?.data_protection(protection)),
            Some(ca.config("bench-target")?.data_protection(protection)),
        ));
    }
    let files = args.tls_files.config()?;
    Ok((files.clone(), files))
}

async fn setup(args: &Args, max_bytes: u64) -> anyhow::Result<Setup> {
    let want: TransportKind = args.transport.parse()?;
    let mut temp_file = None;
    let (initiator_tls, target_tls) = tls_configs(args)?;
    let mut initiator = args.rdma.apply(
        Engine::builder()
            .transports([want])
            .streams(args.streams)
            .buffer_pool(&args.buffer_pool)
            .integrity(args.integrity),
    )?;
    if let Some(tls) = initiator_tls {
        initiator = initiator.tls(tls);
    }
    if args.metrics {
        // Nothing scrapes it: the engine keeps counting into the metrics the registry held.
        initiator = initiator.metrics(&mut ferry::prometheus_client::registry::Registry::default());
    }
    let initiator = initiator.build().await.context("starting the initiator engine")?;
    let (target, addr) = match &args.peer {
        Some(_) if args.target_mem != "host" => bail!(
            "--target-mem applies to the in-process target; a `ferry serve` peer allocates its own memory \
             (drop --peer or --target-mem)"
        ),
        Some(_) if args.target_file.is_some() => {
            bail!("--target-file applies to the in-process target; start `ferry serve --file PATH` for a remote one")
        }
        Some(addr) => (None, addr.clone()),
        None => {
            let mut target = args
                .rdma
                .apply(Engine::builder().transports([want]).listen("127.0.0.1:0"))?;
            let authenticated = target_tls.is_some();
            if let Some(tls) = target_tls {
                target = target.tls(tls);
            }
            let target = target.build().await.context("starting the target engine")?;
            let region = target_region(&target, args, max_bytes as usize, &mut temp_file)?;
            if authenticated {
                region.grant_all(Access::READ_WRITE).await?;
            }
            let addr = target.local_addr().context("target has no address")?.to_string();
            (Some((target, region)), addr)
        }
    };
    let connecting = std::time::Instant::now();
    let peer = initiator
        .connect(&addr, Duration::from_secs(5))
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    let connect_ms = connecting.elapsed().as_secs_f64() * 1e3;
    if peer.transport() != want {
        bail!("asked for {want} but the link to {addr} uses {}", peer.transport());
    }
    let persistent = args.durability != "completed";
    let remote = peer
        .regions()
        .iter()
        .filter(|r| r.access == Access::READ_WRITE && (r.persistent || !persistent))
        .max_by_key(|r| r.len)
        .cloned()
        .with_context(|| {
            format!(
                "{addr} advertises no readable and writable{} region",
                if persistent { " persistent" } else { "" }
            )
        })?;
    if remote.len < max_bytes {
        bail!(
            "the peer's largest region has {} bytes; this run needs {max_bytes}",
            remote.len
        );
    }
    Ok(Setup {
        initiator,
        peer,
        target,
        temp_file,
        remote_addr: remote.addr,
        remote_len: remote.len,
        connect_ms,
    })
}

/// The in-process target's memory, as `--target-mem` and `--durability` ask.
fn target_region(
    target: &Engine,
    args: &Args,
    len: usize,
    temp_file: &mut Option<std::path::PathBuf>,
) -> anyhow::Result<Region> {
    if args.durability != "completed" {
        if args.target_mem != "host" {
            bail!("--durability persistent writes into a file; drop --target-mem");
        }
        let path = match &args.target_file {
            Some(p) => p.clone(),
            None => {
                let p = std::env::temp_dir().join(format!("ferry-bench-{}.data", std::process::id()));
                *temp_file = Some(p.clone());
                p
            }
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let is_regular = file.metadata().map(|m| m.is_file()).unwrap_or(false);
        if is_regular && file.metadata().map(|m| m.len()).unwrap_or(0) < len as u64 {
            file.set_len(len as u64)
                .with_context(|| format!("extending {} to {len} bytes", path.display()))?;
        }
        let region = target
            .register_file(&path, 0, len, Access::READ_WRITE)
            .with_context(|| format!("registering {} as persistent memory", path.display()))?;
        if !args.json {
            eprintln!("target memory: {} at {}", region.kind(), path.display());
        }
        return Ok(region);
    }
    if args.target_mem != "vulkan" && args.vulkan_path != "auto" {
        bail!("--vulkan-path needs --target-mem vulkan");
    }
    if args.target_mem == "cuda" {
        return cuda_region(target, len, args.json);
    }
    if args.target_mem != "vulkan" {
        return target
            .alloc_host(len, Access::READ_WRITE)
            .context("allocating target memory");
    }
    #[cfg(feature = "vulkan")]
    {
        let path = match args.vulkan_path.as_str() {
            "auto" => None,
            name => Some(name.parse::<ferry_vulkan::AllocationPath>()?),
        };
        let ctx = ferry_vulkan::VulkanContext::from_env().context("opening a Vulkan device for --target-mem vulkan")?;
        let registry = ferry_vulkan::VulkanRegistry::new(ctx).with_path(path);
        let region = target
            .alloc_from(&registry, len, Access::READ_WRITE)
            .context("allocating Vulkan target memory")?;
        if !args.json {
            eprintln!("target memory: {} on {}", region.kind(), registry.context().name());
        }
        Ok(region)
    }
    #[cfg(not(feature = "vulkan"))]
    bail!(
        "--target-mem vulkan needs a ferry built with the `vulkan` feature (cargo build -p ferry-cli --features vulkan)"
    )
}

/// A region of `len` bytes of CUDA device memory of device 0, allocated by `engine`; said on
/// stderr unless `quiet`.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_region(engine: &Engine, len: usize, quiet: bool) -> anyhow::Result<Region> {
    let device = ferry::cuda::CudaDevice::open(0).context("opening CUDA device 0")?;
    let registry = ferry::cuda::CudaRegistry::new(device);
    let region = engine
        .alloc_from(&registry, len, Access::READ_WRITE)
        .context("allocating CUDA device memory")?;
    if !quiet {
        eprintln!(
            "cuda memory: {} on {}",
            region.kind(),
            ferry::MemoryRegistry::name(&registry)
        );
    }
    Ok(region)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn cuda_region(_: &Engine, _: usize, _: bool) -> anyhow::Result<Region> {
    bail!("CUDA memory needs a ferry built with the `cuda` feature (cargo build -p ferry-cli --features cuda)")
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let cases = cases(&args);
    if args.depth == 0 || args.batch == Some(0) {
        bail!("--depth and --batch must be at least 1");
    }
    let duration = args.duration.unwrap_or(if cases.len() > 1 {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(3)
    });
    let max_bytes = cases.iter().map(|c| c.size * c.batch as u64).max().unwrap_or(1);
    let setup = setup(&args, max_bytes).await?;
    let local = match args.local_mem.as_str() {
        "cuda" => cuda_region(&setup.initiator, max_bytes as usize, args.json)?,
        _ => setup
            .initiator
            .alloc_host(max_bytes as usize, Access::READ_WRITE)
            .context("allocating local memory")?,
    };
    let registered = max_bytes * if args.peer.is_some() { 1 } else { 2 };

    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(cases.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut results = Vec::new();
    for case in &cases {
        bar.set_message(format!("{} {} x{}", case.op, format_size(case.size), case.batch));
        let r = run_case(&args, &setup, &local, case, duration, registered).await?;
        if args.json {
            println!("{}", serde_json::to_string(&r)?);
        }
        results.push(r);
        bar.inc(1);
    }
    bar.finish_and_clear();
    if !args.json {
        print_table(&results);
        print_durability_ratios(&results);
    }
    debug_assert!(setup.remote_len >= max_bytes);
    drop(setup.target);
    if let Some(path) = setup.temp_file {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// For each write case measured both ways: persistent over completed, and the flush's share.
fn print_durability_ratios(results: &[CaseResult]) {
    for p in results.iter().filter(|r| r.durability == "persistent") {
        let Some(c) = results
            .iter()
            .find(|c| c.durability == "completed" && c.op == p.op && c.size == p.size && c.batch == p.batch)
        else {
            continue;
        };
        let share = p.persist_share.map_or_else(String::new, |s| {
            format!(", flushing {:.0}% of the transfer time", s * 100.0)
        });
        println!(
            "persistent/completed, {} {} x{}: {:.2} ({}{share})",
            p.op,
            format_size(p.size),
            p.batch,
            if c.gb_per_s > 0.0 { p.gb_per_s / c.gb_per_s } else { 0.0 },
            p.persist_method.as_deref().unwrap_or("?"),
        );
    }
}

/// What one lane of a case measured: the latency of each transfer that ended after the warm-up, in
/// nanoseconds, and when the lane's last transfer ended.
struct Tally {
    latencies: Vec<u64>,
    ended: Instant,
}

async fn run_case(
    args: &Args,
    s: &Setup,
    local: &Region,
    case: &Case,
    duration: Duration,
    registered: u64,
) -> anyhow::Result<CaseResult> {
    let (local_order, remote_order) = if args.scatter {
        (shuffled(case.batch, 0x5EED_0001), shuffled(case.batch, 0x5EED_0002))
    } else {
        ((0..case.batch as u64).collect(), (0..case.batch as u64).collect())
    };
    let descs: Vec<TransferDesc> = local_order
        .iter()
        .zip(&remote_order)
        .map(|(&l, &r)| TransferDesc::new(local.addr_at(l * case.size), s.remote_addr + r * case.size, case.size))
        .collect();
    let prepared = match args.prepared {
        true => Some(
            s.initiator
                .prepare_durable(&s.peer, case.op, &descs, case.durability)
                .context("preparing the batch")?,
        ),
        false => None,
    };
    let one = || async {
        match prepared.as_ref() {
            Some(p) => s.initiator.transfer_prepared(p, TIMEOUT).await,
            None => {
                s.initiator
                    .transfer_durable(&s.peer, case.op, &descs, case.durability, TIMEOUT)
                    .await
            }
        }
        .with_context(|| format!("{} of {} x {}", case.op, case.batch, format_size(case.size)))
    };
    let persist_stats = || s.target.as_ref().and_then(|(_, region)| region.persist_stats());
    let measure_from = Instant::now() + duration / 10;
    let stop_starting_at = measure_from + duration;
    let stats_at_start = std::sync::OnceLock::new();
    // `depth` lanes, each a transfer after the other, joined in this task. Not a `FuturesUnordered`:
    // it yields to the runtime after polling all of its futures once, and on a multi-threaded tokio
    // runtime each yield wakes an idle worker, a futex wake and wait per transfer that ferry never
    // asked for (64 B TCP round trip p50: 31-37 us with it, 17.5-19 us without, alternating in one
    // run). `try_join_all` polls up to 30 futures in place; deeper cases go through
    // `FuturesOrdered`, which yields too, but they are bound by throughput, not by a wake-up.
    let lane = |_| async {
        let mut latencies = Vec::new();
        // One clock read per transfer: its end is the next one's start.
        let mut started = Instant::now();
        while started < stop_starting_at {
            one().await?;
            let now = Instant::now();
            if now >= measure_from {
                stats_at_start.get_or_init(persist_stats);
                // Nanoseconds: a transfer into a lent same-host region takes well under a microsecond.
                latencies.push((now - started).as_nanos().min(u64::MAX as u128) as u64);
            }
            started = now;
        }
        anyhow::Ok(Tally {
            latencies,
            ended: started,
        })
    };
    let lanes = futures::future::try_join_all((0..args.depth).map(lane)).await?;
    let stats_at_start = stats_at_start.get().copied().flatten();
    let ended = lanes.iter().map(|l| l.ended).max();
    let mut latencies: Vec<u64> = lanes.into_iter().flat_map(|l| l.latencies).collect();
    let transfers = latencies.len() as u64;
    let secs = ended
        .map_or(0.0, |t| t.saturating_duration_since(measure_from).as_secs_f64())
        .max(1e-9);
    latencies.sort_unstable();
    let pct = |p: f64| -> f64 {
        if latencies.is_empty() {
            return 0.0;
        }
        let i = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1;
        latencies[i] as f64 / 1e3
    };
    let bytes = transfers as f64 * case.batch as f64 * case.size as f64;
    let persistent = case.durability == Durability::Persistent;
    // Transfers still in flight when measuring ended flushed too: the figure is an upper bound.
    let persist_us_per_transfer = match (persistent, stats_at_start, persist_stats()) {
        (true, Some(a), Some(b)) if transfers > 0 => Some((b.nanos - a.nanos) as f64 / 1e3 / transfers as f64),
        _ => None,
    };
    let mean_us = latencies.iter().map(|&l| l as f64 / 1e3).sum::<f64>() / latencies.len().max(1) as f64;
    Ok(CaseResult {
        transport: s.peer.transport().to_string(),
        op: case.op.to_string(),
        durability: durability_name(case.durability),
        persist_method: persistent.then(|| s.peer.persist_method().to_string()),
        persist_us_per_transfer,
        persist_share: persist_us_per_transfer.map(|p| if mean_us > 0.0 { p / mean_us } else { 0.0 }),
        size: case.size,
        batch: case.batch,
        scatter: args.scatter,
        prepared: args.prepared,
        integrity: args.integrity,
        rails: s
            .peer
            .rails()
            .into_iter()
            .map(|r| Rail {
                name: r.name,
                bytes: r.bytes,
                errors: r.errors,
                healthy: r.healthy,
                gb_per_s: r.bytes_per_second.map(|b| b as f64 / 1e9),
            })
            .collect(),
        streams: s.peer.tcp_streams(),
        depth: args.depth,
        gb_per_s: bytes / secs / 1e9,
        ops_per_s: transfers as f64 * case.batch as f64 / secs,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        transfers,
        peak_rss_bytes: peak_rss(),
        connect_ms: s.connect_ms,
        registered_bytes: registered,
    })
}

fn print_table(results: &[CaseResult]) {
    println!(
        "{:<9} {:<6} {:<10} {:>7} {:>6} {:>8} {:>9} {:>12} {:>10} {:>10} {:>12}",
        "transport",
        "op",
        "durability",
        "size",
        "batch",
        "streams",
        "GB/s",
        "ops/s",
        "p50 us",
        "p99 us",
        "flush us/xfer"
    );
    for r in results {
        println!(
            "{:<9} {:<6} {:<10} {:>7} {:>6} {:>8} {:>9.3} {:>12.0} {:>10.1} {:>10.1} {:>12}",
            r.transport,
            r.op,
            r.durability,
            format_size(r.size),
            r.batch,
            r.streams,
            r.gb_per_s,
            r.ops_per_s,
            r.p50_us,
            r.p99_us,
            r.persist_us_per_transfer
                .map_or_else(|| "-".into(), |p| format!("{p:.1}"))
        );
        for rail in &r.rails {
            println!(
                "  rail {:<12} {:>14} bytes {:>6} errors{}",
                rail.name,
                rail.bytes,
                rail.errors,
                if rail.healthy { "" } else { " (resting)" }
            );
        }
    }
}

/// The process's peak resident set (VmHWM), in bytes; 0 where /proc is not there.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// `0..n` in an order fixed by `seed` (Fisher–Yates over a xorshift sequence), so that runs compare.
fn shuffled(n: usize, seed: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..n as u64).collect();
    let mut state = seed | 1;
    for i in (1..n).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        order.swap(i, (state % (i as u64 + 1)) as usize);
    }
    order
}

#[cfg(test)]
mod scatter_tests {
    use super::shuffled;

    #[test]
    fn shuffled_is_a_permutation_that_scatters() {
        let order = shuffled(256, 7);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..256).collect::<Vec<_>>());
        let adjacent = order.windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(adjacent < 8, "{adjacent} neighbours stayed adjacent");
        assert_eq!(shuffled(256, 7), order, "the same seed gives the same order");
    }
}
