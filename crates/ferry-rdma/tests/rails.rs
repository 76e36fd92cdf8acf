//! Several NICs per engine, in the rig's guest: two Soft-RoCE devices (`rxe0` on `eth0`, `rxe1` on
//! `eth1`), named by `FERRY_RDMA_RAILS`. A batch uses both rails; a rail whose device goes down
//! mid-stream (`ip link set eth1 down`) costs no transfer an error and no byte, and carries traffic
//! again once it is back; with every rail down the link moves bytes over TCP; notifications follow
//! the data written on every rail; a region's bytes go to the rails on its NUMA node first, a GPU's to
//! the rails of its device; a persistent write persists every rail's share; several queue pairs per pair of rails share a batch.
//!
//! The tests change the guest's links, so they run one at a time (the rig runs every test binary with
//! one thread).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::emulated::EmulatedDevice;
use common::{T, assert_bytes, in_rig, pattern, wait_for};
use ferry::{Access, Engine, EngineBuilder, Notification, Op, Peer, TransferDesc, TransportKind};

/// Two engines over every rail `FERRY_RDMA_RAILS` names; `None` (after saying so) outside the rig.
async fn rail_pair() -> Option<(Engine, Engine, Peer)> {
    rail_pair_placed(&[]).await
}

/// [`rail_pair`], with the initiator told where its devices sit (`(device, NUMA node)`).
async fn rail_pair_placed(nodes: &[(&str, Option<u32>)]) -> Option<(Engine, Engine, Peer)> {
    let nodes = |b: EngineBuilder| {
        nodes
            .iter()
            .fold(b, |b, &(device, node)| b.rdma_numa_node(device, node))
    };
    rail_pair_with(|rails| (rails.to_vec(), 1), nodes).await
}

/// Two engines over the rails `devices` picks from those `FERRY_RDMA_RAILS` names (with the queue
/// pairs per pair of rails it says), the initiator's builder passed through `initiator`; checks that
/// the link has a rail per device and queue pair. `None` (after saying so) outside the rig.
async fn rail_pair_with(
    devices: impl Fn(&[String]) -> (Vec<String>, u8),
    initiator: impl FnOnce(EngineBuilder) -> EngineBuilder,
) -> Option<(Engine, Engine, Peer)> {
    let Ok(names) = std::env::var("FERRY_RDMA_RAILS") else {
        assert!(!in_rig(), "the rig names its rails in FERRY_RDMA_RAILS");
        eprintln!("skipped: no FERRY_RDMA_RAILS (run inside `cargo xtask rig test`)");
        return None;
    };
    let all: Vec<String> = names.split(',').map(String::from).collect();
    let (rails, queue_pairs) = devices(&all);
    let builder = || {
        Engine::builder()
            .transports([TransportKind::Rdma, TransportKind::Tcp])
            .rdma_devices(rails.clone())
            .rdma_queue_pairs_per_rail(queue_pairs)
    };
    let target = builder().listen("127.0.0.1:0").build().await.unwrap();
    let initiator = initiator(builder()).build().await.unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    assert_eq!(peer.transport(), TransportKind::Rdma, "{:?}", peer.passed_over());
    assert_eq!(
        peer.rails().len(),
        rails.len() * usize::from(queue_pairs),
        "{:?}",
        peer.rails()
    );
    Some((target, initiator, peer))
}

fn set_link(dev: &str, up: bool) {
    let state = if up { "up" } else { "down" };
    let status = Command::new("ip").args(["link", "set", dev, state]).status().unwrap();
    assert!(status.success(), "ip link set {dev} {state}");
}

/// Brings `devs` back up when the test ends, however it ends.
struct Restore(&'static [&'static str]);

impl Drop for Restore {
    fn drop(&mut self) {
        for dev in self.0 {
            let _ = Command::new("ip").args(["link", "set", dev, "up"]).status();
        }
    }
}

