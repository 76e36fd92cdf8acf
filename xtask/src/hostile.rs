//! `cargo xtask hostile`: an authenticated `ferry serve` under a hostile crowd, as a user would run
//! it (two processes), and what the crowd costs its authenticated peers and its memory.
//!
//! The crowd: thousands of sockets that connect and say nothing, more that send garbage and then hold
//! on, and attackers that open a new socket as soon as the target closes theirs. Meanwhile an
//! authenticated `ferry bench --peer` connects and writes 1 MiB blocks. Reported: how long its connect
//! took, its throughput against a run before the crowd came, and how much the target's resident memory
//! grew. Targets: connect within 1 s, ≥ 0.9× the throughput, < 64 MiB of growth.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

#[derive(clap::Args)]
pub struct Args {
    /// Sockets that connect and stay silent.
    #[arg(long, default_value_t = 2000)]
    silent: usize,
    /// Sockets that send 16 KiB of garbage and hold on.
    #[arg(long, default_value_t = 1000)]
    garbage: usize,
    /// Attackers that reopen a socket as soon as the target closes theirs.
    #[arg(long, default_value_t = 8)]
    reopeners: usize,
    /// Runs of the authenticated bench under attack (each 2 s).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// The target process; killed on drop.
struct Target {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// The crowd needs thousands of descriptors here, and the target (which inherits the limit) as many.
fn raise_fd_limit(want: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the plain struct passed by pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < want {
            lim.rlim_cur = want.min(lim.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn start_target(ferry: &std::path::Path, key: &std::path::Path) -> Result<Target> {
    let mut child = Command::new(ferry)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--region-size",
            "256MiB",
            "--grant-all",
        ])
        .args(["--tls-name", "target", "--tls-psk-file"])
        .arg(key)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting ferry serve")?;
    let mut line = String::new();
    let stdout = child.stdout.take().context("ferry serve's output")?;
    BufReader::new(stdout).read_line(&mut line)?;
    let addr = line
        .split_whitespace()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| anyhow!("ferry serve said {line:?}, not where it listens"))?;
    Ok(Target { child, addr })
}

/// One authenticated `ferry bench --peer` run of 1 MiB writes: (GB/s, connect ms).
fn bench(ferry: &std::path::Path, key: &std::path::Path, addr: SocketAddr) -> Result<(f64, f64)> {
    let out = Command::new(ferry)
        .args(["bench", "--peer", &addr.to_string(), "--op", "write", "--size", "1MiB"])
        .args([
            "--batch",
            "1",
            "--duration",
            "2s",
            "--json",
            "--tls-name",
            "client",
            "--tls-psk-file",
        ])
        .arg(key)
        .output()
        .context("running ferry bench")?;
    if !out.status.success() {
        bail!("ferry bench failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with('{'))
        .context("ferry bench printed no JSON")?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let field = |k: &str| {
        v.get(k)
            .and_then(|x| x.as_f64())
            .ok_or_else(|| anyhow!("no {k} in {line}"))
    };
    Ok((field("gb_per_s")?, field("connect_ms")?))
}

/// The crowd, until `stop`: returns how many sockets the reopeners opened.
fn crowd(addr: SocketAddr, args: &Args, stop: Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<u64>> {
    let mut threads = Vec::new();
    let (silent, garbage) = (args.silent, args.garbage);
    let holding = stop.clone();
    threads.push(std::thread::spawn(move || {
        let mut held = Vec::new();
        for i in 0..silent + garbage {
            let Ok(mut s) = TcpStream::connect(addr) else { continue };
            if i >= silent {
                let junk: Vec<u8> = (0..16u32 << 10)
                    .map(|j| (j.wrapping_mul(2_654_435_761) >> 13) as u8)
                    .collect();
                let _ = s.write_all(&junk);
            }
            held.push(s);
        }
        while !holding.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        0
    }));
    for _ in 0..args.reopeners {
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            let mut opened = 0;
            let mut byte = [0u8; 1];
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut s) = TcpStream::connect(addr) else { continue };
                opened += 1;
                let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
                // Until the target closes it (or 3 s pass): then the next.
                let _ = s.read(&mut byte);
            }
            opened
        }));
    }
    threads
}

pub fn run(args: &Args) -> Result<ExitCode> {
    raise_fd_limit(16_384);
    let ferry = crate::bench::build_ferry()?;
    let dir = std::env::temp_dir().join(format!("ferry-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let key = dir.join("psk");
    let mut random = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut random)?;
    std::fs::write(&key, random)?;
    let target = start_target(&ferry, &key)?;
    let pid = target.child.id();

    let (before_gbps, before_connect) = bench(&ferry, &key, target.addr)?;
    let rss_before = rss_kib(pid);
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(rss_before));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let threads = crowd(target.addr, args, stop.clone());
    // Let the crowd gather before measuring.
    let gathering = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let mut during = Vec::new();
    for _ in 0..args.rounds.max(1) {
        during.push(bench(&ferry, &key, target.addr)?);
    }
    stop.store(true, Ordering::Relaxed);
    let reopened: u64 = threads.into_iter().map(|t| t.join().unwrap_or(0)).sum();
    let _ = sampler.join();
    let attack_secs = gathering.elapsed().as_secs_f64();
    let peak = peak.load(Ordering::Relaxed).max(rss_kib(pid));
    drop(target);
    let _ = std::fs::remove_dir_all(&dir);

    let mut gbps: Vec<f64> = during.iter().map(|d| d.0).collect();
    gbps.sort_by(f64::total_cmp);
    let median = gbps[gbps.len() / 2];
    let worst_connect = during.iter().map(|d| d.1).fold(0.0, f64::max);
    let ratio = median / before_gbps;
    let grew_mib = peak.saturating_sub(rss_before) as f64 / 1024.0;
    println!(
        "hostile crowd: {} silent and {} garbage sockets held, {} attackers reopening ({reopened} sockets in \
         {attack_secs:.1} s), against `ferry serve` with TLS (pre-shared key)",
        args.silent, args.garbage, args.reopeners
    );
    println!("| measure | before | under attack | target | met |");
    println!("|---|---|---|---|---|");
    let mark = |ok: bool| if ok { "yes" } else { "NO" };
    println!(
        "| authenticated connect (ms) | {before_connect:.1} | {worst_connect:.1} (worst of {}) | < 1000 | {} |",
        during.len(),
        mark(worst_connect < 1000.0)
    );
    println!(
        "| 1 MiB writes (GB/s) | {before_gbps:.2} | {median:.2} (median; ratio {ratio:.2}) | ≥ 0.9× | {} |",
        mark(ratio >= 0.9)
    );
    println!(
        "| target RSS (MiB) | {:.0} | {:.0} peak (+{grew_mib:.1}) | < +64 | {} |",
        rss_before as f64 / 1024.0,
        peak as f64 / 1024.0,
        mark(grew_mib < 64.0)
    );
    Ok(ExitCode::SUCCESS)
}
