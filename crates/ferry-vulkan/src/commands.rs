//! Copy commands: a command pool, one command buffer and a fence, reused copy after copy.
//!
//! Several TCP streams commit ranges of the same staged region at once, each from its own thread. A
//! command pool may be used by one thread at a time, so each copy command has its own pool: recording in
//! different copy commands runs in parallel, and only `vkQueueSubmit` takes the queue's lock. Copy commands are created
//! on demand up to [`MAX_COPY_COMMANDS`] and go back to the free list only once their fence has signalled; a copy command
//! whose copy never finished (a hung or lost device) is parked, with the buffers it copies between, so
//! that neither its command buffer nor those buffers are ever freed under the GPU.
//!
//! Parking is a deliberate leak, and a bounded one. The parked buffers hold their context, which holds
//! the parked list: that context, its device and those buffers then live until the process ends,
//! because nothing may free memory a device that stopped answering may still write, nor destroy a
//! device with work pending. Parked copy commands count towards [`MAX_COPY_COMMANDS`] and are never
//! made again, so a context parks at most that many copies; once all are parked, every further copy
//! fails with `Timeout` (the device is lost to this process; a new context on it is the way on). This
//! module keeps the parked buffers type-erased: it only keeps them alive, and never needs to know
//! what they are.

use std::any::Any;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use ash::vk;
use ferry_core::{Error, Result};

use crate::error::vk_error;

/// Most copy commands one context creates.
pub(crate) const MAX_COPY_COMMANDS: usize = 16;

/// How long a copy may take before it is reported as [`Error::Timeout`].
pub(crate) const COPY_TIMEOUT: Duration = Duration::from_secs(20);

/// One command pool with one command buffer and its fence.
#[derive(Debug)]
pub(crate) struct CopyCommand {
    pub pool: vk::CommandPool,
    pub cmd: vk::CommandBuffer,
    pub fence: vk::Fence,
}

/// Whatever a parked copy keeps alive (its buffers).
pub(crate) type Keep = Arc<dyn Any + Send + Sync>;

#[derive(Default)]
struct State {
    free: Vec<CopyCommand>,
    created: usize,
    /// Copy commands whose fence never signalled, with the buffers their copy uses.
    parked: Vec<(CopyCommand, Vec<Keep>)>,
}

/// The copy commands of one context.
#[derive(Default)]
pub(crate) struct CopyCommands {
    state: Mutex<State>,
    returned: Condvar,
}

impl CopyCommands {
    pub fn new() -> Self {
        CopyCommands::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update of `State` is a push, a pop or an increment: a panic cannot leave it inconsistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A free copy command, a new one if fewer than [`MAX_COPY_COMMANDS`] exist, or `None`.
    pub fn try_acquire(&self, device: &ash::Device, family: u32) -> Result<Option<CopyCommand>> {
        let mut st = self.lock();
        if let Some(s) = st.free.pop() {
            return Ok(Some(s));
        }
        if st.created >= MAX_COPY_COMMANDS {
            return Ok(None);
        }
        st.created += 1;
        drop(st);
        match create_copy_command(device, family) {
            Ok(s) => Ok(Some(s)),
            Err(e) => {
                self.lock().created -= 1;
                Err(e)
            }
        }
    }

    /// A copy command, waiting (at most [`COPY_TIMEOUT`]) for one to come back when all are in use.
    pub fn acquire(&self, device: &ash::Device, family: u32) -> Result<CopyCommand> {
        if let Some(s) = self.try_acquire(device, family)? {
            return Ok(s);
        }
        let st = self.lock();
        let (mut st, waited) = self
            .returned
            .wait_timeout_while(st, COPY_TIMEOUT, |st| st.free.is_empty())
            .unwrap_or_else(|p| p.into_inner());
        match st.free.pop() {
            Some(s) => Ok(s),
            None if waited.timed_out() => Err(Error::Timeout(format!(
                "all {MAX_COPY_COMMANDS} Vulkan copy commands stayed busy for {COPY_TIMEOUT:?}"
            ))),
            None => Err(Error::Timeout("no Vulkan copy command came back".into())),
        }
    }

    /// Returns a copy command whose fence has signalled (or that was never submitted).
    pub fn release(&self, command: CopyCommand) {
        self.lock().free.push(command);
        self.returned.notify_one();
    }

    /// Keeps a copy command whose copy did not finish, and the buffers it uses, for the life of the
    /// process (see the module: at most [`MAX_COPY_COMMANDS`] per context).
    pub fn park(&self, command: CopyCommand, keep: Vec<Keep>) {
        tracing::error!("a Vulkan copy did not finish; its copy command and buffers are kept alive");
        self.lock().parked.push((command, keep));
    }

    /// Destroys every copy command.
    ///
    /// # Safety
    ///
    /// The device must be idle and no copy command may be in use.
    pub unsafe fn destroy(&self, device: &ash::Device) {
        let mut st = self.lock();
        let parked: Vec<CopyCommand> = st.parked.drain(..).map(|(s, _)| s).collect();
        for s in st.free.drain(..).chain(parked) {
            // SAFETY: the caller promised the device is idle, so no copy command's command buffer is pending;
            // destroying the pool frees its command buffer.
            unsafe {
                device.destroy_fence(s.fence, None);
                device.destroy_command_pool(s.pool, None);
            }
        }
    }
}

fn create_copy_command(device: &ash::Device, family: u32) -> Result<CopyCommand> {
    let info = vk::CommandPoolCreateInfo::default()
        .queue_family_index(family)
        .flags(vk::CommandPoolCreateFlags::TRANSIENT);
    // SAFETY: a live device and a queue family it was created with.
    let pool = unsafe { device.create_command_pool(&info, None) }.map_err(|e| vk_error("vkCreateCommandPool", e))?;
    let alloc = vk::CommandBufferAllocateInfo::default()
        .command_pool(pool)
        .level(vk::CommandBufferLevel::PRIMARY)
        .command_buffer_count(1);
    // SAFETY: `pool` was just created and is used by this thread only.
    let cmd = match unsafe { device.allocate_command_buffers(&alloc) } {
        Ok(v) if !v.is_empty() => v[0],
        other => {
            // SAFETY: the pool is unused.
            unsafe { device.destroy_command_pool(pool, None) };
            let e = other.err().unwrap_or(vk::Result::ERROR_UNKNOWN);
            return Err(vk_error("vkAllocateCommandBuffers", e));
        }
    };
    // SAFETY: a plain, unsignalled fence on a live device.
    let fence = match unsafe { device.create_fence(&vk::FenceCreateInfo::default(), None) } {
        Ok(f) => f,
        Err(e) => {
            // SAFETY: the pool and its buffer are unused.
            unsafe { device.destroy_command_pool(pool, None) };
            return Err(vk_error("vkCreateFence", e));
        }
    };
    Ok(CopyCommand { pool, cmd, fence })
}
