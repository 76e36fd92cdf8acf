//! # ferry-etcd
//!
//! A directory of ferry engines on etcd ([`ferry::Directory`]): an engine publishes its record
//! (name, listen addresses, transports, host, protocol version, whether it authenticates; never its
//! regions) under `<prefix>/engines/<name>`, attached to a lease it keeps alive, and others look it
//! up by name and follow joins and leaves with a watch.
//!
//! ```no_run
//! # async fn run() -> ferry::Result<()> {
//! use std::time::Duration;
//! let directory = ferry_etcd::EtcdDirectory::connect("etcd://10.0.0.2:2379", "/ferry", Default::default()).await?;
//! let engine = ferry::Engine::builder()
//!     .listen("0.0.0.0:9955")
//!     .name("decode-7")
//!     .directory(directory)
//!     .build()
//!     .await?;
//! let prefill = engine.connect_by_name("prefill-0", Duration::from_secs(5)).await?;
//! # Ok(()) }
//! ```
//!
//! - **Leases**: the record lives as long as its lease ([`EtcdOptions::ttl`], 10 s by default); the
//!   engine refreshes it every third of that. An engine that dies (SIGKILL, a lost host) leaves the
//!   directory when the lease runs out, and every watcher sees it leave.
//! - **Names are held, not overwritten**: a record is created only where none exists (an etcd
//!   transaction on the key's create revision); a name a live engine holds is refused with
//!   `AlreadyConnected`. An engine restarted on its old address (same host, same addresses: its
//!   predecessor, which held them, must be dead) takes its name back at once; one elsewhere can
//!   publish once the old lease ran out.
//! - **etcd unreachable**: links keep working (the directory is not on the data path); lookups fail
//!   with `Timeout` or `NotConnected` naming etcd within [`EtcdOptions::timeout`]; the engine keeps
//!   trying, and publishes its record again when etcd answers.
//! - **Fail closed**: `etcds://` URLs use TLS (with [`EtcdOptions::tls`] for the CA and a client
//!   certificate) and never fall back to plaintext; [`EtcdOptions::user`] authenticates with a user
//!   and password, and a refusal is an error, not an anonymous session.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity, PutOptions, TlsOptions,
    Txn, TxnOp, WatchOptions,
};
use ferry::{Directory, EngineRecord, Error, MemberEvent, Result};
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

/// How an engine talks to etcd.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// How long a record outlives its engine's last refresh.
    pub ttl: Duration,
    /// The bound on each request to etcd (and on connecting).
    pub timeout: Duration,
    /// User and password, where etcd has authentication on.
    pub user: Option<(String, String)>,
    /// For `etcds://` URLs: the CA that signed etcd's certificate (PEM), and the client certificate
    /// and key (PEM) where etcd asks for one.
    pub tls: Option<EtcdTls>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            ttl: DEFAULT_TTL,
            timeout: Duration::from_secs(5),
            user: None,
            tls: None,
        }
    }
}

/// The default lease of a record.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

/// TLS to etcd.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// The CA certificate (PEM).
    pub ca_pem: Vec<u8>,
    /// A client certificate and its key (PEM), where etcd checks clients.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

/// The engines' directory on etcd (see the crate documentation). One per published engine: it holds
/// that engine's lease.
pub struct EtcdDirectory {
    client: Client,
    /// `<prefix>/engines/`.
    prefix: String,
    endpoints: String,
    options: EtcdOptions,
    published: Mutex<Option<Published>>,
}

struct Published {
    key: String,
    /// Keeps the lease alive and publishes again after etcd comes back.
    keeper: tokio::task::JoinHandle<()>,
    lease: Arc<std::sync::atomic::AtomicI64>,
}

impl std::fmt::Debug for EtcdDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDirectory")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl Drop for EtcdDirectory {
    fn drop(&mut self) {
        if let Ok(Some(p)) = self.published.get_mut().map(Option::take) {
            // The lease runs out by itself.
            p.keeper.abort();
        }
    }
}

/// Parses `etcd://h:2379[,h:2379]` (or `etcds://` for TLS) into endpoint URLs and whether TLS is on.
pub fn parse_url(url: &str) -> Result<(Vec<String>, bool)> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad_url(url))?;
    let tls = match scheme {
        "etcd" => false,
        "etcds" => true,
        _ => return Err(bad_url(url)),
    };
    let rest = rest.trim_end_matches('/');
    let hosts: Vec<String> = rest
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| format!("{}://{h}", if tls { "https" } else { "http" }))
        .collect();
    if hosts.is_empty() || rest.contains('/') {
        return Err(bad_url(url));
    }
    Ok((hosts, tls))
}

