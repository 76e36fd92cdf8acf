//! The link protocol's bounds, seen from a raw peer: a link gets no more streams than it declared,
//! and region updates that overflow a link's queue come back as one resend of the whole table.

mod common;

use std::collections::BTreeSet;

use common::raw::RawClient;
use common::*;
use ferry::codec::{Frame, ReadStatus};
use ferry::{Access, ErrorCode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_gets_no_more_streams_than_it_declared() {
    let target = target().await;
    let addr = target.local_addr().unwrap();
    let token = 0x5eed_0001;
    let (_control, ack) = RawClient::hello(addr, token, 0, 2).await;
    assert!(ack.refusal.is_none());
    let (_one, ack) = RawClient::hello(addr, token, 1, 2).await;
    assert!(ack.refusal.is_none(), "the declared second stream joins");
    let code = |ack: ferry::codec::HelloAck| ack.refusal.map(|r| r.code);
    let (_again, ack) = RawClient::hello(addr, token, 1, 2).await;
    assert_eq!(code(ack), Some(ErrorCode::Protocol), "the same index twice");
    let (_past, ack) = RawClient::hello(addr, token, 2, 2).await;
    assert_eq!(
        code(ack),
        Some(ErrorCode::InvalidArgument),
        "an index past the declared count"
    );
    let (_stranger, ack) = RawClient::hello(addr, 0x5eed_0002, 1, 2).await;
    assert_eq!(code(ack), Some(ErrorCode::Protocol), "a token no link has");
    let (_too_many, ack) = RawClient::hello(addr, 0x5eed_0003, 0, 65).await;
    assert_eq!(
        code(ack),
        Some(ErrorCode::InvalidArgument),
        "more streams than a link may have"
    );
    assert_eq!(target.link_count(), 1);
}

/// The target's control-stream task is kept busy sending a large read that the peer does not take,
/// while more regions are registered than a link's queue holds: the peer then finds one
/// `RegionTable` with every region, instead of updates silently lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflowing_region_updates_resend_the_whole_table() {
    let target = target().await;
    let big_len = 64usize << 20;
    let big = target.alloc_host(big_len, Access::READ).unwrap();
    let (mut c, ack) = RawClient::handshake(target.local_addr().unwrap()).await;
    assert_eq!(ack.regions.len(), 1);
    let read = Frame::Read {
        id: 1,
        key: big.key(),
        offset: 0,
        len: big_len as u64,
    };
    c.send(&read, &[]).await;
    // Let the target block on the full socket.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let regions: Vec<_> = (0..1100)
        .map(|_| target.alloc_host(64, Access::READ).unwrap())
        .collect();
    let mut known: BTreeSet<u64> = ack.regions.iter().map(|a| a.key.0).collect();
    let (mut added, mut tables) = (0, 0);
    let want: BTreeSet<u64> = regions.iter().map(|r| r.key().0).chain([big.key().0]).collect();
    while known != want {
        let frame = tokio::time::timeout(T, c.recv())
            .await
            .expect("updates keep coming")
            .expect("open");
        match frame.frame {
            Frame::ReadData { id: 1 } => {
                let payload = c.recv_payload(frame.payload_len as usize).await;
                assert_eq!(payload.last(), Some(&(ReadStatus::Intact as u8)));
            }
            Frame::RegionAdded(ad) => {
                added += 1;
                known.insert(ad.key.0);
            }
            Frame::RegionTable { regions } => {
                tables += 1;
                known = regions.iter().map(|a| a.key.0).collect();
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(tables >= 1, "the queue overflowed, so the table was resent");
    assert!(
        added < 1100,
        "the overflowing updates were replaced, not all sent ({added})"
    );
}
