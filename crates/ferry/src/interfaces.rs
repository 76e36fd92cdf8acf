//! The addresses an engine that listens on every interface (`0.0.0.0`, `::`) can be reached at, for
//! its directory record: the host's interface addresses, loopback last.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// `listen` itself where it names one address; otherwise `listen`'s port on each up interface's
/// address of the same family (IPv4 for `0.0.0.0`, both for `::`), loopback last.
pub(crate) fn reachable(listen: SocketAddr) -> Vec<SocketAddr> {
    if !listen.ip().is_unspecified() {
        return vec![listen];
    }
    let mut addrs: Vec<IpAddr> = interface_addrs()
        .into_iter()
        .filter(|ip| listen.is_ipv6() || ip.is_ipv4())
        .filter(|ip| !matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local()))
        .collect();
    addrs.sort_by_key(|ip| ip.is_loopback());
    addrs.dedup();
    if addrs.is_empty() {
        addrs.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    addrs.into_iter().map(|ip| SocketAddr::new(ip, listen.port())).collect()
}

/// The addresses of the interfaces that are up.
fn interface_addrs() -> Vec<IpAddr> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head through the pointer we own; freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut cursor = list;
    while !cursor.is_null() {
        // SAFETY: a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cursor };
        cursor = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
            continue;
        }
        // SAFETY: `ifa_addr` is non-null and points to a sockaddr whose family says its layout.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        match family {
            libc::AF_INET => {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
                out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))));
            }
            libc::AF_INET6 => {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
                out.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
            }
            _ => {}
        }
    }
    // SAFETY: the list getifaddrs returned, freed once, after the last use of its nodes.
    unsafe { libc::freeifaddrs(list) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_address_is_kept_and_every_interface_stands_for_an_unspecified_one() {
        let named: SocketAddr = "10.1.2.3:9955".parse().unwrap();
        assert_eq!(reachable(named), vec![named]);
        let all = reachable("0.0.0.0:9955".parse().unwrap());
        assert!(!all.is_empty());
        assert!(
            all.iter()
                .all(|a| a.port() == 9955 && a.is_ipv4() && !a.ip().is_unspecified())
        );
        assert!(all.iter().any(|a| a.ip().is_loopback()), "loopback is up here: {all:?}");
        // Loopback last: a peer on another host tries the others first.
        let first_loopback = all.iter().position(|a| a.ip().is_loopback()).unwrap();
        assert!(all[first_loopback..].iter().all(|a| a.ip().is_loopback()), "{all:?}");
    }
}
