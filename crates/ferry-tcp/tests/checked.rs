//! Writes and reads the TCP link checks end to end itself (`TransferRequest::checked`): a write's
//! source is summed as it leaves and the target sums what it landed right after landing it; a read's
//! destination is summed right after it landed and the target sums the source it sent (a `Sum`
//! request on each frame's stream, behind it). The link fails the batch with `Integrity` where the
//! two differ.
//!
//! The fault is ferry-core's test hook that flips a byte right after the target landed it, where
//! TCP's own checksums cannot see it. It is one per process, so this binary holds the only test that
//! arms it.

mod common;

use common::{bytes, pair, pattern};
use ferry_core::integrity::fault;
use ferry_core::{Error, Op};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checked_transfer_fails_when_its_landed_bytes_differ_and_an_unchecked_one_does_not() {
    // Tiny and mid ranges coalesce into one frame; the 600 KiB one goes in frames of its own, split
    // over the streams where there are several.
    let ranges: Vec<(u64, u64)> = vec![(0, 1), (7, 4096), (8192, 64 << 10), (200 << 10, 600 << 10)];
    for streams in [1, 4] {
        let p = pair(streams).await;
        let src = pattern(streams as u8);
        p.local.copy_in(0, &src).unwrap();
        let checked = |op| {
            let mut request = p.request(op, &ranges);
            request.checked = true;
            request
        };
        // Bytes of the ranges that differ between `region` and the source.
        let differ_in = |region| {
            let held = bytes(region);
            ranges
                .iter()
                .flat_map(|&(o, n)| o as usize..(o + n) as usize)
                .filter(|&i| held[i] != src[i])
                .count()
        };
        let differing = || differ_in(&p.remote);

        // No fault: checked, every byte in place.
        p.run(checked(Op::Write)).await.unwrap();
        assert_eq!(differing(), 0, "{streams} streams");

        // A byte flipped after landing: the checked write fails and names the range...
        assert!(fault::flip_next_landing(), "test builds have the fault hooks");
        let result = p.run(checked(Op::Write)).await;
        assert_eq!(fault::disarm(), 0, "a landing took the flip");
        assert_eq!(differing(), 1, "one byte differs at the target");
        assert!(
            matches!(&result, Err(Error::Integrity(m)) if m.contains("of this Write differ") && m.contains("CRC32C")),
            "{streams} streams: {result:?}"
        );

        // ...and the same write unchecked reports Ok with the wrong byte in place: the check is
        // what catches it.
        assert!(fault::flip_next_landing());
        p.run(p.request(Op::Write, &ranges)).await.unwrap();
        assert_eq!(fault::disarm(), 0);
        assert_eq!(differing(), 1);

        // Reads the same way: the target's source is summed as it is sent, this side's destination
        // right after it landed. A byte flipped after landing fails the checked read...
        p.remote.copy_in(0, &src).unwrap();
        let missing = || differ_in(&p.local);
        p.local.copy_in(0, &vec![0u8; src.len()]).unwrap();
        p.run(checked(Op::Read)).await.unwrap();
        assert_eq!(missing(), 0, "{streams} streams: read back");
        assert!(fault::flip_next_landing());
        let result = p.run(checked(Op::Read)).await;
        assert_eq!(fault::disarm(), 0);
        assert_eq!(missing(), 1);
        assert!(
            matches!(&result, Err(Error::Integrity(m)) if m.contains("of this Read differ")),
            "{streams} streams: {result:?}"
        );
        // ...and not the unchecked one.
        assert!(fault::flip_next_landing());
        p.run(p.request(Op::Read, &ranges)).await.unwrap();
        assert_eq!(fault::disarm(), 0);
        assert_eq!(missing(), 1);
    }
}
