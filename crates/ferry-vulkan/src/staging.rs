//! Device copies, pipelined: the staging path of HIXL, and `VulkanContext::copy` for applications.
//!
//! A range is cut into chunks of [`CHUNK`] bytes; each chunk is recorded into its own command slot and
//! submitted at once, with up to [`DEPTH`] chunks of one call in flight, so the GPU copies chunk *n*
//! while the CPU records chunk *n + 1*. Calls from several threads (one per TCP stream) run side by side
//! on their own slots, so the device copy of one stream's range overlaps the network receive of the
//! others. A call returns only when every one of its copies is complete on the device, which is what
//! `commit_written` and `prepare_read` promise the engine.
//!
//! Each command buffer starts with a barrier that orders it after earlier transfers (earlier copies into
//! the same bytes, the application's writes) and ends with one that makes its writes visible to the
//! host, so a mapped staging buffer can be read as soon as the fence has signalled.
//!
//! This is not a second guard on region memory. A staged block's `commit_written` and `prepare_read`
//! are called by transports (and `Region::write_at`/`read_at`) while they hold a permit of the
//! region's access guard (`ferry_core::AccessGuard`), on a blocking thread where the caller is async
//! code; the call returns only once
//! each [`PendingCopy`] completed, so the GPU copy lies inside that permit and deregistration, which
//! waits for the permit, waits for the copy. A `PendingCopy` is only the GPU-side completion of one
//! chunk: its command slot and the buffers it copies between, kept alive until its fence signals.

use std::collections::VecDeque;
use std::sync::Arc;

use ash::vk;
use ferry_core::{Error, Result};

use crate::buffer::DeviceBuffer;
use crate::commands::{COPY_TIMEOUT, CopyCommand};
use crate::context::VulkanContext;
use crate::error::vk_error;

/// Bytes per submitted copy.
pub(crate) const CHUNK: u64 = 4 << 20;
/// Chunks of one call in flight at once.
pub(crate) const DEPTH: usize = 4;

/// A Vulkan buffer this crate made, usable as a source or destination of [`VulkanContext::copy`].
pub trait GpuBuffer: private::Sealed {
    /// The buffer handle, for the application's own command buffers.
    fn vk_buffer(&self) -> vk::Buffer;
    /// The buffer's size in bytes.
    fn size(&self) -> u64;
}

pub(crate) mod private {
    use std::sync::Arc;

    /// Keeps [`GpuBuffer`](super::GpuBuffer) implemented only by this crate's types, whose buffers are
    /// valid by construction.
    pub trait Sealed {
        /// The buffer the copy reads or writes.
        fn device_buffer(&self) -> &Arc<crate::buffer::DeviceBuffer>;
    }
}

/// One submitted chunk of a copy made under the caller's permit: its slot and the buffers it copies
/// between, kept alive until its fence signals (the GPU-side completion of that copy, not a guard).
struct PendingCopy<'c> {
    ctx: &'c VulkanContext,
    slot: Option<CopyCommand>,
    keep: [Arc<DeviceBuffer>; 2],
}

impl PendingCopy<'_> {
    /// Waits for the copy; returns the slot for reuse.
    fn finish(mut self) -> Result<CopyCommand> {
        let slot = self
            .slot
            .take()
            .ok_or_else(|| Error::Protocol("copy slot already finished".into()))?;
        match wait(self.ctx, &slot) {
            Ok(()) => Ok(slot),
            Err(e) => {
                self.ctx.slots.park(slot, self.keep.to_vec());
                Err(e)
            }
        }
    }
}

impl Drop for PendingCopy<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            match wait(self.ctx, &slot) {
                Ok(()) => self.ctx.slots.release(slot),
                Err(_) => self.ctx.slots.park(slot, self.keep.to_vec()),
            }
        }
    }
}

fn wait(ctx: &VulkanContext, slot: &CopyCommand) -> Result<()> {
    // SAFETY: the fence belongs to this device and was submitted with the slot's command buffer.
    unsafe {
        ctx.device()
            .wait_for_fences(&[slot.fence], true, COPY_TIMEOUT.as_nanos() as u64)
    }
    .map_err(|e| vk_error("waiting for a Vulkan copy", e))
}

impl VulkanContext {
    /// Copies `len` bytes on the device from `src` at `src_offset` to `dst` at `dst_offset`, and returns
    /// when the copy is complete and visible to the host.
    pub fn copy(
        &self,
        src: &dyn GpuBuffer,
        src_offset: u64,
        dst: &dyn GpuBuffer,
        dst_offset: u64,
        len: u64,
    ) -> Result<()> {
        let (s, d) = (src.device_buffer(), dst.device_buffer());
        for b in [s, d] {
            if !std::ptr::eq(Arc::as_ptr(b.context()), self) {
                return Err(Error::InvalidArgument(
                    "a buffer of another Vulkan context cannot be copied on this one".into(),
                ));
            }
        }
        self.copy_buffers(s, src_offset, d, dst_offset, len)
    }

