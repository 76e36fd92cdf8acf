//! Memory files passed over the link's Unix socket (`SCM_RIGHTS`).
//!
//! The target sends a region's memory file attached to the bytes of its `Mapped` reply; the
//! initiator reads the whole stream with `recvmsg`, so that a descriptor is never dropped by a plain
//! read, and queues the descriptors in the order they came. The kernel hands a message's descriptors
//! to the first `recvmsg` that reads any of that message's bytes, so once a `Mapped` reply is read
//! whole, its descriptor is in the queue.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use tokio::io::Interest;
use tokio::net::unix::OwnedReadHalf;

/// Descriptors one `recvmsg` may bring (the target attaches one per message).
const FDS_PER_READ: usize = 4;
/// Descriptors the initiator keeps unclaimed before it calls the stream malformed.
const MAX_QUEUED: usize = 16;

/// Room for the control message of [`FDS_PER_READ`] descriptors, aligned as `cmsghdr` needs.
#[repr(C, align(8))]
struct ControlBuf([u8; 128]);

/// Sends `bytes` on the blocking `stream` with `fd` attached.
pub(crate) fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut control = ControlBuf([0; 128]);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    debug_assert!(space <= control.0.len());
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty header; its fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `control`, which holds `space` bytes, enough for one header and one
    // descriptor; CMSG_FIRSTHDR is therefore non-null and CMSG_DATA lies inside `control`.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<RawFd>(), fd.as_raw_fd());
    }
    // SAFETY: `msg` and what it points to (`iov` over `bytes`, `control`) live across the call.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    // The descriptor went with the first byte; the rest of the message follows as plain bytes.
    io::Write::write_all(&mut &*stream, &bytes[sent as usize..])
}

/// The initiator's reading end: bytes in order, and the descriptors that came with them.
pub(crate) struct FdReader {
    half: OwnedReadHalf,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    fds: VecDeque<OwnedFd>,
}

impl FdReader {
    pub(crate) fn new(half: OwnedReadHalf) -> Self {
        FdReader {
            half,
            buf: vec![0u8; 16 << 10].into_boxed_slice(),
            start: 0,
            end: 0,
            fds: VecDeque::new(),
        }
    }

    /// Fills `out` from the stream; `UnexpectedEof` if the stream ends first.
    pub(crate) async fn read_exact(&mut self, out: &mut [u8]) -> io::Result<()> {
        let mut filled = 0;
        while filled < out.len() {
            if self.start == self.end {
                self.start = 0;
                self.end = 0;
                self.end = self.fill().await?;
                if self.end == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            }
            let n = (self.end - self.start).min(out.len() - filled);
            out[filled..filled + n].copy_from_slice(&self.buf[self.start..self.start + n]);
            self.start += n;
            filled += n;
        }
        Ok(())
    }

    /// The oldest descriptor received and not yet claimed.
    pub(crate) fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fds.pop_front()
    }

    /// One `recvmsg` into the empty buffer; returns the bytes read (0 at the end of the stream).
    async fn fill(&mut self) -> io::Result<usize> {
        loop {
            self.half.readable().await?;
            let stream = self.half.as_ref();
            let buf = &mut self.buf;
            let fds = &mut self.fds;
            match stream.try_io(Interest::READABLE, || recv(stream.as_raw_fd(), buf, fds)) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

fn recv(socket: RawFd, buf: &mut [u8], fds: &mut VecDeque<OwnedFd>) -> io::Result<usize> {
    let mut control = ControlBuf([0; 128]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty header; its fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = control.0.len() as _;
    // SAFETY: `msg` points at `buf` and `control`, both valid for writes of the lengths it gives.
    let n = unsafe { libc::recvmsg(socket, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled `msg_controllen` bytes of `control` with well-formed headers, which
    // the CMSG macros walk within that length; each SCM_RIGHTS payload is an array of descriptors
    // that this process now owns.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&msg);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let payload = (*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(header).cast::<RawFd>();
                for i in 0..payload / std::mem::size_of::<RawFd>() {
                    fds.push_back(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            header = libc::CMSG_NXTHDR(&msg, header);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > MAX_QUEUED {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the target sent more descriptors than it announced (more than {FDS_PER_READ} at once or {MAX_QUEUED} unclaimed)"
            ),
        ));
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    #[tokio::test]
    async fn a_descriptor_arrives_with_its_bytes_among_plain_ones() {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let b = tokio::net::UnixStream::from_std(b).unwrap();
        let (half, _keep) = b.into_split();
        let mut reader = FdReader::new(half);
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        io::Write::write_all(&mut &a, b"plain").unwrap();
        send_with_fd(&a, b"withfd", file.as_fd()).unwrap();
        io::Write::write_all(&mut &a, b"after").unwrap();
        drop(a);
        let mut got = [0u8; 5];
        reader.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"plain");
        let mut got = [0u8; 6];
        reader.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"withfd");
        let fd = reader.take_fd().expect("the descriptor came with its bytes");
        assert!(reader.take_fd().is_none());
        let mut got = [0u8; 5];
        reader.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"after");
        let err = reader.read_exact(&mut got).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        // The received descriptor is a working one.
        let mut text = String::new();
        io::Read::read_to_string(&mut std::fs::File::from(fd), &mut text).unwrap();
        assert!(text.contains(')'));
    }
}
