//! Which memory type an allocation comes from, and which allocation paths a device can offer.
//!
//! This is the decision logic of the crate, kept free of Vulkan calls so that layouts no machine here
//! has (an NVIDIA GPU with RDMA-capable types, a discrete GPU with a small BAR heap) are tested too.
//! A [`MemoryLayout`] is the device's list of memory types and heaps; a [`TypeWish`] says which
//! property flags an allocation must have, which it would like and which it would rather avoid.

use ash::vk;
use serde::Serialize;

/// Flags no allocation of this crate may use: protected memory needs protected queues, lazily
/// allocated memory exists only for transient attachments.
const FORBIDDEN: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::from_raw(
    vk::MemoryPropertyFlags::PROTECTED.as_raw() | vk::MemoryPropertyFlags::LAZILY_ALLOCATED.as_raw(),
);

/// One memory type as the device reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemType {
    /// Property flags.
    pub flags: vk::MemoryPropertyFlags,
    /// The heap it allocates from.
    pub heap: u32,
}

/// One memory heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Heap {
    /// Size in bytes.
    pub size: u64,
    /// Heap flags.
    pub flags: vk::MemoryHeapFlags,
}

/// A device's memory types and heaps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct MemoryLayout {
    /// Memory types, by index.
    pub types: Vec<MemType>,
    /// Heaps, by index.
    pub heaps: Vec<Heap>,
}

/// What an allocation asks of its memory type.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TypeWish {
    /// Every one of these flags.
    pub required: vk::MemoryPropertyFlags,
    /// As many of these as possible.
    pub preferred: vk::MemoryPropertyFlags,
    /// As few of these as possible (weighs more than `preferred`).
    pub avoided: vk::MemoryPropertyFlags,
}

/// Path 1: the first memory type that is RDMA-capable (`VK_MEMORY_PROPERTY_RDMA_CAPABLE_BIT_NV`).
pub(crate) const RDMA_WISH: TypeWish = TypeWish {
    required: vk::MemoryPropertyFlags::RDMA_CAPABLE_NV,
    preferred: vk::MemoryPropertyFlags::empty(),
    avoided: vk::MemoryPropertyFlags::empty(),
};

/// Path 2: device memory the host can map, coherent and cached if there is such a type.
pub(crate) const HOST_VISIBLE_WISH: TypeWish = TypeWish {
    required: vk::MemoryPropertyFlags::from_raw(
        vk::MemoryPropertyFlags::DEVICE_LOCAL.as_raw() | vk::MemoryPropertyFlags::HOST_VISIBLE.as_raw(),
    ),
    preferred: vk::MemoryPropertyFlags::from_raw(
        vk::MemoryPropertyFlags::HOST_COHERENT.as_raw() | vk::MemoryPropertyFlags::HOST_CACHED.as_raw(),
    ),
    avoided: vk::MemoryPropertyFlags::empty(),
};

/// Path 3, the device side: device-local memory, preferably the kind the host cannot see (VRAM
/// outside the BAR).
pub(crate) const DEVICE_ONLY_WISH: TypeWish = TypeWish {
    required: vk::MemoryPropertyFlags::DEVICE_LOCAL,
    preferred: vk::MemoryPropertyFlags::empty(),
    avoided: vk::MemoryPropertyFlags::HOST_VISIBLE,
};

/// Path 3, the host side: mappable memory in system RAM, cached so that the CPU reads it fast when a
/// peer reads from the region.
pub(crate) const STAGING_WISH: TypeWish = TypeWish {
    required: vk::MemoryPropertyFlags::HOST_VISIBLE,
    preferred: vk::MemoryPropertyFlags::from_raw(
        vk::MemoryPropertyFlags::HOST_COHERENT.as_raw() | vk::MemoryPropertyFlags::HOST_CACHED.as_raw(),
    ),
    avoided: vk::MemoryPropertyFlags::DEVICE_LOCAL,
};

/// Host buffers imported with `VK_EXT_external_memory_host`: any type the import allows, mappable if
/// possible.
pub(crate) const IMPORT_WISH: TypeWish = TypeWish {
    required: vk::MemoryPropertyFlags::empty(),
    preferred: vk::MemoryPropertyFlags::HOST_VISIBLE,
    avoided: vk::MemoryPropertyFlags::empty(),
};

