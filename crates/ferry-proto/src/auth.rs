//! How further streams prove they belong to an authenticated link, and the keys that protect them.
//!
//! On an engine that authenticates, a link's control stream runs mutual TLS; its other streams carry
//! bulk data over plain TCP and would otherwise join on nothing but the link token, which travels in
//! the clear on every stream. So both ends derive a [`JoinKey`] from the control stream's TLS session
//! (an RFC 5705 / RFC 8446 §7.5 exporter, which only the two holders of that session can compute),
//! and each further stream's hello carries `HMAC-SHA256(key, token ‖ index ‖ protection)`. The target
//! checks it in constant time, and each index joins once ([`LinkRegistry`](crate::LinkRegistry)).
//!
//! A join proof alone does not stop someone on the path from writing into the stream after it joined,
//! so from the same secret each stream gets its own pair of record keys
//! ([`JoinKey::stream_keys`], HKDF-SHA256 with the token, index and direction as info), under which
//! the [`seal`](crate::seal) record layer protects every byte after the handshake. Keys differ per
//! stream and per direction, so a record moved from one stream or direction to another fails too.

use ring::{aead, hkdf, hmac};

use ferry_core::{DataProtection, Error, Result};

use crate::ids::{LinkToken, StreamIndex};
use crate::seal::{Opener, Sealer};

/// The label under which the TLS exporter derives a link's [`JoinKey`].
pub const JOIN_EXPORTER_LABEL: &[u8] = b"EXPORTER-ferry-stream-join";

/// A link's key for stream join proofs and stream record keys, derived from its control stream's
/// TLS session.
#[derive(Clone)]
pub struct JoinKey {
    proofs: hmac::Key,
    records: hkdf::Prk,
}

impl std::fmt::Debug for JoinKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JoinKey(..)")
    }
}

impl JoinKey {
    /// The key from 32 bytes of exported keying material.
    pub fn from_exported(secret: &[u8; 32]) -> Self {
        JoinKey {
            proofs: hmac::Key::new(hmac::HMAC_SHA256, secret),
            records: hkdf::Salt::new(hkdf::HKDF_SHA256, RECORD_SALT).extract(secret),
        }
    }

    /// The proof for stream `index` of link `token`, asking for `protection`.
    pub fn proof(&self, token: LinkToken, index: StreamIndex, protection: DataProtection) -> [u8; 32] {
        let tag = hmac::sign(&self.proofs, &message(token, index, protection));
        let mut proof = [0u8; 32];
        proof.copy_from_slice(tag.as_ref());
        proof
    }

    /// Whether `proof` is this key's proof for stream `index` of link `token` asking for
    /// `protection` (constant time).
    pub fn verify(&self, token: LinkToken, index: StreamIndex, protection: DataProtection, proof: &[u8; 32]) -> bool {
        hmac::verify(&self.proofs, &message(token, index, protection), proof).is_ok()
    }

    /// The record keys of stream `index` of link `token`: what the initiator seals and the target
    /// opens, and the other way round.
    pub fn stream_keys(&self, token: LinkToken, index: StreamIndex) -> Result<StreamKeys> {
        Ok(StreamKeys {
            to_target: self.record_key(token, index, TO_TARGET)?,
            to_initiator: self.record_key(token, index, TO_INITIATOR)?,
        })
    }

    fn record_key(&self, token: LinkToken, index: StreamIndex, direction: u8) -> Result<aead::LessSafeKey> {
        let mut info = [0u8; 11];
        info[..8].copy_from_slice(&token.0.to_le_bytes());
        info[8..10].copy_from_slice(&index.0.to_le_bytes());
        info[10] = direction;
        let info = [&info[..]];
        // HKDF-SHA256 expands up to 255 × 32 bytes: 16 never fail.
        let okm = self.records.expand(&info, &aead::AES_128_GCM);
        let key = okm.map_err(|_| Error::Internal("HKDF refused to expand a 16-byte record key".into()))?;
        Ok(aead::LessSafeKey::new(aead::UnboundKey::from(key)))
    }
}

const RECORD_SALT: &[u8] = b"ferry stream records";
const TO_TARGET: u8 = 0;
const TO_INITIATOR: u8 = 1;

/// One stream's record keys, one per direction.
pub struct StreamKeys {
    to_target: aead::LessSafeKey,
    to_initiator: aead::LessSafeKey,
}

impl std::fmt::Debug for StreamKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamKeys(..)")
    }
}

impl StreamKeys {
    /// The initiator's ends: it seals what goes to the target and opens what comes back.
    pub fn initiator(self, protection: DataProtection) -> (Sealer, Opener) {
        (
            Sealer::new(self.to_target, protection),
            Opener::new(self.to_initiator, protection),
        )
    }

    /// The target's ends: it seals what goes to the initiator and opens what comes in.
    pub fn target(self, protection: DataProtection) -> (Sealer, Opener) {
        (
            Sealer::new(self.to_initiator, protection),
            Opener::new(self.to_target, protection),
        )
    }
}

fn message(token: LinkToken, index: StreamIndex, protection: DataProtection) -> [u8; 11] {
    let mut m = [0u8; 11];
    m[..8].copy_from_slice(&token.0.to_le_bytes());
    m[8..10].copy_from_slice(&index.0.to_le_bytes());
    m[10] = protection.to_wire();
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
        let p = DataProtection::Integrity;
        let proof = key.proof(t, i, p);
        assert!(key.verify(t, i, p, &proof));
        assert!(!other.verify(t, i, p, &proof));
        assert!(!key.verify(LinkToken(43), i, p, &proof));
        assert!(!key.verify(t, StreamIndex(4), p, &proof));
        assert!(!key.verify(t, i, p, &[0; 32]));
        // Nobody on the way can lower (or raise) the protection a stream asked for.
        assert!(!key.verify(t, i, DataProtection::Plain, &proof));
        assert!(!key.verify(t, i, DataProtection::Encrypted, &proof));
    }
}
