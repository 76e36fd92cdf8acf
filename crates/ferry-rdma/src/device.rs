//! Finding an RDMA device, its port and the GID to use.
//!
//! The GID is chosen by type, never by a fixed index: RoCEv2 over IPv4 first (an IPv4-mapped address),
//! then any RoCEv2 GID, then the port's first valid GID (InfiniBand). Soft-RoCE, for example, puts its
//! RoCEv2/IPv4 GID at index 1.

use std::net::Ipv6Addr;
use std::sync::Arc;

use ferry_core::{Error, Result};
use sideway::ibverbs::address::GidType;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, PortState};

/// An opened device and the port, GID and limits this transport uses on it.
pub struct OpenDevice {
    /// Device name ("rxe0", "mlx5_0").
    pub name: String,
    /// The verbs context.
    pub context: Arc<DeviceContext>,
    /// Port number (from 1).
    pub port: u8,
    /// GID index chosen by type.
    pub gid_index: u8,
    /// The GID at that index.
    pub gid: Ipv6Addr,
    /// Whether the GID is RoCEv2.
    pub roce_v2: bool,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Active MTU as the verbs enum value.
    pub mtu: u8,
    /// Largest message the port carries.
    pub max_msg: u64,
    /// Scatter-gather entries per work request.
    pub max_sge: u32,
    /// Work requests per queue.
    pub max_qp_wr: u32,
    /// Whether the device reports persistent FLUSH (IBTA 1.5): as a target it persists a FLUSHed
    /// range of a region registered for it; as an initiator it can post one.
    pub flush_capable: bool,
}

impl std::fmt::Debug for OpenDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenDevice")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("gid", &self.gid)
            .finish()
    }
}

fn unsupported(what: impl std::fmt::Display) -> Error {
    Error::Unsupported(format!("RDMA: {what}"))
}

fn list_error(e: impl std::fmt::Display) -> Error {
    if !std::path::Path::new("/sys/class/infiniband").exists() {
        unsupported(format_args!(
            "no RDMA device: the kernel has none (no /sys/class/infiniband; on Soft-RoCE: modprobe rdma_rxe and \
             rdma link add rxe0 type rxe netdev IF) ({e})"
        ))
    } else {
        unsupported(format_args!(
            "cannot list devices ({e}); is libibverbs1 (and ibverbs-providers) installed?"
        ))
    }
}

/// Names of the RDMA devices this host has; `Unsupported` when libibverbs cannot be loaded.
pub fn device_names() -> Result<Vec<String>> {
    let list = DeviceList::new().map_err(list_error)?;
    Ok(list.iter().map(|d| d.name()).collect())
}

/// Opens `wanted` (or the first device with an active port) and picks its port and GID.
pub fn open(wanted: Option<&str>) -> Result<OpenDevice> {
    let list = DeviceList::new().map_err(list_error)?;
    if list.is_empty() {
        return Err(unsupported(
            "no RDMA device on this host (load rdma_rxe and add one: rdma link add rxe0 type rxe netdev IF)",
        ));
    }
    let mut reasons = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        if wanted.is_some_and(|w| w != name) {
            continue;
        }
        match open_one(&dev) {
            Ok(d) => return Ok(d),
            Err(e) => reasons.push(format!("{name}: {e}")),
        }
    }
    match wanted {
        Some(w) if reasons.is_empty() => Err(unsupported(format_args!("no RDMA device named {w}"))),
        _ => Err(unsupported(reasons.join("; "))),
    }
}

