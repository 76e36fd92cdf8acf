//! The conductor (`ferry-chaos run`): builds the network, starts etcd and the engines, injects the
//! schedule's faults while the decode engines pull, and records everything the verdict needs: the
//! members' events, their processes' resources every second, the directory's membership four times a
//! second, and when each fault really started and healed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry::Directory;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::event::{Event, now_ms};
use crate::net::{ETCD_IP, Net};
use crate::schedule::{Fault, Fleet, Profile, Schedule, Shown};
use crate::verdict::{self, Record, Sample};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Which faults: each kind once (about 2.5 minutes), or drawn at random for --duration.
    #[arg(long, value_enum, default_value = "short")]
    pub profile: Profile,
    /// The length of a long run.
    #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Engines in the fleet (half prefill, half decode), each in its own network namespace.
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    /// The schedule's seed [default: from the clock, printed]; the same seed replays the same faults.
    #[arg(long)]
    pub seed: Option<u64>,
    /// The directory lease of every engine, in seconds.
    #[arg(long, default_value_t = 5)]
    pub ttl: u64,
    /// Concurrent pulls per decode engine.
    #[arg(long, default_value_t = 2)]
    pub callers: usize,
    /// Where the summary (summary.json), the timeline (timeline.svg), the events and the logs go.
    #[arg(long, default_value = "target/chaos")]
    pub out: PathBuf,
}

/// Everything recorded during a run.
#[derive(Default)]
pub struct Log {
    pub events: Vec<(f64, usize, Event)>,
    pub samples: Vec<Sample>,
    /// The names the directory listed (`None`: it did not answer).
    pub directory: Vec<(f64, Option<BTreeSet<String>>)>,
    /// Members that exited without being killed: (ms, member, status).
    pub exits: Vec<(f64, usize, String)>,
}

type SharedLog = Arc<Mutex<Log>>;

struct Member {
    index: usize,
    name: String,
    prefill: bool,
    child: Option<Child>,
    pid: u32,
    /// Starts, the first included.
    generation: u32,
}

struct Running {
    fleet: Fleet,
    exe: PathBuf,
    out: PathBuf,
    log: SharedLog,
    members: Vec<Member>,
    ttl: u64,
    callers: usize,
    seed: u64,
    /// Each member's pid and generation, for the resource sampler.
    pids: Pids,
}

fn etcd_url() -> String {
    format!("etcd://{ETCD_IP}:2379")
}

