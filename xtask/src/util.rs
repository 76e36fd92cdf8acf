//! Running commands with a deadline, peer servers that are always killed, and Debian prerequisites.
//!
//! Why: a benchmark or CI step that hangs burns the whole CI budget and says nothing, and a peer server
//! left behind holds a port and skews the next measurement. So every process here runs with a
//! timeout, every background server sits in a guard whose `Drop` kills it, and a missing tool is
//! either installed (root on Debian, as in CI) or reported with the exact command that installs it.

use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// How often a running child is polled for exit.
const POLL: Duration = Duration::from_millis(20);

/// The workspace root: xtask lives one level below it.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

/// The `cargo` that runs us (so `+toolchain` overrides carry over), or `cargo` from `PATH`.
/// A text table: the header, then one line per row; the first column left-aligned, the others
/// right-aligned, two spaces apart.
pub fn columns<const N: usize>(header: [&str; N], rows: &[[String; N]]) -> String {
    let mut widths = header.map(|h| h.chars().count());
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; N]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            match i {
                0 => s.push_str(&format!("{cell:<w$}")),
                _ => s.push_str(&format!("  {cell:>w$}")),
            }
        }
        s.trim_end().to_owned() + "\n"
    };
    let mut out = line(header);
    for row in rows {
        out += &line(row.each_ref().map(String::as_str));
    }
    out
}

/// `cargo metadata --no-deps` of the workspace, parsed.
pub fn cargo_metadata() -> Result<serde_json::Value> {
    let out = run_captured(
        cargo().args(["metadata", "--format-version", "1", "--no-deps"]),
        Duration::from_secs(120),
    )?;
    if !out.status.success() {
        bail!("cargo metadata failed ({}): {}", out.status, out.stderr.trim());
    }
    serde_json::from_str(&out.stdout).context("cargo metadata output is not JSON")
}

/// The workspace's target folder, as cargo metadata reports it.
pub fn target_dir(meta: &serde_json::Value) -> Result<PathBuf> {
    meta["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .context("cargo metadata has no target_directory")
}

pub fn cargo() -> Command {
    let program = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(program);
    cmd.current_dir(workspace_root());
    cmd
}

/// A command as a user would type it, with the environment variables we set in front.
pub fn describe(cmd: &Command) -> String {
    let mut parts: Vec<String> = cmd
        .get_envs()
        .filter_map(|(k, v)| v.map(|v| format!("{}={}", k.to_string_lossy(), v.to_string_lossy())))
        .collect();
    let program = Path::new(cmd.get_program()).file_name().unwrap_or(cmd.get_program());
    parts.push(program.to_string_lossy().into_owned());
    parts.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    parts.join(" ")
}

/// What a finished child printed.
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// Both streams, for error messages.
    pub fn combined(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Waits for `child` until `timeout`; kills it when the time is up.
pub fn wait_with_deadline(child: &mut Child, timeout: Duration, what: &str) -> Result<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().with_context(|| format!("waiting for `{what}`"))? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`{what}` did not finish within {}s and was killed", timeout.as_secs());
        }
        thread::sleep(POLL);
    }
}

