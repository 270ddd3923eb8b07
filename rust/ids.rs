//! Integer handles and the block-hash value type.
//!
//! Block ids are `u32` indices into the pool's struct-of-arrays metadata; block 0 is the
//! null block, as in vLLM. A [`BlockHash`] holds the bytes vLLM computed for one hash block
//! (32 for sha256, 16 for xxhash), inline, so hashing and comparing it never allocates.
#![forbid(unsafe_code)]

/// Index of a block in the pool (`0..num_blocks`); 0 is the null block.
pub type BlockId = u32;

/// The null block: a placeholder that fills table slots whose block was freed
/// (out of a window). Never in the free queue, never hashed, never ref-counted.
pub const NULL_BLOCK: BlockId = 0;

/// A request's handle: `generation << 32 | slot`. The slot is a dense index into the
/// coordinator's slab; the generation (`1..2^31`, drawn from a process-wide counter each time
/// a request is added) makes a handle unique in the process, so a stale handle (its request
/// freed, the slot reused) or another allocator's handle is refused instead of reaching the
/// slot's next owner. It fits an `i64`, so Python code can keep it as a plain int.
pub type ReqHandle = u64;

/// Dense index of a request's slot (what the per-group managers index by).
pub type Slot = u32;

/// Index of a KV cache group.
pub type GroupId = u32;

/// Longest hash the core stores inline (sha256).
pub const MAX_HASH_LEN: usize = 32;

/// The hash of one `hash_block_size` block, chained over the whole prefix (vLLM's
/// `BlockHash`). Invariant: bytes past `len` are zero, so derived `Eq`/`Hash` are exact.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockHash {
    bytes: [u8; MAX_HASH_LEN],
    len: u8,
}

impl BlockHash {
    /// Builds a hash from its bytes. An empty hash is refused: dropping it would shift every
    /// later hash of the request by one position (and give it another prefix's blocks).
    ///
    /// # Errors
    /// `None` if `bytes` is empty or longer than [`MAX_HASH_LEN`].
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.is_empty() || bytes.len() > MAX_HASH_LEN {
            return None;
        }
        let mut b = [0u8; MAX_HASH_LEN];
        b[..bytes.len()].copy_from_slice(bytes);
        Some(Self { bytes: b, len: bytes.len() as u8 })
    }

    /// The hash bytes, exactly as vLLM produced them.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// A hash made from an integer (tests and benches).
    pub fn from_u64(x: u64) -> Self {
        let mut b = [0u8; MAX_HASH_LEN];
        b[..8].copy_from_slice(&x.to_be_bytes());
        Self { bytes: b, len: 8 }
    }

    /// The order of [`Self::as_bytes`] (lexicographic: a proper prefix first), without a
    /// byte-wise compare: the bytes past `len` are zero, so the padded arrays compared as
    /// four big-endian words and then the lengths order two hashes as their bytes do
    /// (sorting hash keys, `policy/retention.rs`' `sort_keys`). O(1).
    #[inline]
    pub fn cmp_bytes(&self, other: &Self) -> std::cmp::Ordering {
        let word = |b: &[u8; MAX_HASH_LEN], i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[8 * i..8 * i + 8]);
            u64::from_be_bytes(w)
        };
        (0..MAX_HASH_LEN / 8)
            .map(|i| word(&self.bytes, i).cmp(&word(&other.bytes, i)))
            .find(|o| o.is_ne())
            .unwrap_or_else(|| self.len.cmp(&other.len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmp_bytes_any_lengths_orders_as_the_bytes() {
        // Lengths 1..=32 with trailing zeros, shared prefixes and bytes at every position.
        let mut hashes = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for len in 1..=MAX_HASH_LEN {
            for k in 0..12 {
                let mut b = vec![0u8; len];
                for (i, byte) in b.iter_mut().enumerate() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Mostly small values, so that prefixes and zero tails repeat.
                    *byte = if (k + i) % 3 == 0 { 0 } else { (x % 3) as u8 };
                }
                hashes.push(BlockHash::from_bytes(&b).unwrap());
            }
        }
        for a in &hashes {
            for b in &hashes {
                assert_eq!(a.cmp_bytes(b), a.as_bytes().cmp(b.as_bytes()), "{a:?} vs {b:?}");
            }
        }
    }
}
