//! `cargo xtask test`: everything CI runs, in CI's order, so a green local run means a green CI run.
//!
//! Why one command: CI (`.ci/run`, the GitHub workflow) and a developer run exactly the same steps, and
//! nothing is skipped silently — a missing prerequisite is installed (root on Debian) or the step
//! fails with the command that installs it. Steps stop at the first failure, which is named, and the
//! last line is always `xtask test: N passed, M failed` for a log reader to grep.

use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, cargo_metadata, ensure_debian_packages, run_step, succeeds, target_dir};

#[derive(clap::Args)]
pub struct Args {
    /// Skip the lint steps (fmt, clippy, doc, deny) and their prerequisites, for quick local runs.
    #[arg(long)]
    no_lint: bool,
    /// Run only the steps whose name contains this text (with the prerequisites), e.g. `python`.
    #[arg(long, value_name = "TEXT")]
    only: Option<String>,
}

/// Debian packages the build and the tests need, as `(binary or absolute path, package)`.
const DEBIAN_PACKAGES: &[(&str, &str)] = &[
    // ferry-rdma's verbs binding builds its loader shim with cmake and generates bindings with libclang.
    ("cmake", "cmake"),
    ("/usr/lib/llvm-14/lib/libclang.so", "libclang-dev"),
    // ferry-rdma's tests find no device on the host and fall back to TCP; the library must load.
    ("/usr/lib/x86_64-linux-gnu/libibverbs.so.1", "libibverbs1"),
    // ferry-vulkan's tests run on lavapipe, Mesa's CPU Vulkan driver.
    ("/usr/lib/x86_64-linux-gnu/libvulkan.so.1", "libvulkan1"),
    ("/usr/share/vulkan/icd.d/lvp_icd.x86_64.json", "mesa-vulkan-drivers"),
    // The netem fault tests build network namespaces and shape a veth pair.
    ("ip", "iproute2"),
    ("tc", "iproute2"),
    // The fuzz targets link libFuzzer, which `libfuzzer-sys` compiles from C++.
    ("g++", "g++"),
    // ferry-etcd: etcd-client generates its gRPC code with protoc, and the directory tests run a real
    // etcd on loopback (Debian's etcd-server package ships the `etcd` binary).
    ("protoc", "protobuf-compiler"),
    ("/usr/include/google/protobuf/descriptor.proto", "libprotobuf-dev"),
    ("etcd", "etcd-server"),
];

const MINUTE: Duration = Duration::from_secs(60);

struct Step {
    name: &'static str,
    lint: bool,
    run: fn(&Args) -> Result<()>,
}

