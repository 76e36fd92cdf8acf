//! The pool and the retry policy against in-process engines: lazy connects and reuse, reconnects after
//! the target restarts, idle closing, the link limit, backpressure, which errors are retried, and the
//! retry budget against a target that never answers.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferry::{Access, Engine, Error, Op, Region};
use ferry_tower::tower::{Service, ServiceBuilder, ServiceExt, service_fn};
use ferry_tower::{
    Descriptor, PoolConfig, RemoteAddr, RetryConfig, RetryPolicy, TransferRequest, TransferService, into_ferry_error,
};
use futures::FutureExt;

const T: Duration = Duration::from_secs(10);

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed.wrapping_mul(131)) as u8 ^ (i >> 8) as u8)
        .collect()
}

async fn target() -> (Engine, Region, SocketAddr) {
    let engine = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let region = engine.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    let addr = engine.local_addr().unwrap();
    (engine, region, addr)
}

async fn initiator() -> Engine {
    Engine::builder().build().await.unwrap()
}

/// Waits (bounded) until `cond` holds.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + T;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn quick_retries() -> RetryPolicy {
    RetryPolicy::new(RetryConfig {
        max_retries: 10,
        backoff_min: Duration::from_millis(5),
        backoff_max: Duration::from_millis(100),
        ..RetryConfig::default()
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connects_lazily_and_reuses_the_link() {
    let (_target, dst, addr) = target().await;
    let engine = initiator().await;
    let service = TransferService::new(engine.clone());
    assert_eq!(engine.link_count(), 0, "no link before the first request");
    assert_eq!(service.stats().links, 0);

    let src = engine.alloc_host(64 << 10, Access::READ_WRITE).unwrap();
    for i in 0..16u64 {
        src.write_at(i * 4096, &pattern(4096, i)).unwrap();
        let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr_at(i * 4096), i * 4096, 4096)]);
        let resp = tokio::time::timeout(T, service.clone().oneshot(req))
            .await
            .expect("request hung")
            .unwrap();
        assert_eq!(resp.bytes, 4096);
        assert_eq!(resp.op, Op::Write);
        assert_eq!(resp.peer, addr);
        assert_eq!(resp.new_link, i == 0, "only the first request connects");
    }
    let stats = service.stats();
    assert_eq!((stats.connects, stats.links, stats.peers), (1, 1, 1), "{stats:?}");
    assert_eq!(engine.link_count(), 1);
    let mut got = vec![0u8; 64 << 10];
    dst.read_at(0, &mut got).unwrap();
    for i in 0..16u64 {
        assert_eq!(&got[(i * 4096) as usize..][..4096], &pattern(4096, i)[..], "block {i}");
    }

    // Absolute and keyed addressing reach the same bytes.
    let back = engine.alloc_host(8192, Access::READ_WRITE).unwrap();
    let req = TransferRequest::read(
        addr,
        vec![
            Descriptor::absolute(back.addr(), dst.addr_at(4096), 4096),
            Descriptor::new(
                back.addr_at(4096),
                RemoteAddr::Region {
                    key: dst.key(),
                    offset: 2 * 4096,
                },
                4096,
            ),
        ],
    );
    let resp = tokio::time::timeout(T, service.clone().oneshot(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.bytes, 8192);
    let mut two = vec![0u8; 8192];
    back.read_at(0, &mut two).unwrap();
    assert_eq!(&two[..4096], &pattern(4096, 1)[..]);
    assert_eq!(&two[4096..], &pattern(4096, 2)[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_follow_a_restarted_target() {
    let (first, first_region, addr) = target().await;
    let engine = initiator().await;
    let service = ServiceBuilder::new()
        .map_err(into_ferry_error)
        .timeout(T)
        .retry(quick_retries())
        .timeout(Duration::from_secs(2))
        .service(TransferService::new(engine.clone()));
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    src.write_at(0, &pattern(4096, 7)).unwrap();
    let write = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 8192, 4096)]);
    tokio::time::timeout(T, service.clone().oneshot(write.clone()))
        .await
        .unwrap()
        .unwrap();
    let old_absolute = first_region.addr_at(8192);
    drop(first_region);
    drop(first);
    // The region's removal reaches the link before its end does: a request in between would wait on a
    // live link whose peer advertises nothing until the link ends. Wait for the end.
    eventually("the old link is closed", || {
        engine.peer_at(addr).is_none_or(|p| p.is_closed())
    })
    .await;

    // A new target on the same port, its region elsewhere.
    let deadline = tokio::time::Instant::now() + T;
    let second = loop {
        match Engine::builder().listen(addr.to_string()).build().await {
            Ok(e) => break e,
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "could not listen on {addr} again: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let _pad = second.alloc_host(12288, Access::READ_WRITE).unwrap();
    let second_region = second.alloc_host(1 << 20, Access::READ_WRITE).unwrap();

    let resp = tokio::time::timeout(T + T, service.clone().oneshot(write))
        .await
        .expect("the request hung")
        .expect("an offset reaches the restarted target");
    assert!(resp.new_link, "the request reconnected");
    let mut got = vec![0u8; 4096];
    second_region.read_at(8192, &mut got).unwrap();
    assert_eq!(got, pattern(4096, 7));

    // The old absolute address names nothing now, and that is not retried.
    if !(second_region.addr()..second_region.addr() + second_region.len()).contains(&old_absolute) {
        let stale = TransferRequest::write(addr, [Descriptor::absolute(src.addr(), old_absolute, 4096)]);
        let err = tokio::time::timeout(T, service.clone().oneshot(stale))
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(err, Error::OutOfBounds(_)), "{err:?}");
    }
}

/// A target that listens (and is found, in a directory) before it registers its memory: a request at
/// an offset waits within its attempt for the target's first region instead of failing for good with
/// `OutOfBounds`; one whose attempt ends first fails with `Timeout`, which is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_has_not_registered_its_memory_yet_is_waited_for() {
    let target = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let addr = target.local_addr().unwrap();
    let engine = initiator().await;
    let service = TransferService::new(engine.clone());
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    src.write_at(0, &pattern(4096, 11)).unwrap();
    let write = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 4096, 4096)]);

    let early = write.clone().with_timeout(Duration::from_millis(300));
    let err = tokio::time::timeout(T, service.clone().oneshot(early))
        .await
        .expect("the request hung")
        .unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    assert!(err.to_string().contains("advertises no region"), "{err}");

    let pending = tokio::spawn(service.clone().oneshot(write));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !pending.is_finished(),
        "the request did not wait for the target's memory"
    );
    let region = target.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    tokio::time::timeout(T, pending)
        .await
        .expect("the request hung")
        .unwrap()
        .expect("the write lands once the target registered its region");
    let mut got = vec![0u8; 4096];
    region.read_at(4096, &mut got).unwrap();
    assert_eq!(got, pattern(4096, 11));
    // What the pool resolved against, read in place, is the table a copy shows.
    let peer = engine.peer_at(addr).expect("the pool's link");
    let keys = |r: &ferry::RemoteRegions| r.iter().map(|a| (a.key, a.addr, a.len)).collect::<Vec<_>>();
    assert_eq!(peer.with_regions(keys).unwrap(), keys(&peer.regions()));
    assert_eq!(peer.with_regions(|r| r.len()).unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_links_are_closed_and_reopened_on_demand() {
    let (_target, dst, addr) = target().await;
    let engine = initiator().await;
    let config = PoolConfig {
        idle_timeout: Duration::from_millis(100),
        ..PoolConfig::default()
    };
    let service = TransferService::with_config(engine.clone(), config).unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    src.write_at(0, &pattern(4096, 1)).unwrap();
    let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    tokio::time::timeout(T, service.clone().oneshot(req.clone()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(engine.link_count(), 1);

    eventually("the idle link is closed", || {
        service.stats().idle_closed == 1 && engine.link_count() == 0
    })
    .await;
    assert_eq!(service.stats().links, 0);

    src.write_at(0, &pattern(4096, 2)).unwrap();
    let resp = tokio::time::timeout(T, service.clone().oneshot(req))
        .await
        .unwrap()
        .unwrap();
    assert!(resp.new_link);
    let mut got = vec![0u8; 4096];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(4096, 2));
    assert_eq!(service.stats().connects, 2);
}

/// A link the application made itself is used by the pool but stays the application's: neither
/// idleness nor dropping the pool disconnects it. A link the pool made is closed with the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_the_application_made_stay_open() {
    let (_target, dst, addr) = target().await;
    let engine = initiator().await;
    let peer = engine.connect(&addr.to_string(), T).await.unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    let config = PoolConfig {
        idle_timeout: Duration::from_millis(100),
        ..PoolConfig::default()
    };
    let service = TransferService::with_config(engine.clone(), config).unwrap();
    let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let direct = [ferry::TransferDesc::new(src.addr(), dst.addr(), 4096)];
    let expect_at_target = |seed| {
        let mut got = vec![0u8; 4096];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern(4096, seed));
    };

    src.write_at(0, &pattern(4096, 1)).unwrap();
    tokio::time::timeout(T, service.clone().oneshot(req.clone()))
        .await
        .unwrap()
        .unwrap();
    expect_at_target(1);
    eventually("the pool lets go of the idle link", || service.stats().links == 0).await;
    // The reaper has run; a disconnect it started would be done within this pause.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!peer.is_closed(), "the pool closed the application's idle link");
    assert_eq!(engine.link_count(), 1);
    assert_eq!(service.stats().idle_closed, 0);
    src.write_at(0, &pattern(4096, 2)).unwrap();
    engine.transfer(&peer, Op::Write, &direct, T).await.unwrap();
    expect_at_target(2);

    // Used again, then the pool is dropped.
    src.write_at(0, &pattern(4096, 3)).unwrap();
    tokio::time::timeout(T, service.clone().oneshot(req.clone()))
        .await
        .unwrap()
        .unwrap();
    expect_at_target(3);
    drop(service);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!peer.is_closed(), "dropping the pool closed the application's link");
    src.write_at(0, &pattern(4096, 4)).unwrap();
    engine.transfer(&peer, Op::Write, &direct, T).await.unwrap();
    expect_at_target(4);

    // The control: a link the pool made goes with the pool.
    let (_other, _other_region, other_addr) = target().await;
    let service = TransferService::new(engine.clone());
    let req = TransferRequest::write(other_addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    tokio::time::timeout(T, service.clone().oneshot(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(engine.link_count(), 2);
    drop(service);
    eventually("the pool's own link is closed with it", || engine.link_count() == 1).await;
    assert!(!peer.is_closed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_link_limit_evicts_the_least_recently_used_idle_link() {
    let (_a, a_region, a) = target().await;
    let (_b, b_region, b) = target().await;
    let engine = initiator().await;
    let config = PoolConfig {
        max_links: 1,
        ..PoolConfig::default()
    };
    let service = TransferService::with_config(engine.clone(), config).unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    src.write_at(0, &pattern(4096, 3)).unwrap();
    for peer in [a, b, a] {
        let req = TransferRequest::write(peer, [Descriptor::at_offset(src.addr(), 0, 4096)]);
        let resp = tokio::time::timeout(T, service.clone().oneshot(req))
            .await
            .unwrap()
            .unwrap();
        assert!(resp.new_link);
    }
    let stats = service.stats();
    assert_eq!((stats.peers, stats.evicted, stats.connects), (1, 2, 3), "{stats:?}");
    eventually("evicted links are disconnected", || engine.link_count() == 1).await;
    for region in [&a_region, &b_region] {
        let mut got = vec![0u8; 4096];
        region.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern(4096, 3));
    }
}

/// A listener that accepts connections and never answers; returns its address and how many it took.
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
async fn the_link_limit_with_every_link_busy_is_resource_exhausted() {
    let (silent, accepted, _listener) = silent_listener().await;
    let (_b, _b_region, b) = target().await;
    let engine = initiator().await;
    let config = PoolConfig {
        max_links: 1,
        connect_timeout: Duration::from_secs(5),
        ..PoolConfig::default()
    };
    let service = TransferService::with_config(engine.clone(), config).unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    // This one holds the pool's only entry (max_links: 1) while it tries to connect.
    let stuck = {
        let req = TransferRequest::write(silent, [Descriptor::at_offset(src.addr(), 0, 4096)]);
        let service = service.clone();
        tokio::spawn(async move { service.oneshot(req).await })
    };
    eventually("the silent peer is being dialled", || {
        accepted.load(Ordering::SeqCst) == 1 && service.stats().peers == 1
    })
    .await;
    let req = TransferRequest::write(b, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let err = tokio::time::timeout(T, service.clone().oneshot(req))
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, Error::ResourceExhausted(_)), "{err:?}");
    let stuck = tokio::time::timeout(T, stuck)
        .await
        .expect("connect is bounded")
        .unwrap();
    assert!(matches!(stuck, Err(Error::Timeout(_))), "{stuck:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_ready_reflects_the_in_flight_bound() {
    let (_target, _dst, addr) = target().await;
    let engine = initiator().await;
    let config = PoolConfig {
        max_in_flight: 1,
        ..PoolConfig::default()
    };
    let mut first = TransferService::with_config(engine.clone(), config).unwrap();
    let mut second = first.clone();
    poll_fn(|cx| first.poll_ready(cx)).now_or_never().unwrap().unwrap();
    assert!(
        poll_fn(|cx| second.poll_ready(cx)).now_or_never().is_none(),
        "the second clone must wait while the first holds the only unit"
    );
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let resp = tokio::time::timeout(T, first.call(req.clone())).await.unwrap().unwrap();
    assert_eq!(resp.bytes, 4096);
    // The unit came back with the response.
    tokio::time::timeout(T, poll_fn(|cx| second.poll_ready(cx)))
        .await
        .unwrap()
        .unwrap();
    assert!(poll_fn(|cx| first.poll_ready(cx)).now_or_never().is_none());
    tokio::time::timeout(T, second.call(req)).await.unwrap().unwrap();

    // Calling without a reserved unit is refused, not a panic.
    let err = first
        .call(TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 1)]))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");

    // A reservation dropped unused, and a call dropped before it ran, give their unit back.
    assert_eq!(first.stats().in_flight, 0);
    let mut unused = second.clone();
    tokio::time::timeout(T, poll_fn(|cx| unused.poll_ready(cx)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.stats().in_flight, 1);
    drop(unused);
    assert_eq!(first.stats().in_flight, 0, "a dropped reservation kept its unit");
    let mut abandoned = second.clone();
    tokio::time::timeout(T, poll_fn(|cx| abandoned.poll_ready(cx)))
        .await
        .unwrap()
        .unwrap();
    drop(abandoned.call(TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 1)])));
    assert_eq!(first.stats().in_flight, 0, "a dropped call kept its unit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_errors_are_not_retried() {
    let target_engine = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let read_only = target_engine.alloc_host(1 << 20, Access::READ).unwrap();
    let addr = target_engine.local_addr().unwrap();
    let engine = initiator().await;
    let attempts = Arc::new(AtomicUsize::new(0));
    let counter = attempts.clone();
    let service = ServiceBuilder::new()
        .map_err(into_ferry_error)
        .retry(quick_retries())
        .timeout(Duration::from_secs(2))
        .map_request(move |r: TransferRequest| {
            counter.fetch_add(1, Ordering::SeqCst);
            r
        })
        .service(TransferService::new(engine.clone()));
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();

    type Expected = fn(&Error) -> bool;
    let cases: Vec<(TransferRequest, Expected)> = vec![
        (
            TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]),
            |e| matches!(e, Error::PermissionDenied(_)),
        ),
        (
            TransferRequest::read(addr, [Descriptor::at_offset(src.addr(), (1 << 20) - 100, 4096)]),
            |e| matches!(e, Error::OutOfBounds(_)),
        ),
        (
            TransferRequest::read(
                addr,
                [Descriptor::absolute(src.addr(), read_only.addr() + (2 << 20), 16)],
            ),
            |e| matches!(e, Error::OutOfBounds(_)),
        ),
        (TransferRequest::write(addr, Vec::new()), |e| {
            matches!(e, Error::InvalidArgument(_))
        }),
    ];
    for (req, expected) in cases {
        attempts.store(0, Ordering::SeqCst);
        let err = tokio::time::timeout(T, service.clone().oneshot(req))
            .await
            .expect("request hung")
            .unwrap_err();
        assert!(expected(&err), "{err:?}");
        assert_eq!(attempts.load(Ordering::SeqCst), 1, "{err:?} was retried");
    }
    // The link survived all of that.
    let read = TransferRequest::read(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let resp = tokio::time::timeout(T, service.clone().oneshot(read))
        .await
        .unwrap()
        .unwrap();
    assert!(!resp.new_link);
}

