//! Authenticated links: mutual TLS on the control stream, data streams that join only with the
//! session's proof, and what an engine that authenticates tells (nothing) to those who do not.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{T, pattern, raw::RawClient};
use ferry::codec::{Frame, Hello};
use ferry::{Access, DevelopmentCa, Engine, Error, ErrorCode, Notification, Op, TlsConfig, TransferDesc};
use ferry_proto::auth::JOIN_EXPORTER_LABEL;
use ferry_proto::{JoinKey, LinkToken, StreamIndex};

const INTEGRITY: ferry::DataProtection = ferry::DataProtection::Integrity;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A certificate authority for one test: the library's development CA, with the tests' unwraps.
struct Ca(DevelopmentCa);

impl Ca {
    fn new(name: &str) -> Ca {
        Ca(DevelopmentCa::new(name).unwrap())
    }

    /// PEM certificate and key for `name`, valid for that name and 127.0.0.1.
    fn issue(&self, name: &str) -> (String, String) {
        let issued = self.0.issue(name, &[]).unwrap();
        (issued.cert, issued.key)
    }

    fn pem(&self) -> String {
        self.0.cert_pem()
    }

    /// A TLS configuration for an engine named `name`, trusting this CA.
    fn config(&self, name: &str) -> TlsConfig {
        self.0.config(name).unwrap()
    }
}

