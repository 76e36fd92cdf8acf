//! One run of each tool `cargo xtask bench` measures, and the parser for what it prints.
//!
//! Why parsers live apart from the runs: each peer prints its own format (iperf3 JSON, a ucx_perftest
//! table, sockperf percentile lines) with traps that are easy to misread — ucx_perftest's "average"
//! bandwidth covers only its last report interval, sockperf's latency is one-way (RTT/2). The parsers
//! are unit-tested against output captured from real runs.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

use crate::util::{ServerGuard, describe, free_port, run_captured};

/// How long a peer server may take to start listening.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Slack on top of the measured duration before a client is killed.
const SLACK: Duration = Duration::from_secs(60);

/// `seconds` rounded up to whole seconds, at least 1 (iperf3 and sockperf take integers).
pub fn whole_seconds(duration: Duration) -> u64 {
    duration.as_secs_f64().ceil().max(1.0) as u64
}

/// One `ferry bench` case, as on its command line.
#[derive(Clone, Copy)]
pub struct FerryCase {
    pub op: &'static str,
    pub size: &'static str,
    pub batch: u32,
    pub streams: Option<u32>,
    pub depth: Option<u32>,
    /// `--target-mem`: where the in-process target's region lives ("host" when `None`).
    pub target_mem: Option<&'static str>,
    /// `--durability` ("completed" when `None`).
    pub durability: Option<&'static str>,
    /// `--scatter`: descriptors over shuffled block slots on both sides (a paged KV cache).
    pub scatter: bool,
    /// `--prepared`: the batch resolved once and posted again and again.
    pub prepared: bool,
    /// `--tls` (mutual TLS on the control stream) and what protects the data streams.
    pub tls: Tls,
    /// `--transport` ("tcp", ferry bench's default, when `None`).
    pub transport: Option<&'static str>,
    /// `--metrics`: the initiator keeps Prometheus metrics.
    pub metrics: bool,
    /// `--integrity`: every transfer checks its bytes end to end.
    pub integrity: bool,
    /// The target is a `ferry serve` process of its own and `ferry bench --peer` measures against
    /// it, as users run ferry; else both engines run in the bench's one process.
    pub two_processes: bool,
    /// `--buffer-pool` ("4:8", ferry bench's default, when `None`; "0:0" turns the pool off).
    pub buffer_pool: Option<&'static str>,
    /// `--local-mem`: where the initiator's buffer lives ("host" when `None`).
    pub local_mem: Option<&'static str>,
}

