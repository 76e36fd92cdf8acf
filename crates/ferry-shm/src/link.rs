//! The initiator's side of a link. Each item of a transfer takes one of three routes:
//!
//! - **Lent regions** (the target's engine allocations, on a link whose peer may read and write
//!   them): the first use asks the target for the region's memory file and maps it
//!   ([`Mapping`]); from then on READ and WRITE are copies between the caller's memory and the
//!   mapping, done by the transfer's own future, with no system call (a batch of host memory and
//!   mapped regions alone, up to [`COPY_CHUNK`] bytes, right in the caller's first poll, before any
//!   future of the link's own exists: `Inner::batch_now`). A write is complete when the
//!   copy returns: its bytes are then in the target's memory. The target's GPU memory (CUDA, with
//!   the `cuda` feature) is lent the same way, as the allocation's CUDA IPC handle, which this
//!   process opens; its copies are the device's (`cuMemcpyAsync` between the caller's memory, on the
//!   host or a GPU, and the peer's), waited for before the transfer completes. Local GPU memory
//!   whose device copies into any host memory (CUDA's) is copied by its device into and out of a
//!   lent host region's mapping the same way ([`DeviceCopies::copy_raw`](ferry_core::DeviceCopies)),
//!   past the host copy in front of it.
//! - **Copied regions** (memory the target did not allocate, persistent writes): requests go over the
//!   link's Unix socket, each with the local addresses the target copies from or into, and complete
//!   when the target replies (after its copy).
//! - **Everything else** (memory staged by its owner that no device copy here reaches, or copied
//!   regions when the kernel denies the
//!   target cross-memory attach) is declined: the transfer hands it back to the engine
//!   ([`Declined`]), which sends it over the control link.
//!
//! The target copies out of this process's memory for a WRITE, so a request holds a permit of each
//! local region's access guard until its reply arrives (or the link ends), not merely while the
//! caller's future lives: a caller that drops its transfer cannot deregister memory the target is
//! still reading. For a READ the target writes into a read buffer the request owns, and the caller's
//! future copies it into place once the reply came: a READ that timed out or was dropped lands no byte
//! in the caller's memory afterwards, whatever the target still does. That costs a copy per READ.
//!
//! A mapping is given back when the target asks (deregistration, revoke) and when the link ends,
//! always after the copies in progress on it: the target's region is never written after the target
//! heard that it was unmapped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::sync::{Lending, Lendings, LendingsRead};
use ferry_core::{
    DataLink, Declined, Durability, Error, Notification, Op, OwnedPermit, PersistMethod, RawCopy, RegionKey, Result,
    TransferItem, TransferRequest, TransportKind,
};
use futures::future::BoxFuture;
use rustc_hash::FxBuildHasher;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::oneshot;

use crate::copy::{Piece, copy_all};
use crate::fdpass::FdReader;
use crate::mapping::Mapping;
use crate::region_key;
use ferry_proto::shm::{self as wire, Item, MAX_ITEMS, REPLY_HEAD, ReplyKind, RequestKind};
use ferry_proto::{OpId, OpTable};

/// What a reply hands back: the result, and the buffer a READ's bytes came into.
type Done = (Result<()>, Option<Vec<u8>>);

/// A request waiting for the target.
enum Pending {
    Transfer {
        done: oneshot::Sender<Done>,
        /// Where the target writes a READ's bytes.
        read_buffer: Option<Vec<u8>>,
        /// The local regions the target may be copying into or out of.
        _permits: Vec<OwnedPermit>,
    },
    Map {
        done: oneshot::Sender<()>,
        key: RegionKey,
    },
}

/// Where the items of one region go.
#[derive(Clone, Copy)]
enum Way {
    /// Copied here, into or out of the mapping at this index of [`Sorted::mappings`].
    Mapped(usize),
    Copied,
    Control,
}

struct Inner {
    /// `None` once the link is closed (dropping the half shuts the socket down for writing).
    writer: tokio::sync::Mutex<Option<OwnedWriteHalf>>,
    /// Requests awaiting their replies, under the rule every transport answers by (`ferry_proto::ops`).
    pending: Mutex<OpTable<Pending>>,
    /// Lendable regions of the target, by the key this peer knows them by.
    /// Keyed with FxHash: looked up on every transfer, and the keys are the target's own (random
    /// ones, by the engine's rule); a target that picked colliding keys would slow only transfers to
    /// itself, over at most the regions it may advertise. Read by every transfer and written only
    /// when a region is asked for, lent or taken back: a sharded lock (see
    /// [`ShardedLock`](ferry_core::sync::ShardedLock)) lets transfers on every core look up at once, where a mutex made each wait
    /// for the other.
    lendings: Lendings<RegionKey, Mapping, FxBuildHasher>,
    closed: AtomicBool,
    control: Arc<dyn DataLink>,
    peer: String,
    /// Why the target cannot copy with this process (cross-memory attach denied), if it cannot.
    copies_denied: Option<String>,
}

/// The first item of each run of items to one region (items of one region usually follow each
/// other, so that each run is looked up once).
fn first_of_runs(items: &[TransferItem]) -> impl Iterator<Item = &TransferItem> {
    let mut last = None;
    items.iter().filter(move |item| {
        let first = last != Some(item.remote_key);
        last = Some(item.remote_key);
        first
    })
}

/// Bytes of one READ request, and so of its read buffer: a large READ runs as several requests in
/// turn, so that a transfer holds no more than this in read buffers (a copy of 4 MiB takes far longer than
/// the round trip that separates two requests).
const READ_BUFFER_BYTES: u64 = 4 << 20;

/// A READ's requests: its items cut into pieces of at most [`READ_BUFFER_BYTES`] bytes in all and
/// [`MAX_ITEMS`] ranges each, in order.
fn read_pieces(request: &TransferRequest) -> Vec<TransferRequest> {
    let mut pieces = Vec::new();
    let mut items: Vec<TransferItem> = Vec::new();
    let mut bytes = 0u64;
    for item in &request.items {
        let mut done = 0u64;
        while done < item.len() {
            if bytes == READ_BUFFER_BYTES || items.len() == MAX_ITEMS {
                pieces.push(std::mem::take(&mut items));
                bytes = 0;
            }
            let n = (item.len() - done).min(READ_BUFFER_BYTES - bytes);
            items.push(item.part(done, n));
            bytes += n;
            done += n;
        }
    }
    if !items.is_empty() {
        pieces.push(items);
    }
    pieces
        .into_iter()
        .map(|items| TransferRequest {
            op: request.op,
            durability: request.durability,
            items,
            checked: request.checked,
        })
        .collect()
}

/// A same-host data link (see the module documentation).
///
/// Aligned to two cache lines so that, inside the engine's `Arc` of it, the reference counts and the
/// link's fields are on different lines: each transfer holds a clone of that `Arc` until its first
/// poll, while every transfer reads the fields, and on one line the counts' writes from one core made
/// every other core's reads miss (16 tasks of 4 KiB writes over a tower stack on two cores: 1.05
/// against 1.2–1.5 M/s apart).
#[repr(align(128))]
pub struct ShmLink {
    inner: Arc<Inner>,
}

