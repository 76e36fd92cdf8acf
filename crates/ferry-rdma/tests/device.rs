//! RDMA into and out of memory that declares `DmaView::Device`: the NIC must reach the device memory
//! at the address the block names for it, at the region's own address, with no host copy and no hook
//! in between; a NIC that refuses that address must get the host copy, with the hooks around it; and
//! TCP, which only the CPU drives, must always go through the host copy and the hooks.
//!
//! The device is emulated ([`EmulatedDevice`]): Soft-RoCE registers any mapped memory, so it reaches
//! the emulated device as a GPUDirect NIC reaches a GPU's memory. Every test can tell the paths apart:
//! the host copy and the device hold different bytes, and the block counts its hook calls.
//!
//! The RDMA tests run inside the rig (`cargo xtask rig test`); elsewhere they say so and return. The
//! TCP test runs everywhere.

use std::sync::Arc;

use ferry::{Access, Engine, Op, TransferDesc, TransportKind};

mod common;
use common::emulated::EmulatedDevice;
use common::{T, assert_bytes, builder, client, pair, pattern, rdma_key, tls, uneven_descs, wait_for};

/// Several pages, ending off a page boundary.
const LEN: usize = (1 << 20) + 4097;

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

/// Local device memory that no NIC reaches moves through its host copy: a WRITE sends what the device
/// holds (copied into the host copy first), a READ's bytes go on to the device (copied from the host
/// copy after). Each transfer's ranges reach the block as one batch, not one call per range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_device_memory_the_nic_cannot_reach_moves_through_its_host_copy() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let remote = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
    wait_for(&peer, &remote).await;
    let stale = pattern(LEN, 13);
    let block = EmulatedDevice::unreachable_by_nics(&stale, &pattern(LEN, 14));
    let local = initiator.register_block(block.clone(), Access::READ_WRITE).unwrap();
    let descs = descs(local.addr(), remote.addr());
    assert!(descs.len() > 1, "several ranges of one block");
    assert_eq!(peer.transport(), TransportKind::Rdma);

    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    assert_bytes(
        &remote.to_vec().unwrap(),
        &pattern(LEN, 14),
        "RDMA WRITEs from local device memory behind its host copy",
    );
    assert_eq!(
        block.batches(),
        1,
        "the write's ranges were copied from the device as one batch"
    );

    let want = pattern(LEN, 15);
    remote.write_at(0, &want).unwrap();
    initiator.transfer(&peer, Op::Read, &descs, T).await.unwrap();
    assert_bytes(
        &block.device_bytes(),
        &want,
        "the local device after RDMA READs into its host copy",
    );
    assert_eq!(
        block.batches(),
        2,
        "the read's ranges were copied to the device as one batch"
    );
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

/// Memory named by its device address (a CUDA region, named by its device pointer) is not registered
/// with the NIC, whose registration of the host copy would answer that name at the wrong address:
/// the route says so, and its bytes move over the link's TCP path through the hooks, as target and
/// as the initiator's local side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_named_by_its_device_address_is_declined_by_the_nic() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let stale = pattern(LEN, 14);
    let remote_block = EmulatedDevice::named_by_device(&stale, &stale);
    let region = target.register_block(remote_block.clone(), Access::READ_WRITE).unwrap();
    assert_eq!(region.addr(), remote_block.device_address());
    wait_for(&peer, &region).await;
    assert_eq!(peer.transport(), TransportKind::Rdma);
    let (_, route) = peer
        .routes()
        .into_iter()
        .find(|(ad, _)| ad.key == region.key())
        .expect("the region's route");
    assert_ne!(route.transport, TransportKind::Rdma, "{route:?}");
    assert!(
        route
            .passed_over
            .as_deref()
            .is_some_and(|why| why.contains("did not register this region")),
        "{route:?}"
    );

    let local_block = EmulatedDevice::named_by_device(&stale, &pattern(LEN, 15));
    let local = initiator
        .register_block(local_block.clone(), Access::READ_WRITE)
        .unwrap();
    initiator
        .transfer(&peer, Op::Write, &descs(local.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(
        &remote_block.device_bytes(),
        &pattern(LEN, 15),
        "the remote device after a write",
    );

    remote_block.set_device(&pattern(LEN, 16));
    initiator
        .transfer(&peer, Op::Read, &descs(local.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(
        &local_block.device_bytes(),
        &pattern(LEN, 16),
        "the local device after a read",
    );
}

/// GPU memory named by its device address that exports a dma-buf (here udmabuf over a memory file,
/// as CUDA memory exports one): a NIC that takes dma-bufs registers it, and RDMA reaches the device
/// with no host copy and no hook, local and remote; a NIC that refuses (Soft-RoCE has no dma-buf
/// registration) leaves it to TCP through the hooks, and the route says the NIC did not register
/// it. Either way every byte lands on the device, and the test says which way it went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_is_reached_through_its_dma_buf_or_over_tcp_saying_why() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let stale = pattern(LEN, 21);
    let remote_block = EmulatedDevice::behind_dma_buf(&stale, &stale);
    // The dma-buf itself must exist, so that what follows is the NIC's answer to it.
    if let Some(Err(e)) = ferry::MemoryBlock::dma_buf(&*remote_block) {
        panic!("no dma-buf of the emulated device (the kernel needs CONFIG_UDMABUF): {e}");
    }
    let region = target.register_block(remote_block.clone(), Access::READ_WRITE).unwrap();
    assert_eq!(region.addr(), remote_block.device_address());
    wait_for(&peer, &region).await;
    let local_block = EmulatedDevice::behind_dma_buf(&stale, &pattern(LEN, 22));
    let local = initiator
        .register_block(local_block.clone(), Access::READ_WRITE)
        .unwrap();
    let (_, route) = peer
        .routes()
        .into_iter()
        .find(|(ad, _)| ad.key == region.key())
        .expect("the region's route");

    initiator
        .transfer(&peer, Op::Write, &descs(local.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(
        &remote_block.device_bytes(),
        &pattern(LEN, 22),
        "the remote device after a write",
    );
    remote_block.set_device(&pattern(LEN, 23));
    initiator
        .transfer(&peer, Op::Read, &descs(local.addr(), region.addr()), T)
        .await
        .unwrap();
    assert_bytes(
        &local_block.device_bytes(),
        &pattern(LEN, 23),
        "the local device after a read",
    );

    match route.transport {
        TransportKind::Rdma => {
            let ad = peer.regions().iter().find(|r| r.key == region.key()).cloned().unwrap();
            assert!(!rdma_key(&ad).hooked, "the key asks for hooks around the NIC's access");
            assert_eq!(
                remote_block.hook_calls() + local_block.hook_calls(),
                0,
                "a hook ran around the NIC"
            );
            assert_bytes(&remote_block.host_bytes(), &stale, "the remote host copy");
            eprintln!("the NIC registered the dma-bufs: RDMA reached both devices directly");
        }
        other => {
            let why = route.passed_over.as_deref().unwrap_or_default();
            assert!(why.contains("did not register this region"), "{other}: {route:?}");
            assert!(
                remote_block.hook_calls() > 0,
                "over {other}, the target's hooks moved the bytes"
            );
            eprintln!("the NIC did not register the dma-bufs: {other} through the hooks ({why})");
        }
    }
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
