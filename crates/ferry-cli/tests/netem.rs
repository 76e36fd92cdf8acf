//! ferry-tower's middleware over a faulty network: two network namespaces joined by a veth pair that
//! the test makes itself (10.77.0.1/24 in `nsA`, 10.77.0.2/24 in `nsB`; the addresses exist only in
//! those namespaces), a `ferry serve` in `nsB`, and the initiator on a thread that entered `nsA`.
//!
//! - `tc netem loss 5%` and `tc netem delay 50ms` on `vethA`: every transfer completes with the right
//!   bytes, or fails with `Timeout` once the retry budget is spent;
//! - a partition (`vethA` down for 2 s): requests fail with transient errors or succeed through
//!   retries, and once the service reaches the target again every request succeeds.
//!
//! In all cases every acknowledged write is read back intact. The namespaces are deleted when a test
//! ends, failed or not. Root, `ip` and `tc` (Debian: iproute2) and the kernel's netem qdisc are
//! needed: without them the tests print "skipped: …" and pass, unless `FERRY_REQUIRE_ALL=1` (as in CI),
//! where a missing prerequisite fails the test with the command that installs it.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry::{Access, Engine, Error};
use ferry_tower::{PoolConfig, RetryConfig, RetryPolicy, TransferService, is_transient_ferry};

mod common;
use common::Serve;
use common::stream::{REGION, WriteStream, read_back, stack};

const HANG: Duration = Duration::from_secs(60);

/// Namespace setup is serialised: the first `ip netns add` on a machine also mounts /run/netns.
static SETUP: Mutex<()> = Mutex::new(());

