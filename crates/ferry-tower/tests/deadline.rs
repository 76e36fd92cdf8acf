//! Deadlines carried by the request (`DeadlineLayer`) and what enforces them with no timer of their
//! own: the service before an attempt, the pool while waiting for a link, the engine's transfer
//! timeout during the transfer, and the retry policy between attempts. Each test would hang past its
//! bound (and fail) if the deadline were ignored: the pool's and the engine's own limits are set far
//! beyond it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferry::{Access, Engine, Error};
use ferry_tower::tower::{ServiceBuilder, ServiceExt};
use ferry_tower::{DeadlineLayer, Descriptor, PoolConfig, RetryConfig, RetryPolicy, TransferRequest, TransferService};

/// Bound on each test's requests: well under the pool's and engine's limits below, well over the
/// deadlines.
const HANG: Duration = Duration::from_secs(20);

/// Limits the deadline must beat.
fn patient_pool() -> PoolConfig {
    PoolConfig {
        connect_timeout: Duration::from_secs(120),
        transfer_timeout: Duration::from_secs(120),
        ..PoolConfig::default()
    }
}

async fn silent_listener() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_deadline_fails_before_anything_is_sent() {
    let target = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let dst = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    let addr = target.local_addr().unwrap();
    let engine = Engine::builder().build().await.unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    src.write_at(0, &[0xab; 4096]).unwrap();
    let service = TransferService::with_config(engine.clone(), patient_pool()).unwrap();

    let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)])
        .with_deadline(tokio::time::Instant::now());
    let err = tokio::time::timeout(HANG, service.clone().oneshot(req))
        .await
        .expect("hung")
        .unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    assert_eq!(service.stats().connects, 0, "no link for a request already late");
    let mut got = [0u8; 4096];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, [0u8; 4096], "nothing written");

    // On a live link the engine refuses the late request, still before sending anything, and the
    // pool does not hold it against the link: late requests are not a link that stops answering.
    let write = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    tokio::time::timeout(HANG, service.clone().oneshot(write.clone().with_attempt_limit(HANG)))
        .await
        .expect("hung")
        .unwrap();
    dst.write_at(0, &[0u8; 4096]).unwrap();
    let before = service.stats();
    for _ in 0..3 {
        let late = write.clone().with_deadline(tokio::time::Instant::now());
        let err = tokio::time::timeout(HANG, service.clone().oneshot(late))
            .await
            .expect("hung")
            .unwrap_err();
        assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    }
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, [0u8; 4096], "nothing written on a live link either");
    let after = service.stats();
    assert_eq!(
        (after.links_dropped, after.connects),
        (before.links_dropped, before.connects),
        "late requests cost the link: {after:?}"
    );

    // The earlier of two deadlines holds: a later one does not revive the request.
    let later = tokio::time::Instant::now() + Duration::from_secs(60);
    let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)])
        .with_deadline(tokio::time::Instant::now())
        .with_deadline(later);
    assert!(req.deadline().is_some_and(|at| at < later));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_ends_a_dial_to_a_silent_peer() {
    let (addr, listener) = silent_listener().await;
    let engine = Engine::builder().build().await.unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    let transfers = TransferService::with_config(engine.clone(), patient_pool()).unwrap();
    let service = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_millis(300)))
        .service(transfers.clone());

    let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let err = tokio::time::timeout(HANG, service.oneshot(req))
        .await
        .expect("the deadline did not end the dial")
        .unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    // The abandoned dial counts as a failed one, so the next request backs off rather than redial.
    assert_eq!(transfers.stats().connect_failures, 1, "{:?}", transfers.stats());
    listener.abort();
}

