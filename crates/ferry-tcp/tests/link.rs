//! The TCP transport on its own, without the engine: a `TcpServer` over a region table and a
//! `TcpLink` dialed to it, as two engines' halves in one process. WRITEs and READs land byte for
//! byte over one stream and several, a refused operation fails by name and changes nothing at the
//! target, and notifications reach the target's notifier intact and in order.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::sync::ShardedLock;
use ferry_core::{
    Access, DataLink, Durability, EngineContext, Error, LinkSlots, MemoryBlock, Notification, Notifier, Op,
    OwnedBuffer, PeerIdentity, PeerNames, RegionEntry, RegionKey, RegionTable, Result, TransferItem, TransferRequest,
    TransportKind,
};
use ferry_tcp::{LinkConfig, LocalIdentity, ServerConfig, TcpLink, TcpServer};

const T: Duration = Duration::from_secs(10);
const LEN: usize = 1 << 20;

/// Notifications as they arrive (with the target's bytes at that moment, for tests that look).
struct Inbox {
    region: Arc<RegionEntry>,
    seen: Mutex<Vec<(Notification, Vec<u8>)>>,
}

impl Notifier for Inbox {
    fn deliver(&self, _: u64, _: u64, _: &str, _: Option<&PeerIdentity>, n: Notification) -> Result<()> {
        let mut bytes = vec![0u8; LEN];
        self.region.copy_out(0, &mut bytes)?;
        self.seen.lock().unwrap().push((n, bytes));
        Ok(())
    }
    fn link_closed(&self, _: u64) {}
}

fn region(key: u64, fill: u8) -> Arc<RegionEntry> {
    let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![fill; LEN]));
    Arc::new(RegionEntry::new(RegionKey(key), Access::READ_WRITE, block).unwrap())
}

fn context(engine_id: u64, regions: &[Arc<RegionEntry>], notifier: Arc<dyn Notifier>) -> Arc<EngineContext> {
    let mut table = RegionTable::new();
    for r in regions {
        table.insert(r.clone()).unwrap();
    }
    Arc::new(EngineContext {
        engine_id,
        host_id: engine_id,
        regions: ShardedLock::new(table),
        notifier,
        incoming: Arc::new(LinkSlots::new(8)),
        outgoing: Arc::new(LinkSlots::new(8)),
        transports: vec![TransportKind::Tcp],
        acceptors: Vec::new(),
        peer_names: Arc::new(PeerNames::random().unwrap()),
        served: Default::default(),
    })
}

struct Pair {
    _server: TcpServer,
    link: TcpLink,
    local: Arc<RegionEntry>,
    remote: Arc<RegionEntry>,
    inbox: Arc<Inbox>,
}

async fn pair(streams: usize) -> Pair {
    let remote = region(0x51, 0);
    let inbox = Arc::new(Inbox {
        region: remote.clone(),
        seen: Mutex::new(Vec::new()),
    });
    let target = context(2, std::slice::from_ref(&remote), inbox.clone());
    let server = TcpServer::bind("127.0.0.1:0".parse().unwrap(), target, ServerConfig::default())
        .await
        .unwrap();
    let me = LocalIdentity {
        engine_id: 1,
        host_id: 1,
        transports: vec![TransportKind::Tcp],
    };
    let config = LinkConfig {
        streams,
        max_inflight_bytes: 64 << 20,
        limits: Default::default(),
        pool: None,
        link_limits: Default::default(),
        send_timeout: T,
        tls: None,
    };
    let link = tokio::time::timeout(T, TcpLink::dial(server.local_addr(), &me, &config))
        .await
        .unwrap()
        .unwrap();
    Pair {
        _server: server,
        link,
        local: region(0x11, 0),
        remote,
        inbox,
    }
}

impl Pair {
    /// `(offset, len)` ranges at the same offsets of the local and the remote region, resolved
    /// against the table the target advertised.
    fn request(&self, op: Op, ranges: &[(u64, u64)]) -> TransferRequest {
        let items = self
            .link
            .with_remote_regions(|table| {
                ranges
                    .iter()
                    .map(|&(offset, len)| {
                        let (ad, _) = table
                            .find(self.remote.addr() + offset, len, op.required_access())
                            .unwrap();
                        TransferItem {
                            local: ferry_core::Resolved {
                                region: self.local.clone(),
                                offset,
                                len,
                            },
                            remote_key: ad.key,
                            remote_offset: self.remote.addr() + offset - ad.addr,
                            remote_addr: self.remote.addr() + offset,
                            remote_transport_key: None,
                            remote_access: ad.access,
                        }
                    })
                    .collect()
            })
            .unwrap();
        TransferRequest {
            op,
            durability: Durability::Completed,
            items,
        }
    }

