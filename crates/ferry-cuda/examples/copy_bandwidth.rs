//! The device's own device-to-device copy rate (`CudaDevice::copy_bandwidth`), as one JSON object:
//! `{"device": ..., "size": ..., "gb_per_s": ...}`. `cargo xtask bench` compares ferry's GPU to GPU
//! transfers between two processes with it.
//!
//! `copy_bandwidth [SIZE_BYTES] [SECONDS]`: 1 MiB copies for 3 s by default, on device 0.

use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let size: usize = args.next().map_or(Ok(1 << 20), |a| a.parse())?;
    let seconds: f64 = args.next().map_or(Ok(3.0), |a| a.parse())?;
    let device = ferry_cuda::CudaDevice::open(0)?;
    let gb_per_s = device.copy_bandwidth(size, Duration::from_secs_f64(seconds))?;
    println!(
        "{{\"device\": \"{} ({})\", \"size\": {size}, \"gb_per_s\": {gb_per_s:.3}}}",
        device.name(),
        device.pci_address()
    );
    Ok(())
}
