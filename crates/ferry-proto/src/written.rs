//! The commit rule of a persistent write in several frames, both halves: what the initiator commits
//! on each stream ([`DeferredCommits`]), and what a stream wrote and has not committed yet, the
//! ranges a `Commit` on that stream may persist at the target ([`WrittenRanges`]).
//!
//! A persistent write in several frames goes as completed writes followed, on each stream it used, by
//! a `Commit` naming what those frames wrote. The target persists only the part of a commit that the
//! stream's earlier writes cover, so that a small frame cannot make it flush a whole file (and hold the
//! region's deregistration meanwhile). Commits of several transfers may interleave on a stream, so a
//! commit takes out only the ranges it persisted.
//!
//! Bounded: at most [`MAX_RANGES`] ranges in all. A write that would keep more spills them: every
//! range kept is handed back to be persisted at once, and forgotten. Persisting early only makes a
//! later commit's promise true sooner; merging ranges instead would make a commit persist the gaps
//! between writes (a peer's 4,097 one-byte writes, spread out, would write back a whole file).
//! So whatever is persisted, early or at a commit, is what the stream wrote, and nothing else.

use std::collections::{BTreeMap, HashMap};

use ferry_core::codec::Segment;
use ferry_core::{Durability, Op, RegionKey};

use crate::batch::{MAX_SEGMENTS, Piece};
use crate::ids::StreamIndex;

/// What one piece of a batch wrote, from [`DeferredCommits::note`].
#[derive(Debug)]
pub struct Noted(Vec<Segment>);

/// The initiator's half: how one batch's frames are sent and which commits follow them. A
/// persistent write of more than one frame is persisted once per stream, after its last frame there:
/// its frames go as completed writes, and a `Commit` follows them on each stream they used (in order
/// on that stream, so no extra round trip), naming what they wrote, in commits of at most
/// [`MAX_SEGMENTS`] segments. A batch of one frame carries its durability itself.
#[derive(Debug)]
pub struct DeferredCommits {
    /// Per stream, what the batch's frames wrote there; `None` when nothing is deferred.
    written: Option<Vec<Vec<Segment>>>,
}

impl DeferredCommits {
    /// The rule for a batch of `op` at `durability` planned in `pieces` frames over a link of
    /// `streams` streams (the control stream counted).
    pub fn new(op: Op, durability: Durability, pieces: usize, streams: usize) -> Self {
        let deferred = op == Op::Write && durability == Durability::Persistent && pieces > 1;
        DeferredCommits {
            written: deferred.then(|| vec![Vec::new(); streams]),
        }
    }

    /// The durability each frame of the batch asks for.
    pub fn frame_durability(&self, requested: Durability) -> Durability {
        match self.written {
            Some(_) => Durability::Completed,
            None => requested,
        }
    }

    /// What `piece` writes, for [`sent`](Self::sent) once the stream it goes on is known (nothing
    /// when no commit is deferred).
    pub fn note(&self, piece: &Piece) -> Noted {
        Noted(match &self.written {
            None => Vec::new(),
            Some(_) => piece.segments(),
        })
    }

    /// Notes that the piece `noted` describes went on `stream`.
    pub fn sent(&mut self, stream: StreamIndex, noted: Noted) {
        if let Some(written) = self.written.as_mut().and_then(|w| w.get_mut(stream.get())) {
            written.extend(noted.0);
        }
    }

    /// The commits to send once every frame went: per stream used, what was written there.
    pub fn commits(self) -> Vec<(StreamIndex, Vec<Segment>)> {
        let mut out = Vec::new();
        for (stream, written) in self.written.unwrap_or_default().into_iter().enumerate() {
            for chunk in written.chunks(MAX_SEGMENTS) {
                out.push((StreamIndex(stream as u16), chunk.to_vec()));
            }
        }
        out
    }
}

/// Most disjoint ranges kept per stream.
pub const MAX_RANGES: usize = 4096;

