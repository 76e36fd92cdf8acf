//! End-to-end integrity of a transfer, when asked: the checksum of each range where it left the
//! source memory against the one where it landed in the destination memory.
//!
//! The sums are CRC32C (Castagnoli), as iSCSI, ext4 and RDMA's own ICRC-free paths use: it catches
//! every burst of up to 32 flipped bits and every odd number of flipped bits, which covers what a
//! NIC, a cable, a proxy or a stray store does to a range, and it runs near memory speed on one core
//! (see the workspace's `crc-fast` note). It is not a MAC: against a network that forges bytes on
//! purpose, authenticated links' protected data streams are the defence.
//!
//! The engine asks the target for the sums of the ranges a completed transfer wrote or read there
//! (`Frame::Sum` on the control link), takes its own of the local ranges, and completes the transfer
//! `Ok` only if they agree ([`Error::Integrity`] otherwise); a link that
//! [checks in band](crate::DataLink::checks_in_band) (TCP) does the same frame by frame,
//! while the bytes are in cache at both ends, with [`compare`]. The target sums
//! what its memory holds after the transfer's bytes landed (for memory staged in front of a device,
//! after a copy from the device: the device's bytes).

use crate::codec::Segment;
use crate::error::{Error, Result};
use crate::region::Resolved;
use crate::types::Op;

/// Sums of at most this many bytes run on the calling thread; past it, callers move them to a
/// blocking thread. At about 50 GB/s from cache that is some 300 µs of a runtime thread at most, and
/// bytes that just landed are summed where they are cached.
pub const SUM_INLINE_BYTES: u64 = 16 << 20;

/// The CRC32C of `bytes`.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, bytes) as u32
}

/// The CRC32C of `a` followed by `bytes`, given `sum`, the CRC32C of `a`.
pub fn crc32c_append(sum: u32, bytes: &[u8]) -> u32 {
    let next = crc32c(bytes) as u64;
    crc_fast::checksum_combine(crc_fast::CrcAlgorithm::Crc32Iscsi, sum as u64, next, bytes.len() as u64) as u32
}

/// The CRC32C of each of a list of ranges, taken from their bytes as they pass back to back in
/// pieces that need not start or end where a range does (a payload moved through a buffer of its
/// own rather than read in place).
#[derive(Debug, Clone)]
pub struct RunningSums {
    lens: Vec<u64>,
    sums: Vec<u32>,
    /// The range the next byte belongs to, and how many of its bytes have passed.
    index: usize,
    done: u64,
}

impl RunningSums {
    /// Sums for ranges of `lens` bytes, in order.
    pub fn new(lens: impl IntoIterator<Item = u64>) -> Self {
        let lens: Vec<u64> = lens.into_iter().collect();
        let sums = vec![0; lens.len()];
        Self {
            lens,
            sums,
            index: 0,
            done: 0,
        }
    }

    /// Takes in the next `bytes` of the ranges; bytes past the last range are ignored.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while let Some(&len) = self.lens.get(self.index) {
            let n = (len - self.done).min(bytes.len() as u64) as usize;
            self.sums[self.index] = crc32c_append(self.sums[self.index], &bytes[..n]);
            self.done += n as u64;
            bytes = &bytes[n..];
            if self.done < len {
                return;
            }
            self.index += 1;
            self.done = 0;
        }
    }

    /// Each range's sum (of the bytes that passed).
    pub fn finish(self) -> Vec<u32> {
        self.sums
    }
}

/// The CRC32C of a resolved range, under a permit of its region's guard: read in place, or, for a
/// block whose device copies into any buffer ([`device_copies`](crate::MemoryBlock::device_copies):
/// CUDA's), copied from the device a piece at a time, past its host copy. Other memory staged in
/// front of a device holds the device's bytes only after the block's `prepare_read` hook ran for
/// the range: the caller runs it first.
pub fn sum(range: &Resolved) -> Result<u32> {
    let region = &range.region;
    let Some(copies) = region.block().device_copies() else {
        return region.crc32c(range.offset, range.len);
    };
    region.check_range(range.offset, range.len)?;
    let _permit = region.guard().enter().ok_or_else(|| region.gone())?;
    let mut piece = vec![0u8; range.len.min(DEVICE_SUM_PIECE) as usize];
    let (mut sum, mut done) = (0, 0u64);
    while done < range.len {
        let n = (range.len - done).min(DEVICE_SUM_PIECE) as usize;
        copies.copy_from_device((range.offset + done) as usize, &mut piece[..n])?;
        sum = crc32c_append(sum, &piece[..n]);
        done += n as u64;
    }
    Ok(sum)
}

/// Most bytes [`sum`] copies from a device at a time.
const DEVICE_SUM_PIECE: u64 = 4 << 20;