const STEPS: &[Step] = &[
    Step {
        name: "prerequisites",
        lint: false,
        run: prerequisites,
    },
    Step {
        name: "fmt",
        lint: true,
        run: |_| run_step(cargo().args(["fmt", "--all", "--", "--check"]), 10 * MINUTE),
    },
    Step {
        name: "clippy",
        lint: true,
        run: |_| {
            run_step(
                cargo().args([
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--all-features",
                    "--",
                    "-D",
                    "warnings",
                ]),
                45 * MINUTE,
            )
        },
    },
    // Public docs with no broken or private links: what docs.rs would render.
    Step {
        name: "doc",
        lint: true,
        run: |_| {
            run_step(
                cargo()
                    .args(["doc", "--workspace", "--no-deps", "--all-features"])
                    .env("RUSTDOCFLAGS", "-D warnings"),
                30 * MINUTE,
            )
        },
    },
    Step {
        name: "deny",
        lint: true,
        run: |_| {
            run_step(
                cargo().args(["deny", "check", "bans", "licenses", "sources"]),
                10 * MINUTE,
            )
        },
    },
    // Release: the tests move many MiB, which takes minutes unoptimised.
    Step {
        name: "test",
        lint: false,
        // FERRY_REQUIRE_ALL turns "skipped: prerequisite missing" into a failure: nothing passes by skipping.
        // The netem tests need the kernel's netem qdisc, which a host kernel may lack: they run in the
        // rig's kernel (a later step) instead of here.
        run: |_| {
            run_step(
                cargo()
                    .args(["test", "--workspace", "--release", "--features", "ferry-cli/directory"])
                    .args(["--exclude", "ferry-cuda"])
                    .args(["--", "--skip", "netem_"])
                    .env("FERRY_REQUIRE_ALL", "1"),
                60 * MINUTE,
            )
        },
    },
    // CUDA memory needs an NVIDIA GPU and its driver, which no CI host has: the unit tests run
    // anywhere, and the GPU tests say, uncaptured, why they did not run. A GPU machine runs them
    // with FERRY_REQUIRE_CUDA=1, which makes a missing device a failure.
    Step {
        name: "cuda (GPU tests say why they did not run where there is no GPU)",
        lint: false,
        run: |_| {
            run_step(
                cargo().args([
                    "test",
                    "-p",
                    "ferry-cuda",
                    "--release",
                    "--",
                    "--nocapture",
                    "--test-threads=1",
                ]),
                10 * MINUTE,
            )
        },
    },
    // The engine's tests run their two engines in one process, where shared memory wins: again over
    // TCP, so that both data paths keep every test.
    Step {
        name: "test (crate ferry, over TCP)",
        lint: false,
        run: |_| {
            run_step(
                cargo()
                    .args(["test", "-p", "ferry", "--release"])
                    .env("FERRY_REQUIRE_ALL", "1")
                    .env("FERRY_TEST_TRANSPORTS", "tcp"),
                30 * MINUTE,
            )
        },
    },
    // The Python binding as a user gets it: `pip install ./bindings/python` into a fresh virtual
    // environment, then its type stubs against the built module (mypy's stubtest), its pytest suite
    // (two processes, concurrency, errors) and its example.
    Step {
        name: "python binding (pip install, stubtest, pytest, example)",
        lint: false,
        run: |_| {
            let python = crate::python::environment()?;
            let dir = crate::python::binding_dir();
            // Each class made in Rust has a C layout of its own (a "disjoint base"); the stubs mark
            // them @final, which already rules out the multiple inheritance that would matter.
            run_step(
                Command::new(&python)
                    .args(["-m", "mypy.stubtest", "--ignore-disjoint-bases", "ferry"])
                    .current_dir(&dir),
                10 * MINUTE,
            )?;
            run_step(
                Command::new(&python)
                    .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"])
                    .env("FERRY_REQUIRE_ALL", "1")
                    .current_dir(&dir),
                20 * MINUTE,
            )?;
            run_step(
                Command::new(&python)
                    .arg("examples/kv_cache_handoff.py")
                    .current_dir(&dir),
                5 * MINUTE,
            )
        },
    },
    // Every interleaving of the access guard's enter, release, close and drain wake-up, of the link
    // slots, and of the access epochs a revoke waits on, under loom. `--cfg loom` rebuilds every
    // dependency, so it gets a target folder of its own (inside the workspace's) and never
    // invalidates the normal build.
    Step {
        name: "loom models (access guard, link slots, access epochs, write-through handoff, lending table)",
        lint: false,
        run: |_| {
            let meta = cargo_metadata()?;
            let target = target_dir(&meta)?.join("loom");
            run_step(
                cargo()
                    .args(["test", "-p", "ferry-core", "--release", "--test", "loom_guard"])
                    .env("RUSTFLAGS", "--cfg loom")
                    .env("CARGO_TARGET_DIR", target),
                30 * MINUTE,
            )
        },
    },
    // The fuzz targets, briefly: the repository's corpus (past crashes included) replayed, then new
    // inputs for a few seconds each. `cargo xtask fuzz` runs them longer.
    Step {
        name: "fuzz (frame decoder, handshake, protocol, transport bytes, records; 15 s each)",
        lint: false,
        run: |_| crate::fuzz::fuzz(crate::fuzz::TARGETS, Duration::from_secs(15)),
    },
    // Real verbs: ferry-rdma's tests inside the Soft-RoCE guest (the host has no RDMA device).
    Step {
        name: "rig test (RDMA over Soft-RoCE)",
        lint: false,
        run: |_| run_step(cargo().args(["xtask", "rig", "test"]), 45 * MINUTE),
    },
    // Loss, delay and a partition between two network namespaces, in the rig's kernel (netem qdisc).
    Step {
        name: "rig test (netem faults)",
        lint: false,
        run: |_| {
            run_step(
                cargo().args(["xtask", "rig", "test", "-p", "ferry-cli", "--", "netem_"]),
                30 * MINUTE,
            )
        },
    },
    // A fleet of eight engines (processes in network namespaces, a real etcd) pulling KV batches while
    // engines are killed, hung, delayed, lossy and partitioned and etcd restarts: every invariant must
    // hold (no wrong byte reported done, no call past its deadline, dead engines leave the directory,
    // bounded resources, throughput back after each fault). In the rig's kernel, for netem.
    Step {
        name: "chaos (short profile: a fleet under faults)",
        lint: false,
        run: |_| run_step(cargo().args(["xtask", "chaos", "--profile", "short"]), 20 * MINUTE),
    },
    // Persistent writes against simulated power cuts (qemu killed on the acknowledgement), TCP and RDMA,
    // with a negative control per transport.
    Step {
        name: "rig powercut (durable writes)",
        lint: false,
        run: |_| run_step(cargo().args(["xtask", "rig", "powercut"]), 30 * MINUTE),
    },
    // libferry and its header as C and C++ programs use them: shared, static, and under ASan/UBSan.
    Step {
        name: "C and C++ examples (libferry: shared, static, ASan)",
        lint: false,
        run: |_| crate::capi::examples(),
    },
    Step {
        name: "example kv_cache_handoff",
        lint: false,
        run: |_| {
            run_step(
                cargo().args(["run", "--release", "--example", "kv_cache_handoff", "-p", "ferry"]),
                20 * MINUTE,
            )
        },
    },
    Step {
        name: "example resilient_client",
        lint: false,
        run: |_| {
            run_step(
                cargo().args(["run", "--release", "--example", "resilient_client", "-p", "ferry-tower"]),
                20 * MINUTE,
            )
        },
    },
];

