//! The same-host transport's guarantees, with both engines in this process (the two-process tests are
//! `shm_processes.rs` and ferry-cli's `shm.rs`): deregistration ends the peer's access before it
//! returns, whether the target copies for the peer or lent it the region's memory file, a bad
//! descriptor is refused before any byte moves, and local memory behind a host copy moves by its hooks.
#![cfg(feature = "shm")]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{T, pattern, rw, wait_for_region};
use ferry::{Engine, Error, Op, TransferDesc, TransportKind};

async fn shm_pair() -> (Engine, Engine, ferry::Peer) {
    let target = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let initiator = Engine::builder().build().await.unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    assert_eq!(peer.transport(), TransportKind::Shm, "{:?}", peer.passed_over());
    (target, initiator, peer)
}

/// Writes stream into caller-owned memory while it is deregistered: once `deregister` returns, a
/// canary painted there stays intact, though the writer keeps trying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistration_ends_the_peers_access_before_it_returns() {
    let (target, initiator, peer) = shm_pair().await;
    const LEN: usize = 4 << 20;
    let memory: &'static mut [u8] = Box::leak(vec![0u8; LEN].into_boxed_slice());
    let ptr = memory.as_mut_ptr();
    // SAFETY: the leaked buffer lives forever and is reached only through the region until it is
    // deregistered, then only by raw pointer.
    let region = unsafe { target.register_raw(ptr, LEN, rw()) }.unwrap();
    wait_for_region(&peer, &region).await;
    let remote = region.addr();
    let src = initiator.register(pattern(LEN, 4), rw()).unwrap();
    let descs: Vec<_> = (0..64u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 16), remote + (i << 16), 1 << 16))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writes = common::keep_writing(&initiator, &peer, descs, ferry::Durability::Completed, stop.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    region.deregister().await.unwrap();
    // SAFETY: the region is deregistered; the bytes are the test's again.
    unsafe { std::ptr::write_bytes(ptr, 0xEE, LEN) };
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let (ok, refused) = tokio::time::timeout(T, writes).await.unwrap().unwrap();
    // SAFETY: as above.
    let after = unsafe { std::slice::from_raw_parts(ptr, LEN) };
    assert!(
        after.iter().all(|&b| b == 0xEE),
        "a write landed after deregister returned"
    );
    assert!(ok > 0 && refused > 0, "{ok} writes before, {refused} refused after");
    assert_eq!(peer.transport(), TransportKind::Shm);
}

/// How many mappings of `len` bytes of an engine allocation (a memfd) this process holds.
fn memfd_mappings(len: usize) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:ferry-host"))
        .filter(|l| {
            let (start, end) = l.split_whitespace().next().unwrap().split_once('-').unwrap();
            usize::from_str_radix(end, 16).unwrap() - usize::from_str_radix(start, 16).unwrap() == len
        })
        .count()
}

/// Writes stream into an engine allocation the target lent to the writer, while it is deregistered;
/// the test keeps the allocation itself. Once `deregister` returns, the writer's mapping is gone and a
/// canary painted there stays intact, though the writer keeps trying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistration_takes_a_lent_region_back_before_it_returns() {
    const LEN: usize = 3 << 20;
    let (target, initiator, peer) = shm_pair().await;
    let memory = Arc::new(ferry::HostAllocation::new(LEN).unwrap());
    let region = target.register_block(memory.clone(), rw()).unwrap();
    wait_for_region(&peer, &region).await;
    let remote = region.addr();
    let src = initiator.register(pattern(LEN, 5), rw()).unwrap();
    let descs: Vec<_> = (0..48u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 16), remote + (i << 16), 1 << 16))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writes = common::keep_writing(&initiator, &peer, descs, ferry::Durability::Completed, stop.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(memfd_mappings(LEN), 2, "the target's own mapping and the one it lent");
    region.deregister().await.unwrap();
    assert_eq!(memfd_mappings(LEN), 1, "the writer unmapped before deregister returned");
    use ferry::MemoryBlock;
    // SAFETY: the region is deregistered; the allocation is the test's alone.
    unsafe { std::ptr::write_bytes(memory.as_ptr(), 0xEE, LEN) };
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let (ok, refused) = tokio::time::timeout(T, writes).await.unwrap().unwrap();
    // SAFETY: as above.
    let after = unsafe { std::slice::from_raw_parts(memory.as_ptr(), LEN) };
    assert!(
        after.iter().all(|&b| b == 0xEE),
        "a write landed after deregister returned"
    );
    assert!(ok > 0 && refused > 0, "{ok} writes before, {refused} refused after");
}

