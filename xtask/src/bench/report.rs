//! `cargo xtask bench --report DIR`: the run as a page a reader takes in at a glance.
//!
//! `DIR/index.html` shows, from one run: every comparison's ratio against its target
//! (`ratios.svg`), throughput against transfer size for ferry and each peer per transport
//! (`throughput-tcp.svg`, `throughput-shm.svg`), round-trip latency percentiles (`latency.svg`), each
//! plot followed by its figures as a table, then the text table and the commands. `report.json`
//! holds the same figures. Plots are SVG with their text as `<text>` elements, so that a test reads
//! them back and a browser needs no fonts of ours.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;

use super::sweep::{Latency, Series, Sweep, Transport};

/// A comparison's target, where it is a bound on the ratio.
#[derive(Clone, Copy, Debug, Serialize)]
pub enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

/// One row of the table, as the ratio plot shows it.
#[derive(Clone, Debug, Serialize)]
pub struct RowFigure {
    pub id: String,
    pub name: String,
    pub ratio: Option<f64>,
    pub bound: Option<Bound>,
    /// `ok`, `MISSED`, `info` or `ERROR`.
    pub status: String,
}

/// Where and when the run was taken.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Meta {
    pub commit: String,
    pub date: String,
    pub host: String,
    pub rounds: u32,
    pub duration: String,
}

impl Meta {
    /// This checkout and machine, as far as `git`, `date` and `uname` say (blank where they fail).
    pub fn here(rounds: u32, duration: &str) -> Self {
        let out = |cmd: &str, args: &[&str]| {
            std::process::Command::new(cmd)
                .args(args)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                .unwrap_or_default()
        };
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        Meta {
            commit: out("git", &["rev-parse", "--short", "HEAD"]),
            date: out("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
            host: format!("{}, {cores} cores", out("uname", &["-srm"])),
            rounds,
            duration: duration.into(),
        }
    }
}

const PALETTE: [RGBColor; 4] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
];
const OK: RGBColor = RGBColor(0x2c, 0xa0, 0x2c);
const MISSED: RGBColor = RGBColor(0xd6, 0x27, 0x28);
const INFO: RGBColor = RGBColor(0x99, 0x99, 0x99);

/// The plots, in the order the page shows them: file, title, and a note on how to read it.
const PLOTS: &[(&str, &str, &str)] = &[
    (
        "ratios.svg",
        "Where ferry stands: every comparison's ratio against its target",
        "Each bar is one row of the table below: ferry's figure over its peer's, measured in the same rounds.",
    ),
    (
        "throughput-tcp.svg",
        "TCP: throughput against transfer size (one stream)",
        "Writes of one size, one TCP stream, over loopback; ferry with 8 transfers in flight. iperf3 writes at most \
         1 MiB per call, so its curve ends there.",
    ),
    (
        "throughput-shm.svg",
        "Shared memory: throughput against transfer size",
        "Two processes on this host; one core's memcpy of the same size is the ceiling for a copy.",
    ),
    (
        "latency.svg",
        "Round trip of 64 bytes, p50 and p99",
        "One message at a time. sockperf and UCX print one-way figures, shown doubled; UCX prints no p99.",
    ),
];

/// Writes `index.html`, `report.json`, `table.txt` and the plots under `dir`.
pub fn write(dir: &Path, meta: &Meta, table: &str, rows: &[RowFigure], sweep: &Sweep) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tcp: Vec<&Series> = sweep.series.iter().filter(|s| s.transport == Transport::Tcp).collect();
    let shm: Vec<&Series> = sweep.series.iter().filter(|s| s.transport == Transport::Shm).collect();
    ratios(&dir.join(PLOTS[0].0), rows).context("drawing ratios.svg")?;
    throughput(&dir.join(PLOTS[1].0), PLOTS[1].1, &tcp).context("drawing throughput-tcp.svg")?;
    throughput(&dir.join(PLOTS[2].0), PLOTS[2].1, &shm).context("drawing throughput-shm.svg")?;
    latency(&dir.join(PLOTS[3].0), &sweep.latency).context("drawing latency.svg")?;
    let json = serde_json::json!({ "meta": meta, "rows": rows, "sweep": sweep });
    std::fs::write(dir.join("report.json"), serde_json::to_vec_pretty(&json)?)?;
    std::fs::write(dir.join("table.txt"), table)?;
    std::fs::write(dir.join("index.html"), page(meta, table, rows, sweep, &tcp, &shm))?;
    Ok(())
}

