//! `cargo xtask rig powercut`: does a write acknowledged as persistent survive the target losing power?
//!
//! Why a guest and not a killed process: a killed process leaves its writes in the page cache, which
//! survives it, so a test that kills the process passes whether or not anything was flushed. Killing
//! qemu (SIGKILL) takes the guest's page cache with it, while what the guest handed to its virtual disk
//! is in the host's image file: a power cut.
//!
//! One trial: a fresh ext4 image holding a pre-allocated file (so the guest allocates no blocks), a
//! boot with timed write-back off (otherwise unflushed pages reach the disk within about 35 s and the
//! test passes vacuously), and ferry's `powercut` example in the guest: a target engine with the file
//! registered, an initiator engine that writes `--ranges` pages with durability persistent and as
//! many control pages with durability completed, then prints `powercut: ACK`. On that line the host
//! kills qemu, replays the journal (`e2fsck -fy`), dumps the file (`debugfs`) and compares. A trial
//! passes when no acknowledged persistent page is lost and at least one control page is (it was able
//! to lose data). A last trial per transport disables the target's persisting (a test-only switch of
//! the `fault-injection` feature) and must fail the check.
//!
//! Each trial prints one JSON line: `transport`, `method`, `acked`, `persisted`, `lost`,
//! `control_lost`, and whether persisting was disabled.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::Timings;
use super::boot::{Devices, Guest};
use super::test::run_json;
use crate::util::{cargo, run_captured};

/// The trial program's page patterns: the same source file, so the two cannot disagree.
#[path = "../../../crates/ferry/examples/powercut/pattern.rs"]
mod pattern;
use pattern::{PAGE, page};

/// What the file holds before a trial: a byte no page pattern is made of.
const FILLER: u8 = 0xee;

#[derive(clap::Args)]
pub struct Args {
    /// Trials per transport.
    #[arg(long, default_value_t = 5)]
    trials: u32,
    /// Pages written persistent per trial (and as many control pages, written completed).
    #[arg(long, default_value_t = 64)]
    ranges: usize,
    /// Pages per transfer in every second trial (the others write one page per transfer); at 32 a
    /// transfer spans several frames, persisted with one commit per stream. Every fourth trial
    /// names them with one descriptor (128 KiB at 32): a TCP target writes so large a range into
    /// the file with `pwrite` rather than through its mapping.
    #[arg(long, default_value_t = 32)]
    pages_per_write: usize,
    /// Transports to cut the power under (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "tcp,rdma")]
    transports: Vec<String>,
    /// Skip the trial with persisting disabled (which must fail the check).
    #[arg(long)]
    no_negative_control: bool,
}

/// One trial's result.
struct Trial {
    transport: String,
    method: String,
    pages_per_write: usize,
    /// One descriptor per transfer rather than one per page.
    whole: bool,
    acked: usize,
    persisted: usize,
    control_lost: usize,
    persist_disabled: bool,
    e2fsck: i32,
    seconds: f64,
}

impl Trial {
    fn lost(&self) -> usize {
        self.acked - self.persisted
    }

    /// The check a trial must pass: nothing acknowledged lost, and something unflushed lost.
    fn check(&self) -> std::result::Result<(), String> {
        if self.e2fsck > 1 {
            return Err(format!("e2fsck found errors it could not fix (status {})", self.e2fsck));
        }
        if self.lost() > 0 {
            return Err(format!(
                "{} of {} acknowledged persistent pages lost",
                self.lost(),
                self.acked
            ));
        }
        if self.control_lost == 0 {
            return Err("no control page was lost: the trial could not have lost data (vacuous)".into());
        }
        Ok(())
    }

    fn json(&self) -> Value {
        json!({
            "transport": self.transport,
            "method": self.method,
            "pages_per_write": self.pages_per_write,
            "descriptors": if self.whole { "write" } else { "page" },
            "acked": self.acked,
            "persisted": self.persisted,
            "lost": self.lost(),
            "control_lost": self.control_lost,
            "persist_disabled": self.persist_disabled,
            "e2fsck_status": self.e2fsck,
            "seconds": (self.seconds * 10.0).round() / 10.0,
        })
    }
}