async fn tls_target(ca: &Ca, name: &str) -> (Engine, SocketAddr) {
    let engine = Engine::builder()
        .listen("127.0.0.1:0")
        .tls(ca.config(name))
        .build()
        .await
        .unwrap();
    let addr = engine.local_addr().unwrap();
    (engine, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authenticated_engines_move_data_and_know_who_they_talk_to() {
    let ca = Ca::new("ferry test CA");
    let (target, addr) = tls_target(&ca, "kv-cache-0").await;
    let dst = target.alloc_host(4 << 20, Access::READ_WRITE).unwrap();
    dst.grant("decode-3", Access::READ_WRITE).await.unwrap();
    let initiator = Engine::builder().tls(ca.config("decode-3")).build().await.unwrap();
    let src = initiator.alloc_host(4 << 20, Access::READ_WRITE).unwrap();
    let data = pattern(4 << 20, 7);
    src.write_at(0, &data).unwrap();

    let peer = initiator.connect(&addr.to_string(), T).await.unwrap();
    let identity = peer.identity().expect("an authenticated link names its peer");
    assert_eq!(identity.name, "kv-cache-0");
    assert!(identity.subject.contains("CN=kv-cache-0"), "{identity:?}");
    assert!(identity.alt_names.contains(&"127.0.0.1".to_string()), "{identity:?}");
    // The peer knows the region by a key and an address of its own, which the target's application
    // can look up to hand out; the raw ones are never told.
    let ad = peer.regions().iter().next().cloned().unwrap();
    let at = dst.addr_for("decode-3");
    assert_eq!((ad.key, ad.addr), (dst.key_for("decode-3"), at));
    assert_ne!(ad.key, dst.key());
    assert_ne!(ad.addr, dst.addr());

    // Large and small writes, and a read back, over the plain data streams.
    let descs = [
        TransferDesc::new(src.addr(), at, 3 << 20),
        TransferDesc::new(src.addr_at(3 << 20), at + (3 << 20), 64),
        TransferDesc::new(src.addr_at((3 << 20) + 64), at + (3 << 20) + 64, (1 << 20) - 64),
    ];
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    let mut got = vec![0u8; 4 << 20];
    dst.read_at(0, &mut got).unwrap();
    assert!(got == data, "the target holds what was written");
    let back = initiator.alloc_host(4 << 20, Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Read, &[TransferDesc::new(back.addr(), at, 4 << 20)], T)
        .await
        .unwrap();
    back.read_at(0, &mut got).unwrap();
    assert!(got == data, "the read brought the same bytes back");

    // The target labels notifications with the certificate's name, not a claimed engine id.
    initiator
        .notify(&peer, Notification::new("kv", "block 7 ready"), T)
        .await
        .unwrap();
    let received = target.take_notifications();
    assert_eq!(received.len(), 1);
    let from = received[0].from_identity.as_ref().expect("an authenticated sender");
    assert_eq!(from.name, "decode-3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypting_every_stream_moves_the_same_bytes() {
    let ca = Ca::new("ferry test CA");
    let (target, addr) = tls_target(&ca, "target").await;
    let dst = target.alloc_host(2 << 20, Access::READ_WRITE).unwrap();
    dst.grant_all(Access::READ_WRITE).await.unwrap();
    let initiator = Engine::builder()
        .tls(ca.config("client").encrypt_data(true))
        .build()
        .await
        .unwrap();
    let src = initiator.alloc_host(2 << 20, Access::READ_WRITE).unwrap();
    let data = pattern(2 << 20, 3);
    src.write_at(0, &data).unwrap();
    let peer = initiator.connect(&addr.to_string(), T).await.unwrap();
    let descs: Vec<_> = (0..64u64)
        .map(|i| TransferDesc::new(src.addr_at(i * 32768), dst.addr_for("client") + i * 32768, 32768))
        .collect();
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    let back = initiator.alloc_host(2 << 20, Access::READ_WRITE).unwrap();
    initiator
        .transfer(
            &peer,
            Op::Read,
            &[TransferDesc::new(back.addr(), dst.addr_for("client"), 2 << 20)],
            T,
        )
        .await
        .unwrap();
    let mut got = vec![0u8; 2 << 20];
    back.read_at(0, &mut got).unwrap();
    assert!(got == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_client_learns_nothing() {
    let ca = Ca::new("ferry test CA");
    let (target, addr) = tls_target(&ca, "target").await;
    let _secret = target.alloc_host(4096, Access::READ_WRITE).unwrap();

    // A plain hello for a control stream: refused, with no engine id, host, transports or regions.
    let (_c, ack) = RawClient::handshake(addr).await;
    let refusal = ack.refusal.expect("refused");
    assert_eq!(refusal.code, ErrorCode::PermissionDenied, "{refusal:?}");
    assert_eq!((ack.engine_id, ack.host_id), (0, 0));
    assert!(ack.transports.is_empty() && ack.regions.is_empty());

    // An engine without TLS cannot connect, and the target holds no link for it.
    let open = Engine::builder().build().await.unwrap();
    let err = open.connect(&addr.to_string(), T).await.unwrap_err();
    assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");
    assert_eq!(target.link_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_from_another_ca_are_refused_both_ways() {
    let ca = Ca::new("ferry test CA");
    let rogue = Ca::new("rogue CA");
    let (target, addr) = tls_target(&ca, "target").await;
    let outsider = Engine::builder().tls(rogue.config("outsider")).build().await.unwrap();
    let err = outsider.connect(&addr.to_string(), T).await.unwrap_err();
    assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");
    assert_eq!(target.link_count(), 0);

    // A client of the right CA does not talk to a target of another, nor to an open one: no fallback.
    let (_rogue_target, rogue_addr) = tls_target(&rogue, "rogue-target").await;
    let client = Engine::builder().tls(ca.config("client")).build().await.unwrap();
    let err = client.connect(&rogue_addr.to_string(), T).await.unwrap_err();
    assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");
    let open_target = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let err = client
        .connect(&open_target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");
    assert_eq!(open_target.link_count(), 0);
}

/// A TLS connection to `addr` with a certificate for `name`, and the join key of its session.
async fn raw_tls(
    ca: &Ca,
    name: &str,
    addr: SocketAddr,
) -> (tokio_rustls::client::TlsStream<tokio::net::TcpStream>, JoinKey) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let (cert, key) = ca.issue(name);
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(
            vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
            PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
        )
        .unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(client))
        .connect(ServerName::IpAddress(addr.ip().into()), tcp)
        .await
        .unwrap();
    let secret = tls
        .get_ref()
        .1
        .export_keying_material([0u8; 32], JOIN_EXPORTER_LABEL, None)
        .unwrap();
    (tls, JoinKey::from_exported(&secret))
}

/// The control stream of a one-stream link of `name`'s, opened by hand: TLS, then an accepted hello.
async fn raw_link(ca: &Ca, name: &str, addr: SocketAddr) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let (mut raw, _) = raw_tls(ca, name, addr).await;
    let hello = Frame::Hello(Hello {
        engine_id: 5,
        link_token: 0x1234,
        stream_index: 0,
        stream_count: 1,
        transports: vec![ferry::TransportKind::Tcp],
        host_id: 0,
        join_proof: [0; 32],
        protection: ferry::DataProtection::Plain,
    });
    assert!(matches!(exchange(&mut raw, &hello, &[]).await, Frame::HelloAck(a) if a.refusal.is_none()));
    raw
}

/// A refusal's message names regions only by the keys the peer sent: from a region's real key a
/// peer would recover the mask its keys are derived with.
fn assert_names_no_real_key(answer: &Frame, asked: &Frame, real: &[ferry::RegionKey]) {
    let Frame::Ack { error: Some(e), .. } = answer else {
        panic!("expected a refusal, got {answer:?}")
    };
    let sent = match asked {
        Frame::Read { key, .. } | Frame::Write { key, .. } => *key,
        other => panic!("not a one-region request: {other:?}"),
    };
    for key in real.iter().filter(|k| **k != sent) {
        assert!(
            !e.message.contains(&format!("{:016x}", key.0)),
            "a refusal names the region's real key: {}",
            e.message
        );
    }
}

/// Starts a 64 KiB write (operation 1) at the start of the region the raw link knows as `key`: its
/// header and the first half of its payload (bytes 0xaa), the rest left for later.
async fn start_half_write(raw: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>, key: ferry::RegionKey) {
    let mut out = bytes::BytesMut::new();
    let write = Frame::Write {
        id: 1,
        key,
        offset: 0,
        durability: ferry::Durability::Completed,
    };
    ferry::codec::encode(&write, 64 << 10, &mut out).unwrap();
    out.extend_from_slice(&[0xaa; 32 << 10]);
    raw.write_all(&out).await.unwrap();
    raw.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Sends `frame` (and `payload`) on a raw TLS stream and returns the next frame that comes back (its
/// payload, if any, read and dropped).
async fn exchange(
    tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    frame: &Frame,
    payload: &[u8],
) -> Frame {
    let mut out = bytes::BytesMut::new();
    ferry::codec::encode(frame, payload.len() as u64, &mut out).unwrap();
    out.extend_from_slice(payload);
    tls.write_all(&out).await.unwrap();
    tls.flush().await.unwrap();
    // Exactly one frame: the header says how long its body is.
    let mut frame = vec![0u8; ferry::codec::HEADER_LEN];
    tokio::time::timeout(T, tls.read_exact(&mut frame))
        .await
        .unwrap()
        .unwrap();
    let body_len = u32::from_le_bytes(frame[4..8].try_into().unwrap()) as usize;
    frame.resize(ferry::codec::HEADER_LEN + body_len, 0);
    tls.read_exact(&mut frame[ferry::codec::HEADER_LEN..]).await.unwrap();
    let (decoded, _) = ferry::codec::decode(&frame, &Default::default()).unwrap().unwrap();
    let mut payload = vec![0u8; decoded.payload_len as usize];
    tls.read_exact(&mut payload).await.unwrap();
    decoded.frame
}

/// Speaks the protocol by hand: a TLS control stream with a known token, then plain streams that
/// try to join it with no proof, another session's proof, and the right one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_joins_only_with_the_sessions_proof() {
    let ca = Ca::new("ferry test CA");
    let (target, addr) = tls_target(&ca, "target").await;
    let (mut tls, key) = raw_tls(&ca, "raw-client", addr).await;
    let token = 0x5eed_0000_0000_0001u64;
    let hello = |index: u16, join_proof: [u8; 32]| {
        Frame::Hello(Hello {
            engine_id: 42,
            link_token: token,
            stream_index: index,
            stream_count: 4,
            transports: vec![ferry::TransportKind::Tcp],
            host_id: 0,
            join_proof,
            protection: INTEGRITY,
        })
    };
    let proof = |index: u16| key.proof(LinkToken(token), StreamIndex(index), INTEGRITY);
    let mut out = bytes::BytesMut::new();
    ferry::codec::encode(&hello(0, [0; 32]), 0, &mut out).unwrap();
    tls.write_all(&out).await.unwrap();
    tls.flush().await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(T, tls.read(&mut buf)).await.unwrap().unwrap();
    let (decoded, _) = ferry::codec::decode(&buf[..n], &Default::default()).unwrap().unwrap();
    let Frame::HelloAck(ack) = decoded.frame else {
        panic!("no hello ack")
    };
    assert!(ack.refusal.is_none(), "{ack:?}");
    assert_ne!(ack.engine_id, 0, "an authenticated stream learns the engine");

    let join = |frame: Frame| async move {
        let mut c = RawClient::connect(addr).await;
        c.send(&frame, &[]).await;
        match c.recv().await.expect("hello ack").frame {
            Frame::HelloAck(ack) => ack,
            other => panic!("expected a hello ack, got {other:?}"),
        }
    };
    let no_proof = join(hello(1, [0; 32])).await;
    assert_eq!(no_proof.refusal.map(|r| r.code), Some(ErrorCode::PermissionDenied));
    assert_eq!(no_proof.engine_id, 0, "a refused join learns nothing");
    let other_session = JoinKey::from_exported(&[9; 32]).proof(LinkToken(token), StreamIndex(1), INTEGRITY);
    let forged = join(hello(1, other_session)).await;
    assert_eq!(forged.refusal.map(|r| r.code), Some(ErrorCode::PermissionDenied));
    let proven = join(hello(1, proof(1))).await;
    assert!(proven.refusal.is_none(), "{proven:?}");
    // The same proof again: that index joined already.
    let replayed = join(hello(1, proof(1))).await;
    assert!(replayed.refusal.is_some());

    let notify = |id| Frame::Notify {
        id,
        name: "kv".into(),
        msg: "forged".into(),
    };
    // After its answer a data stream speaks in sealed records: a frame that is not in one (what
    // someone on the path would inject) ends the stream and is not acted on.
    let mut data = RawClient::connect(addr).await;
    data.send(&hello(2, proof(2)), &[]).await;
    assert!(matches!(data.recv().await.map(|d| d.frame), Some(Frame::HelloAck(a)) if a.refusal.is_none()));
    data.send(&notify(1), &[]).await;
    assert!(
        data.recv().await.is_none(),
        "an unsealed frame did not close the data stream"
    );
    // A notification properly sealed on a data stream, which would be reported as sent by the
    // link's proven identity, ends that stream too and is not delivered: notifications take the
    // control stream only. On the control stream, it is delivered.
    let mut data = RawClient::connect(addr).await;
    data.send(&hello(3, proof(3)), &[]).await;
    assert!(matches!(data.recv().await.map(|d| d.frame), Some(Frame::HelloAck(a)) if a.refusal.is_none()));
    let (mut sealer, _) = key
        .stream_keys(LinkToken(token), StreamIndex(3))
        .unwrap()
        .initiator(INTEGRITY);
    let mut record = Vec::new();
    ferry_proto::Sealer::begin(&mut record);
    let mut frame = bytes::BytesMut::new();
    ferry::codec::encode(&notify(1), 0, &mut frame).unwrap();
    record.extend_from_slice(&frame);
    sealer.finish(&mut record).unwrap();
    data.stream.write_all(&record).await.unwrap();
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(T, data.stream.read_to_end(&mut rest)).await;
    assert!(ended.is_ok(), "a sealed notification did not close the data stream");
    assert!(
        target.take_notifications().is_empty(),
        "a data stream's notification was delivered"
    );
    let answer = exchange(&mut tls, &notify(2), &[]).await;
    assert!(matches!(answer, Frame::Ack { id: 2, error: None }), "{answer:?}");
    let taken = target.take_notifications();
    assert_eq!(taken.len(), 1);
    assert_eq!(
        taken[0].from_identity.as_ref().map(|i| i.name.as_str()),
        Some("raw-client")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_authenticate_are_bounded_displaced_and_timed_out() {
    let ca = Ca::new("ferry test CA");
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .tls(ca.config("target"))
        .handshake_timeout(Duration::from_secs(5))
        .first_bytes_timeout(Duration::from_millis(500))
        .max_pending_handshakes(4)
        .build()
        .await
        .unwrap();
    let addr = target.local_addr().unwrap();
    // Four connections that say nothing hold every place awaiting admission ...
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    // ... so a fifth displaces the oldest of them, which is closed at once, before any deadline.
    let fifth = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut byte = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_millis(400), silent[0].read(&mut byte))
        .await
        .expect("the oldest silent connection was not displaced")
        .unwrap_or(0);
    assert_eq!(n, 0);
    // An authenticated client gets in while the silent ones still wait: it displaces one of them.
    let client = Engine::builder().tls(ca.config("client")).build().await.unwrap();
    client.connect(&addr.to_string(), T).await.unwrap();
    assert_eq!(target.link_count(), 1);
    // The others are closed at the first-bytes deadline, long before the handshake deadline.
    silent.push(fifth);
    for mut s in silent.into_iter().skip(1) {
        let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut byte))
            .await
            .expect("a silent connection outlived the first-bytes deadline")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_are_private_until_granted_and_grants_are_per_peer() {
    let ca = Ca::new("ferry test CA");
    let (target, addr) = tls_target(&ca, "target").await;
    let private = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    let shared = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    shared.grant("reader", Access::READ).await.unwrap();
    let reader = Engine::builder().tls(ca.config("reader")).build().await.unwrap();
    let other = Engine::builder().tls(ca.config("other")).build().await.unwrap();
    let to_reader = reader.connect(&addr.to_string(), T).await.unwrap();
    let to_other = other.connect(&addr.to_string(), T).await.unwrap();
    // Each is told of what it may reach, with what it may do there.
    let seen = to_reader.regions();
    assert_eq!(seen.len(), 1);
    let ad = seen.iter().next().unwrap();
    assert_eq!((ad.key, ad.access), (shared.key_for("reader"), Access::READ));
    assert!(to_other.regions().is_empty(), "nothing was granted to `other`");

    // The target refuses what was not granted even when the peer names the key itself: a raw
    // authenticated client that knows its keys of both regions reads and writes nothing; the regions'
    // raw keys, and the keys another peer is told, name nothing for it.
    private.write_at(0, &[7; 64]).unwrap();
    let mut raw = raw_link(&ca, "reader", addr).await;
    let read = |key, id| Frame::Read {
        id,
        key,
        offset: 0,
        len: 64,
    };
    let write = |key, id| Frame::Write {
        id,
        key,
        offset: 0,
        durability: ferry::Durability::Completed,
    };
    for (frame, payload) in [
        (read(private.key_for("reader"), 1), &[][..]),
        (write(private.key_for("reader"), 2), &[1u8; 64][..]),
        (write(shared.key_for("reader"), 3), &[1u8; 64][..]),
        (read(shared.key(), 5), &[][..]),
        (read(shared.key_for("other"), 6), &[][..]),
    ] {
        let answer = exchange(&mut raw, &frame, payload).await;
        assert!(
            matches!(&answer, Frame::Ack { error: Some(e), .. } if e.code == ErrorCode::PermissionDenied),
            "{frame:?} -> {answer:?}"
        );
        assert_names_no_real_key(&answer, &frame, &[private.key(), shared.key()]);
    }
    // Past the end of a granted region: refused, in the peer's own name for the region.
    let past_end = Frame::Read {
        id: 8,
        key: shared.key_for("reader"),
        offset: 4090,
        len: 64,
    };
    let answer = exchange(&mut raw, &past_end, &[]).await;
    assert!(
        matches!(&answer, Frame::Ack { error: Some(e), .. } if e.code == ErrorCode::OutOfBounds),
        "{answer:?}"
    );
    assert_names_no_real_key(&answer, &past_end, &[private.key(), shared.key()]);
    assert!(matches!(
        exchange(&mut raw, &read(shared.key_for("reader"), 4), &[]).await,
        Frame::ReadData { id: 4 }
    ));
    let mut got = [0u8; 64];
    private.read_at(0, &mut got).unwrap();
    assert_eq!(got, [7; 64], "the ungranted region is untouched");
    shared.read_at(0, &mut got).unwrap();
    assert_eq!(got, [0; 64], "the read-only grant wrote nothing");

    // Deregistration is announced only to those told of the region.
    let (private_key, shared_key) = (private.key_for("reader"), shared.key_for("reader"));
    drop(private);
    drop(shared);
    let mut heard = Vec::new();
    loop {
        match exchange(&mut raw, &Frame::Ping { nonce: 7 }, &[]).await {
            Frame::Pong { .. } if heard.iter().any(|f| matches!(f, Frame::RegionRemoved { .. })) => break,
            Frame::Pong { .. } => tokio::time::sleep(Duration::from_millis(20)).await,
            other => heard.push(other),
        }
    }
    assert!(
        heard
            .iter()
            .all(|f| !matches!(f, Frame::RegionRemoved { key } if *key == private_key)),
        "the removal of an ungranted region was announced: {heard:?}"
    );
    assert!(
        heard
            .iter()
            .any(|f| matches!(f, Frame::RegionRemoved { key } if *key == shared_key))
    );

    // Grants exist only where links are authenticated.
    let open = Engine::builder().build().await.unwrap();
    let r = open.alloc_host(4096, Access::READ_WRITE).unwrap();
    assert!(matches!(
        r.grant("x", Access::READ).await,
        Err(Error::InvalidArgument(_))
    ));
}

/// A target configured to encrypt (`TlsConfig::encrypt_data`) requires it of the links it accepts: an
/// initiator whose data streams are plain is refused, whatever they prove, and one that encrypts gets
/// in and moves bytes. Over TCP only: a same-host path would carry no TCP data stream to refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_requires_encryption_refuses_plain_data_streams() {
    let ca = Ca::new("ferry test CA");
    let tcp = [ferry::TransportKind::Tcp];
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .transports(tcp)
        .tls(ca.config("target").encrypt_data(true))
        .build()
        .await
        .unwrap();
    let addr = target.local_addr().unwrap().to_string();
    let dst = target.alloc_host(64 << 10, Access::READ_WRITE).unwrap();
    dst.grant_all(Access::READ_WRITE).await.unwrap();
    let plain = Engine::builder()
        .transports(tcp)
        .streams(2)
        .tls(ca.config("plain"))
        .build()
        .await
        .unwrap();
    let err = plain.connect(&addr, T).await.unwrap_err();
    assert!(
        matches!(&err, Error::PermissionDenied(m) if m.contains("encrypt")),
        "{err:?}"
    );
    let encrypting = Engine::builder()
        .transports(tcp)
        .streams(2)
        .tls(ca.config("sealed").encrypt_data(true))
        .build()
        .await
        .unwrap();
    let peer = encrypting.connect(&addr, T).await.unwrap();
    let src = encrypting.register(pattern(64 << 10, 4), Access::READ_WRITE).unwrap();
    let remote = dst.addr_for("sealed");
    encrypting
        .transfer(&peer, Op::Write, &[TransferDesc::new(src.addr(), remote, 64 << 10)], T)
        .await
        .unwrap();
    assert_eq!(dst.to_vec().unwrap(), pattern(64 << 10, 4));
}

/// Every certificate here carries 127.0.0.1 (as every one `ferry certs` makes does): a grant to it
/// would reach every peer, so it is refused, and the peers are granted nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_names_nobody_and_cannot_be_granted_to() {
    let ca = Ca::new("ferry test CA");
    let (target, addr) = tls_target(&ca, "target").await;
    let region = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    for address in ["127.0.0.1", "::1"] {
        assert!(matches!(
            region.grant(address, Access::READ).await,
            Err(Error::InvalidArgument(m)) if m.contains("IP address")
        ));
    }
    let client = Engine::builder().tls(ca.config("client")).build().await.unwrap();
    let peer = client.connect(&addr.to_string(), T).await.unwrap();
    assert!(peer.regions().is_empty(), "a refused grant reached a peer");
    region.grant("client", Access::READ).await.unwrap();
    wait_until_told(&peer).await;
}

async fn wait_until_told(peer: &ferry::Peer) {
    let deadline = tokio::time::Instant::now() + T;
    while peer.regions().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the grant was never announced");
        peer.regions_changed(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_stops_a_peer_mid_stream() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let ca = Ca::new("ferry test CA");
    let (target, addr) = tls_target(&ca, "target").await;
    let dst = target.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    dst.grant("writer", Access::READ_WRITE).await.unwrap();
    let writer = Engine::builder().tls(ca.config("writer")).build().await.unwrap();
    let src = writer.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    src.write_at(0, &pattern(1 << 20, 1)).unwrap();
    let peer = writer.connect(&addr.to_string(), T).await.unwrap();
    let descs: Vec<_> = (0..16u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 16), dst.addr_for("writer") + (i << 16), 1 << 16))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writes = common::keep_writing(&writer, &peer, descs, ferry::Durability::Completed, stop.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;

    tokio::time::timeout(T, dst.revoke("writer")).await.unwrap().unwrap();
    // Nothing lands after the revoke returned, though the writer keeps trying.
    dst.write_at(0, &vec![0u8; 1 << 20]).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let (ok, refused) = tokio::time::timeout(T, writes).await.unwrap().unwrap();
    let after = dst.to_vec().unwrap();
    assert!(
        after.iter().all(|b| *b == 0),
        "a write landed after the revoke returned"
    );
    assert!(ok > 0, "the writer wrote before the revoke");
    assert!(refused > 0, "the writer was refused after it");
    assert!(peer.regions().is_empty(), "the writer was told the region is gone");
}

/// A write that passed its grant check before the revoke and is still receiving its payload holds the
/// revoke until it has landed: after `revoke` returns, no byte of it arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_waits_for_a_write_already_under_way() {
    let ca = Ca::new("ferry test CA");
    let (target, addr) = tls_target(&ca, "target").await;
    let dst = Arc::new(target.alloc_host(64 << 10, Access::READ_WRITE).unwrap());
    dst.grant("writer", Access::READ_WRITE).await.unwrap();
    let mut raw = raw_link(&ca, "writer", addr).await;
    start_half_write(&mut raw, dst.key_for("writer")).await;

    let revoking = {
        let dst = dst.clone();
        tokio::spawn(async move { dst.revoke("writer").await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !revoking.is_finished(),
        "the revoke returned while a granted write was still landing"
    );
    raw.write_all(&[0xbb; 32 << 10]).await.unwrap();
    raw.flush().await.unwrap();
    tokio::time::timeout(T, revoking).await.unwrap().unwrap().unwrap();
    let got = dst.to_vec().unwrap();
    assert!(got[..32 << 10].iter().all(|b| *b == 0xaa) && got[32 << 10..].iter().all(|b| *b == 0xbb));

    // Then the peer is refused, and the region stays as it was.
    dst.write_at(0, &vec![0u8; 64 << 10]).unwrap();
    let write = Frame::Write {
        id: 2,
        key: dst.key_for("writer"),
        offset: 0,
        durability: ferry::Durability::Completed,
    };
    let mut answers = Vec::new();
    let mut answer = exchange(&mut raw, &write, &[0xcc; 64 << 10]).await;
    // Frames already on their way (the first write's ack, the region's removal) come first.
    while !matches!(answer, Frame::Ack { id: 2, .. }) {
        answers.push(answer);
        answer = exchange(&mut raw, &Frame::Ping { nonce: 1 }, &[]).await;
    }
    assert!(
        matches!(&answer, Frame::Ack { error: Some(e), .. } if e.code == ErrorCode::PermissionDenied),
        "{answer:?}"
    );
    assert!(
        answers
            .iter()
            .any(|f| matches!(f, Frame::RegionRemoved { key } if *key == dst.key_for("writer"))),
        "the peer was told: {answers:?}"
    );
    assert!(dst.to_vec().unwrap().iter().all(|b| *b == 0));
}

/// A write that passed its grant check and then stalls mid-payload does not hold a revoke past its
/// grace: the revoke closes the writer's link and returns `Ok`, and the rest of the payload, sent
/// afterwards, lands nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_closes_the_link_of_a_write_that_does_not_end() {
    let ca = Ca::new("ferry test CA");
    let (target, addr) = tls_target(&ca, "target").await;
    let dst = Arc::new(target.alloc_host(64 << 10, Access::READ_WRITE).unwrap());
    dst.grant("writer", Access::READ_WRITE).await.unwrap();
    let mut raw = raw_link(&ca, "writer", addr).await;
    start_half_write(&mut raw, dst.key_for("writer")).await;

    tokio::time::timeout(T, dst.revoke("writer"))
        .await
        .expect("the revoke hung")
        .expect("the revoke failed though the writer's link could be closed");
    let after = dst.to_vec().unwrap();
    // The rest of the payload, sent after the revoke returned: the link is gone, nothing lands.
    let _ = raw.write_all(&[0xbb; 32 << 10]).await;
    let _ = raw.flush().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        dst.to_vec().unwrap() == after,
        "a byte landed after the revoke returned"
    );
    assert!(after[32 << 10..].iter().all(|b| *b == 0), "the second half landed");
    assert_eq!(target.link_count(), 0, "the writer's link was closed");
}

/// A revoke waits only for the peers it concerns: with another peer's write stalled mid-payload, a
/// revoke for an identity that has no link returns at once, and the stalled writer keeps its link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_waits_for_nobody_but_the_peer_it_concerns() {
    let ca = Ca::new("ferry test CA");
    let (target, addr) = tls_target(&ca, "target").await;
    let busy = target.alloc_host(64 << 10, Access::READ_WRITE).unwrap();
    busy.grant("writer", Access::READ_WRITE).await.unwrap();
    let other = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    other.grant("nobody", Access::READ_WRITE).await.unwrap();
    let mut raw = raw_link(&ca, "writer", addr).await;
    start_half_write(&mut raw, busy.key_for("writer")).await;

    // Well within the grace a concerned link would get: nothing is waited for.
    tokio::time::timeout(Duration::from_millis(500), other.revoke("nobody"))
        .await
        .expect("a revoke for a peer without a link waited for another peer's write")
        .unwrap();
    assert_eq!(target.link_count(), 1, "the writer's link was left alone");
    // The stalled write still completes.
    raw.write_all(&[0xbb; 32 << 10]).await.unwrap();
    raw.flush().await.unwrap();
    let answer = exchange(&mut raw, &Frame::Ping { nonce: 5 }, &[]).await;
    assert!(matches!(answer, Frame::Ack { id: 1, error: None }), "{answer:?}");
    let got = busy.to_vec().unwrap();
    assert!(got[..32 << 10].iter().all(|b| *b == 0xaa) && got[32 << 10..].iter().all(|b| *b == 0xbb));
}

/// Pre-shared-key mode: engines with the same key admit each other (and know each other's names);
/// an engine with another key, or none, gets nothing; a short key is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_sharing_a_key_admit_each_other_and_nobody_else() {
    let key = [0x42u8; 32];
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .tls(TlsConfig::from_psk(&key, "cache-1").unwrap())
        .build()
        .await
        .unwrap();
    let addr = target.local_addr().unwrap().to_string();
    let dst = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    dst.grant("decode-1", Access::READ_WRITE).await.unwrap();

    let member = Engine::builder()
        .tls(TlsConfig::from_psk(&key, "decode-1").unwrap())
        .build()
        .await
        .unwrap();
    let peer = member.connect(&addr, T).await.unwrap();
    assert_eq!(peer.identity().map(|i| i.name.as_str()), Some("cache-1"));
    let src = member.alloc_host(4096, Access::READ_WRITE).unwrap();
    src.write_at(0, &pattern(4096, 9)).unwrap();
    member
        .transfer(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), dst.addr_for("decode-1"), 4096)],
            T,
        )
        .await
        .unwrap();
    assert_eq!(dst.to_vec().unwrap(), pattern(4096, 9));

    let mut other_key = key;
    other_key[31] ^= 1;
    let outsider = Engine::builder()
        .tls(TlsConfig::from_psk(&other_key, "decode-1").unwrap())
        .build()
        .await
        .unwrap();
    let err = outsider.connect(&addr, T).await.unwrap_err();
    assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");
    let open = Engine::builder().build().await.unwrap();
    assert!(matches!(open.connect(&addr, T).await, Err(Error::PermissionDenied(_))));
    assert_eq!(target.link_count(), 1);
    assert!(matches!(
        TlsConfig::from_psk(&key[..16], "x"),
        Err(Error::InvalidArgument(_))
    ));
}
