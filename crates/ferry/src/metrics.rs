//! Prometheus metrics of an engine, registered in the application's own registry
//! ([`prometheus-client`](prometheus_client), the Prometheus project's OpenMetrics library: typed
//! metrics, an application-owned [`Registry`], and collectors read at scrape time).
//!
//! [`EngineBuilder::metrics`](crate::EngineBuilder::metrics) registers every metric below under the
//! `ferry_` prefix. Two kinds:
//!
//! - **Transfers, counted where they are posted.** The initiator is the one side that sees every
//!   operation on every transport (an RDMA target's CPU never sees a one-sided operation, nor does a
//!   same-host target whose memory the initiator mapped), so transfers are counted by the engine
//!   that posts them, per peer, transport and operation: bytes, batches, descriptors, errors by
//!   kind, and the duration of a batch (buckets from 10 µs to 10 s). A link resolves its counters
//!   once, when it is set up; a transfer then adds to them with atomic operations and one histogram
//!   observation, and takes no lock of a metric family.
//! - **Engine state, read at scrape time**: what this engine's CPU served to peers over TCP streams
//!   (requests and bytes by operation; a target's view, blind to RDMA and mapped memory), links by
//!   direction and their limit, registered regions and bytes, the coalescing pool's buffers and those on loan,
//!   notifications received, queued and their bytes against their budget, and what the engine's persistent regions spent
//!   persisting. Nothing is updated between scrapes.
//!
//! An engine's metrics carry no engine label: give each engine its own registry, or a sub-registry
//! with a label of your choosing (`Registry::sub_registry_with_label`).

use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use ferry_core::{Error, Op, TransportKind};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransferLabels {
    peer: String,
    transport: String,
    op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    peer: String,
    transport: String,
    op: String,
    error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PassedOverLabels {
    transport: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    transport: String,
    op: String,
}

/// Batch durations: 10 µs to 10 s, three buckets per decade.
fn duration_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(10e-6, 10f64.powf(1.0 / 3.0), 19)
}

/// The transfer metric families an engine registered (cheap to clone: each is shared).
#[derive(Clone, Debug)]
pub(crate) struct Metrics {
    bytes: Family<TransferLabels, Counter>,
    batches: Family<TransferLabels, Counter>,
    descriptors: Family<TransferLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    durations: Family<DurationLabels, Histogram>,
    passed_over: Family<PassedOverLabels, Counter>,
    /// The engine, once built, for the scrape-time collector.
    engine: Arc<OnceLock<Weak<dyn StateSource>>>,
}

