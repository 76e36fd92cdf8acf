//! Payloads between a stream's socket and memory whose device copies to and from any buffer
//! ([`DeviceCopies`](ferry_core::DeviceCopies): CUDA's), through two bounce buffers of the stream's
//! own, a piece ([`OVERLAP_PIECE`]) at a time: one piece crosses the socket while the device copies
//! the next (or the one before), so that the device's copies overlap the network's work, and the
//! blocks' host copies are never touched. Both ends of a link move payloads so: a target the writes
//! it lands and the reads it answers, an initiator the writes it sends and the reads it lands.
//! Parts of other memory in the same payload are copied to and from their memory on the same turns.

use ferry_core::integrity::RunningSums;
use ferry_core::{Resolved, Result};

use crate::blocking::{Bounces, DeviceCopy, OVERLAP_PIECE, bytes_of, copied, from_device, pieces, to_device};
use crate::io::{FrameReader, FrameWriter};

/// Sends `pieces` (a payload cut by [`pieces`]), whose first is already copied into `first`: each
/// later piece is copied from the devices into a bounce buffer while the one before it is sent.
/// The bytes are summed into `sums` as they leave. The outer error breaks the stream; the inner one
/// is a copy that failed after the first, for which the rest of the payload went out as zeros (the
/// stream stays framed).
pub(crate) async fn send_pieces(
    writer: &mut FrameWriter,
    pieces: &[Vec<Resolved>],
    first: Vec<u8>,
    bounces: &mut Bounces,
    mut sums: Option<&mut RunningSums>,
) -> Result<Result<()>> {
    let mut ready = first;
    for k in 0..pieces.len() {
        let next = pieces
            .get(k + 1)
            .map(|p| from_device(p.clone(), bounces.take(bytes_of(p))));
        if let Some(sums) = sums.as_deref_mut() {
            sums.feed(&ready);
        }
        let sent = writer.send_bytes(&ready).await;
        bounces.give(std::mem::take(&mut ready));
        sent?;
        let Some(next) = next else { break };
        let (buf, result) = copied(next.await);
        if let Err(e) = result {
            bounces.give(buf);
            tracing::warn!(error = %e, "a copy from the device failed while its payload was sent");
            let rest = pieces[k + 1..].iter().map(|p| bytes_of(p) as u64).sum();
            writer.send_zeros(rest).await?;
            return Ok(Err(e));
        }
        ready = buf;
    }
    Ok(Ok(()))
}

/// Reads a payload for `parts` in pieces into bounce buffers, each piece copied onto the devices
/// while the next one arrives, under what `hold` gives (an initiator's permit of the transfer that
/// waits, kept until the piece's copy ended); its bytes summed into `sums` as they land. Every
/// piece is read whatever happens to the copies (the stream stays framed), and every copy started
/// is waited for before this returns. The outer error breaks the stream; the inner one is the first
/// failed copy or `hold`, after which no piece is copied.
pub(crate) async fn land_pieces<H: Send + 'static>(
    reader: &mut FrameReader,
    parts: &[Resolved],
    bounces: &mut Bounces,
    mut hold: impl FnMut() -> Result<H>,
    mut sums: Option<&mut RunningSums>,
) -> Result<Result<()>> {
    let mut landed = Ok(());
    let mut copying: Option<DeviceCopy> = None;
    for piece in pieces(parts, OVERLAP_PIECE) {
        let mut buf = bounces.take(bytes_of(&piece));
        let read = match copying.take() {
            Some(copy) => {
                let (read, joined) = tokio::join!(reader.read_exact(&mut buf), copy);
                let (before, outcome) = copied(joined);
                bounces.give(before);
                landed = landed.and(outcome);
                read
            }
            None => reader.read_exact(&mut buf).await,
        };
        read?;
        if landed.is_err() {
            bounces.give(buf);
            continue;
        }
        let held = match hold() {
            Ok(held) => held,
            Err(e) => {
                landed = Err(e);
                bounces.give(buf);
                continue;
            }
        };
        // SAFETY: `buf` is this function's own buffer, just filled.
        unsafe { ferry_core::integrity::fault::landed_raw(buf.as_mut_ptr(), buf.len()) };
        if let Some(sums) = sums.as_deref_mut() {
            sums.feed(&buf);
        }
        copying = Some(to_device(piece, buf, held));
    }
    if let Some(copy) = copying {
        let (last, outcome) = copied(copy.await);
        bounces.give(last);
        landed = landed.and(outcome);
    }
    Ok(landed)
}
