//! One engine of the fleet, as its own process (`ferry-chaos member`): a prefill engine serves a region
//! of KV blocks whose bytes are a function of its name ([`crate::pattern`]); a decode engine finds the
//! prefill engines in the directory and pulls scattered batches of blocks from them, all the time,
//! through ferry-tower's pool, retries and deadlines, checks every byte, and notifies the source.
//! Both report on stdout ([`Event`]).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use ferry::{Access, Engine, Notification, Region};
use ferry_tower::tower::{ServiceBuilder, ServiceExt};
use ferry_tower::{DeadlineLayer, Descriptor, PoolConfig, RetryPolicy, TransferRequest, TransferService};
use futures::StreamExt;

use crate::event::{Event, now_ms};
use crate::pattern::{self, BLOCK};
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    Prefill,
    Decode,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, value_enum)]
    pub role: Role,
    /// The engine's name in the directory.
    #[arg(long)]
    pub name: String,
    /// "ip:port".
    #[arg(long)]
    pub listen: String,
    /// etcd://HOST:PORT.
    #[arg(long)]
    pub directory: String,
    /// The directory lease, in seconds.
    #[arg(long, default_value_t = 5)]
    pub ttl: u64,
    /// KV blocks of 64 KiB in a prefill engine's region.
    #[arg(long, default_value_t = 512)]
    pub blocks: u64,
    /// Concurrent pulls of a decode engine.
    #[arg(long, default_value_t = 2)]
    pub callers: usize,
    /// Each pull's overall deadline, retries included.
    #[arg(long, default_value = "4s", value_parser = humantime::parse_duration)]
    pub deadline: Duration,
    /// Each attempt's deadline, connecting included.
    #[arg(long, default_value = "1500ms", value_parser = humantime::parse_duration)]
    pub attempt: Duration,
    /// Seeds the decode engine's choice of sources and blocks.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// The most blocks one pull asks for.
const MAX_BATCH: u64 = 256;
const MIN_BATCH: u64 = 64;

pub async fn run(args: Args) -> anyhow::Result<()> {
    let options = ferry_etcd::EtcdOptions {
        ttl: Duration::from_secs(args.ttl.max(1)),
        ..Default::default()
    };
    let directory = ferry_etcd::EtcdDirectory::connect(&args.directory, "/ferry", options)
        .await
        .with_context(|| format!("connecting to the directory at {}", args.directory))?;
    let engine = Engine::builder()
        .listen(&args.listen)
        .name(&args.name)
        .directory(directory)
        .build()
        .await
        .with_context(|| format!("starting {} on {}", args.name, args.listen))?;
    let work = match args.role {
        Role::Prefill => tokio::spawn(prefill(engine.clone(), args.blocks)),
        Role::Decode => tokio::spawn(decode(engine.clone(), args)),
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
        done = work => done.context("the member's task")??,
    }
    Ok(())
}

async fn prefill(engine: Engine, blocks: u64) -> anyhow::Result<()> {
    // Filled before it is registered: a peer never reads a block that does not hold its bytes yet.
    let seed = pattern::seed(&engine.record().name);
    let mut memory = vec![0u8; (blocks as usize) * BLOCK];
    for (index, block) in memory.chunks_mut(BLOCK).enumerate() {
        pattern::fill(seed, index as u64, block);
    }
    let _region = engine.register(memory, Access::READ_WRITE)?;
    Event::Ready {
        name: engine.record().name,
        pid: std::process::id(),
    }
    .emit();
    let mut notifications = engine.notifications();
    let mut count = 0u64;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            n = notifications.next() => match n {
                Some(_) => count += 1,
                None => anyhow::bail!("the engine's notification stream ended"),
            },
            _ = tick.tick() => Event::Notifications { count }.emit(),
        }
    }
}

/// The prefill engines the directory lists now, by name.
type Sources = Arc<Mutex<Vec<(String, SocketAddr)>>>;

