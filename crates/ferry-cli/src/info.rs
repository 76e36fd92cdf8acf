//! `ferry info`: the transports and devices this build can use on this host.

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let caps = ferry::capabilities();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&caps)?);
        return Ok(());
    }
    println!("ferry {} (protocol {})", caps.version, caps.protocol_version);
    println!("{:<6} {:<9} {:<7} detail", "name", "compiled", "usable");
    for t in &caps.transports {
        println!("{:<6} {:<9} {:<7} {}", t.name, yes(t.compiled), yes(t.usable), t.detail);
    }
    println!("rdma devices:   {}", list(&caps.rdma_devices));
    let vulkan: Vec<String> = caps.vulkan_devices.iter().map(|d| d.to_string()).collect();
    println!("vulkan devices: {}", list(&vulkan));
    Ok(())
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn list(v: &[String]) -> String {
    if v.is_empty() { "none".into() } else { v.join(", ") }
}
