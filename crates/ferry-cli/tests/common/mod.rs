//! `ferry serve` as a child process, for the tests that need a target they can kill.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

/// A running `ferry serve`; killed and reaped on drop.
pub struct Serve {
    pub child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    /// The address of its one region (0 where each peer has its own: ask the peer's adverts).
    pub region: u64,
    /// Where it serves its metrics (`--metrics`).
    pub metrics: Option<SocketAddr>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ferry serve --listen LISTEN --region-size SIZE`, with the binary cargo built for these tests
/// (or `FERRY_BIN`, where the tests run without their build tree: `cargo xtask gpu-kit`).
pub fn serve_command(listen: &str, region_size: &str) -> Command {
    let bin = std::env::var_os("FERRY_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_ferry").into());
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--listen", listen, "--region-size", region_size]);
    cmd
}

/// Starts `cmd` (a `ferry serve`, possibly behind `ip netns exec`) and reads the line it prints once it
/// listens, "listening on ADDR region 0xREGION SIZE"; `None` if it exits first (its port was taken).
pub fn start(mut cmd: Command) -> Option<Serve> {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ferry serve");
    // The guard kills and reaps the child on every early return.
    let mut serve = Serve {
        child,
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        region: 0,
        metrics: None,
    };
    let mut line = String::new();
    BufReader::new(serve.child.stdout.take()?).read_line(&mut line).ok()?;
    let words: Vec<&str> = line.split_whitespace().collect();
    if words.get(..2) != Some(&["listening", "on"][..]) || words.get(3) != Some(&"region") {
        return None;
    }
    serve.addr = words.get(2)?.parse().ok()?;
    // "per-peer" on a server that authenticates: each peer learns its own address when it connects.
    serve.region = match *words.get(4)? {
        "per-peer" => 0,
        hex => u64::from_str_radix(hex.trim_start_matches("0x"), 16).ok()?,
    };
    // "... metrics http://ADDR/metrics" with --metrics.
    serve.metrics = words
        .iter()
        .position(|w| *w == "metrics")
        .and_then(|i| words.get(i + 1))
        .and_then(|url| url.strip_prefix("http://")?.strip_suffix("/metrics")?.parse().ok());
    Some(serve)
}

/// A stream of 4 KiB writes through a tower stack, as the fault tests drive one.
pub mod stream {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use ferry::{Access, Engine, Error, Region};
    use ferry_tower::tower::{Service, ServiceBuilder, ServiceExt};
    use ferry_tower::{Descriptor, RetryPolicy, TransferRequest, TransferService, into_ferry_error};

    /// Bytes per write (and per remote block).
    pub const BLOCK: u64 = 4096;
    /// The target's region: one block per request, never reused.
    pub const REGION: u64 = 64 << 20;

    /// The bytes of block `i`.
    pub fn pattern(i: u64) -> Vec<u8> {
        (0..BLOCK)
            .map(|b| (i.wrapping_mul(2654435761).wrapping_add(b * 31) >> 3) as u8 ^ (b >> 8) as u8)
            .collect()
    }

    /// The resilient stack under test: an overall deadline, retries by `policy`, a per-attempt
    /// timeout, errors as `ferry::Error`.
    pub fn stack(
        transfers: TransferService,
        policy: RetryPolicy,
        overall: Duration,
        attempt: Duration,
    ) -> impl Service<TransferRequest, Error = Error, Future: Send, Response: Send> + Clone + Send + 'static {
        ServiceBuilder::new()
            .map_err(into_ferry_error)
            .timeout(overall)
            .retry(policy)
            .timeout(attempt)
            .service(transfers)
    }

    /// One request's fate.
    pub struct Outcome {
        /// Its block.
        pub index: u64,
        pub started: Instant,
        pub finished: Instant,
        pub result: Result<(), Error>,
    }

    /// `callers` tasks writing block after block (each to its own offset of the target's region) until
    /// stopped or the region is used up.
    pub struct WriteStream {
        pub outcomes: Arc<Mutex<Vec<Outcome>>>,
        stop: Arc<AtomicBool>,
        workers: Vec<tokio::task::JoinHandle<()>>,
        hang: Duration,
    }

    impl WriteStream {
        /// Starts writing from `src` (one local block per request, so that no attempt reads bytes meant
        /// for another) to `target`; a request that takes longer than `hang` fails the test.
        pub fn start<S>(service: S, src: Arc<Region>, target: SocketAddr, callers: usize, hang: Duration) -> Self
        where
            S: Service<TransferRequest, Error = Error> + Clone + Send + 'static,
            S::Future: Send,
            S::Response: Send,
        {
            let next = Arc::new(AtomicU64::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let outcomes = Arc::new(Mutex::new(Vec::<Outcome>::new()));
            let workers = (0..callers)
                .map(|_| {
                    let (service, src, next, stop, outcomes) = (
                        service.clone(),
                        src.clone(),
                        next.clone(),
                        stop.clone(),
                        outcomes.clone(),
                    );
                    tokio::spawn(async move {
                        while !stop.load(Ordering::SeqCst) {
                            let index = next.fetch_add(1, Ordering::SeqCst);
                            if index >= REGION / BLOCK {
                                break;
                            }
                            let offset = index * BLOCK;
                            src.write_at(offset, &pattern(index)).unwrap();
                            let req = TransferRequest::write(
                                target,
                                [Descriptor::at_offset(src.addr_at(offset), offset, BLOCK)],
                            );
                            let started = Instant::now();
                            let result = tokio::time::timeout(hang, service.clone().oneshot(req))
                                .await
                                .unwrap_or_else(|_| panic!("request {index} hung past {hang:?}"))
                                .map(|_| ());
                            outcomes.lock().unwrap().push(Outcome {
                                index,
                                started,
                                finished: Instant::now(),
                                result,
                            });
                        }
                    })
                })
                .collect();
            WriteStream {
                outcomes,
                stop,
                workers,
                hang,
            }
        }

        /// Writes acknowledged so far.
        pub fn acknowledged(&self) -> usize {
            self.outcomes
                .lock()
                .unwrap()
                .iter()
                .filter(|o| o.result.is_ok())
                .count()
        }

        /// Waits (at most a minute) until the outcomes so far satisfy `cond`.
        pub async fn wait_for(&self, what: &str, cond: impl Fn(&[Outcome]) -> bool) {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !cond(&self.outcomes.lock().unwrap()) {
                assert!(Instant::now() < deadline, "never happened: {what}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }

        /// Stops the callers and returns every outcome.
        pub async fn stop(self) -> Vec<Outcome> {
            self.stop.store(true, Ordering::SeqCst);
            for w in self.workers {
                tokio::time::timeout(self.hang, w)
                    .await
                    .expect("a caller hung")
                    .unwrap();
            }
            std::mem::take(&mut *self.outcomes.lock().unwrap())
        }
    }

    /// Reads blocks `acked` back from `target` through `service` and checks each holds its pattern.
    pub async fn read_back<S>(service: &S, engine: &Engine, target: SocketAddr, acked: &[u64], hang: Duration)
    where
        S: Service<TransferRequest, Error = Error> + Clone,
    {
        let back = engine.alloc_host(64 * BLOCK as usize, Access::READ_WRITE).unwrap();
        for chunk in acked.chunks(64) {
            let descs: Vec<_> = chunk
                .iter()
                .enumerate()
                .map(|(pos, &i)| Descriptor::at_offset(back.addr_at(pos as u64 * BLOCK), i * BLOCK, BLOCK))
                .collect();
            tokio::time::timeout(hang, service.clone().oneshot(TransferRequest::read(target, descs)))
                .await
                .expect("read-back hung")
                .expect("read-back");
            let mut got = vec![0u8; BLOCK as usize];
            for (pos, &i) in chunk.iter().enumerate() {
                back.read_at(pos as u64 * BLOCK, &mut got).unwrap();
                assert!(got == pattern(i), "acknowledged write {i} is not at the target");
            }
        }
    }
}
