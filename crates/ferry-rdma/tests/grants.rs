//! Authenticated engines over RDMA: each peer gets its own protection domain, rkeys and addresses,
//! only for what it was granted, and a revoke takes the NIC's access away before it returns.
//! Runs inside `cargo xtask rig`; elsewhere (no device) it says it skipped.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{T, builder, client, pattern, rdma_key, tls};
use ferry::{Access, Error, Op, Peer, TransferDesc, TransportKind};
use ferry_proto::rdma::RemoteKey;

/// The one region `peer` was told of, with its RDMA key.
fn advert(peer: &Peer) -> (ferry::RegionAd, RemoteKey) {
    let ad = peer
        .regions()
        .iter()
        .next()
        .cloned()
        .expect("the peer was told of the region");
    let key = rdma_key(&ad);
    (ad, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_peer_reaches_only_its_grant_through_its_own_keys() {
    let target = builder().listen("127.0.0.1:0").tls(tls("cache")).build().await.unwrap();
    let dst = target.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    dst.grant("writer", Access::READ_WRITE).await.unwrap();
    dst.grant("reader", Access::READ).await.unwrap();
    let Some((writer, to_writer)) = client("writer", &target).await else {
        return;
    };
    let Some((reader, to_reader)) = client("reader", &target).await else {
        return;
    };
    let (w_ad, w_key) = advert(&to_writer);
    let (r_ad, r_key) = advert(&to_reader);
    assert_ne!(w_key.rkey, r_key.rkey, "each peer has its own registration");
    assert_ne!(w_ad.addr, r_ad.addr, "and its own base");
    assert!(w_ad.addr != dst.addr() && r_ad.addr != dst.addr());
    assert_eq!((w_ad.addr, r_ad.addr), (dst.addr_for("writer"), dst.addr_for("reader")));

    // The writer's bytes land over RDMA; the reader reads them over RDMA.
    let data = pattern(1 << 20, 3);
    let src = writer.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    src.write_at(0, &data).unwrap();
    let descs: Vec<_> = (0..4u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 18), w_ad.addr + (i << 18), 1 << 18))
        .collect();
    writer.transfer(&to_writer, Op::Write, &descs, T).await.unwrap();
    assert!(dst.to_vec().unwrap() == data, "the writer's bytes are at the target");
    let back = reader.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    reader
        .transfer(
            &to_reader,
            Op::Read,
            &[TransferDesc::new(back.addr(), r_ad.addr, 1 << 20)],
            T,
        )
        .await
        .unwrap();
    assert!(back.to_vec().unwrap() == data, "the reader read them");
    assert_eq!(to_writer.transport(), TransportKind::Rdma);

    // The reader may not write: refused before anything is posted, and nothing changed.
    let err = reader
        .transfer(
            &to_reader,
            Op::Write,
            &[TransferDesc::new(back.addr(), r_ad.addr, 4096)],
            T,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");
    assert!(dst.to_vec().unwrap() == data);
}

/// A revoke under a stream of RDMA writes: once it returns, no byte lands, whatever the writer still
/// had posted or posts with the key it kept; the writer is told, and later writes are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_takes_the_nics_access_away() {
    let target = builder().listen("127.0.0.1:0").tls(tls("cache")).build().await.unwrap();
    let dst = target.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    dst.grant("writer", Access::READ_WRITE).await.unwrap();
    let Some((writer, peer)) = client("writer", &target).await else {
        return;
    };
    let (ad, _) = advert(&peer);
    let src = writer.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    src.write_at(0, &pattern(1 << 20, 9)).unwrap();
    let descs: Vec<_> = (0..16u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 16), ad.addr + (i << 16), 1 << 16))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writes = {
        let (writer, peer, stop) = (writer.clone(), peer.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, 0u32);
            while !stop.load(Ordering::Relaxed) {
                match writer.transfer(&peer, Op::Write, &descs, Duration::from_secs(5)).await {
                    Ok(()) => ok += 1,
                    // Refused by the target or the engine, or by the NIC (the queue pair then fails and
                    // the link sets up another).
                    Err(_) => {
                        failed += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
            (ok, failed)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    tokio::time::timeout(T, dst.revoke("writer")).await.unwrap().unwrap();
    dst.write_at(0, &vec![0u8; 1 << 20]).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let (ok, failed) = tokio::time::timeout(T, writes).await.unwrap().unwrap();
    assert!(
        dst.to_vec().unwrap().iter().all(|b| *b == 0),
        "an RDMA write landed after the revoke returned"
    );
    assert!(
        ok > 0 && failed > 0,
        "{ok} writes before the revoke, {failed} refused after"
    );
    assert!(peer.regions().is_empty(), "the writer was told the region is gone");
}
