//! How an initiator cuts a batch into frames over several streams: which descriptors share a frame
//! (coalesced, `WriteBatch` or a batched `Read`), which go alone, and where a large one is split so
//! that every stream carries a part of it. A decision of the protocol, not of the sockets: the TCP
//! transport posts the pieces this returns.

use ferry_core::codec::Segment;
use ferry_core::{Op, Resolved, TransferItem};

/// Large descriptors are split into pieces of at least this size.
pub const MIN_SPLIT: u64 = 256 << 10;
/// And at most this size.
pub const MAX_PIECE: u64 = 16 << 20;
/// Most segments in one coalesced frame.
pub const MAX_SEGMENTS: usize = 4096;
/// The least a coalesced frame is filled to before another starts, when the streams' shares are
/// smaller.
const MIN_COALESCED: u64 = 64 << 10;

/// One frame's worth of a batch.
#[derive(Debug)]
pub enum Piece {
    /// One descriptor, or a part of one, in a frame of its own.
    Direct(TransferItem),
    /// Several descriptors in one frame.
    Coalesced(Vec<TransferItem>),
}

impl Piece {
    /// Bytes the piece moves.
    pub fn len(&self) -> u64 {
        match self {
            Piece::Direct(i) => i.len(),
            Piece::Coalesced(g) => g.iter().map(|i| i.len()).sum(),
        }
    }

    /// The remote ranges its frame names, in order.
    pub fn segments(&self) -> Vec<Segment> {
        match self {
            Piece::Direct(item) => segments(std::slice::from_ref(item)),
            Piece::Coalesced(group) => segments(group),
        }
    }

    /// Whether it moves nothing (never, for a piece [`plan`] made).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What the plan depends on besides the batch.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Data streams the link has.
    pub streams: usize,
    /// The size of a coalescing buffer, when the link coalesces (HIXL's buffer pool); `None`: never.
    pub coalesce_buffer: Option<u64>,
    /// Reads below this land through the stream's read buffer and are copied out anyway.
    pub direct_read: u64,
}

/// Whether a descriptor of `len` bytes is worth coalescing into a frame with others: where that
/// saves frames and acknowledgements without adding a copy. Writes are gathered: one `sendmsg(2)`
/// names many ranges straight in their regions, and the target scatters them into its regions with
/// one `readv(2)`, so coalescing costs no copy below [`MIN_SPLIT`], where splitting starts (64 KiB ×
/// 256 scattered writes: 5.6 GB/s one frame each, 8.2 GB/s gathered; 1 MiB × 8: 7.6). Reads land in
/// a pool buffer and are copied out, which pays only where a read's data would go through the read
/// buffer anyway, below [`Shape::direct_read`].
pub fn worth_coalescing(op: Op, len: u64, shape: &Shape) -> bool {
    match op {
        Op::Write => len < MIN_SPLIT,
        Op::Read => len < shape.direct_read,
    }
}

/// Splits a batch into frames: descriptors worth coalescing (see [`worth_coalescing`]; two at least,
/// since a group of one only adds a copy) are coalesced into frames of up to a coalescing buffer,
/// large ones are split across the streams, the rest go in frames of their own. Every byte of every
/// descriptor is in exactly one piece, and the pieces of a split descriptor follow each other.
pub fn plan(op: Op, items: Vec<TransferItem>, shape: &Shape) -> Vec<Piece> {
    plan_within(op, items, shape, MAX_PIECE)
}

