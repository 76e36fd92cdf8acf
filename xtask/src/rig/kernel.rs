//! The guest kernel: a Debian kernel package, looked up at run time, downloaded and unpacked under
//! `target/rig/kernel/<package>/`.
//!
//! Why a distribution kernel: it has `rdma_rxe` (Soft-RoCE) as a module and boots under plain qemu, and
//! apt already knows where to get it. Why bookworm-backports' 6.12 first: its rxe reports FLUSH and
//! ATOMIC_WRITE, which the persistence work needs; bookworm's own 6.1 is the fallback when backports
//! cannot be reached (rxe works there, without those two). Why look the name up at run time: security
//! and backports updates replace the package, so a hard-coded name breaks within weeks; the name
//! found is cached (`rig build --refresh` looks again).
//!
//! Why a private apt configuration (own sources list, lists and cache under `target/rig/apt`): adding
//! backports to the host's `/etc/apt` would change what the host upgrades to; this way the host's apt
//! state is read for the mirror URL and never written.
//!
//! Why boot `vmlinux` rather than `vmlinuz`: qemu loads an uncompressed ELF kernel with a PVH note
//! directly, which skips the firmware's real-mode path and the in-guest decompression, both slow under
//! TCG. The ELF is the xz or zstd stream inside `vmlinuz` that decompresses to `\x7fELF…`.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::{Layout, Timings};
use crate::util::{describe, run_captured, run_step};

/// The default mirror when no bookworm source is configured on the host.
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";

/// The kernel series the rig accepts, in order of preference.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Series {
    /// bookworm-backports: `linux-image-6.12.<n>+deb12-amd64-unsigned`.
    Backports612,
    /// bookworm: `linux-image-6.1.0-<abi>-amd64-unsigned`.
    Bookworm61,
}

impl Series {
    /// A regular expression broad enough for `apt-cache search`; [`Series::accepts`] decides.
    fn search_regex(self) -> &'static str {
        match self {
            Series::Backports612 => r"^linux-image-6\.12\.",
            Series::Bookworm61 => r"^linux-image-6\.1\.",
        }
    }

    /// Whether `name` is this series' generic amd64 unsigned image (not cloud, rt or a meta package).
    fn accepts(self, name: &str) -> bool {
        let (prefix, suffix) = match self {
            Series::Backports612 => ("linux-image-6.12.", "+deb12-amd64-unsigned"),
            Series::Bookworm61 => ("linux-image-6.1.", "-amd64-unsigned"),
        };
        name.strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(suffix))
            .is_some_and(|middle| {
                !middle.is_empty() && middle.chars().all(|c| c.is_ascii_digit() || c == '.' || c == '-')
            })
    }
}

/// The newest accepted package of `series` among `names`, comparing the numbers in the names.
fn pick(series: Series, names: &[String]) -> Option<String> {
    let key = |name: &str| -> Vec<u64> {
        name.split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap_or(0))
            .collect()
    };
    names
        .iter()
        .filter(|n| series.accepts(n))
        .max_by_key(|n| key(n))
        .cloned()
}

/// An unpacked kernel package.
pub struct Kernel {
    /// The Debian package, e.g. `linux-image-6.12.95+deb12-amd64-unsigned`.
    pub package: String,
    /// `uname -r` of the guest, e.g. `6.12.95+deb12-amd64`.
    pub release: String,
    dir: PathBuf,
}

impl Kernel {
    /// The package's file tree (`boot/`, `lib/modules/<release>/`).
    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }

    /// What qemu's `-kernel` gets: the extracted ELF when the kernel has a PVH entry, else `vmlinuz`.
    pub fn boot_image(&self) -> PathBuf {
        let vmlinux = self.dir.join("vmlinux");
        if vmlinux.is_file() {
            vmlinux
        } else {
            self.root().join(format!("boot/vmlinuz-{}", self.release))
        }
    }

    pub fn modules_dir(&self) -> PathBuf {
        self.root().join("lib/modules").join(&self.release)
    }
}

