//! Someone on the path between two authenticated engines: a TCP proxy that passes the TLS control
//! stream through untouched, and writes into or changes the bytes of a data stream after it joined.
//! By default a data stream's records carry tags under keys of the control stream's session, so the
//! target acts on none of it; with protection turned off (both ends opting out) the same attack
//! works, which is what shows these tests can fail.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use common::{T, pattern};
use ferry::codec::{self, Frame};
use ferry::{Access, DataProtection, DevelopmentCa, Engine, Op, TransferDesc, TransportKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const TCP: [TransportKind; 1] = [TransportKind::Tcp];

/// What the proxy does to the first data stream (the second connection of the link).
#[derive(Clone, Copy)]
enum Attack {
    /// Writes whatever the test sends on the channel into it, towards the target, between the
    /// initiator's own bytes.
    Inject,
    /// Flips every bit of the byte `n` bytes after the hello, towards the target.
    Flip(usize),
}

struct Proxy {
    addr: SocketAddr,
    /// Everything the target sent back on the first data stream.
    answers: Arc<Mutex<Vec<u8>>>,
    inject: mpsc::UnboundedSender<Vec<u8>>,
}

async fn proxy(target: SocketAddr, attack: Attack) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answers = Arc::new(Mutex::new(Vec::new()));
    let (inject, mut injections) = mpsc::unbounded_channel::<Vec<u8>>();
    let seen = answers.clone();
    tokio::spawn(async move {
        let mut index = 0;
        loop {
            let Ok((from, _)) = listener.accept().await else { return };
            let to = TcpStream::connect(target).await.unwrap();
            let (mut from_r, mut from_w) = from.into_split();
            let (mut to_r, mut to_w) = to.into_split();
            if index != 1 {
                tokio::spawn(async move { tokio::io::copy(&mut from_r, &mut to_w).await });
                tokio::spawn(async move { tokio::io::copy(&mut to_r, &mut from_w).await });
            } else {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n) = to_r.read(&mut buf).await {
                        if n == 0 || from_w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        seen.lock().unwrap().extend_from_slice(&buf[..n]);
                    }
                });
                // The data stream's hello: whole, as the initiator sent it.
                let mut header = [0u8; codec::HEADER_LEN];
                from_r.read_exact(&mut header).await.unwrap();
                let body = u32::from_le_bytes(header[4..8].try_into().unwrap()) as usize;
                let mut hello = vec![0u8; body];
                from_r.read_exact(&mut hello).await.unwrap();
                to_w.write_all(&header).await.unwrap();
                to_w.write_all(&hello).await.unwrap();
                let mut injections = std::mem::replace(&mut injections, mpsc::unbounded_channel().1);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    let mut passed = 0usize;
                    loop {
                        tokio::select! {
                            read = from_r.read(&mut buf) => {
                                let n = match read { Ok(0) | Err(_) => break, Ok(n) => n };
                                if let Attack::Flip(at) = attack
                                    && (passed..passed + n).contains(&at)
                                {
                                    buf[at - passed] ^= 0xff;
                                }
                                passed += n;
                                if to_w.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                            Some(bytes) = injections.recv() => {
                                if to_w.write_all(&bytes).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                });
            }
            index += 1;
        }
    });
    Proxy { addr, answers, inject }
}

/// A target holding a 64 KiB secret granted to "victim", and the victim's engine, connected to it
/// through a proxy that attacks as `attack` says; both ends protect data as `protection` says.
async fn link_through_proxy(
    protection: DataProtection,
    attack: Attack,
) -> (Engine, ferry::Region, Engine, ferry::Peer, Proxy) {
    let ca = DevelopmentCa::new("injection test CA").unwrap();
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .transports(TCP)
        .tls(ca.config("target").unwrap().data_protection(protection))
        .build()
        .await
        .unwrap();
    let secret = target.alloc_host(64 << 10, Access::READ_WRITE).unwrap();
    secret.write_at(0, &pattern(64 << 10, 0x5e)).unwrap();
    secret.grant("victim", Access::READ_WRITE).await.unwrap();
    let proxy = proxy(target.local_addr().unwrap(), attack).await;
    let victim = Engine::builder()
        .transports(TCP)
        .streams(1)
        .tls(ca.config("victim").unwrap().data_protection(protection))
        .build()
        .await
        .unwrap();
    let peer = victim.connect(&proxy.addr.to_string(), T).await.unwrap();
    assert_eq!(peer.tcp_streams(), 2, "a control stream and one data stream");
    (target, secret, victim, peer, proxy)
}

