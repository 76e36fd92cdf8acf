//! The byte extent of an array that another library describes by shape, element type and strides
//! (`__cuda_array_interface__`, DLPack): what a binding registers when handed a CUDA array rather
//! than a pointer. Only a C-contiguous array is one region; any other layout is refused, since its
//! elements are not one range of bytes.

use ferry_core::{Error, Result};

/// Bytes per element of a NumPy type string (`"<f4"`, `"|u1"`, `">c16"`): the number after the
/// byte-order character and the kind.
pub fn itemsize(typestr: &str) -> Result<u64> {
    let bytes = typestr.as_bytes();
    let valid_order = matches!(bytes.first(), Some(b'<' | b'>' | b'|' | b'='));
    let size = typestr.get(2..).and_then(|n| n.parse::<u64>().ok()).filter(|&n| n > 0);
    match (valid_order && bytes.len() > 2, size) {
        (true, Some(n)) => Ok(n),
        _ => Err(Error::InvalidArgument(format!(
            "{typestr:?} is no array element type (expected a NumPy type string such as \"<f4\")"
        ))),
    }
}

/// The bytes a C-contiguous array of `shape` and `itemsize`-byte elements spans; `strides` (in
/// bytes; `None` for C-contiguous, as the interface says) must be the C-contiguous ones, except along
/// axes of length 1, whose stride no element uses. An empty array is refused: a region has bytes.
pub fn contiguous_bytes(shape: &[u64], itemsize: u64, strides: Option<&[i64]>) -> Result<u64> {
    let elements = shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::InvalidArgument(format!("an array of shape {shape:?} is larger than memory")))?;
    let bytes = elements
        .checked_mul(itemsize)
        .filter(|&b| b > 0)
        .ok_or_else(|| Error::InvalidArgument(format!("an array of shape {shape:?} has no bytes to register")))?;
    if let Some(strides) = strides {
        if strides.len() != shape.len() {
            return Err(Error::InvalidArgument(format!(
                "strides {strides:?} do not match shape {shape:?}"
            )));
        }
        let mut expected = itemsize as i128;
        for (&d, &s) in shape.iter().zip(strides).rev() {
            if d != 1 && s as i128 != expected {
                return Err(Error::InvalidArgument(format!(
                    "an array of shape {shape:?} with strides {strides:?} is not C-contiguous: register a \
                     contiguous copy (tensor.contiguous())"
                )));
            }
            expected *= d as i128;
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn type_strings_give_their_size() {
        assert_eq!(itemsize("<f4").unwrap(), 4);
        assert_eq!(itemsize("|u1").unwrap(), 1);
        assert_eq!(itemsize(">c16").unwrap(), 16);
        for bad in ["", "f4", "<f", "<f0", "xf4", "<fx"] {
            assert!(matches!(itemsize(bad), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }

    #[test]
    fn only_contiguous_non_empty_arrays_are_one_range() {
        assert_eq!(contiguous_bytes(&[4, 8], 2, None).unwrap(), 64);
        assert_eq!(contiguous_bytes(&[4, 8], 2, Some(&[16, 2])).unwrap(), 64);
        // A transposed view, and every other column.
        assert!(contiguous_bytes(&[8, 4], 2, Some(&[2, 16])).is_err());
        assert!(contiguous_bytes(&[4, 4], 2, Some(&[16, 4])).is_err());
        // Axes of length 1 may carry any stride.
        assert_eq!(contiguous_bytes(&[1, 8], 4, Some(&[999, 4])).unwrap(), 32);
        assert!(contiguous_bytes(&[0, 8], 4, None).is_err());
        assert!(contiguous_bytes(&[u64::MAX, 2], 4, None).is_err());
        assert!(contiguous_bytes(&[2], 4, Some(&[4, 4])).is_err());
    }

    proptest! {
        /// The C-contiguous strides of any shape are accepted and give the product of the shape.
        #[test]
        fn c_contiguous_strides_are_accepted(shape in proptest::collection::vec(1u64..16, 1..5), item in 1u64..9) {
            let mut strides = vec![0i64; shape.len()];
            let mut stride = item as i64;
            for (s, &d) in strides.iter_mut().zip(&shape).rev() {
                *s = stride;
                stride *= d as i64;
            }
            let want: u64 = shape.iter().product::<u64>() * item;
            prop_assert_eq!(contiguous_bytes(&shape, item, Some(&strides)).unwrap(), want);
            prop_assert_eq!(contiguous_bytes(&shape, item, None).unwrap(), want);
        }
    }
}
