//! `ferry serve`: a target engine with one registered region, until interrupted.

use anyhow::Context;
use ferry::{Access, Engine};

use crate::units::{format_size, parse_size};

#[derive(clap::Args)]
pub struct Args {
    /// Address to listen on, "ip:port".
    #[arg(long, default_value = "0.0.0.0:9955")]
    listen: String,
    /// Size of the region to register (readable and writable by peers).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    region_size: u64,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let engine = Engine::builder()
        .listen(&args.listen)
        .build()
        .await
        .context("starting the engine")?;
    let len = usize::try_from(args.region_size).context("region size does not fit this machine")?;
    let region = engine
        .alloc_host(len, Access::READ_WRITE)
        .context("allocating the region")?;
    let addr = engine.local_addr().context("the engine has no listen address")?;
    // One line a script can wait for.
    println!(
        "listening on {addr} region {:#x} {}",
        region.addr(),
        format_size(region.len())
    );
    tokio::signal::ctrl_c().await.context("waiting for Ctrl-C")?;
    drop(region);
    Ok(())
}
