//! The coalescing pool: HIXL's `"BUFFER_NUM:BUFFER_SIZE_MB"` buffers through which small descriptors are
//! coalesced into one frame.
//!
//! Buffers are allocated on first use and reused after; a caller waits for a free one, so the pool
//! bounds the memory that coalescing can take to `count × size`.

use std::sync::{Arc, Mutex};

use ferry_core::BufferPool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A bounded set of reusable buffers for coalescing.
#[derive(Debug)]
pub struct CoalescePool {
    free: Mutex<Vec<Vec<u8>>>,
    permits: Arc<Semaphore>,
    count: usize,
    buffer_bytes: usize,
}

impl CoalescePool {
    /// A pool as configured; `None` when the pool is turned off.
    pub fn new(config: BufferPool) -> Option<Arc<Self>> {
        if config.is_off() {
            return None;
        }
        Some(Arc::new(CoalescePool {
            free: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(config.count)),
            count: config.count,
            buffer_bytes: config.buffer_bytes(),
        }))
    }

    /// Size of each buffer.
    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// Buffers in all.
    pub fn buffers(&self) -> usize {
        self.count
    }

    /// Buffers on loan now.
    pub fn in_use(&self) -> usize {
        self.count.saturating_sub(self.permits.available_permits())
    }

    /// Waits for a free buffer, emptied and with room for `buffer_bytes`.
    pub async fn acquire(self: &Arc<Self>) -> CoalesceBuf {
        // The semaphore is never closed, so acquiring only waits.
        let permit = self.permits.clone().acquire_owned().await.ok();
        let mut data = self.free.lock().map(|mut f| f.pop()).ok().flatten().unwrap_or_default();
        data.clear();
        data.reserve_exact(self.buffer_bytes);
        CoalesceBuf {
            data,
            pool: self.clone(),
            _permit: permit,
        }
    }
}

/// A buffer on loan from the pool; goes back on drop.
#[derive(Debug)]
pub struct CoalesceBuf {
    /// The bytes coalesced so far.
    pub data: Vec<u8>,
    pool: Arc<CoalescePool>,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Drop for CoalesceBuf {
    fn drop(&mut self) {
        let data = std::mem::take(&mut self.data);
        if let Ok(mut free) = self.pool.free.lock() {
            free.push(data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn pool_bounds_and_reuses() {
        let pool = CoalescePool::new("2:1".parse().unwrap()).unwrap();
        let a = pool.acquire().await;
        let b = pool.acquire().await;
        assert_eq!((pool.in_use(), pool.buffers()), (2, 2));
        assert!(a.data.capacity() >= 1 << 20);
        let third = tokio::time::timeout(Duration::from_millis(50), pool.acquire()).await;
        assert!(third.is_err(), "a third buffer must wait");
        let ptr = a.data.as_ptr();
        drop(a);
        let c = pool.acquire().await;
        assert_eq!(c.data.as_ptr(), ptr, "buffers are reused");
        drop((b, c));
        assert!(CoalescePool::new(BufferPool::OFF).is_none());
    }
}
