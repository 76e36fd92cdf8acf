//! What this build can do on this host (HIXL `GetCapability`), callable before any engine exists.

use std::sync::Arc;

use ferry_core::{Availability, Transport, TransportKind};
use serde::Serialize;

/// The answer of [`capabilities`].
#[derive(Debug, Clone, Serialize)]
pub struct Capabilities {
    /// ferry's version.
    pub version: &'static str,
    /// The wire protocol version.
    pub protocol_version: u8,
    /// Every transport ferry knows, compiled in or not, usable here or not, and why.
    pub transports: Vec<TransportInfo>,
    /// RDMA devices found (empty without the `rdma` feature).
    pub rdma_devices: Vec<String>,
    /// The RDMA rails an engine would open here, where each sits and which NUMA nodes' memory
    /// prefers it (the others use it as a fallback).
    pub rdma_rails: Vec<RdmaRail>,
    /// Vulkan devices found, with their memory types and allocation paths.
    #[cfg(feature = "vulkan")]
    pub vulkan_devices: Vec<ferry_vulkan::VulkanDeviceInfo>,
    /// Vulkan devices found (always empty: this build has no `vulkan` feature).
    #[cfg(not(feature = "vulkan"))]
    pub vulkan_devices: Vec<String>,
    /// The CUDA driver and its devices, or why there are none.
    pub cuda: CudaReport,
}

/// What [`Capabilities::cuda`] found.
#[derive(Debug, Clone, Serialize)]
pub struct CudaReport {
    /// The driver's version ("12.8"), where one loaded.
    pub driver_version: Option<String>,
    /// The devices the driver sees, with what each offers.
    #[cfg(feature = "cuda")]
    pub devices: Vec<ferry_cuda::CudaDeviceInfo>,
    /// The devices (always empty: this build has no `cuda` feature).
    #[cfg(not(feature = "cuda"))]
    pub devices: Vec<String>,
    /// Why CUDA memory cannot be used here: no driver, a driver that would not initialise, or a
    /// build without the `cuda` feature. `None` where it can.
    pub unavailable: Option<String>,
    /// How each transport reaches CUDA memory in this build.
    pub paths: &'static str,
}

/// One transport's entry.
#[derive(Debug, Clone, Serialize)]
pub struct TransportInfo {
    /// "tcp", "rdma", "shm".
    pub name: &'static str,
    /// Whether this build contains it.
    pub compiled: bool,
    /// Whether it can be used on this host.
    pub usable: bool,
    /// Why not, or what it uses.
    pub detail: String,
}

/// One RDMA rail's place (see [`Capabilities::rdma_rails`]).
#[derive(Debug, Clone, Serialize)]
pub struct RdmaRail {
    /// Device name.
    pub device: String,
    /// Its NUMA node, where one is known.
    pub numa_node: Option<u32>,
    /// Where the node came from: "device" (its PCI function), "network device" (the link a
    /// software device runs over), "override" (`FERRY_RDMA_NUMA`) or "unknown".
    pub source: &'static str,
    /// The NUMA nodes whose memory prefers this rail.
    pub preferred_for: Vec<u32>,
    /// Its PCI function ("0000:3b:00.0"; a software device's is its network device's), where it has one.
    pub pci_address: Option<String>,
    /// The host's GPUs and accelerators (by PCI address) whose memory prefers this rail: the nearest
    /// on the PCIe fabric, or those `FERRY_RDMA_DEVICE_RAILS` names it for.
    pub preferred_for_devices: Vec<String>,
}

impl From<ferry_core::RailPlace> for RdmaRail {
    fn from(p: ferry_core::RailPlace) -> Self {
        RdmaRail {
            device: p.device,
            numa_node: p.numa_node,
            source: p.source,
            preferred_for: p.preferred_for,
            pci_address: p.pci_address.map(|a| a.to_string()),
            preferred_for_devices: p.preferred_for_devices.iter().map(ToString::to_string).collect(),
        }
    }
}

