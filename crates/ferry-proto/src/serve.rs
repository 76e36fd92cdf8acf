//! What a target does with each request it accepted ([`Request`](crate::Request)): which memory a
//! write, read, commit or checksum may touch for this peer, what a refused write's payload becomes,
//! what a landed write leaves to persist, and what a commit persists. The transport moves the bytes
//! between its socket and the memory these name, and persists what they say.
//!
//! Every rule resolves through the engine's grant check ([`EngineContext::resolve`]), so a request
//! touches nothing a peer may not reach, whichever transport carried it.

use ferry_core::codec::Segment;
use ferry_core::{Durability, EngineContext, Error, Op, PeerView, Resolved, Result};

use crate::written::WrittenRanges;

/// What to do with a write's payload.
#[derive(Debug)]
pub enum Landing {
    /// Land it in these parts, in order.
    Land(Vec<Resolved>),
    /// Read and drop its `discard` bytes (so the stream stays framed), then answer `error`.
    Refuse {
        /// The write's answer.
        error: Error,
        /// Payload bytes to drop.
        discard: u64,
    },
}

/// Where a write of `payload_len` bytes to `segments` at `durability` lands for `who`.
pub fn write(
    ctx: &EngineContext,
    who: &PeerView,
    segments: &[Segment],
    payload_len: u64,
    durability: Durability,
) -> Landing {
    let parts = segments
        .iter()
        .map(|s| ctx.resolve_write(who, s.key, s.offset, s.len, durability))
        .collect::<Result<Vec<_>>>();
    match parts {
        Ok(parts) => Landing::Land(parts),
        Err(error) => Landing::Refuse {
            error,
            discard: payload_len,
        },
    }
}

/// What a write that landed in `parts` (for `segments`, at `durability`) leaves to persist now.
#[derive(Debug)]
pub enum Persist {
    /// The write's own parts, as its durability asks (nothing more for a completed write).
    Parts,
    /// These ranges, persistent now: the stream's table of uncommitted ranges was full and handed
    /// them back (see [`WrittenRanges::record`]). Ranges the peer can no longer reach are left out:
    /// no commit of them could succeed either.
    Spilled(Vec<Resolved>),
}

/// Notes in `written` what a completed write put in persistent regions, for a later commit on the
/// same stream, and says what to persist now.
pub fn landed(
    ctx: &EngineContext,
    who: &PeerView,
    written: &mut WrittenRanges,
    segments: &[Segment],
    parts: &[Resolved],
    durability: Durability,
) -> Persist {
    if durability != Durability::Completed {
        return Persist::Parts;
    }
    let mut spilled = Vec::new();
    for (s, p) in segments.iter().zip(parts) {
        if p.region.block().persistent() {
            spilled.extend(written.record(s.key, s.offset, s.len));
        }
    }
    match spilled.is_empty() {
        true => Persist::Parts,
        false => Persist::Spilled(
            spilled
                .iter()
                .filter_map(|s| {
                    ctx.resolve_write(who, s.key, s.offset, s.len, Durability::Persistent)
                        .ok()
                })
                .collect(),
        ),
    }
}

/// What a commit of `segments` at `durability` persists: every segment is checked (grants, bounds,
/// a persistent region), and the part of them this stream's earlier writes covered (`written`) is
/// persisted; or all of them when the link's writes may bypass this stream (`bypassed`: the link has
/// another data path, RDMA, whose writes this stream never saw).
pub fn commit(
    ctx: &EngineContext,
    who: &PeerView,
    written: &mut WrittenRanges,
    bypassed: bool,
    segments: &[Segment],
    durability: Durability,
) -> Result<Vec<Resolved>> {
    let resolve = |segments: &[Segment]| {
        segments
            .iter()
            .map(|s| ctx.resolve_write(who, s.key, s.offset, s.len, durability))
            .collect::<Result<Vec<_>>>()
    };
    let named = resolve(segments)?;
    match bypassed {
        true => Ok(named),
        false => resolve(&written.commit(segments)),
    }
}

/// The memory a read of `segments` sends, at most `max_payload` bytes in one request.
pub fn read(ctx: &EngineContext, who: &PeerView, segments: &[Segment], max_payload: u64) -> Result<Vec<Resolved>> {
    let mut total = 0u64;
    let mut parts = Vec::with_capacity(segments.len());
    for s in segments {
        let part = ctx.resolve(who, s.key, s.offset, s.len, Op::Read)?;
        total = total.saturating_add(s.len);
        if total > max_payload {
            return Err(Error::InvalidArgument(format!(
                "a read of over {max_payload} bytes in one request"
            )));
        }
        parts.push(part);
    }
    Ok(parts)
}

/// The memory whose checksums answer a `Sum` request checking a transfer that did `op` there. A
/// checksum tells something of the bytes, so the peer needs read access besides the access of the
/// operation it checks.
pub fn sums(ctx: &EngineContext, who: &PeerView, op: Op, segments: &[Segment]) -> Result<Vec<Resolved>> {
    let mut parts = Vec::with_capacity(segments.len());
    for s in segments {
        if op == Op::Write {
            ctx.resolve(who, s.key, s.offset, s.len, Op::Write)?;
        }
        let part = ctx
            .resolve(who, s.key, s.offset, s.len, Op::Read)
            .map_err(|e| match e {
                Error::PermissionDenied(m) if op == Op::Write => Error::PermissionDenied(format!(
                    "{m}; an integrity check reads the written range's checksum back, which needs read access: \
                     grant the peer READ as well, or write without integrity"
                )),
                other => other,
            })?;
        parts.push(part);
    }
    Ok(parts)
}