/// Runs `cmd` with stdin closed and stdout/stderr captured; fails only if it cannot start or times out
/// (the caller judges the exit status, since some peers exit non-zero with useful output).
pub fn run_captured(cmd: &mut Command, timeout: Duration) -> Result<Output> {
    let what = describe(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start `{what}`"))?;
    let stdout = child.stdout.take().map(reader_thread);
    let stderr = child.stderr.take().map(reader_thread);
    let status = wait_with_deadline(&mut child, timeout, &what);
    let stdout = stdout.and_then(|t| t.join().ok()).unwrap_or_default();
    let stderr = stderr.and_then(|t| t.join().ok()).unwrap_or_default();
    Ok(Output {
        status: status?,
        stdout,
        stderr,
    })
}

fn reader_thread(mut pipe: impl Read + Send + 'static) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// Runs `cmd` with the terminal's stdout/stderr (so cargo's own output shows) and fails unless it
/// exits 0 within `timeout`.
pub fn run_step(cmd: &mut Command, timeout: Duration) -> Result<()> {
    let what = describe(cmd);
    eprintln!("+ {what}");
    let mut child = cmd
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start `{what}`"))?;
    let status = wait_with_deadline(&mut child, timeout, &what)?;
    if !status.success() {
        bail!("`{what}` failed ({status})");
    }
    Ok(())
}

/// Whether `cmd` starts and exits 0 (used to probe for tools such as `cargo deny --version`).
pub fn succeeds(cmd: &mut Command) -> bool {
    run_captured(cmd, Duration::from_secs(60)).is_ok_and(|o| o.status.success())
}

/// A free TCP port on 127.0.0.1, found by binding port 0 and letting the listener go.
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0 to find a free port")?;
    Ok(listener.local_addr().context("reading the bound address")?.port())
}

/// A background server (a benchmark peer). Dropping the guard kills it, on every exit path.
pub struct ServerGuard {
    child: Child,
    what: String,
    log: PathBuf,
}

impl ServerGuard {
    /// Starts `cmd` in the background with its output going to a log file in the temp directory.
    pub fn spawn(name: &str, cmd: &mut Command) -> Result<Self> {
        let what = describe(cmd);
        let log = std::env::temp_dir().join(format!("ferry-xtask-{name}-{}.log", std::process::id()));
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone().context("duplicating the log file handle")?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("cannot start server `{what}`"))?;
        Ok(Self { child, what, log })
    }

    /// Waits until something listens on TCP `port` (read from /proc/net/tcp{,6}, so no probe
    /// connection disturbs servers that accept exactly one client), or fails if the server exits.
    pub fn wait_listening(&mut self, port: u16, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().context("polling a server")? {
                bail!("server `{}` exited early ({status}): {}", self.what, self.log_tail());
            }
            if is_listening(port) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "server `{}` did not listen on port {port} within {}s: {}",
                    self.what,
                    timeout.as_secs(),
                    self.log_tail()
                );
            }
            thread::sleep(POLL);
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    }
}

impl Drop for ServerGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Whether a socket listens on TCP `port` (any address), per /proc/net/tcp and /proc/net/tcp6.
fn is_listening(port: u16) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .any(|table| listening_in_proc_table(&table, port))
}

/// Parses the text of /proc/net/tcp{,6}: `local_address` is `HEXADDR:HEXPORT`, state `0A` is LISTEN.
pub fn listening_in_proc_table(table: &str, port: u16) -> bool {
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(local), Some(state)) = (fields.get(1), fields.get(3)) else {
            return false;
        };
        let local_port = local.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
        *state == "0A" && local_port == Some(port)
    })
}

/// Whether a prerequisite is there. The one predicate, used both before and after installing, so
/// the two checks cannot disagree: an absolute path names a file that must exist (a library, a data
/// file: nothing says it must be executable), anything else a binary that must be an executable file
/// in a directory of `search_path` (the value of `PATH`).
pub fn present(probe: &str, search_path: Option<&OsStr>) -> bool {
    if probe.starts_with('/') {
        return Path::new(probe).is_file();
    }
    search_path.is_some_and(|path| std::env::split_paths(path).any(|dir| is_executable_file(&dir.join(probe))))
}

