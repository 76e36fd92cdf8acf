//! The target's side of a link: a thread that reads the initiator's requests from the link's Unix
//! socket and answers them with the link's view of the peer (grants, per-peer keys).
//!
//! **Regions the engine allocated** (a memfd) are lent: the target sends the region's memory file
//! (`SCM_RIGHTS`) to a peer that may both read and write it, and the peer copies itself. The target
//! holds a permit of the region's access guard for as long as the peer holds the mapping, so a
//! deregistration asks for the mapping back and waits until the peer answers that it unmapped (after
//! its copies in progress); a revoke asks for it back as soon as the peer's grant no longer covers it.
//! A peer with read-only or write-only access gets no mapping (a memory file's descriptor can be
//! reopened for writing), only copies.
//!
//! **Other regions** are copied by the target, between the peer's memory and the region, with
//! cross-memory attach, under a permit of each region's access guard:
//!
//! - a write is complete when its reply leaves: its bytes are in the region (and persisted first,
//!   when the request asks for that);
//! - a region's deregistration waits for the copies in progress and refuses later ones, exactly as on
//!   TCP;
//! - the peer's process id is the kernel's (`SO_PEERCRED` on the socket, checked against the process
//!   the setup probed), never what the peer says.
//!
//! The thread blocks in system calls and in copies; one per link keeps the runtime's workers free.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use ferry_core::region::{bounce_piece, by_region, file_pieces, into_files};
use ferry_core::{Access, Durability, EngineContext, Error, Op, OwnedPermit, PeerView, RegionKey, Resolved, Result};

use crate::cma::{self, Direction, Range};
use crate::fdpass;
use crate::pidfd::PidFd;
use ferry_proto::shm::{self as wire, Item, REQUEST_HEAD, RequestKind};

/// How long the initiator has to connect to the socket it was told of.
const CONNECT_LIMIT: Duration = Duration::from_secs(10);
/// How long a write to the initiator may block (an initiator that stops reading ends its link).
const WRITE_LIMIT: Duration = Duration::from_secs(5);
/// How long a link the target closed waits for the initiator to give back its mappings and close.
const LINGER_LIMIT: Duration = Duration::from_secs(10);

/// A region lent to the initiator as a memory file: the permit keeps the region's deregistration
/// waiting until the initiator has unmapped it.
struct Lent {
    /// The key the peer knows the region by.
    named: RegionKey,
    /// Whether the target asked for it back.
    asked: bool,
    _permit: OwnedPermit,
}

/// One accepted link, as the target serves it.
pub(crate) struct Served {
    pub ctx: Weak<EngineContext>,
    pub peer: Arc<PeerView>,
    /// The initiator's process, as probed at setup.
    pub pid: u32,
    /// The same process, held: checked around every copy (see [`crate::pidfd`]).
    process: PidFd,
    pub token: [u8; wire::TOKEN_LEN],
    pub link: u64,
    /// The link's socket, for replies and the target's own messages; `None` until the initiator
    /// connected and once the target shut it. Writes are whole messages under this lock, and the
    /// lock is taken before `lent`.
    writer: Mutex<Option<UnixStream>>,
    lent: Mutex<HashMap<RegionKey, Lent>>,
    /// Bumped whenever a lent region comes back (or the link ends).
    given_back: tokio::sync::watch::Sender<u64>,
    next_unmap: AtomicU64,
    /// When the target closed the link.
    shut_at: Mutex<Option<std::time::Instant>>,
}

impl Served {
    pub fn new(
        ctx: Weak<EngineContext>,
        peer: Arc<PeerView>,
        process: PidFd,
        token: [u8; wire::TOKEN_LEN],
        link: u64,
    ) -> Arc<Self> {
        Arc::new(Served {
            ctx,
            peer,
            pid: process.pid(),
            process,
            token,
            link,
            writer: Mutex::new(None),
            lent: Mutex::new(HashMap::new()),
            given_back: tokio::sync::watch::Sender::new(0),
            next_unmap: AtomicU64::new(1),
            shut_at: Mutex::new(None),
        })
    }