/// How a region's bytes live on the device and reach the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AllocationPath {
    /// Path 1: `VK_NV_external_memory_rdma` memory with a remote address for RDMA NICs. TCP reaches it
    /// through its mapping where the type is host-visible, else through staging copies.
    RdmaCapable,
    /// Path 2: device memory that is also host-visible, mapped and registered through its mapping:
    /// TCP moves bytes into it with no extra copy.
    HostVisible,
    /// Path 3: device-local memory reached through a host-visible staging buffer and copies on a
    /// transfer queue.
    Staged,
}

impl AllocationPath {
    /// The name used in options, logs and `ferry info`: "rdma", "host-visible", "staged".
    pub fn name(self) -> &'static str {
        match self {
            AllocationPath::RdmaCapable => "rdma",
            AllocationPath::HostVisible => "host-visible",
            AllocationPath::Staged => "staged",
        }
    }
}

impl std::fmt::Display for AllocationPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for AllocationPath {
    type Err = ferry_core::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "rdma" | "rdma-capable" | "1" => Ok(AllocationPath::RdmaCapable),
            "host-visible" | "hostvisible" | "mapped" | "2" => Ok(AllocationPath::HostVisible),
            "staged" | "device-local" | "3" => Ok(AllocationPath::Staged),
            other => Err(ferry_core::Error::InvalidArgument(format!(
                "unknown Vulkan allocation path {other:?}: expected rdma, host-visible or staged"
            ))),
        }
    }
}

/// Which memory types this crate's buffers may be bound to (`memoryTypeBits`), by the external
/// handle types they are created with.
///
/// A memory type that exists is not one every buffer may use: drivers narrow the choice by the
/// buffer's usage and its external handle types. An NVIDIA H200 (driver 580), for one, lists a
/// device-local and host-visible type, but allows an exportable buffer only its first four types,
/// which are not it. Vulkan gives every buffer created with the same usage, flags and handle types
/// the same bits, whatever its size, so one small probe buffer per set of handle types answers for
/// all allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BufferTypes {
    /// No external handle types.
    pub plain: u32,
    /// Exportable as an opaque fd (0 where the device cannot export such buffers).
    pub opaque_fd: u32,
    /// Exportable as an RDMA address (0 without `VK_NV_external_memory_rdma`).
    pub rdma: u32,
    /// Exportable as a dma-buf (0 without `VK_EXT_external_memory_dma_buf`).
    pub dma_buf: u32,
}

impl BufferTypes {
    /// Every type allowed for every kind of buffer: a layout's upper bound, before a device is open.
    pub const ANY: BufferTypes = BufferTypes {
        plain: u32::MAX,
        opaque_fd: u32::MAX,
        rdma: u32::MAX,
        dma_buf: u32::MAX,
    };

    /// The handle types a buffer for `wish` is created with, given the ones asked for: `wanted` where
    /// a buffer exportable that way may still get a type for `wish`, else none (the allocation is
    /// served, not exportable), or `None` when neither buffer could. A dma-buf is dropped first,
    /// then an opaque fd: an RDMA address is what path 1 exists for.
    pub fn export_for(
        &self,
        layout: &MemoryLayout,
        wish: &TypeWish,
        wanted: vk::ExternalMemoryHandleTypeFlags,
    ) -> Option<vk::ExternalMemoryHandleTypeFlags> {
        let droppable = [
            vk::ExternalMemoryHandleTypeFlags::DMA_BUF_EXT,
            vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD,
        ];
        let fits = |handles| layout.pick(self.allowed(handles), wish).is_some();
        let mut handles = wanted;
        if fits(handles) {
            return Some(handles);
        }
        for drop in droppable.into_iter().filter(|d| wanted.contains(*d)) {
            handles &= !drop;
            if fits(handles) {
                return Some(handles);
            }
        }
        None
    }

