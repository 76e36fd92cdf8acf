//! Which rails are near a region's memory.
//!
//! On a node with several NICs, each NIC hangs off one NUMA node's PCIe root. Its DMA to memory of
//! another node crosses the link between the sockets, which costs bandwidth and adds latency to every
//! access, and that link is shared by everything else the node does. So a region's slices go to the
//! rails on the region's own NUMA node (its *preferred* rails); the others are *fallback* rails, used
//! for it only while no preferred rail can carry the work (resting after a failure, or without a key
//! for the region). Where no rail is on the region's node, the nearest rails by the kernel's distance
//! table are preferred; where nothing is known (a host without NUMA, a device with no node), every
//! rail is.
//!
//! - **A rail's node**: an override ([`RdmaOptions::numa_nodes`](crate::RdmaOptions::numa_nodes),
//!   `FERRY_RDMA_NUMA=rxe0=0,rxe1=1`, `any` for "no node"); else the PCI device's
//!   `/sys/class/infiniband/DEV/device/numa_node`; else, for a software device (Soft-RoCE, siW: no PCI
//!   device of its own), the node of the network device it runs over (`/sys/class/infiniband/DEV/parent`,
//!   then `/sys/class/net/NETDEV/device/numa_node`). The kernel writes -1 for "no node".
//! - **A region's node**: the node of its first page, asked of the kernel (`get_mempolicy` with
//!   `MPOL_F_NODE | MPOL_F_ADDR`) after the first registration pinned it. A region spread over
//!   several nodes (interleaved) is placed by its first page.
//!
//! **Device memory** (a GPU's, which the block names by its PCI address: see
//! [`MemoryBlock::pci_device`](ferry_core::MemoryBlock::pci_device)) is ranked by the PCIe fabric
//! instead, because the NIC's DMA goes to the device, not to a socket's memory. Linux lays sysfs out as
//! the fabric's tree: `/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/…/0000:3b:00.0` is a function
//! below the bridges it hangs from, under host bridge `pci0000:00`. The rails preferred for a device are
//! those whose own function (a software device's: its network device's) shares the deepest bridge with
//! it: below one PCIe switch, peer-to-peer traffic never reaches the CPU; below only the same host
//! bridge, it crosses the root complex. Where no rail shares even the host bridge, the device's NUMA
//! node (`/sys/bus/pci/devices/ADDR/numa_node`) ranks the rails as for host memory. An override names
//! the rails for a device outright ([`RdmaOptions::device_rails`](crate::RdmaOptions::device_rails),
//! `FERRY_RDMA_DEVICE_RAILS=0000:3b:00.0=mlx5_0+mlx5_1`).
//!
//! The ranking is local: it places this engine's end of each rail. `ferry info --json` reports each
//! rail's node and PCI address, where the node came from, which nodes' memory and which of the host's
//! GPUs (PCI display controllers and accelerators) prefer it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use ferry_core::{PciAddress, RailPlace, RegionKey};

/// Where a rail's NUMA node came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeSource {
    /// The options (or `FERRY_RDMA_NUMA`) said so.
    Override,
    /// The device's PCI function in sysfs.
    Device,
    /// The network device a software RDMA device runs over.
    NetworkDevice,
    /// Nothing says (no PCI device, or the kernel reports -1).
    Unknown,
}

impl NodeSource {
    /// "override", "device", "network device" or "unknown".
    pub fn name(self) -> &'static str {
        match self {
            NodeSource::Override => "override",
            NodeSource::Device => "device",
            NodeSource::NetworkDevice => "network device",
            NodeSource::Unknown => "unknown",
        }
    }
}

/// The `KEY=VALUE` entries of a comma-separated override (blank entries skipped), each with its text
/// for messages; an entry without `=` is an error saying the `expected` form.
fn entries<'a>(text: &'a str, expected: &'a str) -> impl Iterator<Item = Result<(&'a str, &'a str, &'a str), String>> {
    text.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(move |entry| {
            let (key, value) = entry
                .split_once('=')
                .ok_or_else(|| format!("`{entry}`: expected {expected}"))?;
            Ok((entry, key.trim(), value.trim()))
        })
}

