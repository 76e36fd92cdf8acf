//! `cargo xtask rig bench`: perftest (`ib_write_bw`, `ib_read_bw`) and `ferry bench --transport rdma`
//! at 64 KiB and 1 MiB, in one guest boot, as medians and ratios; and persistent 64 KiB writes (WRITE
//! then FLUSH into device DAX on the emulated NVDIMM, with rdma-core 55) against `ib_write_bw`.
//!
//! Why in one boot, alternating: under TCG everything is CPU-bound and noisy (±30 % run to run), so a
//! number from another boot says little; each round runs perftest and then ferry for every case, and
//! the report compares medians from the same boot. Why iteration counts rather than durations for
//! perftest: a fixed amount of data (64 MiB per run) keeps a run a few seconds long at rxe's tens of
//! MB/s, whatever the message size.
//!
//! Each round also writes 1 MiB over both rails, over one, and over one with two queue pairs.
//! After the rounds, registration is measured once (`ferry register-cost`): 10,000 regions of 4 KiB and
//! one large region (`--large-region`, 1 GiB by default; the guest gets 1 GiB more memory than that)
//! in small pages and in transparent huge pages, on one rail and on both (a large region is registered
//! on every rail at once, and once more in turn).
//!
//! Units: perftest's "BW average[MB/sec]" uses MB = 2^20 B (its format factor is 0x100000), and
//! `--report_gbits` would print Gb/sec = 10^9 bit/s; both become GB/s = 10^9 B/s here, ferry's unit.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::Timings;
use super::boot::{Devices, Guest, sh_quote};
use super::pmem::{self, DEVDAX_SETUP};
use crate::peers::{parse_ferry, parse_size};
use crate::util::{cargo, cargo_metadata, run_step, target_dir};

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object per case on stdout (the table then goes to stderr).
    #[arg(long)]
    json: bool,
    /// Runs of each case; the report uses the median.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Use this ferry binary instead of building ferry-cli with `--features rdma`.
    #[arg(long, value_name = "PATH")]
    ferry_bin: Option<PathBuf>,
    /// The large region registration is measured on, in whole GiB ("16GiB"); the guest gets 1 GiB
    /// more memory than this, which the host must have available.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = large_region)]
    large_region: u64,
}

/// `--large-region`: whole GiB, at least one.
fn large_region(text: &str) -> std::result::Result<u64, String> {
    let bytes = parse_size(text).map_err(|e| format!("{e:#}"))?;
    if bytes == 0 || bytes % (1 << 30) != 0 {
        return Err(format!("{text}: a whole number of GiB (1GiB, 16GiB)"));
    }
    Ok(bytes >> 30)
}

/// Fails unless the host has `gib` GiB of memory available (`MemAvailable`) beside a margin of 1 GiB:
/// a guest that touches more than the host has would be killed, or take the host down with it.
fn check_host_memory(gib: u64) -> Result<()> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let available_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no MemAvailable in /proc/meminfo")?;
    let available_gib = available_kib as f64 / f64::from(1u32 << 20);
    if available_gib < (gib + 1) as f64 {
        bail!(
            "the guest would need {gib} GiB and the host has {available_gib:.1} GiB available: \
             choose a smaller --large-region"
        );
    }
    Ok(())
}

/// Bytes each perftest run moves; the iteration count follows from the message size.
const BYTES_PER_RUN: u64 = 64 << 20;

/// How long each `ferry bench` case measures.
const FERRY_DURATION: &str = "2s";

/// One comparison: an operation at a message size, and for writes its durability.
struct Case {
    op: &'static str,
    size: &'static str,
    /// Persistent writes into device DAX (FLUSH after the writes), with rdma-core 55.
    persistent: bool,
    /// The ratio this comparison aims for.
    target: f64,
}

const fn case(op: &'static str, size: &'static str) -> Case {
    Case {
        op,
        size,
        persistent: false,
        target: 0.8,
    }
}

/// Where the persistent case writes: the emulated NVDIMM as device DAX.
const DEVDAX: &str = "/dev/dax0.0";

