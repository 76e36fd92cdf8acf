//! Several NICs per link: a batch is cut into slices and spread over rails.
//!
//! An engine opens every active RDMA device (or those it is told to), one rail each, and registers
//! each region on every rail; a region's advert then carries one key per rail
//! ([`RailKeys`]). A link to a peer sets up one queue pair per pair of rails it uses: local rail `i`
//! with the peer's rail `i mod n`, for `i` up to the larger of the two counts, so that every NIC of
//! both ends carries traffic; with
//! [`RdmaOptions::queue_pairs_per_rail`](crate::RdmaOptions::queue_pairs_per_rail) above one, that many
//! per pair, each spread to like a rail of its own (a NIC, or Soft-RoCE's kernel threads, works on
//! several queue pairs at once where it would serialise one).
//!
//! - **Spraying**: a batch's descriptors are cut into slices of at most
//!   [`RdmaOptions::slice_bytes`](crate::RdmaOptions::slice_bytes) ([`DEFAULT_SLICE`] by default) and
//!   each slice goes to the healthy rail that would finish it first, among the rails its local
//!   memory prefers (its NUMA node's: see [`crate::topology`]), or among all rails when none of those
//!   can take it: the rail's bytes in flight (and already planned for this batch) over its measured
//!   throughput (bytes per second of busy time, see the crate's `rate` module), so that a batch
//!   splits in proportion to the rails' speeds and a rail that slows down gets less; rails not yet
//!   measured count as fast as the fastest. Each rail posts its share as one batch (merged and
//!   signalled as on one rail, see [`crate::link`]).
//! - **Rail failure**: a rail whose share fails as a link failure (its queue pair broke, its port went
//!   down: `PeerClosed` or `Io`, not a refusal such as `PermissionDenied`) rests, for
//!   [`FIRST_REST`] and then twice as long each time up to [`MAX_REST`], and its share is posted
//!   again on another rail; the transfer completes without an error when any rail carries it. A
//!   rested rail is tried again with the next batch that finds it healthy; its link sets up a fresh
//!   queue pair then. With no rail left, the share goes over the control link (TCP), and the rails
//!   say why (`Peer::rails`, the log).
//! - **Ordering**: a rail's WRITEs and the SEND of a notification on that rail are ordered by its
//!   queue pair; the WRITEs of the other rails are not. Before a notification, every other rail that
//!   completed WRITEs since its last fence is fenced (a request the target answers only after the
//!   WRITEs before it on that queue pair are placed), so a notification is never seen before the data
//!   of the transfers completed before it, on any rail.
//! - **Persistence**: each rail makes its own share persistent by the link's method before it
//!   completes, so a persistent transfer completes only once every rail's share is persistent.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_core::{
    DataLink, Declined, Durability, Error, Notification, Op, PersistMethod, RailStats, Result, SetupExchange,
    TransferItem, TransferRequest, TransportKey, TransportKind,
};
use futures::future::BoxFuture;

use crate::RdmaShared;
use crate::link::RdmaLink;
use crate::rate::{self, RateMeter};
use crate::topology::Topology;
use ferry_proto::rdma::RailKeys;

/// Bytes per slice unless the options say otherwise.
pub const DEFAULT_SLICE: u64 = 256 << 10;
/// How long a failed rail rests the first time.
pub const FIRST_REST: Duration = Duration::from_millis(500);
/// The longest rest.
pub const MAX_REST: Duration = Duration::from_secs(30);

