//! HIXL's limits and return codes: links, notifications, names, connects that cannot succeed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ferry::{Engine, Error, Notification};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_513th_link_is_refused() {
    raise_fd_limit(4096);
    let target = target().await;
    let addr = target.local_addr().unwrap().to_string();
    let mut clients = Vec::new();
    for _ in 0..512 {
        let e = Engine::builder().streams(1).build().await.unwrap();
        let p = e.connect(&addr, T).await.unwrap();
        clients.push((e, p));
    }
    assert_eq!(target.link_count(), 512);
    let extra = Engine::builder().streams(1).build().await.unwrap();
    let err = extra.connect(&addr, T).await.unwrap_err();
    assert!(matches!(err, Error::ResourceExhausted(_)), "{err:?}");
    // Once one link goes, a new one fits.
    let (e, p) = clients.pop().unwrap();
    e.disconnect(&p, T).await.unwrap();
    let deadline = Instant::now() + T;
    loop {
        match extra.connect(&addr, T).await {
            Ok(_) => break,
            Err(Error::ResourceExhausted(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("{e:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outgoing_links_count_too() {
    let a = target().await;
    let b = target().await;
    let client = Engine::builder().max_links(1).build().await.unwrap();
    client.connect(&a.local_addr().unwrap().to_string(), T).await.unwrap();
    let err = client
        .connect(&b.local_addr().unwrap().to_string(), T)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ResourceExhausted(_)), "{err:?}");
}

/// Peers that hold every incoming slot of an engine (anyone can, on an engine open to anyone) do not
/// stop it from connecting out: the two directions are counted apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_incoming_slots_leave_outgoing_ones_free() {
    let busy = Engine::builder()
        .listen("127.0.0.1:0")
        .max_links(2)
        .build()
        .await
        .unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let mut hostile = Vec::new();
    for _ in 0..2 {
        let e = Engine::builder().streams(1).build().await.unwrap();
        let p = e.connect(&addr, T).await.unwrap();
        hostile.push((e, p));
    }
    let one_more = Engine::builder().streams(1).build().await.unwrap();
    let err = one_more.connect(&addr, T).await.unwrap_err();
    assert!(matches!(err, Error::ResourceExhausted(_)), "incoming is full: {err:?}");
    let other = target().await;
    busy.connect(&other.local_addr().unwrap().to_string(), T)
        .await
        .expect("connecting out with every incoming slot taken");
    assert_eq!(busy.link_count(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_4097th_pending_notification_is_refused() {
    let (target, initiator, peer) = pair().await;
    for i in 0..4096 {
        initiator
            .notify(&peer, Notification::new("n", i.to_string()), T)
            .await
            .unwrap();
    }
    let err = initiator
        .notify(&peer, Notification::new("n", "one too many"), T)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ResourceExhausted(_)), "{err:?}");
    let got = target.take_notifications();
    assert_eq!(got.len(), 4096);
    assert!(
        got.iter().enumerate().all(|(i, n)| n.notification.msg == i.to_string()),
        "in order"
    );
    assert_eq!(got[0].from_engine, initiator.id());
    // Drained: accepted again.
    initiator
        .notify(&peer, Notification::new("n", "after drain"), T)
        .await
        .unwrap();
    assert_eq!(target.take_notifications()[0].notification.msg, "after drain");
}

/// Connect, fill the link's share of the queue, disconnect, again: the notifications of closed links
/// still count, against a byte budget for the whole queue, so memory stays bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_links_notifications_count_against_a_byte_budget() {
    let budget = 256 << 10;
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .max_pending_notifications(64)
        .max_notification_bytes(budget)
        .build()
        .await
        .unwrap();
    let addr = target.local_addr().unwrap().to_string();
    let text = "x".repeat(1000);
    let mut refused = None;
    'flood: for round in 0..64 {
        let e = Engine::builder().streams(1).build().await.unwrap();
        let p = e.connect(&addr, T).await.unwrap();
        for i in 0..64 {
            if let Err(err) = e.notify(&p, Notification::new("flood", text.clone()), T).await {
                refused = Some((round, i, err));
                break 'flood;
            }
        }
        e.disconnect(&p, T).await.unwrap();
    }
    let (round, _, err) = refused.expect("the queue never filled: its memory is unbounded");
    assert!(
        matches!(err, Error::ResourceExhausted(ref m) if m.contains("bytes")),
        "{err:?}"
    );
    assert!(round >= 3, "refused by the per-link limit instead ({round})");
    let held: usize = target
        .take_notifications()
        .iter()
        .map(|n| n.notification.msg.len())
        .sum();
    assert!(held <= budget, "{held} bytes of text held against a budget of {budget}");
    // Drained: a new link is served again.
    let e = Engine::builder().build().await.unwrap();
    let p = e.connect(&addr, T).await.unwrap();
    e.notify(&p, Notification::new("n", "after drain"), T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notification_fields_over_1024_characters_are_refused() {
    let (target, initiator, peer) = pair().await;
    let err = initiator
        .notify(&peer, Notification::new("a".repeat(1025), ""), T)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    let err = initiator
        .notify(&peer, Notification::new("", "m".repeat(1025)), T)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    initiator
        .notify(&peer, Notification::new("ü".repeat(1024), "m".repeat(1024)), T)
        .await
        .unwrap();
    let got = target.take_notifications();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].notification.name.chars().count(), 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_closed_port_fails_fast() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let client = Engine::builder().build().await.unwrap();
    let started = Instant::now();
    let err = client
        .connect(&format!("127.0.0.1:{port}"), Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        matches!(
            &err,
            Error::Io {
                kind: std::io::ErrorKind::ConnectionRefused,
                ..
            } | Error::Timeout(_)
        ),
        "{err:?}"
    );
    assert!(err.is_retryable());
    assert_eq!(client.link_count(), 0, "a failed connect holds no link slot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_name_that_does_not_resolve() {
    let client = Engine::builder().build().await.unwrap();
    let err = client
        .connect("no-such-host.invalid:9955", Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Io { .. } | Error::Timeout(_)), "{err:?}");
    let err = client
        .connect("not an address", Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_listener_times_out() {
    // Accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let client = Engine::builder().build().await.unwrap();
    let started = Instant::now();
    let err = client
        .connect(&addr.to_string(), Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn already_connected_and_not_connected() {
    let (target, initiator, peer) = pair().await;
    let addr = target.local_addr().unwrap().to_string();
    assert!(matches!(
        initiator.connect(&addr, T).await,
        Err(Error::AlreadyConnected(_))
    ));
    initiator.disconnect(&peer, T).await.unwrap();
    assert!(matches!(
        initiator.disconnect(&peer, T).await,
        Err(Error::NotConnected(_))
    ));
    assert!(matches!(
        initiator.notify(&peer, Notification::new("x", "y"), T).await,
        Err(Error::NotConnected(_))
    ));
    // And connecting again works.
    initiator.connect(&addr, T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_options_are_refused() {
    for bad in ["4", "0:8", "x:y", "65:8"] {
        let err = Engine::builder().buffer_pool(bad).build().await.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{bad}: {err:?}");
    }
    assert!(Engine::builder().buffer_pool("0:0").build().await.is_ok());
    assert!(matches!(
        Engine::builder().streams(0).build().await,
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Engine::builder().streams(65).build().await,
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Engine::builder().max_links(0).build().await,
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restricting_to_an_unavailable_transport_is_unsupported() {
    // This test binary is built without the `rdma` feature (or runs on a host without a device).
    let caps = ferry::capabilities();
    if !caps.usable(ferry::TransportKind::Rdma) {
        let err = Engine::builder()
            .transports([ferry::TransportKind::Rdma])
            .build()
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err:?}");
    }
    let tcp_only = Engine::builder()
        .transports([ferry::TransportKind::Tcp])
        .build()
        .await
        .unwrap();
    assert_eq!(tcp_only.transports(), vec![ferry::TransportKind::Tcp]);
}

/// A peer that asks for data and stops reading the answers: once the sent data has waited
/// unacknowledged past the send timeout (its receive window stays shut), the target gives the
/// connection up, without a timer per send, and serves others meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_is_cut_off_after_the_send_timeout() {
    use common::raw::RawClient;
    use ferry::codec::Frame;
    use tokio::io::AsyncReadExt;
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .send_timeout(Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    let region = target.alloc_host(1 << 20, ferry::Access::READ_WRITE).unwrap();
    let addr = target.local_addr().unwrap();
    let (mut c, _) = RawClient::handshake(addr).await;
    // 64 MiB of answers asked for, far more than the socket buffers hold; none read.
    for id in 0..64 {
        c.send(
            &Frame::Read {
                id,
                key: region.key(),
                offset: 0,
                len: 1 << 20,
            },
            &[],
        )
        .await;
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Another peer is served meanwhile.
    let (initiator, peer) = {
        let e = Engine::builder().build().await.unwrap();
        let p = e.connect(&addr.to_string(), T).await.unwrap();
        (e, p)
    };
    let mine = initiator.alloc_host(4096, ferry::Access::READ_WRITE).unwrap();
    initiator
        .transfer(
            &peer,
            ferry::Op::Read,
            &[ferry::TransferDesc::new(mine.addr(), region.addr(), 4096)],
            T,
        )
        .await
        .unwrap();
    // Now read: what the kernels buffered, then the end the target made, well before all 64 MiB.
    let mut total = 0usize;
    let mut buf = vec![0u8; 1 << 20];
    let ended = tokio::time::timeout(T, async {
        loop {
            match c.stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => total += n,
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the connection was never cut off");
    assert!(
        total < 64 << 20,
        "every answer arrived ({total} bytes): nothing was cut off"
    );
}
