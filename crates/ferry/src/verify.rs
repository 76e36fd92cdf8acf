//! A transfer's end-to-end check ([`TransferOptions::integrity`](crate::TransferOptions::integrity)).
//!
//! Once the data path (and the control link, for what the data path declined) reports the batch
//! done, the engine asks the target over the control link for the CRC32C of every remote range as
//! its memory holds them now (`Frame::Sum`), takes its own of the local ranges meanwhile, and
//! completes the batch `Ok` only if every pair agrees. So the check sees what any layer did to the
//! bytes: the network, a proxy, a NIC, a copy that went wrong, a store after landing. The target
//! is asked only once the batch's bytes are in its memory as its CPU sees them:
//!
//! - over TCP a batch is not checked here: the link checks it frame by frame as it carries it (see
//!   [`ferry_core::DataLink::checks_in_band`]), where both of the peer's links can, but for a read
//!   into memory staged in front of a device, checked here after the device's copy;
//! - over shared memory the copies into a lent mapping are this process's own, done before the batch
//!   completes, and the target's copies finish before it replies;
//! - over RDMA a WRITE's completion means only that the target's NIC acknowledged it: the check
//!   first fences the link ([`ferry_core::DataLink::fence_writes`]: on each queue pair that carried WRITEs, a
//!   request the target answers only after the WRITEs before it are placed), then asks. A READ's
//!   completion means its bytes are in this process's memory.
//!
//! Memory staged in front of a device is summed as the device holds it: the block's `prepare_read`
//! hook copies it up first, at either end.

use ferry_core::codec::Segment;
use ferry_core::{Error, Op, Resolved, Result, TransferRequest};
use futures::future::BoxFuture;

use crate::peer::Peer;

/// What a batch with integrity checks once its data moved.
pub(crate) struct Check {
    op: Op,
    local: Local,
    remote: Vec<Segment>,
}

impl Check {
    /// The check of `request`.
    pub(crate) fn of(request: &TransferRequest) -> Result<Box<Check>> {
        let ranges: Vec<Resolved> = request.items.iter().map(|i| i.local.clone()).collect();
        let local = match request.op == Op::Write && inline(&ranges) {
            // A write's source is summed as it starts: right before its bytes leave, and while they
            // are about to be read anyway (the sum brings them into the cache the send reads from).
            true => Local::Summed(sum_all(&ranges)?),
            false => Local::Later(ranges),
        };
        Ok(Box::new(Check {
            op: request.op,
            local,
            remote: request
                .items
                .iter()
                .map(|i| Segment {
                    key: i.remote_key,
                    offset: i.remote_offset,
                    len: i.len(),
                })
                .collect(),
        }))
    }

    /// Runs the check: the target's sums over `peer`'s control link, this side's meanwhile. Its
    /// transfer bounds it in time, with the rest of the batch.
    pub(crate) fn run(self, peer: &Peer) -> BoxFuture<'static, Result<()>> {
        let Check { op, local, remote } = self;
        let addr = peer.addr();
        let fence = (op == Op::Write).then(|| peer.inner.data.fence_writes());
        let control = peer.inner.control.clone();
        Box::pin(async move {
            if let Some(fence) = fence {
                fence.await?;
            }
            let theirs = control.sums(op, remote.clone());
            let ours = async {
                match local {
                    Local::Summed(sums) => Ok(sums),
                    Local::Later(ranges) => local_sums(ranges).await,
                }
            };
            let (theirs, ours) = futures::future::try_join(theirs, ours).await?;
            ferry_core::integrity::compare(op, &ours, &theirs, &remote, &addr)
        })
    }
}

/// This side's sums: taken when the batch started, or to take once its data moved.
enum Local {
    Summed(Vec<u32>),
    Later(Vec<Resolved>),
}

/// Whether `ranges` are summed on the calling thread: small enough, and no device copy first.
fn inline(ranges: &[Resolved]) -> bool {
    ranges.iter().map(|r| r.len).sum::<u64>() <= ferry_core::integrity::SUM_INLINE_BYTES
        && !ranges.iter().any(|r| r.region.block().has_access_hooks())
}

/// The CRC32C of each range, after the device's copy for staged memory (past the host copy where
/// the device copies into any buffer, as [`ferry_core::integrity::sum`] does).
fn sum_all(ranges: &[Resolved]) -> Result<Vec<u32>> {
    ranges
        .iter()
        .map(|r| {
            let block = r.region.block();
            if block.has_access_hooks() && block.device_copies().is_none() {
                let (offset, len) = (r.offset, r.len);
                let prepare = r
                    .region
                    .with_owned_permit(move |region| region.prepare_read_ranges(&[(offset, len)]))?;
                prepare()?;
            }
            ferry_core::integrity::sum(r)
        })
        .collect()
}

/// [`sum_all`], on a blocking thread unless [`inline`].
async fn local_sums(ranges: Vec<Resolved>) -> Result<Vec<u32>> {
    if inline(&ranges) {
        return sum_all(&ranges);
    }
    tokio::task::spawn_blocking(move || sum_all(&ranges))
        .await
        .map_err(|e| Error::Internal(format!("checksumming on a blocking thread panicked: {e}")))?
}