/// Sets up the link to a peer over every pair of rails it uses (see the module documentation). A
/// link of one rail is a plain [`RdmaLink`].
pub(crate) async fn connect(
    rails: &[Arc<RdmaShared>],
    topology: &Arc<Topology>,
    exchange: &dyn SetupExchange,
) -> Result<Arc<dyn DataLink>> {
    let first_local = rails
        .first()
        .ok_or_else(|| Error::Unsupported("RDMA: no device open".into()))?;
    let first = RdmaLink::connect(first_local, exchange, 0, 0).await?;
    let remote = first.remote_rails().max(1) as usize;
    let pairs = rails.len().max(remote);
    // Lanes: every pair of rails, `queue_pairs_per_rail` times over (bounded by validation to fit a u8).
    let lanes = pairs * first_local.options.queue_pairs_per_rail.max(1) as usize;
    if lanes == 1 {
        return Ok(Arc::new(first));
    }
    let mut links = vec![Rail::new(first, 0, 0)];
    let mut notes = Vec::new();
    for i in 1..lanes {
        let (local, remote_rail) = (&rails[i % rails.len()], (i % remote) as u8);
        match RdmaLink::connect(local, exchange, remote_rail, i as u8).await {
            Ok(link) => links.push(Rail::new(link, i % rails.len(), i / pairs)),
            Err(e) => {
                tracing::warn!(device = %local.device.name, remote_rail, error = %e, "RDMA rail not set up");
                notes.push(format!("rail {}->{remote_rail}: {e}", local.device.name));
            }
        }
    }
    tracing::info!(
        rails = ?links.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
        "RDMA link over several rails"
    );
    Ok(Arc::new(MultiRailLink {
        inner: Arc::new(Inner {
            rails: links,
            topology: topology.clone(),
            control: exchange.control_link(),
            slice: first_local.options.slice_bytes,
            notes,
        }),
    }))
}

/// One rail of a link.
struct Rail {
    link: RdmaLink,
    name: String,
    /// The peer's rail it reaches, which picks the key of a region's rail list.
    remote: usize,
    /// This engine's rail (device) it leaves from, which the topology ranks.
    local: usize,
    in_flight: AtomicU64,
    /// Its throughput while busy.
    meter: Mutex<RateMeter>,
    bytes: AtomicU64,
    errors: AtomicU64,
    rest: Mutex<Rest>,
    /// WRITEs completed since its last fence.
    written: AtomicBool,
}

struct Rest {
    until: Option<Instant>,
    next: Duration,
}

impl Rail {
    /// Rail `link` from this engine's rail `local`; `copy` counts the queue pairs of the same pair of
    /// rails before it (named `rxe0->1/1` and on).
    fn new(link: RdmaLink, local: usize, copy: usize) -> Self {
        let name = match copy {
            0 => link.rail_name(),
            n => format!("{}/{n}", link.rail_name()),
        };
        Rail {
            remote: link.remote_rail() as usize,
            local,
            link,
            name,
            in_flight: AtomicU64::new(0),
            meter: Mutex::new(RateMeter::default()),
            bytes: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            rest: Mutex::new(Rest {
                until: None,
                next: FIRST_REST,
            }),
            written: AtomicBool::new(false),
        }
    }

    fn rest(&self) -> std::sync::MutexGuard<'_, Rest> {
        self.rest.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn meter(&self) -> std::sync::MutexGuard<'_, RateMeter> {
        self.meter.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn healthy(&self) -> bool {
        self.rest().until.is_none_or(|until| Instant::now() >= until)
    }

    fn failed(&self, error: &Error) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut rest = self.rest();
        let pause = rest.next;
        rest.until = Some(Instant::now() + pause);
        rest.next = (pause * 2).min(MAX_REST);
        tracing::warn!(rail = %self.name, error = %error, ?pause, "RDMA rail failed; its work goes to the other rails");
    }

    fn succeeded(&self) {
        let mut rest = self.rest();
        if rest.until.is_some() {
            tracing::info!(rail = %self.name, "RDMA rail carries traffic again");
        }
        rest.until = None;
        rest.next = FIRST_REST;
    }
}

/// Whether `e` says the rail's path failed (so another rail may succeed), not that the peer refused.
fn rail_failure(e: &Error) -> bool {
    matches!(e, Error::PeerClosed(_) | Error::Io { .. })
}

/// The key of `item`'s region on the peer's rail `remote`: from the region's rail list, or its plain
/// key (a peer of one rail). `None` where the region has no key on that rail.
fn key_on(item: &TransferItem, remote: usize) -> Option<TransportKey> {
    let key = item.remote_transport_key.as_ref()?;
    match RailKeys::decode(key) {
        Ok(Some(keys)) => keys.0.get(remote)?.as_deref().map(TransportKey::from),
        // A plain key; or a key list that does not parse, which goes on to the rail link as it is,
        // whose key decoding fails the transfer with the protocol error (never a silent detour).
        Ok(None) | Err(_) => (remote == 0).then(|| key.clone()),
    }
}