    /// The types a buffer created with `handles` may use.
    fn allowed(&self, handles: vk::ExternalMemoryHandleTypeFlags) -> u32 {
        let mut bits = u32::MAX;
        if handles.is_empty() {
            bits &= self.plain;
        }
        if handles.contains(vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD) {
            bits &= self.opaque_fd;
        }
        if handles.contains(vk::ExternalMemoryHandleTypeFlags::RDMA_ADDRESS_NV) {
            bits &= self.rdma;
        }
        if handles.contains(vk::ExternalMemoryHandleTypeFlags::DMA_BUF_EXT) {
            bits &= self.dma_buf;
        }
        bits
    }

    /// Whether the memory type a host-visible region gets (exportable where it may be, as the
    /// registry allocates it) is host-cached; `None` where no buffer may get one.
    pub fn mapped_reads_cached(&self, layout: &MemoryLayout) -> Option<bool> {
        let handles = self.export_for(layout, &HOST_VISIBLE_WISH, vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD)?;
        let index = layout.pick(self.allowed(handles), &HOST_VISIBLE_WISH)?;
        Some(layout.flags_of(index).contains(vk::MemoryPropertyFlags::HOST_CACHED))
    }
}

/// The order in which an allocation without a forced path tries the paths.
///
/// Path 2 comes before path 3 where the CPU reads its mapping through the cache. Where it does not
/// (a discrete GPU's VRAM behind its BAR is write-combined: the CPU's writes stream, its reads go one
/// by one over PCIe), a peer's READ of the region would run at the speed of uncached loads, and the
/// staged path, whose reads are a GPU copy into cached host memory, comes first. On an NVIDIA H200,
/// over TCP: 1 MiB reads at 0.06 GB/s from the mapping against 5.1–5.6 GB/s staged, writes at
/// 10.5–10.9 against 4.6–4.8.
pub(crate) fn auto_order(mapped_reads_cached: bool) -> [AllocationPath; 3] {
    use AllocationPath::{HostVisible, RdmaCapable, Staged};
    match mapped_reads_cached {
        true => [RdmaCapable, HostVisible, Staged],
        false => [RdmaCapable, Staged, HostVisible],
    }
}

/// Which allocation paths a device can serve.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PathSupport {
    /// Path 1: `VK_NV_external_memory_rdma` is enabled and a memory type is RDMA-capable.
    pub rdma: bool,
    /// Path 2: a memory type is both device-local and host-visible.
    pub host_visible: bool,
    /// Path 3: there is device-local memory and host-visible memory to stage through.
    pub staged: bool,
}

impl PathSupport {
    /// Whether `path` is available.
    pub fn offers(&self, path: AllocationPath) -> bool {
        match path {
            AllocationPath::RdmaCapable => self.rdma,
            AllocationPath::HostVisible => self.host_visible,
            AllocationPath::Staged => self.staged,
        }
    }
}

impl MemoryLayout {
    /// Copies the layout out of Vulkan's fixed-size arrays.
    pub fn from_vk(p: &vk::PhysicalDeviceMemoryProperties) -> Self {
        let types = p
            .memory_types
            .iter()
            .take(p.memory_type_count as usize)
            .map(|t| MemType {
                flags: t.property_flags,
                heap: t.heap_index,
            })
            .collect();
        let heaps = p
            .memory_heaps
            .iter()
            .take(p.memory_heap_count as usize)
            .map(|h| Heap {
                size: h.size,
                flags: h.flags,
            })
            .collect();
        MemoryLayout { types, heaps }
    }

    /// The best memory type among those in the bit mask `allowed` (from a buffer's memory
    /// requirements) for `wish`: all required flags, fewest avoided flags, most preferred flags, then
    /// the lowest index (the order drivers list their preference in).
    pub fn pick(&self, allowed: u32, wish: &TypeWish) -> Option<u32> {
        self.types
            .iter()
            .enumerate()
            .filter(|&(i, t)| {
                i < 32 && allowed & (1 << i) != 0 && t.flags.contains(wish.required) && (t.flags & FORBIDDEN).is_empty()
            })
            .min_by_key(|&(i, t)| {
                let avoided = (t.flags & wish.avoided).as_raw().count_ones();
                let preferred = (t.flags & wish.preferred).as_raw().count_ones();
                (avoided, u32::MAX - preferred, i)
            })
            .map(|(i, _)| i as u32)
    }

