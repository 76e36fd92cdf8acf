//! Frames on a TCP stream, with payloads moved straight between the socket and registered memory.
//!
//! Headers and bodies go through a small buffer. A payload bound for a region is read with `read(2)`
//! into the region itself, and a payload taken from a region is sent with `write(2)` from the region
//! itself: no intermediate copy, and no `&[u8]` over memory that peers may be writing. Each system call
//! runs under a permit of the region's access guard and is non-blocking, so deregistration never waits on the
//! network.
//!
//! Small payloads are the exception: many small segments are read into the buffer in one call and
//! copied out, which beats one system call per segment.
//!
//! A stream under TLS (a control stream) or under the record layer of a protected data stream
//! ([`crate::sealed`]) cannot hand region memory to the kernel: its payloads go through the buffer,
//! copied in and out under the same permits.

use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use ferry_core::codec::{self, Decoded, Frame, Limits};
use ferry_core::{AccessGuard, Error, Permit, RegionEntry, Resolved, Result};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Interest, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio_rustls::TlsStream;

use crate::sealed::{SealedRead, SealedWrite};
use ferry_proto::seal::MAX_BODY;
use ferry_proto::{Opener, Sealer};

/// How long sent data may stay unacknowledged (a dead peer, or one whose receive window stays shut
/// because it stopped reading) before the kernel gives the connection up, by default.
pub const DEFAULT_SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Sets up a new connection: no Nagle delay, and the kernel ends it once sent data waited
/// `send_timeout` for an acknowledgement (`TCP_USER_TIMEOUT`, which covers a shut receive window
/// too), with keepalive probes so that a silent dead peer is found on an idle link as well. No timer
/// per send: the bound costs nothing on the data path.
pub(crate) fn configure(stream: &TcpStream, send_timeout: std::time::Duration) -> Result<()> {
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("setting TCP_NODELAY", e))?;
    let ms = u32::try_from(send_timeout.as_millis()).unwrap_or(u32::MAX).max(1);
    let idle = (ms / 1000 / 3).clamp(1, 7200) as libc::c_int;
    let options: [(libc::c_int, libc::c_int, libc::c_int); 5] = [
        (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, ms as libc::c_int),
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, idle),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
    ];
    for (level, name, value) in options {
        set_int_option(stream, level, name, value).map_err(|e| Error::io("setting the connection's timeouts", e))?;
    }
    Ok(())
}

/// `setsockopt` of an `int` option on `stream`'s socket.
fn set_int_option(
    stream: &TcpStream,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: `stream` owns the open socket for the duration of the call; the option value is a
    // c_int on the stack, passed with its size.
    let r = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    cvt(r as libc::ssize_t).map(drop)
}

/// A connected stream: plain TCP, or TLS over TCP.
pub(crate) enum Conn {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Conn {
    /// The read and write halves, for a [`FrameReader`] and a [`FrameWriter`].
    pub(crate) fn split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Conn::Plain(tcp) => {
                let (r, w) = tcp.into_split();
                (ReadHalf::Plain(r), WriteHalf::Plain(w))
            }
            Conn::Tls(tls) => {
                let (r, w) = tokio::io::split(*tls);
                (ReadHalf::Tls(r), WriteHalf::Tls(w))
            }
        }
    }
}

/// The read half of a [`Conn`]. Only a plain one lets the kernel write payloads into regions.
pub enum ReadHalf {
    /// Plain TCP.
    Plain(OwnedReadHalf),
    /// TLS over TCP.
    Tls(tokio::io::ReadHalf<TlsStream<TcpStream>>),
    /// Protected records over TCP.
    Sealed(Box<SealedRead>),
}

/// The write half of a [`Conn`]. Only a plain one lets the kernel read payloads from regions.
pub enum WriteHalf {
    /// Plain TCP.
    Plain(OwnedWriteHalf),
    /// TLS over TCP.
    Tls(tokio::io::WriteHalf<TlsStream<TcpStream>>),
    /// Protected records over TCP.
    Sealed(Box<SealedWrite>),
}

impl AsyncRead for ReadHalf {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            ReadHalf::Plain(h) => Pin::new(h).poll_read(cx, buf),
            ReadHalf::Tls(h) => Pin::new(h).poll_read(cx, buf),
            ReadHalf::Sealed(h) => Pin::new(&mut **h).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for WriteHalf {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Plain(h) => Pin::new(h).poll_write(cx, buf),
            WriteHalf::Tls(h) => Pin::new(h).poll_write(cx, buf),
            WriteHalf::Sealed(h) => Pin::new(&mut **h).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Plain(h) => Pin::new(h).poll_flush(cx),
            WriteHalf::Tls(h) => Pin::new(h).poll_flush(cx),
            WriteHalf::Sealed(h) => Pin::new(&mut **h).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Plain(h) => Pin::new(h).poll_shutdown(cx),
            WriteHalf::Tls(h) => Pin::new(h).poll_shutdown(cx),
            WriteHalf::Sealed(h) => Pin::new(&mut **h).poll_shutdown(cx),
        }
    }
}