/// `items` cut into slices of at most `slice` bytes, in order.
fn slices(items: Vec<TransferItem>, slice: u64) -> Vec<TransferItem> {
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        if item.len() <= slice {
            out.push(item);
            continue;
        }
        let mut done = 0u64;
        while done < item.len() {
            let n = (item.len() - done).min(slice);
            out.push(item.part(done, n));
            done += n;
        }
    }
    out
}

struct Inner {
    rails: Vec<Rail>,
    topology: Arc<Topology>,
    control: Arc<dyn DataLink>,
    slice: u64,
    /// Rails that could not be set up, with why.
    notes: Vec<String>,
}

/// A link over several rails (see the module documentation).
pub struct MultiRailLink {
    inner: Arc<Inner>,
}

impl Inner {
    /// Each rail's measured throughput, for [`pick`](Self::pick).
    fn rates(&self) -> Vec<Option<f64>> {
        self.rails.iter().map(|r| r.meter().rate()).collect()
    }

    /// The healthy rail other than `except` that would finish `items` first (its bytes in flight,
    /// counting `planned`, over its measured rate; see [`rate::soonest_finish`]) and has a key for
    /// every item: one whose local device is in `near` (a mask over this engine's rails) if any
    /// can, else any.
    fn pick(
        &self,
        items: &[TransferItem],
        near: u64,
        except: Option<usize>,
        planned: &[u64],
        rates: &[Option<f64>],
    ) -> Option<usize> {
        let usable = |i: &usize| {
            Some(*i) != except
                && self.rails[*i].healthy()
                && items.iter().all(|item| key_on(item, self.rails[*i].remote).is_some())
        };
        let load = |i: usize| self.rails[i].in_flight.load(Ordering::Relaxed) + planned[i];
        let is_near = |i: &usize| near & (1u64 << self.rails[*i].local.min(63)) != 0;
        let bytes: u64 = items.iter().map(TransferItem::len).sum();
        rate::soonest_finish((0..self.rails.len()).filter(is_near).filter(usable), load, rates, bytes)
            .or_else(|| rate::soonest_finish((0..self.rails.len()).filter(usable), load, rates, bytes))
    }

    /// The local rails preferred for the memory of `items` (all share one region in `run_on`'s use;
    /// their first item's region decides).
    fn near(&self, items: &[TransferItem]) -> u64 {
        items
            .first()
            .map_or(u64::MAX, |item| self.topology.preferred_rails(item.local.region.key()))
    }

    /// `items` with each region's key on rail `rail`.
    fn keyed(&self, items: &[TransferItem], rail: usize) -> Vec<TransferItem> {
        let remote = self.rails[rail].remote;
        // The key on the rail of the last item's key, for the run of items with the same key.
        let mut last: Option<(Option<TransportKey>, Option<TransportKey>)> = None;
        items
            .iter()
            .map(|item| {
                let mut item = item.clone();
                let key = match &last {
                    Some((of, key)) if *of == item.remote_transport_key => key.clone(),
                    _ => {
                        let key = key_on(&item, remote);
                        last = Some((item.remote_transport_key.clone(), key.clone()));
                        key
                    }
                };
                item.remote_transport_key = key;
                item
            })
            .collect()
    }

    /// Runs `items` on rail `rail`, and on the others in turn while rails fail; declines them (for the
    /// control link) when none is left, and passes on what a rail declined.
    async fn run_on(
        self: Arc<Self>,
        mut rail: usize,
        op: Op,
        durability: Durability,
        items: Vec<TransferItem>,
    ) -> Result<Declined> {
        let bytes: u64 = items.iter().map(TransferItem::len).sum();
        loop {
            let r = &self.rails[rail];
            r.in_flight.fetch_add(bytes, Ordering::Relaxed);
            r.meter().start(Instant::now());
            let request = TransferRequest {
                op,
                durability,
                items: self.keyed(&items, rail),
                checked: false,
            };
            let result = r.link.transfer(request).await;
            r.in_flight.fetch_sub(bytes, Ordering::Relaxed);
            match result {
                Ok(declined) => {
                    let carried = bytes - declined_bytes(&declined);
                    r.meter().finish(carried, Instant::now());
                    r.bytes.fetch_add(carried, Ordering::Relaxed);
                    if op == Op::Write && carried > 0 {
                        r.written.store(true, Ordering::Release);
                    }
                    r.succeeded();
                    return Ok(declined);
                }
                Err(e) if rail_failure(&e) && !self.control.is_closed() => {
                    r.meter().finish(0, Instant::now());
                    r.failed(&e);
                    let planned = vec![0; self.rails.len()];
                    match self.pick(&items, self.near(&items), Some(rail), &planned, &self.rates()) {
                        Some(next) => rail = next,
                        None => {
                            tracing::warn!(error = %e, "every RDMA rail failed; this share goes over TCP");
                            return Ok(Declined::items(items));
                        }
                    }
                }
                Err(e) => {
                    r.meter().finish(0, Instant::now());
                    return Err(e);
                }
            }
        }
    }

