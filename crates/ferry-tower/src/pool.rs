//! The connection pool behind [`TransferService`](crate::TransferService): one engine link per peer
//! address, made on first use, shared by every request to that peer, replaced when it dies, closed
//! when idle.
//!
//! tower has no keyed pool to reuse: `tower::reconnect` rebuilds a single service from a
//! `MakeService`, and `balance`/`ready_cache` spread requests over interchangeable endpoints, whereas
//! a transfer must reach the one peer it names. So this part is written by hand, and kept small.
//!
//! The rules it follows are documented on [`PoolConfig`], where users see them.

use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use crossbeam_utils::CachePadded;
use crossbeam_utils::sync::{ShardedLock, ShardedLockReadGuard, ShardedLockWriteGuard};
use ferry::{Engine, Error, Peer, Result, TransportKind};
use rustc_hash::FxHashMap;
use tokio::time::Instant;

use crate::error::breaks_link;
use crate::limit::Limit;
use crate::request::primary_region;

/// Settings of the connection pool of a [`TransferService`](crate::TransferService), which keeps one
/// engine link per peer address by these rules:
///
/// - **Lazy and shared.** The first request to an address connects (one connect at a time per
///   address; requests that arrive meanwhile wait for it) and later requests reuse the link. The engine
///   multiplexes concurrent transfers over a link's TCP streams and keys links by address (a second
///   `connect` is `AlreadyConnected`), so one link per peer is both enough and the most there can be;
///   the per-peer limit ([`Self::max_in_flight_per_peer`]) bounds the requests in flight on it.
/// - **Dead links are replaced.** A link is dropped when the engine says it is closed
///   ([`ferry::Peer::is_closed`]: the engine marks a link closed on every error that breaks it), when
///   a transfer on it fails with `PeerClosed` or `NotConnected` (an `Io` or `Protocol` error of one
///   operation, such as a range refused on a truncated file, leaves a healthy link alone), or after
///   [`Self::timeouts_before_reconnect`] consecutive attempts on it that timed out or were
///   abandoned (an outer `tower::timeout` firing), which is how a silently partitioned peer shows.
///   The next request reconnects.
/// - **Reconnects back off.** After a failed connect the address is not dialled again until an
///   exponentially growing, jittered pause has passed ([`Self::reconnect_backoff_min`] to
///   [`Self::reconnect_backoff_max`]); requests in that pause fail at once with the error of
///   the last attempt (same variant, so the retry policy treats them alike). However many callers
///   there are, a dead peer sees at most one connection attempt per pause, and requests to it do not
///   hold capacity that requests to live peers need.
/// - **Bounded.** At most [`Self::max_links`] addresses are held; a request to a new address at
///   the limit closes the least recently used idle link, or fails with `ResourceExhausted` when every
///   link is busy. At most [`Self::max_in_flight`] requests are in flight in total, and that is
///   what `poll_ready` waits for.
/// - **Idle links close** after [`Self::idle_timeout`] without requests, from a background task
///   that ends when the last clone of the service is dropped.
/// - **Links the pool did not make stay open.** Where the engine already has a link to the address
///   (the application called [`Engine::connect`](ferry::Engine::connect) itself, or another pool
///   did), the pool uses that link instead of failing with `AlreadyConnected`, and leaves it to its
///   maker: idle, evicted or with the pool dropped, it is forgotten, not disconnected. Only a link the
///   pool judges broken (above) is disconnected, since the engine keeps one link per address and the
///   pool cannot make its own beside it.
/// - **Region tables are followed.** While a link lives, a small task keeps its peer's primary
///   region (what [`RemoteAddr::Offset`](crate::RemoteAddr::Offset) resolves against) current as
///   the peer's region adverts change, so that requests need not copy the table each time.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Most peers with a link (default 512, HIXL's limit). The engine's own
    /// [`max_links`](ferry::EngineBuilder::max_links) also counts incoming links.
    pub max_links: usize,
    /// Most requests in flight on one peer's link (default 256); more wait for one of them to end.
    pub max_in_flight_per_peer: usize,
    /// Most requests in flight through the service in total (default 4096); `poll_ready` is
    /// `Pending` while they are.
    pub max_in_flight: usize,
    /// A link without requests for this long is closed (default 60 s).
    pub idle_timeout: Duration,
    /// Bound on each connect (default 1 s, HIXL's default).
    pub connect_timeout: Duration,
    /// Pause after the first failed connect to an address (default 20 ms); doubles with each further
    /// failure, with jitter.
    pub reconnect_backoff_min: Duration,
    /// Longest pause between connects to one address (default 1 s).
    pub reconnect_backoff_max: Duration,
    /// Timeout handed to the engine for a transfer when the request sets none (default 10 s).
    pub transfer_timeout: Duration,
    /// Consecutive timed-out or abandoned attempts on one link after which it is replaced
    /// (default 2).
    pub timeouts_before_reconnect: u32,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_links: 512,
            max_in_flight_per_peer: 256,
            max_in_flight: 4096,
            idle_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(1),
            reconnect_backoff_min: Duration::from_millis(20),
            reconnect_backoff_max: Duration::from_secs(1),
            transfer_timeout: Duration::from_secs(10),
            timeouts_before_reconnect: 2,
        }
    }
}

