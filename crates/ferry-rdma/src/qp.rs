//! An RC queue pair with its completion queue and completion channel, and the state transitions
//! that connect it to the peer's.

use std::sync::{Arc, Mutex};

use ferry_core::{Error, Result};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState};

use crate::RdmaOptions;
use crate::device::OpenDevice;
use crate::wire::QpEndpoint;

/// One reliable-connected queue pair.
pub(crate) struct Rc {
    pub qp: Mutex<BasicQueuePair>,
    pub cq: Arc<BasicCompletionQueue>,
    pub channel: Arc<CompletionChannel>,
    pub local: QpEndpoint,
    pub max_send_wr: u32,
    pub max_sge: u32,
}

fn io(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Io {
        kind: std::io::ErrorKind::Other,
        message: format!("RDMA {what}: {e}"),
    }
}

fn random_psn() -> Result<u32> {
    let mut b = [0u8; 4];
    getrandom::fill(&mut b).map_err(|e| io("drawing a PSN", e))?;
    Ok(u32::from_le_bytes(b) & 0xff_ffff)
}

impl Rc {
    /// Creates a queue pair in the INIT state.
    pub fn create(dev: &OpenDevice, pd: &Arc<ProtectionDomain>, opts: &RdmaOptions) -> Result<Rc> {
        let max_send_wr = opts.max_send_wr.min(dev.max_qp_wr);
        let max_sge = dev.max_sge.min(16);
        let channel = dev
            .context
            .create_comp_channel()
            .map_err(|e| io("creating a completion channel", e))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| io("making the completion channel non-blocking", e))?;
        let cq = dev
            .context
            .create_cq_builder()
            .setup_cqe(max_send_wr + 16)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| io("creating a completion queue", e))?;
        let mut qp = pd
            .create_qp_builder()
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .setup_max_send_wr(max_send_wr)
            .setup_max_recv_wr(16)
            .setup_max_send_sge(max_sge)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(0)
            .build()
            .map_err(|e| io("creating a queue pair", e))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(dev.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead);
        qp.modify(&attr).map_err(|e| io("moving the queue pair to INIT", e))?;
        let local = QpEndpoint {
            qpn: qp.qp_number(),
            psn: random_psn()?,
            gid: dev.gid,
            lid: dev.lid,
            mtu: dev.mtu,
        };
        Ok(Rc {
            qp: Mutex::new(qp),
            cq,
            channel,
            local,
            max_send_wr,
            max_sge,
        })
    }

    /// Connects to the peer's queue pair: RTR, then RTS.
    pub fn connect(&self, dev: &OpenDevice, remote: &QpEndpoint, opts: &RdmaOptions) -> Result<()> {
        let mut qp = self
            .qp
            .lock()
            .map_err(|_| Error::Protocol("queue pair lock poisoned".into()))?;
        let rd_atom = 16u8;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::from(u32::from(self.local.mtu.min(remote.mtu))))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(rd_atom)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(dev.port)
            .setup_service_level(opts.service_level)
            .setup_grh(&Gid::from(remote.gid), 0, dev.gid_index, 64, opts.traffic_class);
        attr.setup_address_vector(&ah);
        qp.modify(&attr).map_err(|e| io("moving the queue pair to RTR", e))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(rd_atom);
        qp.modify(&attr).map_err(|e| io("moving the queue pair to RTS", e))?;
        Ok(())
    }
}
