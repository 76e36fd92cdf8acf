//! The functions and types of `ferry.h`.
//!
//! Ownership, as the header states it: the library owns every engine, registration and request
//! behind a handle, and frees it at the matching destroy call (`ferry_engine_destroy`,
//! `ferry_deregister`, a final `ferry_get_transfer_status`); memory the caller registered with
//! `ferry_register` stays the caller's and must outlive the registration; memory from
//! `ferry_alloc_host` is the library's and goes with its registration. Strings passed in are
//! borrowed for the call; strings and structs passed out are copied into the caller's buffers.

use std::collections::VecDeque;
use std::ffi::{CStr, c_char, c_void};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use ferry::{Access, Notification, Op, TransferDesc, TransferStatus, TransportKind};

use crate::state::{self, EngineState, Registration, lock};
use crate::{Failure, Outcome, call, ferry_status, invalid};

/// Peers may read a registered region.
pub const FERRY_ACCESS_READ: u32 = 1;
/// Peers may write a registered region.
pub const FERRY_ACCESS_WRITE: u32 = 2;
/// Most bytes of a notification's name or message (1024 characters of UTF-8).
pub const FERRY_NOTIFY_MAX_BYTES: usize = 4096;
/// The size of a notification's name and message fields: the most bytes and a NUL.
pub const FERRY_NOTIFY_FIELD: usize = 4097;
/// Most descriptors one transfer may carry.
pub const FERRY_MAX_DESCS: usize = 1 << 20;

/// How an engine is made. Zero it (or call [`ferry_engine_options_init`]) and set what you need;
/// every string is optional (null).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_engine_options {
    /// Address to listen on, `"ip:port"` (port 0: any free port); null: do not listen.
    pub listen: *const c_char,
    /// Transports to offer, comma-separated (`"tcp,shm,rdma"`); null: all this build has.
    pub transports: *const c_char,
    /// TCP streams per link; 0: the default.
    pub streams: u32,
    /// Staging buffer pool, `"BUFFER_NUM:BUFFER_SIZE_MB"` (`"0:0"`: none); null: the default.
    pub buffer_pool: *const c_char,
    /// Mutual TLS: this engine's certificate chain, key and the CA roots (PEM files); all three or none.
    pub tls_cert: *const c_char,
    pub tls_key: *const c_char,
    pub tls_ca: *const c_char,
    /// RDMA traffic class (0..=255, a multiple of 4); -1: the default (132). Zeroing the struct
    /// asks for 0: call [`ferry_engine_options_init`] for the defaults.
    pub rdma_traffic_class: i32,
    /// RDMA service level (0..=7); -1: the default (4).
    pub rdma_service_level: i32,
}

/// A transfer's direction.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ferry_op {
    /// Remote memory into local memory.
    FERRY_READ = 0,
    /// Local memory into remote memory.
    FERRY_WRITE = 1,
}

/// One piece of a transfer: `len` bytes between a local and a remote address.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_op_desc {
    pub local_addr: u64,
    pub remote_addr: u64,
    pub len: u64,
}

/// Where an asynchronous transfer stands.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ferry_transfer_status {
    FERRY_TRANSFER_WAITING = 0,
    FERRY_TRANSFER_COMPLETED = 1,
    FERRY_TRANSFER_TIMEOUT = 2,
    FERRY_TRANSFER_FAILED = 3,
}

/// A notification received, copied out: NUL-terminated UTF-8.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ferry_notification {
    /// The sender's engine id, as it claimed it.
    pub from_engine: u64,
    pub name: [c_char; FERRY_NOTIFY_FIELD],
    pub msg: [c_char; FERRY_NOTIFY_FIELD],
}

