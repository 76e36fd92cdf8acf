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
//! says so) and staged regions keep it. The crate's tests pass there; what they could not reach is
//! the RDMA path, which that driver did not offer, and the heap-budget check (one allocation of at
//! most 4 GiB does not exhaust 140 GB of VRAM). 1 MiB writes over TCP land in its mapped VRAM as
//! fast as in host memory (8.68 and 8.71 GB/s against 8.96 and 8.33, alternating, `ferry bench
//! --target-mem vulkan`).
//!
//! The Vulkan loader is opened at run time. Without it, or without a driver, every entry point returns
//! [`Error::Unsupported`](ferry_core::Error::Unsupported) with the reason; nothing panics, and extension
//! functions are only called where the extension was enabled.
//!
//! ```no_run
//! # async fn demo() -> ferry_core::Result<()> {
//! use ferry_vulkan::{DeviceSelector, VulkanContext, VulkanRegistry};
//! let ctx = VulkanContext::new(&DeviceSelector::Default)?;
//! let registry = VulkanRegistry::new(ctx);
//! let block = registry.allocate_block(64 << 20)?;
//! println!("{} via the {} path", ferry_core::MemoryBlock::kind(&*block), block.path());
//! # Ok(()) }
//! ```
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
