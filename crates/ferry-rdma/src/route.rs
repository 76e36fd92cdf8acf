//! How an RDMA link reaches each of its peer's regions, read from the region's advert: what
//! `Peer::routes` and `ferry info --peer` report, region by region.

use ferry_core::{RegionAd, Route, TransportKind};
use ferry_proto::rdma::{RailKeys, RemoteKey};

/// The route to `region` of a link whose queue pairs reach the peer's rails `remote_rails` (the
/// peer's rail indices, each once).
pub(crate) fn of(region: &RegionAd, remote_rails: &[usize]) -> Route {
    let Some(key) = region
        .transport_keys
        .iter()
        .find(|(k, _)| *k == TransportKind::Rdma)
        .map(|(_, key)| key)
    else {
        return Route::declined(
            region,
            "rdma: the peer did not register this region with its NIC (the registration failed, or the region is \
             GPU memory its NIC cannot reach: no dma-buf the NIC accepts and no peer-memory module; the peer's log \
             says which)",
        );
    };
    // One key per rail of the peer (a plain key: the peer has one rail).
    let keys: Vec<Option<RemoteKey>> = match RailKeys::decode(key) {
        Ok(Some(rails)) => rails
            .0
            .iter()
            .map(|k| k.as_deref().and_then(|k| RemoteKey::decode(k).ok()))
            .collect(),
        Ok(None) => vec![RemoteKey::decode(key).ok()],
        Err(e) => {
            return Route::declined(
                region,
                format!("rdma: the peer's key for this region does not parse ({e})"),
            );
        }
    };
    let reached: Vec<&RemoteKey> = remote_rails
        .iter()
        .filter_map(|&r| keys.get(r).and_then(Option::as_ref))
        .collect();
    let Some(first) = reached.first() else {
        return Route::declined(
            region,
            "rdma: the peer registered this region on none of the rails this link reaches",
        );
    };
    let rails = match reached.len() {
        1 => "one rail".to_string(),
        n => format!("{n} rails"),
    };
    let how = if first.bounce_addr.is_some() {
        format!(
            "writes by the NIC into the peer's bounce buffer (memory its NIC cannot pin, a page-cache file) and a \
             commit request, on {rails}; reads over the control link"
        )
    } else if first.hooked {
        format!(
            "NIC to the peer's staging buffer, with a commit request after writes and a prepare request before \
             reads (memory the peer stages in front of a device), on {rails}"
        )
    } else {
        format!("NIC to NIC, on {rails}")
    };
    let mut route = Route::by(TransportKind::Rdma, how).staged(first.hooked);
    if reached.len() < remote_rails.len() {
        route.passed_over = Some(format!(
            "rdma: the peer registered this region on {} of the {} rails this link reaches",
            reached.len(),
            remote_rails.len()
        ));
    }
    route
}

#[cfg(test)]
mod tests {

    use ferry_core::{Access, RegionKey};

    use super::*;

    fn ad(key: Option<Vec<u8>>) -> RegionAd {
        RegionAd {
            key: RegionKey(1),
            addr: 0x1000,
            len: 4096,
            access: Access::READ_WRITE,
            persistent: false,
            staged: false,
            transport_keys: key
                .map(|k| vec![(TransportKind::Rdma, ferry_core::TransportKey::from(k))])
                .unwrap_or_default(),
        }
    }

    fn key(bounced: bool, hooked: bool) -> Vec<u8> {
        RemoteKey {
            rkey: 7,
            flushable: false,
            bounce_addr: bounced.then_some(0x9000),
            hooked,
        }
        .encode()
    }

    #[test]
    fn each_kind_of_key_says_how() {
        assert_eq!(of(&ad(None), &[0]).transport, TransportKind::Tcp);
        let plain = of(&ad(Some(key(false, false))), &[0]);
        assert_eq!(
            (plain.transport, plain.how.as_str()),
            (TransportKind::Rdma, "NIC to NIC, on one rail")
        );
        assert!(of(&ad(Some(key(true, false))), &[0]).how.contains("bounce buffer"));
        assert!(of(&ad(Some(key(false, true))), &[0]).how.contains("staging buffer"));
        // Registered on one of the two rails the link reaches: carried there, the other named.
        let rails = RailKeys(vec![Some(key(false, false)), None]).encode();
        let partial = of(&ad(Some(rails.clone())), &[0, 1]);
        assert_eq!(partial.transport, TransportKind::Rdma);
        assert!(
            partial
                .passed_over
                .as_deref()
                .is_some_and(|m| m.contains("1 of the 2 rails"))
        );
        assert_eq!(of(&ad(Some(rails)), &[1]).transport, TransportKind::Tcp);
    }

    /// Memory its owner stages is staged on every route the link declines, so that a
    /// `stage_gpu_memory(false)` engine refuses it rather than stage it over TCP.
    #[test]
    fn a_declined_route_to_staged_memory_says_staged() {
        let staged = |key: Option<Vec<u8>>| RegionAd {
            staged: true,
            ..ad(key)
        };
        let on_rail_zero = RailKeys(vec![Some(key(false, true)), None]).encode();
        for (what, region, rails) in [
            ("no key", staged(None), vec![0]),
            ("a key that does not parse", staged(Some(vec![0xff; 3])), vec![0]),
            ("none of the rails reached", staged(Some(on_rail_zero)), vec![1]),
        ] {
            let route = of(&region, &rails);
            assert_eq!(route.transport, TransportKind::Tcp, "{what}");
            assert!(route.staged, "{what}: {route:?}");
        }
    }
}