/// A 256 MiB write into a region the target lent, and a 256 MiB read out of it, each with a 2 ms
/// timeout: the copy takes far longer, so each ends with `Timeout`, and once it has returned no byte
/// of it lands, at the target or in the caller's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_holds_on_a_lent_region_and_no_late_byte_lands() {
    const LEN: usize = 256 << 20;
    let (target, initiator, peer) = shm_pair().await;
    let dst = target.alloc_host(LEN, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.alloc_host(LEN, rw()).unwrap();
    src.write_at(0, &vec![0x11; LEN]).unwrap();
    // The first write maps the region (a round trip to the target); the rest copy into the mapping.
    let small = [TransferDesc::new(src.addr(), dst.addr(), 4096)];
    initiator.transfer(&peer, Op::Write, &small, T).await.unwrap();
    let whole = [TransferDesc::new(src.addr(), dst.addr(), LEN as u64)];
    let quickly = Duration::from_millis(2);

    let err = initiator.transfer(&peer, Op::Write, &whole, quickly).await.unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    let landed = dst.to_vec().unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        dst.to_vec().unwrap() == landed,
        "a byte of the write landed after it returned"
    );

    dst.write_at(0, &vec![0x22; LEN]).unwrap();
    let err = initiator.transfer(&peer, Op::Read, &whole, quickly).await.unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    let landed = src.to_vec().unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        src.to_vec().unwrap() == landed,
        "a byte of the read landed after it returned"
    );
    // The link is fine: the same transfers with time to run complete.
    initiator.transfer(&peer, Op::Read, &whole, T).await.unwrap();
    assert!(src.to_vec().unwrap().iter().all(|&b| b == 0x22));
    assert_eq!(peer.transport(), TransportKind::Shm);
}

/// A same-host peer granted read-write maps the region writable; narrowing its grant to read takes
/// the mapping back before `grant` returns, as a revoke does, and its writes are refused from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narrowing_a_grant_to_read_takes_the_writable_mapping_back() {
    // A size no other test here maps, so that the count of mappings is this test's own.
    const LEN: usize = (5 << 20) + 4096;
    let key = [7u8; 32];
    let psk = |name| ferry::TlsConfig::from_psk(&key, name).unwrap();
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .tls(psk("target"))
        .build()
        .await
        .unwrap();
    let initiator = Engine::builder().tls(psk("peer")).build().await.unwrap();
    let dst = target.alloc_host(LEN, rw()).unwrap();
    dst.grant("peer", ferry::Access::READ_WRITE).await.unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    assert_eq!(peer.transport(), TransportKind::Shm, "{:?}", peer.passed_over());
    let remote = peer.regions().iter().next().expect("the granted region").addr;
    let src = initiator.register(pattern(LEN, 1), rw()).unwrap();
    let write = [TransferDesc::new(src.addr(), remote, 4096)];
    // The first write maps the region; the next ones copy into the mapping.
    initiator.transfer(&peer, Op::Write, &write, T).await.unwrap();
    initiator.transfer(&peer, Op::Write, &write, T).await.unwrap();
    assert_eq!(memfd_mappings(LEN), 2, "the target's own mapping and the one it lent");

    dst.grant("peer", ferry::Access::READ).await.unwrap();
    assert_eq!(
        memfd_mappings(LEN),
        1,
        "the writable mapping stayed after the grant narrowed to read"
    );
    dst.write_at(0, &[0xEE; 4096]).unwrap();
    let err = initiator.transfer(&peer, Op::Write, &write, T).await.unwrap_err();
    assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");
    assert_eq!(
        dst.to_vec().unwrap()[..4096],
        [0xEE; 4096],
        "a write landed after the narrowing"
    );
    let read = [TransferDesc::new(src.addr(), remote, 4096)];
    initiator.transfer(&peer, Op::Read, &read, T).await.unwrap();
}