/// Most bytes one system call moves, so that a permit is held briefly.
const MAX_CHUNK: usize = 4 << 20;
/// Payload pieces below this size are copied through the read buffer.
pub(crate) const DIRECT_THRESHOLD: usize = 64 << 10;
/// How much the read buffer asks the socket for at once.
const READ_AHEAD: usize = 256 << 10;
/// The highest `SO_RCVLOWAT` a payload read sets: the read buffer's size (128 KiB measured the same,
/// 1 MiB no better).
const RCVLOWAT_MAX: usize = READ_AHEAD;
/// How much the read buffer of a stream not yet admitted asks for at once: enough for a hello, so
/// that what an unauthenticated peer makes the target hold stays small.
const HANDSHAKE_READ_AHEAD: usize = 1 << 10;
/// Most ranges one `sendmsg(2)`/`readv(2)` names (Linux's `IOV_MAX` is 1024; one is kept for the read
/// buffer).
const MAX_IOV: usize = 1023;

/// Where a sequence of region ranges stands: the range at `index`, `skip` bytes into it.
#[derive(Debug, Clone, Copy, Default)]
struct Cursor {
    index: usize,
    skip: u64,
}

impl Cursor {
    /// Moves `n` bytes on.
    fn advance(&mut self, parts: &[Resolved], mut n: u64) {
        while n > 0 && self.index < parts.len() {
            let rest = parts[self.index].len - self.skip;
            if n >= rest {
                n -= rest;
                self.index += 1;
                self.skip = 0;
            } else {
                self.skip += n;
                n = 0;
            }
        }
    }

    fn done(&self, parts: &[Resolved]) -> bool {
        self.index >= parts.len()
    }

    /// Bytes from here to the end.
    fn remaining(&self, parts: &[Resolved]) -> u64 {
        parts[self.index.min(parts.len())..].iter().map(|p| p.len).sum::<u64>() - self.skip
    }
}

/// The ranges from `at` on, as `iovec`s into region memory, each under a permit of its region's
/// guard (pushed to `permits`): at most [`MAX_IOV`] ranges and [`MAX_CHUNK`] bytes. `None` when a
/// region is being deregistered.
fn region_iovecs<'a>(parts: &'a [Resolved], at: Cursor, permits: &mut Vec<Permit<'a>>) -> Option<Vec<libc::iovec>> {
    let mut iov = Vec::with_capacity((parts.len() - at.index).min(MAX_IOV));
    let mut bytes = 0usize;
    let mut skip = at.skip;
    for p in &parts[at.index..] {
        if iov.len() == MAX_IOV || bytes == MAX_CHUNK {
            break;
        }
        permits.push(p.region.guard().enter()?);
        let len = ((p.len - skip) as usize).min(MAX_CHUNK - bytes);
        iov.push(libc::iovec {
            iov_base: p.region.ptr_at(p.offset + skip).cast(),
            iov_len: len,
        });
        bytes += len;
        skip = 0;
    }
    Some(iov)
}

/// Where a payload segment read from the socket ended up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landed {
    /// Every byte is in the region.
    Written,
    /// The region was deregistered while the bytes arrived: the rest were discarded.
    RegionGone,
    /// The kernel could not write into the region's memory (`EFAULT`: a mapped file that shrank):
    /// the rest were discarded.
    Unbacked,
    /// The operation's caller returned or gave up (its [`AccessGuard`] closed): the rest were discarded, so
    /// that no byte lands in memory that is the caller's again.
    Abandoned,
}

/// Reads frames and payloads from one stream.
pub struct FrameReader {
    half: ReadHalf,
    buf: BytesMut,
    limits: Limits,
    /// How much one read asks the socket for.
    read_ahead: usize,
    /// The socket's `SO_RCVLOWAT` as last set (1, the kernel's default, outside [`read_parts`](
    /// Self::read_parts)).
    rcvlowat: usize,
    peer: String,
}

impl FrameReader {
    /// Wraps the read half of a stream.
    pub fn new(half: ReadHalf, limits: Limits, peer: String) -> Self {
        FrameReader {
            half,
            buf: BytesMut::with_capacity(READ_AHEAD),
            limits,
            read_ahead: READ_AHEAD,
            rcvlowat: 1,
            peer,
        }
    }