impl PoolConfig {
    pub(crate) fn validate(&self) -> Result<()> {
        let positive = [
            ("max_links", self.max_links),
            ("max_in_flight_per_peer", self.max_in_flight_per_peer),
            ("max_in_flight", self.max_in_flight),
            ("timeouts_before_reconnect", self.timeouts_before_reconnect as usize),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(Error::InvalidArgument(format!("PoolConfig::{name} must be at least 1")));
            }
        }
        for (name, v) in [
            ("idle_timeout", self.idle_timeout),
            ("connect_timeout", self.connect_timeout),
            ("transfer_timeout", self.transfer_timeout),
            ("reconnect_backoff_max", self.reconnect_backoff_max),
        ] {
            if v.is_zero() {
                return Err(Error::InvalidArgument(format!("PoolConfig::{name} must not be zero")));
            }
        }
        if self.reconnect_backoff_min > self.reconnect_backoff_max {
            return Err(Error::InvalidArgument(
                "PoolConfig::reconnect_backoff_min must not exceed reconnect_backoff_max".into(),
            ));
        }
        Ok(())
    }
}

/// A snapshot of a pool's state and counters, from [`TransferService::stats`](crate::TransferService::stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Addresses the pool holds (with a live link, connecting, or backing off).
    pub peers: usize,
    /// Live links.
    pub links: usize,
    /// Requests in flight.
    pub in_flight: usize,
    /// Connects that succeeded (including links adopted from the engine).
    pub connects: u64,
    /// Connects that failed.
    pub connect_failures: u64,
    /// Links dropped because they died or stopped answering.
    pub links_dropped: u64,
    /// Links closed for being idle.
    pub idle_closed: u64,
    /// Links closed to make room for another peer.
    pub evicted: u64,
}

#[derive(Default)]
struct Counters {
    connects: AtomicU64,
    connect_failures: AtomicU64,
    links_dropped: AtomicU64,
    idle_closed: AtomicU64,
    evicted: AtomicU64,
}

/// What the pool's entries share with it: a request's lease reaches the engine, the settings, the
/// in-flight limit and the counters through its entry, so that it holds one reference count (the
/// entry's) rather than one for the entry and one for the pool.
pub(crate) struct Shared {
    pub(crate) engine: Engine,
    pub(crate) config: PoolConfig,
    /// The total in-flight bound that `poll_ready` takes from. Written twice by every request: on
    /// lines of its own, so that reading the settings beside it does not wait for the line to
    /// come back from another core.
    pub(crate) in_flight: CachePadded<Limit>,
    counters: Counters,
}

impl Shared {
    fn close_in_background(&self, peer: Peer) {
        let engine = self.engine.clone();
        let timeout = self.config.connect_timeout;
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = engine.disconnect(&peer, timeout).await;
            });
        }
    }
}

/// Aligned to two cache lines: the `Arc` around a pool has its reference count written by every
/// clone of the service (tower clones it per request, `Retry` once more), and with the alignment the
/// count sits on lines of its own, apart from the fields every request reads.
#[repr(align(128))]
pub(crate) struct Pool {
    pub(crate) shared: Arc<Shared>,
    /// Read by every request, written only when a peer comes or goes: a sharded lock lets requests
    /// on every core look their peer up at once without passing a lock word between cores. Keyed with FxHash: the addresses are the application's
    /// own, not a remote party's, so SipHash's defence against chosen keys would only cost time.
    entries: ShardedLock<FxHashMap<SocketAddr, Arc<PeerEntry>>>,
    epoch: Instant,
    /// Nanoseconds since `epoch`, as of the reaper's last tick (or a connect): a clock that requests
    /// can read without asking the OS, precise enough for idle and least-recently-used decisions.
    clock: Arc<AtomicU64>,
    reaper_started: AtomicBool,
    jitter: RandomState,
}

