//! What a run leaves behind: a table on stdout, `summary.json`, and `timeline.svg` (throughput per
//! second, each fault shaded from its start to its healing).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;

use crate::conduct::Log;
use crate::schedule::{Fleet, Schedule};
use crate::verdict::Verdict;

/// Writes `summary.json` and `timeline.svg` under `out`; returns the table.
pub fn write(
    out: &Path,
    schedule: &Schedule,
    fleet: &Fleet,
    v: &Verdict,
    log: &Log,
    t0: f64,
    end_ms: f64,
) -> Result<String> {
    let duration_s = (end_ms - t0) / 1e3;
    let summary = serde_json::json!({
        "seed": schedule.seed,
        "engines": fleet.engines,
        "prefill": fleet.prefill,
        "lease_s": fleet.ttl.as_secs_f64(),
        "duration_s": duration_s,
        "faults_injected": v.faults.len(),
        "verdict": v,
        "passed": v.violations.is_empty(),
        "restarts": log.events.iter().filter(|(_, _, e)| matches!(e, crate::event::Event::Ready { .. })).count().saturating_sub(fleet.engines),
    });
    std::fs::write(out.join("summary.json"), serde_json::to_vec_pretty(&summary)?)?;
    plot(&out.join("timeline.svg"), v, duration_s).context("drawing timeline.svg")?;

    let mut t = String::new();
    let _ = writeln!(
        t,
        "\n{:<44} {:>7} {:>7} {:>10} {:>10} {:>8}",
        "fault", "at s", "heal s", "before MB/s", "back in s", "left s"
    );
    for f in &v.faults {
        let _ = writeln!(
            t,
            "{:<44} {:>7.1} {:>7.1} {:>10.1} {:>10} {:>8}",
            f.fault,
            f.at_s,
            f.heal_s,
            f.before_mb_s,
            f.recovery_s.map_or("never".into(), |r| format!("{r:.0}")),
            f.left_directory_s.map_or("-".into(), |r| format!("{r:.1}")),
        );
    }
    let failed: u64 = v.failures.values().sum();
    let _ = writeln!(
        t,
        "\npulls: {} ok ({:.1} GB checked, {} notifications delivered), {failed} failed {:?}; corrupt {}; late {} (worst overrun {:.0} ms)",
        v.transfers_ok,
        v.bytes_ok as f64 / 1e9,
        v.notifications_delivered,
        v.failures,
        v.corrupt,
        v.late,
        v.worst_overrun_ms
    );
    if !v.resources.is_empty() {
        let shown: Vec<String> = v
            .resources
            .iter()
            .map(|g| {
                format!(
                    "{} fds {}→{} threads {}→{} RSS {}→{} MiB",
                    g.name,
                    g.fds.0,
                    g.fds.1,
                    g.threads.0,
                    g.threads.1,
                    g.rss_kib.0 / 1024,
                    g.rss_kib.1 / 1024
                )
            })
            .collect();
        let _ = writeln!(
            t,
            "engines that ran throughout (before the first fault → end): {}",
            shown.join("; ")
        );
    }
    let _ = writeln!(
        t,
        "summary: {}, timeline: {}",
        out.join("summary.json").display(),
        out.join("timeline.svg").display()
    );
    if v.violations.is_empty() {
        let _ = write!(
            t,
            "chaos: passed: every invariant held over {duration_s:.0} s and {} faults",
            v.faults.len()
        );
    } else {
        let _ = writeln!(t, "chaos: FAILED: {} violation(s):", v.violations.len());
        for violation in &v.violations {
            let _ = writeln!(t, "  - {violation}");
        }
    }
    Ok(t)
}

/// "kill prefill-0" → "kill p0", "partition decode-1 from prefill-2" → "cut d1|p2", "restart etcd
/// empty" → "etcd empty".
fn short(fault: &str) -> String {
    fn name(w: &str) -> String {
        w.replace("prefill-", "p").replace("decode-", "d").replace("'s", "")
    }
    let words: Vec<&str> = fault.split_whitespace().collect();
    match words.as_slice() {
        [verb @ ("kill" | "hang"), who] => format!("{verb} {}", name(who)),
        ["delay", who, ..] => format!("delay {}", name(who)),
        ["lose", _, "of", who, ..] => format!("loss {}", name(who)),
        ["partition", a, "from", b] => format!("cut {}|{}", name(a), name(b)),
        ["restart", "etcd", "empty"] => "etcd empty".into(),
        ["restart", "etcd", ..] => "etcd".into(),
        _ => fault.to_string(),
    }
}

fn plot(path: &Path, v: &Verdict, duration_s: f64) -> Result<()> {
    let root = SVGBackend::new(path, (1400, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = v.throughput.iter().copied().fold(1.0, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "ferry-chaos: checked pull throughput, faults shaded",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..duration_s.max(1.0), 0f64..top)?;
    chart.configure_mesh().x_desc("seconds").y_desc("MB/s").draw()?;
    // Many faults: short labels ("kill p0", "etcd empty"), over three heights so that neighbours
    // do not overlap; the summary names each fault in full.
    let many = v.faults.len() > 12;
    for (i, f) in v.faults.iter().enumerate() {
        chart.draw_series(std::iter::once(Rectangle::new(
            [(f.at_s, 0.0), (f.heal_s.max(f.at_s + 0.3), top)],
            RED.mix(0.18).filled(),
        )))?;
        let y = top * [0.97, 0.92, 0.87][i % 3];
        let label = if many { short(&f.fault) } else { f.fault.clone() };
        chart.draw_series(std::iter::once(Text::new(label, (f.at_s, y), ("sans-serif", 10))))?;
    }
    chart.draw_series(LineSeries::new(
        v.throughput.iter().enumerate().map(|(s, &mb)| (s as f64 + 0.5, mb)),
        &BLUE,
    ))?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::short;

    #[test]
    fn short_labels_name_the_fault_and_its_engines() {
        assert_eq!(short("kill prefill-0"), "kill p0");
        assert_eq!(short("hang prefill-3"), "hang p3");
        assert_eq!(short("delay decode-1 by 100 ms"), "delay d1");
        assert_eq!(short("lose 5% of prefill-1's packets"), "loss p1");
        assert_eq!(short("partition decode-0 from prefill-3"), "cut d0|p3");
        assert_eq!(short("restart etcd on its data"), "etcd");
        assert_eq!(short("restart etcd empty"), "etcd empty");
    }
}
