//! Which data paths a link may take: the best one both ends offer ([`PathPolicy::Any`]), or only the
//! ones named ([`PathPolicy::Require`]), so that a deployment that counts on RDMA or on same-host
//! memory learns at `connect`, by a named error, that it would not get it, instead of from its
//! throughput weeks later.

use ferry_core::TransportKind;

/// Which data paths a link may take ([`EngineBuilder::path_policy`](crate::EngineBuilder::path_policy)
/// for the engine's links, [`Engine::connect_with`](crate::Engine::connect_with) for one).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PathPolicy {
    /// The best path both ends offer. What a better one was passed over for is in
    /// [`Peer::passed_over`](crate::Peer::passed_over), the log and the metrics.
    #[default]
    Any,
    /// One of these transports, tried best first, and nothing else. A link that could take none of
    /// them fails at `connect` with `Unsupported`, saying for each why not and on which side (not in
    /// this build, no device here, not offered by the peer, refused while setting up). A same-host
    /// path that could carry only some regions (the kernel denies cross-memory attach) counts as
    /// refused: the rest would go over TCP.
    Require(Vec<TransportKind>),
}

impl PathPolicy {
    /// Whether a link may take `kind`.
    pub fn allows(&self, kind: TransportKind) -> bool {
        match self {
            PathPolicy::Any => true,
            PathPolicy::Require(kinds) => kinds.contains(&kind),
        }
    }
}

impl std::str::FromStr for PathPolicy {
    type Err = ferry_core::Error;

    /// `any`, or transport names joined by commas (`rdma`, `shm,rdma`).
    fn from_str(s: &str) -> ferry_core::Result<Self> {
        if s.trim() == "any" {
            return Ok(PathPolicy::Any);
        }
        let kinds = s
            .split(',')
            .map(|k| k.trim().parse::<TransportKind>())
            .collect::<ferry_core::Result<Vec<_>>>()?;
        if kinds.is_empty() {
            return Err(ferry_core::Error::InvalidArgument(
                "a path policy is `any` or transport names (`rdma`, `shm,rdma`)".into(),
            ));
        }
        Ok(PathPolicy::Require(kinds))
    }
}

impl std::fmt::Display for PathPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathPolicy::Any => f.write_str("any"),
            PathPolicy::Require(kinds) => {
                let names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
                f.write_str(&names.join(","))
            }
        }
    }
}

/// How one link is set up ([`Engine::connect_using`](crate::Engine::connect_using)): the data paths
/// it may take and whether GPU memory may be staged on it. What is not set here is the engine's
/// ([`EngineBuilder::path_policy`](crate::EngineBuilder::path_policy),
/// [`EngineBuilder::stage_gpu_memory`](crate::EngineBuilder::stage_gpu_memory)).
///
/// ```
/// use ferry::{ConnectOptions, PathPolicy, TransportKind};
/// // RDMA or fail, and no GPU memory through a host copy on this link.
/// let options = ConnectOptions::new()
///     .paths(PathPolicy::Require(vec![TransportKind::Rdma]))
///     .stage_gpu_memory(false);
/// # let _ = options;
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// Which data paths the link may take; `None`: the engine's policy.
    pub paths: Option<PathPolicy>,
    /// Whether transfers on the link may move GPU memory through a host copy at either end; `None`:
    /// as the engine was built.
    pub stage_gpu_memory: Option<bool>,
}

impl ConnectOptions {
    /// The engine's settings.
    pub fn new() -> Self {
        ConnectOptions::default()
    }

    /// The data paths the link may take.
    pub fn paths(mut self, policy: PathPolicy) -> Self {
        self.paths = Some(policy);
        self
    }

    /// Whether GPU memory may be staged on the link: with `false`, a transfer that would move GPU
    /// memory through a host copy at either end fails at start with `Unsupported`, naming the
    /// descriptor and the route.
    pub fn stage_gpu_memory(mut self, allowed: bool) -> Self {
        self.stage_gpu_memory = Some(allowed);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        assert_eq!("any".parse::<PathPolicy>().unwrap(), PathPolicy::Any);
        let p: PathPolicy = "shm, rdma".parse().unwrap();
        assert_eq!(p, PathPolicy::Require(vec![TransportKind::Shm, TransportKind::Rdma]));
        assert_eq!(p.to_string(), "shm,rdma");
        assert!(p.allows(TransportKind::Rdma) && !p.allows(TransportKind::Tcp));
        assert!("carrier-pigeon".parse::<PathPolicy>().is_err());
    }
}
