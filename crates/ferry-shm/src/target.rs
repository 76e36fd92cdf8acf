//! The target's side of a link: a thread that reads requests from the link's Unix socket, resolves
//! them against the region table with the link's view of the peer (grants, per-peer keys), and copies
//! between the peer's memory and its regions with cross-memory attach, under a permit of each region's
//! access guard. The target does every copy itself, so:
//!
//! - a write is complete when its reply leaves: its bytes are in the region (and persisted first,
//!   when the request asks for that);
//! - a region's deregistration waits for the copies in progress and refuses later ones, exactly as on
//!   TCP: no peer ever holds a mapping or an address it could use after the region is gone;
//! - the peer's process id is the kernel's (`SO_PEERCRED` on the socket, checked against the process
//!   the setup probed), never what the peer says.
//!
//! The thread blocks in system calls and in copies; one per link keeps the runtime's workers free.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use ferry_core::{Durability, EngineContext, Error, OwnedPermit, PeerView, RegionEntry, Resolved, Result};

use crate::cma::{self, Direction, Range};
use crate::wire::{self, Item, REQUEST_HEAD};

/// `(offset, len)` ranges of one region.
type Ranges = Vec<(u64, u64)>;

/// How long the initiator has to connect to the socket it was told of.
const CONNECT_LIMIT: Duration = Duration::from_secs(10);

/// One accepted link, as the target serves it.
pub(crate) struct Served {
    pub ctx: Weak<EngineContext>,
    pub peer: Arc<PeerView>,
    /// The initiator's process, as probed at setup.
    pub pid: u32,
    pub token: [u8; wire::TOKEN_LEN],
    pub link: u64,
}

/// The socket of a served link, for the link's owner to shut down (which ends the thread).
#[derive(Default)]
pub(crate) struct Shutdown(Mutex<Option<UnixStream>>);

impl Shutdown {
    pub fn now(&self) {
        if let Ok(Some(s)) = self.0.lock().map(|mut s| s.take()) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Listens on a fresh abstract socket; returns its name and the listener.
pub(crate) fn listen() -> Result<([u8; 24], UnixListener)> {
    let mut random = [0u8; 12];
    getrandom::fill(&mut random).map_err(|e| Error::Internal(format!("drawing a socket name: {e}")))?;
    let mut name = [0u8; 24];
    for (i, b) in random.iter().enumerate() {
        let hex = format!("{b:02x}");
        name[2 * i..2 * i + 2].copy_from_slice(hex.as_bytes());
    }
    let addr = address(&name)?;
    let listener =
        UnixListener::bind_addr(&addr).map_err(|e| Error::io("binding the shared-memory link's socket", e))?;
    Ok((name, listener))
}

/// The abstract address of the socket named `name`.
pub(crate) fn address(name: &[u8; 24]) -> Result<SocketAddr> {
    SocketAddr::from_abstract_name(format!("ferry-shm-{}", String::from_utf8_lossy(name)))
        .map_err(|e| Error::io("naming the shared-memory link's socket", e))
}

/// The process on the other end of `stream`, as the kernel says.
fn peer_pid(stream: &UnixStream) -> Result<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of their sizes; the fd is the stream's, open.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(Error::io(
            "reading the peer's credentials",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(cred.pid as u32)
}

/// Serves the link on its own thread: waits for the initiator's connection, checks it, then answers
/// requests until the socket closes.
pub(crate) fn spawn(listener: UnixListener, served: Served, shutdown: Arc<Shutdown>) -> Result<()> {
    std::thread::Builder::new()
        .name(format!("ferry-shm-{}", served.link))
        .spawn(move || match accept(&listener, &served, &shutdown) {
            Ok(stream) => {
                drop(listener);
                if let Err(e) = serve(stream, &served) {
                    tracing::debug!(link = served.link, error = %e, "shared-memory link ended");
                }
            }
            Err(e) => tracing::warn!(link = served.link, error = %e, "shared-memory link refused"),
        })
        .map(|_| ())
        .map_err(|e| Error::io("starting the shared-memory link's thread", e))
}

fn accept(listener: &UnixListener, served: &Served, shutdown: &Shutdown) -> Result<UnixStream> {
    // The listener waits at most CONNECT_LIMIT: a peer that never connects leaves no thread behind.
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("configuring the link's socket", e))?;
    let deadline = std::time::Instant::now() + CONNECT_LIMIT;
    let mut stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if std::time::Instant::now() >= deadline {
                    return Err(Error::Timeout(
                        "the initiator never connected to the link's socket".into(),
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(Error::io("accepting the link's socket", e)),
        }
    };
    stream
        .set_nonblocking(false)
        .map_err(|e| Error::io("configuring the link's socket", e))?;
    stream
        .set_read_timeout(Some(CONNECT_LIMIT))
        .map_err(|e| Error::io("configuring the link's socket", e))?;
    let pid = peer_pid(&stream)?;
    if pid != served.pid {
        return Err(Error::PermissionDenied(format!(
            "process {pid} connected to the socket set up for process {}",
            served.pid
        )));
    }
    let mut token = [0u8; wire::TOKEN_LEN];
    stream
        .read_exact(&mut token)
        .map_err(|e| Error::io("reading the link's token", e))?;
    if token != served.token {
        return Err(Error::PermissionDenied("a wrong token on the link's socket".into()));
    }
    stream
        .set_read_timeout(None)
        .map_err(|e| Error::io("configuring the link's socket", e))?;
    if let Ok(mut s) = shutdown.0.lock() {
        *s = stream.try_clone().ok();
    }
    Ok(stream)
}

/// Polls the socket for up to [`SPIN`] before the blocking read: a request that follows its
/// predecessor closely is then served without the thread going to sleep and being woken.
fn wait_briefly(stream: &UnixStream) {
    let started = std::time::Instant::now();
    let mut fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    while started.elapsed() < SPIN {
        // SAFETY: one valid pollfd for the stream's open descriptor; a zero timeout never blocks.
        if unsafe { libc::poll(&mut fd, 1, 0) } != 0 {
            return;
        }
        std::hint::spin_loop();
    }
}

/// How long the link's thread polls for the next request before it sleeps in the read.
const SPIN: Duration = Duration::from_micros(15);

fn serve(mut stream: UnixStream, served: &Served) -> Result<()> {
    let mut replies = Vec::new();
    let mut body = Vec::new();
    loop {
        let mut head = [0u8; REQUEST_HEAD];
        wait_briefly(&stream);
        match stream.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(Error::io("reading a request", e)),
        }
        let (id, op, durability, n) = wire::decode_request_head(&head)?;
        body.resize(n * wire::ITEM_LEN, 0);
        stream
            .read_exact(&mut body)
            .map_err(|e| Error::io("reading a request", e))?;
        let items = wire::decode_items(&body)?;
        let Some(ctx) = served.ctx.upgrade() else {
            return Ok(());
        };
        let result = apply(&ctx, served, op, durability, &items);
        replies.clear();
        wire::encode_reply(&mut replies, id, &result);
        stream
            .write_all(&replies)
            .map_err(|e| Error::io("sending a reply", e))?;
    }
}