    fn writer(&self) -> Result<MutexGuard<'_, Option<UnixStream>>> {
        self.writer
            .lock()
            .map_err(|_| Error::Internal("shared-memory link writer lock poisoned".into()))
    }

    fn lent(&self) -> MutexGuard<'_, HashMap<RegionKey, Lent>> {
        self.lent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends one whole message; a failed write shuts the link.
    fn send(&self, writer: &mut Option<UnixStream>, bytes: &[u8]) -> Result<()> {
        let Some(stream) = writer.as_mut() else {
            return Err(Error::PeerClosed("the shared-memory link is closed".into()));
        };
        if let Err(e) = stream.write_all(bytes) {
            if let Some(s) = writer.take() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            return Err(Error::io("writing to the shared-memory link", e));
        }
        Ok(())
    }

    /// Closes the link from the target's side: the initiator sees the end, gives back its mappings
    /// (after its copies in progress) and closes in turn, which ends the link's thread, or
    /// [`LINGER_LIMIT`] does. Until then the regions lent stay held.
    pub fn shut(&self) {
        if let Ok(mut at) = self.shut_at.lock() {
            at.get_or_insert_with(std::time::Instant::now);
        }
        if let Ok(Some(s)) = self.writer.lock().map(|mut w| w.take()) {
            let _ = s.shutdown(std::net::Shutdown::Write);
        }
    }

    /// Whether the target closed the link.
    fn is_shut(&self) -> bool {
        self.shut_at.lock().map_or(true, |at| at.is_some())
    }

    /// Whether the target closed the link more than [`LINGER_LIMIT`] ago.
    fn lingered_out(&self) -> bool {
        self.shut_at
            .lock()
            .ok()
            .and_then(|at| *at)
            .is_some_and(|at| at.elapsed() > LINGER_LIMIT)
    }

    /// The link ended: nothing is lent any more.
    fn ended(&self) {
        self.lent().clear();
        self.given_back.send_modify(|n| *n += 1);
    }

    /// Answers a `Map` request: lends the region's memory file if the peer may both read and write
    /// it, or says why not.
    fn lend(&self, ctx: &EngineContext, id: u64, named: RegionKey) -> Result<()> {
        let mut writer = self.writer()?;
        let decision = (|| {
            let r = ctx.resolve(&self.peer, named, 0, 1, Op::Read)?;
            let access = r.region.access_for(self.peer.identity());
            if !access.contains(Access::READ_WRITE) {
                return Err(Error::Unsupported(format!(
                    "region {named:?} is not open to this peer for both reading and writing, and a mapping \
                     could be used for both: the target copies for it instead"
                )));
            }
            let device = match r.region.block().device_address() {
                Some(address) => Some(device_lend(address, r.region.len())?),
                None if r.region.block().has_access_hooks() || r.region.block().shared_file().is_none() => {
                    return Err(Error::Unsupported(format!(
                        "region {named:?} is {}, not an engine allocation (memfd)",
                        r.region.block().kind()
                    )));
                }
                None => None,
            };
            let permit = r.region.guard().enter_owned().ok_or_else(|| r.region.gone())?;
            Ok((r.region, permit, device))
        })();
        let (region, permit, device) = match decision {
            Ok(lent) => lent,
            Err(e) => {
                let mut bytes = Vec::new();
                wire::encode_reply(&mut bytes, id, &Err(e));
                return self.send(&mut writer, &bytes);
            }
        };
        // Recorded before the file or handle leaves, under the writer's lock: an `Unmap` of it can only
        // follow this reply on the socket.
        let lent = Lent {
            named,
            asked: false,
            _permit: permit,
        };
        if let Some(lend) = device {
            let mut bytes = Vec::with_capacity(wire::REPLY_HEAD + wire::DEVICE_MAPPED_LEN);
            wire::encode_device_mapped(&mut bytes, id, &lend);
            self.lent().insert(region.key(), lent);
            tracing::debug!(link = self.link, region = ?named, "lending a region of GPU memory by its IPC handle");
            return self.send(&mut writer, &bytes);
        }
        let (Some(stream), Some(fd)) = (writer.as_ref(), region.block().shared_file()) else {
            return Err(Error::PeerClosed("the shared-memory link is closed".into()));
        };
        let mut bytes = Vec::with_capacity(wire::REPLY_HEAD + wire::MAPPED_LEN);
        wire::encode_mapped(&mut bytes, id, region.len(), true);
        self.lent().insert(region.key(), lent);
        if let Err(e) = fdpass::send_with_fd(stream, &bytes, fd) {
            if let Some(s) = writer.take() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            return Err(Error::io("lending a region's memory file", e));
        }
        tracing::debug!(link = self.link, region = ?named, "lent a region's memory file");
        Ok(())
    }

    /// Asks the initiator to give back region `real` if it holds it (and was not asked already).
    /// Returns whether it holds it.
    pub fn ask_back(&self, real: RegionKey) -> bool {
        let Ok(mut writer) = self.writer() else { return false };
        let named = match self.lent().get_mut(&real) {
            None => return false,
            Some(l) if l.asked => return true,
            Some(l) => {
                l.asked = true;
                l.named
            }
        };
        let mut bytes = Vec::with_capacity(wire::REPLY_HEAD + wire::UNMAP_LEN);
        wire::encode_unmap(&mut bytes, self.next_unmap.fetch_add(1, Ordering::Relaxed), named);
        // A failed write shuts the link; its thread then ends and frees what was lent.
        let _ = self.send(&mut writer, &bytes);
        true
    }

    /// Asks back region `real` if the peer's grants no longer open it for both reading and writing;
    /// returns whether it was asked back.
    pub fn ask_back_if_revoked(&self, real: RegionKey) -> bool {
        if !self.lent().contains_key(&real) {
            return false;
        }
        let still = self.ctx.upgrade().is_some_and(|ctx| {
            ctx.regions.read().ok().is_some_and(|t| {
                t.get(real)
                    .is_some_and(|e| e.access_for(self.peer.identity()).contains(Access::READ_WRITE))
            })
        });
        !still && self.ask_back(real)
    }

    /// Resolves once region `real` is no longer lent (given back, or the link ended).
    pub async fn returned(self: Arc<Self>, real: RegionKey) {
        let mut changes = self.given_back.subscribe();
        let _ = changes.wait_for(|_| !self.lent().contains_key(&real)).await;
    }

    /// The initiator unmapped the region it knows as `named`.
    fn unmapped(&self, named: RegionKey) {
        let real = self.peer.real_key(named);
        if self.lent().remove(&real).is_some() {
            tracing::debug!(link = self.link, region = ?named, "a lent region came back");
            self.given_back.send_modify(|n| *n += 1);
        }
    }
}

