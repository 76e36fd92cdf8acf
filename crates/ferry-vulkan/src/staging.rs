//! Device copies, pipelined: the staging path of HIXL, and `VulkanContext::copy` for applications.
//!
//! A range is cut into chunks of [`CHUNK`] bytes; each chunk is recorded into its own copy command and
//! submitted at once, with up to [`DEPTH`] chunks of one call in flight, so the GPU copies chunk *n*
//! while the CPU records chunk *n + 1*. The ranges one request wrote or reads (a batch of scattered
//! KV-cache blocks) are recorded together, many to a command buffer up to a chunk's bytes, so that
//! each costs a copy region rather than a submission, a fence and a wait of its own. Calls from several threads (one per TCP stream) run side by side
//! on their own copy commands, so the device copy of one stream's range overlaps the network receive of the
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
//! chunk: its copy command and the buffers it copies between, kept alive until its fence signals.

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
/// Most regions recorded into one command buffer (one `vkCmdCopyBuffer`).
const REGIONS_PER_SUBMIT: usize = 1024;

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

/// One submitted chunk of a copy made under the caller's permit: its copy command and the buffers it copies
/// between, kept alive until its fence signals (the GPU-side completion of that copy, not a guard).
struct PendingCopy<'c> {
    ctx: &'c VulkanContext,
    command: Option<CopyCommand>,
    keep: [Arc<DeviceBuffer>; 2],
}

impl PendingCopy<'_> {
    /// The buffers, for a parked copy to keep.
    fn kept(&self) -> Vec<crate::commands::Keep> {
        self.keep.iter().map(|b| b.clone() as crate::commands::Keep).collect()
    }

    /// Waits for the copy; returns the copy command for reuse.
    fn finish(mut self) -> Result<CopyCommand> {
        let command = self
            .command
            .take()
            .ok_or_else(|| Error::Internal("a staged copy was waited for twice".into()))?;
        match wait(self.ctx, &command) {
            Ok(()) => Ok(command),
            Err(e) => {
                self.ctx.commands.park(command, self.kept());
                Err(e)
            }
        }
    }
}

impl Drop for PendingCopy<'_> {
    fn drop(&mut self) {
        if let Some(command) = self.command.take() {
            match wait(self.ctx, &command) {
                Ok(()) => self.ctx.commands.release(command),
                Err(_) => self.ctx.commands.park(command, self.kept()),
            }
        }
    }
}