/// A batch with one range past the end of the target's region: refused whole, and none of its other
/// ranges was copied, whether the region was not mapped here yet (the batch goes to the link's
/// future, which maps it) or was already (the batch is copied inline, on its first poll).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_a_bad_range_moves_nothing() {
    let (target, initiator, peer) = shm_pair().await;
    let dst = target.alloc_host(1 << 20, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.register(pattern(2 << 20, 6), rw()).unwrap();
    // The engine checks descriptors against the peer's adverts before sending; what the target sees
    // from a peer that does not is covered by the target's own checks, the same for every transport.
    let descs = [
        TransferDesc::new(src.addr(), dst.addr(), 4096),
        TransferDesc::new(src.addr_at(4096), dst.addr_at((1 << 20) - 100), 4096),
    ];
    for mapped in [false, true] {
        let err = initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap_err();
        assert!(matches!(err, Error::OutOfBounds(_)), "{err:?}");
        assert!(
            dst.to_vec().unwrap()[..(1 << 20) - 8192].iter().all(|&b| b == 0),
            "a byte of the batch was written (mapped: {mapped})"
        );
        // A good write at the end maps the region for the next round.
        let good = [TransferDesc::new(src.addr(), dst.addr_at((1 << 20) - 8192), 4096)];
        initiator.transfer(&peer, Op::Write, &good, T).await.unwrap();
    }
}

/// A batch of many small ranges of regions already mapped, alternating between two target regions
/// and two local ones, copied inline on its first poll: every byte lands where its range says, for
/// writes and reads, and a batch that names a region the target does not lend (or no longer lends)
/// still goes the whole way, through the link's future.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_over_several_mapped_regions_lands_each_range_in_place() {
    const N: u64 = 64;
    const LEN: u64 = 1024;
    let (target, initiator, peer) = shm_pair().await;
    let dst = [
        target.alloc_host(1 << 20, rw()).unwrap(),
        target.alloc_host(1 << 20, rw()).unwrap(),
    ];
    for d in &dst {
        wait_for_region(&peer, d).await;
    }
    let src = [
        initiator.register(pattern(1 << 20, 8), rw()).unwrap(),
        initiator.register(pattern(1 << 20, 9), rw()).unwrap(),
    ];
    // Range k goes from local region k % 2 to target region (k / 3) % 2, at offsets that differ.
    let descs: Vec<_> = (0..N)
        .map(|k| {
            let (s, d) = (&src[(k % 2) as usize], &dst[((k / 3) % 2) as usize]);
            TransferDesc::new(s.addr_at(k * LEN), d.addr_at((N - 1 - k) * LEN), LEN)
        })
        .collect();
    let expect = |dst_index: usize| {
        let mut bytes = vec![0u8; 1 << 20];
        for k in (0..N).filter(|k| ((k / 3) % 2) as usize == dst_index) {
            let from = pattern(1 << 20, 8 + (k % 2) as u8);
            let at = ((N - 1 - k) * LEN) as usize;
            bytes[at..at + LEN as usize].copy_from_slice(&from[(k * LEN) as usize..((k + 1) * LEN) as usize]);
        }
        bytes
    };
    // The first batch maps both regions; the second is copied inline.
    for _ in 0..2 {
        initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
        for (i, d) in dst.iter().enumerate() {
            assert!(d.to_vec().unwrap() == expect(i), "target region {i}");
        }
    }
    // Reads bring the same bytes back into zeroed local memory.
    for s in &src {
        s.write_at(0, &vec![0u8; 1 << 20]).unwrap();
    }
    initiator.transfer(&peer, Op::Read, &descs, T).await.unwrap();
    for (k, d) in descs.iter().enumerate() {
        let s = &src[k % 2];
        let mut got = vec![0u8; LEN as usize];
        s.read_at(d.local_addr - s.addr(), &mut got).unwrap();
        let from = pattern(1 << 20, 8 + (k % 2) as u8);
        let at = k * LEN as usize;
        assert_eq!(got, from[at..at + LEN as usize], "range {k} read back");
    }
    // A region the target registered rather than allocated is not lent: the batch that names it
    // with a lent one goes through the link's future, the whole of it.
    let registered = target.register(vec![0u8; 4096], rw()).unwrap();
    wait_for_region(&peer, &registered).await;
    let mixed = [
        TransferDesc::new(src[0].addr(), dst[0].addr(), 512),
        TransferDesc::new(src[0].addr_at(512), registered.addr(), 512),
    ];
    initiator.transfer(&peer, Op::Write, &mixed, T).await.unwrap();
    assert_eq!(registered.to_vec().unwrap()[..512], src[0].to_vec().unwrap()[512..1024]);
    assert_eq!(dst[0].to_vec().unwrap()[..512], src[0].to_vec().unwrap()[..512]);
}

