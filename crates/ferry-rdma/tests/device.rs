//! RDMA into and out of memory that declares `DmaView::Device`: the NIC must reach the device memory
//! at the address the block names for it, at the region's own address, with no host copy and no hook
//! in between; a NIC that refuses that address must get the host copy, with the hooks around it; and
//! TCP, which only the CPU drives, must always go through the host copy and the hooks.
//!
//! The device is emulated: a second buffer of host memory stands for the GPU's memory, the block's
//! pointer is its host copy, and its hooks copy between the two (the GPU copies a real block makes).
//! Soft-RoCE registers any mapped memory, so it reaches that buffer as a GPUDirect NIC reaches a
//! GPU's. Every test can tell the paths apart: the host copy and the device hold different bytes, and
//! the block counts its hook calls.
//!
//! The RDMA tests run inside the rig (`cargo xtask rig test`); elsewhere they say so and return. The
//! TCP test runs everywhere.

use std::alloc::Layout;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ferry::{Access, DmaView, Durability, Engine, MemoryBlock, Op, TransferDesc, TransportKind};

mod common;
use common::{T, assert_bytes, builder, client, pair, pattern, rdma_key, tls, uneven_descs, wait_for};

/// Several pages, ending off a page boundary.
const LEN: usize = (1 << 20) + 4097;

/// A page-aligned buffer of `len` bytes (plus `skew` bytes before the first), freed on drop.
struct Buffer {
    first: *mut u8,
    layout: Layout,
    skew: usize,
}

impl Buffer {
    fn new(bytes: &[u8], skew: usize) -> Self {
        let layout = Layout::from_size_align(bytes.len() + skew, PAGE).unwrap();
        // SAFETY: the layout's size is not zero (every test buffer has bytes).
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!base.is_null(), "allocating a test buffer");
        // SAFETY: `skew + bytes.len()` bytes were just allocated at `base`.
        let first = unsafe { base.add(skew) };
        // SAFETY: as above; the new allocation does not overlap `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), first, bytes.len()) };
        Buffer { first, layout, skew }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, `skew` bytes before `first`.
        unsafe { std::alloc::dealloc(self.first.sub(self.skew), self.layout) };
    }
}

const PAGE: usize = 4096;

/// Emulated device memory behind a host copy. Both buffers are owned here and freed on drop, after
/// the engine has dropped its last handle (which it does only once the region is deregistered).
struct EmulatedDevice {
    host: Buffer,
    device: Buffer,
    len: usize,
    /// What the block tells NICs to register; the device buffer unless a test says otherwise.
    nic_address: u64,
    hook_calls: AtomicUsize,
}

// SAFETY: the two buffers are owned by this value; their bytes are only reached through raw pointers
// (by the engine, the NIC and the helpers below).
unsafe impl Send for EmulatedDevice {}
// SAFETY: as above.
unsafe impl Sync for EmulatedDevice {}

impl EmulatedDevice {
    /// A block whose host copy holds `host` and whose device holds `device`, both page-aligned, as a
    /// staging buffer and device memory are.
    fn new(host: &[u8], device: &[u8]) -> Arc<Self> {
        EmulatedDevice::with_device_skew(host, device, 0)
    }

    /// [`new`](Self::new) with the device memory starting `skew` bytes into a page.
    fn with_device_skew(host: &[u8], device: &[u8], skew: usize) -> Arc<Self> {
        assert_eq!(host.len(), device.len());
        let (host, device) = (Buffer::new(host, 0), Buffer::new(device, skew));
        Arc::new(EmulatedDevice {
            nic_address: device.first as u64,
            len: device.layout.size() - skew,
            host,
            device,
            hook_calls: AtomicUsize::new(0),
        })
    }

    /// A block whose device memory no NIC can reach: it names an address where nothing is mapped, so
    /// registering it fails, as it does for a NIC without access to a GPU's memory. The device
    /// buffer is still reached through the hooks.
    fn unreachable_by_nics(host: &[u8], device: &[u8]) -> Arc<Self> {
        let mut block = Arc::into_inner(EmulatedDevice::new(host, device)).expect("just made");
        block.nic_address = 0;
        Arc::new(block)
    }

    fn device_bytes(&self) -> Vec<u8> {
        // SAFETY: the device buffer holds `len` bytes this value owns; no transfer is in flight when a
        // test looks.
        unsafe { std::slice::from_raw_parts(self.device.first, self.len) }.to_vec()
    }

    fn host_bytes(&self) -> Vec<u8> {
        // SAFETY: as for `device_bytes`.
        unsafe { std::slice::from_raw_parts(self.host.first, self.len) }.to_vec()
    }

