//! What the middleware costs: 4 KiB writes straight through `Engine::transfer` against the same writes
//! through the recommended stack (the pool, `tower::retry`, and an overall and a per-attempt
//! [`DeadlineLayer`]), in one run, on one link. The same stack with two `tower::timeout`s in place of
//! the deadlines is measured beside it, for what a timer per layer costs.
//!
//! Each case runs 16 concurrent callers for a 200 ms slice at a time; the cases take turns, 25
//! slices each, in an order reversed every other turn (direct, deadlines, timeouts; then timeouts,
//! deadlines, direct). A ratio is the median over turns of the case's rate over the direct rate of
//! the same turn: the machines this runs on change speed by a third from one second to the next, and
//! rates taken a few hundred milliseconds apart, in both orders, cancel most of that, where medians
//! of whole-second rounds taken seconds apart did not. Prints one JSON line:
//! `{"case":"tower_overhead_4KiB","direct_ops_per_s":..,"tower_ops_per_s":..,"ratio":..,
//! "added_cpu_us":..,"timeouts_ops_per_s":..,"timeouts_ratio":..}`. `added_cpu_us` is what the stack
//! costs a request in absolute terms: the CPU time per request through the stack less that per direct
//! call, both rates taken with every worker thread busy (16 callers, one worker per CPU), so that a
//! CPU-second is worth `workers / rate` per request. A ratio depends as much on how cheap the
//! operation under the stack is as on the stack; this figure does not.
//!
//! Run it with `cargo run --release -p ferry-tower --example tower_overhead`; with `-- --tcp`, both
//! engines use TCP only (by default, two engines of one host pick shared memory, where a 4 KiB write
//! costs a few times less, so the stack's share of it is larger).
//!
//! With `-- --budgets` it measures instead what a retry budget's deposit costs the stack: the stack
//! alone, and with one more deposit per request into tower's `TpsBudget` or into ferry-tower's
//! `RetryBudget` (taking turns as above). Prints
//! `{"case":"retry_budget_deposit_4KiB","stack_ops_per_s":..,"tps_budget_ratio":..,"retry_budget_ratio":..}`.
//!
//! With `-- --layers` it measures where the stack's cost goes: the pool alone (a bare
//! [`TransferService`]), then with `tower::retry` over it, then with the per-attempt deadline, then
//! the whole stack, each beside the engine in the same turns. Prints one JSON line per step:
//! `{"case":"tower_layers_4KiB","layers":..,"ratio":..,"added_cpu_us":..}`; the differences between
//! successive lines are what each layer adds.
//!
//! With `-- --floor` it measures the least that any `tower::Service` over the engine costs, whatever
//! its layers: a service that holds the engine and the link and hands back the engine's own named
//! future ([`ferry::Transfer`]), called the way the stack is (a clone of the service per request,
//! `oneshot`). What is left is the clone of the service per request (two reference counts) and the
//! `oneshot` around each call. Direct and floor take turns as above. Prints
//! `{"case":"tower_floor_4KiB","direct_ops_per_s":..,"floor_ops_per_s":..,"ratio":..}`.

