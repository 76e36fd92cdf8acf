//! The frames an initiator sends for one batch, in order: the batch cut into pieces ([`plan`](crate::batch::plan)), each
//! piece's `Write`, `WriteBatch`, `Read` or batched `Read` frame, and the `Commit`s that the commit
//! rule of a persistent write in several frames adds after them ([`DeferredCommits`]). The transport
//! takes each [`Send`] in turn, starts its operation (which gives the frame its id and a stream),
//! moves the memory it names, and reports the stream back with [`BatchFrames::sent`].
//!
//! A batch the link checks end to end (`checked`, see [`BatchFrames::new`]) asks, right after each
//! of its frames and on the same stream, for the CRC32C of what that frame wrote or read
//! (`Frame::Sum`). The target serves a stream in order, so it sums those bytes right after they
//! landed (a write) or left (a read), while its cache still holds them; the transport sums its own
//! side the same way, a write's source right before the bytes leave and a read's destination right
//! after they landed, and compares the two when the answer comes. Each range is then read once more at each end, from
//! cache, instead of from memory in a second pass after the batch (64 KiB × 256 scattered writes,
//! 16 MiB a batch and 8 in flight, far past the cache). For that, a checked write's frames carry at
//! most [`CHECKED_FRAME_BYTES`]: with frames of up to a coalescing buffer (8 MiB), the sums read
//! their bytes back from memory (that case: 0.71–0.80 of an unchecked write's throughput; with
//! 1 MiB frames 0.88–0.95, 4 MiB 0.81–0.93, 256 KiB 0.72).
//!
//! So every frame a batch puts on the wire is decided here; the transport decides only what its own
//! I/O needs (a byte budget, a pool buffer to land a coalesced read in, when to copy).

use ferry_core::codec::{Frame, Segment};
use ferry_core::{Durability, Op, Resolved, TransferItem};

use crate::batch::{Piece, Shape, plan_within, segments};
use crate::ids::{OpId, StreamIndex};
use crate::initiator::OpKind;
use crate::written::{DeferredCommits, Noted};

/// Most payload bytes of one frame of a checked batch: what a core's cache holds between the sum of
/// the frame's bytes and their copy (at the source) or between their landing and their sum (at the
/// target). See the module documentation.
pub const CHECKED_FRAME_BYTES: u64 = 1 << 20;

/// One frame of a batch and the local memory that moves with it.
#[derive(Debug)]
pub struct Send {
    frame: Template,
    stream: Option<StreamIndex>,
    bytes: u64,
    parts: Vec<Resolved>,
}

/// What a frame will say, but for its operation id.
#[derive(Debug)]
enum Template {
    Write(TransferItem, Durability),
    WriteBatch(Vec<Segment>, Durability),
    Read(TransferItem),
    ReadBatch(Vec<Segment>),
    Commit(Vec<Segment>),
    /// The sums of what the frame before it (of this operation) wrote or read.
    Sum(Op, Vec<Segment>),
}

impl Send {
    /// What answers it: an acknowledgement, or read data.
    pub fn kind(&self) -> OpKind {
        match self.frame {
            Template::Read(_) | Template::ReadBatch(_) => OpKind::Read,
            Template::Sum(..) => OpKind::Sum,
            _ => OpKind::Ack,
        }
    }

    /// The stream it must go on (a commit: the stream of the writes it persists; a checksum request:
    /// the stream of the write it checks); `None`: any.
    pub fn stream(&self) -> Option<StreamIndex> {
        self.stream
    }

    /// The payload bytes it moves, in either direction (none for a commit).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether it moves several descriptors in one frame (a read's data then lands in one buffer
    /// and is scattered over [`parts`](Self::parts)).
    pub fn is_coalesced(&self) -> bool {
        matches!(self.frame, Template::WriteBatch(..) | Template::ReadBatch(_))
    }

    /// The ranges of the peer whose sums a checksum request asks for (empty for any other frame).
    pub fn checked_ranges(&self) -> &[Segment] {
        match &self.frame {
            Template::Sum(_, segments) => segments,
            _ => &[],
        }
    }

    /// The local memory it moves, in wire order: a write's payload, a read's destination.
    pub fn parts(&self) -> &[Resolved] {
        &self.parts
    }

    /// The frame for operation `id`, and the memory it moves.
    pub fn into_frame(self, id: OpId) -> (Frame, Vec<Resolved>) {
        let (parts, frame) = self.split();
        (frame.frame(id), parts)
    }

