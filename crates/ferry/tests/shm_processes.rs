//! The KV-cache example as two processes on one host: the decode side in one, the prefill side in
//! another. They must find shared memory by themselves, and the decode side checks every byte.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The example binary `cargo test` built beside this test.
fn example() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(|deps| deps.parent()).unwrap();
    profile.join("examples").join("kv_cache_handoff")
}

/// Kills the child when the test ends, however it ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
#[cfg(feature = "shm")]
fn the_kv_cache_example_between_two_processes_uses_shared_memory() {
    let mut decode = Child(
        Command::new(example())
            .args(["--decode", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the decode side"),
    );
    let mut lines = BufReader::new(decode.0.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first
        .strip_prefix("decode listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_string();
    let prefill = Command::new(example())
        .args(["--prefill", &addr])
        .output()
        .expect("run the prefill side");
    let out = String::from_utf8_lossy(&prefill.stdout);
    assert!(
        prefill.status.success(),
        "prefill failed: {out}{}",
        String::from_utf8_lossy(&prefill.stderr)
    );
    assert!(
        out.contains("over shm"),
        "the two processes did not use shared memory: {out}"
    );
    // The decode side exits once it checked every layer.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = decode.0.try_wait().unwrap() {
            break status;
        }
        assert!(std::time::Instant::now() < deadline, "the decode side never finished");
        std::thread::sleep(Duration::from_millis(20));
    };
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(status.success(), "decode failed: {rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("every byte of 32 layers checked")),
        "{rest:?}"
    );
}