/// Written, not yet committed ranges of one stream, by region.
#[derive(Debug, Default)]
pub struct WrittenRanges {
    /// Per region: disjoint, non-adjacent ranges, start → end (exclusive).
    by_key: HashMap<RegionKey, BTreeMap<u64, u64>>,
    count: usize,
}

impl WrittenRanges {
    /// Notes that `len` bytes at `offset` of region `key` were written. Returns what the caller must
    /// persist now: nothing, or, when the table would hold more than [`MAX_RANGES`] ranges, every
    /// range it held (which it then forgets).
    #[must_use = "spilled ranges must be persisted now: no commit will find them"]
    pub fn record(&mut self, key: RegionKey, offset: u64, len: u64) -> Vec<Segment> {
        let Some(end) = offset.checked_add(len).filter(|_| len > 0) else {
            return Vec::new();
        };
        let ranges = self.by_key.entry(key).or_default();
        let before = ranges.len();
        let (mut start, mut end) = (offset, end);
        // Absorb every range that overlaps or touches [start, end).
        let touching: Vec<u64> = ranges
            .range(..=end)
            .rev()
            .take_while(|(_, e)| **e >= start)
            .map(|(s, _)| *s)
            .collect();
        for s in touching {
            if let Some(e) = ranges.remove(&s) {
                start = start.min(s);
                end = end.max(e);
            }
        }
        ranges.insert(start, end);
        self.count = self.count + ranges.len() - before;
        if self.count <= MAX_RANGES {
            return Vec::new();
        }
        self.count = 0;
        self.by_key
            .drain()
            .flat_map(|(key, ranges)| {
                ranges.into_iter().map(move |(offset, end)| Segment {
                    key,
                    offset,
                    len: end - offset,
                })
            })
            .collect()
    }

    /// The parts of `segments` this stream wrote, which a commit of them may persist; they are no
    /// longer counted as uncommitted.
    pub fn commit(&mut self, segments: &[Segment]) -> Vec<Segment> {
        let mut covered = Vec::new();
        for seg in segments {
            let Some(end) = seg.offset.checked_add(seg.len) else {
                continue;
            };
            let Some(ranges) = self.by_key.get_mut(&seg.key) else {
                continue;
            };
            let overlapping: Vec<(u64, u64)> = ranges
                .range(..end)
                .rev()
                .take_while(|(_, e)| **e > seg.offset)
                .map(|(s, e)| (*s, *e))
                .collect();
            for (s, e) in overlapping.into_iter().rev() {
                let (from, to) = (s.max(seg.offset), e.min(end));
                covered.push(Segment {
                    key: seg.key,
                    offset: from,
                    len: to - from,
                });
                ranges.remove(&s);
                self.count -= 1;
                if s < from {
                    ranges.insert(s, from);
                    self.count += 1;
                }
                if to < e {
                    ranges.insert(to, e);
                    self.count += 1;
                }
            }
            if ranges.is_empty() {
                self.by_key.remove(&seg.key);
            }
        }
        covered
    }

    /// Ranges kept now.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether nothing is uncommitted.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use crate::batch::{Shape, plan, segments, test_items};

    /// A persistent write of several frames: each frame goes as a completed write, and each stream
    /// it used gets one commit naming exactly what went on it; a single frame, a completed write or
    /// a read defers nothing.
    #[test]
    fn deferred_commits_name_what_each_stream_carried() {
        let shape = Shape {
            streams: 2,
            coalesce_buffer: None,
            direct_read: 64 << 10,
        };
        let pieces = plan(Op::Write, test_items(&[1 << 20, 4096, 300 << 10]), &shape);
        let mut rule = DeferredCommits::new(Op::Write, Durability::Persistent, pieces.len(), 3);
        assert_eq!(rule.frame_durability(Durability::Persistent), Durability::Completed);
        let mut expected: Vec<Vec<Segment>> = vec![Vec::new(); 3];
        for (n, piece) in pieces.iter().enumerate() {
            let stream = StreamIndex(1 + (n % 2) as u16);
            let noted = rule.note(piece);
            rule.sent(stream, noted);
            if let Piece::Direct(item) = piece {
                expected[stream.get()].push(segments(std::slice::from_ref(item))[0]);
            }
        }
        let commits = rule.commits();
        assert_eq!(commits.len(), 2, "one commit per stream used");
        for (stream, segs) in commits {
            assert_eq!(segs, expected[stream.get()], "{stream} commits what it carried");
        }
        for (op, durability, frames) in [
            (Op::Write, Durability::Persistent, 1),
            (Op::Write, Durability::Completed, 4),
            (Op::Read, Durability::Completed, 4),
        ] {
            let rule = DeferredCommits::new(op, durability, frames, 3);
            assert_eq!(rule.frame_durability(durability), durability);
            assert!(rule.commits().is_empty());
        }
    }

