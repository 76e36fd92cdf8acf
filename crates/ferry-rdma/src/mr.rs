//! Regions registered with the NIC, and the work requests that still use each.
//!
//! A work request takes its regions into use when it is posted (under the queue pair's lock), not
//! when it is planned: planning keeps only a handle. Taking a region into use is taking an
//! [`OwnedPermit`] of the region's [`AccessGuard`], the same guard CPU copies and GPU copies hold, and
//! the permit is held until the work request's completion arrives. Deregistration first closes the
//! guard, so that no work request can take the region into use any more (a transfer planned before
//! then fails with `PermissionDenied` instead of posting), then ends the NIC's use of what was posted
//! already (see `RdmaTransport::deregister_region`), and only then deregisters the memory region,
//! explicitly: handles that planning still holds keep this bookkeeping alive, never the NIC's access.
//!
//! Memory the NIC cannot pin (a file in the page cache: since Linux 6.5 the kernel refuses long-term
//! writable pins of file pages that need dirty tracking) is reached through a bounce buffer: an
//! anonymous buffer of the region's size, registered in its place. RDMA WRITEs land there and the
//! target copies the written ranges into the region when the initiator's commit request names them
//! (`RdmaShared::commit_bounced`); reads of such a region go over TCP.
//!
//! Device memory a NIC reaches by itself (`DmaView::Device`: GPU memory with
//! `VK_NV_external_memory_rdma`) is registered at the address the NIC names it by, mapped onto the
//! region's own (host) address with `ibv_reg_mr_iova2`: work requests and peers address it as any other
//! region, and the NIC moves its bytes to and from the device with no host copy and no hook. GPU
//! memory that no host address reaches (CUDA) is registered the same way through the dma-buf its
//! driver exports (`ibv_reg_dmabuf_mr`), or at its device address where a peer-memory module lets
//! the NIC pin it; either is reached at the region's own address, which for CUDA memory is the
//! device address its owner names it by.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use std::os::fd::AsRawFd;

use ferry_core::{AccessGuard, DmaBuf, OwnedPermit};
use rdma_mummy_sys::{ibv_dereg_mr, ibv_mr, ibv_reg_dmabuf_mr, ibv_reg_mr_iova2};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use ferry_proto::rdma::RemoteKey;

/// A region's registration with the NIC.
pub struct Registered {
    // Before `bounce`: the NIC forgets the buffer before it is freed. `None` once deregistered.
    mr: Mutex<Option<Mr>>,
    lkey: u32,
    rkey: u32,
    /// The region's access guard: a posted work request holds a permit of it until its completion.
    guard: Arc<AccessGuard>,
    bounce: Option<Bounce>,
    /// For device memory registered at the address the NIC names it by (`DmaView::Device`), that
    /// address: work requests then reach the device, never the block's host copy.
    device: Option<u64>,
    /// For device memory registered through a dma-buf, the dma-buf: each peer's domain registers it
    /// again (`crate::scope`).
    dma_buf: Option<DmaBuf>,
    /// What the region's advert carries for RDMA (on an engine that authenticates its links, the
    /// template of each peer's own key: see `crate::scope`).
    advertised: RemoteKey,
}

/// A memory region as the verbs library registered it.
#[expect(dead_code, reason = "held only to be dropped, which deregisters it")]
enum Mr {
    /// At the memory's own address.
    Direct(Arc<MemoryRegion>),
    /// At an address of the caller's choosing.
    Iova(IovaRegion),
}

/// A memory region registered at an address of the caller's choosing (a peer's opaque base, or the
/// host address of a region whose bytes lie in device memory), which the binding has no constructor
/// for. Deregistered when dropped.
pub(crate) struct IovaRegion {
    mr: NonNull<ibv_mr>,
    lkey: u32,
    rkey: u32,
    // Keeps the domain allocated while the registration lives.
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: an `ibv_mr` may be used and deregistered from any thread; this type only reads its keys
// once, at creation, and deregisters in `drop`, which takes `&mut self`.
unsafe impl Send for IovaRegion {}
// SAFETY: no method takes `&self` and touches the registration.
unsafe impl Sync for IovaRegion {}

impl IovaRegion {
    /// Registers `[addr, addr + len)` in `pd`, reached by work requests and peers at
    /// `[iova, iova + len)`.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped until the returned value is dropped.
    pub(crate) unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: *mut u8,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> std::io::Result<Self> {
        // SAFETY: `pd` is a live protection domain (the Arc keeps it allocated); the caller keeps the
        // memory mapped for the registration's life. The access flags are the verbs' own bits.
        let mr = unsafe { ibv_reg_mr_iova2(pd.pd().as_ptr(), addr.cast(), len, iova, access.bits() as u32) };
        // SAFETY: what the library just returned for `pd`.
        unsafe { Self::returned(pd, mr) }
    }