/// What [`ferry_get_capability`] can be asked about.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ferry_feature {
    /// TCP as a data path.
    FERRY_FEATURE_TCP = 0,
    /// Same-host shared memory.
    FERRY_FEATURE_SHM = 1,
    /// RDMA verbs (compiled in and a device usable here).
    FERRY_FEATURE_RDMA = 2,
    /// Notifications between engines.
    FERRY_FEATURE_NOTIFY = 3,
    /// Asynchronous transfers with status.
    FERRY_FEATURE_ASYNC_TRANSFER = 4,
    /// Engines that listen (client/server).
    FERRY_FEATURE_LISTEN = 5,
}

/// Reads an optional C string argument.
///
/// # Safety
/// `p` is null or a NUL-terminated string valid for the call.
unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: not null, and the caller promises a NUL-terminated string valid for the call.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// Reads a required C string argument.
///
/// # Safety
/// As [`opt_str`].
unsafe fn req_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    // SAFETY: passed on from the caller's promise.
    unsafe { opt_str(p, what) }?.ok_or_else(|| invalid(format!("{what} is null")))
}

fn out_ptr<T>(p: *mut T, what: &str) -> Result<(), Failure> {
    match p.is_null() {
        true => Err(invalid(format!("{what} (an output) is null"))),
        false => Ok(()),
    }
}

fn timeout(ms: i32) -> Result<Duration, Failure> {
    match ms {
        ..=0 => Err(invalid(format!(
            "timeout of {ms} ms: give a positive number of milliseconds"
        ))),
        ms => Ok(Duration::from_millis(ms as u64)),
    }
}

fn access(bits: u32) -> Result<Access, Failure> {
    u8::try_from(bits)
        .ok()
        .filter(|b| *b & !3 == 0 && *b != 0)
        .and_then(|b| Access::from_bits(b).ok())
        .ok_or_else(|| {
            invalid(format!(
                "access {bits:#x}: give FERRY_ACCESS_READ, FERRY_ACCESS_WRITE or both"
            ))
        })
}

/// Copies `s` and a NUL into `buf` of `cap` bytes; `needed` gets the size it takes either way.
fn copy_out(s: &str, buf: *mut c_char, cap: usize, needed: *mut usize) -> Outcome {
    let need = s.len() + 1;
    if !needed.is_null() {
        // SAFETY: not null; the caller passes a writable size_t.
        unsafe { needed.write(need) };
    }
    if buf.is_null() || cap < need {
        return Err(invalid(format!("a buffer of {cap} bytes; this needs {need}")));
    }
    // SAFETY: `buf` is not null and the caller promises `cap` writable bytes; `need <= cap`.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr().cast::<c_char>(), buf, s.len());
        buf.add(s.len()).write(0);
    }
    Ok(())
}

fn fill(dst: &mut [c_char; FERRY_NOTIFY_FIELD], s: &str) {
    let n = s.len().min(FERRY_NOTIFY_MAX_BYTES);
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = *b as c_char;
    }
    dst[n] = 0;
}

/// Sets `options` to the defaults: no listening, every transport, default streams and pool, no TLS,
/// default RDMA traffic class and service level.
///
/// # Safety
/// `options` points to a writable `ferry_engine_options`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_options_init(options: *mut ferry_engine_options) -> ferry_status {
    call(|| {
        out_ptr(options, "options")?;
        let defaults = ferry_engine_options {
            listen: std::ptr::null(),
            transports: std::ptr::null(),
            streams: 0,
            buffer_pool: std::ptr::null(),
            tls_cert: std::ptr::null(),
            tls_key: std::ptr::null(),
            tls_ca: std::ptr::null(),
            rdma_traffic_class: -1,
            rdma_service_level: -1,
        };
        // SAFETY: not null; the caller passes a writable ferry_engine_options.
        unsafe { options.write(defaults) };
        Ok(())
    })
}