fn bad_url(url: &str) -> Error {
    Error::InvalidArgument(format!(
        "directory URL `{url}`: expected etcd://HOST:PORT[,HOST:PORT...] (or etcds:// for TLS)"
    ))
}

/// An etcd failure as ferry's error: etcd down or slow is `NotConnected`/`Timeout` naming etcd.
fn etcd_error(endpoints: &str, what: &str, e: etcd_client::Error) -> Error {
    let text = e.to_string();
    match e {
        etcd_client::Error::GRpcStatus(s) if s.code() == tonic::Code::DeadlineExceeded => {
            Error::Timeout(format!("etcd at {endpoints}: {what}: {text}"))
        }
        // etcd refuses a missing user or a wrong password as an invalid argument.
        etcd_client::Error::GRpcStatus(s)
            if matches!(s.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied)
                || ["user name is empty", "authentication failed", "permission denied"]
                    .iter()
                    .any(|m| s.message().contains(m)) =>
        {
            Error::PermissionDenied(format!("etcd at {endpoints}: {what}: {text}"))
        }
        _ => Error::NotConnected(format!(
            "etcd at {endpoints}: {what}: {text} (is etcd running and reachable?)"
        )),
    }
}

impl EtcdDirectory {
    /// Connects to the etcd cluster at `url` (`etcd://h:2379[,h:2379]`, `etcds://` for TLS), with
    /// records under `prefix`.
    pub async fn connect(url: &str, prefix: &str, options: EtcdOptions) -> Result<Arc<Self>> {
        let (endpoints, tls) = parse_url(url)?;
        let mut connect = ConnectOptions::new()
            .with_timeout(options.timeout)
            .with_connect_timeout(options.timeout)
            .with_keep_alive(options.timeout, options.timeout);
        if let Some((user, password)) = &options.user {
            connect = connect.with_user(user.clone(), password.clone());
        }
        match (tls, &options.tls) {
            (true, Some(t)) => {
                let mut config = TlsOptions::new().ca_certificate(Certificate::from_pem(&t.ca_pem));
                if let Some((cert, key)) = &t.client {
                    config = config.identity(Identity::from_pem(cert, key));
                }
                connect = connect.with_tls(config);
            }
            (true, None) => connect = connect.with_tls(TlsOptions::new()),
            (false, Some(_)) => {
                return Err(Error::InvalidArgument(format!(
                    "TLS options for the plaintext directory URL {url}: use etcds://"
                )));
            }
            (false, None) => {}
        }
        let shown = endpoints.join(",");
        let client = tokio::time::timeout(options.timeout, Client::connect(&endpoints, Some(connect)))
            .await
            .map_err(|_| Error::Timeout(format!("connecting to etcd at {shown} took over {:?}", options.timeout)))?
            .map_err(|e| etcd_error(&shown, "connecting", e))?;
        Ok(Arc::new(EtcdDirectory {
            client,
            prefix: format!("{}/engines/", prefix.trim_end_matches('/')),
            endpoints: shown,
            options,
            published: Mutex::new(None),
        }))
    }

    fn key(&self, name: &str) -> Result<String> {
        if name.is_empty() || name.contains('/') {
            return Err(Error::InvalidArgument(format!(
                "engine name `{name}`: it must be non-empty and contain no `/`"
            )));
        }
        Ok(format!("{}{name}", self.prefix))
    }

    fn parse(&self, value: &[u8]) -> Result<EngineRecord> {
        serde_json::from_slice(value).map_err(|e| {
            Error::Protocol(format!(
                "a record in etcd at {} is not an engine record: {e}",
                self.endpoints
            ))
        })
    }

    async fn lookup_record(&self, name: &str) -> Result<EngineRecord> {
        let key = self.key(name)?;
        let reply = self
            .client
            .clone()
            .get(key, None)
            .await
            .map_err(|e| etcd_error(&self.endpoints, &format!("looking up {name}"), e))?;
        match reply.kvs().first() {
            Some(kv) => self.parse(kv.value()),
            None => Err(Error::NotConnected(format!(
                "no engine named {name} in the directory at {}",
                self.endpoints
            ))),
        }
    }

    async fn list_records(&self) -> Result<Vec<EngineRecord>> {
        let reply = self
            .client
            .clone()
            .get(self.prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| etcd_error(&self.endpoints, "listing the engines", e))?;
        reply.kvs().iter().map(|kv| self.parse(kv.value())).collect()
    }

