//! Shared memory between two processes, against `ferry serve` as the target: it is found by itself,
//! refused with the reason where the processes cannot use it (another PID namespace, a process that may
//! not attach to ours), and a target killed mid-batch gives a typed error, not a hang.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{serve_command, start};
use ferry::{Access, Engine, Error, Op, TransferDesc, TransportKind};

const T: Duration = Duration::from_secs(10);

fn root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Writes `len` bytes of a pattern to the target's region in 64 KiB pieces and reads them back.
async fn round_trip(engine: &Engine, peer: &ferry::Peer, region: u64, len: u64) {
    let src = engine.alloc_host(len as usize, Access::READ_WRITE).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + (i >> 12)) as u8).collect();
    src.write_at(0, &data).unwrap();
    let descs: Vec<_> = (0..len / (64 << 10))
        .map(|i| TransferDesc::new(src.addr_at(i << 16), region + (i << 16), 64 << 10))
        .collect();
    engine.transfer(peer, Op::Write, &descs, T).await.unwrap();
    let back = engine.alloc_host(len as usize, Access::READ_WRITE).unwrap();
    engine
        .transfer(peer, Op::Read, &[TransferDesc::new(back.addr(), region, len)], T)
        .await
        .unwrap();
    assert!(back.to_vec().unwrap() == data, "the bytes came back as written");
}

/// Connects to `cmd`'s `ferry serve` and checks that the link fell back to TCP because shared memory
/// was refused for a reason that contains `reason`; then moves bytes over it.
async fn falls_back_to_tcp(cmd: Command, reason: &str) {
    let serve = start(cmd).expect("ferry serve starts");
    let engine = Engine::builder().build().await.unwrap();
    let peer = engine.connect(&serve.addr.to_string(), T).await.unwrap();
    assert_eq!(peer.transport(), TransportKind::Tcp);
    let [(kind, why)] = peer.passed_over() else {
        panic!("one transport passed over: {:?}", peer.passed_over())
    };
    assert_eq!(*kind, TransportKind::Shm);
    assert!(why.contains(reason), "{why}");
    round_trip(&engine, &peer, serve.region, 4 << 20).await;
}

/// An engine linked to `serve` over shared memory (the test fails with the reason otherwise).
async fn connect_over_shm(serve: &common::Serve) -> (Engine, ferry::Peer) {
    let engine = Engine::builder().build().await.unwrap();
    let peer = engine.connect(&serve.addr.to_string(), T).await.unwrap();
    assert_eq!(
        peer.transport(),
        TransportKind::Shm,
        "passed over: {:?}",
        peer.passed_over()
    );
    (engine, peer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_on_one_host_use_shared_memory() {
    let serve = start(serve_command("127.0.0.1:0", "16MiB")).expect("ferry serve starts");
    let (engine, peer) = connect_over_shm(&serve).await;
    assert!(peer.passed_over().is_empty());
    round_trip(&engine, &peer, serve.region, 16 << 20).await;
}

/// A target in its own PID namespace (a container without a shared PID namespace): its process ids
/// mean other processes here, so the link must not use them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_in_another_pid_namespace_falls_back_to_tcp_and_says_why() {
    assert!(root(), "unshare --pid needs root (CI runs as root)");
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--kill-child", env!("CARGO_BIN_EXE_ferry")]);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--region-size", "4MiB"]);
    falls_back_to_tcp(cmd, "PID namespace").await;
}

/// A target that may not attach to this process (another user, so the kernel denies it): the setup's
/// probe fails and the link falls back, with the kernel's answer as the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_the_kernel_denies_falls_back_to_tcp_and_says_why() {
    assert!(
        root(),
        "running the target as another user needs root (CI runs as root)"
    );
    // The binary where user `nobody` may run it (a test's target folder may be private).
    let dir = std::env::temp_dir().join(format!("ferry-shm-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.join("ferry");
    std::fs::copy(env!("CARGO_BIN_EXE_ferry"), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
    cmd.arg(&bin);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--region-size", "4MiB"]);
    falls_back_to_tcp(cmd, "EPERM").await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The target dies (SIGKILL) while batches are under way: the transfer fails with a typed error well
/// within its timeout, and the link says it is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_killed_mid_batch_gives_a_typed_error() {
    let mut serve = start(serve_command("127.0.0.1:0", "64MiB")).expect("ferry serve starts");
    let (engine, peer) = connect_over_shm(&serve).await;
    let src = engine.alloc_host(64 << 20, Access::READ_WRITE).unwrap();
    let descs: Vec<_> = (0..1024u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 16), serve.region + (i << 16), 64 << 10))
        .collect();
    let writes = {
        let (engine, peer) = (engine.clone(), peer.clone());
        tokio::spawn(async move {
            let mut done = 0u32;
            loop {
                match engine.transfer(&peer, Op::Write, &descs, T).await {
                    Ok(()) => done += 1,
                    Err(e) => return (done, e, Instant::now()),
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    serve.child.kill().unwrap();
    let killed = Instant::now();
    let (done, err, failed) = tokio::time::timeout(T, writes).await.expect("no hang").unwrap();
    assert!(done > 0, "batches completed before the kill");
    assert!(matches!(err, Error::PeerClosed(_)), "{err:?}");
    assert!(
        failed.duration_since(killed) < Duration::from_secs(5),
        "the error took {:?}",
        failed - killed
    );
    assert!(peer.is_closed());
}

/// The initiator dies (SIGKILL) in the middle of its batches: the target's side of that link ends, and
/// the target goes on serving the next peer over shared memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_killed_mid_batch_leaves_the_target_serving() {
    let serve = start(serve_command("127.0.0.1:0", "16MiB")).expect("ferry serve starts");
    let mut bench = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["bench", "--peer", &serve.addr.to_string(), "--transport", "shm"])
        .args(["--op", "write", "--size", "1MiB", "--batch", "8", "--duration", "30s"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start ferry bench");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(bench.try_wait().unwrap().is_none(), "the bench is still writing");
    bench.kill().unwrap();
    bench.wait().unwrap();

    let (engine, peer) = connect_over_shm(&serve).await;
    round_trip(&engine, &peer, serve.region, 16 << 20).await;
}
