//! ferry over real verbs: two engines on one RDMA device (Soft-RoCE in `cargo xtask rig test`).
//!
//! Outside the rig there is no device: each test then checks only that the engines fall back to TCP
//! and says it skipped the RDMA part. Inside the rig (`FERRY_RIG=1`) a missing device is a failure.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use ferry::{Access, Error, Notification, Op, TransferDesc, TransportKind};
use futures::StreamExt;

mod common;
use common::{T, builder, in_rig, pair, pattern, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_and_read_many_shapes() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    for (size, batch) in [
        (1usize, 1usize),
        (64, 33),
        (4096, 64),
        (65_537, 5),
        (1 << 20, 3),
        (5 << 20, 1),
    ] {
        let total = size * batch;
        let dst = target.alloc_host(total, Access::READ_WRITE).unwrap();
        wait_for(&peer, &dst).await;
        let src = initiator
            .register(pattern(total, batch as u8), Access::READ_WRITE)
            .unwrap();
        // Descriptors in reverse order so that neighbours are not always contiguous.
        let descs: Vec<_> = (0..batch)
            .rev()
            .map(|i| {
                TransferDesc::new(
                    src.addr_at((i * size) as u64),
                    dst.addr_at((i * size) as u64),
                    size as u64,
                )
            })
            .collect();
        initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
        assert!(
            dst.to_vec().unwrap() == pattern(total, batch as u8),
            "write {batch} x {size}"
        );
        let back = initiator.alloc_host(total, Access::READ_WRITE).unwrap();
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
        assert!(
            back.to_vec().unwrap() == pattern(total, batch as u8),
            "read {batch} x {size}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_follow_their_data() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    const N: usize = 50;
    const BLOCK: usize = 96 << 10;
    let dst = target.alloc_host(N * BLOCK, Access::READ_WRITE).unwrap();
    wait_for(&peer, &dst).await;
    let src = initiator.alloc_host(N * BLOCK, Access::READ_WRITE).unwrap();
    let mut stream = target.notifications();
    for i in 0..N {
        src.write_at((i * BLOCK) as u64, &pattern(BLOCK, i as u8)).unwrap();
        let off = (i * BLOCK) as u64;
        initiator
            .transfer(
                &peer,
                Op::Write,
                &[TransferDesc::new(src.addr_at(off), dst.addr_at(off), BLOCK as u64)],
                T,
            )
            .await
            .unwrap();
        initiator
            .notify(&peer, Notification::new("block", i.to_string()), T)
            .await
            .unwrap();
        let n = tokio::time::timeout(T, stream.next()).await.unwrap().unwrap();
        let j: usize = n.notification.msg.parse().unwrap();
        let mut got = vec![0u8; BLOCK];
        dst.read_at((j * BLOCK) as u64, &mut got).unwrap();
        assert!(got == pattern(BLOCK, j as u8), "notification {j} before its data");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ranges_are_refused_before_posting() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let dst = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    let ro = target.alloc_host(4096, Access::READ).unwrap();
    wait_for(&peer, &dst).await;
    wait_for(&peer, &ro).await;
    let src = initiator.register(vec![7u8; 8192], Access::READ_WRITE).unwrap();
    let err = initiator
        .transfer(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), dst.addr() + 4000, 200)],
            T,
        )
        .await;
    assert!(matches!(err, Err(Error::OutOfBounds(_))), "{err:?}");
    let err = initiator
        .transfer(&peer, Op::Write, &[TransferDesc::new(src.addr(), ro.addr(), 16)], T)
        .await;
    assert!(matches!(err, Err(Error::PermissionDenied(_))), "{err:?}");
    assert_eq!(dst.to_vec().unwrap(), vec![0u8; 4096]);
    assert_eq!(ro.to_vec().unwrap(), vec![0u8; 4096]);
    // The queue pair is still usable.
    initiator
        .transfer(&peer, Op::Write, &[TransferDesc::new(src.addr(), dst.addr(), 4096)], T)
        .await
        .unwrap();
    assert_eq!(dst.to_vec().unwrap(), vec![7u8; 4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_futures_leave_the_link_usable() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let len = 8 << 20;
    let dst = target.alloc_host(len, Access::READ_WRITE).unwrap();
    wait_for(&peer, &dst).await;
    let src = initiator.register(pattern(len, 3), Access::READ_WRITE).unwrap();
    let descs: Vec<_> = (0..8u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 20), dst.addr_at(i << 20), 1 << 20))
        .collect();
    for _ in 0..10 {
        // Dropped almost at once, with work requests on the wire.
        let _ = tokio::time::timeout(
            Duration::from_micros(50),
            initiator.transfer(&peer, Op::Write, &descs, T),
        )
        .await;
    }
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    assert!(dst.to_vec().unwrap() == pattern(len, 3));
}

