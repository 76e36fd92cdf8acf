//! One boot of the guest: a fresh run folder, qemu with a deadline, the console streamed through, and
//! the command's exit status read back.
//!
//! Why TCG unless hardware KVM is really there: on the project's machines `/dev/kvm` exists but is
//! software-backed (no vmx/svm; `kvm_pvm` rather than `kvm_intel`/`kvm_amd`), and stock kernels hit
//! emulation failures under it. A runner with `kvm_intel` or `kvm_amd` loaded gets KVM.
//!
//! Why the status travels three ways: the file `rc` in the run folder is exact (any value); qemu's own
//! exit status, set by the guest through the isa-debug-exit port as `(rc << 1) | 1`, tells a setup
//! failure in `/init` (no `rc` file) from a crash or panic (qemu exits 0, which is never a pass); and
//! the console lines `rig: ready` / `rig: done` time the boot and the command for the CI log.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

use super::{Layout, Prepared, Timings};

/// The kernel command line: serial console, quiet, reboot on panic (which `-no-reboot` turns into exit).
const APPEND: &str = "console=ttyS0 quiet loglevel=3 panic=-1";
/// The guest's memory (qemu `-m`), in GiB, unless [`Devices::memory_gib`] asks for more.
const GUEST_MEMORY_GIB: u64 = 2;

/// Where the guest's console goes.
#[derive(Clone, Copy)]
pub enum Console {
    /// For `rig -- CMD`: the command's output is ours.
    Stdout,
    /// For `rig test`/`rig bench`, whose stdout carries their own report.
    Stderr,
}

/// How to boot: what, for how long, and where the console goes.
#[derive(Clone)]
pub struct Guest<'a> {
    pub prepared: &'a Prepared,
    pub layout: &'a Layout,
    pub timeout: Duration,
    /// Keep the run folder even when the command succeeded.
    pub keep: bool,
    pub console: Console,
    /// Devices beyond the defaults.
    pub devices: Devices,
}

/// Optional guest hardware.
#[derive(Default, Clone)]
pub struct Devices {
    /// An emulated NVDIMM backed by this host file (its size is the file's), as `region0` in the guest.
    pub nvdimm: Option<PathBuf>,
    /// A raw disk image as `/dev/vda` (virtio, host page cache in write-back mode).
    pub disk: Option<PathBuf>,
    /// Kill qemu (SIGKILL, a power cut) the moment a console line starts with this.
    pub kill_on: Option<String>,
    /// The guest's memory in GiB, where it needs more than the default 2 (registering a large region).
    pub memory_gib: Option<u64>,
}

/// When the console showed the guest's milestones.
#[derive(Default)]
struct Marks {
    ready: Option<Instant>,
    done: Option<Instant>,
    lines: Vec<String>,
    /// The line that made the host cut the power, and when.
    killed_on: Option<(String, Instant)>,
}

/// What one boot left behind. Dropping it removes the run folder, unless the command failed (or
/// `--keep`), so a failure's logs stay for a look.
pub struct Outcome {
    pub run_dir: PathBuf,
    keep: bool,
    timed_out: bool,
    timeout: Duration,
    qemu_code: Option<i32>,
    rc: Option<i32>,
    boot: Option<Duration>,
    command: Option<Duration>,
    shutdown: Option<Duration>,
    /// The console line on which the host killed qemu (see [`Devices::kill_on`]).
    pub killed_on: Option<String>,
    /// Every console line, for callers that read results from it.
    pub console: Vec<String>,
}

impl Outcome {
    /// Adds the boot, command and shutdown phases to `timings`.
    pub fn record(&self, timings: &mut Timings) {
        for (name, took) in [
            ("boot", self.boot),
            ("command", self.command),
            ("shutdown", self.shutdown),
        ] {
            if let Some(took) = took {
                timings.add(name, took);
            }
        }
    }

    /// Whether the guest stopped (a kernel panic powers it off) before its setup reported `rig: ready`,
    /// so that the command never started.
    fn died_while_booting(&self) -> bool {
        self.boot.is_none() && self.killed_on.is_none() && !self.timed_out && self.qemu_code == Some(0)
    }

