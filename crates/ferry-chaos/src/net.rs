//! The fleet's network: one network namespace per engine, each joined by a veth pair to a bridge in
//! the conductor's namespace, where etcd listens; engine `i` is `10.88.0.(10+i)`, etcd `10.88.0.1`. To
//! each other the engines are different hosts (TCP over the bridge, no shared memory: their namespaces
//! differ, so ferry's same-host path does not apply). Faults are `tc` qdiscs on the veth ends: `netem`
//! delay or loss on both directions of one engine's link, and a partition as a `prio` qdisc whose
//! extra band drops everything (`netem loss 100%`) and gets, by a `u32` filter, only the packets to
//! the other engine.

use std::process::Command;

use anyhow::{Context, Result, bail};

/// The bridge's address: etcd listens there.
pub const ETCD_IP: &str = "10.88.0.1";
const BRIDGE: &str = "fchaos0";

/// Runs `cmd`, failing with its stderr.
pub fn sh(cmd: &[&str]) -> Result<()> {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .output()
        .with_context(|| format!("running `{}`", cmd.join(" ")))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The namespaces and the bridge; removed on drop.
pub struct Net {
    engines: usize,
}

impl Net {
    pub fn namespace(i: usize) -> String {
        format!("fchaos-{i}")
    }

    pub fn ip(i: usize) -> String {
        format!("10.88.0.{}", 10 + i)
    }

    /// The veth end on the bridge's side of engine `i`.
    fn outer(i: usize) -> String {
        format!("fcv{i}")
    }

    pub fn create(engines: usize) -> Result<Net> {
        let net = Net { engines };
        net.remove();
        sh(&["ip", "link", "add", BRIDGE, "type", "bridge"])?;
        sh(&["ip", "addr", "add", &format!("{ETCD_IP}/24"), "dev", BRIDGE])?;
        sh(&["ip", "link", "set", BRIDGE, "up"])?;
        sh(&["ip", "link", "set", "lo", "up"])?;
        for i in 0..engines {
            let (ns, outer) = (Self::namespace(i), Self::outer(i));
            sh(&["ip", "netns", "add", &ns])?;
            sh(&[
                "ip", "link", "add", &outer, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            sh(&["ip", "link", "set", &outer, "master", BRIDGE])?;
            sh(&["ip", "link", "set", &outer, "up"])?;
            sh(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", Self::ip(i)),
                "dev",
                "eth0",
            ])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    fn remove(&self) {
        for i in 0..self.engines {
            let _ = sh(&["ip", "netns", "del", &Self::namespace(i)]);
            let _ = sh(&["ip", "link", "del", &Self::outer(i)]);
        }
        let _ = sh(&["ip", "link", "del", BRIDGE]);
    }

    /// `tc` on the engine's side of its link, inside its namespace.
    fn tc_inner(i: usize, args: &[&str]) -> Result<()> {
        let ns = Self::namespace(i);
        let mut cmd = vec!["ip", "netns", "exec", &ns, "tc"];
        cmd.extend_from_slice(args);
        sh(&cmd)
    }

    fn tc_outer(i: usize, args: &[&str]) -> Result<()> {
        let outer = Self::outer(i);
        let mut cmd = vec!["tc"];
        cmd.extend(args.iter().map(|a| if *a == "DEV" { outer.as_str() } else { a }));
        sh(&cmd)
    }

    /// `netem ARGS` on both directions of engine `i`'s link ("delay 100ms", "loss 5%").
    pub fn netem(i: usize, netem: &[&str]) -> Result<()> {
        let mut args = vec!["qdisc", "add", "dev", "DEV", "root", "netem"];
        args.extend_from_slice(netem);
        let inner: Vec<&str> = args.iter().map(|a| if *a == "DEV" { "eth0" } else { a }).collect();
        Self::tc_inner(i, &inner)?;
        Self::tc_outer(i, &args)
    }

    /// Removes what [`netem`](Self::netem) added.
    pub fn clear(i: usize) -> Result<()> {
        Self::tc_inner(i, &["qdisc", "del", "dev", "eth0", "root"])?;
        Self::tc_outer(i, &["qdisc", "del", "dev", "DEV", "root"])
    }

    /// Drops every packet between engines `a` and `b`, each on its way out of its namespace.
    pub fn partition(a: usize, b: usize) -> Result<()> {
        for (from, to) in [(a, b), (b, a)] {
            let dst = format!("{}/32", Self::ip(to));
            // Four bands, every priority on band 1:2 (index 1) as usual; band 1:4 drops all.
            let priomap = ["1"; 16];
            let mut qdisc = vec![
                "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "prio", "bands", "4", "priomap",
            ];
            qdisc.extend_from_slice(&priomap);
            Self::tc_inner(from, &qdisc)?;
            Self::tc_inner(
                from,
                &[
                    "qdisc", "add", "dev", "eth0", "parent", "1:4", "handle", "40:", "netem", "loss", "100%",
                ],
            )?;
            Self::tc_inner(
                from,
                &[
                    "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                    "ip", "dst", &dst, "flowid", "1:4",
                ],
            )?;
        }
        Ok(())
    }

    /// Heals a partition.
    pub fn heal_partition(a: usize, b: usize) -> Result<()> {
        for i in [a, b] {
            Self::tc_inner(i, &["qdisc", "del", "dev", "eth0", "root"])?;
        }
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.remove();
    }
}
