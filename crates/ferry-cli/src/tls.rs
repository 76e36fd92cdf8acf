//! The authentication options every command shares, the in-memory certificates `ferry bench --tls`
//! uses, and `ferry certs`, which makes a small certificate authority for a cluster without one.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use ferry::{DataProtection, DevelopmentCa, TlsConfig};

/// Mutual TLS from PEM files: all three, or none (an engine open to anyone who reaches it).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// This engine's certificate chain (PEM), for mutual TLS; with --tls-key and --tls-ca.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// This engine's private key (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// The CA certificates (PEM) that peers' certificates must chain to.
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// The DNS name the peer's certificate must carry, instead of the IP address dialled.
    #[arg(long, requires = "tls_cert")]
    pub tls_server_name: Option<String>,
    /// Pre-shared-key mode instead of certificates: a file of at least 32 random bytes (e.g. `head -c
    /// 32 /dev/urandom > ferry.key`), the same on every engine; with --tls-name.
    #[arg(long, conflicts_with = "tls_cert", requires = "tls_name")]
    pub tls_psk_file: Option<PathBuf>,
    /// With --tls-psk-file: the name this engine goes by (what peers grant to).
    #[arg(long, requires = "tls_psk_file")]
    pub tls_name: Option<String>,
    /// Encrypt the data streams of the links this engine dials (with TLS), and refuse links whose
    /// data streams are not encrypted: the same as --data-protection encrypted.
    #[arg(long, conflicts_with = "data_protection")]
    pub encrypt: bool,
    /// What protects the data streams under TLS, and the least this engine accepts: `integrity`
    /// (the default: every record carries an AES-GCM tag, so nobody on the path can change or inject
    /// a byte), `encrypted`, or `plain` (no protection; only where nobody else can reach the network,
    /// and both ends must say so).
    #[arg(long, value_name = "plain|integrity|encrypted")]
    pub data_protection: Option<DataProtection>,
}

impl TlsArgs {
    /// What protects the data streams, as the options say.
    pub fn protection(&self) -> DataProtection {
        match (self.data_protection, self.encrypt) {
            (Some(p), _) => p,
            (None, true) => DataProtection::Encrypted,
            (None, false) => DataProtection::Integrity,
        }
    }

    /// The configuration the options name, if any.
    pub fn config(&self) -> anyhow::Result<Option<TlsConfig>> {
        if let (Some(file), Some(name)) = (&self.tls_psk_file, &self.tls_name) {
            let key = std::fs::read(file).with_context(|| format!("reading the pre-shared key {}", file.display()))?;
            let config = TlsConfig::from_psk(&key, name).context("setting up pre-shared-key mode")?;
            return Ok(Some(config.data_protection(self.protection())));
        }
        let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca) else {
            if self.encrypt || self.data_protection.is_some() {
                bail!(
                    "--encrypt and --data-protection need TLS (data is protected under keys of the TLS session): \
                     give --tls-cert, --tls-key and --tls-ca, or --tls-psk-file"
                );
            }
            return Ok(None);
        };
        let mut config = TlsConfig::from_pem_files(cert, key, ca).context("loading the TLS certificates")?;
        if let Some(name) = &self.tls_server_name {
            config = config.with_server_name(name)?;
        }
        Ok(Some(config.data_protection(self.protection())))
    }
}

/// `ferry certs`: writes a new CA and one certificate per engine name.
#[derive(clap::Args)]
pub struct CertsArgs {
    /// Directory to write `ca.pem` and `NAME.pem` / `NAME.key` for each name into (created if needed).
    #[arg(long)]
    out: PathBuf,
    /// An engine to issue a certificate for (its common name and first DNS name); repeat for more.
    #[arg(long = "name", required = true)]
    names: Vec<String>,
    /// Further DNS names or IP addresses every certificate is valid for (127.0.0.1 always is). Grants
    /// name engines by `--name`: an address names nobody, and a grant to one is refused.
    #[arg(long = "san")]
    sans: Vec<String>,
}

pub async fn certs(args: CertsArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let ca = DevelopmentCa::new("ferry cluster CA")?;
    write(&args.out.join("ca.pem"), &ca.cert_pem(), false)?;
    for name in &args.names {
        if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
            bail!("{name:?} cannot be a file name");
        }
        let issued = ca.issue(name, &args.sans)?;
        write(&args.out.join(format!("{name}.pem")), &issued.cert, false)?;
        write(&args.out.join(format!("{name}.key")), &issued.key, true)?;
    }
    println!(
        "wrote ca.pem and {} certificate(s) to {}; the CA key was not kept: issue new certificates with a new CA",
        args.names.len(),
        args.out.display()
    );
    Ok(())
}

fn write(path: &Path, text: &str, secret: bool) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}