    /// The command's exit status, or why there is none.
    pub fn command_status(&self) -> Result<i32> {
        if self.timed_out {
            bail!(
                "the guest did not finish within {}s and was killed (console output above)",
                self.timeout.as_secs()
            );
        }
        if let Some(rc) = self.rc {
            return Ok(rc);
        }
        match self.qemu_code {
            Some(0) => bail!(
                "the guest stopped without reporting a result (kernel panic or /init crash? console output above)"
            ),
            Some(code) if code % 2 == 1 => bail!("guest setup failed: {}", setup_failure(code >> 1)),
            Some(code) => bail!("qemu failed with exit status {code} (its messages are above)"),
            None => bail!("qemu was killed by a signal"),
        }
    }

    /// A file the command wrote into its run folder (`$RIG_DIR` in the guest).
    pub fn read(&self, name: &str) -> Option<String> {
        fs::read_to_string(self.run_dir.join(name)).ok()
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if self.keep || self.rc != Some(0) {
            eprintln!("rig: run folder kept: {}", self.run_dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.run_dir);
        }
    }
}

/// The message for a status `/init` reports before the command ran (see `INIT` in image.rs).
fn setup_failure(code: i32) -> String {
    match code {
        120 => "could not mount the host's root file system over 9p".into(),
        121 => "could not mount the run folder over 9p".into(),
        122 => "could not mount the run folder at its host path inside the host root".into(),
        123 => "could not bring up eth0 and eth1 (dummy) and rxe0 and rxe1; see `rdma`/`ip` errors above".into(),
        other => format!("/init stopped with code {other} before running the command"),
    }
}

impl<'a> Guest<'a> {
    /// A guest with no extra devices whose console goes to stderr (stdout carries the reports).
    pub fn new(prepared: &'a Prepared, layout: &'a Layout, timeout: Duration, keep: bool) -> Self {
        Guest {
            prepared,
            layout,
            timeout,
            keep,
            console: Console::Stderr,
            devices: Devices::default(),
        }
    }

    /// This guest with `devices` attached.
    pub fn with_devices(&self, devices: Devices) -> Self {
        Guest {
            devices,
            ..self.clone()
        }
    }

    /// Boots once and runs `script` (shell text) with `env` exported, in the host's current directory.
    pub fn run(&self, script: &str, env: &[(&str, &str)]) -> Result<Outcome> {
        let outcome = self.run_once(script, env)?;
        if !outcome.died_while_booting() {
            return Ok(outcome);
        }
        // The kernel died before the guest's setup finished (seen under TCG: a panic in the
        // scheduler clock at 2 s), so nothing of the command ran: boot once more.
        eprintln!("rig: the guest's kernel died while booting, before the command ran; booting again once");
        self.run_once(script, env)
    }