/// An I/O error of one operation (a range refused because the target's file shrank) fails that request
/// only: the pool keeps the link, and the next request on it succeeds without reconnecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_error_keeps_a_healthy_link() {
    let (target_engine, dst, addr) = target().await;
    let path = std::env::temp_dir().join(format!("ferry-tower-truncated-{}", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    // Smaller than `dst`, which stays the primary region that offsets resolve against.
    file.set_len(64 << 10).unwrap();
    let mapped = target_engine
        .register_file(&path, 0, 64 << 10, Access::READ_WRITE)
        .unwrap();
    let engine = initiator().await;
    let service = TransferService::new(engine.clone());
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    let first = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let resp = service.clone().oneshot(first).await.unwrap();
    assert!(resp.new_link);
    file.set_len(0).unwrap();
    let into_file = TransferRequest::write(addr, [Descriptor::absolute(src.addr(), mapped.addr(), 4096)]);
    let err = tokio::time::timeout(T, service.clone().oneshot(into_file))
        .await
        .expect("request hung")
        .unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    let again = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 4096, 4096)]);
    let resp = service.clone().oneshot(again).await.unwrap();
    assert!(!resp.new_link, "the healthy link was replaced after {err}");
    assert_eq!(service.stats().links_dropped, 0);
    assert_eq!(dst.len(), 1 << 20);
    drop(mapped);
    let _ = std::fs::remove_file(&path);
}