    fn set_device(&self, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.len);
        // SAFETY: the device buffer holds `len` bytes this value owns; nothing else touches them
        // meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.device.first, self.len) };
    }

    fn hook_calls(&self) -> usize {
        self.hook_calls.load(Ordering::SeqCst)
    }
}

// SAFETY: the host and device buffers hold `len` bytes each, owned by the block and valid while it
// lives; `nic_address` is the device buffer, or (`unreachable_by_nics`) an address no NIC can
// register, which is then never reached.
unsafe impl MemoryBlock for EmulatedDevice {
    fn as_ptr(&self) -> *mut u8 {
        self.host.first
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &str {
        "test (emulated device memory)"
    }
    fn dma_view(&self) -> DmaView {
        DmaView::Device {
            nic_address: self.nic_address,
        }
    }
    fn commit_written(&self, offset: usize, len: usize, _durability: Durability) -> ferry::Result<()> {
        self.hook_calls.fetch_add(1, Ordering::SeqCst);
        assert!(offset + len <= self.len, "a hook past the block's end");
        // SAFETY: both ranges lie inside buffers of `len` bytes that this value owns.
        unsafe { std::ptr::copy_nonoverlapping(self.host.first.add(offset), self.device.first.add(offset), len) };
        Ok(())
    }
    fn prepare_read(&self, offset: usize, len: usize) -> ferry::Result<()> {
        self.hook_calls.fetch_add(1, Ordering::SeqCst);
        assert!(offset + len <= self.len, "a hook past the block's end");
        // SAFETY: as in `commit_written`.
        unsafe { std::ptr::copy_nonoverlapping(self.device.first.add(offset), self.host.first.add(offset), len) };
        Ok(())
    }
}

fn descs(local: u64, remote: u64) -> Vec<TransferDesc> {
    uneven_descs(local, remote, LEN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_writes_land_in_device_memory_with_no_host_copy() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let stale = pattern(LEN, 1);
    let block = EmulatedDevice::new(&stale, &stale);
    let region = target.register_block(block.clone(), Access::READ_WRITE).unwrap();
    wait_for(&peer, &region).await;

    let want = pattern(LEN, 2);
    let src = initiator.register(want.clone(), Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Write, &descs(src.addr(), region.addr()), T)
        .await
        .unwrap();
    // Through the host copy, the bytes would be in `host`; a commit hook after them would have put
    // the stale host copy over the device.
    assert_bytes(&block.device_bytes(), &want, "the device after RDMA WRITEs");
    assert_bytes(&block.host_bytes(), &stale, "the host copy after RDMA WRITEs");
    assert_eq!(block.hook_calls(), 0, "no hook runs around the NIC's access");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_reads_come_from_device_memory_with_no_host_copy() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let (in_host, on_device) = (pattern(LEN, 3), pattern(LEN, 4));
    let block = EmulatedDevice::new(&in_host, &on_device);
    let region = target.register_block(block.clone(), Access::READ_WRITE).unwrap();
    wait_for(&peer, &region).await;

    let back = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Read, &descs(back.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(&back.to_vec().unwrap(), &on_device, "RDMA READs of device memory");
    assert_bytes(&block.host_bytes(), &in_host, "the host copy after RDMA READs");
    assert_eq!(block.hook_calls(), 0, "no hook runs around the NIC's access");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_device_memory_is_what_the_nic_reads_and_writes() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let remote = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
    wait_for(&peer, &remote).await;
    let stale = pattern(LEN, 5);
    let block = EmulatedDevice::new(&stale, &stale);
    let local = initiator.register_block(block.clone(), Access::READ_WRITE).unwrap();

    // A READ into local device memory lands on the device.
    let want = pattern(LEN, 6);
    remote.write_at(0, &want).unwrap();
    initiator
        .transfer(&peer, Op::Read, &descs(local.addr(), remote.addr()), T)
        .await
        .unwrap();
    assert_bytes(&block.device_bytes(), &want, "the local device after RDMA READs");
    assert_bytes(&block.host_bytes(), &stale, "the local host copy after RDMA READs");

    // A WRITE from local device memory sends what the device holds, not the host copy.
    let want = pattern(LEN, 7);
    block.set_device(&want);
    initiator
        .transfer(&peer, Op::Write, &descs(local.addr(), remote.addr()), T)
        .await
        .unwrap();
    assert_bytes(&remote.to_vec().unwrap(), &want, "RDMA WRITEs from local device memory");
    assert_eq!(block.hook_calls(), 0, "no hook runs around the NIC's access");
}

/// On an engine that authenticates its links, each peer's registration of the region (in its own
/// protection domain, at its own base) reaches the device memory too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_peer_reaches_device_memory_through_its_own_registration() {
    let target = builder().listen("127.0.0.1:0").tls(tls("cache")).build().await.unwrap();
    let stale = pattern(LEN, 14);
    let block = EmulatedDevice::new(&stale, &stale);
    let region = target.register_block(block.clone(), Access::READ_WRITE).unwrap();
    region.grant("writer", Access::READ_WRITE).await.unwrap();
    let Some((writer, peer)) = client("writer", &target).await else {
        return;
    };
    let base = region.addr_for("writer");
    let ad = peer
        .regions()
        .iter()
        .find(|a| a.addr == base)
        .cloned()
        .expect("the writer was told of the region at its own base");
    let key = rdma_key(&ad);
    assert!(!key.hooked && key.bounce_addr.is_none(), "{key:?}");

    let want = pattern(LEN, 15);
    let src = writer.register(want.clone(), Access::READ_WRITE).unwrap();
    writer
        .transfer(&peer, Op::Write, &descs(src.addr(), base), T)
        .await
        .unwrap();
    assert_bytes(
        &block.device_bytes(),
        &want,
        "the device after the granted peer's WRITEs",
    );
    assert_bytes(
        &block.host_bytes(),
        &stale,
        "the host copy after the granted peer's WRITEs",
    );
    let back = writer.alloc_host(LEN, Access::READ_WRITE).unwrap();
    writer
        .transfer(&peer, Op::Read, &descs(back.addr(), base), T)
        .await
        .unwrap();
    assert_bytes(
        &back.to_vec().unwrap(),
        &want,
        "the granted peer's READs of device memory",
    );
    assert_eq!(block.hook_calls(), 0, "no hook runs around the NIC's access");
}

/// Device memory the NIC cannot register gets the host copy registered instead: the transfer still
/// succeeds over RDMA, with the hooks keeping the device and the copy coherent, as for staged memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nic_that_cannot_reach_the_device_goes_through_the_host_copy() {
    let stale = pattern(LEN, 8);
    refused_device_goes_through_the_host_copy(EmulatedDevice::unreachable_by_nics(&stale, &stale)).await;
}

/// The same when the device memory and its host copy start at different offsets within a page, which
/// the NIC cannot map one onto the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_off_the_host_copys_page_offset_goes_through_the_host_copy() {
    let stale = pattern(LEN, 8);
    refused_device_goes_through_the_host_copy(EmulatedDevice::with_device_skew(&stale, &stale, 64)).await;
}