/// One peer address: its link (if any), its in-flight bound, and its reconnect state.
///
/// Aligned to two cache lines, so that the `Arc`'s reference count, which every request writes, is
/// on lines of its own; the per-peer limit, written by every request too, is padded for the same
/// reason.
#[repr(align(128))]
struct PeerEntry {
    addr: SocketAddr,
    permits: CachePadded<Limit>,
    /// The pool's engine, settings, in-flight limit and counters.
    shared: Arc<Shared>,
    /// The pool's coarse clock.
    clock: Arc<AtomicU64>,
    /// The pool's coarse clock at the last release (or creation).
    last_used: AtomicU64,
    /// Consecutive timed-out or abandoned attempts on the current link.
    strikes: AtomicU32,
    /// Read by every request (is the link live?), written when it changes; sharded, as `entries` is.
    state: ShardedLock<LinkState>,
    /// Held while connecting, so that one request per address dials and the others wait for it.
    connecting: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct LinkState {
    peer: Option<Peer>,
    /// Raised with each new link, so that a failure reported on an old link cannot drop a new one.
    generation: u64,
    /// The link's [`primary_region`], kept current by [`watch_regions`] (`None` while nothing keeps
    /// it: requests then read the peer's table themselves).
    primary: Option<Option<(u64, u64)>>,
    /// Whether `peer` is a link the application made itself, which the pool uses but does not own:
    /// leaving the pool (idle, evicted, the pool dropped) it is forgotten, not disconnected.
    adopted: bool,
    /// Links dropped but not yet disconnected from the engine; the next connect closes them first.
    /// A link the pool adopted lands here too once it has judged it broken: the engine keeps one
    /// link per address, so the pool cannot make its own while that one stays.
    retired: Vec<Peer>,
    failures: u32,
    retry_at: Option<Instant>,
    last_error: Option<Error>,
}

/// A waiting request's unit of the pool's in-flight limit, given back when the request ends, however
/// it ends (its future may be dropped at any point). It holds the pool, which waiting may need to
/// connect; once the request has a link, the unit passes to its [`Lease`].
pub(crate) struct InFlight {
    pool: Arc<Pool>,
    held: bool,
}

impl InFlight {
    /// Passes the unit to `claim`, which gives it back when the request ends.
    fn hand_to(mut self, claim: &mut EntryUse) {
        self.held = false;
        claim.holds_in_flight = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.held {
            self.pool.shared.in_flight.give_back();
        }
    }
}

/// A unit of the pool's in-flight limit, borrowed from the service that reserved it, on its way to
/// the request's lease (or its [`InFlight`]); given back if it gets to neither.
struct Unit<'a>(&'a Limit);

impl Unit<'_> {
    /// The unit has a new owner, who gives it back.
    fn passed_on(self) {
        std::mem::forget(self);
    }
}

impl Drop for Unit<'_> {
    fn drop(&mut self) {
        self.0.give_back();
    }
}

/// A request's hold, for one attempt, on a peer's link and on its units of the per-peer and the
/// pool's in-flight limits. It holds one reference count (its entry's) and no handle to the link:
/// each shared count taken and dropped per request is a cache line moved between cores.
pub(crate) struct Lease {
    pub(crate) new_link: bool,
    /// The data path of the link, for the response.
    pub(crate) transport: TransportKind,
    generation: u64,
    settled: bool,
    claim: EntryUse,
}

/// What starting a transfer on a link needs to know, and the transfer's future then does not: kept
/// apart from the lease, which that future carries.
#[derive(Clone, Copy)]
pub(crate) struct LeaseStart {
    /// The link's primary region as the pool knows it (see [`LinkState::primary`]).
    pub(crate) primary: Option<Option<(u64, u64)>>,
}

/// What [`Pool::try_checkout`] found.
pub(crate) enum Checkout<R> {
    /// A live link with a unit free on it: the common case, with nothing to wait for. The lease,
    /// and what the caller's `begin` made of the link.
    Ready(Lease, R),
    /// The request must wait, for a unit of the peer's limit or for a link:
    /// [`Pool::wait_for_link`] does.
    Wait(InFlight, EntryUse),
}

/// A request's reference to an entry, and the unit of the entry's per-peer limit once the request has
/// taken it. While any exists the entry is in use and is not closed: the pool's map holds one
/// reference, so a count above one means users (requests holding or waiting). New references are
/// taken under the map's lock (read), and closing checks the count under it (write).
pub(crate) struct EntryUse {
    entry: Arc<PeerEntry>,
    holds_unit: bool,
    /// Whether the request's unit of the pool's in-flight limit is held here (once it has a link).
    holds_in_flight: bool,
}

impl EntryUse {
    fn unused(entry: &Arc<PeerEntry>) -> bool {
        Arc::strong_count(entry) == 1
    }

    fn try_take_unit(&mut self) -> bool {
        self.holds_unit = self.holds_unit || self.entry.permits.try_take();
        self.holds_unit
    }