impl Running {
    /// Starts member `i` and waits until it reports ready; a start that fails (its name still held, its
    /// port still bound) is tried again every second, up to 30 s. Returns how many tries it took.
    async fn start(&mut self, i: usize) -> Result<u32> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut tries = 0;
        loop {
            tries += 1;
            let since = now_ms();
            self.spawn(i)?;
            loop {
                let ready = self.log.lock().is_ok_and(|l| {
                    l.events
                        .iter()
                        .rev()
                        .take_while(|(t, _, _)| *t >= since)
                        .any(|(_, m, e)| *m == i && matches!(e, Event::Ready { .. }))
                });
                if ready {
                    return Ok(tries);
                }
                let m = &mut self.members[i];
                if let Some(status) = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                    m.child = None;
                    tracing::warn!(member = %m.name, %status, "a start failed; trying again in 1 s");
                    break;
                }
                if Instant::now() > deadline {
                    bail!("{} did not start within 30 s (see its log)", self.members[i].name);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if Instant::now() > deadline {
                bail!("{} did not start within 30 s (see its log)", self.members[i].name);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let m = &mut self.members[i];
        let logs = self.out.join("logs");
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(logs.join(format!("{}.log", m.name)))?;
        let role = if m.prefill { "prefill" } else { "decode" };
        let mut child = Command::new("ip")
            .args(["netns", "exec", &Net::namespace(i)])
            .arg(&self.exe)
            .args(["member", "--role", role, "--name", &m.name])
            .args(["--listen", &format!("{}:7000", Net::ip(i)), "--directory", &etcd_url()])
            .args(["--ttl", &self.ttl.to_string(), "--callers", &self.callers.to_string()])
            .args([
                "--seed",
                &(self.seed ^ (i as u64) << 20 ^ u64::from(m.generation)).to_string(),
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .context("starting a member")?;
        m.pid = child.id().context("a member without a pid")?;
        m.generation += 1;
        if let Ok(mut pids) = self.pids.lock() {
            pids[i] = (m.pid, m.generation);
        }
        let stdout = child.stdout.take().context("a member without stdout")?;
        m.child = Some(child);
        let (log, index) = (self.log.clone(), m.index);
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(event) = serde_json::from_str::<Event>(&line)
                    && let Ok(mut l) = log.lock()
                {
                    l.events.push((now_ms(), index, event));
                }
            }
        });
        Ok(())
    }

    fn signal(&self, i: usize, signal: libc::c_int) -> Result<()> {
        if self.members[i].child.is_none() {
            bail!("{} is not running", self.members[i].name);
        }
        // SAFETY: kill(2) on a pid this process started and has not reaped (the child is held), so
        // the pid is still that process's.
        if unsafe { libc::kill(self.members[i].pid as libc::pid_t, signal) } != 0 {
            bail!(
                "signal {signal} to {}: {}",
                self.members[i].name,
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    async fn kill(&mut self, i: usize) -> Result<()> {
        self.signal(i, libc::SIGKILL)?;
        if let Some(mut child) = self.members[i].child.take() {
            child.wait().await?;
        }
        Ok(())
    }
}

/// etcd as a child process, on a data folder of its own.
struct Etcd {
    child: Option<Child>,
    data: PathBuf,
    log: PathBuf,
}

impl Etcd {
    async fn start(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let client = format!("http://{ETCD_IP}:2379");
        self.child = Some(
            Command::new("etcd")
                .arg("--data-dir")
                .arg(&self.data)
                .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
                .args(["--listen-peer-urls", "http://127.0.0.1:2380"])
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .context("starting etcd (Debian: apt-get install etcd-server)")?,
        );
        // Answering: a directory connects and lists.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let options = ferry_etcd::EtcdOptions {
                timeout: Duration::from_secs(1),
                ..Default::default()
            };
            if let Ok(d) = ferry_etcd::EtcdDirectory::connect(&etcd_url(), "/ferry", options).await
                && d.list().await.is_ok()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("etcd did not answer within 30 s (see {})", self.log.display());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.start_kill()?;
            child.wait().await?;
        }
        Ok(())
    }
}

pub async fn run(args: Args) -> Result<bool> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("ferry-chaos run needs root: it makes network namespaces and shapes their links");
    }
    anyhow::ensure!(
        args.engines >= 2,
        "--engines: at least one prefill and one decode engine"
    );
    let seed = args.seed.unwrap_or_else(|| now_ms() as u64 % 1_000_000);
    let fleet = Fleet {
        prefill: args.engines / 2,
        engines: args.engines,
        ttl: Duration::from_secs(args.ttl),
    };
    let schedule = crate::schedule::plan(seed, args.profile, fleet, args.duration);
    println!("{}", Shown(&schedule, &fleet));
    let profile = match args.profile {
        Profile::Short => "short",
        Profile::Long => "long",
    };
    println!("replay with: cargo xtask chaos --profile {profile} --seed {seed} (or ferry-chaos run, as root)");
    let out = args.out.clone();
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("clearing {}", out.display()))?;
    }
    std::fs::create_dir_all(out.join("logs")).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("schedule.json"), serde_json::to_vec_pretty(&schedule)?)?;

    let net = Net::create(args.engines)?;
    let mut etcd = Etcd {
        child: None,
        // Local disk, not the output folder: etcd's database is mmap'ed, which a 9p share refuses.
        data: std::env::temp_dir().join(format!("ferry-chaos-etcd-{}", std::process::id())),
        log: out.join("logs/etcd.log"),
    };
    etcd.start().await?;
    let log: SharedLog = Arc::default();
    let mut f = Running {
        fleet,
        exe: std::env::current_exe().context("the conductor's own path")?,
        out: out.clone(),
        log: log.clone(),
        members: (0..args.engines)
            .map(|i| Member {
                index: i,
                name: fleet.name(i),
                prefill: i < fleet.prefill,
                child: None,
                pid: 0,
                generation: 0,
            })
            .collect(),
        ttl: args.ttl,
        callers: args.callers,
        seed,
        pids: Arc::new(Mutex::new(vec![(0, 0); args.engines])),
    };
    // Prefill engines first, so that decode engines find them.
    for i in 0..args.engines {
        f.start(i).await?;
    }
    let t0 = now_ms();
    println!("fleet up: {} engines, etcd at {ETCD_IP}:2379", args.engines);
    let recorders = [
        tokio::spawn(watch_directory(log.clone())),
        tokio::spawn(sample_resources(log.clone(), f.pids.clone())),
    ];
    let (records, aborted) = inject(&mut f, &mut etcd, &schedule, t0).await;
    let end_ms = now_ms();
    for r in &recorders {
        r.abort();
    }
    // Decode engines first: a prefill engine stopped under a pull in flight would fail it (its region
    // deregistered), which is the contract but no finding of the run.
    for prefill in [false, true] {
        let stopping: Vec<usize> = (0..f.members.len())
            .filter(|&i| f.members[i].prefill == prefill)
            .collect();
        for &i in &stopping {
            let _ = f.signal(i, libc::SIGCONT);
            let _ = f.signal(i, libc::SIGTERM);
        }
        for &i in &stopping {
            if let Some(child) = f.members[i].child.as_mut()
                && tokio::time::timeout(Duration::from_secs(5), child.wait())
                    .await
                    .is_err()
            {
                let _ = child.start_kill();
            }
        }
    }
    let _ = etcd.kill().await;
    let _ = std::fs::remove_dir_all(&etcd.data);
    drop(net);
    let log = std::mem::take(&mut *log.lock().map_err(|_| anyhow::anyhow!("log lock poisoned"))?);
    write_events(&out, &log)?;
    let verdict = verdict::judge(&verdict::Input {
        fleet: &fleet,
        records: &records,
        log: &log,
        t0,
        end_ms,
    });
    let summary = crate::report::write(&out, &schedule, &fleet, &verdict, &log, t0, end_ms)?;
    println!("{summary}");
    if let Some(e) = aborted {
        println!("the run stopped early: {e:#}");
        return Ok(false);
    }
    Ok(verdict.violations.is_empty())
}

