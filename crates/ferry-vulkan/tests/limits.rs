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
    let registry = VulkanRegistry::new(ctx.clone()).with_path(Some(AllocationPath::HostVisible));
    // Take a good part of the heap (never touched, so it costs address space, not memory)…
    let probe = registry.allocate_block(4096).unwrap();
    let heap = probe_heap(&ctx, probe.memory_type_index());
    drop(probe);
    let (budget, _) = ctx.heap_budget(heap).unwrap();
    let first_len = (budget / 2).min(ctx.max_allocation_size() / 2) as usize + (1 << 20);
    let first = registry.allocate_block(first_len).unwrap();
    let (budget, used) = ctx.heap_budget(heap).unwrap();
    assert!(used >= first_len as u64, "the heap usage counts the allocation");
    // …then ask for more than is left, but less than one allocation may be.
    let rest = budget.saturating_sub(used) + (1 << 20);
    assert!(
        rest <= ctx.max_allocation_size(),
        "test setup: {rest} vs {}",
        ctx.max_allocation_size()
    );
    let before = ctx.stats();
    for path in [None, Some(AllocationPath::HostVisible), Some(AllocationPath::Staged)] {
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