/// Finds (or reuses) the kernel package and unpacks it; fast when cached.
pub fn prepare(layout: &Layout, refresh: bool, timings: &mut Timings) -> Result<Kernel> {
    let apt = Apt::new(layout);
    let name_file = layout.dir.join("kernel-package");
    let cached = fs::read_to_string(&name_file)
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty() && !refresh);
    let (package, from_cache) = match cached {
        Some(name) => (name, true),
        None => {
            let start = Instant::now();
            let name = apt.lookup()?;
            fs::write(&name_file, format!("{name}\n")).with_context(|| format!("writing {}", name_file.display()))?;
            timings.record("kernel lookup", start, "");
            (name, false)
        }
    };
    let dir = layout.dir.join("kernel").join(&package);
    if let Ok(release) = fs::read_to_string(dir.join("ready")) {
        let start = Instant::now();
        let kernel = Kernel {
            package,
            release: release.trim().to_owned(),
            dir,
        };
        timings.record("kernel", start, "cached");
        return Ok(kernel);
    }
    let start = Instant::now();
    let download_dir = layout.dir.join("download");
    let deb = match apt.download(&package, &download_dir) {
        Ok(deb) => deb,
        Err(e) if from_cache => {
            // The cached name may have been superseded on the mirror: look it up again, once.
            eprintln!("rig: could not download the cached kernel package {package} ({e:#}); looking it up again");
            fs::remove_file(&name_file).ok();
            return prepare(layout, true, timings);
        }
        Err(e) => return Err(e),
    };
    timings.record("kernel download", start, "");
    let start = Instant::now();
    let kernel = unpack(&package, &deb, &dir)?;
    fs::remove_dir_all(&download_dir).ok();
    timings.record("kernel unpack", start, "");
    Ok(kernel)
}

/// Unpacks `deb` into `dir` (through `dir.partial`, so an interrupted run leaves no half tree behind),
/// generates `modules.dep` and extracts `vmlinux`.
fn unpack(package: &str, deb: &Path, dir: &Path) -> Result<Kernel> {
    let partial = dir.with_file_name(format!("{package}.partial"));
    if partial.exists() {
        fs::remove_dir_all(&partial).with_context(|| format!("removing {}", partial.display()))?;
    }
    let root = partial.join("root");
    fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    run_step(
        Command::new("dpkg-deb").arg("-x").arg(deb).arg(&root),
        Duration::from_secs(10 * 60),
    )
    .with_context(|| format!("unpacking {}", deb.display()))?;
    let release = release_of(&root)?;
    // The package ships no modules.dep (its postinst runs depmod); modprobe needs it.
    run_step(
        Command::new("depmod").arg("-b").arg(&root).arg(&release),
        Duration::from_secs(10 * 60),
    )
    .context("generating modules.dep for the guest kernel")?;
    let vmlinuz = root.join(format!("boot/vmlinuz-{release}"));
    let config = fs::read_to_string(root.join(format!("boot/config-{release}"))).unwrap_or_default();
    if config.lines().any(|l| l == "CONFIG_PVH=y") {
        extract_vmlinux(&vmlinuz, &partial.join("vmlinux"))?;
    } else {
        eprintln!("rig: {package} has no PVH entry (CONFIG_PVH); booting the compressed vmlinuz");
    }
    fs::write(partial.join("ready"), format!("{release}\n")).context("writing the ready marker")?;
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    fs::rename(&partial, dir).with_context(|| format!("renaming {} to {}", partial.display(), dir.display()))?;
    Ok(Kernel {
        package: package.to_owned(),
        release,
        dir: dir.to_owned(),
    })
}

