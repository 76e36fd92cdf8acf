//! The Python binding's environment: a virtual environment under the target folder, with the
//! wheel built from this workspace the way a user builds it (`pip install ./bindings/python`) and
//! the tools its tests need. `cargo xtask test` runs the pytest suite and the example in it;
//! `cargo xtask bench` runs `python -m ferry.bench` from it.
//!
//! The interpreter is Debian's (`/usr/bin/python3`, or `FERRY_PYTHON`), not whatever `python3`
//! comes first on `PATH`, so that what CI tests is what a fresh machine gets from apt; Debian ships
//! `venv`'s pip bootstrap in a separate package, `python3-venv`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{
    apt_install, cargo_metadata, ensure_debian_packages, run_step, succeeds, target_dir, workspace_root,
};

const SYSTEM_PYTHON: &str = "/usr/bin/python3";

/// What the tests and the benchmark import besides ferry (the `test` extra of the package).
/// mypy's stubtest checks the type stubs against the built module. PyTorch, for the tests that
/// move CPU tensors as the programs moving KV caches hold them: PyPI's wheel brings its CUDA
/// libraries (about 5 GiB installed, a minute or two to fetch) even where only its CPU tensors
/// are used, since `import torch` loads them.
const TEST_REQUIREMENTS: &[&str] = &["pytest>=7", "numpy>=1.22", "mypy>=1.18", "torch>=2"];

const MINUTE: Duration = Duration::from_secs(60);

/// The binding's source folder.
pub fn binding_dir() -> PathBuf {
    workspace_root().join("bindings").join("python")
}

/// Makes the environment (installing Debian's python3 and python3-venv when missing), installs
/// the test requirements and builds and installs the binding afresh; returns its interpreter.
pub fn environment() -> Result<PathBuf> {
    let system = std::env::var("FERRY_PYTHON").unwrap_or_else(|_| SYSTEM_PYTHON.into());
    if system == SYSTEM_PYTHON {
        ensure_debian_packages(&[(SYSTEM_PYTHON, "python3")])?;
        if !can_make_venv(&system) {
            apt_install(&["python3-venv"])?;
            if !can_make_venv(&system) {
                bail!("`{system} -m venv` still cannot bootstrap pip after installing python3-venv");
            }
        }
    } else if !can_make_venv(&system) {
        bail!("FERRY_PYTHON={system} cannot make a virtual environment with pip (`{system} -m venv`)");
    }
    let venv = target_dir(&cargo_metadata()?)?.join("python-venv");
    let python = venv.join("bin").join("python");
    if !succeeds(Command::new(&python).args(["-c", "import sys"])) {
        if venv.exists() {
            std::fs::remove_dir_all(&venv).with_context(|| format!("removing the broken {}", venv.display()))?;
        }
        run_step(
            Command::new(&system)
                .args(["-m", "venv"])
                .arg(&venv)
                .stdout(std::io::stderr()),
            5 * MINUTE,
        )
        .context("making the Python virtual environment")?;
    }
    run_step(
        Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .args(TEST_REQUIREMENTS)
            .stdout(std::io::stderr()),
        20 * MINUTE,
    )
    .context("installing the Python test requirements")?;
    // --force-reinstall: pip would keep an installed ferry of the same version, built from older code.
    // With RDMA built in, as a user on an RDMA cluster builds it (the prerequisites step installed
    // cmake and libclang; the wheel loads libibverbs at run time), and the etcd directory that
    // ferry.nixl's NIXL_ETCD_ENDPOINTS uses (its build needs protoc, also a prerequisite).
    run_step(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--force-reinstall",
                "--no-deps",
            ])
            .arg(binding_dir())
            .env("MATURIN_PEP517_ARGS", "--features rdma,etcd"),
        45 * MINUTE,
    )
    .context("building and installing the binding with `pip install ./bindings/python`")?;
    // A NIXL user on an RDMA cluster must not silently get TCP: the package says RDMA is compiled in
    // (and the etcd directory, which NIXL_ETCD_ENDPOINTS needs).
    run_step(
        Command::new(&python).args([
            "-c",
            "import ferry, sys; c = ferry.capabilities(); \
             t = [t for t in c['transports'] if t['name'] == 'rdma']; \
             d = [d for d in c['directories'] if d['name'] == 'etcd']; \
             sys.exit(0 if t and t[0]['compiled'] and d and d[0]['compiled'] \
             else 'the installed ferry package lacks RDMA or the etcd directory: ' + repr((t, d)))",
        ]),
        MINUTE,
    )
    .context("checking that the installed package has RDMA and the etcd directory compiled in")?;
    Ok(python)
}

/// Whether `python -m venv` would have pip: Debian's python3 lacks `ensurepip` without python3-venv.
fn can_make_venv(python: impl AsRef<Path>) -> bool {
    succeeds(Command::new(python.as_ref()).args(["-c", "import ensurepip, venv"]))
}