impl Metrics {
    /// Registers the families and the engine's collector in `registry`, under `ferry_`.
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let metrics = Metrics {
            bytes: Family::default(),
            batches: Family::default(),
            descriptors: Family::default(),
            errors: Family::default(),
            durations: Family::new_with_constructor(|| Histogram::new(duration_buckets())),
            passed_over: Family::default(),
            engine: Arc::new(OnceLock::new()),
        };
        let registry = registry.sub_registry_with_prefix("ferry");
        registry.register(
            "transfer_bytes",
            "Bytes of transfers this engine posted that completed, by peer, transport and operation",
            metrics.bytes.clone(),
        );
        registry.register(
            "transfer_batches",
            "Batches this engine posted that completed",
            metrics.batches.clone(),
        );
        registry.register(
            "transfer_descriptors",
            "Descriptors of the batches this engine posted that completed",
            metrics.descriptors.clone(),
        );
        registry.register(
            "transfer_errors",
            "Batches this engine posted that failed, by error kind",
            metrics.errors.clone(),
        );
        registry.register(
            "transfer_duration_seconds",
            "Time from posting a batch to its completion, by transport and operation",
            metrics.durations.clone(),
        );
        registry.register(
            "paths_passed_over",
            "Better data paths a link of this engine could not take, by transport and the error kind that stopped it",
            metrics.passed_over.clone(),
        );
        registry.register_collector(Box::new(EngineCollector {
            engine: metrics.engine.clone(),
        }));
        metrics
    }

    /// Points the scrape-time collector at the engine just built.
    pub(crate) fn attach(&self, engine: Weak<dyn StateSource>) {
        let _ = self.engine.set(engine);
    }

    /// Counts a better data path a link could not take, and why (an error kind's name).
    pub(crate) fn passed_over(&self, transport: TransportKind, reason: &str) {
        self.passed_over
            .get_or_create(&PassedOverLabels {
                transport: transport.name().to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// The counters of one link, resolved once.
    pub(crate) fn link(&self, peer: &str, transport: TransportKind) -> LinkMetrics {
        let op = |op: Op| {
            let labels = TransferLabels {
                peer: peer.to_string(),
                transport: transport.name().to_string(),
                op: op_name(op).to_string(),
            };
            OpMetrics {
                bytes: self.bytes.get_or_create(&labels).clone(),
                batches: self.batches.get_or_create(&labels).clone(),
                descriptors: self.descriptors.get_or_create(&labels).clone(),
                duration: self
                    .durations
                    .get_or_create(&DurationLabels {
                        transport: labels.transport.clone(),
                        op: labels.op.clone(),
                    })
                    .clone(),
            }
        };
        LinkMetrics {
            write: op(Op::Write),
            read: op(Op::Read),
            errors: self.errors.clone(),
            peer: peer.to_string(),
            transport: transport.name(),
        }
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Write => "write",
        Op::Read => "read",
    }
}

#[derive(Debug)]
struct OpMetrics {
    bytes: Counter,
    batches: Counter,
    descriptors: Counter,
    duration: Histogram,
}

/// One link's transfer counters.
#[derive(Debug)]
pub(crate) struct LinkMetrics {
    write: OpMetrics,
    read: OpMetrics,
    errors: Family<ErrorLabels, Counter>,
    peer: String,
    transport: &'static str,
}

impl LinkMetrics {
    /// Counts a batch of `descriptors` descriptors and `bytes` bytes that ended with `result` after
    /// `took`.
    pub(crate) fn record(&self, op: Op, descriptors: usize, bytes: u64, took: Duration, result: &Result<(), Error>) {
        let m = match op {
            Op::Write => &self.write,
            Op::Read => &self.read,
        };
        match result {
            Ok(()) => {
                m.bytes.inc_by(bytes);
                m.batches.inc();
                m.descriptors.inc_by(descriptors as u64);
                m.duration.observe(took.as_secs_f64());
            }
            Err(e) => {
                // Failures are rare: the family's lock is taken only for them.
                self.errors
                    .get_or_create(&ErrorLabels {
                        peer: self.peer.clone(),
                        transport: self.transport.to_string(),
                        op: op_name(op).to_string(),
                        error: e.code().name().to_string(),
                    })
                    .inc();
            }
        }
    }
}

/// Reads the engine's state at each scrape.
#[derive(Debug)]
struct EngineCollector {
    engine: Arc<OnceLock<Weak<dyn StateSource>>>,
}

fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: i64) -> std::fmt::Result {
    let g = ConstGauge::new(value);
    let metric = encoder.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(metric)
}

fn counter(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64) -> std::fmt::Result {
    let c = ConstCounter::new(value);
    let metric = encoder.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(metric)
}

impl Collector for EngineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(engine) = self.engine.get().and_then(Weak::upgrade) else {
            return Ok(());
        };
        let state = engine.state();
        let g = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        counter(
            &mut encoder,
            "served_writes",
            "WRITE requests of peers this engine's CPU completed over TCP streams (RDMA and mapped same-host memory bypass it)",
            state.served_writes,
        )?;
        counter(
            &mut encoder,
            "served_write_bytes",
            "Bytes of those writes",
            state.served_write_bytes,
        )?;
        counter(
            &mut encoder,
            "served_reads",
            "READ requests of peers this engine's CPU answered over TCP streams",
            state.served_reads,
        )?;
        counter(
            &mut encoder,
            "served_read_bytes",
            "Bytes of those reads",
            state.served_read_bytes,
        )?;
        gauge(
            &mut encoder,
            "links_incoming",
            "Links peers opened to this engine",
            g(state.incoming_links),
        )?;
        gauge(
            &mut encoder,
            "links_outgoing",
            "Links this engine opened to peers",
            g(state.outgoing_links),
        )?;
        gauge(
            &mut encoder,
            "links_limit",
            "The most links in each direction (EngineBuilder::max_links): a new one beyond is refused",
            g(state.max_links),
        )?;
        {
            let mut family = encoder.encode_descriptor(
                "links_by_transport",
                "Links this engine opened, by the data path each took",
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            for (transport, n) in &state.links_by_transport {
                let labels = vec![("transport", *transport)];
                ConstGauge::new(g(*n)).encode(family.encode_family(&labels)?)?;
            }
        }
        gauge(&mut encoder, "regions", "Registered regions", g(state.regions))?;
        gauge(
            &mut encoder,
            "coalesce_pool_buffers",
            "Buffers of the pool small TCP descriptors are coalesced through (EngineBuilder::buffer_pool)",
            g(state.coalesce_buffers),
        )?;
        gauge(
            &mut encoder,
            "coalesce_pool_buffers_in_use",
            "Of those, on loan now (all of them: transfers wait for one)",
            g(state.coalesce_in_use),
        )?;
        gauge(
            &mut encoder,
            "registered_bytes",
            "Bytes of the registered regions",
            i64::try_from(state.registered_bytes).unwrap_or(i64::MAX),
        )?;
        counter(
            &mut encoder,
            "notifications_received",
            "Notifications peers sent that the engine queued",
            state.notifications_received,
        )?;
        gauge(
            &mut encoder,
            "notifications_queued",
            "Notifications waiting to be taken",
            g(state.notifications_queued),
        )?;
        gauge(
            &mut encoder,
            "notifications_queued_bytes",
            "What the waiting notifications weigh, against the engine's byte budget",
            g(state.notifications_queued_bytes),
        )?;
        gauge(
            &mut encoder,
            "notifications_queued_bytes_limit",
            "The byte budget of waiting notifications (EngineBuilder::max_notification_bytes): beyond it, new ones are refused",
            g(state.max_notification_bytes),
        )?;
        gauge(
            &mut encoder,
            "persisted_bytes",
            "Bytes the registered persistent regions were asked to persist",
            i64::try_from(state.persisted_bytes).unwrap_or(i64::MAX),
        )?;
        let g = ConstGauge::new(state.persist_seconds);
        let metric = encoder.encode_descriptor(
            "persist_seconds",
            "Time the registered persistent regions spent persisting (msync or cache-line write-back)",
            None,
            g.metric_type(),
        )?;
        g.encode(metric)
    }
}

