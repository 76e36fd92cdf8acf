//! A hostile-peer run against `ferry serve` with authentication on, in two processes: thousands of
//! malicious connections (garbage, oversized frame headers, TLS handshakes that stall, floods of stream
//! joins, authenticated floods of notifications) while an authorised client transfers. The server's
//! memory must stay bounded and the client must be served; the figures are printed.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferry::codec::{Frame, Hello};
use ferry::{Engine, Notification, Op, TlsConfig, TransferDesc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(30);

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn raise_fd_limit(want: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit write and read the plain struct passed by pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < want {
            lim.rlim_cur = want.min(lim.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn tls(dir: &Path, name: &str) -> TlsConfig {
    TlsConfig::from_pem_files(
        &dir.join(format!("{name}.pem")),
        &dir.join(format!("{name}.key")),
        &dir.join("ca.pem"),
    )
    .unwrap()
}

/// Writes 64 MiB in 1 MiB descriptors, `rounds` times; GB/s.
async fn throughput(engine: &Engine, peer: &ferry::Peer, src: &ferry::Region, dst: u64, rounds: u32) -> f64 {
    let descs: Vec<_> = (0..64u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 20), dst + (i << 20), 1 << 20))
        .collect();
    let started = Instant::now();
    for _ in 0..rounds {
        engine.transfer(peer, Op::Write, &descs, T).await.unwrap();
    }
    (rounds as f64 * (64u64 << 20) as f64) / started.elapsed().as_secs_f64() / 1e9
}

fn hello(token: u64, index: u16) -> Vec<u8> {
    let mut out = bytes::BytesMut::new();
    let frame = Frame::Hello(Hello {
        engine_id: token,
        link_token: token,
        stream_index: index,
        stream_count: 64,
        transports: vec![ferry::TransportKind::Tcp],
        host_id: 0,
        join_proof: [0; 32],
        protection: ferry::DataProtection::Plain,
    });
    ferry::codec::encode(&frame, 0, &mut out).unwrap();
    out.to_vec()
}

/// One malicious connection of kind `k`; returns once the server closed it (or it gave up).
async fn attack(addr: std::net::SocketAddr, k: usize, closed: Arc<AtomicUsize>) {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        // Not let in at all.
        closed.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let bytes: Vec<u8> = match k % 4 {
        // Garbage.
        0 => (0..16 << 10)
            .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect(),
        // A frame header that announces a 4 GiB body and a 2^60-byte payload.
        1 => {
            let mut h = Vec::new();
            h.extend_from_slice(&ferry::codec::MAGIC.to_le_bytes());
            h.extend_from_slice(&[ferry::codec::VERSION, 1]);
            h.extend_from_slice(&u32::MAX.to_le_bytes());
            h.extend_from_slice(&(1u64 << 60).to_le_bytes());
            h
        }
        // The start of a TLS record, then nothing: a handshake that stalls.
        2 => vec![0x16, 0x03, 0x01, 0x02, 0x00],
        // Stream joins of links that do not exist, without proofs.
        _ => (1..64).flat_map(|i| hello(k as u64, i)).collect(),
    };
    let _ = s.write_all(&bytes).await;
    let mut sink = [0u8; 4096];
    loop {
        match tokio::time::timeout(T, s.read(&mut sink)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Ok(Ok(_)) => continue,
            Err(_) => return,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_region_survives_thousands_of_hostile_connections() {
    raise_fd_limit(8192);
    let dir = std::env::temp_dir().join(format!("ferry-hostile-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "certs",
            "--out",
            dir.to_str().unwrap(),
            "--name",
            "server",
            "--name",
            "client",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut cmd = common::serve_command("127.0.0.1:0", "64MiB");
    for (flag, file) in [
        ("--tls-cert", "server.pem"),
        ("--tls-key", "server.key"),
        ("--tls-ca", "ca.pem"),
    ] {
        cmd.arg(flag).arg(dir.join(file));
    }
    cmd.args(["--grant", "client"]);
    let serve = common::start(cmd).expect("ferry serve starts");
    let (addr, pid) = (serve.addr, serve.child.id());

    let client = Engine::builder().tls(tls(&dir, "client")).build().await.unwrap();
    let src = client.alloc_host(64 << 20, ferry::Access::READ_WRITE).unwrap();
    src.write_at(0, &vec![0x5a; 64 << 20]).unwrap();
    let peer = client.connect(&addr.to_string(), T).await.unwrap();
    // An authenticating server tells each peer its own address for the region.
    assert_eq!(serve.region, 0);
    let region = peer
        .regions()
        .iter()
        .next()
        .map(|r| r.addr)
        .expect("the region was granted to us");
    let before_gbps = throughput(&client, &peer, &src, region, 8).await;
    let rss_before = rss_kib(pid);

    // 8 authenticated engines that will flood notifications.
    let mut floods = Vec::new();
    for _ in 0..8 {
        let e = Engine::builder()
            .tls(tls(&dir, "client"))
            .streams(1)
            .build()
            .await
            .unwrap();
        let p = e.connect(&addr.to_string(), T).await.unwrap();
        floods.push((e, p));
    }
    // 2,400 malicious connections, 512 at a time, of four kinds, and the notification floods, while
    // the client keeps writing.
    let closed = Arc::new(AtomicUsize::new(0));
    let connections = 2400;
    let at_once = Arc::new(tokio::sync::Semaphore::new(512));
    let attackers: Vec<_> = (0..connections)
        .map(|k| {
            let (closed, at_once) = (closed.clone(), at_once.clone());
            tokio::spawn(async move {
                let _turn = at_once.acquire_owned().await.unwrap();
                attack(addr, k, closed).await
            })
        })
        .collect();
    let flooders: Vec<_> = floods
        .into_iter()
        .map(|(e, p)| {
            tokio::spawn(async move {
                let (mut sent, mut refused) = (0u32, 0u32);
                for i in 0..4000 {
                    match e.notify(&p, Notification::new("flood", "x".repeat(1000)), T).await {
                        Ok(()) => sent += 1,
                        Err(ferry::Error::ResourceExhausted(_)) => refused += 1,
                        Err(err) => panic!("notification {i}: {err:?}"),
                    }
                }
                (sent, refused)
            })
        })
        .collect();
    let mut peak = rss_before;
    let mut during = Vec::new();
    while attackers.iter().any(|a| !a.is_finished()) {
        during.push(throughput(&client, &peer, &src, region, 2).await);
        peak = peak.max(rss_kib(pid));
    }
    for a in attackers {
        a.await.unwrap();
    }
    let mut notified = 0;
    for f in flooders {
        notified += tokio::time::timeout(T, f).await.unwrap().unwrap().0;
    }
    peak = peak.max(rss_kib(pid));
    let after_gbps = throughput(&client, &peer, &src, region, 8).await;
    let during_gbps = during.iter().sum::<f64>() / during.len().max(1) as f64;
    let grew_mib = peak.saturating_sub(rss_before) / 1024;
    println!(
        "{connections} hostile connections ({} closed by the server), {notified} notifications flooded: server RSS \
         {} MiB -> peak {} MiB (+{grew_mib} MiB); authorised client 1 MiB writes: {before_gbps:.2} GB/s before, \
         {during_gbps:.2} GB/s during ({} samples), {after_gbps:.2} GB/s after",
        closed.load(Ordering::Relaxed),
        rss_before / 1024,
        peak / 1024,
        during.len()
    );
    assert!(grew_mib < 64, "the server grew by {grew_mib} MiB under attack");
    assert_eq!(
        closed.load(Ordering::Relaxed),
        connections,
        "every malicious connection was closed by the server"
    );
    // The client's link survived: one more transfer, and the bytes are there.
    let mut back = vec![0u8; 4096];
    let check = client.alloc_host(4096, ferry::Access::READ_WRITE).unwrap();
    client
        .transfer(&peer, Op::Read, &[TransferDesc::new(check.addr(), region, 4096)], T)
        .await
        .unwrap();
    check.read_at(0, &mut back).unwrap();
    assert!(back.iter().all(|b| *b == 0x5a));
    drop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}
