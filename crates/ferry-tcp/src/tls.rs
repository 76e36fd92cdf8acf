//! Mutual TLS on a link's streams: [`TlsConfig`].

use std::io::BufReader;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use ferry_core::{DataProtection, Error, PeerIdentity, Result};
use ferry_proto::JoinKey;
use ferry_proto::auth::JOIN_EXPORTER_LABEL;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector, TlsStream};

/// The name every certificate of pre-shared-key mode carries, and that initiators check
/// ([`TlsConfig::from_psk`]).
pub const PSK_SERVER_NAME: &str = "psk.ferry.invalid";

/// First byte of a TLS handshake record (content type 22): how a target tells a TLS control stream
/// from a stream that starts with a plain hello (whose first byte is the frame magic's, 0xE7).
pub(crate) const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// How an engine authenticates its links: its certificate and key, and the CA roots its peers'
/// certificates must chain to.
///
/// Mutual TLS 1.3 on a link's control stream, and the data streams protected under keys derived
/// from that session ([`TlsConfig::data_protection`]).
///
/// The control stream carries everything a peer must not learn or forge without authenticating (the
/// region table with keys and addresses, engine ids, notifications, the RDMA queue-pair parameters
/// and rkeys). The data streams join with a proof derived from its session (see `ferry_proto::auth`),
/// so nobody joins a link without having held it, and by default every record on them carries an
/// AES-GCM tag under a key of that session ([`DataProtection::Integrity`]): nobody on the path can
/// change, inject or replay a byte unnoticed. Bulk data on a private fabric needs no secrecy from the
/// network, so it is not encrypted unless asked ([`DataProtection::Encrypted`], `--encrypt`).
///
/// Both sides present certificates, and each checks the other's against its own CA roots (rustls'
/// WebPKI verifiers). The initiator checks the target's certificate against the name it dials (the
/// IP address, unless [`TlsConfig::with_server_name`] names the DNS name the targets' certificates
/// carry). rustls with the `ring` provider: TLS 1.3 only, no session tickets (links are long-lived,
/// so resumption would save nothing and only widen what must be kept secret).
#[derive(Clone)]
pub struct TlsConfig {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    server_name: Option<ServerName<'static>>,
    data_protection: DataProtection,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("server_name", &self.server_name)
            .field("data_protection", &self.data_protection)
            .finish_non_exhaustive()
    }
}

/// A certificate authority made in memory, for development, tests and small clusters without a PKI:
/// it issues each engine a certificate for its name (and 127.0.0.1, for loopback), and
/// [`DevelopmentCa::config`] turns one into the engine's [`TlsConfig`]. Its key lives only in this
/// value: certificates for more engines later need the same value (or a new CA, trusted anew). `ferry
/// certs` writes such a CA's certificates to files.
///
/// ```
/// # fn main() -> ferry_core::Result<()> {
/// let ca = ferry_tcp::DevelopmentCa::new("my cluster CA")?;
/// let target = ca.config("decode-0")?; // EngineBuilder::tls(target) on one engine,
/// let initiator = ca.config("prefill-0")?; // EngineBuilder::tls(initiator) on the other
/// # Ok(()) }
/// ```
pub struct DevelopmentCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl std::fmt::Debug for DevelopmentCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevelopmentCa").finish_non_exhaustive()
    }
}

/// A certificate and its private key, PEM.
#[derive(Clone)]
pub struct IssuedPem {
    /// The certificate.
    pub cert: String,
    /// Its private key (PKCS#8).
    pub key: String,
}

impl std::fmt::Debug for IssuedPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedPem")
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