    async fn transfer(self: Arc<Self>, request: TransferRequest) -> Result<Declined> {
        let (op, durability) = (request.op, request.durability);
        let mut shares: Vec<Vec<TransferItem>> = (0..self.rails.len()).map(|_| Vec::new()).collect();
        let mut planned = vec![0u64; self.rails.len()];
        let mut declined = Vec::new();
        let rates = self.rates();
        // Slices of one region come in runs: its preferred rails are looked up once per run.
        let mut near: Option<(ferry_core::RegionKey, u64)> = None;
        for item in slices(request.items, self.slice) {
            if item.remote_transport_key.is_none() {
                // A region with no RDMA key at all (its NIC could not register it): the control link.
                declined.push(item);
                continue;
            }
            let key = item.local.region.key();
            let mask = match near {
                Some((k, mask)) if k == key => mask,
                _ => {
                    let mask = self.topology.preferred_rails(key);
                    near = Some((key, mask));
                    mask
                }
            };
            match self.pick(std::slice::from_ref(&item), mask, None, &planned, &rates) {
                Some(rail) => {
                    planned[rail] += item.len();
                    shares[rail].push(item);
                }
                None => declined.push(item),
            }
        }
        let runs = shares
            .into_iter()
            .enumerate()
            .filter(|(_, share)| !share.is_empty())
            .map(|(rail, share)| self.clone().run_on(rail, op, durability, share));
        let mut declined = Declined::items(declined);
        for more in futures::future::try_join_all(runs).await? {
            declined.extend(more);
        }
        Ok(declined)
    }

    /// Fences every rail that completed WRITEs since its last fence (see [`DataLink::fence_writes`]).
    async fn fence_writes(self: Arc<Self>) -> Result<()> {
        let fences = (0..self.rails.len())
            .filter(|&i| self.rails[i].written.swap(false, Ordering::AcqRel))
            .map(|i| {
                let inner = self.clone();
                async move { inner.rails[i].link.fence().await }
            });
        futures::future::try_join_all(fences).await?;
        Ok(())
    }

    async fn notify(self: Arc<Self>, notification: Notification) -> Result<()> {
        let planned = vec![0; self.rails.len()];
        let mut chosen = (0..self.rails.len()).find(|&i| self.rails[i].healthy());
        // The other rails' WRITEs first: placed before the notification can be seen.
        let fences = (0..self.rails.len())
            .filter(|&i| Some(i) != chosen && self.rails[i].written.swap(false, Ordering::AcqRel))
            .map(|i| {
                let inner = self.clone();
                async move {
                    if let Err(e) = inner.rails[i].link.fence().await {
                        // Its WRITEs completed (the target's NIC acknowledged them); the rail is down now.
                        inner.rails[i].failed(&e);
                    }
                }
            });
        futures::future::join_all(fences).await;
        while let Some(i) = chosen {
            let rail = &self.rails[i];
            rail.written.store(false, Ordering::Release);
            match rail.link.notify(notification.clone()).await {
                Ok(()) => return Ok(()),
                Err(e) if rail_failure(&e) && !self.control.is_closed() => {
                    rail.failed(&e);
                    chosen = self.pick(&[], u64::MAX, Some(i), &planned, &self.rates());
                }
                Err(e) => return Err(e),
            }
        }
        self.control.notify(notification).await
    }
}