    /// Wraps the read half of a stream that has yet to be admitted: frames are decoded with the
    /// handshake's `limits` and the socket is read a little at a time, so that a peer holds at most
    /// about a hello's worth of the target's memory until [`admitted`](Self::admitted).
    pub fn before_admission(half: ReadHalf, limits: Limits, peer: String) -> Self {
        FrameReader {
            half,
            buf: BytesMut::with_capacity(HANDSHAKE_READ_AHEAD),
            limits,
            read_ahead: HANDSHAKE_READ_AHEAD,
            rcvlowat: 1,
            peer,
        }
    }

    /// The stream was admitted: from now on frames are decoded with `limits`, and read ahead fully.
    pub fn admitted(&mut self, limits: Limits) {
        self.limits = limits;
        self.read_ahead = READ_AHEAD;
    }

    /// From here on the stream's bytes come in records that `opener` opens (what was read past the
    /// handshake already is the start of them). Only a plain stream turns protected.
    pub fn sealed(self, opener: Opener) -> Result<FrameReader> {
        let ReadHalf::Plain(half) = self.half else {
            return Err(Error::Internal("only a plain stream can turn protected".into()));
        };
        Ok(FrameReader {
            half: ReadHalf::Sealed(Box::new(SealedRead::new(half, opener, &self.buf))),
            buf: BytesMut::with_capacity(self.read_ahead),
            ..self
        })
    }