/// Runs as the target of `peer_killed_mid_batch` when the variable is set; idle otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_target() {
    if std::env::var_os("FERRY_RDMA_CHILD").is_none() {
        return;
    }
    let target = builder().listen("127.0.0.1:0").build().await.unwrap();
    let region = target.alloc_host(64 << 20, Access::READ_WRITE).unwrap();
    // libtest may print its own words before this on the same line: a marker finds it.
    println!("FERRY_CHILD {} {:#x}", target.local_addr().unwrap(), region.addr());
    tokio::time::sleep(Duration::from_secs(600)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_mid_batch() {
    let (mut child, addr, region) = spawn_target();
    let initiator = builder().build().await.unwrap();
    let peer = initiator.connect(&addr, T).await.unwrap();
    if peer.transport() != TransportKind::Rdma {
        assert!(!in_rig(), "inside the rig the link must use RDMA");
        let _ = child.kill();
        let _ = child.wait();
        eprintln!("skipped: no usable RDMA device here; the rig runs this test");
        return;
    }
    let src = initiator.alloc_host(64 << 20, Access::READ_WRITE).unwrap();
    let descs: Vec<_> = (0..16u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 22), region + (i << 22), 4 << 20))
        .collect();
    let batches = {
        let (initiator, peer) = (initiator.clone(), peer.clone());
        tokio::spawn(async move {
            loop {
                if let Err(e) = initiator.transfer(&peer, Op::Write, &descs, T).await {
                    return e;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    child.kill().unwrap();
    child.wait().unwrap();
    let err = tokio::time::timeout(T + Duration::from_secs(10), batches)
        .await
        .expect("the transfer hung")
        .unwrap();
    assert!(matches!(err, Error::PeerClosed(_) | Error::Timeout(_)), "{err:?}");
    assert!(peer.is_closed());

    // A new target process: the same engine connects again, over RDMA, and moves bytes.
    let (mut child, addr, region) = spawn_target();
    let peer = initiator.connect(&addr, T).await.unwrap();
    assert_eq!(peer.transport(), TransportKind::Rdma);
    src.write_at(0, &pattern(1 << 20, 9)).unwrap();
    initiator
        .transfer(&peer, Op::Write, &[TransferDesc::new(src.addr(), region, 1 << 20)], T)
        .await
        .unwrap();
    let back = initiator.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Read, &[TransferDesc::new(back.addr(), region, 1 << 20)], T)
        .await
        .unwrap();
    assert!(back.to_vec().unwrap() == pattern(1 << 20, 9));
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Starts this test binary as a target process (`child_target`); returns it, its address and region.
// The caller kills and waits for the child; should the test fail before that, the child ends by itself
// when its `child_target` sleep runs out.
#[allow(clippy::zombie_processes)]
fn spawn_target() -> (std::process::Child, String, u64) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_target", "--nocapture", "--test-threads=1"])
        .env("FERRY_RDMA_CHILD", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("child output").unwrap();
        if let Some(rest) = line.split("FERRY_CHILD ").nth(1) {
            let mut w = rest.split_whitespace();
            let addr = w.next().unwrap().to_string();
            let region = u64::from_str_radix(w.next().unwrap().trim_start_matches("0x"), 16).unwrap();
            return (child, addr, region);
        }
    }
}

/// A burst of notifications larger than the message buffers on either end: every one is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_notifications_is_answered() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    const N: usize = 200;
    let results = futures::future::join_all(
        (0..N).map(|i| initiator.notify(&peer, Notification::new("burst", i.to_string()), T)),
    )
    .await;
    let failed: Vec<_> = results.iter().enumerate().filter(|(_, r)| r.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} of {N} failed, first: {:?}",
        failed.len(),
        failed.first()
    );
    let mut got: Vec<usize> = target
        .take_notifications()
        .iter()
        .map(|n| n.notification.msg.parse().unwrap())
        .collect();
    got.sort_unstable();
    assert_eq!(got, (0..N).collect::<Vec<_>>());
}

/// A READ that timed out lands nothing in its destination afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_read_lands_nothing_later() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    const PART: usize = 1 << 20;
    const PARTS: usize = 32;
    let src = target.register(pattern(PART * PARTS, 5), Access::READ_WRITE).unwrap();
    wait_for(&peer, &src).await;
    let dst = initiator.alloc_host(PART * PARTS, Access::READ_WRITE).unwrap();
    let descs: Vec<_> = (0..PARTS as u64)
        .map(|i| TransferDesc::new(dst.addr_at(i * PART as u64), src.addr_at(i * PART as u64), PART as u64))
        .collect();
    let err = initiator
        .transfer(&peer, Op::Read, &descs, Duration::from_millis(1))
        .await;
    assert!(matches!(err, Err(Error::Timeout(_))), "{err:?}");
    let canary = vec![0xa5u8; PART * PARTS];
    dst.write_at(0, &canary).unwrap();
    // Longer than the whole READ takes on the rig.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let now = dst.to_vec().unwrap();
    let landed = now.iter().zip(&canary).filter(|(a, b)| a != b).count();
    assert_eq!(landed, 0, "bytes of the timed-out READ landed after it returned");
}

