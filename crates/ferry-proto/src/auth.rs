//! How further streams prove they belong to an authenticated link.
//!
//! On an engine that authenticates, a link's control stream runs mutual TLS; its other streams carry
//! bulk data in the clear (the threat is who connects, not who watches a private fabric) and would
//! otherwise join on nothing but the link token, which travels in the clear on every stream. So both
//! ends derive a [`JoinKey`] from the control stream's TLS session (an RFC 5705 / RFC 8446 §7.5
//! exporter, which only the two holders of that session can compute), and each further stream's hello
//! carries `HMAC-SHA256(key, token ‖ index)`. The target checks it in constant time, and each index
//! joins once ([`LinkRegistry`](crate::LinkRegistry)): a proof seen on the wire is worth nothing once
//! its stream has joined, and a connection that never held the session cannot make one.

use ring::hmac;

use crate::ids::{LinkToken, StreamIndex};

/// The label under which the TLS exporter derives a link's [`JoinKey`].
pub const JOIN_EXPORTER_LABEL: &[u8] = b"EXPORTER-ferry-stream-join";

/// A link's key for stream join proofs, derived from its control stream's TLS session.
#[derive(Clone)]
pub struct JoinKey(hmac::Key);

impl std::fmt::Debug for JoinKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JoinKey(..)")
    }
}

impl JoinKey {
    /// The key from 32 bytes of exported keying material.
    pub fn from_exported(secret: &[u8; 32]) -> Self {
        JoinKey(hmac::Key::new(hmac::HMAC_SHA256, secret))
    }

    /// The proof for stream `index` of link `token`.
    pub fn proof(&self, token: LinkToken, index: StreamIndex) -> [u8; 32] {
        let tag = hmac::sign(&self.0, &message(token, index));
        let mut proof = [0u8; 32];
        proof.copy_from_slice(tag.as_ref());
        proof
    }

    /// Whether `proof` is this key's proof for stream `index` of link `token` (constant time).
    pub fn verify(&self, token: LinkToken, index: StreamIndex, proof: &[u8; 32]) -> bool {
        hmac::verify(&self.0, &message(token, index), proof).is_ok()
    }
}

fn message(token: LinkToken, index: StreamIndex) -> [u8; 10] {
    let mut m = [0u8; 10];
    m[..8].copy_from_slice(&token.0.to_le_bytes());
    m[8..].copy_from_slice(&index.0.to_le_bytes());
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_for_its_key_token_and_index_only() {
        let key = JoinKey::from_exported(&[7; 32]);
        let other = JoinKey::from_exported(&[8; 32]);
        let (t, i) = (LinkToken(42), StreamIndex(3));
        let proof = key.proof(t, i);
        assert!(key.verify(t, i, &proof));
        assert!(!other.verify(t, i, &proof));
        assert!(!key.verify(LinkToken(43), i, &proof));
        assert!(!key.verify(t, StreamIndex(4), &proof));
        assert!(!key.verify(t, i, &[0; 32]));
    }
}