/// Parses `FERRY_RDMA_NUMA`'s form: `DEV=NODE` pairs separated by commas, `NODE` a number or `any`.
pub fn parse_overrides(text: &str) -> Result<Vec<(String, Option<u32>)>, String> {
    entries(text, "DEVICE=NODE (a NUMA node number, or `any`)")
        .map(|entry| {
            let (entry, device, node) = entry?;
            let node = match node {
                "any" => None,
                n => Some(
                    n.parse::<u32>()
                        .map_err(|_| format!("`{entry}`: NUMA node `{n}` is not a number (or `any`)"))?,
                ),
            };
            Ok((device.to_string(), node))
        })
        .collect()
}

/// Reads a sysfs `numa_node` file: `None` when it is missing or says -1.
fn read_node(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path)
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()?
        .try_into()
        .ok()
}

/// The node of RDMA device `device` as sysfs under `root` tells it (`root` is `/sys` but in tests).
pub(crate) fn sysfs_node(root: &Path, device: &str) -> (Option<u32>, NodeSource) {
    let ib = root.join("class/infiniband").join(device);
    if let Some(node) = read_node(&ib.join("device/numa_node")) {
        return (Some(node), NodeSource::Device);
    }
    let parent = std::fs::read_to_string(ib.join("parent")).ok();
    let netdev_node = parent
        .as_deref()
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.contains('/'))
        .and_then(|p| read_node(&root.join("class/net").join(p).join("device/numa_node")));
    match netdev_node {
        Some(node) => (Some(node), NodeSource::NetworkDevice),
        None => (None, NodeSource::Unknown),
    }
}

/// Parses `FERRY_RDMA_DEVICE_RAILS`'s form: `ADDR=DEV+DEV` entries separated by commas, `ADDR` a PCI
/// address (`0000:3b:00.0`) and each `DEV` an RDMA device.
pub fn parse_device_rails(text: &str) -> Result<Vec<(PciAddress, Vec<String>)>, String> {
    entries(text, "PCI_ADDRESS=DEVICE+DEVICE (0000:3b:00.0=mlx5_0+mlx5_1)")
        .map(|entry| {
            let (entry, address, devices) = entry?;
            let address = address.parse::<PciAddress>()?;
            let devices: Vec<String> = devices
                .split('+')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .map(String::from)
                .collect();
            if devices.is_empty() {
                return Err(format!("`{entry}`: names no RDMA device"));
            }
            Ok((address, devices))
        })
        .collect()
}

/// A PCI function's place on the fabric: its sysfs path below `devices/`, one component per level
/// (`pci0000:00`, `0000:00:01.0`, …, the function itself).
pub type PciPath = Vec<String>;

/// The fabric path of the PCI function that sysfs link `link` points to; `None` for what is not on a
/// PCI bus (a virtual device) or not there.
fn pci_path(root: &Path, link: &Path) -> Option<PciPath> {
    let real = std::fs::canonicalize(link).ok()?;
    let devices = std::fs::canonicalize(root.join("devices")).ok()?;
    let parts: PciPath = real
        .strip_prefix(&devices)
        .ok()?
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    (parts.len() >= 2 && parts[0].starts_with("pci")).then_some(parts)
}

/// The fabric path of RDMA device `device`: its PCI function's, else (a software device) its network
/// device's.
fn rail_pci_path(root: &Path, device: &str) -> Option<PciPath> {
    let ib = root.join("class/infiniband").join(device);
    pci_path(root, &ib.join("device")).or_else(|| {
        let parent = std::fs::read_to_string(ib.join("parent")).ok()?;
        let parent = parent.trim();
        if parent.is_empty() || parent.contains('/') {
            return None;
        }
        pci_path(root, &root.join("class/net").join(parent).join("device"))
    })
}

