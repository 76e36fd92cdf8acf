//! What a hostile peer can make a target hold, and whom it can keep out: every per-stream buffer has
//! a cap, what is read before admission is small, and connections that never authenticate cannot
//! lock authenticated peers out.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use common::raw::RawClient;
use common::*;
use ferry::codec::{self, Decoded, Frame, Limits, MAGIC, VERSION};
use ferry::{Access, Engine, Op, TlsConfig, TransferDesc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;

const PSK: [u8; 32] = [0x3c; 32];

async fn psk_engine(name: &str, listen: bool) -> Engine {
    let builder = Engine::builder().tls(TlsConfig::from_psk(&PSK, name).unwrap());
    let builder = match listen {
        true => builder.listen("127.0.0.1:0"),
        false => builder,
    };
    builder.build().await.unwrap()
}

/// The next frame on `rd` and its payload.
async fn next_answer(rd: &mut OwnedReadHalf, buf: &mut BytesMut) -> (Frame, Vec<u8>) {
    let Decoded { frame, payload_len } = next_frame(rd, buf).await;
    while (buf.len() as u64) < payload_len {
        assert!(rd.read_buf(buf).await.unwrap() > 0, "the target closed mid-payload");
    }
    (frame, buf.split_to(payload_len as usize).to_vec())
}

/// The next frame on `rd`, its payload read into `scratch` and dropped: no allocation that grows with
/// the payload.
async fn skip_answer(rd: &mut OwnedReadHalf, buf: &mut BytesMut, scratch: &mut [u8]) -> (Frame, u64) {
    let Decoded { frame, payload_len } = next_frame(rd, buf).await;
    let buffered = buf.len().min(payload_len as usize);
    buf.advance(buffered);
    let mut left = payload_len - buffered as u64;
    while left > 0 {
        let want = scratch.len().min(left as usize);
        let n = rd.read(&mut scratch[..want]).await.unwrap();
        assert!(n > 0, "the target closed mid-payload");
        left -= n as u64;
    }
    (frame, payload_len)
}

async fn next_frame(rd: &mut OwnedReadHalf, buf: &mut BytesMut) -> Decoded {
    loop {
        if let Some((d, used)) = codec::decode(buf, &Limits::default()).unwrap() {
            buf.advance(used);
            return d;
        }
        assert!(rd.read_buf(buf).await.unwrap() > 0, "the target closed the stream");
    }
}

/// A peer pipelines 20,000 READs of 16 KiB (under 1 MiB of frames, asking for 320 MiB of answers)
/// behind one large READ, reads the large answer, then stops reading. The target must not queue the
/// small answers in memory: it holds at most its cap of unsent answers and waits for the peer. When
/// the peer reads again, every answer comes, in order, with the region's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_reads_piped_by_a_peer_that_stops_reading_hold_bounded_memory() {
    let target = target().await;
    let small = target.alloc_host(16 << 10, Access::READ_WRITE).unwrap();
    let data = pattern(16 << 10, 9);
    small.write_at(0, &data).unwrap();
    let large = target.alloc_host(8 << 20, Access::READ_WRITE).unwrap();
    let (client, ack) = RawClient::handshake(target.local_addr().unwrap()).await;
    assert!(ack.refusal.is_none(), "{ack:?}");
    let (mut rd, mut wr, mut buf) = client.into_split();

    let count = 20_000u64;
    let mut frames = BytesMut::new();
    let large_read = Frame::Read {
        id: count,
        key: large.key(),
        offset: 0,
        len: 8 << 20,
    };
    codec::encode(&large_read, 0, &mut frames).unwrap();
    for id in 0..count {
        let read = Frame::Read {
            id,
            key: small.key(),
            offset: 0,
            len: 16 << 10,
        };
        codec::encode(&read, 0, &mut frames).unwrap();
    }
    let mut scratch = vec![1u8; 64 << 10];
    let before = rss_kib();
    let sender = tokio::spawn(async move { wr.write_all(&frames).await.map(|()| wr) });
    // The large answer, read whole; meanwhile the small READs wait in the target's socket.
    let skipped = tokio::time::timeout(T, skip_answer(&mut rd, &mut buf, &mut scratch)).await;
    let (frame, payload_len) = skipped.unwrap();
    assert!(matches!(frame, Frame::ReadData { id } if id == count), "{frame:?}");
    assert_eq!(payload_len, (8 << 20) + 1);
    // Now read nothing for a while: a target that queued answers grows by 16 KiB per READ it takes.
    let mut peak = before;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        peak = peak.max(rss_kib());
    }
    let grew_mib = peak.saturating_sub(before) / 1024;
    println!("{count} pipelined 16 KiB READs, answers unread: the process grew by {grew_mib} MiB");
    assert!(
        grew_mib < 16,
        "the target queued {grew_mib} MiB of answers for a peer that reads none"
    );
    // The stream was held back, not broken: every answer comes, in order, with the region's bytes.
    let read_all = async {
        for id in 0..count {
            let (frame, payload) = next_answer(&mut rd, &mut buf).await;
            assert!(matches!(frame, Frame::ReadData { id: got } if got == id), "{frame:?}");
            assert_eq!(&payload[..16 << 10], &data[..], "answer {id}");
            assert_eq!(payload[16 << 10], 0, "answer {id} is intact");
        }
    };
    tokio::time::timeout(Duration::from_secs(120), read_all)
        .await
        .expect("the answers were not all sent once the peer read again");
    tokio::time::timeout(T, sender).await.unwrap().unwrap().unwrap();
}

