//! Helpers shared by the integration tests: one Vulkan context per test binary, the skip-or-fail rule,
//! and engine plumbing.
#![allow(dead_code)]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ferry::{Engine, Peer, Region};
use ferry_core::Error;
use ferry_vulkan::{AllocationPath, INSTALL_HINT, VulkanContext};

pub const T: Duration = Duration::from_secs(20);

/// Whether a missing prerequisite must fail the test instead of skipping it.
pub fn required() -> bool {
    std::env::var("FERRY_REQUIRE_ALL").is_ok_and(|v| v == "1")
}

/// Skips (returns `None`, saying so) or, under `FERRY_REQUIRE_ALL=1`, fails with the install command.
pub fn skip_or_fail<T>(what: &str, e: &Error) -> Option<T> {
    let hint = if e.message().contains(INSTALL_HINT) {
        String::new()
    } else {
        format!("; install it: {INSTALL_HINT}")
    };
    if required() {
        panic!("{what} needs a Vulkan driver (FERRY_REQUIRE_ALL=1): {e}{hint}");
    }
    eprintln!("skipped: {what}: no usable Vulkan driver ({e}){hint}");
    None
}

/// The context this test binary shares (device creation costs tens of milliseconds).
pub fn context(what: &str) -> Option<Arc<VulkanContext>> {
    static CTX: OnceLock<Result<Arc<VulkanContext>, Error>> = OnceLock::new();
    match CTX.get_or_init(VulkanContext::from_env) {
        Ok(c) => Some(c.clone()),
        Err(e) => skip_or_fail(what, e),
    }
}

/// A context of its own, for tests that count live objects.
pub fn private_context(what: &str) -> Option<Arc<VulkanContext>> {
    match VulkanContext::from_env() {
        Ok(c) => Some(c),
        Err(e) => skip_or_fail(what, &e),
    }
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8 ^ (i >> 16) as u8)
        .collect()
}

/// Asserts that every byte matches, naming the first that does not.
pub fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {i} of {} is {:#04x}, expected {:#04x}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// A listening target, an initiator, and the initiator's link to the target.
pub async fn pair() -> (Engine, Engine, Peer) {
    let target = Engine::builder().listen("127.0.0.1:0").build().await.unwrap();
    let initiator = Engine::builder().build().await.unwrap();
    let addr = target.local_addr().unwrap().to_string();
    let peer = initiator.connect(&addr, T).await.unwrap();
    (target, initiator, peer)
}

/// Waits until `peer` has learned of `region`.
pub async fn wait_for_region(peer: &Peer, region: &Region) {
    let deadline = tokio::time::Instant::now() + T;
    while !peer.regions().iter().any(|r| r.key == region.key()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "peer never learned of the region"
        );
        peer.regions_changed(Duration::from_millis(50)).await;
    }
}

/// A path whose blocks the host reads and writes (through a mapping or a staging buffer), for
/// checking what a device buffer holds: host-visible where the device offers it, else staged. A
/// discrete GPU may offer no host-visible memory to ferry's buffers at all.
pub fn host_reachable_path(ctx: &VulkanContext) -> AllocationPath {
    match ctx.paths().host_visible {
        true => AllocationPath::HostVisible,
        false => AllocationPath::Staged,
    }
}

/// Whether the test of `path` applies: `false` (saying so) where the device does not offer it. Where
/// a driver is required, lavapipe (the driver CI installs) must offer the host-visible and staged
/// paths, so that a test there never passes by skipping.
pub fn offered(ctx: &VulkanContext, path: AllocationPath) -> bool {
    if ctx.paths().offers(path) {
        return true;
    }
    let lavapipe = ctx.name().contains("llvmpipe");
    if required() && lavapipe && path != AllocationPath::RdmaCapable {
        panic!("{} must offer the {path} path", ctx.name());
    }
    eprintln!(
        "skipped: {} does not offer the {path} allocation path to ferry's buffers",
        ctx.name()
    );
    false
}
