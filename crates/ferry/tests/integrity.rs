//! Transfers with integrity (`TransferOptions::integrity`, `EngineBuilder::integrity`): the bytes are
//! checksummed at the source and at the destination after they landed, and a transfer whose sums
//! differ fails with `Integrity`.
//!
//! The faults: a hook (ferry-core's `fault-hooks` feature, on in test builds) that flips a byte right
//! after it landed, on each transport and in each direction; and a TCP proxy that flips a byte of a
//! data stream's payload on the way (the kernel's TCP checksums are the proxy's own, so TCP sees
//! nothing wrong). Each fault is also run without integrity, where the transfer reports `Ok` with
//! the wrong byte in place: that is what shows the option does the catching.
//!
//! The hook is one per process: every test here takes `FAULTS` first, so that no other transfer of
//! this binary lands while one is armed.

mod common;

use std::net::SocketAddr;

use common::{T, pattern};
use ferry::integrity::fault;
use ferry::{Access, Engine, Error, Op, Peer, Region, TransferDesc, TransferOptions, TransportKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

static FAULTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const LEN: usize = 64 << 10;

/// A target with a 64 KiB region of its own allocation (lent over shared memory) and one of memory it
/// registered (copied by the target over shared memory), an initiator with a source and a
/// destination, linked over `transport`.
struct Rig {
    _target: Engine,
    lent: Region,
    registered: Region,
    initiator: Engine,
    peer: Peer,
    src: Region,
    dst: Region,
}

async fn rig(transport: TransportKind) -> Rig {
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .transports([transport])
        .build()
        .await
        .unwrap();
    let lent = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
    let registered = target.register(vec![0u8; LEN], Access::READ_WRITE).unwrap();
    let initiator = Engine::builder().transports([transport]).build().await.unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    assert_eq!(peer.transport(), transport);
    let src = initiator.register(pattern(LEN, 0x3c), Access::READ_WRITE).unwrap();
    let dst = initiator.register(vec![0u8; LEN], Access::READ_WRITE).unwrap();
    Rig {
        _target: target,
        lent,
        registered,
        initiator,
        peer,
        src,
        dst,
    }
}

impl Rig {
    async fn write(&self, to: &Region, integrity: bool) -> ferry::Result<()> {
        let desc = TransferDesc::new(self.src.addr(), to.addr(), LEN as u64);
        let options = TransferOptions::within(T).integrity(integrity);
        self.initiator.start(&self.peer, Op::Write, &[desc], options)?.await
    }

    async fn read(&self, from: &Region, integrity: bool) -> ferry::Result<()> {
        let desc = TransferDesc::new(self.dst.addr(), from.addr(), LEN as u64);
        let options = TransferOptions::within(T).integrity(integrity);
        self.initiator.start(&self.peer, Op::Read, &[desc], options)?.await
    }
}

/// Bytes of `got` that differ from `want`.
fn differing(got: &Region, want: &[u8]) -> usize {
    let got = got.to_vec().unwrap();
    got.iter().zip(want).filter(|(a, b)| a != b).count()
}

/// On `transport`, each way and into each kind of region: a byte flipped after landing fails a
/// transfer with integrity as `Integrity`, and passes unseen without it (one wrong byte in place);
/// with no fault, both complete with the right bytes.
async fn a_flip_after_landing_is_caught_only_with_integrity(transport: TransportKind) {
    let _one_at_a_time = FAULTS.lock().await;
    let rig = rig(transport).await;
    let source = pattern(LEN, 0x3c);
    for region in [&rig.lent, &rig.registered] {
        // No fault: both complete, with the source's bytes.
        rig.write(region, true).await.unwrap();
        assert_eq!(differing(region, &source), 0);
        region.write_at(0, &vec![0u8; LEN]).unwrap();
        rig.write(region, false).await.unwrap();
        assert_eq!(differing(region, &source), 0);

        for integrity in [true, false] {
            assert!(fault::flip_next_landing(), "test builds have the fault hooks");
            let result = rig.write(region, integrity).await;
            assert_eq!(fault::disarm(), 0, "the write's landing took the flip");
            assert_eq!(differing(region, &source), 1, "one byte was flipped after it landed");
            match integrity {
                true => assert!(
                    matches!(&result, Err(Error::Integrity(m)) if m.contains("range 0 (65536 bytes at offset 0")),
                    "{transport}: a write whose landed bytes changed: {result:?}"
                ),
                false => assert!(
                    result.is_ok(),
                    "{transport}: without integrity nothing looks: {result:?}"
                ),
            }
        }

        region.write_at(0, &source).unwrap();
        for integrity in [true, false] {
            rig.dst.write_at(0, &vec![0u8; LEN]).unwrap();
            assert!(fault::flip_next_landing());
            let result = rig.read(region, integrity).await;
            assert_eq!(fault::disarm(), 0, "the read's landing took the flip");
            assert_eq!(differing(&rig.dst, &source), 1, "one byte was flipped after it landed");
            match integrity {
                true => assert!(
                    matches!(&result, Err(Error::Integrity(m)) if m.contains("Read")),
                    "{transport}: a read whose landed bytes changed: {result:?}"
                ),
                false => assert!(
                    result.is_ok(),
                    "{transport}: without integrity nothing looks: {result:?}"
                ),
            }
        }
        rig.read(region, true).await.unwrap();
        assert_eq!(differing(&rig.dst, &source), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tcp_a_flip_after_landing_is_caught_only_with_integrity() {
    a_flip_after_landing_is_caught_only_with_integrity(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_shared_memory_a_flip_after_landing_is_caught_only_with_integrity() {
    a_flip_after_landing_is_caught_only_with_integrity(TransportKind::Shm).await;
}

/// A proxy for `target` that passes every connection of a link through, except that it flips every bit
/// of the byte `at` bytes into each connection towards the target (only a stream that carries a
/// write's payload gets that far).
async fn flipping_proxy(target: SocketAddr, at: usize) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((from, _)) = listener.accept().await else { return };
            let to = TcpStream::connect(target).await.unwrap();
            let (mut from_r, mut from_w) = from.into_split();
            let (mut to_r, mut to_w) = to.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut to_r, &mut from_w).await });
            let flip = Some(at);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                let mut passed = 0usize;
                loop {
                    let n = match from_r.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if let Some(at) = flip
                        && (passed..passed + n).contains(&at)
                    {
                        buf[at - passed] ^= 0xff;
                    }
                    passed += n;
                    if to_w.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// A byte of a write's payload changed on the wire between two plain TCP engines: the write with
/// integrity fails as `Integrity`; without, it reports `Ok` with the wrong byte at the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_changed_on_the_wire_is_caught_only_with_integrity() {
    let _one_at_a_time = FAULTS.lock().await;
    for integrity in [true, false] {
        let target = Engine::builder()
            .listen("127.0.0.1:0")
            .transports([TransportKind::Tcp])
            .build()
            .await
            .unwrap();
        let dst = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
        // Well into the payload of the write (past the data stream's hello and the frame header).
        let proxy = flipping_proxy(target.local_addr().unwrap(), 40_000).await;
        let initiator = Engine::builder()
            .transports([TransportKind::Tcp])
            .integrity(integrity)
            .build()
            .await
            .unwrap();
        let peer = initiator.connect(&proxy.to_string(), T).await.unwrap();
        let data = pattern(LEN, 0xd1);
        let src = initiator.register(data.clone(), Access::READ_WRITE).unwrap();
        let desc = TransferDesc::new(src.addr(), dst.addr(), LEN as u64);
        // The engine's default, as built.
        let result = initiator.transfer(&peer, Op::Write, &[desc], T).await;
        assert_eq!(differing(&dst, &data), 1, "the proxy changed one byte on the way");
        match integrity {
            true => assert!(matches!(result, Err(Error::Integrity(_))), "{result:?}"),
            false => assert!(result.is_ok(), "{result:?}"),
        }
    }
}

/// A checksum tells something of the bytes: on an authenticated engine a peer granted WRITE alone
/// cannot have its writes checked, and is told why; with READ as well it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_only_grant_refuses_the_check_and_says_why() {
    let _one_at_a_time = FAULTS.lock().await;
    let ca = ferry::DevelopmentCa::new("integrity test CA").unwrap();
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .transports([TransportKind::Tcp])
        .tls(ca.config("target").unwrap())
        .build()
        .await
        .unwrap();
    let dst = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
    dst.grant("writer", Access::WRITE).await.unwrap();
    let initiator = Engine::builder()
        .transports([TransportKind::Tcp])
        .tls(ca.config("writer").unwrap())
        .build()
        .await
        .unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    let src = initiator.register(pattern(LEN, 7), Access::READ_WRITE).unwrap();
    let desc = TransferDesc::new(src.addr(), dst.addr_for("writer"), LEN as u64);
    let options = TransferOptions::within(T).integrity(true);
    let result = initiator.start(&peer, Op::Write, &[desc], options).unwrap().await;
    assert!(
        matches!(&result, Err(Error::PermissionDenied(m)) if m.contains("needs read access")),
        "{result:?}"
    );
    dst.grant("writer", Access::READ_WRITE).await.unwrap();
    initiator
        .start(&peer, Op::Write, &[desc], options)
        .unwrap()
        .await
        .unwrap();
}