    async fn take_unit(&mut self) {
        if !self.holds_unit {
            self.entry.permits.take().await;
            self.holds_unit = true;
        }
    }
}

impl Drop for EntryUse {
    fn drop(&mut self) {
        // The units go back before the reference does, so that an entry seen unused has none out;
        // the peer's before the pool's, so that a pool with nothing in flight has no peer unit out.
        if self.holds_unit {
            self.entry.permits.give_back();
        }
        if self.holds_in_flight {
            self.entry.shared.in_flight.give_back();
        }
        self.entry.touch();
    }
}

impl PeerEntry {
    fn new(addr: SocketAddr, shared: Arc<Shared>, clock: Arc<AtomicU64>) -> Self {
        PeerEntry {
            addr,
            permits: CachePadded::new(Limit::new(shared.config.max_in_flight_per_peer)),
            shared,
            last_used: AtomicU64::new(clock.load(Ordering::Relaxed)),
            clock,
            strikes: AtomicU32::new(0),
            state: ShardedLock::new(LinkState::default()),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    /// Notes a release. The coarse clock moves once per reaper tick, so most releases find the time
    /// already noted and only read it: the line stays shared between cores instead of moving to each
    /// releasing one.
    fn touch(&self) {
        let now = self.clock.load(Ordering::Relaxed);
        if self.last_used.load(Ordering::Relaxed) != now {
            self.last_used.store(now, Ordering::Relaxed);
        }
    }

    fn state(&self) -> Result<ShardedLockWriteGuard<'_, LinkState>> {
        self.state.write().map_err(|_| poisoned())
    }

    fn read_state(&self) -> Result<ShardedLockReadGuard<'_, LinkState>> {
        self.state.read().map_err(|_| poisoned())
    }

