//! A peer writes into and reads from Vulkan memory; the GPU side is checked with device copies
//! (vkCmdCopyBuffer), every byte compared on the host. The two engines of one process link over
//! shared memory, which moves staged memory (either side's) over its TCP control link and the rest
//! itself: these tests see the paths a same-host user gets.

mod common;

use std::sync::Arc;

use common::*;
use ferry::{Access, MemoryBlock, Op, TransferDesc};
use ferry_vulkan::{AllocationPath, VulkanBlock, VulkanContext, VulkanRegistry};

/// Spans several staging chunks and TCP pieces, and ends off any page or chunk boundary.
const LEN: usize = (9 << 20) + 4097;

/// Descriptors of uneven sizes that cover `[0, LEN)`: a single byte, small ones coalesced through the
/// engine's coalescing pool, and large ones split across streams.
fn descs(local: u64, remote: u64) -> Vec<TransferDesc> {
    let cuts = [0usize, 1, 4097, 70_000, 400_000, 5 << 20, LEN];
    cuts.windows(2)
        .map(|w| TransferDesc::new(local + w[0] as u64, remote + w[0] as u64, (w[1] - w[0]) as u64))
        .collect()
}

fn expected_kind(path: AllocationPath) -> &'static str {
    match path {
        AllocationPath::HostVisible => "vulkan host-visible",
        AllocationPath::Staged => "vulkan device-local (staged)",
        AllocationPath::RdmaCapable => "vulkan rdma-capable",
    }
}

async fn write_lands_on_device(path: AllocationPath) {
    let Some(ctx) = context("write into Vulkan memory over TCP") else {
        return;
    };
    if !offered(&ctx, path) {
        return;
    }
    let registry = VulkanRegistry::new(ctx.clone()).with_path(Some(path));
    let block = registry.allocate_block(LEN).unwrap();
    assert_eq!(block.path(), path);
    assert_eq!(block.is_staged(), path == AllocationPath::Staged);
    // The RDMA transport ranks rails by the GPU's PCIe path only where a NIC's DMA reaches the GPU's
    // own memory: never through a staging buffer, never on a CPU driver or an integrated GPU.
    let host_side =
        path == AllocationPath::Staged || ["cpu", "integrated-gpu"].contains(&ctx.info().device_type.as_str());
    if host_side {
        assert_eq!(block.pci_device(), None);
    }
    let (target, initiator, peer) = pair().await;
    let region = target.register_block(block.clone(), Access::READ_WRITE).unwrap();
    assert_eq!(region.kind(), expected_kind(path));
    wait_for_region(&peer, &region).await;

    let want = pattern(LEN, 7);
    let src = initiator.register(want.clone(), Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Write, &descs(src.addr(), region.addr()), T)
        .await
        .unwrap();

    // The device buffer itself (not the staging buffer) must hold the bytes: copy it on the GPU into
    // a buffer of its own and read that on the host (through its mapping, or its own staging copy).
    let check = VulkanRegistry::new(ctx.clone())
        .with_path(Some(host_reachable_path(&ctx)))
        .allocate_block(LEN)
        .unwrap();
    ctx.copy(&*block, 0, &*check, 0, LEN as u64).unwrap();
    let mut got = vec![0u8; LEN];
    check.download(0, &mut got).unwrap();
    assert_bytes(&got, &want, &format!("{path} write, after a device copy"));
}

