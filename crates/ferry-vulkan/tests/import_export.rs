//! Host regions imported into Vulkan as copy targets, and memory exported as an opaque fd and imported
//! again.

mod common;

use std::os::fd::AsRawFd;
use std::sync::Arc;

use common::*;
use ferry::{Access, Engine, HostAllocation, MemoryBlock};
use ferry_core::Error;
use ferry_vulkan::{AllocationPath, ImportedBuffer, ImportedHostBuffer, VulkanRegistry};

const LEN: usize = 3 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_host_region_is_a_device_copy_target() {
    let Some(ctx) = context("host region imported into Vulkan") else {
        return;
    };
    if ctx.host_import_alignment().is_none() {
        if required() {
            panic!("{} does not offer VK_EXT_external_memory_host", ctx.name());
        }
        eprintln!("skipped: {} does not offer VK_EXT_external_memory_host", ctx.name());
        return;
    }
    let engine = Engine::builder().build().await.unwrap();
    let region = engine.alloc_host(LEN, Access::READ_WRITE).unwrap();
    // SAFETY: `region` stays registered (and so allocated) until the end of the test, after `imported`
    // and every copy using it are gone.
    let imported = unsafe { ImportedHostBuffer::from_raw(&ctx, region.as_ptr(), LEN) }.unwrap();

    let gpu = VulkanRegistry::new(ctx.clone())
        .with_path(Some(host_reachable_path(&ctx)))
        .allocate_block(LEN)
        .unwrap();
    let want = pattern(LEN, 3);
    gpu.upload(0, &want).unwrap();
    ctx.copy(&*gpu, 0, &imported, 0, LEN as u64).unwrap();
    assert_bytes(
        &region.to_vec().unwrap(),
        &want,
        "device copy into the registered host region",
    );

    // And the other way: the host writes the region, the GPU pulls it in.
    let back = pattern(LEN, 200);
    region.write_at(0, &back).unwrap();
    ctx.copy(&imported, 4096, &*gpu, 0, (LEN - 4096) as u64).unwrap();
    let mut got = vec![0u8; LEN - 4096];
    gpu.download(0, &mut got).unwrap();
    assert_bytes(&got, &back[4096..], "device copy out of the registered host region");
    drop(imported);
    drop(region);

    // The safe form holds the block alive itself.
    let block = Arc::new(HostAllocation::new(LEN).unwrap());
    let region = engine.register_block(block.clone(), Access::READ_WRITE).unwrap();
    let imported = ImportedHostBuffer::from_block(&ctx, block).unwrap();
    ctx.copy(&*gpu, 0, &imported, 0, LEN as u64).unwrap();
    assert_bytes(
        &region.to_vec().unwrap()[..LEN - 4096],
        &back[4096..],
        "copy into a block import",
    );
}

#[test]
fn misaligned_host_memory_is_refused() {
    let Some(ctx) = context("host import alignment") else {
        return;
    };
    let Some(align) = ctx.host_import_alignment() else {
        return;
    };
    let block = HostAllocation::new(2 * align as usize).unwrap();
    // SAFETY: the range lies inside `block`, which outlives the (failed) import.
    let r = unsafe { ImportedHostBuffer::from_raw(&ctx, block.as_ptr().add(1), align as usize) };
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    // SAFETY: as above.
    let r = unsafe { ImportedHostBuffer::from_raw(&ctx, block.as_ptr(), align as usize + 1) };
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
}

#[test]
fn exported_fd_imports_as_the_same_memory() {
    let Some(ctx) = context("opaque fd export") else {
        return;
    };
    for path in [AllocationPath::HostVisible, AllocationPath::Staged] {
        if !offered(&ctx, path) {
            continue;
        }
        let registry = VulkanRegistry::new(ctx.clone()).with_path(Some(path));
        let block = registry.allocate_block(LEN).unwrap();
        let want = pattern(LEN, 11);
        block.upload(0, &want).unwrap();
        let exported = match block.export() {
            Ok(e) => e,
            Err(e @ Error::Unsupported(_)) => {
                // A device may let exportable buffers use no memory type of this path: the registry
                // then serves the path without export, and says so here.
                let lavapipe = ctx.name().contains("llvmpipe");
                assert!(!(required() && lavapipe), "export must work on the test driver: {e}");
                assert!(e.message().contains("exportable"), "{e}");
                eprintln!("skipped: {path}: {e}");
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        assert!(exported.fd.as_raw_fd() >= 0);
        assert!(exported.allocation_size >= LEN as u64);
        let imported = ImportedBuffer::import(&ctx, exported).unwrap();

        // What the block holds is what the import reads…
        let check = VulkanRegistry::new(ctx.clone())
            .with_path(Some(host_reachable_path(&ctx)))
            .allocate_block(LEN)
            .unwrap();
        ctx.copy(&imported, 0, &*check, 0, LEN as u64).unwrap();
        let mut got = vec![0u8; LEN];
        check.download(0, &mut got).unwrap();
        assert_bytes(&got, &want, &format!("{path}: read through the imported fd"));

        // …and what the import writes, the block holds.
        let next = pattern(LEN, 77);
        check.upload(0, &next).unwrap();
        ctx.copy(&*check, 0, &imported, 0, LEN as u64).unwrap();
        block.download(0, &mut got).unwrap();
        assert_bytes(&got, &next, &format!("{path}: written through the imported fd"));
    }
}

#[test]
fn export_needs_exportable_memory() {
    let Some(ctx) = context("export of non-exportable memory") else {
        return;
    };
    let block = VulkanRegistry::new(ctx)
        .exportable(false)
        .allocate_block(1 << 16)
        .unwrap();
    assert!(matches!(block.export(), Err(Error::Unsupported(_))));
    assert_eq!(block.len(), 1 << 16);
}

/// Device-local memory behind staging offers a NIC its dma-buf exactly where the device exports one
/// (`VK_EXT_external_memory_dma_buf`; lavapipe does not): then it is a file of at least the region's
/// size, which the RDMA transport registers in place of the staging buffer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_memory_offers_a_dma_buf_exactly_where_the_device_exports_one() {
    let Some(ctx) = context("dma-buf of staged memory") else {
        return;
    };
    if !ctx.paths().staged {
        eprintln!("skipped: {} offers no staged path", ctx.name());
        return;
    }
    let exports = ctx.info().external_memory_dma_buf;
    let block = VulkanRegistry::new(ctx.clone())
        .with_path(Some(AllocationPath::Staged))
        .allocate_block(LEN)
        .unwrap();
    match (exports, block.dma_buf()) {
        (false, None) => eprintln!(
            "{} exports no dma-buf: the NIC registers the staging buffer",
            ctx.name()
        ),
        (true, Some(Ok(buf))) => {
            let size = std::fs::File::from(buf.fd.try_clone().unwrap())
                .metadata()
                .unwrap()
                .len();
            assert_eq!(buf.offset, 0);
            assert!(size as usize >= LEN, "a dma-buf of {size} bytes");
        }
        (exports, offered) => panic!(
            "{} lists VK_EXT_external_memory_dma_buf: {exports}, and its staged block offers {offered:?}",
            ctx.name()
        ),
    }
    // Memory the CPU maps needs none: the NIC registers the mapping itself.
    let mapped = VulkanRegistry::new(ctx.clone())
        .with_path(Some(host_reachable_path(&ctx)))
        .allocate_block(LEN)
        .unwrap();
    if mapped.dma_view() == ferry::DmaView::Host {
        assert!(mapped.dma_buf().is_none());
    }
}