/// How many levels of the fabric two functions share: 0 under different host bridges, 1 under the
/// same host bridge only (traffic crosses the root complex), more below a common PCIe bridge.
pub fn shared_levels(a: &[String], b: &[String]) -> usize {
    // The last component is the function itself, never a bridge the other hangs from.
    let bridges = |p: &[String]| p.len().saturating_sub(1);
    a.iter()
        .zip(b)
        .take(bridges(a).min(bridges(b)))
        .take_while(|(x, y)| x == y)
        .count()
}

/// The rails preferred for a device at `device` on the fabric, as a bit mask: those sharing the most
/// levels with it; 0 when none shares even its host bridge (or no rail's place is known).
pub fn preferred_by_fabric(rails: &[Option<PciPath>], device: &[String]) -> u64 {
    let levels: Vec<usize> = rails
        .iter()
        .map(|r| r.as_deref().map_or(0, |r| shared_levels(r, device)))
        .collect();
    let best = levels.iter().copied().max().unwrap_or(0);
    if best == 0 {
        return 0;
    }
    mask_of(levels.iter().map(|&l| l == best))
}

/// A rail mask with bit `i` set where the `i`th flag is (rails past the 64th are never set).
fn mask_of(flags: impl Iterator<Item = bool>) -> u64 {
    flags
        .take(64)
        .enumerate()
        .filter(|&(_, set)| set)
        .fold(0, |mask, (i, _)| mask | 1 << i)
}

/// The host's GPUs and accelerators as sysfs lists them: PCI class 0x03 (display controllers) and
/// 0x12 (processing accelerators).
fn host_devices(root: &Path) -> Vec<PciAddress> {
    let Ok(entries) = std::fs::read_dir(root.join("bus/pci/devices")) else {
        return Vec::new();
    };
    let mut found: Vec<PciAddress> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            std::fs::read_to_string(e.path().join("class"))
                .is_ok_and(|c| c.trim().starts_with("0x03") || c.trim().starts_with("0x12"))
        })
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    found.sort();
    found
}

/// The distances from node `from` to every node, as the kernel's table gives them (index = node).
fn sysfs_distances(root: &Path, from: u32) -> Option<Vec<u32>> {
    let text = std::fs::read_to_string(root.join(format!("devices/system/node/node{from}/distance"))).ok()?;
    text.split_whitespace().map(|d| d.parse().ok()).collect()
}

/// The NUMA nodes the host has online (`0-1`, `0,2-3`); just node 0 where sysfs says nothing.
fn online_nodes(root: &Path) -> Vec<u32> {
    let Ok(text) = std::fs::read_to_string(root.join("devices/system/node/online")) else {
        return vec![0];
    };
    let mut nodes = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
            nodes.extend(a..=b.min(a.saturating_add(1023)));
        }
    }
    if nodes.is_empty() { vec![0] } else { nodes }
}

/// The rails preferred for memory on `memory`, as a bit mask over `rails` (bit `i` for rail `i`).
///
/// Rails on `memory` itself; else those nearest to it by `distance` (`distance(memory)[node]`, `None`
/// where the table is unknown); a rail with no node counts as farther than any rail with one. Every
/// rail when `memory` is unknown or no rail's node is known.
pub fn preferred(rails: &[Option<u32>], memory: Option<u32>, distance: impl Fn(u32) -> Option<Vec<u32>>) -> u64 {
    let all = if rails.len() >= 64 {
        u64::MAX
    } else {
        (1u64 << rails.len()) - 1
    };
    let Some(memory) = memory else { return all };
    if rails.iter().all(Option::is_none) {
        return all;
    }
    let table = distance(memory);
    let cost = |node: Option<u32>| -> u64 {
        match node {
            None => u64::MAX,
            Some(n) if n == memory => 0,
            Some(n) => table
                .as_ref()
                .and_then(|t| t.get(n as usize))
                .map_or(u64::MAX - 1, |&d| u64::from(d).max(1)),
        }
    };
    let best = rails.iter().map(|&n| cost(n)).min().unwrap_or(u64::MAX);
    mask_of(rails.iter().map(|&n| cost(n) == best))
}

