//! The directory against a real etcd on loopback (Debian's `etcd`, which `cargo xtask test` installs):
//! engines publish and find each other by name; a name a live engine holds is refused; an engine
//! killed with SIGKILL leaves within its lease and watchers see it leave; with etcd stopped, links
//! keep transferring and lookups fail with a named error in time, and once etcd is back the records
//! are there again, even where etcd came back empty.

mod etcd;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd::Etcd;
use ferry::{Access, Directory, Engine, Error, MemberEvent, Op, TransferDesc};
use ferry_etcd::{EtcdDirectory, EtcdOptions};
use futures::StreamExt;

const T: Duration = Duration::from_secs(10);
/// Short leases, so that the tests wait seconds, not the default's ten.
const TTL: Duration = Duration::from_secs(3);

fn options() -> EtcdOptions {
    EtcdOptions {
        ttl: TTL,
        timeout: Duration::from_secs(2),
        ..Default::default()
    }
}

async fn named(etcd: &Etcd, prefix: &str, name: &str) -> ferry::Result<Engine> {
    etcd::publish(&etcd.url(), prefix, name, options()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_publish_and_find_each_other_by_name() {
    let Some(etcd) = Etcd::start() else { return };
    let names = ["prefill-0", "decode-0", "decode-1"];
    let mut engines = Vec::new();
    for name in names {
        engines.push(named(&etcd, "/find", name).await.unwrap());
    }
    let listed = etcd::member_names(&engines[0]).await.unwrap();
    assert_eq!(listed, ["decode-0", "decode-1", "prefill-0"]);
    let record = &engines[1]
        .list_members()
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.name == "decode-1")
        .unwrap();
    assert_eq!(record.addrs, [engines[2].local_addr().unwrap().to_string()]);
    assert_eq!(record.transports, ["tcp"]);
    assert!(!record.authenticated);

    // Each finds the others by name and moves bytes to them.
    let region = engines[2].alloc_host(4096, Access::READ_WRITE).unwrap();
    let src = engines[0].register(vec![7u8; 4096], Access::READ_WRITE).unwrap();
    let peer = engines[0].connect_by_name("decode-1", T).await.unwrap();
    assert_eq!(peer.addr(), engines[2].local_addr().unwrap());
    let deadline = Instant::now() + T;
    while !peer.regions().iter().any(|r| r.key == region.key()) {
        assert!(Instant::now() < deadline);
        peer.regions_changed(Duration::from_millis(50)).await;
    }
    engines[0]
        .transfer(
            &peer,
            Op::Write,
            &[TransferDesc::new(src.addr(), region.addr(), 4096)],
            T,
        )
        .await
        .unwrap();
    assert_eq!(region.to_vec().unwrap(), vec![7u8; 4096]);
    engines[1].connect_by_name("prefill-0", T).await.unwrap();

    let missing = engines[0].connect_by_name("nobody", T).await.unwrap_err();
    assert!(matches!(missing, Error::NotConnected(_)), "{missing}");

    // A name a live engine holds is refused, and the holder keeps it.
    let taken = named(&etcd, "/find", "decode-0").await.unwrap_err();
    assert!(matches!(taken, Error::AlreadyConnected(_)), "{taken}");
    let record = engines[1]
        .list_members()
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.name == "decode-0")
        .unwrap();
    assert_eq!(record.addrs, [engines[1].local_addr().unwrap().to_string()]);

    // Dropping an engine withdraws it at once, and the name is free again.
    drop(engines.remove(1));
    let deadline = Instant::now() + T;
    while etcd::member_names(&engines[0])
        .await
        .unwrap()
        .contains(&"decode-0".to_string())
    {
        assert!(Instant::now() < deadline, "the dropped engine's record stayed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    named(&etcd, "/find", "decode-0").await.unwrap();
}

/// The child's part of the SIGKILL tests: an engine published under the name in
/// `FERRY_ETCD_CHILD` ("URL NAME [LISTEN]"), until it is killed. Does nothing in a normal run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_engine() {
    let Ok(spec) = std::env::var("FERRY_ETCD_CHILD") else {
        return;
    };
    let mut words = spec.split(' ');
    let (url, name) = (words.next().unwrap(), words.next().unwrap());
    let listen = words.next().unwrap_or("127.0.0.1:0");
    let directory = EtcdDirectory::connect(url, "/kill", options()).await.unwrap();
    let _engine = Engine::builder()
        .listen(listen)
        .name(name)
        .directory(directory)
        .build()
        .await
        .unwrap();
    println!("published");
    tokio::time::sleep(Duration::from_secs(600)).await;
}

/// Starts `child_engine` as its own process, published as `name` (listening on `listen`), and waits
/// until it says it is.
fn published_child(etcd: &Etcd, name: &str, listen: &str) -> std::process::Child {
    use std::io::BufRead;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_engine", "--nocapture"])
        .env("FERRY_ETCD_CHILD", format!("{} {name} {listen}", etcd.url()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.contains("published"))),
        "the child engine did not publish itself"
    );
    child
}