/// Writes into a lent region complete on their first poll, with no system call and no future of the
/// link's own; a caller that writes in a loop must still give its runtime thread up now and then. On a
/// runtime of one thread, a task spawned beside such a loop runs before the loop ends by itself.
#[tokio::test(flavor = "current_thread")]
async fn a_loop_of_inline_writes_lets_other_tasks_run() {
    a_loop_of_writes_lets_other_tasks_run(1, 64).await;
}

/// The same with batches of two ranges, which the link copies inline too, on the batch's first
/// poll: no less a loop that never waits.
#[tokio::test(flavor = "current_thread")]
async fn a_loop_of_batched_writes_lets_other_tasks_run() {
    a_loop_of_writes_lets_other_tasks_run(2, 64).await;
}

/// Large copies are charged to the task's budget by their size, not one unit each as a small one is:
/// a loop of 16 MiB writes (about half a millisecond each) yields after a few of them, not after the
/// 128 (2 GiB) that a unit each allows. Inline (one range) and in the link's future (two, more than
/// the link copies inline in one batch).
#[tokio::test(flavor = "current_thread")]
async fn a_loop_of_large_writes_yields_by_the_bytes_it_copied() {
    const MIB: u64 = 1 << 20;
    for ranges in [1, 2] {
        let writes = a_loop_of_writes_lets_other_tasks_run(ranges, 16 * MIB / ranges).await;
        assert!(
            writes * 16 <= 256,
            "{ranges} range(s): {writes} writes of 16 MiB ({} MiB) before the loop yielded",
            writes * 16
        );
    }
}

/// Writes `ranges` ranges of `len` bytes in a loop until a task spawned beside the loop ran; returns
/// how many writes that took.
async fn a_loop_of_writes_lets_other_tasks_run(ranges: u64, len: u64) -> u64 {
    let (target, initiator, peer) = shm_pair().await;
    let size = (ranges * len) as usize;
    let dst = target.alloc_host(size, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.register(pattern(size, 7), rw()).unwrap();
    let descs: Vec<_> = (0..ranges)
        .map(|i| TransferDesc::new(src.addr_at(i * len), dst.addr_at(i * len), len))
        .collect();
    // The first write maps the region (a round trip to the target); the rest are copies.
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    tokio::spawn({
        let ran = ran.clone();
        async move { ran.store(true, Ordering::Relaxed) }
    });
    const MOST: u64 = 100_000;
    let mut writes = 0;
    while !ran.load(Ordering::Relaxed) && writes < MOST {
        initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
        writes += 1;
    }
    assert!(ran.load(Ordering::Relaxed), "{MOST} writes in a row never yielded");
    assert!(dst.to_vec().unwrap() == pattern(size, 7), "the bytes at the target");
    dst.deregister().await.unwrap();
    writes
}

/// Dropping a region deregisters it on the dropping thread, and a region lent to a peer in this
/// process comes back only once that peer's tasks have unmapped it. On a runtime of one worker (a
/// container limited to one CPU), a drop in a task on that worker must let those tasks run while it
/// waits: holding the worker, it would wait out `DEREGISTER_LIMIT` and return with the peer's mapping
/// still in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn dropping_a_lent_region_on_a_one_worker_runtime_takes_it_back() {
    // Lengths no other test of this file maps.
    drop_lent_region_in_a_task(5 << 20, false).await;
}

