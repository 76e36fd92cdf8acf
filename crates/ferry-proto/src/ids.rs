//! Typed ids, so that an operation id is never taken for a nonce or a stream index.

use std::fmt;

/// An operation's id on its link: chosen by the initiator, echoed by the target's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

/// A stream's place in its link; stream 0 is the control stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamIndex(pub u16);

/// The random token that names a link; further streams present it to join.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LinkToken(pub u64);

impl StreamIndex {
    /// The control stream: the handshake's region table, region updates, notifications and data-path
    /// setup travel on it.
    pub const CONTROL: StreamIndex = StreamIndex(0);

    /// As an index into a list of streams.
    pub fn get(self) -> usize {
        self.0 as usize
    }

    /// Whether this is the control stream.
    pub fn is_control(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op {}", self.0)
    }
}

impl fmt::Display for StreamIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream {}", self.0)
    }
}