    /// The memory it moves, and its frame, still waiting for an operation id: for a transport that
    /// must hand the memory over before the operation starts (a read's destination).
    pub fn split(self) -> (Vec<Resolved>, FrameFor) {
        (self.parts, FrameFor(self.frame))
    }
}

/// A frame waiting for its operation id ([`Send::split`]).
#[derive(Debug)]
pub struct FrameFor(Template);

impl FrameFor {
    /// The frame of operation `id`.
    pub fn frame(self, id: OpId) -> Frame {
        let id = id.0;
        match self.0 {
            Template::Write(item, durability) => Frame::Write {
                id,
                key: item.remote_key,
                offset: item.remote_offset,
                durability,
            },
            Template::WriteBatch(segments, durability) => Frame::WriteBatch {
                id,
                durability,
                segments,
            },
            Template::Read(item) => Frame::Read {
                id,
                key: item.remote_key,
                offset: item.remote_offset,
                len: item.len(),
            },
            Template::ReadBatch(segments) => Frame::ReadBatch { id, segments },
            Template::Commit(segments) => Frame::Commit {
                id,
                durability: Durability::Persistent,
                segments,
            },
            Template::Sum(op, segments) => Frame::Sum { id, op, segments },
        }
    }
}

/// The frames of one batch, handed out one at a time: every piece, then the commits.
#[derive(Debug)]
pub struct BatchFrames {
    op: Op,
    durability: Durability,
    pieces: std::vec::IntoIter<Piece>,
    commits: Option<DeferredCommits>,
    /// What the piece last handed out wrote, until [`sent`](Self::sent) names its stream.
    unsent: Option<Noted>,
    /// Whether each frame is followed by a request for its sums.
    checked: bool,
    /// The checksum request of the frame last handed out, once its stream is known.
    check: Option<Send>,
    /// That frame's remote ranges, until then.
    to_check: Option<Vec<Segment>>,
    /// The commits, once every piece went.
    closing: Option<std::vec::IntoIter<(StreamIndex, Vec<Segment>)>>,
}

impl BatchFrames {
    /// The frames of a batch of `op` on `items` at `durability`, over a link shaped `shape` with
    /// `streams` streams (the control stream counted). A `checked` batch follows each frame with a
    /// request for the CRC32C of the peer's ranges it wrote or read, on its stream (see the module
    /// documentation); the answer is one sum per range of the frame, in the order of its
    /// [`Send::parts`].
    pub fn new(
        op: Op,
        durability: Durability,
        items: Vec<TransferItem>,
        shape: &Shape,
        streams: usize,
        checked: bool,
    ) -> Self {
        let pieces = match checked {
            true => {
                let capped = Shape {
                    coalesce_buffer: shape.coalesce_buffer.map(|b| b.min(CHECKED_FRAME_BYTES)),
                    ..*shape
                };
                plan_within(op, items, &capped, CHECKED_FRAME_BYTES)
            }
            false => plan_within(op, items, shape, crate::batch::MAX_PIECE),
        };
        let commits = DeferredCommits::new(op, durability, pieces.len(), streams);
        BatchFrames {
            op,
            durability: commits.frame_durability(durability),
            pieces: pieces.into_iter(),
            commits: Some(commits),
            unsent: None,
            checked,
            check: None,
            to_check: None,
            closing: None,
        }
    }

    /// The next frame to send; `None` when the batch is all sent. After a piece, call
    /// [`sent`](Self::sent) with the stream it took before asking for the next.
    #[allow(clippy::should_implement_trait)] // needs `sent` between items: not an `Iterator`
    pub fn next(&mut self) -> Option<Send> {
        if let Some(check) = self.check.take() {
            return Some(check);
        }
        if let Some(piece) = self.pieces.next() {
            return Some(self.piece(piece));
        }
        let closing = self.closing.get_or_insert_with(|| {
            let commits = self.commits.take().map(DeferredCommits::commits);
            commits.unwrap_or_default().into_iter()
        });
        closing.next().map(|(stream, segments)| Send {
            frame: Template::Commit(segments),
            stream: Some(stream),
            bytes: 0,
            parts: Vec::new(),
        })
    }