/// Makes an engine (HIXL `Initialize`). `options` may be null (the defaults). On success `*engine`
/// is its handle, to be destroyed with [`ferry_engine_destroy`].
///
/// # Safety
/// `options` is null or points to a `ferry_engine_options` whose strings are null or NUL-terminated;
/// `engine` points to a writable `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_create(options: *const ferry_engine_options, engine: *mut u64) -> ferry_status {
    call(|| {
        out_ptr(engine, "engine")?;
        let options = match options.is_null() {
            true => None,
            // SAFETY: not null; the caller promises a readable ferry_engine_options.
            false => Some(unsafe { options.read() }),
        };
        let mut builder = ferry::Engine::builder();
        if let Some(o) = options {
            // SAFETY (each string): the caller promises null or a NUL-terminated string.
            if let Some(listen) = unsafe { opt_str(o.listen, "options.listen") }? {
                builder = builder.listen(listen);
            }
            if let Some(list) = unsafe { opt_str(o.transports, "options.transports") }? {
                let kinds = list
                    .split(',')
                    .map(|k| k.trim().parse::<TransportKind>())
                    .collect::<ferry::Result<Vec<_>>>()?;
                builder = builder.transports(kinds);
            }
            if o.streams > 0 {
                builder = builder.streams(o.streams as usize);
            }
            if let Some(pool) = unsafe { opt_str(o.buffer_pool, "options.buffer_pool") }? {
                builder = builder.buffer_pool(pool);
            }
            if o.rdma_traffic_class >= 0 {
                let tc = u8::try_from(o.rdma_traffic_class)
                    .map_err(|_| invalid(format!("rdma_traffic_class {} is over 255", o.rdma_traffic_class)))?;
                builder = builder.rdma_traffic_class(tc);
            }
            if o.rdma_service_level >= 0 {
                let sl = u8::try_from(o.rdma_service_level)
                    .map_err(|_| invalid(format!("rdma_service_level {} is over 7", o.rdma_service_level)))?;
                builder = builder.rdma_service_level(sl);
            }
            let cert = unsafe { opt_str(o.tls_cert, "options.tls_cert") }?;
            let key = unsafe { opt_str(o.tls_key, "options.tls_key") }?;
            let ca = unsafe { opt_str(o.tls_ca, "options.tls_ca") }?;
            match (cert, key, ca) {
                (None, None, None) => {}
                (Some(cert), Some(key), Some(ca)) => {
                    let (cert, key, ca) = (Path::new(cert), Path::new(key), Path::new(ca));
                    builder = builder.tls(ferry::TlsConfig::from_pem_files(cert, key, ca)?);
                }
                _ => return Err(invalid("TLS needs tls_cert, tls_key and tls_ca together")),
            }
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ferry-capi")
            .enable_all()
            .build()
            .map_err(|e| Failure(ferry_status::FERRY_IO, format!("starting the engine's runtime: {e}")))?;
        let built = runtime.block_on(builder.build())?;
        let handle = state::insert_engine(EngineState {
            engine: built,
            peers: Mutex::default(),
            regions: Mutex::default(),
            requests: Mutex::default(),
            notifications: Mutex::new(VecDeque::new()),
            runtime,
        })?;
        // SAFETY: checked not null above; the caller passes a writable uint64_t.
        unsafe { engine.write(handle) };
        Ok(())
    })
}

/// Destroys an engine (HIXL `Finalize`): closes its links, deregisters and frees what it holds. The
/// handle, and every registration and request of the engine, is invalid afterwards.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_engine_destroy(engine: u64) -> ferry_status {
    call(|| {
        let state = state::remove_engine(engine)?;
        let mut peers = std::mem::take(&mut *lock(&state.peers)?);
        let links: Vec<_> = peers.drain().map(|(_, p)| p).collect();
        state.runtime.block_on(async {
            for peer in links {
                let _ = state.engine.disconnect(&peer, Duration::from_secs(1)).await;
            }
        });
        lock(&state.requests)?.clear();
        let regions = std::mem::take(&mut *lock(&state.regions)?);
        for (_, r) in regions {
            state.engine.deregister_blocking(r.region);
        }
        Ok(())
    })
}

