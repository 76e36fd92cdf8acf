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
/// What a receiving half holds until a record needs more: an idle stream costs little, and only a
/// stream that carries large records holds a buffer of their size.
const IDLE_BUFFER: usize = 16 << 10;

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
    /// The sealed record being sent, and how much of it went (all of it once sent: the buffer keeps
    /// its length, to be overwritten by the next record).
    record: Vec<u8>,
    sent: usize,
}

impl SealedWrite {
    pub(crate) fn new(inner: OwnedWriteHalf, sealer: Sealer) -> Self {
        SealedWrite {
            inner,
            sealer,
            record: Vec::new(),
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
        // The header's room and the body, without zeroing what the copy overwrites anyway (the
        // buffer keeps its length between records; only growing it fills).
        let want = HEADER_LEN + len;
        match self.record.len() < want {
            true => self.record.resize(want, 0),
            false => self.record.truncate(want),
        }
        let intact = region.copy_out(offset, &mut self.record[HEADER_LEN..]).is_ok();
        if !intact {
            self.record[HEADER_LEN..].fill(0);
        }
        self.sealer.finish(&mut self.record).map_err(io_error)?;
        self.sent = 0;
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
        this.sent = 0;
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
        let mut raw = vec![0u8; IDLE_BUFFER.max(already.len())];
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
                // Make room for the whole record (or its header) behind what is held: at the front,
                // and in a buffer that grows to the record's size (never past one record and a half).
                self.raw.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
                if self.raw.len() < len {
                    self.raw.resize((len + len / 2).min(MAX_RECORD + MAX_RECORD / 2), 0);
                }
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

#[cfg(test)]
mod tests {
    use ferry_core::DataProtection;
    use ferry_proto::{JoinKey, LinkToken, StreamIndex};
    use proptest::prelude::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Sends `writes` through a sealed writer whose bytes reach the socket in pieces of `pieces`
    /// sizes (so records arrive cut anywhere), and reads them back with reads of `reads` sizes.
    async fn round_trip(
        protection: DataProtection,
        writes: Vec<Vec<u8>>,
        pieces: Vec<usize>,
        reads: Vec<usize>,
    ) -> Vec<u8> {
        let key = JoinKey::from_exported(&[4; 32]);
        let (sealer, _) = key
            .stream_keys(LinkToken(1), StreamIndex(1))
            .unwrap()
            .initiator(protection);
        let (_, opener) = key
            .stream_keys(LinkToken(1), StreamIndex(1))
            .unwrap()
            .target(protection);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let (_, tx) = client.unwrap().into_split();
        let (rx, _) = accepted.unwrap().0.into_split();
        // The sealed bytes, produced once, then written in arbitrary pieces.
        let mut sealed = Vec::new();
        {
            let mut sealer = sealer;
            for w in &writes {
                let mut at = 0;
                while at < w.len() {
                    let n = (w.len() - at).min(MAX_BODY);
                    let mut record = Vec::new();
                    Sealer::begin(&mut record);
                    record.extend_from_slice(&w[at..at + n]);
                    sealer.finish(&mut record).unwrap();
                    sealed.extend_from_slice(&record);
                    at += n;
                }
            }
        }
        let writer = tokio::spawn(async move {
            let mut tx = tx;
            let mut at = 0;
            let mut i = 0;
            while at < sealed.len() {
                let n = pieces[i % pieces.len()].clamp(1, sealed.len() - at);
                tx.write_all(&sealed[at..at + n]).await.unwrap();
                tokio::task::yield_now().await;
                at += n;
                i += 1;
            }
        });
        let mut reader = SealedRead::new(rx, opener, &[]);
        let total: usize = writes.iter().map(Vec::len).sum();
        let mut got = Vec::new();
        let mut i = 0;
        while got.len() < total {
            let mut buf = vec![0u8; reads[i % reads.len()].max(1)];
            let n = reader.read(&mut buf).await.unwrap();
            assert!(n > 0, "the stream ended after {} of {total} bytes", got.len());
            got.extend_from_slice(&buf[..n]);
            i += 1;
        }
        writer.await.unwrap();
        got
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Whatever the sizes of the records, of the pieces they arrive in and of the reads, the
        /// plaintext comes out whole and in order, through a buffer that grows only as records need.
        #[test]
        fn records_cut_anywhere_read_back_whole(
            sizes in proptest::collection::vec(1usize..(3 * MAX_BODY / 2), 1..5),
            pieces in proptest::collection::vec(1usize..300_000, 1..6),
            reads in proptest::collection::vec(1usize..200_000, 1..6),
            encrypted in any::<bool>(),
        ) {
            let writes: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| (0..n).map(|b| (b * 7 + i) as u8).collect()).collect();
            let expected: Vec<u8> = writes.concat();
            let protection = if encrypted { DataProtection::Encrypted } else { DataProtection::Integrity };
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let got = rt.block_on(round_trip(protection, writes, pieces, reads));
            prop_assert!(got == expected);
        }
    }
}
