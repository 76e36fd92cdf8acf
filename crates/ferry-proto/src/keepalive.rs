//! Finding out that a peer went silent.
//!
//! A peer that vanished without closing its connections (a host that lost power, a cable pulled)
//! leaves TCP streams that neither deliver nor fail for many minutes. The initiator probes a link it
//! has heard nothing from for [`Keepalive::idle`] with a ping on the control stream, and gives the
//! link up when it has still heard nothing [`Keepalive::dead`] after the last frame: every operation
//! then fails at once instead of waiting for its own timeout. Any frame heard counts, since a target
//! answers the streams in order and a busy one is heard through its answers.

use std::time::{Duration, Instant};

use ferry_core::codec::Frame;
use ferry_core::{Error, Result};

/// Probe a link silent for this long.
pub const DEFAULT_IDLE: Duration = Duration::from_secs(5);
/// Give a link up after this long without a frame. A target answers each stream in order, and one
/// answer may wait on a flush of persistent memory or a GPU copy (bounded at 20 s), so this is longer.
pub const DEFAULT_DEAD: Duration = Duration::from_secs(60);

/// The keepalive state of one link.
#[derive(Debug)]
pub struct Keepalive {
    idle: Duration,
    dead: Duration,
    last_heard: Instant,
    probe_due: bool,
    probed: bool,
    nonce: u64,
}

impl Keepalive {
    /// A link last heard from at `now`.
    pub fn new(now: Instant, idle: Duration, dead: Duration) -> Self {
        Keepalive {
            idle,
            dead: dead.max(idle),
            last_heard: now,
            probe_due: false,
            probed: false,
            nonce: 0,
        }
    }

    /// How long silence lasts before a probe.
    pub fn idle(&self) -> Duration {
        self.idle
    }

    /// How long silence lasts before the link is given up.
    pub fn dead(&self) -> Duration {
        self.dead
    }

    /// A frame arrived at `now`.
    pub fn heard(&mut self, now: Instant) {
        self.last_heard = now;
        self.probed = false;
    }

    /// When [`Keepalive::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Instant {
        match self.probed {
            false => self.last_heard + self.idle,
            true => self.last_heard + self.dead,
        }
    }

    /// Time has come to `now`: a probe falls due, or the link is dead (the error to fail it with).
    pub fn handle_timeout(&mut self, now: Instant, peer: &str) -> Result<()> {
        let silent = now.saturating_duration_since(self.last_heard);
        if silent >= self.dead {
            return Err(Error::PeerClosed(format!(
                "{peer} sent nothing for {silent:?}, not even an answer to a ping: the link is given up"
            )));
        }
        if silent >= self.idle && !self.probed {
            self.probed = true;
            self.probe_due = true;
        }
        Ok(())
    }

    /// The probe to send on the control stream, once per silence.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        if !std::mem::take(&mut self.probe_due) {
            return None;
        }
        self.nonce += 1;
        Some(Frame::Ping { nonce: self.nonce })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_once_per_silence_then_gives_up() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut k = Keepalive::new(t0, 5 * s, 60 * s);
        assert_eq!(k.poll_timeout(), t0 + 5 * s);
        k.handle_timeout(t0 + 4 * s, "p").unwrap();
        assert_eq!(k.poll_transmit(), None);
        k.handle_timeout(t0 + 5 * s, "p").unwrap();
        assert_eq!(k.poll_transmit(), Some(Frame::Ping { nonce: 1 }));
        assert_eq!(k.poll_transmit(), None);
        assert_eq!(k.poll_timeout(), t0 + 60 * s);
        k.handle_timeout(t0 + 30 * s, "p").unwrap();
        assert_eq!(k.poll_transmit(), None, "one probe per silence");
        // An answer resets the clock.
        k.heard(t0 + 31 * s);
        assert_eq!(k.poll_timeout(), t0 + 36 * s);
        k.handle_timeout(t0 + 36 * s, "p").unwrap();
        assert_eq!(k.poll_transmit(), Some(Frame::Ping { nonce: 2 }));
        assert!(matches!(k.handle_timeout(t0 + 91 * s, "p"), Err(Error::PeerClosed(_))));
    }
}