fn is_executable_file(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// `apt-get update` runs at most once per xtask process.
static APT_UPDATED: AtomicBool = AtomicBool::new(false);

/// Makes sure each `(probe, debian_package)` is present (see [`present`]): when some probe is missing
/// and we are root on Debian, installs the packages with apt-get; otherwise fails naming the exact
/// command to run.
pub fn ensure_debian_packages(needs: &[(&str, &str)]) -> Result<()> {
    let search_path = std::env::var_os("PATH");
    ensure_packages_with(needs, search_path.as_deref(), apt_install)
}

/// [`ensure_debian_packages`] with the installer and the search path as parameters, so that the
/// branch a fresh machine takes (probe missing, install, probe again) is exercised by tests too.
pub fn ensure_packages_with(
    needs: &[(&str, &str)],
    search_path: Option<&OsStr>,
    install: impl FnOnce(&[&str]) -> Result<()>,
) -> Result<()> {
    let mut packages: Vec<&str> = needs
        .iter()
        .filter(|(probe, _)| !present(probe, search_path))
        .map(|&(_, pkg)| pkg)
        .collect();
    packages.sort_unstable();
    packages.dedup();
    if packages.is_empty() {
        return Ok(());
    }
    install(&packages)?;
    let still_missing: Vec<String> = needs
        .iter()
        .filter(|(probe, _)| !present(probe, search_path))
        .map(|(probe, pkg)| format!("`{probe}` (Debian package {pkg})"))
        .collect();
    if !still_missing.is_empty() {
        bail!(
            "still missing after installing {}: {}",
            packages.join(", "),
            still_missing.join(", ")
        );
    }
    Ok(())
}

/// Installs Debian packages with apt-get as root (one `apt-get update` per process first), or fails
/// with the command that would install them.
pub fn apt_install(packages: &[&str]) -> Result<()> {
    let install = format!(
        "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends {}",
        packages.join(" ")
    );
    let debian = Path::new("/etc/debian_version").exists();
    if !debian || !is_root() {
        let on = if debian { "as root" } else { "on Debian/Ubuntu, as root" };
        bail!(
            "missing Debian packages {}; install them ({on}) with: apt-get update && {install}",
            packages.join(", ")
        );
    }
    let timeout = Duration::from_secs(20 * 60);
    if !APT_UPDATED.swap(true, Ordering::SeqCst) {
        run_step(Command::new("apt-get").args(["update", "-qq"]), timeout).context("apt-get update")?;
    }
    let mut cmd = Command::new("apt-get");
    cmd.env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(packages);
    run_step(&mut cmd, timeout).with_context(|| format!("installing {}", packages.join(", ")))
}

/// Parses a duration such as `3s`, `500ms`, `2m` or `3` (seconds).
pub fn parse_duration(text: &str) -> Result<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .with_context(|| format!("`{text}` is not a duration such as 3s or 500ms"))?;
    let seconds = match unit.trim() {
        "" | "s" => number,
        "ms" => number / 1e3,
        "m" | "min" => number * 60.0,
        other => bail!("unknown unit `{other}` in duration `{text}` (use ms, s or m)"),
    };
    if !(seconds.is_finite() && seconds > 0.0) {
        bail!("duration `{text}` must be positive");
    }
    Ok(Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align() {
        let rows = [["write 1MiB".to_string(), "8.0".into()], ["r".into(), "10.25".into()]];
        assert_eq!(
            columns(["case", "GB/s"], &rows),
            "case         GB/s\nwrite 1MiB    8.0\nr           10.25\n"
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("3s").ok(), Some(Duration::from_secs(3)));
        assert_eq!(parse_duration("500ms").ok(), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m").ok(), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("4").ok(), Some(Duration::from_secs(4)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("3h").is_err());
        assert!(parse_duration("s").is_err());
    }

    #[test]
    fn proc_net_tcp_listen() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:3B6F 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n   1: 0100007F:9C40 0100007F:3B6F 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n";
        assert!(listening_in_proc_table(table, 0x3B6F));
        assert!(!listening_in_proc_table(table, 0x9C40));
        let table6 = "  sl  local_address                         remote_address                        st\n   0: 00000000000000000000000000000000:1451 00000000000000000000000000000000:0000 0A 0\n";
        assert!(listening_in_proc_table(table6, 5201));
    }

    /// A fresh folder under the temp directory, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("ferry-xtask-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("creating a temp folder");
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn write_file(path: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, b"\x7fELF").expect("writing a probe file");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    #[test]
    fn probe_library_path_is_a_file_that_exists() {
        let dir = TempDir::new("probe-lib");
        let lib = dir.0.join("libfoo.so.1");
        let probe = lib.to_str().expect("utf-8 temp path");
        assert!(!present(probe, None));
        write_file(&lib, 0o644);
        assert!(
            present(probe, None),
            "a non-executable library named by path is present"
        );
        assert!(!present(dir.0.to_str().expect("utf-8"), None), "a folder is not a file");
    }

    #[test]
    fn probe_binary_must_be_executable_on_the_search_path() {
        let dir = TempDir::new("probe-bin");
        let search = dir.0.clone().into_os_string();
        assert!(!present("ferry-probe-tool", Some(&search)));
        write_file(&dir.0.join("ferry-probe-tool"), 0o644);
        assert!(!present("ferry-probe-tool", Some(&search)), "not executable");
        write_file(&dir.0.join("ferry-probe-tool"), 0o755);
        assert!(present("ferry-probe-tool", Some(&search)));
        assert!(!present("ferry-probe-tool", None), "no PATH, no binary");
        assert!(present("sh", std::env::var_os("PATH").as_deref()), "sh is on PATH");
    }

    /// The branch a fresh machine takes: probes missing, the installer runs, the same probes pass.
    #[test]
    fn install_branch_rechecks_with_the_same_predicate() {
        let dir = TempDir::new("install");
        let lib = dir.0.join("libbar.so.1");
        let lib_probe = lib.to_str().expect("utf-8").to_owned();
        let search = dir.0.clone().into_os_string();
        let needs = [
            (lib_probe.as_str(), "libbar1"),
            ("bar-tool", "bar-utils"),
            ("sh-probe", "bar-utils"),
        ];
        let mut asked = Vec::new();
        let result = ensure_packages_with(&needs, Some(&search), |packages| {
            asked = packages.iter().map(|p| p.to_string()).collect();
            write_file(&lib, 0o644);
            write_file(&dir.0.join("bar-tool"), 0o755);
            write_file(&dir.0.join("sh-probe"), 0o755);
            Ok(())
        });
        assert!(result.is_ok(), "{result:?}");
        assert_eq!(asked, ["bar-utils", "libbar1"], "each package once, sorted");
        let nothing_to_do = ensure_packages_with(&needs, Some(&search), |_| panic!("nothing is missing"));
        assert!(nothing_to_do.is_ok());
    }

    #[test]
    fn install_that_leaves_a_probe_missing_names_it() {
        let dir = TempDir::new("install-fails");
        let lib = dir.0.join("libbaz.so.1");
        let probe = lib.to_str().expect("utf-8").to_owned();
        let err = ensure_packages_with(&[(probe.as_str(), "libbaz1")], None, |_| Ok(()))
            .expect_err("the probe is still missing");
        let text = err.to_string();
        assert!(text.contains(&probe) && text.contains("libbaz1"), "{text}");
        let refused = ensure_packages_with(&[(probe.as_str(), "libbaz1")], None, |_| bail!("no apt here"));
        assert_eq!(refused.expect_err("installer failed").to_string(), "no apt here");
    }

    /// The real installer on a package that nothing else uses: removed first, so every run installs
    /// it through `apt_install` as a fresh machine would, probed by absolute path, then removed again.
    #[test]
    fn real_apt_install_of_a_removed_package() {
        const PROBE: &str = "/usr/bin/hello";
        if !(is_root() && Path::new("/etc/debian_version").exists()) {
            assert!(
                std::env::var_os("FERRY_REQUIRE_ALL").is_none(),
                "this test installs the Debian package `hello` with apt-get: run it as root on Debian"
            );
            eprintln!("skipped: installing a package needs root on Debian");
            return;
        }
        let purge = || {
            let status = Command::new("dpkg").args(["--purge", "hello"]).output();
            assert!(status.is_ok_and(|o| o.status.success()), "dpkg --purge hello");
        };
        purge();
        assert!(!present(PROBE, None));
        let result = ensure_debian_packages(&[(PROBE, "hello")]);
        let installed = present(PROBE, None);
        purge();
        assert!(result.is_ok(), "{result:?}");
        assert!(installed);
    }

    #[test]
    fn free_port_is_nonzero() {
        assert!(free_port().is_ok_and(|p| p != 0));
    }
}