/// The one directory under `lib/modules/`.
fn release_of(root: &Path) -> Result<String> {
    let modules = root.join("lib/modules");
    let mut releases: Vec<String> = fs::read_dir(&modules)
        .with_context(|| format!("reading {}", modules.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    match releases.len() {
        1 => Ok(releases.remove(0)),
        n => bail!(
            "expected one kernel release under {}, found {n}: {releases:?}",
            modules.display()
        ),
    }
}

/// apt with its own sources list, lists and cache under `target/rig/apt`.
struct Apt {
    dir: PathBuf,
}

impl Apt {
    fn new(layout: &Layout) -> Self {
        Self {
            dir: layout.dir.join("apt"),
        }
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        let path = |p: &str| self.dir.join(p).display().to_string();
        for (key, value) in [
            ("Dir::Etc::SourceList", path("sources.list")),
            ("Dir::Etc::SourceParts", path("sources.list.d")),
            ("Dir::State::Lists", path("lists")),
            ("Dir::Cache", path("cache")),
            // Root would otherwise hand downloads to the `_apt` user, who cannot write into target/.
            ("APT::Sandbox::User", "root".to_owned()),
        ] {
            cmd.arg("-o").arg(format!("{key}={value}"));
        }
        cmd
    }

    /// Writes the private sources list and refreshes its package lists.
    fn update(&self) -> Result<String> {
        for sub in ["sources.list.d", "lists/partial", "cache/archives/partial"] {
            let d = self.dir.join(sub);
            fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        }
        let mirror = host_mirror();
        let options = mirror
            .signed_by
            .as_deref()
            .map(|k| format!("[signed-by={k}] "))
            .unwrap_or_default();
        let list = format!(
            "# Written by `cargo xtask rig` from the host's apt sources; the host's /etc/apt is left alone.\n\
             deb {options}{uri} bookworm-backports main\n\
             deb {options}{uri} bookworm main\n",
            uri = mirror.uri
        );
        let list_path = self.dir.join("sources.list");
        fs::write(&list_path, list).with_context(|| format!("writing {}", list_path.display()))?;
        eprintln!(
            "rig: looking up the kernel package on {} (bookworm-backports, bookworm)",
            mirror.uri
        );
        let mut cmd = self.command("apt-get");
        cmd.args(["update", "-q"]);
        let out = run_captured(&mut cmd, Duration::from_secs(10 * 60))?;
        // apt-get update exits 0 when only some sources failed; the lines starting with W:/E: say which.
        let combined = out.combined();
        let problems: Vec<&str> = combined
            .lines()
            .filter(|l| l.starts_with("W:") || l.starts_with("E:") || l.starts_with("Err:"))
            .map(str::trim)
            .collect();
        Ok(problems.join("\n"))
    }

    fn search(&self, series: Series) -> Result<Vec<String>> {
        let mut cmd = self.command("apt-cache");
        cmd.args(["search", "--names-only", series.search_regex()]);
        let what = describe(&cmd);
        let out = run_captured(&mut cmd, Duration::from_secs(120))?;
        if !out.status.success() {
            bail!("`{what}` failed ({}): {}", out.status, out.combined());
        }
        Ok(out
            .stdout
            .lines()
            .filter_map(|l| l.split(" - ").next())
            .map(|n| n.trim().to_owned())
            .collect())
    }

    /// The newest 6.12 image from bookworm-backports, else bookworm's newest 6.1 (saying so).
    fn lookup(&self) -> Result<String> {
        let problems = self.update()?;
        if let Some(name) = pick(Series::Backports612, &self.search(Series::Backports612)?) {
            eprintln!("rig: kernel package: {name} (bookworm-backports)");
            return Ok(name);
        }
        if let Some(name) = pick(Series::Bookworm61, &self.search(Series::Bookworm61)?) {
            eprintln!(
                "rig: WARNING: no linux-image-6.12.*+deb12-amd64-unsigned found (bookworm-backports unreachable?); \
                 falling back to bookworm's {name}: rxe works, but without FLUSH and ATOMIC_WRITE"
            );
            if !problems.is_empty() {
                eprintln!("rig: apt-get update said:\n{problems}");
            }
            return Ok(name);
        }
        bail!(
            "found neither linux-image-6.12.*+deb12-amd64-unsigned (bookworm-backports) nor \
             linux-image-6.1.*-amd64-unsigned (bookworm) through {}; apt-get update said:\n{problems}",
            self.dir.join("sources.list").display()
        )
    }

    /// `apt-get download` of `package` into a fresh `into`; returns the .deb.
    fn download(&self, package: &str, into: &Path) -> Result<PathBuf> {
        if into.exists() {
            fs::remove_dir_all(into).with_context(|| format!("removing {}", into.display()))?;
        }
        fs::create_dir_all(into).with_context(|| format!("creating {}", into.display()))?;
        let mut cmd = self.command("apt-get");
        cmd.current_dir(into).args(["download", "-q", package]);
        let what = describe(&cmd);
        let out = run_captured(&mut cmd, Duration::from_secs(20 * 60))?;
        if !out.status.success() {
            bail!("`{what}` failed ({}): {}", out.status, out.combined().trim());
        }
        let prefix = format!("{package}_");
        fs::read_dir(into)
            .with_context(|| format!("reading {}", into.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
            })
            .with_context(|| format!("`{what}` succeeded but left no {prefix}*.deb in {}", into.display()))
    }
}

/// The Debian mirror the host uses for bookworm, with its key when the source names one.
#[derive(Debug, PartialEq)]
struct Mirror {
    uri: String,
    signed_by: Option<String>,
}

/// One `deb` source: its URI, suites and `signed-by` key.
#[derive(Debug, PartialEq)]
struct Source {
    uri: String,
    suites: Vec<String>,
    signed_by: Option<String>,
}

/// The mirror of the first source that carries the suite `bookworm`, from `/etc/apt/sources.list` and
/// `/etc/apt/sources.list.d/*.{list,sources}` (only the files apt itself reads); else deb.debian.org.
fn host_mirror() -> Mirror {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut parts: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        parts.sort();
        files.extend(parts);
    }
    let mut sources = Vec::new();
    for file in files {
        let Ok(text) = fs::read_to_string(&file) else { continue };
        match file.extension().and_then(|e| e.to_str()) {
            Some("sources") => sources.extend(parse_deb822(&text)),
            Some("list") => sources.extend(parse_one_line(&text)),
            _ => {}
        }
    }
    match sources.into_iter().find(|s| s.suites.iter().any(|x| x == "bookworm")) {
        Some(s) => Mirror {
            uri: s.uri.trim_end_matches('/').to_owned(),
            signed_by: s.signed_by,
        },
        None => {
            eprintln!("rig: no bookworm source in /etc/apt; using {DEFAULT_MIRROR}");
            Mirror {
                uri: DEFAULT_MIRROR.to_owned(),
                signed_by: None,
            }
        }
    }
}

/// `deb [options] uri suite component…` lines.
fn parse_one_line(text: &str) -> Vec<Source> {
    let mut sources = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let Some(rest) = line.strip_prefix("deb ") else {
            continue;
        };
        let mut rest = rest.trim_start();
        let mut signed_by = None;
        if let Some(after) = rest.strip_prefix('[') {
            let Some((options, tail)) = after.split_once(']') else {
                continue;
            };
            signed_by = options
                .split_whitespace()
                .find_map(|o| o.strip_prefix("signed-by="))
                .map(str::to_owned);
            rest = tail.trim_start();
        }
        let mut words = rest.split_whitespace();
        if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
            sources.push(Source {
                uri: uri.to_owned(),
                suites: vec![suite.to_owned()],
                signed_by,
            });
        }
    }
    sources
}