/// The same with the target engine dropped first (its region's `Drop` then finds no engine): the
/// mapping comes back as the link ends, also before the drop returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn dropping_a_lent_region_after_its_engine_on_a_one_worker_runtime_takes_it_back() {
    drop_lent_region_in_a_task(6 << 20, true).await;
}

async fn drop_lent_region_in_a_task(len: usize, engine_first: bool) {
    let (target, initiator, peer) = shm_pair().await;
    let dst = target.alloc_host(len, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.register(pattern(4096, 8), rw()).unwrap();
    let desc = [TransferDesc::new(src.addr(), dst.addr(), 4096)];
    initiator.transfer(&peer, Op::Write, &desc, T).await.unwrap();
    assert_eq!(memfd_mappings(len), 2, "the target's own mapping and the one it lent");
    // On the worker: the test's own body runs on the thread that called `block_on`.
    let dropped = tokio::spawn(async move {
        if engine_first {
            drop(target);
        }
        drop(dst);
        memfd_mappings(len)
    });
    let left = tokio::time::timeout(T, dropped).await.unwrap().unwrap();
    assert_eq!(
        left, 0,
        "the peer unmapped, and then the target, before the drop returned"
    );
    let err = initiator.transfer(&peer, Op::Write, &desc, T).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfBounds(_) | Error::PermissionDenied(_) | Error::PeerClosed(_)
        ),
        "{err:?}"
    );
}

