//! Who may reach a region, and how a revoke knows that no access it forbids is still under way.
//!
//! An engine open to anyone (no authentication) has nobody to grant to: every peer reaches every
//! region with the region's own access. Once links are authenticated, regions are private: a peer
//! reaches a region only with what was granted to its identity (the name in its certificate) or to
//! every authenticated peer, never more than the region's access. The target checks this on every
//! operation, and tells each peer only of the regions it may reach.
//!
//! A revoke must also wait out the operations that passed the check before it and are still moving
//! bytes. [`AccessEpochs`] counts operations in progress by the epoch they started in, two epochs at
//! a time (the current one and the one before), so that a revoke advances the epoch and waits for
//! the old one to empty: one atomic add when an operation starts and one when it ends.

use crate::sync::shim::{AtomicBool, AtomicU64, AtomicUsize, Ordering, seq_cst_order};
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::types::{Access, PeerIdentity};

/// What a region grants, by peer identity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    /// Granted to every authenticated peer.
    pub everyone: Access,
    /// Granted to peers by name (a certificate's name or any of its alternative names that is not
    /// an IP address).
    pub named: BTreeMap<String, Access>,
}

impl Grants {
    /// What `who` is granted (before the region's own access limits it). An IP address in a
    /// certificate says where an engine may be dialled, and many engines' certificates carry the
    /// same one (127.0.0.1 in every certificate `ferry certs` makes), so it names nobody: grants never
    /// match it (and [`Grants::check_name`] refuses to make such a grant).
    pub fn for_identity(&self, who: &PeerIdentity) -> Access {
        let mut access = self.everyone;
        for name in who.names() {
            if let Some(a) = self.named.get(name) {
                access = access.union(*a);
            }
        }
        access
    }

    /// Whether going from these grants to `after` takes something away from someone (a peer named
    /// here, or every peer): such a change must wait out what runs under the old grants, as a revoke
    /// does.
    pub fn narrowed_by(&self, after: &Grants) -> bool {
        if !after.everyone.contains(self.everyone) {
            return true;
        }
        self.named.iter().any(|(name, granted)| {
            let before = granted.union(self.everyone);
            let now = after
                .named
                .get(name)
                .copied()
                .unwrap_or(Access::NONE)
                .union(after.everyone);
            !now.contains(before)
        })
    }

    /// Whether `name` may be granted to: an engine's name, not an empty string or an IP address.
    pub fn check_name(name: &str) -> crate::Result<()> {
        if name.is_empty() {
            return Err(crate::Error::InvalidArgument(
                "a grant names a peer: its certificate's name or one of its DNS names".into(),
            ));
        }
        if crate::types::is_address(name) {
            return Err(crate::Error::InvalidArgument(format!(
                "{name} is an IP address, which certificates share (every one `ferry certs` makes carries \
                 127.0.0.1): grant to the peer's name (its certificate's common name or a DNS name) instead"
            )));
        }
        Ok(())
    }
}

/// Operations in progress, by the epoch they started in (see the module documentation).
#[derive(Debug, Default)]
pub struct AccessEpochs {
    epoch: AtomicU64,
    /// Operations in progress that started in an even and an odd epoch.
    active: [AtomicUsize; 2],
    /// Set by whoever advances the epoch, until its wait is dropped: one advance at a time.
    advancing: AtomicBool,
    /// An advance gave up before its old epoch emptied: that epoch's operations now share a counter
    /// with newer ones, so the next advance waits for both counters to empty.
    stale: AtomicBool,
}

/// An operation in progress; ends when dropped.
#[derive(Debug)]
pub struct EpochTicket {
    epochs: Arc<AccessEpochs>,
    parity: usize,
}

impl Drop for EpochTicket {
    fn drop(&mut self) {
        self.epochs.active[self.parity].fetch_sub(1, Ordering::SeqCst);
    }
}

impl AccessEpochs {
    /// Counts an operation as started now. Take it before checking the grant the operation relies on.
    pub fn begin(self: &Arc<Self>) -> EpochTicket {
        loop {
            let epoch = self.epoch.load(Ordering::SeqCst);
            let parity = (epoch & 1) as usize;
            self.active[parity].fetch_add(1, Ordering::SeqCst);
            // Counted under the epoch it read: if the epoch moved meanwhile, the advancer may already
            // be waiting on the other counter; count again under the new one. The count and this
            // check, and the advancer's step and its look at the counter, are `SeqCst`: one of the
            // two sees the other.
            seq_cst_order();
            if self.epoch.load(Ordering::SeqCst) == epoch {
                return EpochTicket {
                    epochs: self.clone(),
                    parity,
                };
            }
            self.active[parity].fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Starts a new epoch and returns a check that is true once every operation started before it
    /// has ended. One advance at a time (callers serialize them): `None` while another one's wait
    /// lives.
    pub fn advance(&self) -> Option<EpochWait<'_>> {
        if self.advancing.swap(true, Ordering::SeqCst) {
            return None;
        }
        let old = self.epoch.fetch_add(1, Ordering::SeqCst);
        seq_cst_order();
        Some(EpochWait {
            epochs: self,
            parity: (old & 1) as usize,
            both: self.stale.load(Ordering::SeqCst),
        })
    }
}

/// The old epoch's operations, until they end (from [`AccessEpochs::advance`]).
#[derive(Debug)]
pub struct EpochWait<'a> {
    epochs: &'a AccessEpochs,
    parity: usize,
    /// Wait for both counters (see [`AccessEpochs::stale`]).
    both: bool,
}