    /// The peer, for messages.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    fn closed(&self) -> Error {
        Error::PeerClosed(format!("{} closed the connection", self.peer))
    }

    /// Sets the plain socket's `SO_RCVLOWAT` to `mark` unless it is that already. An error breaks
    /// the stream: a mark left above what a peer will send would leave its bytes unread.
    fn set_rcvlowat(&mut self, mark: usize) -> Result<()> {
        if mark == self.rcvlowat {
            return Ok(());
        }
        if let ReadHalf::Plain(half) = &self.half {
            set_rcvlowat(half.as_ref(), mark)
                .map_err(|e| Error::io(format_args!("setting SO_RCVLOWAT on the stream from {}", self.peer), e))?;
        }
        self.rcvlowat = mark;
        Ok(())
    }

    async fn fill(&mut self) -> Result<()> {
        self.buf.reserve(self.read_ahead);
        let n = self.half.read_buf(&mut self.buf).await.map_err(|e| self.io_error(e))?;
        if n == 0 {
            return Err(self.closed());
        }
        Ok(())
    }

    fn io_error(&self, e: std::io::Error) -> Error {
        match e.kind() {
            std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof => Error::PeerClosed(format!("{}: {e}", self.peer)),
            _ => Error::io(format_args!("reading from {}", self.peer), e),
        }
    }

    /// Whether a whole frame (header and body) is already buffered, or a malformed one that will fail
    /// at once: either way `next` will not wait for the network.
    pub fn has_frame(&self) -> bool {
        !matches!(codec::decode(&self.buf, &self.limits), Ok(None))
    }

    /// The next frame; `Ok(None)` on a clean end of stream between frames.
    pub async fn next(&mut self) -> Result<Option<Decoded>> {
        loop {
            if let Some((decoded, used)) = codec::decode(&self.buf, &self.limits)? {
                self.buf.advance(used);
                return Ok(Some(decoded));
            }
            self.buf.reserve(self.read_ahead);
            let n = self.half.read_buf(&mut self.buf).await.map_err(|e| self.io_error(e))?;
            if n == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(self.closed())
                };
            }
        }
    }

    /// Reads `dst.len()` payload bytes into `dst` (a pool buffer, or the buffer a write passes
    /// through on its way into a file). While a large part of it is still to come, the socket's
    /// low-water mark is raised as [`read_parts`](Self::read_parts) raises it, and it is back at 1
    /// when this returns.
    pub async fn read_exact(&mut self, dst: &mut [u8]) -> Result<()> {
        let filled = self.read_exact_marked(dst).await;
        self.set_rcvlowat(1)?;
        filled
    }

    async fn read_exact_marked(&mut self, dst: &mut [u8]) -> Result<()> {
        let mut at = self.buf.len().min(dst.len());
        dst[..at].copy_from_slice(&self.buf[..at]);
        self.buf.advance(at);
        while at < dst.len() {
            let left = dst.len() - at;
            self.set_rcvlowat(match left >= DIRECT_THRESHOLD {
                true => left.min(RCVLOWAT_MAX),
                false => 1,
            })?;
            let n = self.half.read(&mut dst[at..]).await.map_err(|e| self.io_error(e))?;
            if n == 0 {
                return Err(self.closed());
            }
            at += n;
        }
        Ok(())
    }

    /// Reads a payload that goes to `parts`, back to back (one region range, or a batched write's
    /// segments). Bytes already buffered are copied in; the rest is read with `readv(2)` straight into
    /// the regions; once less than [`DIRECT_THRESHOLD`] of the payload is left, whatever follows on the
    /// stream comes into the read buffer in the same call, so that many small segments and the next
    /// frames cost one system call. Reading ahead earlier would pull the next payload through the
    /// buffer, a copy more (1 MiB writes on one stream: 5.1 GB/s reading ahead always, 6.3 near the
    /// end only). Each copy and call
    /// holds permits of the regions' guards and, when given, of `caller`'s: the guard of the operation
    /// that asked for the bytes, which closes when that operation returns or is dropped. When a guard
    /// refuses, or the kernel finds a region's memory unbacked, the rest of the payload is read and
    /// dropped, and the result says why.
    ///
    /// While a large part of the payload is still to come, the socket is told not to report it
    /// readable for less (`SO_RCVLOWAT`, up to [`RCVLOWAT_MAX`]): the kernel then wakes this task
    /// once per that many bytes rather than for every few segments, and the sender, which on one
    /// host delivers the segments itself, wakes it as seldom. Between two processes on a 2-core
    /// machine that raised 1 MiB writes on one stream from 5.2-5.5 GB/s to 7.4-8.7 (reads: 5.9-6.0 to
    /// 7.1-7.4). The mark never exceeds what the payload still owes, so the bytes it waits for are
    /// on their way, and it is back at 1 when this returns.
    pub async fn read_parts(&mut self, parts: &[Resolved], caller: Option<&AccessGuard>) -> Result<Landed> {
        let landed = self.read_parts_marked(parts, caller).await;
        self.set_rcvlowat(1)?;
        landed
    }

    async fn read_parts_marked(&mut self, parts: &[Resolved], caller: Option<&AccessGuard>) -> Result<Landed> {
        let mut at = Cursor::default();
        let stopped = loop {
            if at.done(parts) {
                return Ok(Landed::Written);
            }
            let step = match self.buf.is_empty() {
                false => self.copy_buffered(parts, at, caller),
                true => self.readv_into(parts, at, caller).await?,
            };
            match step {
                Ok(n) => at.advance(parts, n),
                Err(stopped) => break stopped,
            }
        };
        let rest = at.remaining(parts);
        self.discard(rest).await?;
        Ok(stopped)
    }

    /// Copies buffered bytes into the range at `at`: how many, or why not.
    fn copy_buffered(
        &mut self,
        parts: &[Resolved],
        at: Cursor,
        caller: Option<&AccessGuard>,
    ) -> std::result::Result<u64, Landed> {
        let n = copy_into_part(parts, at, caller, &self.buf)?;
        self.buf.advance(n);
        Ok(n as u64)
    }

    /// One `readv(2)` into the ranges from `at` on (and, past the payload, into the read buffer): how
    /// many payload bytes landed, or why none may. An error breaks the stream.
    async fn readv_into(
        &mut self,
        parts: &[Resolved],
        at: Cursor,
        caller: Option<&AccessGuard>,
    ) -> Result<std::result::Result<u64, Landed>> {
        let payload_left = at.remaining(parts);
        self.set_rcvlowat(match payload_left >= DIRECT_THRESHOLD as u64 {
            true => payload_left.min(RCVLOWAT_MAX as u64) as usize,
            false => 1,
        })?;
        let half = match &mut self.half {
            ReadHalf::Plain(half) => half,
            ReadHalf::Sealed(_) => return self.copy_opened(parts, at, caller).await,
            ReadHalf::Tls(_) => {
                // Decrypted bytes exist only in user space: through the buffer.
                self.fill().await?;
                return Ok(self.copy_buffered(parts, at, caller));
            }
        };
        let stream: &TcpStream = half.as_ref();
        self.buf.reserve(self.read_ahead);
        let buf = &mut self.buf;
        let res = raw_io(stream, Interest::READABLE, || {
            let _held = match caller.map(AccessGuard::enter) {
                Some(None) => return Ok(Err(Landed::Abandoned)),
                held => held,
            };
            let mut permits = Vec::new();
            let Some(mut iov) = region_iovecs(parts, at, &mut permits) else {
                return Ok(Err(Landed::RegionGone));
            };
            let named: u64 = iov.iter().map(|v| v.iov_len as u64).sum();
            if named == payload_left && payload_left < DIRECT_THRESHOLD as u64 {
                // What follows the end of the payload lands in the read buffer.
                let spare = buf.spare_capacity_mut();
                iov.push(libc::iovec {
                    iov_base: spare.as_mut_ptr().cast(),
                    iov_len: spare.len(),
                });
            }
            // SAFETY: every iovec but the last names a range inside a region (resolved by the
            // caller), registered for the duration of this non-blocking call by the permits held;
            // the last, when present, is the read buffer's spare capacity. The kernel writes
            // through the raw pointers; no Rust reference to region memory exists.
            let r = unsafe { libc::readv(stream.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int) };
            cvt(r).map(|n| Ok((n as u64, named)))
        })
        .await;
        let (n, named) = match res {
            Ok(Ok(read)) => read,
            Ok(Err(stopped)) => return Ok(Err(stopped)),
            // The bytes stay in the socket: the caller discards them.
            Err(e) if e.raw_os_error() == Some(libc::EFAULT) => return Ok(Err(Landed::Unbacked)),
            Err(e) => return Err(self.io_error(e)),
        };
        if n == 0 {
            return Err(self.closed());
        }
        let into_regions = n.min(named);
        // SAFETY: the kernel initialised the bytes past the payload in the spare capacity, right
        // after the buffer's (empty) contents.
        unsafe { self.buf.set_len(self.buf.len() + (n - into_regions) as usize) };
        Ok(Ok(into_regions))
    }

    /// Copies the opened plaintext of a sealed stream into the range at `at`, straight from the
    /// record it came in: how many bytes, or why none may.
    async fn copy_opened(
        &mut self,
        parts: &[Resolved],
        at: Cursor,
        caller: Option<&AccessGuard>,
    ) -> Result<std::result::Result<u64, Landed>> {
        let ReadHalf::Sealed(sealed) = &mut self.half else {
            return Err(Error::Internal("copy_opened on a stream that is not sealed".into()));
        };
        match std::future::poll_fn(|cx| sealed.poll_fill(cx)).await {
            Ok(true) => {}
            Ok(false) => return Err(self.closed()),
            Err(e) => return Err(self.io_error(e)),
        }
        let copied = copy_into_part(parts, at, caller, sealed.plain());
        if let Ok(n) = copied {
            sealed.consume(n);
        }
        Ok(copied.map(|n| n as u64))
    }

    /// Reads and drops `len` payload bytes: the payload of a refused operation.
    pub async fn discard(&mut self, mut len: u64) -> Result<()> {
        while len > 0 {
            if self.buf.is_empty() {
                self.fill().await?;
            }
            let n = self.buf.len().min(len.min(usize::MAX as u64) as usize);
            self.buf.advance(n);
            len -= n as u64;
        }
        Ok(())
    }
}