    /// What a registration call returned for `pd`: the registration, or the error it left in `errno`.
    ///
    /// # Safety
    ///
    /// `mr` must be null or a registration the verbs library just made in `pd`, owned by nothing else.
    unsafe fn returned(pd: &Arc<ProtectionDomain>, mr: *mut ibv_mr) -> std::io::Result<Self> {
        let mr = NonNull::new(mr).ok_or_else(std::io::Error::last_os_error)?;
        // SAFETY: a live registration (the caller's promise).
        let (lkey, rkey) = unsafe { (mr.as_ref().lkey, mr.as_ref().rkey) };
        Ok(IovaRegion {
            mr,
            lkey,
            rkey,
            _pd: pd.clone(),
        })
    }

    /// Registers `len` bytes of the dma-buf `buf`, from its block's first byte, in `pd`, reached by
    /// work requests and peers at `[iova, iova + len)`.
    ///
    /// # Safety
    ///
    /// The dma-buf's exporter must keep the memory allocated until the returned value is dropped.
    pub(crate) unsafe fn register_dma_buf(
        pd: &Arc<ProtectionDomain>,
        buf: &DmaBuf,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> std::io::Result<Self> {
        // SAFETY: `pd` is a live protection domain; the descriptor is open (`buf` owns it) and the
        // kernel takes its own reference to the dma-buf; the caller keeps the memory allocated.
        let mr = unsafe {
            ibv_reg_dmabuf_mr(
                pd.pd().as_ptr(),
                buf.offset,
                len,
                iova,
                buf.fd.as_raw_fd(),
                access.bits(),
            )
        };
        // SAFETY: what the library just returned for `pd`.
        unsafe { Self::returned(pd, mr) }
    }

    /// The key peers name.
    pub(crate) fn rkey(&self) -> u32 {
        self.rkey
    }
}

impl Drop for IovaRegion {
    fn drop(&mut self) {
        // SAFETY: the registration is live and deregistered only here, once.
        let rc = unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            tracing::error!(
                rc,
                "deregistering an RDMA registration failed; the NIC may still reach its memory"
            );
        }
    }
}

/// A region taken into use by a posted group of work requests: a permit of its access guard, released
/// when this is dropped (the group's completion arrived, or its queue pair is gone).
pub(crate) struct InUse {
    region: Arc<Registered>,
    _permit: OwnedPermit,
}

impl InUse {
    /// The registration in use.
    pub(crate) fn region(&self) -> &Arc<Registered> {
        &self.region
    }
}

/// The buffer a region that the NIC cannot pin is reached through.
pub(crate) struct Bounce {
    memory: Box<[u8]>,
    /// The first byte, taken once from a unique borrow: the NIC writes through it.
    first: *mut u8,
}

// SAFETY: `first` points into `memory`, which this value owns; the bytes are only copied out of under
// the region's guard (see `RdmaShared::commit_bounced`).
unsafe impl Send for Bounce {}
// SAFETY: as above; no `&self` method writes through `first`.
unsafe impl Sync for Bounce {}

impl Bounce {
    pub(crate) fn new(len: usize) -> Self {
        let mut memory = vec![0u8; len].into_boxed_slice();
        let first = memory.as_mut_ptr();
        Bounce { memory, first }
    }

    /// The first byte (for registering it, and for copying out of it under the NIC's feet).
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.first
    }

    pub(crate) fn len(&self) -> usize {
        self.memory.len()
    }
}

impl Registered {
    /// The registration of a region whose accesses `guard` counts.
    pub(crate) fn new(mr: Arc<MemoryRegion>, guard: Arc<AccessGuard>) -> Self {
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        Registered::with_keys(Mr::Direct(mr), lkey, rkey, guard)
    }