impl From<Availability> for TransportInfo {
    fn from(a: Availability) -> Self {
        TransportInfo {
            name: a.kind.name(),
            compiled: a.compiled,
            usable: a.usable,
            detail: a.detail,
        }
    }
}

impl Capabilities {
    /// Whether `kind` is compiled in and usable here.
    pub fn usable(&self, kind: TransportKind) -> bool {
        self.transports.iter().any(|t| t.name == kind.name() && t.usable)
    }
}

/// Options of the transports that have any (HIXL's RDMA traffic class and service level, say).
#[derive(Debug, Clone)]
pub struct TransportOptions {
    /// RDMA device name, alone; see `rdma_devices`.
    pub rdma_device: Option<String>,
    /// RDMA devices, one rail each; when empty (and `rdma_device` is `None`), those that
    /// `FERRY_RDMA_DEVICES` names (comma-separated), or else every device with an active port.
    pub rdma_devices: Vec<String>,
    /// NUMA nodes of RDMA devices, overriding sysfs (`None`: no node); when empty, those
    /// `FERRY_RDMA_NUMA` gives (`rxe0=0,rxe1=any`). See `ferry_rdma`'s `topology`.
    pub rdma_numa_nodes: Vec<(String, Option<u32>)>,
    /// The RDMA rails preferred for a PCI device's memory (a GPU's), overriding the PCIe-fabric
    /// ranking; when empty, those `FERRY_RDMA_DEVICE_RAILS` gives (`0000:3b:00.0=mlx5_0+mlx5_1`).
    pub rdma_device_rails: Vec<(ferry_core::PciAddress, Vec<String>)>,
    /// RDMA traffic class: 0..=255, a multiple of 4 (HIXL default 132).
    pub rdma_traffic_class: u8,
    /// RDMA service level: 0..=7 (HIXL default 4).
    pub rdma_service_level: u8,
    /// Busy-poll RDMA completions instead of waiting for the completion channel.
    pub rdma_busy_poll: bool,
    /// Bytes of the slices an RDMA batch is cut into and spread over the rails (at least 4 KiB);
    /// when `None`, `FERRY_RDMA_SLICE` (bytes, or with KiB/MiB), else 256 KiB.
    pub rdma_slice_bytes: Option<u64>,
    /// RDMA queue pairs per pair of rails (1..=8); when `None`, `FERRY_RDMA_QUEUE_PAIRS`, else 1.
    pub rdma_queue_pairs_per_rail: Option<u8>,
    /// Register large regions on every RDMA rail at once (a thread per rail); when `None`, as
    /// `FERRY_RDMA_PARALLEL_REGISTRATION` says (`0` or `1`), else at once.
    pub rdma_parallel_registration: Option<bool>,
    /// Make persistent RDMA writes persistent only this way (tests force the fallbacks with it); the
    /// best both ends support when `None`.
    pub rdma_persist_method: Option<ferry_core::PersistMethod>,
    /// Declare this host ADR with DDIO off, so that RDMA initiators may persist by a READ after their
    /// writes. Never assumed: a wrong declaration loses data on power loss.
    pub adr_without_ddio: bool,
}

impl Default for TransportOptions {
    fn default() -> Self {
        TransportOptions {
            rdma_device: None,
            rdma_devices: Vec::new(),
            rdma_numa_nodes: Vec::new(),
            rdma_device_rails: Vec::new(),
            rdma_traffic_class: 132,
            rdma_service_level: 4,
            rdma_busy_poll: false,
            rdma_slice_bytes: None,
            rdma_queue_pairs_per_rail: None,
            rdma_parallel_registration: None,
            rdma_persist_method: None,
            adr_without_ddio: false,
        }
    }
}