async fn refused_device_goes_through_the_host_copy(block: Arc<EmulatedDevice>) {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let region = target.register_block(block.clone(), Access::READ_WRITE).unwrap();
    wait_for(&peer, &region).await;
    assert_eq!(peer.transport(), TransportKind::Rdma);

    let want = pattern(LEN, 9);
    let src = initiator.register(want.clone(), Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Write, &descs(src.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(
        &block.device_bytes(),
        &want,
        "the device after WRITEs through the host copy",
    );
    assert!(block.hook_calls() > 0, "the commit hook took the bytes to the device");

    let on_device = pattern(LEN, 10);
    block.set_device(&on_device);
    let back = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Read, &descs(back.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(&back.to_vec().unwrap(), &on_device, "READs through the host copy");
}

/// TCP is driven by the CPU, which reaches only the host copy: a write is committed to the device
/// and a read is prepared from it, at both ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_goes_through_the_host_copy_and_the_hooks() {
    let tcp = || Engine::builder().transports([TransportKind::Tcp]);
    let target = tcp().listen("127.0.0.1:0").build().await.unwrap();
    let initiator = tcp().build().await.unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    let stale = pattern(LEN, 11);
    let remote_block = EmulatedDevice::new(&stale, &stale);
    let region = target.register_block(remote_block.clone(), Access::READ_WRITE).unwrap();
    wait_for(&peer, &region).await;
    let local_block = EmulatedDevice::new(&stale, &pattern(LEN, 12));
    let local = initiator
        .register_block(local_block.clone(), Access::READ_WRITE)
        .unwrap();

    // From the local device (prepared into its host copy) to the remote device (committed from its
    // host copy).
    initiator
        .transfer(&peer, Op::Write, &descs(local.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(
        &remote_block.device_bytes(),
        &pattern(LEN, 12),
        "the remote device after a TCP write",
    );

    // And back: the remote device's bytes reach the local device.
    remote_block.set_device(&pattern(LEN, 13));
    initiator
        .transfer(&peer, Op::Read, &descs(local.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(
        &local_block.device_bytes(),
        &pattern(LEN, 13),
        "the local device after a TCP read",
    );
}