    /// The live link. A link the engine reports closed is retired here.
    fn live(&self) -> Result<Option<Link>> {
        let held = |peer: &Peer, generation, start: LeaseStart| Link {
            peer: peer.clone(),
            generation,
            primary: start.primary,
        };
        if let Some(link) = self.with_live(held)? {
            return Ok(Some(link));
        }
        // None, or closed: retire a closed one, unless another request did so (or reconnected)
        // meanwhile.
        let mut st = self.state()?;
        match &st.peer {
            Some(p) if !p.is_closed() => Ok(Some(held(p, st.generation, LeaseStart { primary: st.primary }))),
            Some(_) => {
                if let Some(p) = st.peer.take() {
                    tracing::warn!(peer = %self.addr, "the link is closed; reconnecting on next use");
                    self.shared.counters.links_dropped.fetch_add(1, Ordering::Relaxed);
                    st.retired.push(p);
                }
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Drops the link of `generation` if it is still the current one.
    fn invalidate(&self, generation: u64, why: &str) {
        self.strikes.store(0, Ordering::Relaxed);
        let Ok(mut st) = self.state.write() else { return };
        if st.generation != generation {
            return;
        }
        if let Some(p) = st.peer.take() {
            tracing::warn!(peer = %self.addr, reason = why, "dropping the link; reconnecting on next use");
            self.shared.counters.links_dropped.fetch_add(1, Ordering::Relaxed);
            st.retired.push(p);
        }
    }

    /// Runs `begin` on the live link, under the state's (sharded) read lock, so that the request
    /// borrows the link rather than counting a reference to it; `None` if there is no live link now
    /// (then [`live`](Self::live) retires a closed one).
    fn with_live<R>(&self, begin: impl FnOnce(&Peer, u64, LeaseStart) -> R) -> Result<Option<R>> {
        let st = self.read_state()?;
        Ok(match &st.peer {
            Some(peer) if !peer.is_closed() => Some(begin(peer, st.generation, LeaseStart { primary: st.primary })),
            _ => None,
        })
    }

    /// Whether the link of `generation` is still this entry's and the engine has closed it.
    fn closed(&self, generation: u64) -> bool {
        self.read_state()
            .is_ok_and(|st| st.generation == generation && st.peer.as_ref().is_some_and(Peer::is_closed))
    }

    /// Takes every link out of this entry and returns those the pool must close: the retired ones, and
    /// the live one unless the application made it (see [`LinkState::adopted`]).
    fn take_links(&self) -> Vec<Peer> {
        match self.state.write() {
            Ok(mut st) => {
                let mut all = std::mem::take(&mut st.retired);
                match st.peer.take() {
                    Some(_) if st.adopted => {
                        tracing::debug!(peer = %self.addr, "leaving the application's own link open");
                    }
                    live => all.extend(live),
                }
                all
            }
            Err(_) => Vec::new(),
        }
    }
}

impl Drop for PeerEntry {
    /// An entry leaves the pool with its links taken out (idle, evicted), or is dropped with the
    /// pool: then, or when the last request on it ends if some were running, its links close.
    fn drop(&mut self) {
        for peer in self.take_links() {
            self.shared.close_in_background(peer);
        }
    }
}

impl Pool {
    pub(crate) fn new(engine: Engine, config: PoolConfig) -> Result<Self> {
        config.validate()?;
        Ok(Pool::unchecked(engine, config))
    }

    /// A pool with settings known to be valid.
    pub(crate) fn unchecked(engine: Engine, config: PoolConfig) -> Self {
        Pool {
            shared: Arc::new(Shared {
                engine,
                in_flight: CachePadded::new(Limit::new(config.max_in_flight)),
                config,
                counters: Counters::default(),
            }),
            entries: ShardedLock::new(FxHashMap::default()),
            epoch: Instant::now(),
            clock: Arc::new(AtomicU64::new(0)),
            reaper_started: AtomicBool::new(false),
            jitter: RandomState::new(),
        }
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let (peers, links) = match self.entries.read() {
            Ok(entries) => {
                let links = entries
                    .values()
                    .filter(|s| {
                        s.state
                            .read()
                            .is_ok_and(|st| st.peer.as_ref().is_some_and(|p| !p.is_closed()))
                    })
                    .count();
                (entries.len(), links)
            }
            Err(_) => (0, 0),
        };
        let c = &self.shared.counters;
        PoolStats {
            peers,
            links,
            in_flight: self.shared.in_flight.used(),
            connects: c.connects.load(Ordering::Relaxed),
            connect_failures: c.connect_failures.load(Ordering::Relaxed),
            links_dropped: c.links_dropped.load(Ordering::Relaxed),
            idle_closed: c.idle_closed.load(Ordering::Relaxed),
            evicted: c.evicted.load(Ordering::Relaxed),
        }
    }

    /// A live link to `addr` with a unit of its per-peer limit, if both are at hand now: then the
    /// lease, and what `begin` made of the link (it runs with the link borrowed, the entry's lock
    /// held for reading). Otherwise the claim on the peer's entry, for
    /// [`wait_for_link`](Self::wait_for_link).
    ///
    /// The caller holds a unit of the pool's in-flight limit (the service reserved it); the lease or
    /// the claim takes it over, and it goes back if this fails.
    pub(crate) fn try_checkout<R>(
        self: &Arc<Self>,
        addr: SocketAddr,
        begin: impl FnOnce(&Peer, LeaseStart) -> R,
    ) -> Result<Checkout<R>> {
        let unit = Unit(&self.shared.in_flight);
        let (entry, evicted) = self.claim(addr)?;
        let mut claim = EntryUse {
            entry,
            holds_unit: false,
            holds_in_flight: false,
        };
        for peer in evicted {
            self.shared.close_in_background(peer);
        }
        if claim.try_take_unit() {
            let begun = claim
                .entry
                .with_live(|peer, generation, start| (begin(peer, start), generation, peer.transport()))?;
            if let Some((begun, generation, transport)) = begun {
                unit.passed_on();
                claim.holds_in_flight = true;
                return Ok(Checkout::Ready(Lease::new(claim, generation, transport, false), begun));
            }
        }
        unit.passed_on();
        let held = InFlight {
            pool: self.clone(),
            held: true,
        };
        Ok(Checkout::Wait(held, claim))
    }

    /// [`try_checkout`](Self::try_checkout) when it must wait: for a unit of the per-peer limit unless
    /// `claim` holds one, then for a live link, dialling one if no other request is. Waiting ends with
    /// `Timeout` at `deadline`.
    pub(crate) async fn wait_for_link(
        held: InFlight,
        claim: EntryUse,
        deadline: Option<Instant>,
    ) -> Result<(Lease, Link)> {
        let addr = claim.entry.addr;
        let waiting = Pool::wait_unbounded(held, claim);
        match deadline {
            None => waiting.await,
            Some(at) => tokio::time::timeout_at(at, waiting)
                .await
                .unwrap_or_else(|_| Err(past_deadline(addr, "waiting for a link"))),
        }
    }

    async fn wait_unbounded(held: InFlight, mut claim: EntryUse) -> Result<(Lease, Link)> {
        claim.take_unit().await;
        let (link, new_link) = match claim.entry.live()? {
            Some(link) => (link, false),
            None => {
                let _dialling = claim.entry.connecting.lock().await;
                // Someone else may have connected while this request waited.
                match claim.entry.live()? {
                    Some(link) => (link, false),
                    // Boxed: connecting is rarer than waiting, and its future is large; inline it
                    // would grow every wait's future.
                    None => (Box::pin(held.pool.dial(&claim.entry)).await?, true),
                }
            }
        };
        held.hand_to(&mut claim);
        let lease = Lease::new(claim, link.generation, link.peer.transport(), new_link);
        Ok((lease, link))
    }

    /// Connects `entry`'s address (its `connecting` lock held), or says why not.
    async fn dial(&self, entry: &Arc<PeerEntry>) -> Result<Link> {
        let addr = entry.addr;
        let retired = {
            let mut st = entry.state()?;
            if let Some(at) = st.retry_at.filter(|at| *at > Instant::now()) {
                return Err(backed_off(
                    st.last_error.as_ref(),
                    addr,
                    at - Instant::now(),
                    st.failures,
                ));
            }
            std::mem::take(&mut st.retired)
        };
        // From here until the outcome is recorded, a dropped future (an outer timeout) counts as a
        // failed connect, so that abandoned dials back off like failed ones.
        let mut dial = Dial {
            pool: self,
            entry,
            done: false,
        };
        for old in retired {
            // Frees the engine's entry for this address; it may already be gone.
            let _ = self
                .shared
                .engine
                .disconnect(&old, self.shared.config.connect_timeout)
                .await;
        }
        let connected = match self
            .shared
            .engine
            .connect(&addr.to_string(), self.shared.config.connect_timeout)
            .await
        {
            // A link the application (or another pool) made itself through the engine: use it,
            // and leave closing it to its maker.
            Err(Error::AlreadyConnected(msg)) => self
                .shared
                .engine
                .peer_at(addr)
                .filter(|p| !p.is_closed())
                .map(|p| (p, true))
                .ok_or(Error::AlreadyConnected(msg)),
            other => other.map(|p| (p, false)),
        };
        dial.done = true;
        self.tick_clock();
        let mut st = entry.state()?;
        match connected {
            Ok((peer, adopted)) => {
                self.shared.counters.connects.fetch_add(1, Ordering::Relaxed);
                if st.failures > 0 {
                    tracing::info!(peer = %addr, failures = st.failures, "reconnected");
                } else {
                    tracing::debug!(peer = %addr, transport = %peer.transport(), "connected");
                }
                st.generation += 1;
                st.peer = Some(peer.clone());
                st.adopted = adopted;
                st.failures = 0;
                st.retry_at = None;
                st.last_error = None;
                st.primary = None;
                entry.strikes.store(0, Ordering::Relaxed);
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    st.primary = Some(peer.with_regions(primary_region).ok().flatten());
                    runtime.spawn(watch_regions(Arc::downgrade(entry), peer.clone(), st.generation));
                }
                Ok(Link {
                    peer,
                    generation: st.generation,
                    primary: st.primary,
                })
            }
            Err(e) => {
                self.connect_failed(addr, &mut st, &e);
                Err(e)
            }
        }
    }

    fn tick_clock(&self) {
        self.clock.store(nanos_since(self.epoch), Ordering::Relaxed);
    }

    fn connect_failed(&self, addr: SocketAddr, st: &mut LinkState, e: &Error) {
        self.shared.counters.connect_failures.fetch_add(1, Ordering::Relaxed);
        st.failures = st.failures.saturating_add(1);
        let pause = self.reconnect_pause(st.failures);
        st.retry_at = Some(Instant::now() + pause);
        st.last_error = Some(e.clone());
        tracing::warn!(peer = %addr, error = %e, failures = st.failures, ?pause, "connect failed");
    }

    /// Finds or makes the entry for `addr` and counts a user on it; at the link limit, takes the least
    /// recently used idle entry out (its links are returned, to be closed).
    fn claim(self: &Arc<Self>, addr: SocketAddr) -> Result<(Arc<PeerEntry>, Vec<Peer>)> {
        // No need to note the time here: an entry in use is never idle, and the release notes it.
        if let Some(entry) = self.entries.read().map_err(|_| poisoned())?.get(&addr) {
            return Ok((entry.clone(), Vec::new()));
        }
        self.start_reaper();
        let mut entries = self.entries.write().map_err(|_| poisoned())?;
        // Another request may have made the entry between the two locks.
        if let Some(entry) = entries.get(&addr) {
            return Ok((entry.clone(), Vec::new()));
        }
        let mut evicted = Vec::new();
        if entries.len() >= self.shared.config.max_links {
            let victim = entries
                .values()
                .filter(|s| EntryUse::unused(s))
                .min_by_key(|s| s.last_used.load(Ordering::Relaxed))
                .map(|s| s.addr);
            let Some(victim) = victim.and_then(|a| entries.remove(&a)) else {
                return Err(Error::ResourceExhausted(format!(
                    "the pool holds links to {} peers, all busy (PoolConfig::max_links); {addr} must wait",
                    self.shared.config.max_links
                )));
            };
            tracing::debug!(peer = %victim.addr, "closing the least recently used idle link to make room");
            self.shared.counters.evicted.fetch_add(1, Ordering::Relaxed);
            evicted = victim.take_links();
        }
        self.tick_clock();
        let entry = Arc::new(PeerEntry::new(addr, self.shared.clone(), self.clock.clone()));
        entries.insert(addr, entry.clone());
        Ok((entry, evicted))
    }

    /// Exponential pause with "equal jitter": half fixed, half random.
    fn reconnect_pause(&self, failures: u32) -> Duration {
        let min = self.shared.config.reconnect_backoff_min;
        let max = self.shared.config.reconnect_backoff_max;
        let base = min
            .checked_mul(1u32 << failures.saturating_sub(1).min(20))
            .unwrap_or(max)
            .min(max);
        let random = self.jitter.hash_one((failures, nanos_since(self.epoch)));
        let fraction = (random >> 11) as f64 / (1u64 << 53) as f64;
        base / 2 + base.mul_f64(fraction / 2.0)
    }

    fn start_reaper(self: &Arc<Self>) {
        if self.reaper_started.load(Ordering::Relaxed) || self.reaper_started.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Not inside a tokio runtime: try again on the next request.
            self.reaper_started.store(false, Ordering::Release);
            return;
        };
        let pool = Arc::downgrade(self);
        let tick = (self.shared.config.idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        runtime.spawn(async move {
            let mut interval = tokio::time::interval(tick);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                interval.tick().await;
                let Some(pool) = pool.upgrade() else { break };
                pool.tick_clock();
                for peer in pool.take_idle(tick) {
                    let _ = pool
                        .shared
                        .engine
                        .disconnect(&peer, pool.shared.config.connect_timeout)
                        .await;
                }
            }
        });
    }

    /// Takes the entries idle for `idle_timeout` out of the pool and returns their links. Last-use times
    /// lag by up to one `tick` of the coarse clock, so that much is added before judging.
    fn take_idle(&self, tick: Duration) -> Vec<Peer> {
        let now = nanos_since(self.epoch);
        let idle = u64::try_from((self.shared.config.idle_timeout + tick).as_nanos()).unwrap_or(u64::MAX);
        let Ok(mut entries) = self.entries.write() else {
            return Vec::new();
        };
        let mut closing = Vec::new();
        entries.retain(|addr, entry| {
            let unused = EntryUse::unused(entry) && now.saturating_sub(entry.last_used.load(Ordering::Relaxed)) >= idle;
            if unused {
                let links = entry.take_links();
                if !links.is_empty() {
                    tracing::debug!(peer = %addr, "closing an idle link");
                    self.shared.counters.idle_closed.fetch_add(1, Ordering::Relaxed);
                }
                closing.extend(links);
            }
            !unused
        });
        closing
    }
}

/// A connect in progress; see [`Pool::wait_for_link`].
struct Dial<'a> {
    pool: &'a Pool,
    entry: &'a PeerEntry,
    done: bool,
}

