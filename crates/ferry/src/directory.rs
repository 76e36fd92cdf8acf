//! A directory of engines: where an engine publishes itself under a name, and where others find it.
//!
//! The engine only speaks this trait; a directory service implements it (`ferry-etcd` does, on etcd
//! with leases). With [`EngineBuilder::name`](crate::EngineBuilder::name) and
//! [`EngineBuilder::directory`](crate::EngineBuilder::directory), an engine publishes its
//! [`EngineRecord`] when it starts and withdraws it when it is dropped; a directory with leases also
//! drops the record of an engine that died. [`Engine::connect_by_name`](crate::Engine::connect_by_name)
//! looks a name up and connects, and [`Engine::members`](crate::Engine::members) follows joins and
//! leaves.
//!
//! A record says where an engine listens and what it speaks, never which regions it holds: region
//! addresses and keys travel only over the (authenticated) link.

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

use crate::Result;

/// What an engine publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineRecord {
    /// Its name in the directory ("decode-7").
    pub name: String,
    /// Addresses it listens on ("10.0.0.7:9955").
    pub addrs: Vec<String>,
    /// The transports it can use ("shm", "rdma", "tcp"), best first.
    pub transports: Vec<String>,
    /// Its host's id (engines on one host share it).
    pub host_id: String,
    /// The wire protocol version it speaks.
    pub protocol_version: u8,
    /// The engine's random id, new at every start.
    pub engine_id: String,
    /// Whether its links are authenticated (mutual TLS): a peer then needs a certificate it trusts.
    pub authenticated: bool,
}

/// A change in a directory's membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberEvent {
    /// An engine published its record (or published it again, after a restart).
    Joined(EngineRecord),
    /// The engine of this name withdrew, or its lease ran out.
    Left(String),
}

/// A directory service an engine publishes itself in (see the module documentation).
pub trait Directory: Send + Sync + 'static {
    /// Publishes `record` under its name, and keeps it published until
    /// [`withdraw`](Self::withdraw) (re-publishing it if the service loses it and comes back).
    /// `AlreadyConnected` when a live engine holds the name.
    fn publish(&self, record: EngineRecord) -> BoxFuture<'_, Result<()>>;

    /// Withdraws what [`publish`](Self::publish) published.
    fn withdraw(&self) -> BoxFuture<'_, Result<()>>;

    /// The record published under `name`; `NotConnected` when there is none.
    fn lookup<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<EngineRecord>>;

    /// Every record published now.
    fn list(&self) -> BoxFuture<'_, Result<Vec<EngineRecord>>>;

    /// Joins and leaves from now on.
    fn watch(&self) -> BoxFuture<'_, Result<BoxStream<'static, MemberEvent>>>;
}