pub fn run(args: &Args, guest: &Guest<'_>, timings: &mut Timings) -> Result<ExitCode> {
    if args.ranges == 0 || args.trials == 0 {
        bail!("--ranges and --trials must be at least 1");
    }
    let start = Instant::now();
    let program = build_program()?;
    timings.record("build powercut", start, "");
    let work = guest.layout.dir.join(format!("powercut-{}", std::process::id()));
    fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    // (transport, persisting disabled, pages per write, one descriptor per write)
    let mut plan: Vec<(String, bool, usize, bool)> = Vec::new();
    for transport in &args.transports {
        for k in 0..args.trials {
            let per = if k % 2 == 1 { args.pages_per_write.max(1) } else { 1 };
            plan.push((transport.clone(), false, per, k % 4 == 3));
        }
    }
    if !args.no_negative_control {
        for transport in &args.transports {
            plan.push((transport.clone(), true, 1, false));
        }
    }
    let mut failures = 0;
    // Per negative control: whether its check failed, as it must.
    let mut negatives: Vec<bool> = Vec::new();
    let trials_start = Instant::now();
    for (i, (transport, disabled, per, whole)) in plan.iter().enumerate() {
        let seed = seed(i);
        let trial = run_trial(
            &TrialSpec {
                program: &program,
                transport,
                ranges: args.ranges,
                pages_per_write: *per,
                whole: *whole,
                seed,
                persist_disabled: *disabled,
                work: &work,
            },
            guest,
        );
        match trial {
            Ok(t) => {
                println!("{}", t.json());
                match (t.check(), t.persist_disabled) {
                    (Ok(()), false) => eprintln!("rig powercut: trial {} ({transport}): pass", i + 1),
                    (Err(why), false) => {
                        failures += 1;
                        eprintln!("rig powercut: trial {} ({transport}): FAIL: {why}", i + 1);
                    }
                    (Err(why), true) => {
                        eprintln!(
                            "rig powercut: {transport} with persisting disabled: the check failed, as it must ({why})"
                        );
                        negatives.push(true);
                    }
                    (Ok(()), true) => {
                        failures += 1;
                        eprintln!(
                            "rig powercut: {transport} with persisting disabled, yet the check passed: it cannot tell a target that persists from one that does not"
                        );
                        negatives.push(false);
                    }
                }
            }
            Err(e) => {
                failures += 1;
                eprintln!("rig powercut: trial {} ({transport}) did not complete: {e:#}", i + 1);
            }
        }
    }
    timings.add("trials", trials_start.elapsed());
    let _ = fs::remove_dir_all(&work);
    let caught = negatives.iter().filter(|&&failed| failed).count();
    eprintln!(
        "rig powercut: {} trials, {failures} failed; {caught} of {} runs with persisting disabled failed the check, as they must",
        plan.len(),
        plan.iter().filter(|p| p.1).count()
    );
    Ok(if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// A different pattern every trial, so that a stale image can never pass.
fn seed(trial: usize) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    now ^ ((trial as u64) << 48) ^ u64::from(std::process::id())
}

/// Builds the `powercut` example of ferry (release, with RDMA and the test-only switch) and returns its path.
fn build_program() -> Result<PathBuf> {
    let mut cmd = cargo();
    cmd.args([
        "build",
        "--release",
        "-p",
        "ferry",
        "--example",
        "powercut",
        "--features",
        "rdma,fault-injection",
        "--message-format=json",
    ]);
    let stdout = run_json(&mut cmd, Duration::from_secs(45 * 60))?;
    stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "powercut")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .context("cargo built no powercut executable")
}

struct TrialSpec<'a> {
    program: &'a Path,
    transport: &'a str,
    ranges: usize,
    pages_per_write: usize,
    whole: bool,
    seed: u64,
    persist_disabled: bool,
    work: &'a Path,
}