fn wait(ctx: &VulkanContext, command: &CopyCommand) -> Result<()> {
    // SAFETY: the fence belongs to this device and was submitted with the copy command's buffer.
    unsafe {
        ctx.device()
            .wait_for_fences(&[command.fence], true, COPY_TIMEOUT.as_nanos() as u64)
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
        let region = vk::BufferCopy {
            src_offset,
            dst_offset,
            size: len,
        };
        self.copy_regions(src, dst, &[region])
    }

    /// Copies the `(offset, len)` ranges of `src` to the same offsets of `dst` (a staging buffer and the
    /// device buffer behind it), several ranges to a submission, and returns when every copy is
    /// complete and visible to the host: a request that wrote many small ranges pays for one
    /// submission and one fence, not one of each per range.
    pub(crate) fn copy_ranges(
        &self,
        src: &Arc<DeviceBuffer>,
        dst: &Arc<DeviceBuffer>,
        ranges: &[(u64, u64)],
    ) -> Result<()> {
        if Arc::ptr_eq(src, dst) {
            return Err(Error::InvalidArgument(
                "a range copied onto itself: the staging copies run between two buffers".into(),
            ));
        }
        let size = src.size().min(dst.size());
        let mut regions = Vec::with_capacity(ranges.len());
        for &(offset, len) in ranges {
            if offset.checked_add(len).is_none_or(|end| end > size) {
                return Err(Error::OutOfBounds(format!(
                    "a copy of {len} bytes at offset {offset} does not fit buffers of {} and {} bytes",
                    src.size(),
                    dst.size()
                )));
            }
            if len > 0 {
                regions.push(vk::BufferCopy {
                    src_offset: offset,
                    dst_offset: offset,
                    size: len,
                });
            }
        }
        self.copy_regions(src, dst, &regions)
    }

    /// Submits `regions` (checked by the caller) as [`submissions`] cuts them, up to [`DEPTH`] in
    /// flight, and waits for them all.
    fn copy_regions(&self, src: &Arc<DeviceBuffer>, dst: &Arc<DeviceBuffer>, regions: &[vk::BufferCopy]) -> Result<()> {
        let mut pipeline = Pipeline {
            ctx: self,
            src,
            dst,
            inflight: VecDeque::with_capacity(DEPTH),
        };
        for batch in submissions(regions) {
            pipeline.submit(&batch)?;
        }
        pipeline.finish()
    }

    fn record_and_submit(
        &self,
        command: &CopyCommand,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        regions: &[vk::BufferCopy],
    ) -> Result<()> {
        let device = self.device();
        let before = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::MEMORY_WRITE)
            .dst_access_mask(vk::AccessFlags::TRANSFER_READ | vk::AccessFlags::TRANSFER_WRITE);
        let after = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(vk::AccessFlags::HOST_READ);
        // SAFETY: the copy command is ours alone (taken from the pool, its previous submission complete), so its
        // pool may be reset and its command buffer recorded on this thread; the buffers are live (the
        // caller holds `Arc`s, kept by the in-flight entry until the fence signals) and the region lies
        // inside both (checked by `copy_buffers` and `copy_ranges`); the fence is unsignalled after the reset.
        unsafe {
            device
                .reset_command_pool(command.pool, vk::CommandPoolResetFlags::empty())
                .map_err(|e| vk_error("vkResetCommandPool", e))?;
            let begin = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            device
                .begin_command_buffer(command.cmd, &begin)
                .map_err(|e| vk_error("vkBeginCommandBuffer", e))?;
            device.cmd_pipeline_barrier(
                command.cmd,
                vk::PipelineStageFlags::ALL_COMMANDS,
                vk::PipelineStageFlags::TRANSFER,
                vk::DependencyFlags::empty(),
                &[before],
                &[],
                &[],
            );
            device.cmd_copy_buffer(command.cmd, src.handle(), dst.handle(), regions);
            device.cmd_pipeline_barrier(
                command.cmd,
                vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::HOST,
                vk::DependencyFlags::empty(),
                &[after],
                &[],
                &[],
            );
            device
                .end_command_buffer(command.cmd)
                .map_err(|e| vk_error("vkEndCommandBuffer", e))?;
            device
                .reset_fences(&[command.fence])
                .map_err(|e| vk_error("vkResetFences", e))?;
            let cmds = [command.cmd];
            let submit = vk::SubmitInfo::default().command_buffers(&cmds);
            let queue = self.queue()?;
            device
                .queue_submit(*queue, &[submit], command.fence)
                .map_err(|e| vk_error("vkQueueSubmit", e))
        }
    }
}

/// `regions` cut into command buffers' worth, in order: each of at most [`CHUNK`] bytes and
/// [`REGIONS_PER_SUBMIT`] regions, a region larger than what is left of a chunk split across two.
fn submissions(regions: &[vk::BufferCopy]) -> Vec<Vec<vk::BufferCopy>> {
    let mut all = Vec::new();
    let mut batch: Vec<vk::BufferCopy> = Vec::new();
    let mut bytes = 0u64;
    for r in regions {
        let mut done = 0u64;
        while done < r.size {
            let n = (r.size - done).min(CHUNK - bytes);
            batch.push(vk::BufferCopy {
                src_offset: r.src_offset + done,
                dst_offset: r.dst_offset + done,
                size: n,
            });
            bytes += n;
            done += n;
            if bytes == CHUNK || batch.len() == REGIONS_PER_SUBMIT {
                all.push(std::mem::take(&mut batch));
                bytes = 0;
            }
        }
    }
    if !batch.is_empty() {
        all.push(batch);
    }
    all
}

/// One call's submissions between a source and a destination buffer, up to [`DEPTH`] in flight.
struct Pipeline<'c> {
    ctx: &'c VulkanContext,
    src: &'c Arc<DeviceBuffer>,
    dst: &'c Arc<DeviceBuffer>,
    inflight: VecDeque<PendingCopy<'c>>,
}

