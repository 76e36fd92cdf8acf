//! PCI addresses: where on the PCIe fabric a device sits.
//!
//! A NIC that reads or writes a GPU's memory directly (GPUDirect RDMA, or a mapping of the GPU's BAR)
//! moves the bytes over the PCIe path between the two devices. Through one PCIe switch that path
//! never touches the CPU; between two root complexes it crosses the link between the sockets. So a
//! block of device memory names its device ([`MemoryBlock::pci_device`](crate::MemoryBlock::pci_device))
//! and the RDMA transport ranks its NICs by their path to it.

use std::fmt;
use std::str::FromStr;

/// A PCI function's address, as Linux writes it: `DDDD:BB:DD.F` (domain, bus, device, function, in
/// hexadecimal; the domain may be longer than four digits, as behind Intel VMD).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    /// The PCI segment (domain).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number, 0..=31.
    pub device: u8,
    /// Function number, 0..=7.
    pub function: u8,
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl FromStr for PciAddress {
    type Err = String;

    /// Parses `DDDD:BB:DD.F`, or `BB:DD.F` in domain 0 (as `lspci` prints it).
    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || format!("`{text}` is not a PCI address (DDDD:BB:DD.F, hexadecimal)");
        let (rest, function) = text.trim().rsplit_once('.').ok_or_else(bad)?;
        let mut parts = rest.rsplitn(3, ':');
        let device = parts.next().ok_or_else(bad)?;
        let bus = parts.next().ok_or_else(bad)?;
        let domain = parts.next().unwrap_or("0");
        let hex = |s: &str, digits: usize| -> Result<u32, String> {
            if s.is_empty() || s.len() > digits || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            u32::from_str_radix(s, 16).map_err(|_| bad())
        };
        let address = PciAddress {
            domain: hex(domain, 8)?,
            bus: u8::try_from(hex(bus, 2)?).map_err(|_| bad())?,
            device: u8::try_from(hex(device, 2)?).map_err(|_| bad())?,
            function: u8::try_from(hex(function, 1)?).map_err(|_| bad())?,
        };
        if address.device > 31 || address.function > 7 {
            return Err(bad());
        }
        Ok(address)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn parses_what_linux_and_lspci_print() {
        let a: PciAddress = "0000:3b:00.0".parse().unwrap();
        assert_eq!((a.domain, a.bus, a.device, a.function), (0, 0x3b, 0, 0));
        assert_eq!("3b:1f.7".parse::<PciAddress>().unwrap().to_string(), "0000:3b:1f.7");
        assert_eq!("10000:e1:00.1".parse::<PciAddress>().unwrap().domain, 0x10000);
        for bad in [
            "",
            "3b:00",
            "0000:3b:20.0",
            "0000:3b:00.8",
            "0000:13b:00.0",
            "x:3b:00.0",
            "0000:3b:00.0.1",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad:?} parsed");
        }
    }

    proptest! {
        #[test]
        fn display_and_parse_round_trip(domain in any::<u32>(), bus in any::<u8>(), device in 0u8..32, function in 0u8..8) {
            let a = PciAddress { domain, bus, device, function };
            prop_assert_eq!(a.to_string().parse::<PciAddress>(), Ok(a));
        }

        #[test]
        fn parsing_never_panics(text in "[0-9a-fA-F:.x]{0,16}") {
            let _ = text.parse::<PciAddress>();
        }
    }
}
