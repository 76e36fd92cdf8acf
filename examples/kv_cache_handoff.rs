//! KV-cache hand-off from a prefill engine to a decode engine, as LLM-serving stacks do it.
//!
//! The decode side registers one buffer holding, per layer, a K and a V cache of `BLOCKS` blocks. The
//! prefill side computes its cache (here: a pattern that encodes layer, kind, block and byte), writes
//! every block of a layer into the decode side's memory in one batch, and notifies once per layer. The
//! decode side waits for each layer's notification and checks every byte of that layer, which it may
//! do because a notification is never seen before the data of the transfers that completed before it.
//!
//! Run it with `cargo run --release --example kv_cache_handoff` (both workers in one process), or as two
//! processes: `kv_cache_handoff --decode 127.0.0.1:7000` and `kv_cache_handoff --prefill 127.0.0.1:7000`
//! (on one host they use shared memory; `prefill` says which transport it got, and why not a better one).

use std::time::{Duration, Instant};

use ferry::{Access, Engine, Notification, Op, TransferDesc};
use futures::StreamExt;

const LAYERS: usize = 32;
const BLOCKS: usize = 64;
const BLOCK_BYTES: usize = 16 << 10; // 16 tokens x 8 heads x 64 dims x 2 bytes
const LAYER_BYTES: usize = 2 * BLOCKS * BLOCK_BYTES; // K and V
const TIMEOUT: Duration = Duration::from_secs(10);

/// The byte at `i` of block `block` of kind `kv` (0 = K, 1 = V) of layer `layer`.
fn cache_byte(layer: usize, kv: usize, block: usize, i: usize) -> u8 {
    (layer * 7 + kv * 13 + block * 31 + i * 3 + (i >> 8)) as u8
}

fn block_offset(layer: usize, kv: usize, block: usize) -> usize {
    layer * LAYER_BYTES + (kv * BLOCKS + block) * BLOCK_BYTES
}

/// Decode worker: listens at `listen`, registers its KV cache, and returns the address it listens on
/// and a task that checks each layer as soon as its notification arrives.
async fn decode_side(listen: &str) -> ferry::Result<(Engine, String, tokio::task::JoinHandle<ferry::Result<()>>)> {
    let decode = Engine::builder().listen(listen).build().await?;
    let kv_cache = decode.alloc_host(LAYERS * LAYER_BYTES, Access::READ_WRITE)?;
    let decode_addr = decode.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut notifications = decode.notifications();
    let checker = tokio::spawn(async move {
        for expected in 0..LAYERS {
            let n = notifications
                .next()
                .await
                .ok_or_else(|| ferry::Error::PeerClosed("no more notifications".into()))?;
            let layer: usize = n
                .notification
                .msg
                .parse()
                .map_err(|_| ferry::Error::Protocol("bad layer".into()))?;
            if layer != expected {
                return Err(ferry::Error::Protocol(format!(
                    "layer {layer} arrived before layer {expected}"
                )));
            }
            let mut got = vec![0u8; BLOCK_BYTES];
            for kv in 0..2 {
                for block in 0..BLOCKS {
                    kv_cache.read_at(block_offset(layer, kv, block) as u64, &mut got)?;
                    for (i, &b) in got.iter().enumerate() {
                        if b != cache_byte(layer, kv, block, i) {
                            return Err(ferry::Error::Protocol(format!(
                                "layer {layer} kv {kv} block {block} byte {i}: {b} is wrong"
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    });
    Ok((decode, decode_addr, checker))
}

/// Prefill worker: its own cache, filled by "prefill" in a different (shuffled) block order, as a paged
/// allocator would leave it; one batch per layer into the decode side's cache, then a notification.
async fn prefill_side(decode_addr: &str) -> ferry::Result<()> {
    let prefill = Engine::builder().build().await?;
    let staging = prefill.alloc_host(LAYERS * LAYER_BYTES, Access::READ_WRITE)?;
    let local_slot = |layer: usize, kv: usize, block: usize| {
        let shuffled = (block * 37 + 11) % BLOCKS;
        block_offset(layer, kv, shuffled)
    };
    for layer in 0..LAYERS {
        for kv in 0..2 {
            for block in 0..BLOCKS {
                let bytes: Vec<u8> = (0..BLOCK_BYTES).map(|i| cache_byte(layer, kv, block, i)).collect();
                staging.write_at(local_slot(layer, kv, block) as u64, &bytes)?;
            }
        }
    }
    let peer = prefill.connect(decode_addr, TIMEOUT).await?;
    println!("prefill connected to decode at {decode_addr} over {}", peer.transport());
    for (kind, why) in peer.passed_over() {
        println!("prefill: {kind} not used: {why}");
    }
    let remote_base = peer.regions().iter().next().map(|r| r.addr).unwrap_or_default();
    let started = Instant::now();
    for layer in 0..LAYERS {
        let mut descs = Vec::with_capacity(2 * BLOCKS);
        for kv in 0..2 {
            for block in 0..BLOCKS {
                descs.push(TransferDesc::new(
                    staging.addr_at(local_slot(layer, kv, block) as u64),
                    remote_base + block_offset(layer, kv, block) as u64,
                    BLOCK_BYTES as u64,
                ));
            }
        }
        prefill.transfer(&peer, Op::Write, &descs, TIMEOUT).await?;
        prefill
            .notify(&peer, Notification::new("kv-layer-ready", layer.to_string()), TIMEOUT)
            .await?;
    }
    let elapsed = started.elapsed();
    let total = LAYERS * LAYER_BYTES;
    println!(
        "handed off {LAYERS} layers x {} blocks x {} KiB = {} MiB in {elapsed:.2?} ({:.2} GB/s)",
        2 * BLOCKS,
        BLOCK_BYTES >> 10,
        total >> 20,
        total as f64 / elapsed.as_secs_f64() / 1e9
    );
    Ok(())
}

async fn confirmed(checker: tokio::task::JoinHandle<ferry::Result<()>>) -> ferry::Result<()> {
    tokio::time::timeout(TIMEOUT, checker)
        .await
        .map_err(|_| ferry::Error::Timeout("decode did not confirm every layer".into()))?
        .map_err(|e| ferry::Error::Protocol(format!("the decode checker failed: {e}")))??;
    println!("decode: every byte of {LAYERS} layers checked");
    Ok(())
}

#[tokio::main]
async fn main() -> ferry::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        // Both workers in this process.
        [] => {
            let (_decode, addr, checker) = decode_side("127.0.0.1:0").await?;
            prefill_side(&addr).await?;
            confirmed(checker).await
        }
        // Two processes: start the decode side, then the prefill side with the address it prints.
        ["--decode", listen] => {
            let (_decode, addr, checker) = decode_side(listen).await?;
            println!("decode listening on {addr}");
            confirmed(checker).await
        }
        ["--prefill", addr] => prefill_side(addr).await,
        _ => Err(ferry::Error::InvalidArgument(
            "usage: kv_cache_handoff [--decode LISTEN | --prefill DECODE_ADDR]".into(),
        )),
    }
}
