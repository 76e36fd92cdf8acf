//! The frame decoder on arbitrary bytes: it never panics, never asks for more than the limits allow,
//! and what it decodes encodes back to a frame that decodes the same.
#![no_main]

use ferry_core::codec::{self, Limits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        max_body: 64 << 10,
        max_payload: 1 << 30,
    };
    let mut rest = data;
    while let Ok(Some((decoded, used))) = codec::decode(rest, &limits) {
        assert!(
            used > 0 && used <= rest.len(),
            "decode used {used} of {} bytes",
            rest.len()
        );
        assert!(decoded.payload_len <= limits.max_payload);
        let mut again = bytes::BytesMut::new();
        if codec::encode(&decoded.frame, decoded.payload_len, &mut again).is_ok() {
            let (round, _) = codec::decode(&again, &Limits::default())
                .expect("an encoded frame decodes")
                .expect("an encoded frame is whole");
            assert_eq!(round.frame, decoded.frame);
            assert_eq!(round.payload_len, decoded.payload_len);
        }
        rest = &rest[used..];
    }
});