    /// The pipelined copy behind [`copy`](Self::copy) and the staging path.
    pub(crate) fn copy_buffers(
        &self,
        src: &Arc<DeviceBuffer>,
        src_offset: u64,
        dst: &Arc<DeviceBuffer>,
        dst_offset: u64,
        len: u64,
    ) -> Result<()> {
        for (b, off, what) in [(src, src_offset, "source"), (dst, dst_offset, "destination")] {
            if off.checked_add(len).is_none_or(|end| end > b.size()) {
                return Err(Error::OutOfBounds(format!(
                    "a copy of {len} bytes at offset {off} does not fit the {what} buffer of {} bytes",
                    b.size()
                )));
            }
        }
        if Arc::ptr_eq(src, dst) && src_offset < dst_offset + len && dst_offset < src_offset + len {
            return Err(Error::InvalidArgument(
                "a copy within one buffer may not overlap itself".into(),
            ));
        }
        let family = self.queue_family_index();
        let mut inflight: VecDeque<PendingCopy<'_>> = VecDeque::with_capacity(DEPTH);
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(CHUNK);
            let slot = if inflight.len() >= DEPTH {
                next_free(&mut inflight)?
            } else if inflight.is_empty() {
                self.slots.acquire(self.device(), family)?
            } else {
                // Holding slots already: never wait on the pool (two callers could wait on each other);
                // reuse our own oldest slot instead.
                match self.slots.try_acquire(self.device(), family)? {
                    Some(s) => s,
                    None => next_free(&mut inflight)?,
                }
            };
            let region = vk::BufferCopy {
                src_offset: src_offset + done,
                dst_offset: dst_offset + done,
                size: n,
            };
            if let Err(e) = self.record_and_submit(&slot, src, dst, region) {
                self.slots.release(slot);
                return Err(e);
            }
            inflight.push_back(PendingCopy {
                ctx: self,
                slot: Some(slot),
                keep: [src.clone(), dst.clone()],
            });
            done += n;
        }
        let mut result = Ok(());
        for f in inflight {
            match f.finish() {
                Ok(slot) => self.slots.release(slot),
                Err(e) if result.is_ok() => result = Err(e),
                Err(_) => {}
            }
        }
        result
    }

    fn record_and_submit(
        &self,
        slot: &CopyCommand,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        region: vk::BufferCopy,
    ) -> Result<()> {
        let device = self.device();
        let before = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::MEMORY_WRITE)
            .dst_access_mask(vk::AccessFlags::TRANSFER_READ | vk::AccessFlags::TRANSFER_WRITE);
        let after = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(vk::AccessFlags::HOST_READ);
        // SAFETY: the slot is ours alone (taken from the pool, its previous submission complete), so its
        // pool may be reset and its command buffer recorded on this thread; the buffers are live (the
        // caller holds `Arc`s, kept by the in-flight entry until the fence signals) and the region lies
        // inside both (checked by `copy_buffers`); the fence is unsignalled after the reset.
        unsafe {
            device
                .reset_command_pool(slot.pool, vk::CommandPoolResetFlags::empty())
                .map_err(|e| vk_error("vkResetCommandPool", e))?;
            let begin = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            device
                .begin_command_buffer(slot.cmd, &begin)
                .map_err(|e| vk_error("vkBeginCommandBuffer", e))?;
            device.cmd_pipeline_barrier(
                slot.cmd,
                vk::PipelineStageFlags::ALL_COMMANDS,
                vk::PipelineStageFlags::TRANSFER,
                vk::DependencyFlags::empty(),
                &[before],
                &[],
                &[],
            );
            device.cmd_copy_buffer(slot.cmd, src.handle(), dst.handle(), &[region]);
            device.cmd_pipeline_barrier(
                slot.cmd,
                vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::HOST,
                vk::DependencyFlags::empty(),
                &[after],
                &[],
                &[],
            );
            device
                .end_command_buffer(slot.cmd)
                .map_err(|e| vk_error("vkEndCommandBuffer", e))?;
            device
                .reset_fences(&[slot.fence])
                .map_err(|e| vk_error("vkResetFences", e))?;
            let cmds = [slot.cmd];
            let submit = vk::SubmitInfo::default().command_buffers(&cmds);
            let queue = self.queue()?;
            device
                .queue_submit(*queue, &[submit], slot.fence)
                .map_err(|e| vk_error("vkQueueSubmit", e))
        }
    }
}

/// Waits for the oldest in-flight chunk and hands back its slot.
fn next_free(inflight: &mut VecDeque<PendingCopy<'_>>) -> Result<CopyCommand> {
    match inflight.pop_front() {
        Some(f) => f.finish(),
        None => Err(Error::Protocol("no copy in flight to wait for".into())),
    }
}
