//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferry::{Access, Durability, Engine, Error, Op, Peer, Region, TransferDesc};

pub const T: Duration = Duration::from_secs(10);

/// Writes `descs` with `durability` over and over until `stop`, and counts the transfers that completed
/// and those refused because a region went away (`PermissionDenied`, `OutOfBounds`); any other error
/// fails the test.
pub fn keep_writing(
    initiator: &Engine,
    peer: &Peer,
    descs: Vec<TransferDesc>,
    durability: Durability,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(u32, u32)> {
    let (initiator, peer) = (initiator.clone(), peer.clone());
    tokio::spawn(async move {
        let (mut ok, mut refused) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            match initiator
                .transfer_durable(&peer, Op::Write, &descs, durability, T)
                .await
            {
                Ok(()) => ok += 1,
                Err(Error::PermissionDenied(_) | Error::OutOfBounds(_)) => {
                    refused += 1;
                    // A refusal made before anything is sent returns without yielding: let the rest of
                    // the runtime (the timer that ends this loop) run.
                    tokio::task::yield_now().await;
                }
                Err(e) => panic!("unexpected {e:?}"),
            }
        }
        (ok, refused)
    })
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// An engine builder for the tests' targets and initiators. Both live in this process, where shared
/// memory wins; `FERRY_TEST_TRANSPORTS=tcp` (a step of `cargo xtask test`) runs the same tests over TCP.
pub fn builder() -> ferry::EngineBuilder {
    match std::env::var("FERRY_TEST_TRANSPORTS").as_deref() {
        Ok("tcp") => Engine::builder().transports([ferry::TransportKind::Tcp]),
        Ok(other) => panic!("FERRY_TEST_TRANSPORTS={other}: only `tcp` is known"),
        Err(_) => Engine::builder(),
    }
}

pub async fn target() -> Engine {
    builder().listen("127.0.0.1:0").build().await.unwrap()
}

/// A target and an initiator built from `builder` (restricted like [`builder`]'s when the tests run
/// over one transport), and the initiator's link to the target.
pub async fn pair_with(builder: ferry::EngineBuilder) -> (Engine, Engine, Peer) {
    let target = target().await;
    let builder = match std::env::var("FERRY_TEST_TRANSPORTS").as_deref() {
        Ok("tcp") => builder.transports([ferry::TransportKind::Tcp]),
        _ => builder,
    };
    let initiator = builder.build().await.unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    (target, initiator, peer)
}

pub async fn pair() -> (Engine, Engine, Peer) {
    pair_with(Engine::builder()).await
}

/// Waits until `peer` has learned of `region` (registered after the link came up).
pub async fn wait_for_region(peer: &Peer, region: &Region) {
    let deadline = tokio::time::Instant::now() + T;
    while !peer.regions().iter().any(|r| r.key == region.key()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "peer never learned of region {:?}",
            region.key()
        );
        peer.regions_changed(Duration::from_millis(50)).await;
    }
}

pub fn rw() -> Access {
    Access::READ_WRITE
}

/// This process's resident memory, KiB.
pub fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Raises this process's limit of open descriptors to `want` (or as far as the hard limit allows).
pub fn raise_fd_limit(want: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the plain struct passed by pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < want {
            lim.rlim_cur = want.min(lim.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// A hand-driven protocol client, for sending what a well-behaved engine never would.
pub mod raw {
    use bytes::BytesMut;
    use ferry::codec::{self, Decoded, Frame, Hello, HelloAck, Limits};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    pub struct RawClient {
        pub stream: TcpStream,
        buf: BytesMut,
    }

    impl RawClient {
        pub async fn connect(addr: std::net::SocketAddr) -> RawClient {
            let stream = TcpStream::connect(addr).await.unwrap();
            stream.set_nodelay(true).unwrap();
            RawClient {
                stream,
                buf: BytesMut::new(),
            }
        }

        /// Connects and completes the handshake as stream 0 of a one-stream link.
        pub async fn handshake(addr: std::net::SocketAddr) -> (RawClient, HelloAck) {
            RawClient::hello(addr, rand_token(), 0, 1).await
        }

        /// Connects and says hello as stream `index` of a link of `count` streams named `token`.
        pub async fn hello(addr: std::net::SocketAddr, token: u64, index: u16, count: u16) -> (RawClient, HelloAck) {
            let mut c = RawClient::connect(addr).await;
            c.send(
                &Frame::Hello(Hello {
                    engine_id: 42,
                    link_token: token,
                    stream_index: index,
                    stream_count: count,
                    transports: vec![ferry::TransportKind::Tcp],
                    host_id: 0,
                    join_proof: [0; 32],
                    protection: ferry::DataProtection::Plain,
                }),
                &[],
            )
            .await;
            match c.recv().await.expect("hello ack").frame {
                Frame::HelloAck(ack) => (c, ack),
                other => panic!("expected a hello ack, got {other:?}"),
            }
        }

        pub async fn send(&mut self, frame: &Frame, payload: &[u8]) {
            let mut out = BytesMut::new();
            codec::encode(frame, payload.len() as u64, &mut out).unwrap();
            out.extend_from_slice(payload);
            self.stream.write_all(&out).await.unwrap();
        }

        pub async fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
            self.stream.write_all(bytes).await
        }

        /// The next frame, or `None` when the server closed the connection.
        pub async fn recv(&mut self) -> Option<Decoded> {
            loop {
                if let Some((d, used)) = codec::decode(&self.buf, &Limits::default()).unwrap() {
                    let _ = self.buf.split_to(used);
                    return Some(d);
                }
                let n = self.stream.read_buf(&mut self.buf).await.ok()?;
                if n == 0 {
                    return None;
                }
            }
        }

        /// The stream's two halves, and whatever was read past the last frame returned.
        pub fn into_split(
            self,
        ) -> (
            tokio::net::tcp::OwnedReadHalf,
            tokio::net::tcp::OwnedWriteHalf,
            BytesMut,
        ) {
            let (r, w) = self.stream.into_split();
            (r, w, self.buf)
        }

        /// Reads `n` payload bytes following a frame.
        pub async fn recv_payload(&mut self, n: usize) -> Vec<u8> {
            while self.buf.len() < n {
                let r = self.stream.read_buf(&mut self.buf).await.unwrap();
                assert!(r > 0, "closed mid-payload");
            }
            self.buf.split_to(n).to_vec()
        }
    }

    fn rand_token() -> u64 {
        use std::time::{SystemTime, UNIX_EPOCH};
        SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 ^ std::process::id() as u64
    }
}
