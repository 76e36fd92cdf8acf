//! CUDA memory written and read by a remote engine, every byte checked on the device (copied out of
//! device memory past the host copy). Without a CUDA driver and device each test prints that it
//! did not run and why; with `FERRY_REQUIRE_CUDA=1` (the GPU machine's script) it fails instead.

use std::sync::Arc;
use std::time::Duration;

use ferry::{Access, Durability, Engine, Error, MemoryBlock, Op, Peer, Region, TransferDesc, TransportKind};
use ferry_cuda::{CudaBlock, CudaDevice, CudaRegistry, PointerKind};

const T: Duration = Duration::from_secs(30);
/// Spans many TCP pieces and ends off any page boundary.
const LEN: usize = (9 << 20) + 4097;

/// Device 0, or `None` after saying why the test did not run.
fn device(what: &str) -> Option<Arc<CudaDevice>> {
    match CudaDevice::open(0) {
        Ok(device) => Some(device),
        Err(e) if std::env::var("FERRY_REQUIRE_CUDA").is_ok_and(|v| v == "1") => {
            panic!("{what} needs a CUDA device (FERRY_REQUIRE_CUDA=1): {e}")
        }
        Err(e) => {
            eprintln!("did not run: {what}: no CUDA device ({e})");
            None
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8 ^ (i >> 16) as u8)
        .collect()
}

fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {i} of {} is {:#04x}, expected {:#04x}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// Descriptors of uneven sizes that cover `[0, len)`.
fn descs(local: u64, remote: u64, len: usize) -> Vec<TransferDesc> {
    let cuts = [0usize, 1, 4097, 70_000, 400_000, 5 << 20, len];
    cuts.windows(2)
        .map(|w| TransferDesc::new(local + w[0] as u64, remote + w[0] as u64, (w[1] - w[0]) as u64))
        .collect()
}

/// A target and an initiator linked over `transport`: TCP alone, or shared memory (which moves
/// staged memory over its TCP control link, as a same-host user gets).
async fn pair(transport: TransportKind) -> (Engine, Engine, Peer) {
    let builder = || match transport {
        TransportKind::Tcp => Engine::builder().transports([TransportKind::Tcp]),
        _ => Engine::builder(),
    };
    let target = builder().listen("127.0.0.1:0").build().await.unwrap();
    let initiator = builder().build().await.unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    assert_eq!(peer.transport(), transport);
    (target, initiator, peer)
}

async fn wait_for_region(peer: &Peer, region: &Region) {
    let deadline = tokio::time::Instant::now() + T;
    while !peer.regions().iter().any(|r| r.key == region.key()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "peer never learned of the region"
        );
        peer.regions_changed(Duration::from_millis(50)).await;
    }
}

/// A peer's WRITE is on the device when it completes, and a peer's READ returns what the device
/// holds (written there past the host copy), over `transport`.
async fn round_trip(block: Arc<CudaBlock>, transport: TransportKind, what: &str) {
    let (target, initiator, peer) = pair(transport).await;
    let len = block.len();
    let region = target.register_block(block.clone(), Access::READ_WRITE).unwrap();
    assert!(region.kind().starts_with("cuda device"), "{}", region.kind());
    wait_for_region(&peer, &region).await;

    let want = pattern(len, 7);
    let src = initiator.register(want.clone(), Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Write, &descs(src.addr(), region.addr(), len), T)
        .await
        .unwrap();
    let mut on_device = vec![0u8; len];
    block.read_device(0, &mut on_device).unwrap();
    assert_bytes(
        &on_device,
        &want,
        &format!("{what}: a peer's write, read back from the device"),
    );

    let fresh = pattern(len, 99);
    block.write_device(0, &fresh).unwrap();
    let dst = initiator.register(vec![0u8; len], Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Read, &descs(dst.addr(), region.addr(), len), T)
        .await
        .unwrap();
    let mut got = vec![0u8; len];
    dst.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &fresh, &format!("{what}: a peer's read of what the device holds"));

    // GPU memory has no persistence domain: refused before anything is sent.
    let err = initiator
        .transfer_durable(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), region.addr(), 64)],
            Durability::Persistent,
            T,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    block.read_device(0, &mut on_device[..64]).unwrap();
    assert_bytes(
        &on_device[..64],
        &fresh[..64],
        &format!("{what}: nothing written after a refused persistent write"),
    );
    // A target copies between the GPU and its own buffers (TCP, and the shared-memory control
    // link) or lends the allocation (CUDA IPC): its host copy never sees a byte.
    // SAFETY: the block's host copy, `len` bytes, read while no transfer runs.
    let host_copy = unsafe { std::slice::from_raw_parts(block.as_ptr(), len) };
    assert!(
        host_copy.iter().all(|&b| b == 0),
        "{what}: the target's transfers went through its host copy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocated_memory_over_tcp_and_shared_memory() {
    let Some(device) = device("CUDA memory allocated by ferry, written and read by a peer") else {
        return;
    };
    let registry = CudaRegistry::new(device);
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let block = registry.allocate_block(LEN).unwrap();
        round_trip(block, transport, &format!("allocated, {transport:?}")).await;
    }
}

