//! The TCP transport on its own, without the engine: a `TcpServer` over a region table and a
//! `TcpLink` dialed to it, as two engines' halves in one process. WRITEs and READs land byte for
//! byte over one stream and several, a refused operation fails by name and changes nothing at the
//! target, notifications reach the target's notifier intact and in order, and a batch its caller
//! drops leaves nothing on the link.

mod common;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::{LEN, T, bytes, pair, pair_with, pattern};
use ferry_core::{
    Access, DataLink, DmaView, Error, MemoryBlock, Notification, Op, OwnedBuffer, RegionEntry, RegionKey, Result,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_land_byte_for_byte_over_every_stream_count() {
    for streams in [1, 4] {
        let p = pair(streams).await;
        let src = pattern(streams as u8);
        p.local.copy_in(0, &src).unwrap();
        // Scattered ranges of every size class: tiny, mid, and one over a frame's usual payload.
        let ranges: Vec<(u64, u64)> = vec![
            (0, 1),
            (7, 4096),
            (8192, 64 << 10),
            (200 << 10, 600 << 10),
            (LEN as u64 - 3, 3),
        ];
        p.run(p.request(Op::Write, &ranges)).await.unwrap();
        let at_target = bytes(&p.remote);
        for &(o, n) in &ranges {
            let (o, n) = (o as usize, n as usize);
            assert_eq!(
                at_target[o..o + n],
                src[o..o + n],
                "{streams} streams: write at {o}+{n}"
            );
        }
        assert!(
            at_target[1..7].iter().all(|&b| b == 0),
            "nothing outside the ranges is written"
        );

        // Read it all back into a cleared local region.
        p.local.copy_in(0, &vec![0u8; LEN]).unwrap();
        p.run(p.request(Op::Read, &[(0, LEN as u64)])).await.unwrap();
        assert_eq!(bytes(&p.local), at_target, "{streams} streams: read back");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_the_target_refuses_fails_by_name_and_writes_nothing() {
    let p = pair(2).await;
    p.local.copy_in(0, &pattern(9)).unwrap();
    let mut request = p.request(Op::Write, &[(0, 4096)]);
    // Past the end of the target's region: the target checks every range itself.
    request.items[0].remote_offset = LEN as u64 - 100;
    request.items[0].remote_addr = p.remote.addr() + LEN as u64 - 100;
    let err = p.run(request).await.unwrap_err();
    assert!(matches!(err, Error::OutOfBounds(_)), "{err:?}");
    // A region the target does not have.
    let mut request = p.request(Op::Write, &[(0, 4096)]);
    request.items[0].remote_key = RegionKey(0xdead);
    let err = p.run(request).await.unwrap_err();
    assert!(
        matches!(&err, Error::PermissionDenied(m) if m.contains("no region")),
        "{err:?}"
    );
    assert!(
        bytes(&p.remote).iter().all(|&b| b == 0),
        "a refused operation wrote nothing"
    );
    // The link goes on.
    p.run(p.request(Op::Write, &[(0, 4096)])).await.unwrap();
    assert_eq!(bytes(&p.remote)[..4096], pattern(9)[..4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_reach_the_targets_notifier_intact_and_in_order() {
    let p = pair(4).await;
    let long = "x".repeat(1024);
    for round in 0..8u64 {
        let msg = if round == 7 { long.clone() } else { round.to_string() };
        tokio::time::timeout(T, p.link.notify(Notification::new(format!("n{round}"), msg)))
            .await
            .unwrap()
            .unwrap();
    }
    let seen = p.inbox.seen.lock().unwrap();
    assert_eq!(seen.len(), 8, "each notification is queued once it is acknowledged");
    for (round, (n, _)) in seen.iter().enumerate() {
        assert_eq!(n.name, format!("n{round}"), "in the order sent");
        assert_eq!(n.msg, if round == 7 { long.clone() } else { round.to_string() });
    }
}

/// A block whose peer reads wait at a gate first (its `prepare_read` hook, which the target runs
/// before it sends a read's data): a target that stops answering until the test opens it.
struct Gated {
    bytes: OwnedBuffer,
    open: Arc<(Mutex<bool>, Condvar)>,
}

// SAFETY: every promise is `OwnedBuffer`'s, whose pointer and length this block hands on unchanged;
// the gate only delays the hook.
unsafe impl MemoryBlock for Gated {
    fn as_ptr(&self) -> *mut u8 {
        self.bytes.as_ptr()
    }
    fn len(&self) -> usize {
        self.bytes.len()
    }
    fn kind(&self) -> &str {
        "gated host"
    }
    /// Staged, as device memory behind a host copy is: its hooks may block, so the target runs them
    /// off its runtime's threads.
    fn dma_view(&self) -> DmaView {
        DmaView::Staged
    }
    fn prepare_read(&self, _: usize, _: usize) -> Result<()> {
        let (open, opened) = &*self.open;
        let guard = open.lock().unwrap();
        let (_guard, waited) = opened.wait_timeout_while(guard, T, |open| !*open).unwrap();
        assert!(!waited.timed_out(), "the test never opened the gate");
        Ok(())
    }
}

/// The caller bounds a batch by dropping it, and the link keeps nothing of it: its operation is
/// taken back at the drop (not when an answer comes, which may be never), the answer that comes
/// late is discarded (the dropped read's buffer is never written) and the link serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_leaves_nothing_waiting_and_its_late_answer_lands_nowhere() {
    let open = Arc::new((Mutex::new(false), Condvar::new()));
    let block = Gated {
        bytes: OwnedBuffer::new(pattern(3)),
        open: open.clone(),
    };
    let remote = Arc::new(RegionEntry::new(RegionKey(0x51), Access::READ_WRITE, Arc::new(block)).unwrap());
    let p = pair_with(remote, 1).await;
    assert_eq!(p.link.waiting_operations(), 0);

    let mut stalled = p.link.transfer(p.request(Op::Read, &[(0, 4096)]));
    let gave_up = tokio::time::timeout(Duration::from_millis(300), &mut stalled).await;
    assert!(
        gave_up.is_err(),
        "the target answered a read it was holding: {gave_up:?}"
    );
    assert_eq!(
        p.link.waiting_operations(),
        1,
        "the read waits while its batch is alive"
    );
    drop(stalled);
    assert_eq!(p.link.waiting_operations(), 0, "the dropped batch took its read back");

    *open.0.lock().unwrap() = true;
    open.1.notify_all();
    // Behind the stalled read on the link's one stream: once this one is answered, the late data
    // came and went.
    p.run(p.request(Op::Read, &[(8192, 4096)])).await.unwrap();
    let local = bytes(&p.local);
    assert_eq!(local[8192..12288], pattern(3)[8192..12288]);
    assert!(local[..4096].iter().all(|&b| b == 0), "the dropped read's data landed");
    assert_eq!(p.link.waiting_operations(), 0);
}