async fn read_sees_device_writes(path: AllocationPath) {
    let Some(ctx) = context("read from Vulkan memory over TCP") else {
        return;
    };
    if !offered(&ctx, path) {
        return;
    }
    let registry = VulkanRegistry::new(ctx.clone()).with_path(Some(path));
    let block = registry.allocate_block(LEN).unwrap();
    let (target, initiator, peer) = pair().await;
    let region = target.register_block(block.clone(), Access::READ_WRITE).unwrap();
    wait_for_region(&peer, &region).await;

    // Only the device writes the region: a source the host fills, copied on the GPU into it.
    let want = pattern(LEN, 99);
    let source = VulkanRegistry::new(ctx.clone())
        .with_path(Some(host_reachable_path(&ctx)))
        .allocate_block(LEN)
        .unwrap();
    source.upload(0, &want).unwrap();
    ctx.copy(&*source, 0, &*block, 0, LEN as u64).unwrap();

    let back = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Read, &descs(back.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(
        &back.to_vec().unwrap(),
        &want,
        &format!("{path} read of device-written bytes"),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_into_host_visible_memory_lands_on_device() {
    write_lands_on_device(AllocationPath::HostVisible).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_into_staged_memory_lands_on_device() {
    write_lands_on_device(AllocationPath::Staged).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_from_host_visible_memory_sees_device_copy() {
    read_sees_device_writes(AllocationPath::HostVisible).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_from_staged_memory_sees_device_copy() {
    read_sees_device_writes(AllocationPath::Staged).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alloc_from_picks_the_best_offered_path() {
    let Some(ctx) = context("automatic path choice") else {
        return;
    };
    let registry = VulkanRegistry::new(ctx.clone());
    let target = ferry::Engine::builder().build().await.unwrap();
    let region = target.alloc_from(&registry, 1 << 20, Access::READ_WRITE).unwrap();
    let paths = ctx.paths();
    // Mapped memory the CPU reads uncached (a discrete GPU's BAR) gives way to the staged path.
    let mapped_uncached = !ctx.info().memory_types.iter().any(|t| {
        ["device-local", "host-visible", "host-cached"]
            .iter()
            .all(|f| t.flags.iter().any(|have| have == f))
    });
    let want = if paths.rdma {
        "vulkan rdma-capable"
    } else if paths.host_visible && !(mapped_uncached && paths.staged) {
        "vulkan host-visible"
    } else {
        "vulkan device-local (staged)"
    };
    assert!(region.kind().starts_with(want), "{} on {:?}", region.kind(), paths);
    // Bytes written through the region's copy-in land in the (mapped or staged) host side.
    let block = registry.allocate_block(4096).unwrap();
    assert_eq!(block.len(), 4096);
    block.upload(100, b"ferry").unwrap();
    let mut out = [0u8; 5];
    block.download(100, &mut out).unwrap();
    assert_eq!(&out, b"ferry");
    assert!(block.upload(4092, b"ferry").is_err(), "past the end");
}

/// Blocks of the scattered tests: every other one of `COUNT`, `BLOCK` bytes each.
const BLOCK: usize = 16 << 10;
const COUNT: usize = 128;
const SCATTERED: usize = 2 * BLOCK * COUNT;

/// A staged block of `SCATTERED` bytes whose device memory holds `bytes`, put there by a GPU copy alone
/// (its staging buffer never saw them), and a host-reachable block to read the device through.
struct DeviceHeld {
    ctx: Arc<VulkanContext>,
    block: Arc<VulkanBlock>,
    host_side: Arc<VulkanBlock>,
    bytes: Vec<u8>,
}

impl DeviceHeld {
    /// `None` (the test skips, saying so) where the device offers no staged path.
    fn new(ctx: &Arc<VulkanContext>, bytes: Vec<u8>) -> Option<Self> {
        if !offered(ctx, AllocationPath::Staged) {
            return None;
        }
        let block = VulkanRegistry::new(ctx.clone())
            .with_path(Some(AllocationPath::Staged))
            .allocate_block(SCATTERED)
            .unwrap();
        let host_side = VulkanRegistry::new(ctx.clone())
            .with_path(Some(host_reachable_path(ctx)))
            .allocate_block(SCATTERED)
            .unwrap();
        host_side.upload(0, &bytes).unwrap();
        ctx.copy(&*host_side, 0, &*block, 0, SCATTERED as u64).unwrap();
        Some(DeviceHeld {
            ctx: ctx.clone(),
            block,
            host_side,
            bytes,
        })
    }

    /// What the device memory holds now, read through a GPU copy.
    fn on_device(&self) -> Vec<u8> {
        self.ctx
            .copy(&*self.block, 0, &*self.host_side, 0, SCATTERED as u64)
            .unwrap();
        let mut got = vec![0u8; SCATTERED];
        self.host_side.download(0, &mut got).unwrap();
        got
    }
}

/// Scattered ranges of one staged region, written in one batch (several to a frame, whose device
/// copies are submitted together) and read back: each range reaches the device, and the bytes between
/// them keep what the device held, which the staging buffer never saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scattered_ranges_of_staged_memory_move_exactly() {
    let Some(ctx) = context("scattered ranges of staged Vulkan memory") else {
        return;
    };
    let Some(staged) = DeviceHeld::new(&ctx, pattern(SCATTERED, 3)) else {
        return;
    };
    let (block, before) = (staged.block.clone(), staged.bytes.clone());

    let (target, initiator, peer) = pair().await;
    let region = target.register_block(block.clone(), Access::READ_WRITE).unwrap();
    wait_for_region(&peer, &region).await;
    let written = pattern(SCATTERED, 4);
    let src = initiator.register(written.clone(), Access::READ_WRITE).unwrap();
    // Every other block, shifted off any page boundary, in reverse order on the target.
    let ranges: Vec<(usize, usize)> = (0..COUNT)
        .map(|i| (i * 2 * BLOCK, (COUNT - 1 - i) * 2 * BLOCK + 1000))
        .collect();
    let descs: Vec<TransferDesc> = ranges
        .iter()
        .map(|&(local, remote)| {
            TransferDesc::new(src.addr() + local as u64, region.addr() + remote as u64, BLOCK as u64)
        })
        .collect();
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();

    let mut want = before.clone();
    for &(local, remote) in &ranges {
        want[remote..remote + BLOCK].copy_from_slice(&written[local..local + BLOCK]);
    }
    assert_bytes(
        &staged.on_device(),
        &want,
        "scattered staged writes, after a device copy",
    );

    // Read back the same ranges, and the gaps' first bytes, which only the device holds.
    let back = initiator.alloc_host(SCATTERED, Access::READ_WRITE).unwrap();
    let reads: Vec<TransferDesc> = ranges
        .iter()
        .map(|&(local, remote)| {
            TransferDesc::new(
                back.addr() + local as u64,
                region.addr() + remote as u64 - 1000,
                BLOCK as u64,
            )
        })
        .collect();
    initiator.transfer(&peer, Op::Read, &reads, T).await.unwrap();
    let back = back.to_vec().unwrap();
    for &(local, remote) in &ranges {
        let remote = remote - 1000;
        assert_bytes(
            &back[local..local + BLOCK],
            &want[remote..remote + BLOCK],
            "scattered staged read",
        );
    }
}

/// The same from the initiator's side: scattered ranges of a staged region are written to a peer
/// (brought from the device first) and read from it into the region (taken to the device after),
/// every range exactly, the gaps untouched on the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scattered_ranges_of_local_staged_memory_move_exactly() {
    let Some(ctx) = context("scattered ranges of local staged Vulkan memory") else {
        return;
    };
    let Some(staged) = DeviceHeld::new(&ctx, pattern(SCATTERED, 5)) else {
        return;
    };
    let (block, on_device) = (staged.block.clone(), staged.bytes.clone());

    let (target, initiator, peer) = pair().await;
    let local = initiator.register_block(block.clone(), Access::READ_WRITE).unwrap();
    let remote = target.alloc_host(SCATTERED, Access::READ_WRITE).unwrap();
    wait_for_region(&peer, &remote).await;
    let ranges: Vec<(usize, usize)> = (0..COUNT)
        .map(|i| (i * 2 * BLOCK + 1000, (COUNT - 1 - i) * 2 * BLOCK))
        .collect();
    let descs: Vec<TransferDesc> = ranges
        .iter()
        .map(|&(l, r)| TransferDesc::new(local.addr() + l as u64, remote.addr() + r as u64, BLOCK as u64))
        .collect();

    // Out of the device: what the peer gets is what only the device held.
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    let at_peer = remote.to_vec().unwrap();
    for &(l, r) in &ranges {
        assert_bytes(
            &at_peer[r..r + BLOCK],
            &on_device[l..l + BLOCK],
            "scattered write from staged memory",
        );
    }

    // Into the device: the ranges change, the gaps keep the device's bytes.
    let fresh = pattern(SCATTERED, 6);
    remote.write_at(0, &fresh).unwrap();
    initiator.transfer(&peer, Op::Read, &descs, T).await.unwrap();
    let mut want = on_device.clone();
    for &(l, r) in &ranges {
        want[l..l + BLOCK].copy_from_slice(&fresh[r..r + BLOCK]);
    }
    assert_bytes(
        &staged.on_device(),
        &want,
        "scattered reads into staged memory, after a device copy",
    );
}