    async fn publish_record(&self, record: EngineRecord) -> Result<()> {
        let key = self.key(&record.name)?;
        let value =
            serde_json::to_vec(&record).map_err(|e| Error::Internal(format!("encoding the engine record: {e}")))?;
        let old = self
            .published
            .lock()
            .map_err(|_| Error::Internal("directory lock poisoned".into()))?
            .take();
        if let Some(old) = old {
            old.keeper.abort();
        }
        let lease = claim(
            &self.client,
            &self.endpoints,
            &key,
            &value,
            &record.name,
            self.options.ttl,
        )
        .await?;
        let lease = Arc::new(std::sync::atomic::AtomicI64::new(lease));
        let keeper = tokio::spawn(keep(
            self.client.clone(),
            self.endpoints.clone(),
            key.clone(),
            value,
            record.name.clone(),
            self.options.ttl,
            lease.clone(),
        ));
        tracing::info!(name = %record.name, etcd = %self.endpoints, "engine published in the directory");
        *self
            .published
            .lock()
            .map_err(|_| Error::Internal("directory lock poisoned".into()))? = Some(Published { key, keeper, lease });
        Ok(())
    }

    async fn withdraw_record(&self) -> Result<()> {
        let Some(p) = self
            .published
            .lock()
            .map_err(|_| Error::Internal("directory lock poisoned".into()))?
            .take()
        else {
            return Ok(());
        };
        p.keeper.abort();
        let lease = p.lease.load(std::sync::atomic::Ordering::Acquire);
        // Revoking the lease deletes the record with it.
        self.client
            .clone()
            .lease_revoke(lease)
            .await
            .map_err(|e| etcd_error(&self.endpoints, &format!("withdrawing {}", p.key), e))?;
        Ok(())
    }

    async fn watch_records(&self) -> Result<BoxStream<'static, MemberEvent>> {
        // From the revision of a read now: a watch that breaks resumes from the last event seen.
        let start = self
            .client
            .clone()
            .get(
                self.prefix.clone(),
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await
            .map_err(|e| etcd_error(&self.endpoints, "watching the engines", e))?
            .header()
            .map_or(0, |h| h.revision());
        let state = WatchState {
            client: self.client.clone(),
            prefix: self.prefix.clone(),
            next: start + 1,
            stream: None,
            pending: Default::default(),
        };
        Ok(futures::stream::unfold(state, next_event).boxed())
    }
}

/// Puts `key` on a new lease where no record exists, where the record is this engine's own (its lease
/// was lost while etcd was away), or where it is a dead predecessor's (see [`is_predecessor`]);
/// `AlreadyConnected` where a live engine's record is.
async fn claim(client: &Client, endpoints: &str, key: &str, value: &[u8], name: &str, ttl: Duration) -> Result<i64> {
    let mut client = client.clone();
    let ttl_s = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    let lease = client
        .lease_grant(ttl_s, None)
        .await
        .map_err(|e| etcd_error(endpoints, "granting a lease", e))?
        .id();
    let put = TxnOp::put(key, value.to_vec(), Some(PutOptions::new().with_lease(lease)));
    let mine: Option<EngineRecord> = serde_json::from_slice(value).ok();
    let mut holder = String::new();
    // Each round reads what holds the name and puts ours only if that is still what holds it; a
    // record that changed or vanished in between is read again (a lease running out right then).
    for _ in 0..4 {
        let current = client
            .get(key, None)
            .await
            .map_err(|e| etcd_error(endpoints, &format!("publishing {name}"), e))?;
        let compare = match current.kvs().first() {
            None => Compare::create_revision(key, CompareOp::Equal, 0),
            Some(kv) => {
                let theirs: Option<EngineRecord> = serde_json::from_slice(kv.value()).ok();
                let ours = kv.value() == value;
                let dead = matches!((&theirs, &mine), (Some(t), Some(m)) if is_predecessor(t, m));
                if !ours && !dead {
                    holder = String::from_utf8_lossy(kv.value()).into_owned();
                    break;
                }
                if dead {
                    tracing::info!(%name, etcd = %endpoints, "taking the name over from this engine's dead predecessor");
                }
                Compare::mod_revision(key, CompareOp::Equal, kv.mod_revision())
            }
        };
        let reply = client
            .txn(Txn::new().when([compare]).and_then([put.clone()]))
            .await
            .map_err(|e| etcd_error(endpoints, &format!("publishing {name}"), e))?;
        if reply.succeeded() {
            return Ok(lease);
        }
    }
    let _ = client.lease_revoke(lease).await;
    Err(Error::AlreadyConnected(format!(
        "the name {name} is held by a live engine in the directory at {endpoints} ({holder}); pick another name, \
         or stop that engine (a dead one's record goes when its lease runs out, within {ttl:?})"
    )))
}