/// Deregistering a region that RDMA READs still land in, on a current-thread runtime: it returns
/// without waiting for the runtime, and the NIC never writes the memory again.
#[tokio::test(flavor = "current_thread")]
async fn deregistration_under_reads_ends_the_nics_access() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    const LEN: usize = 4 << 20;
    let src = target.register(pattern(LEN, 11), Access::READ_WRITE).unwrap();
    wait_for(&peer, &src).await;
    let mut memory = vec![0u8; LEN];
    // SAFETY: `memory` outlives the region (dropped below, before `memory`).
    let local = unsafe { initiator.register_raw(memory.as_mut_ptr(), LEN, Access::READ_WRITE) }.unwrap();
    let descs: Vec<_> = (0..4u64)
        .map(|i| TransferDesc::new(local.addr_at(i << 20), src.addr_at(i << 20), 1 << 20))
        .collect();
    let stream = {
        let (initiator, peer) = (initiator.clone(), peer.clone());
        tokio::spawn(async move {
            loop {
                if let Err(e) = initiator.transfer(&peer, Op::Read, &descs, T).await {
                    return e;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let watchdog = Watchdog::arm("deregistering a region in use", Duration::from_secs(20));
    drop(local);
    drop(watchdog);
    memory.fill(0x5a);
    let err = tokio::time::timeout(T, stream).await.expect("the stream hung").unwrap();
    eprintln!("the stream of READs ended with: {err}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let landed = memory.iter().filter(|&&b| b != 0x5a).count();
    assert_eq!(landed, 0, "the NIC wrote into deregistered memory");
}

/// A local region dropped while its transfer waits for room on the send queue: nothing is posted
/// into it, and the transfer fails with a named error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_dropped_before_posting_is_never_written() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    // More work requests than the send queue holds (256), each long (the same MiB over and over:
    // ranges that do not follow each other are never merged): the queue stays full for seconds, and a
    // transfer started meanwhile waits for room long after it was planned.
    const N: usize = 320;
    const PIECE: u64 = 1 << 20;
    let dst = target.alloc_host(PIECE as usize, Access::READ_WRITE).unwrap();
    wait_for(&peer, &dst).await;
    let src = initiator.alloc_host(PIECE as usize, Access::READ_WRITE).unwrap();
    let descs: Vec<_> = (0..N)
        .map(|_| TransferDesc::new(src.addr(), dst.addr(), PIECE))
        .collect();
    let filler = {
        let (initiator, peer) = (initiator.clone(), peer.clone());
        tokio::spawn(async move { initiator.transfer(&peer, Op::Write, &descs, T).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut memory = vec![0u8; 1 << 20];
    // SAFETY: `memory` outlives the region (dropped below, before `memory`).
    let local = unsafe { initiator.register_raw(memory.as_mut_ptr(), 1 << 20, Access::READ_WRITE) }.unwrap();
    let read = {
        let (initiator, peer) = (initiator.clone(), peer.clone());
        let desc = [TransferDesc::new(local.addr(), dst.addr(), 1 << 20)];
        tokio::spawn(async move { initiator.transfer(&peer, Op::Read, &desc, T).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(local);
    memory.fill(0x5a);
    let filled = tokio::time::timeout(T, filler).await.expect("the filler hung").unwrap();
    let read = tokio::time::timeout(T, read).await.expect("the read hung").unwrap();
    eprintln!("filler: {filled:?}, read: {read:?}");
    assert!(filled.is_ok(), "{filled:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let landed = memory.iter().filter(|&&b| b != 0x5a).count();
    assert_eq!(landed, 0, "a READ landed in a deregistered region");
    assert!(matches!(read, Err(Error::PermissionDenied(_))), "{read:?}");
}

/// READs racing the target's deregistration of their source: only they fail, and the link carries
/// the next transfer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_racing_remote_deregistration_leaves_the_link_up() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let other = target.register(pattern(1 << 20, 21), Access::READ_WRITE).unwrap();
    wait_for(&peer, &other).await;
    let dst = initiator.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    for round in 0..5 {
        let src = target.register(pattern(1 << 20, round), Access::READ_WRITE).unwrap();
        wait_for(&peer, &src).await;
        let descs: Vec<_> = (0..16u64)
            .map(|i| TransferDesc::new(dst.addr_at(i << 16), src.addr_at(i << 16), 1 << 16))
            .collect();
        let reads = {
            let (initiator, peer) = (initiator.clone(), peer.clone());
            tokio::spawn(async move {
                loop {
                    if let Err(e) = initiator.transfer(&peer, Op::Read, &descs, T).await {
                        return e;
                    }
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(src);
        let err = tokio::time::timeout(T, reads).await.expect("the reads hung").unwrap();
        assert!(!matches!(err, Error::PeerClosed(_)), "round {round}: {err:?}");
        initiator
            .transfer(
                &peer,
                Op::Read,
                &[TransferDesc::new(dst.addr(), other.addr(), 1 << 20)],
                T,
            )
            .await
            .unwrap_or_else(|e| panic!("round {round}: the next transfer on the link: {e:?}"));
        assert!(dst.to_vec().unwrap() == pattern(1 << 20, 21), "round {round}");
    }
}

/// Ends the process if not dropped within `limit`: a synchronous call that hangs cannot be timed out
/// from inside the runtime it blocks. (Dropping the sender is what disarms it.)
struct Watchdog(#[allow(dead_code)] std::sync::mpsc::Sender<()>);

impl Watchdog {
    fn arm(what: &'static str, limit: Duration) -> Self {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                eprintln!("watchdog: {what} did not return within {limit:?}");
                std::process::exit(101);
            }
        });
        Watchdog(tx)
    }
}
