//! Persistent regions over TCP: a write that asks for persistence is flushed by the target before it is
//! acknowledged, and the API says which durability the caller got.

mod common;

use std::io::Write;

use common::*;
use ferry::{Durability, Engine, Error, Op, PersistMethod, TransferDesc};

fn temp_file(len: usize) -> (std::path::PathBuf, std::fs::File) {
    let path = std::env::temp_dir().join(format!("ferry-persist-{}-{}", std::process::id(), rand_suffix()));
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&vec![0u8; len]).unwrap();
    f.sync_all().unwrap();
    (path, f)
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_writes_reach_the_file() {
    let (target, initiator, peer) = pair().await;
    let len = 1 << 20;
    let (path, _f) = temp_file(len);
    let region = target.register_file(&path, 0, len, rw()).unwrap();
    assert!(region.is_persistent());
    assert!(region.kind().starts_with("file ("), "{}", region.kind());
    wait_for_region(&peer, &region).await;
    assert!(peer.regions().iter().any(|r| r.key == region.key() && r.persistent));

    let src = initiator.register(pattern(len, 5), rw()).unwrap();
    // A batch of scattered ranges, persistent: the target flushes each before acknowledging.
    let descs: Vec<_> = (0..16u64)
        .map(|i| TransferDesc::new(src.addr_at(i * 65536), region.addr_at(i * 65536), 4096))
        .collect();
    initiator
        .transfer_durable(&peer, Op::Write, &descs, Durability::Persistent, T)
        .await
        .unwrap();
    let on_disk = std::fs::read(&path).unwrap();
    for i in 0..16usize {
        let at = i * 65536;
        assert_eq!(
            on_disk[at..at + 4096],
            pattern(len, 5)[at..at + 4096],
            "range {i} in the file"
        );
        assert!(
            on_disk[at + 4096..at + 65536].iter().all(|&b| b == 0),
            "nothing else written"
        );
    }
    drop(region);
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistence_is_refused_where_it_cannot_be_had() {
    let (target, initiator, peer) = pair().await;
    let plain = target.alloc_host(4096, rw()).unwrap();
    wait_for_region(&peer, &plain).await;
    let src = initiator.register(vec![1u8; 4096], rw()).unwrap();
    let d = [TransferDesc::new(src.addr(), plain.addr(), 4096)];
    let err = initiator
        .transfer_durable(&peer, Op::Write, &d, Durability::Persistent, T)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert_eq!(
        plain.to_vec().unwrap(),
        vec![0u8; 4096],
        "refused before anything was sent"
    );
    let err = initiator
        .transfer_durable(&peer, Op::Read, &d, Durability::Persistent, T)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_regions_check_their_range() {
    let e = Engine::builder().build().await.unwrap();
    let (path, _f) = temp_file(8192);
    assert!(matches!(
        e.register_file(&path, 0, 8193, rw()),
        Err(Error::OutOfBounds(_))
    ));
    assert!(matches!(
        e.register_file(&path, 100, 4096, rw()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        e.register_file(&path, 0, 0, rw()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        e.register_file("/nonexistent/ferry", 0, 4096, rw()),
        Err(Error::Io { .. })
    ));
    let m = ferry::FileMapping::open(&path, 4096, 4096).unwrap();
    // The temporary directory is not DAX here; the fallback is msync.
    assert!(matches!(m.method(), PersistMethod::Msync | PersistMethod::CacheFlush));
    drop(m);
    let _ = std::fs::remove_file(&path);
}
