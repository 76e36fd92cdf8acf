//! Operations awaiting answers, and the one rule every transport applies to an answer.
//!
//! An initiator gives each operation the target answers an id of its own, from 1 up, never reused on
//! the link. An answer then falls in one of three cases, the same on TCP, shared memory and RDMA:
//! - its operation is waiting: the answer is taken, and the operation with it;
//! - the id was issued but nothing waits for it (the operation was taken back locally, after a
//!   deadline or a failed send, or a duplicate answer came): the answer is **stale** and ignored;
//! - the id was never issued on this link (0, or past the last one): the peer broke the protocol,
//!   and the link ends with `Error::Protocol`.
//!
//! [`OpTable`] keeps the waiting operations of one link (or one stream) with that rule;
//! [`check_issued`] is the rule alone, for a table whose ids are issued elsewhere (the TCP
//! initiator's streams share one id sequence).

use std::collections::HashMap;
use std::fmt::Display;

use ferry_core::{Error, Result};

use crate::ids::OpId;

/// The rule for an answer's id on a link whose next id to issue is `next`: `Ok` when it was issued,
/// `Error::Protocol` naming `peer` when it never was.
pub fn check_issued(id: OpId, next: u64, peer: &dyn Display) -> Result<()> {
    if id.0 == 0 || id.0 >= next {
        return Err(Error::Protocol(format!(
            "{peer} answered {id}, which this link never sent"
        )));
    }
    Ok(())
}

/// The operations of one link waiting for their answers, each under the id it was sent with. `P` is
/// the transport's per-operation state (where the answer goes).
#[derive(Debug)]
pub struct OpTable<P> {
    next: u64,
    waiting: HashMap<u64, P>,
}

impl<P> Default for OpTable<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P> OpTable<P> {
    /// An empty table; the first id it issues is 1.
    pub fn new() -> Self {
        OpTable {
            next: 1,
            waiting: HashMap::new(),
        }
    }

    /// Issues a new id for `op`, which waits under it until answered or taken back.
    pub fn insert(&mut self, op: P) -> OpId {
        let id = OpId(self.next);
        self.next += 1;
        self.waiting.insert(id.0, op);
        id
    }

    /// Takes operation `id` back before its answer (it failed locally); its answer will be stale.
    pub fn take_back(&mut self, id: OpId) -> Option<P> {
        self.waiting.remove(&id.0)
    }

    /// The operation an answer for `id` from `peer` ends: `Some` when it waits, `None` when the
    /// answer is stale, `Error::Protocol` when this table never issued `id` (see the module).
    pub fn answer(&mut self, id: OpId, peer: &dyn Display) -> Result<Option<P>> {
        check_issued(id, self.next, peer)?;
        Ok(self.waiting.remove(&id.0))
    }

    /// Every waiting operation, taken out (the link ended); ids are not issued again.
    pub fn drain(&mut self) -> impl Iterator<Item = P> + '_ {
        self.waiting.drain().map(|(_, op)| op)
    }

    /// How many operations wait.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_three_cases() {
        let mut t = OpTable::new();
        let a = t.insert("a");
        let b = t.insert("b");
        assert_eq!(t.answer(a, &"peer").unwrap(), Some("a"));
        // Answered once: a second answer is stale.
        assert_eq!(t.answer(a, &"peer").unwrap(), None);
        // Taken back: its answer is stale.
        assert_eq!(t.take_back(b), Some("b"));
        assert_eq!(t.answer(b, &"peer").unwrap(), None);
        // Never issued: the peer broke the protocol.
        for never in [OpId(0), OpId(3), OpId(u64::MAX)] {
            let e = t.answer(never, &"peer").unwrap_err();
            assert!(
                matches!(&e, Error::Protocol(m) if m.contains("peer") && m.contains("never sent")),
                "{e}"
            );
        }
        assert!(t.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Step {
        Insert,
        TakeBack(u64),
        Answer(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            Just(Step::Insert),
            (0u64..40).prop_map(Step::TakeBack),
            (0u64..40).prop_map(Step::Answer),
        ]
    }

    proptest! {
        /// Against a model: an answer ends its operation exactly once, and only while it waits; an
        /// id never issued is always a protocol error and changes nothing.
        #[test]
        fn answers_follow_the_model(steps in proptest::collection::vec(step(), 0..200)) {
            let mut table = OpTable::new();
            let mut issued = 0u64;
            let mut waiting = std::collections::BTreeSet::new();
            for s in steps {
                match s {
                    Step::Insert => {
                        let id = table.insert(issued + 1);
                        issued += 1;
                        prop_assert_eq!(id, OpId(issued));
                        waiting.insert(issued);
                    }
                    Step::TakeBack(id) => {
                        let got = table.take_back(OpId(id));
                        prop_assert_eq!(got, waiting.remove(&id).then_some(id));
                    }
                    Step::Answer(id) => {
                        let got = table.answer(OpId(id), &"peer");
                        if id == 0 || id > issued {
                            prop_assert!(matches!(got, Err(Error::Protocol(_))));
                        } else {
                            prop_assert_eq!(got.unwrap(), waiting.remove(&id).then_some(id));
                        }
                    }
                }
                prop_assert_eq!(table.len(), waiting.len());
            }
        }
    }
}