    fn run_once(&self, script: &str, env: &[(&str, &str)]) -> Result<Outcome> {
        let run_dir = self.make_run_dir()?;
        let mut outcome = Outcome {
            run_dir: run_dir.clone(),
            keep: self.keep,
            timed_out: false,
            timeout: self.timeout,
            qemu_code: None,
            rc: None,
            boot: None,
            command: None,
            shutdown: None,
            killed_on: None,
            console: Vec::new(),
        };
        fs::write(
            run_dir.join("config"),
            format!("RIG_DIR={}\n", sh_quote(&run_dir.display().to_string())),
        )
        .context("writing the run folder's config")?;
        fs::write(run_dir.join("cmd.sh"), command_script(script, env)).context("writing cmd.sh")?;

        let mut cmd = self.qemu(&run_dir);
        let argv: Vec<String> = std::iter::once(cmd.get_program())
            .chain(cmd.get_args())
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        eprintln!("+ {}", shell_words(&argv));
        let start = Instant::now();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start qemu-system-x86_64")?;
        let stderr = child.stderr.take().context("no stderr pipe from qemu")?;
        let stderr_reader = thread::spawn(move || forward_qemu_stderr(stderr));
        let marks = Arc::new(Mutex::new(Marks::default()));
        let stdout = child.stdout.take().context("no stdout pipe from qemu")?;
        let reader = {
            let marks = Arc::clone(&marks);
            let console = self.console;
            let kill = self.devices.kill_on.clone().map(|line| (line, child.id()));
            thread::spawn(move || stream_console(stdout, console, &marks, kill))
        };
        let deadline = start + self.timeout;
        let status = loop {
            if let Some(status) = child.try_wait().context("waiting for qemu")? {
                break Some(status);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            thread::sleep(Duration::from_millis(20));
        };
        let exited = Instant::now();
        let _ = reader.join();
        let _ = stderr_reader.join();
        let (marks, killed_on, console) = match Arc::try_unwrap(marks).map(|m| m.into_inner()) {
            Ok(Ok(m)) => ((m.ready, m.done), m.killed_on, m.lines),
            _ => ((None, None), None, Vec::new()),
        };
        outcome.killed_on = killed_on.map(|(line, _)| line);
        outcome.console = console;
        outcome.timed_out = status.is_none() && outcome.killed_on.is_none();
        outcome.qemu_code = status.and_then(|s| s.code());
        outcome.rc = fs::read_to_string(run_dir.join("rc"))
            .ok()
            .and_then(|s| s.trim().parse().ok());
        outcome.boot = marks.0.map(|r| r - start);
        outcome.command = marks.0.zip(marks.1).map(|(r, d)| d - r);
        outcome.shutdown = marks.1.map(|d| exited - d);
        let show = |d: Option<Duration>| d.map_or_else(|| "-".to_owned(), |d| format!("{:.1}s", d.as_secs_f64()));
        eprintln!(
            "rig: guest boot {}, command {}, shutdown {}; qemu exit status {}",
            show(outcome.boot),
            show(outcome.command),
            show(outcome.shutdown),
            outcome
                .qemu_code
                .map_or_else(|| "none (killed)".to_owned(), |c| c.to_string())
        );
        Ok(outcome)
    }

    fn make_run_dir(&self) -> Result<PathBuf> {
        let stamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let dir = self.layout.dir.join(format!("run-{}-{stamp}", std::process::id()));
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // Absolute, since the guest mounts the share at this very path inside the host's root.
        dir.canonicalize()
            .with_context(|| format!("resolving {}", dir.display()))
    }

    fn qemu(&self, run_dir: &Path) -> Command {
        let (accel, cpu) = accelerator();
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args(["-accel", accel, "-cpu", cpu, "-smp", "2"]);
        // Memory is allocated as the guest touches it; 2 GiB leaves room for registering 1 GiB at once.
        let memory = self
            .devices
            .memory_gib
            .unwrap_or(GUEST_MEMORY_GIB)
            .max(GUEST_MEMORY_GIB);
        if self.devices.nvdimm.is_none() {
            cmd.args(["-m", &format!("{memory}G")]);
        }
        cmd.arg("-kernel")
            .arg(self.prepared.kernel.boot_image())
            .arg("-initrd")
            .arg(&self.prepared.initramfs)
            .args(["-append", APPEND])
            .args(["-nographic", "-no-reboot", "-nodefaults", "-no-user-config"])
            .args(["-serial", "stdio", "-monitor", "none", "-nic", "none"])
            .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"])
            // SeaBIOS would otherwise paint escape sequences and a banner on the serial console.
            .args(["-fw_cfg", "name=etc/sercon-port,string=0"])
            .arg("-virtfs")
            .arg("local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
            .arg("-virtfs")
            .arg(format!(
                "local,path={},mount_tag=rig,security_model=none",
                escape(run_dir)
            ));
        if let Some(image) = &self.devices.nvdimm {
            let size = fs::metadata(image).map(|m| m.len()).unwrap_or(0);
            cmd.args([
                "-machine",
                "pc,nvdimm=on",
                "-m",
                &format!("{memory}G,slots=2,maxmem={}G", memory + 4),
            ])
            .arg("-object")
            .arg(format!(
                "memory-backend-file,id=pmem0,share=on,mem-path={},size={size}",
                escape(image)
            ))
            .args(["-device", "nvdimm,memdev=pmem0,id=nvdimm0"]);
        }
        if let Some(disk) = &self.devices.disk {
            cmd.arg("-drive")
                .arg(format!("file={},format=raw,if=virtio,cache=writeback", escape(disk)));
        }
        cmd
    }
}

/// A path inside a qemu option value (commas doubled).
fn escape(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

/// `("kvm", "host")` where hardware KVM is loaded and `/dev/kvm` opens, else `("tcg", "max")`.
fn accelerator() -> (&'static str, &'static str) {
    let hardware = ["/sys/module/kvm_intel", "/sys/module/kvm_amd"]
        .iter()
        .any(|m| Path::new(m).exists());
    let usable = fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok();
    if hardware && usable {
        ("kvm", "host")
    } else {
        ("tcg", "max")
    }
}

/// Copies qemu's own messages to our stderr, less the warning that the SeaBIOS option draws.
fn forward_qemu_stderr(from: impl Read) {
    use std::io::BufRead;
    for line in std::io::BufReader::new(from).lines() {
        let Ok(line) = line else { return };
        if !line.contains("externally provided fw_cfg item names") {
            eprintln!("{line}");
        }
    }
}

/// Copies qemu's stdout (the guest console) to ours or to stderr as it arrives, noting the milestones
/// and keeping the lines; with `kill`, SIGKILLs qemu (pid) as soon as a line starts with its text.
fn stream_console(mut from: impl Read, console: Console, marks: &Mutex<Marks>, kill: Option<(String, u32)>) {
    let mut buf = [0u8; 8192];
    let mut line = Vec::new();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let chunk = &buf[..n];
        let _ = match console {
            Console::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(chunk).and_then(|()| out.flush())
            }
            Console::Stderr => std::io::stderr().lock().write_all(chunk),
        };
        for &byte in chunk {
            if byte != b'\n' {
                line.push(byte);
                continue;
            }
            let text = String::from_utf8_lossy(&line);
            let text = text.trim_end_matches('\r');
            if let Some((prefix, pid)) = &kill
                && text.starts_with(prefix.as_str())
            {
                // The power cut: nothing the guest has not handed to its virtual disk survives.
                let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
                if let Ok(mut m) = marks.lock() {
                    m.killed_on.get_or_insert_with(|| (text.to_owned(), Instant::now()));
                }
            }
            if let Ok(mut m) = marks.lock() {
                if text == "rig: ready" {
                    m.ready.get_or_insert_with(Instant::now);
                } else if text.starts_with("rig: done rc=") {
                    m.done.get_or_insert_with(Instant::now);
                }
                m.lines.push(text.to_owned());
            }
            line.clear();
        }
    }
}

/// The script the guest runs: environment, the host's working directory, then `script`.
fn command_script(script: &str, env: &[(&str, &str)]) -> String {
    let mut out = String::from("# Written by `cargo xtask rig`; runs in the guest, in a chroot of the host's root.\n");
    let host_path = std::env::var("PATH").unwrap_or_default();
    let mut vars: Vec<(String, String)> = vec![
        ("PATH".into(), format!("{host_path}:/usr/sbin:/usr/bin:/sbin:/bin")),
        ("FERRY_RIG".into(), "1".into()),
        ("FERRY_RDMA_DEVICE".into(), "rxe0".into()),
        // One rail unless a test asks for both (`FERRY_RDMA_RAILS` names them).
        ("FERRY_RDMA_DEVICES".into(), "rxe0".into()),
        ("FERRY_RDMA_RAILS".into(), "rxe0,rxe1".into()),
        // Inside the rig every prerequisite is there: a test that would skip fails instead.
        ("FERRY_REQUIRE_ALL".into(), "1".into()),
    ];
    for key in ["HOME", "USER", "LANG", "RUSTUP_HOME", "CARGO_HOME", "RUSTUP_TOOLCHAIN"] {
        if let Ok(value) = std::env::var(key) {
            vars.push((key.into(), value));
        }
    }
    vars.extend(env.iter().map(|&(k, v)| (k.to_owned(), v.to_owned())));
    for (key, value) in vars {
        out += &format!("export {key}={}\n", sh_quote(&value));
    }
    if let Ok(cwd) = std::env::current_dir() {
        out += &format!("cd {} 2>/dev/null || cd /\n", sh_quote(&cwd.display().to_string()));
    }
    out += script;
    out.push('\n');
    out
}

/// `word` quoted for sh, unless it needs no quoting.
pub fn sh_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_@%+=:,./-".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A command line for sh that runs exactly `argv`.
pub fn shell_words(argv: &[String]) -> String {
    argv.iter().map(|a| sh_quote(a)).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(sh_quote("ibv_devinfo"), "ibv_devinfo");
        assert_eq!(sh_quote("/a/b-c.d"), "/a/b-c.d");
        assert_eq!(sh_quote(""), "''");
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
        let argv = ["sh", "-c", "a & b; echo $x"].map(String::from);
        assert_eq!(shell_words(&argv), "sh -c 'a & b; echo $x'");
    }

    #[test]
    fn script_exports_and_runs() {
        let script = command_script("true", &[("RUST_BACKTRACE", "1")]);
        assert!(script.contains("export FERRY_RDMA_DEVICE=rxe0\n"));
        assert!(script.contains("export RUST_BACKTRACE=1\n"));
        assert!(script.ends_with("true\n"));
    }

    #[test]
    fn setup_failures_are_named() {
        assert!(setup_failure(120).contains("9p"));
        assert!(setup_failure(123).contains("rxe0"));
    }
}
