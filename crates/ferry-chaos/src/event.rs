//! What a fleet member tells the conductor: one JSON object per line on its stdout.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch: every process of the run shares this clock.
pub fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Event {
    /// The engine listens and is published in the directory.
    Ready { name: String, pid: u32 },
    /// One pull through the tower stack, as its caller saw it.
    Transfer {
        /// The prefill engine it read from.
        from: String,
        start_ms: f64,
        end_ms: f64,
        /// The overall deadline the request carried.
        deadline_ms: f64,
        bytes: u64,
        /// `ok`, or the name of the error (`Timeout`, `PeerClosed`, ...).
        outcome: String,
        error: Option<String>,
        /// Whether the notification after it was delivered.
        notified: bool,
    },
    /// A pull that completed `Ok` with bytes that are not the source's: the one thing that must never
    /// happen.
    Corrupt {
        from: String,
        block: u64,
        offset: usize,
        end_ms: f64,
    },
    /// A prefill engine's count of notifications received so far.
    Notifications { count: u64 },
}

impl Event {
    /// The event as one line of JSON.
    pub fn emit(&self) {
        if let Ok(line) = serde_json::to_string(self) {
            println!("{line}");
        }
    }
}