/// When an outer `tower::timeout` gives up on a read, no byte of it lands in the local buffer later,
/// so a retry's data cannot be overwritten by the first attempt's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_abandoned_by_a_timeout_leaves_the_buffer_alone() {
    let target_engine = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let len = 128usize << 20;
    let _src = target_engine.register(vec![0x11u8; len], Access::READ_WRITE).unwrap();
    let addr = target_engine.local_addr().unwrap();
    let engine = initiator().await;
    let dst = engine.alloc_host(len, Access::READ_WRITE).unwrap();
    // Connect through the bare service first (the pool is shared by its clones), so that the short
    // timeout cuts the read and not the connect.
    let pooled = TransferService::new(engine.clone());
    let small = TransferRequest::read(addr, [Descriptor::at_offset(dst.addr(), 0, 4096)]);
    let first = tokio::time::timeout(T, pooled.clone().oneshot(small))
        .await
        .unwrap()
        .unwrap();
    assert!(first.new_link);
    let service = ServiceBuilder::new()
        .map_err(into_ferry_error)
        .timeout(Duration::from_millis(3))
        .service(pooled);
    let whole = TransferRequest::read(addr, [Descriptor::at_offset(dst.addr(), 0, len as u64)]);
    let err = service.clone().oneshot(whole).await.unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    dst.write_at(0, &vec![0xEEu8; len]).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let late = dst.to_vec().unwrap().iter().filter(|&&b| b != 0xEE).count();
    assert_eq!(late, 0, "{late} bytes landed after the service gave up");
}

