//! `ferry serve` as a child process, for the tests that need a target they can kill.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

/// A running `ferry serve`; killed and reaped on drop.
pub struct Serve {
    pub child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    /// The address of its one region.
    pub region: u64,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ferry serve --listen LISTEN --region-size SIZE`, with the binary cargo built for these tests.
pub fn serve_command(listen: &str, region_size: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferry"));
    cmd.args(["serve", "--listen", listen, "--region-size", region_size]);
    cmd
}

/// Starts `cmd` (a `ferry serve`, possibly behind `ip netns exec`) and reads the line it prints once it
/// listens, "listening on ADDR region 0xREGION SIZE"; `None` if it exits first (its port was taken).
pub fn start(mut cmd: Command) -> Option<Serve> {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ferry serve");
    // The guard kills and reaps the child on every early return.
    let mut serve = Serve {
        child,
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        region: 0,
    };
    let mut line = String::new();
    BufReader::new(serve.child.stdout.take()?).read_line(&mut line).ok()?;
    let words: Vec<&str> = line.split_whitespace().collect();
    if words.get(..2) != Some(&["listening", "on"][..]) || words.get(3) != Some(&"region") {
        return None;
    }
    serve.addr = words.get(2)?.parse().ok()?;
    serve.region = u64::from_str_radix(words.get(4)?.trim_start_matches("0x"), 16).ok()?;
    Some(serve)
}
