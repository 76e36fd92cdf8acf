//! A staged block's work off the runtime: a staged block's device copies (`commit_written`, `prepare_read`)
//! and a persist that is an `msync` may block for milliseconds or more, so the server runs them on a
//! blocking thread (a persist in place, its worker's other tasks handed to another thread), under an
//! owned permit of the region's access guard held across it: the region's deregistration waits for
//! the work, and no other task waits for it.

use std::sync::Arc;

use ferry_core::region::by_region;
use ferry_core::{Durability, Error, RegionEntry, Resolved, Result};

/// Runs `work` on `region` under an owned permit: on a blocking thread when `blocking`, else here.
/// Fails with the region's `PermissionDenied` once it is being deregistered.
async fn under_permit(
    region: &Arc<RegionEntry>,
    blocking: bool,
    work: impl FnOnce(&RegionEntry) -> Result<()> + Send + 'static,
) -> Result<()> {
    let work = region.with_owned_permit(work)?;
    if !blocking {
        return work();
    }
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::Internal(format!("a staged block's work on a blocking thread panicked: {e}")))?
}

/// After `parts` were written (by a peer, or by a read's data landing): each part's block checked
/// intact (a copy into a file that shrank meanwhile landed in zero pages without failing), then the
/// staged blocks' copies to the device. Several parts with staged memory among them go one batch per
/// region (`MemoryBlock::commit_written_ranges`): one trip to a blocking thread and one device
/// submission per region, not per range. Other requests go part by part, allocating nothing. Every
/// part is committed whatever happened to the others; the first error is returned.
pub(crate) async fn commit_written(parts: &[Resolved]) -> Result<()> {
    let mut result = Ok(());
    let mut keep_first = |outcome: Result<()>| {
        if result.is_ok() {
            result = outcome;
        }
    };
    if worth_grouping(parts) {
        for (region, ranges) in by_region(parts) {
            keep_first(match region.block().check_intact() {
                Ok(()) => {
                    under_permit(&region, may_block(&region), move |region| {
                        region.commit_written_ranges(&ranges, Durability::Completed)
                    })
                    .await
                }
                Err(e) => Err(e),
            });
        }
    } else {
        for r in parts {
            let (offset, len) = (r.offset as usize, r.len as usize);
            keep_first(match r.region.block().check_intact() {
                Ok(()) => {
                    under_permit(&r.region, may_block(&r.region), move |region| {
                        region.block().commit_written(offset, len, Durability::Completed)
                    })
                    .await
                }
                Err(e) => Err(e),
            });
        }
    }
    result
}

/// Before `parts` are read: the staged blocks' copies from the device, grouped as
/// [`commit_written`] groups them; stops at the first error.
pub(crate) async fn prepare_read(parts: &[Resolved]) -> Result<()> {
    if worth_grouping(parts) {
        for (region, ranges) in by_region(parts) {
            under_permit(&region, may_block(&region), move |region| {
                region.prepare_read_ranges(&ranges)
            })
            .await?;
        }
        return Ok(());
    }
    for r in parts {
        let (offset, len) = (r.offset as usize, r.len as usize);
        under_permit(&r.region, may_block(&r.region), move |region| {
            region.block().prepare_read(offset, len)
        })
        .await?;
    }
    Ok(())
}

/// Bytes a request moves per device copy when it overlaps those copies with the network: a large
/// payload into or out of staged memory goes in pieces of this size, each piece's copy to the device
/// running while the next piece arrives (a write), or its copy from the device while the piece
/// before it is sent (a read), so that a DMA engine and the socket work at once. Each piece costs a
/// trip to a blocking thread and a device submission with its fence: on a machine where the copies
/// are the CPU's (lavapipe, 2 cores, 16 MiB writes and reads at depth 1), 1 MiB pieces made writes
/// 25 % slower, 2 MiB 6 %, and 4 MiB none (reads 8 % faster).
pub(crate) const OVERLAP_PIECE: u64 = 4 << 20;