/// Whether `old`, the record that holds a name, was published by a dead predecessor of the engine
/// publishing `new`: an engine of the same host (`host_id`) that published exactly the addresses this
/// one listens on now. Two live engines cannot listen on one address, so the one that published
/// them is gone, though its lease has not run out yet: a supervisor restarting a crashed engine at
/// once (same name, same port) takes its name back instead of being refused for a lease's length.
/// The rule assumes the host's engines do not reuse one address in different network namespaces
/// under one name.
fn is_predecessor(old: &EngineRecord, new: &EngineRecord) -> bool {
    let specific = |addrs: &[String]| {
        !addrs.is_empty()
            && addrs.iter().all(|a| {
                a.parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| a.port() != 0 && !a.ip().is_unspecified())
            })
    };
    let sorted = |addrs: &[String]| {
        let mut a = addrs.to_vec();
        a.sort();
        a
    };
    old.name == new.name
        && old.host_id == new.host_id
        && old.engine_id != new.engine_id
        && specific(&new.addrs)
        && sorted(&old.addrs) == sorted(&new.addrs)
}

/// Refreshes the lease every third of `ttl`. When refreshing fails (etcd away), tries every second:
/// to refresh the same lease again, or, once etcd says it expired, to publish the record on a new one.
async fn keep(
    client: Client,
    endpoints: String,
    key: String,
    value: Vec<u8>,
    name: String,
    ttl: Duration,
    lease: Arc<std::sync::atomic::AtomicI64>,
) {
    let period = ttl / 3;
    loop {
        let id = lease.load(std::sync::atomic::Ordering::Acquire);
        let outcome = match refresh(&client, id, period).await {
            // Why: etcd away, or answering without the lease (it lost its data, or a new cluster).
            Refresh::Failed => lease_state(&client, id).await,
            expired => expired,
        };
        match outcome {
            Refresh::Failed => {
                tracing::warn!(%name, etcd = %endpoints, "refreshing the directory lease failed; trying again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Refresh::Expired => match claim(&client, &endpoints, &key, &value, &name, ttl).await {
                Ok(id) => {
                    lease.store(id, std::sync::atomic::Ordering::Release);
                    tracing::info!(%name, etcd = %endpoints, "engine published in the directory again");
                }
                Err(e @ Error::AlreadyConnected(_)) => {
                    // Another engine took the name while this one's lease was gone: it stays unpublished.
                    tracing::error!(error = %e, "the engine's name was taken while its lease was gone");
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "etcd still unreachable");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            },
        }
    }
}

/// Why [`refresh`] stopped.
enum Refresh {
    /// etcd did not answer.
    Failed,
    /// etcd says the lease is gone.
    Expired,
}

/// Whether etcd still has lease `id` (`Failed` while etcd does not answer).
async fn lease_state(client: &Client, id: i64) -> Refresh {
    match client.clone().lease_time_to_live(id, None).await {
        // etcd answers -1 for a lease it does not have.
        Ok(r) if r.ttl() <= 0 => Refresh::Expired,
        Ok(_) => Refresh::Failed,
        Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::NotFound => Refresh::Expired,
        Err(_) => Refresh::Failed,
    }
}

/// Keeps lease `id` alive every `period` until a refresh fails or etcd says the lease is gone.
async fn refresh(client: &Client, id: i64, period: Duration) -> Refresh {
    let Ok((mut keeper, mut replies)) = client.clone().lease_keep_alive(id).await else {
        return Refresh::Failed;
    };
    loop {
        if keeper.keep_alive().await.is_err() {
            return Refresh::Failed;
        }
        match tokio::time::timeout(period, replies.message()).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => {}
            // A TTL of 0: the lease expired (or etcd never had it).
            Ok(Ok(Some(_))) => return Refresh::Expired,
            _ => return Refresh::Failed,
        }
        tokio::time::sleep(period).await;
    }
}

struct WatchState {
    client: Client,
    prefix: String,
    /// The revision to resume from.
    next: i64,
    stream: Option<etcd_client::WatchStream>,
    pending: std::collections::VecDeque<MemberEvent>,
}

