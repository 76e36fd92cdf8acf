//! Which physical device a context uses: by index, by name, by UUID, or the default.
//!
//! A host may have several Vulkan devices (a discrete GPU, an integrated one, lavapipe on the CPU).
//! Transfers want the GPU that the application computes on, so the caller can name it the way its other
//! tools do: `nvidia-smi`-style index, a part of the name, or the device UUID that CUDA and Vulkan
//! share. Without a choice the first discrete GPU wins, then an integrated or virtual one, then
//! anything (lavapipe). The `FERRY_VULKAN_DEVICE` variable makes the same choice for tools.

use std::fmt;
use std::str::FromStr;

use ash::vk;
use ferry_core::{Error, Result};

/// The environment variable [`DeviceSelector::from_env`] reads.
pub const DEVICE_ENV: &str = "FERRY_VULKAN_DEVICE";

/// How to pick a Vulkan physical device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DeviceSelector {
    /// The first discrete GPU, else the first integrated or virtual GPU, else any device.
    #[default]
    Default,
    /// The device at this position in the driver's enumeration.
    Index(usize),
    /// The first device whose name contains this text (case-insensitive).
    Name(String),
    /// The device with this UUID (`VkPhysicalDeviceIDProperties::deviceUUID`).
    Uuid([u8; 16]),
}

impl DeviceSelector {
    /// The selector in `FERRY_VULKAN_DEVICE`, or the default when it is unset or empty.
    pub fn from_env() -> Result<Self> {
        match std::env::var(DEVICE_ENV) {
            Ok(v) if !v.trim().is_empty() => v.parse(),
            _ => Ok(DeviceSelector::Default),
        }
    }
}

impl FromStr for DeviceSelector {
    type Err = Error;

    /// Parses "3" or "index:3", a UUID ("uuid:…" or 32 hex digits, dashes allowed), "name:…" or any
    /// other text as part of a name; "" and "default" are the default.
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if let Some(rest) = s.strip_prefix("index:") {
            return rest
                .trim()
                .parse()
                .map(DeviceSelector::Index)
                .map_err(|_| Error::InvalidArgument(format!("{rest:?} is not a device index")));
        }
        if let Some(rest) = s.strip_prefix("uuid:") {
            return parse_uuid(rest)
                .map(DeviceSelector::Uuid)
                .ok_or_else(|| Error::InvalidArgument(format!("{rest:?} is not a device UUID (32 hex digits)")));
        }
        if let Some(rest) = s.strip_prefix("name:") {
            return Ok(DeviceSelector::Name(rest.trim().to_string()));
        }
        if s.is_empty() || s.eq_ignore_ascii_case("default") {
            return Ok(DeviceSelector::Default);
        }
        if let Ok(i) = s.parse() {
            return Ok(DeviceSelector::Index(i));
        }
        if let Some(u) = parse_uuid(s) {
            return Ok(DeviceSelector::Uuid(u));
        }
        Ok(DeviceSelector::Name(s.to_string()))
    }
}

impl fmt::Display for DeviceSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSelector::Default => f.write_str("the default device"),
            DeviceSelector::Index(i) => write!(f, "device index {i}"),
            DeviceSelector::Name(n) => write!(f, "a device named like {n:?}"),
            DeviceSelector::Uuid(u) => write!(f, "device UUID {}", format_uuid(u)),
        }
    }
}

/// Parses 32 hex digits, dashes ignored.
fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s.bytes().filter(|&b| b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let text = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(text, 16).ok()?;
    }
    Some(out)
}

/// The canonical text form of a UUID: 8-4-4-4-12 lowercase hex digits.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let mut s = String::with_capacity(36);
    for (i, b) in u.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// What selection needs to know about one physical device.
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    /// Position in the enumeration.
    pub index: usize,
    /// `deviceName`.
    pub name: String,
    /// `deviceUUID`.
    pub uuid: [u8; 16],
    /// Discrete, integrated, CPU…
    pub device_type: vk::PhysicalDeviceType,
    /// Why this crate cannot use the device, if it cannot (a Vulkan 1.0 device).
    pub unusable: Option<String>,
}