impl TransportOptions {
    /// Checks HIXL's ranges, whether or not the transport is compiled in.
    pub fn validate(&self) -> ferry_core::Result<()> {
        if !self.rdma_traffic_class.is_multiple_of(4) {
            return Err(ferry_core::Error::InvalidArgument(format!(
                "RDMA traffic class {} is not a multiple of 4 (0..=255)",
                self.rdma_traffic_class
            )));
        }
        if self.rdma_service_level > 7 {
            return Err(ferry_core::Error::InvalidArgument(format!(
                "RDMA service level {} is not in 0..=7",
                self.rdma_service_level
            )));
        }
        if self.rdma_persist_method == Some(ferry_core::PersistMethod::FlushBeforeAck) {
            return Err(ferry_core::Error::InvalidArgument(
                "RDMA writes bypass the target's CPU: flush-before-ack is TCP's method (use flush-verb, \
                 read-after-write or flush-request)"
                    .into(),
            ));
        }
        #[cfg(feature = "rdma")]
        self.numa_nodes()?;
        #[cfg(feature = "rdma")]
        self.device_rails()?;
        let slice = self.slice_bytes()?;
        if slice.is_some_and(|s| s < 4096) {
            return Err(ferry_core::Error::InvalidArgument(format!(
                "RDMA slices of {} bytes: at least 4096",
                slice.unwrap_or_default()
            )));
        }
        let qps = self.queue_pairs_per_rail()?;
        if !(1..=8).contains(&qps) {
            return Err(ferry_core::Error::InvalidArgument(format!(
                "{qps} RDMA queue pairs per pair of rails: 1 to 8"
            )));
        }
        Ok(())
    }

    /// The options' slice size, else `FERRY_RDMA_SLICE`'s; `None` for the transport's default.
    fn slice_bytes(&self) -> ferry_core::Result<Option<u64>> {
        if let Some(n) = self.rdma_slice_bytes {
            return Ok(Some(n));
        }
        match std::env::var("FERRY_RDMA_SLICE") {
            Ok(text) => parse_bytes(&text).map(Some).ok_or_else(|| {
                ferry_core::Error::InvalidArgument(format!(
                    "FERRY_RDMA_SLICE={text}: expected a size in bytes (262144, 256KiB, 1MiB), at least 4 KiB"
                ))
            }),
            Err(_) => Ok(None),
        }
    }

    /// The options' queue pairs per pair of rails, else `FERRY_RDMA_QUEUE_PAIRS`'s, else 1.
    fn queue_pairs_per_rail(&self) -> ferry_core::Result<u8> {
        if let Some(n) = self.rdma_queue_pairs_per_rail {
            return Ok(n);
        }
        match std::env::var("FERRY_RDMA_QUEUE_PAIRS") {
            Ok(text) => text.trim().parse().map_err(|_| {
                ferry_core::Error::InvalidArgument(format!(
                    "FERRY_RDMA_QUEUE_PAIRS={text}: expected a number of queue pairs per pair of rails, 1 to 8"
                ))
            }),
            Err(_) => Ok(1),
        }
    }

    /// The rails named for PCI devices: the options', else `FERRY_RDMA_DEVICE_RAILS`'s.
    #[cfg(feature = "rdma")]
    fn device_rails(&self) -> ferry_core::Result<Vec<(ferry_core::PciAddress, Vec<String>)>> {
        given_or_env(
            &self.rdma_device_rails,
            "FERRY_RDMA_DEVICE_RAILS",
            ferry_rdma::topology::parse_device_rails,
        )
    }

    /// The RDMA devices' NUMA overrides: the options', else `FERRY_RDMA_NUMA`'s.
    #[cfg(feature = "rdma")]
    fn numa_nodes(&self) -> ferry_core::Result<Vec<(String, Option<u32>)>> {
        given_or_env(
            &self.rdma_numa_nodes,
            "FERRY_RDMA_NUMA",
            ferry_rdma::topology::parse_overrides,
        )
    }
}