/// [`plan`], with pieces of at most `max_piece` bytes (at least [`MIN_SPLIT`]).
pub(crate) fn plan_within(op: Op, items: Vec<TransferItem>, shape: &Shape, max_piece: u64) -> Vec<Piece> {
    let max_piece = max_piece.max(MIN_SPLIT);
    let streams = shape.streams.max(1) as u64;
    let mut pieces = Vec::new();
    let coalesce = shape.coalesce_buffer.is_some()
        && items
            .iter()
            .filter(|i| worth_coalescing(op, i.len(), shape))
            .take(2)
            .count()
            == 2;
    let mut small = Vec::new();
    for item in items {
        let len = item.len();
        if coalesce && worth_coalescing(op, len, shape) {
            small.push(item);
            continue;
        }
        let piece_len = len.div_ceil(streams).clamp(MIN_SPLIT, max_piece);
        if len <= piece_len {
            pieces.push(Piece::Direct(item));
            continue;
        }
        let mut off = 0;
        while off < len {
            let n = piece_len.min(len - off);
            pieces.push(Piece::Direct(TransferItem {
                local: Resolved {
                    region: item.local.region.clone(),
                    offset: item.local.offset + off,
                    len: n,
                },
                remote_key: item.remote_key,
                remote_offset: item.remote_offset + off,
                remote_addr: item.remote_addr + off,
                remote_transport_key: item.remote_transport_key.clone(),
                remote_access: item.remote_access,
            }));
            off += n;
        }
    }
    if let Some(buffer) = shape.coalesce_buffer.filter(|_| !small.is_empty()) {
        let total: u64 = small.iter().map(|i| i.len()).sum();
        // Spread coalesced frames over the streams, but never beyond a buffer.
        let target = total.div_ceil(streams).clamp(MIN_COALESCED.min(buffer), buffer);
        let mut group = Vec::new();
        let mut group_len = 0;
        for item in small {
            if !group.is_empty() && (group_len + item.len() > target || group.len() == MAX_SEGMENTS) {
                pieces.push(Piece::Coalesced(std::mem::take(&mut group)));
                group_len = 0;
            }
            group_len += item.len();
            group.push(item);
        }
        if !group.is_empty() {
            pieces.push(Piece::Coalesced(group));
        }
    }
    pieces
}

/// The segments a frame names for `items`, in order.
pub fn segments(items: &[TransferItem]) -> Vec<Segment> {
    items
        .iter()
        .map(|i| Segment {
            key: i.remote_key,
            offset: i.remote_offset,
            len: i.len(),
        })
        .collect()
}

