//! `ferry info`: the transports and devices this build can use on this host; with `--peer`, the link
//! to a running engine (its transport and how it makes persistent writes persistent); with `--file`,
//! how a persistent region on that file would be mapped and flushed.

use std::time::Duration;

use anyhow::Context;
use ferry::{Access, Engine};
use serde::Serialize;

use crate::tls::TlsArgs;

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Connect to the engine at "host:port" and describe the link.
    #[arg(long)]
    peer: Option<String>,
    /// With --peer: the data paths the link may take, "any" or transports ("rdma", "shm,rdma"); a
    /// link that can take none of them is an error that says why for each.
    #[arg(long, default_value = "any", value_name = "POLICY")]
    path_policy: ferry::PathPolicy,
    /// Map this file (or device-DAX device) as a persistent region and say how writes to it persist.
    #[arg(long)]
    file: Option<std::path::PathBuf>,
    /// Authenticate to the peer with mutual TLS.
    #[command(flatten)]
    tls: TlsArgs,
}

#[derive(Serialize)]
struct Link {
    peer: String,
    /// "mutual TLS" or "none".
    authentication: &'static str,
    /// The name in the peer's certificate, on an authenticated link.
    peer_identity: Option<String>,
    transport: String,
    /// Better transports both ends offer that could not be used, with why ("shm: …").
    passed_over: Vec<String>,
    persist_method: String,
    tcp_streams: usize,
    regions: usize,
    persistent_regions: usize,
    /// How transfers to each of the peer's regions travel.
    routes: Vec<RegionRoute>,
}

/// How transfers to one of the peer's regions travel (`Peer::routes`).
#[derive(Serialize)]
struct RegionRoute {
    /// The region's address as the peer names it to this engine.
    addr: u64,
    len: u64,
    transport: String,
    how: String,
    /// Why the link's better path does not carry it, where it does not.
    passed_over: Option<String>,
}

#[derive(Serialize)]
struct FileInfo {
    path: String,
    kind: String,
    mapped_bytes: u64,
}

