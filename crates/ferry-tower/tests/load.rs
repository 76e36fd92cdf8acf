//! 64 concurrent callers × 1,000 writes of 4 KiB through one middleware stack: no errors, every final
//! write at the target, and the peak RSS printed for the record.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Access, Engine};
use ferry_tower::tower::{ServiceBuilder, ServiceExt};
use ferry_tower::{Descriptor, PoolConfig, RetryPolicy, TransferRequest, TransferService, into_ferry_error};

const CALLERS: usize = 64;
const PER_CALLER: usize = 1000;
const SIZE: usize = 4096;
/// Each caller rotates through this many remote blocks of its own.
const BLOCKS: usize = 16;

fn pattern(caller: usize, i: usize) -> Vec<u8> {
    let seed = (caller * 7919 + i * 104_729) as u64;
    (0..SIZE)
        .map(|b| (seed.wrapping_mul(6364136223846793005).wrapping_add(b as u64) >> 7) as u8 ^ b as u8)
        .collect()
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_callers_share_one_stack() {
    let target = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let dst = target.alloc_host(CALLERS * BLOCKS * SIZE, Access::READ_WRITE).unwrap();
    let addr = target.local_addr().unwrap();

    let engine = Engine::builder().build().await.unwrap();
    let src = Arc::new(engine.alloc_host(CALLERS * SIZE, Access::READ_WRITE).unwrap());
    let transfers = TransferService::with_config(engine.clone(), PoolConfig::default()).unwrap();
    let stats = transfers.clone();
    let service = ServiceBuilder::new()
        .map_err(into_ferry_error)
        .load_shed()
        .concurrency_limit(256)
        .timeout(Duration::from_secs(60))
        .retry(RetryPolicy::default())
        .timeout(Duration::from_secs(10))
        .service(transfers);

    let started = Instant::now();
    let callers: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let service = service.clone();
            let src = src.clone();
            tokio::spawn(async move {
                let local = (caller * SIZE) as u64;
                for i in 0..PER_CALLER {
                    src.write_at(local, &pattern(caller, i)).unwrap();
                    let remote = ((caller * BLOCKS + i % BLOCKS) * SIZE) as u64;
                    let req =
                        TransferRequest::write(addr, [Descriptor::at_offset(src.addr_at(local), remote, SIZE as u64)]);
                    let resp = service.clone().oneshot(req).await;
                    let resp = resp.unwrap_or_else(|e| panic!("caller {caller}, write {i}: {e:?}"));
                    assert_eq!(resp.bytes, SIZE as u64);
                }
            })
        })
        .collect();
    for c in callers {
        tokio::time::timeout(Duration::from_secs(600), c)
            .await
            .expect("a caller hung")
            .unwrap();
    }
    let elapsed = started.elapsed();

    // The last BLOCKS writes of each caller are what its blocks hold now.
    let mut got = vec![0u8; SIZE];
    for caller in 0..CALLERS {
        for i in PER_CALLER - BLOCKS..PER_CALLER {
            dst.read_at(((caller * BLOCKS + i % BLOCKS) * SIZE) as u64, &mut got)
                .unwrap();
            assert!(
                got == pattern(caller, i),
                "caller {caller}, write {i} is not at the target"
            );
        }
    }
    let s = stats.stats();
    assert_eq!((s.connects, s.links_dropped, s.in_flight), (1, 0, 0), "{s:?}");
    let total = CALLERS * PER_CALLER;
    println!(
        "load: {total} writes of {SIZE} B by {CALLERS} callers in {elapsed:?} ({:.0} ops/s), 0 errors, \
         peak RSS {} KiB (VmHWM)",
        total as f64 / elapsed.as_secs_f64(),
        peak_rss_kib().map_or("unknown".to_string(), |k| k.to_string())
    );
}