/// `4096` → `4 KiB`, `1048576` → `1 MiB`.
pub fn human_size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn area(path: &Path, size: (u32, u32)) -> Result<DrawingArea<SVGBackend<'_>, Shift>> {
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    Ok(root)
}

fn throughput(path: &Path, title: &str, series: &[&Series]) -> Result<()> {
    let root = area(path, (900, 480))?;
    // x is log2 of the size, so that the axis is labelled at each power of two.
    let xs = || series.iter().flat_map(|s| s.points.iter().map(|p| (p.0 as f64).log2()));
    let lo = xs().fold(f64::INFINITY, f64::min);
    let hi = xs().fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo, hi)
    } else {
        (12.0, 22.0)
    };
    let top = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.1, f64::max)
        * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(lo - 0.3..hi + 0.3, 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("bytes per transfer")
        .y_desc("GB/s")
        .x_labels((hi - lo) as usize + 2)
        .x_label_formatter(&|x| match (x - x.round()).abs() < 0.01 {
            true => human_size(2f64.powf(x.round()) as u64),
            false => String::new(),
        })
        .draw()?;
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let points: Vec<(f64, f64)> = s.points.iter().map(|&(b, gb)| ((b as f64).log2(), gb)).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(points.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present()?;
    Ok(())
}

/// One figure of a system's latency.
type Pick = fn(&Latency) -> Option<f64>;

/// The series' names in a box at `position`.
fn legend<'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    position: SeriesLabelPosition,
) -> Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    Ok(())
}

/// Horizontal bars, one pair (p50, p99) per system; a system without a p99 shows its p50 alone.
fn latency(path: &Path, systems: &[Latency]) -> Result<()> {
    let n = systems.len().max(1);
    let root = area(path, (900, 90 + 46 * n as u32))?;
    let top = systems
        .iter()
        .flat_map(|l| [l.p50_us, l.p99_us])
        .flatten()
        .fold(1.0, f64::max)
        * 1.12;
    let names: Vec<String> = systems.iter().map(|l| l.name.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption("Round trip of 64 bytes (lower is better)", ("sans-serif", 18))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(210)
        .build_cartesian_2d(0f64..top, -0.5f64..n as f64 - 0.5)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&|y| label_at(&names, *y))
        .x_desc("microseconds")
        .draw()?;
    // p50 above each system's row, p99 below it, each bar labelled with its figure.
    let percentiles: [(&str, Pick, f64); 2] = [("p50", |l| l.p50_us, 0.17), ("p99", |l| l.p99_us, -0.17)];
    for (k, (label, pick, offset)) in percentiles.into_iter().enumerate() {
        let color = PALETTE[k];
        let bars: Vec<(f64, f64)> = systems
            .iter()
            .enumerate()
            .filter_map(|(i, l)| Some((pick(l)?, i as f64 + offset)))
            .collect();
        chart
            .draw_series(
                bars.iter()
                    .map(|&(v, y)| Rectangle::new([(0.0, y - 0.15), (v, y + 0.15)], color.filled())),
            )?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
        chart.draw_series(
            bars.iter()
                .map(|&(v, y)| Text::new(format!("{v:.1}"), (v, y + 0.08), ("sans-serif", 11))),
        )?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    root.present()?;
    Ok(())
}

/// The name of the bar at `y` (bars sit at whole numbers); blank between bars.
fn label_at(names: &[String], y: f64) -> String {
    let i = y.round();
    match (y - i).abs() < 0.01 && i >= 0.0 {
        true => names.get(i as usize).cloned().unwrap_or_default(),
        false => String::new(),
    }
}

/// One bar per comparison with a ratio, on a log scale around 1, coloured by whether it met its
/// target; the target is a black tick on the bar's row.
fn ratios(path: &Path, rows: &[RowFigure]) -> Result<()> {
    let shown: Vec<&RowFigure> = rows.iter().filter(|r| r.ratio.is_some_and(|r| r > 0.0)).collect();
    let n = shown.len().max(1);
    let root = area(path, (1000, 90 + 22 * n as u32))?;
    let values = || {
        shown.iter().flat_map(|r| {
            [
                r.ratio,
                r.bound.map(|b| match b {
                    Bound::AtLeast(t) | Bound::AtMost(t) => t,
                }),
            ]
        })
    };
    let lo = values().flatten().fold(0.5, f64::min) / 1.3;
    let hi = values().flatten().fold(2.0, f64::max) * 1.3;
    // Top row first, as in the table.
    let names: Vec<String> = shown.iter().rev().map(|r| short_name(r)).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "ferry / peer, each comparison (ticks: targets; green met, red missed, grey informational)",
            ("sans-serif", 16),
        )
        .margin(14)
        .x_label_area_size(36)
        .y_label_area_size(430)
        .build_cartesian_2d((lo..hi).log_scale(), -0.5f64..n as f64 - 0.5)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&|y| label_at(&names, *y))
        .y_label_style(("sans-serif", 11))
        .x_desc("ratio (log scale)")
        .draw()?;
    let row_y = |i: usize| (n - 1 - i) as f64;
    chart.draw_series(shown.iter().enumerate().filter_map(|(i, r)| {
        let color = match r.status.as_str() {
            "ok" => OK,
            "MISSED" => MISSED,
            _ => INFO,
        };
        let y = row_y(i);
        Some(Rectangle::new(
            [(lo, y - 0.32), (r.ratio?, y + 0.32)],
            color.mix(0.8).filled(),
        ))
    }))?;
    chart.draw_series(shown.iter().enumerate().filter_map(|(i, r)| {
        let t = match r.bound? {
            Bound::AtLeast(t) | Bound::AtMost(t) => t,
        };
        let y = row_y(i);
        Some(PathElement::new(
            vec![(t, y - 0.45), (t, y + 0.45)],
            BLACK.stroke_width(2),
        ))
    }))?;
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(1.0, -0.5), (1.0, n as f64 - 0.5)],
        BLACK.mix(0.4),
    )))?;
    root.present()?;
    Ok(())
}