/// Dropping the link gives back every mapping (after the copies in progress on it), then shuts the
/// socket down for writing; the target finishes the request it is copying, sees the end and closes
/// its side, and only then does the reader task end and free what requests in flight hold. The
/// target may be writing a READ's bytes into a read buffer until that moment: the buffer must
/// outlive its copy, not the caller's interest in it.
impl Drop for ShmLink {
    fn drop(&mut self) {
        self.inner.closed.store(true, Ordering::Release);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(self.inner.clone().finish());
            }
            // No runtime: no transfer can be in progress; the mappings go with the last reference.
            Err(_) => {
                if let Ok(mut w) = self.inner.writer.try_lock() {
                    w.take();
                }
            }
        }
    }
}

/// Requests still pending when the link's state goes (its runtime was shut down before the target
/// answered) may have the target writing into their read buffers still: those are leaked, not freed.
impl Drop for Inner {
    fn drop(&mut self) {
        let pending = match self.pending.get_mut() {
            Ok(p) => p,
            Err(p) => p.into_inner(),
        };
        for p in pending.drain() {
            if let Pending::Transfer {
                read_buffer: Some(read_buffer),
                ..
            } = p
            {
                std::mem::forget(read_buffer);
            }
        }
    }
}

impl Inner {
    fn down(&self) -> Error {
        Error::PeerClosed(format!(
            "the shared-memory link to {} is down; connect again",
            self.peer
        ))
    }

    /// Ends every request in flight with `error`, and the link with it.
    fn fail_all(&self, error: &Error) {
        self.closed.store(true, Ordering::Release);
        let pending: Vec<Pending> = self.pending.lock().map(|mut p| p.drain().collect()).unwrap_or_default();
        for p in pending {
            match p {
                Pending::Transfer { done, .. } => {
                    let _ = done.send((Err(error.clone()), None));
                }
                Pending::Map { done, .. } => {
                    let _ = done.send(());
                }
            }
        }
    }

    /// Gives back every mapping, after the copies in progress on each.
    async fn give_back_all(&self) {
        for m in self.lendings.close() {
            m.give_back().await;
        }
    }

    /// The link's end, from this side: mappings given back, then the socket shut for writing.
    async fn finish(self: Arc<Self>) {
        self.closed.store(true, Ordering::Release);
        self.give_back_all().await;
        if let Some(mut w) = self.writer.lock().await.take() {
            let _ = w.shutdown().await;
        }
    }

    async fn send(&self, bytes: &[u8]) -> Result<()> {
        let sent = match self.writer.lock().await.as_mut() {
            Some(w) => w.write_all(bytes).await,
            None => Err(std::io::ErrorKind::NotConnected.into()),
        };
        sent.map_err(|e| {
            let e = Error::PeerClosed(format!("sending to {} over shared memory: {e}", self.peer));
            self.fail_all(&e);
            e
        })
    }

    async fn read_replies(self: Arc<Self>, mut reader: FdReader) {
        let end = loop {
            let mut head = [0u8; REPLY_HEAD];
            if let Err(e) = reader.read_exact(&mut head).await {
                break Error::PeerClosed(format!("the shared-memory link to {} closed: {e}", self.peer));
            }
            let (id, kind, len) = match wire::decode_reply_head(&head) {
                Ok(h) => h,
                Err(e) => break e,
            };
            let mut body = vec![0u8; len];
            if let Err(e) = reader.read_exact(&mut body).await {
                break Error::PeerClosed(format!("the shared-memory link to {} closed: {e}", self.peer));
            }
            let handled = match kind {
                ReplyKind::Done(code) => self.done(id, code, &body),
                ReplyKind::Mapped => self.mapped(id, &body, reader.take_fd()),
                ReplyKind::DeviceMapped => self.device_mapped(id, &body),
                ReplyKind::Unmap => self.unmap(id, &body),
            };
            if let Err(e) = handled {
                break e;
            }
        };
        tracing::debug!(peer = %self.peer, error = %end, "shared-memory link ended");
        self.fail_all(&end);
        self.finish().await;
    }

    /// The request a reply to `id` ends; `None` for a stale reply (its request is no longer
    /// waiting), `Error::Protocol` for an id this link never sent.
    fn take_pending(&self, id: u64) -> Result<Option<Pending>> {
        self.pending
            .lock()
            .map_err(|_| Error::Internal("shared-memory request table lock poisoned".into()))?
            .answer(OpId(id), &format_args!("the shared-memory target {}", self.peer))
    }

    /// A request ended.
    fn done(&self, id: u64, code: Option<ferry_core::ErrorCode>, message: &[u8]) -> Result<()> {
        let result = match code {
            None => Ok(()),
            Some(code) => Err(wire::reply_error(code, message)),
        };
        match self.take_pending(id)? {
            None => tracing::debug!(peer = %self.peer, id, "a stale reply"),
            Some(Pending::Transfer { done, read_buffer, .. }) => {
                let _ = done.send((result, read_buffer));
            }
            Some(Pending::Map { done, key }) => {
                if let Err(e) = &result {
                    tracing::debug!(peer = %self.peer, region = ?key, reason = %e, "the target copies for this region");
                }
                self.lendings.declined(key);
                let _ = done.send(());
            }
        }
        Ok(())
    }

    /// The target lent a region: map it.
    fn mapped(self: &Arc<Self>, id: u64, body: &[u8], fd: Option<std::os::fd::OwnedFd>) -> Result<()> {
        let body: &[u8; wire::MAPPED_LEN] = body.try_into().map_err(|_| wire::malformed("mapped reply"))?;
        let (len, writable) = wire::decode_mapped(body)?;
        let fd = fd.ok_or_else(|| Error::Protocol("a mapped reply came without its memory file".into()))?;
        let Some(pending) = self.take_pending(id)? else {
            tracing::debug!(peer = %self.peer, id, "a stale mapped reply: its memory file is closed");
            return Ok(());
        };
        let Pending::Map { done, key } = pending else {
            return Err(Error::Protocol(format!("a mapped reply to transfer {id}")));
        };
        self.settle(key, Mapping::new(key, fd, len, writable), len);
        let _ = done.send(());
        Ok(())
    }

    /// The target lent a region of GPU memory: open it.
    fn device_mapped(self: &Arc<Self>, id: u64, body: &[u8]) -> Result<()> {
        let body: &[u8; wire::DEVICE_MAPPED_LEN] =
            body.try_into().map_err(|_| wire::malformed("device mapped reply"))?;
        let lend = wire::decode_device_mapped(body)?;
        let Some(pending) = self.take_pending(id)? else {
            tracing::debug!(peer = %self.peer, id, "a stale device mapped reply: nothing was opened");
            return Ok(());
        };
        let Pending::Map { done, key } = pending else {
            return Err(Error::Protocol(format!("a device mapped reply to transfer {id}")));
        };
        self.settle(key, open_device(key, &lend), lend.len);
        let _ = done.send(());
        Ok(())
    }

