//! The Grafana dashboard (`deploy/grafana/ferry-dashboard.json`) and the alert rules
//! (`deploy/prometheus/ferry-alerts.yml`) against what running engines export: a `ferry serve
//! --metrics` target scraped over HTTP, and an initiator's registry after writes, reads, a refused
//! transfer and notifications. Every metric a query names must be a family the engines register
//! (with the suffix its type gives its samples), and every label a query groups by or matches on must
//! be one those samples carry (`instance` and `job` are Prometheus's own), so that a renamed metric or
//! label breaks this test and not an operator's dashboard.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

use ferry::prometheus_client::registry::Registry;
use ferry::{Access, Engine, Notification, Op, TransferDesc};

const T: Duration = Duration::from_secs(10);

/// What a scrape says: each family's type, and the labels each sample name carries.
#[derive(Default, Debug)]
struct Scrape {
    types: BTreeMap<String, String>,
    labels: BTreeMap<String, BTreeSet<String>>,
}

impl Scrape {
    fn add(&mut self, text: &str) {
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut words = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                    self.types.insert(name.to_string(), kind.to_string());
                }
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let labels = self.labels.entry(line[..name_end].to_string()).or_default();
            if let Some(inner) = line[name_end..].strip_prefix('{').and_then(|r| r.split_once('}')) {
                for pair in inner.0.split(',') {
                    if let Some((label, _)) = pair.split_once('=') {
                        labels.insert(label.trim().to_string());
                    }
                }
            }
        }
    }

    /// Declares the counter families `registry.register("name", ...)` registers in `source` (the
    /// engine's metrics module) that the scrapes did not show.
    fn declare_registered(&mut self, source: &str) {
        let mut rest = source;
        while let Some(at) = rest.find("registry.register(") {
            rest = &rest[at..];
            let Some(open) = rest.find('"') else { break };
            let name_and_more = &rest[open + 1..];
            let Some(close) = name_and_more.find('"') else { break };
            let family = format!("ferry_{}", &name_and_more[..close]);
            // What the family is: the metric value passed last (`metrics.durations` is a histogram).
            let call_end = name_and_more.find(");").unwrap_or(name_and_more.len());
            let kind = if name_and_more[..call_end].contains("durations") {
                "histogram"
            } else {
                "counter"
            };
            self.types.entry(family).or_insert_with(|| kind.to_string());
            rest = &name_and_more[close..];
        }
    }

    /// The family a sample name belongs to, if the scrape declares it with that suffix.
    fn family_of(&self, name: &str) -> Option<&str> {
        if let Some((family, _)) = self.types.get_key_value(name)
            && self.types[family] == "gauge"
        {
            return Some(family);
        }
        for (suffix, kinds) in [
            ("_total", &["counter"][..]),
            ("_bucket", &["histogram"]),
            ("_sum", &["histogram"]),
            ("_count", &["histogram"]),
        ] {
            if let Some(base) = name.strip_suffix(suffix)
                && let Some((family, kind)) = self.types.get_key_value(base)
                && kinds.contains(&kind.as_str())
            {
                return Some(family);
            }
        }
        None
    }
}

fn http_get_metrics(addr: std::net::SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(T)).unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: ferry\r\n\r\n")
        .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    reply.split_once("\r\n\r\n").unwrap().1.to_string()
}

fn repo_file(path: &str) -> String {
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(path);
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()))
}

