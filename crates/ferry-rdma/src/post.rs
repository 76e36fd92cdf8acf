//! Posting READ and WRITE work requests with `ibv_post_send`, on the extended queue pair.
//!
//! Why not sideway's `ibv_wr_*` guard for these: the rxe provider's `ibv_wr_set_sge_list` (rdma-core
//! 44 and 55 alike) sums the first entry's length `num_sge` times, so a work request whose
//! scatter-gather entries differ in length moves the wrong number of bytes (found by the rig's
//! persistence tests: the last byte of an odd-sized two-part write was missing). `ibv_post_send`
//! computes the length right on every provider. Batches of the two interfaces may alternate on one
//! queue pair as long as neither is posted inside the other's `ibv_wr_start`/`ibv_wr_complete`
//! (ibv_wr_post(3)); the queue pair's mutex makes sure of that.

use std::ptr::NonNull;

use rdma_mummy_sys::{ibv_post_send, ibv_qp, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode, rdma_t, wr_t};

/// One READ or WRITE.
pub(crate) struct DataWr<'a> {
    pub id: u64,
    pub read: bool,
    pub signalled: bool,
    pub rkey: u32,
    pub remote_addr: u64,
    pub sges: &'a [ibv_sge],
}

/// Posts `wrs` as one chain.
///
/// # Safety
///
/// `qp` is a live queue pair whose lock the caller holds (no `ibv_wr_*` batch open on it), and every
/// SGE names memory registered with its protection domain that stays registered until the work
/// request completes.
pub(crate) unsafe fn post_data(qp: NonNull<ibv_qp>, wrs: &[DataWr<'_>]) -> std::io::Result<()> {
    if wrs.is_empty() {
        return Ok(());
    }
    let mut chain: Vec<ibv_send_wr> = wrs
        .iter()
        .map(|w| {
            // SAFETY: ibv_send_wr is plain data (integers, pointers, unions of them); all-zero is a
            // valid value: no next, no SGEs, no flags.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = w.id;
            wr.sg_list = w.sges.as_ptr().cast_mut();
            wr.num_sge = w.sges.len() as i32;
            wr.opcode = if w.read {
                ibv_wr_opcode::IBV_WR_RDMA_READ
            } else {
                ibv_wr_opcode::IBV_WR_RDMA_WRITE
            };
            wr.send_flags = if w.signalled {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            // The `rdma` member of the union is the one READ and WRITE use.
            wr.wr = wr_t {
                rdma: rdma_t {
                    remote_addr: w.remote_addr,
                    rkey: w.rkey,
                },
            };
            wr
        })
        .collect();
    // Link the chain only now: the vector no longer moves.
    let base = chain.as_mut_ptr();
    for i in 1..chain.len() {
        // SAFETY: `i` and `i - 1` are in bounds of `chain`.
        unsafe { (*base.add(i - 1)).next = base.add(i) };
    }
    let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
    // SAFETY: the caller's promises about `qp` and the SGEs; the chain and the SGE arrays live until
    // the call returns, and the provider copies what it needs before it does.
    let rc = unsafe { ibv_post_send(qp.as_ptr(), base, &mut bad) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(rc))
    }
}
