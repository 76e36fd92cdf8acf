//! `ferry serve`: a target engine with one registered region, until interrupted: host memory, or with
//! `--file` a persistent region on that file (writes to it may ask for durability persistent); with
//! `--metrics ADDR`, its Prometheus metrics at `http://ADDR/metrics`.

use anyhow::Context;
use ferry::{Access, Engine};

use crate::tls::TlsArgs;
use crate::units::{format_size, parse_size};

#[derive(clap::Args)]
pub struct Args {
    /// Address to listen on, "ip:port".
    #[arg(long, default_value = "0.0.0.0:9955")]
    listen: String,
    /// Size of the region to register (readable and writable by peers).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    region_size: u64,
    /// Register this file (or device-DAX device) as a persistent region of --region-size bytes
    /// instead of host memory; a regular file is extended to that size.
    #[arg(long)]
    file: Option<std::path::PathBuf>,
    /// Register memory this process allocates itself (as `Engine::register` does) instead of an
    /// engine allocation: peers on this host then reach it by cross-memory attach, never through a
    /// mapping of it.
    #[arg(long, conflicts_with = "file")]
    caller_owned: bool,
    /// Where the region lives: host memory, or cuda (device memory of CUDA device 0, which
    /// `CUDA_VISIBLE_DEVICES` picks; peers of this host open it by its CUDA IPC handle, others reach
    /// it staged).
    #[arg(long, default_value = "host", value_parser = ["host", "cuda"], conflicts_with_all = ["file", "caller_owned"])]
    mem: String,
    /// Declare this host ADR with DDIO off, so that RDMA initiators may persist by a READ after
    /// their writes. Never assumed; a wrong declaration loses data on power loss.
    #[arg(long)]
    adr_without_ddio: bool,
    #[command(flatten)]
    tls: TlsArgs,
    /// With TLS: let the peer whose certificate carries this name read and write the region; repeat
    /// for more. Without --grant or --grant-all no peer may reach it.
    #[arg(long = "grant")]
    grants: Vec<String>,
    /// With TLS: let every authenticated peer read and write the region.
    #[arg(long)]
    grant_all: bool,
    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// Publish the engine under this name in the --directory.
    #[arg(long, requires = "directory")]
    name: Option<String>,
    #[command(flatten)]
    directory: crate::directory::DirectoryArgs,
    #[command(flatten)]
    rdma: crate::rdma::RdmaArgs,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let tls = args.tls.config()?;
    let authenticated = tls.is_some();
    anyhow::ensure!(
        authenticated || (args.grants.is_empty() && !args.grant_all),
        "--grant and --grant-all need authentication (--tls-cert/--tls-key/--tls-ca or --tls-psk-file): \
         without it every peer reaches the region"
    );
    let mut builder = args.rdma.apply(
        Engine::builder()
            .listen(&args.listen)
            .adr_without_ddio(args.adr_without_ddio),
    )?;
    if let Some(tls) = tls {
        builder = builder.tls(tls);
    }
    let mut registry = ferry::prometheus_client::registry::Registry::default();
    let scrapes = match &args.metrics {
        Some(addr) => {
            builder = builder.metrics(&mut registry);
            Some(crate::metrics_http::bind(addr).await?)
        }
        None => None,
    };
    match (&args.name, args.directory.connect().await?) {
        (Some(name), Some(directory)) => builder = builder.name(name).directory(directory),
        (None, Some(_)) => anyhow::bail!("--directory needs --name: the name to publish the engine under"),
        _ => {}
    }
    let engine = builder.build().await.context("starting the engine")?;
    let mut metrics_note = String::new();
    if let Some(listener) = scrapes {
        metrics_note = format!(" metrics http://{}/metrics", listener.local_addr()?);
        tokio::spawn(crate::metrics_http::serve(listener, std::sync::Arc::new(registry)));
    }
    let len = usize::try_from(args.region_size).context("region size does not fit this machine")?;
    let region = match &args.file {
        None if args.mem == "cuda" => crate::bench::cuda_region(&engine, len, true)?,
        None if args.caller_owned => engine
            .register(vec![0u8; len], Access::READ_WRITE)
            .context("registering the region")?,
        None => engine
            .alloc_host(len, Access::READ_WRITE)
            .context("allocating the region")?,
        Some(path) => {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?;
            let meta = file.metadata()?;
            if meta.is_file() && meta.len() < args.region_size {
                file.set_len(args.region_size)
                    .with_context(|| format!("extending {}", path.display()))?;
            }
            let region = engine
                .register_file(path, 0, len, Access::READ_WRITE)
                .with_context(|| format!("registering {}", path.display()))?;
            eprintln!("persistent region: {} on {}", region.kind(), path.display());
            region
        }
    };
    let addr = engine.local_addr().context("the engine has no listen address")?;
    if authenticated {
        for name in &args.grants {
            region.grant(name, Access::READ_WRITE).await?;
        }
        if args.grant_all {
            region.grant_all(Access::READ_WRITE).await?;
        }
        let who = match (args.grant_all, args.grants.is_empty()) {
            (true, _) => "every peer with a certificate from the given CA".to_string(),
            (false, false) => args.grants.join(", "),
            (false, true) => "no peer yet (give --grant NAME or --grant-all)".to_string(),
        };
        eprintln!("authentication: mutual TLS; the region is granted to {who}");
        // Each peer knows the region by an address of its own: what to hand a peer out of band.
        for name in &args.grants {
            eprintln!("peer {name} knows the region at {:#x}", region.addr_for(name));
        }
    } else {
        eprintln!(
            "WARNING: authentication is off: anyone who can reach {addr} can read and overwrite this region \
             (start with --tls-cert, --tls-key and --tls-ca to admit only peers with certificates)"
        );
    }
    // One line a script can wait for. With authentication each peer has its own address for the
    // region, which it learns when it connects.
    let shown = match authenticated {
        true => "per-peer".to_string(),
        false => format!("{:#x}", region.addr()),
    };
    println!(
        "listening on {addr} region {shown} {}{metrics_note}",
        format_size(region.len())
    );
    // Nobody reads notifications here: log and drop them, so that they hold no memory.
    let mut notifications = engine.notifications();
    tokio::spawn(async move {
        use futures::StreamExt;
        while let Some(n) = notifications.next().await {
            let from = n
                .from_identity
                .as_ref()
                .map_or(n.from_addr.as_str(), |i| i.name.as_str());
            tracing::info!(%from, name = %n.notification.name, "notification");
        }
    });
    tokio::signal::ctrl_c().await.context("waiting for Ctrl-C")?;
    drop(region);
    Ok(())
}
