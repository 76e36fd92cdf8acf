//! A client that keeps working when its peers do not: ferry transfers through tower middleware
//! (connection pool, retries with backoff and a budget, deadlines, a concurrency limit, load shedding).
//!
//! It starts a target engine in this process, then:
//!
//! 1. 16 callers write 4 KiB blocks through one shared stack and the blocks are read back through it;
//! 2. a request outside the target's region fails with `OutOfBounds` at once (never retried);
//! 3. 100 concurrent requests to a port where nothing listens: those past the concurrency limit are
//!    shed at once (`ResourceExhausted`), the rest fail with `ConnectionRefused` after a few retries;
//!    the pool dials that address only a few times (reconnect backoff) and the retry budget caps the
//!    retries.
//!
//! Run it with `cargo run --release --example resilient_client`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferry::{Access, Engine};
use ferry_tower::tower::{ServiceBuilder, ServiceExt};
use ferry_tower::{
    DeadlineLayer, Descriptor, PoolConfig, RetryPolicy, TransferRequest, TransferService, into_ferry_error,
};

const CALLERS: u64 = 16;
const PER_CALLER: u64 = 500;
const BLOCK: u64 = 4096;

fn block(i: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|b| (i.wrapping_mul(131).wrapping_add(b * 7) >> 2) as u8)
        .collect()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The target: an engine that listens and registers one region.
    let target = Engine::builder().listen("127.0.0.1:0").build().await?;
    let region = target.alloc_host((CALLERS * PER_CALLER * BLOCK) as usize, Access::READ_WRITE)?;
    let peer = target.local_addr().ok_or("the target does not listen")?;

    // The client: one engine, one pool, one stack shared by every caller.
    let engine = Engine::builder().build().await?;
    let transfers = TransferService::with_config(engine.clone(), PoolConfig::default())?;
    let pool = transfers.clone();
    let attempts = Arc::new(AtomicUsize::new(0));
    let counted = attempts.clone();
    let service = ServiceBuilder::new()
        .map_err(into_ferry_error)
        .load_shed()
        .concurrency_limit(64)
        .layer(DeadlineLayer::new(Duration::from_secs(10)))
        .retry(RetryPolicy::default())
        .layer(DeadlineLayer::per_attempt(Duration::from_secs(2)))
        .map_request(move |r: TransferRequest| {
            counted.fetch_add(1, Ordering::Relaxed);
            r
        })
        .service(transfers);

    // 1. Writes from 16 callers, each block to its own offset.
    let src = Arc::new(engine.alloc_host((CALLERS * PER_CALLER * BLOCK) as usize, Access::READ_WRITE)?);
    let started = Instant::now();
    let callers: Vec<_> = (0..CALLERS)
        .map(|c| {
            let (service, src) = (service.clone(), src.clone());
            tokio::spawn(async move {
                let mut errors = BTreeMap::<String, u64>::new();
                for n in 0..PER_CALLER {
                    let i = c * PER_CALLER + n;
                    if let Err(e) = src.write_at(i * BLOCK, &block(i)) {
                        *errors.entry(format!("{:?}", e.code())).or_default() += 1;
                        continue;
                    }
                    let req =
                        TransferRequest::write(peer, [Descriptor::at_offset(src.addr_at(i * BLOCK), i * BLOCK, BLOCK)]);
                    if let Err(e) = service.clone().oneshot(req).await {
                        *errors.entry(format!("{:?}", e.code())).or_default() += 1;
                    }
                }
                errors
            })
        })
        .collect();
    let mut errors = BTreeMap::<String, u64>::new();
    for c in callers {
        for (k, v) in c.await? {
            *errors.entry(k).or_default() += v;
        }
    }
    let elapsed = started.elapsed();
    let total = CALLERS * PER_CALLER;
    println!(
        "writes:      {total} x {BLOCK} B from {CALLERS} callers in {elapsed:.2?}: {:.0} ops/s, {:.1} MiB/s, \
         errors {errors:?}",
        total as f64 / elapsed.as_secs_f64(),
        (total * BLOCK) as f64 / elapsed.as_secs_f64() / (1 << 20) as f64
    );

    // ... read back through the stack, 64 blocks per request, and compared.
    let back = engine.alloc_host((64 * BLOCK) as usize, Access::READ_WRITE)?;
    let mut bad = 0u64;
    let mut got = vec![0u8; BLOCK as usize];
    for first in (0..total).step_by(64) {
        let descs: Vec<_> = (first..(first + 64).min(total))
            .map(|i| Descriptor::at_offset(back.addr_at((i - first) * BLOCK), i * BLOCK, BLOCK))
            .collect();
        service.clone().oneshot(TransferRequest::read(peer, descs)).await?;
        for i in first..(first + 64).min(total) {
            back.read_at((i - first) * BLOCK, &mut got)?;
            bad += u64::from(got != block(i));
        }
    }
    println!("read back:   {total} blocks, {bad} differ");
    let mut direct = vec![0u8; BLOCK as usize];
    region.read_at(0, &mut direct)?;
    println!(
        "target:      block 0 as the target sees it is {}",
        if direct == block(0) { "intact" } else { "WRONG" }
    );

    // 2. A permanent error is returned at once.
    attempts.store(0, Ordering::Relaxed);
    let outside = TransferRequest::write(peer, [Descriptor::at_offset(src.addr(), region.len(), BLOCK)]);
    let err = service.clone().oneshot(outside).await.err();
    println!(
        "past the end: {:?} after {} attempt(s)",
        err.map(|e| e.code()),
        attempts.load(Ordering::Relaxed)
    );

    // 3. A dead peer, 100 requests at once: the concurrency limit sheds what exceeds it, the pool
    //    dials a few times (one dial per reconnect pause; the other attempts fail without touching the
    //    network), and the retry budget caps the retries (here it is funded by the 8,000 writes above:
    //    one retry per five recent requests).
    let dead = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    attempts.store(0, Ordering::Relaxed);
    let before = pool.stats().connect_failures;
    let started = Instant::now();
    let requests: Vec<_> = (0..100)
        .map(|_| {
            let req = TransferRequest::write(dead, [Descriptor::at_offset(src.addr(), 0, BLOCK)]);
            tokio::spawn(service.clone().oneshot(req))
        })
        .collect();
    let mut codes = BTreeMap::<String, u64>::new();
    for r in requests {
        if let Err(e) = r.await? {
            *codes.entry(format!("{:?}", e.code())).or_default() += 1;
        }
    }
    println!(
        "dead peer:   100 requests in {:.2?}: {codes:?}; {} attempts, {} dials",
        started.elapsed(),
        attempts.load(Ordering::Relaxed),
        pool.stats().connect_failures - before
    );
    println!("pool:        {:?}", pool.stats());
    if bad > 0 || !errors.is_empty() {
        return Err("some writes were lost or failed".into());
    }
    Ok(())
}