/// Writes frames and payloads to one stream.
pub struct FrameWriter {
    half: WriteHalf,
    buf: BytesMut,
    peer: String,
}

impl FrameWriter {
    /// Wraps the write half of a stream.
    pub fn new(half: WriteHalf, peer: String) -> Self {
        FrameWriter {
            half,
            buf: BytesMut::with_capacity(64 << 10),
            peer,
        }
    }

    fn io_error(&self, e: std::io::Error) -> Error {
        write_error(&self.peer, e)
    }

    /// From here on everything sent goes in records that `sealer` seals. Only a plain stream with
    /// nothing queued turns protected.
    pub fn sealed(self, sealer: Sealer) -> Result<FrameWriter> {
        let (WriteHalf::Plain(half), true) = (self.half, self.buf.is_empty()) else {
            return Err(Error::Internal(
                "only a plain stream with nothing queued can turn protected".into(),
            ));
        };
        Ok(FrameWriter {
            half: WriteHalf::Sealed(Box::new(SealedWrite::new(half, sealer))),
            ..self
        })
    }

    /// Queues a frame header and body.
    pub fn push(&mut self, frame: &Frame, payload_len: u64) -> Result<()> {
        codec::encode(frame, payload_len, &mut self.buf)
    }

    /// Queues payload bytes already in hand (small payloads, pool buffers).
    pub fn push_bytes(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes queued and not yet sent.
    pub fn queued(&self) -> usize {
        self.buf.len()
    }

    /// Queues `len` bytes copied from `region` at `offset`; for small payloads.
    /// Returns false (and queues zeros) if the region was deregistered.
    pub fn push_region(&mut self, region: &RegionEntry, offset: u64, len: usize) -> bool {
        let start = self.buf.len();
        self.buf.resize(start + len, 0);
        let ok = region.copy_out(offset, &mut self.buf[start..]).is_ok();
        if !ok {
            self.buf[start..].fill(0);
        }
        ok
    }

    /// Sends everything queued.
    pub async fn flush(&mut self) -> Result<()> {
        if !self.buf.is_empty() {
            let r = self.half.write_all(&self.buf).await;
            self.buf.clear();
            r.map_err(|e| self.io_error(e))?;
        }
        if !matches!(self.half, WriteHalf::Plain(_)) {
            // TLS and sealed streams keep records they could not send yet; plain TCP keeps nothing.
            self.half.flush().await.map_err(|e| self.io_error(e))?;
        }
        Ok(())
    }

    /// Sends what is queued as far as the socket takes it without waiting: true once all is sent.
    /// Under TLS nothing is sent here (encrypting belongs on the write task): false while bytes wait.
    pub fn try_flush(&mut self) -> Result<bool> {
        let WriteHalf::Plain(half) = &self.half else {
            return Ok(self.buf.is_empty());
        };
        while !self.buf.is_empty() {
            match half.try_write(&self.buf) {
                Ok(n) => bytes::Buf::advance(&mut self.buf, n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => {
                    self.buf.clear();
                    return Err(self.io_error(e));
                }
            }
        }
        Ok(true)
    }

    /// Flushes what is queued and shuts the write direction down; errors are moot by then.
    pub async fn shutdown(&mut self) {
        let _ = self.flush().await;
        let _ = self.half.shutdown().await;
    }
    /// Flushes, then sends the ranges `parts` back to back straight from their regions, several
    /// ranges to a `sendmsg(2)` (a batched write's segments): no copy into a buffer. Each call runs
    /// under permits of the regions' guards. If a region is deregistered part-way (or its memory is
    /// found unbacked), the rest of the payload goes out as zeros so that the stream stays framed, and
    /// false is returned.
    pub async fn write_parts(&mut self, parts: &[Resolved]) -> Result<bool> {
        self.flush().await?;
        let half = match &mut self.half {
            WriteHalf::Plain(half) => half,
            WriteHalf::Sealed(_) | WriteHalf::Tls(_) => return self.write_parts_copied(parts).await,
        };
        let stream: &TcpStream = half.as_ref();
        let mut at = Cursor::default();
        while !at.done(parts) {
            let res = raw_io(stream, Interest::WRITABLE, || {
                let mut permits = Vec::new();
                let Some(mut iov) = region_iovecs(parts, at, &mut permits) else {
                    return Ok(None);
                };
                // SAFETY: an all-zero msghdr is valid (no name, no control data).
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = iov.as_mut_ptr();
                msg.msg_iovlen = iov.len();
                // SAFETY: every iovec names a range inside a region (resolved by the caller), kept
                // registered for the duration of this non-blocking call by the permits held; the
                // kernel only reads through the raw pointers, and no Rust reference to region memory
                // is made.
                let r = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
                cvt(r).map(Some)
            })
            .await;
            match res {
                Ok(Some(n)) => at.advance(parts, n as u64),
                // Deregistered, or (EFAULT) a mapped file that shrank: zeros go out instead.
                Ok(None) => return self.send_zeros(at.remaining(parts)).await.map(|()| false),
                Err(e) if e.raw_os_error() == Some(libc::EFAULT) => {
                    return self.send_zeros(at.remaining(parts)).await.map(|()| false);
                }
                Err(e) => return Err(self.io_error(e)),
            }
        }
        Ok(true)
    }

    /// [`write_parts`](Self::write_parts) on a stream that encrypts or seals in user space: each
    /// range is copied a chunk at a time under its region's guard, straight into a record on a
    /// sealed stream ([`MAX_BODY`] at a time), through the buffer under TLS ([`MAX_CHUNK`]).
    async fn write_parts_copied(&mut self, parts: &[Resolved]) -> Result<bool> {
        let mut intact = true;
        for p in parts {
            let mut done = 0u64;
            while done < p.len {
                let (offset, left) = (p.offset + done, p.len - done);
                let n = match &mut self.half {
                    WriteHalf::Sealed(sealed) => {
                        let n = left.min(MAX_BODY as u64) as usize;
                        intact &= sealed
                            .send_region(&p.region, offset, n)
                            .await
                            .map_err(|e| write_error(&self.peer, e))?;
                        n
                    }
                    _ => {
                        let n = left.min(MAX_CHUNK as u64) as usize;
                        intact &= self.push_region(&p.region, offset, n);
                        self.flush().await?;
                        n
                    }
                };
                done += n as u64;
            }
        }
        self.flush().await?;
        Ok(intact)
    }

    /// Sends `bytes`, after whatever is queued: a payload from a buffer of the transport's own.
    pub(crate) async fn send_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        self.flush().await?;
        self.half.write_all(bytes).await.map_err(|e| self.io_error(e))?;
        self.half.flush().await.map_err(|e| self.io_error(e))
    }

    /// Sends `len` zero bytes: the rest of a payload whose memory went away, to keep the stream framed.
    pub(crate) async fn send_zeros(&mut self, mut len: u64) -> Result<()> {
        let zeros = vec![0u8; (len as usize).min(64 << 10)];
        while len > 0 {
            let n = (len as usize).min(zeros.len());
            self.half.write_all(&zeros[..n]).await.map_err(|e| self.io_error(e))?;
            len -= n as u64;
        }
        self.half.flush().await.map_err(|e| self.io_error(e))
    }
}

/// Copies the start of `src` into the range at `at` (as much as both hold), under a permit of
/// `caller`'s guard when given: how many bytes, or why none may land.
fn copy_into_part(
    parts: &[Resolved],
    at: Cursor,
    caller: Option<&AccessGuard>,
    src: &[u8],
) -> std::result::Result<usize, Landed> {
    let p = &parts[at.index];
    let n = src.len().min((p.len - at.skip) as usize);
    let _held = match caller.map(AccessGuard::enter) {
        Some(None) => return Err(Landed::Abandoned),
        held => held,
    };
    if p.region.copy_in(p.offset + at.skip, &src[..n]).is_err() {
        return Err(Landed::RegionGone);
    }
    Ok(n)
}

/// The error of a failed write to `peer`.
fn write_error(peer: &str, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe => {
            Error::PeerClosed(format!("{peer}: {e}"))
        }
        _ => Error::io(format_args!("writing to {peer}"), e),
    }
}