    /// The heap of memory type `index`.
    pub fn heap_of(&self, index: u32) -> Option<u32> {
        self.types.get(index as usize).map(|t| t.heap)
    }

    /// The flags of memory type `index`.
    pub fn flags_of(&self, index: u32) -> vk::MemoryPropertyFlags {
        self.types
            .get(index as usize)
            .map_or(vk::MemoryPropertyFlags::empty(), |t| t.flags)
    }

    /// The heap RDMA-capable memory comes from: that of the first RDMA-capable memory type.
    pub fn rdma_heap(&self) -> Option<u32> {
        self.types
            .iter()
            .find(|t| t.flags.contains(vk::MemoryPropertyFlags::RDMA_CAPABLE_NV))
            .map(|t| t.heap)
    }

    /// Which paths this layout supports for buffers that may use `types`, given whether the RDMA
    /// extension and feature are enabled. With [`BufferTypes::ANY`]: what the memory types alone
    /// allow, before a device is open.
    pub fn paths(&self, rdma_enabled: bool, types: &BufferTypes) -> PathSupport {
        let none = vk::ExternalMemoryHandleTypeFlags::empty();
        let fd = vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;
        let rdma = vk::ExternalMemoryHandleTypeFlags::RDMA_ADDRESS_NV;
        // Each path's buffers are tried exportable first and plain after (see `export_for`).
        let served = |wish: &TypeWish, wanted| types.export_for(self, wish, wanted).is_some();
        PathSupport {
            rdma: rdma_enabled && served(&RDMA_WISH, rdma),
            host_visible: served(&HOST_VISIBLE_WISH, fd),
            staged: served(&DEVICE_ONLY_WISH, fd) && served(&STAGING_WISH, none),
        }
    }
}

/// Whether `size` more bytes fit into a heap with `budget` bytes of which `usage` are in use.
pub(crate) fn fits_budget(size: u64, budget: u64, usage: u64) -> bool {
    budget.checked_sub(usage).is_some_and(|free| size <= free)
}

