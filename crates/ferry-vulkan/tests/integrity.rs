//! Transfers with integrity into Vulkan memory behind a staging buffer: the target's sum is of the
//! bytes the device holds (a device copy brings them back first), not of the staging buffer. The
//! fault hook (ferry-core's `fault-hooks` feature, on in this test build) flips a byte on the device
//! right after the staged block copied a write there, leaving the staging buffer intact: only a sum
//! of the device's bytes sees it. The hook is one per process: this file holds one test.

mod common;

use common::*;
use ferry::integrity::fault;
use ferry::{Access, Error, Op, TransferDesc, TransferOptions};
use ferry_vulkan::{AllocationPath, VulkanRegistry};

const LEN: usize = (3 << 20) + 4097;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sum_of_staged_memory_is_the_devices() {
    let Some(ctx) = context("integrity over staged Vulkan memory") else {
        return;
    };
    if !offered(&ctx, AllocationPath::Staged) {
        return;
    }
    let block = VulkanRegistry::new(ctx.clone())
        .with_path(Some(AllocationPath::Staged))
        .allocate_block(LEN)
        .unwrap();
    let (target, initiator, peer) = pair().await;
    let region = target.register_block(block.clone(), Access::READ_WRITE).unwrap();
    wait_for_region(&peer, &region).await;
    // Engines of one process link over shared memory, which does not reach staged memory: the
    // region's route says so.
    let (_, route) = peer
        .routes()
        .into_iter()
        .find(|(ad, _)| ad.key == region.key())
        .expect("the region's route");
    assert_eq!(route.transport, ferry::TransportKind::Tcp, "{route:?}");
    assert!(
        route
            .passed_over
            .as_deref()
            .is_some_and(|m| m.contains("stages this region")),
        "{route:?}"
    );
    let want = pattern(LEN, 5);
    let src = initiator.register(want.clone(), Access::READ_WRITE).unwrap();
    let back = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    let write = [TransferDesc::new(src.addr(), region.addr(), LEN as u64)];
    let read = [TransferDesc::new(back.addr(), region.addr(), LEN as u64)];
    let with = |on| TransferOptions::within(T).integrity(on);
    let on_device = || {
        let mut got = vec![0u8; LEN];
        block.download(0, &mut got).unwrap();
        got.iter().zip(&want).filter(|(a, b)| a != b).count()
    };

    // No fault: checked both ways.
    initiator
        .start(&peer, Op::Write, &write, with(true))
        .unwrap()
        .await
        .unwrap();
    assert_eq!(on_device(), 0);
    initiator
        .start(&peer, Op::Read, &read, with(true))
        .unwrap()
        .await
        .unwrap();
    assert_bytes(&back.to_vec().unwrap(), &want, "read from staged memory with integrity");

    // A byte changed on the device after the write's copy, the staging buffer as written.
    for integrity in [true, false] {
        block.upload(0, &vec![0u8; LEN]).unwrap();
        assert!(fault::flip_next_device_copy(), "this test build has the fault hooks");
        let result = initiator
            .start(&peer, Op::Write, &write, with(integrity))
            .unwrap()
            .await;
        assert_eq!(fault::disarm(), 0, "the write's device copy took the flip");
        assert_eq!(on_device(), 1, "one byte differs on the device");
        match integrity {
            true => assert!(
                matches!(&result, Err(Error::Integrity(m)) if m.contains("Write")),
                "{result:?}"
            ),
            false => assert!(result.is_ok(), "without integrity nothing looks: {result:?}"),
        }
    }
}