fn run_trial(spec: &TrialSpec<'_>, guest: &Guest<'_>) -> Result<Trial> {
    let started = Instant::now();
    let image = ext4_image(spec.work, 2 * spec.ranges * PAGE)?;
    let script = format!(
        "set -e\n\
         mkdir -p /tmp/powercut\n\
         mount -t ext4 /dev/vda /tmp/powercut\n\
         # No timed write-back: only what is flushed on purpose reaches the disk.\n\
         echo 0 > /proc/sys/vm/dirty_writeback_centisecs\n\
         echo 360000 > /proc/sys/vm/dirty_expire_centisecs\n\
         echo 90 > /proc/sys/vm/dirty_background_ratio\n\
         echo 95 > /proc/sys/vm/dirty_ratio\n\
         exec {} --file /tmp/powercut/data --transport {} --ranges {} --pages-per-write {} \
         --descriptors {} --seed {} --listen 10.0.2.15:0\n",
        super::boot::sh_quote(&spec.program.display().to_string()),
        spec.transport,
        spec.ranges,
        spec.pages_per_write,
        if spec.whole { "write" } else { "page" },
        spec.seed,
    );
    let guest = guest.with_devices(Devices {
        disk: Some(image.clone()),
        kill_on: Some("powercut: ACK".into()),
        ..Default::default()
    });
    let env: Vec<(&str, &str)> = if spec.persist_disabled {
        vec![("FERRY_FAULT_SKIP_PERSIST", "1")]
    } else {
        Vec::new()
    };
    let outcome = guest.run(&script, &env)?;
    if outcome.killed_on.is_none() {
        let status = outcome.command_status();
        bail!("the guest never acknowledged its writes (powercut exited: {status:?}); console output above");
    }
    let method = outcome
        .console
        .iter()
        .find_map(|l| l.strip_prefix("powercut: transport="))
        .and_then(|rest| rest.split_whitespace().find_map(|w| w.strip_prefix("method=")))
        .unwrap_or("?")
        .to_owned();
    let (e2fsck, data) = read_back(&image, spec.work)?;
    let _ = fs::remove_file(&image);
    let (persisted, control_survived) = compare(&data, spec.ranges, spec.seed)?;
    Ok(Trial {
        transport: spec.transport.to_owned(),
        method,
        pages_per_write: spec.pages_per_write,
        whole: spec.whole,
        acked: spec.ranges,
        persisted,
        control_lost: spec.ranges - control_survived,
        persist_disabled: spec.persist_disabled,
        e2fsck,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// An ext4 image (in the folder `work`, created) whose `/data` holds `len` filler bytes in allocated
/// blocks (mke2fs -d skips blocks of zeros, which would leave holes for the guest to allocate); with
/// 16 MiB to spare.
pub(super) fn ext4_image(work: &Path, len: usize) -> Result<PathBuf> {
    let content = work.join("content");
    fs::create_dir_all(&content).with_context(|| format!("creating {}", content.display()))?;
    if len > 0 {
        fs::write(content.join("data"), vec![FILLER; len]).context("writing the data file")?;
    }
    let image = work.join("disk.img");
    let _ = fs::remove_file(&image);
    let size_kib = (len / 1024 + 16 * 1024).to_string();
    let out = run_captured(
        Command::new("mke2fs")
            .args(["-q", "-F", "-t", "ext4", "-b", "4096", "-d"])
            .arg(&content)
            .arg(&image)
            .arg(size_kib),
        Duration::from_secs(120),
    )?;
    if !out.status.success() {
        bail!("mke2fs failed ({}): {}", out.status, out.combined().trim());
    }
    Ok(image)
}

/// Replays the journal and repairs (`e2fsck -fy`; its status), then dumps `/data`.
fn read_back(image: &Path, work: &Path) -> Result<(i32, Vec<u8>)> {
    let fsck = run_captured(Command::new("e2fsck").arg("-fy").arg(image), Duration::from_secs(120))?;
    let e2fsck = fsck.status.code().unwrap_or(-1);
    let dumped = work.join("data.out");
    let _ = fs::remove_file(&dumped);
    let out = run_captured(
        Command::new("debugfs")
            .arg("-R")
            .arg(format!("dump /data {}", dumped.display()))
            .arg(image),
        Duration::from_secs(120),
    )?;
    let data = fs::read(&dumped)
        .with_context(|| format!("debugfs dumped no /data ({}): {}", out.status, out.combined().trim()))?;
    let _ = fs::remove_file(&dumped);
    Ok((e2fsck, data))
}

/// How many persistent pages and how many control pages hold their pattern.
fn compare(data: &[u8], ranges: usize, seed: u64) -> Result<(usize, usize)> {
    if data.len() < 2 * ranges * PAGE {
        bail!("the file has {} bytes, expected {}", data.len(), 2 * ranges * PAGE);
    }
    let intact = |index: usize, control: bool| {
        let at = if control { ranges + index } else { index } * PAGE;
        data[at..at + PAGE] == page(seed, index, control)[..]
    };
    let persisted = (0..ranges).filter(|&i| intact(i, false)).count();
    let control = (0..ranges).filter(|&i| intact(i, true)).count();
    Ok((persisted, control))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparison_counts_pages() {
        let ranges = 3;
        let seed = 42;
        let mut data = vec![FILLER; 2 * ranges * PAGE];
        for (i, control) in [(0, false), (2, false), (1, true)] {
            let at = if control { ranges + i } else { i } * PAGE;
            data[at..at + PAGE].copy_from_slice(&page(seed, i, control));
        }
        assert_eq!(compare(&data, ranges, seed).unwrap(), (2, 1));
        assert_eq!(
            compare(&data, ranges, seed + 1).unwrap(),
            (0, 0),
            "another trial's seed matches nothing"
        );
        assert!(compare(&data[..100], ranges, seed).is_err());
    }

    #[test]
    fn checks() {
        let t = |persisted, control_lost, e2fsck| Trial {
            transport: "tcp".into(),
            method: "flush-before-ack".into(),
            pages_per_write: 1,
            whole: false,
            acked: 4,
            persisted,
            control_lost,
            persist_disabled: false,
            e2fsck,
            seconds: 1.0,
        };
        assert!(t(4, 2, 0).check().is_ok());
        assert!(
            t(4, 2, 1).check().is_ok(),
            "e2fsck status 1: errors corrected (the journal)"
        );
        assert!(t(3, 2, 0).check().is_err(), "a lost acknowledged page");
        assert!(t(4, 0, 0).check().is_err(), "vacuous");
        assert!(t(4, 2, 4).check().is_err(), "uncorrected file-system errors");
        assert_eq!(t(3, 2, 0).json()["lost"], 1);
    }
}
