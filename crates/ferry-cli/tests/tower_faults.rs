//! ferry-tower's middleware under faults, against real `ferry serve` processes and raw sockets:
//!
//! - the target is killed with SIGKILL in the middle of a stream of writes and restarted on the same
//!   port: requests in flight fail with transient errors or succeed through retries, every request
//!   after the service reaches the new process succeeds, and every write acknowledged by the new
//!   process is there when read back through the service;
//! - a target that accepts connections and never answers: requests fail with `Timeout`, and the retry
//!   budget bounds the attempts (and so the connections the listener sees).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferry::{Access, Engine, Error};
use ferry_tower::tower::{ServiceBuilder, ServiceExt};
use ferry_tower::{
    Descriptor, PoolConfig, RetryConfig, RetryPolicy, TransferRequest, TransferService, into_ferry_error,
    is_transient_ferry,
};

mod common;
use common::Serve;
use common::stream::{BLOCK, REGION, WriteStream, read_back, stack};

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

/// A listener that accepts connections and holds them without a word.
async fn silent_listener() -> (SocketAddr, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            held.push(socket);
        }
    });
    (addr, accepted, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_target_times_out_within_the_retry_budget() {
    let (addr, accepted, listener) = silent_listener().await;
    let engine = Engine::builder().build().await.unwrap();
    let src = engine.alloc_host(BLOCK as usize, Access::READ_WRITE).unwrap();
    let transfers = TransferService::with_config(
        engine.clone(),
        PoolConfig {
            // Longer than an attempt: the timeout layer cuts each dial short, and the pool counts the
            // abandoned dial as a failed one.
            connect_timeout: Duration::from_secs(2),
            reconnect_backoff_min: Duration::from_millis(20),
            reconnect_backoff_max: Duration::from_millis(200),
            ..PoolConfig::default()
        },
    )
    .unwrap();
    // Budget: a reserve of 10 retries (1 per second over 10 s) plus one per ten requests.
    let (max_retries, min_per_sec, ttl_secs) = (5u64, 1u64, 10u64);
    let policy = RetryPolicy::new(RetryConfig {
        max_retries: max_retries as u32,
        backoff_min: Duration::from_millis(10),
        backoff_max: Duration::from_millis(50),
        budget_ttl: Duration::from_secs(ttl_secs),
        budget_min_per_sec: min_per_sec as u32,
        budget_retry_ratio: 0.1,
        ..RetryConfig::default()
    })
    .unwrap();
    let attempts = Arc::new(AtomicUsize::new(0));
    let counter = attempts.clone();
    let service = ServiceBuilder::new()
        .map_err(into_ferry_error)
        .timeout(Duration::from_secs(5))
        .retry(policy)
        .timeout(Duration::from_millis(300))
        .map_request(move |r: TransferRequest| {
            counter.fetch_add(1, Ordering::SeqCst);
            r
        })
        .service(transfers);

    let requests = 40u64;
    let started = Instant::now();
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let service = service.clone();
            let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, BLOCK)]);
            tokio::spawn(async move {
                let mut errors = Vec::new();
                for _ in 0..requests / 8 {
                    let r = tokio::time::timeout(HANG, service.clone().oneshot(req.clone()))
                        .await
                        .expect("a request to a silent target hung");
                    errors.push(r.expect_err("a silent target cannot acknowledge a write"));
                }
                errors
            })
        })
        .collect();
    for w in workers {
        for e in tokio::time::timeout(HANG, w).await.expect("a worker hung").unwrap() {
            assert!(matches!(e, Error::Timeout(_)), "{e:?}");
        }
    }
    listener.abort();
    let attempts = attempts.load(Ordering::SeqCst) as u64;
    let accepted = accepted.load(Ordering::SeqCst) as u64;
    // The reserve refills as withdrawals age out of the budget's window: one more reserve per window
    // the run took (one in all, on any machine that is not very slow).
    let windows = 1 + started.elapsed().as_secs() / ttl_secs;
    let bound = requests + windows * min_per_sec * ttl_secs + requests / 10;
    println!(
        "{requests} requests to a silent target: {attempts} attempts, {accepted} connections accepted \
         (budget bound {bound}; retries without a budget: up to {})",
        requests * (1 + max_retries)
    );
    assert!(attempts >= requests);
    assert!(attempts <= bound, "{attempts} attempts exceed the budget's {bound}");
    // Each attempt dials at most once, and only after the pool's reconnect pause.
    assert!(
        accepted >= 1 && accepted <= attempts,
        "{accepted} connections for {attempts} attempts"
    );
}
