//! # ferry-vulkan
//!
//! GPU memory for ferry through Vulkan, so that a peer's transfer lands in (or is read from) GPU memory
//! on any vendor's device, and so that RDMA NICs can reach it where NVIDIA's
//! `VK_NV_external_memory_rdma` is available.
//!
//! - [`VulkanContext`] opens one device (by index, name or UUID: [`DeviceSelector`]; by default the
//!   first discrete GPU) with the external-memory extensions it offers. Share it: opening costs tens of
//!   milliseconds.
//! - [`VulkanRegistry`] is a ferry [`MemoryRegistry`](ferry_core::MemoryRegistry): `engine.alloc_from(&registry, len, access)`.
//!   Each allocation takes one of three [`AllocationPath`]s, reported by `Region::kind()` and
//!   [`VulkanBlock::path`]: RDMA-capable memory with a remote address ([`VulkanBlock::rdma_address`]),
//!   host-visible device memory registered through its mapping (no extra copy over TCP), or device-local
//!   memory behind a staging buffer, copied on a transfer queue before a write is acknowledged and
//!   before a read is answered.
//! - [`ImportedHostBuffer`] makes a registered host region a GPU copy source or target
//!   (`VK_EXT_external_memory_host`); [`VulkanBlock::export`] hands an opaque fd to another Vulkan device
//!   or CUDA, and [`ImportedBuffer`] takes one in.
//! - [`probe()`] lists the devices for `ferry info`.
//!
//! Which paths a device offers is decided from the memory types its buffers may use, not from the
//! types it lists: drivers narrow them by a buffer's external handle types. On an NVIDIA H200
//! (driver 580.159) all VRAM is mappable, yet a buffer exportable as an opaque fd may not use that
//! memory type, so host-visible regions there are served without export ([`VulkanBlock::export`]
//! says so) and staged regions keep it. That mapping is write-combined, not cached: over TCP, 1 MiB
//! writes into it ran at 10.5–10.9 GB/s (host memory: 10.3–10.7) but reads out of it at 0.06 GB/s,
//! against 4.6–4.8 and 5.1–5.6 staged (`ferry bench --target-mem vulkan --vulkan-path ...`,
//! alternating). So where mapped device memory is not host-cached, automatic allocations take the
//! staged path first; force the host-visible one for regions peers only write. The crate's tests
//! pass there; what they could not reach is the RDMA path, which that driver did not offer, and the
//! heap-budget check (one allocation of at most 4 GiB does not exhaust 140 GB of VRAM).
//!
#![deny(missing_docs)]

mod block;
mod buffer;
mod commands;
mod context;
mod error;
mod ext;
mod import;
mod loader;
mod memtype;
mod probe;
mod registry;
mod select;
mod staging;

pub use ash;
pub use block::{ExportedMemory, VulkanBlock};
pub use context::{AllocationStats, VulkanContext};
pub use import::{ImportedBuffer, ImportedHostBuffer};
pub use loader::INSTALL_HINT;
pub use memtype::{AllocationPath, PathSupport};
pub use probe::{MemoryHeapInfo, MemoryTypeInfo, VulkanDeviceInfo, probe};
pub use registry::VulkanRegistry;
pub use select::{DEVICE_ENV, DeviceSelector, format_uuid};
pub use staging::GpuBuffer;
