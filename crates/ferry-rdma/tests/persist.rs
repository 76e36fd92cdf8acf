//! Persistent RDMA writes on real verbs: the FLUSH verb into device-DAX persistent memory,
//! and the fallbacks, forced.
//!
//! `cargo xtask rig test` runs this twice in a guest with an emulated NVDIMM turned into `/dev/dax0.0`
//! (`FERRY_PMEM`): once with Debian's libibverbs 44, which cannot post FLUSH (so the flush request is
//! the best method), and once with rdma-core 55 (`FERRY_EXPECT_FLUSH_VERB=1`). The FLUSH run writes
//! `FERRY_PMEM_MARKER` persistently; the host then looks for it in the NVDIMM's backing file.
//!
//! Outside the rig there is no device and no persistent memory: the tests say so and return.

use ferry::{
    Access, Durability, Engine, EngineBuilder, Error, Op, Peer, PersistMethod, Region, TransferDesc, TransportKind,
};

mod common;
use common::{T, builder, connect_rdma, in_rig, pair, pattern, wait_for};

/// Device DAX maps in 2 MiB pages.
const LEN: usize = 2 << 20;

/// The persistent memory to write to, or `None` (after saying so) outside the rig.
fn pmem() -> Option<String> {
    match std::env::var("FERRY_PMEM") {
        Ok(p) => Some(p),
        Err(_) => {
            assert!(!in_rig(), "inside the rig FERRY_PMEM names the emulated NVDIMM");
            eprintln!("skipped: no persistent memory here (FERRY_PMEM unset); `cargo xtask rig test` runs this");
            None
        }
    }
}

/// A target with its persistent region, an initiator and the link between them; `None` where there is
/// no RDMA device (outside the rig).
async fn setup(target: EngineBuilder, initiator: EngineBuilder, file: &str) -> Option<(Engine, Region, Engine, Peer)> {
    let target = target.listen("127.0.0.1:0").build().await.unwrap();
    let region = target.register_file(file, 0, LEN, Access::READ_WRITE).unwrap();
    let initiator = initiator.build().await.unwrap();
    let peer = connect_rdma(&initiator, &target).await?;
    wait_for(&peer, &region).await;
    Some((target, region, initiator, peer))
}

/// Writes `data` at `offset` with durability persistent and checks the bytes at the target.
async fn write_persistent(initiator: &Engine, peer: &Peer, region: &Region, offset: u64, data: Vec<u8>) {
    let len = data.len();
    let src = initiator.register(data.clone(), Access::READ_WRITE).unwrap();
    // Two descriptors, neighbours at the target: one FLUSH (or one flush request) covers both.
    let half = (len / 2) as u64;
    let descs = [
        TransferDesc::new(src.addr(), region.addr_at(offset), half),
        TransferDesc::new(src.addr_at(half), region.addr_at(offset + half), len as u64 - half),
    ];
    initiator
        .transfer_durable(peer, Op::Write, &descs, Durability::Persistent, T)
        .await
        .unwrap();
    let mut back = vec![0u8; len];
    region.read_at(offset, &mut back).unwrap();
    if back != data {
        let differ: Vec<usize> = (0..len).filter(|&i| back[i] != data[i]).collect();
        panic!(
            "the bytes at the target: {} of {len} differ, first at {} (got {:#x}, want {:#x}), last at {}",
            differ.len(),
            differ[0],
            back[differ[0]],
            data[differ[0]],
            differ[differ.len() - 1]
        );
    }
}

/// Whether the page at `addr` is mapped into this process: bit 63 of its `/proc/self/pagemap` entry.
fn page_present(addr: u64) -> bool {
    use std::os::unix::fs::FileExt;
    let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
    let mut entry = [0u8; 8];
    pagemap.read_exact_at(&mut entry, addr / 4096 * 8).unwrap();
    u64::from_le_bytes(entry) >> 63 == 1
}

