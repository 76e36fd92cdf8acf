//! What a retry budget's deposit costs the stack: the recommended stack (two `DeadlineLayer`s around
//! `retry(RetryPolicy)`), alone and with one more deposit per request into tower's `TpsBudget` or into
//! ferry-tower's `RetryBudget`, in rounds that alternate in one process (7 rounds of 1 s, 16 callers,
//! 4 KiB writes). The difference between the stacks is the deposit's cost under contention; it is why
//! `RetryPolicy` uses `RetryBudget`.
//!
//! Run it with `cargo run --release -p ferry-tower --example budget_ab` (shared memory between the two
//! engines of this host), or with `-- --tcp` (TCP only).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Access, Engine, Error};
use ferry_tower::tower::retry::Policy;
use ferry_tower::tower::retry::budget::{Budget, TpsBudget};
use ferry_tower::tower::{Service, ServiceBuilder, ServiceExt};
use ferry_tower::{DeadlineLayer, Descriptor, RetryBudget, RetryPolicy, TransferRequest, TransferService};

const CALLERS: u64 = 16;
const SIZE: u64 = 4096;
const ROUND: Duration = Duration::from_secs(1);
const TIMEOUT: Duration = Duration::from_secs(10);

/// `RetryPolicy`, plus one more deposit per request into the given budget.
#[derive(Clone)]
struct Extra(RetryPolicy, Option<Arc<dyn Budget + Send + Sync>>);

impl<Res> Policy<TransferRequest, Res, Error> for Extra {
    type Future = tokio::time::Sleep;
    fn retry(&mut self, req: &mut TransferRequest, result: &mut Result<Res, Error>) -> Option<Self::Future> {
        self.0.retry(req, result)
    }
    fn clone_request(&mut self, req: &TransferRequest) -> Option<TransferRequest> {
        if let Some(b) = &self.1 {
            b.deposit();
        }
        <RetryPolicy as Policy<TransferRequest, Res, Error>>::clone_request(&mut self.0, req)
    }
}

async fn run<S>(service: &S, target: std::net::SocketAddr, src: &Arc<ferry::Region>) -> f64
where
    S: Service<TransferRequest, Error = ferry::Error> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send,
{
    let deadline = Instant::now() + ROUND;
    let started = Instant::now();
    let callers: Vec<_> = (0..CALLERS)
        .map(|c| {
            let (service, src) = (service.clone(), src.clone());
            tokio::spawn(async move {
                let req =
                    TransferRequest::write(target, [Descriptor::at_offset(src.addr_at(c * SIZE), c * SIZE, SIZE)]);
                let mut ops = 0u64;
                while Instant::now() < deadline {
                    service.clone().oneshot(req.clone()).await.map(|_| ops += 1).unwrap();
                }
                ops
            })
        })
        .collect();
    let mut ops = 0;
    for c in callers {
        ops += c.await.unwrap();
    }
    ops as f64 / started.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> ferry::Result<()> {
    let tcp = std::env::args().any(|a| a == "--tcp");
    let builder = || match tcp {
        true => Engine::builder().transports([ferry::TransportKind::Tcp]),
        false => Engine::builder(),
    };
    let target = builder().listen("127.0.0.1:0").build().await?;
    let _region = target.alloc_host((CALLERS * SIZE) as usize, Access::READ_WRITE)?;
    let addr = target.local_addr().unwrap();
    let engine = builder().build().await?;
    let src = Arc::new(engine.alloc_host((CALLERS * SIZE) as usize, Access::READ_WRITE)?);
    let stack = |extra: Option<Arc<dyn Budget + Send + Sync>>| {
        ServiceBuilder::new()
            .layer(DeadlineLayer::new(TIMEOUT))
            .retry(Extra(RetryPolicy::default(), extra))
            .layer(DeadlineLayer::new(TIMEOUT))
            .service(TransferService::new(engine.clone()))
    };
    let a = stack(None);
    let b = stack(Some(Arc::new(TpsBudget::default())));
    let c = stack(Some(Arc::new(RetryBudget::new(Duration::from_secs(10), 10, 0.2)?)));
    run(&a, addr, &src).await;
    let (mut ra, mut rb, mut rc) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..7 {
        ra.push(run(&a, addr, &src).await);
        rb.push(run(&b, addr, &src).await);
        rc.push(run(&c, addr, &src).await);
    }
    let (ma, mb, mc) = (median(ra), median(rb), median(rc));
    println!(
        "stack {ma:.0} ops/s; + a TpsBudget deposit {mb:.0} ({:.3}); + a RetryBudget deposit {mc:.0} ({:.3})",
        mb / ma,
        mc / ma
    );
    Ok(())
}