#[derive(Serialize)]
struct Report {
    #[serde(flatten)]
    capabilities: ferry::Capabilities,
    #[serde(skip_serializing_if = "Option::is_none")]
    link: Option<Link>,
    #[serde(skip_serializing_if = "Option::is_none")]
    file: Option<FileInfo>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let link = match &args.peer {
        Some(addr) => Some(link(addr, &args.tls, &args.path_policy).await?),
        None => None,
    };
    let file = match &args.file {
        Some(path) => Some(file(path).await?),
        None => None,
    };
    let report = Report {
        capabilities: ferry::capabilities(),
        link,
        file,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let caps = &report.capabilities;
    println!("ferry {} (protocol {})", caps.version, caps.protocol_version);
    println!("{:<6} {:<9} {:<7} detail", "name", "compiled", "usable");
    for t in &caps.transports {
        println!("{:<6} {:<9} {:<7} {}", t.name, yes(t.compiled), yes(t.usable), t.detail);
    }
    println!("rdma devices:   {}", list(&caps.rdma_devices));
    for rail in &caps.rdma_rails {
        let node = rail.numa_node.map_or("none".to_string(), |n| n.to_string());
        let nodes: Vec<String> = rail.preferred_for.iter().map(u32::to_string).collect();
        println!(
            "rdma rail {}: NUMA node {node} ({}), PCI {}, preferred for memory on node(s) {} and of device(s) {}",
            rail.device,
            rail.source,
            rail.pci_address.as_deref().unwrap_or("none"),
            list(&nodes),
            list(&rail.preferred_for_devices)
        );
    }
    let vulkan: Vec<String> = caps.vulkan_devices.iter().map(|d| d.to_string()).collect();
    println!("vulkan devices: {}", list(&vulkan));
    print_cuda(&caps.cuda);
    if let Some(l) = &report.link {
        println!(
            "link to {}: {} ({} TCP streams), persistent writes by {}; {} regions, {} persistent",
            l.peer, l.transport, l.tcp_streams, l.persist_method, l.regions, l.persistent_regions
        );
        for why in &l.passed_over {
            println!("not used: {why}");
        }
        for r in &l.routes {
            println!("  region {:#x} ({} bytes): {}, {}", r.addr, r.len, r.transport, r.how);
            if let Some(why) = &r.passed_over {
                println!("    not by the link's best path: {why}");
            }
        }
        match &l.peer_identity {
            Some(name) => println!("authentication: mutual TLS, the peer is {name}"),
            None => println!("authentication: none (the peer admits anyone who reaches it)"),
        }
    }
    if let Some(f) = &report.file {
        println!("file {}: {} ({} bytes mapped)", f.path, f.kind, f.mapped_bytes);
    }
    Ok(())
}

async fn link(addr: &str, tls: &TlsArgs, policy: &ferry::PathPolicy) -> anyhow::Result<Link> {
    let mut builder = Engine::builder();
    if let Some(tls) = tls.config()? {
        builder = builder.tls(tls);
    }
    let engine = builder.build().await.context("starting an engine")?;
    let peer = engine
        .connect_with(addr, Duration::from_secs(5), policy)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    let regions = peer.regions();
    Ok(Link {
        peer: addr.to_string(),
        authentication: if peer.identity().is_some() {
            "mutual TLS"
        } else {
            "none"
        },
        peer_identity: peer.identity().map(|i| i.name.clone()),
        transport: peer.transport().to_string(),
        passed_over: peer
            .passed_over()
            .iter()
            .map(|(k, why)| format!("{k}: {why}"))
            .collect(),
        persist_method: peer.persist_method().to_string(),
        tcp_streams: peer.tcp_streams(),
        regions: regions.len(),
        persistent_regions: regions.iter().filter(|r| r.persistent).count(),
        routes: peer
            .routes()
            .into_iter()
            .map(|(ad, route)| RegionRoute {
                addr: ad.addr,
                len: ad.len,
                transport: route.transport.to_string(),
                how: route.how,
                passed_over: route.passed_over,
            })
            .collect(),
    })
}

async fn file(path: &std::path::Path) -> anyhow::Result<FileInfo> {
    // The first 2 MiB at most (device DAX maps in 2 MiB pages); nothing is written.
    let size = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    let len = if size == 0 { 2 << 20 } else { size.min(2 << 20) & !4095 };
    anyhow::ensure!(len > 0, "{} is shorter than a page", path.display());
    let engine = Engine::builder().build().await.context("starting an engine")?;
    let region = engine
        .register_file(path, 0, len as usize, Access::READ)
        .with_context(|| format!("mapping {}", path.display()))?;
    Ok(FileInfo {
        path: path.display().to_string(),
        kind: region.kind().to_string(),
        mapped_bytes: region.len(),
    })
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn list(v: &[String]) -> String {
    if v.is_empty() { "none".into() } else { v.join(", ") }
}

/// The CUDA line: the driver and each device with what it offers, or why there is none.
fn print_cuda(cuda: &ferry::CudaReport) {
    match (&cuda.unavailable, &cuda.driver_version) {
        (Some(why), _) => println!("cuda:           not usable: {why}"),
        (None, version) => println!(
            "cuda:           driver {}; device memory {}",
            version.as_deref().unwrap_or("?"),
            cuda.paths
        ),
    }
    #[cfg(feature = "cuda")]
    for d in &cuda.devices {
        println!(
            "cuda device {}: {} (PCI {}, {} MiB, compute {}): unified addressing {}, GPUDirect RDMA {}, dma-buf {}, \
             VMM {} (fd handles {})",
            d.ordinal,
            d.name,
            d.pci_address,
            d.memory_bytes >> 20,
            d.compute_capability,
            yes(d.unified_addressing),
            yes(d.gpudirect_rdma),
            yes(d.dma_buf),
            yes(d.vmm),
            yes(d.posix_fd_handles)
        );
    }
}
