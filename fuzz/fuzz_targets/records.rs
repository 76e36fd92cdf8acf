//! The record layer of protected data streams (`ferry_proto::seal`) on arbitrary input: an opener fed
//! any bytes as records reads each header, refuses or opens each record, and never panics; and what
//! a sealer makes of the same input, cut into records at sizes the input chooses, opens to exactly
//! the bytes that went in, in order.
#![no_main]

use ferry_core::DataProtection;
use ferry_proto::seal::HEADER_LEN;
use ferry_proto::{JoinKey, LinkToken, Opener, Sealer, StreamIndex};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let protection = match flags & 1 {
        0 => DataProtection::Integrity,
        _ => DataProtection::Encrypted,
    };
    let key = JoinKey::from_exported(&[7; 32]);
    let ends = || key.stream_keys(LinkToken(1), StreamIndex(1)).expect("keys");

    // Arbitrary bytes taken as records.
    let (_, mut opener) = ends().target(protection);
    let mut raw = rest.to_vec();
    let mut at = 0;
    while raw.len() - at >= HEADER_LEN {
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(&raw[at..at + HEADER_LEN]);
        let Ok(len) = Opener::record_len(header) else { break };
        if raw.len() - at < len {
            break;
        }
        if let Ok(body) = opener.open(&mut raw[at..at + len]) {
            assert!(body.end <= len, "an opened body lies outside its record");
        }
        at += len;
    }

    // Sealed records of the input, cut where its bytes say, open to the input.
    let (mut sealer, _) = ends().initiator(protection);
    let (_, mut opener) = ends().target(protection);
    let cut = usize::from(flags >> 1).max(1) * 97;
    for piece in rest.chunks(cut) {
        let mut record = Vec::new();
        Sealer::begin(&mut record);
        record.extend_from_slice(piece);
        sealer
            .finish(&mut record)
            .expect("a record of at most MAX_BODY bytes seals");
        let body = opener.open(&mut record).expect("a sealed record opens");
        assert_eq!(&record[body], piece);
    }
});
