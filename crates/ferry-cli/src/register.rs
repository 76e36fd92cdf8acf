//! `ferry register-cost`: what registering memory costs on this host's transports, per region and per
//! GiB. The memory is allocated and touched first (an application registers memory it filled), then
//! timed while the engine registers it as regions of `--size`, then while it deregisters them.
//! `--pages huge` asks the kernel for transparent huge pages on that memory first (`MADV_HUGEPAGE`):
//! a NIC then pins and maps one 2 MiB page where it would take 512 small ones; `--pages small` forbids
//! them (`MADV_NOHUGEPAGE`); by default the kernel's setting decides.

use std::time::Instant;

use anyhow::{Context, bail};
use ferry::{Access, Engine, TransportKind};
use serde::Serialize;

use crate::units::{format_size, parse_size};

#[derive(clap::Args)]
pub struct Args {
    /// Transport whose registration to measure (with RDMA, every rail the engine opens registers).
    #[arg(long, default_value = "rdma")]
    transport: String,
    /// Regions to register.
    #[arg(long, default_value_t = 1000)]
    regions: usize,
    /// Bytes per region (4KiB, 64KiB, 1GiB…).
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    size: u64,
    /// Back the memory with transparent huge pages (`huge`, where the kernel allows them) or only
    /// with small pages (`small`); the kernel's setting decides when omitted.
    #[arg(long, value_parser = ["huge", "small"])]
    pages: Option<String>,
    /// Print one JSON object instead of a line.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    rdma: crate::rdma::RdmaArgs,
}

#[derive(Serialize)]
struct Report {
    transport: String,
    rails: usize,
    regions: usize,
    size: u64,
    pages: String,
    /// Bytes of the memory the kernel backs with huge pages (`AnonHugePages` of its mapping).
    huge_bytes: u64,
    register_s: f64,
    per_region_us: f64,
    per_gib_ms: f64,
    deregister_s: f64,
}

/// Anonymous memory, mapped for the run and unmapped at its end.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping belongs to the process, not to a thread; this type only hands out its address
// (to the engine) and unmaps it once, in `drop`.
unsafe impl Send for Mapping {}

impl Mapping {
    fn new(len: usize, pages: Option<&str>) -> anyhow::Result<Self> {
        // SAFETY: a fresh private anonymous mapping; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            bail!(
                "mapping {}: {}",
                format_size(len as u64),
                std::io::Error::last_os_error()
            );
        }
        let mapping = Mapping { ptr: ptr.cast(), len };
        let advice = match pages {
            Some("huge") => Some(libc::MADV_HUGEPAGE),
            Some(_) => Some(libc::MADV_NOHUGEPAGE),
            None => None,
        };
        // SAFETY: advice on the mapping just made, of its own length.
        if let Some(advice) = advice
            && unsafe { libc::madvise(ptr, len, advice) } != 0
        {
            bail!(
                "advising {:?} pages: {} (is /sys/kernel/mm/transparent_hugepage/enabled `never`?)",
                pages,
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: `len` writable bytes of the mapping.
        unsafe { std::ptr::write_bytes(mapping.ptr, 1, len) };
        Ok(mapping)
    }

    /// Bytes of the mapping backed by huge pages, from `/proc/self/smaps`.
    fn huge_bytes(&self) -> u64 {
        let start = format!("{:x}-", self.ptr as usize);
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return 0;
        };
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
        lines.next();
        // The mapping's own fields ("Name:   value"), up to the next mapping's header line.
        lines
            .take_while(|l| l.split_whitespace().next().is_some_and(|w| w.ends_with(':')))
            .find_map(|l| l.strip_prefix("AnonHugePages:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb << 10)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; every region over it was deregistered before (the
        // report is built after `deregister` returned).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let want: TransportKind = args.transport.parse()?;
    if args.regions == 0 || args.size == 0 {
        bail!("--regions and --size must be at least 1");
    }
    let len = usize::try_from(args.size)
        .ok()
        .and_then(|s| s.checked_mul(args.regions))
        .context("--regions × --size does not fit in memory")?;
    let engine = args
        .rdma
        .apply(Engine::builder().transports([want]))?
        .build()
        .await
        .context("starting the engine")?;
    if !engine.transports().contains(&want) {
        bail!("{want} is not usable here (see `ferry info`)");
    }
    let rails = ferry::capabilities().rdma_rails.len().max(1);
    let memory = Mapping::new(len, args.pages.as_deref())?;
    let huge_bytes = memory.huge_bytes();

    let started = Instant::now();
    let mut regions = Vec::with_capacity(args.regions);
    for i in 0..args.regions {
        // SAFETY: region `i` is its own `size` bytes of `memory`, which outlives every region: they
        // are deregistered below, before `memory` is dropped.
        let region = unsafe {
            engine.register_raw(
                memory.ptr.add(i * args.size as usize),
                args.size as usize,
                Access::READ_WRITE,
            )
        }
        .with_context(|| format!("registering region {i}"))?;
        regions.push(region);
    }
    let register_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    for region in regions {
        region.deregister().await.context("deregistering")?;
    }
    let deregister_s = started.elapsed().as_secs_f64();

    let report = Report {
        transport: want.to_string(),
        rails: if want == TransportKind::Rdma { rails } else { 1 },
        regions: args.regions,
        size: args.size,
        pages: args.pages.clone().unwrap_or_else(|| "default".into()),
        huge_bytes,
        register_s,
        per_region_us: register_s * 1e6 / args.regions as f64,
        per_gib_ms: register_s * 1e3 / (len as f64 / f64::from(1u32 << 30)),
        deregister_s,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} regions of {} over {} ({} rail(s), {} in huge pages): {:.1} µs per region, {:.0} ms per GiB; \
             deregistering {:.3} s",
            report.regions,
            format_size(report.size),
            report.transport,
            report.rails,
            format_size(report.huge_bytes),
            report.per_region_us,
            report.per_gib_ms,
            report.deregister_s
        );
    }
    Ok(())
}
