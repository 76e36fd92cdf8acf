//! The NIC, not the engine, refuses what a peer was not granted. An initiator that is not ferry's
//! engine posts whatever it likes: this test drives the RDMA transport's initiator side by hand, with
//! rkeys and addresses of its choosing, against a target whose links each have a protection domain of
//! their own. Every refusal is paired with the same harness landing bytes where the grant allows, so a
//! refusal is the NIC's, not the harness's. Runs inside `cargo xtask rig`; elsewhere it says it skipped.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::in_rig;
use ferry_core::{
    AcceptSetup, AcceptedPath, Access, DataLink, Durability, EngineContext, Error, LinkSlots, MemoryBlock,
    Notification, Notifier, Op, OwnedBuffer, PeerIdentity, PeerNames, PeerScope, PeerView, RegionEntry, RegionKey,
    RegionTable, Resolved, Result, SetupExchange, TransferItem, TransferRequest, Transport, TransportKind,
};
use ferry_proto::rdma::RemoteKey;
use ferry_rdma::{RdmaOptions, RdmaTransport};
use futures::future::BoxFuture;

const LEN: usize = 64 << 10;

struct NoNotifications;

impl Notifier for NoNotifications {
    fn deliver(&self, _: u64, _: u64, _: &str, _: Option<&PeerIdentity>, _: Notification) -> Result<()> {
        Err(Error::Unsupported("this test takes no notifications".into()))
    }
    fn link_closed(&self, _: u64) {}
}

/// Hands the initiator's setup straight to the target's `accept`, as the link `link` of `peer`.
struct Exchange {
    target: Arc<RdmaTransport>,
    ctx: Arc<EngineContext>,
    link: u64,
    peer: Arc<PeerView>,
    accepted: Mutex<Vec<Box<dyn AcceptedPath>>>,
}

impl SetupExchange for Exchange {
    fn exchange(&self, _: TransportKind, blob: Vec<u8>) -> BoxFuture<'_, Result<Vec<u8>>> {
        Box::pin(async move {
            let (answer, path) = self.target.accept(AcceptSetup {
                link: self.link,
                blob: &blob,
                notifier: Arc::new(NoNotifications),
                peer_engine: 7,
                peer_addr: "127.0.0.1:4000",
                peer: &self.peer,
                context: Arc::downgrade(&self.ctx),
            })?;
            self.accepted.lock().unwrap().push(path);
            Ok(answer)
        })
    }
    fn control_link(&self) -> Arc<dyn DataLink> {
        Arc::new(ferry_core::NoControlLink)
    }
}

fn options(per_peer_domains: bool) -> RdmaOptions {
    RdmaOptions {
        device: std::env::var("FERRY_RDMA_DEVICE").ok(),
        per_peer_domains,
        ..Default::default()
    }
}

fn identity(name: &str) -> PeerIdentity {
    PeerIdentity {
        name: name.into(),
        subject: format!("CN={name}"),
        alt_names: vec![name.into()],
    }
}

/// A region over `bytes`, registered with `transport`.
fn region(transport: &RdmaTransport, bytes: Vec<u8>) -> Arc<RegionEntry> {
    let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(bytes));
    let entry = RegionEntry::new(RegionKey::random().unwrap(), Access::READ_WRITE, block).unwrap();
    let key = transport.register_region(&entry).unwrap().expect("an RDMA key");
    Arc::new(entry.with_transport_key(TransportKind::Rdma, key))
}

struct Rig {
    target: Arc<RdmaTransport>,
    initiator: RdmaTransport,
    ctx: Arc<EngineContext>,
    dst: Arc<RegionEntry>,
    src: Arc<RegionEntry>,
}

impl Rig {
    /// One RDMA operation of 4 KiB on a fresh queue pair of link `link` (peer `peer`), naming the
    /// target's memory by `rkey` at `addr`, as an initiator that ignores what it was told would.
    async fn post(&self, link: u64, peer: &Arc<PeerView>, op: Op, rkey: &RemoteKey, addr: u64) -> Result<()> {
        let exchange = Exchange {
            target: self.target.clone(),
            ctx: self.ctx.clone(),
            link,
            peer: peer.clone(),
            accepted: Mutex::new(Vec::new()),
        };
        let data = self.initiator.connect(&exchange).await?;
        let request = TransferRequest {
            op,
            durability: Durability::Completed,
            items: vec![TransferItem {
                local: Resolved {
                    region: self.src.clone(),
                    offset: 0,
                    len: 4096,
                },
                remote_key: RegionKey(0),
                remote_offset: 0,
                remote_addr: addr,
                remote_transport_key: Some(rkey.encode().into()),
                remote_access: Access::READ_WRITE,
            }],
            checked: false,
        };
        let result = tokio::time::timeout(Duration::from_secs(30), data.transfer(request))
            .await
            .map_err(|_| Error::Timeout("the RDMA operation never completed".into()))?;
        data.close().await;
        // The operation is the NIC's to refuse or do: nothing of it may be left to another link.
        let declined = result?;
        assert!(
            declined.is_empty(),
            "the RDMA link declined the operation to the control link"
        );
        Ok(())
    }

