//! Each transfer runs in a `tracing` span with its fields, which an application's subscriber sees.
//! In a binary of its own: the subscriber is the process's global default, so no other test's
//! threads race it for the span's interest.

use std::time::Duration;

use ferry::{Access, Engine, Op, TransferDesc, TransportKind};

const T: Duration = Duration::from_secs(10);

/// A writer the test reads back: what a subscriber printed.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn each_transfer_runs_in_a_span_a_subscriber_sees() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter("ferry=debug")
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let addr = {
        runtime.block_on(async {
            let target = Engine::builder()
                .transports([TransportKind::Tcp])
                .listen("127.0.0.1:0")
                .build()
                .await
                .unwrap();
            let dst = target.alloc_host(8192, Access::READ_WRITE).unwrap();
            let engine = Engine::builder()
                .transports([TransportKind::Tcp])
                .build()
                .await
                .unwrap();
            let src = engine.alloc_host(8192, Access::READ_WRITE).unwrap();
            let addr = target.local_addr().unwrap();
            let peer = engine.connect(&addr.to_string(), T).await.unwrap();
            while !peer.regions().iter().any(|r| r.key == dst.key()) {
                peer.regions_changed(Duration::from_millis(50)).await;
            }
            let descs = [
                TransferDesc::new(src.addr(), dst.addr(), 4096),
                TransferDesc::new(src.addr_at(4096), dst.addr_at(4096), 1000),
            ];
            engine.transfer(&peer, Op::Write, &descs, T).await.unwrap();
            addr
        })
    };
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let span = format!("transfer{{op=Write peer={addr} transport=tcp descriptors=2 bytes=5096 outcome=\"ok\"}}");
    assert!(
        text.lines().any(|l| l.contains(&span) && l.contains(" close ")),
        "no `{span}` closing in:\n{text}"
    );
}