    /// Notes that the piece last handed out went on `stream` (its commit, if one is deferred, goes
    /// there after it).
    pub fn sent(&mut self, stream: StreamIndex) {
        if let (Some(commits), Some(noted)) = (self.commits.as_mut(), self.unsent.take()) {
            commits.sent(stream, noted);
        }
        if let Some(segments) = self.to_check.take() {
            self.check = Some(Send {
                frame: Template::Sum(self.op, segments),
                stream: Some(stream),
                bytes: 0,
                parts: Vec::new(),
            });
        }
    }

    fn piece(&mut self, piece: Piece) -> Send {
        self.unsent = self.commits.as_ref().map(|c| c.note(&piece));
        self.to_check = self.checked.then(|| piece.segments());
        let bytes = piece.len();
        let (frame, parts) = match (self.op, piece) {
            (Op::Write, Piece::Direct(item)) => {
                let local = item.local.clone();
                (Template::Write(item, self.durability), vec![local])
            }
            (Op::Read, Piece::Direct(item)) => {
                let local = item.local.clone();
                (Template::Read(item), vec![local])
            }
            (op, Piece::Coalesced(group)) => {
                let segments = segments(&group);
                let parts = group.into_iter().map(|i| i.local).collect();
                match op {
                    Op::Write => (Template::WriteBatch(segments, self.durability), parts),
                    Op::Read => (Template::ReadBatch(segments), parts),
                }
            }
        };
        Send {
            frame,
            stream: None,
            bytes,
            parts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::test_items;

    fn shape(streams: usize) -> Shape {
        Shape {
            streams,
            coalesce_buffer: Some(1 << 20),
            direct_read: 64 << 10,
        }
    }

    /// Sends every frame of a batch, piece `i` on stream `1 + i % data_streams`, and returns the
    /// frames with their streams (`None`: any).
    fn run(op: Op, durability: Durability, sizes: &[u64], data_streams: usize) -> Vec<(Option<StreamIndex>, Frame)> {
        let mut frames = BatchFrames::new(
            op,
            durability,
            test_items(sizes),
            &shape(data_streams),
            data_streams + 1,
            false,
        );
        let mut out = Vec::new();
        let mut i = 0u16;
        while let Some(send) = frames.next() {
            let stream = send.stream();
            let (frame, _) = send.into_frame(OpId(u64::from(i)));
            if !matches!(frame, Frame::Commit { .. }) {
                frames.sent(StreamIndex(1 + i % data_streams as u16));
            }
            out.push((stream, frame));
            i += 1;
        }
        out
    }

    #[test]
    fn one_frame_carries_its_durability_itself() {
        let frames = run(Op::Write, Durability::Persistent, &[1 << 20], 1);
        assert!(matches!(
            frames[..],
            [(
                None,
                Frame::Write {
                    durability: Durability::Persistent,
                    ..
                }
            )]
        ));
    }

    #[test]
    fn a_persistent_write_in_several_frames_commits_on_each_stream_it_used() {
        let frames = run(Op::Write, Durability::Persistent, &[4 << 20, 4 << 20, 4 << 20], 2);
        let (writes, commits): (Vec<_>, Vec<_>) = frames.iter().partition(|(_, f)| !matches!(f, Frame::Commit { .. }));
        assert!(writes.len() > 1);
        for (_, w) in &writes {
            assert!(
                matches!(
                    w,
                    Frame::Write {
                        durability: Durability::Completed,
                        ..
                    }
                ),
                "{w:?}"
            );
        }
        // The commits come last, one per stream used, and name every byte written.
        assert_eq!(frames.len(), writes.len() + commits.len());
        assert!(
            frames[writes.len()..]
                .iter()
                .all(|(_, f)| matches!(f, Frame::Commit { .. }))
        );
        let streams: Vec<_> = commits.iter().map(|(s, _)| *s).collect();
        assert_eq!(streams, vec![Some(StreamIndex(1)), Some(StreamIndex(2))]);
        let committed: u64 = commits
            .iter()
            .flat_map(|(_, f)| match f {
                Frame::Commit { segments, .. } => segments.clone(),
                _ => Vec::new(),
            })
            .map(|s| s.len)
            .sum();
        assert_eq!(committed, 12 << 20);
    }

    #[test]
    fn small_descriptors_share_a_frame_both_ways() {
        for (op, coalesced) in [(Op::Write, "WriteBatch"), (Op::Read, "ReadBatch")] {
            let frames = run(op, Durability::Completed, &[4096; 64], 1);
            assert_eq!(frames.len(), 1, "{op:?}: {frames:?}");
            let name = format!("{:?}", frames[0].1);
            assert!(name.starts_with(coalesced), "{op:?}: {name}");
        }
    }

    #[test]
    fn a_checked_write_asks_for_each_frames_sums_right_behind_it_on_its_stream() {
        let sizes = [4096, 4096, 4 << 20, 4 << 20];
        let mut frames = BatchFrames::new(
            Op::Write,
            Durability::Persistent,
            test_items(&sizes),
            &shape(2),
            3,
            true,
        );
        let mut order = Vec::new();
        let mut last_write: Option<(StreamIndex, Vec<Segment>)> = None;
        let mut i = 0u16;
        while let Some(send) = frames.next() {
            let (kind, asked, len) = (send.kind(), send.stream(), send.bytes());
            assert!(
                len <= CHECKED_FRAME_BYTES,
                "a checked write's frame stays in cache: {len}"
            );
            let (frame, _) = send.into_frame(OpId(u64::from(i)));
            match frame {
                Frame::Sum { op, segments, .. } => {
                    let (stream, wrote) = last_write.take().expect("a sum request follows a write frame");
                    assert_eq!((kind, op, asked), (OpKind::Sum, Op::Write, Some(stream)));
                    assert_eq!(segments, wrote, "it asks for what that frame wrote");
                    order.push("sum");
                }
                Frame::Commit { .. } => order.push("commit"),
                Frame::Write { key, offset, .. } => {
                    let stream = StreamIndex(1 + i % 2);
                    last_write = Some((stream, vec![Segment { key, offset, len }]));
                    frames.sent(stream);
                    order.push("write");
                }
                Frame::WriteBatch { ref segments, .. } => {
                    let stream = StreamIndex(1 + i % 2);
                    last_write = Some((stream, segments.clone()));
                    frames.sent(stream);
                    order.push("write");
                }
                other => panic!("unexpected {other:?}"),
            }
            i += 1;
        }
        // Every write frame has its sum request right behind it; the commits come last. The two
        // 4 MiB descriptors go in 1 MiB frames.
        let writes = order.iter().filter(|&&o| o == "write").count();
        assert!(writes >= 9, "{order:?}");
        assert_eq!(order.iter().filter(|&&o| o == "sum").count(), writes);
        for pair in order.chunks(2).take(writes) {
            assert_eq!(pair, ["write", "sum"], "{order:?}");
        }
        assert!(order[2 * writes..].iter().all(|&o| o == "commit"), "{order:?}");

        // A checked read: each frame (the 4 MiB descriptor in 1 MiB frames) and then its sums, on
        // its stream, for what it read.
        let mut reads = BatchFrames::new(
            Op::Read,
            Durability::Completed,
            test_items(&[4 << 20]),
            &shape(1),
            2,
            true,
        );
        let mut frames_read = 0;
        while let Some(read) = reads.next() {
            assert_eq!((read.kind(), read.bytes()), (OpKind::Read, CHECKED_FRAME_BYTES));
            let (frame, _) = read.into_frame(OpId(1));
            let Frame::Read { key, offset, len, .. } = frame else {
                panic!("{frame:?}")
            };
            reads.sent(StreamIndex(1));
            let sum = reads.next().expect("its sums");
            assert_eq!(sum.stream(), Some(StreamIndex(1)));
            let (frame, _) = sum.into_frame(OpId(2));
            assert_eq!(
                frame,
                Frame::Sum {
                    id: 2,
                    op: Op::Read,
                    segments: vec![Segment { key, offset, len }]
                }
            );
            frames_read += 1;
        }
        assert_eq!(frames_read, 4);
    }

    #[test]
    fn a_read_asks_for_what_its_destination_holds() {
        let mut frames = BatchFrames::new(
            Op::Read,
            Durability::Completed,
            test_items(&[1 << 20]),
            &shape(1),
            2,
            false,
        );
        let send = frames.next().expect("one piece");
        assert_eq!(
            (send.kind(), send.bytes(), send.is_coalesced()),
            (OpKind::Read, 1 << 20, false)
        );
        let (frame, parts) = send.into_frame(OpId(9));
        assert!(matches!(frame, Frame::Read { id: 9, len, .. } if len == 1 << 20));
        assert_eq!(parts.iter().map(|p| p.len).sum::<u64>(), 1 << 20);
        frames.sent(StreamIndex(1));
        assert!(frames.next().is_none());
    }
}
