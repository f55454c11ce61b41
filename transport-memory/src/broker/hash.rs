//! A fast hasher for the crate's own maps: keys are the names of queues and exchanges the
//! user declared and the ids of simulated messages, never hostile input, so the default
//! hasher's protection against flooding only costs time on every lookup.

use std::hash::{BuildHasherDefault, Hasher};

/// A multiply-rotate hasher over 8-byte words.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

/// An odd constant with well-spread bits (2^64 divided by the golden ratio).
const K: u64 = 0x9e37_79b9_7f4a_7c15;

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        // The table indexes by the low bits: fold the well-mixed high bits into them
        // (aligned integers, multiplied, have zero low bits).
        self.0 ^ (self.0 >> 29)
    }
}

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<FastHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn spreads_aligned_integers_and_short_names() {
        let build = BuildHasherDefault::<FastHasher>::default();
        let mut low: Vec<u64> = (0..64u64)
            .map(|i| build.hash_one(0x7f00_0000_0000 + i * 64) & 63)
            .collect();
        low.sort_unstable();
        low.dedup();
        assert!(low.len() > 32, "only {} distinct buckets", low.len());
        assert_ne!(
            build.hash_one("comments"),
            build.hash_one("comments.retry.1m")
        );
    }
}
