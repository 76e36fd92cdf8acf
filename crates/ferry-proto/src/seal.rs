//! The record layer of a protected data stream.
//!
//! After its handshake, every byte of a data stream with [`DataProtection::Integrity`] or
//! [`DataProtection::Encrypted`] travels in records:
//!
//! ```text
//! body_len u32 LE | body (body_len bytes, at most MAX_BODY) | tag (16 bytes)
//! ```
//!
//! The tag is AES-128-GCM's, under the stream's key for that direction
//! ([`JoinKey::stream_keys`](crate::JoinKey::stream_keys)), with the record's sequence number (its
//! index on this stream and direction, from 0) as the nonce and the length as associated data. So a
//! record that was changed, cut, injected, replayed, reordered or moved from another stream fails to
//! open, and the reader acts on no byte of it: the I/O layer hands out a body only once its record
//! opened.
//!
//! With [`DataProtection::Encrypted`] the body is the ciphertext. With [`DataProtection::Integrity`]
//! it is the plaintext, and the tag is the one AES-GCM gives that plaintext: both ends encrypt a copy
//! and keep only the tag. That is GMAC over the ciphertext, with the keystream never sent; forging a
//! tag for a changed body is forging an AES-GCM ciphertext for its nonce. It costs one copy more than
//! a GMAC over the plaintext would, and runs at the speed of the CPU's AES-GCM (several GB/s on
//! AES-NI), where the GHASH of associated data alone is several times slower in the crypto library we
//! use.

use std::ops::Range;

use ferry_core::{DataProtection, Error, Result};
use ring::aead::{self, Aad, LessSafeKey, Nonce};
use subtle::ConstantTimeEq;

/// Bytes of a record's length.
pub const HEADER_LEN: usize = 4;
/// Bytes of a record's tag.
pub const TAG_LEN: usize = 16;
/// Largest body of one record: large enough that the per-record cost (a system call, a tag) is
/// small, small enough that a record stays in the CPU's cache between the copy and the cipher.
pub const MAX_BODY: usize = 256 << 10;

/// Seals the records one direction of a stream sends.
pub struct Sealer {
    key: LessSafeKey,
    protection: DataProtection,
    seq: u64,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("protection", &self.protection)
            .field("seq", &self.seq)
            .finish()
    }
}

impl Sealer {
    pub(crate) fn new(key: LessSafeKey, protection: DataProtection) -> Self {
        Sealer {
            key,
            protection,
            seq: 0,
            scratch: Vec::new(),
        }
    }

    /// What it protects with.
    pub fn protection(&self) -> DataProtection {
        self.protection
    }

    /// Starts a record in `out`, which it clears: room for the header, then the caller appends at
    /// most [`MAX_BODY`] bytes of body and calls [`finish`](Self::finish).
    pub fn begin(out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(&[0; HEADER_LEN]);
    }

    /// Seals the record `out` holds (header room and body, as [`begin`](Self::begin) left it plus the
    /// body): writes the header, encrypts the body when it encrypts, and appends the tag.
    pub fn finish(&mut self, out: &mut Vec<u8>) -> Result<()> {
        let body_len = out
            .len()
            .checked_sub(HEADER_LEN)
            .filter(|n| *n <= MAX_BODY)
            .ok_or_else(|| {
                Error::Internal(format!(
                    "a record of {} bytes is outside 0..={MAX_BODY}",
                    out.len().saturating_sub(HEADER_LEN)
                ))
            })?;
        let header = (body_len as u32).to_le_bytes();
        out[..HEADER_LEN].copy_from_slice(&header);
        let nonce = next_nonce(&mut self.seq)?;
        let aad = Aad::from(header);
        let body = &mut out[HEADER_LEN..];
        let tag = match self.protection {
            DataProtection::Encrypted => self.key.seal_in_place_separate_tag(nonce, aad, body),
            _ => {
                self.scratch.clear();
                self.scratch.extend_from_slice(body);
                self.key.seal_in_place_separate_tag(nonce, aad, &mut self.scratch)
            }
        }
        .map_err(|_| Error::Internal("AES-GCM refused to seal a record".into()))?;
        out.extend_from_slice(tag.as_ref());
        Ok(())
    }
}

/// Opens the records one direction of a stream receives.
pub struct Opener {
    key: LessSafeKey,
    protection: DataProtection,
    seq: u64,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opener")
            .field("protection", &self.protection)
            .field("seq", &self.seq)
            .finish()
    }
}

impl Opener {
    pub(crate) fn new(key: LessSafeKey, protection: DataProtection) -> Self {
        Opener {
            key,
            protection,
            seq: 0,
            scratch: Vec::new(),
        }
    }

    /// The length of a whole record (header, body and tag) whose first [`HEADER_LEN`] bytes are
    /// `header`; an error for a body over [`MAX_BODY`], which no sealer makes.
    pub fn record_len(header: [u8; HEADER_LEN]) -> Result<usize> {
        let body = u32::from_le_bytes(header) as usize;
        if body > MAX_BODY {
            return Err(corrupt(format_args!(
                "a record header announces {body} bytes, over the {MAX_BODY} any sender makes"
            )));
        }
        Ok(HEADER_LEN + body + TAG_LEN)
    }