/// The error for a region whose memory the kernel could not write (a mapped file that shrank).
pub(crate) fn unbacked(region: &ferry_core::RegionEntry) -> Error {
    region.block().check_backing().err().unwrap_or_else(|| Error::Io {
        kind: std::io::ErrorKind::InvalidData,
        message: format!(
            "region {:?} ({}) could not be written: its memory is no longer backed",
            region.key(),
            region.block().kind()
        ),
    })
}

/// The error of an access to `parts` that stopped short: a region being deregistered (its guard
/// closed), else a region whose memory is no longer backed.
pub(crate) fn access_error(parts: &[Resolved]) -> Error {
    if let Some(p) = parts.iter().find(|p| p.region.guard().is_closed()) {
        return p.region.gone();
    }
    let unbacked_part = parts.iter().find(|p| p.region.block().check_backing().is_err());
    match unbacked_part.or(parts.first()) {
        Some(p) => unbacked(&p.region),
        None => Error::Internal("an access to no memory stopped short".into()),
    }
}

/// `setsockopt(SO_RCVLOWAT)`: the socket reports itself readable once `mark` bytes wait (or the
/// stream ended, or the kernel runs short of memory or receive window), and the kernel re-checks its
/// readiness at once, so that lowering the mark under bytes already waiting reports them.
fn set_rcvlowat(stream: &TcpStream, mark: usize) -> std::io::Result<()> {
    let value = libc::c_int::try_from(mark).unwrap_or(libc::c_int::MAX);
    set_int_option(stream, libc::SOL_SOCKET, libc::SO_RCVLOWAT, value)
}