impl Drop for Dial<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Ok(mut st) = self.entry.state.write() {
            let e = Error::Timeout(format!(
                "connecting to {} was abandoned before it finished (an outer timeout)",
                self.entry.addr
            ));
            self.pool.connect_failed(self.entry.addr, &mut st, &e);
        }
    }
}

impl Lease {
    fn new(claim: EntryUse, generation: u64, transport: TransportKind, new_link: bool) -> Self {
        Lease {
            new_link,
            transport,
            generation,
            settled: false,
            claim,
        }
    }

    /// The address the lease is for.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.claim.entry.addr
    }

    /// The pool's engine, settings and limits.
    pub(crate) fn shared(&self) -> &Shared {
        &self.claim.entry.shared
    }

    /// Records how the attempt on this link ended.
    pub(crate) fn settle(&mut self, result: &Result<()>) {
        match result {
            Ok(()) => {
                self.settled = true;
                let entry = &self.claim.entry;
                if entry.strikes.load(Ordering::Relaxed) != 0 {
                    entry.strikes.store(0, Ordering::Relaxed);
                }
            }
            Err(e) => self.settle_failed(e),
        }
    }

    /// Records that the attempt on this link failed with `e`.
    pub(crate) fn settle_failed(&mut self, e: &Error) {
        self.settled = true;
        match e {
            e if breaks_link(e) || self.claim.entry.closed(self.generation) => {
                self.claim.entry.invalidate(self.generation, e.message());
            }
            Error::Timeout(_) => self.strike("transfers on it time out"),
            _ => {}
        }
    }

    /// Ends the attempt without a verdict on the link (the request itself was wrong).
    pub(crate) fn settle_neutral(&mut self) {
        self.settled = true;
    }

    fn strike(&self, why: &str) {
        let entry = &self.claim.entry;
        let n = entry.strikes.fetch_add(1, Ordering::AcqRel) + 1;
        if n >= entry.shared.config.timeouts_before_reconnect {
            entry.invalidate(self.generation, why);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.settled {
            // Dropped mid-transfer: an outer timeout fired or the caller gave up.
            self.strike("attempts on it are abandoned unfinished");
        }
    }
}