#[cfg(test)]
/// Descriptors of `sizes`, one after the other in one local region, each to a region of its own.
pub(crate) fn test_items(sizes: &[u64]) -> Vec<TransferItem> {
    let total: u64 = sizes.iter().sum();
    let block = std::sync::Arc::new(ferry_core::OwnedBuffer::new(vec![0u8; total as usize]));
    let region = std::sync::Arc::new(
        ferry_core::RegionEntry::new(ferry_core::RegionKey(1), ferry_core::Access::READ_WRITE, block).unwrap(),
    );
    let mut at = 0;
    sizes
        .iter()
        .enumerate()
        .map(|(n, &len)| {
            let item = TransferItem {
                local: Resolved {
                    region: region.clone(),
                    offset: at,
                    len,
                },
                remote_key: ferry_core::RegionKey(100 + n as u64),
                remote_offset: 7,
                remote_addr: 0x1000 + 7,
                remote_transport_key: None,
                remote_access: ferry_core::Access::READ_WRITE,
            };
            at += len;
            item
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const KIB: u64 = 1024;

    fn shape(coalesce: bool) -> Shape {
        Shape {
            streams: 2,
            coalesce_buffer: coalesce.then_some(8 << 20),
            direct_read: 64 * KIB,
        }
    }

    /// Descriptor counts per piece: `Ok(n)` a coalesced piece of n, `Err(len)` a direct piece.
    fn pieces(op: Op, sizes: &[u64], coalesce: bool) -> Vec<std::result::Result<usize, u64>> {
        plan(op, test_items(sizes), &shape(coalesce))
            .into_iter()
            .map(|p| match p {
                Piece::Coalesced(g) => Ok(g.len()),
                Piece::Direct(i) => Err(i.len()),
            })
            .collect()
    }

    #[test]
    fn coalescing_only_where_it_adds_no_copy() {
        // Writes below the split size are gathered, into frames of about a stream's share (at least
        // 64 KiB); larger ones go on their own, split across the streams when large enough.
        assert_eq!(
            pieces(Op::Write, &[4 * KIB, 16 * KIB, 64 * KIB, 4 * KIB], true),
            [Ok(2), Ok(1), Ok(1)]
        );
        assert_eq!(pieces(Op::Write, &[64 * KIB; 8], true), [Ok(4), Ok(4)]);
        assert_eq!(
            pieces(Op::Write, &[64 * KIB, 256 * KIB, 64 * KIB], true),
            [Err(256 * KIB), Ok(1), Ok(1)]
        );
        // Reads below the direct threshold land through the read buffer anyway: coalesced. Larger
        // ones land straight in their region.
        assert_eq!(
            pieces(Op::Read, &[32 * KIB, 32 * KIB, 64 * KIB], true),
            [Err(64 * KIB), Ok(2)]
        );
        // A lone small descriptor has nothing to be coalesced with.
        assert_eq!(
            pieces(Op::Write, &[4 * KIB, 1 << 20], true),
            [Err(4 * KIB), Err(512 * KIB), Err(512 * KIB)]
        );
        // No coalescing buffer (`buffer_pool("0:0")`), no coalescing.
        assert_eq!(
            pieces(Op::Write, &[4 * KIB, 4 * KIB], false),
            [Err(4 * KIB), Err(4 * KIB)]
        );
    }

    proptest! {
        /// Every byte of every descriptor is in exactly one piece, split pieces follow each other,
        /// and every piece keeps the limits: a direct piece at most `MAX_PIECE` (or the descriptor,
        /// if smaller), a coalesced one at most `MAX_SEGMENTS` descriptors and a buffer's bytes
        /// (unless one descriptor alone is larger), and nothing coalesced without a buffer.
        #[test]
        fn pieces_cover_the_batch_once_and_keep_the_limits(
            sizes in proptest::collection::vec(prop_oneof![1u64..8192, 8192u64..(1 << 20), (1u64 << 20)..(40 << 20)], 1..64),
            read in any::<bool>(),
            coalesce in any::<bool>(),
            streams in 1usize..5,
        ) {
            let op = if read { Op::Read } else { Op::Write };
            let shape = Shape { streams, ..shape(coalesce) };
            let plan = plan(op, test_items(&sizes), &shape);
            let mut covered: Vec<Vec<(u64, u64)>> = vec![Vec::new(); sizes.len()];
            for piece in &plan {
                prop_assert!(!piece.is_empty());
                let group: Vec<&TransferItem> = match piece {
                    Piece::Direct(i) => {
                        prop_assert!(i.len() <= MAX_PIECE);
                        vec![i]
                    }
                    Piece::Coalesced(g) => {
                        prop_assert!(coalesce, "coalesced without a buffer");
                        prop_assert!(!g.is_empty() && g.len() <= MAX_SEGMENTS);
                        prop_assert!(g.len() == 1 || piece.len() <= 8 << 20);
                        prop_assert!(g.iter().all(|i| worth_coalescing(op, i.len(), &shape)));
                        g.iter().collect()
                    }
                };
                for i in group {
                    let n = (i.remote_key.0 - 100) as usize;
                    let first = test_items(&sizes)[n].local.offset;
                    prop_assert_eq!(i.remote_offset - 7, i.local.offset - first, "local and remote move together");
                    covered[n].push((i.local.offset - first, i.len()));
                }
            }
            for (n, parts) in covered.iter().enumerate() {
                let mut next = 0;
                for &(at, len) in parts {
                    prop_assert_eq!(at, next, "descriptor {}: its pieces follow each other", n);
                    next += len;
                }
                prop_assert_eq!(next, sizes[n], "descriptor {} covered once", n);
            }
        }
    }
}
