//! Persistent regions over TCP: a write that asks for persistence is flushed by the target before it is
//! acknowledged, and the API says which durability the caller got.

mod common;

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::raw::RawClient;
use common::*;
use ferry::codec::{Frame, Segment};
use ferry::{Durability, Engine, Error, FlushMethod, Op, PersistMethod, TransferDesc};

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
    assert_eq!(peer.persist_method(), PersistMethod::FlushBeforeAck);
    assert_eq!(region.persist_stats().unwrap().batches, 0);

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
    // Flushed in batches (one per request frame), not once per range.
    let stats = region.persist_stats().unwrap();
    assert_eq!(stats.bytes, 16 * 4096, "{stats:?}");
    assert!((1..16).contains(&stats.batches), "{stats:?}");
    // Completed writes do not flush.
    initiator.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    assert_eq!(region.persist_stats().unwrap().bytes, 16 * 4096);
    // Asynchronous ones can ask too.
    let handle = initiator
        .transfer_async_durable(&peer, Op::Write, &descs[..1], Durability::Persistent, T)
        .unwrap();
    handle.await.unwrap();
    assert_eq!(region.persist_stats().unwrap().bytes, 17 * 4096);
    drop(region);
    let _ = std::fs::remove_file(&path);
}

/// A persistent transfer spread over many frames is flushed once per stream, not once per frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_is_flushed_once_per_stream() {
    let (target, initiator, peer) = pair().await;
    let len = 8 << 20;
    let (path, _f) = temp_file(len);
    let region = target.register_file(&path, 0, len, rw()).unwrap();
    wait_for_region(&peer, &region).await;
    let src = initiator.register(pattern(len, 8), rw()).unwrap();
    let descs: Vec<_> = (0..8u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 20), region.addr_at(i << 20), 1 << 20))
        .collect();
    initiator
        .transfer_durable(&peer, Op::Write, &descs, Durability::Persistent, T)
        .await
        .unwrap();
    let stats = region.persist_stats().unwrap();
    assert_eq!(stats.bytes, len as u64, "{stats:?}");
    assert!(
        (1..=peer.tcp_streams() as u64).contains(&stats.batches),
        "8 frames over {} streams, flushed in {} batches",
        peer.tcp_streams(),
        stats.batches
    );
    assert!(
        std::fs::read(&path).unwrap() == pattern(len, 8),
        "every byte in the file"
    );
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
    assert!(matches!(m.method(), FlushMethod::Msync | FlushMethod::CacheFlush));
    drop(m);
    let _ = std::fs::remove_file(&path);
}

fn io_kind(e: &Error) -> Option<std::io::ErrorKind> {
    match e {
        Error::Io { kind, .. } => Some(*kind),
        _ => None,
    }
}

/// Commits, spoken raw on a TCP-only link: the target persists what the stream wrote, and no more (a
/// 60-byte frame naming a whole file flushes nothing else), after checking every named range. (On a
/// link with an RDMA path, whose writes the target never sees, commits are flush requests taken as
/// they come: the rig's persistence tests cover those.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_persist_what_the_stream_wrote_and_check_every_range() {
    let target = target().await;
    let len = 64 << 10;
    let (path, _f) = temp_file(len);
    let file = target.register_file(&path, 0, len, rw()).unwrap();
    let plain = target.alloc_host(4096, rw()).unwrap();
    let (mut c, _ack) = RawClient::handshake(target.local_addr().unwrap()).await;
    let seg = |key, offset, len| Segment { key, offset, len };
    let mut ask = async |id: u64, frame: Frame, payload: &[u8]| {
        c.send(&frame, payload).await;
        loop {
            match c.recv().await.expect("an answer").frame {
                Frame::Ack { id: got, error } if got == id => return error,
                Frame::RegionAdded(_) | Frame::RegionRemoved { .. } | Frame::RegionTable { .. } => continue,
                other => panic!("unexpected {other:?}"),
            }
        }
    };
    let commit = |id, segments| Frame::Commit {
        id,
        durability: Durability::Persistent,
        segments,
    };
    // A commit of the whole file with nothing written: nothing to flush.
    let err = ask(1, commit(1, vec![seg(file.key(), 0, len as u64)]), &[]).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(
        file.persist_stats().unwrap().bytes,
        0,
        "a commit flushed what nobody wrote"
    );
    // Two completed writes, then a commit naming the whole file: the 150 written bytes are flushed.
    for (id, offset, n) in [(2, 8192u64, 100usize), (3, 8292, 50)] {
        let write = Frame::WriteBatch {
            id,
            durability: Durability::Completed,
            segments: vec![seg(file.key(), offset, n as u64)],
        };
        assert!(ask(id, write, &vec![7u8; n]).await.is_none());
    }
    let err = ask(4, commit(4, vec![seg(file.key(), 0, len as u64)]), &[]).await;
    assert!(err.is_none(), "{err:?}");
    let stats = file.persist_stats().unwrap();
    assert_eq!((stats.batches, stats.bytes), (1, 150), "one batch, of what was written");
    assert_eq!(&std::fs::read(&path).unwrap()[8192..8342], &[7u8; 150]);
    // A region that cannot persist, a range past the end, an unknown key: refused, nothing flushed.
    let refusals = [
        (5, seg(plain.key(), 0, 16), ferry::ErrorCode::InvalidArgument),
        (6, seg(file.key(), len as u64 - 10, 20), ferry::ErrorCode::OutOfBounds),
        (
            7,
            seg(ferry::RegionKey(12345), 0, 16),
            ferry::ErrorCode::PermissionDenied,
        ),
    ];
    for (id, s, code) in refusals {
        let err = ask(id, commit(id, vec![s]), &[]).await;
        assert_eq!(err.map(|e| e.code), Some(code), "request {id}");
    }
    assert_eq!(file.persist_stats().unwrap().batches, 1);
    drop(file);
    let _ = std::fs::remove_file(&path);
}