/// The handle of device memory at `address`, `len` bytes, for a peer of this host.
#[cfg(feature = "cuda")]
fn device_lend(address: ferry_core::DeviceAddress, len: u64) -> Result<wire::DeviceLend> {
    let ferry_core::DeviceAddress::Cuda(ptr) = address else {
        return Err(Error::Unsupported(format!(
            "{address:?} cannot be lent to another process"
        )));
    };
    let export = ferry_cuda::ipc::export(ptr, len)?;
    if !wire::pci_address_fits(&export.pci_address) {
        return Err(Error::Internal(format!(
            "the CUDA driver named a device \"{}\", which is no PCI address",
            export.pci_address
        )));
    }
    Ok(wire::DeviceLend {
        len,
        offset: export.offset,
        handle: export.handle,
        pci_address: export.pci_address,
    })
}

/// Device memory is lent only by a build with the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn device_lend(address: ferry_core::DeviceAddress, _len: u64) -> Result<wire::DeviceLend> {
    Err(Error::Unsupported(format!(
        "{address:?}: this build of ferry-shm has no `cuda` feature, so it lends no device memory"
    )))
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
pub(crate) fn spawn(listener: UnixListener, served: Arc<Served>) -> Result<()> {
    std::thread::Builder::new()
        .name(format!("ferry-shm-{}", served.link))
        .spawn(move || {
            match accept(&listener, &served) {
                Ok(stream) => {
                    drop(listener);
                    if let Err(e) = serve(stream, &served) {
                        tracing::debug!(link = served.link, error = %e, "shared-memory link ended");
                    }
                }
                Err(e) => tracing::warn!(link = served.link, error = %e, "shared-memory link refused"),
            }
            served.ended();
        })
        .map(|_| ())
        .map_err(|e| Error::io("starting the shared-memory link's thread", e))
}