use std::future::{Future, Ready, ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ferry::{Access, Durability, Engine, Op, Peer, Region, TransferDesc};
use ferry_tower::tower::retry::Policy;
use ferry_tower::tower::retry::budget::{Budget, TpsBudget};
use ferry_tower::tower::{Service, ServiceBuilder, ServiceExt};
use ferry_tower::{
    DeadlineLayer, Descriptor, RemoteAddr, RetryBudget, RetryPolicy, TransferRequest, TransferService, into_ferry_error,
};
use futures::future::Either;

const CALLERS: u64 = 16;
const SIZE: u64 = 4096;
/// Turns each case takes, and how long one runs.
const SLICES: usize = 25;
const SLICE: Duration = Duration::from_millis(200);
const TIMEOUT: Duration = Duration::from_secs(10);

async fn direct(engine: &Engine, peer: &Peer, src: &Arc<Region>, dst: u64) -> f64 {
    let deadline = Instant::now() + SLICE;
    let started = Instant::now();
    let callers: Vec<_> = (0..CALLERS)
        .map(|c| {
            let (engine, peer, src) = (engine.clone(), peer.clone(), src.clone());
            tokio::spawn(async move {
                let desc = [TransferDesc::new(src.addr_at(c * SIZE), dst + c * SIZE, SIZE)];
                let mut ops = 0u64;
                while Instant::now() < deadline {
                    engine
                        .transfer(&peer, Op::Write, &desc, TIMEOUT)
                        .await
                        .map(|()| ops += 1)?;
                }
                Ok::<_, ferry::Error>(ops)
            })
        })
        .collect();
    count(callers, started).await
}

async fn through_tower<S>(service: &S, target: std::net::SocketAddr, src: &Arc<Region>) -> f64
where
    S: Service<TransferRequest, Error = ferry::Error> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send,
{
    let deadline = Instant::now() + SLICE;
    let started = Instant::now();
    let callers: Vec<_> = (0..CALLERS)
        .map(|c| {
            let (service, src) = (service.clone(), src.clone());
            tokio::spawn(async move {
                let req =
                    TransferRequest::write(target, [Descriptor::at_offset(src.addr_at(c * SIZE), c * SIZE, SIZE)]);
                let mut ops = 0u64;
                while Instant::now() < deadline {
                    service.clone().oneshot(req.clone()).await.map(|_| ops += 1)?;
                }
                Ok::<_, ferry::Error>(ops)
            })
        })
        .collect();
    count(callers, started).await
}

async fn count(callers: Vec<tokio::task::JoinHandle<ferry::Result<u64>>>, started: Instant) -> f64 {
    let mut ops = 0;
    for c in callers {
        match c.await {
            Ok(Ok(n)) => ops += n,
            Ok(Err(e)) => panic!("a transfer failed: {e}"),
            Err(e) => panic!("a caller panicked: {e}"),
        }
    }
    ops as f64 / started.elapsed().as_secs_f64()
}

/// `RetryPolicy`, plus one more deposit per request into another budget.
#[derive(Clone)]
struct ExtraDeposit(RetryPolicy, Option<Arc<dyn Budget + Send + Sync>>);

impl<Res> Policy<TransferRequest, Res, ferry::Error> for ExtraDeposit {
    type Future = tokio::time::Sleep;

    fn retry(&mut self, req: &mut TransferRequest, result: &mut Result<Res, ferry::Error>) -> Option<Self::Future> {
        self.0.retry(req, result)
    }

    fn clone_request(&mut self, req: &TransferRequest) -> Option<TransferRequest> {
        if let Some(budget) = &self.1 {
            budget.deposit();
        }
        <RetryPolicy as Policy<TransferRequest, Res, ferry::Error>>::clone_request(&mut self.0, req)
    }
}

/// The `--budgets` measurement (see the module documentation).
async fn budgets(engine: &Engine, target: std::net::SocketAddr, src: &Arc<Region>) -> ferry::Result<()> {
    let stack = |extra: Option<Arc<dyn Budget + Send + Sync>>| {
        ServiceBuilder::new()
            .layer(DeadlineLayer::new(TIMEOUT))
            .retry(ExtraDeposit(RetryPolicy::default(), extra))
            .layer(DeadlineLayer::per_attempt(TIMEOUT))
            .service(TransferService::new(engine.clone()))
    };
    let alone = stack(None);
    let tps = stack(Some(Arc::new(TpsBudget::default())));
    let ours = stack(Some(Arc::new(RetryBudget::new(Duration::from_secs(10), 10, 0.2)?)));
    let rates = take_turns(&[
        &|| Box::pin(through_tower(&alone, target, src)),
        &|| Box::pin(through_tower(&tps, target, src)),
        &|| Box::pin(through_tower(&ours, target, src)),
    ])
    .await;
    println!(
        "{}",
        serde_json::json!({
            "case": "retry_budget_deposit_4KiB",
            "stack_ops_per_s": median(rates[0].clone()).round(),
            "tps_budget_ratio": ratio_per_turn(&rates[1], &rates[0]),
            "retry_budget_ratio": ratio_per_turn(&rates[2], &rates[0]),
        })
    );
    Ok(())
}

/// The `--floor` service: the engine's transfer on one link, with nothing around it (see the module
/// documentation).
#[derive(Clone)]
struct Floor {
    engine: Engine,
    peer: Peer,
    /// The target region's address, which `RemoteAddr::Offset` descriptors are relative to.
    base: u64,
}

impl Service<TransferRequest> for Floor {
    type Response = ();
    type Error = ferry::Error;
    type Future = Either<Ready<ferry::Result<()>>, ferry::Transfer>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<ferry::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: TransferRequest) -> Self::Future {
        let mut descs = request.descriptors().iter().map(|d| match d.remote {
            RemoteAddr::Offset(offset) => Ok(TransferDesc::new(d.local_addr, self.base + offset, d.len)),
            RemoteAddr::Absolute(addr) => Ok(TransferDesc::new(d.local_addr, addr, d.len)),
            RemoteAddr::Region { .. } => Err(ferry::Error::InvalidArgument(
                "the floor service takes no region keys".into(),
            )),
        });
        // The callers send one descriptor each.
        let desc = match (descs.next(), descs.next()) {
            (Some(desc), None) => desc,
            _ => Err(ferry::Error::InvalidArgument(
                "the floor service takes one descriptor".into(),
            )),
        };
        let transfer = desc.and_then(|desc| {
            self.engine
                .transfer_future(&self.peer, request.op(), &[desc], Durability::Completed, TIMEOUT)
        });
        match transfer {
            Ok(transfer) => Either::Right(transfer),
            Err(e) => Either::Left(ready(Err(e))),
        }
    }
}