#[tokio::test]
async fn transient_errors_are_retried_until_success() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let flaky = service_fn(move |_: TransferRequest| {
        let n = c.fetch_add(1, Ordering::SeqCst);
        async move {
            match n {
                0 => Err(Error::PeerClosed("gone".into())),
                1 => Err(Error::io(
                    "connect",
                    std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
                )),
                2 => Err(Error::Timeout("slow".into())),
                _ => Ok(n),
            }
        }
    });
    let service = ServiceBuilder::new().retry(quick_retries()).service(flaky);
    let req = TransferRequest::write("127.0.0.1:9".parse().unwrap(), Vec::new());
    let n = tokio::time::timeout(T, service.oneshot(req)).await.unwrap().unwrap();
    assert_eq!(n, 3);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn the_retry_budget_bounds_attempts_on_a_dead_peer() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let dead = service_fn(move |_: TransferRequest| {
        c.fetch_add(1, Ordering::SeqCst);
        async { Err::<(), _>(Error::Timeout("no answer".into())) }
    });
    // A reserve of 1 retry per second over 1 s, and none earned by requests.
    let policy = RetryPolicy::new(RetryConfig {
        max_retries: 5,
        backoff_min: Duration::from_millis(1),
        backoff_max: Duration::from_millis(2),
        budget_ttl: Duration::from_secs(1),
        budget_min_per_sec: 1,
        budget_retry_ratio: 0.0,
        ..RetryConfig::default()
    })
    .unwrap();
    let service = ServiceBuilder::new().retry(policy).service(dead);
    let requests = 20;
    for _ in 0..requests {
        let req = TransferRequest::write("127.0.0.1:9".parse().unwrap(), Vec::new());
        let err = tokio::time::timeout(T, service.clone().oneshot(req))
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(err, Error::Timeout(_)));
    }
    let calls = calls.load(Ordering::SeqCst);
    println!(
        "{requests} requests to a dead peer made {calls} attempts (without a budget: up to {})",
        requests * 6
    );
    // Each request once, plus what the reserve allows while the test runs (1 per second).
    assert!(calls >= requests);
    assert!(calls <= requests + 5, "{calls} attempts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_shedding_answers_resource_exhausted() {
    let (silent, _accepted, _listener) = silent_listener().await;
    let engine = initiator().await;
    let config = PoolConfig {
        connect_timeout: Duration::from_secs(5),
        ..PoolConfig::default()
    };
    let mut service = ServiceBuilder::new()
        .map_err(into_ferry_error)
        .load_shed()
        .concurrency_limit(1)
        .service(TransferService::with_config(engine.clone(), config).unwrap());
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    let req = TransferRequest::write(silent, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    // The first takes the only place the concurrency limit leaves and hangs in connect (bounded by connect_timeout).
    let first = service.ready().await.unwrap().call(req.clone());
    let err = tokio::time::timeout(T, service.ready().await.unwrap().call(req))
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, Error::ResourceExhausted(_)), "{err:?}");
    let first = tokio::time::timeout(T, first)
        .await
        .expect("bounded by the connect timeout");
    assert!(matches!(first, Err(Error::Timeout(_))), "{first:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_peer_is_dialled_with_backoff() {
    // A port with nothing listening: bind, note the address, close.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let engine = initiator().await;
    let config = PoolConfig {
        reconnect_backoff_min: Duration::from_millis(200),
        reconnect_backoff_max: Duration::from_secs(2),
        ..PoolConfig::default()
    };
    let service = TransferService::with_config(engine.clone(), config).unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let mut results = Vec::new();
    for _ in 0..50 {
        results.push(
            tokio::time::timeout(T, service.clone().oneshot(req.clone()))
                .await
                .unwrap(),
        );
    }
    for r in &results {
        assert!(
            matches!(
                r,
                Err(Error::Io {
                    kind: std::io::ErrorKind::ConnectionRefused,
                    ..
                })
            ),
            "{r:?}"
        );
    }
    let stats = service.stats();
    // 50 back-to-back requests fit in the first pauses: a handful of dials, not 50.
    assert!(stats.connect_failures >= 1 && stats.connect_failures < 10, "{stats:?}");
    assert_eq!(stats.connects, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_boxed_stack_serves_concurrent_callers() {
    let (_target, dst, addr) = target().await;
    let engine = initiator().await;
    // `.boxed()` erases the type and `Clone`; `Buffer` makes it shareable (and retryable) again.
    let service = ServiceBuilder::new()
        .map_err(into_ferry_error)
        .retry(quick_retries())
        .timeout(Duration::from_secs(2))
        .buffer(64)
        .service(TransferService::new(engine.clone()).boxed());
    let src = Arc::new(engine.alloc_host(32 * 4096, Access::READ_WRITE).unwrap());
    let callers: Vec<_> = (0..32u64)
        .map(|i| {
            let (service, src) = (service.clone(), src.clone());
            tokio::spawn(async move {
                src.write_at(i * 4096, &pattern(4096, i + 100)).unwrap();
                let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr_at(i * 4096), i * 4096, 4096)]);
                // Boxed as `dyn Future + Send`: without it rustc cannot prove the spawned future Send
                // through Buffer's generics ("higher-ranked lifetime error", rust-lang/rust#102211).
                let done: std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>> =
                    Box::pin(service.oneshot(req));
                done.await
            })
        })
        .collect();
    for c in callers {
        tokio::time::timeout(T, c).await.unwrap().unwrap().unwrap();
    }
    let mut got = vec![0u8; 4096];
    for i in 0..32u64 {
        dst.read_at(i * 4096, &mut got).unwrap();
        assert_eq!(got, pattern(4096, i + 100), "block {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_follow_the_primary_region_of_a_live_peer() {
    let target_engine = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let small = target_engine.alloc_host(64 << 10, Access::READ_WRITE).unwrap();
    let addr = target_engine.local_addr().unwrap();
    let engine = initiator().await;
    let service = TransferService::new(engine.clone());
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    let write = |seed: u64| {
        src.write_at(0, &pattern(4096, seed)).unwrap();
        TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 4096, 4096)])
    };
    tokio::time::timeout(T, service.clone().oneshot(write(1)))
        .await
        .unwrap()
        .unwrap();
    let mut got = vec![0u8; 4096];
    small.read_at(4096, &mut got).unwrap();
    assert_eq!(got, pattern(4096, 1));

    // A larger region registered while connected becomes the primary one once its advert arrives.
    let large = target_engine.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    let deadline = tokio::time::Instant::now() + T;
    let mut seed = 2;
    loop {
        tokio::time::timeout(T, service.clone().oneshot(write(seed)))
            .await
            .unwrap()
            .unwrap();
        large.read_at(4096, &mut got).unwrap();
        if got == pattern(4096, seed) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "offsets never moved to the larger region"
        );
        seed += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(service.stats().connects, 1);
}