    async fn run(&self, request: TransferRequest) -> Result<()> {
        let declined = tokio::time::timeout(T, self.link.transfer(request, None))
            .await
            .unwrap()?;
        // The control link reaches every region: it never leaves anything to another link.
        assert!(declined.is_empty(), "TCP declined {} items", declined.len());
        Ok(())
    }
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn bytes(r: &RegionEntry) -> Vec<u8> {
    let mut b = vec![0u8; LEN];
    r.copy_out(0, &mut b).unwrap();
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_land_byte_for_byte_over_every_stream_count() {
    for streams in [1, 4] {
        let p = pair(streams).await;
        let src = pattern(streams as u8);
        p.local.copy_in(0, &src).unwrap();
        // Scattered ranges of every size class: tiny, mid, and one over a frame's usual payload.
        let ranges: Vec<(u64, u64)> = vec![
            (0, 1),
            (7, 4096),
            (8192, 64 << 10),
            (200 << 10, 600 << 10),
            (LEN as u64 - 3, 3),
        ];
        p.run(p.request(Op::Write, &ranges)).await.unwrap();
        let at_target = bytes(&p.remote);
        for &(o, n) in &ranges {
            let (o, n) = (o as usize, n as usize);
            assert_eq!(
                at_target[o..o + n],
                src[o..o + n],
                "{streams} streams: write at {o}+{n}"
            );
        }
        assert!(
            at_target[1..7].iter().all(|&b| b == 0),
            "nothing outside the ranges is written"
        );

        // Read it all back into a cleared local region.
        p.local.copy_in(0, &vec![0u8; LEN]).unwrap();
        p.run(p.request(Op::Read, &[(0, LEN as u64)])).await.unwrap();
        assert_eq!(bytes(&p.local), at_target, "{streams} streams: read back");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_the_target_refuses_fails_by_name_and_writes_nothing() {
    let p = pair(2).await;
    p.local.copy_in(0, &pattern(9)).unwrap();
    let mut request = p.request(Op::Write, &[(0, 4096)]);
    // Past the end of the target's region: the target checks every range itself.
    request.items[0].remote_offset = LEN as u64 - 100;
    request.items[0].remote_addr = p.remote.addr() + LEN as u64 - 100;
    let err = p.run(request).await.unwrap_err();
    assert!(matches!(err, Error::OutOfBounds(_)), "{err:?}");
    // A region the target does not have.
    let mut request = p.request(Op::Write, &[(0, 4096)]);
    request.items[0].remote_key = RegionKey(0xdead);
    let err = p.run(request).await.unwrap_err();
    assert!(
        matches!(&err, Error::PermissionDenied(m) if m.contains("no region")),
        "{err:?}"
    );
    assert!(
        bytes(&p.remote).iter().all(|&b| b == 0),
        "a refused operation wrote nothing"
    );
    // The link goes on.
    p.run(p.request(Op::Write, &[(0, 4096)])).await.unwrap();
    assert_eq!(bytes(&p.remote)[..4096], pattern(9)[..4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_reach_the_targets_notifier_intact_and_in_order() {
    let p = pair(4).await;
    let long = "x".repeat(1024);
    for round in 0..8u64 {
        let msg = if round == 7 { long.clone() } else { round.to_string() };
        tokio::time::timeout(T, p.link.notify(Notification::new(format!("n{round}"), msg)))
            .await
            .unwrap()
            .unwrap();
    }
    let seen = p.inbox.seen.lock().unwrap();
    assert_eq!(seen.len(), 8, "each notification is queued once it is acknowledged");
    for (round, (n, _)) in seen.iter().enumerate() {
        assert_eq!(n.name, format!("n{round}"), "in the order sent");
        assert_eq!(n.msg, if round == 7 { long.clone() } else { round.to_string() });
    }
}