/// A link as a waiting request sees it.
pub(crate) struct Link {
    pub(crate) peer: Peer,
    generation: u64,
    pub(crate) primary: Option<Option<(u64, u64)>>,
}

impl Link {
    pub(crate) fn start(&self) -> LeaseStart {
        LeaseStart { primary: self.primary }
    }
}

/// How often [`watch_regions`] re-reads a peer's table without being told of a change.
const REGION_REFRESH: Duration = Duration::from_secs(1);

/// Keeps [`LinkState::primary`] current for the link of `generation`, so that requests with
/// [`RemoteAddr::Offset`](crate::RemoteAddr::Offset) descriptors need not copy the peer's region table
/// each time. Ends when the link is replaced or closed, or the entry leaves the pool.
async fn watch_regions(entry: std::sync::Weak<PeerEntry>, peer: Peer, generation: u64) {
    loop {
        let mut changed = std::pin::pin!(peer.regions_changed(REGION_REFRESH));
        // Poll once before re-reading, so that a change during the re-read still ends the wait.
        let pending = std::future::poll_fn(|cx| Poll::Ready(changed.as_mut().poll(cx).is_pending())).await;
        {
            let Some(entry) = entry.upgrade() else { return };
            if peer.is_closed() {
                return;
            }
            let Ok(mut st) = entry.state.write() else { return };
            if st.generation != generation {
                return;
            }
            st.primary = Some(peer.with_regions(primary_region).ok().flatten());
        }
        if pending {
            changed.await;
        }
    }
}

