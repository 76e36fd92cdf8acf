//! Registration after connect, deregistration through the access guard (once it returns, sync or async, no byte of the region is touched again), engine-allocated memory.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use ferry::{Access, DmaView, Durability, Error, MemoryBlock, Op, TransferDesc};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_registered_after_connect_reach_the_peer() {
    let (target, initiator, peer) = pair().await;
    assert!(peer.regions().is_empty());
    let late = target.alloc_host(1 << 20, rw()).unwrap();
    wait_for_region(&peer, &late).await;
    let src = initiator.register(pattern(1 << 20, 4), rw()).unwrap();
    initiator
        .transfer(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), late.addr(), 1 << 20)],
            T,
        )
        .await
        .unwrap();
    assert_eq!(late.to_vec().unwrap(), pattern(1 << 20, 4));

    // Deregistration reaches the peer too, and the address is refused from then on.
    let addr = late.addr();
    target.deregister_blocking(late);
    let deadline = tokio::time::Instant::now() + T;
    while peer.regions().iter().any(|r| r.addr == addr) {
        assert!(tokio::time::Instant::now() < deadline);
        peer.regions_changed(Duration::from_millis(50)).await;
    }
    let err = initiator
        .transfer(&peer, Op::Write, &[TransferDesc::new(src.addr(), addr, 16)], T)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::OutOfBounds(_)), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_byte_is_touched_after_deregister_returns() {
    let (target, initiator, peer) = pair().await;
    const LEN: usize = 4 << 20;
    let mut backing = vec![0u8; LEN];
    // SAFETY: `backing` outlives the region: it is dropped at the end of the test, after the region.
    let region = unsafe { target.register_raw(backing.as_mut_ptr(), LEN, Access::READ_WRITE) }.unwrap();
    wait_for_region(&peer, &region).await;
    let remote = region.addr();
    let src = initiator.alloc_host(LEN, rw()).unwrap();
    src.write_at(0, &pattern(LEN, 1)).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let descs: Vec<_> = (0..4)
        .map(|i| TransferDesc::new(src.addr_at(i << 20), remote + (i << 20), 1 << 20))
        .collect();
    let writer = keep_writing(&initiator, &peer, descs, Durability::Completed, stop.clone());
    tokio::time::sleep(Duration::from_millis(100)).await;
    target.deregister_blocking(region);
    let snapshot = backing.clone();
    // Writes keep coming for a while; none may land.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let (ok, refused) = writer.await.unwrap();
    assert!(ok > 0, "some writes landed before deregistration");
    assert!(refused > 0, "some writes were refused after it");
    assert!(backing == snapshot, "memory was written after deregister returned");
    // The link survived.
    let fresh = target.alloc_host(4096, rw()).unwrap();
    wait_for_region(&peer, &fresh).await;
    initiator
        .transfer(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), fresh.addr(), 4096)],
            T,
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_allocations_are_page_aligned_and_zeroed() {
    let e = target().await;
    let page = 4096;
    for len in [1usize, 4095, 4096, 1 << 20] {
        let r = e.alloc_host(len, rw()).unwrap();
        assert_eq!(r.addr() % page, 0);
        assert_eq!(r.len(), len as u64);
        assert_eq!(r.kind(), "host (memfd)");
        assert!(r.to_vec().unwrap().iter().all(|&b| b == 0));
    }
    assert!(matches!(e.alloc_host(0, rw()), Err(Error::InvalidArgument(_))));
    assert!(matches!(e.register(Vec::new(), rw()), Err(Error::InvalidArgument(_))));
    let r = e.alloc_host(8192, rw()).unwrap();
    // SAFETY: the second registration is refused, so nothing keeps this pointer.
    let overlap = unsafe { e.register_raw(r.as_ptr().add(4096), 100, rw()) };
    assert!(matches!(overlap, Err(Error::InvalidArgument(_))));
    assert_eq!(e.region_count(), 1);
    drop(r);
    assert_eq!(e.region_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_copies_check_bounds() {
    let e = target().await;
    let r = e.register(vec![0u8; 100], Access::READ).unwrap();
    assert!(matches!(r.write_at(99, &[1, 2]), Err(Error::OutOfBounds(_))));
    assert!(matches!(r.read_at(u64::MAX, &mut [0u8; 2]), Err(Error::OutOfBounds(_))));
    r.write_at(98, &[1, 2]).unwrap();
    let mut two = [0u8; 2];
    r.read_at(98, &mut two).unwrap();
    assert_eq!(two, [1, 2]);
}

/// What the slow staged block's `prepare_read` did.
#[derive(Default)]
struct Hooks {
    started: AtomicBool,
    done: AtomicBool,
}

/// Host memory that says it is staged, whose `prepare_read` (the device copy of a staged GPU block)
/// takes [`SLOW_HOOK`]: a read of it holds a permit of the region's guard that long, off the runtime.
struct SlowStaged {
    ptr: *mut u8,
    len: usize,
    hooks: Arc<Hooks>,
}

const SLOW_HOOK: Duration = Duration::from_millis(300);

// SAFETY: `ptr` is a leaked allocation (never freed), reached only through raw pointers.
unsafe impl Send for SlowStaged {}
// SAFETY: as above.
unsafe impl Sync for SlowStaged {}

// SAFETY: `ptr` points to `len` bytes leaked by the test, valid for the rest of the process.
unsafe impl MemoryBlock for SlowStaged {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &str {
        "test (slow staged)"
    }
    fn dma_view(&self) -> DmaView {
        DmaView::Staged
    }
    fn prepare_read(&self, _offset: usize, _len: usize) -> ferry::Result<()> {
        self.hooks.started.store(true, Ordering::SeqCst);
        std::thread::sleep(SLOW_HOOK);
        self.hooks.done.store(true, Ordering::SeqCst);
        Ok(())
    }
}

/// On a current-thread runtime (one thread for both engines, the test and a ticker), a read of a
/// staged region is in flight (its device copy holds a permit) when `deregister().await` starts: the
/// runtime keeps running other tasks while it waits, it returns only once that access ended, and after
/// it returns no byte of the region is touched: a canary written then is neither overwritten nor sent.
#[tokio::test(flavor = "current_thread")]
async fn async_deregister_waits_for_a_read_in_flight_without_blocking_the_runtime() {
    let (target, region, read, hooks) = a_read_in_flight().await;
    let ticks = Arc::new(AtomicUsize::new(0));
    let ticker = {
        let ticks = ticks.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(5)).await;
                ticks.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    region.deregister().await.unwrap();
    assert!(
        hooks.done.load(Ordering::SeqCst),
        "deregister returned while the read's access was still in progress"
    );
    let ticked = ticks.load(Ordering::SeqCst);
    ticker.abort();
    assert!(
        ticked >= 5,
        "the runtime's only thread was blocked during deregistration ({ticked} ticks)"
    );
    assert_eq!(target.region_count(), 0);
    no_byte_touched_after(read).await;
}

/// A read of a slow staged region from another engine, in flight: its `prepare_read` has started
/// (holding a permit of the region's guard, off the runtime's thread) and not finished. The region's
/// memory is the test's (leaked), which the region's block does not own.
struct ReadInFlight {
    ptr: *mut u8,
    original: Vec<u8>,
    task: tokio::task::JoinHandle<(ferry::Result<()>, Vec<u8>)>,
}

const IN_FLIGHT_LEN: usize = 1 << 20;

async fn a_read_in_flight() -> (ferry::Engine, ferry::Region, ReadInFlight, Arc<Hooks>) {
    let (target, initiator, peer) = pair().await;
    let original = pattern(IN_FLIGHT_LEN, 3);
    let memory: &'static mut [u8] = Box::leak(original.clone().into_boxed_slice());
    let ptr = memory.as_mut_ptr();
    let hooks = Arc::new(Hooks::default());
    let block = Arc::new(SlowStaged {
        ptr,
        len: IN_FLIGHT_LEN,
        hooks: hooks.clone(),
    });
    let region = target.register_block(block, Access::READ_WRITE).unwrap();
    wait_for_region(&peer, &region).await;
    let remote = region.addr();

    let task = tokio::spawn(async move {
        let dst = initiator.alloc_host(IN_FLIGHT_LEN, rw()).unwrap();
        let result = initiator
            .transfer(
                &peer,
                Op::Read,
                &[TransferDesc::new(dst.addr(), remote, IN_FLIGHT_LEN as u64)],
                T,
            )
            .await;
        (result, dst.to_vec().unwrap())
    });
    let deadline = tokio::time::Instant::now() + T;
    while !hooks.started.load(Ordering::SeqCst) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the read never reached the target"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        !hooks.done.load(Ordering::SeqCst),
        "the hook runs off the runtime's thread"
    );
    (target, region, ReadInFlight { ptr, original, task }, hooks)
}

/// Paints a canary over the region's memory (deregistered: the test's again) and checks that the
/// read saw none of it and that nothing overwrote it.
async fn no_byte_touched_after(read: ReadInFlight) {
    // SAFETY: the region is deregistered; the bytes are the test's again, reached by raw pointer.
    unsafe { std::ptr::write_bytes(read.ptr, 0xEE, IN_FLIGHT_LEN) };
    let (result, got) = tokio::time::timeout(T, read.task).await.unwrap().unwrap();
    match result {
        // Finished before the guard closed: the bytes are the original ones.
        Ok(()) => assert!(got == read.original, "the read returned bytes other than the region's"),
        Err(e) => assert!(matches!(e, Error::PermissionDenied(_) | Error::OutOfBounds(_)), "{e:?}"),
    }
    assert!(
        !got.contains(&0xEE),
        "a byte of the region was read after deregistration returned"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    // SAFETY: as above; nothing else reaches these bytes.
    let after = unsafe { std::slice::from_raw_parts(read.ptr, IN_FLIGHT_LEN) };
    assert!(after.iter().all(|&b| b == 0xEE), "the canary was overwritten");
}

/// The same read in flight when the region is dropped, on a current-thread runtime: memory the
/// caller keeps (a block that does not own its bytes) must not change once the drop returns, so the
/// drop waits for the access on the thread (the access runs off it), rather than leaving the wait to
/// a task as it may for memory only the region holds.
#[tokio::test(flavor = "current_thread")]
async fn dropping_a_region_of_memory_the_caller_keeps_waits_for_a_read_in_flight() {
    let (target, region, read, hooks) = a_read_in_flight().await;
    drop(region);
    assert!(
        hooks.done.load(Ordering::SeqCst),
        "the drop returned while the read's access was still in progress"
    );
    assert_eq!(target.region_count(), 0);
    no_byte_touched_after(read).await;
}

/// Staged host memory named by an address of its own (as CUDA device memory is named by its device
/// pointer while its bytes move through a host mirror), with the ranges its hooks were called for.
struct NamedApart {
    ptr: *mut u8,
    len: usize,
    name: u64,
    committed: std::sync::Mutex<Vec<(usize, usize)>>,
    prepared: std::sync::Mutex<Vec<(usize, usize)>>,
}

// SAFETY: `ptr` is a leaked allocation (never freed), reached only through raw pointers.
unsafe impl Send for NamedApart {}
// SAFETY: as above; the hook records are behind locks.
unsafe impl Sync for NamedApart {}

impl NamedApart {
    fn new(len: usize, name: u64) -> Arc<Self> {
        Arc::new(NamedApart {
            ptr: Box::leak(vec![0u8; len].into_boxed_slice()).as_mut_ptr(),
            len,
            name,
            committed: Default::default(),
            prepared: Default::default(),
        })
    }

    fn bytes(&self) -> Vec<u8> {
        // SAFETY: `len` bytes at `ptr` are the leaked allocation; no transfer runs meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

// SAFETY: `ptr` points to `len` bytes leaked by the test, valid for the rest of the process.
unsafe impl MemoryBlock for NamedApart {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn address(&self) -> u64 {
        self.name
    }
    fn kind(&self) -> &str {
        "test (named apart)"
    }
    fn dma_view(&self) -> DmaView {
        DmaView::Staged
    }
    fn commit_written(&self, offset: usize, len: usize, durability: Durability) -> ferry::Result<()> {
        self.commit_written_ranges(&[(offset, len)], durability)
    }
    fn commit_written_ranges(&self, ranges: &[(usize, usize)], _durability: Durability) -> ferry::Result<()> {
        self.committed.lock().unwrap().extend_from_slice(ranges);
        Ok(())
    }
    fn prepare_read(&self, offset: usize, len: usize) -> ferry::Result<()> {
        self.prepare_read_ranges(&[(offset, len)])
    }
    fn prepare_read_ranges(&self, ranges: &[(usize, usize)]) -> ferry::Result<()> {
        self.prepared.lock().unwrap().extend_from_slice(ranges);
        Ok(())
    }
}

/// A region whose block names itself apart from its pointer is known, advertised and addressed
/// by that name on both sides of a transfer, while the bytes move through the pointer and the
/// hooks see the ranges: a peer's WRITE to `name + offset` lands at `ptr + offset`, and a READ into
/// such a local region, described by its name, lands in its memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_named_apart_from_their_memory_are_addressed_by_name() {
    const LEN: usize = 256 << 10;
    let (target, initiator, peer) = pair().await;
    let remote_block = NamedApart::new(LEN, 0x6100_0000_0000);
    let remote = target.register_block(remote_block.clone(), rw()).unwrap();
    assert_eq!(remote.addr(), 0x6100_0000_0000);
    wait_for_region(&peer, &remote).await;
    assert!(
        peer.regions()
            .iter()
            .any(|r| r.key == remote.key() && r.addr == remote.addr())
    );

    let src = initiator.register(pattern(LEN, 9), rw()).unwrap();
    let descs = [
        TransferDesc::new(src.addr(), remote.addr(), 4096),
        TransferDesc::new(src.addr() + 4096, remote.addr() + 4096, (LEN - 4096) as u64),
    ];
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    assert_eq!(
        remote_block.bytes(),
        pattern(LEN, 9),
        "the bytes landed in the block's memory"
    );
    let committed: u64 = remote_block
        .committed
        .lock()
        .unwrap()
        .iter()
        .map(|&(_, n)| n as u64)
        .sum();
    assert_eq!(committed, LEN as u64, "the commit hook saw every written byte");
    assert_eq!(remote.to_vec().unwrap(), pattern(LEN, 9));

    // The same kind of block as the initiator's local side, named in the descriptor.
    let local_block = NamedApart::new(LEN, 0x6200_0000_0000);
    let local = initiator.register_block(local_block.clone(), rw()).unwrap();
    initiator
        .transfer(
            &peer,
            Op::Read,
            &[TransferDesc::new(local.addr(), remote.addr(), LEN as u64)],
            T,
        )
        .await
        .unwrap();
    assert_eq!(
        local_block.bytes(),
        pattern(LEN, 9),
        "a READ into it landed in its memory"
    );
    assert!(
        !remote_block.prepared.lock().unwrap().is_empty(),
        "the target prepared its read"
    );

    // Its host pointer is no name: descriptors must use the region's address.
    let err = initiator
        .transfer(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), remote_block.ptr as u64, 16)],
            T,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::OutOfBounds(_)), "{err:?}");
}
