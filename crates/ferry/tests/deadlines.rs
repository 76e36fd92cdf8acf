//! Transfer timeouts over TCP, which the link enforces with one timer for all its operations (the
//! protocol core's deadlines): a write to a frozen target ends at its own timeout, even when another
//! write with a much later one is already waiting, and the link serves again once the target thaws.

use std::sync::mpsc;
use std::time::Duration;

use ferry::{Access, Engine, Error, Op, TransferDesc, TransportKind};

/// Far longer than any step here takes, and shorter than the link's keepalive step (5 s), so that a
/// timer that slept towards that step instead of the sooner deadline shows as a hang.
const HANG: Duration = Duration::from_secs(3);

/// A TCP target on a runtime of one thread of its own, which [`Frozen::freeze`] blocks until `thaw`.
struct Frozen {
    addr: std::net::SocketAddr,
    region: u64,
    freeze: mpsc::Sender<()>,
    /// Sent by the target's thread right before it blocks, with nothing in between that could serve.
    frozen: mpsc::Receiver<()>,
    thaw: mpsc::Sender<()>,
    done: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

fn frozen_target() -> Frozen {
    let (ready_tx, ready_rx) = mpsc::channel();
    let (freeze, freeze_rx) = mpsc::channel::<()>();
    let (frozen_tx, frozen) = mpsc::channel::<()>();
    let (thaw, thaw_rx) = mpsc::channel::<()>();
    let (done, done_rx) = mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let target = Engine::builder()
                .transports([TransportKind::Tcp])
                .listen("127.0.0.1:0")
                .build()
                .await
                .unwrap();
            let dst = target.alloc_host(1 << 16, Access::READ_WRITE).unwrap();
            ready_tx.send((target.local_addr().unwrap(), dst.addr())).unwrap();
            let _ = tokio::task::spawn_blocking(move || freeze_rx.recv()).await;
            // Frozen: the only thread the target runs on waits here. No await between the
            // acknowledgement and the wait, so no request sent after it is served.
            let _ = frozen_tx.send(());
            let _ = thaw_rx.recv_timeout(HANG * 10);
            // Thawed: serve until the test is done.
            let _ = tokio::task::spawn_blocking(move || done_rx.recv_timeout(HANG * 10)).await;
            drop(dst);
        });
    });
    let (addr, region) = ready_rx.recv_timeout(HANG).unwrap();
    Frozen {
        addr,
        region,
        freeze,
        frozen,
        thaw,
        done,
        thread,
    }
}

impl Frozen {
    /// Blocks the target's thread, and returns once it is blocked.
    fn freeze(&self) {
        self.freeze.send(()).unwrap();
        self.frozen.recv_timeout(HANG).expect("the target did not freeze");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_ends_at_its_own_timeout_however_late_the_others_are() {
    let target = frozen_target();
    let engine = Engine::builder()
        .transports([TransportKind::Tcp])
        .build()
        .await
        .unwrap();
    let peer = engine.connect(&target.addr.to_string(), HANG).await.unwrap();
    let src = engine.alloc_host(1 << 16, Access::READ_WRITE).unwrap();
    src.write_at(0, &[7u8; 4096]).unwrap();
    let desc = |at: u64| [TransferDesc::new(src.addr_at(at), target.region + at, 4096)];
    engine.transfer(&peer, Op::Write, &desc(0), HANG).await.unwrap();

    target.freeze();
    let patient = {
        let (engine, peer, desc) = (engine.clone(), peer.clone(), desc(4096));
        tokio::spawn(async move { engine.transfer(&peer, Op::Write, &desc, HANG * 10).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let hasty = tokio::time::timeout(
        HANG,
        engine.transfer(&peer, Op::Write, &desc(8192), Duration::from_millis(300)),
    )
    .await
    .expect("the short timeout waited for the link's later timer step");
    match hasty {
        Err(Error::Timeout(msg)) => assert!(msg.contains("within 300ms"), "{msg}"),
        other => panic!("a write to a frozen target: {other:?}"),
    }
    assert!(!patient.is_finished(), "the write with the later timeout ended early");

    target.thaw.send(()).unwrap();
    tokio::time::timeout(HANG * 2, patient)
        .await
        .expect("the patient write never completed after the thaw")
        .unwrap()
        .unwrap();
    // The link still serves, and an answer that came after its operation's deadline broke nothing.
    engine.transfer(&peer, Op::Write, &desc(12288), HANG).await.unwrap();
    drop(engine);
    target.done.send(()).unwrap();
    target.thread.join().unwrap();
}
