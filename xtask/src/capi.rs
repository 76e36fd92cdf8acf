//! The C ABI's examples, as a C or C++ program gets them: `libferry` built in release, each example
//! compiled with the system compiler against `include/`, linked to the shared library, to the static
//! one, and once more under AddressSanitizer and UndefinedBehaviorSanitizer; every build is run, and
//! each run is two processes checking every byte.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::util::{cargo, cargo_metadata, run_step, target_dir};

const MINUTE: Duration = Duration::from_secs(60);

/// What a Rust static library needs from the system when a C program links it.
const STATIC_LIBS: &[&str] = &["-lpthread", "-ldl", "-lm", "-lrt", "-lgcc_s"];

pub fn examples() -> Result<()> {
    run_step(cargo().args(["build", "--release", "-p", "ferry-capi"]), 30 * MINUTE)?;
    let meta = cargo_metadata()?;
    let root = meta["workspace_root"]
        .as_str()
        .context("cargo metadata has no workspace_root")?;
    let crate_dir = Path::new(root).join("crates/ferry-capi");
    let lib_dir = target_dir(&meta)?.join("release");
    let out = lib_dir.join("capi-examples");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let include = format!("-I{}", crate_dir.join("include").display());
    let examples = [
        ("cc", "two_processes.c", &["-std=c11", "-D_DEFAULT_SOURCE"][..]),
        ("c++", "hixl_two_processes.cpp", &["-std=c++17"][..]),
    ];
    for (compiler, source, language) in examples {
        let source_path = crate_dir.join("examples").join(source);
        let stem = source.split('.').next().unwrap_or(source);
        let shared = [
            format!("-L{}", lib_dir.display()),
            "-lferry".into(),
            format!("-Wl,-rpath,{}", lib_dir.display()),
        ];
        let mut static_link = vec![lib_dir.join("libferry.a").display().to_string()];
        static_link.extend(STATIC_LIBS.iter().map(|s| s.to_string()));
        let sanitized = [
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
            "-g",
        ];
        let variants: [(&str, Vec<String>, &[&str]); 3] = [
            ("shared", shared.to_vec(), &["-O2"]),
            ("static", static_link, &["-O2"]),
            ("asan", shared.to_vec(), &sanitized),
        ];
        for (variant, link, flags) in variants {
            let binary = out.join(format!("{stem}-{variant}"));
            run_step(
                Command::new(compiler)
                    .args(["-Wall", "-Wextra", "-Werror"])
                    .args(language)
                    .args(flags)
                    .arg(&include)
                    .arg(&source_path)
                    .arg("-o")
                    .arg(&binary)
                    .args(&link),
                5 * MINUTE,
            )?;
            // detect_leaks: LeakSanitizer reports what either process never freed.
            run_step(
                Command::new(&binary).env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1"),
                3 * MINUTE,
            )?;
        }
    }
    Ok(())
}
