//! Transfers with integrity over RDMA (run by `cargo xtask rig test`): the engine fences the queue
//! pairs that carried a batch's WRITEs before it asks the target for its sums, so the sums are of
//! the placed bytes; a byte flipped after landing fails the transfer as `Integrity`.
//!
//! The fault hooks (ferry-core's `fault-hooks` feature, on in this test build): a READ's bytes are
//! flipped where they landed in this process once its completion came; a WRITE's, at the target
//! right before it sums them (its NIC placed them without the target's CPU, which has no other place
//! to see them). The hook is one per process: this file holds one test.

mod common;

use common::{T, assert_bytes, pair, pattern, wait_for};
use ferry::integrity::fault;
use ferry::{Access, Error, Op, TransferOptions};

const LEN: usize = 3 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_rdma_a_flip_after_landing_is_caught_by_integrity() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let dst = target.alloc_host(LEN, Access::READ_WRITE).unwrap();
    wait_for(&peer, &dst).await;
    let (_, route) = peer
        .routes()
        .into_iter()
        .find(|(ad, _)| ad.key == dst.key())
        .expect("the region's route");
    assert_eq!(route.transport, ferry::TransportKind::Rdma, "{route:?}");
    assert!(route.how.starts_with("NIC to NIC"), "{route:?}");
    let data = pattern(LEN, 0x17);
    let src = initiator.register(data.clone(), Access::READ_WRITE).unwrap();
    let back = initiator.alloc_host(LEN, Access::READ_WRITE).unwrap();
    // Uneven pieces, so that the batch is several work requests and slices.
    let writes = common::uneven_descs(src.addr(), dst.addr(), LEN);
    let reads = common::uneven_descs(back.addr(), dst.addr(), LEN);
    let with = |on| TransferOptions::within(T).integrity(on);

    // No fault: checked both ways, the right bytes.
    initiator
        .start(&peer, Op::Write, &writes, with(true))
        .unwrap()
        .await
        .unwrap();
    assert_bytes(&dst.to_vec().unwrap(), &data, "written with integrity");
    initiator
        .start(&peer, Op::Read, &reads, with(true))
        .unwrap()
        .await
        .unwrap();
    assert_bytes(&back.to_vec().unwrap(), &data, "read with integrity");

    // A byte of the WRITE changed after it was placed: caught.
    assert!(fault::flip_next_landing(), "this test build has the fault hooks");
    let result = initiator.start(&peer, Op::Write, &writes, with(true)).unwrap().await;
    assert_eq!(fault::disarm(), 0, "the target's sums took the flip");
    assert!(
        matches!(&result, Err(Error::Integrity(m)) if m.contains("Write")),
        "{result:?}"
    );
    let differ = dst.to_vec().unwrap().iter().zip(&data).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 1, "one byte was flipped after it was placed");
    dst.write_at(0, &data).unwrap();

    // A byte of the READ changed where it landed here: caught with integrity, unseen without.
    for integrity in [true, false] {
        back.write_at(0, &vec![0u8; LEN]).unwrap();
        assert!(fault::flip_next_landing());
        let result = initiator.start(&peer, Op::Read, &reads, with(integrity)).unwrap().await;
        assert_eq!(fault::disarm(), 0, "the read's landing took the flip");
        let differ = back.to_vec().unwrap().iter().zip(&data).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 1, "one byte was flipped after it landed");
        match integrity {
            true => assert!(
                matches!(&result, Err(Error::Integrity(m)) if m.contains("Read")),
                "{result:?}"
            ),
            false => assert!(result.is_ok(), "without integrity nothing looks: {result:?}"),
        }
    }
}
