//! The engine's side of a directory, with an in-memory directory: an engine publishes its record when
//! it starts and withdraws it when dropped, `connect_by_name` finds it, and a name without a
//! directory (or a published engine that does not listen) is refused when the engine is built.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry::{Directory, Engine, EngineRecord, Error, MemberEvent, Result};
use futures::future::BoxFuture;
use futures::stream::BoxStream;

const T: Duration = Duration::from_secs(10);

/// Records in a map shared by every engine's handle; each handle remembers what it published.
#[derive(Default)]
struct Memory {
    records: Arc<Mutex<HashMap<String, EngineRecord>>>,
    mine: Mutex<Option<String>>,
}

impl Memory {
    fn handle(&self) -> Arc<Memory> {
        Arc::new(Memory {
            records: self.records.clone(),
            mine: Mutex::default(),
        })
    }
}

impl Directory for Memory {
    fn publish(&self, record: EngineRecord) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let mut records = self.records.lock().unwrap();
            if records.contains_key(&record.name) {
                return Err(Error::AlreadyConnected(format!("{} is taken", record.name)));
            }
            *self.mine.lock().unwrap() = Some(record.name.clone());
            records.insert(record.name.clone(), record);
            Ok(())
        })
    }

    fn withdraw(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            if let Some(name) = self.mine.lock().unwrap().take() {
                self.records.lock().unwrap().remove(&name);
            }
            Ok(())
        })
    }

    fn lookup<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<EngineRecord>> {
        Box::pin(async move {
            self.records
                .lock()
                .unwrap()
                .get(name)
                .cloned()
                .ok_or_else(|| Error::NotConnected(format!("no {name}")))
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<EngineRecord>>> {
        Box::pin(async move { Ok(self.records.lock().unwrap().values().cloned().collect()) })
    }

    fn watch(&self) -> BoxFuture<'_, Result<BoxStream<'static, MemberEvent>>> {
        Box::pin(async move { Ok(Box::pin(futures::stream::empty()) as BoxStream<'static, MemberEvent>) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_publishes_itself_is_found_by_name_and_withdraws_when_dropped() {
    let directory = Memory::default();
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .name("decode-7")
        .directory(directory.handle())
        .build()
        .await
        .unwrap();
    let record = directory.records.lock().unwrap()["decode-7"].clone();
    assert_eq!(record, target.record());
    assert_eq!(record.addrs, [target.local_addr().unwrap().to_string()]);
    assert_eq!(record.protocol_version, ferry::codec::VERSION);

    let taken = Engine::builder()
        .listen("127.0.0.1:0")
        .name("decode-7")
        .directory(directory.handle())
        .build()
        .await
        .unwrap_err();
    assert!(matches!(taken, Error::AlreadyConnected(_)), "{taken}");

    let client = Engine::builder()
        .listen("127.0.0.1:0")
        .name("client")
        .directory(directory.handle())
        .build()
        .await
        .unwrap();
    let peer = client.connect_by_name("decode-7", T).await.unwrap();
    assert_eq!(peer.addr(), target.local_addr().unwrap());
    assert_eq!(client.list_members().await.unwrap().len(), 2);
    let missing = client.connect_by_name("nobody", T).await.unwrap_err();
    assert!(matches!(missing, Error::NotConnected(_)), "{missing}");

    drop(target);
    let deadline = tokio::time::Instant::now() + T;
    while directory.records.lock().unwrap().contains_key("decode-7") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the dropped engine stayed published"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn names_and_directories_come_together_on_a_listening_engine() {
    let directory = Memory::default();
    let no_listen = Engine::builder().name("x").directory(directory.handle()).build().await;
    assert!(matches!(no_listen, Err(Error::InvalidArgument(_))));
    let no_directory = Engine::builder().listen("127.0.0.1:0").name("x").build().await;
    assert!(matches!(no_directory, Err(Error::InvalidArgument(_))));
    let no_name = Engine::builder()
        .listen("127.0.0.1:0")
        .directory(directory.handle())
        .build()
        .await;
    assert!(matches!(no_name, Err(Error::InvalidArgument(_))));
    let plain = Engine::builder().build().await.unwrap();
    let none = plain.connect_by_name("x", T).await.unwrap_err();
    assert!(matches!(none, Error::InvalidArgument(_)), "{none}");
    assert!(directory.records.lock().unwrap().is_empty());
}

/// On authenticated engines `connect_by_name` binds the name to the identity the engine proves: a
/// forged record that publishes "prefill-0" at the address of the engine that proves "decode-7" is
/// refused, no link to it stays, and the true name still connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_record_does_not_send_an_authenticated_engine_elsewhere() {
    let key = [9u8; 32];
    let directory = Memory::default();
    let target = Engine::builder()
        .listen("127.0.0.1:0")
        .name("decode-7")
        .directory(directory.handle())
        .tls(ferry::TlsConfig::from_psk(&key, "decode-7").unwrap())
        .build()
        .await
        .unwrap();
    // Someone who can write the directory publishes another name at the same address.
    let mut forged = target.record();
    forged.name = "prefill-0".into();
    directory.records.lock().unwrap().insert("prefill-0".into(), forged);
    let client = Engine::builder()
        .listen("127.0.0.1:0")
        .name("client")
        .directory(directory.handle())
        .tls(ferry::TlsConfig::from_psk(&key, "client").unwrap())
        .build()
        .await
        .unwrap();
    let err = client.connect_by_name("prefill-0", T).await.unwrap_err();
    assert!(
        matches!(&err, Error::PermissionDenied(m) if m.contains("decode-7")),
        "{err}"
    );
    let deadline = tokio::time::Instant::now() + T;
    while target.link_count() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the refused link stayed open");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let peer = client.connect_by_name("decode-7", T).await.unwrap();
    assert_eq!(peer.identity().map(|i| i.name.as_str()), Some("decode-7"));
}