/// The `--floor` measurement (see the module documentation).
async fn floor(engine: &Engine, target: std::net::SocketAddr, base: u64, src: &Arc<Region>) -> ferry::Result<()> {
    let peer = engine.connect(&target.to_string(), TIMEOUT).await?;
    let service = Floor {
        engine: engine.clone(),
        peer: peer.clone(),
        base,
    };
    let rates = take_turns(&[&|| Box::pin(direct(engine, &peer, src, base)), &|| {
        Box::pin(through_tower(&service, target, src))
    }])
    .await;
    println!(
        "{}",
        serde_json::json!({
            "case": "tower_floor_4KiB",
            "transport": peer.transport().to_string(),
            "direct_ops_per_s": median(rates[0].clone()).round(),
            "floor_ops_per_s": median(rates[1].clone()).round(),
            "ratio": ratio_per_turn(&rates[1], &rates[0]),
        })
    );
    Ok(())
}

/// The `--layers` measurement (see the module documentation).
async fn layers(engine: &Engine, peer: &Peer, target: std::net::SocketAddr, base: u64, src: &Arc<Region>) {
    let pool = TransferService::new(engine.clone());
    let retry = ServiceBuilder::new()
        .retry(RetryPolicy::default())
        .service(TransferService::new(engine.clone()));
    let attempt = ServiceBuilder::new()
        .retry(RetryPolicy::default())
        .layer(DeadlineLayer::per_attempt(TIMEOUT))
        .service(TransferService::new(engine.clone()));
    let stack = ServiceBuilder::new()
        .layer(DeadlineLayer::new(TIMEOUT))
        .retry(RetryPolicy::default())
        .layer(DeadlineLayer::per_attempt(TIMEOUT))
        .service(TransferService::new(engine.clone()));
    let rates = take_turns(&[
        &|| Box::pin(direct(engine, peer, src, base)),
        &|| Box::pin(through_tower(&pool, target, src)),
        &|| Box::pin(through_tower(&retry, target, src)),
        &|| Box::pin(through_tower(&attempt, target, src)),
        &|| Box::pin(through_tower(&stack, target, src)),
    ])
    .await;
    let direct_ops = median(rates[0].clone());
    let steps = [
        "pool",
        "pool+retry",
        "pool+retry+per_attempt",
        "pool+retry+per_attempt+deadline",
    ];
    for (layers, ops) in steps.iter().zip(&rates[1..]) {
        let ratio = ratio_per_turn(ops, &rates[0]);
        println!(
            "{}",
            serde_json::json!({
                "case": "tower_layers_4KiB",
                "transport": peer.transport().to_string(),
                "layers": layers,
                "ratio": ratio,
                "added_cpu_us": (added_cpu_us(ratio, direct_ops) * 1000.0).round() / 1000.0,
            })
        );
    }
}

/// The CPU time a request through a service with `ratio` of the engine's rate costs beyond a direct
/// call, from that ratio and the direct rate: both taken with every worker thread busy (16 callers,
/// one worker per CPU), so that a CPU-second is worth `workers / rate` per request.
fn added_cpu_us(ratio: f64, direct_ops: f64) -> f64 {
    let workers = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    workers * 1e6 * (1.0 / ratio - 1.0) / direct_ops
}

/// One case: a slice of callers, to its rate in operations a second.
type Case<'a> = &'a dyn Fn() -> Pin<Box<dyn Future<Output = f64> + 'a>>;