/// What a scrape reads the engine's state from (the engine's shared state, which sits above this
/// module: the collector holds it weakly, through this trait, so that metrics import nothing of it).
pub(crate) trait StateSource: Send + Sync {
    /// The engine's state now.
    fn state(&self) -> EngineState;
}

/// The engine's state for a scrape.
#[derive(Debug, Default)]
pub(crate) struct EngineState {
    pub(crate) served_writes: u64,
    pub(crate) served_write_bytes: u64,
    pub(crate) served_reads: u64,
    pub(crate) served_read_bytes: u64,
    pub(crate) coalesce_buffers: usize,
    pub(crate) coalesce_in_use: usize,
    pub(crate) incoming_links: usize,
    pub(crate) outgoing_links: usize,
    /// The most links in each direction.
    pub(crate) max_links: usize,
    pub(crate) max_notification_bytes: usize,
    pub(crate) regions: usize,
    pub(crate) registered_bytes: u64,
    pub(crate) notifications_received: u64,
    pub(crate) notifications_queued: usize,
    pub(crate) notifications_queued_bytes: usize,
    pub(crate) persisted_bytes: u64,
    pub(crate) persist_seconds: f64,
    /// Open links this engine opened, by the name of the transport each took.
    pub(crate) links_by_transport: Vec<(&'static str, usize)>,
}
