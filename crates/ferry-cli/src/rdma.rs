//! The RDMA options of every command that starts an engine: which devices are its rails, where they
//! sit, and which rails a GPU's memory prefers. Each also has an environment variable, which the
//! engine reads when the option is not given.

use ferry::EngineBuilder;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct RdmaArgs {
    /// RDMA devices to use, each a rail ("mlx5_0,mlx5_1"); else `FERRY_RDMA_DEVICES`, else every
    /// device with an active port.
    #[arg(long, value_delimiter = ',', value_name = "DEVICES")]
    rdma_devices: Vec<String>,
    /// NUMA nodes of RDMA devices, overriding sysfs ("mlx5_0=0,mlx5_1=1", `any` for no node); else
    /// `FERRY_RDMA_NUMA`.
    #[arg(long, value_name = "DEVICE=NODE,..")]
    rdma_numa: Option<String>,
    /// The rails a GPU's memory prefers, overriding the PCIe ranking
    /// ("0000:3b:00.0=mlx5_0+mlx5_1,0000:86:00.0=mlx5_2"); else `FERRY_RDMA_DEVICE_RAILS`.
    #[arg(long, value_name = "PCI=DEVICE+DEVICE,..")]
    rdma_device_rails: Option<String>,
    /// Queue pairs per pair of rails, 1 to 8; else `FERRY_RDMA_QUEUE_PAIRS`, else 1.
    #[arg(long, value_name = "N")]
    rdma_queue_pairs: Option<u8>,
    /// Bytes of the slices a batch is cut into and spread over the rails ("256KiB", at least 4KiB);
    /// else `FERRY_RDMA_SLICE`, else 256 KiB.
    #[arg(long, value_name = "SIZE", value_parser = crate::units::parse_size)]
    rdma_slice: Option<u64>,
}

impl RdmaArgs {
    fn given(&self) -> bool {
        !self.rdma_devices.is_empty()
            || self.rdma_numa.is_some()
            || self.rdma_device_rails.is_some()
            || self.rdma_queue_pairs.is_some()
            || self.rdma_slice.is_some()
    }

    /// The builder with these options applied; an error for text that does not parse, or for any
    /// option in a build without RDMA.
    pub fn apply(&self, builder: EngineBuilder) -> anyhow::Result<EngineBuilder> {
        if !self.given() {
            return Ok(builder);
        }
        apply(self, builder)
    }
}

#[cfg(feature = "rdma")]
fn apply(args: &RdmaArgs, mut builder: EngineBuilder) -> anyhow::Result<EngineBuilder> {
    use anyhow::Context;
    if !args.rdma_devices.is_empty() {
        builder = builder.rdma_devices(args.rdma_devices.clone());
    }
    if let Some(text) = &args.rdma_numa {
        let nodes = ferry::rdma::parse_numa_nodes(text)
            .map_err(anyhow::Error::msg)
            .context("--rdma-numa")?;
        for (device, node) in nodes {
            builder = builder.rdma_numa_node(device, node);
        }
    }
    if let Some(text) = &args.rdma_device_rails {
        let entries = ferry::rdma::parse_device_rails(text)
            .map_err(anyhow::Error::msg)
            .context("--rdma-device-rails")?;
        for (device, rails) in entries {
            builder = builder.rdma_device_rails(device, rails);
        }
    }
    if let Some(n) = args.rdma_queue_pairs {
        builder = builder.rdma_queue_pairs_per_rail(n);
    }
    if let Some(bytes) = args.rdma_slice {
        builder = builder.rdma_slice_bytes(bytes);
    }
    Ok(builder)
}

#[cfg(not(feature = "rdma"))]
fn apply(_: &RdmaArgs, _: EngineBuilder) -> anyhow::Result<EngineBuilder> {
    anyhow::bail!("the --rdma-* options need RDMA: this ferry was built without the `rdma` feature")
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        rdma: RdmaArgs,
    }

    #[test]
    fn options_parse_and_bad_text_is_an_error_naming_the_option() {
        let cli = Cli::try_parse_from(["ferry", "--rdma-devices", "rxe0,rxe1", "--rdma-queue-pairs", "2"]).unwrap();
        assert_eq!(cli.rdma.rdma_devices, ["rxe0", "rxe1"]);
        assert!(cli.rdma.apply(ferry::Engine::builder()).is_ok() == cfg!(feature = "rdma"));
        assert!(
            Cli::try_parse_from(["ferry"])
                .unwrap()
                .rdma
                .apply(ferry::Engine::builder())
                .is_ok()
        );
        let bad = Cli::try_parse_from(["ferry", "--rdma-device-rails", "gpu0=mlx5_0"]).unwrap();
        let error = format!("{:#}", bad.rdma.apply(ferry::Engine::builder()).unwrap_err());
        if cfg!(feature = "rdma") {
            assert!(
                error.contains("--rdma-device-rails") && error.contains("not a PCI address"),
                "{error}"
            );
        } else {
            assert!(error.contains("built without the `rdma` feature"), "{error}");
        }
    }
}