/// deb822 paragraphs (`Types:`, `URIs:`, `Suites:`, `Signed-By:`, `Enabled:`).
fn parse_deb822(text: &str) -> Vec<Source> {
    let mut sources = Vec::new();
    for paragraph in text.split("\n\n") {
        let mut fields: Vec<(String, String)> = Vec::new();
        for line in paragraph.lines() {
            if line.starts_with('#') {
                continue;
            }
            if line.starts_with([' ', '\t']) {
                // A continuation line (e.g. an inline key block): keep the field, ignore the text.
                continue;
            }
            if let Some((key, value)) = line.split_once(':') {
                fields.push((key.trim().to_ascii_lowercase(), value.trim().to_owned()));
            }
        }
        let get = |key: &str| fields.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        let types_deb = get("types").is_some_and(|t| t.split_whitespace().any(|t| t == "deb"));
        let enabled = get("enabled").is_none_or(|e| !e.eq_ignore_ascii_case("no"));
        let (Some(uris), Some(suites)) = (get("uris"), get("suites")) else {
            continue;
        };
        let Some(uri) = uris.split_whitespace().next() else {
            continue;
        };
        if !types_deb || !enabled {
            continue;
        }
        sources.push(Source {
            uri: uri.to_owned(),
            suites: suites.split_whitespace().map(str::to_owned).collect(),
            signed_by: get("signed-by").filter(|k| k.starts_with('/')).map(str::to_owned),
        });
    }
    sources
}

const XZ_MAGIC: &[u8] = b"\xfd7zXZ\x00";
const ZSTD_MAGIC: &[u8] = b"\x28\xb5\x2f\xfd";

/// Writes the ELF kernel inside `vmlinuz` to `out`: tries every xz and zstd stream start until one
/// decompresses to a complete ELF file.
fn extract_vmlinux(vmlinuz: &Path, out: &Path) -> Result<()> {
    let data = fs::read(vmlinuz).with_context(|| format!("reading {}", vmlinuz.display()))?;
    for (tool, args, magic) in [
        ("xz", &["-dc", "--single-stream"][..], XZ_MAGIC),
        ("zstd", &["-dc"][..], ZSTD_MAGIC),
    ] {
        for offset in find_all(&data, magic) {
            let elf = decompress(tool, args, &data[offset..])?;
            if elf_complete(&elf) {
                let partial = out.with_extension("partial");
                fs::write(&partial, &elf).with_context(|| format!("writing {}", partial.display()))?;
                fs::rename(&partial, out).with_context(|| format!("renaming {}", partial.display()))?;
                return Ok(());
            }
        }
    }
    bail!(
        "no xz or zstd stream in {} decompresses to an ELF kernel",
        vmlinuz.display()
    )
}

fn find_all(haystack: &[u8], needle: &[u8]) -> Vec<usize> {
    haystack
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect()
}