impl DevelopmentCa {
    /// A new CA, its common name `name`, with a fresh key.
    pub fn new(name: &str) -> Result<DevelopmentCa> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(rcgen_error)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().map_err(rcgen_error)?;
        Ok(DevelopmentCa {
            issuer: rcgen::CertifiedIssuer::self_signed(params, key).map_err(rcgen_error)?,
        })
    }

    /// A certificate for the engine `name` (its common name and first DNS name, what peers grant to),
    /// also valid for `alt_names` (DNS names or IP addresses it is dialled by) and 127.0.0.1.
    pub fn issue(&self, name: &str, alt_names: &[String]) -> Result<IssuedPem> {
        let mut sans = vec![name.to_string()];
        sans.extend(alt_names.iter().cloned());
        sans.push("127.0.0.1".into());
        sans.dedup();
        let mut params = rcgen::CertificateParams::new(sans)
            .map_err(|e| invalid(format!("{name:?} cannot name an engine in a certificate: {e}")))?;
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().map_err(rcgen_error)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(rcgen_error)?;
        Ok(IssuedPem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// The CA's certificate, PEM: what every engine trusts.
    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    /// An engine's configuration under this CA: a new certificate for `name`, and this CA as the
    /// only root its peers' certificates must chain to.
    pub fn config(&self, name: &str) -> Result<TlsConfig> {
        let issued = self.issue(name, &[])?;
        TlsConfig::from_pem(
            issued.cert.as_bytes(),
            issued.key.as_bytes(),
            self.cert_pem().as_bytes(),
        )
    }
}

/// What authenticating a stream established.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    /// Who the other end proved to be.
    pub(crate) identity: PeerIdentity,
    /// The link's key for stream join proofs.
    pub(crate) join_key: JoinKey,
}

impl TlsConfig {
    /// From PEM files: this engine's certificate chain (leaf first), its private key (PKCS#8, PKCS#1 or
    /// SEC1), and the CA certificates that its peers' certificates must chain to.
    pub fn from_pem_files(cert_chain: &Path, key: &Path, ca: &Path) -> Result<TlsConfig> {
        let read = |what: &str, path: &Path| {
            std::fs::read(path).map_err(|e| Error::io(format_args!("reading the {what} {}", path.display()), e))
        };
        TlsConfig::from_pem(
            &read("certificate chain", cert_chain)?,
            &read("private key", key)?,
            &read("CA certificates", ca)?,
        )
    }

