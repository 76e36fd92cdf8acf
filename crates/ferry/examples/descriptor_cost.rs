//! What registering and resolving cost, with many regions: registers 10,000 regions of 64 KiB and one
//! of 1 GiB (time per region and per GiB, with every transport this build has), then resolves a batch
//! of 15,000 descriptors of 4 KiB against one local region and against the 10,000 (time per
//! descriptor: a lookup is O(log n) in the regions), and posts the batch prepared once and resolved
//! each time. Prints one JSON line.
//!
//! Run it with `cargo run --release -p ferry --example descriptor_cost` (add `--features rdma` to
//! include the NIC's registration where a device is present).

use std::time::{Duration, Instant};

use ferry::{Access, Engine, Op, TransferDesc};

const REGIONS: usize = 10_000;
const REGION_LEN: usize = 64 << 10;
const DESCS: usize = 15_000;
const BLOCK: u64 = 4096;
const T: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> ferry::Result<()> {
    let target = Engine::builder().listen("127.0.0.1:0").build().await?;
    let remote = target.alloc_host(DESCS * BLOCK as usize, Access::READ_WRITE)?;
    let addr = target
        .local_addr()
        .ok_or_else(|| ferry::Error::InvalidArgument("the target does not listen".into()))?;
    let engine = Engine::builder().build().await?;
    let peer = engine.connect(&addr.to_string(), T).await?;

    // The memory first (allocating and touching it is the application's cost), then the registrations.
    let memory: &'static mut [u8] = Box::leak(vec![1u8; REGIONS * REGION_LEN].into_boxed_slice());
    let base = memory.as_mut_ptr();
    let started = Instant::now();
    let mut many = Vec::with_capacity(REGIONS);
    for i in 0..REGIONS {
        // SAFETY: each region is its own 64 KiB of a leaked buffer that lives for the whole program
        // and is reached only through the engine.
        many.push(unsafe { engine.register_raw(base.add(i * REGION_LEN), REGION_LEN, Access::READ_WRITE) }?);
    }
    let per_region_us = started.elapsed().as_secs_f64() * 1e6 / REGIONS as f64;

    let started = Instant::now();
    let big = engine.alloc_host(1 << 30, Access::READ_WRITE)?;
    let per_gib_ms = started.elapsed().as_secs_f64() * 1e3;

    // The same remote side; the local side in one region, or spread over the 10,000.
    let one_region: Vec<TransferDesc> = (0..DESCS as u64)
        .map(|i| TransferDesc::new(big.addr_at(i * BLOCK), remote.addr_at(i * BLOCK), BLOCK))
        .collect();
    let spread: Vec<TransferDesc> = (0..DESCS as u64)
        .map(|i| {
            let r = &many[(i as usize * 7919) % REGIONS];
            TransferDesc::new(r.addr_at((i % 16) * BLOCK), remote.addr_at(i * BLOCK), BLOCK)
        })
        .collect();
    let resolve_ns = |descs: &[TransferDesc]| -> ferry::Result<f64> {
        const ROUNDS: u32 = 20;
        let started = Instant::now();
        for _ in 0..ROUNDS {
            std::hint::black_box(engine.prepare(&peer, Op::Write, descs)?);
        }
        Ok(started.elapsed().as_secs_f64() * 1e9 / (ROUNDS as f64 * descs.len() as f64))
    };
    let one_region_ns = resolve_ns(&one_region)?;
    let spread_ns = resolve_ns(&spread)?;

    // Posting: resolved on every transfer, or prepared once.
    const POSTS: u32 = 10;
    let started = Instant::now();
    for _ in 0..POSTS {
        engine.transfer(&peer, Op::Write, &spread, T).await?;
    }
    let resolved_each_ms = started.elapsed().as_secs_f64() * 1e3 / POSTS as f64;
    let prepared = engine.prepare(&peer, Op::Write, &spread)?;
    let started = Instant::now();
    for _ in 0..POSTS {
        engine.transfer_prepared(&prepared, T).await?;
    }
    let prepared_ms = started.elapsed().as_secs_f64() * 1e3 / POSTS as f64;

    println!(
        "{{\"case\":\"descriptor_cost\",\"transport\":\"{}\",\"regions\":{REGIONS},\"register_us_per_region\":{per_region_us:.2},\
         \"register_ms_per_gib\":{per_gib_ms:.1},\"resolve_ns_per_desc_one_region\":{one_region_ns:.1},\
         \"resolve_ns_per_desc_10000_regions\":{spread_ns:.1},\"transfer_ms_15000x4KiB_resolved\":{resolved_each_ms:.2},\
         \"transfer_ms_15000x4KiB_prepared\":{prepared_ms:.2}}}",
        peer.transport()
    );
    Ok(())
}
