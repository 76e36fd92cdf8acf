//! `cargo xtask rig test`: the `ferry-rdma` integration tests against real verbs, in one guest boot.
//!
//! Why build on the host and run in the guest: compiling under TCG would take many times longer, and
//! the guest runs the host's own root file system, so a host-built test binary finds the same
//! libibverbs and rxe provider there. Why one boot for all binaries: a boot costs seconds of CPU under
//! TCG; a test binary costs a fork. Tests run with `--test-threads=1` because they share one rxe device
//! and time-sensitive completions under an emulated CPU; the environment tells them where they are
//! (`FERRY_RDMA_DEVICE=rxe0`, `FERRY_RIG=1`).
//!
//! The guest also has an emulated NVDIMM as device DAX (`FERRY_PMEM=/dev/dax0.0`). Test binaries whose
//! name starts with `persist` run a second time with rdma-core 55 (see [`super::pmem`]), which can post
//! the FLUSH verb (`FERRY_EXPECT_FLUSH_VERB=1`); that pass writes `FERRY_PMEM_MARKER` persistently, and
//! the host checks afterwards that the marker reached the NVDIMM's backing file.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::Timings;
use super::boot::{Devices, Guest, sh_quote};
use super::pmem::{self, DEVDAX_SETUP};
use crate::util::{cargo, cargo_metadata, describe, wait_with_deadline};

/// The package whose tests `rig test` runs by default.
const DEFAULT_PACKAGE: &str = "ferry-rdma";

#[derive(clap::Args)]
pub struct Args {
    /// The package whose tests run [default: ferry-rdma, or the package at --manifest-path].
    #[arg(long, short = 'p')]
    package: Option<String>,
    /// Build the tests of this Cargo.toml instead of the workspace's ferry-rdma (e.g. a probe project).
    #[arg(long, value_name = "PATH")]
    manifest_path: Option<PathBuf>,
    /// Arguments for every test binary, after `--` (a name filter, `--nocapture`, `--ignored`).
    #[arg(last = true, value_name = "TEST_ARGS")]
    test_args: Vec<String>,
}

/// One test executable from cargo's `compiler-artifact` messages.
#[derive(Debug, PartialEq)]
struct TestBinary {
    /// The target's name and kind, e.g. `verbs (test)`.
    label: String,
    executable: PathBuf,
    /// The package's folder: cargo runs test binaries there, and so does the rig.
    package_dir: PathBuf,
}