pub fn run(args: &Args) -> ExitCode {
    let steps: Vec<&Step> = STEPS
        .iter()
        .filter(|s| !(args.no_lint && s.lint))
        .filter(|s| {
            args.only
                .as_deref()
                .is_none_or(|text| s.name == "prerequisites" || s.name.contains(text))
        })
        .collect();
    let mut passed = 0;
    for (i, step) in steps.iter().enumerate() {
        eprintln!("==> xtask test [{}/{}]: {}", i + 1, steps.len(), step.name);
        if let Err(e) = (step.run)(args) {
            eprintln!("xtask test: step `{}` failed: {e:#}", step.name);
            println!("xtask test: {passed} passed, 1 failed");
            return ExitCode::FAILURE;
        }
        passed += 1;
    }
    println!("xtask test: {passed} passed, 0 failed");
    ExitCode::SUCCESS
}

/// Installs what the steps need when it is missing: Debian packages, rustfmt/clippy, cargo-deny.
fn prerequisites(args: &Args) -> Result<()> {
    ensure_debian_packages(DEBIAN_PACKAGES)?;
    if args.no_lint {
        return Ok(());
    }
    if !succeeds(cargo().args(["fmt", "--version"])) || !succeeds(cargo().args(["clippy", "--version"])) {
        run_step(
            Command::new("rustup").args(["component", "add", "rustfmt", "clippy"]),
            10 * MINUTE,
        )
        .context("rustfmt or clippy is missing; installing with `rustup component add rustfmt clippy`")?;
    }
    if !succeeds(cargo().args(["deny", "--version"])) {
        run_step(cargo().args(["install", "--locked", "cargo-deny"]), 45 * MINUTE)
            .context("cargo-deny is missing; installing with `cargo install --locked cargo-deny`")?;
        if !succeeds(cargo().args(["deny", "--version"])) {
            bail!("`cargo deny --version` still fails after `cargo install --locked cargo-deny`");
        }
    }
    Ok(())
}