/// 4,097 one-byte completed writes, 16 KiB apart across a 64 MiB file, then one commit of the whole
/// file: what the target persists is the 4,097 written bytes (their pages), not the span between
/// them, although the stream can keep only 4,096 ranges apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_thousands_of_scattered_writes_persists_only_what_was_written() {
    let target = target().await;
    let writes = ferry_proto::written::MAX_RANGES as u64 + 1;
    let stride = 16u64 << 10;
    let len = (writes * stride) as usize;
    let (path, _f) = temp_file(len);
    let file = target.register_file(&path, 0, len, rw()).unwrap();
    let (mut c, _ack) = RawClient::handshake(target.local_addr().unwrap()).await;
    for i in 0..writes {
        let write = Frame::WriteBatch {
            id: i,
            durability: Durability::Completed,
            segments: vec![Segment {
                key: file.key(),
                offset: i * stride,
                len: 1,
            }],
        };
        c.send(&write, &[0x5a]).await;
    }
    let commit = Frame::Commit {
        id: writes,
        durability: Durability::Persistent,
        segments: vec![Segment {
            key: file.key(),
            offset: 0,
            len: len as u64,
        }],
    };
    c.send(&commit, &[]).await;
    let mut acked = 0;
    while acked <= writes {
        match tokio::time::timeout(T, c.recv())
            .await
            .unwrap()
            .expect("an answer")
            .frame
        {
            Frame::Ack { error: None, .. } => acked += 1,
            Frame::Ack { id, error: Some(e) } => panic!("request {id} refused: {e:?}"),
            Frame::RegionAdded(_) | Frame::RegionRemoved { .. } | Frame::RegionTable { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let stats = file.persist_stats().unwrap();
    println!("{writes} scattered one-byte writes and a commit: {stats:?}");
    assert_eq!(stats.bytes, writes, "persisted beyond the written bytes: {stats:?}");
    let on_disk = std::fs::read(&path).unwrap();
    for i in 0..writes {
        assert_eq!(on_disk[(i * stride) as usize], 0x5a, "write {i}");
    }
    drop(file);
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_file_gives_an_error_not_a_sigbus() {
    let (target, initiator, peer) = pair().await;
    let len = 256 << 10;
    let (path, f) = temp_file(len);
    let region = target.register_file(&path, 0, len, rw()).unwrap();
    wait_for_region(&peer, &region).await;
    let src = initiator.register(pattern(len, 3), rw()).unwrap();
    let whole = [TransferDesc::new(src.addr(), region.addr(), len as u64)];
    initiator.transfer(&peer, Op::Write, &whole, T).await.unwrap();

    // Another process shrinks the file: every page of the mapping is now past its end.
    f.set_len(0).unwrap();
    // The local copy touches such a page (SIGBUS, caught) and fails cleanly.
    let err = region.write_at(0, &[1u8; 64]).unwrap_err();
    assert_eq!(io_kind(&err), Some(std::io::ErrorKind::InvalidData), "{err:?}");
    let mut back = [0u8; 64];
    assert!(region.read_at(4096, &mut back).is_err());
    // Remote writes, persistent or not, small (staged) or large: refused by the target, link intact.
    let small = [TransferDesc::new(src.addr(), region.addr_at(4096), 512)];
    for (descs, durability) in [
        (&small[..], Durability::Persistent),
        (&whole[..], Durability::Persistent),
        (&whole[..], Durability::Completed),
    ] {
        let err = initiator
            .transfer_durable(&peer, Op::Write, descs, durability, T)
            .await
            .unwrap_err();
        // The target's I/O error crosses the wire as an I/O error with its message.
        assert!(io_kind(&err).is_some(), "{err:?}");
        assert!(
            err.to_string().contains("truncated") || err.to_string().contains("shrank"),
            "{err}"
        );
    }
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0, "nothing grew the file back");
    let fresh = target.alloc_host(4096, rw()).unwrap();
    wait_for_region(&peer, &fresh).await;
    initiator
        .transfer(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), fresh.addr(), 4096)],
            T,
        )
        .await
        .unwrap();
    drop(region);
    let _ = std::fs::remove_file(&path);
}

