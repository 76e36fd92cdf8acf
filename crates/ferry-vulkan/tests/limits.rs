//! Allocations past what the device allows fail with ResourceExhausted and leave nothing behind;
//! paths the device cannot serve are Unsupported.

mod common;

use common::*;
use ferry_core::Error;
use ferry_vulkan::{AllocationPath, AllocationStats, VulkanRegistry};

#[test]
fn allocation_beyond_max_allocation_size_is_resource_exhausted() {
    let Some(ctx) = private_context("maxMemoryAllocationSize") else {
        return;
    };
    let before = ctx.stats();
    assert_eq!(before, AllocationStats::default());
    let too_big = usize::try_from(ctx.max_allocation_size()).unwrap_or(usize::MAX - 1) + 1;
    for path in [None, Some(AllocationPath::HostVisible), Some(AllocationPath::Staged)] {
        let r = VulkanRegistry::new(ctx.clone()).with_path(path).allocate_block(too_big);
        assert!(
            matches!(&r, Err(Error::ResourceExhausted(m)) if m.contains("maxMemoryAllocationSize")),
            "{path:?}: {r:?}"
        );
        assert_eq!(ctx.stats(), before, "{path:?}: nothing may stay allocated");
    }
}

#[test]
fn allocation_beyond_heap_budget_is_resource_exhausted_and_leaks_nothing() {
    let Some(ctx) = private_context("heap budget") else {
        return;
    };
    let mut heaps = Vec::new();
    for path in [AllocationPath::HostVisible, AllocationPath::Staged] {
        if !offered(&ctx, path) {
            continue;
        }
        let registry = VulkanRegistry::new(ctx.clone()).with_path(Some(path));
        // The heap this path's device memory comes from.
        let probe = registry.allocate_block(4096).unwrap();
        let heap = probe_heap(&ctx, probe.memory_type_index());
        drop(probe);
        heaps.push(heap);
        exceed_budget(&ctx, heap, &[Some(path)]);
    }
    // Where every path draws on one heap (lavapipe), the automatic choice has nowhere else to go.
    if heaps.len() > 1 && heaps.windows(2).all(|w| w[0] == w[1]) {
        exceed_budget(&ctx, heaps[0], &[None]);
    }
}

/// Takes a good part of `heap` with one allocation, then asks each of `paths` for more than is left
/// (but less than one allocation may be): each must fail with ResourceExhausted, leaving nothing.
fn exceed_budget(ctx: &std::sync::Arc<ferry_vulkan::VulkanContext>, heap: u32, paths: &[Option<AllocationPath>]) {
    let (budget, _) = ctx.heap_budget(heap).unwrap();
    let first_path = paths[0].unwrap_or(AllocationPath::HostVisible);
    // A staged block takes its length twice where its staging buffer shares the heap (lavapipe).
    let share = if first_path == AllocationPath::Staged { 4 } else { 2 };
    let first_len = (budget / share).min(ctx.max_allocation_size() / 2) as usize + (1 << 20);
    // Never touched: on a CPU driver it costs address space, not memory.
    let first = VulkanRegistry::new(ctx.clone())
        .with_path(Some(first_path))
        .allocate_block(first_len)
        .unwrap();
    let (budget, used) = ctx.heap_budget(heap).unwrap();
    assert!(used >= first_len as u64, "the heap usage counts the allocation");
    let rest = budget.saturating_sub(used) + (1 << 20);
    if rest > ctx.max_allocation_size() {
        // A heap larger than twice what one allocation may be (a GPU's VRAM, say) is not exceeded by
        // one more allocation; the size limit has its own test.
        assert!(
            !ctx.name().contains("llvmpipe"),
            "test setup: {rest} vs {}",
            ctx.max_allocation_size()
        );
        eprintln!(
            "heap {heap} of {}: {rest} bytes left exceed maxMemoryAllocationSize; the budget is not reached this way",
            ctx.name()
        );
        return;
    }
    let before = ctx.stats();
    for &path in paths {
        let r = VulkanRegistry::new(ctx.clone())
            .with_path(path)
            .allocate_block(rest as usize);
        assert!(
            matches!(&r, Err(Error::ResourceExhausted(m)) if m.contains("budget")),
            "{path:?}: {r:?}"
        );
        assert_eq!(
            ctx.stats(),
            before,
            "{path:?}: the failed allocation left objects behind"
        );
    }
    drop(first);
    assert_eq!(ctx.stats(), AllocationStats::default(), "everything freed");
    assert_eq!(ctx.heap_budget(heap).unwrap().1, 0, "the heap usage is back to zero");
}

fn probe_heap(ctx: &ferry_vulkan::VulkanContext, type_index: u32) -> u32 {
    ctx.info().memory_types[type_index as usize].heap
}

#[test]
fn paths_the_device_lacks_are_unsupported() {
    let Some(ctx) = context("unsupported paths") else {
        return;
    };
    if !ctx.paths().rdma {
        let r = VulkanRegistry::new(ctx.clone())
            .with_path(Some(AllocationPath::RdmaCapable))
            .allocate_block(1 << 20);
        assert!(
            matches!(&r, Err(Error::Unsupported(m)) if m.contains("VK_NV_external_memory_rdma")),
            "{r:?}"
        );
    }
    let r = VulkanRegistry::new(ctx).allocate_block(0);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
}