/// An initiator's own CUDA memory written to a peer's host memory, and read back into it: over TCP
/// (through the link's own buffers), over shared memory into memory the peer allocated (the device
/// copies straight into the peer's memory lent here) and into memory the peer registered (over the
/// control link). Every byte is checked on the device and at the peer, and the initiator's host
/// copy never sees a byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_initiators_own_cuda_memory_goes_past_its_host_copy() {
    let Some(device) = device("an initiator's own CUDA memory, written to and read from a peer") else {
        return;
    };
    let registry = CudaRegistry::new(device);
    for (transport, lent) in [
        (TransportKind::Tcp, false),
        (TransportKind::Shm, true),
        (TransportKind::Shm, false),
    ] {
        let what = format!("initiator's CUDA memory, {transport:?}, lent: {lent}");
        let (target, initiator, peer) = pair(transport).await;
        let remote = match lent {
            true => target.alloc_host(LEN, Access::READ_WRITE).unwrap(),
            false => target.register(vec![0u8; LEN], Access::READ_WRITE).unwrap(),
        };
        wait_for_region(&peer, &remote).await;
        let block = registry.allocate_block(LEN).unwrap();
        let local = initiator.register_block(block.clone(), Access::READ_WRITE).unwrap();

        let want = pattern(LEN, 41);
        block.write_device(0, &want).unwrap();
        initiator
            .transfer(&peer, Op::Write, &descs(local.addr(), remote.addr(), LEN), T)
            .await
            .unwrap();
        let mut at_peer = vec![0u8; LEN];
        remote.read_at(0, &mut at_peer).unwrap();
        assert_bytes(&at_peer, &want, &format!("{what}: written from the device"));

        let fresh = pattern(LEN, 43);
        remote.write_at(0, &fresh).unwrap();
        initiator
            .transfer(&peer, Op::Read, &descs(local.addr(), remote.addr(), LEN), T)
            .await
            .unwrap();
        let mut on_device = vec![0u8; LEN];
        block.read_device(0, &mut on_device).unwrap();
        assert_bytes(&on_device, &fresh, &format!("{what}: read onto the device"));

        // SAFETY: the block's host copy, `LEN` bytes, read while no transfer runs.
        let host_copy = unsafe { std::slice::from_raw_parts(block.as_ptr(), LEN) };
        assert!(
            host_copy.iter().all(|&b| b == 0),
            "{what}: the initiator's transfers went through its host copy"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn borrowed_memory_of_the_runtime_context() {
    let Some(_device) = device("CUDA memory borrowed from a pointer, written and read by a peer") else {
        return;
    };
    // As PyTorch allocates: the runtime's primary context, a plain cuMemAlloc.
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    // SAFETY: the primary context is current on this thread; the memory is freed at the end.
    let ptr = unsafe { cudarc::driver::result::malloc_sync(LEN + 4096) }.unwrap();

    let kind = ferry_cuda::classify(ptr + 4096, LEN as u64).unwrap();
    assert!(
        matches!(kind, PointerKind::Device { ordinal: 0, start, .. } if start == ptr),
        "{kind:?}"
    );
    // A range past the allocation, and host memory, are refused.
    // SAFETY: refused before anything is borrowed.
    let past = unsafe { CudaBlock::borrow(ptr + 4096, LEN + 1, None) }.unwrap_err();
    assert!(matches!(past, Error::InvalidArgument(_)), "{past:?}");
    let host = vec![0u8; 4096];
    // SAFETY: as above.
    let not_device = unsafe { CudaBlock::borrow(host.as_ptr() as u64, host.len(), None) }.unwrap_err();
    assert!(matches!(not_device, Error::InvalidArgument(_)), "{not_device:?}");

    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        // SAFETY: the allocation outlives the block, which the round trip drops with its engines.
        let block = unsafe { CudaBlock::borrow(ptr + 4096, LEN, None) }.unwrap();
        assert_eq!(block.device_ptr(), ptr + 4096);
        round_trip(block, transport, &format!("borrowed, {transport:?}")).await;
    }
    ctx.bind_to_thread().unwrap();
    // SAFETY: every block over the memory was dropped with its engine.
    unsafe { cudarc::driver::result::free_sync(ptr) }.unwrap();
}

#[test]
fn without_a_driver_the_reason_is_reported() {
    match ferry_cuda::probe() {
        Ok(devices) => {
            assert!(!devices.is_empty() || ferry_cuda::driver().unwrap().devices == 0);
            for d in &devices {
                assert!(!d.name.is_empty() && d.pci_address.contains(':'), "{d:?}");
                println!("{d:?}");
            }
        }
        Err(e) => {
            assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
            assert!(e.message().contains("CUDA"), "{e}");
            let open = CudaDevice::open(0).unwrap_err();
            assert_eq!(open.message(), e.message(), "the same reason every time");
            println!("no CUDA here, as reported: {e}");
        }
    }
}