/// Writes `round`'s pattern over the whole region and checks every byte at the target.
async fn write_round(initiator: &Engine, peer: &Peer, src: &ferry::Region, dst: &ferry::Region, round: u8) {
    let len = src.len() as usize;
    let data = pattern(len, round);
    src.write_at(0, &data).unwrap();
    initiator
        .transfer(
            peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), dst.addr(), len as u64)],
            T,
        )
        .await
        .unwrap_or_else(|e| panic!("round {round}: {e}; rails {:?}", peer.rails()));
    assert!(
        dst.to_vec().unwrap() == data,
        "round {round}: the bytes at the target differ"
    );
}

/// An initiator region of `len` bytes and a target one that `peer` already knows.
async fn host_regions(target: &Engine, initiator: &Engine, peer: &Peer, len: usize) -> (ferry::Region, ferry::Region) {
    let dst = target.alloc_host(len, Access::READ_WRITE).unwrap();
    wait_for(peer, &dst).await;
    (initiator.alloc_host(len, Access::READ_WRITE).unwrap(), dst)
}

/// A target region of `len` bytes and an initiator one, and rounds 0 to 2 written between them with
/// every byte checked.
async fn three_rounds(target: &Engine, initiator: &Engine, peer: &Peer, len: usize) -> (ferry::Region, ferry::Region) {
    let (src, dst) = host_regions(target, initiator, peer, len).await;
    for round in 0..3 {
        write_round(initiator, peer, &src, &dst, round).await;
    }
    (src, dst)
}

