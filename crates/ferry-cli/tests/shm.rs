//! Shared memory between two processes, against `ferry serve` as the target: it is found by itself,
//! the target's engine allocation is lent and mapped here (seen in this process's own memory map),
//! refused with the reason where the processes cannot use it (another PID namespace), narrowed to the
//! lent regions where the kernel denies cross-memory attach, and a target killed mid-batch gives a
//! typed error, not a hang, and leaves no mapping behind.
//!
//! The initiators here keep their own buffers in memory they own (`register`), so every mapping of an
//! engine allocation in this process is one a target lent; each test's region has its own size, so
//! that tests running side by side count only their own.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{serve_command, start};
use ferry::{Access, Engine, Error, Op, PathPolicy, TransferDesc, TransportKind};

const T: Duration = Duration::from_secs(10);

fn root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// How many mappings of `len` bytes of an engine allocation (a memfd) this process holds.
fn lent_mappings(len: u64) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:ferry-host"))
        .filter(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (start, end) = range.split_once('-').unwrap();
            u64::from_str_radix(end, 16).unwrap() - u64::from_str_radix(start, 16).unwrap() == len
        })
        .count()
}

/// Waits until this process holds no mapping of `len` bytes of an engine allocation.
async fn no_mapping_left(len: u64) {
    let deadline = Instant::now() + T;
    while lent_mappings(len) > 0 {
        assert!(
            Instant::now() < deadline,
            "a mapping of the target's region is still held"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes `len` bytes of a pattern to the target's region in 64 KiB pieces and reads them back.
async fn round_trip(engine: &Engine, peer: &ferry::Peer, region: u64, len: u64) {
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + (i >> 12)) as u8).collect();
    let src = engine.register(data.clone(), Access::READ_WRITE).unwrap();
    let descs: Vec<_> = (0..len / (64 << 10))
        .map(|i| TransferDesc::new(src.addr_at(i << 16), region + (i << 16), 64 << 10))
        .collect();
    engine.transfer(peer, Op::Write, &descs, T).await.unwrap();
    let back = engine.register(vec![0u8; len as usize], Access::READ_WRITE).unwrap();
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
    const LEN: u64 = 24 << 20;
    let serve = start(serve_command("127.0.0.1:0", "24MiB")).expect("ferry serve starts");
    let (engine, peer) = connect_over_shm(&serve).await;
    assert!(peer.passed_over().is_empty());
    round_trip(&engine, &peer, serve.region, LEN).await;
    assert_eq!(lent_mappings(LEN), 1, "the target's region is mapped here, once");
    // Closing the link gives the mapping back.
    engine.disconnect(&peer, T).await.unwrap();
    no_mapping_left(LEN).await;
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

/// `ferry serve` as user `nobody`: another user, so the kernel denies it cross-memory attach to this
/// process (the setup's probe fails with EPERM).
fn serve_as_nobody(dir: &std::path::Path, region_size: &str, caller_owned: bool) -> Command {
    assert!(
        root(),
        "running the target as another user needs root (CI runs as root)"
    );
    // The binary where user `nobody` may run it (a test's target folder may be private).
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.join("ferry");
    std::fs::copy(env!("CARGO_BIN_EXE_ferry"), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
    cmd.arg(&bin);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--region-size", region_size]);
    if caller_owned {
        cmd.arg("--caller-owned");
    }
    cmd
}

/// Connects to `serve`, which the kernel denies cross-memory attach to this process: the link is
/// shared memory all the same (for what the target lends), and says what goes over TCP and why.
async fn connect_denied(serve: &common::Serve) -> (Engine, ferry::Peer) {
    let (engine, peer) = connect_over_shm(serve).await;
    let [(kind, why)] = peer.passed_over() else {
        panic!("one note: {:?}", peer.passed_over())
    };
    assert_eq!(*kind, TransportKind::Shm);
    assert!(why.contains("EPERM") && why.contains("tcp"), "{why}");
    (engine, peer)
}

/// The kernel denies cross-memory attach, but the target's region is its engine's allocation: it is
/// lent, mapped here, and every byte moves over shared memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lent_region_needs_no_cross_memory_attach() {
    const LEN: u64 = 5 << 20;
    let dir = std::env::temp_dir().join(format!("ferry-shm-test-lent-{}", std::process::id()));
    let serve = start(serve_as_nobody(&dir, "5MiB", false)).expect("ferry serve starts");
    let (engine, peer) = connect_denied(&serve).await;
    let [(_, route)] = &peer.routes()[..] else {
        panic!("one region: {:?}", peer.routes())
    };
    assert_eq!(route.transport, TransportKind::Shm, "{route:?}");
    assert!(
        route.how.starts_with("mapped into this process") && route.passed_over.is_none(),
        "{route:?}"
    );
    round_trip(&engine, &peer, serve.region, LEN).await;
    assert_eq!(lent_mappings(LEN), 1, "the region moved through a mapping");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The kernel denies cross-memory attach and the target's region is memory it owns: that region
/// falls back to TCP (and is never mapped here), the link stays shared memory for the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_owned_memory_falls_back_to_tcp_where_the_kernel_denies_it() {
    const LEN: u64 = 6 << 20;
    let dir = std::env::temp_dir().join(format!("ferry-shm-test-owned-{}", std::process::id()));
    let serve = start(serve_as_nobody(&dir, "6MiB", true)).expect("ferry serve starts");
    let (engine, peer) = connect_denied(&serve).await;
    // Region by region: this one over TCP, and why.
    let [(_, route)] = &peer.routes()[..] else {
        panic!("one region: {:?}", peer.routes())
    };
    assert_eq!(route.transport, TransportKind::Tcp, "{route:?}");
    let why = route.passed_over.as_deref().unwrap_or_default();
    assert!(
        why.starts_with("shm: the peer does not lend this region") && why.contains("EPERM"),
        "{why}"
    );
    round_trip(&engine, &peer, serve.region, LEN).await;
    assert_eq!(lent_mappings(LEN), 0, "memory the target owns is never lent");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Same-host memory required where the kernel denies cross-memory attach: the link would carry only
/// some regions, the rest over TCP, so `connect` fails instead, naming the kernel's refusal; nothing
/// is left linked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_memory_required_where_the_kernel_denies_it_fails_at_connect_and_says_why() {
    let dir = std::env::temp_dir().join(format!("ferry-shm-test-policy-{}", std::process::id()));
    let serve = start(serve_as_nobody(&dir, "4MiB", true)).expect("ferry serve starts");
    let engine = Engine::builder().build().await.unwrap();
    let policy = PathPolicy::Require(vec![TransportKind::Shm]);
    let err = engine
        .connect_with(&serve.addr.to_string(), T, &policy)
        .await
        .unwrap_err();
    let Error::Unsupported(m) = &err else {
        panic!("expected Unsupported, got {err:?}")
    };
    assert!(
        m.contains("shm: refused while setting it up") && m.contains("EPERM"),
        "{m}"
    );
    assert!(
        engine.peers().is_empty() && engine.link_count() == 0,
        "a refused link stays"
    );
    // The policy `any` takes the same link, shared memory for what is lent and TCP for the rest.
    let (engine, peer) = connect_denied(&serve).await;
    round_trip(&engine, &peer, serve.region, 4 << 20).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Same-host memory required of a peer in another PID namespace: refused, and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_memory_required_of_a_peer_in_another_pid_namespace_fails_and_says_why() {
    assert!(root(), "unshare --pid needs root (CI runs as root)");
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--kill-child", env!("CARGO_BIN_EXE_ferry")]);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--region-size", "4MiB"]);
    let serve = start(cmd).expect("ferry serve starts");
    let engine = Engine::builder()
        .path_policy(PathPolicy::Require(vec![TransportKind::Shm]))
        .build()
        .await
        .unwrap();
    let err = engine.connect(&serve.addr.to_string(), T).await.unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported(m) if m.contains("shm: refused while setting it up") && m.contains("PID namespace")),
        "{err:?}"
    );
}

/// The target dies (SIGKILL) while batches are under way: the transfer fails with a typed error well
/// within its timeout, and the link says it is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_killed_mid_batch_gives_a_typed_error() {
    let mut serve = start(serve_command("127.0.0.1:0", "64MiB")).expect("ferry serve starts");
    let (engine, peer) = connect_over_shm(&serve).await;
    let src = engine.register(vec![7u8; 64 << 20], Access::READ_WRITE).unwrap();
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
    assert_eq!(lent_mappings(64 << 20), 1, "the writes go through a mapping");
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
    // The dead target's memory is not pinned here: the mapping went with the link.
    no_mapping_left(64 << 20).await;
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