    fn dst_bytes(&self) -> Vec<u8> {
        let mut v = vec![0u8; LEN];
        self.dst.copy_out(0, &mut v).unwrap();
        v
    }

    fn clear_dst(&self) {
        self.dst.copy_in(0, &vec![0u8; LEN]).unwrap();
    }
}

/// What `peer` is told of the target's region: its rkey and base.
fn told(peer: &PeerView, dst: &RegionEntry) -> (RemoteKey, u64) {
    let ad = peer.advert(dst).expect("the peer may reach the region");
    let (_, key) = ad
        .transport_keys
        .iter()
        .find(|(k, _)| *k == TransportKind::Rdma)
        .expect("an RDMA key");
    (RemoteKey::decode(key).unwrap(), ad.addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nic_refuses_what_a_peer_was_not_granted() {
    let target = Arc::new(RdmaTransport::new(options(true)));
    if !target.availability().usable {
        assert!(
            !in_rig(),
            "inside the rig the device must open: {:?}",
            target.availability()
        );
        eprintln!("skipped: no usable RDMA device here; the rig runs this test");
        return;
    }
    let initiator = RdmaTransport::new(options(false));
    let dst = region(&target, vec![0u8; LEN]);
    dst.update_grants(|g| {
        g.named.insert("reader".into(), Access::READ);
        g.named.insert("writer".into(), Access::READ_WRITE);
    })
    .unwrap();
    let mut table = RegionTable::new();
    table.insert(dst.clone()).unwrap();
    let ctx = Arc::new(EngineContext {
        engine_id: 1,
        host_id: 1,
        regions: ferry_core::sync::ShardedLock::new(table),
        notifier: Arc::new(NoNotifications),
        incoming: Arc::new(LinkSlots::new(8)),
        outgoing: Arc::new(LinkSlots::new(8)),
        transports: vec![TransportKind::Rdma],
        acceptors: vec![target.clone() as Arc<dyn Transport>],
        peer_names: Arc::new(PeerNames::random().unwrap()),
        served: Default::default(),
    });
    let src = region(&initiator, vec![0xab; LEN]);
    let rig = Rig {
        target: target.clone(),
        initiator,
        ctx: ctx.clone(),
        dst: dst.clone(),
        src,
    };
    let view = |link: u64, name: &str| {
        let scope: Arc<dyn PeerScope> = target.peer_scope(link).unwrap().expect("a domain per link");
        Arc::new(PeerView::authenticated(
            identity(name),
            ctx.peer_names.clone(),
            vec![scope],
        ))
    };
    let (reader, writer) = (view(1, "reader"), view(2, "writer"));
    let (reader_key, reader_base) = told(&reader, &dst);
    let (writer_key, writer_base) = told(&writer, &dst);
    assert_ne!(reader_key.rkey, writer_key.rkey);

    // The harness lands bytes where the grant allows: the writer's own key, at its own base.
    rig.post(2, &writer, Op::Write, &writer_key, writer_base).await.unwrap();
    assert!(
        rig.dst_bytes()[..4096].iter().all(|b| *b == 0xab),
        "the granted write landed"
    );
    rig.clear_dst();
    // And the reader reads with its own key.
    rig.post(1, &reader, Op::Read, &reader_key, reader_base).await.unwrap();

    // The reader writing with its read-only key, with the writer's key (on its own queue pair), or at
    // the region's real address: the NIC refuses each, and nothing lands.
    for (what, key, addr) in [
        ("its read-only key", &reader_key, reader_base),
        ("the writer's key and base", &writer_key, writer_base),
        ("its key at the region's real address", &reader_key, dst.addr()),
    ] {
        let result = rig.post(1, &reader, Op::Write, key, addr).await;
        assert!(result.is_err(), "a write with {what} was not refused");
        assert!(rig.dst_bytes().iter().all(|b| *b == 0), "a write with {what} landed");
    }

    // A revoke: the writer's registration goes (what the engine does when the grant changes), and the
    // key it kept names nothing on its own queue pair.
    dst.update_grants(|g| {
        g.named.remove("writer");
    })
    .unwrap();
    assert!(writer.advert(&dst).is_none());
    writer.forget(dst.key());
    let result = rig.post(2, &writer, Op::Write, &writer_key, writer_base).await;
    assert!(result.is_err(), "a write with a revoked key was not refused");
    assert!(
        rig.dst_bytes().iter().all(|b| *b == 0),
        "a write with a revoked key landed"
    );

    // Deregistration takes every peer's registration with it.
    target.deregister_region(dst.key());
    let result = rig.post(1, &reader, Op::Read, &reader_key, reader_base).await;
    assert!(result.is_err(), "a read of a deregistered region was not refused");
}
