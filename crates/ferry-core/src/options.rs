//! Engine options that come as strings in HIXL's form.

use crate::error::{Error, Result};

/// The coalescing pool (HIXL's buffer pool), `"BUFFER_NUM:BUFFER_SIZE_MB"`: `"4:8"` by default, `"0:0"` off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferPool {
    /// Number of buffers.
    pub count: usize,
    /// Size of each buffer in MiB.
    pub size_mb: usize,
}

impl BufferPool {
    /// HIXL's default, four 8 MiB buffers.
    pub const DEFAULT: BufferPool = BufferPool { count: 4, size_mb: 8 };
    /// No pool: small descriptors are sent one by one.
    pub const OFF: BufferPool = BufferPool { count: 0, size_mb: 0 };

    /// Whether the pool is turned off.
    pub fn is_off(&self) -> bool {
        self.count == 0
    }

    /// Size of each buffer in bytes.
    pub fn buffer_bytes(&self) -> usize {
        self.size_mb << 20
    }
}

impl Default for BufferPool {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl std::str::FromStr for BufferPool {
    type Err = Error;

    /// Parses `"num:size_mb"`. Both zero turns the pool off; one zero alone is refused, as are more
    /// than 64 buffers or buffers over 1024 MiB.
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "buffer pool {s:?} {why}: expected \"BUFFER_NUM:BUFFER_SIZE_MB\" such as \"4:8\", or \"0:0\" to turn it off"
            ))
        };
        let (n, m) = s.split_once(':').ok_or_else(|| bad("has no ':'"))?;
        let count: usize = n
            .trim()
            .parse()
            .map_err(|_| bad("has a buffer count that is not a number"))?;
        let size_mb: usize = m
            .trim()
            .parse()
            .map_err(|_| bad("has a buffer size that is not a number"))?;
        match (count, size_mb) {
            (0, 0) => Ok(BufferPool::OFF),
            (0, _) | (_, 0) => Err(bad("turns only one half off")),
            (c, _) if c > 64 => Err(bad("asks for more than 64 buffers")),
            (_, m) if m > 1024 => Err(bad("asks for buffers over 1024 MiB")),
            (count, size_mb) => Ok(BufferPool { count, size_mb }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_hixl_forms() {
        assert_eq!("4:8".parse::<BufferPool>().unwrap(), BufferPool::DEFAULT);
        assert!("0:0".parse::<BufferPool>().unwrap().is_off());
        for bad in [
            "", "4", "4:", ":8", "0:8", "4:0", "a:b", "-1:8", "65:1", "1:1025", "4:8:1",
        ] {
            assert!(
                matches!(bad.parse::<BufferPool>(), Err(Error::InvalidArgument(_))),
                "{bad}"
            );
        }
    }

    proptest! {
        #[test]
        fn any_string_parses_or_is_invalid_argument(s in ".{0,16}") {
            match s.parse::<BufferPool>() {
                Ok(p) => prop_assert!(p.is_off() || (p.count <= 64 && p.size_mb <= 1024 && p.count > 0 && p.size_mb > 0)),
                Err(e) => prop_assert!(matches!(e, Error::InvalidArgument(_))),
            }
        }

        #[test]
        fn valid_pairs_round_trip(c in 1usize..=64, m in 1usize..=1024) {
            let p: BufferPool = format!("{c}:{m}").parse().unwrap();
            prop_assert_eq!(p, BufferPool { count: c, size_mb: m });
        }
    }
}
