//! The RDMA and same-host transports' own bytes on arbitrary input: every decoder of
//! `ferry_proto::rdma` and `ferry_proto::shm` either refuses or returns a value, never panics, and
//! what it returns survives encoding: decoding that value's encoding gives a value that encodes and
//! decodes to itself (the first round may normalise, as a reply's message is cut to 1024 bytes).
#![no_main]

use ferry_proto::{rdma, shm};
use libfuzzer_sys::fuzz_target;

/// `decode(encode(decode(x)))` is a fixed point of `decode ∘ encode`.
fn settles<T: PartialEq + std::fmt::Debug>(first: T, round: impl Fn(&T) -> Option<T>) {
    let Some(second) = round(&first) else { return };
    let third = round(&second);
    assert_eq!(third.as_ref(), Some(&second), "{first:?} does not settle");
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 8 {
        0 => {
            if let Ok(m) = rdma::Message::decode(rest) {
                settles(m, |m| {
                    let mut b = Vec::new();
                    m.encode(&mut b).ok()?;
                    Some(rdma::Message::decode(&b).expect("an encoded message decodes"))
                });
            }
        }
        1 => {
            if let Ok(e) = rdma::QpEndpoint::decode(rest) {
                settles(e, |e| {
                    Some(rdma::QpEndpoint::decode(&e.encode()).expect("an encoded endpoint decodes"))
                });
            }
        }
        2 => {
            if let Ok(k) = rdma::RemoteKey::decode(rest) {
                settles(k, |k| {
                    Some(rdma::RemoteKey::decode(&k.encode()).expect("an encoded key decodes"))
                });
            }
        }
        3 => {
            if let Ok(Some(k)) = rdma::RailKeys::decode(rest) {
                settles(k, |k| rdma::RailKeys::decode(&k.encode()).expect("encoded rail keys decode"));
            }
        }
        4 => {
            if let Ok(o) = shm::Offer::decode(rest) {
                settles(o, |o| {
                    Some(shm::Offer::decode(&o.encode()).expect("an encoded offer decodes"))
                });
            }
        }
        5 => {
            if let Ok(a) = shm::Answer::decode(rest) {
                settles(a, |a| {
                    Some(shm::Answer::decode(&a.encode()).expect("an encoded answer decodes"))
                });
            }
        }
        6 => {
            if let Some((head, body)) = rest.split_first_chunk::<{ shm::REQUEST_HEAD }>() {
                let _ = shm::decode_request_head(head);
                let _ = shm::decode_items(body);
            }
        }
        _ => {
            if let Some((head, body)) = rest.split_first_chunk::<{ shm::REPLY_HEAD }>() {
                let _ = shm::decode_reply_head(head);
                if let Some(mapped) = body.first_chunk::<{ shm::MAPPED_LEN }>() {
                    let _ = shm::decode_mapped(mapped);
                }
            }
        }
    }
});