/// The next join or leave; re-watches from the last revision seen when the watch breaks.
async fn next_event(mut st: WatchState) -> Option<(MemberEvent, WatchState)> {
    loop {
        if let Some(event) = st.pending.pop_front() {
            return Some((event, st));
        }
        if st.stream.is_none() {
            let options = WatchOptions::new().with_prefix().with_start_revision(st.next);
            match st.client.watch(st.prefix.clone(), Some(options)).await {
                Ok(stream) => st.stream = Some(stream),
                Err(e) => {
                    tracing::debug!(error = %e, "watching the directory; trying again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            }
        }
        let Some(stream) = st.stream.as_mut() else { continue };
        match stream.message().await {
            Ok(Some(reply)) => {
                for event in reply.events() {
                    let Some(kv) = event.kv() else { continue };
                    st.next = st.next.max(kv.mod_revision() + 1);
                    let name = String::from_utf8_lossy(kv.key())
                        .trim_start_matches(st.prefix.as_str())
                        .to_string();
                    match event.event_type() {
                        EventType::Put => match serde_json::from_slice::<EngineRecord>(kv.value()) {
                            Ok(record) => st.pending.push_back(MemberEvent::Joined(record)),
                            Err(e) => {
                                tracing::warn!(%name, error = %e, "a record in the directory is not an engine record")
                            }
                        },
                        EventType::Delete => st.pending.push_back(MemberEvent::Left(name)),
                    }
                }
                if reply.canceled() {
                    st.stream = None;
                }
            }
            Ok(None) | Err(_) => {
                st.stream = None;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

impl Directory for EtcdDirectory {
    fn publish(&self, record: EngineRecord) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.publish_record(record))
    }

    fn withdraw(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.withdraw_record())
    }

    fn lookup<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<EngineRecord>> {
        Box::pin(self.lookup_record(name))
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<EngineRecord>>> {
        Box::pin(self.list_records())
    }

    fn watch(&self) -> BoxFuture<'_, Result<BoxStream<'static, MemberEvent>>> {
        Box::pin(self.watch_records())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(engine_id: &str, addrs: &[&str]) -> EngineRecord {
        EngineRecord {
            name: "prefill-0".into(),
            addrs: addrs.iter().map(|a| a.to_string()).collect(),
            transports: vec!["tcp".into()],
            host_id: "h1".into(),
            protocol_version: 8,
            engine_id: engine_id.into(),
            authenticated: false,
        }
    }

    #[test]
    fn only_a_record_of_this_host_on_exactly_these_addresses_is_a_dead_predecessor() {
        let new = record("new", &["10.0.0.7:7000"]);
        assert!(is_predecessor(&record("old", &["10.0.0.7:7000"]), &new));
        // Itself (its own lease lost): not a predecessor, it is handled as its own record.
        assert!(!is_predecessor(&record("new", &["10.0.0.7:7000"]), &new));
        // Elsewhere: another port, another address, another host, another name.
        assert!(!is_predecessor(&record("old", &["10.0.0.7:7001"]), &new));
        assert!(!is_predecessor(&record("old", &["10.0.0.8:7000"]), &new));
        assert!(!is_predecessor(
            &record("old", &["10.0.0.7:7000", "10.0.1.7:7000"]),
            &new
        ));
        let mut other_host = record("old", &["10.0.0.7:7000"]);
        other_host.host_id = "h2".into();
        assert!(!is_predecessor(&other_host, &new));
        let mut other_name = record("old", &["10.0.0.7:7000"]);
        other_name.name = "prefill-1".into();
        assert!(!is_predecessor(&other_name, &new));
        // Addresses that do not say where it listens prove nothing.
        assert!(!is_predecessor(&record("old", &[]), &record("new", &[])));
        assert!(!is_predecessor(
            &record("old", &["0.0.0.0:7000"]),
            &record("new", &["0.0.0.0:7000"])
        ));
        // Order does not matter.
        assert!(is_predecessor(
            &record("old", &["10.0.1.7:7000", "10.0.0.7:7000"]),
            &record("new", &["10.0.0.7:7000", "10.0.1.7:7000"])
        ));
    }

    #[test]
    fn urls_name_etcd_and_say_whether_tls_is_on() {
        assert_eq!(
            parse_url("etcd://10.0.0.2:2379,10.0.0.3:2379").unwrap(),
            (
                vec!["http://10.0.0.2:2379".to_string(), "http://10.0.0.3:2379".to_string()],
                false
            )
        );
        assert_eq!(
            parse_url("etcds://e:2379/").unwrap(),
            (vec!["https://e:2379".to_string()], true)
        );
        for bad in ["http://e:2379", "e:2379", "etcd://", "etcd://e:2379/x"] {
            assert!(matches!(parse_url(bad), Err(Error::InvalidArgument(_))), "{bad}");
        }
    }
}