/// `tool args` with `input` on stdin; returns whatever it wrote, even when it then complains about the
/// bytes that follow the stream (zstd does: the rest of vmlinuz is not zstd).
fn decompress(tool: &str, args: &[&str], input: &[u8]) -> Result<Vec<u8>> {
    let mut child = Command::new(tool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start `{tool}`"))?;
    let mut stdin = child.stdin.take().context("no stdin pipe")?;
    let input = input.to_vec();
    let writer = thread::spawn(move || {
        // A broken pipe just means the tool stopped reading (garbage after the stream).
        let _ = stdin.write_all(&input);
    });
    let mut output = Vec::new();
    child
        .stdout
        .take()
        .context("no stdout pipe")?
        .read_to_end(&mut output)
        .with_context(|| format!("reading the output of `{tool}`"))?;
    let _ = child.wait();
    let _ = writer.join();
    Ok(output)
}

/// Whether `elf` is a 64-bit ELF file whose program and section header tables lie inside it.
fn elf_complete(elf: &[u8]) -> bool {
    let u16_at = |at: usize| elf.get(at..at + 2).map(|b| u64::from(u16::from_le_bytes([b[0], b[1]])));
    let u64_at = |at: usize| {
        elf.get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    if !elf.starts_with(b"\x7fELF") || elf.get(4) != Some(&2) {
        return false;
    }
    let len = elf.len() as u64;
    let table_fits = |off: Option<u64>, size: Option<u64>, num: Option<u64>| match (off, size, num) {
        (Some(off), Some(size), Some(num)) => off.checked_add(size * num).is_some_and(|end| end <= len),
        _ => false,
    };
    table_fits(u64_at(0x20), u16_at(0x36), u16_at(0x38)) && table_fits(u64_at(0x28), u16_at(0x3a), u16_at(0x3c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names() {
        let names: Vec<String> = [
            "linux-image-6.12.90+deb12-amd64-unsigned",
            "linux-image-6.12.95+deb12-amd64-unsigned",
            "linux-image-6.12.95+deb12-cloud-amd64-unsigned",
            "linux-image-6.12.95+deb12-rt-amd64-unsigned",
            "linux-image-6.12.95+deb12-amd64-unsigned-dbg",
            "linux-image-6.1.0-37-amd64-unsigned",
            "linux-image-6.1.0-40-amd64-unsigned",
            "linux-image-6.1.0-40-cloud-amd64-unsigned",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            pick(Series::Backports612, &names).as_deref(),
            Some("linux-image-6.12.95+deb12-amd64-unsigned")
        );
        assert_eq!(
            pick(Series::Bookworm61, &names).as_deref(),
            Some("linux-image-6.1.0-40-amd64-unsigned")
        );
        assert_eq!(pick(Series::Backports612, &names[5..]), None);
    }

    #[test]
    fn deb822_sources() {
        let text = "Types: deb\n# http://snapshot.debian.org/archive/debian/20250520T000000Z\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\nComponents: main\n\nTypes: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\n\nTypes: deb\nEnabled: no\nURIs: http://off.example/debian\nSuites: bookworm\n";
        let sources = parse_deb822(text);
        assert_eq!(sources.len(), 2);
        assert_eq!(
            sources[0],
            Source {
                uri: "http://deb.debian.org/debian".into(),
                suites: vec!["bookworm".into(), "bookworm-updates".into()],
                signed_by: Some("/usr/share/keyrings/debian-archive-keyring.gpg".into()),
            }
        );
        assert_eq!(sources[1].suites, ["bookworm-security"]);
    }

    #[test]
    fn one_line_sources() {
        let text = "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian/ bookworm main contrib\ndeb-src http://mirror.example/debian bookworm main\ndeb http://security.debian.org/debian-security bookworm-security main\n";
        let sources = parse_one_line(text);
        assert_eq!(sources.len(), 2);
        assert_eq!(sources[0].uri, "http://mirror.example/debian/");
        assert_eq!(sources[0].signed_by.as_deref(), Some("/k.gpg"));
        assert_eq!(sources[1].suites, ["bookworm-security"]);
    }

    #[test]
    fn elf_checks() {
        assert!(!elf_complete(b"\x7fELF"));
        assert!(!elf_complete(b"MZ not an elf"));
        // A minimal 64-bit header with empty program and section header tables.
        let mut header = vec![0u8; 64];
        header[..5].copy_from_slice(b"\x7fELF\x02");
        assert!(elf_complete(&header));
        header[0x20] = 200; // e_phoff past the end with one entry of 56 bytes
        header[0x36] = 56;
        header[0x38] = 1;
        assert!(!elf_complete(&header));
        assert_eq!(find_all(b"abXZabXZ", b"XZ"), [2, 6]);
    }
}
