//! One trial of the power-cut test (`cargo xtask rig powercut`), run inside the rig's guest.
//!
//! A target engine registers a file on the guest's ext4 disk; an initiator engine in the same process
//! writes `--ranges` pages with durability persistent and, interleaved, as many control pages with
//! durability completed, each page a pattern derived from `--seed`. When the last persistent write is
//! acknowledged it prints `powercut: ACK` and waits: the host kills the guest on that line and then
//! checks the disk image. Every persistent page must be there; the control pages, which nothing
//! flushed, should not all be.
//!
//! The file holds `2 * ranges` pages: persistent page `i` at page `i`, control page `i` at page
//! `ranges + i`, so that flushing one never flushes the other. `--pages-per-write N` puts N pages (one
//! descriptor each) in every transfer: from 32 on, a transfer spans several frames, which TCP persists
//! with one commit per stream after them.

use std::io::Write;
use std::time::Duration;

use ferry::{Access, Durability, Engine, Op, TransferDesc, TransportKind};

mod pattern;
use pattern::{PAGE, page};

const T: Duration = Duration::from_secs(60);

struct Args {
    file: String,
    transport: TransportKind,
    ranges: usize,
    seed: u64,
    listen: String,
    pages_per_write: usize,
    /// One descriptor for a transfer's pages (they are contiguous) rather than one per page.
    whole: bool,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        file: String::new(),
        transport: TransportKind::Tcp,
        ranges: 64,
        seed: 1,
        listen: "127.0.0.1:0".into(),
        pages_per_write: 1,
        whole: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--file" => args.file = value,
            "--transport" => args.transport = value.parse().map_err(|e| format!("{e}"))?,
            "--ranges" => args.ranges = value.parse().map_err(|e| format!("--ranges: {e}"))?,
            "--seed" => args.seed = value.parse().map_err(|e| format!("--seed: {e}"))?,
            "--listen" => args.listen = value,
            "--pages-per-write" => {
                args.pages_per_write = value.parse().map_err(|e| format!("--pages-per-write: {e}"))?
            }
            "--descriptors" => {
                args.whole = match value.as_str() {
                    "page" => false,
                    "write" => true,
                    other => return Err(format!("--descriptors: {other} is neither `page` nor `write`")),
                }
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    if args.file.is_empty() || args.ranges == 0 || args.pages_per_write == 0 {
        return Err(
            "usage: powercut --file PATH [--transport tcp|rdma] [--ranges N] [--seed S] [--listen IP:0] \
                    [--pages-per-write N] [--descriptors page|write]"
                .into(),
        );
    }
    Ok(args)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse()?;
    let transports = match args.transport {
        TransportKind::Tcp => vec![TransportKind::Tcp],
        other => vec![other, TransportKind::Tcp],
    };
    let len = 2 * args.ranges * PAGE;
    let target = Engine::builder()
        .listen(&args.listen)
        .transports(transports.clone())
        .build()
        .await?;
    let file = target.register_file(&args.file, 0, len, Access::READ_WRITE)?;
    let initiator = Engine::builder().transports(transports).build().await?;
    let addr = target.local_addr().ok_or("the target engine has no listen address")?;
    let peer = initiator.connect(&addr.to_string(), T).await?;
    if peer.transport() != args.transport {
        return Err(format!("asked for {} but the link uses {}", args.transport, peer.transport()).into());
    }
    println!(
        "powercut: transport={} method={} region={}",
        peer.transport(),
        peer.persist_method(),
        file.kind()
    );
    let src = initiator.alloc_host(len, Access::READ_WRITE)?;
    for i in 0..args.ranges {
        src.write_at((i * PAGE) as u64, &page(args.seed, i, false))?;
        src.write_at(((args.ranges + i) * PAGE) as u64, &page(args.seed, i, true))?;
    }
    for first in (0..args.ranges).step_by(args.pages_per_write) {
        let pages = first..(first + args.pages_per_write).min(args.ranges);
        for (base, durability) in [(args.ranges, Durability::Completed), (0, Durability::Persistent)] {
            let descs: Vec<TransferDesc> = match args.whole {
                // One range, which a target lands in the file itself once it is large enough.
                true => {
                    let off = ((base + pages.start) * PAGE) as u64;
                    vec![TransferDesc::new(
                        src.addr_at(off),
                        file.addr_at(off),
                        (pages.len() * PAGE) as u64,
                    )]
                }
                false => pages
                    .clone()
                    .map(|i| {
                        let off = ((base + i) * PAGE) as u64;
                        TransferDesc::new(src.addr_at(off), file.addr_at(off), PAGE as u64)
                    })
                    .collect(),
            };
            initiator
                .transfer_durable(&peer, Op::Write, &descs, durability, T)
                .await?;
        }
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "powercut: ACK ranges={}", args.ranges)?;
    out.flush()?;
    drop(out);
    // The host cuts the power now; whatever happens after this line must not matter.
    tokio::time::sleep(Duration::from_secs(3600)).await;
    Ok(())
}