/// How a bench case authenticates its link: not at all, or mutual TLS with its data streams
/// protected as `--data-protection` says ("plain", "integrity" or "encrypted").
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Tls {
    Off,
    On(&'static str),
}

impl FerryCase {
    fn args(&self, duration: &str) -> Vec<String> {
        let mut args: Vec<String> = ["bench", "--op", self.op, "--size", self.size]
            .map(String::from)
            .to_vec();
        args.extend(["--batch".into(), self.batch.to_string()]);
        if let Some(transport) = self.transport {
            args.extend(["--transport".into(), transport.into()]);
        }
        if let Some(streams) = self.streams {
            args.extend(["--streams".into(), streams.to_string()]);
        }
        if let Some(depth) = self.depth {
            args.extend(["--depth".into(), depth.to_string()]);
        }
        // A `ferry serve` of a two-process case allocates the target's memory (`serve_for`).
        if let Some(mem) = self.target_mem.filter(|_| !self.two_processes) {
            args.extend(["--target-mem".into(), mem.into()]);
        }
        if let Some(mem) = self.local_mem {
            args.extend(["--local-mem".into(), mem.into()]);
        }
        if let Some(durability) = self.durability {
            args.extend(["--durability".into(), durability.into()]);
        }
        if let Some(pool) = self.buffer_pool {
            args.extend(["--buffer-pool".into(), pool.into()]);
        }
        if self.scatter {
            args.push("--scatter".into());
        }
        if self.prepared {
            args.push("--prepared".into());
        }
        if self.metrics {
            args.push("--metrics".into());
        }
        if self.integrity {
            args.push("--integrity".into());
        }
        match self.tls {
            Tls::Off => {}
            Tls::On(protection) => args.extend(["--tls".into(), "--data-protection".into(), protection.into()]),
        }
        args.extend(["--duration".into(), duration.into(), "--json".into()]);
        args
    }

    /// The command line, for the report.
    pub fn describe(&self, duration: &str) -> String {
        match self.two_processes {
            true => format!(
                "{}ferry {} --peer 127.0.0.1:PORT",
                serve_description(self.target_mem),
                self.args(duration).join(" ")
            ),
            false => format!("ferry {}", self.args(duration).join(" ")),
        }
    }
}

/// The region a `ferry serve` of a two-process case registers: room for every case's batches in
/// flight (the KV shape: 16 MiB batches, 8 in flight).
const SERVE_REGION: &str = "512MiB";

/// Starts `ferry serve` (`bin`) on a free port of loopback, its region in `mem` ("host" when
/// `None`), waits until it listens, and gives `cmd` its address (`--peer`): the target of a
/// two-process case, serving until the guard is dropped.
fn serve_for(bin: &Path, mem: Option<&str>, cmd: &mut Command) -> Result<ServerGuard> {
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let mut serve = Command::new(bin);
    serve.args(["serve", "--listen", &listen, "--region-size", SERVE_REGION]);
    if let Some(mem) = mem {
        serve.args(["--mem", mem]);
    }
    let mut server = ServerGuard::spawn("ferry-serve", &mut serve)?;
    server.wait_listening(port, LISTEN_TIMEOUT)?;
    cmd.args(["--peer", &listen]);
    Ok(server)
}

/// How [`serve_for`] starts a two-process case's target, for the report.
pub fn serve_description(mem: Option<&str>) -> String {
    let mem = mem.map_or_else(String::new, |m| format!(" --mem {m}"));
    format!("ferry serve --listen 127.0.0.1:PORT --region-size {SERVE_REGION}{mem} & ")
}

/// The figures of one `ferry bench --json` case that the comparisons use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FerryResult {
    pub gb_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Descriptors per second.
    pub ops_per_s: f64,
    pub peak_rss_bytes: f64,
    pub registered_bytes: f64,
    /// The target's flush time over the transfer time, for persistent writes (else 0).
    pub persist_share: f64,
}

/// Runs `ferry bench` for one case and returns its JSON figures.
pub fn ferry(bin: &Path, case: &FerryCase, duration_arg: &str, duration: Duration) -> Result<FerryResult> {
    let mut cmd = Command::new(bin);
    cmd.args(case.args(duration_arg));
    // A two-process case's target: serving until dropped, after the measurement.
    let _server = match case.two_processes {
        true => Some(serve_for(bin, case.target_mem, &mut cmd)?),
        false => None,
    };
    let what = describe(&cmd);
    let out = run_captured(&mut cmd, duration * 4 + SLACK)?;
    if !out.status.success() {
        bail!("`{what}` failed ({}): {}", out.status, tail(&out.combined()));
    }
    let size = parse_size(case.size)?;
    parse_ferry(&out.stdout, case.op, size).with_context(|| format!("reading the output of `{what}`"))
}

/// Whether `bin` (a ferry binary) finds a CUDA device on this host: `Err` with its reason where it
/// does not (`ferry info --json`'s `cuda.unavailable`, or that it lists no device).
pub fn cuda_devices(bin: &Path) -> std::result::Result<(), String> {
    let out = run_captured(Command::new(bin).args(["info", "--json"]), Duration::from_secs(60))
        .map_err(|e| format!("`ferry info --json` did not run: {e:#}"))?;
    if !out.status.success() {
        return Err(format!("`ferry info --json` failed: {}", tail(&out.combined())));
    }
    let info: Value =
        serde_json::from_str(&out.stdout).map_err(|e| format!("`ferry info --json` printed no JSON: {e}"))?;
    cuda_of_info(&info)
}

/// CUDA device 0's own device-to-device copy rate for 1 MiB copies, GB/s: ferry-cuda's
/// `copy_bandwidth` example (`bin`), which prints one JSON object.
pub fn cuda_copy_gb_per_s(bin: &Path, duration: Duration) -> Result<f64> {
    let mut cmd = Command::new(bin);
    cmd.args([(1u64 << 20).to_string(), duration.as_secs_f64().to_string()]);
    let what = describe(&cmd);
    let out = run_captured(&mut cmd, duration * 4 + SLACK)?;
    if !out.status.success() {
        bail!("`{what}` failed ({}): {}", out.status, tail(&out.combined()));
    }
    let v: Value = serde_json::from_str(out.stdout.trim()).with_context(|| format!("reading `{what}`"))?;
    v["gb_per_s"]
        .as_f64()
        .ok_or_else(|| anyhow!("`{what}` printed no gb_per_s: {}", out.stdout.trim()))
}