/// The node of the page at `addr`, as the kernel placed it; `None` where the kernel has no NUMA or
/// the address is not mapped.
pub(crate) fn memory_node(addr: *const u8) -> Option<u32> {
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy writes one int through the first pointer (valid, on this stack); a null
    // node mask with max node 0 asks for no mask; with MPOL_F_ADDR it only looks up `addr`, which it
    // reads as a number (an unmapped address is an EFAULT, not an access).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    (rc == 0).then_some(node).and_then(|n| u32::try_from(n).ok())
}

/// This engine's rails, where each sits, and each registered region's preferred rails.
pub(crate) struct Topology {
    root: PathBuf,
    names: Vec<String>,
    nodes: Vec<(Option<u32>, NodeSource)>,
    fabric: Vec<Option<PciPath>>,
    /// Devices whose rails an override names, with those rails as a mask (never 0).
    device_rails: Vec<(PciAddress, u64)>,
    regions: RwLock<HashMap<RegionKey, u64>>,
}

/// What places the rails besides sysfs: node overrides, and rails named for devices.
#[derive(Debug, Clone, Default)]
pub(crate) struct Overrides {
    pub nodes: Vec<(String, Option<u32>)>,
    pub device_rails: Vec<(PciAddress, Vec<String>)>,
}

impl Topology {
    /// Places `devices` (in rail order) by `overrides`, else by sysfs.
    pub(crate) fn new(devices: &[String], overrides: &Overrides) -> Self {
        Topology::with_root(PathBuf::from("/sys"), devices, overrides)
    }

    fn with_root(root: PathBuf, devices: &[String], overrides: &Overrides) -> Self {
        let nodes = devices
            .iter()
            .map(|d| match overrides.nodes.iter().find(|(name, _)| name == d) {
                Some(&(_, node)) => (node, NodeSource::Override),
                None => sysfs_node(&root, d),
            })
            .collect();
        let fabric = devices.iter().map(|d| rail_pci_path(&root, d)).collect();
        let device_rails = overrides
            .device_rails
            .iter()
            .filter_map(|(address, names)| {
                let mask = mask_of(devices.iter().map(|d| names.contains(d)));
                if mask == 0 {
                    tracing::warn!(device = %address, rails = ?names, "no rail of this engine is named for the device; ranking it by the fabric");
                }
                (mask != 0).then_some((*address, mask))
            })
            .collect();
        Topology {
            root,
            names: devices.to_vec(),
            nodes,
            fabric,
            device_rails,
            regions: RwLock::new(HashMap::new()),
        }
    }

    /// The rails preferred for the memory of PCI device `device`: an override's; else the nearest on
    /// the fabric; else those of the device's NUMA node; else every rail.
    fn preferred_for_device(&self, device: PciAddress) -> u64 {
        if let Some(&(_, mask)) = self.device_rails.iter().find(|(a, _)| *a == device) {
            return mask;
        }
        let sysfs = self.root.join("bus/pci/devices").join(device.to_string());
        if let Some(path) = pci_path(&self.root, &sysfs) {
            let mask = preferred_by_fabric(&self.fabric, &path);
            if mask != 0 {
                return mask;
            }
        }
        self.preferred_for(read_node(&sysfs.join("numa_node")))
    }

    fn rail_nodes(&self) -> Vec<Option<u32>> {
        self.nodes.iter().map(|&(n, _)| n).collect()
    }

    fn preferred_for(&self, memory: Option<u32>) -> u64 {
        preferred(&self.rail_nodes(), memory, |m| sysfs_distances(&self.root, m))
    }

    /// Places a region whose first byte is at `addr` (already registered, so its first page is in
    /// memory) and whose memory is PCI device `device`'s, if any; returns the rails it prefers.
    pub(crate) fn place(&self, key: RegionKey, addr: *const u8, device: Option<PciAddress>) -> u64 {
        let mask = match device {
            Some(device) => {
                let mask = self.preferred_for_device(device);
                tracing::debug!(region = ?key, %device, preferred = format_args!("{mask:#b}"), "region placed");
                mask
            }
            None => {
                let node = memory_node(addr);
                let mask = self.preferred_for(node);
                tracing::debug!(region = ?key, ?node, preferred = format_args!("{mask:#b}"), "region placed");
                mask
            }
        };
        if let Ok(mut regions) = self.regions.write() {
            regions.insert(key, mask);
        }
        mask
    }