/// `parts` cut into pieces of at most `most` bytes, in order, when the request is larger than one
/// piece and some of its memory is staged (its device copies are worth overlapping with the
/// network); `None` otherwise. A part larger than what is left of a piece is split across pieces.
pub(crate) fn overlap_pieces(parts: &[Resolved], most: u64) -> Option<Vec<Vec<Resolved>>> {
    let total: u64 = parts.iter().map(|p| p.len).sum();
    if total <= most || !parts.iter().any(|p| p.region.block().has_access_hooks()) {
        return None;
    }
    Some(pieces(parts, most))
}

/// `parts` cut into pieces of at most `most` bytes, in order (one piece at least); a part larger
/// than what is left of a piece is split across pieces.
pub(crate) fn pieces(parts: &[Resolved], most: u64) -> Vec<Vec<Resolved>> {
    ferry_core::region::cut(
        parts,
        most,
        |p| p.len,
        |p, done, n| Resolved {
            region: p.region.clone(),
            offset: p.offset + done,
            len: n,
        },
    )
}

/// How many bytes `parts` hold.
pub(crate) fn bytes_of(parts: &[Resolved]) -> usize {
    parts.iter().map(|p| p.len as usize).sum()
}

/// Whether a payload moves through a stream's [`Bounces`] ([`crate::device`]): some part's block
/// copies between its device and any buffer
/// ([`MemoryBlock::device_copies`](ferry_core::MemoryBlock::device_copies)), so that its bytes
/// never pass through the block's host copy. Both ends decide by this one rule, for writes and
/// reads alike; the payload's other parts go through the same buffers, host memory by a plain copy
/// and staged memory without device copies through its host copy, brought from or committed to
/// its device around the pieces ([`staged_in_host_copy`]).
pub(crate) fn through_device<'a>(parts: impl IntoIterator<Item = &'a Resolved>) -> bool {
    parts.into_iter().any(|p| p.region.block().device_copies().is_some())
}

/// The parts of staged memory whose blocks have no device copies of their own (Vulkan's): their
/// bytes pass through the host copy, which [`prepare_read`] fills from the device before a read
/// and [`commit_written`] copies to the device after a write. Blocks with device copies are left
/// out: for them both hooks would move the whole range through the host copy.
pub(crate) fn staged_in_host_copy<'a>(parts: impl IntoIterator<Item = &'a Resolved>) -> Vec<Resolved> {
    parts
        .into_iter()
        .filter(|p| {
            let block = p.region.block();
            block.has_access_hooks() && block.device_copies().is_none()
        })
        .cloned()
        .collect()
}

/// A stream's buffers for payloads that do not go straight into region memory: a write into a
/// page-cache file, and a payload through devices' copies ([`through_device`]), whose pieces take
/// turns in two buffers (one filled from or sent to the socket while the other is copied). They
/// grow to the largest piece and stay: a stream holds at most two pieces' worth.
#[derive(Default)]
pub(crate) struct Bounces(Vec<Vec<u8>>);

impl Bounces {
    /// The first buffer, for a user that needs one at a time.
    pub(crate) fn first(&mut self) -> &mut Vec<u8> {
        if self.0.is_empty() {
            self.0.push(Vec::new());
        }
        &mut self.0[0]
    }

    /// A buffer of `len` bytes, taken until it is [given back](Self::give).
    pub(crate) fn take(&mut self, len: usize) -> Vec<u8> {
        let mut buf = self.0.pop().unwrap_or_default();
        buf.resize(len, 0);
        buf
    }

    /// Keeps `buf` for the next [`take`](Self::take).
    pub(crate) fn give(&mut self, buf: Vec<u8>) {
        if self.0.len() < 2 {
            self.0.push(buf);
        }
    }
}

/// Where a piece's copy between its devices and a buffer runs: a blocking thread, which hands the
/// buffer back with the outcome.
pub(crate) type DeviceCopy = tokio::task::JoinHandle<(Vec<u8>, Result<()>)>;

