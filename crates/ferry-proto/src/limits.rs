//! The bounds a link keeps, whatever its peer sends.

/// Limits of one link, enforced by the state machines of this crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkLimits {
    /// Most streams one link may have, the control stream included.
    pub max_streams: u16,
    /// Most operations awaiting an answer on one stream (transfers' frames, commits, notifications,
    /// data-path setups).
    pub max_outstanding_per_stream: usize,
    /// Region updates queued for one link before they are replaced by one resend of the whole table.
    pub advert_queue: usize,
    /// Most bytes of answers a target's stream holds for its peer before it sends them; past it the
    /// stream waits until the peer takes them (a peer that sends requests and reads no answers stops
    /// being served, and holds no more of the target's memory than this).
    pub max_unsent_answers: usize,
    /// On an authenticating target, most links one peer identity may hold at once: one identity
    /// cannot take every link slot.
    pub max_links_per_identity: usize,
    /// On an authenticating target, most streams (as links declare them) one peer identity may hold
    /// at once, over all its links.
    pub max_streams_per_identity: usize,
}

impl Default for LinkLimits {
    fn default() -> Self {
        LinkLimits {
            max_streams: 64,
            max_outstanding_per_stream: 1 << 16,
            advert_queue: 1024,
            max_unsent_answers: 256 << 10,
            max_links_per_identity: 64,
            max_streams_per_identity: 1024,
        }
    }
}
