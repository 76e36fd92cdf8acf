//! Authentication from the command line, across processes: `ferry certs` makes a CA and certificates,
//! `ferry serve` with them admits only holders of a certificate from that CA, and says when it is
//! open to anyone.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;

fn ferry(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .output()
        .expect("run ferry")
}

fn certs(dir: &Path, names: &[&str]) {
    let mut args = vec!["certs", "--out", dir.to_str().unwrap()];
    for n in names {
        args.extend(["--name", n]);
    }
    let out = ferry(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn tls_args(dir: &Path, name: &str) -> Vec<String> {
    let p = |f: String| dir.join(f).to_str().unwrap().to_string();
    vec![
        "--tls-cert".into(),
        p(format!("{name}.pem")),
        "--tls-key".into(),
        p(format!("{name}.key")),
        "--tls-ca".into(),
        p("ca.pem".into()),
    ]
}

#[test]
fn a_served_region_is_reachable_only_with_a_certificate_of_its_ca() {
    let dir = std::env::temp_dir().join(format!("ferry-auth-{}", std::process::id()));
    certs(&dir, &["server", "client"]);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.join("client.key")).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "a private key is readable by its owner only: {mode:o}");
    let other = dir.join("other");
    certs(&other, &["stranger"]);

    let mut cmd = common::serve_command("127.0.0.1:0", "1MiB");
    cmd.args(tls_args(&dir, "server")).args(["--grant", "client"]);
    let serve = common::start(cmd).expect("ferry serve with TLS starts");
    let addr = serve.addr.to_string();

    let mut args = vec!["info", "--json", "--peer", addr.as_str()];
    let client = tls_args(&dir, "client");
    args.extend(client.iter().map(String::as_str));
    let out = ferry(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["link"]["authentication"], "mutual TLS", "{v}");
    assert_eq!(v["link"]["peer_identity"], "server", "{v}");
    assert_eq!(v["link"]["regions"], 1);

    // Without a certificate, or with one from another CA: refused, and told why.
    for extra in [Vec::new(), tls_args(&other, "stranger")] {
        let mut args = vec!["info", "--peer", addr.as_str()];
        args.extend(extra.iter().map(String::as_str));
        let out = ferry(&args);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("PermissionDenied") || err.to_lowercase().contains("permission"),
            "{err}"
        );
    }
    drop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_open_server_says_so() {
    let mut child = common::serve_command("127.0.0.1:0", "1MiB")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 512];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !seen.contains("authentication is off") && std::time::Instant::now() < deadline {
        match stderr.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(seen.contains("WARNING: authentication is off"), "{seen}");
    assert!(seen.contains("anyone who can reach"), "{seen}");
}