/// Starts copying `buf`, the bytes of `piece` back to back, onto the parts' devices (into the
/// memory of a part whose block has no device copies), each part under a permit of its region (its
/// `PermissionDenied` once the region is being deregistered). `held` is dropped once the copies
/// ended: an initiator's permit of the transfer that waits for them.
pub(crate) fn to_device(piece: Vec<Resolved>, buf: Vec<u8>, held: impl Send + 'static) -> DeviceCopy {
    tokio::task::spawn_blocking(move || {
        let mut at = 0usize;
        let mut result = Ok(());
        for p in &piece {
            let src = &buf[at..at + p.len as usize];
            let copied = match p.region.block().device_copies() {
                Some(copies) => with_permit(p, || copies.copy_to_device(p.offset as usize, src)),
                None => p.region.copy_in(p.offset, src),
            };
            if result.is_ok() {
                result = copied;
            }
            at += src.len();
        }
        drop(held);
        (buf, result)
    })
}

/// Starts copying the bytes of `piece` from the parts' devices (from the memory of a part whose
/// block has no device copies) into `buf` (as long as the piece), back to back, each part under a
/// permit of its region; stops at the first error.
pub(crate) fn from_device(piece: Vec<Resolved>, mut buf: Vec<u8>) -> DeviceCopy {
    tokio::task::spawn_blocking(move || {
        let mut at = 0usize;
        for p in &piece {
            let dst = &mut buf[at..at + p.len as usize];
            let copied = match p.region.block().device_copies() {
                Some(copies) => with_permit(p, || copies.copy_from_device(p.offset as usize, dst)),
                None => p.region.copy_out(p.offset, dst),
            };
            if let Err(e) = copied {
                return (buf, Err(e));
            }
            at += p.len as usize;
        }
        (buf, Ok(()))
    })
}

/// Runs `copy` under a permit of `part`'s region (its range was checked when the part was resolved).
fn with_permit(part: &Resolved, copy: impl FnOnce() -> Result<()>) -> Result<()> {
    let Some(_permit) = part.region.guard().enter() else {
        return Err(part.region.gone());
    };
    copy()
}

/// The outcome of a [`DeviceCopy`]: its buffer (empty if its thread panicked) and result.
pub(crate) fn copied(
    joined: std::result::Result<(Vec<u8>, Result<()>), tokio::task::JoinError>,
) -> (Vec<u8>, Result<()>) {
    joined.unwrap_or_else(|e| {
        (
            Vec::new(),
            Err(Error::Internal(format!(
                "a device copy on a blocking thread panicked: {e}"
            ))),
        )
    })
}

/// Whether `parts` are several and some have hooks to batch (staged memory).
fn worth_grouping(parts: &[Resolved]) -> bool {
    parts.len() > 1 && parts.iter().any(|r| r.region.block().has_access_hooks())
}

/// Whether a completed access's hooks on `region` may block (and so run on a blocking thread).
fn may_block(region: &RegionEntry) -> bool {
    region.staging_may_block(Durability::Completed)
}

/// Runs a persist (`work` on `region`, under an owned permit) that may block: in place on a worker
/// of a multi-threaded runtime (`tokio::task::block_in_place`, which hands the worker's other tasks
/// to another thread first), else on a blocking thread. In place, the task goes on to answer on the
/// thread that ran the `msync`, where a blocking thread would have to wake the task's worker and it
/// another: 4 KiB persistent writes over TCP, one in flight, p50 323-352 µs on a blocking thread,
/// 244 in place, of which the `msync` takes about 210.
async fn persist_under_permit(
    region: &Arc<RegionEntry>,
    blocking: bool,
    work: impl FnOnce(&RegionEntry) -> Result<()> + Send + 'static,
) -> Result<()> {
    let in_place = blocking
        && tokio::runtime::Handle::try_current()
            .is_ok_and(|runtime| runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    match in_place {
        true => tokio::task::block_in_place(region.with_owned_permit(work)?),
        false => under_permit(region, blocking, work).await,
    }
}

/// What wrote the bytes a persist makes durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Writer {
    /// This host's CPU (a copy into the memory, or a `pwrite` into its file): the pages it wrote are
    /// dirty already.
    Cpu,
    /// Possibly a NIC (RDMA), whose writes into a page cache dirty no page.
    Any,
}