    /// Records what came of the target's lending of region `key`: the mapping made of it, or, when
    /// it could not be made, that the target must take it back (its items then go elsewhere).
    fn settle(self: &Arc<Self>, key: RegionKey, made: Result<Mapping>, len: u64) {
        match made {
            Ok(m) => match self.lendings.lent(key, Arc::new(m)) {
                Ok(()) => tracing::debug!(peer = %self.peer, region = ?key, len, "mapped a region the target lent"),
                // The link was closed while the target answered: given back at once.
                Err(late) => {
                    let inner = self.clone();
                    tokio::spawn(async move {
                        late.give_back().await;
                        inner.unmapped(0, key).await;
                    });
                }
            },
            Err(e) => {
                tracing::warn!(peer = %self.peer, region = ?key, error = %e, "not mapping a region the target lent");
                self.lendings.declined(key);
                let inner = self.clone();
                tokio::spawn(async move { inner.unmapped(0, key).await });
            }
        }
    }

    /// The target asks for a region back.
    fn unmap(self: &Arc<Self>, id: u64, body: &[u8]) -> Result<()> {
        let key = RegionKey(u64::from_le_bytes(
            body.try_into().map_err(|_| wire::malformed("unmap"))?,
        ));
        let lent = self.lendings.take_back(&key);
        let inner = self.clone();
        tokio::spawn(async move {
            if let Some(m) = lent {
                m.give_back().await;
            }
            inner.unmapped(id, key).await;
        });
        Ok(())
    }

    /// Tells the target that region `key` is unmapped.
    async fn unmapped(&self, id: u64, key: RegionKey) {
        let mut out = Vec::with_capacity(wire::REQUEST_HEAD + wire::ITEM_LEN);
        wire::encode_region_request(&mut out, id, RequestKind::Unmapped, key);
        let _ = self.send(&out).await;
    }

    /// Asks the target to lend region `key` and waits for the answer (the reader records it).
    async fn ask(self: Arc<Self>, key: RegionKey) {
        let (done, answered) = oneshot::channel();
        let id = match self.pending.lock() {
            Ok(mut p) if !self.closed.load(Ordering::Acquire) => p.insert(Pending::Map { done, key }).0,
            _ => return,
        };
        let mut out = Vec::with_capacity(wire::REQUEST_HEAD + wire::ITEM_LEN);
        wire::encode_region_request(&mut out, id, RequestKind::Map, key);
        if self.send(&out).await.is_ok() {
            let _ = answered.await;
        }
    }

    /// One range of a region already mapped (a small synchronous write, say), copied here and now,
    /// or a batch of them ([`batch_now`](Self::batch_now)); `None` for anything else. A link already
    /// seen down fails at once.
    fn transfer_now(&self, request: &TransferRequest) -> Option<Result<()>> {
        if self.closed.load(Ordering::Acquire) {
            return Some(Err(self.down()));
        }
        let [item] = &request.items[..] else {
            return self.batch_now(request);
        };
        // A large copy goes in chunks, in the transfer's future (see `COPY_CHUNK`).
        if !Inner::lendable(item, request.durability)
            || lent_as(item) != Some(region_key::LENDABLE)
            || stages_locally(item)
            || item.len() > COPY_CHUNK as u64
        {
            return None;
        }
        let done = match item.len() <= COPY_UNDER_LOOKUP {
            // Under the table's read lock (a shard of this thread's): no count taken on the mapping,
            // whose reference count every worker's copies would otherwise pass between cores.
            true => match self.lendings.read().get(&item.remote_key) {
                Some(Lending::Lent(mapping)) => copy_one(request.op, item, mapping)?,
                _ => return None,
            },
            false => copy_one(request.op, item, &*self.mapping_of(item.remote_key)?)?,
        };
        // Bytes copied into the mapping of a target whose end of the link is already seen closed
        // reach nobody: that is no completed write.
        if done.is_ok() && self.closed.load(Ordering::Acquire) {
            return Some(Err(self.down()));
        }
        Some(done)
    }

