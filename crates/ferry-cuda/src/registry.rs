//! [`CudaRegistry`]: where the engine gets CUDA memory from (`engine.alloc_from(&registry, ..)`).

use std::sync::Arc;

use ferry_core::{Error, MemoryBlock, MemoryRegistry, Result};

use crate::block::CudaBlock;
use crate::device::CudaDevice;

/// Allocates device memory on one device, as [`CudaBlock`]s.
#[derive(Debug, Clone)]
pub struct CudaRegistry {
    device: Arc<CudaDevice>,
    name: String,
}

impl CudaRegistry {
    /// A registry on `device`.
    pub fn new(device: Arc<CudaDevice>) -> Self {
        let name = format!("cuda {} ({})", device.ordinal(), device.name());
        CudaRegistry { device, name }
    }

    /// Allocates `len` bytes, keeping the typed block (for device copies and checks); register it
    /// with `Engine::register_block(block.clone(), access)`.
    pub fn allocate_block(&self, len: usize) -> Result<Arc<CudaBlock>> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot allocate zero bytes".into()));
        }
        CudaBlock::allocate(&self.device, len).map(Arc::new)
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
}

impl MemoryRegistry for CudaRegistry {
    fn name(&self) -> &str {
        &self.name
    }

    fn allocate(&self, len: usize) -> Result<Arc<dyn MemoryBlock>> {
        Ok(self.allocate_block(len)?)
    }
}
