//! Human sizes and durations on the command line: `4KiB`, `1MiB`, `64`, `3s`, `500ms`.

use std::time::Duration;

/// Parses a byte size such as `64`, `4KiB`, `1MiB`, `1 GiB`, `16M` (SI and binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let size: bytesize::ByteSize = s
        .trim()
        .parse()
        .map_err(|e| format!("{s:?} is not a size such as 4KiB or 1MiB: {e}"))?;
    match size.as_u64() {
        0 => Err("a size must be at least one byte".into()),
        n => Ok(n),
    }
}

/// Parses a duration such as `3s`, `500ms`, `1m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("{s:?} is not a duration such as 3s or 500ms: {e}"))
}

/// Formats a byte count the way the table shows it.
pub fn format_size(n: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if n >= unit && n.is_multiple_of(unit) {
            return format!("{}{name}", n / unit);
        }
    }
    format!("{n}B")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64").unwrap(), 64);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("16 MiB").unwrap(), 16 << 20);
        assert!(parse_size("0").is_err());
        assert!(parse_size("lots").is_err());
        assert_eq!(format_size(1 << 20), "1MiB");
        assert_eq!(format_size(64), "64B");
        assert_eq!(format_size(4096), "4KiB");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("3s").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert!(parse_duration("soon").is_err());
    }

    proptest! {
        #[test]
        fn any_input_parses_or_errors(s in ".{0,12}") {
            let _ = parse_size(&s);
            let _ = parse_duration(&s);
        }

        #[test]
        fn formatted_sizes_parse_back(n in 1u64..1 << 40) {
            prop_assert_eq!(parse_size(&format_size(n)).unwrap(), n);
        }
    }
}