impl Pipeline<'_> {
    /// Records `regions` into a free copy command and submits them.
    fn submit(&mut self, regions: &[vk::BufferCopy]) -> Result<()> {
        let ctx = self.ctx;
        let family = ctx.queue_family_index();
        let command = if self.inflight.len() >= DEPTH {
            next_free(&mut self.inflight)?
        } else if self.inflight.is_empty() {
            ctx.commands.acquire(ctx.device(), family)?
        } else {
            // Holding copy commands already: never wait on the pool (two callers could wait on each other);
            // reuse our own oldest one instead.
            match ctx.commands.try_acquire(ctx.device(), family)? {
                Some(s) => s,
                None => next_free(&mut self.inflight)?,
            }
        };
        if let Err(e) = ctx.record_and_submit(&command, self.src, self.dst, regions) {
            ctx.commands.release(command);
            return Err(e);
        }
        self.inflight.push_back(PendingCopy {
            ctx,
            command: Some(command),
            keep: [self.src.clone(), self.dst.clone()],
        });
        Ok(())
    }

    /// Waits for every submission; the first error, once all are done.
    fn finish(self) -> Result<()> {
        let mut result = Ok(());
        for f in self.inflight {
            match f.finish() {
                Ok(command) => self.ctx.commands.release(command),
                Err(e) if result.is_ok() => result = Err(e),
                Err(_) => {}
            }
        }
        result
    }
}

/// Waits for the oldest in-flight chunk and hands back its copy command.
fn next_free(inflight: &mut VecDeque<PendingCopy<'_>>) -> Result<CopyCommand> {
    match inflight.pop_front() {
        Some(f) => f.finish(),
        None => Err(Error::Internal("no staged copy in flight to wait for".into())),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn copy(offset: u64, size: u64) -> vk::BufferCopy {
        vk::BufferCopy {
            src_offset: offset,
            dst_offset: offset + 1,
            size,
        }
    }

    #[test]
    fn small_ranges_share_a_submission_and_large_ones_are_cut() {
        let many: Vec<_> = (0..256).map(|i| copy((i * 128) << 10, 64 << 10)).collect();
        assert_eq!(
            submissions(&many).len(),
            4,
            "16 MiB of 64 KiB ranges: four 4 MiB submissions"
        );
        let one = submissions(&[copy(0, 9 << 20)]);
        let sizes: Vec<u64> = one.iter().map(|b| b[0].size).collect();
        assert_eq!(sizes, [CHUNK, CHUNK, 1 << 20]);
        assert_eq!(one[1][0].src_offset, CHUNK);
        assert_eq!(one[1][0].dst_offset, CHUNK + 1);
        let tiny: Vec<_> = (0..2500).map(|i| copy(i * 8, 4)).collect();
        let counts: Vec<usize> = submissions(&tiny).iter().map(Vec::len).collect();
        assert_eq!(
            counts,
            [REGIONS_PER_SUBMIT, REGIONS_PER_SUBMIT, 2500 - 2 * REGIONS_PER_SUBMIT]
        );
        assert!(submissions(&[]).is_empty());
    }

    proptest! {
        /// Every byte of every region is copied once, in order, to the same place, within the
        /// limits of a submission.
        #[test]
        fn submissions_cover_the_regions_exactly(sizes in proptest::collection::vec(1u64..(9 << 20), 0..40)) {
            let mut offset = 0;
            let regions: Vec<_> = sizes.iter().map(|&n| { let r = copy(offset, n); offset += n + 3; r }).collect();
            let batches = submissions(&regions);
            let pieces: Vec<vk::BufferCopy> = batches.iter().flatten().copied().collect();
            for b in &batches {
                prop_assert!(!b.is_empty() && b.len() <= REGIONS_PER_SUBMIT);
                prop_assert!(b.iter().map(|r| r.size).sum::<u64>() <= CHUNK);
            }
            let mut next = pieces.iter();
            for r in &regions {
                let mut done = 0;
                while done < r.size {
                    let p = next.next().ok_or_else(|| TestCaseError::fail("a region was not copied whole"))?;
                    prop_assert_eq!(p.src_offset, r.src_offset + done);
                    prop_assert_eq!(p.dst_offset, r.dst_offset + done);
                    prop_assert!(p.size > 0);
                    done += p.size;
                }
                prop_assert_eq!(done, r.size);
            }
            prop_assert!(next.next().is_none());
        }
    }
}
