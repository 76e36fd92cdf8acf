//! Without a Vulkan driver every entry point answers Unsupported with the reason, and nothing panics.
//!
//! The driver is hidden with `VK_DRIVER_FILES=/nonexistent` in a child process (this test binary run
//! again), because changing the environment of a running multithreaded test binary is unsound.

use std::process::Command;

use ferry_core::Error;
use ferry_vulkan::{DeviceSelector, VulkanContext, probe};

const CHILD: &str = "FERRY_VULKAN_NO_DRIVER_CHILD";

#[test]
fn without_a_driver_everything_is_unsupported() {
    if std::env::var_os(CHILD).is_some() {
        let ctx = VulkanContext::new(&DeviceSelector::Default);
        assert!(matches!(&ctx, Err(Error::Unsupported(m)) if !m.is_empty()), "{ctx:?}");
        let listed = probe();
        assert!(matches!(&listed, Err(Error::Unsupported(_))), "{listed:?}");
        println!(
            "no-driver child: {}",
            ctx.err().map(|e| e.to_string()).unwrap_or_default()
        );
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([
            "--exact",
            "without_a_driver_everything_is_unsupported",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("VK_DRIVER_FILES", "/nonexistent")
        .env("VK_ICD_FILENAMES", "/nonexistent")
        .env_remove("VK_ADD_DRIVER_FILES")
        .output()
        .expect("running the test binary again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed: {stdout}\n{stderr}");
    assert!(
        stdout.contains("no-driver child: unsupported:"),
        "the child did not run its checks: {stdout}\n{stderr}"
    );
}
