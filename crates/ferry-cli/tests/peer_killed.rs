//! A `ferry serve` process killed with SIGKILL in the middle of a batch: the transfer fails with
//! PeerClosed or Timeout within its timeout, never hangs, and the engine can connect again.

use std::time::{Duration, Instant};

use ferry::{Access, Engine, Error, Op, TransferDesc};

mod common;
use common::Serve;

fn serve() -> Serve {
    common::start(common::serve_command("127.0.0.1:0", "256MiB")).expect("ferry serve listens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_mid_batch() {
    let mut target = serve();
    let engine = Engine::builder().build().await.unwrap();
    let peer = engine
        .connect(&target.addr.to_string(), Duration::from_secs(5))
        .await
        .unwrap();
    let src = engine.alloc_host(256 << 20, Access::READ_WRITE).unwrap();
    let descs: Vec<_> = (0..64u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 22), target.region + (i << 22), 4 << 20))
        .collect();
    engine
        .transfer(&peer, Op::Write, &descs[..1], Duration::from_secs(10))
        .await
        .unwrap();

    let timeout = Duration::from_secs(10);
    let started = Instant::now();
    let batch = {
        let (engine, peer) = (engine.clone(), peer.clone());
        tokio::spawn(async move {
            // Keep batches going until one fails.
            loop {
                if let Err(e) = engine.transfer(&peer, Op::Write, &descs, timeout).await {
                    return e;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    target.child.kill().unwrap();
    target.child.wait().unwrap();
    let err = tokio::time::timeout(timeout + Duration::from_secs(5), batch)
        .await
        .expect("the transfer hung")
        .unwrap();
    assert!(matches!(err, Error::PeerClosed(_) | Error::Timeout(_)), "{err:?}");
    assert!(err.is_retryable());
    assert!(started.elapsed() < timeout + Duration::from_secs(5));
    assert!(peer.is_closed());
    let again = engine
        .transfer(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), target.region, 1)],
            timeout,
        )
        .await;
    assert!(matches!(again, Err(Error::PeerClosed(_))), "{again:?}");

    // A restarted target is reachable again from the same engine.
    let target = serve();
    let peer = engine
        .connect(&target.addr.to_string(), Duration::from_secs(5))
        .await
        .unwrap();
    engine
        .transfer(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), target.region, 4096)],
            timeout,
        )
        .await
        .unwrap();
}