/// Runs every case once to warm it up, then [`SLICES`] turns of all of them, the order reversed
/// every other turn; returns each case's rates, turn by turn.
async fn take_turns(cases: &[Case<'_>]) -> Vec<Vec<f64>> {
    for case in cases {
        case().await;
    }
    let mut rates = vec![Vec::with_capacity(SLICES); cases.len()];
    for turn in 0..SLICES {
        let order: Vec<usize> = match turn % 2 {
            0 => (0..cases.len()).collect(),
            _ => (0..cases.len()).rev().collect(),
        };
        for i in order {
            rates[i].push(cases[i]().await);
        }
    }
    rates
}

/// The median over turns of `ops` over `base` in the same turn, to three decimals.
fn ratio_per_turn(ops: &[f64], base: &[f64]) -> f64 {
    let per_turn = ops.iter().zip(base).map(|(o, b)| o / b).collect();
    (median(per_turn) * 1000.0).round() / 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> ferry::Result<()> {
    let tcp = std::env::args().skip(1).any(|a| a == "--tcp");
    let budget_costs = std::env::args().skip(1).any(|a| a == "--budgets");
    let floor_only = std::env::args().skip(1).any(|a| a == "--floor");
    let by_layer = std::env::args().skip(1).any(|a| a == "--layers");
    let builder = || match tcp {
        true => Engine::builder().transports([ferry::TransportKind::Tcp]),
        false => Engine::builder(),
    };
    let target = builder().listen("127.0.0.1:0").build().await?;
    let region = target.alloc_host((CALLERS * SIZE) as usize, Access::READ_WRITE)?;
    let addr = target
        .local_addr()
        .ok_or_else(|| ferry::Error::InvalidArgument("the target does not listen".into()))?;

    let engine = builder().build().await?;
    let src = Arc::new(engine.alloc_host((CALLERS * SIZE) as usize, Access::READ_WRITE)?);
    if budget_costs {
        return budgets(&engine, addr, &src).await;
    }
    if floor_only {
        return floor(&engine, addr, region.addr(), &src).await;
    }
    // One link for both: the pool adopts the link the direct case made.
    let peer = engine.connect(&addr.to_string(), TIMEOUT).await?;
    if by_layer {
        layers(&engine, &peer, addr, region.addr(), &src).await;
        return Ok(());
    }
    // Every layer of this stack answers with ferry::Error: nothing to map back.
    let service = ServiceBuilder::new()
        .layer(DeadlineLayer::new(TIMEOUT))
        .retry(RetryPolicy::default())
        .layer(DeadlineLayer::per_attempt(TIMEOUT))
        .service(TransferService::new(engine.clone()));
    let timeouts = ServiceBuilder::new()
        .map_err(into_ferry_error)
        .timeout(TIMEOUT)
        .retry(RetryPolicy::default())
        .timeout(TIMEOUT)
        .service(TransferService::new(engine.clone()));

    let rates = take_turns(&[
        &|| Box::pin(direct(&engine, &peer, &src, region.addr())),
        &|| Box::pin(through_tower(&service, addr, &src)),
        &|| Box::pin(through_tower(&timeouts, addr, &src)),
    ])
    .await;
    for (turn, ((d, t), o)) in rates[0].iter().zip(&rates[1]).zip(&rates[2]).enumerate() {
        eprintln!("turn {turn}: direct {d:.0} ops/s, deadlines {t:.0} ops/s, timeouts {o:.0} ops/s");
    }
    let (direct_ops, tower_ops, timeouts_ops) = (
        median(rates[0].clone()),
        median(rates[1].clone()),
        median(rates[2].clone()),
    );
    let tower_ratio = ratio_per_turn(&rates[1], &rates[0]);
    // From the ratio rather than the two medians, which come from different turns.
    let added_cpu_us = added_cpu_us(tower_ratio, direct_ops);
    println!(
        "{}",
        serde_json::json!({
            "case": "tower_overhead_4KiB",
            "transport": peer.transport().to_string(),
            "direct_ops_per_s": direct_ops.round(),
            "tower_ops_per_s": tower_ops.round(),
            "ratio": tower_ratio,
            "added_cpu_us": (added_cpu_us * 1000.0).round() / 1000.0,
            "timeouts_ops_per_s": timeouts_ops.round(),
            "timeouts_ratio": ratio_per_turn(&rates[2], &rates[0]),
        })
    );
    Ok(())
}