fn short_name(r: &RowFigure) -> String {
    let full = format!("{}. {}", r.id, r.name);
    match full.chars().count() > 64 {
        true => format!("{}…", full.chars().take(63).collect::<String>()),
        false => full,
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn page(meta: &Meta, table: &str, rows: &[RowFigure], sweep: &Sweep, tcp: &[&Series], shm: &[&Series]) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>ferry bench report</title>\n\
         <style>body{{font-family:sans-serif;max-width:1040px;margin:2em auto;color:#222}}\
         table{{border-collapse:collapse;margin:.5em 0 2em}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}\
         th:first-child,td:first-child{{text-align:left}}pre{{font-size:12px;overflow-x:auto}}img{{max-width:100%}}\
         .missed{{color:#d62728}}</style></head><body>\n\
         <h1>ferry beside its peers</h1>\n<p>Commit {}, {}, on {}. {} round(s) of {} per measurement; every figure is the median over \
         the rounds, each ferry figure measured in the same round as the peer it is compared with.</p>\n",
        escape(&meta.commit),
        escape(&meta.date),
        escape(&meta.host),
        meta.rounds,
        escape(&meta.duration)
    );
    let missed: Vec<String> = rows
        .iter()
        .filter(|r| r.status == "MISSED")
        .map(|r| escape(&format!("{}. {}", r.id, r.name)))
        .collect();
    let met = rows.iter().filter(|r| r.status == "ok").count();
    let _ = writeln!(
        h,
        "<p>{met} target(s) met, {} missed{}.</p>",
        missed.len(),
        match missed.is_empty() {
            true => String::new(),
            false => format!(": <span class=\"missed\">{}</span>", missed.join("; ")),
        }
    );
    for (file, title, note) in PLOTS {
        let _ = write!(
            h,
            "<h2>{}</h2>\n<p>{}</p>\n<img src=\"{file}\" alt=\"{}\">\n",
            escape(title),
            escape(note),
            escape(title)
        );
        match *file {
            "throughput-tcp.svg" => series_table(&mut h, tcp),
            "throughput-shm.svg" => series_table(&mut h, shm),
            "latency.svg" => latency_table(&mut h, &sweep.latency),
            _ => {}
        }
    }
    if !sweep.errors.is_empty() {
        h += "<h2>Measurements that failed</h2>\n<ul>\n";
        for e in &sweep.errors {
            let _ = writeln!(h, "<li>{}</li>", escape(e));
        }
        h += "</ul>\n";
    }
    let _ = write!(
        h,
        "<h2>The table</h2>\n<pre>{}</pre>\n<p>The same figures: <a href=\"report.json\">report.json</a>, \
         <a href=\"table.txt\">table.txt</a>.</p>\n</body></html>\n",
        escape(table)
    );
    h
}

fn series_table(h: &mut String, series: &[&Series]) {
    let sizes: std::collections::BTreeSet<u64> = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).collect();
    *h += "<table><tr><th>GB/s</th>";
    for &b in &sizes {
        let _ = write!(h, "<th>{}</th>", human_size(b));
    }
    *h += "</tr>\n";
    for s in series {
        let _ = write!(h, "<tr><td title=\"{}\">{}</td>", escape(&s.command), escape(&s.name));
        for b in &sizes {
            match s.points.iter().find(|p| p.0 == *b) {
                Some(p) => {
                    let _ = write!(h, "<td>{:.2}</td>", p.1);
                }
                None => *h += "<td>-</td>",
            }
        }
        *h += "</tr>\n";
    }
    *h += "</table>\n";
}

fn latency_table(h: &mut String, systems: &[Latency]) {
    *h += "<table><tr><th>64 B round trip</th><th>p50 us</th><th>p99 us</th></tr>\n";
    let show = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    for l in systems {
        let _ = writeln!(
            h,
            "<tr><td title=\"{}\">{}</td><td>{}</td><td>{}</td></tr>",
            escape(&l.command),
            escape(&l.name),
            show(l.p50_us),
            show(l.p99_us)
        );
    }
    *h += "</table>\n";
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep() -> Sweep {
        let series = |name: &str, transport, scale: f64| Series {
            name: name.into(),
            transport,
            command: format!("{name} --size SIZE"),
            points: (0..6).map(|i| (4096u64 << (2 * i), scale * (i + 1) as f64)).collect(),
        };
        Sweep {
            rounds: 1,
            series: vec![
                series("ferry, two processes", Transport::Tcp, 1.0),
                series("iperf3", Transport::Tcp, 0.5),
                series("ferry, two processes", Transport::Shm, 4.0),
                series("memcpy, one core", Transport::Shm, 8.0),
            ],
            latency: vec![
                Latency {
                    name: "ferry TCP, two processes".into(),
                    command: "ferry bench".into(),
                    p50_us: Some(40.0),
                    p99_us: Some(90.0),
                },
                Latency {
                    name: "UCX am_lat (posix,cma)".into(),
                    command: "ucx_perftest".into(),
                    p50_us: Some(2.0),
                    p99_us: None,
                },
            ],
            errors: vec!["UCX put_bw 4KiB: <refused>".into()],
        }
    }

    fn rows() -> Vec<RowFigure> {
        let row = |id: &str, ratio, bound, status: &str| RowFigure {
            id: id.into(),
            name: format!("comparison {id}"),
            ratio,
            bound,
            status: status.into(),
        };
        vec![
            row("a", Some(1.05), Some(Bound::AtLeast(1.0)), "ok"),
            row("b", Some(0.4), Some(Bound::AtLeast(0.8)), "MISSED"),
            row("e", Some(1.3), Some(Bound::AtMost(1.5)), "ok"),
            row("v", Some(6.0), None, "info"),
            row("x", None, Some(Bound::AtLeast(1.0)), "ERROR"),
        ]
    }

    fn svg(dir: &Path, file: &str) -> String {
        std::fs::read_to_string(dir.join(file)).unwrap()
    }

    /// The `<text>` contents of an SVG, parsed as XML (which fails on a malformed file).
    fn texts(doc: &roxmltree::Document) -> Vec<String> {
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| {
                let text: String = n
                    .descendants()
                    .filter(|t| t.is_text())
                    .filter_map(|t| t.text())
                    .collect();
                text.trim().to_owned()
            })
            .collect()
    }

    /// The (x, y) pixel points of every polyline in the SVG.
    fn polylines(doc: &roxmltree::Document) -> Vec<Vec<(f64, f64)>> {
        doc.descendants()
            .filter(|n| n.has_tag_name("polyline"))
            .filter_map(|n| n.attribute("points"))
            .map(|p| {
                p.split_whitespace()
                    .filter_map(|xy| {
                        let (x, y) = xy.split_once(',')?;
                        Some((x.parse().ok()?, y.parse().ok()?))
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn the_report_draws_every_series_and_names_it() {
        let dir = std::env::temp_dir().join(format!("ferry-bench-report-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let meta = Meta {
            commit: "abc1234".into(),
            ..Meta::default()
        };
        write(&dir, &meta, "the <table>", &rows(), &sweep()).unwrap();

        let tcp = svg(&dir, "throughput-tcp.svg");
        let doc = roxmltree::Document::parse(&tcp).expect("throughput-tcp.svg is XML");
        let t = texts(&doc);
        for name in ["ferry, two processes", "iperf3", "4 KiB", "4 MiB", "GB/s"] {
            assert!(t.iter().any(|x| x == name), "{name} missing from {t:?}");
        }
        assert!(
            !t.iter().any(|x| x == "memcpy, one core"),
            "a shm series on the TCP plot"
        );
        // One line of six points per series, left to right; ferry's rises (smaller y is higher)
        // and stays above iperf3's, whose figures are half of it at every size.
        let lines: Vec<_> = polylines(&doc).into_iter().filter(|l| l.len() == 6).collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        let (ferry, iperf3) = (&lines[0], &lines[1]);
        assert!(
            ferry.windows(2).all(|w| w[1].0 > w[0].0 && w[1].1 < w[0].1),
            "{ferry:?}"
        );
        assert!(ferry.iter().zip(iperf3).all(|(f, i)| f.0 == i.0 && f.1 < i.1));

        let shm = svg(&dir, "throughput-shm.svg");
        let doc = roxmltree::Document::parse(&shm).expect("throughput-shm.svg is XML");
        assert!(texts(&doc).iter().any(|x| x == "memcpy, one core"));

        let lat = svg(&dir, "latency.svg");
        let doc = roxmltree::Document::parse(&lat).expect("latency.svg is XML");
        let t = texts(&doc);
        for name in [
            "ferry TCP, two processes",
            "UCX am_lat (posix,cma)",
            "p50",
            "p99",
            "90.0",
            "2.0",
        ] {
            assert!(t.iter().any(|x| x == name), "{name} missing from {t:?}");
        }

        let ratios = svg(&dir, "ratios.svg");
        let doc = roxmltree::Document::parse(&ratios).expect("ratios.svg is XML");
        let t = texts(&doc);
        // Every row with a ratio has a bar and a label; the one without is left out, not drawn
        // as zero.
        for name in [
            "a. comparison a",
            "b. comparison b",
            "e. comparison e",
            "v. comparison v",
        ] {
            assert!(t.iter().any(|x| x == name), "{name} missing from {t:?}");
        }
        assert!(!t.iter().any(|x| x.starts_with("x. ")));
        let missed = format!("{:02X}{:02X}{:02X}", MISSED.0, MISSED.1, MISSED.2);
        assert_eq!(ratios.matches(&format!("#{missed}")).count(), 1, "one missed bar");

        let html = std::fs::read_to_string(dir.join("index.html")).unwrap();
        for (file, _, _) in PLOTS {
            assert!(html.contains(&format!("src=\"{file}\"")), "{file} not on the page");
        }
        assert!(html.contains("the &lt;table&gt;"), "the table is escaped");
        assert!(html.contains("&lt;refused&gt;"), "errors are listed");
        assert!(html.contains("1 missed"), "{html}");
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
        assert_eq!(json["sweep"]["series"].as_array().map(Vec::len), Some(4));
        assert_eq!(json["meta"]["commit"], "abc1234");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(1 << 20), "1 MiB");
        assert_eq!(human_size(64), "64 B");
        assert_eq!(human_size(1536), "1536 B");
    }
}
