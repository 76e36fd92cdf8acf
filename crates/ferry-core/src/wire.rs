//! The one way ferry reads bytes a peer sent: a cursor over a message that checks every length
//! before it reads, and refuses what is left over.
//!
//! Every wire format (the frame codec, the same-host transport's requests and replies, the RDMA
//! transport's setup, keys and queue-pair messages) reads through [`WireReader`]: little-endian
//! integers, byte strings and UTF-8 strings behind a `u16` length, element counts checked against
//! the bytes present (so a count cannot cause a large allocation), and [`finish`](WireReader::finish)
//! for a message that must be consumed whole. A short or malformed message is `Error::Protocol`
//! naming the message.

use crate::error::{Error, Result};

/// A cursor over one message from a peer.
#[derive(Debug, Clone)]
pub struct WireReader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> WireReader<'a> {
    /// Reads `buf`, a message of kind `what` (named in errors: "shared-memory request", say).
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        WireReader { buf, what }
    }

    /// The error for this message being malformed in the way `detail` says.
    pub fn malformed(&self, detail: impl std::fmt::Display) -> Error {
        Error::Protocol(format!("{}: {detail}", self.what))
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(self.malformed(format_args!(
                "truncated: needed {n} more bytes, {} left",
                self.buf.len()
            )));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// The next `N` bytes, as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    /// A byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// An element count (a `u32`), refused when `min_elem` bytes per element would not fit in what
    /// is left: it cannot make the reader allocate more than the message holds.
    pub fn count(&mut self, min_elem: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        self.check_count(n, min_elem)?;
        Ok(n)
    }

    /// [`count`](Self::count) for a count read some other way (a `u16`, a byte).
    pub fn check_count(&self, n: usize, min_elem: usize) -> Result<()> {
        if n.saturating_mul(min_elem) > self.buf.len() {
            return Err(self.malformed(format_args!("count {n} exceeds what the message can hold")));
        }
        Ok(())
    }

    /// Bytes behind a `u16` length.
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u16()? as usize;
        self.take(n)
    }

    /// Bytes behind a one-byte length.
    pub fn short_bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u8()? as usize;
        self.take(n)
    }

    /// A UTF-8 string behind a `u16` length.
    pub fn string(&mut self) -> Result<String> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| self.malformed("a string field is not UTF-8"))
    }

    /// Whatever is left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }

    /// Whether nothing is left.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Ends a message that must be read whole: an error if bytes are left over.
    pub fn finish(&self) -> Result<()> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(self.malformed(format_args!("{n} bytes follow its end"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_what_is_there_and_names_the_message_when_it_is_not() {
        let mut r = WireReader::new(&[1, 2, 0, 3, 0, 0, 0, 2, 0, b'h', b'i', 9], "test message");
        assert_eq!(r.u8().unwrap(), 1);
        assert_eq!(r.u16().unwrap(), 2);
        assert_eq!(r.u32().unwrap(), 3);
        assert_eq!(r.take(0).unwrap(), &[] as &[u8]);
        assert_eq!(r.string().unwrap(), "hi");
        let e = r.finish().unwrap_err();
        assert!(
            matches!(&e, Error::Protocol(m) if m.starts_with("test message: 1 bytes follow")),
            "{e}"
        );
        assert_eq!(r.u8().unwrap(), 9);
        r.finish().unwrap();
        let e = r.u64().unwrap_err();
        assert!(
            matches!(&e, Error::Protocol(m) if m.contains("test message: truncated")),
            "{e}"
        );
        let mut counted = WireReader::new(&[0xff, 0xff, 0xff, 0x7f, 0, 0], "counted");
        assert!(
            matches!(counted.count(1), Err(Error::Protocol(_))),
            "a count larger than the message"
        );
    }

    proptest! {
        /// Any bytes: every read either succeeds within the buffer or fails with a protocol error.
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64), ops in proptest::collection::vec(0u8..9, 0..16)) {
            let mut r = WireReader::new(&b, "arbitrary");
            for op in ops {
                let read = match op {
                    0 => r.u8().map(|_| ()),
                    1 => r.u16().map(|_| ()),
                    2 => r.u32().map(|_| ()),
                    3 => r.u64().map(|_| ()),
                    4 => r.bytes().map(|_| ()),
                    5 => r.short_bytes().map(|_| ()),
                    6 => r.string().map(|_| ()),
                    7 => r.count(8).map(|_| ()),
                    _ => r.finish(),
                };
                if let Err(e) = read {
                    prop_assert!(matches!(e, Error::Protocol(_)));
                }
            }
        }
    }
}
