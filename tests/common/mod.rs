//! Helpers shared by the Rust integration tests: a [`Config`] with defaults (override a
//! field with struct update syntax, `Config { enable_events: true, ..config(..) }`), the
//! groups of a kind list, and one chained block-hash function.
// Each test crate uses a different subset of these helpers.
#![allow(dead_code)]

use hybrid_alloc::{AttentionKind, BlockHash, Config, GroupSpec};

/// One group per kind, all of `block_size` tokens, `spec_key` = the group's index.
pub fn groups(kinds: &[AttentionKind], block_size: u32) -> Vec<GroupSpec> {
    kinds.iter().enumerate().map(|(i, &kind)| GroupSpec { kind, block_size, spec_key: i as u32 }).collect()
}

/// A config of `num_blocks` blocks over `groups`, hashed and scheduled at `block_size`;
/// caching on, events off, no watermark, dense retention, no zeroing, no lookahead hashes,
/// `max_model_len` and `max_in_flight_tokens` 4096.
pub fn config(num_blocks: u32, groups: Vec<GroupSpec>, block_size: u32) -> Config {
    Config::new(num_blocks, groups, block_size)
}

/// Chained hashes of blocks with these contents, from `seed`: hash `i` mixes hash `i - 1`
/// with block `i`'s content, so equal hashes mean equal prefixes.
pub fn chain_from(seed: u64, contents: &[u64]) -> Vec<u64> {
    let mut prev = seed;
    contents
        .iter()
        .map(|&c| {
            prev = prev.rotate_left(5) ^ c.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xABCD;
            prev
        })
        .collect()
}

/// [`chain_from`] the tests' common seed.
pub fn chain(contents: &[u64]) -> Vec<u64> {
    chain_from(0x5EED, contents)
}

/// [`chain`] of the first `num_blocks` blocks (at most `contents.len()`), as block hashes.
pub fn chain_hashes(contents: &[u64], num_blocks: u32) -> Vec<BlockHash> {
    let n = (num_blocks as usize).min(contents.len());
    chain(&contents[..n]).into_iter().map(BlockHash::from_u64).collect()
}

/// Hashes as the bytes `Allocator::append_hashes` takes (8 bytes each).
pub fn hash_bytes(hashes: &[BlockHash]) -> Vec<u8> {
    hashes.iter().flat_map(|h| h.as_bytes().to_vec()).collect()
}

/// How many cases a proptest runs: `PROPTEST_CASES` when set (CI and a long soak set it),
/// else `default`.
pub fn proptest_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}