    /// A batch of ranges of host memory here and of regions already mapped, [`COPY_CHUNK`] bytes
    /// at most, copied here and now, the way [`copy_mapped`] copies them but without sorting the
    /// batch into ways first: a batch of many small ranges spent as long sorting and gathering them
    /// as copying them. `None`, with nothing done, for any other batch, or one whose mappings are
    /// not all lent now (being given back, say): it goes through [`DataLink::transfer`].
    fn batch_now(&self, request: &TransferRequest) -> Option<Result<()>> {
        if request.durability != Durability::Completed {
            return None;
        }
        // The mapping of each run of items of one region, the items' own checks made first: a
        // region's memory and its lending are looked at once a run.
        let mut mappings: Vec<Arc<Mapping>> = Vec::new();
        let mut total = 0u64;
        {
            let lendings = self.lendings.read();
            let (mut last_remote, mut last_local) = (None, None);
            for item in &request.items {
                if last_remote != Some(item.remote_key) {
                    match (lent_as(item), lendings.get(&item.remote_key)) {
                        (Some(region_key::LENDABLE), Some(Lending::Lent(m))) => mappings.push(m.clone()),
                        _ => return None,
                    }
                    last_remote = Some(item.remote_key);
                }
                let local = Arc::as_ptr(&item.local.region);
                if last_local != Some(local) {
                    if stages_locally(item) || copies_by_device(item) {
                        return None;
                    }
                    last_local = Some(local);
                }
                total += item.len();
            }
        }
        if total > COPY_CHUNK as u64 {
            return None;
        }
        let remote: Vec<ferry_core::Permit<'_>> = mappings.iter().map(|m| m.enter()).collect::<Option<_>>()?;
        // Each local region's permit, by the region's address: one a region, however its items
        // alternate with another's.
        let mut local: Vec<(*const ferry_core::RegionEntry, ferry_core::Permit<'_>)> = Vec::new();
        let mut pieces = Vec::with_capacity(request.items.len());
        let (mut m, mut last_remote) = (0, None);
        for item in &request.items {
            if last_remote.is_some_and(|key| key != item.remote_key) {
                m += 1;
            }
            last_remote = Some(item.remote_key);
            if let Err(e) = check_mapped(request.op, item, &mappings[m]) {
                return Some(Err(e));
            }
            let region = &item.local.region;
            if !local.iter().any(|(r, _)| *r == Arc::as_ptr(region)) {
                match region.guard().enter() {
                    Some(permit) => local.push((Arc::as_ptr(region), permit)),
                    None => return Some(Err(region.gone())),
                }
            }
            pieces.push(piece(request.op, item, &mappings[m]));
        }
        // SAFETY: every range was checked against its mapping and region above, and a permit of each
        // mapping and region is held until the copies end (and the fault hook's writes into the
        // destinations, just written); regions are never handed out as Rust references.
        unsafe { copy_landing(&pieces) };
        drop((local, remote));
        // Bytes copied into the mapping of a target whose end of the link is already seen closed
        // reach nobody: that is no completed write.
        if self.closed.load(Ordering::Acquire) {
            return Some(Err(self.down()));
        }
        Some(Ok(()))
    }

    /// The mapping of the region the peer knows as `key`, if this link holds one.
    fn mapping_of(&self, key: RegionKey) -> Option<Arc<Mapping>> {
        self.lendings.lent_of(&key)
    }

    /// Whether `item`'s region is one the target may lend, for this transfer.
    fn lendable(item: &TransferItem, durability: Durability) -> bool {
        // A persistent write goes to the target, which persists before it replies (or refuses).
        durability == Durability::Completed
            && (lent_as(item) == Some(region_key::LENDABLE)
                || (cfg!(feature = "cuda") && lent_as(item) == Some(region_key::DEVICE)))
    }

    /// Where the items of `item`'s region go (see the module documentation).
    fn way(
        &self,
        lendings: &LendingsRead<'_, RegionKey, Mapping, FxBuildHasher>,
        item: &TransferItem,
        durability: Durability,
        mappings: &mut Vec<Arc<Mapping>>,
    ) -> Way {
        // The target's GPU memory is reached by the device's copies here, or by the target's own
        // (staged) ones over the control link, never by its copies of this process's memory.
        let fallback = match (lent_as(item), &self.copies_denied) {
            (Some(region_key::DEVICE), _) | (_, Some(_)) => Way::Control,
            _ => Way::Copied,
        };
        if item.remote_transport_key.is_none() {
            return Way::Control;
        }
        if !Self::lendable(item, durability) {
            return fallback;
        }
        match lendings.get(&item.remote_key) {
            Some(Lending::Lent(m)) => match mappings.iter().position(|known| Arc::ptr_eq(known, m)) {
                Some(i) => Way::Mapped(i),
                None => {
                    mappings.push(m.clone());
                    Way::Mapped(mappings.len() - 1)
                }
            },
            // Asked for and not answered yet, declined, or asked back meanwhile: the target answers.
            _ => fallback,
        }
    }

    /// Sorts a transfer's items by way, asking first for the lendable regions it names that this
    /// link has not asked for yet. Items of one region usually follow each other: each run of them
    /// is looked up once.
    async fn sort(self: &Arc<Self>, request: TransferRequest) -> Sorted {
        let durability = request.durability;
        // Nearly always every region was asked for already: look under the read lock first.
        let unasked = |lendings: &LendingsRead<'_, RegionKey, Mapping, FxBuildHasher>, item: &TransferItem| {
            Self::lendable(item, durability) && !lendings.contains(&item.remote_key)
        };
        let any_unasked = {
            let lendings = self.lendings.read();
            first_of_runs(&request.items).any(|item| unasked(&lendings, item))
        };
        let mut to_ask = Vec::new();
        if any_unasked {
            let lendable = first_of_runs(&request.items).filter(|item| Self::lendable(item, durability));
            to_ask = self.lendings.ask(lendable.map(|item| item.remote_key));
        }
        for key in to_ask {
            self.clone().ask(key).await;
        }
        let mut sorted = Sorted {
            op: request.op,
            durability,
            mapped: Vec::with_capacity(request.items.len()),
            device: Vec::new(),
            local_device: Vec::new(),
            mappings: Vec::new(),
            copied: Vec::new(),
            control: Vec::new(),
        };
        let lendings = self.lendings.read();
        let mut last: Option<(RegionKey, Way)> = None;
        for item in request.items {
            let way = match last {
                Some((key, way)) if key == item.remote_key => way,
                _ => {
                    let way = self.way(&lendings, &item, durability, &mut sorted.mappings);
                    last = Some((item.remote_key, way));
                    way
                }
            };
            match way {
                Way::Mapped(i) if sorted.mappings[i].is_device() => match device_reaches(&item) {
                    true => sorted.device.push((item, i)),
                    false => sorted.control.push(item),
                },
                Way::Mapped(i) if copies_by_device(&item) => sorted.local_device.push((item, i)),
                _ if stages_locally(&item) => sorted.control.push(item),
                Way::Mapped(i) => sorted.mapped.push((item, i)),
                Way::Copied => sorted.copied.push(item),
                Way::Control => sorted.control.push(item),
            }
        }
        sorted
    }

    /// Sends one request of at most [`MAX_ITEMS`] ranges and waits for its reply.
    async fn request(self: Arc<Self>, request: TransferRequest) -> Result<()> {
        let mut permits = Vec::with_capacity(request.items.len());
        let mut items = Vec::with_capacity(request.items.len());
        let reading = request.op == Op::Read;
        let total: u64 = request.items.iter().map(|i| i.local.len).sum();
        let mut read_buffer = reading.then(|| vec![0u8; total as usize]);
        let mut at = 0usize;
        for i in &request.items {
            let region = &i.local.region;
            let addr = match &mut read_buffer {
                Some(buf) => buf.as_mut_ptr().wrapping_add(at) as u64,
                None => {
                    permits.push(region.guard().enter_owned().ok_or_else(|| region.gone())?);
                    region.ptr_at(i.local.offset) as u64
                }
            };
            at += i.local.len as usize;
            items.push(Item {
                key: i.remote_key,
                offset: i.remote_offset,
                len: i.local.len,
                addr,
            });
        }
        let (done, result) = oneshot::channel();
        let id = {
            let mut pending = self
                .pending
                .lock()
                .map_err(|_| Error::Internal("shared-memory request table lock poisoned".into()))?;
            if self.closed.load(Ordering::Acquire) {
                return Err(self.down());
            }
            pending
                .insert(Pending::Transfer {
                    done,
                    read_buffer,
                    _permits: permits,
                })
                .0
        };
        let mut out = Vec::with_capacity(wire::REQUEST_HEAD + items.len() * wire::ITEM_LEN);
        wire::encode_request(
            &mut out,
            id,
            RequestKind::Transfer(request.op),
            request.durability,
            &items,
        );
        self.send(&out).await?;
        let (result, read_buffer) = result.await.unwrap_or_else(|_| (Err(self.down()), None));
        result?;
        // A READ's bytes go into place here, while the caller still waits for them.
        if let Some(read_buffer) = read_buffer {
            let mut at = 0usize;
            for i in &request.items {
                let n = i.local.len as usize;
                i.local.region.copy_in(i.local.offset, &read_buffer[at..at + n])?;
                ferry_core::integrity::fault::landed(&i.local);
                at += n;
            }
        }
        Ok(())
    }

    /// The items the target copies: READs in pieces of bounded read buffers, one after the other; WRITEs
    /// in requests of at most [`MAX_ITEMS`] ranges, all at once.
    async fn copied(self: Arc<Self>, op: Op, durability: Durability, items: Vec<TransferItem>) -> Result<()> {
        let request = TransferRequest {
            op,
            durability,
            items,
            checked: false,
        };
        if request.op == Op::Read {
            for piece in read_pieces(&request) {
                self.clone().request(piece).await?;
            }
            return Ok(());
        }
        if request.items.len() <= MAX_ITEMS {
            return self.request(request).await;
        }
        let chunks: Vec<TransferRequest> = request
            .items
            .chunks(MAX_ITEMS)
            .map(|c| TransferRequest {
                op: request.op,
                durability: request.durability,
                items: c.to_vec(),
                checked: request.checked,
            })
            .collect();
        futures::future::try_join_all(chunks.into_iter().map(|c| self.clone().request(c))).await?;
        Ok(())
    }

    /// Items that could not go where they were sorted: to the target, or, where the kernel denies
    /// the target's copies, back to the engine for the control link.
    async fn elsewhere(self: Arc<Self>, op: Op, durability: Durability, items: Vec<TransferItem>) -> Result<Declined> {
        if items.is_empty() {
            return Ok(Declined::none());
        }
        match self.copies_denied {
            None => self.copied(op, durability, items).await.map(|()| Declined::none()),
            Some(_) => Ok(Declined::items(items)),
        }
    }
}

