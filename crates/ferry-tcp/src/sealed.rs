//! A protected data stream: `ferry-proto`'s record layer ([`ferry_proto::seal`]) over plain TCP.
//!
//! [`SealedWrite`] turns each write into one record (at most [`MAX_BODY`] bytes of it) and sends it
//! whole before it takes the next; [`SealedRead`] reads whole records and hands out a body only once
//! its record opened. Frames and payloads go through the frame layer's buffers as they do under TLS,
//! but records are eight times larger than TLS's and there is no TLS state machine between: the cost
//! is a copy and AES-GCM per byte on each side.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use ferry_core::RegionEntry;
use ferry_proto::seal::{HEADER_LEN, MAX_BODY, TAG_LEN};
use ferry_proto::{Opener, Sealer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

const MAX_RECORD: usize = HEADER_LEN + MAX_BODY + TAG_LEN;

fn io_error(e: ferry_core::Error) -> std::io::Error {
    match e {
        ferry_core::Error::Io { kind, message } => std::io::Error::new(kind, message),
        other => std::io::Error::other(other.to_string()),
    }
}

/// The sending half of a protected stream.
pub struct SealedWrite {
    inner: OwnedWriteHalf,
    sealer: Sealer,
    /// The sealed record being sent, and how much of it went.
    record: Vec<u8>,
    sent: usize,
}

impl SealedWrite {
    pub(crate) fn new(inner: OwnedWriteHalf, sealer: Sealer) -> Self {
        SealedWrite {
            inner,
            sealer,
            record: Vec::with_capacity(MAX_RECORD),
            sent: 0,
        }
    }

    /// Sends the rest of the current record.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while self.sent < self.record.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.record[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.record.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl SealedWrite {
    /// Seals `len` bytes of `region` at `offset` into one record, copied straight from the region
    /// (under its guard), and starts sending it; at most [`MAX_BODY`] bytes. False (and zeros sent
    /// in their place) if the region was deregistered.
    pub(crate) async fn send_region(&mut self, region: &RegionEntry, offset: u64, len: usize) -> std::io::Result<bool> {
        std::future::poll_fn(|cx| self.poll_drain(cx)).await?;
        let len = len.min(MAX_BODY);
        Sealer::begin(&mut self.record);
        self.record.resize(HEADER_LEN + len, 0);
        let intact = region.copy_out(offset, &mut self.record[HEADER_LEN..]).is_ok();
        if !intact {
            self.record[HEADER_LEN..].fill(0);
        }
        self.sealer.finish(&mut self.record).map_err(io_error)?;
        Ok(intact)
    }
}

impl AsyncWrite for SealedWrite {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = buf.len().min(MAX_BODY);
        Sealer::begin(&mut this.record);
        this.record.extend_from_slice(&buf[..n]);
        this.sealer.finish(&mut this.record).map_err(io_error)?;
        // The record is taken: start sending it now, and finish on the next write or flush.
        if let Poll::Ready(Err(e)) = this.poll_drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

/// The receiving half of a protected stream.
pub struct SealedRead {
    inner: OwnedReadHalf,
    opener: Opener,
    /// Bytes from the socket, `raw[start..end]`: records, the first of them opened when `opened` is
    /// not zero (its length), with its body's unread part at `plain`.
    raw: Vec<u8>,
    start: usize,
    end: usize,
    opened: usize,
    plain: std::ops::Range<usize>,
}

impl SealedRead {
    /// `already` holds bytes read from the socket before the stream turned protected (records too).
    pub(crate) fn new(inner: OwnedReadHalf, opener: Opener, already: &[u8]) -> Self {
        let mut raw = vec![0u8; (2 * MAX_RECORD).max(already.len())];
        raw[..already.len()].copy_from_slice(already);
        SealedRead {
            inner,
            opener,
            raw,
            start: 0,
            end: already.len(),
            opened: 0,
            plain: 0..0,
        }
    }

    /// Opens the record at the front when it is whole: true if one was opened (or skipped, empty).
    fn open_front(&mut self) -> std::io::Result<bool> {
        let held = self.end - self.start;
        let len = match held >= HEADER_LEN {
            true => {
                let mut header = [0u8; HEADER_LEN];
                header.copy_from_slice(&self.raw[self.start..self.start + HEADER_LEN]);
                Opener::record_len(header).map_err(io_error)?
            }
            false => HEADER_LEN,
        };
        if held < len {
            if self.raw.len() - self.start < len {
                // Make room for the whole record (or its header) behind what is held.
                self.raw.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            return Ok(false);
        }
        let body = self
            .opener
            .open(&mut self.raw[self.start..self.start + len])
            .map_err(io_error)?;
        self.opened = len;
        self.plain = self.start + body.start..self.start + body.end;
        Ok(true)
    }
}

impl SealedRead {
    /// Waits until some opened plaintext is at hand: `Ok(false)` at a clean end of stream (between
    /// records).
    pub(crate) fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<bool>> {
        loop {
            if self.opened > 0 {
                if !self.plain.is_empty() {
                    return Poll::Ready(Ok(true));
                }
                self.consume(0);
                continue;
            }
            if self.open_front()? {
                continue;
            }
            let mut rb = ReadBuf::new(&mut self.raw[self.end..]);
            ready!(Pin::new(&mut self.inner).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == 0 {
                return match self.start == self.end {
                    true => Poll::Ready(Ok(false)),
                    false => Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the stream ended inside a record",
                    ))),
                };
            }
            self.end += n;
        }
    }

    /// The opened plaintext at hand (empty until [`poll_fill`](Self::poll_fill) said there is some).
    pub(crate) fn plain(&self) -> &[u8] {
        match self.opened {
            0 => &[],
            _ => &self.raw[self.plain.clone()],
        }
    }

    /// Marks `n` bytes of [`plain`](Self::plain) used.
    pub(crate) fn consume(&mut self, n: usize) {
        if self.opened == 0 {
            return;
        }
        self.plain.start += n.min(self.plain.len());
        if self.plain.is_empty() {
            self.start += self.opened;
            self.opened = 0;
            if self.start == self.end {
                (self.start, self.end) = (0, 0);
            }
        }
    }
}

impl AsyncRead for SealedRead {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if out.remaining() == 0 || !ready!(this.poll_fill(cx))? {
            return Poll::Ready(Ok(()));
        }
        let plain = this.plain();
        let n = plain.len().min(out.remaining());
        out.put_slice(&plain[..n]);
        this.consume(n);
        Poll::Ready(Ok(()))
    }
}