/// 240 plain connections to an authenticating engine, each announcing a 1 MiB hello and sending all
/// but its last byte: each is refused at the header, before the target holds the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_larger_than_a_hello_is_refused_before_its_body_is_held() {
    raise_fd_limit(4096);
    let target = psk_engine("target", true).await;
    let addr = target.local_addr().unwrap();
    let connections = 240;
    let body = 1usize << 20;
    let before = rss_kib();
    let closed = Arc::new(AtomicUsize::new(0));
    let mut holders = Vec::new();
    let all_sent = Arc::new(tokio::sync::Barrier::new(connections + 1));
    for _ in 0..connections {
        let (closed, all_sent) = (closed.clone(), all_sent.clone());
        holders.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let mut out = Vec::with_capacity(16 + body);
            out.extend_from_slice(&MAGIC.to_le_bytes());
            out.extend_from_slice(&[VERSION, 1]);
            out.extend_from_slice(&(body as u32).to_le_bytes());
            out.extend_from_slice(&0u64.to_le_bytes());
            out.resize(16 + body - 1, 0x41);
            // A target that refuses at the header closes while this is still being written.
            let _ = tokio::time::timeout(T, s.write_all(&out)).await;
            drop(out);
            all_sent.wait().await;
            let mut byte = [0u8; 1];
            if let Ok(Ok(0) | Err(_)) = tokio::time::timeout(T, s.read(&mut byte)).await {
                closed.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    all_sent.wait().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let grew_mib = rss_kib().saturating_sub(before) / 1024;
    for h in holders {
        h.await.unwrap();
    }
    println!("{connections} oversized hellos: the process grew by {grew_mib} MiB");
    assert!(grew_mib < 32, "the target held {grew_mib} MiB of hellos");
    assert_eq!(
        closed.load(Ordering::Relaxed),
        connections,
        "every oversized hello was refused"
    );
    // An authenticated peer is still served.
    let client = psk_engine("client", false).await;
    client.connect(&addr.to_string(), T).await.unwrap();
}

/// 2,000 silent sockets, and attackers that reopen sockets as the target closes them, against an
/// authenticating engine: authenticated peers still get in within their connect timeout, one after
/// another, while the flood goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_reopened_connections_cannot_lock_authenticated_peers_out() {
    raise_fd_limit(8192);
    let target = psk_engine("target", true).await;
    let addr = target.local_addr().unwrap();
    let src_data = pattern(4096, 2);
    let dst = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    dst.grant("client", Access::READ_WRITE).await.unwrap();

    let mut silent = Vec::new();
    for _ in 0..2000 {
        match TcpStream::connect(addr).await {
            Ok(s) => silent.push(s),
            Err(e) => panic!("the 2,000 silent sockets could not all connect: {e}"),
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let reopened = Arc::new(AtomicUsize::new(0));
    let reopeners: Vec<_> = (0..8)
        .map(|_| {
            let (stop, reopened) = (stop.clone(), reopened.clone());
            tokio::spawn(async move {
                let mut byte = [0u8; 1];
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut s) = TcpStream::connect(addr).await else {
                        continue;
                    };
                    reopened.fetch_add(1, Ordering::Relaxed);
                    // Hold it until the target closes it, then open the next.
                    let _ = tokio::time::timeout(Duration::from_secs(3), s.read(&mut byte)).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;

    for i in 0..5 {
        let client = psk_engine("client", false).await;
        let peer = client
            .connect(&addr.to_string(), Duration::from_secs(3))
            .await
            .unwrap_or_else(|e| panic!("authenticated peer {i} was kept out: {e:?}"));
        let src = client.register(src_data.clone(), Access::READ_WRITE).unwrap();
        let remote = peer.regions().iter().next().expect("the granted region").addr;
        client
            .transfer(&peer, Op::Write, &[TransferDesc::new(src.addr(), remote, 4096)], T)
            .await
            .unwrap();
        assert_eq!(dst.to_vec().unwrap(), src_data);
        dst.write_at(0, &[0; 4096]).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for r in reopeners {
        tokio::time::timeout(T, r).await.unwrap().unwrap();
    }
    println!(
        "5 authenticated peers got in past 2,000 silent sockets and {} reopened ones",
        reopened.load(Ordering::Relaxed)
    );
    drop(silent);
}

/// One peer identity fills its share of the notification budget: its next `notify` is refused, named,
/// and another peer's notifications still land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_fill_the_notification_budget_for_everyone() {
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .tls(TlsConfig::from_psk(&PSK, "target").unwrap())
        .max_notification_bytes(1 << 20)
        .max_notification_bytes_per_peer(256 << 10)
        .build()
        .await
        .unwrap();
    let addr = target.local_addr().unwrap().to_string();
    let flood = psk_engine("flood", false).await;
    let to_target = flood.connect(&addr, T).await.unwrap();
    let mut sent = 0usize;
    let refusal = loop {
        match flood
            .notify(&to_target, ferry::Notification::new("flood", "x".repeat(1000)), T)
            .await
        {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 2000, "the flood was never refused");
    };
    assert!(
        matches!(&refusal, ferry::Error::ResourceExhausted(m) if m.contains("flood")),
        "{refusal:?}"
    );
    let other = psk_engine("decode-1", false).await;
    let peer = other.connect(&addr, T).await.unwrap();
    other
        .notify(&peer, ferry::Notification::new("kv", "ready"), T)
        .await
        .expect("another peer's notification was refused because of the flood");
    let taken = target.take_notifications();
    assert_eq!(taken.len(), sent + 1);
    // Taken, the flood's share is free again.
    flood
        .notify(&to_target, ferry::Notification::new("flood", "again"), T)
        .await
        .unwrap();
}

/// One peer identity holds at most its quota of links and streams; past it its next link is refused,
/// named, and another peer still gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_holds_at_most_its_links_and_streams() {
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .tls(TlsConfig::from_psk(&PSK, "target").unwrap())
        .max_links_per_peer(2)
        .max_streams_per_peer(6)
        .build()
        .await
        .unwrap();
    let addr = target.local_addr().unwrap().to_string();
    let engine = |name: &'static str, streams: usize| async move {
        Engine::builder()
            .tls(TlsConfig::from_psk(&PSK, name).unwrap())
            .streams(streams)
            .build()
            .await
            .unwrap()
    };
    let (a, b, c) = (
        engine("flood", 2).await,
        engine("flood", 2).await,
        engine("flood", 1).await,
    );
    let _la = a.connect(&addr, T).await.unwrap();
    let lb = b.connect(&addr, T).await.unwrap();
    let err = c.connect(&addr, T).await.unwrap_err();
    assert!(
        matches!(&err, ferry::Error::ResourceExhausted(m) if m.contains("flood") && m.contains("links")),
        "{err:?}"
    );
    // Streams: two streams are left for `flood`, and a link of three does not fit.
    b.disconnect(&lb, T).await.unwrap();
    let wide = engine("flood", 3).await;
    let deadline = tokio::time::Instant::now() + T;
    let err = loop {
        // The closed link's quota comes back once the target has seen it close.
        match wide.connect(&addr, T).await {
            Err(e @ ferry::Error::ResourceExhausted(_)) if e.to_string().contains("streams") => break e,
            Err(ferry::Error::ResourceExhausted(_)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("expected a refusal for streams, got {other:?}"),
        }
    };
    assert!(err.to_string().contains("flood"), "{err:?}");
    // Another identity is not held back.
    let other = engine("decode-1", 4).await;
    other.connect(&addr, T).await.unwrap();
}