/// The PromQL expressions of the dashboard's panels.
fn dashboard_queries() -> Vec<(String, String)> {
    let dashboard: serde_json::Value = serde_json::from_str(&repo_file("deploy/grafana/ferry-dashboard.json")).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            queries.push((
                format!("panel `{}`", panel["title"].as_str().unwrap()),
                target["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    queries
}

/// The `expr` of each alert rule: on one line, or folded (`>-`) over the lines indented below it.
fn alert_queries() -> Vec<(String, String)> {
    let text = repo_file("deploy/prometheus/ferry-alerts.yml");
    let lines: Vec<&str> = text.lines().collect();
    let mut queries = Vec::new();
    let mut alert = String::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim_start();
        if let Some(name) = line.strip_prefix("- alert:") {
            alert = name.trim().to_string();
        }
        if let Some(rest) = line.strip_prefix("expr:") {
            let indent = lines[i].len() - line.len();
            let mut expr = rest.trim().to_string();
            if expr == ">-" || expr == ">" || expr == "|" {
                expr.clear();
                while i + 1 < lines.len() && lines[i + 1].len() - lines[i + 1].trim_start().len() > indent {
                    i += 1;
                    expr.push(' ');
                    expr.push_str(lines[i].trim());
                }
            }
            queries.push((format!("alert {alert}"), expr));
        }
        i += 1;
    }
    queries
}

/// Identifiers in `expr` that name ferry metrics.
fn metrics_in(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("ferry_") {
        let start = i + at;
        let end = start
            + expr[start..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(expr.len() - start);
        if start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_') {
            names.insert(expr[start..end].to_string());
        }
        i = end;
    }
    names
}

/// Labels `expr` groups by (`by (...)`) or matches on (`{...}`).
fn labels_in(expr: &str) -> BTreeSet<String> {
    let mut labels = BTreeSet::new();
    for (open, close, is_group) in [("by (", ')', true), ("{", '}', false)] {
        let mut rest = expr;
        while let Some(at) = rest.find(open) {
            let inner = &rest[at + open.len()..];
            let Some(end) = inner.find(close) else { break };
            for part in inner[..end].split(',') {
                let label = if is_group {
                    part.trim()
                } else {
                    part.split(['=', '!', '~']).next().unwrap_or("").trim()
                };
                if !label.is_empty() {
                    labels.insert(label.to_string());
                }
            }
            rest = &inner[end..];
        }
    }
    labels
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_of_the_dashboard_and_the_alerts_names_what_engines_export() {
    let mut cmd = common::serve_command("127.0.0.1:0", "1MiB");
    cmd.args(["--metrics", "127.0.0.1:0"]);
    let serve = common::start(cmd).expect("ferry serve starts");

    let mut registry = Registry::default();
    let engine = Engine::builder()
        .transports([ferry::TransportKind::Tcp])
        .metrics(&mut registry)
        .build()
        .await
        .unwrap();
    let src = engine.alloc_host(1 << 20, Access::READ_WRITE).unwrap();
    let peer = engine.connect(&serve.addr.to_string(), T).await.unwrap();
    let descs = [TransferDesc::new(src.addr(), serve.region, 64 << 10)];
    engine.transfer(&peer, Op::Write, &descs, T).await.unwrap();
    engine.transfer(&peer, Op::Read, &descs, T).await.unwrap();
    engine.notify(&peer, Notification::new("kv", "ready"), T).await.unwrap();

    let mut scrape = Scrape::default();
    scrape.add(&http_get_metrics(
        serve.metrics.expect("serve prints where its metrics are"),
    ));
    // The target hung (SIGSTOP): a batch posted that times out, counted by its error.
    // SAFETY: kill(2) on our child's pid, which it still is (the Serve guard reaps it on drop).
    assert_eq!(unsafe { libc::kill(serve.child.id() as i32, libc::SIGSTOP) }, 0);
    // A group stop begins only once one of the target's threads runs to take the signal: on a
    // loaded host another of its threads may answer the next request first. Wait until all stopped.
    wait_stopped(serve.child.id());
    let hung = engine
        .transfer(&peer, Op::Write, &descs, Duration::from_millis(300))
        .await;
    assert!(matches!(hung, Err(ferry::Error::Timeout(_))), "{hung:?}");
    drop(serve);
    // A family shows in a scrape only once it has a sample, and a passed-over data path needs a
    // better path that failed, which two engines on one host cannot stage: such families are
    // checked against what the engine registers (their labels cannot be).
    scrape.declare_registered(&repo_file("crates/ferry/src/metrics.rs"));
    let mut initiator = String::new();
    ferry::prometheus_client::encoding::text::encode(&mut initiator, &registry).unwrap();
    scrape.add(&initiator);

    let queries: Vec<_> = dashboard_queries().into_iter().chain(alert_queries()).collect();
    assert!(
        queries.len() >= 20,
        "the dashboard and the rules were not read: {queries:?}"
    );
    let alerts = queries.iter().filter(|(w, _)| w.starts_with("alert")).count();
    assert_eq!(alerts, 5, "{queries:?}");
    let mut problems = Vec::new();
    for (whose, expr) in &queries {
        let names = metrics_in(expr);
        if names.is_empty() {
            problems.push(format!("{whose}: no ferry metric in `{expr}`"));
        }
        for name in &names {
            if scrape.family_of(name).is_none() {
                problems.push(format!("{whose}: `{name}` is no metric the engines export"));
            }
        }
        for label in labels_in(expr) {
            if ["instance", "job", "le"].contains(&label.as_str()) {
                continue;
            }
            for name in &names {
                // A family with no samples in this scrape cannot be checked for labels.
                if let Some(have) = scrape.labels.get(name)
                    && !have.contains(&label)
                {
                    problems.push(format!("{whose}: `{name}` has no label `{label}` (it has {have:?})"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}\n{initiator}", problems.join("\n"));
    // The families the alerts are about were all seen with samples.
    for name in [
        "ferry_transfer_errors_total",
        "ferry_transfer_batches_total",
        "ferry_links_limit",
        "ferry_notifications_queued_bytes_limit",
    ] {
        assert!(scrape.labels.contains_key(name), "no sample of {name}: {initiator}");
    }
}

#[test]
fn the_query_parser_finds_metrics_and_labels() {
    let expr = r#"sum by (instance, peer) (rate(ferry_transfer_errors_total{instance=~"$instance",op!="read"}[5m])) / ferry_links_limit"#;
    assert_eq!(
        metrics_in(expr),
        ["ferry_links_limit", "ferry_transfer_errors_total"]
            .map(String::from)
            .into()
    );
    assert_eq!(labels_in(expr), ["instance", "op", "peer"].map(String::from).into());
    let mut scrape = Scrape::default();
    scrape.add("# TYPE ferry_x counter\nferry_x_total{peer=\"a\"} 1\n# TYPE ferry_h histogram\n# TYPE ferry_g gauge\nferry_g 3\n");
    assert_eq!(scrape.family_of("ferry_x_total"), Some("ferry_x"));
    assert_eq!(scrape.family_of("ferry_x"), None);
    assert_eq!(scrape.family_of("ferry_h_bucket"), Some("ferry_h"));
    assert_eq!(scrape.family_of("ferry_g"), Some("ferry_g"));
    assert_eq!(scrape.family_of("ferry_g_total"), None);
}

/// Waits (at most 10 s) until every thread of process `pid` is stopped (state `T` in
/// `/proc/PID/task/*/stat`).
fn wait_stopped(pid: u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let stopped = || -> bool {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return false;
        };
        tasks.flatten().all(|task| {
            std::fs::read_to_string(task.path().join("stat"))
                .ok()
                .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
                .unwrap_or(false)
        })
    };
    while !stopped() {
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} did not stop within 10 s of SIGSTOP"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
