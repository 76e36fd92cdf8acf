//! Same-host data-path setups under abuse. A setup costs the target more than the frame that asks for
//! it: a link may make a burst of them and a few a second after that, and a setup that is replaced
//! releases its thread and socket at once. And the socket a setup opens is reachable by anyone on the
//! host: a squatter neither gets in nor keeps the initiator out. In a file of its own, so that the
//! threads and descriptors it counts are its own.
#![cfg(feature = "shm")]

mod common;

use std::time::Duration;

use common::raw::RawClient;
use common::*;
use ferry::codec::Frame;
use ferry::{ErrorCode, TransportKind};
use ferry_proto::shm::{Answer, Offer, PROBE_LEN};
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};

fn shm_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("ferry-shm"))
        .count()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// 300 same-host setups on one link, as fast as the peer can send them: most are refused for the
/// link's budget, and once the answers are in, the replaced ones have left no thread or descriptor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_setups_is_refused_past_a_budget_and_replaced_setups_release_everything() {
    // Same-host setups need a target that offers shared memory, also in the run restricted to TCP.
    let target = ferry::Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let (mut c, ack) = RawClient::handshake(target.local_addr().unwrap()).await;
    assert!(ack.refusal.is_none(), "{ack:?}");
    let probe = Box::new([0x6b_u8; PROBE_LEN]);
    let offer = Offer {
        facts: ferry_shm::host::here().unwrap(),
        probe_addr: probe.as_ptr() as u64,
        probe: *probe,
    };
    let blob = offer.encode();
    let (threads_before, fds_before) = (shm_threads(), open_fds());
    let setups = 300u64;
    for id in 0..setups {
        let setup = Frame::TransportSetup {
            id,
            kind: TransportKind::Shm,
            blob: blob.clone(),
        };
        c.send(&setup, &[]).await;
    }
    let (mut accepted, mut refused) = (0u32, 0u32);
    for _ in 0..setups {
        let answer = tokio::time::timeout(T, c.recv()).await.unwrap().expect("an answer");
        match answer.frame {
            Frame::TransportSetupReply { error: None, .. } => accepted += 1,
            Frame::TransportSetupReply { error: Some(e), .. } => {
                assert_eq!(e.code, ErrorCode::ResourceExhausted, "{e:?}");
                refused += 1;
            }
            other => panic!("expected a setup reply, got {other:?}"),
        }
    }
    println!("{setups} setups: {accepted} accepted, {refused} refused");
    assert!(accepted >= 1, "the first setups are served");
    assert!(
        accepted <= ferry_proto::SetupBudget::BURST + 8,
        "{accepted} setups were served at once"
    );
    // Every setup but the last was replaced: their threads and sockets go at once, not when the
    // initiator's time to connect runs out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    let (mut threads, mut fds) = (shm_threads(), open_fds());
    while (threads > threads_before + 1 || fds > fds_before + 2) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        (threads, fds) = (shm_threads(), open_fds());
    }
    println!(
        "after the flood: {} more shared-memory threads, {} more descriptors",
        threads - threads_before,
        fds.saturating_sub(fds_before)
    );
    assert!(
        threads <= threads_before + 1,
        "{} setup threads outlived their replacement",
        threads - threads_before
    );
    assert!(
        fds <= fds_before + 2,
        "{} descriptors outlived their setups",
        fds - fds_before
    );
    // The link is still served.
    c.send(&Frame::Ping { nonce: 3 }, &[]).await;
    let pong = tokio::time::timeout(T, c.recv()).await.unwrap().unwrap();
    assert!(matches!(pong.frame, Frame::Pong { nonce: 3 }), "{:?}", pong.frame);
    drop(probe);
}

/// Someone on the host connects to the link's socket before the initiator does and sends a wrong
/// token: the target closes that connection and keeps waiting, and the initiator's own connection,
/// with the right token, is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_squatter_on_the_link_socket_neither_gets_in_nor_keeps_the_initiator_out() {
    let target = ferry::Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let (mut c, _) = RawClient::handshake(target.local_addr().unwrap()).await;
    let probe = Box::new([0x6b_u8; PROBE_LEN]);
    let offer = Offer {
        facts: ferry_shm::host::here().unwrap(),
        probe_addr: probe.as_ptr() as u64,
        probe: *probe,
    };
    let setup = Frame::TransportSetup {
        id: 1,
        kind: TransportKind::Shm,
        blob: offer.encode(),
    };
    c.send(&setup, &[]).await;
    let answer = match tokio::time::timeout(T, c.recv()).await.unwrap().unwrap().frame {
        Frame::TransportSetupReply { error: None, blob, .. } => Answer::decode(&blob).unwrap(),
        other => panic!("expected a setup answer, got {other:?}"),
    };
    let name = format!("ferry-shm-{}", String::from_utf8_lossy(&answer.socket));
    let addr = SocketAddr::from_abstract_name(name).unwrap();
    let token = answer.token;
    let outcome = tokio::task::spawn_blocking(move || {
        // The squatter: first to connect, with a wrong token; the target closes it.
        let mut squatter = UnixStream::connect_addr(&addr).unwrap();
        let mut wrong = token;
        wrong[0] ^= 0xff;
        squatter.write_all(&wrong).unwrap();
        squatter.set_read_timeout(Some(T)).unwrap();
        let mut byte = [0u8; 1];
        let squatter_closed = matches!(squatter.read(&mut byte), Ok(0) | Err(_));
        // The initiator connects after it, with its token, and stays connected.
        let mut initiator = UnixStream::connect_addr(&addr).expect("the initiator was kept out");
        initiator.write_all(&token).unwrap();
        initiator.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let served = match initiator.read(&mut byte) {
            Err(e) => matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
            Ok(_) => false,
        };
        (squatter_closed, served)
    })
    .await
    .unwrap();
    assert_eq!(outcome, (true, true), "(squatter closed, initiator served)");
    drop(probe);
}
