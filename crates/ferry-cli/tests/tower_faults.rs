//! ferry-tower's middleware under a fault that needs a real process: the target (`ferry serve`) is
//! killed with SIGKILL in the middle of a stream of writes and restarted on the same port. Requests in
//! flight fail with transient errors or succeed through retries, every request after the service
//! reaches the new process succeeds, and every write acknowledged by the new process is there when
//! read back through the service. (The silent target and its retry budget are in ferry-tower's own
//! tests.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Access, Engine};
use ferry_tower::{PoolConfig, RetryConfig, RetryPolicy, TransferService, is_transient_ferry};

mod common;
use common::Serve;
use common::stream::{REGION, WriteStream, read_back, stack};

/// Bound on any single request through the stack, retries included (the stack's own deadline is
/// 15 s); past it the test calls the request hung.
const HANG: Duration = Duration::from_secs(30);

/// Starts `ferry serve` on `listen`; `None` if it exits before saying it listens (port still taken).
fn serve(listen: &str) -> Option<Serve> {
    common::start(common::serve_command(listen, "64MiB"))
}

fn serve_on(listen: &str) -> Serve {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = serve(listen) {
            return s;
        }
        assert!(Instant::now() < deadline, "ferry serve never listened on {listen}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_killed_and_restarted_mid_stream() {
    let first = serve_on("127.0.0.1:0");
    let addr = first.addr;
    let engine = Engine::builder().build().await.unwrap();
    // One local block per request, so that no attempt ever reads bytes meant for another request.
    let src = Arc::new(engine.alloc_host(REGION as usize, Access::READ_WRITE).unwrap());
    let transfers = TransferService::with_config(
        engine.clone(),
        PoolConfig {
            reconnect_backoff_max: Duration::from_millis(200),
            ..PoolConfig::default()
        },
    )
    .unwrap();
    let pool = transfers.clone();
    let policy = RetryPolicy::new(RetryConfig {
        max_retries: 20,
        backoff_min: Duration::from_millis(10),
        backoff_max: Duration::from_millis(300),
        budget_min_per_sec: 50,
        budget_retry_ratio: 0.5,
        ..RetryConfig::default()
    })
    .unwrap();
    let service = stack(transfers, policy, Duration::from_secs(15), Duration::from_secs(2));
    let writes = WriteStream::start(service.clone(), src, addr, 4, HANG);
    writes
        .wait_for("100 writes before the kill", |o| {
            o.iter().filter(|o| o.result.is_ok()).count() >= 100
        })
        .await;
    let mut first = first;
    first.child.kill().unwrap(); // SIGKILL
    first.child.wait().unwrap();
    let killed_at = Instant::now();
    // Let the stream run into the dead target for a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let restarted_at = Instant::now();
    let second = tokio::task::spawn_blocking(move || serve_on(&addr.to_string()))
        .await
        .unwrap();
    assert_eq!(second.addr, addr);

    writes
        .wait_for("200 writes acknowledged by the restarted target", |o| {
            o.iter()
                .filter(|o| o.result.is_ok() && o.finished > restarted_at)
                .count()
                >= 200
        })
        .await;
    let outcomes = writes.stop().await;
    let errors: Vec<_> = outcomes.iter().filter_map(|o| o.result.as_ref().err()).collect();
    for e in &errors {
        assert!(
            is_transient_ferry(e),
            "a request failed with a non-transient error: {e:?}"
        );
    }
    // Once the service reached the new process, every request succeeded.
    let back_at = outcomes
        .iter()
        .filter(|o| o.result.is_ok() && o.finished > restarted_at)
        .map(|o| o.finished)
        .min()
        .expect("writes after the restart");
    for o in outcomes.iter().filter(|o| o.started > back_at) {
        assert!(
            o.result.is_ok(),
            "request {} failed after the target was back: {:?}",
            o.index,
            o.result
        );
    }
    let around_kill = outcomes
        .iter()
        .filter(|o| o.started < restarted_at && o.finished > killed_at)
        .count();
    let stats = pool.stats();
    println!(
        "{} requests: {} ok, {} failed ({} in flight across the kill); pool {stats:?}",
        outcomes.len(),
        outcomes.len() - errors.len(),
        errors.len(),
        around_kill
    );
    assert!(stats.connects >= 2, "the pool reconnected: {stats:?}");

    // Every write the new process acknowledged is there: read back through the service.
    let acked: Vec<u64> = outcomes
        .iter()
        .filter(|o| o.result.is_ok() && o.finished > restarted_at)
        .map(|o| o.index)
        .collect();
    read_back(&service, &engine, addr, &acked, HANG).await;
    println!("{} acknowledged writes after the restart read back intact", acked.len());
    drop(second);
}