/// Writes the address the engine listens on (`"ip:port"`, NUL-terminated) into `buf` of `cap` bytes;
/// `*needed` (if not null) gets the size it takes. `FERRY_UNSUPPORTED` if it does not listen.
///
/// # Safety
/// `buf` points to `cap` writable bytes; `needed` is null or a writable `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_local_addr(
    engine: u64,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> ferry_status {
    call(|| {
        let state = state::engine(engine)?;
        let addr = state
            .engine
            .local_addr()
            .ok_or_else(|| Failure(ferry_status::FERRY_UNSUPPORTED, "this engine does not listen".into()))?;
        copy_out(&addr.to_string(), buf, cap, needed)
    })
}

/// Registers `len` bytes of the caller's memory at `ptr` (HIXL `RegisterMem`); `*mem` gets the
/// registration's handle. The memory stays the caller's: it must stay valid, and must not be freed,
/// until [`ferry_deregister`] has returned.
///
/// # Safety
/// `ptr..ptr+len` is memory of this process that stays valid until the registration is removed;
/// `mem` points to a writable `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_register(
    engine: u64,
    ptr: *mut c_void,
    len: usize,
    access_bits: u32,
    mem: *mut u64,
) -> ferry_status {
    call(|| {
        out_ptr(mem, "mem")?;
        if ptr.is_null() || len == 0 {
            return Err(invalid("ferry_register needs a non-null pointer and a length above 0"));
        }
        let access = access(access_bits)?;
        let state = state::engine(engine)?;
        // SAFETY: the caller promises `ptr..ptr+len` stays valid memory of this process until
        // ferry_deregister, as register_raw requires; it checks the range is mapped.
        let region = unsafe { state.engine.register_raw(ptr.cast(), len, access) }?;
        // SAFETY: `mem` was checked not null above.
        unsafe { keep(&state, region, None, mem) }
    })
}

/// Allocates `len` bytes of host memory, zeroed, and registers them (HIXL `MallocMem`): `*ptr` gets
/// the memory and `*mem` the registration. The memory is the library's: it is freed by
/// [`ferry_deregister`] (or [`ferry_free_host`]) and must not be used afterwards.
///
/// # Safety
/// `ptr` and `mem` point to writable storage.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_alloc_host(
    engine: u64,
    len: usize,
    access_bits: u32,
    ptr: *mut *mut c_void,
    mem: *mut u64,
) -> ferry_status {
    call(|| {
        out_ptr(ptr, "ptr")?;
        out_ptr(mem, "mem")?;
        if len == 0 {
            return Err(invalid("ferry_alloc_host needs a length above 0"));
        }
        let access = access(access_bits)?;
        let state = state::engine(engine)?;
        let region = state.engine.alloc_host(len, access)?;
        // SAFETY: `ptr` and `mem` were checked not null above.
        unsafe { keep(&state, region, Some(ptr), mem) }
    })
}

/// Registers `len` bytes of CUDA device memory at the device address `ptr` (HIXL `RegisterMem` with
/// `MEM_DEVICE`); `*mem` gets the registration's handle. The CUDA driver must know the range as one
/// allocation of device memory in its device's primary context (the runtime API's, where
/// `cudaMalloc` allocates); descriptors name it by its device address, and its bytes move through a
/// pinned host copy. `FERRY_UNSUPPORTED` without a CUDA driver, `FERRY_INVALID_ARGUMENT` for memory
/// that is not such an allocation.
///
/// # Safety
/// `ptr..ptr+len` is device memory that stays allocated until the registration is removed; `mem`
/// points to a writable `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_register_device(
    engine: u64,
    ptr: *mut c_void,
    len: usize,
    access_bits: u32,
    mem: *mut u64,
) -> ferry_status {
    call(|| {
        out_ptr(mem, "mem")?;
        if ptr.is_null() || len == 0 {
            return Err(invalid(
                "ferry_register_device needs a non-null pointer and a length above 0",
            ));
        }
        let access = access(access_bits)?;
        let state = state::engine(engine)?;
        // SAFETY: the caller promises the device memory stays allocated until ferry_deregister;
        // `borrow` checks with the driver that it is one allocation of device memory.
        let block = unsafe { ferry::cuda::CudaBlock::borrow(ptr as u64, len, None) }?;
        let region = state.engine.register_block(block, access)?;
        // SAFETY: `mem` was checked not null above.
        unsafe { keep(&state, region, None, mem) }
    })
}

