//! An RC queue pair with its completion queue and completion channel, and the state transitions
//! that connect it to the peer's.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use ferry_core::{Error, Result};
use rdma_mummy_sys::{ibv_qp_ex, ibv_qp_to_qp_ex};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, QueuePair, QueuePairAttribute, QueuePairBuilder, QueuePairState, SendOperationFlags,
};

use crate::RdmaOptions;
use crate::device::OpenDevice;
use crate::messages::{RECV_BUFFERS, SEND_BUFFERS};
use ferry_proto::rdma::QpEndpoint;

/// One reliable-connected queue pair (an extended one: the FLUSH verb exists only in the `ibv_wr_*`
/// interface).
pub(crate) struct Rc {
    pub qp: Mutex<ExtendedQueuePair>,
    /// The queue pair's `ibv_qp_ex`, for the work requests sideway has no setter for (FLUSH); `Some`
    /// only where the queue pair was created with the FLUSH operation.
    pub flush: Option<FlushHandle>,
    pub cq: Arc<BasicCompletionQueue>,
    pub channel: Arc<CompletionChannel>,
    pub local: QpEndpoint,
    /// The send queue's share for data work requests (READ, WRITE, FLUSH).
    pub max_send_wr: u32,
    pub max_sge: u32,
    /// Held while the completion queue is polled (see [`crate::completions::drain`]).
    pub poll: Mutex<()>,
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

/// The signature of `ibv_qp_ex::wr_flush`.
type WrFlush = unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, usize, u8, u8);

/// The `ibv_qp_ex` of a queue pair created with the FLUSH operation, and its `wr_flush`.
#[derive(Clone, Copy)]
pub(crate) struct FlushHandle {
    qp_ex: NonNull<ibv_qp_ex>,
    wr_flush: WrFlush,
}

// SAFETY: a pointer to the queue pair's own `ibv_qp_ex`, used only while its `Rc.qp` mutex is held (the
// same discipline as sideway's guard), and the queue pair outlives the `Rc` that holds the handle.
unsafe impl Send for FlushHandle {}
// SAFETY: as above.
unsafe impl Sync for FlushHandle {}

impl FlushHandle {
    /// Makes the work request that `construct_wr` just started a persistent FLUSH of
    /// `[remote_addr, remote_addr + len)` under `rkey`.
    ///
    /// # Safety
    ///
    /// Call with the queue pair's mutex held, between `construct_wr` and `post` of a guard of the queue
    /// pair this handle came from.
    pub unsafe fn setup_flush(self, rkey: u32, remote_addr: u64, len: u64) {
        const IBV_FLUSH_PERSISTENT: u8 = 1 << 1;
        const IBV_FLUSH_RANGE: u8 = 0;
        // SAFETY: the live queue pair's `ibv_qp_ex` and the `wr_flush` its library set (see `build`);
        // the caller is inside a started work request. A length past usize is clamped (only on 32-bit
        // hosts, where no region is that long).
        unsafe {
            (self.wr_flush)(
                self.qp_ex.as_ptr(),
                rkey,
                remote_addr,
                usize::try_from(len).unwrap_or(usize::MAX),
                IBV_FLUSH_PERSISTENT,
                IBV_FLUSH_RANGE,
            )
        };
    }
}

/// The FLUSH handle of `qp`, created with IBV_QP_EX_WITH_FLUSH.
fn flush_handle(qp: &ExtendedQueuePair) -> Option<FlushHandle> {
    // SAFETY: `qp()` is the live queue pair; ibv_qp_to_qp_ex only offsets into it.
    let qp_ex = NonNull::new(unsafe { ibv_qp_to_qp_ex(qp.qp().as_ptr()) })?;
    // SAFETY: the library accepted IBV_QP_EX_WITH_FLUSH, so its `ibv_qp_ex` is the version with the
    // `wr_flush` member (a library without FLUSH refuses the flag and never gets here).
    let wr_flush = unsafe { (*qp_ex.as_ptr()).wr_flush }?;
    Some(FlushHandle { qp_ex, wr_flush })
}

/// Creates the queue pair, with the FLUSH operation where `try_flush` and the library accepts it.
fn build(builder: &mut QueuePairBuilder, try_flush: bool) -> Result<(ExtendedQueuePair, Option<FlushHandle>)> {
    let basic = SendOperationFlags::Send | SendOperationFlags::Write | SendOperationFlags::Read;
    if try_flush {
        builder.setup_send_ops_flags(basic | SendOperationFlags::Flush);
        match builder.build_ex() {
            Ok(qp) => {
                let flush = flush_handle(&qp);
                return Ok((qp, flush));
            }
            Err(e) => tracing::debug!(
                error = %e,
                "no FLUSH on this queue pair (libibverbs before 45?); persistent writes use other means"
            ),
        }
    }
    builder.setup_send_ops_flags(basic);
    let qp = builder.build_ex().map_err(|e| io("creating a queue pair", e))?;
    Ok((qp, None))
}

impl Rc {
    /// Creates a queue pair in the INIT state. `remote_access`: whether the peer may read and write
    /// through it (a target's queue pair); an initiator's on an engine that authenticates its links
    /// accepts no RDMA READ or WRITE at all.
    pub fn create(dev: &OpenDevice, pd: &Arc<ProtectionDomain>, opts: &RdmaOptions, remote_access: bool) -> Result<Rc> {
        // The send queue holds the data work requests and, beside them, a SEND per message buffer (a
        // notification or commit request may be posted while the data share is full).
        let messages = SEND_BUFFERS as u32;
        let max_send_wr = opts.max_send_wr.min(dev.max_qp_wr.saturating_sub(messages)).max(1);
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
            .setup_cqe(max_send_wr + messages + RECV_BUFFERS as u32)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| io("creating a completion queue", e))?;
        let mut builder = pd.create_qp_builder();
        builder
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .setup_max_send_wr(max_send_wr + messages)
            .setup_max_recv_wr(RECV_BUFFERS as u32)
            .setup_max_send_sge(max_sge)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(0);
        let (mut qp, flush) = build(&mut builder, dev.flush_capable)?;
        let mut access = AccessFlags::LocalWrite;
        if remote_access {
            access |= AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        }
        if remote_access && dev.flush_capable {
            // A responder refuses FLUSH (invalid request) on a queue pair without these.
            access |= AccessFlags::FlushGlobal | AccessFlags::FlushPersistent;
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(dev.port)
            .setup_access_flags(access);
        qp.modify(&attr).map_err(|e| io("moving the queue pair to INIT", e))?;
        let local = QpEndpoint {
            qpn: qp.qp_number(),
            psn: random_psn()?,
            gid: dev.gid,
            lid: dev.lid,
            mtu: dev.mtu,
            flags: 0,
            rail: 0,
            rails: 1,
            lane: 0,
        };
        Ok(Rc {
            qp: Mutex::new(qp),
            flush,
            cq,
            channel,
            local,
            max_send_wr,
            max_sge,
            poll: Mutex::new(()),
        })
    }

    /// Connects to the peer's queue pair: RTR, then RTS.
    pub fn connect(&self, dev: &OpenDevice, remote: &QpEndpoint, opts: &RdmaOptions) -> Result<()> {
        let mut qp = self
            .qp
            .lock()
            .map_err(|_| Error::Internal("queue pair lock poisoned".into()))?;
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