/// Bound on any single request to the silent target, retries included (the stack's own deadline is
/// 5 s); past it the test calls the request hung.
const SILENT_HANG: Duration = Duration::from_secs(30);

/// A target that accepts connections and never answers: requests fail with `Timeout`, and the retry
/// budget bounds the attempts (and so the connections the listener sees).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_target_times_out_within_the_retry_budget() {
    let (addr, accepted, listener) = silent_listener().await;
    let engine = Engine::builder().build().await.unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
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
    let started = std::time::Instant::now();
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let service = service.clone();
            let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
            tokio::spawn(async move {
                let mut errors = Vec::new();
                for _ in 0..requests / 8 {
                    let r = tokio::time::timeout(SILENT_HANG, service.clone().oneshot(req.clone()))
                        .await
                        .expect("a request to a silent target hung");
                    errors.push(r.expect_err("a silent target cannot acknowledge a write"));
                }
                errors
            })
        })
        .collect();
    for w in workers {
        for e in tokio::time::timeout(SILENT_HANG, w)
            .await
            .expect("a worker hung")
            .unwrap()
        {
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

/// A request whose link is at hand is handed to the engine inside `call`; its future, dropped before
/// it is ever polled, sent nothing, and must not count as an attempt abandoned on the link (two of
/// those in a row would replace a healthy link). Nothing lands at the target, and the unit of the
/// in-flight limit comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn futures_dropped_unpolled_send_nothing_and_leave_the_link_alone() {
    let (_target, dst, addr) = target().await;
    let engine = initiator().await;
    let config = PoolConfig {
        max_in_flight: 1,
        ..PoolConfig::default()
    };
    let mut service = TransferService::with_config(engine.clone(), config).unwrap();
    let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
    src.write_at(0, &pattern(4096, 7)).unwrap();
    let write = || TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    let first = tokio::time::timeout(T, service.clone().oneshot(write()))
        .await
        .expect("hung");
    assert!(first.unwrap().new_link);
    dst.write_at(0, &[0u8; 4096]).unwrap();

    let strikes_to_replace = service.config().timeouts_before_reconnect;
    for _ in 0..strikes_to_replace + 1 {
        tokio::time::timeout(T, service.ready())
            .await
            .expect("the unit never came back")
            .unwrap();
        drop(service.call(write()));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut got = vec![1u8; 4096];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, vec![0u8; 4096], "an unpolled request wrote");
    let stats = service.stats();
    assert_eq!(
        (stats.links_dropped, stats.connects, stats.in_flight),
        (0, 1, 0),
        "{stats:?}"
    );

    let again = tokio::time::timeout(T, service.clone().oneshot(write()))
        .await
        .expect("hung");
    assert!(!again.unwrap().new_link, "the link was replaced");
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(4096, 7));
}

