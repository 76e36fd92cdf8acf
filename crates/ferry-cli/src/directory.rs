//! The directory options of `ferry serve` and `ferry ls`, and `ferry ls`: the engines published in an
//! etcd directory. Built with the `directory` feature (crate `ferry-etcd`, whose build needs `protoc`).

use std::sync::Arc;

use anyhow::Context;
use serde::Serialize;

#[derive(clap::Args, Clone)]
pub struct DirectoryArgs {
    /// The etcd directory: etcd://HOST:PORT[,HOST:PORT...], or etcds:// for TLS.
    #[arg(long, value_name = "URL")]
    pub directory: Option<String>,
    /// The key prefix of the engines' records in etcd.
    #[arg(long, default_value = "/ferry")]
    pub directory_prefix: String,
    /// How long a record outlives its engine's last refresh, in seconds.
    #[arg(long, default_value_t = 10)]
    pub directory_ttl: u64,
    /// The etcd user; the password is read from FERRY_ETCD_PASSWORD.
    #[arg(long)]
    pub directory_user: Option<String>,
    /// The CA of etcd's certificate (PEM), for etcds:// URLs.
    #[arg(long, value_name = "FILE")]
    pub directory_ca: Option<std::path::PathBuf>,
    /// A client certificate and key (PEM) for etcd, where it checks clients.
    #[arg(long, value_name = "FILE", requires = "directory_key")]
    pub directory_cert: Option<std::path::PathBuf>,
    /// The key of --directory-cert.
    #[arg(long, value_name = "FILE", requires = "directory_cert")]
    pub directory_key: Option<std::path::PathBuf>,
}

impl DirectoryArgs {
    /// The directory the options name, connected; `None` without `--directory`.
    pub async fn connect(&self) -> anyhow::Result<Option<Arc<dyn ferry::Directory>>> {
        let Some(url) = &self.directory else { return Ok(None) };
        connect(self, url).await.map(Some)
    }
}

#[cfg(feature = "directory")]
async fn connect(args: &DirectoryArgs, url: &str) -> anyhow::Result<Arc<dyn ferry::Directory>> {
    let user = match &args.directory_user {
        Some(user) => {
            let password = std::env::var("FERRY_ETCD_PASSWORD")
                .context("--directory-user: set the password in FERRY_ETCD_PASSWORD")?;
            Some((user.clone(), password))
        }
        None => None,
    };
    let read = |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let tls = match &args.directory_ca {
        Some(ca) => Some(ferry_etcd::EtcdTls {
            ca_pem: read(ca)?,
            client: match (&args.directory_cert, &args.directory_key) {
                (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
                _ => None,
            },
        }),
        None => None,
    };
    let options = ferry_etcd::EtcdOptions {
        ttl: std::time::Duration::from_secs(args.directory_ttl.max(1)),
        user,
        tls,
        ..Default::default()
    };
    let directory = ferry_etcd::EtcdDirectory::connect(url, &args.directory_prefix, options)
        .await
        .with_context(|| format!("connecting to the directory at {url}"))?;
    Ok(directory)
}

#[cfg(not(feature = "directory"))]
async fn connect(_: &DirectoryArgs, _: &str) -> anyhow::Result<Arc<dyn ferry::Directory>> {
    anyhow::bail!(
        "this ferry was built without the `directory` feature (etcd): build it with \
         `cargo build -p ferry-cli --features directory` (which needs protoc)"
    )
}

#[derive(clap::Args)]
pub struct LsArgs {
    #[command(flatten)]
    directory: DirectoryArgs,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Member {
    name: String,
    addrs: Vec<String>,
    transports: Vec<String>,
    host_id: String,
    authenticated: bool,
    protocol_version: u8,
}

/// `ferry ls`: the engines published in the directory now.
pub async fn ls(args: LsArgs) -> anyhow::Result<()> {
    let directory = args
        .directory
        .connect()
        .await?
        .context("give the directory to list: --directory etcd://HOST:PORT")?;
    let mut members: Vec<Member> = directory
        .list()
        .await?
        .into_iter()
        .map(|r| Member {
            name: r.name,
            addrs: r.addrs,
            transports: r.transports,
            host_id: r.host_id,
            authenticated: r.authenticated,
            protocol_version: r.protocol_version,
        })
        .collect();
    members.sort_by(|a, b| a.name.cmp(&b.name));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&members)?);
        return Ok(());
    }
    println!(
        "{:<20} {:<24} {:<16} {:<17} auth",
        "name", "address", "transports", "host"
    );
    for m in &members {
        println!(
            "{:<20} {:<24} {:<16} {:<17} {}",
            m.name,
            m.addrs.join(","),
            m.transports.join(","),
            m.host_id,
            if m.authenticated { "mutual TLS" } else { "none" }
        );
    }
    Ok(())
}
