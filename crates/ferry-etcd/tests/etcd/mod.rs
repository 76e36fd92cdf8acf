//! A real etcd on loopback for tests, in a temporary data folder, on free ports. Shared by the
//! directory tests of `ferry-etcd` and `ferry-cli`.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// An etcd of its own, in a temporary data folder; killed when dropped.
pub struct Etcd {
    child: Option<Child>,
    pub dir: PathBuf,
    client: u16,
    peer: u16,
    /// Its certificate and key (PEM files), where clients must use TLS.
    tls: Option<(PathBuf, PathBuf)>,
}

impl Etcd {
    /// Starts etcd, or `None` (after saying so) where there is none and nothing requires it.
    pub fn start() -> Option<Etcd> {
        Etcd::start_with(None)
    }

    /// [`start`](Self::start), serving clients over TLS with this certificate and key.
    pub fn start_with(tls: Option<(PathBuf, PathBuf)>) -> Option<Etcd> {
        if Command::new("etcd").arg("--version").output().is_err() {
            assert!(
                std::env::var_os("FERRY_REQUIRE_ALL").is_none(),
                "no etcd binary (Debian package etcd-server); `cargo xtask test` installs it"
            );
            eprintln!("skipped: no etcd here");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("ferry-etcd-{}-{}", std::process::id(), free_port()));
        let mut etcd = Etcd {
            child: None,
            dir,
            client: free_port(),
            peer: free_port(),
            tls,
        };
        etcd.run();
        Some(etcd)
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "etcds" } else { "etcd" };
        format!("{scheme}://127.0.0.1:{}", self.client)
    }

    /// The client endpoint as etcd-client takes it.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client)
    }

    /// Starts (or restarts) the server on the same folder and ports; waits until it answers.
    pub fn run(&mut self) {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client);
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let mut cmd = Command::new("etcd");
        if let Some((cert, key)) = &self.tls {
            cmd.arg("--cert-file").arg(cert).arg("--key-file").arg(key);
        }
        let child = cmd
            .args(["--name", "t", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting etcd");
        self.child = Some(child);
        let deadline = Instant::now() + T;
        while std::net::TcpStream::connect(("127.0.0.1", self.client)).is_err() {
            assert!(Instant::now() < deadline, "etcd did not start listening");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An engine named `name`, published through a directory made with `options` at `url` under
/// `prefix`.
pub async fn publish(
    url: &str,
    prefix: &str,
    name: &str,
    options: ferry_etcd::EtcdOptions,
) -> ferry::Result<ferry::Engine> {
    let directory = ferry_etcd::EtcdDirectory::connect(url, prefix, options).await?;
    ferry::Engine::builder()
        .transports([ferry::TransportKind::Tcp])
        .listen("127.0.0.1:0")
        .name(name)
        .directory(directory)
        .build()
        .await
}

/// The names `engine`'s directory lists now, sorted.
pub async fn member_names(engine: &ferry::Engine) -> ferry::Result<Vec<String>> {
    let mut names: Vec<String> = engine.list_members().await?.into_iter().map(|r| r.name).collect();
    names.sort();
    Ok(names)
}