/// Checks every range, then copies them all, then persists them if asked: nothing is copied for a
/// request with a range that does not resolve.
fn apply(
    ctx: &EngineContext,
    served: &Served,
    op: ferry_core::Op,
    durability: Durability,
    items: &[Item],
) -> Result<()> {
    // Counted from before the grant checks until the copies end, for revokes to wait out.
    let _in_progress = ctx.accesses.begin();
    let mut parts: Vec<(Resolved, OwnedPermit)> = Vec::with_capacity(items.len());
    for i in items {
        let r = match op {
            ferry_core::Op::Write => ctx.resolve_write(&served.peer, i.key, i.offset, i.len, durability)?,
            ferry_core::Op::Read => ctx.resolve(&served.peer, i.key, i.offset, i.len, op)?,
        };
        if r.region.block().has_access_hooks() {
            return Err(Error::Unsupported(format!(
                "region {:?} is {}: its bytes move through its owner's staging, not shared memory",
                i.key,
                r.region.block().kind()
            )));
        }
        let permit = r.region.guard().enter_owned().ok_or_else(|| r.region.gone())?;
        parts.push((r, permit));
    }
    let ranges: Vec<Range> = parts
        .iter()
        .zip(items)
        .map(|((r, _), i)| Range {
            local: r.region.ptr_at(r.offset),
            remote: i.addr,
            len: r.len as usize,
        })
        .collect();
    let direction = match op {
        ferry_core::Op::Write => Direction::In,
        ferry_core::Op::Read => Direction::Out,
    };
    // SAFETY: every local range lies in its region (resolved above) and a permit of the region's guard
    // is held until the copy ends, so the memory stays mapped; regions are never handed out as Rust
    // references, so the kernel's writes conflict with no borrow.
    unsafe { cma::copy(served.pid, direction, &ranges)? };
    if op == ferry_core::Op::Write {
        for (r, _) in &parts {
            r.region.block().check_backing()?;
        }
        if durability == Durability::Persistent {
            // One flush per region per request, as on TCP, not one per range.
            let mut by_region: Vec<(&Arc<RegionEntry>, Ranges)> = Vec::new();
            for (r, _) in &parts {
                match by_region.iter_mut().find(|(region, _)| Arc::ptr_eq(region, &r.region)) {
                    Some((_, ranges)) => ranges.push((r.offset, r.len)),
                    None => by_region.push((&r.region, vec![(r.offset, r.len)])),
                }
            }
            for (region, ranges) in by_region {
                region.persist(&ranges)?;
            }
        }
    }
    Ok(())
}