/// The names of the flags set in `flags`, for `ferry info`.
pub(crate) fn flag_names(flags: vk::MemoryPropertyFlags) -> Vec<&'static str> {
    use vk::MemoryPropertyFlags as F;
    [
        (F::DEVICE_LOCAL, "device-local"),
        (F::HOST_VISIBLE, "host-visible"),
        (F::HOST_COHERENT, "host-coherent"),
        (F::HOST_CACHED, "host-cached"),
        (F::LAZILY_ALLOCATED, "lazily-allocated"),
        (F::PROTECTED, "protected"),
        (F::DEVICE_COHERENT_AMD, "device-coherent-amd"),
        (F::DEVICE_UNCACHED_AMD, "device-uncached-amd"),
        (F::RDMA_CAPABLE_NV, "rdma-capable"),
    ]
    .into_iter()
    .filter(|(f, _)| flags.contains(*f))
    .map(|(_, n)| n)
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use vk::MemoryPropertyFlags as F;

    fn layout(types: &[(F, u32)], heaps: &[u64]) -> MemoryLayout {
        MemoryLayout {
            types: types.iter().map(|&(flags, heap)| MemType { flags, heap }).collect(),
            heaps: heaps
                .iter()
                .map(|&size| Heap {
                    size,
                    flags: vk::MemoryHeapFlags::DEVICE_LOCAL,
                })
                .collect(),
        }
    }

    /// lavapipe: one heap, one type with everything.
    fn lavapipe() -> MemoryLayout {
        layout(
            &[(F::DEVICE_LOCAL | F::HOST_VISIBLE | F::HOST_COHERENT | F::HOST_CACHED, 0)],
            &[2 << 30],
        )
    }

    /// A discrete NVIDIA GPU with the RDMA extension: VRAM, system memory, a BAR window, and
    /// RDMA-capable VRAM.
    fn nvidia() -> MemoryLayout {
        layout(
            &[
                (F::empty(), 1),
                (F::DEVICE_LOCAL, 0),
                (F::HOST_VISIBLE | F::HOST_COHERENT, 1),
                (F::HOST_VISIBLE | F::HOST_COHERENT | F::HOST_CACHED, 1),
                (F::DEVICE_LOCAL | F::HOST_VISIBLE | F::HOST_COHERENT, 2),
                (F::DEVICE_LOCAL | F::RDMA_CAPABLE_NV, 0),
            ],
            &[80 << 30, 64 << 30, 256 << 20],
        )
    }

    #[test]
    fn lavapipe_offers_paths_two_and_three_from_its_one_type() {
        let l = lavapipe();
        assert_eq!(
            l.paths(false, &BufferTypes::ANY),
            PathSupport {
                rdma: false,
                host_visible: true,
                staged: true
            }
        );
        assert_eq!(l.pick(1, &HOST_VISIBLE_WISH), Some(0));
        assert_eq!(l.pick(1, &DEVICE_ONLY_WISH), Some(0));
        assert_eq!(l.pick(1, &STAGING_WISH), Some(0));
        assert_eq!(l.pick(1, &RDMA_WISH), None);
        assert_eq!(l.pick(0, &HOST_VISIBLE_WISH), None, "no allowed type, no pick");
    }

    #[test]
    fn nvidia_layout_picks_the_intended_type_for_each_role() {
        let l = nvidia();
        assert!(l.paths(true, &BufferTypes::ANY).rdma);
        assert!(
            !l.paths(false, &BufferTypes::ANY).rdma,
            "RDMA needs the extension enabled"
        );
        assert_eq!(l.pick(u32::MAX, &RDMA_WISH), Some(5));
        assert_eq!(l.rdma_heap(), Some(0));
        assert_eq!(l.pick(u32::MAX, &HOST_VISIBLE_WISH), Some(4), "the BAR window");
        assert_eq!(l.pick(u32::MAX, &DEVICE_ONLY_WISH), Some(1), "VRAM outside the BAR");
        assert_eq!(l.pick(u32::MAX, &STAGING_WISH), Some(3), "cached system memory");
        // A buffer whose requirements exclude type 1 falls back to the next device-only type, then to
        // the BAR window.
        assert_eq!(l.pick(!(1 << 1), &DEVICE_ONLY_WISH), Some(5));
        assert_eq!(l.pick(!(1 << 1 | 1 << 5), &DEVICE_ONLY_WISH), Some(4));
        assert_eq!(l.heap_of(4), Some(2));
        assert_eq!(l.heap_of(40), None);
    }

    /// An NVIDIA H200 as its driver (580.159) reports it: VRAM all mappable (resizable BAR), system
    /// memory plain and cached; exportable buffers may use types 0-3 only.
    fn h200() -> (MemoryLayout, BufferTypes) {
        let layout = layout(
            &[
                (F::empty(), 1),
                (F::DEVICE_LOCAL, 0),
                (F::HOST_VISIBLE | F::HOST_COHERENT, 1),
                (F::HOST_VISIBLE | F::HOST_COHERENT | F::HOST_CACHED, 1),
                (F::DEVICE_LOCAL | F::HOST_VISIBLE | F::HOST_COHERENT, 0),
            ],
            &[150_754_820_096, 101_346_797_568],
        );
        let types = BufferTypes {
            plain: 0b1_1111,
            opaque_fd: 0b1111,
            rdma: 0,
            dma_buf: 0b1111,
        };
        (layout, types)
    }

    #[test]
    fn a_dma_buf_is_dropped_before_an_opaque_fd_and_kept_where_it_fits() {
        let fd = vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;
        let dma_buf = vk::ExternalMemoryHandleTypeFlags::DMA_BUF_EXT;
        let (l, types) = h200();
        // VRAM behind staging: exportable both ways.
        assert_eq!(
            types.export_for(&l, &DEVICE_ONLY_WISH, fd | dma_buf),
            Some(fd | dma_buf)
        );
        // A device whose dma-buf exports may use only system memory: VRAM keeps its opaque fd.
        let narrow = BufferTypes {
            dma_buf: 0b1100,
            ..types
        };
        assert_eq!(narrow.export_for(&l, &DEVICE_ONLY_WISH, fd | dma_buf), Some(fd));
        // Without the extension (no types): no dma-buf, whatever was asked.
        let none = BufferTypes { dma_buf: 0, ..types };
        assert_eq!(
            none.export_for(&l, &DEVICE_ONLY_WISH, dma_buf),
            Some(vk::ExternalMemoryHandleTypeFlags::empty())
        );
    }

    #[test]
    fn paths_follow_the_types_a_buffer_may_use() {
        let fd = vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;
        let plain = vk::ExternalMemoryHandleTypeFlags::empty();
        let (l, types) = h200();
        assert_eq!(
            l.paths(false, &types),
            PathSupport {
                rdma: false,
                host_visible: true,
                staged: true
            }
        );
        // Mapped VRAM is served, but not exportable; VRAM behind staging stays exportable.
        assert_eq!(types.export_for(&l, &HOST_VISIBLE_WISH, fd), Some(plain));
        assert_eq!(types.export_for(&l, &DEVICE_ONLY_WISH, fd), Some(fd));
        assert_eq!(l.pick(types.plain, &HOST_VISIBLE_WISH), Some(4));
        assert_eq!(l.pick(types.opaque_fd, &DEVICE_ONLY_WISH), Some(1));
        assert_eq!(l.pick(types.plain, &STAGING_WISH), Some(3));
        // Its mapped VRAM is not cached: automatic allocations take the staged path first.
        assert_eq!(types.mapped_reads_cached(&l), Some(false));
        assert_eq!(auto_order(false)[1], AllocationPath::Staged);
        let (cpu, all) = (lavapipe(), BufferTypes::ANY);
        assert_eq!(all.mapped_reads_cached(&cpu), Some(true));
        assert_eq!(auto_order(true)[1], AllocationPath::HostVisible);
        // Were plain buffers as narrow, there would be no host-visible path at all, where the memory
        // types alone say there is.
        let narrow = BufferTypes { plain: 0b1111, ..types };
        assert!(l.paths(false, &BufferTypes::ANY).host_visible);
        assert!(!l.paths(false, &narrow).host_visible);
        assert_eq!(narrow.export_for(&l, &HOST_VISIBLE_WISH, fd), None);
        // An RDMA address is never dropped to find a type.
        let nv = nvidia();
        let rdma = vk::ExternalMemoryHandleTypeFlags::RDMA_ADDRESS_NV;
        let no_rdma_type = BufferTypes {
            rdma: !(1 << 5),
            ..BufferTypes::ANY
        };
        assert!(!nv.paths(true, &no_rdma_type).rdma);
        assert_eq!(no_rdma_type.export_for(&nv, &RDMA_WISH, rdma | fd), None);
        assert_eq!(BufferTypes::ANY.export_for(&nv, &RDMA_WISH, rdma | fd), Some(rdma | fd));
    }

    #[test]
    fn forbidden_flags_are_never_picked() {
        let l = layout(
            &[
                (F::DEVICE_LOCAL | F::PROTECTED, 0),
                (F::DEVICE_LOCAL | F::LAZILY_ALLOCATED, 0),
            ],
            &[1 << 30],
        );
        assert_eq!(l.pick(u32::MAX, &DEVICE_ONLY_WISH), None);
        assert!(!l.paths(false, &BufferTypes::ANY).staged);
    }

    #[test]
    fn budget_check_counts_what_is_in_use() {
        assert!(fits_budget(10, 100, 90));
        assert!(!fits_budget(11, 100, 90));
        assert!(!fits_budget(1, 100, 120), "usage past the budget leaves nothing");
        assert!(fits_budget(0, 0, 0));
    }

    #[test]
    fn path_names_round_trip() {
        for p in [
            AllocationPath::RdmaCapable,
            AllocationPath::HostVisible,
            AllocationPath::Staged,
        ] {
            assert_eq!(p.name().parse::<AllocationPath>().ok(), Some(p));
        }
        assert!("gpu".parse::<AllocationPath>().is_err());
    }

    #[test]
    fn flag_names_list_the_set_flags() {
        assert_eq!(
            flag_names(F::DEVICE_LOCAL | F::RDMA_CAPABLE_NV),
            vec!["device-local", "rdma-capable"]
        );
    }
}