/// What `ferry info --json` says of CUDA: `Ok` when it lists a device.
pub fn cuda_of_info(info: &Value) -> std::result::Result<(), String> {
    let cuda = &info["cuda"];
    if let Some(why) = cuda["unavailable"].as_str() {
        return Err(why.to_string());
    }
    match cuda["devices"].as_array().map_or(0, Vec::len) {
        0 => Err("the CUDA driver lists no device".into()),
        _ => Ok(()),
    }
}

/// Runs one case of the Python binding's benchmark (`python -m ferry.bench --case`), which prints
/// one JSON object with `gb_per_s` and `p50_us`.
///
/// With `serve` (the `ferry` binary), the case runs against a `ferry serve` that this starts, and
/// stops after it (`--peer`).
pub fn python_bench(
    python: &Path,
    case: &str,
    blocking: bool,
    serve: Option<&Path>,
    duration: Duration,
) -> Result<FerryResult> {
    let mut cmd = Command::new(python);
    cmd.args(["-m", "ferry.bench", "--case", case, "--duration"])
        .arg(format!("{}", duration.as_secs_f64()));
    if blocking {
        cmd.arg("--blocking");
    }
    let _server = serve.map(|bin| serve_for(bin, None, &mut cmd)).transpose()?;
    let v = last_json_line(&mut cmd, duration * 4 + SLACK)?;
    let num = |key: &str| {
        v[key]
            .as_f64()
            .ok_or_else(|| anyhow!("key `{key}` missing or not a number: {v}"))
    };
    Ok(FerryResult {
        gb_per_s: num("gb_per_s")?,
        p50_us: num("p50_us")?,
        p99_us: v["p99_us"].as_f64().unwrap_or(0.0),
        ops_per_s: 0.0,
        peak_rss_bytes: 0.0,
        registered_bytes: 0.0,
        persist_share: 0.0,
    })
}

/// Runs ferry-tower's `tower_overhead` example (with `--tcp`, over TCP only) and returns its ratio
/// (the stack's rate over direct engine calls' or, with `floor` (`--floor`), the least service's)
/// and, for the stack, the CPU time it adds per request in microseconds.
pub fn tower_overhead(bin: &Path, tcp: bool, floor: bool, duration: Duration) -> Result<(f64, Option<f64>)> {
    let mut cmd = Command::new(bin);
    if tcp {
        cmd.arg("--tcp");
    }
    if floor {
        cmd.arg("--floor");
    }
    let v = last_json_line(&mut cmd, duration * 20 + SLACK)?;
    let ratio = v["ratio"].as_f64().ok_or_else(|| anyhow!("no `ratio` in {v}"))?;
    Ok((ratio, v["added_cpu_us"].as_f64()))
}

/// Runs `cmd`, which must succeed within `timeout`, and parses the last line of its stdout that is
/// a JSON object.
fn last_json_line(cmd: &mut Command, timeout: Duration) -> Result<Value> {
    let what = describe(cmd);
    let out = run_captured(cmd, timeout)?;
    if !out.status.success() {
        bail!("`{what}` failed ({}): {}", out.status, tail(&out.combined()));
    }
    let line = out.stdout.lines().map(str::trim).rfind(|l| l.starts_with('{'));
    let line = line.ok_or_else(|| anyhow!("`{what}` printed no JSON line"))?;
    serde_json::from_str(line).with_context(|| format!("not JSON: {line}"))
}

/// Picks the JSON line for (`op`, `size`) from `ferry bench --json` output.
pub fn parse_ferry(stdout: &str, op: &str, size: u64) -> Result<FerryResult> {
    let mut seen = Vec::new();
    for line in stdout.lines().map(str::trim).filter(|l| l.starts_with('{')) {
        let v: Value = serde_json::from_str(line).with_context(|| format!("not JSON: {line}"))?;
        if v["op"].as_str() == Some(op) && v["size"].as_u64() == Some(size) {
            let num = |key: &str| {
                v[key]
                    .as_f64()
                    .ok_or_else(|| anyhow!("key `{key}` missing or not a number: {line}"))
            };
            return Ok(FerryResult {
                gb_per_s: num("gb_per_s")?,
                p50_us: num("p50_us")?,
                p99_us: num("p99_us")?,
                ops_per_s: num("ops_per_s")?,
                peak_rss_bytes: num("peak_rss_bytes")?,
                registered_bytes: num("registered_bytes")?,
                persist_share: v["persist_share"].as_f64().unwrap_or(0.0),
            });
        }
        seen.push(line.to_owned());
    }
    bail!("no JSON line with op={op} size={size}; lines seen: {seen:?}")
}