/// The error for a request that arrives while reconnecting to `addr` is paused: the last connect's
/// variant (so that retry decisions do not change), with a message that says so.
fn backed_off(last: Option<&Error>, addr: SocketAddr, left: Duration, failures: u32) -> Error {
    let last_msg = last.map(|e| e.message()).unwrap_or("unknown");
    let msg = format!(
        "{addr}: not reconnecting for another {} ms after {failures} failed connects; the last: {last_msg}",
        left.as_millis()
    );
    match last {
        Some(Error::Timeout(_)) => Error::Timeout(msg),
        Some(Error::PeerClosed(_)) => Error::PeerClosed(msg),
        Some(Error::Io { kind, .. }) => Error::Io {
            kind: *kind,
            message: msg,
        },
        Some(other) if !crate::is_transient_ferry(other) => other.clone(),
        _ => Error::NotConnected(msg),
    }
}

fn nanos_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The error for a request whose deadline (see [`crate::deadline`]) passed while it was `doing` something.
pub(crate) fn past_deadline(addr: SocketAddr, doing: &str) -> Error {
    Error::Timeout(format!("the request to {addr} reached its deadline {doing}"))
}

fn poisoned() -> Error {
    Error::Internal("a connection pool lock was poisoned by a panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_configs_are_rejected() {
        let cases = [
            PoolConfig {
                max_links: 0,
                ..PoolConfig::default()
            },
            PoolConfig {
                max_in_flight: 0,
                ..PoolConfig::default()
            },
            PoolConfig {
                connect_timeout: Duration::ZERO,
                ..PoolConfig::default()
            },
            PoolConfig {
                reconnect_backoff_min: Duration::from_secs(5),
                reconnect_backoff_max: Duration::from_secs(1),
                ..PoolConfig::default()
            },
        ];
        for c in cases {
            assert!(matches!(c.validate(), Err(Error::InvalidArgument(_))), "{c:?}");
        }
        assert!(PoolConfig::default().validate().is_ok());
    }

    #[test]
    fn backed_off_errors_keep_the_variant() {
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let refused = Error::io("connect", std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        let e = backed_off(Some(&refused), addr, Duration::from_millis(5), 3);
        assert!(matches!(
            e,
            Error::Io {
                kind: std::io::ErrorKind::ConnectionRefused,
                ..
            }
        ));
        let t = backed_off(Some(&Error::Timeout("x".into())), addr, Duration::from_millis(5), 1);
        assert!(matches!(t, Error::Timeout(_)));
        let u = Error::Unsupported("no transport in common".into());
        assert_eq!(backed_off(Some(&u), addr, Duration::ZERO, 1), u);
    }
}