/// The position (in `candidates`) of the device `selector` picks.
pub(crate) fn choose(candidates: &[Candidate], selector: &DeviceSelector) -> Result<usize> {
    let listing = || {
        candidates
            .iter()
            .map(|c| format!("{}: {} ({})", c.index, c.name, format_uuid(&c.uuid)))
            .collect::<Vec<_>>()
            .join("; ")
    };
    if candidates.is_empty() {
        return Err(Error::Unsupported(
            "the Vulkan driver lists no physical device".to_string(),
        ));
    }
    let found = match selector {
        DeviceSelector::Default => {
            let rank = |t: vk::PhysicalDeviceType| match t {
                vk::PhysicalDeviceType::DISCRETE_GPU => 0,
                vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
                vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
                _ => 3,
            };
            let best = candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| c.unusable.is_none())
                .min_by_key(|(i, c)| (rank(c.device_type), *i))
                .map(|(i, _)| i);
            return best.ok_or_else(|| {
                Error::Unsupported(format!(
                    "no usable Vulkan device: {}",
                    candidates
                        .iter()
                        .map(|c| format!("{} ({})", c.name, c.unusable.as_deref().unwrap_or("usable")))
                        .collect::<Vec<_>>()
                        .join("; ")
                ))
            });
        }
        DeviceSelector::Index(i) => candidates.iter().position(|c| c.index == *i),
        DeviceSelector::Name(n) => {
            let n = n.to_lowercase();
            candidates.iter().position(|c| c.name.to_lowercase().contains(&n))
        }
        DeviceSelector::Uuid(u) => candidates.iter().position(|c| &c.uuid == u),
    };
    let i = found
        .ok_or_else(|| Error::InvalidArgument(format!("no Vulkan device matches {selector}; found {}", listing())))?;
    match &candidates[i].unusable {
        Some(why) => Err(Error::Unsupported(format!(
            "{} cannot be used: {why}",
            candidates[i].name
        ))),
        None => Ok(i),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(index: usize, name: &str, t: vk::PhysicalDeviceType, unusable: Option<&str>) -> Candidate {
        Candidate {
            index,
            name: name.into(),
            uuid: [index as u8; 16],
            device_type: t,
            unusable: unusable.map(Into::into),
        }
    }

    fn host() -> Vec<Candidate> {
        vec![
            c(0, "llvmpipe (LLVM 15)", vk::PhysicalDeviceType::CPU, None),
            c(1, "Intel(R) UHD 770", vk::PhysicalDeviceType::INTEGRATED_GPU, None),
            c(2, "NVIDIA H200", vk::PhysicalDeviceType::DISCRETE_GPU, None),
            c(3, "Old GPU", vk::PhysicalDeviceType::DISCRETE_GPU, Some("Vulkan 1.0")),
        ]
    }

    #[test]
    fn parses_every_form() {
        assert_eq!("".parse::<DeviceSelector>().ok(), Some(DeviceSelector::Default));
        assert_eq!("2".parse::<DeviceSelector>().ok(), Some(DeviceSelector::Index(2)));
        assert_eq!("index:7".parse::<DeviceSelector>().ok(), Some(DeviceSelector::Index(7)));
        assert_eq!(
            "llvmpipe".parse::<DeviceSelector>().ok(),
            Some(DeviceSelector::Name("llvmpipe".into()))
        );
        assert_eq!(
            "name:42".parse::<DeviceSelector>().ok(),
            Some(DeviceSelector::Name("42".into()))
        );
        let u = "00112233-4455-6677-8899-aabbccddeeff";
        let parsed = u.parse::<DeviceSelector>().ok();
        let want = DeviceSelector::Uuid([
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff,
        ]);
        assert_eq!(parsed.as_ref(), Some(&want));
        if let DeviceSelector::Uuid(bytes) = want {
            assert_eq!(format_uuid(&bytes), u);
        }
        assert!("index:x".parse::<DeviceSelector>().is_err());
        assert!("uuid:1234".parse::<DeviceSelector>().is_err());
    }

    #[test]
    fn default_prefers_discrete_then_integrated_then_anything() {
        let h = host();
        assert_eq!(choose(&h, &DeviceSelector::Default).ok(), Some(2));
        assert_eq!(choose(&h[..2], &DeviceSelector::Default).ok(), Some(1));
        assert_eq!(choose(&h[..1], &DeviceSelector::Default).ok(), Some(0));
    }

    #[test]
    fn explicit_choices_find_their_device_or_say_what_exists() {
        let h = host();
        assert_eq!(choose(&h, &DeviceSelector::Index(1)).ok(), Some(1));
        assert_eq!(choose(&h, &DeviceSelector::Name("LLVMPIPE".into())).ok(), Some(0));
        assert_eq!(choose(&h, &DeviceSelector::Uuid([2; 16])).ok(), Some(2));
        let err = choose(&h, &DeviceSelector::Index(9)).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("llvmpipe")),
            "{err}"
        );
        assert!(matches!(
            choose(&h, &DeviceSelector::Name("old".into())),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            choose(&[], &DeviceSelector::Default),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            choose(&h[3..], &DeviceSelector::Default),
            Err(Error::Unsupported(_))
        ));
    }
}
