//! The frames an initiator sends for one batch, in order: the batch cut into pieces ([`plan`]), each
//! piece's `Write`, `WriteBatch`, `Read` or batched `Read` frame, and the `Commit`s that the commit
//! rule of a persistent write in several frames adds after them ([`DeferredCommits`]). The transport
//! takes each [`Send`] in turn, starts its operation (which gives the frame its id and a stream),
//! moves the memory it names, and reports the stream back with [`BatchFrames::sent`].
//!
//! So every frame a batch puts on the wire is decided here; the transport decides only what its own
//! I/O needs (a byte budget, a pool buffer to land a coalesced read in, when to copy).

use ferry_core::codec::{Frame, Segment};
use ferry_core::{Durability, Op, Resolved, TransferItem};

use crate::batch::{Piece, Shape, plan, segments};
use crate::ids::{OpId, StreamIndex};
use crate::initiator::OpKind;
use crate::written::{DeferredCommits, Noted};

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
}

impl Send {
    /// What answers it: an acknowledgement, or read data.
    pub fn kind(&self) -> OpKind {
        match self.frame {
            Template::Read(_) | Template::ReadBatch(_) => OpKind::Read,
            _ => OpKind::Ack,
        }
    }

    /// The stream it must go on (a commit: the stream of the writes it persists); `None`: any.
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
    /// The commits, once every piece went.
    closing: Option<std::vec::IntoIter<(StreamIndex, Vec<Segment>)>>,
}

impl BatchFrames {
    /// The frames of a batch of `op` on `items` at `durability`, over a link shaped `shape` with
    /// `streams` streams (the control stream counted).
    pub fn new(op: Op, durability: Durability, items: Vec<TransferItem>, shape: &Shape, streams: usize) -> Self {
        let pieces = plan(op, items, shape);
        let commits = DeferredCommits::new(op, durability, pieces.len(), streams);
        BatchFrames {
            op,
            durability: commits.frame_durability(durability),
            pieces: pieces.into_iter(),
            commits: Some(commits),
            unsent: None,
            closing: None,
        }
    }

    /// The next frame to send; `None` when the batch is all sent. After a piece, call
    /// [`sent`](Self::sent) with the stream it took before asking for the next.
    #[allow(clippy::should_implement_trait)] // needs `sent` between items: not an `Iterator`
    pub fn next(&mut self) -> Option<Send> {
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
    }

    fn piece(&mut self, piece: Piece) -> Send {
        self.unsent = self.commits.as_ref().map(|c| c.note(&piece));
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
    fn a_read_asks_for_what_its_destination_holds() {
        let mut frames = BatchFrames::new(Op::Read, Durability::Completed, test_items(&[1 << 20]), &shape(1), 2);
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