const CASES: &[Case] = &[
    case("write", "64KiB"),
    case("write", "1MiB"),
    case("read", "64KiB"),
    case("read", "1MiB"),
    Case {
        persistent: true,
        target: 0.5,
        ..case("write", "64KiB")
    },
];

impl Case {
    fn name(&self) -> String {
        if self.persistent {
            format!("{} {} persistent (FLUSH)", self.op, self.size)
        } else {
            format!("{} {}", self.op, self.size)
        }
    }

    fn key(&self) -> String {
        if self.persistent {
            format!("{}-{}-persistent", self.op, self.size)
        } else {
            format!("{}-{}", self.op, self.size)
        }
    }

    fn peer(&self) -> &'static str {
        if self.op == "write" {
            "ib_write_bw"
        } else {
            "ib_read_bw"
        }
    }

    fn bytes(&self) -> u64 {
        parse_size(self.size).unwrap_or(1)
    }

    fn iterations(&self) -> u64 {
        (BYTES_PER_RUN / self.bytes()).max(16)
    }

    fn peer_command(&self, port: &str) -> String {
        format!(
            "{} -d rxe0 -s {} -n {} -F -p {port}",
            self.peer(),
            self.bytes(),
            self.iterations()
        )
    }

    fn ferry_args(&self) -> String {
        let durability = if self.persistent {
            format!(" --durability persistent --target-file {DEVDAX}")
        } else {
            String::new()
        };
        format!(
            "bench --transport rdma --op {} --size {} --duration {FERRY_DURATION}{durability} --json",
            self.op, self.size
        )
    }
}

/// The multi-rail comparison: the same `ferry bench` case on both of the guest's rails and on one.
const RAILS_CASE: &str = "bench --transport rdma --op write --size 1MiB --duration 2s --json";
/// The rails of the two-rail run.
const TWO_RAILS: &str = "rxe0,rxe1";

/// The registration runs: name, devices, whether a large region is registered on the rails at once,
/// `ferry register-cost` arguments (`LARGE` stands for `--large-region`).
const REGISTRATION: [(&str, &str, bool, &str); 8] = [
    ("reg-many-1", "rxe0", true, "--regions 10000 --size 4KiB"),
    ("reg-many-2", TWO_RAILS, true, "--regions 10000 --size 4KiB"),
    ("reg-large-1", "rxe0", true, "--regions 1 --size LARGE --pages small"),
    (
        "reg-large-1-huge",
        "rxe0",
        true,
        "--regions 1 --size LARGE --pages huge",
    ),
    ("reg-large-2", TWO_RAILS, true, "--regions 1 --size LARGE --pages small"),
    (
        "reg-large-2-serial",
        TWO_RAILS,
        false,
        "--regions 1 --size LARGE --pages small",
    ),
    (
        "reg-large-2-huge",
        TWO_RAILS,
        true,
        "--regions 1 --size LARGE --pages huge",
    ),
    (
        "reg-large-2-huge-serial",
        TWO_RAILS,
        false,
        "--regions 1 --size LARGE --pages huge",
    ),
];

/// The ferry binary, or why there is none.
enum Ferry {
    Bin(PathBuf),
    Unavailable { reason: String, is_error: bool },
}

