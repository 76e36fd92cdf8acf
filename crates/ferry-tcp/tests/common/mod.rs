//! A `TcpServer` over a region table and a `TcpLink` dialed to it, as two engines' halves in one
//! process: what the TCP transport's own tests share.
#![allow(dead_code)] // each test binary uses its part

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::sync::ShardedLock;
use ferry_core::{
    Access, DataLink, Durability, EngineContext, LinkSlots, MemoryBlock, Notification, Notifier, Op, OwnedBuffer,
    PeerIdentity, PeerNames, RegionEntry, RegionKey, RegionTable, Result, TransferItem, TransferRequest, TransportKind,
};
use ferry_tcp::{CoalescePool, LinkConfig, LocalIdentity, ServerConfig, TcpLink, TcpServer};

pub const T: Duration = Duration::from_secs(10);
pub const LEN: usize = 1 << 20;

/// Notifications as they arrive (with the target's bytes at that moment, for tests that look).
pub struct Inbox {
    pub region: Arc<RegionEntry>,
    pub seen: Mutex<Vec<(Notification, Vec<u8>)>>,
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

pub fn region(key: u64, fill: u8) -> Arc<RegionEntry> {
    let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![fill; LEN]));
    Arc::new(RegionEntry::new(RegionKey(key), Access::READ_WRITE, block).unwrap())
}

pub fn context(engine_id: u64, regions: &[Arc<RegionEntry>], notifier: Arc<dyn Notifier>) -> Arc<EngineContext> {
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

pub struct Pair {
    pub _server: TcpServer,
    pub link: TcpLink,
    pub local: Arc<RegionEntry>,
    pub remote: Arc<RegionEntry>,
    pub inbox: Arc<Inbox>,
}

pub async fn pair(streams: usize) -> Pair {
    pair_with(region(0x51, 0), streams).await
}

/// A pair whose target serves `remote` (key and length as [`region`]'s).
pub async fn pair_with(remote: Arc<RegionEntry>, streams: usize) -> Pair {
    pair_serving(&[remote], streams, None).await
}

/// A pair whose target serves `remotes` (the first is the pair's `remote`), its link coalescing
/// small descriptors through `pool` if given.
pub async fn pair_serving(remotes: &[Arc<RegionEntry>], streams: usize, pool: Option<Arc<CoalescePool>>) -> Pair {
    let remote = remotes[0].clone();
    let inbox = Arc::new(Inbox {
        region: remote.clone(),
        seen: Mutex::new(Vec::new()),
    });
    let target = context(2, remotes, inbox.clone());
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
        pool,
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
    pub fn request(&self, op: Op, ranges: &[(u64, u64)]) -> TransferRequest {
        let items = ranges
            .iter()
            .map(|&(offset, len)| self.item(op, offset, &self.remote, offset, len))
            .collect();
        self.request_of(op, items)
    }

    /// `len` bytes at `local_offset` of the local region and `remote_offset` of `remote` (one the
    /// target serves), resolved against the table the target advertised.
    pub fn item(&self, op: Op, local_offset: u64, remote: &RegionEntry, remote_offset: u64, len: u64) -> TransferItem {
        let addr = remote.addr() + remote_offset;
        self.link
            .with_remote_regions(|table| {
                let (ad, _) = table.find(addr, len, op.required_access()).unwrap();
                TransferItem {
                    local: ferry_core::Resolved {
                        region: self.local.clone(),
                        offset: local_offset,
                        len,
                    },
                    remote_key: ad.key,
                    remote_offset: addr - ad.addr,
                    remote_addr: addr,
                    remote_transport_key: None,
                    remote_access: ad.access,
                }
            })
            .unwrap()
    }

    /// A request of `items`.
    pub fn request_of(&self, op: Op, items: Vec<TransferItem>) -> TransferRequest {
        TransferRequest {
            op,
            durability: Durability::Completed,
            items,
            checked: false,
        }
    }

    pub async fn run(&self, request: TransferRequest) -> Result<()> {
        let declined = tokio::time::timeout(T, self.link.transfer(request)).await.unwrap()?;
        // The control link reaches every region: it never leaves anything to another link.
        assert!(declined.is_empty(), "TCP declined {} items", declined.len());
        Ok(())
    }
}

pub fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

pub fn bytes(r: &RegionEntry) -> Vec<u8> {
    let mut b = vec![0u8; LEN];
    r.copy_out(0, &mut b).unwrap();
    b
}