fn rail_bytes(peer: &Peer) -> Vec<u64> {
    peer.rails().iter().map(|r| r.bytes).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_spread_over_every_rail() {
    let Some((target, initiator, peer)) = rail_pair().await else {
        return;
    };
    const LEN: usize = 8 << 20;
    let dst = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
    wait_for(&peer, &dst).await;
    let src = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    write_round(&initiator, &peer, &src, &dst, 1).await;
    let back = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    initiator
        .transfer(
            &peer,
            Op::Read,
            &[TransferDesc::new(back.addr(), dst.addr(), LEN as u64)],
            T,
        )
        .await
        .unwrap();
    assert!(back.to_vec().unwrap() == pattern(LEN, 1));
    let rails = peer.rails();
    assert!(
        rails.iter().all(|r| r.bytes > 0 && r.healthy && r.errors == 0),
        "every rail carried bytes: {rails:?}"
    );
}

/// Device memory (`DmaView::Device`) is registered on every rail at its device address: a batch
/// spread over both rails lands on the device at both ends, with no host copy and no hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_is_reached_directly_on_every_rail() {
    let Some((target, initiator, peer)) = rail_pair().await else {
        return;
    };
    const LEN: usize = 8 << 20;
    let stale = pattern(LEN, 20);
    let remote = EmulatedDevice::new(&stale, &stale);
    let dst = target.register_block(remote.clone(), Access::READ_WRITE).unwrap();
    wait_for(&peer, &dst).await;
    let local = EmulatedDevice::new(&stale, &pattern(LEN, 21));
    let src = initiator.register_block(local.clone(), Access::READ_WRITE).unwrap();
    let before = rail_bytes(&peer);
    initiator
        .transfer(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), dst.addr(), LEN as u64)],
            T,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}; rails {:?}", peer.rails()));
    assert_bytes(&remote.device_bytes(), &pattern(LEN, 21), "the target's device");
    assert_bytes(&remote.host_bytes(), &stale, "the target's host copy");
    let after = rail_bytes(&peer);
    assert!(
        before.iter().zip(&after).all(|(b, a)| a > b),
        "every rail carried bytes: {before:?} then {after:?}"
    );
    assert_eq!(
        (remote.hook_calls(), local.hook_calls()),
        (0, 0),
        "no hook runs around the NICs' accesses"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rail_that_goes_down_costs_no_transfer_and_comes_back() {
    let Some((target, initiator, peer)) = rail_pair().await else {
        return;
    };
    let _restore = Restore(&["eth1"]);
    const LEN: usize = 2 << 20;
    let (src, dst) = three_rounds(&target, &initiator, &peer, LEN).await;
    set_link("eth1", false);
    for round in 3..12 {
        write_round(&initiator, &peer, &src, &dst, round).await;
    }
    let down = peer.rails();
    assert!(
        down.iter().any(|r| r.name.starts_with("rxe1") && r.errors > 0),
        "the rail on eth1 failed and its work went elsewhere: {down:?}"
    );
    // Back up: within a few rests it carries traffic again.
    set_link("eth1", true);
    let before = rail_bytes(&peer);
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut round = 12u8;
    loop {
        write_round(&initiator, &peer, &src, &dst, round).await;
        round = round.wrapping_add(1);
        let now = peer.rails();
        let rejoined = now
            .iter()
            .zip(&before)
            .any(|(r, b)| r.name.starts_with("rxe1") && r.bytes > *b);
        if rejoined {
            break;
        }
        assert!(Instant::now() < deadline, "the rail never came back: {now:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_rail_down_the_bytes_go_over_tcp() {
    let Some((target, initiator, peer)) = rail_pair().await else {
        return;
    };
    let _restore = Restore(&["eth0", "eth1"]);
    const LEN: usize = 1 << 20;
    let dst = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
    wait_for(&peer, &dst).await;
    let src = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    write_round(&initiator, &peer, &src, &dst, 1).await;
    set_link("eth0", false);
    set_link("eth1", false);
    // The control link runs over loopback, which stays up.
    for round in 2..6 {
        write_round(&initiator, &peer, &src, &dst, round).await;
    }
    let rails = peer.rails();
    assert!(rails.iter().all(|r| r.errors > 0), "every rail failed: {rails:?}");
    assert_eq!(peer.transport(), TransportKind::Rdma);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_follow_the_data_of_every_rail() {
    let Some((target, initiator, peer)) = rail_pair().await else {
        return;
    };
    const LEN: usize = 1 << 20;
    let dst = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
    wait_for(&peer, &dst).await;
    let src = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    for round in 0..200u32 {
        let byte = (round % 251) as u8 + 1;
        src.write_at(0, &vec![byte; LEN]).unwrap();
        initiator
            .transfer(
                &peer,
                Op::Write,
                &[TransferDesc::new(src.addr(), dst.addr(), LEN as u64)],
                T,
            )
            .await
            .unwrap();
        initiator
            .notify(&peer, Notification::new("round", round.to_string()), T)
            .await
            .unwrap();
        let deadline = Instant::now() + T;
        let n = loop {
            if let Some(n) = target.take_notifications().into_iter().next() {
                break n;
            }
            assert!(Instant::now() < deadline, "round {round}: no notification");
            tokio::time::sleep(Duration::from_micros(200)).await;
        };
        assert_eq!(n.notification.msg, round.to_string(), "notifications in order");
        // Every byte of the round, whichever rail carried it, is there when the notification is seen.
        let got = dst.to_vec().unwrap();
        assert!(
            got.iter().all(|&b| b == byte),
            "round {round}: a notification overtook its data"
        );
    }
    assert!(peer.rails().iter().all(|r| r.bytes > 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_goes_to_the_rails_on_its_numa_node_first() {
    // The guest's memory is on node 0. Placing rxe1 there and rxe0 on a node 1 the guest does not
    // have makes rxe1 the region's only preferred rail and rxe0 its fallback.
    let Some((target, initiator, peer)) = rail_pair_placed(&[("rxe0", Some(1)), ("rxe1", Some(0))]).await else {
        return;
    };
    let _restore = Restore(&["eth1"]);
    const LEN: usize = 4 << 20;
    let (src, dst) = three_rounds(&target, &initiator, &peer, LEN).await;
    let rails = peer.rails();
    let bytes_on = |rails: &[ferry::RailStats], dev: &str| -> u64 {
        rails.iter().filter(|r| r.name.starts_with(dev)).map(|r| r.bytes).sum()
    };
    assert_eq!(
        bytes_on(&rails, "rxe1"),
        3 * LEN as u64,
        "every byte on the near rail: {rails:?}"
    );
    assert_eq!(bytes_on(&rails, "rxe0"), 0, "nothing on the far rail: {rails:?}");

    // The near rail down: the far one carries the region rather than fail it.
    set_link("eth1", false);
    for round in 3..8 {
        write_round(&initiator, &peer, &src, &dst, round).await;
    }
    let rails = peer.rails();
    assert!(bytes_on(&rails, "rxe0") > 0, "the fallback rail took over: {rails:?}");

    // What an engine would report here without overrides: the guest's NICs sit on no NUMA node
    // (or on node 0, its only one), so every rail is preferred for node 0's memory.
    let report = ferry::capabilities().rdma_rails;
    assert!(!report.is_empty(), "{report:?}");
    assert!(
        report.iter().all(|r| r.source != "override" && r.preferred_for == [0]),
        "{report:?}"
    );
}

/// Host memory that says it is a GPU's, as a mapping of a GPU's BAR would: the RDMA transport must
/// place it by the device, not by the NUMA node of its pages.
struct DeviceMemory {
    bytes: *mut [u8],
    device: ferry::PciAddress,
}

impl DeviceMemory {
    fn new(len: usize, device: ferry::PciAddress) -> Self {
        DeviceMemory {
            bytes: Box::into_raw(vec![0u8; len].into_boxed_slice()),
            device,
        }
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: `bytes` came from `Box::into_raw` in `new` and is freed once, here.
        drop(unsafe { Box::from_raw(self.bytes) });
    }
}

// SAFETY: the allocation is reached only through raw pointers, from any thread.
unsafe impl Send for DeviceMemory {}
// SAFETY: as above.
unsafe impl Sync for DeviceMemory {}

// SAFETY: `bytes` is a live allocation of `len` bytes until the block is dropped, and never moves.
unsafe impl ferry::MemoryBlock for DeviceMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.bytes.cast()
    }
    fn len(&self) -> usize {
        self.bytes.len()
    }
    fn kind(&self) -> &str {
        "device (test)"
    }
    fn pci_device(&self) -> Option<ferry::PciAddress> {
        Some(self.device)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_goes_to_the_rails_of_its_device_not_of_its_numa_node() {
    let gpu: ferry::PciAddress = "0000:3b:00.0".parse().unwrap();
    // By NUMA, the guest's memory (node 0) prefers rxe0; the rails named for the device say rxe1.
    let placed = |b: EngineBuilder| {
        b.rdma_numa_node("rxe0", Some(0))
            .rdma_numa_node("rxe1", Some(1))
            .rdma_device_rails(gpu, ["rxe1"])
    };
    let Some((target, initiator, peer)) = rail_pair_with(|rails| (rails.to_vec(), 1), placed).await else {
        return;
    };
    const LEN: usize = 4 << 20;
    let dst = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
    wait_for(&peer, &dst).await;
    let bytes_on = |dev: &str| -> u64 {
        let rails = peer.rails();
        rails.iter().filter(|r| r.name.starts_with(dev)).map(|r| r.bytes).sum()
    };
    let on_device = initiator
        .register_block(std::sync::Arc::new(DeviceMemory::new(LEN, gpu)), Access::READ_WRITE)
        .unwrap();
    let on_host = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    for round in 0..3 {
        let before = (bytes_on("rxe0"), bytes_on("rxe1"));
        write_round(&initiator, &peer, &on_device, &dst, round).await;
        let device_share = (bytes_on("rxe0") - before.0, bytes_on("rxe1") - before.1);
        assert_eq!(
            device_share,
            (0, LEN as u64),
            "round {round}: the device's memory, every byte on rxe1"
        );
        write_round(&initiator, &peer, &on_host, &dst, round + 10).await;
        let host_share = (bytes_on("rxe0") - before.0, bytes_on("rxe1") - before.1 - LEN as u64);
        assert_eq!(
            host_share,
            (LEN as u64, 0),
            "round {round}: host memory on node 0, every byte on rxe0"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_write_persists_the_share_of_every_rail() {
    let Some((target, initiator, peer)) = rail_pair().await else {
        return;
    };
    // A file in the page cache: the target's CPU persists what each rail's flush request names.
    const LEN: usize = 4 << 20;
    let path = std::env::temp_dir().join(format!("ferry-rails-persist-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; LEN]).unwrap();
    let dst = target
        .register_file(path.to_str().unwrap(), 0, LEN, Access::READ_WRITE)
        .unwrap();
    wait_for(&peer, &dst).await;
    let src = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    let before_rails = rail_bytes(&peer);
    let before = dst.persist_stats().expect("a file region counts what it persists");
    for round in 0..3u8 {
        let data = pattern(LEN, round);
        src.write_at(0, &data).unwrap();
        initiator
            .transfer_durable(
                &peer,
                Op::Write,
                &[TransferDesc::new(src.addr(), dst.addr(), LEN as u64)],
                ferry::Durability::Persistent,
                T,
            )
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}; rails {:?}", peer.rails()));
        assert!(std::fs::read(&path).unwrap() == data, "round {round}: the file differs");
    }
    let rails: Vec<u64> = rail_bytes(&peer)
        .iter()
        .zip(&before_rails)
        .map(|(a, b)| a - b)
        .collect();
    assert!(rails.iter().all(|&b| b > 0), "both rails carried a share: {rails:?}");
    let persisted = dst.persist_stats().unwrap().bytes - before.bytes;
    assert_eq!(
        persisted,
        3 * LEN as u64,
        "every rail's share was persisted, no more (rails {rails:?})"
    );
    drop(dst);
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_queue_pairs_per_rail_share_a_batch() {
    let Some((target, initiator, peer)) = rail_pair_with(|all| (all[..1].to_vec(), 3), |b| b).await else {
        return;
    };
    let first = peer.rails()[0].name.split("->").next().unwrap().to_string();
    let names: Vec<String> = peer.rails().into_iter().map(|r| r.name).collect();
    assert_eq!(
        names,
        [format!("{first}->0"), format!("{first}->0/1"), format!("{first}->0/2")],
        "three queue pairs on the one pair of rails"
    );
    const LEN: usize = 4 << 20;
    let _regions = three_rounds(&target, &initiator, &peer, LEN).await;
    let rails = peer.rails();
    assert!(
        rails.iter().all(|r| r.bytes > 0 && r.errors == 0),
        "each queue pair carried bytes: {rails:?}"
    );
    assert_eq!(rails.iter().map(|r| r.bytes).sum::<u64>(), 3 * LEN as u64);

    // Out of range: refused when the engine is built.
    let refused = Engine::builder().rdma_queue_pairs_per_rail(9).build().await;
    assert!(matches!(refused, Err(ferry::Error::InvalidArgument(_))), "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slice_size_decides_how_finely_a_batch_is_spread() {
    const LEN: usize = 128 << 10;
    let shares =
        |peer: &Peer, before: &[u64]| -> Vec<u64> { rail_bytes(peer).iter().zip(before).map(|(a, b)| a - b).collect() };
    // The default slice (256 KiB) holds the whole 128 KiB write: one rail carries it.
    let Some((target, initiator, peer)) = rail_pair().await else {
        return;
    };
    let (src, dst) = host_regions(&target, &initiator, &peer, LEN).await;
    for round in 0..3 {
        let before = rail_bytes(&peer);
        write_round(&initiator, &peer, &src, &dst, round).await;
        let mut share = shares(&peer, &before);
        share.sort_unstable();
        assert_eq!(share, [0, LEN as u64], "round {round}: one slice, one rail");
    }
    drop((target, initiator, peer));

    // 16 KiB slices: eight per write, spread over both rails.
    let Some((target, initiator, peer)) =
        rail_pair_with(|rails| (rails.to_vec(), 1), |b| b.rdma_slice_bytes(16 << 10)).await
    else {
        return;
    };
    let (src, dst) = host_regions(&target, &initiator, &peer, LEN).await;
    for round in 0..3 {
        let before = rail_bytes(&peer);
        write_round(&initiator, &peer, &src, &dst, round).await;
        let share = shares(&peer, &before);
        assert!(
            share.iter().all(|&b| b > 0),
            "round {round}: both rails carried slices: {share:?}"
        );
        assert_eq!(share.iter().sum::<u64>(), LEN as u64);
    }

    // Under 4 KiB: refused when the engine is built.
    let refused = Engine::builder().rdma_slice_bytes(1024).build().await;
    assert!(matches!(refused, Err(ferry::Error::InvalidArgument(_))), "{refused:?}");
}