/// The frames the proxy injects: a READ of the victim's 64 bytes, and a WRITE of 64 bytes of 0xEE
/// over its start, both named as the victim names them.
fn forged_frames(peer: &ferry::Peer, secret: &ferry::Region) -> Vec<u8> {
    let regions = peer.regions();
    let (ad, offset) = regions.find(secret.addr_for("victim"), 64, Access::READ).unwrap();
    let mut out = bytes::BytesMut::new();
    let read = Frame::Read {
        id: 9_000,
        key: ad.key,
        offset,
        len: 64,
    };
    codec::encode(&read, 0, &mut out).unwrap();
    let write = Frame::Write {
        id: 9_001,
        key: ad.key,
        offset,
        durability: ferry::Durability::Completed,
    };
    codec::encode(&write, 64, &mut out).unwrap();
    out.extend_from_slice(&[0xEE; 64]);
    out.to_vec()
}

fn leaked(answers: &Mutex<Vec<u8>>, secret: &[u8]) -> bool {
    answers.lock().unwrap().windows(64).any(|w| w == secret)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_injected_into_a_data_stream_are_not_acted_on() {
    let (_target, secret, _victim, peer, proxy) = link_through_proxy(DataProtection::Integrity, Attack::Inject).await;
    let before = secret.to_vec().unwrap();
    proxy.inject.send(forged_frames(&peer, &secret)).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(
        !leaked(&proxy.answers, &before[..64]),
        "an injected READ was answered with the victim's bytes"
    );
    assert_eq!(secret.to_vec().unwrap(), before, "an injected WRITE landed");
}

/// The same attack on streams whose protection both ends turned off: it works (this is the attack
/// the default stops).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_protection_the_same_injection_reads_and_writes() {
    let (_target, secret, _victim, peer, proxy) = link_through_proxy(DataProtection::Plain, Attack::Inject).await;
    let before = secret.to_vec().unwrap();
    proxy.inject.send(forged_frames(&peer, &secret)).unwrap();
    let deadline = tokio::time::Instant::now() + T;
    while !(leaked(&proxy.answers, &before[..64]) && secret.to_vec().unwrap()[..64] == [0xEE; 64]) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the injection into a plain stream did not work"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A byte of a WRITE's payload changed on the way: the write is not reported done, and the changed
/// byte does not land (every byte at the target is the old one or the one written). Without
/// protection the write reports `Ok` with a wrong byte in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_byte_fails_the_write_and_never_lands() {
    for protection in [
        DataProtection::Integrity,
        DataProtection::Encrypted,
        DataProtection::Plain,
    ] {
        // Well into the payload of the write below (after its frame header).
        let (_target, secret, victim, peer, _proxy) = link_through_proxy(protection, Attack::Flip(40_000)).await;
        let before = secret.to_vec().unwrap();
        let data = pattern(64 << 10, 0xda);
        let src = victim.register(data.clone(), Access::READ_WRITE).unwrap();
        let desc = TransferDesc::new(src.addr(), secret.addr_for("victim"), 64 << 10);
        let result = victim.transfer(&peer, Op::Write, &[desc], T).await;
        let after = secret.to_vec().unwrap();
        let foreign = (0..after.len())
            .filter(|&i| after[i] != before[i] && after[i] != data[i])
            .count();
        match protection {
            DataProtection::Plain => {
                assert!(result.is_ok(), "{result:?}");
                assert_eq!(foreign, 1, "the flipped byte landed and the write was reported done");
            }
            _ => {
                assert!(
                    result.is_err(),
                    "{protection}: a write whose bytes were changed was reported done"
                );
                assert_eq!(foreign, 0, "{protection}: a changed byte landed");
            }
        }
    }
}
