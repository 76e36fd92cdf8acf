//! What a prefill engine's KV blocks hold: a function of the engine's name and the block's index, so
//! that a decode engine can check every byte it pulled without being told, and a block that came from
//! the wrong engine (a stale record, a reused port) or from nowhere (a read that wrote nothing) fails
//! the check.

/// Bytes per KV block.
pub const BLOCK: usize = 64 << 10;

/// The seed of an engine's blocks.
pub fn seed(name: &str) -> u64 {
    // FNV-1a: stable across builds and processes, unlike std's hasher.
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn mix(mut z: u64) -> u64 {
    // splitmix64's finaliser.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `out` (one block) with block `index` of the engine seeded `seed`.
pub fn fill(seed: u64, index: u64, out: &mut [u8]) {
    let base = mix(seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    for (word, chunk) in out.chunks_mut(8).enumerate() {
        let value = mix(base.wrapping_add(word as u64)).to_le_bytes();
        chunk.copy_from_slice(&value[..chunk.len()]);
    }
}

/// The first byte offset where `got` differs from block `index` of `seed`; `None` if it is that block.
pub fn first_difference(seed: u64, index: u64, got: &[u8]) -> Option<usize> {
    let base = mix(seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    got.chunks(8).enumerate().find_map(|(word, chunk)| {
        let want = mix(base.wrapping_add(word as u64)).to_le_bytes();
        (chunk != &want[..chunk.len()]).then(|| word * 8 + chunk.iter().zip(want).take_while(|(a, b)| *a == b).count())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_checks_against_itself_and_not_against_another_engine_or_index() {
        let mut block = vec![0u8; BLOCK];
        fill(seed("prefill-0"), 7, &mut block);
        assert_eq!(first_difference(seed("prefill-0"), 7, &block), None);
        assert_eq!(first_difference(seed("prefill-1"), 7, &block), Some(0));
        assert!(first_difference(seed("prefill-0"), 8, &block).is_some());
        block[BLOCK - 3] ^= 1;
        assert_eq!(first_difference(seed("prefill-0"), 7, &block), Some(BLOCK - 3));
        assert!(first_difference(seed("prefill-0"), 7, &vec![0xee; BLOCK]).is_some());
    }
}