/// `Ok` when the sums of every range agree: `ours`, taken of this engine's ranges, and `theirs`,
/// the peer's of its ranges `remote` (in the same order), for a transfer of `op` with `peer`. Else
/// `Integrity`, naming the first range that differs, how many do, and which end had which sum.
pub fn compare(op: Op, ours: &[u32], theirs: &[u32], remote: &[Segment], peer: &dyn std::fmt::Display) -> Result<()> {
    let differ: Vec<usize> = (0..ours.len().max(theirs.len()))
        .filter(|&i| ours.get(i) != theirs.get(i))
        .collect();
    let Some(&first) = differ.first() else {
        return Ok(());
    };
    let (source, destination) = match op {
        Op::Write => ("this engine's source".to_string(), format!("{peer}'s destination")),
        Op::Read => (format!("the source at {peer}"), "this engine's destination".to_string()),
    };
    let (ours_first, theirs_first) = (ours.get(first).copied(), theirs.get(first).copied());
    let (sent, landed) = match op {
        Op::Write => (ours_first, theirs_first),
        Op::Read => (theirs_first, ours_first),
    };
    let shown = |sum: Option<u32>| sum.map_or_else(|| "none".to_string(), |s| format!("{s:#010x}"));
    let range = remote
        .get(first)
        .map(|s| {
            format!(
                " ({} bytes at offset {} of the peer's region {:?})",
                s.len, s.offset, s.key
            )
        })
        .unwrap_or_default();
    Err(Error::Integrity(format!(
        "{} of {} ranges of this {op:?} differ: range {first}{range} has CRC32C {} at {destination} where \
         {source} had {}. The bytes were changed on the way or after landing, or at either end while the \
         transfer ran{}; retry it",
        differ.len(),
        remote.len().max(ours.len()),
        shown(landed),
        shown(sent),
        match op {
            Op::Read => " (the destination's bytes are not promised)",
            Op::Write => "",
        }
    )))
}

/// Faults for tests: bytes changed after they landed, where no transport's own check can see it.
///
/// Built only with the `fault-hooks` feature (test builds); without it every call here does
/// nothing and is compiled away. Transports call [`fault::landed`] (or [`fault::landed_raw`])
/// right after a transfer's bytes reached their destination memory: over TCP where the target lands
/// a write and where the initiator lands a read, over shared memory after each copy, over RDMA where
/// a READ completed and where the target sums a write; a staged block calls
/// [`fault::device_copy_done`] after its copy onto the device.
pub mod fault {
    #[cfg(feature = "fault-hooks")]
    use std::sync::atomic::{AtomicU64, Ordering};

    use crate::region::Resolved;

    /// How many of the next landings flip a byte.
    #[cfg(feature = "fault-hooks")]
    static FLIPS: AtomicU64 = AtomicU64::new(0);
    /// How many of the next copies of written bytes onto a device (a staged block's) flip one there.
    #[cfg(feature = "fault-hooks")]
    static DEVICE_FLIPS: AtomicU64 = AtomicU64::new(0);

    /// Makes the next landing, on any transport in this process, flip the first byte it landed after
    /// it landed. Only with the `fault-hooks` feature; without it, `false` and nothing happens.
    pub fn flip_next_landing() -> bool {
        #[cfg(feature = "fault-hooks")]
        {
            FLIPS.fetch_add(1, Ordering::AcqRel);
            true
        }
        #[cfg(not(feature = "fault-hooks"))]
        false
    }

    /// Makes the next copy of written bytes from a staged block's host buffer onto its device flip
    /// the first byte on the device, leaving the host buffer as it was: bytes that differ where they
    /// finally are, which only a sum of the device's bytes sees. Only with the `fault-hooks` feature.
    pub fn flip_next_device_copy() -> bool {
        #[cfg(feature = "fault-hooks")]
        {
            DEVICE_FLIPS.fetch_add(1, Ordering::AcqRel);
            true
        }
        #[cfg(not(feature = "fault-hooks"))]
        false
    }

    /// Disarms every armed flip, of landings and of device copies; how many were armed.
    pub fn disarm() -> u64 {
        #[cfg(feature = "fault-hooks")]
        {
            FLIPS.swap(0, Ordering::AcqRel) + DEVICE_FLIPS.swap(0, Ordering::AcqRel)
        }
        #[cfg(not(feature = "fault-hooks"))]
        0
    }

    /// Whether one of `flips` is armed (and counts it taken).
    #[cfg(feature = "fault-hooks")]
    fn take_from(flips: &AtomicU64) -> bool {
        flips.load(Ordering::Acquire) > 0
            && flips
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
    }

