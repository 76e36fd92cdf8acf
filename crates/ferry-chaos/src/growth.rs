//! `ferry-chaos growth`: what one engine costs as the cluster around it grows, each curve measured
//! from a target engine in a child process of its own (so that its RSS, file descriptors, CPU time
//! and bytes written are its alone), with the initiators in this process, over TCP on loopback:
//!
//! - **links**: the target's links from 1 to its limit: the connect time of each new link, and the
//!   target's RSS and file descriptors per link;
//! - **adverts**: regions × peers: the target registers R regions with P peers connected (every
//!   registration is advertised to every peer), then one more; the time until every peer sees them,
//!   the bytes the target wrote and its CPU time; and a new peer connecting to a target with R regions;
//! - **directory**: 1,000 records in a real etcd: a lookup, a listing (what `ferry ls` does), and a
//!   watch's fan-out when every record leaves and comes back (a mass restart);
//! - **fan-in**: notifications from 1 and from 64 senders to one receiver.
//!
//! Each curve prints a table; `--json` prints one JSON object per measured point instead.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry::{Access, Directory, Engine, Notification, TransportKind};
use futures::StreamExt;

const T: Duration = Duration::from_secs(60);

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Which curves: links, adverts, directory, fanin (comma-separated) [default: all].
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// The most links (the target's `max_links`).
    #[arg(long, default_value_t = 512)]
    pub max_links: usize,
    /// Print JSON lines instead of tables.
    #[arg(long)]
    pub json: bool,
    /// (internal) run as the measured target: commands on stdin, answers on stdout.
    #[arg(long, hide = true)]
    pub target: bool,
}

pub async fn run(args: Args) -> Result<()> {
    if args.target {
        return target(args.max_links).await;
    }
    let wants = |curve: &str| args.only.is_empty() || args.only.iter().any(|o| o == curve);
    let out = Out { json: args.json };
    if wants("links") {
        links(&out, args.max_links).await?;
    }
    if wants("adverts") {
        adverts(&out).await?;
    }
    if wants("directory") {
        directory(&out).await?;
    }
    if wants("fanin") {
        fan_in(&out).await?;
    }
    Ok(())
}

struct Out {
    json: bool,
}

impl Out {
    fn header(&self, title: &str, columns: &str) {
        if !self.json {
            println!("\n{title}\n{columns}");
        }
    }
    fn row(&self, curve: &str, point: serde_json::Value, line: String) {
        if self.json {
            let mut point = point;
            point["curve"] = curve.into();
            println!("{point}");
        } else {
            println!("{line}");
        }
    }
}

/// The measured target in its own process: `register N` registers N regions of 4 KiB and answers
/// `ok`; `stat` answers `rss_kib fds cpu_ms`; the first line it prints is its address.
async fn target(max_links: usize) -> Result<()> {
    let engine = Engine::builder()
        .transports([TransportKind::Tcp])
        .listen("127.0.0.1:0")
        .max_links(max_links)
        .build()
        .await?;
    println!("{}", engine.local_addr().context("no listen address")?);
    let mut regions = Vec::new();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(tokio::io::stdin()));
    while let Some(line) = lines.next_line().await? {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["register", n] => {
                let started = Instant::now();
                for _ in 0..n.parse::<usize>()? {
                    regions.push(engine.alloc_host(4096, Access::READ_WRITE)?);
                }
                println!("ok {} {}", regions.len(), started.elapsed().as_micros());
            }
            ["stat"] => {
                let s = self_stat()?;
                println!("{} {} {}", s.rss_kib, s.fds, s.cpu_ms);
            }
            _ => bail!("unknown command {line:?}"),
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, Default)]
struct Stat {
    rss_kib: u64,
    fds: u64,
    cpu_ms: u64,
}

