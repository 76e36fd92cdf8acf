//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use ferry::{Access, Engine, Peer, Region};

pub const T: Duration = Duration::from_secs(10);

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

pub async fn target() -> Engine {
    Engine::builder().listen("127.0.0.1:0").build().await.unwrap()
}

pub async fn pair_with(builder: ferry::EngineBuilder) -> (Engine, Engine, Peer) {
    let target = target().await;
    let initiator = builder.build().await.unwrap();
    let peer = initiator.connect(&target.local_addr().unwrap().to_string(), T).await.unwrap();
    (target, initiator, peer)
}

pub async fn pair() -> (Engine, Engine, Peer) {
    pair_with(Engine::builder()).await
}

/// Waits until `peer` has learned of `region` (registered after the link came up).
pub async fn wait_for_region(peer: &Peer, region: &Region) {
    let deadline = tokio::time::Instant::now() + T;
    while !peer.regions().iter().any(|r| r.key == region.key()) {
        assert!(tokio::time::Instant::now() < deadline, "peer never learned of region {:?}", region.key());
        peer.regions_changed(Duration::from_millis(50)).await;
    }
}

pub fn rw() -> Access {
    Access::READ_WRITE
}