    use super::*;

    const K: RegionKey = RegionKey(1);

    fn seg(offset: u64, len: u64) -> Segment {
        Segment { key: K, offset, len }
    }

    #[test]
    fn a_commit_persists_only_what_was_written() {
        let mut w = WrittenRanges::default();
        assert!(w.record(K, 100, 50).is_empty());
        assert!(w.record(K, 150, 50).is_empty()); // touches: one range [100, 200)
        assert!(w.record(K, 1000, 10).is_empty());
        assert_eq!(w.len(), 2);
        // A commit naming the whole file persists what was written, and only that.
        assert_eq!(w.commit(&[seg(0, 1 << 40)]), vec![seg(100, 100), seg(1000, 10)]);
        assert!(w.is_empty());
        assert!(w.commit(&[seg(0, 1 << 40)]).is_empty(), "nothing twice");
    }

    #[test]
    fn interleaved_commits_each_find_their_writes() {
        let mut w = WrittenRanges::default();
        let _ = w.record(K, 0, 10); // transfer A
        let _ = w.record(K, 100, 10); // transfer B
        assert_eq!(w.commit(&[seg(0, 10)]), vec![seg(0, 10)]); // A's commit
        assert_eq!(w.commit(&[seg(100, 10)]), vec![seg(100, 10)]); // B's
        assert!(w.is_empty());
    }

    #[test]
    fn the_ranges_stay_bounded_and_spill_only_what_was_written() {
        let mut w = WrittenRanges::default();
        let mut spilled = Vec::new();
        let writes = MAX_RANGES as u64 * 3;
        for i in 0..writes {
            spilled.extend(w.record(K, i * 10, 1));
            assert!(w.len() <= MAX_RANGES, "{}", w.len());
        }
        // Spilled and committed together: exactly the written bytes, each once, and no gap between.
        spilled.extend(w.commit(&[seg(0, u64::MAX)]));
        spilled.sort_by_key(|s| s.offset);
        assert_eq!(spilled.len() as u64, writes);
        for (i, s) in spilled.iter().enumerate() {
            assert_eq!(*s, seg(i as u64 * 10, 1));
        }
    }

    proptest! {
        /// Against a model: a commit returns exactly the written, uncommitted bytes it names.
        #[test]
        fn commits_match_a_byte_model(ops in proptest::collection::vec((any::<bool>(), 0u64..512, 1u64..64), 1..64)) {
            let mut w = WrittenRanges::default();
            let mut model = vec![false; 600];
            for (is_write, offset, len) in ops {
                if is_write {
                    prop_assert!(w.record(K, offset, len).is_empty(), "a spill under the bound");
                    for b in &mut model[offset as usize..(offset + len) as usize] {
                        *b = true;
                    }
                } else {
                    let mut got = vec![false; 600];
                    for s in w.commit(&[seg(offset, len)]) {
                        prop_assert!(s.offset >= offset && s.offset + s.len <= offset + len);
                        for b in &mut got[s.offset as usize..(s.offset + s.len) as usize] {
                            prop_assert!(!*b, "a byte returned twice");
                            *b = true;
                        }
                    }
                    for i in offset as usize..(offset + len) as usize {
                        prop_assert_eq!(got[i], model[i], "byte {}", i);
                        model[i] = false;
                    }
                }
            }
        }
    }
}