/// Allocates `len` bytes of device memory, zeroed, on CUDA device 0 (as `CUDA_VISIBLE_DEVICES`
/// numbers them) and registers them (HIXL `MallocMem` with `MEM_DEVICE`): `*ptr` gets the device
/// address and `*mem` the registration. Freed by [`ferry_deregister`] or [`ferry_free_host`].
/// `FERRY_UNSUPPORTED` without a CUDA driver or device.
///
/// # Safety
/// `ptr` and `mem` point to writable storage.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_alloc_device(
    engine: u64,
    len: usize,
    access_bits: u32,
    ptr: *mut *mut c_void,
    mem: *mut u64,
) -> ferry_status {
    call(|| {
        out_ptr(ptr, "ptr")?;
        out_ptr(mem, "mem")?;
        if len == 0 {
            return Err(invalid("ferry_alloc_device needs a length above 0"));
        }
        let access = access(access_bits)?;
        let state = state::engine(engine)?;
        let registry = ferry::cuda::CudaRegistry::new(ferry::cuda::CudaDevice::open(0)?);
        let region = state.engine.alloc_from(&registry, len, access)?;
        // SAFETY: `ptr` and `mem` were checked not null above.
        unsafe { keep(&state, region, Some(ptr), mem) }
    })
}

/// Keeps `region` in the engine's table and writes its handle to `*mem`. With `allocated`, the memory
/// is the library's (freed with the registration), and its address is written to `*allocated`.
///
/// # Safety
/// `mem`, and `allocated` where given, point to writable storage.
unsafe fn keep(
    state: &EngineState,
    region: ferry::Region,
    allocated: Option<*mut *mut c_void>,
    mem: *mut u64,
) -> Result<(), Failure> {
    let addr = region.addr();
    let handle = state::new_handle();
    lock(&state.regions)?.insert(
        handle,
        Registration {
            region,
            allocated: allocated.is_some(),
        },
    );
    // SAFETY: the caller's promise.
    unsafe {
        if let Some(ptr) = allocated {
            ptr.write(addr as *mut c_void);
        }
        mem.write(handle);
    }
    Ok(())
}

/// Removes a registration (HIXL `DeregisterMem`); memory from [`ferry_alloc_host`] is freed with it.
/// Returns once no transfer touches the memory any more.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_deregister(engine: u64, mem: u64) -> ferry_status {
    call(|| {
        let state = state::engine(engine)?;
        let registration = lock(&state.regions)?.remove(&mem).ok_or_else(|| {
            Failure(
                ferry_status::FERRY_INVALID_HANDLE,
                format!("registration handle {mem} names no registration of this engine (deregistered already?)"),
            )
        })?;
        state.engine.deregister_blocking(registration.region);
        Ok(())
    })
}

/// Frees memory [`ferry_alloc_host`] or [`ferry_alloc_device`] returned, by its pointer (HIXL
/// `FreeMem`).
#[unsafe(no_mangle)]
pub extern "C" fn ferry_free_host(engine: u64, ptr: *mut c_void) -> ferry_status {
    call(|| {
        let state = state::engine(engine)?;
        let mut regions = lock(&state.regions)?;
        let handle = regions
            .iter()
            .find(|(_, r)| r.allocated && r.region.addr() == ptr as u64)
            .map(|(h, _)| *h)
            .ok_or_else(|| {
                invalid(format!(
                    "{ptr:?} is not memory ferry_alloc_host or ferry_alloc_device returned (or it was freed)"
                ))
            })?;
        let registration = regions
            .remove(&handle)
            .ok_or_else(|| invalid("the allocation went away"))?;
        drop(regions);
        state.engine.deregister_blocking(registration.region);
        Ok(())
    })
}