/// Parses `64`, `4KiB`, `1MiB`, `16MiB`, `1GiB` into bytes.
pub fn parse_size(text: &str) -> Result<u64> {
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().with_context(|| format!("`{text}` is not a size"))?;
    let scale = match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => bail!("unknown unit `{other}` in size `{text}`"),
    };
    Ok(number * scale)
}

/// The iperf3 client command for `streams` parallel streams, without the port.
pub fn iperf3_describe(streams: u32, duration: Duration) -> String {
    iperf3_describe_len(streams, "1M", duration)
}

/// The iperf3 client command with `len` bytes per write (`-l`), without the port.
pub fn iperf3_describe_len(streams: u32, len: &str, duration: Duration) -> String {
    let parallel = if streams > 1 {
        format!(" -P {streams}")
    } else {
        String::new()
    };
    format!(
        "iperf3 -c 127.0.0.1 -p PORT{parallel} -l {len} -t {} -J (server: iperf3 -s -1 -B 127.0.0.1 -p PORT)",
        whole_seconds(duration)
    )
}

/// Runs an iperf3 server (one test) and client over loopback; returns GB/s received (10^9 B/s).
pub fn iperf3(streams: u32, duration: Duration) -> Result<f64> {
    iperf3_len(streams, "1M", duration)
}

/// [`iperf3`] with `len` bytes per write (`-l`: `1M`, `4096`, ...).
pub fn iperf3_len(streams: u32, len: &str, duration: Duration) -> Result<f64> {
    let port = free_port()?.to_string();
    let mut server = ServerGuard::spawn(
        "iperf3",
        Command::new("iperf3").args(["-s", "-1", "-B", "127.0.0.1", "-p", &port]),
    )?;
    server.wait_listening(port.parse()?, LISTEN_TIMEOUT)?;
    let mut cmd = Command::new("iperf3");
    cmd.args([
        "-c",
        "127.0.0.1",
        "-p",
        &port,
        "-l",
        len,
        "-t",
        &whole_seconds(duration).to_string(),
        "-J",
    ]);
    if streams > 1 {
        cmd.args(["-P", &streams.to_string()]);
    }
    let what = describe(&cmd);
    let out = run_captured(&mut cmd, duration + SLACK)?;
    let parsed = parse_iperf3(&out.stdout).with_context(|| format!("reading the output of `{what}`"));
    if !out.status.success() && parsed.is_err() {
        bail!("`{what}` failed ({}): {}", out.status, tail(&out.combined()));
    }
    drop(server);
    parsed
}

/// `end.sum_received.bits_per_second` of `iperf3 -J` output, in GB/s (10^9 B/s).
pub fn parse_iperf3(stdout: &str) -> Result<f64> {
    let v: Value = serde_json::from_str(stdout).context("iperf3 -J output is not JSON")?;
    if let Some(err) = v["error"].as_str() {
        bail!("iperf3: {err}");
    }
    let bits = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .ok_or_else(|| anyhow!("no end.sum_received.bits_per_second in iperf3 output"))?;
    Ok(bits / 8e9)
}

/// The UCX transport lists tried in order for ucx_perftest over TCP.
pub const UCX_TLS_CHOICES: &[&str] = &["tcp,self", "tcp"];

/// Iterations of 1 MiB puts per ucx_perftest run.
pub const UCX_ITERS: &str = "2000";

pub fn ucx_describe(tls: &str) -> String {
    format!(
        "UCX_TLS={tls} ucx_perftest 127.0.0.1 -p PORT -t ucp_put_bw -s 1048576 -n {UCX_ITERS} (server: ucx_perftest -p PORT)"
    )
}

/// Runs ucx_perftest `ucp_put_bw` with 1 MiB messages over loopback with `UCX_TLS=tls`; returns GB/s.
pub fn ucx_put_bw(tls: &str) -> Result<f64> {
    ucx_put_bw_size(tls, "1048576")
}