/// On a current-thread runtime the peer's tasks cannot run while a drop holds the thread, so a drop
/// that waited for the peer to unmap would wait out `DEREGISTER_LIMIT` and return with the mapping
/// still in place. A region whose memory only the region holds (an `alloc_host`) is instead left to a
/// task of the runtime, which frees the memory once the peer gave its mapping back: the drop returns
/// at once with both mappings still there, the peer's next write is refused, and the mappings are
/// all gone soon after.
#[tokio::test(flavor = "current_thread")]
async fn dropping_a_lent_allocation_on_a_current_thread_runtime_leaves_it_to_a_task() {
    // A length no other test of this file maps.
    const LEN: usize = 7 << 20;
    let (target, initiator, peer) = shm_pair().await;
    let dst = target.alloc_host(LEN, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.register(pattern(4096, 9), rw()).unwrap();
    let desc = [TransferDesc::new(src.addr(), dst.addr(), 4096)];
    initiator.transfer(&peer, Op::Write, &desc, T).await.unwrap();
    assert_eq!(memfd_mappings(LEN), 2, "the target's own mapping and the one it lent");
    drop(dst);
    assert_eq!(
        memfd_mappings(LEN),
        2,
        "the drop returned before the peer's tasks ran, with the target's memory kept for them"
    );
    tokio::time::timeout(T, async {
        while memfd_mappings(LEN) > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the peer unmapped the region, and then the target freed it");
    let err = initiator.transfer(&peer, Op::Write, &desc, T).await.unwrap_err();
    assert!(
        matches!(err, Error::OutOfBounds(_) | Error::PermissionDenied(_)),
        "{err:?}"
    );
    drop((target, initiator));
}

/// Memory its owner stages, as a GPU block behind a host copy is: the bytes that count are in
/// `device`; `prepare_read` brings a range to the host copy, `commit_written` takes it back.
struct Staged {
    host: std::sync::Mutex<Vec<u8>>,
    device: std::sync::Mutex<Vec<u8>>,
    ptr: *mut u8,
}

// SAFETY: `ptr` points into `host`'s buffer, never reallocated; the mutexes guard the rest.
unsafe impl Send for Staged {}
// SAFETY: as above.
unsafe impl Sync for Staged {}

impl Staged {
    fn new(device: Vec<u8>) -> Arc<Self> {
        let mut host = vec![0u8; device.len()];
        let ptr = host.as_mut_ptr();
        Arc::new(Staged {
            host: std::sync::Mutex::new(host),
            device: std::sync::Mutex::new(device),
            ptr,
        })
    }
}

// SAFETY: `ptr` is the start of `host`'s `len` bytes, which live (unmoved) as long as the block.
unsafe impl ferry::MemoryBlock for Staged {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.device.lock().unwrap().len()
    }
    fn kind(&self) -> &str {
        "test (staged)"
    }
    fn dma_view(&self) -> ferry::DmaView {
        ferry::DmaView::Staged
    }
    fn prepare_read(&self, offset: usize, len: usize) -> ferry::Result<()> {
        let device = self.device.lock().unwrap();
        self.host.lock().unwrap()[offset..offset + len].copy_from_slice(&device[offset..offset + len]);
        Ok(())
    }
    fn commit_written(&self, offset: usize, len: usize, _: ferry::Durability) -> ferry::Result<()> {
        let host = self.host.lock().unwrap();
        self.device.lock().unwrap()[offset..offset + len].copy_from_slice(&host[offset..offset + len]);
        Ok(())
    }
}

/// A local region its owner stages moves by its hooks, which the shared-memory link leaves to its
/// control link: a write sends what the device holds (not the host copy's zeros), a read lands on
/// the device; one range (the inline path) and a batch alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_memory_behind_a_host_copy_moves_by_its_hooks() {
    const LEN: usize = 64 << 10;
    let (target, initiator, peer) = shm_pair().await;
    let remote = target.alloc_host(LEN, rw()).unwrap();
    wait_for_region(&peer, &remote).await;
    let block = Staged::new(pattern(LEN, 7));
    let local = initiator.register_block(block.clone(), rw()).unwrap();
    let one = [TransferDesc::new(local.addr(), remote.addr(), 4096)];
    let batch: Vec<TransferDesc> = (1..8u64)
        .map(|i| TransferDesc::new(local.addr() + i * 8192, remote.addr() + i * 8192, 4096))
        .collect();

    for descs in [&one[..], &batch[..]] {
        initiator.transfer(&peer, Op::Write, descs, T).await.unwrap();
    }
    let at_peer = remote.to_vec().unwrap();
    let want = pattern(LEN, 7);
    for d in one.iter().chain(&batch) {
        let at = (d.remote_addr - remote.addr()) as usize;
        assert_eq!(
            at_peer[at..at + 4096],
            want[at..at + 4096],
            "a write at {at} sent the host copy"
        );
    }

    let fresh = pattern(LEN, 8);
    remote.write_at(0, &fresh).unwrap();
    for descs in [&one[..], &batch[..]] {
        initiator.transfer(&peer, Op::Read, descs, T).await.unwrap();
    }
    let device = block.device.lock().unwrap().clone();
    for d in one.iter().chain(&batch) {
        let at = (d.local_addr - local.addr()) as usize;
        assert_eq!(
            device[at..at + 4096],
            fresh[at..at + 4096],
            "a read at {at} did not reach the device"
        );
    }
    assert_eq!(device[4096..8192], want[4096..8192], "bytes between the ranges changed");
}

/// GPU memory behind a host copy, as [`Staged`] is, that names itself CUDA memory: the same-host
/// link offers to open it by its CUDA IPC handle. The address it gives is the host copy's, which no
/// driver knows as device memory, so the target can never lend it.
#[cfg(feature = "cuda")]
struct DeviceNamed(Arc<Staged>);

// SAFETY: every method forwards to `Staged`, whose promises hold.
#[cfg(feature = "cuda")]
unsafe impl ferry::MemoryBlock for DeviceNamed {
    fn as_ptr(&self) -> *mut u8 {
        self.0.as_ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn kind(&self) -> &str {
        "test (staged, named CUDA memory)"
    }
    fn dma_view(&self) -> ferry::DmaView {
        ferry::DmaView::Staged
    }
    fn device_address(&self) -> Option<ferry::DeviceAddress> {
        Some(ferry::DeviceAddress::Cuda(self.0.as_ptr() as u64))
    }
    fn prepare_read(&self, offset: usize, len: usize) -> ferry::Result<()> {
        self.0.prepare_read(offset, len)
    }
    fn commit_written(&self, offset: usize, len: usize, durability: ferry::Durability) -> ferry::Result<()> {
        self.0.commit_written(offset, len, durability)
    }
}

/// A peer's GPU memory that it cannot lend by CUDA IPC (no driver here; on a GPU host, an address
/// the driver does not know as device memory) moves over the control link, by the target's hooks:
/// a write lands on the "device", a read returns what the device holds, and the route names the
/// control link and why, never the IPC path it could not take.
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_the_peer_cannot_lend_moves_staged_and_says_so() {
    const LEN: usize = 256 << 10;
    let (target, initiator, peer) = shm_pair().await;
    let staged = Staged::new(vec![0u8; LEN]);
    let remote = target
        .register_block(Arc::new(DeviceNamed(staged.clone())), rw())
        .unwrap();
    wait_for_region(&peer, &remote).await;
    let src = initiator.register(pattern(LEN, 11), rw()).unwrap();
    let descs: Vec<TransferDesc> = (0..4u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 16), remote.addr() + (i << 16), 1 << 16))
        .collect();
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    assert_eq!(
        *staged.device.lock().unwrap(),
        pattern(LEN, 11),
        "the write did not reach the device"
    );

    let fresh = pattern(LEN, 12);
    staged.device.lock().unwrap().copy_from_slice(&fresh);
    let back = initiator.alloc_host(LEN, rw()).unwrap();
    let reads: Vec<TransferDesc> = (0..4u64)
        .map(|i| TransferDesc::new(back.addr_at(i << 16), remote.addr() + (i << 16), 1 << 16))
        .collect();
    initiator.transfer(&peer, Op::Read, &reads, T).await.unwrap();
    assert_eq!(
        back.to_vec().unwrap(),
        fresh,
        "the read did not return what the device holds"
    );

    let (_, route) = peer
        .routes()
        .into_iter()
        .find(|(ad, _)| ad.addr == remote.addr())
        .expect("the region has a route");
    assert_eq!(route.transport, TransportKind::Tcp, "{route:?}");
    let why = route.passed_over.as_deref().unwrap_or_default();
    assert!(why.contains("did not lend this GPU memory"), "{route:?}");
}

