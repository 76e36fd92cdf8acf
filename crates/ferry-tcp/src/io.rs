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

use std::os::fd::AsRawFd;

use bytes::{Buf, BytesMut};
use ferry_core::codec::{self, Decoded, Frame, Limits};
use ferry_core::{AccessGuard, Error, RegionEntry, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// Most bytes one system call moves, so that a permit is held briefly.
const MAX_CHUNK: usize = 4 << 20;
/// Payload pieces below this size are copied through the read buffer.
pub(crate) const DIRECT_THRESHOLD: usize = 64 << 10;
/// How much the read buffer asks the socket for at once.
const READ_AHEAD: usize = 256 << 10;

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
    half: OwnedReadHalf,
    buf: BytesMut,
    limits: Limits,
    peer: String,
}

impl FrameReader {
    /// Wraps the read half of a stream.
    pub fn new(half: OwnedReadHalf, limits: Limits, peer: String) -> Self {
        FrameReader {
            half,
            buf: BytesMut::with_capacity(READ_AHEAD),
            limits,
            peer,
        }
    }

    /// The peer, for messages.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    fn closed(&self) -> Error {
        Error::PeerClosed(format!("{} closed the connection", self.peer))
    }

    async fn fill(&mut self) -> Result<()> {
        self.buf.reserve(READ_AHEAD);
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
            self.buf.reserve(READ_AHEAD);
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

    /// Reads `len` payload bytes into `region` at `offset` (a range the caller resolved). Each copy
    /// holds a permit of the region's access guard and, when given, of `caller`'s: the guard of the operation
    /// that asked for the bytes, which closes when that operation returns or is dropped.
    pub async fn read_into(
        &mut self,
        region: &RegionEntry,
        offset: u64,
        len: u64,
        caller: Option<&AccessGuard>,
    ) -> Result<Landed> {
        let mut done = 0u64;
        let mut landed = Landed::Written;
        // Bytes already buffered come first.
        while done < len && (!self.buf.is_empty() || len - done < DIRECT_THRESHOLD as u64) {
            if self.buf.is_empty() {
                self.fill().await?;
            }
            let n = self.buf.len().min((len - done) as usize);
            if landed == Landed::Written {
                let held = caller.map(AccessGuard::enter);
                landed = match held {
                    Some(None) => Landed::Abandoned,
                    _ if region.copy_in(offset + done, &self.buf[..n]).is_err() => Landed::RegionGone,
                    _ => Landed::Written,
                };
            }
            self.buf.advance(n);
            done += n as u64;
        }
        let stream: &TcpStream = self.half.as_ref();
        while done < len {
            let want = ((len - done) as usize).min(MAX_CHUNK);
            if landed != Landed::Written {
                self.discard(len - done).await?;
                return Ok(landed);
            }
            let at = offset + done;
            let res = raw_io(stream, Interest::READABLE, || {
                let held = caller.map(AccessGuard::enter);
                if let Some(None) = held {
                    return Ok(Err(Landed::Abandoned));
                }
                let Some(_permit) = region.guard().enter() else {
                    return Ok(Err(Landed::RegionGone));
                };
                // SAFETY: `[at, at + want)` lies inside the region (resolved by the caller, and
                // `done + want <= len`); the permit keeps the memory registered for the duration of
                // this non-blocking call; the kernel writes through the raw pointer, no Rust
                // reference to region memory exists.
                let r = unsafe { libc::read(stream.as_raw_fd(), region.ptr_at(at).cast(), want) };
                cvt(r).map(Ok)
            })
            .await;
            let n = match res {
                Ok(Ok(n)) => n,
                Ok(Err(stopped)) => {
                    landed = stopped;
                    continue;
                }
                // The bytes stay in the socket: they are discarded above.
                Err(e) if e.raw_os_error() == Some(libc::EFAULT) => {
                    landed = Landed::Unbacked;
                    continue;
                }
                Err(e) => return Err(self.io_error(e)),
            };
            if n == 0 {
                return Err(self.closed());
            }
            done += n as u64;
        }
        Ok(landed)
    }

    /// Reads `len` payload bytes into `dst` (a pool buffer).
    pub async fn read_exact(&mut self, dst: &mut [u8]) -> Result<()> {
        let from_buf = self.buf.len().min(dst.len());
        dst[..from_buf].copy_from_slice(&self.buf[..from_buf]);
        self.buf.advance(from_buf);
        self.half
            .read_exact(&mut dst[from_buf..])
            .await
            .map_err(|e| self.io_error(e))?;
        Ok(())
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
    half: OwnedWriteHalf,
    buf: BytesMut,
    peer: String,
}

impl FrameWriter {
    /// Wraps the write half of a stream.
    pub fn new(half: OwnedWriteHalf, peer: String) -> Self {
        FrameWriter {
            half,
            buf: BytesMut::with_capacity(64 << 10),
            peer,
        }
    }

    fn io_error(&self, e: std::io::Error) -> Error {
        match e.kind() {
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe => {
                Error::PeerClosed(format!("{}: {e}", self.peer))
            }
            _ => Error::io(format_args!("writing to {}", self.peer), e),
        }
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
        Ok(())
    }

    /// Sends what is queued as far as the socket takes it without waiting: true once all is sent.
    pub fn try_flush(&mut self) -> Result<bool> {
        while !self.buf.is_empty() {
            match self.half.try_write(&self.buf) {
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

    /// Flushes, then sends `bytes` (a pool buffer) without copying them into the frame buffer.
    pub async fn write_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        self.flush().await?;
        self.half.write_all(bytes).await.map_err(|e| self.io_error(e))
    }

    /// Flushes what is queued and shuts the write direction down; errors are moot by then.
    pub async fn shutdown(&mut self) {
        let _ = self.flush().await;
        let _ = self.half.shutdown().await;
    }

    /// Flushes, then sends `len` bytes straight from `region` at `offset` (a range the caller resolved).
    /// If the region is deregistered part-way, the rest of the payload is sent as zeros so that the
    /// stream stays framed, and false is returned.
    pub async fn write_region(&mut self, region: &RegionEntry, offset: u64, len: u64) -> Result<bool> {
        self.flush().await?;
        let mut done = 0u64;
        let mut intact = true;
        while done < len {
            let want = ((len - done) as usize).min(MAX_CHUNK);
            let at = offset + done;
            let n = if intact {
                let stream: &TcpStream = self.half.as_ref();
                let res = raw_io(stream, Interest::WRITABLE, || {
                    let Some(_permit) = region.guard().enter() else {
                        return Ok(None);
                    };
                    // SAFETY: `[at, at + want)` lies inside the region (resolved by the caller); the permit
                    // keeps it registered for this non-blocking call; the kernel reads through the raw
                    // pointer and no Rust reference to region memory is made.
                    let r =
                        unsafe { libc::send(stream.as_raw_fd(), region.ptr_at(at).cast(), want, libc::MSG_NOSIGNAL) };
                    cvt(r).map(Some)
                })
                .await;
                match res {
                    Ok(Some(n)) => n,
                    // Deregistered, or (EFAULT) a mapped file that shrank: zeros go out instead.
                    Ok(None) => {
                        intact = false;
                        continue;
                    }
                    Err(e) if e.raw_os_error() == Some(libc::EFAULT) => {
                        intact = false;
                        continue;
                    }
                    Err(e) => return Err(self.io_error(e)),
                }
            } else {
                let zeros = vec![0u8; want.min(64 << 10)];
                self.half.write_all(&zeros).await.map_err(|e| self.io_error(e))?;
                zeros.len()
            };
            done += n as u64;
        }
        Ok(intact)
    }
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
