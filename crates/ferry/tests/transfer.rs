//! Writes and reads of many sizes and batch shapes, every byte checked.

mod common;

use common::*;
use ferry::{Engine, Op, TransferDesc, TransferStatus};

async fn round_trip(builder: ferry::EngineBuilder, sizes: &[usize], batch: usize) {
    let (target, initiator, peer) = pair_with(builder).await;
    for &size in sizes {
        let total = size * batch;
        let dst = target.alloc_host(total, rw()).unwrap();
        wait_for_region(&peer, &dst).await;
        let src = initiator.register(pattern(total, size as u8), rw()).unwrap();
        let descs: Vec<_> = (0..batch)
            .map(|i| {
                TransferDesc::new(
                    src.addr_at((i * size) as u64),
                    dst.addr_at((i * size) as u64),
                    size as u64,
                )
            })
            .collect();
        initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
        assert_eq!(
            dst.to_vec().unwrap(),
            pattern(total, size as u8),
            "write of {batch} x {size}"
        );

        let back = initiator.alloc_host(total, rw()).unwrap();
        let descs: Vec<_> = (0..batch)
            .map(|i| {
                TransferDesc::new(
                    back.addr_at((i * size) as u64),
                    dst.addr_at((i * size) as u64),
                    size as u64,
                )
            })
            .collect();
        initiator.transfer(&peer, Op::Read, &descs, T).await.unwrap();
        assert_eq!(
            back.to_vec().unwrap(),
            pattern(total, size as u8),
            "read of {batch} x {size}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_descriptors_of_many_sizes() {
    round_trip(
        Engine::builder(),
        &[1, 7, 4096, 65_535, 256 << 10, (1 << 20) + 3, 9 << 20],
        1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_coalesced_through_the_pool() {
    round_trip(Engine::builder(), &[1, 64, 4096, 100_000], 300).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_without_a_pool() {
    round_trip(Engine::builder().buffer_pool("0:0"), &[3, 4096, 300_000], 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_streams_and_mixed_sizes() {
    let (target, initiator, peer) = pair_with(Engine::builder().streams(5)).await;
    assert_eq!(peer.tcp_streams(), 5);
    let sizes = [10usize, 300_000, 5, 4 << 20, 8191, 1 << 20, 70_000];
    let total: usize = sizes.iter().sum();
    let dst = target.alloc_host(total, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.register(pattern(total, 9), rw()).unwrap();
    let mut off = 0u64;
    let mut descs = Vec::new();
    for s in sizes {
        descs.push(TransferDesc::new(src.addr_at(off), dst.addr_at(off), s as u64));
        off += s as u64;
    }
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    assert_eq!(dst.to_vec().unwrap(), pattern(total, 9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_transfer_reports_status_and_resolves() {
    let (target, initiator, peer) = pair().await;
    let dst = target.alloc_host(8 << 20, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.register(pattern(8 << 20, 1), rw()).unwrap();
    let handle = initiator
        .transfer_async(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), dst.addr(), 8 << 20)],
            T,
        )
        .unwrap();
    let s = handle.status();
    assert!(
        matches!(s, TransferStatus::Waiting | TransferStatus::Completed),
        "{s:?}"
    );
    handle.await.unwrap();
    assert_eq!(dst.to_vec().unwrap(), pattern(8 << 20, 1));
}

/// `transfer_future` checks a batch when it is called and hands back a named future that does
/// nothing until it is polled: a bad descriptor is refused at once, a future dropped unpolled moves
/// no byte, and one kept and awaited later moves them all. On each transport a pair of one host
/// can use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_transfer_futures_are_checked_at_once_and_lazy() {
    for transports in [vec![], vec![ferry::TransportKind::Tcp]] {
        let builder = match transports.is_empty() {
            true => Engine::builder(),
            false => Engine::builder().transports(transports),
        };
        let (target, initiator, peer) = pair_with(builder).await;
        let dst = target.alloc_host(64 << 10, rw()).unwrap();
        wait_for_region(&peer, &dst).await;
        let src = initiator.register(pattern(64 << 10, 3), rw()).unwrap();
        let write = |len| [TransferDesc::new(src.addr(), dst.addr(), len)];
        let completed = ferry::Durability::Completed;

        let past_the_end = initiator.transfer_future(&peer, Op::Write, &write(65 << 10), completed, T);
        assert!(
            matches!(past_the_end, Err(ferry::Error::OutOfBounds(_))),
            "{past_the_end:?}"
        );
        let none = initiator.transfer_future(&peer, Op::Write, &[], completed, T);
        assert!(matches!(none, Err(ferry::Error::InvalidArgument(_))), "{none:?}");

        let unpolled = initiator
            .transfer_future(&peer, Op::Write, &write(64 << 10), completed, T)
            .unwrap();
        drop(unpolled);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(
            dst.to_vec().unwrap(),
            vec![0u8; 64 << 10],
            "{}: a dropped future wrote",
            peer.transport()
        );

        struct Kept(ferry::Transfer);
        let kept = Kept(
            initiator
                .transfer_future(&peer, Op::Write, &write(64 << 10), completed, T)
                .unwrap(),
        );
        tokio::time::timeout(T, kept.0).await.expect("hung").unwrap();
        assert_eq!(dst.to_vec().unwrap(), pattern(64 << 10, 3), "{}", peer.transport());
    }
}

/// Once a transfer returns (here: timed out) or its future is dropped, no byte lands in its local
/// buffer again: a canary painted right after stays intact while the target would still be sending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_byte_lands_after_a_read_returns_or_is_dropped() {
    use std::time::Duration;
    let (target, initiator, peer) = pair().await;
    let len = 256usize << 20;
    let src = target.register(vec![0x11u8; len], rw()).unwrap();
    wait_for_region(&peer, &src).await;
    let dst = initiator.alloc_host(len, rw()).unwrap();
    let desc = [TransferDesc::new(dst.addr(), src.addr(), len as u64)];
    let canary = vec![0xEEu8; len];
    let untouched = |what: &str| {
        let now = dst.to_vec().unwrap();
        let late = now.iter().filter(|&&b| b != 0xEE).count();
        assert_eq!(late, 0, "{late} bytes landed after the read {what}");
    };

    let err = initiator
        .transfer(&peer, Op::Read, &desc, Duration::from_millis(2))
        .await
        .unwrap_err();
    assert!(matches!(err, ferry::Error::Timeout(_)), "{err:?}");
    dst.write_at(0, &canary).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    untouched("timed out");

    let read = {
        let (initiator, peer) = (initiator.clone(), peer.clone());
        tokio::spawn(async move { initiator.transfer(&peer, Op::Read, &desc, T).await })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    read.abort();
    match read.await {
        Err(e) => assert!(e.is_cancelled(), "{e}"),
        // A loaded machine may let the whole read finish before the abort: then nothing may land
        // after it either, which the canary below checks all the same.
        Ok(result) => result.unwrap(),
    }
    dst.write_at(0, &canary).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    untouched("was dropped");

    let handle = initiator
        .transfer_async(&peer, Op::Read, &desc, Duration::from_millis(2))
        .unwrap();
    assert!(matches!(handle.await, Err(ferry::Error::Timeout(_))));
    dst.write_at(0, &canary).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    untouched("was reported timed out by its handle");

    // The link still serves whole reads.
    initiator.transfer(&peer, Op::Read, &desc[..], T).await.unwrap();
    assert!(dst.to_vec().unwrap().iter().all(|&b| b == 0x11));
}

/// Descriptors of mixed sizes, scattered (and in reverse order) at the target, more of them per
/// frame than one `sendmsg(2)` or `readv(2)` names, in two regions at each end: every byte lands
/// where its descriptor says, and nothing else is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gathered_writes_land_scattered_bytes_exactly() {
    let (target, initiator, peer) = pair().await;
    let sizes: Vec<usize> = (0..3000)
        .map(|i| [1, 256, 777, 4096, 13_000, 70_000][i % 6] * (i % 3 + 1) / 2 + 1)
        .collect();
    let total: usize = sizes.iter().sum();
    let len = total + 5 * sizes.len();
    let dsts = [
        target.alloc_host(len, rw()).unwrap(),
        target.alloc_host(len, rw()).unwrap(),
    ];
    for d in &dsts {
        wait_for_region(&peer, d).await;
    }
    let src_bytes = [pattern(total, 11), pattern(total, 53)];
    let srcs = [
        initiator.register(src_bytes[0].clone(), rw()).unwrap(),
        initiator.register(src_bytes[1].clone(), rw()).unwrap(),
    ];
    let mut expect = [vec![0u8; len], vec![0u8; len]];
    let mut descs = Vec::new();
    let mut at_src = 0usize;
    let mut used = [0usize; 2];
    for (i, &n) in sizes.iter().enumerate() {
        let (s, d) = (i % 2, (i / 2) % 2);
        // From the end of the region down, with gaps: the last descriptor lands lowest.
        used[d] += n + i % 5;
        let dst_off = len - used[d];
        descs.push(TransferDesc::new(
            srcs[s].addr_at(at_src as u64),
            dsts[d].addr_at(dst_off as u64),
            n as u64,
        ));
        expect[d][dst_off..dst_off + n].copy_from_slice(&src_bytes[s][at_src..at_src + n]);
        at_src += n;
    }
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    for (d, want) in dsts.iter().zip(&expect) {
        assert!(
            d.to_vec().unwrap() == *want,
            "the target holds exactly the descriptors' bytes"
        );
    }
    // 4000 descriptors of 100 bytes, every other 100 bytes of the target: frames of about 2000
    // segments, more than one system call names.
    let small: Vec<_> = (0..4000u64)
        .map(|i| TransferDesc::new(srcs[0].addr_at(i * 100), dsts[0].addr_at(i * 200), 100))
        .collect();
    initiator.transfer(&peer, Op::Write, &small, T).await.unwrap();
    let got = dsts[0].to_vec().unwrap();
    for i in 0..4000usize {
        assert_eq!(
            got[i * 200..i * 200 + 100],
            src_bytes[0][i * 100..i * 100 + 100],
            "descriptor {i}"
        );
        if i * 200 + 200 <= len {
            assert_eq!(
                got[i * 200 + 100..i * 200 + 200],
                expect[0][i * 200 + 100..i * 200 + 200],
                "gap after {i}"
            );
        }
    }
}
