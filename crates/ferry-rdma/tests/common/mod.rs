//! What the verbs and persistence tests share: where they run, how engines find the device, and
//! waiting for a region to reach a peer.
#![allow(dead_code)]

pub mod emulated;

use std::time::Duration;

use ferry::{Engine, EngineBuilder, Peer, Region, TransportKind};

pub const T: Duration = Duration::from_secs(30);

/// Inside `cargo xtask rig` (`FERRY_RIG=1`), where a missing device is a failure, not a skip.
pub fn in_rig() -> bool {
    std::env::var_os("FERRY_RIG").is_some()
}

/// An engine builder on the device the rig names (`FERRY_RDMA_DEVICE`), if it names one. RDMA or TCP
/// only: the engines of these tests share a host, where shared memory would otherwise win.
pub fn builder() -> EngineBuilder {
    let b = Engine::builder().transports([TransportKind::Rdma, TransportKind::Tcp]);
    match std::env::var("FERRY_RDMA_DEVICE") {
        Ok(dev) => b.rdma_device(dev),
        Err(_) => b,
    }
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

/// Waits until `peer` advertises `region`. By key, not address: a region freed in the step before may
/// have had the same address, and its removal may still be on the way.
pub async fn wait_for(peer: &Peer, region: &Region) {
    let deadline = tokio::time::Instant::now() + T;
    while !peer.regions().iter().any(|r| r.key == region.key()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the region never reached the peer"
        );
        peer.regions_changed(Duration::from_millis(50)).await;
    }
}

/// Two engines over the device; `None` (after saying so) where there is no device outside the rig.
pub async fn pair() -> Option<(Engine, Engine, Peer)> {
    let target = builder().listen("127.0.0.1:0").build().await.unwrap();
    let initiator = builder().build().await.unwrap();
    let peer = connect_rdma(&initiator, &target).await?;
    Some((target, initiator, peer))
}

/// `engine`'s link to `target`, which must be RDMA inside the rig; outside it, `None` (after saying
/// so) where the engines fell back to TCP for want of a device.
pub async fn connect_rdma(engine: &Engine, target: &Engine) -> Option<Peer> {
    let peer = engine
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    if peer.transport() == TransportKind::Rdma {
        return Some(peer);
    }
    let caps = ferry::capabilities();
    assert!(
        !in_rig(),
        "inside the rig the link must use RDMA; capabilities: {caps:?}"
    );
    assert_eq!(
        peer.transport(),
        TransportKind::Tcp,
        "without a device the engines fall back to TCP"
    );
    eprintln!(
        "skipped: no usable RDMA device here ({:?}); the rig runs this test",
        caps.transports
    );
    None
}

/// Descriptors of uneven sizes that cover `[0, len)` from `local` to `remote`: cut at 1 byte, one page
/// and a byte, and other sizes that end off any page boundary.
pub fn uneven_descs(local: u64, remote: u64, len: usize) -> Vec<ferry::TransferDesc> {
    let mut cuts: Vec<usize> = [0usize, 1, 4097, 70_000, 400_000, 2 << 20]
        .into_iter()
        .filter(|&c| c < len)
        .collect();
    cuts.push(len);
    cuts.windows(2)
        .map(|w| ferry::TransferDesc::new(local + w[0] as u64, remote + w[0] as u64, (w[1] - w[0]) as u64))
        .collect()
}

/// Fails with how many bytes differ and where the first is, rather than printing megabytes.
pub fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let differ = got.iter().zip(want).filter(|(a, b)| a != b).count();
        panic!("{what}: {differ} of {} bytes differ, first at {i}", got.len());
    }
}

/// The RDMA key an advert carries.
pub fn rdma_key(ad: &ferry::RegionAd) -> ferry_proto::rdma::RemoteKey {
    ad.transport_keys
        .iter()
        .find(|(k, _)| *k == TransportKind::Rdma)
        .map(|(_, k)| ferry_proto::rdma::RemoteKey::decode(k).unwrap())
        .expect("the advert carries an RDMA key")
}

/// A pre-shared-key TLS configuration naming this engine `name`, with the key every test shares.
pub fn tls(name: &str) -> ferry::TlsConfig {
    ferry::TlsConfig::from_psk(&[0x5c; 32], name).unwrap()
}

/// An engine authenticated as `name` (see [`tls`]) and its link to `target`; `None` (after saying so)
/// where there is no device outside the rig.
pub async fn client(name: &str, target: &Engine) -> Option<(Engine, Peer)> {
    let engine = builder().tls(tls(name)).build().await.unwrap();
    let peer = connect_rdma(&engine, target).await?;
    Some((engine, peer))
}
