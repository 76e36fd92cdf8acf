//! The README's "In code" example, run as written on an open engine and on an authenticated one: the
//! initiator's code is the same in both; only the builders' configuration and the target's grant
//! differ.

use std::time::Duration;

use ferry::{Access, DevelopmentCa, Engine, Notification, Op, TlsConfig, TransferDesc};

/// The initiator's side of the example: connect, name the target's region by what the link says, write
/// 64 MiB in 64 descriptors, notify.
async fn initiator_side(initiator: &Engine, target: &str) -> ferry::Result<()> {
    let t = Duration::from_secs(5);
    let src = initiator.alloc_host(64 << 20, Access::READ_WRITE)?;
    src.write_at(0, &vec![0x3d; 64 << 20])?;
    let peer = initiator.connect(target, t).await?;
    let remote = peer
        .regions()
        .iter()
        .next()
        .map(|r| r.addr)
        .expect("the target's region");
    let batch: Vec<_> = (0..64)
        .map(|i| TransferDesc::new(src.addr_at(i << 20), remote + (i << 20), 1 << 20))
        .collect();
    initiator.transfer(&peer, Op::Write, &batch, t).await?;
    initiator
        .notify(&peer, Notification::new("kv-ready", "layer 0"), t)
        .await
}

async fn run(tls: Option<(TlsConfig, TlsConfig)>) {
    let (target_tls, initiator_tls) = tls.map_or((None, None), |(t, i)| (Some(t), Some(i)));
    let mut target = Engine::builder().listen("127.0.0.1:0");
    if let Some(tls) = target_tls.clone() {
        target = target.tls(tls);
    }
    let target = target.build().await.unwrap();
    let dst = target.alloc_host(64 << 20, Access::READ_WRITE).unwrap();
    if target_tls.is_some() {
        dst.grant("initiator", Access::READ_WRITE).await.unwrap();
    }
    let mut initiator = Engine::builder();
    if let Some(tls) = initiator_tls {
        initiator = initiator.tls(tls);
    }
    let initiator = initiator.build().await.unwrap();
    initiator_side(&initiator, &target.local_addr().unwrap().to_string())
        .await
        .unwrap();
    assert!(
        dst.to_vec().unwrap().iter().all(|&b| b == 0x3d),
        "the bytes at the target"
    );
    let n = target.take_notifications();
    assert_eq!(n.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_example_runs_on_an_open_engine() {
    run(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_example_runs_unchanged_on_an_authenticated_engine() {
    let ca = DevelopmentCa::new("readme CA").unwrap();
    run(Some((ca.config("target").unwrap(), ca.config("initiator").unwrap()))).await;
}
