//! CUDA memory between two processes, against `ferry serve --mem cuda`: the served region is GPU
//! memory, written by this process over TCP (copied between the server's own buffers and the GPU) and over
//! shared memory (the region opened here by its CUDA IPC handle), and each write is read back over
//! the other path. Both paths reach the GPU itself, not a host copy the other could see (a TCP read
//! makes the server copy from the device before it answers; IPC copies are the device's), so the
//! bytes compared are the GPU's. Then GPU to GPU: CUDA memory of this process written into the
//! peer's region and read back, checked on this process's device.
//!
//! Needs an NVIDIA GPU and its driver: without them each test says that it did not run and why;
//! with `FERRY_REQUIRE_CUDA=1` (the GPU machine's script) that is a failure.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{serve_command, start};
use ferry::cuda::{CudaBlock, CudaDevice, CudaRegistry};
use ferry::{Access, Engine, Op, Peer, Region, TransferDesc, TransportKind};

const T: Duration = Duration::from_secs(30);
const LEN: u64 = 8 << 20;
const PIECE: u64 = 1 << 20;

/// Device 0, or `None` after saying why there is none (a failure under `FERRY_REQUIRE_CUDA=1`).
fn device(test: &str) -> Option<Arc<CudaDevice>> {
    match CudaDevice::open(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("FERRY_REQUIRE_CUDA").is_ok_and(|v| v == "1") => {
            panic!("{test} needs a CUDA device (FERRY_REQUIRE_CUDA=1): {e}")
        }
        Err(e) => {
            eprintln!("{test}: did not run: no CUDA device: {e}");
            None
        }
    }
}

fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(131) >> 3) as u8 ^ seed ^ (i >> 16) as u8)
        .collect()
}

fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first wrong byte at {at}: {:#04x}, expected {:#04x}",
            got[at], want[at]
        );
    }
}

/// `[from, from + len)` of `local` to the same offsets of the peer's region, in 1 MiB pieces.
fn descs(local: &Region, remote: u64, from: u64, len: u64) -> Vec<TransferDesc> {
    (from..from + len)
        .step_by(PIECE as usize)
        .map(|at| TransferDesc::new(local.addr_at(at), remote + at, PIECE))
        .collect()
}

/// An engine that reaches the server only by `transport`, and its link.
async fn link(addr: &str, transport: TransportKind) -> (Engine, Peer) {
    let engine = Engine::builder().transports([transport]).build().await.unwrap();
    let peer = engine.connect(addr, T).await.unwrap();
    assert_eq!(peer.transport(), transport, "{:?}", peer.passed_over());
    (engine, peer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_region_of_another_process_over_tcp_and_shared_memory() {
    let test = "a_gpu_region_of_another_process_over_tcp_and_shared_memory";
    let Some(device) = device(test) else { return };
    let mut cmd = serve_command("127.0.0.1:0", &LEN.to_string());
    cmd.args(["--mem", "cuda"]);
    let serve = start(cmd).expect("ferry serve --mem cuda starts");
    let addr = serve.addr.to_string();
    let (tcp, over_tcp) = link(&addr, TransportKind::Tcp).await;
    let (shm, over_shm) = link(&addr, TransportKind::Shm).await;
    let remote = serve.region;

    // The served region is a whole allocation of ferry's: it is lent by CUDA IPC, not staged.
    let (_, route) = over_shm
        .routes()
        .into_iter()
        .find(|(ad, _)| ad.addr == remote)
        .expect("the served region has a route");
    assert_eq!(route.transport, TransportKind::Shm, "{route:?}");
    assert!(route.how.contains("CUDA IPC"), "{route:?}");

    // Host memory here: the first half written over TCP and read over shared memory, the second the
    // other way round.
    let half = LEN / 2;
    let first = pattern(LEN, 0x11);
    let src = tcp.register(first.clone(), Access::READ_WRITE).unwrap();
    tcp.transfer(&over_tcp, Op::Write, &descs(&src, remote, 0, half), T)
        .await
        .unwrap();
    let back = shm.alloc_host(LEN as usize, Access::READ_WRITE).unwrap();
    shm.transfer(&over_shm, Op::Read, &descs(&back, remote, 0, half), T)
        .await
        .unwrap();
    assert_bytes(
        &back.to_vec().unwrap()[..half as usize],
        &first[..half as usize],
        "written over TCP, read by CUDA IPC",
    );
    let (_, route) = over_shm.routes().into_iter().find(|(ad, _)| ad.addr == remote).unwrap();
    assert_eq!(
        route.transport,
        TransportKind::Shm,
        "the IPC path was not taken: {route:?}"
    );

    let second = pattern(LEN, 0x22);
    let src = shm.register(second.clone(), Access::READ_WRITE).unwrap();
    shm.transfer(&over_shm, Op::Write, &descs(&src, remote, half, half), T)
        .await
        .unwrap();
    let back = tcp.alloc_host(LEN as usize, Access::READ_WRITE).unwrap();
    tcp.transfer(&over_tcp, Op::Read, &descs(&back, remote, half, half), T)
        .await
        .unwrap();
    assert_bytes(
        &back.to_vec().unwrap()[half as usize..],
        &second[half as usize..],
        "written by CUDA IPC, read over TCP",
    );

    // GPU to GPU: this process's device memory into the peer's and back, checked on the device.
    let registry = CudaRegistry::new(device);
    let gpu_src: Arc<CudaBlock> = registry.allocate_block(LEN as usize).unwrap();
    let third = pattern(LEN, 0x33);
    gpu_src.write_device(0, &third).unwrap();
    let src = shm.register_block(gpu_src.clone(), Access::READ_WRITE).unwrap();
    shm.transfer(&over_shm, Op::Write, &descs(&src, remote, 0, LEN), T)
        .await
        .unwrap();
    tcp.transfer(&over_tcp, Op::Read, &descs(&back, remote, 0, LEN), T)
        .await
        .unwrap();
    assert_bytes(&back.to_vec().unwrap(), &third, "GPU to GPU by CUDA IPC, read over TCP");
    let gpu_dst: Arc<CudaBlock> = registry.allocate_block(LEN as usize).unwrap();
    let dst = shm.register_block(gpu_dst.clone(), Access::READ_WRITE).unwrap();
    shm.transfer(&over_shm, Op::Read, &descs(&dst, remote, 0, LEN), T)
        .await
        .unwrap();
    let mut on_gpu = vec![0u8; LEN as usize];
    gpu_dst.read_device(0, &mut on_gpu).unwrap();
    assert_bytes(&on_gpu, &third, "GPU to GPU by CUDA IPC, read into this process's GPU");
    drop(serve);
}
