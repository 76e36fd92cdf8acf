//! Making RDMA writes persistent, and choosing how, per link.
//!
//! An RDMA WRITE completes once the target's NIC has the data; the target's CPU never sees it. To
//! make it persistent the initiator follows the writes with one of, best first:
//!
//! 1. the IBTA FLUSH verb (persistent type, range): the target's NIC writes the range back into its
//!    persistence domain and answers. Needs this side's library and device to post FLUSH, the
//!    target's device to execute it, and the region registered for it (persistent memory only);
//! 2. a READ of the written region, where the target declared ADR with DDIO off (the READ drains
//!    the I/O buffers, and ADR makes what reached the memory controller persistent);
//! 3. a flush request naming the written ranges, a SEND on the same queue pair after the writes (so the
//!    target's CPU sees it only once they are placed; see `crate::link`): the target's CPU persists
//!    them (cache-line write-back, or `msync`) and answers. Works everywhere.
//!
//! A link settles on the best method both ends offer; a transfer whose regions do not qualify for it
//! (not registered for FLUSH, not readable) uses the flush request.

use ferry_core::{Error, PersistMethod, Result};

use ferry_proto::rdma::{ADR_WITHOUT_DDIO, CAN_POST_FLUSH, FLUSH_TARGET};

/// The method for a link between an initiator with `local` flags and a target with `remote` flags,
/// or the one `forced`, if the two ends can use it.
pub fn choose(local: u8, remote: u8, forced: Option<PersistMethod>) -> Result<PersistMethod> {
    let flush_verb = local & CAN_POST_FLUSH != 0 && remote & FLUSH_TARGET != 0;
    let read_after_write = remote & ADR_WITHOUT_DDIO != 0;
    let available = |m: PersistMethod| match m {
        PersistMethod::FlushVerb => flush_verb,
        PersistMethod::ReadAfterWrite => read_after_write,
        PersistMethod::FlushRequest => true,
        PersistMethod::FlushBeforeAck => false,
    };
    match forced {
        Some(m) if available(m) => Ok(m),
        Some(m) => Err(Error::Unsupported(format!(
            "persistent writes by {m} were asked for, but {}",
            match m {
                PersistMethod::FlushVerb if local & CAN_POST_FLUSH == 0 =>
                    "this side cannot post FLUSH (it needs rdma-core 45 or later and a device that reports FLUSH)",
                PersistMethod::FlushVerb => "the target's device does not execute persistent FLUSH",
                PersistMethod::ReadAfterWrite => "the target did not declare ADR with DDIO off",
                _ => "RDMA writes bypass the target's CPU",
            }
        ))),
        None => Ok([PersistMethod::FlushVerb, PersistMethod::ReadAfterWrite]
            .into_iter()
            .find(|&m| available(m))
            .unwrap_or(PersistMethod::FlushRequest)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_common_method_first() {
        let all = CAN_POST_FLUSH;
        assert_eq!(
            choose(all, FLUSH_TARGET | ADR_WITHOUT_DDIO, None).unwrap(),
            PersistMethod::FlushVerb
        );
        assert_eq!(
            choose(0, FLUSH_TARGET | ADR_WITHOUT_DDIO, None).unwrap(),
            PersistMethod::ReadAfterWrite
        );
        assert_eq!(choose(all, 0, None).unwrap(), PersistMethod::FlushRequest);
        assert_eq!(choose(0, FLUSH_TARGET, None).unwrap(), PersistMethod::FlushRequest);
    }

    #[test]
    fn forced_methods_need_both_ends() {
        assert_eq!(
            choose(CAN_POST_FLUSH, FLUSH_TARGET, Some(PersistMethod::FlushRequest)).unwrap(),
            PersistMethod::FlushRequest
        );
        assert!(matches!(
            choose(0, FLUSH_TARGET, Some(PersistMethod::FlushVerb)),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            choose(CAN_POST_FLUSH, FLUSH_TARGET, Some(PersistMethod::ReadAfterWrite)),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            choose(CAN_POST_FLUSH, FLUSH_TARGET, Some(PersistMethod::FlushBeforeAck)),
            Err(Error::Unsupported(_))
        ));
    }
}