pub fn run(args: &Args, guest: &Guest<'_>, timings: &mut Timings) -> Result<ExitCode> {
    let start = Instant::now();
    let binaries = build(args)?;
    timings.record("build tests", start, "");
    if binaries.is_empty() {
        bail!("cargo built no test executables");
    }
    let rdma_core = pmem::rdma_core_55(guest.layout, timings)?;
    let runs = plan(&binaries, &rdma_core.env());
    let script = guest_script(&runs, &args.test_args);
    let nvdimm = pmem::nvdimm_image(&guest.layout.dir)?;
    let disk = super::powercut::ext4_image(&guest.layout.dir.join(format!("test-disk-{}", std::process::id())), 0)?;
    let marker = format!("ferry-pmem-marker-{:x}-{:x}", std::process::id(), nanos());
    let guest = guest.with_devices(Devices {
        nvdimm: Some(nvdimm.clone()),
        disk: Some(disk.clone()),
        ..Default::default()
    });
    let outcome = guest.run(
        &script,
        &[
            ("RUST_BACKTRACE", "1"),
            ("FERRY_PMEM", "/dev/dax0.0"),
            ("FERRY_PMEM_MARKER", &marker),
        ],
    )?;
    outcome.record(timings);
    // Tests that passed wrote these persistently; they must be in the NVDIMM's backing file now.
    let logs: Vec<String> = (0..runs.len())
        .map(|i| outcome.read(&format!("test-{i}.log")).unwrap_or_default())
        .collect();
    let passed = |test: &str, run: &dyn Fn(&Run<'_>) -> bool| {
        runs.iter()
            .zip(&logs)
            .any(|(r, log)| run(r) && log.lines().any(|l| l.trim_end() == format!("test {test} ... ok")))
    };
    let mut markers = Vec::new();
    if passed("tcp_writes_to_device_dax_are_written_back_by_the_cpu", &|_| true) {
        markers.push(("CPU write-back over TCP", format!("{marker}-cpu")));
    }
    if passed("best_method_to_device_dax", &|r| !r.env.is_empty()) {
        markers.push(("FLUSH verb over RDMA", format!("{marker}-flush-verb")));
    }
    let found: Vec<(&str, Result<bool>)> = markers
        .iter()
        .map(|(what, m)| (*what, pmem::file_contains(&nvdimm, m.as_bytes())))
        .collect();
    let _ = std::fs::remove_file(&nvdimm);
    if let Some(dir) = disk.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
    let status = outcome.command_status();
    let mut failed = 0;
    for (i, run) in runs.iter().enumerate() {
        println!("     Running {} ({})", run.label, run.binary.executable.display());
        let log = outcome.read(&format!("test-{i}.log")).unwrap_or_default();
        let rc: Option<i32> = outcome
            .read(&format!("test-{i}.rc"))
            .and_then(|s| s.trim().parse().ok());
        let results: Vec<&str> = log
            .lines()
            .map(|l| l.trim_end_matches('\r'))
            .filter(|l| l.starts_with("test result:"))
            .collect();
        for line in &results {
            println!("{line}");
        }
        match rc {
            Some(0) => {}
            Some(rc) => {
                failed += 1;
                if results.is_empty() {
                    println!("error: the test binary exited with status {rc} before printing a result");
                }
            }
            None => {
                failed += 1;
                println!("error: the test binary did not run to the end (see the console output above)");
            }
        }
    }
    for (what, found) in found {
        match found {
            Ok(true) => println!("rig test: the marker written persistently ({what}) is in the NVDIMM's backing file"),
            Ok(false) => {
                failed += 1;
                println!("error: the marker written persistently ({what}) is not in the NVDIMM's backing file");
            }
            Err(e) => {
                failed += 1;
                println!("error: checking the NVDIMM's backing file: {e:#}");
            }
        }
    }
    if let Err(e) = status {
        eprintln!("rig test: {e:#}");
        failed = failed.max(1);
    }
    println!("rig test: {} test runs, {failed} failed", runs.len());
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Builds the test executables on the host and lists them.
fn build(args: &Args) -> Result<Vec<TestBinary>> {
    let mut cmd = cargo();
    cmd.args(["test", "--release", "--no-run", "--message-format=json"]);
    match &args.manifest_path {
        Some(manifest) => {
            let manifest = manifest
                .canonicalize()
                .with_context(|| format!("no Cargo.toml at {}", manifest.display()))?;
            cmd.arg("--manifest-path").arg(manifest);
            if let Some(package) = &args.package {
                cmd.args(["-p", package]);
            }
        }
        None => {
            let package = args.package.as_deref().unwrap_or(DEFAULT_PACKAGE);
            require_package(package)?;
            cmd.args(["-p", package]);
        }
    }
    let stdout = run_json(&mut cmd, Duration::from_secs(45 * 60))?;
    parse_artifacts(&stdout)
}

/// Fails with a clear message when `package` is not (yet) a member of the workspace.
fn require_package(package: &str) -> Result<()> {
    let meta = cargo_metadata()?;
    let found = meta["packages"]
        .as_array()
        .is_some_and(|ps| ps.iter().any(|p| p["name"].as_str() == Some(package)));
    if !found {
        bail!(
            "the package `{package}` is not in this workspace yet (is crates/{package} listed in the root Cargo.toml's \
             members?); nothing for `rig test` to run"
        );
    }
    Ok(())
}

/// Runs a cargo command whose stdout is JSON messages, with its progress (stderr) on our stderr and a
/// deadline; returns stdout.
pub(super) fn run_json(cmd: &mut Command, timeout: Duration) -> Result<String> {
    let what = describe(cmd);
    eprintln!("+ {what}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot start `{what}`"))?;
    let mut pipe = child.stdout.take().context("no stdout pipe")?;
    let reader = thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    });
    let status = wait_with_deadline(&mut child, timeout, &what)?;
    let stdout = reader.join().unwrap_or_default();
    if !status.success() {
        // With JSON messages the compiler's diagnostics are on stdout, not on the terminal: show them,
        // or a failed build says nothing of why (a full disk reads the same as a type error otherwise).
        for rendered in compiler_diagnostics(&stdout) {
            eprint!("{rendered}");
        }
        bail!("`{what}` failed ({status})");
    }
    Ok(stdout)
}

/// The rendered text of every `compiler-message` among cargo's JSON messages.
fn compiler_diagnostics(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-message")
        .filter_map(|m| m["message"]["rendered"].as_str().map(str::to_owned))
        .collect()
}

/// The executables of the `compiler-artifact` messages built with the test profile.
fn parse_artifacts(stdout: &str) -> Result<Vec<TestBinary>> {
    let mut binaries = Vec::new();
    for line in stdout.lines().filter(|l| l.starts_with('{')) {
        let msg: Value =
            serde_json::from_str(line).with_context(|| format!("cargo printed a line that is not JSON: {line}"))?;
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let Some(executable) = msg["executable"].as_str() else {
            continue;
        };
        let name = msg["target"]["name"].as_str().unwrap_or("?");
        let kind = msg["target"]["kind"][0].as_str().unwrap_or("?");
        let manifest = PathBuf::from(msg["manifest_path"].as_str().unwrap_or("/"));
        binaries.push(TestBinary {
            label: format!("{name} ({kind})"),
            executable: PathBuf::from(executable),
            package_dir: manifest.parent().map(PathBuf::from).unwrap_or_else(|| "/".into()),
        });
    }
    Ok(binaries)
}