/// [`ucx_put_bw`] with `size`-byte messages (a number of bytes).
pub fn ucx_put_bw_size(tls: &str, size: &str) -> Result<f64> {
    let fields = ucx_final(tls, "ucp_put_bw", size)?;
    bandwidth_gb_per_s(&fields)
}

/// The bandwidth "overall" column of a `Final:` row (MB/s with MB = 2^20 B), in GB/s (10^9 B/s). The
/// row's "average" column is the moment average over the last report interval only (ucx_perftest
/// prints `bandwidth.moment_average` there), so the whole run is "overall".
pub fn bandwidth_gb_per_s(fields: &[f64]) -> Result<f64> {
    // iters, latency p50, latency avg, latency overall, bw avg, bw overall, rate avg, rate overall
    let overall_mb = fields
        .get(5)
        .ok_or_else(|| anyhow!("a short `Final:` row from ucx_perftest"))?;
    Ok(overall_mb * (1u64 << 20) as f64 / 1e9)
}

/// The typical latency (one-way, microseconds) of a latency test's `Final:` row: iters, typical
/// latency, average latency, overall latency, ...
pub fn typical_latency_us(fields: &[f64]) -> Result<f64> {
    fields
        .get(1)
        .copied()
        .ok_or_else(|| anyhow!("a short `Final:` row from ucx_perftest"))
}

/// The UCX transports of the same-host comparisons: shared memory and cross-memory attach.
pub const UCX_SHM_TLS: &str = "posix,cma,self";

pub fn ucx_shm_describe(test: &str, size: &str) -> String {
    format!(
        "UCX_TLS={UCX_SHM_TLS} ucx_perftest 127.0.0.1 -p PORT -t {test} -s {size} -n {UCX_ITERS} (server: ucx_perftest -p PORT)"
    )
}

/// Runs ucx_perftest `test` (`ucp_put_bw`, `ucp_get_bw`, `ucp_am_lat`) with `size`-byte messages
/// between two processes of this host over UCX's shared-memory transports; returns the `Final:` row's
/// fields (see [`bandwidth_gb_per_s`] for their order).
pub fn ucx_shm(test: &str, size: &str) -> Result<Vec<f64>> {
    ucx_final(UCX_SHM_TLS, test, size)
}

/// Runs ucx_perftest `test` with `size`-byte messages over loopback with `UCX_TLS=tls`; returns the
/// numbers of its `Final:` row.
fn ucx_final(tls: &str, test: &str, size: &str) -> Result<Vec<f64>> {
    let port = free_port()?.to_string();
    let mut server_cmd = Command::new("ucx_perftest");
    server_cmd.env("UCX_TLS", tls).args(["-p", &port]);
    let mut server = ServerGuard::spawn("ucx_perftest", &mut server_cmd)?;
    server.wait_listening(port.parse()?, LISTEN_TIMEOUT)?;
    let mut cmd = Command::new("ucx_perftest");
    cmd.env("UCX_TLS", tls)
        .args(["127.0.0.1", "-p", &port, "-t", test, "-s", size, "-n", UCX_ITERS]);
    let what = describe(&cmd);
    let out = run_captured(&mut cmd, Duration::from_secs(120) + SLACK)?;
    if !out.status.success() {
        bail!("`{what}` failed ({}): {}", out.status, tail(&out.combined()));
    }
    drop(server);
    parse_ucx_final(&out.stdout).with_context(|| format!("reading the output of `{what}`"))
}

/// The numbers of ucx_perftest's `Final:` row.
pub fn parse_ucx_final(stdout: &str) -> Result<Vec<f64>> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with("Final:"))
        .ok_or_else(|| anyhow!("no `Final:` line in ucx_perftest output"))?;
    line.split_whitespace()
        .skip(1)
        .map(|f| f.parse::<f64>().with_context(|| format!("a field of `{line}`")))
        .collect()
}

/// GB/s of a single-threaded copy of `size` bytes between two buffers, repeated for `duration`: what
/// one core's memory copy reaches here.
pub fn memcpy_gb_per_s(size: usize, duration: Duration) -> f64 {
    let src = vec![0x5au8; size];
    let mut dst = vec![0u8; size];
    let started = std::time::Instant::now();
    let mut copies = 0u64;
    while started.elapsed() < duration {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        copies += 1;
    }
    copies as f64 * size as f64 / started.elapsed().as_secs_f64() / 1e9
}

