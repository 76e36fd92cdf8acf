//! The scrape endpoint of `ferry serve --metrics ADDR`: `GET /metrics` answers the registry in the
//! OpenMetrics text format; every other request gets 404 or 405.
//!
//! One request per connection, then close: what a Prometheus scrape needs, and nothing a hostile
//! client can hold open. A request head is read up to 8 KiB and for at most 5 s, and at most 32
//! connections are served at once (more are closed at once). A full HTTP server library would bring
//! a dozen crates for this one answer.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry::prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

const MAX_HEAD: usize = 8 << 10;
const HEAD_DEADLINE: Duration = Duration::from_secs(5);
const MAX_CONNECTIONS: usize = 32;
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Binds `addr`; the endpoint's address.
pub async fn bind(addr: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("listening for metrics scrapes on {addr}"))
}

/// Serves scrapes of `registry` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>) {
    let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok((stream, from)) = listener.accept().await else {
            // Out of descriptors, say: let the condition pass.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            tracing::debug!(%from, "metrics: too many scrapes at once; closing");
            continue;
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(stream, &registry).await {
                tracing::debug!(%from, error = %e, "metrics: request not answered");
            }
            drop(permit);
        });
    }
}

/// Reads one request head and answers it.
async fn answer(mut stream: TcpStream, registry: &Registry) -> anyhow::Result<()> {
    let head = tokio::time::timeout(HEAD_DEADLINE, read_head(&mut stream))
        .await
        .context("the request head did not arrive in time")??;
    let (status, content_type, body) = respond(&head, registry);
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(reply.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await?;
    Ok(())
}

/// The bytes up to the blank line that ends a request head.
async fn read_head(stream: &mut TcpStream) -> anyhow::Result<Vec<u8>> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        anyhow::ensure!(head.len() < MAX_HEAD, "request head over {MAX_HEAD} bytes");
        let n = stream.read(&mut buf).await?;
        anyhow::ensure!(n > 0, "closed before the end of the request head");
        head.extend_from_slice(&buf[..n]);
    }
    Ok(head)
}

/// The status line, content type and body for a request head.
fn respond(head: &[u8], registry: &Registry) -> (&'static str, &'static str, String) {
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = std::str::from_utf8(line).unwrap_or_default().split(' ');
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let path = target.split('?').next().unwrap_or_default();
    match (method, path) {
        ("GET", "/metrics") => {
            let mut body = String::new();
            match ferry::prometheus_client::encoding::text::encode(&mut body, registry) {
                Ok(()) => ("200 OK", CONTENT_TYPE, body),
                Err(_) => (
                    "500 Internal Server Error",
                    "text/plain",
                    "encoding the metrics failed\n".into(),
                ),
            }
        }
        (_, "/metrics") => ("405 Method Not Allowed", "text/plain", "only GET\n".into()),
        _ => ("404 Not Found", "text/plain", "metrics are at /metrics\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_of_metrics_is_answered_with_the_registry() {
        let mut registry = Registry::default();
        let counter = ferry::prometheus_client::metrics::counter::Counter::<u64>::default();
        counter.inc_by(7);
        registry.register("things", "Things", counter);
        let (status, kind, body) = respond(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &registry);
        assert_eq!((status, kind), ("200 OK", CONTENT_TYPE));
        assert!(body.contains("things_total 7\n"), "{body}");
        assert!(body.ends_with("# EOF\n"), "{body}");
        assert_eq!(respond(b"GET /metrics?x=1 HTTP/1.1\r\n\r\n", &registry).0, "200 OK");
        assert_eq!(
            respond(b"POST /metrics HTTP/1.1\r\n\r\n", &registry).0,
            "405 Method Not Allowed"
        );
        assert_eq!(respond(b"GET / HTTP/1.1\r\n\r\n", &registry).0, "404 Not Found");
        assert_eq!(respond(b"\xff\xfe\r\n\r\n", &registry).0, "404 Not Found");
    }
}