/// Device memory that copies into and out of any host memory, as CUDA's does: the bytes that count
/// are in the [`Staged`] block's `device`, and its host copy stays zero unless a path goes through
/// it. Counts the copies of each kind: through a transport's buffers (`copy_to_device`,
/// `copy_from_device`) and straight into or out of other memory (`copy_raw`).
struct AnyBuffer {
    staged: Arc<Staged>,
    buffer_copies: std::sync::atomic::AtomicUsize,
    raw_copies: std::sync::atomic::AtomicUsize,
}

// SAFETY: every promise about the host copy is `Staged`'s, whose pointer and length this forwards.
unsafe impl ferry::MemoryBlock for AnyBuffer {
    fn as_ptr(&self) -> *mut u8 {
        self.staged.as_ptr()
    }
    fn len(&self) -> usize {
        self.staged.len()
    }
    fn kind(&self) -> &str {
        "test (device copies into any buffer)"
    }
    fn dma_view(&self) -> ferry::DmaView {
        ferry::DmaView::Staged
    }
    fn prepare_read(&self, offset: usize, len: usize) -> ferry::Result<()> {
        self.staged.prepare_read(offset, len)
    }
    fn commit_written(&self, offset: usize, len: usize, durability: ferry::Durability) -> ferry::Result<()> {
        self.staged.commit_written(offset, len, durability)
    }
    fn device_copies(&self) -> Option<&dyn ferry::DeviceCopies> {
        Some(self)
    }
}