/// A size in bytes: a number, or a number of KiB, MiB or GiB ("256KiB").
fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let digits = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    number.parse::<u64>().ok()?.checked_mul(scale)
}

/// `given` when it holds anything, else environment variable `var` parsed by `parse` (nothing when
/// it is unset).
#[cfg(feature = "rdma")]
fn given_or_env<T: Clone>(
    given: &[T],
    var: &str,
    parse: impl Fn(&str) -> std::result::Result<Vec<T>, String>,
) -> ferry_core::Result<Vec<T>> {
    if !given.is_empty() {
        return Ok(given.to_vec());
    }
    match std::env::var(var) {
        Ok(text) => parse(&text).map_err(|e| ferry_core::Error::InvalidArgument(format!("{var}: {e}"))),
        Err(_) => Ok(Vec::new()),
    }
}

/// The transports compiled into this build, best first. `authenticates`: the engine authenticates its
/// links, so each peer gets only what it was granted, enforced by the NIC where there is one.
pub(crate) fn compiled_transports(options: &TransportOptions, authenticates: bool) -> Vec<Arc<dyn Transport>> {
    let mut v: Vec<Arc<dyn Transport>> = Vec::with_capacity(3);
    // Best first: on one host, nothing beats one copy.
    #[cfg(feature = "shm")]
    v.push(Arc::new(ferry_shm::ShmTransport::default()));
    #[cfg(feature = "rdma")]
    v.push(Arc::new(ferry_rdma::RdmaTransport::new(ferry_rdma::RdmaOptions {
        device: options.rdma_device.clone(),
        devices: match (&options.rdma_devices, &options.rdma_device) {
            (named, _) if !named.is_empty() => named.clone(),
            (_, Some(_)) => Vec::new(),
            _ => std::env::var("FERRY_RDMA_DEVICES")
                .map(|v| {
                    v.split(',')
                        .map(str::trim)
                        .filter(|d| !d.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
        },
        numa_nodes: options.numa_nodes().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "RDMA NUMA overrides ignored");
            Vec::new()
        }),
        device_rails: options.device_rails().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "RDMA device rails ignored");
            Vec::new()
        }),
        traffic_class: options.rdma_traffic_class,
        service_level: options.rdma_service_level,
        busy_poll: options.rdma_busy_poll,
        queue_pairs_per_rail: options.queue_pairs_per_rail().unwrap_or(1),
        slice_bytes: options
            .slice_bytes()
            .ok()
            .flatten()
            .unwrap_or(ferry_rdma::multirail::DEFAULT_SLICE),
        parallel_registration: options
            .rdma_parallel_registration
            .unwrap_or_else(|| std::env::var("FERRY_RDMA_PARALLEL_REGISTRATION").map_or(true, |v| v.trim() != "0")),
        persist_method: options.rdma_persist_method,
        adr_without_ddio: options.adr_without_ddio,
        per_peer_domains: authenticates,
        ..Default::default()
    })));
    #[cfg(not(feature = "rdma"))]
    let _ = (options, authenticates);
    if cfg!(feature = "tcp") {
        v.push(Arc::new(ferry_tcp::TcpTransport));
    }
    v
}

fn not_compiled(kind: TransportKind, why: &str) -> Availability {
    Availability {
        kind,
        compiled: false,
        usable: false,
        detail: why.to_string(),
        devices: Vec::new(),
        rails: Vec::new(),
    }
}

