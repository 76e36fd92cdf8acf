//! The initiator's side of a link: requests go over the link's Unix socket, each with the local
//! addresses the target copies from or into, and complete when the target replies (after its copy).
//!
//! The target copies out of this process's memory for a WRITE, so a request holds a permit of each
//! local region's access guard until its reply arrives (or the link ends), not merely while the
//! caller's future lives: a caller that drops its transfer cannot deregister memory the target is
//! still reading. For a READ the target writes into a staging buffer the request owns, and the caller's
//! future copies it into place once the reply came: a READ that timed out or was dropped lands no byte
//! in the caller's memory afterwards, whatever the target still does. That costs a copy per READ.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::{
    DataLink, Error, Notification, Op, OwnedPermit, PersistMethod, Result, TransferItem, TransferRequest, TransportKind,
};
use futures::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::oneshot;

use crate::wire::{self, Item, MAX_ITEMS, REPLY_HEAD};

/// What a reply hands back: the result, and a READ's staging buffer.
type Done = (Result<()>, Option<Vec<u8>>);

struct Pending {
    done: oneshot::Sender<Done>,
    /// Where the target writes a READ's bytes.
    staging: Option<Vec<u8>>,
    /// The local regions the target may be copying into or out of.
    _permits: Vec<OwnedPermit>,
}

struct Inner {
    /// `None` once the link is closed (dropping the half shuts the socket down for writing).
    writer: tokio::sync::Mutex<Option<OwnedWriteHalf>>,
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    closed: AtomicBool,
    control: Arc<dyn DataLink>,
    peer: String,
}

/// Bytes of one READ request, and so of its staging buffer: a large READ runs as several requests in
/// turn, so that a transfer holds no more than this in staging (a copy of 4 MiB takes far longer than
/// the round trip that separates two requests).
const READ_STAGING: u64 = 4 << 20;

/// A READ's requests: its items cut into pieces of at most [`READ_STAGING`] bytes in all and
/// [`MAX_ITEMS`] ranges each, in order.
fn read_pieces(request: &TransferRequest) -> Vec<TransferRequest> {
    let mut pieces = Vec::new();
    let mut items: Vec<TransferItem> = Vec::new();
    let mut bytes = 0u64;
    for item in &request.items {
        let mut done = 0u64;
        while done < item.len() {
            if bytes == READ_STAGING || items.len() == MAX_ITEMS {
                pieces.push(std::mem::take(&mut items));
                bytes = 0;
            }
            let n = (item.len() - done).min(READ_STAGING - bytes);
            let mut part = item.clone();
            part.local.offset += done;
            part.local.len = n;
            part.remote_offset += done;
            part.remote_addr += done;
            items.push(part);
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
        })
        .collect()
}

/// A same-host data link (see the crate documentation).
pub struct ShmLink {
    inner: Arc<Inner>,
}

/// Dropping the link shuts its socket down for writing; the target finishes the request it is copying,
/// sees the end and closes its side, and only then does the reader task end and free what requests in
/// flight hold. The target may be writing a READ's bytes into a staging buffer until that moment: the
/// buffer must outlive its copy, not the caller's interest in it.
impl Drop for ShmLink {
    fn drop(&mut self) {
        self.inner.closed.store(true, Ordering::Release);
        if let Ok(mut w) = self.inner.writer.try_lock() {
            w.take();
            return;
        }
        // A request is being written: close once it is sent (no runtime left: nothing is in flight).
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let inner = self.inner.clone();
            rt.spawn(async move {
                inner.writer.lock().await.take();
            });
        }
    }
}