/// A small write whose header the target approved (the file was whole) but whose payload lands after
/// the file shrank: the copy hits zero pages (the SIGBUS guard), and the write must be refused, not
/// acknowledged. The frame's header and payload are sent apart to put the truncation between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_write_racing_a_truncation_is_not_acknowledged() {
    let target = target().await;
    let (mut c, _) = RawClient::handshake(target.local_addr().unwrap()).await;
    let len = 256 << 10;
    for (id, durability) in [(1u64, Durability::Completed), (2, Durability::Persistent)] {
        let (path, f) = temp_file(len);
        let region = target.register_file(&path, 0, len, rw()).unwrap();
        let write = Frame::Write {
            id,
            key: region.key(),
            offset: 8192,
            durability,
        };
        let mut header = bytes::BytesMut::new();
        ferry::codec::encode(&write, 4096, &mut header).unwrap();
        c.send_raw(&header).await.unwrap();
        // The target has checked the file and waits for the payload.
        tokio::time::sleep(Duration::from_millis(200)).await;
        f.set_len(0).unwrap();
        c.send_raw(&[0x5A; 4096]).await.unwrap();
        let error = loop {
            match c.recv().await.expect("an answer").frame {
                Frame::Ack { id: got, error } if got == id => break error,
                Frame::RegionAdded(_) | Frame::RegionRemoved { .. } | Frame::RegionTable { .. } => continue,
                other => panic!("expected the ack of write {id}, got {other:?}"),
            }
        };
        let error = error.unwrap_or_else(|| panic!("a {durability:?} write into a truncated file was acknowledged"));
        assert_eq!(error.code, ferry::ErrorCode::Io, "{error:?}");
        assert_eq!(error.io_kind, std::io::ErrorKind::InvalidData);
        drop(region);
        let _ = std::fs::remove_file(&path);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_file_refuses_persistent_writes() {
    let (target, initiator, peer) = pair().await;
    let (path, _f) = temp_file(8192);
    let region = target.register_file(&path, 0, 8192, rw()).unwrap();
    wait_for_region(&peer, &region).await;
    std::fs::remove_file(&path).unwrap();
    let src = initiator.register(vec![9u8; 4096], rw()).unwrap();
    let d = [TransferDesc::new(src.addr(), region.addr(), 4096)];
    let err = initiator
        .transfer_durable(&peer, Op::Write, &d, Durability::Persistent, T)
        .await
        .unwrap_err();
    assert!(io_kind(&err).is_some(), "{err:?}");
    assert!(err.to_string().contains("removed"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistering_a_persistent_region_under_writes() {
    let (target, initiator, peer) = pair().await;
    const LEN: usize = 2 << 20;
    let (path, _f) = temp_file(LEN);
    let region = target.register_file(&path, 0, LEN, rw()).unwrap();
    wait_for_region(&peer, &region).await;
    let src = initiator.alloc_host(LEN, rw()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let descs: Vec<_> = (0..8u64)
        .map(|i| TransferDesc::new(src.addr_at(i << 18), region.addr_at(i << 18), 1 << 18))
        .collect();
    let writer = keep_writing(&initiator, &peer, descs, Durability::Persistent, stop.clone());
    tokio::time::sleep(Duration::from_millis(150)).await;
    target.deregister_blocking(region);
    let snapshot = std::fs::read(&path).unwrap();
    // New patterns in the source, so that a write landing after deregister would show in the file.
    for seed in 1..=20u8 {
        src.write_at(0, &pattern(LEN, seed)).unwrap();
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let (ok, refused) = writer.await.unwrap();
    assert!(ok > 0, "some persistent writes completed before deregistration");
    assert!(refused > 0, "some were refused after it");
    assert!(
        std::fs::read(&path).unwrap() == snapshot,
        "the file changed after deregister returned"
    );
    let _ = std::fs::remove_file(&path);
}

/// Whether the page at `addr` is mapped into this process: bit 63 of its `/proc/self/pagemap` entry
/// (readable without privileges).
fn page_present(addr: u64) -> bool {
    use std::os::unix::fs::FileExt;
    let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
    let mut entry = [0u8; 8];
    pagemap.read_exact_at(&mut entry, addr / 4096 * 8).unwrap();
    u64::from_le_bytes(entry) >> 63 == 1
}

/// A large write over TCP or shared memory into a page-cache file goes into the file (`pwrite`), not
/// through the target's mapping, once it is persistent or the region was flushed before: not one
/// page of the mapping is faulted in by such a write or by its flush, and its bytes are in the file
/// and seen through the mapping. A completed write into a region never flushed lands in the mapping,
/// whose pages are still writable, which also shows that the probe sees pages when they are
/// touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_over_tcp_go_into_the_file_not_through_the_mapping() {
    writes_go_into_the_file_not_through_the_mapping(ferry::TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_over_shared_memory_go_into_the_file_not_through_the_mapping() {
    writes_go_into_the_file_not_through_the_mapping(ferry::TransportKind::Shm).await;
}

async fn writes_go_into_the_file_not_through_the_mapping(transport: ferry::TransportKind) {
    // Built here rather than by `pair`, which `FERRY_TEST_TRANSPORTS` may restrict.
    let target = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let initiator = Engine::builder().transports([transport]).build().await.unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    assert_eq!(peer.transport(), transport, "{:?}", peer.passed_over());
    let len = 1 << 20;
    let quarter = len / 4;
    // Two files: a fault maps a whole folio of the page cache, which may span many pages, so the
    // write that faults and those that must not go to different files.
    let (path, _f) = temp_file(len);
    let (never_flushed_path, _g) = temp_file(len);
    let region = target.register_file(&path, 0, len, rw()).unwrap();
    let never_flushed = target.register_file(&never_flushed_path, 0, len, rw()).unwrap();
    wait_for_region(&peer, &region).await;
    wait_for_region(&peer, &never_flushed).await;
    let mapped = |region: &ferry::Region| {
        (0..len / 4096)
            .filter(|&page| page_present(region.addr_at(page as u64 * 4096)))
            .count()
    };
    assert_eq!(
        mapped(&region) + mapped(&never_flushed),
        0,
        "registering a file mapped pages of it"
    );
    let bytes = pattern(len, 7);
    let src = initiator.register(bytes.clone(), rw()).unwrap();
    let desc = |to: &ferry::Region, at: usize, n: usize| {
        TransferDesc::new(src.addr_at(at as u64), to.addr_at(at as u64), n as u64)
    };

    // Completed, into a region never flushed: into the mapping, whose pages stay writable.
    let into_never_flushed = [desc(&never_flushed, 0, quarter)];
    initiator
        .transfer(&peer, Op::Write, &into_never_flushed, T)
        .await
        .unwrap();
    assert!(
        mapped(&never_flushed) > 0,
        "a completed write lands in the mapping, and the probe sees it"
    );
    // Persistent: one range, and a batch of two ranges (over TCP a completed write on each of two
    // streams and a commit on each).
    let batches = [
        vec![desc(&region, 0, quarter)],
        vec![
            desc(&region, quarter, quarter / 2),
            desc(&region, quarter * 3 / 2, quarter / 2),
        ],
    ];
    for descs in batches {
        initiator
            .transfer_durable(&peer, Op::Write, &descs, Durability::Persistent, T)
            .await
            .unwrap();
    }
    assert_eq!(mapped(&region), 0, "a persistent write faulted pages of the mapping in");
    let stats = region.persist_stats().unwrap();
    assert_eq!(stats.bytes, 2 * quarter as u64, "{stats:?}");
    // Completed, once the region was flushed: into the file, nothing flushed.
    initiator
        .transfer(&peer, Op::Write, &[desc(&region, 2 * quarter, quarter)], T)
        .await
        .unwrap();
    assert_eq!(mapped(&region), 0, "a completed write after a flush faulted pages in");
    assert_eq!(region.persist_stats().unwrap().bytes, 2 * quarter as u64);

    let written = 3 * quarter;
    assert!(
        std::fs::read(&path).unwrap()[..written] == bytes[..written],
        "the file holds the writes"
    );
    let mut back = vec![0u8; written];
    region.read_at(0, &mut back).unwrap();
    assert!(back == bytes[..written], "the mapping shows the file's bytes");
    drop((region, never_flushed));
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&never_flushed_path);
}
