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
//! The ranking is local: it places this engine's end of each rail. `ferry info --json` reports each
//! rail's node, where it came from, and which nodes' memory it is preferred for.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use ferry_core::{RailPlace, RegionKey};

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

/// Parses `FERRY_RDMA_NUMA`'s form: `DEV=NODE` pairs separated by commas, `NODE` a number or `any`.
pub fn parse_overrides(text: &str) -> Result<Vec<(String, Option<u32>)>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (device, node) = pair
                .split_once('=')
                .ok_or_else(|| format!("`{pair}`: expected DEVICE=NODE (a NUMA node number, or `any`)"))?;
            let node = match node.trim() {
                "any" => None,
                n => Some(
                    n.parse::<u32>()
                        .map_err(|_| format!("`{pair}`: NUMA node `{n}` is not a number (or `any`)"))?,
                ),
            };
            Ok((device.trim().to_string(), node))
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
    rails
        .iter()
        .enumerate()
        .take(64)
        .filter(|&(_, &n)| cost(n) == best)
        .fold(0, |mask, (i, _)| mask | 1 << i)
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
    regions: RwLock<HashMap<RegionKey, u64>>,
}

impl Topology {
    /// Places `devices` (in rail order) by `overrides`, else by sysfs.
    pub(crate) fn new(devices: &[String], overrides: &[(String, Option<u32>)]) -> Self {
        Topology::with_root(PathBuf::from("/sys"), devices, overrides)
    }

    fn with_root(root: PathBuf, devices: &[String], overrides: &[(String, Option<u32>)]) -> Self {
        let nodes = devices
            .iter()
            .map(|d| match overrides.iter().find(|(name, _)| name == d) {
                Some(&(_, node)) => (node, NodeSource::Override),
                None => sysfs_node(&root, d),
            })
            .collect();
        Topology {
            root,
            names: devices.to_vec(),
            nodes,
            regions: RwLock::new(HashMap::new()),
        }
    }

    fn rail_nodes(&self) -> Vec<Option<u32>> {
        self.nodes.iter().map(|&(n, _)| n).collect()
    }

    fn preferred_for(&self, memory: Option<u32>) -> u64 {
        preferred(&self.rail_nodes(), memory, |m| sysfs_distances(&self.root, m))
    }

    /// Places a region whose first byte is at `addr` (already registered, so its first page is in
    /// memory); returns the rails it prefers.
    pub(crate) fn place(&self, key: RegionKey, addr: *const u8) -> u64 {
        let node = memory_node(addr);
        let mask = self.preferred_for(node);
        tracing::debug!(region = ?key, ?node, preferred = format_args!("{mask:#b}"), "region placed");
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
        self.names
            .iter()
            .zip(&self.nodes)
            .enumerate()
            .map(|(i, (name, &(node, source)))| RailPlace {
                device: name.clone(),
                numa_node: node,
                source: source.name(),
                preferred_for: masks
                    .iter()
                    .filter(|&&(_, mask)| mask & (1 << i) != 0)
                    .map(|&(n, _)| n)
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
        let topology = Topology::with_root(root.clone(), &devices, &[("gone0".into(), Some(1))]);
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

    #[test]
    fn this_processs_memory_has_a_node_where_the_kernel_has_numa() {
        let page = vec![1u8; 4096];
        let node = memory_node(page.as_ptr());
        if std::path::Path::new("/sys/devices/system/node/node0").exists() {
            assert!(node.is_some(), "a touched page has a node on a NUMA kernel");
        }
        assert_eq!(memory_node(std::ptr::null()), None, "address 0 is not mapped");
    }

    proptest! {
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
