//! xorshift64*: a small seeded generator, the same on every machine, for the fault schedule and the
//! decode engines' choice of sources and blocks (a run replays from its seed).

pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed` (any value, zero included).
    pub fn new(seed: u64) -> Self {
        Rng::from_state(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// A generator whose state is `state` (not zero).
    pub fn from_state(state: u64) -> Self {
        Rng(state)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// An index below `n`.
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// `n` distinct values below `bound`, in random order (scattered blocks).
    pub fn distinct(&mut self, n: u64, bound: u64) -> Vec<u64> {
        let mut all: Vec<u64> = (0..bound).collect();
        let n = n.min(bound) as usize;
        for i in 0..n {
            let j = i + self.index(all.len() - i);
            all.swap(i, j);
        }
        all.truncate(n);
        all
    }
}