async fn decode(engine: Engine, args: Args) -> anyhow::Result<()> {
    let region = Arc::new(engine.alloc_host(args.callers * (MAX_BATCH as usize) * BLOCK, Access::READ_WRITE)?);
    let sources: Sources = Arc::default();
    tokio::spawn(follow_directory(engine.clone(), sources.clone()));
    let transfers = TransferService::with_config(
        engine.clone(),
        PoolConfig {
            connect_timeout: args.attempt,
            ..Default::default()
        },
    )?;
    let stack = ServiceBuilder::new()
        .layer(DeadlineLayer::new(args.deadline))
        .retry(RetryPolicy::default())
        .layer(DeadlineLayer::per_attempt(args.attempt))
        .service(transfers);
    Event::Ready {
        name: engine.record().name,
        pid: std::process::id(),
    }
    .emit();
    let callers: Vec<_> = (0..args.callers)
        .map(|caller| {
            let (engine, region, sources, stack) = (engine.clone(), region.clone(), sources.clone(), stack.clone());
            let mut rng =
                Rng::from_state(args.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (caller as u64 + 1) << 32 | 1);
            let (blocks, deadline) = (args.blocks, args.deadline);
            tokio::spawn(async move {
                let base = (caller as u64) * MAX_BATCH * BLOCK as u64;
                loop {
                    let Some((from, addr)) = pick(&sources, &mut rng) else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    let n = MIN_BATCH + rng.below(MAX_BATCH - MIN_BATCH + 1);
                    let indices = rng.distinct(n, blocks);
                    pull(&engine, &region, base, &stack, &from, addr, &indices, deadline).await;
                }
            })
        })
        .collect();
    // The callers pull until the process ends; one that stops has panicked.
    let (stopped, ..) = futures::future::select_all(callers).await;
    stopped.context("a decode caller")?;
    anyhow::bail!("a decode caller stopped")
}

fn pick(sources: &Sources, rng: &mut Rng) -> Option<(String, SocketAddr)> {
    let sources = sources.lock().ok()?;
    (!sources.is_empty()).then(|| sources[rng.index(sources.len())].clone())
}

/// One pull: poison the destination (so that a read that wrote nothing cannot pass), read, check
/// every byte, notify the source, report.
#[allow(clippy::too_many_arguments)]
async fn pull<S>(
    engine: &Engine,
    region: &Region,
    base: u64,
    stack: &S,
    from: &str,
    addr: SocketAddr,
    indices: &[u64],
    deadline: Duration,
) where
    S: ferry_tower::tower::Service<TransferRequest, Error = ferry::Error> + Clone,
{
    let poison = vec![0xee; BLOCK];
    let block = BLOCK as u64;
    for i in 0..indices.len() as u64 {
        if region.write_at(base + i * block, &poison).is_err() {
            return;
        }
    }
    let descs: Vec<Descriptor> = indices
        .iter()
        .enumerate()
        .map(|(i, &index)| Descriptor::at_offset(region.addr_at(base + i as u64 * block), index * block, block))
        .collect();
    let start_ms = now_ms();
    let result = stack.clone().oneshot(TransferRequest::read(addr, descs)).await;
    let end_ms = now_ms();
    let mut notified = false;
    if result.is_ok() {
        let seed = pattern::seed(from);
        let mut got = vec![0u8; BLOCK];
        for (i, &index) in indices.iter().enumerate() {
            let diff = region
                .read_at(base + i as u64 * block, &mut got)
                .map_or(Some(0), |()| pattern::first_difference(seed, index, &got));
            if let Some(offset) = diff {
                Event::Corrupt {
                    from: from.to_string(),
                    block: index,
                    offset,
                    end_ms,
                }
                .emit();
                break;
            }
        }
        if let Some(peer) = engine.peer_at(addr) {
            let note = Notification::new("kv-done", format!("{} blocks", indices.len()));
            notified = engine.notify(&peer, note, Duration::from_secs(1)).await.is_ok();
        }
    }
    let (outcome, error) = match &result {
        Ok(_) => ("ok".to_string(), None),
        Err(e) => (e.code().name().to_string(), Some(e.to_string())),
    };
    Event::Transfer {
        from: from.to_string(),
        start_ms,
        end_ms,
        deadline_ms: deadline.as_secs_f64() * 1e3,
        bytes: indices.len() as u64 * block,
        outcome,
        error,
        notified,
    }
    .emit();
}

/// Keeps `sources` at the prefill engines the directory lists, every half second; while the directory
/// does not answer, the last list stands (links do not need it).
async fn follow_directory(engine: Engine, sources: Sources) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let Ok(Ok(records)) = tokio::time::timeout(Duration::from_secs(2), engine.list_members()).await else {
            continue;
        };
        let mut now: Vec<(String, SocketAddr)> = records
            .into_iter()
            .filter(|r| r.name.starts_with("prefill-"))
            .filter_map(|r| Some((r.name.clone(), r.addrs.first()?.parse().ok()?)))
            .collect();
        now.sort();
        if let Ok(mut s) = sources.lock() {
            *s = now;
        }
    }
}