/// One run of a test binary in the guest.
struct Run<'a> {
    label: String,
    binary: &'a TestBinary,
    /// Extra environment (rdma-core 55's, for the FLUSH pass).
    env: Vec<(&'static str, String)>,
}

/// Every binary once with Debian's verbs libraries, then the `persist*` ones again with rdma-core 55.
fn plan<'a>(binaries: &'a [TestBinary], rdma_core_55: &[(&'static str, String)]) -> Vec<Run<'a>> {
    let mut runs: Vec<Run<'a>> = binaries
        .iter()
        .map(|b| Run {
            label: b.label.clone(),
            binary: b,
            env: Vec::new(),
        })
        .collect();
    for b in binaries.iter().filter(|b| b.label.starts_with("persist")) {
        let mut env = rdma_core_55.to_vec();
        env.push(("FERRY_EXPECT_FLUSH_VERB", "1".into()));
        runs.push(Run {
            label: format!("{} with rdma-core 55", b.label),
            binary: b,
            env,
        });
    }
    runs
}

/// Sets up device DAX, then runs every test run in turn (never stopping at a failure), each one's
/// output to the console and to `test-N.log`, its status to `test-N.rc`; exits non-zero if any failed.
fn guest_script(runs: &[Run<'_>], test_args: &[String]) -> String {
    let mut script = format!(
        "{DEVDAX_SETUP}failed=0\nsetup_devdax || failed=1\n\
         mkdir -p /tmp/ext4 && mount -t ext4 /dev/vda /tmp/ext4 && export FERRY_EXT4_DIR=/tmp/ext4 || failed=1\n"
    );
    let extra: String = test_args.iter().map(|a| format!(" {}", sh_quote(a))).collect();
    for (i, run) in runs.iter().enumerate() {
        let b = run.binary;
        let dir = sh_quote(&b.package_dir.display().to_string());
        let env: String = run.env.iter().map(|(k, v)| format!("{k}={} ", sh_quote(v))).collect();
        script += &format!(
            "echo {banner}\ncd {dir}\n{{ {env}CARGO_MANIFEST_DIR={dir} {exe} --test-threads=1{extra}; echo $? > \"$RIG_DIR/test-{i}.rc\"; }} 2>&1 | tee \"$RIG_DIR/test-{i}.log\"\n[ \"$(cat \"$RIG_DIR/test-{i}.rc\")\" = 0 ] || failed=1\n",
            banner = sh_quote(&format!("rig: running {} ({}/{})", run.label, i + 1, runs.len())),
            exe = sh_quote(&b.executable.display().to_string()),
        );
    }
    script += "exit $failed\n";
    script
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn artifacts() {
        let out = concat!(
            r#"{"reason":"compiler-artifact","package_id":"x","manifest_path":"/w/crates/ferry-rdma/Cargo.toml","target":{"kind":["lib"],"name":"ferry_rdma"},"profile":{"test":false},"executable":null}"#,
            "\n",
            r#"{"reason":"compiler-artifact","package_id":"x","manifest_path":"/w/crates/ferry-rdma/Cargo.toml","target":{"kind":["test"],"name":"verbs"},"profile":{"test":true},"executable":"/w/target/release/deps/verbs-0123"}"#,
            "\n",
            r#"{"reason":"build-finished","success":true}"#,
            "\n"
        );
        assert_eq!(
            parse_artifacts(out).ok(),
            Some(vec![TestBinary {
                label: "verbs (test)".into(),
                executable: "/w/target/release/deps/verbs-0123".into(),
                package_dir: "/w/crates/ferry-rdma".into(),
            }])
        );
    }

    #[test]
    fn a_failed_build_shows_the_compilers_words() {
        let out = concat!(
            r#"{"reason":"compiler-message","message":{"rendered":"error: linking with `cc` failed: No space left on device\n"}}"#,
            "\n",
            r#"{"reason":"build-finished","success":false}"#,
            "\n"
        );
        assert_eq!(
            compiler_diagnostics(out),
            vec!["error: linking with `cc` failed: No space left on device\n".to_owned()]
        );
    }

    #[test]
    fn script_runs_every_binary() {
        let b = |n: &str| TestBinary {
            label: n.into(),
            executable: format!("/t/{n}").into(),
            package_dir: "/p".into(),
        };
        let binaries = [b("a"), b("persist")];
        let runs = plan(&binaries, &[("LD_LIBRARY_PATH", "/v55".into())]);
        assert_eq!(runs.len(), 3, "the persist binary runs again with rdma-core 55");
        let script = guest_script(&runs, &["--nocapture".into()]);
        assert!(script.contains("/t/a --test-threads=1 --nocapture; echo $? > \"$RIG_DIR/test-0.rc\""));
        assert!(script.contains("tee \"$RIG_DIR/test-1.log\""));
        assert!(script.contains("LD_LIBRARY_PATH=/v55 FERRY_EXPECT_FLUSH_VERB=1 CARGO_MANIFEST_DIR=/p /t/persist"));
        assert!(script.contains("setup_devdax || failed=1"));
        assert!(script.ends_with("exit $failed\n"));
    }
}
