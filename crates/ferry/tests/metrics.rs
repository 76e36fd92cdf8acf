//! Metrics: after a known workload, the initiator's registry holds the exact bytes, batches,
//! descriptors and errors it posted, per transport and operation, and the target's the links,
//! regions and notifications it holds, read at scrape time.

use std::time::Duration;

use ferry::prometheus_client::encoding::text::encode;
use ferry::prometheus_client::registry::Registry;
use ferry::{Access, Engine, Notification, Op, TransferDesc, TransportKind};

const T: Duration = Duration::from_secs(10);

/// The value of the sample `name{labels}` in an OpenMetrics text, labels in any order.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, "}"));
        if metric != name {
            return None;
        }
        let rest = rest.strip_suffix('}')?;
        let have: Vec<&str> = rest.split(',').filter(|l| !l.is_empty()).collect();
        let want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        (have.len() == want.len() && want.iter().all(|w| have.contains(&w.as_str())))
            .then(|| value.parse().ok())
            .flatten()
    })
}

fn scrape(registry: &Registry) -> String {
    let mut text = String::new();
    encode(&mut text, registry).unwrap();
    text
}

async fn known_workload(transport: TransportKind) {
    let mut target_metrics = Registry::default();
    let target = Engine::builder()
        .transports([transport])
        .listen("127.0.0.1:0")
        .metrics(&mut target_metrics)
        .build()
        .await
        .unwrap();
    let dst = target.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    let mut metrics = Registry::default();
    let engine = Engine::builder()
        .transports([transport])
        .metrics(&mut metrics)
        .build()
        .await
        .unwrap();
    let src = engine.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    let addr = target.local_addr().unwrap();
    let peer = engine.connect(&addr.to_string(), T).await.unwrap();
    assert_eq!(peer.transport(), transport, "{:?}", peer.passed_over());
    let deadline = tokio::time::Instant::now() + T;
    while !peer.regions().iter().any(|r| r.key == dst.key()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the region never reached the peer"
        );
        peer.regions_changed(Duration::from_millis(50)).await;
    }

    // Five writes of three 4 KiB descriptors, two reads of one 8 KiB descriptor.
    for i in 0..5u64 {
        let descs: Vec<_> = (0..3u64)
            .map(|d| TransferDesc::new(src.addr_at((i * 3 + d) * 4096), dst.addr_at((i * 3 + d) * 4096), 4096))
            .collect();
        engine.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    }
    for _ in 0..2 {
        let descs = [TransferDesc::new(src.addr_at(1 << 19), dst.addr(), 8192)];
        engine.transfer(&peer, Op::Read, &descs, T).await.unwrap();
    }
    for n in 0..3 {
        engine
            .notify(&peer, Notification::new("step", n.to_string()), T)
            .await
            .unwrap();
    }
    // One batch that fails after it was posted: prepared, then its remote region goes away.
    let doomed = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    while !peer.regions().iter().any(|r| r.key == doomed.key()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the region never reached the peer"
        );
        peer.regions_changed(Duration::from_millis(50)).await;
    }
    let prepared = engine
        .prepare(&peer, Op::Write, &[TransferDesc::new(src.addr(), doomed.addr(), 4096)])
        .unwrap();
    doomed.deregister().await.unwrap();
    let failed = engine.transfer_prepared(&prepared, T).await.unwrap_err();

    let text = scrape(&metrics);
    let peer_label = addr.to_string();
    let labels = |op| {
        [
            ("peer", peer_label.as_str()),
            ("transport", transport.name()),
            ("op", op),
        ]
    };
    let value = |name: &str, op| sample(&text, name, &labels(op)).unwrap_or_else(|| panic!("no {name} {op}:\n{text}"));
    assert_eq!(value("ferry_transfer_bytes_total", "write"), 5.0 * 3.0 * 4096.0);
    assert_eq!(value("ferry_transfer_batches_total", "write"), 5.0);
    assert_eq!(value("ferry_transfer_descriptors_total", "write"), 15.0);
    assert_eq!(value("ferry_transfer_bytes_total", "read"), 2.0 * 8192.0);
    assert_eq!(value("ferry_transfer_batches_total", "read"), 2.0);
    let per_transport = [("transport", transport.name()), ("op", "write")];
    assert_eq!(
        sample(&text, "ferry_transfer_duration_seconds_count", &per_transport),
        Some(5.0),
        "{text}"
    );
    let error = [
        ("peer", peer_label.as_str()),
        ("transport", transport.name()),
        ("op", "write"),
        ("error", failed.code().name()),
    ];
    assert_eq!(
        sample(&text, "ferry_transfer_errors_total", &error),
        Some(1.0),
        "{failed}: {text}"
    );
    assert_eq!(sample(&text, "ferry_links_outgoing", &[]), Some(1.0), "{text}");
    // By the path each link took: this one on `transport`, none on the others.
    for kind in [TransportKind::Tcp, TransportKind::Shm, TransportKind::Rdma] {
        let want = if kind == transport { 1.0 } else { 0.0 };
        let by = [("transport", kind.name())];
        assert_eq!(sample(&text, "ferry_links_by_transport", &by), Some(want), "{text}");
    }
    // The default pool, "4:8": four buffers, none on loan once the transfers are done.
    assert_eq!(sample(&text, "ferry_coalesce_pool_buffers", &[]), Some(4.0), "{text}");
    assert_eq!(
        sample(&text, "ferry_coalesce_pool_buffers_in_use", &[]),
        Some(0.0),
        "{text}"
    );

    let text = scrape(&target_metrics);
    assert_eq!(
        sample(&text, "ferry_notifications_received_total", &[]),
        Some(3.0),
        "{text}"
    );
    assert_eq!(sample(&text, "ferry_notifications_queued", &[]), Some(3.0), "{text}");
    assert_eq!(sample(&text, "ferry_links_incoming", &[]), Some(1.0), "{text}");
    assert_eq!(sample(&text, "ferry_regions", &[]), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, "ferry_registered_bytes", &[]),
        Some((1 << 20) as f64),
        "{text}"
    );
    assert!(
        sample(&text, "ferry_transfer_bytes_total", &labels("write")).is_none(),
        "a target counts no transfer it did not post"
    );
    assert_eq!(target.take_notifications().len(), 3);
    let text = scrape(&target_metrics);
    assert_eq!(sample(&text, "ferry_notifications_queued", &[]), Some(0.0), "{text}");
    assert!(text.ends_with("# EOF\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_workload_over_tcp_counts_exactly() {
    known_workload(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_workload_over_shared_memory_counts_exactly() {
    if !ferry::capabilities().usable(TransportKind::Shm) {
        assert!(
            std::env::var_os("FERRY_REQUIRE_ALL").is_none(),
            "shared memory must be usable here"
        );
        eprintln!("skipped: no shared-memory transport in this build");
        return;
    }
    known_workload(TransportKind::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_without_metrics_registers_nothing() {
    let mut registry = Registry::default();
    // Registered, then the engine is built without them: nothing of it shows.
    let _unused = Engine::builder().metrics(&mut registry);
    let text = scrape(&registry);
    assert!(!text.contains("ferry_links"), "no engine, no state: {text}");
}
