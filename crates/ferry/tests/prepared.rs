//! Prepared batches: resolved once, posted many times, with the bytes checked after every post, and
//! refused with the transfer's own errors once what they name is gone.

mod common;

use common::{T, pair, pattern, rw, wait_for_region};
use ferry::{Error, Op, TransferDesc};

/// 4 KiB blocks of a paged cache, in a shuffled order on each side.
fn scattered(blocks: u64, local: u64, remote: u64) -> Vec<TransferDesc> {
    (0..blocks)
        .map(|i| {
            let there = (i * 7919) % blocks;
            TransferDesc::new(local + (i << 12), remote + (there << 12), 4096)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_batch_moves_the_current_bytes_on_every_post() {
    const BLOCKS: u64 = 3000;
    let len = (BLOCKS << 12) as usize;
    let (target, initiator, peer) = pair().await;
    let dst = target.alloc_host(len, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.alloc_host(len, rw()).unwrap();
    let descs = scattered(BLOCKS, src.addr(), dst.addr());
    let write = initiator.prepare(&peer, Op::Write, &descs).unwrap();
    assert_eq!((write.len(), write.op()), (BLOCKS as usize, Op::Write));
    for round in 0..5u8 {
        let data = pattern(len, round);
        src.write_at(0, &data).unwrap();
        initiator.transfer_prepared(&write, T).await.unwrap();
        let got = dst.to_vec().unwrap();
        for i in 0..BLOCKS as usize {
            let there = (i * 7919) % BLOCKS as usize;
            assert!(
                got[there << 12..(there + 1) << 12] == data[i << 12..(i + 1) << 12],
                "round {round}: block {i} did not land at {there}"
            );
        }
    }
    // And back: a prepared READ into a second buffer brings the last round's bytes.
    let back = initiator.alloc_host(len, rw()).unwrap();
    let read = initiator
        .prepare(&peer, Op::Read, &scattered(BLOCKS, back.addr(), dst.addr()))
        .unwrap();
    initiator.transfer_prepared(&read, T).await.unwrap();
    assert!(back.to_vec().unwrap() == src.to_vec().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_batch_fails_like_a_transfer_once_its_regions_are_gone() {
    let (target, initiator, peer) = pair().await;
    let dst = target.alloc_host(1 << 20, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.register(pattern(1 << 20, 3), rw()).unwrap();
    let prepared = initiator
        .prepare(&peer, Op::Write, &[TransferDesc::new(src.addr(), dst.addr(), 1 << 20)])
        .unwrap();
    initiator.transfer_prepared(&prepared, T).await.unwrap();

    // The target's region goes: the post is refused and writes nothing anywhere.
    dst.deregister().await.unwrap();
    let err = initiator.transfer_prepared(&prepared, T).await.unwrap_err();
    assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");

    // A prepared batch of a disconnected peer is refused before anything is posted.
    let fresh = target.alloc_host(1 << 20, rw()).unwrap();
    wait_for_region(&peer, &fresh).await;
    let prepared = initiator
        .prepare(&peer, Op::Write, &[TransferDesc::new(src.addr(), fresh.addr(), 4096)])
        .unwrap();
    initiator.disconnect(&peer, T).await.unwrap();
    let err = initiator.transfer_prepared(&prepared, T).await.unwrap_err();
    assert!(matches!(err, Error::NotConnected(_)), "{err:?}");
    assert!(fresh.to_vec().unwrap().iter().all(|&b| b == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_descriptors_are_refused_when_prepared() {
    let (target, initiator, peer) = pair().await;
    let dst = target.alloc_host(1 << 20, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.register(pattern(1 << 20, 4), rw()).unwrap();
    let past_the_end = [TransferDesc::new(src.addr(), dst.addr_at((1 << 20) - 100), 4096)];
    let err = initiator.prepare(&peer, Op::Write, &past_the_end).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds(_)), "{err:?}");
    let err = initiator.prepare(&peer, Op::Write, &[]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
}
