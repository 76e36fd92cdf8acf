//! `EngineBuilder::stage_gpu_memory(false)`: a transfer that would move GPU memory through a host
//! copy fails at start, naming the side and the route, instead of running at host-copy speed; the
//! default stages as before. Over shared memory and over TCP (engines of one process); and one link
//! may say otherwise than its engine (`ConnectOptions::stage_gpu_memory`).

mod common;

use common::*;
use ferry::{Access, ConnectOptions, Engine, Error, Op, TransferDesc, TransportKind};
use ferry_vulkan::{AllocationPath, VulkanRegistry};

const LEN: usize = 1 << 20;

async fn refusing(transport: Option<TransportKind>) -> (Engine, Engine, ferry::Peer) {
    let restrict = |b: ferry::EngineBuilder| match transport {
        Some(t) => b.transports([t]),
        None => b,
    };
    let target = restrict(Engine::builder().listen("127.0.0.1:0")).build().await.unwrap();
    let initiator = restrict(Engine::builder().stage_gpu_memory(false))
        .build()
        .await
        .unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    (target, initiator, peer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_gpu_memory_is_refused_where_the_engine_says_so() {
    let Some(ctx) = context("the GPU staging policy") else {
        return;
    };
    if !offered(&ctx, AllocationPath::Staged) {
        return;
    }
    let staged = || {
        VulkanRegistry::new(ctx.clone())
            .with_path(Some(AllocationPath::Staged))
            .allocate_block(LEN)
            .unwrap()
    };
    for transport in [None, Some(TransportKind::Tcp)] {
        // The peer's region is staged: refused at start, nothing sent.
        let (target, initiator, peer) = refusing(transport).await;
        let region = target.register_block(staged(), Access::READ_WRITE).unwrap();
        wait_for_region(&peer, &region).await;
        let (_, route) = peer
            .routes()
            .into_iter()
            .find(|(ad, _)| ad.key == region.key())
            .unwrap();
        assert!(route.staged, "{route:?}");
        let src = initiator.register(pattern(LEN, 1), Access::READ_WRITE).unwrap();
        let desc = [TransferDesc::new(src.addr(), region.addr(), LEN as u64)];
        let err = initiator.transfer(&peer, Op::Write, &desc, T).await.unwrap_err();
        assert!(
            matches!(&err, Error::Unsupported(m) if m.contains("descriptor 0") && m.contains("is GPU memory that this link reaches")),
            "{transport:?}: {err:?}"
        );
        assert_eq!(region.to_vec().unwrap(), vec![0u8; LEN], "nothing was written");

        // This side's region is staged: refused too.
        let host = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
        wait_for_region(&peer, &host).await;
        let local = initiator.register_block(staged(), Access::READ_WRITE).unwrap();
        let desc = [TransferDesc::new(local.addr(), host.addr(), LEN as u64)];
        let err = initiator.transfer(&peer, Op::Read, &desc, T).await.unwrap_err();
        assert!(
            matches!(&err, Error::Unsupported(m) if m.contains("the local region is")),
            "{transport:?}: {err:?}"
        );
    }

    // By default the same transfer stages, and completes.
    let (target, initiator, peer) = pair().await;
    let region = target.register_block(staged(), Access::READ_WRITE).unwrap();
    wait_for_region(&peer, &region).await;
    let src = initiator.register(pattern(LEN, 2), Access::READ_WRITE).unwrap();
    let desc = [TransferDesc::new(src.addr(), region.addr(), LEN as u64)];
    initiator.transfer(&peer, Op::Write, &desc, T).await.unwrap();
}

/// The policy per link (`ConnectOptions::stage_gpu_memory`) over the engine's: a link of a staging
/// engine that refuses is refused, and a link of a refusing engine that allows stages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_may_stage_otherwise_than_its_engine() {
    let Some(ctx) = context("the GPU staging policy per link") else {
        return;
    };
    if !offered(&ctx, AllocationPath::Staged) {
        return;
    }
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .transports([TransportKind::Tcp])
        .build()
        .await
        .unwrap();
    let region = target
        .register_block(
            VulkanRegistry::new(ctx.clone())
                .with_path(Some(AllocationPath::Staged))
                .allocate_block(LEN)
                .unwrap(),
            Access::READ_WRITE,
        )
        .unwrap();
    let addr = target.local_addr().unwrap().to_string();
    for (engine_stages, link_stages) in [(true, false), (false, true)] {
        let initiator = Engine::builder()
            .transports([TransportKind::Tcp])
            .stage_gpu_memory(engine_stages)
            .build()
            .await
            .unwrap();
        let options = ConnectOptions::new().stage_gpu_memory(link_stages);
        let peer = initiator.connect_using(&addr, T, &options).await.unwrap();
        wait_for_region(&peer, &region).await;
        let src = initiator.register(pattern(LEN, 3), Access::READ_WRITE).unwrap();
        let desc = [TransferDesc::new(src.addr(), region.addr(), LEN as u64)];
        let result = initiator.transfer(&peer, Op::Write, &desc, T).await;
        match link_stages {
            true => {
                result.unwrap();
                assert_eq!(region.to_vec().unwrap(), pattern(LEN, 3), "the link staged it");
            }
            false => {
                let err = result.unwrap_err();
                assert!(
                    matches!(&err, Error::Unsupported(m) if m.contains("this link does not stage")),
                    "{err:?}"
                );
            }
        }
    }
}
