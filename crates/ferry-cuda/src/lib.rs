//! # ferry-cuda
//!
//! CUDA device memory for ferry, where the KV caches of inference engines live: allocated by ferry
//! ([`CudaRegistry`], for `engine.alloc_from`) or borrowed from a pointer the caller holds, such as
//! a PyTorch tensor's `data_ptr()` ([`CudaBlock::borrow`]), after the driver confirmed it is device
//! memory, which device and context it belongs to, and that the range lies in one allocation
//! ([`classify`]).
//!
//! The driver is loaded at run time ([`driver()`]): the crate builds without CUDA, and a host
//! without it gets [`Error::Unsupported`](ferry_core::Error::Unsupported) naming why, which
//! `ferry info` and `capabilities()` report ([`probe()`]).
//!
//! Every transport reaches a [`CudaBlock`] as staged memory ([`DmaView::Staged`](ferry_core::DmaView::Staged)):
//! a write is on the GPU before it is acknowledged, a read sends what the GPU holds. Both ends of a
//! TCP link copy between their own bounded buffers and the GPU ([`DeviceCopies`](ferry_core::DeviceCopies));
//! other paths go through the block's host copy, a mapping whose pages exist only once touched.
//! Between two processes of one host, the shared-memory
//! transport lends a whole allocation by CUDA IPC instead ([`ipc`]): the peer copies device to device;
//! and the device copies between a block and host memory a peer lent this process, past the host
//! copy ([`DeviceCopies::copy_raw`](ferry_core::DeviceCopies::copy_raw)).
//! A NIC registers the device memory itself where it can: by the dma-buf the block exports
//! ([`dmabuf`]), or, with a peer-memory module loaded, at its device address. What each device
//! offers is reported by [`probe()`]; a region's `kind()` names the staged path, which the CPU
//! transports always take.
#![deny(missing_docs)]

pub mod array;
mod block;
mod device;
pub mod dmabuf;
mod driver;
mod error;
pub mod ipc;
mod pointer;
mod registry;

pub use block::CudaBlock;
pub use device::CudaDevice;
pub use driver::{CudaDeviceInfo, Driver, INSTALL_HINT, driver, probe};
pub use pointer::{PointerAttributes, PointerKind, attributes_of, classify, classify_attributes};
pub use registry::CudaRegistry;