impl ferry::DeviceCopies for AnyBuffer {
    fn copy_to_device(&self, offset: usize, src: &[u8]) -> ferry::Result<()> {
        self.buffer_copies.fetch_add(1, Ordering::SeqCst);
        self.staged.device.lock().unwrap()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }
    fn copy_from_device(&self, offset: usize, dst: &mut [u8]) -> ferry::Result<()> {
        self.buffer_copies.fetch_add(1, Ordering::SeqCst);
        dst.copy_from_slice(&self.staged.device.lock().unwrap()[offset..offset + dst.len()]);
        Ok(())
    }
    unsafe fn copy_raw(&self, copies: &[ferry::RawCopy]) -> ferry::Result<()> {
        self.raw_copies.fetch_add(1, Ordering::SeqCst);
        let mut device = self.staged.device.lock().unwrap();
        for c in copies {
            let on_device = device[c.offset..c.offset + c.len].as_mut_ptr();
            // SAFETY: the host range is valid for `len` bytes (the caller's promise); the device
            // range lies in `device` (the caller checked it), which the lock keeps to this copy.
            unsafe {
                match c.to_device {
                    true => std::ptr::copy_nonoverlapping(c.host.cast_const(), on_device, c.len),
                    false => std::ptr::copy_nonoverlapping(on_device.cast_const(), c.host, c.len),
                }
            }
        }
        Ok(())
    }
}

/// Local device memory whose device copies into any host memory (CUDA's) is copied by the device
/// straight into and out of the host region the peer lent, in batches: every byte arrives, no byte
/// goes through the control link's buffers, and the host copy in front of the device stays zero,
/// transfers with integrity included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_device_memory_copies_by_its_device_into_the_peers_lent_memory() {
    const LEN: usize = 20 << 20;
    let (target, initiator, peer) = shm_pair().await;
    let remote = target.alloc_host(LEN, rw()).unwrap();
    wait_for_region(&peer, &remote).await;
    let block = Arc::new(AnyBuffer {
        staged: Staged::new(pattern(LEN, 21)),
        buffer_copies: Default::default(),
        raw_copies: Default::default(),
    });
    let local = initiator.register_block(block.clone(), rw()).unwrap();
    // One range of most of the region, and small ones after it.
    let big = LEN - (64 << 10);
    let mut descs = vec![TransferDesc::new(local.addr(), remote.addr(), big as u64)];
    descs.extend((0..4u64).map(|i| {
        let at = big as u64 + i * 16384;
        TransferDesc::new(local.addr() + at, remote.addr() + at, 4096)
    }));

    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    let at_peer = remote.to_vec().unwrap();
    let want = pattern(LEN, 21);
    for d in &descs {
        let (at, n) = ((d.remote_addr - remote.addr()) as usize, d.len as usize);
        assert!(
            at_peer[at..at + n] == want[at..at + n],
            "a write at {at} did not carry the device's bytes"
        );
    }
    assert!(
        block.raw_copies.load(Ordering::SeqCst) >= 3,
        "{} MiB went in fewer batches than 8 MiB each",
        LEN >> 20
    );

    let fresh = pattern(LEN, 22);
    remote.write_at(0, &fresh).unwrap();
    initiator.transfer(&peer, Op::Read, &descs, T).await.unwrap();
    let device = block.staged.device.lock().unwrap().clone();
    for d in &descs {
        let (at, n) = ((d.local_addr - local.addr()) as usize, d.len as usize);
        assert!(
            device[at..at + n] == fresh[at..at + n],
            "a read at {at} did not reach the device"
        );
    }
    assert_eq!(
        block.buffer_copies.load(Ordering::SeqCst),
        0,
        "bytes went over the control link"
    );

    // With integrity, this side's sums are taken of what the device holds, also past the host copy.
    for op in [Op::Write, Op::Read] {
        let options = ferry::TransferOptions::within(T).integrity(true);
        initiator.start(&peer, op, &descs, options).unwrap().await.unwrap();
    }
    assert!(
        block.staged.host.lock().unwrap().iter().all(|&b| b == 0),
        "bytes went through the host copy"
    );
}
