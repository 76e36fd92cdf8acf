//! `ferry bench` refuses option combinations that would measure something else than asked.

use std::process::Command;

#[test]
fn a_vulkan_path_without_vulkan_memory_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["bench", "--vulkan-path", "staged", "--duration", "100ms"])
        .output()
        .expect("run ferry");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ferry bench ran: {stderr}");
    assert!(stderr.contains("--vulkan-path needs --target-mem vulkan"), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "nothing may be measured: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}