/// A transfer's items by way.
struct Sorted {
    op: Op,
    durability: Durability,
    /// Items copied here, each with the index of its region's mapping in `mappings`.
    mapped: Vec<(TransferItem, usize)>,
    /// Items copied here by the device, into or out of the GPU memory of the mapping at this index.
    device: Vec<(TransferItem, usize)>,
    /// Items of local device memory copied by its own device into or out of the host memory of the
    /// mapping at this index.
    local_device: Vec<(TransferItem, usize)>,
    mappings: Vec<Arc<Mapping>>,
    copied: Vec<TransferItem>,
    control: Vec<TransferItem>,
}

/// Whether `item`'s local memory is staged by its owner (device memory behind a host copy), which
/// only the control link moves: its hooks bring the bytes from the device before a write and take
/// them there after a read, where a copy through a mapping or by the target would see the host
/// copy alone. (Such memory is not offered to peers over this transport either: see
/// `register_region`.)
fn stages_locally(item: &TransferItem) -> bool {
    item.local.region.block().has_access_hooks()
}

/// Whether `item`'s local memory is a device's that copies into and out of any host memory (CUDA's):
/// its device then copies into or out of a lent host region's mapping, past the host copy.
fn copies_by_device(item: &TransferItem) -> bool {
    item.local.region.block().device_copies().is_some()
}

/// How the target said it lends `item`'s region ([`region_key`]), if it reaches it over this link.
fn lent_as(item: &TransferItem) -> Option<u8> {
    match item.remote_transport_key.as_deref() {
        Some(&[key]) => Some(key),
        _ => None,
    }
}

/// Whether the device's copies reach `item`'s local memory as its owner holds it: host memory
/// without hooks, or CUDA memory (by its device address, past any host copy in front of it).
fn device_reaches(item: &TransferItem) -> bool {
    let block = item.local.region.block();
    !block.has_access_hooks() || matches!(block.device_address(), Some(ferry_core::DeviceAddress::Cuda(_)))
}

/// Checks every item against its region's mapping in `mappings` ([`check_mapped`]) before any byte
/// moves; whether there is any item to copy.
fn check_all_mapped(op: Op, items: &[(TransferItem, usize)], mappings: &[Arc<Mapping>]) -> Result<bool> {
    for (item, m) in items {
        check_mapped(op, item, &mappings[*m])?;
    }
    Ok(!items.is_empty())
}

/// Checks that `item` lies in its local region and in `mapping` (writable, for a WRITE).
fn check_mapped(op: Op, item: &TransferItem, mapping: &Mapping) -> Result<()> {
    mapping.check(item.remote_offset, item.len(), op == Op::Write)?;
    item.local.region.check_range(item.local.offset, item.local.len)
}

/// The copy that moves `item` between its local region and `mapping`, for `op`. Only for a range
/// [`check_mapped`] passed, copied under a permit of both.
fn piece(op: Op, item: &TransferItem, mapping: &Mapping) -> Piece {
    let (here, there) = (
        item.local.region.ptr_at(item.local.offset),
        mapping.at(item.remote_offset),
    );
    let len = item.local.len as usize;
    match op {
        Op::Write => Piece {
            src: here,
            dst: there,
            len,
        },
        Op::Read => Piece {
            src: there,
            dst: here,
            len,
        },
    }
}

/// Copies one item into or out of its region's mapping; `None` when the mapping is being given
/// back (the item then takes the batch's way, to the target).
fn copy_one(op: Op, item: &TransferItem, mapping: &Mapping) -> Option<Result<()>> {
    if let Err(e) = check_mapped(op, item, mapping) {
        return Some(Err(e));
    }
    let _remote = mapping.enter()?;
    let region = &item.local.region;
    let Some(_local) = region.guard().enter() else {
        return Some(Err(region.gone()));
    };
    let piece = piece(op, item, mapping);
    // SAFETY: both ranges were checked against the mapping and the region, and a permit of each is
    // held until the copy ends (and the fault hook's write into the destination, which was just
    // written); regions are never handed out as Rust references.
    unsafe { copy_landing(std::slice::from_ref(&piece)) };
    Some(Ok(()))
}

/// Copies `pieces` ([`copy_all`]), then shows each destination to the integrity fault hook as
/// landed, as every copy that completes a transfer here does.
///
/// # Safety
/// As [`copy_all`]'s, and each destination stays writable until this returns (its permit held).
unsafe fn copy_landing(pieces: &[Piece]) {
    // SAFETY: per this function's contract.
    unsafe { copy_all(pieces) };
    for p in pieces {
        // SAFETY: each destination was just written and is still writable, per the contract.
        unsafe { ferry_core::integrity::fault::landed_raw(p.dst, p.len) };
    }
}

/// Most bytes copied into or out of mappings between two yields to the runtime: a transfer's future
/// copies at most this much in one poll, so that other tasks run, and a transfer whose caller stopped
/// waiting for it (its timeout passed, or it was dropped) copies no further chunk.
const COPY_CHUNK: usize = 8 << 20;

/// Largest copy [`Inner::transfer_now`] makes while it holds the lendings table's read lock, which a
/// lending or a take-back waits for: a few microseconds at most.
const COPY_UNDER_LOOKUP: u64 = 64 << 10;

