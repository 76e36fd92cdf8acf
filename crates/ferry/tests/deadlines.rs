//! Transfer timeouts over TCP, which the engine's `Transfer` enforces as it does on every link (the
//! link keeps no transfer's time): a write to a frozen target ends at its own timeout, even when
//! another write with a much later one is already waiting, and the link serves again once the target
//! thaws.
//! A deadline (`Engine::transfer_future_until`) ends a write that its timeout would let run on, and
//! one already passed refuses the transfer before anything is sent.

use std::sync::mpsc;
use std::time::Duration;

use ferry::{Access, Durability, Engine, Error, Op, Peer, Region, TransferDesc, TransportKind};

/// Far longer than any step here takes, and shorter than the link's keepalive step (5 s), so that a
/// write that only the link's giving up ended shows as a hang.
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

/// An engine linked to `target` over TCP, with a local region of 64 KiB.
async fn writer_to(target: &Frozen) -> (Engine, Peer, Region) {
    let engine = Engine::builder()
        .transports([TransportKind::Tcp])
        .build()
        .await
        .unwrap();
    let peer = engine.connect(&target.addr.to_string(), HANG).await.unwrap();
    let src = engine.alloc_host(1 << 16, Access::READ_WRITE).unwrap();
    (engine, peer, src)
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
    let (engine, peer, src) = writer_to(&target).await;
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

/// `transfer_future_until` ends a write at its deadline when that comes before its timeout: against a
/// frozen target, a write with ten times `HANG` to run and a deadline 300 ms away fails with
/// `Timeout` well within `HANG`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_ends_at_its_deadline_before_its_timeout() {
    let target = frozen_target();
    let (engine, peer, src) = writer_to(&target).await;
    let desc = [TransferDesc::new(src.addr(), target.region, 4096)];
    engine.transfer(&peer, Op::Write, &desc, HANG).await.unwrap();

    target.freeze();
    let started = std::time::Instant::now();
    let deadline = started + Duration::from_millis(300);
    let transfer = engine
        .transfer_future_until(
            &peer,
            Op::Write,
            &desc,
            Durability::Completed,
            HANG * 10,
            Some(deadline),
        )
        .unwrap();
    let result = tokio::time::timeout(HANG, transfer)
        .await
        .expect("the write waited past its deadline");
    assert!(matches!(result, Err(Error::Timeout(_))), "{result:?}");
    assert!(std::time::Instant::now() >= deadline, "it ended before its deadline");

    target.thaw.send(()).unwrap();
    drop(engine);
    target.done.send(()).unwrap();
    target.thread.join().unwrap();
}

/// A transfer whose deadline has already passed is refused when it is made, with `Timeout`, and
/// sends nothing, over TCP and over shared memory alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_past_its_deadline_sends_nothing() {
    for transports in [vec![TransportKind::Tcp], vec![TransportKind::Shm]] {
        let target = Engine::builder()
            .transports(transports.clone())
            .listen("127.0.0.1:0")
            .build()
            .await
            .unwrap();
        let dst = target.alloc_host(4096, Access::READ_WRITE).unwrap();
        let engine = Engine::builder().transports(transports).build().await.unwrap();
        let peer = engine
            .connect(&target.local_addr().unwrap().to_string(), HANG)
            .await
            .unwrap();
        let src = engine.alloc_host(4096, Access::READ_WRITE).unwrap();
        src.write_at(0, &[0x5a; 4096]).unwrap();
        let desc = [TransferDesc::new(src.addr(), dst.addr(), 4096)];
        let past = std::time::Instant::now() - Duration::from_millis(1);
        let late = engine.transfer_future_until(&peer, Op::Write, &desc, Durability::Completed, HANG, Some(past));
        match late {
            Err(Error::Timeout(msg)) => assert!(msg.contains("nothing was sent"), "{msg}"),
            other => panic!("{}: a transfer made past its deadline: {other:?}", peer.transport()),
        }
        // The link is fine, and nothing of the late write landed before this one's check.
        let mut got = [1u8; 4096];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(got, [0u8; 4096], "{}: the late write landed", peer.transport());
        let soon = std::time::Instant::now() + HANG;
        engine
            .transfer_future_until(&peer, Op::Write, &desc, Durability::Completed, HANG, Some(soon))
            .unwrap()
            .await
            .unwrap();
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(got, [0x5a; 4096], "{}: a write within its deadline", peer.transport());
    }
}