/// Bytes sent over loopback so far, by every process (both directions of every link, headers
/// included): what a phase put on the wire, where only it runs.
fn loopback_bytes() -> u64 {
    std::fs::read_to_string("/sys/class/net/lo/statistics/tx_bytes")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn self_stat() -> Result<Stat> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir("/proc/self/fd")?.count() as u64;
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    // From the state (field 3) on: utime and stime are fields 14 and 15.
    let field = |n: usize| {
        after
            .split_whitespace()
            .nth(n - 3)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let cpu_ms = (field(14) + field(15)) * 1000 / ticks;
    Ok(Stat { rss_kib, fds, cpu_ms })
}

/// The target as a child process.
struct Target {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    addr: String,
}

impl Target {
    fn start(max_links: usize) -> Result<Target> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["growth", "--target", "--max-links", &max_links.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the target")?;
        let stdin = child.stdin.take().context("no stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        let mut addr = String::new();
        stdout.read_line(&mut addr)?;
        Ok(Target {
            child,
            stdin,
            stdout,
            addr: addr.trim().to_string(),
        })
    }

    fn ask(&mut self, command: &str) -> Result<String> {
        writeln!(self.stdin, "{command}")?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        anyhow::ensure!(!line.is_empty(), "the target exited");
        Ok(line.trim().to_string())
    }

    fn stat(&mut self) -> Result<Stat> {
        let answer = self.ask("stat")?;
        let v: Vec<u64> = answer.split_whitespace().filter_map(|w| w.parse().ok()).collect();
        anyhow::ensure!(v.len() == 3, "the target said {answer:?}");
        Ok(Stat {
            rss_kib: v[0],
            fds: v[1],
            cpu_ms: v[2],
        })
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn initiator() -> Result<Engine> {
    Ok(Engine::builder().transports([TransportKind::Tcp]).build().await?)
}

async fn links(out: &Out, max_links: usize) -> Result<()> {
    let mut target = Target::start(max_links)?;
    out.header(
        &format!("links: one target, 1 to {max_links} links from as many initiator engines"),
        "links   connect p50 ms   connect max ms   target RSS MiB   KiB/link   target fds   fds/link",
    );
    let base = target.stat()?;
    let mut peers = Vec::new();
    let mut engines = Vec::new();
    let mut next = 1;
    while peers.len() < max_links {
        let mut times = Vec::new();
        while peers.len() < next.min(max_links) {
            let engine = initiator().await?;
            let started = Instant::now();
            peers.push(engine.connect(&target.addr, T).await?);
            times.push(started.elapsed().as_secs_f64() * 1e3);
            engines.push(engine);
        }
        times.sort_by(f64::total_cmp);
        let s = target.stat()?;
        let n = peers.len() as f64;
        let per_link_kib = (s.rss_kib as f64 - base.rss_kib as f64) / n;
        let fds_per_link = (s.fds as f64 - base.fds as f64) / n;
        out.row(
            "links",
            serde_json::json!({"links": peers.len(), "connect_p50_ms": times[times.len() / 2], "connect_max_ms": times[times.len() - 1],
                "rss_kib": s.rss_kib, "kib_per_link": per_link_kib, "fds": s.fds, "fds_per_link": fds_per_link}),
            format!(
                "{:>5}   {:>14.2}   {:>14.2}   {:>14.1}   {:>8.1}   {:>10}   {:>8.2}",
                peers.len(),
                times[times.len() / 2],
                times[times.len() - 1],
                s.rss_kib as f64 / 1024.0,
                per_link_kib,
                s.fds,
                fds_per_link
            ),
        );
        next *= 4;
    }
    // One past the limit is refused.
    let extra = initiator().await?;
    let refused = extra.connect(&target.addr, Duration::from_secs(5)).await.is_err();
    if !out.json {
        println!(
            "link {} (past the limit): {}",
            max_links + 1,
            if refused { "refused" } else { "ACCEPTED" }
        );
    }
    Ok(())
}

/// Waits until every peer sees `n` regions of the target; the time it took.
async fn all_see(peers: &[ferry::Peer], n: usize) -> Result<Duration> {
    let started = Instant::now();
    for p in peers {
        let seen = || p.with_regions(|r| r.len()).unwrap_or(0);
        while seen() < n {
            anyhow::ensure!(
                started.elapsed() < T,
                "a peer saw {} of {n} regions after {T:?}",
                seen()
            );
            p.regions_changed(Duration::from_millis(1)).await;
        }
    }
    Ok(started.elapsed())
}

async fn adverts(out: &Out) -> Result<()> {
    out.header(
        "adverts: the target registers R regions with P peers connected, then one more, then a new peer connects",
        "regions  peers   all see R ms   on the wire MiB   target CPU ms   | one more: ms   wire KiB   CPU ms | new peer: ms   wire KiB",
    );
    for regions in [100usize, 1_000, 10_000] {
        for peer_count in [1usize, 8, 64] {
            let mut target = Target::start(512)?;
            let mut engines = Vec::new();
            let mut peers = Vec::new();
            for _ in 0..peer_count {
                let e = initiator().await?;
                peers.push(e.connect(&target.addr, T).await?);
                engines.push(e);
            }
            let before = target.stat()?;
            let wire = loopback_bytes();
            let started = Instant::now();
            target.ask(&format!("register {regions}"))?;
            let _ = all_see(&peers, regions).await?;
            let all = started.elapsed();
            let after = target.stat()?;
            let wire_all = loopback_bytes() - wire;
            let wire = loopback_bytes();
            let started = Instant::now();
            target.ask("register 1")?;
            let one = all_see(&peers, regions + 1).await?.max(started.elapsed());
            let after_one = target.stat()?;
            let wire_one = loopback_bytes() - wire;
            let wire = loopback_bytes();
            let newcomer = initiator().await?;
            let started = Instant::now();
            let new_peer = newcomer.connect(&target.addr, T).await?;
            let joined = all_see(std::slice::from_ref(&new_peer), regions + 1)
                .await?
                .max(started.elapsed());
            let after_join = target.stat()?;
            let wire_join = loopback_bytes() - wire;
            out.row(
                "adverts",
                serde_json::json!({"regions": regions, "peers": peer_count, "all_see_ms": all.as_secs_f64() * 1e3,
                    "wire_bytes": wire_all, "cpu_ms": after.cpu_ms - before.cpu_ms,
                    "one_more_ms": one.as_secs_f64() * 1e3, "one_more_wire_bytes": wire_one,
                    "one_more_cpu_ms": after_one.cpu_ms - after.cpu_ms, "new_peer_ms": joined.as_secs_f64() * 1e3,
                    "new_peer_wire_bytes": wire_join, "new_peer_cpu_ms": after_join.cpu_ms - after_one.cpu_ms}),
                format!(
                    "{regions:>7}  {peer_count:>5}   {:>12.1}   {:>16.2}   {:>13}   | {:>13.2}   {:>9.1}   {:>6} | {:>12.1}   {:>9.1}",
                    all.as_secs_f64() * 1e3,
                    wire_all as f64 / (1 << 20) as f64,
                    after.cpu_ms - before.cpu_ms,
                    one.as_secs_f64() * 1e3,
                    wire_one as f64 / 1024.0,
                    after_one.cpu_ms - after.cpu_ms,
                    joined.as_secs_f64() * 1e3,
                    wire_join as f64 / 1024.0,
                ),
            );
        }
    }
    Ok(())
}

/// etcd on loopback, on a data folder of its own; killed on drop.
struct LocalEtcd {
    child: Child,
    url: String,
    dir: std::path::PathBuf,
}

impl LocalEtcd {
    async fn start() -> Result<LocalEtcd> {
        let free = || -> Result<u16> { Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()) };
        let (client, peer) = (free()?, free()?);
        let dir = std::env::temp_dir().join(format!("ferry-growth-etcd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let child = Command::new("etcd")
            .arg("--data-dir")
            .arg(&dir)
            .args(["--listen-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--advertise-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting etcd (Debian: apt-get install etcd-server)")?;
        let etcd = LocalEtcd {
            child,
            url: format!("etcd://127.0.0.1:{client}"),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(d) = ferry_etcd::EtcdDirectory::connect(&etcd.url, "/growth", Default::default()).await
                && d.list().await.is_ok()
            {
                return Ok(etcd);
            }
            anyhow::ensure!(Instant::now() < deadline, "etcd did not answer within 30 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Record `i`: an engine's own record (its protocol version, its transports), named and placed apart.
fn record(template: &ferry::EngineRecord, i: usize) -> ferry::EngineRecord {
    ferry::EngineRecord {
        name: format!("engine-{i}"),
        addrs: vec![format!("10.1.{}.{}:7000", i / 250, i % 250 + 1)],
        host_id: format!("{i:016x}"),
        engine_id: format!("{:016x}", i + 1),
        ..template.clone()
    }
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn percentile(mut xs: Vec<f64>, p: f64) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[((xs.len() - 1) as f64 * p).round() as usize]
}

async fn directory(out: &Out) -> Result<()> {
    let etcd = LocalEtcd::start().await?;
    out.header(
        "directory: records in a real etcd on loopback (one client and lease per record)",
        "records   publish all s   lookup p50 ms   lookup p99 ms   list (ferry ls) ms   watchers   mass restart: all watchers saw every event, s",
    );
    let template = initiator().await?.record();
    let mut published: Vec<std::sync::Arc<ferry_etcd::EtcdDirectory>> = Vec::new();
    for records in [10usize, 100, 1_000] {
        let started = Instant::now();
        while published.len() < records {
            let i = published.len();
            let d = ferry_etcd::EtcdDirectory::connect(&etcd.url, "/growth", Default::default()).await?;
            d.publish(record(&template, i)).await?;
            published.push(d);
        }
        let publish_s = started.elapsed().as_secs_f64();
        let reader = ferry_etcd::EtcdDirectory::connect(&etcd.url, "/growth", Default::default()).await?;
        let mut lookups = Vec::new();
        for i in 0..200 {
            let started = Instant::now();
            reader.lookup(&format!("engine-{}", (i * 7919) % records)).await?;
            lookups.push(millis(started.elapsed()));
        }
        let started = Instant::now();
        let listed = reader.list().await?;
        let list_ms = millis(started.elapsed());
        anyhow::ensure!(listed.len() == records, "listed {} of {records}", listed.len());
        // A mass restart: every record withdrawn and published again, seen by 16 watchers.
        let watchers = 16;
        let mut streams = Vec::new();
        for _ in 0..watchers {
            let d = ferry_etcd::EtcdDirectory::connect(&etcd.url, "/growth", Default::default()).await?;
            streams.push((d.watch().await?, d));
        }
        let started = Instant::now();
        let counting: Vec<_> = streams
            .into_iter()
            .map(|(mut s, d)| {
                tokio::spawn(async move {
                    let _keep = d;
                    let mut seen = 0;
                    while seen < 2 * records {
                        match tokio::time::timeout(T, s.next()).await {
                            Ok(Some(_)) => seen += 1,
                            _ => break,
                        }
                    }
                    seen
                })
            })
            .collect();
        for d in &published {
            d.withdraw().await?;
        }
        for (i, d) in published.iter().enumerate() {
            d.publish(record(&template, i)).await?;
        }
        let mut complete = true;
        for c in counting {
            complete &= c.await? == 2 * records;
        }
        let fan_out_s = started.elapsed().as_secs_f64();
        out.row(
            "directory",
            serde_json::json!({"records": records, "publish_s": publish_s, "lookup_p50_ms": percentile(lookups.clone(), 0.5),
                "lookup_p99_ms": percentile(lookups.clone(), 0.99), "list_ms": list_ms, "watchers": watchers,
                "mass_restart_s": fan_out_s, "every_event_seen": complete}),
            format!(
                "{records:>7}   {publish_s:>13.2}   {:>13.2}   {:>13.2}   {list_ms:>18.2}   {watchers:>8}   {fan_out_s:.2}{}",
                percentile(lookups.clone(), 0.5),
                percentile(lookups, 0.99),
                if complete { "" } else { " (some watcher missed events)" }
            ),
        );
    }
    for d in &published {
        let _ = d.withdraw().await;
    }
    Ok(())
}

async fn fan_in(out: &Out) -> Result<()> {
    out.header(
        "fan-in: notifications from S senders (each its own engine and link) to one receiver",
        "senders   each sends   total   all received s   notifications/s",
    );
    const TOTAL: usize = 64_000;
    for senders in [1usize, 8, 64] {
        let receiver = Engine::builder()
            .transports([TransportKind::Tcp])
            .listen("127.0.0.1:0")
            .build()
            .await?;
        let addr = receiver.local_addr().context("no address")?.to_string();
        let mut stream = receiver.notifications();
        let mut engines = Vec::new();
        for _ in 0..senders {
            let e = initiator().await?;
            let p = e.connect(&addr, T).await?;
            engines.push((e, p));
        }
        let each = TOTAL / senders;
        let started = Instant::now();
        let sending: Vec<_> = engines
            .iter()
            .map(|(e, p)| {
                let (e, p) = (e.clone(), p.clone());
                tokio::spawn(async move {
                    for i in 0..each {
                        e.notify(&p, Notification::new("kv", i.to_string()), T).await?;
                    }
                    Ok::<(), ferry::Error>(())
                })
            })
            .collect();
        let mut got = 0;
        let mut names = BTreeSet::new();
        while got < each * senders {
            match tokio::time::timeout(T, stream.next()).await {
                Ok(Some(n)) => {
                    got += 1;
                    names.insert(n.from_addr);
                }
                _ => bail!("fan-in: {got} of {} notifications arrived", each * senders),
            }
        }
        for s in sending {
            s.await??;
        }
        let took = started.elapsed().as_secs_f64();
        anyhow::ensure!(
            names.len() == senders,
            "notifications from {} of {senders} senders",
            names.len()
        );
        out.row(
            "fanin",
            serde_json::json!({"senders": senders, "each": each, "total": got, "seconds": took, "per_s": got as f64 / took}),
            format!("{senders:>7}   {each:>10}   {got:>5}   {took:>14.2}   {:>15.0}", got as f64 / took),
        );
    }
    Ok(())
}