/// `openssl speed -evp aes-128-gcm` on 16 KiB blocks, one process: what one core of this CPU
/// seals with AES-128-GCM, in GB/s. The limit protected data streams pay on each side.
pub fn openssl_aes_gcm(duration: Duration) -> Result<f64> {
    let mut cmd = Command::new("openssl");
    cmd.args(["speed", "-evp", "aes-128-gcm", "-bytes", "16384", "-seconds"])
        .arg(whole_seconds(duration).to_string());
    let what = describe(&cmd);
    let out = run_captured(&mut cmd, duration * 4 + SLACK)?;
    if !out.status.success() {
        bail!("`{what}` failed ({}): {}", out.status, tail(&out.combined()));
    }
    parse_openssl_speed(&out.stdout).with_context(|| format!("reading the output of `{what}`"))
}

/// MiB that [`dd_dsync_gb_per_s`] writes per second of `duration`: about what `dd` reaches on the
/// development machine's virtual disk (0.3-1.7 GB/s), so that it runs about as long as the case
/// beside it.
const DD_MIB_PER_SECOND: u64 = 256;

/// The file `dd` writes: in the temporary folder, where `ferry bench --durability persistent` puts
/// its target's file, so that both measure the same file system.
fn dd_file() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("ferry-bench-dd-{}.data", std::process::id()))
}

/// The `dd` run of [`dd_dsync_gb_per_s`], which [`dd_describe`] prints.
fn dd_command(duration: Duration) -> Command {
    let count = (DD_MIB_PER_SECOND * whole_seconds(duration)).max(64);
    let mut cmd = Command::new("dd");
    cmd.arg("if=/dev/zero")
        .arg(format!("of={}", dd_file().display()))
        .args(["bs=1M", "oflag=dsync"])
        .arg(format!("count={count}"));
    cmd
}

/// GB/s of `dd bs=1M oflag=dsync` into a file of the temporary folder: what a durable 1 MiB write
/// costs this machine's file system (each `write` returns once its data is on the disk, as a
/// persistent ferry write is acknowledged once the target's `msync` returned). The file is removed.
pub fn dd_dsync_gb_per_s(duration: Duration) -> Result<f64> {
    let mut cmd = dd_command(duration);
    let what = describe(&cmd);
    let out = run_captured(&mut cmd, duration * 10 + SLACK);
    let _ = std::fs::remove_file(dd_file());
    let out = out?;
    if !out.status.success() {
        bail!("`{what}` failed ({}): {}", out.status, tail(&out.combined()));
    }
    parse_dd(&out.stderr).with_context(|| format!("reading the output of `{what}`"))
}

/// The `dd` command line of [`dd_dsync_gb_per_s`], for the report.
pub fn dd_describe(duration: Duration) -> String {
    describe(&dd_command(duration))
}

/// GB/s from dd's summary line (`536870912 bytes (537 MB, 512 MiB) copied, 0.33 s, 1.6 GB/s`), from
/// its bytes and seconds rather than its rounded rate.
fn parse_dd(stderr: &str) -> Result<f64> {
    let line = stderr
        .lines()
        .rev()
        .find(|l| l.contains(" copied, "))
        .ok_or_else(|| anyhow!("no summary line in: {}", tail(stderr)))?;
    let bytes: f64 = line
        .split_whitespace()
        .next()
        .and_then(|b| b.parse().ok())
        .ok_or_else(|| anyhow!("no byte count in {line:?}"))?;
    let seconds: f64 = line
        .split(" copied, ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("no time in {line:?}"))?;
    if seconds <= 0.0 {
        bail!("a time of {seconds} s in {line:?}");
    }
    Ok(bytes / seconds / 1e9)
}

pub fn openssl_describe(duration: Duration) -> String {
    format!(
        "openssl speed -evp aes-128-gcm -bytes 16384 -seconds {}",
        whole_seconds(duration)
    )
}

/// The last figure of openssl speed's table row (`AES-128-GCM  4301144.06k`: thousands of bytes per
/// second) in GB/s.
fn parse_openssl_speed(stdout: &str) -> Result<f64> {
    let row = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().to_ascii_uppercase().starts_with("AES-128-GCM"))
        .ok_or_else(|| anyhow!("no AES-128-GCM row in: {}", tail(stdout)))?;
    let figure = row
        .split_whitespace()
        .last()
        .and_then(|f| f.strip_suffix('k'))
        .ok_or_else(|| anyhow!("no figure in {row:?}"))?;
    let kbytes: f64 = figure.parse().with_context(|| format!("{figure:?} in {row:?}"))?;
    Ok(kbytes * 1e3 / 1e9)
}

