//! `ferry serve --metrics`: a scrape over HTTP, from another process, after a known workload shows
//! the exact requests and bytes the target served, its links and region, and the notifications it
//! received; anything but
//! `GET /metrics` is refused, and an endless request head is cut off.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use ferry::{Access, Engine, Notification, Op, TransferDesc};

const T: Duration = Duration::from_secs(10);

/// One HTTP exchange: the request as given, the whole reply.
fn http(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(T)).unwrap();
    stream.write_all(request).unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    reply
}

fn value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_shows_what_the_target_holds_and_received() {
    let mut cmd = common::serve_command("127.0.0.1:0", "1MiB");
    cmd.args(["--metrics", "127.0.0.1:0"]);
    let serve = common::start(cmd).expect("ferry serve starts");
    let scrape_at = serve.metrics.expect("serve prints where its metrics are");

    // Over TCP: the streams this target's CPU serves (RDMA and mapped memory would bypass it).
    let engine = Engine::builder()
        .transports([ferry::TransportKind::Tcp])
        .build()
        .await
        .unwrap();
    let src = engine.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    let peer = engine.connect(&serve.addr.to_string(), T).await.unwrap();
    // Three writes of 16 KiB and two reads of 4 KiB, each small enough to go as one request.
    let write = [TransferDesc::new(src.addr(), serve.region, 16 << 10)];
    let read = [TransferDesc::new(src.addr(), serve.region, 4096)];
    for _ in 0..3 {
        engine.transfer(&peer, Op::Write, &write, T).await.unwrap();
    }
    for _ in 0..2 {
        engine.transfer(&peer, Op::Read, &read, T).await.unwrap();
    }
    for n in 0..4 {
        engine
            .notify(&peer, Notification::new("step", n.to_string()), T)
            .await
            .unwrap();
    }

    let reply = http(scrape_at, b"GET /metrics HTTP/1.1\r\nHost: ferry\r\n\r\n");
    let (head, body) = reply.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(head.contains("Content-Type: application/openmetrics-text"), "{head}");
    assert_eq!(value(body, "ferry_links_incoming"), Some(1.0), "{body}");
    assert_eq!(value(body, "ferry_regions"), Some(1.0), "{body}");
    assert_eq!(value(body, "ferry_registered_bytes"), Some((1 << 20) as f64), "{body}");
    assert_eq!(value(body, "ferry_notifications_received_total"), Some(4.0), "{body}");
    assert_eq!(value(body, "ferry_served_writes_total"), Some(3.0), "{body}");
    assert_eq!(
        value(body, "ferry_served_write_bytes_total"),
        Some((3 * (16 << 10)) as f64),
        "{body}"
    );
    assert_eq!(value(body, "ferry_served_reads_total"), Some(2.0), "{body}");
    assert_eq!(value(body, "ferry_served_read_bytes_total"), Some(8192.0), "{body}");
    assert!(body.ends_with("# EOF\n"), "{body}");

    assert!(http(scrape_at, b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    assert!(http(scrape_at, b"DELETE /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    // A head that never ends is cut off after 8 KiB, with no answer.
    let endless = vec![b'a'; 64 << 10];
    let mut stream = TcpStream::connect(scrape_at).unwrap();
    stream.set_read_timeout(Some(T)).unwrap();
    let _ = stream.write_all(&endless);
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    assert!(rest.is_empty(), "no answer to an endless head");
    // Still serving.
    assert!(http(scrape_at, b"GET /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200"));
}