/// A request holds its link, not the service: dropping every clone of the service while requests
/// are under way leaves their link up until the last of them ends, and it closes then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_outlive_the_service_and_its_link_closes_after_them() {
    let (_target, dst, addr) = target().await;
    let engine = initiator().await;
    let src = engine.alloc_host(64 << 10, Access::READ_WRITE).unwrap();
    src.write_at(0, &pattern(64 << 10, 9)).unwrap();
    let mut service = TransferService::new(engine.clone());
    // The first request connects; the next two find the link and are started inside `call`.
    let first = TransferRequest::write(addr, [Descriptor::at_offset(src.addr(), 0, 4096)]);
    tokio::time::timeout(T, service.clone().oneshot(first))
        .await
        .unwrap()
        .unwrap();
    let mut pending = Vec::new();
    for i in 1..3u64 {
        let req = TransferRequest::write(addr, [Descriptor::at_offset(src.addr_at(i * 16384), i * 16384, 16384)]);
        poll_fn(|cx| service.poll_ready(cx)).await.unwrap();
        pending.push(service.call(req));
    }
    drop(service);
    // The pool is gone; a close it started would be done within this pause.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(engine.link_count(), 1, "the link closed under requests still to run");
    let last = pending.pop().unwrap();
    let resp = tokio::time::timeout(T, pending.pop().unwrap()).await.unwrap().unwrap();
    assert_eq!(resp.bytes, 16384);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(engine.link_count(), 1, "the link closed with a request still to run");
    tokio::time::timeout(T, last).await.unwrap().unwrap();
    let mut got = vec![0u8; 2 * 16384];
    dst.read_at(16384, &mut got).unwrap();
    assert_eq!(got, pattern(64 << 10, 9)[16384..3 * 16384], "bytes at the target");
    eventually("the pool's link closes after its last request", || {
        engine.link_count() == 0
    })
    .await;
}
