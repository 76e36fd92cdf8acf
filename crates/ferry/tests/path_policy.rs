//! No silent fallback: a link takes only a data path its policy allows, or `connect` fails with
//! `Unsupported` saying, for each path required, why not and on which side. With the policy `any`
//! the link comes up on the best path and says what it passed over.

mod common;

use common::T;
use ferry::{Access, Engine, Error, Op, PathPolicy, TransferDesc, TransportKind};

async fn target(transports: Option<Vec<TransportKind>>) -> Engine {
    let mut b = Engine::builder().listen("127.0.0.1:0");
    if let Some(t) = transports {
        b = b.transports(t);
    }
    b.build().await.unwrap()
}

fn addr(e: &Engine) -> String {
    e.local_addr().unwrap().to_string()
}

/// The link is gone on both sides after a refused connect: nothing half set up stays.
async fn no_link_left(initiator: &Engine, target: &Engine) {
    assert!(initiator.peers().is_empty(), "the initiator kept a link");
    assert_eq!(initiator.link_count(), 0, "the initiator kept its link slot");
    let deadline = tokio::time::Instant::now() + T;
    while target.link_count() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the target kept the refused link"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_required_without_a_device_fails_at_connect_and_says_why() {
    let target = target(None).await;
    let initiator = Engine::builder().build().await.unwrap();
    let policy = PathPolicy::Require(vec![TransportKind::Rdma]);
    let err = initiator.connect_with(&addr(&target), T, &policy).await.unwrap_err();
    let Error::Unsupported(m) = &err else {
        panic!("expected Unsupported, got {err:?}")
    };
    // Where this build has RDMA, the host has no device; where it has not, the build says so.
    assert!(m.contains("requires rdma"), "{m}");
    assert!(
        m.contains("rdma: not usable on this engine") || m.contains("rdma: not in this build"),
        "{m}"
    );
    no_link_left(&initiator, &target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_the_peer_does_not_offer_is_named_as_the_peers() {
    // The target leaves shared memory out; the initiator insists on it.
    let target = target(Some(vec![TransportKind::Tcp])).await;
    let initiator = Engine::builder()
        .path_policy(PathPolicy::Require(vec![TransportKind::Shm]))
        .build()
        .await
        .unwrap();
    let err = initiator.connect(&addr(&target), T).await.unwrap_err();
    let Error::Unsupported(m) = &err else {
        panic!("expected Unsupported, got {err:?}")
    };
    assert!(m.contains("shm:") && m.contains("does not offer it"), "{m}");
    no_link_left(&initiator, &target).await;

    // The same engines with the policy `any`: the link comes up over TCP, which is reported.
    let peer = initiator
        .connect_with(&addr(&target), T, &PathPolicy::Any)
        .await
        .unwrap();
    assert_eq!(peer.transport(), TransportKind::Tcp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_path_that_can_be_had_is_taken_and_moves_the_bytes() {
    let target = target(None).await;
    let dst = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    let initiator = Engine::builder().build().await.unwrap();
    // Best first would pick shared memory on one host; a policy of TCP alone gets TCP.
    let peer = initiator
        .connect_with(&addr(&target), T, &PathPolicy::Require(vec![TransportKind::Tcp]))
        .await
        .unwrap();
    assert_eq!(peer.transport(), TransportKind::Tcp);
    let src = initiator.register(vec![7u8; 4096], Access::READ_WRITE).unwrap();
    let remote = peer.regions().iter().next().map(|r| r.addr).unwrap();
    initiator
        .transfer(&peer, Op::Write, &[TransferDesc::new(src.addr(), remote, 4096)], T)
        .await
        .unwrap();
    let mut got = vec![0u8; 4096];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, vec![7u8; 4096]);
    // And shared memory, where required, is had between two engines of this host.
    let other = Engine::builder().build().await.unwrap();
    let shm = other
        .connect_with(&addr(&target), T, &PathPolicy::Require(vec![TransportKind::Shm]))
        .await
        .unwrap();
    assert_eq!(shm.transport(), TransportKind::Shm, "{:?}", shm.passed_over());
    assert!(shm.passed_over().is_empty());
}