/// Opens the devices `wanted` names, in that order, each of which must open; or, when it names none,
/// every device with an active port (the reasons of those that would not open are logged).
pub fn open_all(wanted: &[String]) -> Result<Vec<OpenDevice>> {
    if !wanted.is_empty() {
        return wanted.iter().map(|w| open(Some(w))).collect();
    }
    let list = DeviceList::new().map_err(list_error)?;
    let mut opened = Vec::new();
    let mut reasons = Vec::new();
    for dev in list.iter() {
        match open_one(&dev) {
            Ok(d) => opened.push(d),
            Err(e) => reasons.push(format!("{}: {e}", dev.name())),
        }
    }
    if opened.is_empty() {
        return Err(match reasons.is_empty() {
            true => unsupported(
                "no RDMA device on this host (load rdma_rxe and add one: rdma link add rxe0 type rxe netdev IF)",
            ),
            false => unsupported(reasons.join("; ")),
        });
    }
    for why in reasons {
        tracing::info!(device = %why, "RDMA device not used");
    }
    opened.truncate(ferry_proto::rdma::MAX_RAILS);
    Ok(opened)
}

/// Whether the device's extended capabilities include FLUSH_GLOBAL and FLUSH_PERSISTENT
/// (`IB_UVERBS_DEVICE_FLUSH_GLOBAL` and `_PERSISTENT`, bits 38 and 39 of `device_cap_flags_ex`, which
/// libibverbs passes through from the kernel; its own headers have no names for them).
fn reports_flush_persistent(context: &DeviceContext) -> bool {
    const FLUSH_GLOBAL: u64 = 1 << 38;
    const FLUSH_PERSISTENT: u64 = 1 << 39;
    let mut attr = std::mem::MaybeUninit::<rdma_mummy_sys::ibv_device_attr_ex>::zeroed();
    // SAFETY: the context is open for as long as `context` lives; a null input asks for the defaults;
    // `attr` is writable, zero-initialised memory of the size the call is told.
    let rc =
        unsafe { rdma_mummy_sys::ibv_query_device_ex(context.context().as_ptr(), std::ptr::null(), attr.as_mut_ptr()) };
    if rc != 0 {
        return false;
    }
    // SAFETY: zero-initialised, then filled in by a successful query; every field is plain data.
    let flags = unsafe { attr.assume_init() }.device_cap_flags_ex;
    flags & FLUSH_GLOBAL != 0 && flags & FLUSH_PERSISTENT != 0
}

fn open_one(dev: &sideway::ibverbs::device::Device<'_>) -> Result<OpenDevice> {
    let name = dev.name();
    let context = dev
        .open()
        .map_err(|e| unsupported(format_args!("opening {name}: {e}")))?;
    let attr = context
        .query_device()
        .map_err(|e| unsupported(format_args!("querying {name}: {e}")))?;
    let gids = context
        .query_gid_table()
        .map_err(|e| unsupported(format_args!("reading {name}'s GID table: {e}")))?;
    for port in 1..=attr.phys_port_cnt() {
        let Ok(p) = context.query_port(port) else { continue };
        if p.port_state() != PortState::Active {
            continue;
        }
        let on_port: Vec<_> = gids.iter().filter(|g| g.port_num() == port as u32).collect();
        let is_v4 = |g: &Ipv6Addr| g.to_ipv4_mapped().is_some();
        let chosen = on_port
            .iter()
            .find(|g| g.gid_type() == GidType::RoceV2 && is_v4(&Ipv6Addr::from(g.gid())))
            .or_else(|| on_port.iter().find(|g| g.gid_type() == GidType::RoceV2))
            .or_else(|| on_port.iter().find(|g| !g.gid().is_zero()));
        let Some(g) = chosen else { continue };
        let gid_index = u8::try_from(g.gid_index()).map_err(|_| unsupported("GID index above 255"))?;
        return Ok(OpenDevice {
            name,
            port,
            gid_index,
            gid: Ipv6Addr::from(g.gid()),
            roce_v2: g.gid_type() == GidType::RoceV2,
            lid: p.lid(),
            mtu: p.active_mtu() as u8,
            max_msg: u64::from(p.attr.max_msg_sz),
            max_sge: u32::try_from(attr.max_sge()).unwrap_or(1).max(1),
            max_qp_wr: u32::try_from(attr.max_qp_wr()).unwrap_or(64).max(16),
            flush_capable: reports_flush_persistent(&context),
            context,
        });
    }
    Err(unsupported(format_args!("{name} has no active port with a usable GID")))
}