    #[cfg(feature = "fault-hooks")]
    fn take() -> bool {
        take_from(&FLIPS)
    }

    /// Whether a copy of written bytes onto a device, just done, should have its first byte flipped
    /// there (and counts it taken); always false without the `fault-hooks` feature.
    #[inline(always)]
    pub fn device_copy_done() -> bool {
        #[cfg(feature = "fault-hooks")]
        {
            take_from(&DEVICE_FLIPS)
        }
        #[cfg(not(feature = "fault-hooks"))]
        false
    }

    /// The bytes of `range` just landed in its region.
    #[inline(always)]
    pub fn landed(range: &Resolved) {
        #[cfg(feature = "fault-hooks")]
        if range.len > 0 && FLIPS.load(Ordering::Acquire) > 0 && take() {
            let mut b = [0u8; 1];
            if range.region.copy_out(range.offset, &mut b).is_ok() {
                b[0] ^= 0x5a;
                let _ = range.region.copy_in(range.offset, &b);
                tracing::warn!(offset = range.offset, "fault hook: flipped a byte after it landed");
            }
        }
        #[cfg(not(feature = "fault-hooks"))]
        let _ = range;
    }

    /// [`landed`], for bytes landed in a caller's buffers that `caller` guards: nothing once the
    /// caller's transfer has returned (its guard closed), as no real landing writes then. The guard
    /// is entered only when a flip is armed, so that the data path pays nothing for the hook.
    #[inline(always)]
    pub fn landed_for(range: &Resolved, caller: &crate::guard::AccessGuard) {
        #[cfg(feature = "fault-hooks")]
        if FLIPS.load(Ordering::Acquire) > 0
            && let Some(_held) = caller.enter()
        {
            landed(range);
        }
        #[cfg(not(feature = "fault-hooks"))]
        let _ = (range, caller);
    }

    /// `len` bytes just landed at `ptr`, memory the caller may write (a peer's mapped region).
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` is memory the caller may write, as it just did.
    #[inline(always)]
    pub unsafe fn landed_raw(ptr: *mut u8, len: usize) {
        #[cfg(feature = "fault-hooks")]
        if len > 0 && FLIPS.load(Ordering::Acquire) > 0 && take() {
            // SAFETY: the caller's promise: `ptr` is writable memory it just wrote.
            unsafe { *ptr ^= 0x5a };
            tracing::warn!("fault hook: flipped a byte after it landed");
        }
        #[cfg(not(feature = "fault-hooks"))]
        let _ = (ptr, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Fed in pieces cut anywhere, each range's sum is the one taken of it whole.
        #[test]
        fn running_sums_match_sums_taken_whole(
            lens in proptest::collection::vec(0u64..300, 0..8),
            cuts in proptest::collection::vec(0usize..400, 0..8),
            seed in proptest::prelude::any::<u8>(),
        ) {
            let total: u64 = lens.iter().sum();
            let bytes: Vec<u8> = (0..total).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
            let mut running = RunningSums::new(lens.iter().copied());
            let mut at = 0usize;
            for cut in cuts {
                let n = cut.min(bytes.len() - at);
                running.feed(&bytes[at..at + n]);
                at += n;
            }
            running.feed(&bytes[at..]);
            let mut start = 0usize;
            let whole: Vec<u32> = lens.iter().map(|&len| {
                let sum = crc32c(&bytes[start..start + len as usize]);
                start += len as usize;
                sum
            }).collect();
            proptest::prop_assert_eq!(running.finish(), whole);
        }
    }

    #[test]
    fn crc32c_is_castagnoli() {
        // The check value of CRC-32/ISCSI.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[]), 0);
    }

    #[test]
    fn a_difference_names_the_first_range_and_the_count() {
        let seg = |offset| Segment {
            key: crate::RegionKey(9),
            offset,
            len: 4096,
        };
        let peer = "127.0.0.1:9";
        let remote = [seg(0), seg(4096), seg(8192)];
        assert!(compare(Op::Write, &[1, 2, 3], &[1, 2, 3], &remote, &peer).is_ok());
        let Err(Error::Integrity(m)) = compare(Op::Read, &[1, 7, 8], &[1, 2, 3], &remote, &peer) else {
            panic!("expected Integrity")
        };
        assert!(
            m.starts_with("2 of 3 ranges of this Read differ: range 1 (4096 bytes at offset 4096"),
            "{m}"
        );
        assert!(m.contains("0x00000007") && m.contains("0x00000002"), "{m}");
        // Too few answers is a difference too, and so is too many.
        assert!(compare(Op::Write, &[1, 2], &[1], &remote[..2], &peer).is_err());
        assert!(compare(Op::Write, &[1], &[1, 2], &remote[..1], &peer).is_err());
    }
}