    /// From PEM text: as [`from_pem_files`](Self::from_pem_files).
    pub fn from_pem(cert_chain: &[u8], key: &[u8], ca: &[u8]) -> Result<TlsConfig> {
        let certs = pem_certs(cert_chain, "certificate chain")?;
        let key = PrivateKeyDer::from_pem_reader(BufReader::new(key))
            .map_err(|e| invalid(format!("no usable private key in the key PEM: {e}")))?;
        let mut roots = RootCertStore::empty();
        for ca in pem_certs(ca, "CA certificates")? {
            roots
                .add(ca)
                .map_err(|e| invalid(format!("a CA certificate is not usable as a trust anchor: {e}")))?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| invalid(format!("the CA roots cannot verify client certificates: {e}")))?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| invalid(format!("TLS 1.3 with the ring provider: {e}")))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(|e| invalid(format!("the certificate and key do not make a server identity: {e}")))?;
        server.send_tls13_tickets = 0;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| invalid(format!("TLS 1.3 with the ring provider: {e}")))?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(|e| invalid(format!("the certificate and key do not make a client identity: {e}")))?;
        Ok(TlsConfig::from_rustls(Arc::new(server), Arc::new(client)))
    }

    /// Pre-shared-key mode, for clusters without a PKI: every engine given the same `psk` (at least
    /// 32 bytes, from a secure random source) admits every other, and nobody else. This engine is
    /// known to its peers as `name` (a DNS-style name), which any holder of the key could also claim:
    /// in this mode the key, not the name, is what is proven.
    ///
    /// How: rustls has no TLS 1.3 external-PSK mode, so the key becomes a certificate authority
    /// instead. An Ed25519 CA key is derived from the PSK (HKDF-SHA256), each engine issues itself a
    /// certificate with it at start, and links run the same mutual TLS as with a real PKI: a peer
    /// without the key cannot make a certificate that verifies. The certificates carry the fixed name
    /// [`PSK_SERVER_NAME`] that initiators check.
    pub fn from_psk(psk: &[u8], name: &str) -> Result<TlsConfig> {
        if psk.len() < 32 {
            return Err(invalid(format!(
                "a pre-shared key needs at least 32 bytes (256 bits) of random data, not {}",
                psk.len()
            )));
        }
        let salt = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, b"ferry psk ca v1");
        let mut seed = [0u8; 32];
        salt.extract(psk)
            .expand(&[b"ed25519 ca key"], ring::hkdf::HKDF_SHA256)
            .and_then(|okm| okm.fill(&mut seed))
            .map_err(|_| Error::Internal("deriving the CA key from the pre-shared key".into()))?;
        // PKCS#8 v1 of an Ed25519 private key: a fixed prefix, then the 32-byte seed (RFC 8410).
        let mut pkcs8 = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
        ];
        pkcs8.extend_from_slice(&seed);
        let ca_key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8.into(), &rcgen::PKCS_ED25519)
            .map_err(|e| Error::Internal(format!("the derived CA key: {e}")))?;
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(rcgen_error)?;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "ferry pre-shared-key CA");
        ca.not_before = rcgen::date_time_ymd(2025, 1, 1);
        ca.not_after = rcgen::date_time_ymd(2125, 1, 1);
        let ca = rcgen::CertifiedIssuer::self_signed(ca, ca_key).map_err(rcgen_error)?;
        let mut leaf = rcgen::CertificateParams::new(vec![name.to_string(), PSK_SERVER_NAME.to_string()])
            .map_err(|e| invalid(format!("{name:?} cannot name an engine in a certificate: {e}")))?;
        leaf.distinguished_name.push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().map_err(rcgen_error)?;
        let cert = leaf.signed_by(&key, &ca).map_err(rcgen_error)?;
        TlsConfig::from_pem(
            cert.pem().as_bytes(),
            key.serialize_pem().as_bytes(),
            ca.pem().as_bytes(),
        )?
        .with_server_name(PSK_SERVER_NAME)
    }

    /// From rustls configurations made elsewhere. The server side must require client certificates
    /// and the client side must present one: links are authenticated both ways, or not at all.
    pub fn from_rustls(server: Arc<ServerConfig>, client: Arc<ClientConfig>) -> TlsConfig {
        TlsConfig {
            server,
            client,
            server_name: None,
            data_protection: DataProtection::Integrity,
        }
    }

    /// The name the targets' certificates are checked against (a DNS name), instead of the IP address
    /// dialled.
    pub fn with_server_name(mut self, name: &str) -> Result<TlsConfig> {
        let name = ServerName::try_from(name.to_string())
            .map_err(|e| Error::InvalidArgument(format!("{name:?} is not a DNS name or IP address: {e}")))?;
        self.server_name = Some(name);
        Ok(self)
    }

    /// What protects the data streams of the links this engine dials, and the least a listening
    /// engine accepts on the links it admits (a stream that asks for less is refused, however well it
    /// proves its link). [`DataProtection::Integrity`] by default; [`DataProtection::Plain`] only
    /// where nobody can reach the network between the engines (and both ends must say so), and
    /// [`DataProtection::Encrypted`] where the bytes are secret. Protected bytes pay for AES-GCM and
    /// a copy on each side, and move through a buffer instead of straight between socket and region.
    pub fn data_protection(mut self, protection: DataProtection) -> TlsConfig {
        self.data_protection = protection;
        self
    }

    /// Encrypts the data streams too ([`DataProtection::Encrypted`]); `false` goes back to the
    /// default, [`DataProtection::Integrity`].
    pub fn encrypt_data(self, on: bool) -> TlsConfig {
        self.data_protection(match on {
            true => DataProtection::Encrypted,
            false => DataProtection::Integrity,
        })
    }

    /// What protects the data streams (see [`data_protection`](Self::data_protection)).
    pub fn protection(&self) -> DataProtection {
        self.data_protection
    }

    /// Whether the data streams are encrypted.
    pub fn encrypts_data(&self) -> bool {
        self.data_protection == DataProtection::Encrypted
    }

    /// Runs the target's side of the handshake on `tcp` (whose first byte is a TLS record).
    pub(crate) async fn accept(&self, tcp: TcpStream, peer: SocketAddr) -> Result<(TlsStream<TcpStream>, Session)> {
        let tls = TlsAcceptor::from(self.server.clone())
            .accept(tcp)
            .await
            .map_err(|e| handshake_failed(peer, e))?;
        let session = session_of(tls.get_ref().1, peer)?;
        Ok((TlsStream::Server(tls), session))
    }

    /// Runs the initiator's side of the handshake with the target at `peer`.
    pub(crate) async fn connect(&self, tcp: TcpStream, peer: SocketAddr) -> Result<(TlsStream<TcpStream>, Session)> {
        let name = self
            .server_name
            .clone()
            .unwrap_or_else(|| ServerName::IpAddress(peer.ip().into()));
        let tls = TlsConnector::from(self.client.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| handshake_failed(peer, e))?;
        let session = session_of(tls.get_ref().1, peer)?;
        Ok((TlsStream::Client(tls), session))
    }
}