/// A shared view of the members' pids, which the sampler reads and restarts update.
type Pids = Arc<Mutex<Vec<(u32, u32)>>>;

/// Runs the schedule; returns what happened when, and the error that stopped it early, if any.
async fn inject(
    f: &mut Running,
    etcd: &mut Etcd,
    schedule: &Schedule,
    t0: f64,
) -> (Vec<Record>, Option<anyhow::Error>) {
    let mut records = Vec::new();
    let at = |d: Duration| {
        tokio::time::sleep_until(
            tokio::time::Instant::now()
                + Duration::from_secs_f64((t0 + d.as_secs_f64() * 1e3 - now_ms()).max(0.0) / 1e3),
        )
    };
    for step in &schedule.steps {
        at(step.at).await;
        let mut record = Record {
            step: *step,
            at_ms: now_ms(),
            heal_ms: 0.0,
            restart_tries: 0,
        };
        println!(
            "t={:>6.1}s  {}",
            (record.at_ms - t0) / 1e3,
            step.fault.describe(&f.fleet)
        );
        let applied: Result<()> = async {
            match step.fault {
                Fault::Kill { member } => f.kill(member).await,
                Fault::Hang { member } => f.signal(member, libc::SIGSTOP),
                Fault::Delay { member, ms } => Net::netem(member, &["delay", &format!("{ms}ms")]),
                Fault::Loss { member, percent } => Net::netem(member, &["loss", &format!("{percent}%")]),
                Fault::Partition { a, b } => Net::partition(a, b),
                Fault::EtcdRestart { .. } => etcd.kill().await,
            }
        }
        .await;
        if let Err(e) = applied {
            return (
                records,
                Some(e.context(format!("injecting: {}", step.fault.describe(&f.fleet)))),
            );
        }
        at(step.heals_at()).await;
        let healed: Result<()> = async {
            match step.fault {
                Fault::Kill { member } => {
                    record.restart_tries = f.start(member).await?;
                    Ok(())
                }
                Fault::Hang { member } => f.signal(member, libc::SIGCONT),
                Fault::Delay { member, .. } | Fault::Loss { member, .. } => Net::clear(member),
                Fault::Partition { a, b } => Net::heal_partition(a, b),
                Fault::EtcdRestart { keep_data } => {
                    if !keep_data {
                        let _ = std::fs::remove_dir_all(&etcd.data);
                    }
                    etcd.start().await
                }
            }
        }
        .await;
        record.heal_ms = now_ms();
        println!("t={:>6.1}s  healed", (record.heal_ms - t0) / 1e3);
        records.push(record);
        if let Err(e) = healed {
            return (
                records,
                Some(e.context(format!("healing: {}", step.fault.describe(&f.fleet)))),
            );
        }
        // Members that exited on their own are a failure of the run; the verdict names them.
        for m in &mut f.members {
            if let Some(status) = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                m.child = None;
                if let Ok(mut l) = f.log.lock() {
                    l.exits.push((now_ms(), m.index, status.to_string()));
                }
            }
        }
    }
    at(schedule.end).await;
    (records, None)
}