fn run(cmd: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .output()
        .map_err(|e| format!("`{}`: {e}", cmd.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{}` failed: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Whether the test may run; prints why not (or fails, under `FERRY_REQUIRE_ALL=1`). `needs` completes
/// "needs root and iproute2".
fn prerequisite(check: Result<(), String>, needs: &str, install: &str) -> bool {
    match check {
        Ok(()) => true,
        Err(why) if std::env::var("FERRY_REQUIRE_ALL").is_ok_and(|v| v == "1") => {
            panic!("netem test prerequisite missing: {why}; install with: {install}")
        }
        Err(why) => {
            println!("skipped: needs root and iproute2{needs} ({why}; {install})");
            false
        }
    }
}

fn tools() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not running as root".into());
    }
    run(&["ip", "-V"])?;
    run(&["tc", "-V"])
}

/// Two namespaces and the veth pair between them; deleted on drop.
struct Netns {
    a: String,
    b: String,
}

impl Netns {
    fn create(tag: &str) -> Result<Netns, String> {
        let _serial = SETUP.lock().unwrap_or_else(|p| p.into_inner());
        let pid = std::process::id();
        let ns = Netns {
            a: format!("ferry-{pid}-{tag}-a"),
            b: format!("ferry-{pid}-{tag}-b"),
        };
        // Leftovers of an earlier run with this pid, if any.
        let _ = run(&["ip", "netns", "del", &ns.a]);
        let _ = run(&["ip", "netns", "del", &ns.b]);
        run(&["ip", "netns", "add", &ns.a])?;
        run(&["ip", "netns", "add", &ns.b])?;
        let (a, b) = (ns.a.as_str(), ns.b.as_str());
        run(&[
            "ip", "link", "add", "vethA", "netns", a, "type", "veth", "peer", "name", "vethB", "netns", b,
        ])?;
        run(&["ip", "-n", a, "addr", "add", "10.77.0.1/24", "dev", "vethA"])?;
        run(&["ip", "-n", b, "addr", "add", "10.77.0.2/24", "dev", "vethB"])?;
        for (n, dev) in [(a, "vethA"), (b, "vethB"), (a, "lo"), (b, "lo")] {
            run(&["ip", "-n", n, "link", "set", dev, "up"])?;
        }
        Ok(ns)
    }

    fn tc(&self, args: &[&str]) -> Result<(), String> {
        let mut cmd = vec!["ip", "netns", "exec", &self.a, "tc"];
        cmd.extend_from_slice(args);
        run(&cmd)
    }

    fn link(&self, state: &str) {
        run(&["ip", "-n", &self.a, "link", "set", "vethA", state]).unwrap();
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in [&self.a, &self.b] {
            if let Err(e) = run(&["ip", "netns", "del", n]) {
                eprintln!("cleanup: {e}");
            }
        }
    }
}

fn serve_in(ns: &Netns) -> Serve {
    // `ip netns exec` execs the command, so the child is `ferry serve` itself.
    let mut cmd = Command::new("ip");
    let serve = common::serve_command("10.77.0.2:0", "64MiB");
    cmd.args(["netns", "exec", &ns.b])
        .arg(serve.get_program())
        .args(serve.get_args());
    common::start(cmd).expect("ferry serve listens in nsB")
}

/// Runs `f` on a thread inside namespace `ns`, on a current-thread runtime of its own, so that every
/// socket it opens lives there.
fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>> + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // SAFETY: `file` is an open namespace file for the duration of the call; setns changes the
        // network namespace of this thread only.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(f())
    })
}

/// What the initiator in nsA does, with the fault applied from outside.
struct Stream {
    /// Writes acknowledged so far.
    ok: Arc<AtomicUsize>,
    /// Set by the test when the fault is over.
    healed: Arc<Mutex<Option<Instant>>>,
    /// Acknowledged writes after `healed` at which the stream stops.
    after_heal: usize,
    /// The per-attempt timeout.
    attempt: Duration,
}

/// Writes 4 KiB blocks (each to its own offset) from 8 callers through the full stack until
/// `after_heal` writes were acknowledged after the fault ended, then checks the outcomes and reads
/// every acknowledged write back. Returns a summary line.
async fn stream(target: SocketAddr, s: Stream, partition: bool) -> String {
    let engine = Engine::builder().build().await.unwrap();
    let src = Arc::new(engine.alloc_host(REGION as usize, Access::READ_WRITE).unwrap());
    let transfers = TransferService::with_config(
        engine.clone(),
        PoolConfig {
            connect_timeout: Duration::from_secs(1),
            reconnect_backoff_max: Duration::from_millis(500),
            ..PoolConfig::default()
        },
    )
    .unwrap();
    let stats = transfers.clone();
    let policy = RetryPolicy::new(RetryConfig {
        max_retries: 10,
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(500),
        ..RetryConfig::default()
    })
    .unwrap();
    let service = stack(transfers, policy, Duration::from_secs(20), s.attempt);
    let writes = WriteStream::start(service.clone(), src, target, 8, HANG);

    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        s.ok.store(writes.acknowledged(), Ordering::SeqCst);
        let healed = *s.healed.lock().unwrap();
        if let Some(at) = healed {
            let acked_after = writes
                .outcomes
                .lock()
                .unwrap()
                .iter()
                .filter(|o| o.result.is_ok() && o.started > at)
                .count();
            if acked_after >= s.after_heal {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the stream never completed {} writes after the fault",
            s.after_heal
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let outcomes = writes.stop().await;
    let healed = s.healed.lock().unwrap().unwrap_or_else(Instant::now);
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for o in &outcomes {
        if let Err(e) = &o.result {
            *kinds.entry(format!("{:?}", e.code())).or_default() += 1;
            if partition {
                assert!(is_transient_ferry(e), "request {}: {e:?}", o.index);
            } else {
                assert!(matches!(e, Error::Timeout(_)), "request {}: {e:?}", o.index);
            }
        }
    }
    if partition {
        // Once the service reached the target again, every request succeeded.
        let back = outcomes
            .iter()
            .filter(|o| o.result.is_ok() && o.started > healed)
            .map(|o| o.started)
            .min()
            .expect("writes after the partition");
        for o in outcomes.iter().filter(|o| o.started > back) {
            assert!(
                o.result.is_ok(),
                "request {} failed after the partition: {:?}",
                o.index,
                o.result
            );
        }
    }

    // Every acknowledged write is at the target.
    let acked: Vec<u64> = outcomes.iter().filter(|o| o.result.is_ok()).map(|o| o.index).collect();
    read_back(&service, &engine, target, &acked, HANG).await;
    format!(
        "{} requests, {} acknowledged and read back intact, errors {kinds:?}; pool {:?}",
        outcomes.len(),
        acked.len(),
        stats.stats()
    )
}

/// Sets up the namespaces and the target, runs the stream in nsA and `fault` from here.
fn scenario(tag: &str, fault: impl FnOnce(&Netns, &AtomicUsize), partition: bool) {
    if !prerequisite(tools(), "", "apt-get install -y iproute2 (and run as root)") {
        return;
    }
    let ns = match Netns::create(tag) {
        Ok(ns) => ns,
        Err(why) => {
            prerequisite(Err(why), "", "run as root with CAP_SYS_ADMIN and CAP_NET_ADMIN");
            return;
        }
    };
    if !partition {
        // Is the netem qdisc there? (A kernel module, not part of iproute2.)
        let probe = ns.tc(&["qdisc", "add", "dev", "vethA", "root", "netem", "delay", "0ms"]);
        let probe = probe.and_then(|()| ns.tc(&["qdisc", "del", "dev", "vethA", "root"]));
        let needs = ", and the kernel's netem qdisc";
        if !prerequisite(probe, needs, "modprobe sch_netem (a kernel with CONFIG_NET_SCH_NETEM)") {
            return;
        }
    }
    let serve = serve_in(&ns);
    let ok = Arc::new(AtomicUsize::new(0));
    let healed = Arc::new(Mutex::new(None));
    let s = Stream {
        ok: ok.clone(),
        healed: healed.clone(),
        after_heal: 100,
        // Under loss and delay an attempt has time for TCP to retransmit. Across the partition it
        // must not: a hung attempt is cut short, the link replaced and the request retried.
        attempt: if partition {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(3)
        },
    };
    let target = serve.addr;
    let initiator = in_netns(&ns.a, move || Box::pin(stream(target, s, partition)));

    fault(&ns, &ok);
    *healed.lock().unwrap() = Some(Instant::now());
    let summary = match initiator.join() {
        Ok(summary) => summary,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    println!("{tag}: {summary}");
    drop(serve);
    drop(ns);
}

/// Waits (bounded) until `n` writes were acknowledged.
fn wait_for_acks(ok: &AtomicUsize, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while ok.load(Ordering::SeqCst) < n {
        assert!(
            Instant::now() < deadline,
            "only {} writes acknowledged",
            ok.load(Ordering::SeqCst)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn netem_loss() {
    scenario(
        "loss",
        |ns, ok| {
            ns.tc(&["qdisc", "add", "dev", "vethA", "root", "netem", "loss", "5%"])
                .unwrap();
            let before = ok.load(Ordering::SeqCst);
            wait_for_acks(ok, before + 300);
            ns.tc(&["qdisc", "del", "dev", "vethA", "root"]).unwrap();
        },
        false,
    );
}

#[test]
fn netem_delay() {
    scenario(
        "delay",
        |ns, ok| {
            ns.tc(&["qdisc", "add", "dev", "vethA", "root", "netem", "delay", "50ms"])
                .unwrap();
            let before = ok.load(Ordering::SeqCst);
            wait_for_acks(ok, before + 200);
            ns.tc(&["qdisc", "del", "dev", "vethA", "root"]).unwrap();
        },
        false,
    );
}

#[test]
fn netem_partition() {
    scenario(
        "part",
        |ns, ok| {
            wait_for_acks(ok, 100);
            ns.link("down");
            std::thread::sleep(Duration::from_secs(2));
            ns.link("up");
        },
        true,
    );
}