/// What this build can do on this host.
pub fn capabilities() -> Capabilities {
    let mut transports: Vec<Availability> = compiled_transports(&TransportOptions::default(), false)
        .iter()
        .map(|t| t.availability())
        .collect();
    for (kind, why) in [
        (TransportKind::Shm, "not in this build: enable the `shm` feature"),
        (TransportKind::Rdma, "not in this build: enable the `rdma` feature"),
        (TransportKind::Tcp, "not in this build: enable the `tcp` feature"),
    ] {
        if !transports.iter().any(|t| t.kind == kind) {
            transports.push(not_compiled(kind, why));
        }
    }
    transports.sort_by_key(|t| t.kind);
    let rdma_devices = transports
        .iter()
        .filter(|t| t.kind == TransportKind::Rdma)
        .flat_map(|t| t.devices.clone())
        .collect();
    let rdma_rails = transports
        .iter()
        .filter(|t| t.kind == TransportKind::Rdma)
        .flat_map(|t| t.rails.clone())
        .map(RdmaRail::from)
        .collect();
    Capabilities {
        version: env!("CARGO_PKG_VERSION"),
        protocol_version: ferry_core::codec::VERSION,
        transports: transports.into_iter().map(Into::into).collect(),
        rdma_devices,
        rdma_rails,
        vulkan_devices: vulkan_devices(),
        cuda: cuda_report(),
    }
}

/// How each transport reaches CUDA memory, best first.
#[cfg(feature = "cuda")]
const CUDA_PATHS: &str = "rdma: the NIC registers the device memory by its dma-buf, else through a peer-memory \
     module (nvidia_peermem), else not at all (over TCP); shm: whole allocations opened by the peer by CUDA IPC, and a \
     peer's lent host memory copied by the device; \
     otherwise staged: both ends of a TCP link copy between the GPU and their streams' own buffers, in pieces \
     overlapped with the network; other paths through the block's host copy (asynchronous copies on a stream of \
     the block's own)";

#[cfg(feature = "cuda")]
fn cuda_report() -> CudaReport {
    let driver_version = ferry_cuda::driver().ok().map(|d| d.version_string());
    match ferry_cuda::probe() {
        Ok(devices) => CudaReport {
            unavailable: devices
                .is_empty()
                .then(|| "the CUDA driver sees no device (CUDA_VISIBLE_DEVICES applies)".to_string()),
            driver_version,
            devices,
            paths: CUDA_PATHS,
        },
        Err(e) => CudaReport {
            driver_version,
            devices: Vec::new(),
            unavailable: Some(e.message().to_string()),
            paths: CUDA_PATHS,
        },
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_report() -> CudaReport {
    CudaReport {
        driver_version: None,
        devices: Vec::new(),
        unavailable: Some("this build has no `cuda` feature (build ferry with --features cuda)".into()),
        paths: "none",
    }
}

/// The Vulkan devices and what ferry can do with them; none (with the reason logged) without a loader
/// or driver.
#[cfg(feature = "vulkan")]
fn vulkan_devices() -> Vec<ferry_vulkan::VulkanDeviceInfo> {
    ferry_vulkan::probe().unwrap_or_else(|e| {
        tracing::info!(reason = %e, "no Vulkan devices");
        Vec::new()
    })
}

#[cfg(not(feature = "vulkan"))]
fn vulkan_devices() -> Vec<String> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_or_without_a_unit() {
        assert_eq!(parse_bytes("262144"), Some(262_144));
        assert_eq!(parse_bytes(" 256KiB "), Some(256 << 10));
        assert_eq!(parse_bytes("1MiB"), Some(1 << 20));
        assert_eq!(parse_bytes("1 MiB"), Some(1 << 20));
        for bad in ["", "KiB", "1MB", "-4096", "99999999999999999999GiB"] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn slices_under_4_kib_are_refused() {
        let options = TransportOptions {
            rdma_slice_bytes: Some(1024),
            ..TransportOptions::default()
        };
        let error = options.validate().unwrap_err();
        assert!(
            matches!(&error, ferry_core::Error::InvalidArgument(m) if m.contains("at least 4096")),
            "{error}"
        );
        let options = TransportOptions {
            rdma_slice_bytes: Some(64 << 10),
            ..TransportOptions::default()
        };
        assert!(options.validate().is_ok());
    }
}