pub fn run(args: &Args, guest: &Guest<'_>, timings: &mut Timings) -> Result<ExitCode> {
    let start = Instant::now();
    let ferry = match &args.ferry_bin {
        Some(bin) => Ferry::Bin(
            bin.canonicalize()
                .with_context(|| format!("no ferry binary at {}", bin.display()))?,
        ),
        None => build_ferry(),
    };
    timings.record("build ferry", start, "");
    if let Ferry::Unavailable { reason, .. } = &ferry {
        eprintln!("rig bench: ferry's column is unavailable: {reason}");
    }
    let ferry_bin = match &ferry {
        Ferry::Bin(bin) => Some(bin.clone()),
        Ferry::Unavailable { .. } => None,
    };
    let memory_gib = args.large_region + 1;
    check_host_memory(memory_gib)?;
    let rdma_core = pmem::rdma_core_55(guest.layout, timings)?;
    let large = format!("{}GiB", args.large_region);
    let script = guest_script(args.rounds, ferry_bin.as_ref(), &rdma_core.env(), &large);
    let nvdimm = pmem::nvdimm_image(&guest.layout.dir)?;
    let guest = guest.with_devices(Devices {
        nvdimm: Some(nvdimm.clone()),
        memory_gib: Some(memory_gib),
        ..Default::default()
    });
    let outcome = guest.run(&script, &[]);
    let _ = std::fs::remove_file(&nvdimm);
    let outcome = outcome?;
    outcome.record(timings);
    if let Err(e) = outcome.command_status() {
        eprintln!("rig bench: {e:#}");
    }

    let mut rows = Vec::new();
    let mut complete = true;
    for case in CASES {
        let mut peer = Samples::default();
        let mut ferry_samples = Samples::default();
        for round in 1..=args.rounds {
            let name = format!("{}-peer-{round}", case.key());
            peer.add(read_run(&outcome, &name).and_then(|out| parse_perftest(&out, case.bytes())));
            if ferry_bin.is_some() {
                let name = format!("{}-ferry-{round}", case.key());
                ferry_samples.add(
                    read_run(&outcome, &name)
                        .and_then(|out| parse_ferry(&out, case.op, case.bytes()).map(|r| r.gb_per_s)),
                );
            }
        }
        complete &= !peer.values.is_empty() && (ferry_bin.is_none() || !ferry_samples.values.is_empty());
        let ferry_error = match &ferry {
            Ferry::Unavailable { reason, .. } => Some(format!("unavailable: {reason}")),
            Ferry::Bin(_) => ferry_samples.error.clone(),
        };
        rows.push(Row::new(case, args.rounds, &ferry, &ferry_samples, &peer, ferry_error));
    }
    let mut table = render_table(&rows, &ferry, args.rounds);
    if ferry_bin.is_some() {
        let (rails, line) = rails_comparison(&outcome, args.rounds);
        complete &= rails.is_some();
        table += &line;
        let (measured, lines) = registration_report(&outcome, &large);
        complete &= measured;
        table += &lines;
    }
    if args.json {
        eprint!("{table}");
        for row in &rows {
            println!("{}", row.json);
        }
    } else {
        print!("{table}");
    }
    let ferry_failed = matches!(ferry, Ferry::Unavailable { is_error: true, .. });
    Ok(if complete && !ferry_failed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Two rails against one, and two queue pairs on one rail against one (write 1MiB, the median over
/// rounds of each); returns the two-rail ratio and the report's lines. Under TCG the rails share the
/// guest's two vCPUs: the ratios show that both carry traffic and what spreading costs, not what two
/// NICs would give.
fn rails_comparison(outcome: &super::boot::Outcome, rounds: u32) -> (Option<f64>, String) {
    let median = |prefix: &str| {
        let mut samples = Samples::default();
        for round in 1..=rounds {
            let name = format!("{prefix}-{round}");
            samples
                .add(read_run(outcome, &name).and_then(|out| parse_ferry(&out, "write", 1 << 20).map(|r| r.gb_per_s)));
        }
        (samples.median(), samples.error)
    };
    let ((two, two_error), (one, one_error), (qps, qps_error)) =
        (median("rails-2"), median("rails-1"), median("qps-2"));
    let ratio = |a: Option<f64>| a.zip(one).filter(|(_, one)| *one > 0.0).map(|(a, one)| a / one);
    let show = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"));
    let show_ratio = |r: Option<f64>| r.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}"));
    let mut line = format!(
        "
write 1MiB over two rails ({TWO_RAILS}) / over one (rxe0): {} / {} GB/s = {} (medians over {rounds} round(s); \
         1.3 or more is expected with two vCPUs)
write 1MiB over one rail with two queue pairs / with one: {} / {} GB/s = {}\n",
        show(two),
        show(one),
        show_ratio(ratio(two)),
        show(qps),
        show(one),
        show_ratio(ratio(qps)),
    );
    for e in [two_error, one_error, qps_error].into_iter().flatten() {
        line += &format!("  ERROR (rails): {e}\n");
    }
    (ratio(two).filter(|_| ratio(qps).is_some()), line)
}

/// The registration runs' lines (per region for the many small ones, per GiB for the large one),
/// and whether every run gave a figure.
fn registration_report(outcome: &super::boot::Outcome, large: &str) -> (bool, String) {
    let mut all = true;
    let mut text = String::from("\nregistration (ferry register-cost, touched memory, once):\n");
    for (name, devices, parallel, args) in REGISTRATION {
        // Only a large region is registered on the rails at once.
        let is_large = args.contains("LARGE");
        let args = args.replace("LARGE", large);
        let devices = match (parallel, devices.contains(',') && is_large) {
            (_, false) => devices.to_string(),
            (false, true) => format!("{devices}, in turn"),
            (true, true) => format!("{devices}, at once"),
        };
        let figure = read_run(outcome, name).and_then(|out| {
            let line = out.lines().find(|l| l.starts_with('{')).context("no JSON line")?;
            let v: Value = serde_json::from_str(line).with_context(|| format!("not JSON: {line}"))?;
            let num = |k: &str| v[k].as_f64().with_context(|| format!("no `{k}` in {line}"));
            Ok(match v["regions"].as_u64() {
                Some(1) => format!(
                    "{:.0} ms per GiB ({} MiB of it in huge pages)",
                    num("per_gib_ms")?,
                    num("huge_bytes")? as u64 >> 20
                ),
                _ => format!("{:.1} µs per region", num("per_region_us")?),
            })
        });
        match figure {
            Ok(f) => text += &format!("  {args} on {devices}: {f}\n"),
            Err(e) => {
                all = false;
                text += &format!("  {args} on {devices}: ERROR {e:#}\n");
            }
        }
    }
    (all, text)
}

/// `target/release/ferry` built with `--features rdma`, when ferry-cli has that feature.
fn build_ferry() -> Ferry {
    let meta = match ferry_cli_metadata() {
        Ok(meta) => meta,
        Err(e) => {
            return Ferry::Unavailable {
                reason: format!("{e:#}"),
                is_error: true,
            };
        }
    };
    let (has_rdma, target_dir) = meta;
    if !has_rdma {
        return Ferry::Unavailable {
            reason: "ferry-cli has no `rdma` feature yet".into(),
            is_error: false,
        };
    }
    let build = run_step(
        cargo().args(["build", "--release", "-p", "ferry-cli", "--features", "rdma"]),
        Duration::from_secs(45 * 60),
    );
    match build {
        Ok(()) => Ferry::Bin(target_dir.join("release/ferry")),
        Err(e) => Ferry::Unavailable {
            reason: format!("building it failed: {e:#}"),
            is_error: true,
        },
    }
}

/// Whether ferry-cli declares an `rdma` feature, and the workspace's target folder.
fn ferry_cli_metadata() -> Result<(bool, PathBuf)> {
    let meta = cargo_metadata()?;
    let cli = meta["packages"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "ferry-cli"))
        .context("no ferry-cli package in the workspace")?;
    Ok((cli["features"].get("rdma").is_some(), target_dir(&meta)?))
}

/// The guest's part: every round runs each case's perftest pair, then ferry, each run's stdout to
/// `<case>-<peer|ferry>-<round>.out`, stderr to `.err` and status to `.rc`.
fn guest_script(rounds: u32, ferry: Option<&PathBuf>, rdma_core_55: &[(&str, String)], large: &str) -> String {
    let mut script = String::from(DEVDAX_SETUP);
    script += r#"bad=0
setup_devdax || bad=1
# Whether a TCP socket listens on port $1 (perftest's out-of-band exchange), per /proc/net/tcp{,6}.
listening() {
  awk -v p="$(printf %04X "$1")" '$4 == "0A" && $2 ~ (":" p "$") { f = 1 } END { exit !f }' /proc/net/tcp /proc/net/tcp6 2>/dev/null
}
# peer NAME PORT SERVER-COMMAND...: the server in the background, the client to 10.0.2.15.
peer() {
  name=$1; port=$2; shift 2
  timeout 300 "$@" > "$RIG_DIR/$name.server" 2>&1 &
  server=$!
  i=0
  until listening "$port"; do
    i=$((i + 1))
    if [ $i -gt 400 ] || ! kill -0 $server 2>/dev/null; then break; fi
    sleep 0.05
  done
  timeout 300 "$@" 10.0.2.15 > "$RIG_DIR/$name.out" 2> "$RIG_DIR/$name.err"
  rc=$?
  echo $rc > "$RIG_DIR/$name.rc"
  wait $server
  [ $rc = 0 ] || bad=1
  grep -A1 '#bytes' "$RIG_DIR/$name.out" | tail -n 1
}
# ferry NAME ARGS...
ferry() {
  name=$1; shift
  timeout 300 "$@" > "$RIG_DIR/$name.out" 2> "$RIG_DIR/$name.err"
  rc=$?
  echo $rc > "$RIG_DIR/$name.rc"
  [ $rc = 0 ] || bad=1
  grep '^{' "$RIG_DIR/$name.out"
}
"#;
    let mut port = 18515u16;
    for round in 1..=rounds {
        for case in CASES {
            script += &format!(
                "echo {}\n",
                sh_quote(&format!("rig bench: round {round}/{rounds}: {}", case.name()))
            );
            script += &format!(
                "peer {}-peer-{round} {port} {}\n",
                case.key(),
                case.peer_command(&port.to_string())
            );
            port += 1;
            if let Some(bin) = ferry {
                // The persistent case posts FLUSH, which needs rdma-core 55's libibverbs.
                let env: String = if case.persistent {
                    let vars: Vec<String> = rdma_core_55
                        .iter()
                        .map(|(k, v)| format!("{k}={}", sh_quote(v)))
                        .collect();
                    format!("env {} ", vars.join(" "))
                } else {
                    String::new()
                };
                script += &format!(
                    "ferry {}-ferry-{round} {env}{} {}\n",
                    case.key(),
                    sh_quote(&bin.display().to_string()),
                    case.ferry_args()
                );
            }
        }
        if let Some(bin) = ferry {
            let bin = sh_quote(&bin.display().to_string());
            script += &format!("echo 'rig bench: round {round}/{rounds}: write 1MiB, two rails and one'\n");
            script += &format!("ferry rails-2-{round} env FERRY_RDMA_DEVICES={TWO_RAILS} {bin} {RAILS_CASE}\n");
            script += &format!("ferry rails-1-{round} env FERRY_RDMA_DEVICES=rxe0 {bin} {RAILS_CASE}\n");
            script += &format!(
                "ferry qps-2-{round} env FERRY_RDMA_DEVICES=rxe0 FERRY_RDMA_QUEUE_PAIRS=2 {bin} {RAILS_CASE}\n"
            );
        }
    }
    if let Some(bin) = ferry {
        let bin = sh_quote(&bin.display().to_string());
        script += "echo 'rig bench: registration'\n";
        for (name, devices, parallel, args) in REGISTRATION {
            let parallel = u8::from(parallel);
            let args = args.replace("LARGE", large);
            script += &format!(
                "ferry {name} env FERRY_RDMA_DEVICES={devices} FERRY_RDMA_PARALLEL_REGISTRATION={parallel} {bin} \
                 register-cost {args} --json\n"
            );
        }
    }
    script += "exit $bad\n";
    script
}

/// A run's stdout, or why it failed (its status and the tail of its stderr).
fn read_run(outcome: &super::boot::Outcome, name: &str) -> Result<String> {
    let rc = outcome.read(&format!("{name}.rc"));
    let out = outcome.read(&format!("{name}.out")).unwrap_or_default();
    let err = outcome.read(&format!("{name}.err")).unwrap_or_default();
    match rc.as_deref().map(str::trim) {
        Some("0") => Ok(out),
        Some(rc) => {
            let text = format!("{out}{err}");
            let tail: Vec<&str> = text.lines().rev().take(5).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!("{name} exited with status {rc}: {}", tail.join(" | "))
        }
        None => bail!("{name} did not run (the guest stopped early?)"),
    }
}

/// perftest's BW average for `size`-byte messages, in GB/s (10^9 B/s).
fn parse_perftest(stdout: &str, size: u64) -> Result<f64> {
    let mut scale = None;
    for line in stdout.lines().map(str::trim) {
        if line.starts_with("#bytes") {
            let unit = line
                .split("average[")
                .nth(1)
                .and_then(|rest| rest.split(']').next())
                .context("perftest's header has no `BW average[unit]` column")?;
            scale = Some(match unit {
                "MB/sec" => f64::from(1u32 << 20) / 1e9,
                "Gb/sec" => 1.0 / 8.0,
                other => bail!("unknown perftest bandwidth unit `{other}`"),
            });
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        if let (Some(scale), [bytes, _iterations, _peak, average, ..]) = (scale, fields.as_slice())
            && bytes.parse::<u64>().ok() == Some(size)
        {
            let average: f64 = average
                .parse()
                .with_context(|| format!("perftest's BW average `{average}` is not a number"))?;
            return Ok(average * scale);
        }
    }
    bail!("no perftest result row for {size}-byte messages in:\n{stdout}")
}

#[derive(Default)]
struct Samples {
    values: Vec<f64>,
    error: Option<String>,
}

impl Samples {
    fn add(&mut self, sample: Result<f64>) {
        match sample {
            Ok(v) => self.values.push(v),
            Err(e) => {
                self.error.get_or_insert_with(|| format!("{e:#}"));
            }
        }
    }

    fn median(&self) -> Option<f64> {
        crate::bench::median(&self.values)
    }
}

struct Row {
    cells: [String; 5],
    json: Value,
}

impl Row {
    fn new(case: &Case, rounds: u32, ferry: &Ferry, f: &Samples, p: &Samples, ferry_error: Option<String>) -> Self {
        let (ferry_gb, peer_gb) = (f.median(), p.median());
        let ratio = ferry_gb.zip(peer_gb).filter(|(_, p)| *p > 0.0).map(|(f, p)| f / p);
        let show = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"));
        let ferry_command = match ferry {
            Ferry::Bin(bin) => Some(format!("{} {}", bin.display(), case.ferry_args())),
            Ferry::Unavailable { .. } => None,
        };
        let cells = [
            case.name(),
            if matches!(ferry, Ferry::Bin(_)) {
                show(ferry_gb)
            } else {
                "unavailable".into()
            },
            case.peer().to_owned(),
            show(peer_gb),
            ratio.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}")),
        ];
        let json = json!({
            "case": case.name(),
            "op": case.op,
            "durability": if case.persistent { "persistent" } else { "completed" },
            "target_ratio": case.target,
            "size_bytes": case.bytes(),
            "ferry_gb_per_s": ferry_gb,
            "peer": case.peer(),
            "peer_gb_per_s": peer_gb,
            "ratio": ratio,
            "rounds": rounds,
            "ferry_samples": f.values,
            "peer_samples": p.values,
            "ferry_command": ferry_command,
            "peer_command": format!("{} 10.0.2.15 (server: the same without the address)", case.peer_command("PORT")),
            "ferry_error": ferry_error,
            "peer_error": p.error,
        });
        Row { cells, json }
    }
}

fn render_table(rows: &[Row], ferry: &Ferry, rounds: u32) -> String {
    let header = ["case", "ferry GB/s", "peer", "peer GB/s", "ratio"];
    let cells: Vec<[String; 5]> = rows.iter().map(|r| r.cells.clone()).collect();
    let mut out =
        format!("\nferry vs perftest on Soft-RoCE (rxe0, one guest boot): medians over {rounds} round(s)\n\n");
    out += &crate::util::columns(header, &cells);
    out += "\nnotes:\n";
    out += "  targets: ratio >= 0.8; the persistent row (WRITE + FLUSH into device DAX, rdma-core 55) >= 0.5.\n";
    out += "  GB/s = 10^9 B/s; perftest's `BW average[MB/sec]` uses MB = 2^20 B and is converted.\n";
    out += &format!(
        "  perftest: {} MiB per run (-n = that / size), server and client on rxe0, client to 10.0.2.15.\n",
        BYTES_PER_RUN >> 20
    );
    if let Ferry::Unavailable { reason, .. } = ferry {
        out += &format!("  ferry: unavailable: {reason}\n");
    }
    for row in rows {
        for key in ["peer_error", "ferry_error"] {
            if let Some(e) = row.json[key].as_str().filter(|e| !e.starts_with("unavailable")) {
                out += &format!("  ERROR {} ({key}): {e}\n", row.cells[0]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client's output from `ib_write_bw -d rxe0 -s 65536 -F 10.0.2.15` in the guest (6.12, TCG).
    const WRITE_BW: &str = "\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF		Device         : rxe0
 Link type       : Ethernet
 GID index       : 1
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 65536      5000             72.25              69.99  		   0.001120
---------------------------------------------------------------------------------------
";

    #[test]
    fn perftest_average_in_gb_per_s() {
        let gb = parse_perftest(WRITE_BW, 65536).ok();
        let expected = 69.99 * 1_048_576.0 / 1e9;
        assert!(gb.is_some_and(|g| (g - expected).abs() < 1e-9), "{gb:?}");
        assert!(parse_perftest(WRITE_BW, 1 << 20).is_err());
        let gbits = WRITE_BW.replace("[MB/sec]", "[Gb/sec]");
        assert!(parse_perftest(&gbits, 65536).is_ok_and(|g| (g - 69.99 / 8.0).abs() < 1e-9));
    }

    #[test]
    fn medians() {
        let mut s = Samples::default();
        assert_eq!(s.median(), None);
        for v in [3.0, 1.0, 2.0] {
            s.add(Ok(v));
        }
        assert_eq!(s.median(), Some(2.0));
        s.add(Err(anyhow::anyhow!("x")));
        assert_eq!(s.error.as_deref(), Some("x"));
    }

    #[test]
    fn the_large_region_is_whole_gib() {
        assert_eq!(large_region("16GiB"), Ok(16));
        assert_eq!(large_region("1GiB"), Ok(1));
        assert!(large_region("1536MiB").unwrap_err().contains("whole number of GiB"));
        assert!(large_region("0GiB").is_err());
        assert!(large_region("lots").is_err());
    }

    #[test]
    fn script_alternates_and_uses_fresh_ports() {
        let env = [("LD_LIBRARY_PATH", "/v55".to_string())];
        let script = guest_script(2, Some(&PathBuf::from("/t/ferry")), &env, "1GiB");
        assert!(script.contains("peer write-64KiB-peer-1 18515 ib_write_bw -d rxe0 -s 65536 -n 1024 -F -p 18515\n"));
        assert!(script.contains("peer read-1MiB-peer-2 18523 ib_read_bw -d rxe0 -s 1048576 -n 64 -F -p 18523\n"));
        assert!(script.contains(
            "ferry write-1MiB-ferry-1 /t/ferry bench --transport rdma --op write --size 1MiB --duration 2s --json\n"
        ));
        assert!(script.contains(
            "ferry write-64KiB-persistent-ferry-1 env LD_LIBRARY_PATH=/v55 /t/ferry bench --transport rdma --op write \
             --size 64KiB --duration 2s --durability persistent --target-file /dev/dax0.0 --json\n"
        ));
        assert!(script.contains("setup_devdax || bad=1"));
        assert!(script.contains(
            "ferry reg-large-2-huge-serial env FERRY_RDMA_DEVICES=rxe0,rxe1 FERRY_RDMA_PARALLEL_REGISTRATION=0 \
             /t/ferry register-cost --regions 1 --size 1GiB --pages huge --json\n"
        ));
        assert!(!guest_script(1, None, &env, "1GiB").contains("\nferry write"));
        assert!(!guest_script(1, None, &env, "1GiB").contains("register-cost"));
        assert!(
            guest_script(1, Some(&PathBuf::from("/t/ferry")), &env, "12GiB")
                .contains("register-cost --regions 1 --size 12GiB --pages huge --json\n")
        );
    }
}