/// Links to the engine listening at `remote` (`"ip:port"`, HIXL `Connect`). Later calls name the
/// link by the same string.
///
/// # Safety
/// `remote` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_connect(engine: u64, remote: *const c_char, timeout_ms: i32) -> ferry_status {
    call(|| {
        // SAFETY: the caller promises a NUL-terminated string.
        let remote = unsafe { req_str(remote, "remote") }?;
        let timeout = timeout(timeout_ms)?;
        let state = state::engine(engine)?;
        if lock(&state.peers)?.contains_key(remote) {
            return Err(Failure(
                ferry_status::FERRY_ALREADY_CONNECTED,
                format!("already linked to {remote}"),
            ));
        }
        let peer = state.runtime.block_on(state.engine.connect(remote, timeout))?;
        lock(&state.peers)?.insert(remote.to_string(), peer);
        Ok(())
    })
}

/// Closes the link to `remote` (HIXL `Disconnect`).
///
/// # Safety
/// `remote` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_disconnect(engine: u64, remote: *const c_char, timeout_ms: i32) -> ferry_status {
    call(|| {
        // SAFETY: the caller promises a NUL-terminated string.
        let remote = unsafe { req_str(remote, "remote") }?;
        let timeout = timeout(timeout_ms)?;
        let state = state::engine(engine)?;
        let peer = state.peer(remote)?;
        state.runtime.block_on(state.engine.disconnect(&peer, timeout))?;
        lock(&state.peers)?.remove(remote);
        Ok(())
    })
}

/// The descriptors of a transfer call, checked.
///
/// # Safety
/// `descs` points to `count` readable `ferry_op_desc`.
unsafe fn descriptors(descs: *const ferry_op_desc, count: usize) -> Result<Vec<TransferDesc>, Failure> {
    if descs.is_null() || count == 0 || count > FERRY_MAX_DESCS {
        return Err(invalid(format!(
            "a transfer needs 1 to {FERRY_MAX_DESCS} descriptors at a non-null pointer (got {count})"
        )));
    }
    // SAFETY: not null, and the caller promises `count` readable descriptors.
    let descs = unsafe { std::slice::from_raw_parts(descs, count) };
    Ok(descs
        .iter()
        .map(|d| TransferDesc::new(d.local_addr, d.remote_addr, d.len))
        .collect())
}

/// A `ferry_op` value from C (a C enum may hold any int: checked, never transmuted).
fn op(value: u32) -> Result<Op, Failure> {
    match value {
        v if v == ferry_op::FERRY_READ as u32 => Ok(Op::Read),
        v if v == ferry_op::FERRY_WRITE as u32 => Ok(Op::Write),
        other => Err(invalid(format!("operation {other}: give FERRY_READ or FERRY_WRITE"))),
    }
}

/// Moves the bytes `descs` describe and returns when every one is at its destination (HIXL
/// `TransferSync`); `operation` is a `ferry_op`. Every local address must lie in a registration of this engine, every remote one
/// in a region the remote engine registered.
///
/// # Safety
/// `remote` is a NUL-terminated string; `descs` points to `count` readable descriptors.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_transfer_sync(
    engine: u64,
    remote: *const c_char,
    operation: u32,
    descs: *const ferry_op_desc,
    count: usize,
    timeout_ms: i32,
) -> ferry_status {
    call(|| {
        // SAFETY: the caller's promises, passed on.
        let (remote, descs) = unsafe { (req_str(remote, "remote")?, descriptors(descs, count)?) };
        let timeout = timeout(timeout_ms)?;
        let state = state::engine(engine)?;
        let peer = state.peer(remote)?;
        ferry::blocking::block_on(
            &state.runtime,
            state.engine.transfer(&peer, op(operation)?, &descs, timeout),
        )?;
        Ok(())
    })
}