/// A target whose runtime is frozen after the link is up: the transfer itself must end at the
/// deadline, through the engine's timeout, not the pool's 120 s default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_ends_a_transfer_to_a_frozen_target() {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (freeze_tx, freeze_rx) = std::sync::mpsc::channel::<()>();
    let (frozen_tx, frozen_rx) = std::sync::mpsc::channel::<()>();
    let (thaw_tx, thaw_rx) = std::sync::mpsc::channel::<()>();
    let target_thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            // TCP: its target serves on the runtime this test freezes (a shared-memory target copies on
            // a thread of its own, which a frozen runtime does not stop).
            let target = Engine::builder()
                .transports([ferry::TransportKind::Tcp])
                .listen("127.0.0.1:0")
                .build()
                .await
                .unwrap();
            let _dst = target.alloc_host(4096, Access::READ_WRITE).unwrap();
            addr_tx.send(target.local_addr().unwrap()).unwrap();
            // Serve until told to freeze, then block the only thread the target runs on.
            let freeze = tokio::task::spawn_blocking(move || freeze_rx.recv());
            let _ = freeze.await;
            // No await between the acknowledgement and the wait, so no request sent after it is
            // served.
            let _ = frozen_tx.send(());
            let _ = thaw_rx.recv_timeout(HANG * 2);
        });
    });
    let addr = addr_rx.recv_timeout(HANG).unwrap();

    let engine = Engine::builder().build().await.unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    let transfers = TransferService::with_config(engine.clone(), patient_pool()).unwrap();
    let service = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_millis(500)))
        .service(transfers);
    let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    tokio::time::timeout(HANG, service.clone().oneshot(req.clone()))
        .await
        .expect("hung before the freeze")
        .expect("the target serves before it freezes");

    freeze_tx.send(()).unwrap();
    frozen_rx.recv_timeout(HANG).expect("the target did not freeze");
    let err = tokio::time::timeout(HANG, service.oneshot(req))
        .await
        .expect("the deadline did not end the transfer")
        .unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    thaw_tx.send(()).unwrap();
    target_thread.join().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_retry_waits_past_the_deadline() {
    // A port nobody listens on: every attempt fails at once with a transient error.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let engine = Engine::builder().build().await.unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    let policy = RetryPolicy::new(RetryConfig {
        max_retries: 5,
        backoff_min: Duration::from_secs(60),
        backoff_max: Duration::from_secs(60),
        ..RetryConfig::default()
    })
    .unwrap();
    let attempts = Arc::new(AtomicUsize::new(0));
    let counter = attempts.clone();
    let service = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_secs(1)))
        .retry(policy)
        .map_request(move |r: TransferRequest| {
            counter.fetch_add(1, Ordering::SeqCst);
            r
        })
        .service(TransferService::with_config(engine.clone(), patient_pool()).unwrap());

    let req = TransferRequest::write(closed, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let err = tokio::time::timeout(HANG, service.oneshot(req))
        .await
        .expect("a retry slept past the deadline")
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Io {
                kind: std::io::ErrorKind::ConnectionRefused,
                ..
            }
        ),
        "the first attempt's error comes back: {err:?}"
    );
    assert_eq!(attempts.load(Ordering::SeqCst), 1);
}

/// An attempt limit is a length, not a point in time: it starts when an attempt reaches the service.
/// A request that waited longer than its limit before its attempt still gets all of it, where a
/// deadline set at the same moment has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_limit_starts_with_the_attempt() {
    let target = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let dst = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    let addr = target.local_addr().unwrap();
    let engine = Engine::builder().build().await.unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    src.write_at(0, &[0x11; 4096]).unwrap();
    let service = TransferService::with_config(engine.clone(), patient_pool()).unwrap();

    let limit = Duration::from_millis(200);
    let set_at = tokio::time::Instant::now();
    let write = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let limited = write.clone().with_attempt_limit(limit);
    let deadline = write.clone().with_deadline(set_at + limit);
    assert_eq!(limited.attempt_limit(), Some(limit));
    assert_eq!(
        limited.clone().with_attempt_limit(limit * 2).attempt_limit(),
        Some(limit),
        "the smaller limit holds"
    );
    tokio::time::sleep(limit * 2).await;

    let err = tokio::time::timeout(HANG, service.clone().oneshot(deadline))
        .await
        .expect("hung")
        .unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    let mut got = [0u8; 4096];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, [0u8; 4096], "nothing written for the late request");

    // Connect with a request that has no bound, so that the limited one only has its transfer to
    // do, well within its limit even on a loaded machine.
    tokio::time::timeout(HANG, service.clone().oneshot(write))
        .await
        .expect("hung")
        .unwrap();
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, [0x11; 4096]);
    src.write_at(0, &[0x5a; 4096]).unwrap();
    assert!(
        set_at.elapsed() > limit * 2,
        "the limited request has waited past its limit"
    );
    tokio::time::timeout(HANG, service.oneshot(limited))
        .await
        .expect("hung")
        .expect("the attempt had its whole limit");
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, [0x5a; 4096]);
}

/// Each attempt gets the whole limit, wherever the layer sits: two attempts at a silent peer each
/// dial it until their own limit ends them. Were the limit fixed once, as a deadline is, the second
/// attempt would fail before dialling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_attempt_gets_the_whole_limit() {
    let (addr, listener) = silent_listener().await;
    let engine = Engine::builder().build().await.unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    let transfers = TransferService::with_config(
        engine.clone(),
        PoolConfig {
            // Shorter than the retry's pause, so that the second attempt dials again.
            reconnect_backoff_min: Duration::from_millis(1),
            reconnect_backoff_max: Duration::from_millis(1),
            ..patient_pool()
        },
    )
    .unwrap();
    let policy = RetryPolicy::new(RetryConfig {
        max_retries: 1,
        backoff_min: Duration::from_millis(50),
        backoff_max: Duration::from_millis(50),
        ..RetryConfig::default()
    })
    .unwrap();
    let attempts = Arc::new(AtomicUsize::new(0));
    let counter = attempts.clone();
    // Outside `retry`: the limit is still per attempt.
    let service = ServiceBuilder::new()
        .layer(DeadlineLayer::per_attempt(Duration::from_millis(300)))
        .retry(policy)
        .map_request(move |r: TransferRequest| {
            counter.fetch_add(1, Ordering::SeqCst);
            r
        })
        .service(transfers.clone());

    let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let err = tokio::time::timeout(HANG, service.oneshot(req))
        .await
        .expect("an attempt limit did not end a dial")
        .unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    assert_eq!(
        transfers.stats().connect_failures,
        2,
        "both attempts dialled and were cut short: {:?}",
        transfers.stats()
    );
    listener.abort();
}