fn cvt(r: libc::ssize_t) -> std::io::Result<usize> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// Runs a non-blocking system call when the stream is ready, retrying on `WouldBlock`.
async fn raw_io<T>(
    stream: &TcpStream,
    interest: Interest,
    mut call: impl FnMut() -> std::io::Result<T>,
) -> std::io::Result<T> {
    loop {
        stream.ready(interest).await?;
        match stream.try_io(interest, &mut call) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ferry_core::{Access, MemoryBlock, OwnedBuffer, RegionKey};
    use proptest::prelude::*;

    use super::*;

    fn parts(lens: &[u64]) -> Vec<Resolved> {
        let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; lens.iter().sum::<u64>() as usize + 1]));
        let region = Arc::new(RegionEntry::new(RegionKey(1), Access::READ_WRITE, block).unwrap());
        let mut at = 0;
        lens.iter()
            .map(|&len| {
                let r = Resolved {
                    region: region.clone(),
                    offset: at,
                    len,
                };
                at += len;
                r
            })
            .collect()
    }

    proptest! {
        /// Walking a list of ranges by arbitrary steps: what remains shrinks by exactly each step, the
        /// walk ends exactly at the total, and the iovecs from any point cover what remains, in order.
        #[test]
        fn a_cursor_walks_ranges_exactly(
            lens in proptest::collection::vec(1u64..5000, 1..40),
            steps in proptest::collection::vec(0u64..7000, 0..60),
        ) {
            let parts = parts(&lens);
            let total: u64 = lens.iter().sum();
            let mut at = Cursor::default();
            let mut walked = 0u64;
            for step in steps {
                let step = step.min(total - walked);
                let mut permits = Vec::new();
                let iov = region_iovecs(&parts, at, &mut permits).expect("the region is open");
                let named: u64 = iov.iter().map(|v| v.iov_len as u64).sum();
                prop_assert_eq!(named, at.remaining(&parts).min(MAX_CHUNK as u64));
                if let Some(first) = iov.first() {
                    let p = &parts[at.index];
                    prop_assert_eq!(first.iov_base as usize, p.region.ptr_at(p.offset + at.skip) as usize);
                }
                drop(permits);
                at.advance(&parts, step);
                walked += step;
                prop_assert_eq!(at.remaining(&parts), total - walked);
                prop_assert_eq!(at.done(&parts), walked == total);
            }
        }
    }

    fn rcvlowat_of(reader: &FrameReader) -> libc::c_int {
        let ReadHalf::Plain(half) = &reader.half else {
            panic!("a plain stream")
        };
        let stream: &TcpStream = half.as_ref();
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reads a c_int option of an open socket into a c_int on the stack, with its size.
        let r = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&raw mut value).cast(),
                &mut len,
            )
        };
        assert_eq!(r, 0, "getsockopt: {}", std::io::Error::last_os_error());
        value
    }

    /// A large payload read with the low-water mark raised: its bytes arrive in pieces with pauses
    /// between (each piece under the mark), the sender then sends a few bytes more and waits, and
    /// both the payload and those bytes are read, with the mark back at 1 in between.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_payload_read_under_a_raised_mark_ends_and_the_mark_is_lowered() {
        read_under_a_raised_mark(ReadInto::Regions).await;
    }

    /// The same, read into a buffer (`read_exact`, which a write into a file goes through).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_payload_read_into_a_buffer_under_a_raised_mark_ends_and_the_mark_is_lowered() {
        read_under_a_raised_mark(ReadInto::Buffer).await;
    }

    enum ReadInto {
        Regions,
        Buffer,
    }

    async fn read_under_a_raised_mark(into: ReadInto) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (mut client, (server, _)) = (client.unwrap(), accepted.unwrap());
        let payload: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let sent = payload.clone();
        let sender = tokio::spawn(async move {
            for piece in [&sent[..200 << 10], &sent[200 << 10..700 << 10], &sent[700 << 10..]] {
                client.write_all(piece).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(30)).await;
            }
            client.write_all(b"next!").await.unwrap();
            // Open, and silent, until the reader has everything.
            let _ = released.await;
        });
        let (rx, _tx) = server.into_split();
        let mut reader = FrameReader::new(ReadHalf::Plain(rx), Limits::default(), "test".into());
        let parts = parts(&[300 << 10, 724 << 10]);
        let within = std::time::Duration::from_secs(10);
        let mut landed_bytes = vec![0u8; payload.len()];
        match into {
            ReadInto::Regions => {
                let landed = tokio::time::timeout(within, reader.read_parts(&parts, None)).await;
                assert!(matches!(landed, Ok(Ok(Landed::Written))), "{landed:?}");
                parts[0].region.copy_out(0, &mut landed_bytes).unwrap();
            }
            ReadInto::Buffer => {
                let read = tokio::time::timeout(within, reader.read_exact(&mut landed_bytes)).await;
                assert!(matches!(read, Ok(Ok(()))), "{read:?}");
            }
        }
        assert_eq!(rcvlowat_of(&reader), 1);
        let mut next = [0u8; 5];
        let read = tokio::time::timeout(within, reader.read_exact(&mut next)).await;
        assert!(
            matches!(read, Ok(Ok(()))),
            "the bytes after the payload were not read: {read:?}"
        );
        assert_eq!(&next, b"next!");
        assert!(landed_bytes == payload, "the payload landed changed");
        let _ = release.send(());
        sender.await.unwrap();
    }

    #[test]
    fn no_iovecs_once_a_region_is_closing() {
        let parts = parts(&[10, 20]);
        parts[0].region.guard().close();
        assert!(region_iovecs(&parts, Cursor::default(), &mut Vec::new()).is_none());
    }
}
