//! A remote region's key for one transport, as its advert carries it and as every transfer item to
//! the region carries it again.
//!
//! Why a type of its own: an item of a batch is built per descriptor, so whatever the key costs to
//! clone, a batch of small ranges pays per range. Shared behind a reference count, each clone and
//! drop is an atomic read-modify-write on a line that every thread transferring to the region
//! touches: on a batch of 256 × 4 KiB over shared memory, the key's and the local region's counts
//! together were a tenth of the batch's time. The keys in use are short (a shared-memory region's
//! kind, one byte; an RDMA key, six bytes): held inline, they clone as a copy of one word, in a
//! type no larger than the shared form. Longer ones (an RDMA key of a region the target bounces,
//! an RDMA key list of a multi-rail target) stay shared.

use std::sync::Arc;

/// Bytes a key may have and still be held inline.
const INLINE: usize = 7;

/// A transport-specific remote key: opaque bytes the transport wrote into the region's advert
/// (an RDMA rkey and its flags, say). Reads as `&[u8]`; clones without an allocation, and without
/// touching a shared count up to 7 bytes.
#[derive(Clone)]
pub struct TransportKey(Repr);

#[derive(Clone)]
enum Repr {
    Inline(Word),
    // Thin (one pointer), so that `Option<TransportKey>` stays 16 bytes.
    Shared(Arc<Box<[u8]>>),
}

/// An inline key as one aligned word, its length in the first byte: a clone moves it as one load
/// and one store (a key spread over odd-sized fields was copied piecewise, through stores that a
/// wider load then waited on).
#[derive(Clone, Copy)]
#[repr(align(8))]
struct Word([u8; INLINE + 1]);

impl TransportKey {
    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline(Word(word)) => &word[1..1 + word[0] as usize],
            Repr::Shared(bytes) => bytes,
        }
    }
}

impl From<&[u8]> for TransportKey {
    fn from(key: &[u8]) -> Self {
        match key.len() {
            n if n <= INLINE => {
                let mut word = [0u8; INLINE + 1];
                word[0] = n as u8;
                word[1..1 + n].copy_from_slice(key);
                TransportKey(Repr::Inline(Word(word)))
            }
            _ => TransportKey(Repr::Shared(Arc::new(key.into()))),
        }
    }
}

impl From<Vec<u8>> for TransportKey {
    fn from(key: Vec<u8>) -> Self {
        match key.len() {
            n if n <= INLINE => TransportKey::from(&key[..]),
            _ => TransportKey(Repr::Shared(Arc::new(key.into_boxed_slice()))),
        }
    }
}

impl std::ops::Deref for TransportKey {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl AsRef<[u8]> for TransportKey {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl PartialEq for TransportKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for TransportKey {}

impl std::fmt::Debug for TransportKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TransportKey(")?;
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_optional_key_is_no_larger_than_a_shared_slice() {
        assert_eq!(std::mem::size_of::<Option<TransportKey>>(), 16);
    }

    proptest! {
        /// Any bytes come back as they went in, inline or shared, through either constructor and
        /// through a clone; two keys are equal exactly when their bytes are.
        #[test]
        fn a_key_reads_back_its_bytes(key in proptest::collection::vec(any::<u8>(), 0..64),
                                      other in proptest::collection::vec(any::<u8>(), 0..64)) {
            let (a, b) = (TransportKey::from(&key[..]), TransportKey::from(key.clone()));
            prop_assert_eq!(a.as_bytes(), &key[..]);
            prop_assert_eq!(&*b, &key[..]);
            let cloned = a.clone();
            prop_assert_eq!(cloned.as_bytes(), &key[..]);
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(a == TransportKey::from(&other[..]), key == other);
        }
    }
}
