//! The target's handshake on arbitrary hellos: whatever arrives, a link has at most the streams it
//! declared, each index joins once, a control stream of an authenticating registry opens nothing
//! without a session, and nothing panics.
#![no_main]

use ferry_core::codec::{self, Frame, Limits};
use ferry_proto::{Admission, JoinKey, LinkLimits, LinkRegistry, LinkToken, Proven};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let limits = LinkLimits {
        max_streams: 8,
        ..LinkLimits::default()
    };
    let authenticating = mode & 1 == 1;
    let mut reg = match authenticating {
        true => LinkRegistry::authenticating(limits),
        false => LinkRegistry::new(limits),
    };
    let proven = Proven {
        join_key: JoinKey::from_exported(&[mode; 32]),
        identity: format!("peer-{}", mode >> 1),
    };
    let mut opened = Vec::new();
    let mut n = 0u32;
    while let Ok(Some((decoded, used))) = codec::decode(rest, &Limits::default()) {
        rest = &rest[used..];
        n += 1;
        let Frame::Hello(hello) = decoded.frame else { continue };
        // Every third control stream comes with a TLS session.
        let session = (n % 3 == 0).then_some(&proven);
        match reg.admit(&hello, session) {
            Ok(Admission::Open) => {
                assert!(!authenticating || session.is_some(), "opened without a session");
                if reg.open(&hello, n, session).is_ok() {
                    opened.push((LinkToken(hello.link_token), hello.stream_count));
                }
            }
            Ok(Admission::Join(..)) => {}
            Err(_) => {}
        }
        if n % 7 == 0
            && let Some((token, _)) = opened.pop()
        {
            reg.close(token);
        }
        for (token, count) in &opened {
            assert!(reg.streams(*token) <= usize::from(*count), "more streams than declared");
        }
        assert!(reg.len() <= opened.len());
    }
});
