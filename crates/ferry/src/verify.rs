//! A transfer's end-to-end check ([`TransferOptions::integrity`](crate::TransferOptions::integrity)).
//!
//! Once the data path (and the control link, for what the data path declined) reports the batch
//! done, the engine asks the target over the control link for the CRC32C of every remote range as
//! its memory holds them now (`Frame::Sum`), takes its own of the local ranges meanwhile, and
//! completes the batch `Ok` only if every pair agrees. So the check sees what any layer did to the
//! bytes: the network, a proxy, a NIC, a copy that went wrong, a store after landing. The target
//! is asked only once the batch's bytes are in its memory as its CPU sees them:
//!
//! - over TCP the target acknowledges a write after it landed, and a read's data came from its
//!   memory before the answer;
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
use ferry_core::{Due, Error, Op, Resolved, Result, TransferRequest};
use futures::future::BoxFuture;

use crate::peer::Peer;

/// What a batch with integrity checks once its data moved.
pub(crate) struct Check {
    op: Op,
    local: Local,
    remote: Vec<Segment>,
    /// The batch's bound, where it was known when the batch started (a link that bounds batches
    /// itself); else the caller's timer gives it when the check starts.
    pub(crate) due: Option<Due>,
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
            due: None,
        }))
    }

    /// Runs the check, by `due` where given: the target's sums over `peer`'s control link, this
    /// side's meanwhile.
    pub(crate) fn run(self, peer: &Peer, due: Option<Due>) -> BoxFuture<'static, Result<()>> {
        let Check { op, local, remote, .. } = self;
        let addr = peer.addr();
        let fence = (op == Op::Write).then(|| peer.inner.data.fence_writes());
        let control = peer.inner.control.clone();
        Box::pin(async move {
            if let Some(fence) = fence {
                fence.await?;
            }
            let theirs = control.sums(op, remote.clone(), due.map(|d| d.at));
            let ours = async {
                match local {
                    Local::Summed(sums) => Ok(sums),
                    Local::Later(ranges) => local_sums(ranges).await,
                }
            };
            let (theirs, ours) = futures::future::try_join(theirs, ours).await?;
            compare(op, &ours, &theirs, &remote, addr)
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

/// The CRC32C of each range, after the device's copy for staged memory.
fn sum_all(ranges: &[Resolved]) -> Result<Vec<u32>> {
    ranges
        .iter()
        .map(|r| {
            if r.region.block().has_access_hooks() {
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

/// `Ok` when every range's sums agree; else `Integrity`, naming the first that differs and how many do.
fn compare(op: Op, ours: &[u32], theirs: &[u32], remote: &[Segment], peer: std::net::SocketAddr) -> Result<()> {
    let differ: Vec<usize> = (0..ours.len()).filter(|&i| ours.get(i) != theirs.get(i)).collect();
    let Some(&first) = differ.first() else {
        return Ok(());
    };
    let (source, destination) = match op {
        Op::Write => ("this engine's source", format!("{peer}'s destination")),
        Op::Read => ("the source at the peer", "this engine's destination".to_string()),
    };
    let s = &remote[first];
    let (sent, landed) = match op {
        Op::Write => (ours[first], theirs.get(first).copied().unwrap_or_default()),
        Op::Read => (theirs.get(first).copied().unwrap_or_default(), ours[first]),
    };
    Err(Error::Integrity(format!(
        "{} of {} ranges of this {op:?} differ: descriptor {first} ({} bytes at offset {} of the peer's region \
         {:?}) has CRC32C {landed:#010x} at {destination} where {source} had {sent:#010x}. The bytes were \
         changed on the way or after landing, or at either end while the transfer ran{}; retry it",
        differ.len(),
        ours.len(),
        s.len,
        s.offset,
        s.key,
        match op {
            Op::Read => " (the destination's bytes are not promised)",
            Op::Write => "",
        }
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::RegionKey;

    #[test]
    fn a_difference_names_the_first_range_and_the_count() {
        let seg = |offset| Segment {
            key: RegionKey(9),
            offset,
            len: 4096,
        };
        let addr: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
        let remote = [seg(0), seg(4096), seg(8192)];
        assert!(compare(Op::Write, &[1, 2, 3], &[1, 2, 3], &remote, addr).is_ok());
        let Err(Error::Integrity(m)) = compare(Op::Read, &[1, 7, 8], &[1, 2, 3], &remote, addr) else {
            panic!("expected Integrity")
        };
        assert!(
            m.starts_with("2 of 3 ranges of this Read differ: descriptor 1 (4096 bytes at offset 4096"),
            "{m}"
        );
        assert!(m.contains("0x00000007") && m.contains("0x00000002"), "{m}");
        // Too few answers is a difference too.
        assert!(compare(Op::Write, &[1, 2], &[1], &remote[..2], addr).is_err());
    }
}