    /// Opens a whole record in place: the range of `record` that holds its plaintext body, or an
    /// error when the record fails its check (then nothing of it may be used, and the stream is over).
    pub fn open(&mut self, record: &mut [u8]) -> Result<Range<usize>> {
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(
            record
                .get(..HEADER_LEN)
                .ok_or_else(|| corrupt("a record shorter than its header"))?,
        );
        if record.len() != Self::record_len(header)? {
            return Err(corrupt("a record whose length is not the one its header announces"));
        }
        let seq = self.seq;
        let nonce = next_nonce(&mut self.seq)?;
        let aad = Aad::from(header);
        let tag_at = record.len() - TAG_LEN;
        let (body, tag) = record[HEADER_LEN..].split_at_mut(tag_at - HEADER_LEN);
        let opened = match self.protection {
            DataProtection::Encrypted => {
                let tag = aead::Tag::try_from(&tag[..]).map_err(|_| corrupt("a record without its tag"))?;
                self.key.open_in_place_separate_tag(nonce, aad, tag, body, 0..).is_ok()
            }
            _ => {
                self.scratch.clear();
                self.scratch.extend_from_slice(body);
                match self.key.seal_in_place_separate_tag(nonce, aad, &mut self.scratch) {
                    Ok(expected) => bool::from(expected.as_ref().ct_eq(tag)),
                    Err(_) => false,
                }
            }
        };
        if !opened {
            return Err(corrupt(format_args!(
                "record {seq} failed its integrity check: its bytes were changed, cut or injected on the \
                 way (or come from another stream); nothing of it was used, and the stream is closed"
            )));
        }
        Ok(HEADER_LEN..tag_at)
    }
}

/// The nonce of record `seq`, moving `seq` on; an error once a stream has sealed 2^64 records (it
/// never will: that is 2^81 bytes).
fn next_nonce(seq: &mut u64) -> Result<Nonce> {
    let mut nonce = [0u8; aead::NONCE_LEN];
    nonce[4..].copy_from_slice(&seq.to_be_bytes());
    *seq = seq
        .checked_add(1)
        .ok_or_else(|| Error::ResourceExhausted("a stream used up its record sequence numbers".into()))?;
    Ok(Nonce::assume_unique_for_key(nonce))
}

fn corrupt(what: impl std::fmt::Display) -> Error {
    Error::Io {
        kind: std::io::ErrorKind::InvalidData,
        message: what.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{JoinKey, LinkToken, StreamIndex};

    fn ends(protection: DataProtection, index: u16) -> (Sealer, Opener) {
        let key = JoinKey::from_exported(&[3; 32]);
        let (sealer, _) = key
            .stream_keys(LinkToken(7), StreamIndex(index))
            .expect("keys")
            .initiator(protection);
        let (_, opener) = key
            .stream_keys(LinkToken(7), StreamIndex(index))
            .expect("keys")
            .target(protection);
        (sealer, opener)
    }

    fn seal(sealer: &mut Sealer, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        Sealer::begin(&mut out);
        out.extend_from_slice(body);
        sealer.finish(&mut out).expect("sealed");
        out
    }

    #[test]
    fn records_open_in_order_and_only_on_their_own_stream() {
        for protection in [DataProtection::Integrity, DataProtection::Encrypted] {
            let (mut sealer, mut opener) = ends(protection, 1);
            let first = seal(&mut sealer, b"first");
            let second = seal(&mut sealer, b"second");
            // Plaintext on the wire only without encryption.
            let visible = first.windows(5).any(|w| w == b"first");
            assert_eq!(visible, protection == DataProtection::Integrity);
            // Reordered: the second record in the first's place fails.
            assert!(opener.open(&mut second.clone()).is_err());
            let (_, mut opener) = ends(protection, 1);
            let mut r = first.clone();
            let body = opener.open(&mut r).expect("first opens");
            assert_eq!(&r[body], b"first");
            // Replayed: the first again, where the second belongs, fails.
            assert!(opener.open(&mut first.clone()).is_err());
            // From another stream (other keys): fails.
            let (mut elsewhere, _) = ends(protection, 2);
            let (_, mut opener) = ends(protection, 1);
            assert!(opener.open(&mut seal(&mut elsewhere, b"first")).is_err());
        }
    }

    #[test]
    fn a_header_over_the_largest_body_is_refused_before_anything_is_read() {
        let too_long = ((MAX_BODY + 1) as u32).to_le_bytes();
        assert!(
            matches!(Opener::record_len(too_long), Err(Error::Io { kind, .. }) if kind == std::io::ErrorKind::InvalidData)
        );
        assert_eq!(
            Opener::record_len((MAX_BODY as u32).to_le_bytes()).ok(),
            Some(HEADER_LEN + MAX_BODY + TAG_LEN)
        );
    }

    proptest! {
        /// Any change to any byte of a record (header, body or tag) makes it fail, in both modes,
        /// and an intact one opens to its body.
        #[test]
        fn every_changed_byte_is_caught(
            body in proptest::collection::vec(any::<u8>(), 0..2048),
            at in any::<prop::sample::Index>(),
            flip in 1u8..=255,
            encrypted in any::<bool>(),
        ) {
            let protection = if encrypted { DataProtection::Encrypted } else { DataProtection::Integrity };
            let (mut sealer, mut opener) = ends(protection, 3);
            let record = seal(&mut sealer, &body);
            let mut intact = record.clone();
            let range = opener.open(&mut intact).expect("an intact record opens");
            prop_assert_eq!(&intact[range], &body[..]);

            let (_, mut opener) = ends(protection, 3);
            let mut changed = record.clone();
            let i = at.index(changed.len());
            changed[i] ^= flip;
            prop_assert!(opener.open(&mut changed).is_err());
        }
    }
}