/// Makes the written `parts` persistent when asked, one batch per region (a page written by several
/// parts is flushed once); an `msync` runs where it may block ([`persist_under_permit`]).
/// [`RegionEntry::persist_written`](ferry_core::RegionEntry::persist_written) picks the flush by
/// `writer`.
pub(crate) async fn persist(parts: &[Resolved], durability: Durability, writer: Writer) -> Result<()> {
    if durability != Durability::Persistent {
        return Ok(());
    }
    for (region, ranges) in by_region(parts) {
        let blocking = region.staging_may_block(durability);
        let by_cpu = writer == Writer::Cpu;
        persist_under_permit(&region, blocking, move |region| region.persist_written(&ranges, by_cpu)).await?;
    }
    Ok(())
}

/// The CRC32C of each part, in order ([`ferry_core::integrity::sum`]: `prepare_read` ran first
/// where the memory is staged without device copies of its own); off the runtime when large or
/// copied from a device.
pub(crate) async fn sums(parts: Vec<Resolved>) -> Result<Vec<u32>> {
    let total: u64 = parts.iter().map(|p| p.len).sum();
    let any_device = parts.iter().any(|p| p.region.block().device_copies().is_some());
    let work = move || {
        parts
            .iter()
            .map(ferry_core::integrity::sum)
            .collect::<Result<Vec<u32>>>()
    };
    if total <= ferry_core::integrity::SUM_INLINE_BYTES && !any_device {
        return work();
    }
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::Internal(format!("checksumming on a blocking thread panicked: {e}")))?
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ferry_core::{Access, DmaView, MemoryBlock, OwnedBuffer, RegionEntry, RegionKey, Resolved};
    use proptest::prelude::*;

    use super::overlap_pieces;

    /// Host memory that says it is staged.
    struct Staged(OwnedBuffer);

    // SAFETY: every promise is `OwnedBuffer`'s, whose pointer and length this block hands on.
    unsafe impl MemoryBlock for Staged {
        fn as_ptr(&self) -> *mut u8 {
            self.0.as_ptr()
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn kind(&self) -> &str {
            "staged host"
        }
        fn dma_view(&self) -> DmaView {
            DmaView::Staged
        }
    }

    fn region(key: u64, staged: bool) -> Arc<RegionEntry> {
        let bytes = OwnedBuffer::new(vec![0u8; 1 << 16]);
        let block: Arc<dyn MemoryBlock> = match staged {
            true => Arc::new(Staged(bytes)),
            false => Arc::new(bytes),
        };
        Arc::new(RegionEntry::new(RegionKey(key), Access::READ_WRITE, block).unwrap())
    }

    proptest! {
        /// Pieces hold every byte of every part once, in order, each at most `most` bytes, and
        /// come only for a request of staged memory larger than one piece.
        #[test]
        fn pieces_cover_the_parts_in_order(
            lens in proptest::collection::vec(1u64..5000, 1..12),
            most in 1u64..9000,
            staged in proptest::collection::vec(any::<bool>(), 12),
        ) {
            let regions: Vec<_> = (0..lens.len()).map(|i| region(i as u64 + 1, staged[i])).collect();
            let parts: Vec<Resolved> = lens
                .iter()
                .zip(&regions)
                .map(|(&len, r)| Resolved { region: r.clone(), offset: 7, len })
                .collect();
            let total: u64 = lens.iter().sum();
            let any_staged = staged[..lens.len()].iter().any(|&s| s);
            let Some(pieces) = overlap_pieces(&parts, most) else {
                prop_assert!(total <= most || !any_staged);
                return Ok(());
            };
            prop_assert!(total > most && any_staged);
            let flat: Vec<&Resolved> = pieces.iter().flatten().collect();
            for piece in &pieces {
                let bytes: u64 = piece.iter().map(|p| p.len).sum();
                prop_assert!(bytes > 0 && bytes <= most);
            }
            // Walk the parts: each piece part continues where the last one of its part ended.
            let mut next = 0usize;
            let mut done = 0u64;
            for p in flat {
                prop_assert!(Arc::ptr_eq(&p.region, &parts[next].region));
                prop_assert_eq!(p.offset, parts[next].offset + done);
                done += p.len;
                if done == parts[next].len {
                    next += 1;
                    done = 0;
                }
            }
            prop_assert_eq!(next, parts.len());
        }
    }
}