/// The directory's members, four times a second.
async fn watch_directory(log: SharedLog) {
    let options = ferry_etcd::EtcdOptions {
        timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let mut directory = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        if directory.is_none() {
            directory = ferry_etcd::EtcdDirectory::connect(&etcd_url(), "/ferry", options.clone())
                .await
                .ok();
        }
        let names = match &directory {
            Some(d) => match tokio::time::timeout(Duration::from_secs(1), d.list()).await {
                Ok(Ok(records)) => Some(records.into_iter().map(|r| r.name).collect()),
                _ => None,
            },
            None => None,
        };
        if let Ok(mut l) = log.lock() {
            l.directory.push((now_ms(), names));
        }
    }
}

/// Every member's RSS, threads and open file descriptors, every second.
async fn sample_resources(log: SharedLog, pids: Pids) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let now: Vec<(u32, u32)> = pids.lock().map(|p| p.clone()).unwrap_or_default();
        let t = now_ms();
        let samples: Vec<Sample> = now
            .iter()
            .enumerate()
            .filter_map(|(member, &(pid, generation))| {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                let field = |key: &str| -> Option<u64> {
                    status
                        .lines()
                        .find(|l| l.starts_with(key))?
                        .split_whitespace()
                        .nth(1)?
                        .parse()
                        .ok()
                };
                Some(Sample {
                    t,
                    member,
                    generation,
                    rss_kib: field("VmRSS:")?,
                    threads: field("Threads:")?,
                    fds: std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64,
                })
            })
            .collect();
        if let Ok(mut l) = log.lock() {
            l.samples.extend(samples);
        }
    }
}

fn write_events(out: &Path, log: &Log) -> Result<()> {
    use std::io::Write;
    let mut file = std::io::BufWriter::new(std::fs::File::create(out.join("events.jsonl"))?);
    for (t, member, event) in &log.events {
        writeln!(
            file,
            "{}",
            serde_json::json!({"t": t, "member": member, "event": event})
        )?;
    }
    let mut file = std::io::BufWriter::new(std::fs::File::create(out.join("resources.jsonl"))?);
    for sample in &log.samples {
        writeln!(file, "{}", serde_json::to_string(sample)?)?;
    }
    Ok(())
}
