//! A notification sent after a transfer completed is never observed before that transfer's data.

mod common;

use common::*;
use ferry::{Engine, Notification, Op, TransferDesc};
use futures::StreamExt;

const ITERATIONS: usize = 200;
const LARGE: usize = 300 << 10;
const SMALL: usize = 4 << 10;
const SMALLS: usize = 8;
const SLOT: usize = LARGE + SMALL * SMALLS;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_never_overtake_data() {
    let (target, initiator, peer) = pair_with(Engine::builder().streams(4)).await;
    let dst = target.alloc_host(SLOT * ITERATIONS, rw()).unwrap();
    wait_for_region(&peer, &dst).await;
    let src = initiator.alloc_host(SLOT * ITERATIONS, rw()).unwrap();
    for i in 0..ITERATIONS {
        src.write_at((i * SLOT) as u64, &pattern(SLOT, i as u8)).unwrap();
    }

    let checker = {
        let mut stream = target.notifications();
        let dst_addr = dst.addr();
        let dst = std::sync::Arc::new(dst);
        let d = dst.clone();
        tokio::spawn(async move {
            for expected in 0..ITERATIONS {
                let n = stream.next().await.unwrap();
                let i: usize = n.notification.msg.parse().unwrap();
                assert_eq!(i, expected, "notifications arrive in order");
                let mut got = vec![0u8; SLOT];
                d.read_at((i * SLOT) as u64, &mut got).unwrap();
                assert!(
                    got == pattern(SLOT, i as u8),
                    "notification {i} arrived before its data"
                );
            }
            let _ = dst_addr;
            dst
        })
    };

    for i in 0..ITERATIONS {
        let base = (i * SLOT) as u64;
        let mut descs = vec![TransferDesc::new(
            src.addr_at(base),
            dst_addr_at(&peer, base),
            LARGE as u64,
        )];
        for s in 0..SMALLS {
            let off = base + (LARGE + s * SMALL) as u64;
            descs.push(TransferDesc::new(
                src.addr_at(off),
                dst_addr_at(&peer, off),
                SMALL as u64,
            ));
        }
        initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
        initiator
            .notify(&peer, Notification::new("done", i.to_string()), T)
            .await
            .unwrap();
    }
    tokio::time::timeout(T, checker)
        .await
        .expect("checker finished")
        .unwrap();
}

fn dst_addr_at(peer: &ferry::Peer, offset: u64) -> u64 {
    peer.regions().iter().next().unwrap().addr + offset
}
