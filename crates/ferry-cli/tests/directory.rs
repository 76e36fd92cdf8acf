//! `ferry serve --name --directory` and `ferry ls` against a real etcd, each engine its own process:
//! a served engine is listed with its address, a second one claiming its name exits with the reason,
//! and a SIGKILLed one drops out of the listing within its lease. Needs the `directory` feature
//! (`cargo xtask test` builds it).
#![cfg(feature = "directory")]

mod common;
#[path = "../../ferry-etcd/tests/etcd/mod.rs"]
mod etcd;

use std::process::Command;
use std::time::{Duration, Instant};

const TTL: &str = "3";

fn ls(url: &str) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["ls", "--directory", url, "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn served_engines_are_listed_held_and_dropped_when_killed() {
    let Some(etcd) = etcd::Etcd::start() else { return };
    let url = etcd.url();
    let serve = |name: &str| {
        let mut cmd = common::serve_command("127.0.0.1:0", "1MiB");
        cmd.args(["--name", name, "--directory", &url, "--directory-ttl", TTL]);
        cmd
    };
    let mut first = common::start(serve("cache-0")).expect("ferry serve --name starts");
    let listed = ls(&url);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["name"], "cache-0");
    assert_eq!(listed[0]["addrs"][0], first.addr.to_string());

    // The name is held: a second engine claiming it exits, saying so.
    let out = serve("cache-0").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("held by a live engine"), "{err}");
    assert_eq!(ls(&url).len(), 1);

    // SIGKILL: no goodbye, the lease runs out.
    first.child.kill().unwrap();
    let _ = first.child.wait();
    let killed = Instant::now();
    while !ls(&url).is_empty() {
        assert!(
            killed.elapsed() < Duration::from_secs(3 + 2),
            "the killed engine is still listed after its lease + 2 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // And the name is free for a restarted engine.
    let again = common::start(serve("cache-0")).expect("the name is free again");
    assert_eq!(ls(&url)[0]["addrs"][0], again.addr.to_string());
}