fn session_of<D>(conn: &rustls::ConnectionCommon<D>, peer: SocketAddr) -> Result<Session> {
    let certs = conn
        .peer_certificates()
        .ok_or_else(|| Error::PermissionDenied(format!("{peer} presented no certificate")))?;
    let leaf = certs
        .first()
        .ok_or_else(|| Error::PermissionDenied(format!("{peer} presented no certificate")))?;
    let identity = identity_of(leaf)?;
    let secret = conn
        .export_keying_material([0u8; 32], JOIN_EXPORTER_LABEL, None)
        .map_err(|e| Error::Internal(format!("deriving the stream join key: {e}")))?;
    Ok(Session {
        identity,
        join_key: JoinKey::from_exported(&secret),
    })
}

/// The names in a certificate that verification accepted.
pub(crate) fn identity_of(cert: &CertificateDer<'_>) -> Result<PeerIdentity> {
    use x509_parser::extensions::GeneralName;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| Error::PermissionDenied(format!("the peer's certificate does not parse: {e}")))?;
    let subject = parsed.subject().to_string();
    let mut alt_names = Vec::new();
    if let Ok(Some(san)) = parsed.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(n) | GeneralName::URI(n) | GeneralName::RFC822Name(n) => {
                    alt_names.push((*n).to_string());
                }
                GeneralName::IPAddress(ip) => {
                    if let Ok(v4) = <[u8; 4]>::try_from(*ip) {
                        alt_names.push(std::net::Ipv4Addr::from(v4).to_string());
                    } else if let Ok(v6) = <[u8; 16]>::try_from(*ip) {
                        alt_names.push(std::net::Ipv6Addr::from(v6).to_string());
                    }
                }
                _ => {}
            }
        }
    }
    let common_name = parsed
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_string);
    let name = alt_names
        .first()
        .cloned()
        .or(common_name)
        .unwrap_or_else(|| subject.clone());
    Ok(PeerIdentity {
        name,
        subject,
        alt_names,
    })
}

fn pem_certs(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_reader_iter(BufReader::new(pem))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("the {what} PEM does not parse: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(format!("the {what} PEM holds no certificate")));
    }
    Ok(certs)
}

fn rcgen_error(e: rcgen::Error) -> Error {
    Error::Internal(format!("making a certificate: {e}"))
}

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

fn handshake_failed(peer: SocketAddr, e: std::io::Error) -> Error {
    Error::PermissionDenied(format!("the TLS handshake with {peer} failed: {e}"))
}