    /// A registration reached directly, advertised with its rkey and nothing else.
    fn with_keys(mr: Mr, lkey: u32, rkey: u32, guard: Arc<AccessGuard>) -> Self {
        Registered {
            lkey,
            rkey,
            advertised: RemoteKey {
                rkey,
                flushable: false,
                bounce_addr: None,
                hooked: false,
            },
            mr: Mutex::new(Some(mr)),
            guard,
            bounce: None,
            device: None,
            dma_buf: None,
        }
    }

    /// The registration of a region whose bytes lie in device memory, registered at `nic_address`
    /// and reached at the region's own (host) address, which work requests and the region's adverts
    /// name: `mr` maps the one onto the other.
    pub(crate) fn device(mr: IovaRegion, nic_address: u64, guard: Arc<AccessGuard>) -> Self {
        let (lkey, rkey) = (mr.lkey, mr.rkey);
        Registered {
            device: Some(nic_address),
            ..Registered::with_keys(Mr::Iova(mr), lkey, rkey, guard)
        }
    }

    /// The registration of a region whose bytes lie in device memory, registered through its
    /// dma-buf `buf` and reached at `address` (the region's own).
    pub(crate) fn dma_buf(mr: IovaRegion, buf: DmaBuf, address: u64, guard: Arc<AccessGuard>) -> Self {
        let (lkey, rkey) = (mr.lkey, mr.rkey);
        Registered {
            device: Some(address),
            dma_buf: Some(buf),
            ..Registered::with_keys(Mr::Iova(mr), lkey, rkey, guard)
        }
    }

    /// The dma-buf the region's device memory was registered through, if it was.
    pub(crate) fn registered_dma_buf(&self) -> Option<&DmaBuf> {
        self.dma_buf.as_ref()
    }

    /// The registration, with what its advert carries for RDMA.
    pub(crate) fn advertising(self, key: RemoteKey) -> Self {
        Registered {
            advertised: key,
            ..self
        }
    }

    /// What the region's advert carries for RDMA.
    pub(crate) fn advertised(&self) -> RemoteKey {
        self.advertised
    }

    /// Where the NIC reaches the region when that is not the region's own memory, for registering
    /// it for a peer: the bounce buffer's first byte, or the device memory's address (`None` for a
    /// region registered directly).
    pub(crate) fn nic_first(&self) -> Option<*mut u8> {
        self.bounce
            .as_ref()
            .map(Bounce::as_ptr)
            .or(self.device.map(|a| a as usize as *mut u8))
    }

    /// Whether work requests reach the region's bytes in device memory, bypassing its host copy:
    /// the block's access hooks then have nothing to do for RDMA.
    pub fn reaches_device(&self) -> bool {
        self.device.is_some()
    }

    /// A registration of `bounce` standing in for a region the NIC cannot pin.
    pub(crate) fn bounced(mr: Arc<MemoryRegion>, bounce: Bounce, guard: Arc<AccessGuard>) -> Self {
        Registered {
            bounce: Some(bounce),
            ..Registered::new(mr, guard)
        }
    }

    /// Whether RDMA reaches the region through a bounce buffer.
    pub fn is_bounced(&self) -> bool {
        self.bounce.is_some()
    }

    /// The bounce buffer's byte at `offset` (`None` for a region registered directly).
    pub(crate) fn bounce_ptr(&self, offset: u64) -> Option<*const u8> {
        let s = self.bounce.as_ref()?;
        (offset as usize <= s.len()).then(|| s.first.cast_const().wrapping_add(offset as usize))
    }

    /// The key local work requests name.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// The key peers name.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Takes the region into use for a group of work requests; `None` once its guard is closed.
    pub(crate) fn take(self: &Arc<Self>) -> Option<InUse> {
        Some(InUse {
            _permit: self.guard.enter_owned()?,
            region: self.clone(),
        })
    }

    /// No work request (nor any other access) may take the region into use from now on; returns how
    /// many accesses still hold a permit (work requests, and CPU or GPU copies in progress).
    pub(crate) fn close(&self) -> usize {
        self.guard.close()
    }

    /// Accesses that still hold a permit of the region's guard.
    pub fn in_use(&self) -> usize {
        self.guard.held()
    }

    /// Deregisters the memory region: the NIC refuses every access to it from now on.
    pub(crate) fn forget(&self) {
        let mr = self
            .mr
            .lock()
            .map(|mut m| m.take())
            .unwrap_or_else(|p| p.into_inner().take());
        drop(mr);
    }
}