/// A supervisor restarts a crashed engine at once, on its address: the new engine takes its name back
/// though the dead one's lease has not run out, and keeps it after that lease runs out; an engine
/// elsewhere is still refused the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_on_its_address_takes_its_name_back_at_once() {
    let Some(etcd) = Etcd::start() else { return };
    let listen = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().to_string()
    };
    let mut child = published_child(&etcd, "phoenix", &listen);
    let directory = EtcdDirectory::connect(&etcd.url(), "/kill", options()).await.unwrap();
    let before = directory.lookup("phoenix").await.unwrap();
    // SAFETY: kill(2) on our own child's pid, which it still is (not yet reaped).
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGKILL) }, 0);
    let _ = child.wait();
    let killed = Instant::now();

    let elsewhere = EtcdDirectory::connect(&etcd.url(), "/kill", options()).await.unwrap();
    let refused = Engine::builder()
        .listen("127.0.0.1:0")
        .name("phoenix")
        .directory(elsewhere)
        .build()
        .await
        .unwrap_err();
    assert!(matches!(refused, Error::AlreadyConnected(_)), "{refused}");

    let again = EtcdDirectory::connect(&etcd.url(), "/kill", options()).await.unwrap();
    let restarted = Engine::builder()
        .listen(&listen)
        .name("phoenix")
        .directory(again)
        .build()
        .await
        .expect("the restarted engine takes its name back");
    assert!(killed.elapsed() < TTL, "the test was too slow to prove anything");
    let after = directory.lookup("phoenix").await.unwrap();
    assert_ne!(after.engine_id, before.engine_id);
    assert_eq!(after, restarted.record());
    // The dead engine's lease runs out; the record, on the new engine's lease, stays.
    tokio::time::sleep(TTL + Duration::from_secs(1)).await;
    assert_eq!(directory.lookup("phoenix").await.unwrap(), restarted.record());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_leaves_within_its_lease() {
    let Some(etcd) = Etcd::start() else { return };
    let watcher = {
        let directory = EtcdDirectory::connect(&etcd.url(), "/kill", options()).await.unwrap();
        Engine::builder()
            .listen("127.0.0.1:0")
            .name("watcher")
            .directory(directory)
            .build()
            .await
            .unwrap()
    };
    let mut events = watcher.members().await.unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_engine", "--nocapture"])
        .env("FERRY_ETCD_CHILD", format!("{} victim", etcd.url()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let joined = tokio::time::timeout(T * 3, async {
        loop {
            match events.next().await {
                Some(MemberEvent::Joined(r)) if r.name == "victim" => return r,
                Some(_) => {}
                None => panic!("the watch ended"),
            }
        }
    })
    .await
    .expect("the child published itself");
    let peer = watcher.connect_by_name("victim", T).await.unwrap();
    assert_eq!(peer.addr().to_string(), joined.addrs[0]);

    // SAFETY: kill(2) on our own child's pid, which it still is (not yet reaped).
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGKILL) }, 0);
    let killed = Instant::now();
    let left = tokio::time::timeout(TTL + Duration::from_secs(2), async {
        loop {
            match events.next().await {
                Some(MemberEvent::Left(name)) if name == "victim" => return,
                Some(_) => {}
                None => panic!("the watch ended"),
            }
        }
    })
    .await;
    let _ = child.wait();
    assert!(left.is_ok(), "no leave event within the lease ({TTL:?}) + 2 s");
    eprintln!(
        "the killed engine left the directory {:?} after SIGKILL",
        killed.elapsed()
    );
    let gone = watcher.connect_by_name("victim", T).await.unwrap_err();
    assert!(matches!(gone, Error::NotConnected(_)), "{gone}");
    // The link saw it too.
    let deadline = Instant::now() + T;
    while !peer.is_closed() {
        assert!(Instant::now() < deadline, "the link outlived the killed engine");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_etcd_links_keep_working_and_records_come_back() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("ferry_etcd=debug")
        .with_test_writer()
        .try_init();
    let Some(mut etcd) = Etcd::start() else { return };
    let a = named(&etcd, "/outage", "a").await.unwrap();
    let b = named(&etcd, "/outage", "b").await.unwrap();
    let peer = a.connect_by_name("b", T).await.unwrap();
    let region = b.alloc_host(4096, Access::READ_WRITE).unwrap();
    let src = Arc::new(a.register(vec![3u8; 4096], Access::READ_WRITE).unwrap());
    let deadline = Instant::now() + T;
    while !peer.regions().iter().any(|r| r.key == region.key()) {
        assert!(Instant::now() < deadline);
        peer.regions_changed(Duration::from_millis(50)).await;
    }
    let descs = [TransferDesc::new(src.addr(), region.addr(), 4096)];
    let write = || a.transfer(&peer, Op::Write, &descs, T);

    etcd.stop();
    write().await.expect("the link does not need etcd");
    let started = Instant::now();
    let lookup = a.connect_by_name("b", Duration::from_secs(3)).await.unwrap_err();
    assert!(
        matches!(lookup, Error::Timeout(_) | Error::NotConnected(_)) && lookup.to_string().contains("etcd"),
        "{lookup}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the lookup ended in its time"
    );
    // Longer than a lease: etcd keeps leases across its own restart, and the engines refresh theirs.
    tokio::time::sleep(TTL + Duration::from_secs(1)).await;
    write().await.unwrap();

    etcd.run();
    wait_for_both(&a).await;
    eprintln!("back after a restart");

    // etcd back empty (its data lost, or a new cluster): the engines publish themselves again.
    etcd.stop();
    std::fs::remove_dir_all(&etcd.dir).unwrap();
    etcd.run();
    wait_for_both(&a).await;
    // And they stay: still there after more than a lease.
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(a.list_members().await.unwrap().len(), 2);
    // Found again: the lookup reaches b, to which a is connected already.
    let again = a.connect_by_name("b", T).await.unwrap_err();
    assert!(matches!(again, Error::AlreadyConnected(_)), "{again}");
}

/// Waits until the directory lists engines a and b again.
async fn wait_for_both(a: &Engine) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let names = etcd::member_names(a).await.unwrap_or_default();
        if names == ["a", "b"] {
            return;
        }
        assert!(Instant::now() < deadline, "the records did not come back: {names:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
