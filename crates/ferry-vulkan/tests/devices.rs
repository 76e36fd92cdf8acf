//! Device listing (`ferry info`) and device selection by index, name and UUID.

mod common;

use common::*;
use ferry_core::Error;
use ferry_vulkan::{DeviceSelector, VulkanContext, probe};

#[test]
fn probe_lists_devices_with_their_paths() {
    let infos = match probe() {
        Ok(v) => v,
        Err(e) => return skip_or_fail("device listing", &e).unwrap_or(()),
    };
    assert!(!infos.is_empty(), "a driver without devices");
    let json = serde_json::to_value(&infos).unwrap();
    for (i, d) in infos.iter().enumerate() {
        assert_eq!(d.index, i);
        assert!(!d.name.is_empty() && !d.driver.is_empty());
        assert!(!d.memory_types.is_empty() && !d.memory_heaps.is_empty());
        for key in [
            "name",
            "driver",
            "memory_types",
            "paths",
            "nv_rdma",
            "uuid",
            "pci_address",
        ] {
            assert!(json[i].get(key).is_some(), "{key} missing from {}", json[i]);
        }
        assert!(json[i]["paths"].get("host_visible").is_some());
        if let Some(address) = &d.pci_address {
            let parsed: ferry_core::PciAddress = address.parse().unwrap();
            assert_eq!(&parsed.to_string(), address);
        }
        if d.name.contains("llvmpipe") {
            assert!(d.paths.host_visible && d.paths.staged, "{d}");
            assert!(!d.paths.rdma && !d.nv_rdma, "lavapipe has no NV RDMA");
            assert!(d.external_memory_fd && d.external_memory_host);
            assert!(
                d.to_string().contains("paths: host-visible, staged; nv-rdma: no"),
                "{d}"
            );
        }
    }
}

#[test]
fn selection_by_index_name_and_uuid_finds_the_device() {
    let Some(ctx) = context("device selection") else {
        return;
    };
    let info = ctx.info();
    for sel in [
        DeviceSelector::Index(info.index),
        DeviceSelector::Name(info.name.to_uppercase()),
        info.uuid.parse().unwrap(),
    ] {
        let other = VulkanContext::new(&sel).unwrap();
        assert_eq!(other.device_uuid(), ctx.device_uuid(), "{sel}");
    }
    let r = VulkanContext::new(&DeviceSelector::Name("no such device, surely".into()));
    assert!(
        matches!(&r, Err(Error::InvalidArgument(m)) if m.contains(&info.name)),
        "{r:?}"
    );
}