/// Starts a transfer and returns at once (HIXL `TransferAsync`): `*request` gets its handle, to
/// query with [`ferry_get_transfer_status`]. The descriptors are checked before this returns.
///
/// # Safety
/// As [`ferry_transfer_sync`]; `request` points to a writable `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_transfer_async(
    engine: u64,
    remote: *const c_char,
    operation: u32,
    descs: *const ferry_op_desc,
    count: usize,
    timeout_ms: i32,
    request: *mut u64,
) -> ferry_status {
    call(|| {
        out_ptr(request, "request")?;
        // SAFETY: the caller's promises, passed on.
        let (remote, descs) = unsafe { (req_str(remote, "remote")?, descriptors(descs, count)?) };
        let timeout = timeout(timeout_ms)?;
        let state = state::engine(engine)?;
        let peer = state.peer(remote)?;
        let handle = {
            let _entered = state.runtime.enter();
            state.engine.transfer_async(&peer, op(operation)?, &descs, timeout)?
        };
        let id = state::new_handle();
        lock(&state.requests)?.insert(id, handle);
        // SAFETY: checked not null above.
        unsafe { request.write(id) };
        Ok(())
    })
}

/// Where an asynchronous transfer stands (HIXL `GetTransferStatus`). Once it reports
/// `COMPLETED`, `TIMEOUT` or `FAILED` the request is released: its handle is invalid afterwards.
/// A failed transfer's reason is in [`crate::ferry_last_error`] after the call that reports it.
///
/// # Safety
/// `status` points to a writable `ferry_transfer_status`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_get_transfer_status(
    engine: u64,
    request: u64,
    status: *mut ferry_transfer_status,
) -> ferry_status {
    call(|| {
        out_ptr(status, "status")?;
        let state = state::engine(engine)?;
        let mut requests = lock(&state.requests)?;
        let handle = requests.get(&request).ok_or_else(|| {
            Failure(
                ferry_status::FERRY_INVALID_HANDLE,
                format!("request handle {request} names no transfer in progress (it reported a final state already?)"),
            )
        })?;
        let now = match handle.status() {
            TransferStatus::Waiting => ferry_transfer_status::FERRY_TRANSFER_WAITING,
            TransferStatus::Completed => ferry_transfer_status::FERRY_TRANSFER_COMPLETED,
            TransferStatus::Timeout => ferry_transfer_status::FERRY_TRANSFER_TIMEOUT,
            TransferStatus::Failed => ferry_transfer_status::FERRY_TRANSFER_FAILED,
        };
        if now != ferry_transfer_status::FERRY_TRANSFER_WAITING
            && let Some(done) = requests.remove(&request)
        {
            drop(requests);
            let result = state.runtime.block_on(done);
            if let Err(e) = result {
                crate::set_last_error(&e.to_string());
            }
        }
        // SAFETY: checked not null above.
        unsafe { status.write(now) };
        Ok(())
    })
}

/// Sends `{name, msg}` to `remote`'s notification queue (HIXL `SendNotify`); each at most
/// [`FERRY_NOTIFY_MAX_BYTES`] bytes (1024 characters).
///
/// # Safety
/// `remote`, `name` and `msg` are NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_notify(
    engine: u64,
    remote: *const c_char,
    name: *const c_char,
    msg: *const c_char,
    timeout_ms: i32,
) -> ferry_status {
    call(|| {
        // SAFETY: the caller promises NUL-terminated strings.
        let (remote, name, msg) = unsafe { (req_str(remote, "remote")?, req_str(name, "name")?, req_str(msg, "msg")?) };
        let timeout = timeout(timeout_ms)?;
        let state = state::engine(engine)?;
        let peer = state.peer(remote)?;
        state
            .runtime
            .block_on(state.engine.notify(&peer, Notification::new(name, msg), timeout))?;
        Ok(())
    })
}

