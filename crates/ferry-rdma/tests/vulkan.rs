//! RDMA into and out of Vulkan device-local memory, which the NIC reaches through a host staging
//! buffer: written bytes must reach the device buffer, and READs must return what the device holds.
//! The device buffer is checked through a GPU copy (vkCmdCopyBuffer) into memory of its own.
//!
//! Inside the rig (`cargo xtask rig test`) the guest sees the host's file system, so Mesa's lavapipe
//! (`mesa-vulkan-drivers`) is the Vulkan driver there, and a missing driver or device is a failure.
//! Outside the rig there is no RDMA device: the tests say so and return.

use std::sync::Arc;

use ferry::{Access, Engine, Op, Peer, Region, TransferDesc};
use ferry_vulkan::{AllocationPath, INSTALL_HINT, VulkanBlock, VulkanContext, VulkanRegistry};

mod common;
use common::{T, assert_bytes, in_rig, pair, pattern, uneven_descs, wait_for};

/// Spans several staging chunks and ends off any page boundary.
const LEN: usize = (3 << 20) + 4097;

/// The Vulkan context, or `None` (after saying so) outside the rig where there is no driver.
fn context() -> Option<Arc<VulkanContext>> {
    match VulkanContext::from_env() {
        Ok(c) => Some(c),
        Err(e) => {
            assert!(
                !in_rig(),
                "inside the rig lavapipe must be usable: {e}; install it: {INSTALL_HINT}"
            );
            eprintln!("skipped: no usable Vulkan driver here ({e})");
            None
        }
    }
}

fn block(ctx: &Arc<VulkanContext>, path: AllocationPath) -> Arc<VulkanBlock> {
    let block = VulkanRegistry::new(ctx.clone())
        .with_path(Some(path))
        .allocate_block(LEN)
        .unwrap();
    assert_eq!(block.is_staged(), path == AllocationPath::Staged);
    block
}

/// What the device buffer of `block` holds, through a GPU copy into host-visible memory.
fn device_bytes(ctx: &Arc<VulkanContext>, block: &VulkanBlock) -> Vec<u8> {
    let check = self::block(ctx, AllocationPath::HostVisible);
    ctx.copy(block, 0, &*check, 0, LEN as u64).unwrap();
    let mut got = vec![0u8; LEN];
    check.download(0, &mut got).unwrap();
    got
}

/// Puts `bytes` on the device buffer of `block` only: a GPU copy from host-visible memory.
fn device_write(ctx: &Arc<VulkanContext>, block: &VulkanBlock, bytes: &[u8]) {
    let source = self::block(ctx, AllocationPath::HostVisible);
    source.upload(0, bytes).unwrap();
    ctx.copy(&*source, 0, block, 0, LEN as u64).unwrap();
}

fn descs(local: u64, remote: u64) -> Vec<TransferDesc> {
    uneven_descs(local, remote, LEN)
}

/// Two engines over RDMA, the target's region device-local GPU memory behind a staging buffer. Bind
/// every field when destructuring (`_target` too): a field left to `..` drops the target engine at once.
struct StagedTarget {
    ctx: Arc<VulkanContext>,
    _target: Engine,
    initiator: Engine,
    peer: Peer,
    gpu: Arc<VulkanBlock>,
    region: Region,
}

async fn staged_target() -> Option<StagedTarget> {
    let ctx = context()?;
    let (target, initiator, peer) = pair().await?;
    let gpu = block(&ctx, AllocationPath::Staged);
    let region = target.register_block(gpu.clone(), Access::READ_WRITE).unwrap();
    wait_for(&peer, &region).await;
    Some(StagedTarget {
        ctx,
        _target: target,
        initiator,
        peer,
        gpu,
        region,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_writes_into_staged_gpu_memory_reach_the_device() {
    let Some(StagedTarget {
        ctx,
        initiator,
        peer,
        gpu,
        region,
        _target,
    }) = staged_target().await
    else {
        return;
    };
    let want = pattern(LEN, 7);
    let src = initiator.register(want.clone(), Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Write, &descs(src.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(&device_bytes(&ctx, &gpu), &want, "the device buffer after RDMA WRITEs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_reads_from_staged_gpu_memory_see_the_device() {
    let Some(StagedTarget {
        ctx,
        initiator,
        peer,
        gpu,
        region,
        _target,
    }) = staged_target().await
    else {
        return;
    };
    let want = pattern(LEN, 99);
    device_write(&ctx, &gpu, &want);
    let back = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    initiator
        .transfer(&peer, Op::Read, &descs(back.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(&back.to_vec().unwrap(), &want, "RDMA READs of device-written bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_staged_gpu_memory_over_rdma() {
    let Some(ctx) = context() else { return };
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let remote = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
    wait_for(&peer, &remote).await;
    let gpu = block(&ctx, AllocationPath::Staged);
    let local = initiator.register_block(gpu.clone(), Access::READ_WRITE).unwrap();
    // A READ into local GPU memory lands on the device.
    let want = pattern(LEN, 3);
    remote.write_at(0, &want).unwrap();
    initiator
        .transfer(&peer, Op::Read, &descs(local.addr(), remote.addr()), T)
        .await
        .unwrap();
    assert_bytes(
        &device_bytes(&ctx, &gpu),
        &want,
        "the local device buffer after RDMA READs",
    );
    // A WRITE from local GPU memory sends what the device holds.
    let want = pattern(LEN, 4);
    device_write(&ctx, &gpu, &want);
    initiator
        .transfer(&peer, Op::Write, &descs(local.addr(), remote.addr()), T)
        .await
        .unwrap();
    assert_bytes(&remote.to_vec().unwrap(), &want, "RDMA WRITEs of device-written bytes");
}