pub fn sockperf_describe(duration: Duration) -> String {
    format!(
        "sockperf ping-pong --tcp -i 127.0.0.1 -p PORT -m 64 -t {} (server: sockperf server --tcp -i 127.0.0.1 -p PORT)",
        whole_seconds(duration)
    )
}

/// Runs sockperf TCP ping-pong with 64-byte messages over loopback; returns its p50 in microseconds,
/// which sockperf reports one-way (RTT/2).
pub fn sockperf_p50(duration: Duration) -> Result<f64> {
    sockperf_percentiles(duration, &["50.000"]).map(|p| p[0])
}

/// [`sockperf_p50`] for each of `percentiles` (as sockperf prints them: `50.000`, `99.000`), one-way.
pub fn sockperf_percentiles(duration: Duration, percentiles: &[&str]) -> Result<Vec<f64>> {
    let port = free_port()?.to_string();
    let mut server = ServerGuard::spawn(
        "sockperf",
        Command::new("sockperf").args(["server", "--tcp", "-i", "127.0.0.1", "-p", &port]),
    )?;
    server.wait_listening(port.parse()?, LISTEN_TIMEOUT)?;
    let mut cmd = Command::new("sockperf");
    cmd.args(["ping-pong", "--tcp", "-i", "127.0.0.1", "-p", &port, "-m", "64"]);
    cmd.args(["-t", &whole_seconds(duration).to_string()]);
    let what = describe(&cmd);
    let out = run_captured(&mut cmd, duration + SLACK)?;
    if !out.status.success() {
        bail!("`{what}` failed ({}): {}", out.status, tail(&out.combined()));
    }
    drop(server);
    let output = out.combined();
    percentiles
        .iter()
        .map(|p| parse_sockperf_percentile(&output, p))
        .collect::<Result<_>>()
        .with_context(|| format!("reading the output of `{what}`"))
}

/// The value of sockperf's `percentile {percentile} =` line, in microseconds (one-way).
pub fn parse_sockperf_percentile(output: &str, percentile: &str) -> Result<f64> {
    let label = format!("percentile {percentile}");
    let line = output
        .lines()
        .find(|l| l.contains(&label))
        .ok_or_else(|| anyhow!("no `{label} =` line in sockperf output"))?;
    let value = line.rsplit('=').next().unwrap_or_default().trim();
    value.parse().with_context(|| format!("the {label} value of `{line}`"))
}

/// The last lines of a failed command's output, for error messages.
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

#[cfg(test)]
mod tests {

    #[test]
    fn cuda_rows_run_only_where_ferry_info_lists_a_device() {
        use serde_json::json;
        let none = json!({"cuda": {"unavailable": "no CUDA driver: libcuda.so.1 could not be opened", "devices": []}});
        assert_eq!(
            super::cuda_of_info(&none),
            Err("no CUDA driver: libcuda.so.1 could not be opened".to_string())
        );
        let empty = json!({"cuda": {"unavailable": null, "devices": []}});
        assert_eq!(
            super::cuda_of_info(&empty),
            Err("the CUDA driver lists no device".to_string())
        );
        let one = json!({"cuda": {"unavailable": null, "devices": [{"ordinal": 0}]}});
        assert_eq!(super::cuda_of_info(&one), Ok(()));
    }

    #[test]
    fn openssl_speed_rows_read_as_gb_per_s() {
        let out = "version: 3.0.17\nbuilt on: ...\nThe 'numbers' are in 1000s of bytes per second processed.\n\
                   type          16384 bytes\nAES-128-GCM    4301144.06k\n";
        let gb = parse_openssl_speed(out).unwrap();
        assert!((gb - 4.30114406).abs() < 1e-6, "{gb}");
        assert!(parse_openssl_speed("type 16384 bytes\n").is_err());
    }

