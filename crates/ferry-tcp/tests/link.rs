//! The TCP transport on its own, without the engine: a `TcpServer` over a region table and a
//! `TcpLink` dialed to it, as two engines' halves in one process. WRITEs and READs land byte for
//! byte over one stream and several, a refused operation fails by name and changes nothing at the
//! target, and notifications reach the target's notifier intact and in order.

mod common;

use common::{LEN, T, bytes, pair, pattern};
use ferry_core::{DataLink, Error, Notification, Op, RegionKey};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_land_byte_for_byte_over_every_stream_count() {
    for streams in [1, 4] {
        let p = pair(streams).await;
        let src = pattern(streams as u8);
        p.local.copy_in(0, &src).unwrap();
        // Scattered ranges of every size class: tiny, mid, and one over a frame's usual payload.
        let ranges: Vec<(u64, u64)> = vec![
            (0, 1),
            (7, 4096),
            (8192, 64 << 10),
            (200 << 10, 600 << 10),
            (LEN as u64 - 3, 3),
        ];
        p.run(p.request(Op::Write, &ranges)).await.unwrap();
        let at_target = bytes(&p.remote);
        for &(o, n) in &ranges {
            let (o, n) = (o as usize, n as usize);
            assert_eq!(
                at_target[o..o + n],
                src[o..o + n],
                "{streams} streams: write at {o}+{n}"
            );
        }
        assert!(
            at_target[1..7].iter().all(|&b| b == 0),
            "nothing outside the ranges is written"
        );

        // Read it all back into a cleared local region.
        p.local.copy_in(0, &vec![0u8; LEN]).unwrap();
        p.run(p.request(Op::Read, &[(0, LEN as u64)])).await.unwrap();
        assert_eq!(bytes(&p.local), at_target, "{streams} streams: read back");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_the_target_refuses_fails_by_name_and_writes_nothing() {
    let p = pair(2).await;
    p.local.copy_in(0, &pattern(9)).unwrap();
    let mut request = p.request(Op::Write, &[(0, 4096)]);
    // Past the end of the target's region: the target checks every range itself.
    request.items[0].remote_offset = LEN as u64 - 100;
    request.items[0].remote_addr = p.remote.addr() + LEN as u64 - 100;
    let err = p.run(request).await.unwrap_err();
    assert!(matches!(err, Error::OutOfBounds(_)), "{err:?}");
    // A region the target does not have.
    let mut request = p.request(Op::Write, &[(0, 4096)]);
    request.items[0].remote_key = RegionKey(0xdead);
    let err = p.run(request).await.unwrap_err();
    assert!(
        matches!(&err, Error::PermissionDenied(m) if m.contains("no region")),
        "{err:?}"
    );
    assert!(
        bytes(&p.remote).iter().all(|&b| b == 0),
        "a refused operation wrote nothing"
    );
    // The link goes on.
    p.run(p.request(Op::Write, &[(0, 4096)])).await.unwrap();
    assert_eq!(bytes(&p.remote)[..4096], pattern(9)[..4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_reach_the_targets_notifier_intact_and_in_order() {
    let p = pair(4).await;
    let long = "x".repeat(1024);
    for round in 0..8u64 {
        let msg = if round == 7 { long.clone() } else { round.to_string() };
        tokio::time::timeout(T, p.link.notify(Notification::new(format!("n{round}"), msg)))
            .await
            .unwrap()
            .unwrap();
    }
    let seen = p.inbox.seen.lock().unwrap();
    assert_eq!(seen.len(), 8, "each notification is queued once it is acknowledged");
    for (round, (n, _)) in seen.iter().enumerate() {
        assert_eq!(n.name, format!("n{round}"), "in the order sent");
        assert_eq!(n.msg, if round == 7 { long.clone() } else { round.to_string() });
    }
}