fn target_flushes(region: &Region) -> u64 {
    region
        .persist_stats()
        .expect("a file region counts its flushes")
        .batches
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn best_method_to_device_dax() {
    let Some(file) = pmem() else { return };
    let Some((_target, region, initiator, peer)) = setup(builder(), builder(), &file).await else {
        return;
    };
    assert!(
        region.kind().contains("MAP_SYNC"),
        "device DAX maps with MAP_SYNC: {}",
        region.kind()
    );
    let expect_verb = std::env::var_os("FERRY_EXPECT_FLUSH_VERB").is_some();
    let expected = if expect_verb {
        PersistMethod::FlushVerb
    } else {
        PersistMethod::FlushRequest
    };
    assert_eq!(peer.persist_method(), expected, "region {}", region.kind());
    let before = target_flushes(&region);
    write_persistent(&initiator, &peer, &region, 4096, pattern(100_000, 7)).await;
    if expect_verb {
        assert_eq!(
            target_flushes(&region),
            before,
            "the NIC persisted: the target's CPU flushed nothing"
        );
        if let Ok(marker) = std::env::var("FERRY_PMEM_MARKER") {
            // The host looks for this in the NVDIMM's backing file after the guest powers off. The last
            // page of the region: no other test writes there.
            let marker = format!("{marker}-flush-verb").into_bytes();
            write_persistent(&initiator, &peer, &region, (LEN - 4096) as u64, marker).await;
        }
    } else {
        assert_eq!(
            target_flushes(&region),
            before + 1,
            "one flush request for the transfer"
        );
    }
}

/// Over TCP the target's CPU persists: cache-line write-back on the `MAP_SYNC` mapping of device DAX.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_writes_to_device_dax_are_written_back_by_the_cpu() {
    let Some(file) = pmem() else { return };
    let tcp = || Engine::builder().transports([TransportKind::Tcp]);
    let target = tcp().listen("127.0.0.1:0").build().await.unwrap();
    let region = target.register_file(&file, 0, LEN, Access::READ_WRITE).unwrap();
    let kind = region.kind().to_string();
    assert!(
        ["clwb", "clflushopt", "clflush"]
            .iter()
            .any(|i| kind == format!("file (MAP_SYNC, {i})")),
        "MAP_SYNC accepted and the write-back instruction named: {kind}"
    );
    let initiator = tcp().build().await.unwrap();
    let peer = initiator
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    assert_eq!(peer.persist_method(), PersistMethod::FlushBeforeAck);
    let before = target_flushes(&region);
    write_persistent(&initiator, &peer, &region, 40_000, pattern(20_000, 4)).await;
    assert_eq!(target_flushes(&region), before + 1);
    if let Ok(marker) = std::env::var("FERRY_PMEM_MARKER") {
        let marker = format!("{marker}-cpu").into_bytes();
        write_persistent(&initiator, &peer, &region, (LEN - 8192) as u64, marker).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_flush_request() {
    let Some(file) = pmem() else { return };
    let initiator = builder().rdma_persist_method(PersistMethod::FlushRequest);
    let Some((_target, region, initiator, peer)) = setup(builder(), initiator, &file).await else {
        return;
    };
    assert_eq!(peer.persist_method(), PersistMethod::FlushRequest);
    let before = target_flushes(&region);
    write_persistent(&initiator, &peer, &region, 8192, pattern(65_536, 3)).await;
    assert_eq!(target_flushes(&region), before + 1, "the target's CPU persisted, once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_after_write_only_where_the_target_declares_adr() {
    let Some(file) = pmem() else { return };
    let forced = || builder().rdma_persist_method(PersistMethod::ReadAfterWrite);
    let Some((_target, region, initiator, peer)) = setup(builder().adr_without_ddio(true), forced(), &file).await
    else {
        return;
    };
    assert_eq!(peer.persist_method(), PersistMethod::ReadAfterWrite);
    let before = target_flushes(&region);
    write_persistent(&initiator, &peer, &region, 0, pattern(10_000, 9)).await;
    assert_eq!(target_flushes(&region), before, "a READ, no flush on the target's CPU");
    drop((region, initiator, peer));

    // Never assumed: without the declaration the forced method has no RDMA link to use.
    let target = builder().listen("127.0.0.1:0").build().await.unwrap();
    let peer = forced()
        .build()
        .await
        .unwrap()
        .connect(&target.local_addr().unwrap().to_string(), T)
        .await
        .unwrap();
    assert_eq!(peer.transport(), TransportKind::Tcp, "RDMA setup refused, TCP fallback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_cache_regions_fall_back_to_the_flush_request() {
    if pmem().is_none() {
        return;
    }
    let path = std::env::temp_dir().join(format!("ferry-rdma-persist-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; LEN]).unwrap();
    let Some((_target, region, initiator, peer)) = setup(builder(), builder(), path.to_str().unwrap()).await else {
        let _ = std::fs::remove_file(&path);
        return;
    };
    assert!(region.kind().contains("msync"), "{}", region.kind());
    let before = target_flushes(&region);
    write_persistent(&initiator, &peer, &region, 12_345, pattern(70_000, 5)).await;
    assert_eq!(
        target_flushes(&region),
        before + 1,
        "not registered for FLUSH: the flush request"
    );
    assert_eq!(&std::fs::read(&path).unwrap()[12_345..82_345], &pattern(70_000, 5)[..]);
    drop(region);
    let _ = std::fs::remove_file(&path);
}

/// A file on ext4: the kernel will not pin its pages for the NIC, so the target stages RDMA writes in a
/// registered buffer and copies them in on the initiator's commit request; reads go over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpinnable_page_cache_files_are_staged() {
    let Ok(dir) = std::env::var("FERRY_EXT4_DIR") else {
        assert!(!in_rig(), "inside the rig FERRY_EXT4_DIR names a mounted ext4 disk");
        eprintln!("skipped: no ext4 folder given (FERRY_EXT4_DIR); `cargo xtask rig test` runs this");
        return;
    };
    let path = std::path::Path::new(&dir).join("staged");
    std::fs::write(&path, vec![0u8; LEN]).unwrap();
    let Some((_target, region, initiator, peer)) = setup(builder(), builder(), path.to_str().unwrap()).await else {
        return;
    };
    // Completed: the commit request copies the staged bytes in; nothing is flushed.
    let data = pattern(50_001, 11);
    let src = initiator.register(data.clone(), Access::READ_WRITE).unwrap();
    let d = [TransferDesc::new(src.addr(), region.addr_at(777), data.len() as u64)];
    initiator.transfer(&peer, Op::Write, &d, T).await.unwrap();
    let mut back = vec![0u8; data.len()];
    region.read_at(777, &mut back).unwrap();
    assert!(back == data, "completed write visible in the region");
    assert_eq!(target_flushes(&region), 0);
    // Persistent: copied in and flushed, once.
    write_persistent(&initiator, &peer, &region, 300_000, pattern(9_999, 12)).await;
    assert_eq!(target_flushes(&region), 1);
    // A large persistent range goes from the staging buffer into the file (pwrite), not through the
    // target's mapping: none of its pages is mapped into the target, and the file holds it.
    let (at, large) = (1 << 20, pattern(256 << 10, 13));
    let mapped = || {
        (at..at + large.len())
            .step_by(4096)
            .filter(|&o| page_present(region.addr_at(o as u64)))
            .count()
    };
    assert_eq!(mapped(), 0, "registration mapped pages of the file");
    let src = initiator.register(large.clone(), Access::READ_WRITE).unwrap();
    let d = [TransferDesc::new(
        src.addr(),
        region.addr_at(at as u64),
        large.len() as u64,
    )];
    initiator
        .transfer_durable(&peer, Op::Write, &d, Durability::Persistent, T)
        .await
        .unwrap();
    assert_eq!(target_flushes(&region), 2);
    assert_eq!(mapped(), 0, "the staged write was copied through the mapping");
    assert!(
        std::fs::read(&path).unwrap()[at..at + large.len()] == large[..],
        "the file holds the write"
    );
    // Reads see the region (the file), not the staging buffer: change it behind RDMA's back.
    region.write_at(777, b"written by the target").unwrap();
    let into = initiator.alloc_host(64, Access::READ_WRITE).unwrap();
    initiator
        .transfer(
            &peer,
            Op::Read,
            &[TransferDesc::new(into.addr(), region.addr_at(777), 21)],
            T,
        )
        .await
        .unwrap();
    let mut got = [0u8; 21];
    into.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"written by the target");
    drop(region);
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistence_is_refused_for_plain_memory() {
    let Some((target, initiator, peer)) = pair().await else {
        return;
    };
    let plain = target.alloc_host(4096, Access::READ_WRITE).unwrap();
    wait_for(&peer, &plain).await;
    let src = initiator.register(vec![1u8; 4096], Access::READ_WRITE).unwrap();
    let err = initiator
        .transfer_durable(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), plain.addr(), 4096)],
            Durability::Persistent,
            T,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert_eq!(plain.to_vec().unwrap(), vec![0u8; 4096], "nothing written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_shapes_persist_intact() {
    let Some(file) = pmem() else { return };
    let Some((_target, region, initiator, peer)) = setup(builder(), builder(), &file).await else {
        return;
    };
    let mut bad = Vec::new();
    // Odd totals split in two make scatter-gather entries of different lengths (the case rxe's
    // `ibv_wr_set_sge_list` gets wrong; see src/post.rs).
    for (i, len) in [1usize, 2, 3, 7, 8, 9, 39, 40, 63, 64, 65, 100, 4095, 4096, 4097, 10_000]
        .into_iter()
        .enumerate()
    {
        for split in [false, true] {
            let data = pattern(len, i as u8 + 1);
            let src = initiator.register(data.clone(), Access::READ_WRITE).unwrap();
            let offset = 3 * 4096 * i as u64 + if split { 1 << 20 } else { 0 };
            let descs = if split && len > 1 {
                let half = (len / 2) as u64;
                vec![
                    TransferDesc::new(src.addr(), region.addr_at(offset), half),
                    TransferDesc::new(src.addr_at(half), region.addr_at(offset + half), len as u64 - half),
                ]
            } else {
                vec![TransferDesc::new(src.addr(), region.addr_at(offset), len as u64)]
            };
            initiator
                .transfer_durable(&peer, Op::Write, &descs, Durability::Persistent, T)
                .await
                .unwrap();
            let mut back = vec![0u8; len];
            region.read_at(offset, &mut back).unwrap();
            let differ: Vec<usize> = (0..len).filter(|&j| back[j] != data[j]).collect();
            if !differ.is_empty() {
                bad.push(format!(
                    "len {len} split {split}: {} differ {:?}",
                    differ.len(),
                    &differ[..differ.len().min(4)]
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{}: {bad:#?}", peer.persist_method());
}