/// Waits for the initiator's connection to the link's socket, by [`CONNECT_LIMIT`]. Anyone on the
/// host can connect to an abstract socket, so a connection from another process, or with a wrong
/// token, is closed and the wait goes on: a squatter neither gets in nor keeps the initiator out.
fn accept(listener: &UnixListener, served: &Served) -> Result<UnixStream> {
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("configuring the link's socket", e))?;
    let deadline = std::time::Instant::now() + CONNECT_LIMIT;
    loop {
        let stream = next_connection(listener, served, deadline)?;
        match admit(stream, served, deadline) {
            Ok(stream) => return Ok(stream),
            Err(e) => tracing::warn!(
                link = served.link,
                error = %e,
                "closed a connection to the shared-memory link's socket; still waiting for the initiator"
            ),
        }
    }
}

/// The next connection to the link's socket. The wait ends at `deadline`, and at once when the link's
/// path was dropped (a setup replaced by another): a peer that never connects leaves no thread or
/// socket behind.
fn next_connection(listener: &UnixListener, served: &Served, deadline: std::time::Instant) -> Result<UnixStream> {
    loop {
        match listener.accept() {
            Ok((s, _)) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if served.is_shut() {
                    return Err(Error::PeerClosed(
                        "the link's path was closed before the initiator connected to it".into(),
                    ));
                }
                if std::time::Instant::now() >= deadline {
                    return Err(Error::Timeout(
                        "the initiator never connected to the link's socket".into(),
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(Error::io("accepting the link's socket", e)),
        }
    }
}

/// Checks a connection to the link's socket: the process the setup probed (as the kernel says, read
/// before anything is), then the link's token, by `deadline`.
fn admit(stream: UnixStream, served: &Served, deadline: std::time::Instant) -> Result<UnixStream> {
    let configure = |e| Error::io("configuring the link's socket", e);
    stream.set_nonblocking(false).map_err(configure)?;
    let pid = peer_pid(&stream)?;
    if pid != served.pid {
        return Err(Error::PermissionDenied(format!(
            "process {pid} connected to the socket set up for process {}",
            served.pid
        )));
    }
    // The id the kernel gave is the probed process's only while that process lives.
    served.process.check("before it connected")?;
    let left = deadline
        .saturating_duration_since(std::time::Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).map_err(configure)?;
    stream.set_write_timeout(Some(WRITE_LIMIT)).map_err(configure)?;
    let mut token = [0u8; wire::TOKEN_LEN];
    (&stream)
        .read_exact(&mut token)
        .map_err(|e| Error::io("reading the link's token", e))?;
    if token != served.token {
        return Err(Error::PermissionDenied("a wrong token on the link's socket".into()));
    }
    // Reads start once `poll` saw a request begin (see `wait_for_request`): the limit bounds only an
    // initiator that stops in the middle of one.
    stream.set_read_timeout(Some(REQUEST_LIMIT)).map_err(configure)?;
    *served.writer()? = Some(stream.try_clone().map_err(configure)?);
    Ok(stream)
}

/// Waits until a request starts to arrive: polls the socket for up to [`SPIN`] (a request that
/// follows its predecessor closely is then served without the thread going to sleep and being
/// woken), then sleeps in `poll`, waking every [`IDLE_CHECK`] to see whether the target closed the
/// link more than [`LINGER_LIMIT`] ago. Returns `false` then: an initiator that never gives back what
/// was lent nor closes its end holds the link's thread and the lent regions no longer.
fn wait_for_request(stream: &UnixStream, served: &Served) -> bool {
    let started = std::time::Instant::now();
    let mut fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    while started.elapsed() < SPIN {
        // SAFETY: one valid pollfd for the stream's open descriptor; a zero timeout never blocks.
        if unsafe { libc::poll(&mut fd, 1, 0) } != 0 {
            return true;
        }
        std::hint::spin_loop();
    }
    loop {
        // SAFETY: as above; the timeout bounds the wait.
        if unsafe { libc::poll(&mut fd, 1, IDLE_CHECK.as_millis() as i32) } != 0 {
            return true;
        }
        if served.lingered_out() {
            return false;
        }
    }
}

/// How long the link's thread polls for the next request before it sleeps.
const SPIN: Duration = Duration::from_micros(15);
/// How often a sleeping link thread checks whether it outlived its link.
const IDLE_CHECK: Duration = Duration::from_millis(500);
/// How long the rest of a request may take once its first byte arrived.
const REQUEST_LIMIT: Duration = Duration::from_secs(10);

fn serve(mut stream: UnixStream, served: &Served) -> Result<()> {
    let mut replies = Vec::new();
    let mut body = Vec::new();
    // What writes into files pass through (see `copy_into_files`), kept for the link.
    let mut bounce = Vec::new();
    loop {
        let mut head = [0u8; REQUEST_HEAD];
        if !wait_for_request(&stream, served) {
            return Err(Error::Timeout(format!(
                "the initiator neither gave back what was lent nor closed within {LINGER_LIMIT:?} of the link's end"
            )));
        }
        match stream.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(Error::io("reading a request", e)),
        }
        let head = wire::decode_request_head(&head)?;
        body.resize(head.items * wire::ITEM_LEN, 0);
        stream
            .read_exact(&mut body)
            .map_err(|e| Error::io("reading a request", e))?;
        let items = wire::decode_items(&body)?;
        let Some(ctx) = served.ctx.upgrade() else {
            return Ok(());
        };
        match head.kind {
            RequestKind::Transfer(op) => {
                let result = apply(&ctx, served, (op, head.durability, &items), &mut bounce);
                replies.clear();
                wire::encode_reply(&mut replies, head.id, &result);
                served.send(&mut *served.writer()?, &replies)?;
            }
            RequestKind::Map => served.lend(&ctx, head.id, items[0].key)?,
            RequestKind::Unmapped => served.unmapped(items[0].key),
        }
    }
}

/// Checks every range, then copies them all, then persists them if asked: nothing is copied for a
/// request with a range that does not resolve. Writes whose every range is large and lies in a
/// page-cache file go into the files through `bounce` ([`into_files`]).
fn apply(
    ctx: &EngineContext,
    served: &Served,
    (op, durability, items): (Op, Durability, &[Item]),
    bounce: &mut Vec<u8>,
) -> Result<()> {
    // Counted from before the grant checks until the copies end, for revokes to wait out.
    let _in_progress = served.peer.accesses().begin();
    let mut parts: Vec<(Resolved, OwnedPermit)> = Vec::with_capacity(items.len());
    for i in items {
        let r = match op {
            Op::Write => ctx.resolve_write(&served.peer, i.key, i.offset, i.len, durability)?,
            Op::Read => ctx.resolve(&served.peer, i.key, i.offset, i.len, op)?,
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
    served.process.check("before a copy")?;
    if op == Op::Write && into_files(parts.iter().map(|(r, _)| r), durability) {
        copy_into_files(served.pid, &parts, items, bounce)?;
    } else {
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
            Op::Write => Direction::In,
            Op::Read => Direction::Out,
        };
        // SAFETY: every local range lies in its region (resolved above) and a permit of the region's
        // guard is held until the copy ends, so the memory stays mapped; regions are never handed
        // out as Rust references, so the kernel's writes conflict with no borrow.
        unsafe { cma::copy(served.pid, direction, &ranges)? };
    }
    // Alive after the copy as before it: the id named this process throughout.
    served.process.check("during a copy")?;
    if op == Op::Write {
        for (r, _) in &parts {
            r.region.block().check_backing()?;
            ferry_core::integrity::fault::landed(r);
        }
        if durability == Durability::Persistent {
            // One flush per region per request, as on TCP, not one per range. The bytes were
            // written through the file or by `process_vm_readv`, whose copy into this process is a
            // CPU store like any other: every written page is dirty already.
            for (region, ranges) in by_region(parts.iter().map(|(r, _)| r)) {
                region.persist_written(&ranges, true)?;
            }
        }
    }
    Ok(())
}

/// Copies each write's range from the initiator into `bounce` in pieces ([`file_pieces`])
/// and writes it into its region's file ([`ferry_core::FileWriter`]); the permits in `parts` are held.
fn copy_into_files(pid: u32, parts: &[(Resolved, OwnedPermit)], items: &[Item], bounce: &mut Vec<u8>) -> Result<()> {
    for ((r, _), item) in parts.iter().zip(items) {
        for (at, n) in file_pieces(r.len) {
            let piece = bounce_piece(bounce, n);
            let range = Range {
                local: piece.as_mut_ptr(),
                remote: item.addr + at,
                len: n,
            };
            // SAFETY: the local range is `piece`, the first `n` bytes of `bounce`, a buffer this
            // thread owns and lends to no one while the kernel writes into it.
            unsafe { cma::copy(pid, Direction::In, &[range])? };
            r.region.write_through_file(r.offset + at, piece)?;
        }
    }
    Ok(())
}