impl EpochWait<'_> {
    /// Whether every operation started before the advance has ended.
    pub fn settled(&self) -> bool {
        let empty = |parity: usize| self.epochs.active[parity].load(Ordering::SeqCst) == 0;
        let settled = empty(self.parity) && (!self.both || empty(1 - self.parity));
        if settled && self.both {
            self.epochs.stale.store(false, Ordering::SeqCst);
        }
        settled
    }
}

impl Drop for EpochWait<'_> {
    fn drop(&mut self) {
        if !self.settled() {
            self.epochs.stale.store(true, Ordering::SeqCst);
        }
        self.epochs.advancing.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(name: &str, alt: &[&str]) -> PeerIdentity {
        PeerIdentity {
            name: name.into(),
            subject: format!("CN={name}"),
            alt_names: alt.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn grants_add_up_by_name_and_for_everyone() {
        let mut g = Grants::default();
        assert_eq!(g.for_identity(&who("a", &[])), Access::NONE);
        g.named.insert("a".into(), Access::READ);
        g.named.insert("b.example".into(), Access::WRITE);
        assert_eq!(g.for_identity(&who("a", &[])), Access::READ);
        assert_eq!(g.for_identity(&who("a", &["b.example"])), Access::READ_WRITE);
        g.everyone = Access::WRITE;
        assert_eq!(g.for_identity(&who("c", &[])), Access::WRITE);
    }

    #[test]
    fn narrowing_is_told_from_widening() {
        let mut before = Grants::default();
        before.named.insert("a".into(), Access::READ_WRITE);
        let mut after = before.clone();
        assert!(!before.narrowed_by(&after), "no change");
        after.named.insert("b".into(), Access::READ);
        assert!(!before.narrowed_by(&after), "a grant to someone else");
        after.named.insert("a".into(), Access::READ);
        assert!(before.narrowed_by(&after), "read-write to read");
        after.everyone = Access::READ_WRITE;
        assert!(!before.narrowed_by(&after), "what everyone has covers it");
        let wide = Grants {
            everyone: Access::READ,
            ..Grants::default()
        };
        assert!(wide.narrowed_by(&Grants::default()), "taken from everyone");
        let mut removed = before.clone();
        removed.named.remove("a");
        assert!(before.narrowed_by(&removed), "a revoke");
    }

    #[test]
    fn an_address_in_a_certificate_names_nobody() {
        let mut g = Grants::default();
        // Made directly (a grant through the engine is refused before this): it still matches nobody.
        g.named.insert("127.0.0.1".into(), Access::READ_WRITE);
        g.named.insert("::1".into(), Access::READ_WRITE);
        assert_eq!(g.for_identity(&who("a", &["127.0.0.1", "::1"])), Access::NONE);
        assert_eq!(g.for_identity(&who("127.0.0.1", &[])), Access::NONE);
        assert!(matches!(
            Grants::check_name("127.0.0.1"),
            Err(crate::Error::InvalidArgument(_))
        ));
        assert!(matches!(
            Grants::check_name("::1"),
            Err(crate::Error::InvalidArgument(_))
        ));
        assert!(matches!(Grants::check_name(""), Err(crate::Error::InvalidArgument(_))));
        Grants::check_name("decode-1").unwrap();
        Grants::check_name("decode-1.cluster.example").unwrap();
    }

    #[test]
    fn an_advance_waits_for_what_started_before_it_only() {
        let epochs = Arc::new(AccessEpochs::default());
        let before = epochs.begin();
        let wait = epochs.advance().unwrap();
        assert!(epochs.advance().is_none(), "one advance at a time");
        assert!(!wait.settled());
        let after = epochs.begin();
        drop(before);
        assert!(
            wait.settled(),
            "an operation started after the advance does not hold it"
        );
        drop(wait);
        let wait = epochs.advance().unwrap();
        assert!(!wait.settled(), "it does hold the next one");
        drop(after);
        assert!(wait.settled());
    }

    #[test]
    fn an_advance_that_gave_up_makes_the_next_wait_for_everything() {
        let epochs = Arc::new(AccessEpochs::default());
        let old = epochs.begin();
        drop(epochs.advance().unwrap()); // gave up with `old` still running
        let newer = epochs.begin(); // shares `old`'s counter
        let wait = epochs.advance().unwrap();
        drop(newer);
        assert!(!wait.settled(), "`old` started before both advances and still runs");
        drop(old);
        assert!(wait.settled());
    }
}