/// Moves up to `cap` received notifications into `out` (HIXL `GetNotifies`); `*taken` gets how many.
/// Those that did not fit stay for the next call.
///
/// # Safety
/// `out` points to `cap` writable `ferry_notification`s; `taken` to a writable `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_take_notifications(
    engine: u64,
    out: *mut ferry_notification,
    cap: usize,
    taken: *mut usize,
) -> ferry_status {
    call(|| {
        out_ptr(taken, "taken")?;
        if out.is_null() && cap > 0 {
            return Err(invalid("out is null but cap is not 0"));
        }
        let state = state::engine(engine)?;
        let mut pending = lock(&state.notifications)?;
        // Taken off the engine only when what is held here does not fill the caller's array: a
        // caller that takes few at a time leaves the rest with the engine, whose bound on pending
        // notifications then holds senders back, instead of piling them up here.
        if pending.len() < cap {
            pending.extend(state.engine.take_notifications());
        }
        let n = pending.len().min(cap);
        for (i, received) in pending.drain(..n).enumerate() {
            let mut slot = ferry_notification {
                from_engine: received.from_engine,
                name: [0; FERRY_NOTIFY_FIELD],
                msg: [0; FERRY_NOTIFY_FIELD],
            };
            fill(&mut slot.name, &received.notification.name);
            fill(&mut slot.msg, &received.notification.msg);
            // SAFETY: `out` is not null (cap > 0 here) and holds `cap > i` writable slots.
            unsafe { out.add(i).write(slot) };
        }
        // SAFETY: checked not null above.
        unsafe { taken.write(n) };
        Ok(())
    })
}

/// Whether this build and host support `feature` (a `ferry_feature`; HIXL `GetCapability`): `*value`
/// is 1 or 0. Callable before any engine exists. `FERRY_UNSUPPORTED` for a feature this build does
/// not know, `FERRY_INVALID_ARGUMENT` for a negative one.
///
/// # Safety
/// `value` points to a writable `int32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_get_capability(feature: i32, value: *mut i32) -> ferry_status {
    call(|| {
        out_ptr(value, "value")?;
        let usable = |kind: TransportKind| {
            ferry::capabilities()
                .transports
                .iter()
                .any(|t| t.name == kind.name() && t.compiled && t.usable)
        };
        use ferry_feature as F;
        let supported = match feature {
            f if f < 0 => return Err(invalid(format!("feature {f} is negative"))),
            f if f == F::FERRY_FEATURE_TCP as i32 => usable(TransportKind::Tcp),
            f if f == F::FERRY_FEATURE_SHM as i32 => usable(TransportKind::Shm),
            f if f == F::FERRY_FEATURE_RDMA as i32 => usable(TransportKind::Rdma),
            f if f == F::FERRY_FEATURE_NOTIFY as i32
                || f == F::FERRY_FEATURE_ASYNC_TRANSFER as i32
                || f == F::FERRY_FEATURE_LISTEN as i32 =>
            {
                true
            }
            other => {
                return Err(Failure(
                    ferry_status::FERRY_UNSUPPORTED,
                    format!("feature {other} is unknown to this build"),
                ));
            }
        };
        // SAFETY: checked not null above.
        unsafe { value.write(i32::from(supported)) };
        Ok(())
    })
}

/// Writes what this build and host can do (transports and why, devices), as JSON, into `buf` of
/// `cap` bytes; `*needed` (if not null) gets the size it takes, so a first call with `cap` 0 sizes it.
///
/// # Safety
/// `buf` points to `cap` writable bytes (or is null with `cap` 0); `needed` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_capabilities_json(buf: *mut c_char, cap: usize, needed: *mut usize) -> ferry_status {
    call(|| {
        let json = serde_json::to_string(&ferry::capabilities()).map_err(|e| {
            Failure(
                ferry_status::FERRY_INTERNAL,
                format!("writing capabilities as JSON: {e}"),
            )
        })?;
        copy_out(&json, buf, cap, needed)
    })
}
