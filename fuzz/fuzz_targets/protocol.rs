//! The initiator's and the target's state machines on arbitrary frames and local operations, in any
//! order and on any stream: answers for unknown operations, frames on the wrong stream, region updates
//! without end, operations taken back (their callers gave up), keepalive steps. Errors are expected
//! (the link then closes); a panic, or an operation that is lost (neither answered, taken back nor
//! failed at the close), is a bug.
#![no_main]

use std::time::{Duration, Instant};

use ferry_core::codec::{self, Limits};
use ferry_proto::initiator::OpKind;
use ferry_proto::{Event, Initiator, Keepalive, LinkLimits, StreamIndex, TargetStream};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&shape, mut rest)) = data.split_first() else {
        return;
    };
    let streams = usize::from(shape % 4) + 1;
    let now = Instant::now();
    let keepalive = Keepalive::new(now, Duration::from_secs(5), Duration::from_secs(60));
    let limits = LinkLimits {
        max_outstanding_per_stream: 16,
        ..LinkLimits::default()
    };
    let Ok(mut link) = Initiator::<u32>::new("peer".into(), streams, Vec::new(), limits, keepalive) else {
        return;
    };
    if shape & 0x10 != 0 {
        link.reserve_control();
    }
    let targets: Vec<_> = (0..streams)
        .map(|i| TargetStream::new(StreamIndex(i as u16), "initiator".into()))
        .collect();
    let (mut started, mut finished) = (0u32, 0u32);
    let mut ids = Vec::new();
    let mut clock = now;
    while let Some((&selector, after)) = rest.split_first() {
        rest = after;
        clock += Duration::from_millis(u64::from(selector) * 50);
        let stream = StreamIndex(u16::from(selector) % streams as u16);
        match selector % 6 {
            0 => {
                let kind = [OpKind::Ack, OpKind::Read, OpKind::Setup][usize::from(selector / 6) % 3];
                let on = (selector & 0x80 != 0).then_some(stream);
                if let Ok(id) = link.start(on, kind, u64::from(selector), started) {
                    started += 1;
                    ids.push(id);
                }
            }
            1 => {
                if selector & 0x40 != 0 && !ids.is_empty() {
                    let (s, id) = ids.swap_remove(usize::from(selector) % ids.len());
                    finished += u32::from(link.take(s, id).is_some());
                }
                if link.handle_timeout(clock).is_err() {
                    finished += link.close(ferry_core::Error::Timeout("keepalive".into())).len() as u32;
                }
            }
            _ => {
                let Ok(Some((decoded, used))) = codec::decode(rest, &Limits::default()) else {
                    break;
                };
                rest = &rest[used..];
                let _ = targets[stream.get()].request(decoded.clone());
                match link.handle(stream, decoded, clock) {
                    Ok(Event::Answered { .. } | Event::Data { .. } | Event::SetupAnswered { .. }) => finished += 1,
                    Ok(_) => {}
                    Err(e) => finished += link.close(e).len() as u32,
                }
            }
        }
        assert!(finished <= started, "{finished} operations ended of {started} started");
        assert_eq!(link.waiting() as u32 + finished, started, "an operation was lost");
    }
});
