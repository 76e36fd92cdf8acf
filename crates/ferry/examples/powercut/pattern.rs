//! The page patterns of the power-cut trials, shared by the trial program (which writes them) and
//! `cargo xtask rig powercut` (which looks for them in the disk image afterwards), so that the two can
//! never disagree.

/// Bytes in a page of the trial file.
pub const PAGE: usize = 4096;

/// The bytes of persistent (`control == false`) or control page `index` in trial `seed`: xorshift64
/// from a seed that differs per trial, page and kind, so a stale image or another page never matches.
pub fn page(seed: u64, index: usize, control: bool) -> Vec<u8> {
    let mut x = seed ^ ((index as u64) << 20) ^ if control { 0x5555_0000_0000 } else { 0xaaaa_0000_0000 };
    (0..PAGE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}