/// Bytes of what a rail declined.
fn declined_bytes(declined: &Declined) -> u64 {
    declined.iter().map(TransferItem::len).sum()
}

impl DataLink for MultiRailLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn transfer(&self, request: TransferRequest) -> BoxFuture<'static, Result<Declined>> {
        Box::pin(self.inner.clone().transfer(request))
    }

    fn notify(&self, notification: Notification) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.inner.clone().notify(notification))
    }

    fn fence_writes(&self) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.inner.clone().fence_writes())
    }

    fn persist_method(&self) -> PersistMethod {
        self.inner.rails[0].link.persist_method()
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        let closes: Vec<_> = self.inner.rails.iter().map(|r| r.link.close()).collect();
        Box::pin(async move {
            futures::future::join_all(closes).await;
        })
    }

    fn is_closed(&self) -> bool {
        self.inner.control.is_closed() || self.inner.rails.iter().all(|r| r.link.is_closed())
    }

    fn route(&self, region: &ferry_core::RegionAd) -> ferry_core::Route {
        let mut remote: Vec<usize> = self.inner.rails.iter().map(|r| r.remote).collect();
        remote.sort_unstable();
        remote.dedup();
        crate::route::of(region, &remote)
    }

    fn fallback_note(&self) -> Option<String> {
        (!self.inner.notes.is_empty()).then(|| format!("RDMA rails not set up: {}", self.inner.notes.join("; ")))
    }

    fn rails(&self) -> Vec<RailStats> {
        self.inner
            .rails
            .iter()
            .map(|r| RailStats {
                name: r.name.clone(),
                bytes: r.bytes.load(Ordering::Relaxed),
                errors: r.errors.load(Ordering::Relaxed),
                healthy: r.healthy(),
                bytes_per_second: r.meter().rate().map(|b| b as u64),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use ferry_core::{Access, MemoryBlock, OwnedBuffer, RegionEntry, RegionKey, Resolved};

    use super::*;
    use ferry_proto::rdma::RemoteKey;

    fn item(offset: u64, len: u64, key: Option<Vec<u8>>) -> TransferItem {
        let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; 8 << 20]));
        let region = Arc::new(RegionEntry::new(RegionKey(1), Access::READ_WRITE, block).unwrap());
        TransferItem {
            local: Resolved { region, offset, len },
            remote_key: RegionKey(2),
            remote_offset: offset + 3,
            remote_addr: 0x1000 + offset + 3,
            remote_transport_key: key.map(TransportKey::from),
            remote_access: Access::READ_WRITE,
        }
    }

    #[test]
    fn slices_cover_every_byte_once_in_order() {
        let items = vec![
            item(0, 1000, None),
            item(1000, 3 << 20, None),
            item((3 << 20) + 1000, 7, None),
        ];
        let cut = slices(items, 1 << 20);
        assert_eq!(cut.len(), 1 + 3 + 1);
        let mut next = 0u64;
        for s in &cut {
            assert!(s.len() <= 1 << 20);
            assert_eq!(
                (s.local.offset, s.remote_offset, s.remote_addr),
                (next, next + 3, 0x1000 + next + 3)
            );
            next += s.len();
        }
        assert_eq!(next, (3 << 20) + 1007);
    }

    #[test]
    fn each_rail_takes_its_own_key() {
        let k = |rkey| {
            RemoteKey {
                rkey,
                flushable: false,
                bounce_addr: None,
                hooked: false,
            }
            .encode()
        };
        let listed = item(0, 1, Some(RailKeys(vec![Some(k(7)), None, Some(k(9))]).encode()));
        assert_eq!(key_on(&listed, 0).as_deref(), Some(&k(7)[..]));
        assert_eq!(key_on(&listed, 1), None, "not registered on that rail");
        assert_eq!(key_on(&listed, 2).as_deref(), Some(&k(9)[..]));
        assert_eq!(key_on(&listed, 3), None);
        // A peer of one rail: its plain key serves its rail 0 only.
        let plain = item(0, 1, Some(k(5)));
        assert_eq!(key_on(&plain, 0).as_deref(), Some(&k(5)[..]));
        assert_eq!(key_on(&plain, 1), None);
        assert_eq!(key_on(&item(0, 1, None), 0), None);
    }
}