    /// Forgets a deregistered region.
    pub(crate) fn forget(&self, key: RegionKey) {
        if let Ok(mut regions) = self.regions.write() {
            regions.remove(&key);
        }
    }

    /// The local rails `key`'s memory prefers (every rail for a region this transport did not place).
    pub(crate) fn preferred_rails(&self, key: RegionKey) -> u64 {
        self.regions
            .read()
            .ok()
            .and_then(|r| r.get(&key).copied())
            .unwrap_or(u64::MAX)
    }

    /// Each rail's place and the nodes whose memory prefers it, for reports.
    pub(crate) fn report(&self) -> Vec<RailPlace> {
        let online = online_nodes(&self.root);
        let masks: Vec<(u32, u64)> = online.iter().map(|&n| (n, self.preferred_for(Some(n)))).collect();
        let mut devices = host_devices(&self.root);
        devices.extend(self.device_rails.iter().map(|&(a, _)| a));
        devices.sort();
        devices.dedup();
        let device_masks: Vec<(PciAddress, u64)> = devices.iter().map(|&d| (d, self.preferred_for_device(d))).collect();
        self.names
            .iter()
            .zip(&self.nodes)
            .zip(&self.fabric)
            .enumerate()
            .map(|(i, ((name, &(node, source)), fabric))| RailPlace {
                device: name.clone(),
                numa_node: node,
                source: source.name(),
                preferred_for: masks
                    .iter()
                    .filter(|&&(_, mask)| mask & (1 << i) != 0)
                    .map(|&(n, _)| n)
                    .collect(),
                pci_address: fabric.as_ref().and_then(|p| p.last()?.parse().ok()),
                preferred_for_devices: device_masks
                    .iter()
                    .filter(|&&(_, mask)| mask & (1 << i) != 0)
                    .map(|&(d, _)| d)
                    .collect(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn two_sockets(from: u32) -> Option<Vec<u32>> {
        match from {
            0 => Some(vec![10, 21]),
            1 => Some(vec![21, 10]),
            _ => None,
        }
    }

    #[test]
    fn rails_on_the_memorys_node_are_preferred() {
        let rails = [Some(0), Some(1), Some(0), Some(1)];
        assert_eq!(preferred(&rails, Some(0), two_sockets), 0b0101);
        assert_eq!(preferred(&rails, Some(1), two_sockets), 0b1010);
    }

    #[test]
    fn without_a_rail_on_the_node_the_nearest_are_preferred() {
        // Four nodes; memory on node 3, rails on 0, 1 and 2, node 2 nearest.
        let table = |_| Some(vec![30, 20, 12, 10]);
        assert_eq!(preferred(&[Some(0), Some(1), Some(2)], Some(3), table), 0b100);
        // A rail with no node counts as farthest.
        assert_eq!(preferred(&[None, Some(1)], Some(0), two_sockets), 0b10);
    }

    #[test]
    fn knowing_nothing_prefers_every_rail() {
        assert_eq!(preferred(&[Some(0), Some(1)], None, two_sockets), 0b11);
        assert_eq!(preferred(&[None, None, None], Some(1), two_sockets), 0b111);
        assert_eq!(preferred(&[], Some(0), two_sockets), 0);
    }

    #[test]
    fn overrides_parse_and_refuse_what_is_not_a_node() {
        assert_eq!(
            parse_overrides("rxe0=0, rxe1 = any,,mlx5_2=3").unwrap(),
            vec![
                ("rxe0".to_string(), Some(0)),
                ("rxe1".to_string(), None),
                ("mlx5_2".to_string(), Some(3))
            ]
        );
        assert!(parse_overrides("rxe0").unwrap_err().contains("DEVICE=NODE"));
        assert!(parse_overrides("rxe0=-1").unwrap_err().contains("not a number"));
        assert_eq!(parse_overrides("").unwrap(), vec![]);
    }

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn sysfs_places_pci_and_software_devices_and_reports_the_ranking() {
        let root = std::env::temp_dir().join(format!("ferry-topology-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        write(&root.join("class/infiniband/mlx5_0/device/numa_node"), "1\n");
        write(&root.join("class/infiniband/mlx5_1/device/numa_node"), "-1\n");
        write(&root.join("class/infiniband/rxe0/parent"), "eth0\n");
        write(&root.join("class/net/eth0/device/numa_node"), "0\n");
        write(&root.join("devices/system/node/online"), "0-1\n");
        write(&root.join("devices/system/node/node0/distance"), "10 21\n");
        write(&root.join("devices/system/node/node1/distance"), "21 10\n");
        let devices: Vec<String> = ["mlx5_0", "mlx5_1", "rxe0", "gone0"].map(String::from).into();
        let overrides = Overrides {
            nodes: vec![("gone0".into(), Some(1))],
            device_rails: Vec::new(),
        };
        let topology = Topology::with_root(root.clone(), &devices, &overrides);
        let report = topology.report();
        let places: Vec<_> = report
            .iter()
            .map(|r| (r.device.as_str(), r.numa_node, r.source, r.preferred_for.clone()))
            .collect();
        assert_eq!(
            places,
            vec![
                ("mlx5_0", Some(1), "device", vec![1]),
                ("mlx5_1", None, "unknown", vec![]),
                ("rxe0", Some(0), "network device", vec![0]),
                ("gone0", Some(1), "override", vec![1]),
            ]
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A fake sysfs with two host bridges: GPU 03:00.0 below the same PCIe switch as NIC 04:00.0 (and
    /// 04:00.1, the network device of a Soft-RoCE rail), NIC 05:00.0 under the first host bridge only,
    /// NIC 81:00.0 and GPU 82:00.0 under the second, accelerator c1:00.0 under a third with no NIC.
    fn fabric(root: &Path) {
        let pci = |path: &str, class: &str, node: &str| {
            let dir = root.join("devices").join(path);
            write(&dir.join("class"), class);
            write(&dir.join("numa_node"), node);
            let address = path.rsplit('/').next().unwrap();
            let link = root.join("bus/pci/devices").join(address);
            std::fs::create_dir_all(link.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(&dir, &link).unwrap();
            dir
        };
        let switch = "pci0000:00/0000:00:01.0/0000:01:00.0";
        pci(&format!("{switch}/0000:02:00.0/0000:03:00.0"), "0x030200\n", "0\n");
        let nic0 = pci(&format!("{switch}/0000:02:01.0/0000:04:00.0"), "0x020000\n", "0\n");
        let nic0_port1 = pci(&format!("{switch}/0000:02:01.0/0000:04:00.1"), "0x020000\n", "0\n");
        let nic1 = pci("pci0000:00/0000:00:02.0/0000:05:00.0", "0x020700\n", "0\n");
        let nic2 = pci("pci0000:80/0000:80:01.0/0000:81:00.0", "0x020700\n", "1\n");
        pci("pci0000:80/0000:80:02.0/0000:82:00.0", "0x030000\n", "1\n");
        pci("pci0000:c0/0000:c0:01.0/0000:c1:00.0", "0x120000\n", "0\n");
        for (dev, dir) in [("mlx5_0", &nic0), ("mlx5_1", &nic1), ("mlx5_2", &nic2)] {
            let ib = root.join("class/infiniband").join(dev);
            std::fs::create_dir_all(&ib).unwrap();
            std::os::unix::fs::symlink(dir, ib.join("device")).unwrap();
        }
        write(&root.join("class/infiniband/rxe0/parent"), "eth1\n");
        std::fs::create_dir_all(root.join("class/net/eth1")).unwrap();
        std::os::unix::fs::symlink(&nic0_port1, root.join("class/net/eth1/device")).unwrap();
        write(&root.join("devices/system/node/online"), "0-1\n");
        write(&root.join("devices/system/node/node0/distance"), "10 21\n");
        write(&root.join("devices/system/node/node1/distance"), "21 10\n");
    }

    fn address(text: &str) -> PciAddress {
        text.parse().unwrap()
    }

    #[test]
    fn device_memory_prefers_the_rails_nearest_on_the_fabric() {
        let root = std::env::temp_dir().join(format!("ferry-fabric-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        fabric(&root);
        let devices: Vec<String> = ["mlx5_0", "mlx5_1", "mlx5_2", "rxe0"].map(String::from).into();
        let topology = Topology::with_root(root.clone(), &devices, &Overrides::default());
        // Below one switch (the NIC, and the Soft-RoCE device over the same NIC's second port).
        assert_eq!(topology.preferred_for_device(address("0000:03:00.0")), 0b1001);
        // Sharing only the host bridge beats being elsewhere.
        assert_eq!(topology.preferred_for_device(address("0000:82:00.0")), 0b0100);
        // No rail under its host bridge: its NUMA node's rails (0), as for host memory.
        assert_eq!(topology.preferred_for_device(address("0000:c1:00.0")), 0b1011);
        // A device sysfs does not know: every rail.
        assert_eq!(topology.preferred_for_device(address("0000:ff:00.0")), 0b1111);

        // Regions of device memory are placed by their device, and forgotten.
        let key = RegionKey(7);
        assert_eq!(
            topology.place(key, std::ptr::null(), Some(address("0000:82:00.0"))),
            0b0100
        );
        assert_eq!(topology.preferred_rails(key), 0b0100);
        topology.forget(key);
        assert_eq!(topology.preferred_rails(key), u64::MAX);

        let report = topology.report();
        let places: Vec<_> = report
            .iter()
            .map(|r| {
                let gpus: Vec<String> = r.preferred_for_devices.iter().map(|a| a.to_string()).collect();
                (
                    r.device.as_str(),
                    r.pci_address.map(|a| a.to_string()),
                    r.numa_node,
                    gpus,
                )
            })
            .collect();
        let s = |v: &[&str]| v.iter().map(|t| t.to_string()).collect::<Vec<_>>();
        assert_eq!(
            places,
            vec![
                (
                    "mlx5_0",
                    Some("0000:04:00.0".into()),
                    Some(0),
                    s(&["0000:03:00.0", "0000:c1:00.0"])
                ),
                ("mlx5_1", Some("0000:05:00.0".into()), Some(0), s(&["0000:c1:00.0"])),
                ("mlx5_2", Some("0000:81:00.0".into()), Some(1), s(&["0000:82:00.0"])),
                (
                    "rxe0",
                    Some("0000:04:00.1".into()),
                    Some(0),
                    s(&["0000:03:00.0", "0000:c1:00.0"])
                ),
            ]
        );

        // An override names the rails outright; one naming no rail of this engine is ignored.
        let overrides = Overrides {
            nodes: Vec::new(),
            device_rails: vec![
                (address("0000:c1:00.0"), vec!["mlx5_2".into()]),
                (address("0000:03:00.0"), vec!["mlx5_9".into()]),
            ],
        };
        let topology = Topology::with_root(root.clone(), &devices, &overrides);
        assert_eq!(topology.preferred_for_device(address("0000:c1:00.0")), 0b0100);
        assert_eq!(topology.preferred_for_device(address("0000:03:00.0")), 0b1001);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn device_rails_parse_and_refuse_what_is_not_an_address_or_a_device() {
        assert_eq!(
            parse_device_rails("0000:3b:00.0=mlx5_0+mlx5_1, 86:00.0 = mlx5_2,").unwrap(),
            vec![
                (
                    address("0000:3b:00.0"),
                    vec!["mlx5_0".to_string(), "mlx5_1".to_string()]
                ),
                (address("0000:86:00.0"), vec!["mlx5_2".to_string()]),
            ]
        );
        assert!(parse_device_rails("mlx5_0").unwrap_err().contains("PCI_ADDRESS=DEVICE"));
        assert!(
            parse_device_rails("gpu0=mlx5_0")
                .unwrap_err()
                .contains("not a PCI address")
        );
        assert!(
            parse_device_rails("0000:3b:00.0=+")
                .unwrap_err()
                .contains("names no RDMA device")
        );
    }

    #[test]
    fn this_processs_memory_has_a_node_where_the_kernel_has_numa() {
        let page = vec![1u8; 4096];
        let node = memory_node(page.as_ptr());
        if std::path::Path::new("/sys/devices/system/node/node0").exists() {
            assert!(node.is_some(), "a touched page has a node on a NUMA kernel");
        }
        assert_eq!(memory_node(std::ptr::null()), None, "address 0 is not mapped");
    }

    fn path(parts: &[&str]) -> PciPath {
        parts.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn shared_levels_count_bridges_not_the_functions_themselves() {
        let gpu = path(&[
            "pci0000:00",
            "0000:00:01.0",
            "0000:01:00.0",
            "0000:02:00.0",
            "0000:03:00.0",
        ]);
        let same_switch = path(&[
            "pci0000:00",
            "0000:00:01.0",
            "0000:01:00.0",
            "0000:02:01.0",
            "0000:04:00.0",
        ]);
        let same_root = path(&["pci0000:00", "0000:00:02.0", "0000:05:00.0"]);
        let elsewhere = path(&["pci0000:80", "0000:80:01.0", "0000:81:00.0"]);
        assert_eq!(shared_levels(&gpu, &same_switch), 3);
        assert_eq!(shared_levels(&gpu, &same_root), 1);
        assert_eq!(shared_levels(&gpu, &elsewhere), 0);
        // A root-complex function shares only the host bridge with anything, itself included.
        let integrated = path(&["pci0000:00", "0000:00:02.0"]);
        assert_eq!(shared_levels(&integrated, &integrated), 1);
        assert_eq!(
            preferred_by_fabric(&[None, Some(same_root.clone()), Some(same_switch)], &gpu),
            0b100
        );
        assert_eq!(preferred_by_fabric(&[Some(elsewhere), None], &gpu), 0);
    }

    proptest! {
        /// The fabric's choice is never empty when a rail shares the host bridge, and every chosen rail
        /// shares at least as many levels as every other.
        #[test]
        fn fabric_preference_is_the_deepest_shared_bridge(
            rails in proptest::collection::vec(proptest::option::of(proptest::collection::vec(0u8..3, 1..5)), 1..8),
            device in proptest::collection::vec(0u8..3, 1..5),
        ) {
            let as_path = |v: &Vec<u8>| -> PciPath { v.iter().map(|b| format!("b{b}")).collect() };
            let rails: Vec<Option<PciPath>> = rails.iter().map(|r| r.as_ref().map(as_path)).collect();
            let device = as_path(&device);
            let levels: Vec<usize> = rails.iter().map(|r| r.as_deref().map_or(0, |r| shared_levels(r, &device))).collect();
            let mask = preferred_by_fabric(&rails, &device);
            prop_assert_eq!(mask == 0, levels.iter().all(|&l| l == 0));
            for (i, &l) in levels.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    prop_assert!(levels.iter().all(|&other| other <= l));
                }
            }
        }

        /// The preferred rails are never empty when there are rails, each is at least as near as every
        /// other rail, and a rail on the memory's own node is always among them.
        #[test]
        fn preferred_rails_are_the_nearest(
            rails in proptest::collection::vec(proptest::option::of(0u32..4), 1..8),
            memory in proptest::option::of(0u32..4),
        ) {
            let table = |from: u32| Some((0..4u32).map(|to| if to == from { 10 } else { 10 + 5 * from.abs_diff(to) }).collect());
            let mask = preferred(&rails, memory, table);
            prop_assert!(mask != 0);
            prop_assert_eq!(mask >> rails.len(), 0);
            if let Some(m) = memory.filter(|m| rails.contains(&Some(*m))) {
                for (i, r) in rails.iter().enumerate() {
                    prop_assert_eq!(mask & (1 << i) != 0, *r == Some(m));
                }
            }
        }
    }
}