/// Copies the items whose regions are mapped, [`COPY_CHUNK`] bytes at a time (each chunk split over
/// two threads when large); returns those whose mapping was being given back, to go elsewhere. Every
/// range is checked before the first byte moves, and each region's and mapping's permit is taken once
/// and held until the last chunk is copied or the future is dropped.
async fn copy_mapped(
    op: Op,
    items: Vec<(TransferItem, usize)>,
    mappings: &[Arc<Mapping>],
) -> Result<Vec<TransferItem>> {
    if !check_all_mapped(op, &items, mappings)? {
        return Ok(Vec::new());
    }
    let remote: Vec<_> = mappings.iter().map(|m| m.enter()).collect();
    // Each local region's permit, by the region's address.
    let mut local: Vec<(usize, ferry_core::Permit<'_>)> = Vec::new();
    let mut pieces = Vec::with_capacity(items.len());
    let mut given_back = Vec::new();
    for (n, (item, m)) in items.iter().enumerate() {
        if remote[*m].is_none() {
            given_back.push(n);
            continue;
        }
        let region = &item.local.region;
        let at = Arc::as_ptr(region) as usize;
        if !local.iter().any(|(r, _)| *r == at) {
            local.push((at, region.guard().enter().ok_or_else(|| region.gone())?));
        }
        pieces.push(piece(op, item, &mappings[*m]));
    }
    let chunks = chunked(&pieces, COPY_CHUNK);
    for (i, chunk) in chunks.iter().enumerate() {
        if i > 0 {
            tokio::task::yield_now().await;
        }
        // SAFETY: every range was checked against its mapping and region above, and a permit of each
        // region and mapping is held until the last chunk is copied (or this future is dropped, after
        // which no chunk is), so all stay mapped; a chunk's pieces lie inside those ranges; regions
        // are never handed out as Rust references, so the copies conflict with no borrow.
        unsafe { copy_all(chunk) };
    }
    for p in &pieces {
        // SAFETY: as for the copies: each destination is writable, inside its range, under a permit
        // still held.
        unsafe { ferry_core::integrity::fault::landed_raw(p.dst, p.len) };
    }
    drop((local, remote));
    Ok(items
        .into_iter()
        .enumerate()
        .filter(|(n, _)| given_back.binary_search(n).is_ok())
        .map(|(_, (item, _))| item)
        .collect())
}

/// Copies the items whose local memory is a device's that copies into and out of any host memory
/// ([`copies_by_device`]) into or out of the host memory the target lent here, by their devices
/// ([`DeviceCopies::copy_raw`](ferry_core::DeviceCopies::copy_raw)), in batches of at most
/// [`COPY_CHUNK`] bytes a region with a yield to the runtime between two (a dropped transfer queues
/// no further batch). Every range is checked first; each region's and mapping's permit is held
/// until its last batch is copied. Returns the items whose mapping was being given back, for the
/// control link (never for the target's copies: they would read the host copy).
async fn copy_local_device(
    op: Op,
    items: Vec<(TransferItem, usize)>,
    mappings: &[Arc<Mapping>],
) -> Result<Vec<TransferItem>> {
    if !check_all_mapped(op, &items, mappings)? {
        return Ok(Vec::new());
    }
    let remote: Vec<_> = mappings.iter().map(|m| m.enter()).collect();
    let mut given_back = Vec::new();
    // Each local region's permit and copies, in the order regions first appear.
    let mut regions: Vec<(&TransferItem, ferry_core::Permit<'_>, Vec<RawCopy>)> = Vec::new();
    for (item, m) in &items {
        if remote[*m].is_none() {
            given_back.push(item.clone());
            continue;
        }
        let copy = RawCopy {
            offset: item.local.offset as usize,
            host: mappings[*m].at(item.remote_offset),
            len: item.local.len as usize,
            to_device: op == Op::Read,
        };
        let region = &item.local.region;
        match regions
            .iter_mut()
            .find(|(first, ..)| Arc::ptr_eq(&first.local.region, region))
        {
            Some((.., copies)) => copies.push(copy),
            None => regions.push((item, region.guard().enter().ok_or_else(|| region.gone())?, vec![copy])),
        }
    }
    let mut batches = 0;
    for (first, _permit, copies) in &regions {
        let Some(device) = first.local.region.block().device_copies() else {
            return Err(Error::Internal(format!(
                "region {:?} ({}) no longer copies by its device",
                first.local.region.key(),
                first.local.region.block().kind()
            )));
        };
        let cut = ferry_core::region::cut(
            copies,
            COPY_CHUNK as u64,
            |c| c.len as u64,
            |c, done, n| RawCopy {
                offset: c.offset + done as usize,
                host: c.host.wrapping_add(done as usize),
                len: n as usize,
                to_device: c.to_device,
            },
        );
        for batch in cut {
            if batches > 0 {
                tokio::task::yield_now().await;
            }
            batches += 1;
            // SAFETY: every host range lies in its mapping and every device range in its region
            // (`check_mapped`), and a permit of each region and mapping is held until the last
            // batch is copied (or this future is dropped, after which no batch is), so the mapping
            // stays mapped; `copy_raw` returns once its copies are done.
            unsafe { device.copy_raw(&batch)? };
        }
    }
    if op == Op::Write {
        for (.., copies) in &regions {
            for c in copies {
                // SAFETY: each destination is writable mapped memory, inside its checked range,
                // under a permit still held.
                unsafe { ferry_core::integrity::fault::landed_raw(c.host, c.len) };
            }
        }
    }
    drop((regions, remote));
    Ok(given_back)
}

/// Opens the GPU memory the target lent as region `key`.
#[cfg(feature = "cuda")]
fn open_device(key: RegionKey, lend: &wire::DeviceLend) -> Result<Mapping> {
    let export = ferry_cuda::ipc::IpcExport {
        handle: lend.handle,
        offset: lend.offset,
        pci_address: lend.pci_address.clone(),
    };
    Mapping::device(key, ferry_cuda::ipc::IpcWindow::open(&export, lend.len)?)
}

/// A build without the `cuda` feature never asks for device memory; a target that lends it some
/// anyway is answered that it cannot be opened here.
#[cfg(not(feature = "cuda"))]
fn open_device(key: RegionKey, _: &wire::DeviceLend) -> Result<Mapping> {
    Err(Error::Unsupported(format!(
        "the target lent region {key:?} as GPU memory, which this build (no `cuda` feature) cannot open"
    )))
}

/// Copies the items whose regions are the target's GPU memory opened here, by the device, in
/// batches of at most [`COPY_CHUNK`] bytes with a yield to the runtime between two (a dropped
/// transfer queues no further batch). Every range is checked first; each region's and window's
/// permit is held while its bytes move. Returns the items whose window was being given back, for
/// the control link.
#[cfg(feature = "cuda")]
async fn copy_device(
    op: Op,
    items: Vec<(TransferItem, usize)>,
    mappings: &[Arc<Mapping>],
) -> Result<Vec<TransferItem>> {
    use ferry_cuda::ipc::WindowCopy;
    if !check_all_mapped(op, &items, mappings)? {
        return Ok(Vec::new());
    }
    let mut given_back = Vec::new();
    for (m, mapping) in mappings.iter().enumerate().filter(|(_, m)| m.is_device()) {
        let mine: Vec<&TransferItem> = items.iter().filter(|(_, i)| *i == m).map(|(item, _)| item).collect();
        if mine.is_empty() {
            continue;
        }
        let (Some(_remote), Some(window)) = (mapping.enter(), mapping.window()) else {
            given_back.extend(mine.into_iter().cloned());
            continue;
        };
        let mut local = Vec::with_capacity(mine.len());
        let mut copies = Vec::with_capacity(mine.len());
        for item in &mine {
            let region = &item.local.region;
            local.push(region.guard().enter().ok_or_else(|| region.gone())?);
            let at = match region.block().device_address() {
                Some(ferry_core::DeviceAddress::Cuda(ptr)) => ptr + item.local.offset,
                _ => region.ptr_at(item.local.offset) as u64,
            };
            copies.push(WindowCopy {
                local: at,
                offset: item.remote_offset,
                len: item.local.len,
                into_window: op == Op::Write,
            });
        }
        for (n, batch) in device_batches(&copies, COPY_CHUNK as u64).iter().enumerate() {
            if n > 0 {
                tokio::task::yield_now().await;
            }
            // SAFETY: every local range was checked against its region (`check_mapped`) and a
            // permit of each region is held until the last batch is copied (or this future is
            // dropped, after which no batch is queued), so the memory stays registered; `copy`
            // waits for its copies before it returns, and regions are never handed out as Rust
            // references, so nothing else borrows the bytes meanwhile.
            unsafe { window.copy(batch)? };
        }
        if op == Op::Read {
            for item in mine
                .iter()
                .filter(|i| i.local.region.block().device_address().is_none())
            {
                ferry_core::integrity::fault::landed(&item.local);
            }
        }
        drop(local);
    }
    Ok(given_back)
}

/// Without the `cuda` feature no mapping is of device memory, so no item is sorted here.
#[cfg(not(feature = "cuda"))]
async fn copy_device(_: Op, items: Vec<(TransferItem, usize)>, _: &[Arc<Mapping>]) -> Result<Vec<TransferItem>> {
    Ok(items.into_iter().map(|(item, _)| item).collect())
}

/// `copies` in order, cut into batches of at most `most` bytes (see [`ferry_core::region::cut`]).
#[cfg(feature = "cuda")]
fn device_batches(copies: &[ferry_cuda::ipc::WindowCopy], most: u64) -> Vec<Vec<ferry_cuda::ipc::WindowCopy>> {
    ferry_core::region::cut(
        copies,
        most,
        |c| c.len,
        |c, done, n| ferry_cuda::ipc::WindowCopy {
            local: c.local + done,
            offset: c.offset + done,
            len: n,
            into_window: c.into_window,
        },
    )
}

/// `pieces` in order, cut into chunks of at most `most` bytes (a piece larger than what is left of a
/// chunk is split across chunks).
fn chunked(pieces: &[Piece], most: usize) -> Vec<Vec<Piece>> {
    ferry_core::region::cut(
        pieces,
        most as u64,
        |p| p.len as u64,
        |p, done, n| Piece {
            src: p.src.wrapping_add(done as usize),
            dst: p.dst.wrapping_add(done as usize),
            len: n as usize,
        },
    )
}

impl ShmLink {
    /// Wraps a connected socket; `control` carries notifications and says whether the peer is alive
    /// (what this link declines goes back to the engine, which sends it there).
    pub(crate) fn start(
        stream: UnixStream,
        control: Arc<dyn DataLink>,
        peer: String,
        copies_denied: Option<String>,
    ) -> Self {
        let (reader, writer) = stream.into_split();
        let inner = Arc::new(Inner {
            writer: tokio::sync::Mutex::new(Some(writer)),
            pending: Mutex::new(OpTable::new()),
            lendings: Lendings::new(),
            closed: AtomicBool::new(false),
            control,
            peer,
            copies_denied,
        });
        // The reader task, not the link, keeps `inner` (and the read buffers of requests in flight)
        // alive until the target closes its end: see `Drop`.
        tokio::spawn(inner.clone().read_replies(FdReader::new(reader)));
        ShmLink { inner }
    }
}

impl ShmLink {
    /// How transfers to the peer's GPU memory travel: by this process's device copies once the peer
    /// lent it, else over the control link, staged by the peer.
    fn device_route(&self, region: &ferry_core::RegionAd) -> ferry_core::Route {
        if !cfg!(feature = "cuda") {
            return ferry_core::Route::declined(
                region,
                "shm: the peer lends this region as GPU memory (CUDA IPC), which this build (no `cuda` feature) \
                 cannot open",
            );
        }
        match self.inner.lendings.read().get(&region.key) {
            Some(Lending::Declined) => ferry_core::Route::declined(
                region,
                "shm: the peer did not lend this GPU memory, or this process could not open its CUDA IPC handle \
                 (a region that is part of a larger allocation, a grant for reading or writing only, another \
                 process's device not visible here: the logs of both say which)",
            ),
            _ => ferry_core::Route::by(
                TransportKind::Shm,
                "the peer's GPU memory, opened in this process by its CUDA IPC handle: transfers are device \
                 copies (cuMemcpyAsync) from and into this process's memory, GPU or host, never through the \
                 peer's host copy (persistent writes: refused by the peer, over the control link)",
            ),
        }
    }
}

impl DataLink for ShmLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn transfer(&self, request: TransferRequest) -> BoxFuture<'static, Result<Declined>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            if let Some(done) = inner.transfer_now(&request) {
                // A transfer over a mapping never waits: without this, a caller that transfers in
                // a loop would hold its runtime thread and starve every other task there.
                tokio::task::coop::consume_budget().await;
                return done.map(|()| Declined::none());
            }
            let Sorted {
                op,
                durability,
                mapped,
                device,
                local_device,
                mappings,
                copied,
                control,
            } = inner.sort(request).await;
            // The target's share is sent first, so that it moves while this future copies the mapped
            // share.
            let to_target = async {
                match copied.is_empty() {
                    true => Ok(()),
                    false => inner.clone().copied(op, durability, copied).await,
                }
            };
            let here = async {
                let elsewhere = copy_mapped(op, mapped, &mappings).await?;
                // GPU memory whose window was being given back goes over the control link, as does
                // local GPU memory whose mapping was.
                let mut given_back = copy_device(op, device, &mappings).await?;
                given_back.extend(copy_local_device(op, local_device, &mappings).await?);
                // Bytes copied into the mapping of a target whose end of the link is already seen
                // closed reach nobody: that is no completed write.
                if inner.closed.load(Ordering::Acquire) {
                    return Err(inner.down());
                }
                // A transfer over mappings alone never waits: without this, a caller that transfers
                // in a loop would hold its runtime thread and starve every other task there.
                tokio::task::consume_budget().await;
                let mut declined = inner.clone().elsewhere(op, durability, elsewhere).await?;
                declined.extend(Declined::items(given_back));
                Ok(declined)
            };
            let ((), mut declined) = futures::future::try_join(to_target, here).await?;
            declined.extend(Declined::items(control));
            Ok(declined)
        })
    }

    fn transfer_now(&self, request: &TransferRequest) -> Option<Result<()>> {
        self.inner.transfer_now(request)
    }

    fn notify(&self, notification: Notification) -> BoxFuture<'static, Result<()>> {
        // Every transfer that completed before this had its bytes in the target's memory (copied by
        // this process into the mapping, or by the target before it replied): a notification on the
        // control link cannot overtake its data.
        self.inner.control.notify(notification)
    }

    fn persist_method(&self) -> PersistMethod {
        PersistMethod::FlushBeforeAck
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        let inner = self.inner.clone();
        Box::pin(async move {
            inner.finish().await;
        })
    }

    fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire) || self.inner.control.is_closed()
    }

    fn route(&self, region: &ferry_core::RegionAd) -> ferry_core::Route {
        let key = region
            .transport_keys
            .iter()
            .find(|(k, _)| *k == TransportKind::Shm)
            .map(|(_, key)| key.as_ref());
        match (key, &self.inner.copies_denied) {
            (Some([region_key::DEVICE]), _) => self.device_route(region),
            (Some([region_key::LENDABLE]), _) => ferry_core::Route::by(
                TransportKind::Shm,
                "mapped into this process (the peer lends it): transfers are this process's own copies \
                 (persistent writes: copied and persisted by the peer's process)",
            ),
            (Some(_), None) => ferry_core::Route::by(
                TransportKind::Shm,
                "copied by the peer's process between the two processes' memory (cross-memory attach)",
            ),
            (Some(_), Some(why)) => ferry_core::Route::declined(
                region,
                format!(
                    "shm: the peer does not lend this region (memory it did not allocate with alloc_host), and {why}"
                ),
            ),
            (None, _) => ferry_core::Route::declined(
                region,
                "shm: the peer stages this region in front of a device (GPU memory behind a host copy), which \
                 only its own copies reach",
            ),
        }
    }

    fn fallback_note(&self) -> Option<String> {
        self.inner.copies_denied.as_ref().map(|why| {
            format!(
                "for the regions the peer does not lend (memory it did not allocate with alloc_host, or granted \
                 to this engine for reading or writing only), which go over {}: {why}",
                self.inner.control.kind()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ferry_core::{Access, MemoryBlock, OwnedBuffer, RegionEntry, RegionKey, Resolved};

    use super::*;

    #[cfg(feature = "cuda")]
    #[test]
    fn device_batches_cover_the_copies_in_order_and_none_is_larger_than_asked() {
        use ferry_cuda::ipc::WindowCopy;
        let lens = [5u64, 17, 1, 40, 3, 64, 9];
        let mut at = 0;
        let copies: Vec<WindowCopy> = lens
            .iter()
            .map(|&len| {
                let c = WindowCopy {
                    local: 0x1000 + at,
                    offset: 7 * at,
                    len,
                    into_window: true,
                };
                at += len;
                c
            })
            .collect();
        for most in [1, 7, 16, 64, 1000] {
            let mut next = 0;
            for batch in device_batches(&copies, most) {
                assert!(batch.iter().map(|c| c.len).sum::<u64>() <= most);
                for c in batch {
                    assert!(c.len > 0 && c.into_window);
                    // The local and remote addresses advance together within each copy.
                    let copy = copies.iter().rfind(|o| o.local <= c.local).unwrap();
                    assert_eq!(c.offset - copy.offset, c.local - copy.local, "batches of {most}");
                    assert_eq!(c.local, 0x1000 + next, "batches of {most}");
                    next += c.len;
                }
            }
            assert_eq!(next, at, "batches of {most} cover every byte");
        }
    }

    #[test]
    fn chunks_cover_the_pieces_in_order_and_none_is_larger_than_asked() {
        let base = 0x1000usize;
        let lens = [5usize, 17, 1, 40, 3, 64, 9];
        let mut at = 0;
        let pieces: Vec<Piece> = lens
            .iter()
            .map(|&len| {
                let p = Piece {
                    src: (base + at) as *const u8,
                    dst: (base * 16 + at) as *mut u8,
                    len,
                };
                at += len;
                p
            })
            .collect();
        for most in [1, 7, 16, 64, 1000] {
            let chunks = chunked(&pieces, most);
            let mut next = 0;
            for chunk in &chunks {
                assert!(chunk.iter().map(|p| p.len).sum::<usize>() <= most);
                for p in chunk {
                    assert_eq!(p.src as usize, base + next, "chunks of {most}");
                    assert_eq!(p.dst as usize, base * 16 + next);
                    assert!(p.len > 0);
                    next += p.len;
                }
            }
            assert_eq!(next, at, "chunks of {most} cover every byte");
        }
    }

    #[test]
    fn a_large_read_is_cut_into_pieces_that_cover_it_in_order() {
        let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; 16 << 20]));
        let region = Arc::new(RegionEntry::new(RegionKey(1), Access::READ_WRITE, block).unwrap());
        let item = |offset: u64, len: u64| TransferItem {
            local: Resolved {
                region: region.clone(),
                offset,
                len,
            },
            remote_key: RegionKey(2),
            remote_offset: offset + 7,
            remote_addr: 0x1000 + offset + 7,
            remote_transport_key: Some(vec![1u8].into()),
            remote_access: Access::READ,
        };
        let request = TransferRequest {
            op: Op::Read,
            durability: ferry_core::Durability::Completed,
            items: vec![item(0, 10 << 20), item(10 << 20, 3), item((10 << 20) + 3, 1 << 20)],
            checked: false,
        };
        let pieces = read_pieces(&request);
        let mut next = 0u64;
        for p in &pieces {
            assert!(p.items.iter().map(|i| i.len()).sum::<u64>() <= READ_BUFFER_BYTES);
            for i in &p.items {
                assert_eq!(i.local.offset, next, "pieces follow each other");
                assert_eq!((i.remote_offset, i.remote_addr), (next + 7, 0x1000 + next + 7));
                next += i.len();
            }
        }
        assert_eq!(next, (11 << 20) + 3, "every byte is covered once");
        assert_eq!(pieces.len(), 3);
    }

    /// A link whose target end is the returned socket (played by the test), and a one-item WRITE
    /// request it can send.
    fn link_to_a_scripted_target() -> (ShmLink, UnixStream, TransferRequest) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let link = ShmLink::start(ours, Arc::new(ferry_core::NoControlLink), "scripted".into(), None);
        let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![7u8; 64]));
        let region = Arc::new(RegionEntry::new(RegionKey(1), Access::READ_WRITE, block).unwrap());
        let request = TransferRequest {
            op: Op::Write,
            durability: ferry_core::Durability::Completed,
            items: vec![TransferItem {
                local: Resolved {
                    region,
                    offset: 0,
                    len: 64,
                },
                remote_key: RegionKey(2),
                remote_offset: 0,
                remote_addr: 0x1000,
                remote_transport_key: None,
                remote_access: Access::READ_WRITE,
            }],
            checked: false,
        };
        (link, theirs, request)
    }

    /// Reads one request off the target's end: its id.
    async fn request_id(target: &mut UnixStream) -> u64 {
        use tokio::io::AsyncReadExt;
        let mut head = [0u8; wire::REQUEST_HEAD];
        target.read_exact(&mut head).await.unwrap();
        let head = wire::decode_request_head(&head).unwrap();
        let mut items = vec![0u8; head.items as usize * wire::ITEM_LEN];
        target.read_exact(&mut items).await.unwrap();
        head.id
    }

    async fn reply(target: &mut UnixStream, id: u64) {
        let mut out = Vec::new();
        wire::encode_reply(&mut out, id, &Ok(()));
        target.write_all(&out).await.unwrap();
    }

    const T: std::time::Duration = std::time::Duration::from_secs(10);

    #[tokio::test]
    async fn a_duplicate_reply_is_stale_and_the_link_goes_on() {
        let (link, mut target, request) = link_to_a_scripted_target();
        let first = tokio::spawn(link.inner.clone().request(request.clone()));
        let id = request_id(&mut target).await;
        reply(&mut target, id).await;
        reply(&mut target, id).await;
        tokio::time::timeout(T, first).await.unwrap().unwrap().unwrap();
        let second = tokio::spawn(link.inner.clone().request(request));
        let id2 = request_id(&mut target).await;
        assert!(id2 > id, "ids are never reused");
        reply(&mut target, id2).await;
        tokio::time::timeout(T, second).await.unwrap().unwrap().unwrap();
        assert!(!link.inner.closed.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn a_reply_to_a_request_never_sent_ends_the_link_with_a_protocol_error() {
        let (link, mut target, request) = link_to_a_scripted_target();
        let waiting = tokio::spawn(link.inner.clone().request(request));
        let id = request_id(&mut target).await;
        reply(&mut target, id + 100).await;
        let got = tokio::time::timeout(T, waiting).await.unwrap().unwrap();
        assert!(
            matches!(&got, Err(Error::Protocol(m)) if m.contains("never sent")),
            "{got:?}"
        );
        assert!(link.inner.closed.load(Ordering::Acquire));
    }
}
