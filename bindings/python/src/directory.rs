//! The engines' directory a Python engine publishes itself in (`Engine(directory=...)`): ferry's
//! etcd directory where the wheel was built with the `etcd` feature, else a clear refusal naming
//! the feature (etcd-client's build needs `protoc`, so it is not in a default build).

use std::sync::Arc;
use std::time::Duration;

/// The key prefix of the records when `directory_prefix` is not given: `ferry serve`'s default.
pub const DEFAULT_PREFIX: &str = "/ferry";

/// Whether this build can publish engines in an etcd directory.
pub const COMPILED: bool = cfg!(feature = "etcd");

#[cfg(feature = "etcd")]
pub async fn connect(url: &str, prefix: &str, ttl: Duration) -> ferry::Result<Arc<dyn ferry::Directory>> {
    let options = ferry_etcd::EtcdOptions {
        ttl,
        ..Default::default()
    };
    let directory: Arc<dyn ferry::Directory> = ferry_etcd::EtcdDirectory::connect(url, prefix, options).await?;
    Ok(directory)
}

#[cfg(not(feature = "etcd"))]
pub async fn connect(url: &str, _prefix: &str, _ttl: Duration) -> ferry::Result<Arc<dyn ferry::Directory>> {
    Err(ferry::Error::Unsupported(format!(
        "directory {url}: this ferry package was built without the etcd directory; build it with \
         MATURIN_PEP517_ARGS=\"--features etcd\" pip install ./bindings/python (needs protoc)"
    )))
}