/// Requests still pending when the link's state goes (its runtime was shut down before the target
/// answered) may have the target writing into their staging buffers still: those are leaked, not freed.
impl Drop for Inner {
    fn drop(&mut self) {
        let pending = match self.pending.get_mut() {
            Ok(p) => std::mem::take(p),
            Err(p) => std::mem::take(p.into_inner()),
        };
        for (_, p) in pending {
            if let Some(staging) = p.staging {
                std::mem::forget(staging);
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
        let pending: Vec<Pending> = self
            .pending
            .lock()
            .map(|mut p| p.drain().map(|(_, v)| v).collect())
            .unwrap_or_default();
        for p in pending {
            let _ = p.done.send((Err(error.clone()), None));
        }
    }

    async fn read_replies(self: Arc<Self>, mut reader: OwnedReadHalf) {
        let end = loop {
            let mut head = [0u8; REPLY_HEAD];
            if let Err(e) = reader.read_exact(&mut head).await {
                break Error::PeerClosed(format!("the shared-memory link to {} closed: {e}", self.peer));
            }
            let (id, code, len) = match wire::decode_reply_head(&head) {
                Ok(h) => h,
                Err(e) => break e,
            };
            let mut message = vec![0u8; len];
            if let Err(e) = reader.read_exact(&mut message).await {
                break Error::PeerClosed(format!("the shared-memory link to {} closed: {e}", self.peer));
            }
            let result = match code {
                None => Ok(()),
                Some(code) => Err(wire::reply_error(code, &message)),
            };
            let pending = self.pending.lock().ok().and_then(|mut p| p.remove(&id));
            match pending {
                Some(p) => {
                    let _ = p.done.send((result, p.staging));
                }
                None => break Error::Protocol(format!("a reply to unknown request {id} on the shared-memory link")),
            }
        };
        tracing::debug!(peer = %self.peer, error = %end, "shared-memory link ended");
        self.fail_all(&end);
    }

    /// Sends one request of at most [`MAX_ITEMS`] ranges and waits for its reply.
    async fn request(self: Arc<Self>, request: TransferRequest) -> Result<()> {
        let mut permits = Vec::with_capacity(request.items.len());
        let mut items = Vec::with_capacity(request.items.len());
        let reading = request.op == Op::Read;
        let total: u64 = request.items.iter().map(|i| i.local.len).sum();
        let mut staging = reading.then(|| vec![0u8; total as usize]);
        let mut at = 0usize;
        for i in &request.items {
            let region = &i.local.region;
            let addr = match &mut staging {
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
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut out = Vec::with_capacity(wire::REQUEST_HEAD + items.len() * wire::ITEM_LEN);
        wire::encode_request(&mut out, id, request.op, request.durability, &items);
        let (done, result) = oneshot::channel();
        {
            let mut pending = self
                .pending
                .lock()
                .map_err(|_| Error::Internal("shared-memory request table lock poisoned".into()))?;
            if self.closed.load(Ordering::Acquire) {
                return Err(self.down());
            }
            pending.insert(
                id,
                Pending {
                    done,
                    staging,
                    _permits: permits,
                },
            );
        }
        let sent = match self.writer.lock().await.as_mut() {
            Some(w) => w.write_all(&out).await,
            None => Err(std::io::ErrorKind::NotConnected.into()),
        };
        if let Err(e) = sent {
            let e = Error::PeerClosed(format!("sending to {} over shared memory: {e}", self.peer));
            self.fail_all(&e);
            return Err(e);
        }
        let (result, staging) = result.await.unwrap_or_else(|_| (Err(self.down()), None));
        result?;
        // A READ's bytes go into place here, while the caller still waits for them.
        if let Some(staging) = staging {
            let mut at = 0usize;
            for i in &request.items {
                let n = i.local.len as usize;
                i.local.region.copy_in(i.local.offset, &staging[at..at + n])?;
                at += n;
            }
        }
        Ok(())
    }
}

impl ShmLink {
    /// Wraps a connected socket; `control` carries notifications and says whether the peer is alive.
    pub(crate) fn start(stream: UnixStream, control: Arc<dyn DataLink>, peer: String) -> Self {
        let (reader, writer) = stream.into_split();
        let inner = Arc::new(Inner {
            writer: tokio::sync::Mutex::new(Some(writer)),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            control,
            peer,
        });
        // The reader task, not the link, keeps `inner` (and the staging buffers of requests in flight)
        // alive until the target closes its end: see `Drop`.
        tokio::spawn(inner.clone().read_replies(reader));
        ShmLink { inner }
    }
}

impl DataLink for ShmLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn transfer(&self, request: TransferRequest) -> BoxFuture<'static, Result<()>> {
        let inner = self.inner.clone();
        // A region the target serves only through its staging (no shared-memory key) goes over the
        // control link, the whole batch with it.
        if request.items.iter().any(|i| i.remote_transport_key.is_none()) {
            return inner.control.transfer(request);
        }
        Box::pin(async move {
            if inner.closed.load(Ordering::Acquire) {
                return Err(inner.down());
            }
            if request.op == Op::Read {
                // One staging buffer of at most READ_STAGING bytes at a time per transfer.
                for piece in read_pieces(&request) {
                    inner.clone().request(piece).await?;
                }
                return Ok(());
            }
            if request.items.len() <= MAX_ITEMS {
                return inner.request(request).await;
            }
            let chunks: Vec<TransferRequest> = request
                .items
                .chunks(MAX_ITEMS)
                .map(|c| TransferRequest {
                    op: request.op,
                    durability: request.durability,
                    items: c.to_vec(),
                })
                .collect();
            futures::future::try_join_all(chunks.into_iter().map(|c| inner.clone().request(c))).await?;
            Ok(())
        })
    }

    fn notify(&self, notification: Notification) -> BoxFuture<'static, Result<()>> {
        // Every transfer that completed before this was copied by the target before it replied: a
        // notification on the control link cannot overtake its data.
        self.inner.control.notify(notification)
    }

    fn persist_method(&self) -> PersistMethod {
        PersistMethod::FlushBeforeAck
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        let inner = self.inner.clone();
        Box::pin(async move {
            inner.closed.store(true, Ordering::Release);
            if let Some(mut w) = inner.writer.lock().await.take() {
                let _ = w.shutdown().await;
            }
        })
    }

    fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire) || self.inner.control.is_closed()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ferry_core::{Access, MemoryBlock, OwnedBuffer, RegionEntry, RegionKey, Resolved};

    use super::*;

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
            remote_transport_key: Some(vec![1]),
            remote_access: Access::READ,
        };
        let request = TransferRequest {
            op: Op::Read,
            durability: ferry_core::Durability::Completed,
            items: vec![item(0, 10 << 20), item(10 << 20, 3), item((10 << 20) + 3, 1 << 20)],
        };
        let pieces = read_pieces(&request);
        let mut next = 0u64;
        for p in &pieces {
            assert!(p.items.iter().map(|i| i.len()).sum::<u64>() <= READ_STAGING);
            for i in &p.items {
                assert_eq!(i.local.offset, next, "pieces follow each other");
                assert_eq!((i.remote_offset, i.remote_addr), (next + 7, 0x1000 + next + 7));
                next += i.len();
            }
        }
        assert_eq!(next, (11 << 20) + 3, "every byte is covered once");
        assert_eq!(pieces.len(), 3);
    }
}