    #[test]
    fn dd_summaries_read_as_gb_per_s() {
        let err = "512+0 records in\n512+0 records out\n536870912 bytes (537 MB, 512 MiB) copied, 0.335 s, 1.6 GB/s\n";
        let gb = parse_dd(err).unwrap();
        assert!((gb - 536870912.0 / 0.335 / 1e9).abs() < 1e-9, "{gb}");
        // One MiB: dd says "1.0 MiB" and a time in its own format all the same.
        let one = "1048576 bytes (1.0 MB, 1.0 MiB) copied, 0.00102 s, 1.0 GB/s\n";
        assert!((parse_dd(one).unwrap() - 1048576.0 / 0.00102 / 1e9).abs() < 1e-9);
        assert!(parse_dd("dd: failed to open 'x': Permission denied\n").is_err());
        assert!(parse_dd("0 bytes copied, 0 s, 0 kB/s\n").is_err());
    }

    use super::*;

    #[test]
    fn ferry_json_lines() {
        let out = "warming up\n{\"transport\":\"tcp\",\"op\":\"write\",\"size\":1048576,\"batch\":1,\"streams\":2,\"depth\":8,\"gb_per_s\":4.5,\"ops_per_s\":4291.5,\"p50_us\":400.0,\"p99_us\":900.5,\"peak_rss_bytes\":90000000,\"registered_bytes\":33554432}\n";
        let r = parse_ferry(out, "write", 1 << 20).ok();
        assert_eq!(
            r,
            Some(FerryResult {
                gb_per_s: 4.5,
                p50_us: 400.0,
                p99_us: 900.5,
                ops_per_s: 4291.5,
                peak_rss_bytes: 9e7,
                registered_bytes: 33554432.0,
                persist_share: 0.0,
            })
        );
        assert!(parse_ferry(out, "read", 1 << 20).is_err());
        assert!(parse_ferry(out, "write", 4096).is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64").ok(), Some(64));
        assert_eq!(parse_size("4KiB").ok(), Some(4096));
        assert_eq!(parse_size("16MiB").ok(), Some(16 << 20));
        assert!(parse_size("1MB").is_err());
    }

    #[test]
    fn iperf3_json() {
        let out = r#"{"start":{},"intervals":[],"end":{"sum_sent":{"bits_per_second":42.0e9},"sum_received":{"bits_per_second":42.657e9}}}"#;
        let gb = parse_iperf3(out).ok().unwrap_or_default();
        assert!((gb - 5.332125).abs() < 1e-6, "{gb}");
        assert!(parse_iperf3(r#"{"start":{},"error":"unable to connect to server"}"#).is_err());
    }

    /// Captured from `UCX_TLS=tcp,self ucx_perftest 127.0.0.1 -p P -t ucp_put_bw -s 1048576 -n 2000`
    /// (UCX 1.13.1, Debian bookworm).
    const UCX_OUT: &str = "\
+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |       overhead (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
[thread 0]              1389      0.140   719.922   719.922     1389.04    1389.04        1389        1389
Final:                  2000      0.140  2549.087  1278.732      392.30     782.02         392         782
";

    #[test]
    fn ucx_final_overall_column() {
        let gb = parse_ucx_final(UCX_OUT)
            .and_then(|f| bandwidth_gb_per_s(&f))
            .ok()
            .unwrap_or_default();
        assert!((gb - 782.02 * 1048576.0 / 1e9).abs() < 1e-9, "{gb}");
        assert!(parse_ucx_final("Waiting for connection...\n").is_err());
    }

    /// Captured from `sockperf ping-pong --tcp -i 127.0.0.1 -p P -m 64 -t 2` (sockperf 3.7).
    const SOCKPERF_OUT: &str = "\
sockperf: \x1b[2;35m====> avg-latency=34.902 (std-dev=18.347)\x1b[0m
sockperf: Summary: Latency is 34.902 usec
sockperf: ---> percentile 99.000 =  107.885
sockperf: ---> percentile 90.000 =   35.217
sockperf: ---> percentile 50.000 =   33.144
sockperf: ---> percentile 25.000 =   32.533
";

    #[test]
    fn sockperf_percentile_50() {
        assert_eq!(parse_sockperf_percentile(SOCKPERF_OUT, "50.000").ok(), Some(33.144));
        assert_eq!(parse_sockperf_percentile(SOCKPERF_OUT, "99.000").ok(), Some(107.885));
        assert!(parse_sockperf_percentile("sockperf: Test ended\n", "50.000").is_err());
    }

    #[test]
    fn whole_seconds_round_up() {
        assert_eq!(whole_seconds(Duration::from_millis(500)), 1);
        assert_eq!(whole_seconds(Duration::from_millis(2500)), 3);
        assert_eq!(whole_seconds(Duration::from_secs(3)), 3);
    }
}
