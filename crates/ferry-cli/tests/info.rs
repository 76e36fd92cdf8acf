//! `ferry info` reports the link to a running engine, how it persists, and how a file maps.

mod common;

use std::process::Command;

use serde_json::Value;

fn info(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("info")
        .args(args)
        .arg("--json")
        .output()
        .expect("run ferry info");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("ferry info --json prints JSON")
}

#[test]
fn info_describes_a_link_to_a_persistent_target() {
    let path = std::env::temp_dir().join(format!("ferry-info-{}", std::process::id()));
    let mut cmd = common::serve_command("127.0.0.1:0", "1MiB");
    cmd.arg("--file").arg(&path);
    let serve = common::start(cmd).expect("ferry serve --file starts");
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        1 << 20,
        "the file was extended"
    );

    let v = info(&["--peer", &serve.addr.to_string()]);
    let link = &v["link"];
    // Two processes on one host: shared memory, whose target persists before it answers.
    assert_eq!(link["transport"], "shm", "{link}");
    assert_eq!(link["passed_over"], serde_json::json!([]));
    assert_eq!(link["persist_method"], "flush-before-ack");
    assert_eq!(link["persistent_regions"], 1);
    // Region by region: the file region is copied by the target's process (it is not an allocation
    // the target lends).
    let route = &link["routes"][0];
    assert_eq!(route["transport"], "shm", "{link}");
    assert!(
        route["how"].as_str().unwrap().contains("copied by the peer's process"),
        "{route}"
    );
    assert_eq!(route["passed_over"], Value::Null);
    assert!(v["transports"].is_array(), "the capabilities are there too: {v}");

    let v = info(&["--file", path.to_str().unwrap()]);
    let kind = v["file"]["kind"].as_str().unwrap();
    assert!(kind == "file (msync)" || kind.starts_with("file (MAP_SYNC"), "{kind}");
    drop(serve);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn info_names_an_unreachable_peer() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["info", "--peer", "127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("127.0.0.1:1"), "{err}");
}

#[test]
fn info_with_a_path_policy_says_why_the_link_cannot_have_it() {
    let serve = common::start(common::serve_command("127.0.0.1:0", "1MiB")).expect("ferry serve starts");
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["info", "--peer", &serve.addr.to_string(), "--path-policy", "rdma"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "RDMA cannot be had on this host");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("requires rdma") && err.contains("rdma: not"), "{err}");
    // Shared memory can.
    let v = info(&["--peer", &serve.addr.to_string(), "--path-policy", "shm"]);
    assert_eq!(v["link"]["transport"], "shm", "{v}");
}
