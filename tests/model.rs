//! Property test: random operation sequences against [`Allocator`] and a naive model.
//!
//! Each case builds an allocator from one of a few shapes (full attention; full + sliding
//! window 32, 48 or 33; sliding window only; full + chunked local 64; chunked local only), all
//! with block size 16, prefix caching on or off, events on or off, a retention interval of
//! `None`, `Some(0)` or `Some(32)`, and a small pool (20..80 blocks) so that pressure, lazy
//! eviction and `None` results happen. It then runs up to 200 operations: admitting requests
//! (cache-hit search, then `allocate_slots` with the stored hit, sometimes with tokens from a
//! KV connector, loaded synchronously or not), prefill chunks and decode steps (with
//! lookahead, in-flight tokens, delayed caching), preemption, freeing, popping blocks and
//! freeing them later, caching, recycling out-of-window blocks, evicting, resetting the
//! prefix cache, and bad inputs, which must fail and leave the state unchanged.
//!
//! Requests are lists of "token blocks" drawn from a small alphabet with shared prefixes;
//! block hash `i` chains hash `i - 1` with block `i`, so requests sharing a token prefix
//! share hashes, as vLLM's do.
//!
//! After every operation: `invariants::check` (`check_with(.., false)` while popped blocks
//! are outstanding), plus the model's own checks:
//! - free blocks + distinct blocks held (live tables and popped batches) = `num_blocks - 1`;
//! - every table is positional: `cdiv(slots allocated so far, block_size)` long, a prefix
//!   of null blocks exactly as long as the out-of-window blocks recycled so far, then real
//!   blocks, no block twice in one request;
//! - `num_cached` is what the model expects, and a block in a table is hashed only at a
//!   cached position and only with the request's own hash for that position;
//! - the cached keys rebuilt from the events equal the keys the blocks hold.
//!
//! Per operation the model predicts, from the state before it, the free queue after it
//! (LRU order included), the new block ids, the tables, and whether `allocate_slots` fits,
//! and compares `find_longest_cache_hit` with a naive search over the cached keys. After
//! the last operation everything is freed and the pool must be whole again.
//!
//! Steps without a reserve or delayed caching go, every other time, through the fast path
//! (`Allocator::plain_step`, with the request's fields and whole hash list): when it answers
//! "no-op" without running the allocation, the model's prediction (made independently) must
//! be that nothing changes. Block sizes 8, 16 and 32 are drawn per case.
//!
//! A second property ("hit-list shapes", at the end) covers every attention kind's hit list
//! in `allocate_slots`: a list of the wrong length for its group is refused with the state
//! unchanged, except a KV connector's lagging group, and the right list is adopted.
//!
//! `PROPTEST_CASES` overrides the number of cases of each test (default 256; 48 in debug builds).

use std::collections::{HashMap, HashSet};

mod common;

use hybrid_alloc::invariants;
use hybrid_alloc::policy::LEVEL_NORMAL;
use hybrid_alloc::{
    AllocateArgs, Allocator, AttentionKind, BlockHash, BlockId, CacheBlocksArgs, Config, Event, GroupId, GroupSpec,
    HashSource, NewComputed, PlainStep, Policy, ReqHandle, StepFields, NULL_BLOCK,
};
use proptest::prelude::*;

thread_local! {
    /// Tokens per block (every group, and the hash block) of the case running on this thread.
    static BLOCK_SIZE: std::cell::Cell<u32> = const { std::cell::Cell::new(16) };
}

/// Tokens per block of the current case (8, 16 or 32).
#[allow(non_snake_case)]
fn BS() -> u32 {
    BLOCK_SIZE.with(|c| c.get())
}
/// `max_model_len` of every shape (small, so requests reach it).
const MAX_MODEL_LEN: u32 = 512;

type Key = (BlockHash, GroupId);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    Full,
    /// Full attention + a sliding window of this many tokens.
    FullSwa(u32),
    /// One sliding-window group.
    Swa(u32),
    FullChunked64,
    Chunked64,
}

fn group(kind: AttentionKind, spec_key: u32) -> GroupSpec {
    GroupSpec { kind, block_size: BS(), spec_key }
}

fn swa(window: u32) -> AttentionKind {
    AttentionKind::SlidingWindow { window, extra_retained_tokens: 0 }
}

fn make_config(shape: Shape, caching: bool, events: bool, num_blocks: u32, retention: u8) -> Config {
    let chunked = AttentionKind::ChunkedLocal { chunk: 64 };
    let groups = match shape {
        Shape::Full => vec![group(AttentionKind::Full, 0)],
        Shape::FullSwa(w) => vec![group(AttentionKind::Full, 0), group(swa(w), 1)],
        Shape::Swa(w) => vec![group(swa(w), 0)],
        Shape::FullChunked64 => vec![group(AttentionKind::Full, 0), group(chunked, 1)],
        Shape::Chunked64 => vec![group(chunked, 0)],
    };
    let has_swa = groups.iter().any(|g| matches!(g.kind, AttentionKind::SlidingWindow { .. }));
    let retention_interval = match retention % 3 {
        0 => None,
        1 => Some(0),
        _ if has_swa => Some(32),
        _ => Some(0),
    };
    Config {
        max_model_len: MAX_MODEL_LEN,
        max_in_flight_tokens: 128,
        enable_caching: caching,
        enable_events: events,
        watermark_blocks: 2,
        retention_interval,
        ..common::config(num_blocks, groups, BS())
    }
}

fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.rotate_left(17) ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn cdiv(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}

fn num_skipped_tokens(kind: AttentionKind, n: u32) -> u32 {
    match kind {
        AttentionKind::Full | AttentionKind::Rswa { .. } | AttentionKind::Cross | AttentionKind::CircularBuffer => 0,
        AttentionKind::SlidingWindow { window, extra_retained_tokens }
        | AttentionKind::SlidingWindowReplay { window, extra_retained_tokens } => {
            (n as i64 - window as i64 + 1 - extra_retained_tokens as i64).max(0) as u32
        }
        AttentionKind::ChunkedLocal { chunk } => n / chunk * chunk,
        AttentionKind::Mamba { .. } => n.saturating_sub(1),
    }
}

/// A request as the model sees it.
#[derive(Clone, Debug)]
struct Req {
    h: ReqHandle,
    /// Content ids of the prompt's blocks (the last one may be partial).
    prompt: Vec<u64>,
    /// Decides the content of generated tokens (equal seeds, equal outputs).
    seed: u64,
    num_prompt_tokens: u32,
    num_tokens: u32,
    /// `request.num_computed_tokens` (advanced when a step is scheduled).
    computed: u32,
    /// Admitted: `allocate_slots` succeeded once.
    running: bool,
    /// Largest `num_tokens_need_slot` of a successful allocation.
    max_slots: u32,
    /// Per group: table slots recycled into null blocks so far (a prefix).
    null_prefix: Vec<u32>,
    /// Per group: the expected `num_cached` (blocks cached, or counted as such).
    cached: Vec<u32>,
    /// Chained hash values of the full blocks, as sent to the allocator.
    hashes: Vec<u64>,
}

impl Req {
    fn content(&self, j: usize) -> u64 {
        let full_prompt = (self.num_prompt_tokens / BS()) as usize;
        if j < full_prompt {
            self.prompt[j]
        } else if j < self.prompt.len() {
            mix(self.prompt[j], 0xD0 + self.seed)
        } else {
            mix(0xDEC0DE ^ self.seed, j as u64)
        }
    }

    /// Extends `hashes` to every full block; returns the new ones.
    fn extend_hashes(&mut self) -> Vec<u64> {
        let start = self.hashes.len();
        while self.hashes.len() < (self.num_tokens / BS()) as usize {
            let j = self.hashes.len();
            let prev = if j == 0 { 0x5EED } else { self.hashes[j - 1] };
            self.hashes.push(mix(prev, self.content(j)));
        }
        self.hashes[start..].to_vec()
    }

    fn block_hash(&self, i: usize) -> BlockHash {
        BlockHash::from_u64(self.hashes[i])
    }
}

fn hash_bytes(hs: &[u64]) -> Vec<u8> {
    hs.iter().flat_map(|h| BlockHash::from_u64(*h).as_bytes().to_vec()).collect()
}

/// A request's fields as `plain_step` reads them.
struct Fields<'a> {
    args: &'a AllocateArgs,
    hashes: &'a Vec<BlockHash>,
}

impl StepFields for Fields<'_> {
    type Error = hybrid_alloc::Error;
    fn num_computed_tokens(&self) -> Result<i64, Self::Error> {
        Ok(self.args.num_computed_tokens as i64)
    }
    fn num_in_flight_tokens(&self) -> Result<i64, Self::Error> {
        Ok(self.args.num_in_flight_tokens as i64)
    }
    fn num_tokens(&self) -> Result<i64, Self::Error> {
        Ok(self.args.num_tokens as i64)
    }
    fn num_prompt_tokens(&self) -> Result<i64, Self::Error> {
        Ok(self.args.num_prompt_tokens as i64)
    }
    fn shared_prefix_boundary(&self) -> Result<i64, Self::Error> {
        Ok(self.args.shared_prefix_boundary as i64)
    }
    fn with_block_hashes<T>(
        &self,
        f: impl FnOnce(&dyn HashSource) -> Result<T, Self::Error>,
    ) -> Result<T, Self::Error> {
        f(self.hashes)
    }
}

/// Admission of a waiting request (`get_computed_blocks` + `allocate_slots`).
#[derive(Clone, Copy, Debug)]
struct AdmitOp {
    pick: u16,
    /// Prefill budget in tokens.
    chunk: u16,
    lookahead: u8,
    /// Search for a local hit first.
    use_hit: bool,
    /// Tokens a KV connector supplies after the local hit.
    ext: u8,
    /// The external tokens load asynchronously: nothing new is scheduled, caching waits.
    load_async: bool,
    must_fit: bool,
    watermark: bool,
    reserved: u8,
}

/// One scheduler step of a running request.
#[derive(Clone, Copy, Debug)]
struct StepOp {
    pick: u16,
    /// Prefill budget in tokens.
    chunk: u16,
    /// Tokens that join when everything is computed (one decoded token, or accepted drafts).
    grow: u8,
    lookahead: u8,
    reserved: u8,
    /// Computed tokens still in flight (async scheduling): recycling lags behind them.
    in_flight: u8,
    delay_cache: bool,
}

#[derive(Clone, Debug)]
enum Op {
    Add { family: u8, shared: u8, extra: u8, partial: u8, seed: u8, split: bool },
    Admit(AdmitOp),
    Step(StepOp),
    Free { pick: u16 },
    Preempt { pick: u16 },
    Pop { pick: u16 },
    FreePopped { pick: u16 },
    Cache { pick: u16 },
    RemoveSkipped { pick: u16 },
    FindOnly { pick: u16 },
    Evict { ids: Vec<u8> },
    Touch { ids: Vec<u8> },
    Reset,
    Bad { kind: u8, pick: u16 },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u8..3, 0u8..6, 0u8..4, 0u8..16, 0u8..3, any::<bool>()).prop_map(
            |(family, shared, extra, partial, seed, split)| Op::Add { family, shared, extra, partial, seed, split }
        ),
        5 => (
            (any::<u16>(), 1u16..160, 0u8..4, prop::bool::weighted(0.8)),
            (prop_oneof![3 => Just(0u8), 1 => 1u8..100], prop::bool::weighted(0.3)),
            (any::<bool>(), any::<bool>(), 0u8..3)
        )
            .prop_map(|((pick, chunk, lookahead, use_hit), (ext, load_async), (must_fit, watermark, reserved))| {
                Op::Admit(AdmitOp { pick, chunk, lookahead, use_hit, ext, load_async, must_fit, watermark, reserved })
            }),
        12 => (any::<u16>(), 1u16..96, 1u8..20, 0u8..4, 0u8..2, prop_oneof![3 => Just(0u8), 1 => 1u8..4], prop::bool::weighted(0.1))
            .prop_map(|(pick, chunk, grow, lookahead, reserved, in_flight, delay_cache)| {
                Op::Step(StepOp { pick, chunk, grow, lookahead, reserved, in_flight, delay_cache })
            }),
        2 => any::<u16>().prop_map(|pick| Op::Free { pick }),
        1 => any::<u16>().prop_map(|pick| Op::Preempt { pick }),
        1 => any::<u16>().prop_map(|pick| Op::Pop { pick }),
        1 => any::<u16>().prop_map(|pick| Op::FreePopped { pick }),
        1 => any::<u16>().prop_map(|pick| Op::Cache { pick }),
        1 => any::<u16>().prop_map(|pick| Op::RemoveSkipped { pick }),
        1 => any::<u16>().prop_map(|pick| Op::FindOnly { pick }),
        1 => prop::collection::vec(any::<u8>(), 0..4).prop_map(|ids| Op::Evict { ids }),
        1 => prop::collection::vec(any::<u8>(), 0..5).prop_map(|ids| Op::Touch { ids }),
        1 => Just(Op::Reset),
        3 => (0u8..17, any::<u16>()).prop_map(|(kind, pick)| Op::Bad { kind, pick }),
    ]
}

/// The pool as the model reads it before an operation.
#[derive(Clone, Debug)]
struct PoolSnap {
    queue: Vec<BlockId>,
    rc: Vec<u32>,
    hashed: Vec<bool>,
}

/// Everything observable through the public API, for "a failed call changes nothing".
#[derive(Clone, Debug, PartialEq)]
struct Snapshot {
    num_free: u32,
    usage_bits: u64,
    queue: Vec<BlockId>,
    rc: Vec<u32>,
    hashes: Vec<Option<Key>>,
    hash_tokens: Vec<u32>,
    num_requests: usize,
    reqs: Vec<ReqSnapshot>,
}

/// One live request in a [`Snapshot`].
#[derive(Clone, Debug, PartialEq)]
struct ReqSnapshot {
    h: ReqHandle,
    /// Per group.
    tables: Vec<Vec<BlockId>>,
    /// Per group.
    num_cached: Vec<u32>,
    /// Per group: the hit stored by the last search.
    stored_hits: Vec<Vec<BlockId>>,
    hashes: Vec<BlockHash>,
}

/// How often the interesting paths were taken (the generator must reach them).
#[derive(Clone, Copy, Debug, Default)]
struct Stats {
    admitted: u32,
    admitted_with_hit: u32,
    admitted_with_external: u32,
    refused: u32,
    steps: u32,
    steps_refused: u32,
    recycled: u32,
    lazy_evictions: u32,
    shared_hits: u32,
    pops: u32,
    bad: u32,
    resets: u32,
    /// Steps the fast path answered without running the allocation.
    noops: u32,
}

struct Harness {
    a: Allocator,
    stats: Stats,
    caching: bool,
    events: bool,
    kinds: Vec<AttentionKind>,
    reqs: Vec<Req>,
    /// Batches returned by `pop_blocks_for_free`, not yet freed.
    popped: Vec<Vec<BlockId>>,
    /// Cached keys rebuilt from the events (a multiset: duplicates are allowed).
    event_keys: HashMap<Key, i64>,
}

impl Harness {
    fn new(cfg: Config) -> Self {
        let caching = cfg.enable_caching;
        let events = cfg.enable_events;
        let kinds = cfg.groups.iter().map(|g| g.kind).collect();
        let a = Allocator::new(cfg, Policy::Exact).expect("valid config");
        let h = Self {
            a,
            stats: Stats::default(),
            caching,
            events,
            kinds,
            reqs: Vec::new(),
            popped: Vec::new(),
            event_keys: HashMap::new(),
        };
        h.check_all();
        h
    }

    fn ng(&self) -> usize {
        self.kinds.len()
    }

    fn num_blocks(&self) -> u32 {
        self.a.pool().num_blocks()
    }

    fn snap_pool(&self) -> PoolSnap {
        let p = self.a.pool();
        let n = p.num_blocks();
        PoolSnap {
            queue: p.free_queue_order(),
            rc: (0..n).map(|b| p.ref_cnt(b)).collect(),
            hashed: (0..n).map(|b| p.block_hash(b).is_some()).collect(),
        }
    }

    fn tables(&self, h: ReqHandle) -> Vec<Vec<BlockId>> {
        (0..self.ng()).map(|g| self.a.blocks(h, g).unwrap().to_vec()).collect()
    }

    fn snapshot(&self) -> Snapshot {
        let p = self.a.pool();
        let n = p.num_blocks();
        let mut handles: Vec<ReqHandle> = self.a.live_handles().collect();
        handles.sort_unstable();
        Snapshot {
            num_free: self.a.num_free_blocks(),
            usage_bits: self.a.usage().to_bits(),
            queue: p.free_queue_order(),
            rc: (0..n).map(|b| p.ref_cnt(b)).collect(),
            hashes: (0..n).map(|b| p.block_hash(b).copied()).collect(),
            hash_tokens: (0..n).map(|b| p.block_hash_num_tokens(b)).collect(),
            num_requests: self.a.num_requests(),
            reqs: handles
                .into_iter()
                .map(|h| ReqSnapshot {
                    h,
                    tables: self.tables(h),
                    num_cached: self.a.managers().iter().map(|m| m.num_cached(h as u32)).collect(),
                    stored_hits: (0..self.ng()).map(|g| self.a.stored_hit(h, g).unwrap().to_vec()).collect(),
                    hashes: self.a.hashes(h).unwrap().to_vec(),
                })
                .collect(),
        }
    }

    /// Every (hash, group) key some block holds, with multiplicity.
    fn cached_keys(&self) -> HashMap<Key, i64> {
        let p = self.a.pool();
        let mut m = HashMap::new();
        for b in 1..p.num_blocks() {
            if let Some(k) = p.block_hash(b) {
                *m.entry(*k).or_insert(0) += 1;
            }
        }
        m
    }

    fn dead_handle(&self, pick: u16) -> ReqHandle {
        let mut h = (pick % 64) as ReqHandle;
        while self.a.is_live(h) {
            h += 1;
        }
        h
    }

    fn pick(&self, pick: u16, filter: impl Fn(&Req) -> bool) -> Option<usize> {
        let idx: Vec<usize> = (0..self.reqs.len()).filter(|&i| filter(&self.reqs[i])).collect();
        if idx.is_empty() {
            None
        } else {
            Some(idx[pick as usize % idx.len()])
        }
    }

    // ---- checks after every operation ---------------------------------------------------

    fn check_all(&self) {
        invariants::check(&self.a).unwrap();
        let nb = self.num_blocks();
        assert_eq!(self.a.num_requests(), self.reqs.len(), "live request count");
        let mut held: HashSet<BlockId> = HashSet::new();
        for batch in &self.popped {
            held.extend(batch.iter().copied().filter(|&b| b != NULL_BLOCK));
        }
        for r in &self.reqs {
            let tables = self.tables(r.h);
            assert_eq!(self.a.num_hashes(r.h).unwrap(), r.hashes.len(), "hashes of {}", r.h);
            let mut mine = HashSet::new();
            for (g, t) in tables.iter().enumerate() {
                let kind = self.kinds[g];
                let m = &self.a.managers()[g];
                // Positional table: cdiv(slots, bs) long, null prefix, then real blocks.
                assert_eq!(t.len() as u32, cdiv(r.max_slots, BS()), "table length of {} group {g}: {t:?}", r.h);
                let np = r.null_prefix[g] as usize;
                assert!(np <= t.len(), "null prefix {np} past table {t:?}");
                assert!(t[..np].iter().all(|&b| b == NULL_BLOCK), "group {g} ({kind:?}): {t:?} null prefix {np}");
                assert!(t[np..].iter().all(|&b| b != NULL_BLOCK), "group {g} ({kind:?}): {t:?} null prefix {np}");
                if matches!(kind, AttentionKind::Full) {
                    assert_eq!(np, 0);
                }
                for &b in &t[np..] {
                    assert!(mine.insert(b), "block {b} twice in request {}", r.h);
                }
                // num_cached and the hashes blocks hold.
                let nc = m.num_cached(r.h as u32);
                let expect_nc = r.cached[g];
                assert_eq!(nc, expect_nc, "num_cached of {} group {g}", r.h);
                for (i, &b) in t.iter().enumerate() {
                    if b == NULL_BLOCK {
                        continue;
                    }
                    match self.a.pool().block_hash(b) {
                        None => {}
                        Some(k) => {
                            assert!(i < nc as usize, "block {b} at {i} >= num_cached {nc} is hashed");
                            assert_eq!(
                                *k,
                                (r.block_hash(i), g as GroupId),
                                "block {b} at {i} hashed for another prefix"
                            );
                            assert_eq!(self.a.pool().block_hash_num_tokens(b), (i as u32 + 1) * BS());
                        }
                    }
                }
            }
            if !r.running {
                assert!(tables.iter().all(|t| t.is_empty()), "waiting request {} has blocks", r.h);
            }
            held.extend(mine);
        }
        assert_eq!(self.a.num_free_blocks() + held.len() as u32, nb - 1, "free + held != num_blocks - 1");
        if !self.caching {
            assert!((1..nb).all(|b| self.a.pool().block_hash(b).is_none()), "a block is hashed with caching off");
        }
    }

    /// Drains the events and checks them against the keys the blocks hold.
    fn check_events(&mut self) {
        let evs = self.a.take_events();
        if !self.events {
            assert!(evs.is_empty());
            return;
        }
        for e in evs {
            match e {
                Event::Stored { group, hashes, block_indices, block_size, .. } => {
                    assert_eq!(block_size, BS());
                    assert_eq!(hashes.len(), block_indices.len());
                    for h in hashes {
                        *self.event_keys.entry((h, group)).or_insert(0) += 1;
                    }
                }
                Event::Removed { hash, group } => {
                    let c = self.event_keys.entry((hash, group)).or_insert(0);
                    *c -= 1;
                    assert!(*c >= 0, "Removed for a key not stored");
                }
                Event::AllCleared => self.event_keys.clear(),
            }
        }
        self.event_keys.retain(|_, c| *c != 0);
        assert_eq!(self.event_keys, self.cached_keys(), "keys from events != keys held");
    }

    // ---- the naive model of the hit search ----------------------------------------------

    fn naive_hit(&self, r: &Req, max_len: u32) -> (u32, u32) {
        if !self.caching {
            return (0, 0);
        }
        let cached = self.cached_keys();
        let has = |i: u32, g: usize| cached.contains_key(&(r.block_hash(i as usize), g as GroupId));
        let nh = r.hashes.len() as u32;
        let full = |max_tokens: u32, g: usize| {
            let mut n = 0;
            while n < (max_tokens / BS()).min(nh) && has(n, g) {
                n += 1;
            }
            n * BS()
        };
        let sliding = |max_tokens: u32, g: usize, window: u32| {
            let need = cdiv(window - 1, BS());
            let max_blocks = (max_tokens / BS()).min(nh);
            for nb in (0..=max_blocks).rev() {
                if (nb.saturating_sub(need)..nb).all(|i| has(i, g)) {
                    return nb * BS();
                }
            }
            unreachable!("nb = 0 always matches")
        };
        let chunked = |max_tokens: u32, g: usize, chunk: u32| {
            let start = max_tokens / chunk * chunk / BS();
            let end = (max_tokens / BS()).min(nh);
            let mut n = start;
            while n < end && has(n, g) {
                n += 1;
            }
            n * BS()
        };
        let other = |max_tokens: u32, g: usize| match self.kinds[g] {
            AttentionKind::SlidingWindow { window, .. } => sliding(max_tokens, g, window),
            AttentionKind::ChunkedLocal { chunk } => chunked(max_tokens, g, chunk),
            AttentionKind::Full | AttentionKind::Rswa { .. } => full(max_tokens, g),
            AttentionKind::Cross
            | AttentionKind::Mamba { .. }
            | AttentionKind::CircularBuffer
            | AttentionKind::SlidingWindowReplay { .. } => unreachable!("the model draws no such group"),
        };
        if self.ng() == 1 {
            (other(max_len, 0), 0)
        } else {
            let f = full(max_len, 0);
            let hit = other(f, 1);
            (hit, f - hit)
        }
    }

    /// The free queue after `free_blocks(blocks)`, as vLLM orders it.
    fn sim_free(
        &self,
        q: &mut Vec<BlockId>,
        rc: &mut [u32],
        hashed: &[bool],
        blocks: impl IntoIterator<Item = BlockId>,
    ) {
        let mut first = Vec::new();
        let mut last = Vec::new();
        for b in blocks {
            if b == NULL_BLOCK {
                continue;
            }
            rc[b as usize] -= 1;
            if rc[b as usize] == 0 {
                if !hashed[b as usize] || !self.caching {
                    first.push(b);
                } else {
                    last.push(b);
                }
            }
        }
        q.splice(0..0, first);
        q.extend(last);
    }

    /// Predicts the recycling `remove_skipped_blocks(h, processed)` does: updates the
    /// expected tables, queue and ref counts; returns the new null prefixes.
    fn sim_remove_skipped(
        &self,
        r: &Req,
        processed: u32,
        tables: &mut [Vec<BlockId>],
        q: &mut Vec<BlockId>,
        rc: &mut [u32],
        hashed: &[bool],
    ) -> Vec<u32> {
        let mut nps = r.null_prefix.clone();
        for g in 0..self.ng() {
            let n = (num_skipped_tokens(self.kinds[g], processed) / BS()).min(tables[g].len() as u32);
            if n > nps[g] {
                let freed: Vec<BlockId> = (nps[g]..n).rev().map(|i| tables[g][i as usize]).collect();
                self.sim_free(q, rc, hashed, freed);
                for i in nps[g]..n {
                    tables[g][i as usize] = NULL_BLOCK;
                }
                nps[g] = n;
            }
        }
        nps
    }

    fn count_lazy_evictions(&mut self, before: &PoolSnap) {
        self.stats.lazy_evictions +=
            self.a.new_block_ids().iter().filter(|&&b| before.hashed[b as usize]).count() as u32;
    }

    /// Checks the new block ids of a successful allocation against the predicted queue
    /// front and appends them to the expected tables.
    fn take_new_blocks(&self, n: u32, per_group: &[u32], q: &mut Vec<BlockId>, tables: &mut [Vec<BlockId>]) {
        assert_eq!(per_group.iter().sum::<u32>(), n);
        assert_eq!(self.a.new_block_counts(), per_group, "new blocks per group");
        let expect: Vec<BlockId> = q.drain(..n as usize).collect();
        assert_eq!(self.a.new_block_ids(), &expect[..], "new blocks are not the queue front");
        let mut it = expect.into_iter();
        for (g, &c) in per_group.iter().enumerate() {
            tables[g].extend(it.by_ref().take(c as usize));
        }
    }

    // ---- operations ---------------------------------------------------------------------

    fn add(&mut self, family: u8, shared: u8, extra: u8, partial: u8, seed: u8, split: bool) {
        let nblocks = (shared as usize + extra as usize).max(1);
        let prompt: Vec<u64> = (0..nblocks)
            .map(|j| {
                if j < shared as usize {
                    family as u64 * 1000 + j as u64
                } else {
                    700 + (seed as u64 * 7 + j as u64) % 3
                }
            })
            .collect();
        let num_prompt_tokens = (nblocks as u32 * BS()).saturating_sub(partial as u32 % BS()).max(1);
        let h = self.a.add_request();
        assert!(self.reqs.iter().all(|r| r.h != h), "handle {h} handed out twice");
        let mut r = Req {
            h,
            prompt,
            seed: seed as u64,
            num_prompt_tokens,
            num_tokens: num_prompt_tokens,
            computed: 0,
            running: false,
            max_slots: 0,
            null_prefix: vec![0; self.ng()],
            cached: vec![0; self.ng()],
            hashes: Vec::new(),
        };
        let hs = r.extend_hashes();
        let cut = if split { hs.len() / 2 } else { 0 };
        self.a.append_hashes(h, &hash_bytes(&hs[..cut]), 8).unwrap();
        self.a.append_hashes(h, &hash_bytes(&hs[cut..]), 8).unwrap();
        assert!(self.tables(h).iter().all(|t| t.is_empty()));
        self.reqs.push(r);
    }

    /// `get_computed_blocks` then `allocate_slots`, as the scheduler admits a waiting request,
    /// possibly with tokens from a KV connector after the local hit.
    fn admit(&mut self, o: &AdmitOp) {
        let Some(i) = self.pick(o.pick, |r| !r.running) else { return };
        let r = self.reqs[i].clone();
        let (hit, stored) = if o.use_hit {
            let expect = self.naive_hit(&r, r.num_tokens - 1);
            let got = self.a.find_longest_cache_hit(r.h, r.num_tokens - 1).unwrap();
            assert_eq!((got.num_tokens, got.num_uncached_common_prefix_tokens), expect, "hit of {r:?}");
            let stored = self.check_stored_hit(&r, got.num_tokens);
            (got.num_tokens, stored)
        } else {
            (0, vec![Vec::new(); self.ng()])
        };
        let ext = (o.ext as u32).min(r.num_tokens - 1 - hit);
        let load_async = o.load_async && ext > 0;
        let total = hit + ext;
        let new = if load_async { 0 } else { (o.chunk as u32).min(r.num_tokens - total) };
        let need_slot = (total + new + o.lookahead as u32).min(MAX_MODEL_LEN);
        let args = AllocateArgs {
            num_new_tokens: new,
            num_new_computed_tokens: hit,
            num_lookahead_tokens: o.lookahead as u32,
            num_external_computed_tokens: ext,
            delay_cache_blocks: load_async,
            full_sequence_must_fit: o.must_fit,
            reserved_blocks: o.reserved as u32,
            apply_watermark: o.watermark,
            num_computed_tokens: 0,
            num_prompt_tokens: r.num_prompt_tokens,
            num_tokens: r.num_tokens,
            ..Default::default()
        };
        // Predict: what it needs, whether it fits, the tables and the queue after.
        let before = self.snap_pool();
        let cfg = self.a.config().clone();
        let watermark = if o.watermark { cfg.watermark_blocks as i64 } else { 0 };
        let free = before.queue.len() as i64;
        let adopts = stored.iter().any(|v| !v.is_empty()) || ext > 0;
        let (mut need_full, mut need) = (0i64, 0i64);
        let (mut ext_blocks, mut per_group) = (Vec::new(), Vec::new());
        let mut tables = vec![Vec::new(); self.ng()];
        let mut nps = vec![0; self.ng()];
        let mut cached = vec![0; self.ng()];
        for g in 0..self.ng() {
            let skipped_tokens = num_skipped_tokens(self.kinds[g], total);
            let skipped = skipped_tokens / BS();
            let hit_len = stored[g].len() as i64;
            let kept = stored[g].get(skipped as usize..).unwrap_or(&[]);
            let evictable = kept.iter().filter(|&&b| b != NULL_BLOCK && before.rc[b as usize] == 0).count() as i64;
            // The table after adoption: out-of-window nulls, then the hit blocks still needed.
            let local = (skipped as i64).max(hit_len);
            let mut full = cdiv(r.num_tokens.min(MAX_MODEL_LEN), BS()) as i64;
            if let Some(cap) = cfg.max_admission_blocks(&cfg.groups[g]) {
                full = full.min(cap as i64);
            }
            need_full += (full - local).max(0) + evictable;
            let required = cdiv(need_slot, BS()) as i64;
            need += (required - local).max(0) + evictable;
            // Blocks for the connector's tokens inside the window come first.
            let ext_in_window = if skipped_tokens > 0 { ext.min(total - skipped_tokens) } else { ext };
            let e = if ext_in_window > 0 { (cdiv(total, BS()) as i64 - local).max(0) } else { 0 };
            ext_blocks.push(e as usize);
            per_group.push((required - local - e).max(0) as u32);
            if adopts {
                tables[g].extend(std::iter::repeat_n(NULL_BLOCK, skipped as usize));
                tables[g].extend_from_slice(kept);
                nps[g] = skipped;
                cached[g] = local as u32;
            }
        }
        let fits = !(o.must_fit && need_full + watermark > free) && need + watermark <= free - o.reserved as i64;

        let nc = if o.use_hit { NewComputed::Stored } else { NewComputed::Empty };
        let res = self.a.allocate_slots(r.h, &args, nc, None).unwrap();
        assert_eq!(res.is_some(), fits, "admission of {r:?} ({o:?}): need {need} (full {need_full}), free {free}");
        if let Some(n) = res {
            let mut q = before.queue.clone();
            let mut rc = before.rc.clone();
            for t in &tables {
                for &b in t {
                    if b != NULL_BLOCK {
                        if rc[b as usize] == 0 {
                            q.retain(|&x| x != b);
                        } else {
                            self.stats.shared_hits += 1;
                        }
                        rc[b as usize] += 1;
                    }
                }
            }
            for (t, &e) in tables.iter_mut().zip(&ext_blocks) {
                t.extend(q.drain(..e));
            }
            self.take_new_blocks(n, &per_group, &mut q, &mut tables);
            self.count_lazy_evictions(&before);
            self.stats.admitted += 1;
            self.stats.admitted_with_hit += (hit > 0) as u32;
            self.stats.admitted_with_external += (ext > 0) as u32;
            assert_eq!(self.tables(r.h), tables, "tables after admitting {} ({o:?})", r.h);
            assert_eq!(self.a.pool().free_queue_order(), q, "free queue after admitting {}", r.h);
            let m = &mut self.reqs[i];
            m.running = true;
            m.computed = total + new;
            m.max_slots = need_slot;
            m.null_prefix = nps;
            m.cached = cached;
            if self.caching && !load_async {
                let full_blocks = m.computed.min(m.num_tokens) / BS();
                m.cached.iter_mut().for_each(|c| *c = (*c).max(full_blocks));
            }
        } else {
            self.stats.refused += 1;
            assert!(self.tables(r.h).iter().all(|t| t.is_empty()));
            assert_eq!(self.a.pool().free_queue_order(), before.queue, "a refused admission changed the queue");
        }
    }

    /// Checks the hit stored by `find_longest_cache_hit`; returns it.
    fn check_stored_hit(&self, r: &Req, hit: u32) -> Vec<Vec<BlockId>> {
        assert_eq!(hit % BS(), 0);
        assert!(hit < r.num_tokens);
        let mut out = Vec::new();
        for g in 0..self.ng() {
            let s = self.a.stored_hit(r.h, g).unwrap().to_vec();
            assert_eq!(s.len() as u32, hit / BS(), "stored hit of group {g}: {s:?}");
            for (i, &b) in s.iter().enumerate() {
                if b != NULL_BLOCK {
                    let key = self.a.pool().block_hash(b).copied();
                    assert_eq!(key, Some((r.block_hash(i), g as GroupId)), "hit block {b} at {i}");
                }
            }
            if matches!(self.kinds[g], AttentionKind::Full) {
                assert!(s.iter().all(|&b| b != NULL_BLOCK));
            }
            out.push(s);
        }
        out
    }

    /// One scheduler step of a running request: a prefill chunk, or (when everything is
    /// computed) `grow` new tokens (a decode token, or accepted drafts) then their slots.
    fn step(&mut self, o: &StepOp) {
        let Some(i) = self.pick(o.pick, |r| r.running) else { return };
        if self.reqs[i].computed == self.reqs[i].num_tokens {
            let grow = (o.grow as u32).min(MAX_MODEL_LEN - self.reqs[i].num_tokens);
            if grow == 0 {
                return;
            }
            let r = &mut self.reqs[i];
            r.num_tokens += grow;
            let hs = r.extend_hashes();
            let h = r.h;
            self.a.append_hashes(h, &hash_bytes(&hs), 8).unwrap();
        }
        let r = self.reqs[i].clone();
        let new = (o.chunk as u32).min(r.num_tokens - r.computed);
        let need_slot = (r.computed + new + o.lookahead as u32).min(MAX_MODEL_LEN);
        let in_flight = (o.in_flight as u32).min(r.computed);
        let args = AllocateArgs {
            num_new_tokens: new,
            num_lookahead_tokens: o.lookahead as u32,
            reserved_blocks: o.reserved as u32,
            delay_cache_blocks: o.delay_cache,
            num_computed_tokens: r.computed,
            num_in_flight_tokens: in_flight,
            num_prompt_tokens: r.num_prompt_tokens,
            num_tokens: r.num_tokens,
            ..Default::default()
        };
        let before = self.snap_pool();
        let mut q = before.queue.clone();
        let mut rc = before.rc.clone();
        let mut tables = self.tables(r.h);
        let processed = r.computed.min(MAX_MODEL_LEN) - in_flight;
        let nps = self.sim_remove_skipped(&r, processed, &mut tables, &mut q, &mut rc, &before.hashed);
        let per_group: Vec<u32> =
            tables.iter().map(|t| (cdiv(need_slot, BS()) as i64 - t.len() as i64).max(0) as u32).collect();
        let need: u32 = per_group.iter().sum();
        let fits = need as i64 <= q.len() as i64 - o.reserved as i64;

        let plain = o.reserved == 0 && !o.delay_cache && new > 0 && o.pick % 2 == 0;
        let mut noop = false;
        let res = if plain {
            let hashes: Vec<BlockHash> = r.hashes.iter().map(|&x| BlockHash::from_u64(x)).collect();
            let fields = Fields { args: &args, hashes: &hashes };
            match self.a.plain_step(r.h, new as i64, o.lookahead as i64, &fields).unwrap() {
                PlainStep::NoOp => {
                    assert_eq!(need, 0, "no-op step of {r:?} that needs {need} blocks");
                    self.stats.noops += 1;
                    noop = true;
                    Some(0)
                }
                PlainStep::Allocated(res) => res,
                PlainStep::NotHere => panic!("live request {} not found by plain_step", r.h),
            }
        } else {
            self.a.allocate_slots(r.h, &args, NewComputed::Empty, None).unwrap()
        };
        assert_eq!(res.is_some(), fits, "step of {r:?}: need {need}, free after recycling {}", q.len());
        if let Some(n) = res.filter(|_| !noop) {
            self.take_new_blocks(n, &per_group, &mut q, &mut tables);
            self.count_lazy_evictions(&before);
        }
        self.stats.steps += 1;
        self.stats.steps_refused += res.is_none() as u32;
        self.stats.recycled += nps.iter().zip(&r.null_prefix).map(|(a, b)| a - b).sum::<u32>();
        assert_eq!(self.tables(r.h), tables, "tables after a step of {}", r.h);
        assert_eq!(self.a.pool().free_queue_order(), q, "free queue after a step of {}", r.h);
        let m = &mut self.reqs[i];
        m.null_prefix = nps;
        if res.is_some() {
            m.computed += new;
            m.max_slots = m.max_slots.max(need_slot);
            if self.caching && !o.delay_cache {
                let full_blocks = m.computed.min(m.num_tokens) / BS();
                m.cached.iter_mut().for_each(|c| *c = (*c).max(full_blocks));
            }
        }
    }

    fn free(&mut self, i: usize) {
        let r = self.reqs.remove(i);
        let before = self.snap_pool();
        let mut q = before.queue.clone();
        let mut rc = before.rc.clone();
        for t in self.tables(r.h) {
            self.sim_free(&mut q, &mut rc, &before.hashed, t.into_iter().rev());
        }
        self.a.free(r.h, LEVEL_NORMAL).unwrap();
        assert!(!self.a.is_live(r.h));
        assert_eq!(self.a.pool().free_queue_order(), q, "free queue after freeing {}", r.h);
    }

    /// Preemption: the request is freed and comes back waiting, with its tokens.
    fn preempt(&mut self, i: usize) {
        let old = self.reqs[i].clone();
        self.free(i);
        let h = self.a.add_request();
        self.a.append_hashes(h, &hash_bytes(&old.hashes), 8).unwrap();
        let ng = self.ng();
        let r =
            Req { h, computed: 0, running: false, max_slots: 0, null_prefix: vec![0; ng], cached: vec![0; ng], ..old };
        self.reqs.push(r);
    }

    fn pop(&mut self, i: usize) {
        let r = self.reqs.remove(i);
        let expect: Vec<BlockId> = self.tables(r.h).concat();
        let before = self.snapshot();
        let mut out = Vec::new();
        self.a.pop_blocks_for_free(r.h, &mut out).unwrap();
        assert_eq!(out, expect, "pop_blocks_for_free returns the tables in group order");
        assert!(!self.a.is_live(r.h));
        let after = self.snapshot();
        assert_eq!((after.queue, after.rc), (before.queue, before.rc), "pop freed something");
        self.stats.pops += 1;
        if !out.is_empty() {
            self.popped.push(out);
        }
    }

    fn free_popped(&mut self, pick: u16) {
        if self.popped.is_empty() {
            return;
        }
        let batch = self.popped.remove(pick as usize % self.popped.len());
        let before = self.snap_pool();
        let mut q = before.queue.clone();
        let mut rc = before.rc.clone();
        self.sim_free(&mut q, &mut rc, &before.hashed, batch.iter().copied());
        self.a.free_block_ids(&batch).unwrap();
        assert_eq!(self.a.pool().free_queue_order(), q, "free queue after free_block_ids");
    }

    fn cache(&mut self, pick: u16) {
        let Some(i) = self.pick(pick, |r| r.running) else { return };
        let r = &self.reqs[i];
        let before = self.snapshot();
        self.a
            .cache_blocks(
                r.h,
                &CacheBlocksArgs {
                    num_computed_tokens: r.computed,
                    num_prompt_tokens: r.num_prompt_tokens,
                    shared_prefix_boundary: 0,
                    ..Default::default()
                },
                None,
            )
            .unwrap();
        let after = self.snapshot();
        assert_eq!((after.queue, after.rc), (before.queue, before.rc), "cache_blocks moved blocks");
        if self.caching {
            let full_blocks = self.reqs[i].computed / BS();
            self.reqs[i].cached.iter_mut().for_each(|c| *c = (*c).max(full_blocks));
        }
    }

    fn remove_skipped(&mut self, pick: u16) {
        let Some(i) = self.pick(pick, |_| true) else { return };
        let r = self.reqs[i].clone();
        let before = self.snap_pool();
        let mut q = before.queue.clone();
        let mut rc = before.rc.clone();
        let mut tables = self.tables(r.h);
        let nps = self.sim_remove_skipped(&r, r.computed, &mut tables, &mut q, &mut rc, &before.hashed);
        self.a.remove_skipped_blocks(r.h, r.computed, None).unwrap();
        assert_eq!(self.tables(r.h), tables, "tables after remove_skipped_blocks");
        assert_eq!(self.a.pool().free_queue_order(), q, "free queue after remove_skipped_blocks");
        self.reqs[i].null_prefix = nps;
    }

    fn find_only(&mut self, pick: u16) {
        let Some(i) = self.pick(pick, |r| !r.running) else { return };
        let r = self.reqs[i].clone();
        let expect = self.naive_hit(&r, r.num_tokens - 1);
        let before = self.snapshot();
        let got = self.a.find_longest_cache_hit(r.h, r.num_tokens - 1).unwrap();
        assert_eq!((got.num_tokens, got.num_uncached_common_prefix_tokens), expect);
        self.check_stored_hit(&r, got.num_tokens);
        let after = self.snapshot();
        assert_eq!((after.queue, after.rc, after.hashes), (before.queue, before.rc, before.hashes), "a search touched");
    }

    /// A connector's pins (`touch_block_ids`, vLLM's `block_pool.touch`): each non-null block
    /// gains a reference, a free one leaves the queue; the pins are given back later as a
    /// popped batch (`free_block_ids`).
    fn touch(&mut self, ids: &[u8]) {
        let ids: Vec<BlockId> = ids.iter().map(|&x| x as u32 % self.num_blocks()).collect();
        let before = self.snap_pool();
        let (mut q, mut rc) = (before.queue.clone(), before.rc.clone());
        for &b in ids.iter().filter(|&&b| b != NULL_BLOCK) {
            if rc[b as usize] == 0 {
                q.retain(|&x| x != b);
            }
            rc[b as usize] += 1;
        }
        self.a.touch_block_ids(&ids).unwrap();
        let after = self.snap_pool();
        assert_eq!((after.queue, after.rc), (q, rc), "touch_block_ids");
        let pins: Vec<BlockId> = ids.into_iter().filter(|&b| b != NULL_BLOCK).collect();
        if !pins.is_empty() {
            self.popped.push(pins);
        }
    }

    fn evict(&mut self, ids: &[u8]) {
        let ids: Vec<BlockId> = ids.iter().map(|&x| x as u32 % self.num_blocks()).collect();
        let before = self.snapshot();
        self.a.evict_blocks(&ids).unwrap();
        for &b in &ids {
            assert!(self.a.pool().block_hash(b).is_none(), "evicted block {b} still hashed");
        }
        let after = self.snapshot();
        assert_eq!((after.queue, after.rc), (before.queue, before.rc), "evict_blocks moved blocks");
    }

    fn reset(&mut self) {
        let all_free = self.a.num_free_blocks() == self.num_blocks() - 1;
        let before = self.snap_pool();
        assert_eq!(self.a.reset_prefix_cache(), all_free);
        self.stats.resets += all_free as u32;
        if all_free {
            assert!(self.cached_keys().is_empty(), "reset left hashes");
        }
        assert_eq!(self.a.pool().free_queue_order(), before.queue);
    }

    /// A bad input: must fail with an error and change nothing.
    fn bad(&mut self, kind: u8, pick: u16) {
        let dead = self.dead_handle(pick);
        let nb = self.num_blocks();
        let ng = self.ng();
        let one = AllocateArgs { num_new_tokens: 1, num_tokens: 1, num_prompt_tokens: 1, ..Default::default() };
        if kind == 1 {
            // Double free: free a live request, then free it again.
            let Some(i) = self.pick(pick, |_| true) else { return };
            let h = self.reqs[i].h;
            self.free(i);
            self.check_all();
            let before = self.snapshot();
            assert!(self.a.free(h, LEVEL_NORMAL).is_err(), "double free of {h} accepted");
            assert_eq!(self.snapshot(), before, "a double free changed the state");
            return;
        }
        if kind == 13 {
            // A running request searches again; adopting the hit must be refused.
            let Some(i) = self.pick(pick, |r| r.running) else { return };
            let r = self.reqs[i].clone();
            let hit = self.a.find_longest_cache_hit(r.h, r.num_tokens - 1).unwrap();
            let tracked = self.a.managers().iter().any(|m| m.is_tracked(r.h as u32));
            if hit.num_tokens == 0 || !tracked {
                return;
            }
            let before = self.snapshot();
            let args = AllocateArgs { num_new_tokens: 1, num_new_computed_tokens: hit.num_tokens, ..one };
            assert!(self.a.allocate_slots(r.h, &args, NewComputed::Stored, None).is_err());
            assert_eq!(self.snapshot(), before, "a refused adoption changed the state");
            return;
        }
        let live = self.pick(pick, |_| true).map(|i| self.reqs[i].h);
        let waiting = self.pick(pick, |r| !r.running).map(|i| self.reqs[i].h);
        let tracked = self
            .pick(pick, |r| r.running)
            .map(|i| self.reqs[i].h)
            .filter(|&h| self.a.managers().iter().any(|m| m.is_tracked(h as u32)));
        let untracked = self
            .pick(pick, |r| r.running && r.max_slots > 0)
            .map(|i| self.reqs[i].h)
            .filter(|&h| self.a.managers().iter().all(|m| !m.is_tracked(h as u32)));
        let valid_hit: Vec<Vec<BlockId>> = (0..ng).map(|g| if g == 0 { vec![1] } else { Vec::new() }).collect();
        let before = self.snapshot();
        let err = match kind {
            0 => self.a.allocate_slots(dead, &one, NewComputed::Empty, None).is_err(),
            2 => match live {
                Some(h) => self.a.allocate_slots(h, &AllocateArgs::default(), NewComputed::Empty, None).is_err(),
                None => return,
            },
            3 => {
                let mut ids: Vec<BlockId> = (0..nb).step_by(3).collect();
                ids.insert(pick as usize % (ids.len() + 1), nb + pick as u32 % 5);
                self.a.evict_blocks(&ids).is_err() && self.a.touch_block_ids(&ids).is_err()
            }
            4 => {
                let mut ids = self.popped.first().cloned().unwrap_or_default();
                ids.push(nb + pick as u32 % 5);
                self.a.free_block_ids(&ids).is_err()
            }
            5 => {
                // One free more than the block's references (pool-held or not).
                let b = 1 + pick as u32 % (nb - 1);
                let mut ids = self.popped.first().cloned().unwrap_or_default();
                let extra = self.a.pool().ref_cnt(b) + 1 - ids.iter().filter(|&&x| x == b).count() as u32;
                ids.extend(std::iter::repeat_n(b, extra as usize));
                self.a.free_block_ids(&ids).is_err()
            }
            6 => self.a.find_longest_cache_hit(dead, 100).is_err(),
            7 => self
                .a
                .cache_blocks(
                    dead,
                    &CacheBlocksArgs { num_computed_tokens: 16, num_prompt_tokens: 16, ..Default::default() },
                    None,
                )
                .is_err(),
            8 => self.a.remove_skipped_blocks(dead, 1000, None).is_err(),
            9 => {
                let mut out = Vec::new();
                let e = self.a.pop_blocks_for_free(dead, &mut out).is_err()
                    && self.a.append_hashes(dead, &[1; 8], 8).is_err()
                    && self.a.blocks(dead, 0).is_err()
                    && self.a.estimate_cached_tokens(dead).is_err()
                    && self.a.truncate_hashes(dead, 0).is_err();
                assert!(out.is_empty());
                e
            }
            10 => match live {
                Some(h) => {
                    let (bytes, len) =
                        [(vec![1u8; 16], 0), (vec![1u8; 66], 33), (vec![1u8; 10], 8)][pick as usize % 3].clone();
                    self.a.append_hashes(h, &bytes, len).is_err()
                }
                None => return,
            },
            11 => match waiting {
                Some(h) => {
                    let wrong = vec![Vec::new(); ng + 1];
                    self.a.allocate_slots(h, &one, NewComputed::Explicit(&wrong), None).is_err()
                }
                None => return,
            },
            12 => match waiting {
                Some(h) => {
                    let mut bad = valid_hit.clone();
                    bad[0] = vec![nb + pick as u32 % 3];
                    let args = AllocateArgs { num_new_computed_tokens: BS(), num_tokens: 2 * BS(), ..one };
                    self.a.allocate_slots(h, &args, NewComputed::Explicit(&bad), None).is_err()
                }
                None => return,
            },
            15 => match untracked {
                // Holds blocks but cached none yet: adopting would need an empty table.
                Some(h) => {
                    let args = AllocateArgs { num_new_computed_tokens: BS(), num_tokens: 2 * BS(), ..one };
                    let ext = AllocateArgs { num_external_computed_tokens: BS(), num_tokens: 2 * BS(), ..one };
                    self.a.allocate_slots(h, &args, NewComputed::Explicit(&valid_hit), None).is_err()
                        && self.a.allocate_slots(h, &ext, NewComputed::Empty, None).is_err()
                }
                None => return,
            },
            16 => match waiting {
                Some(h) if !self.caching => {
                    let args = AllocateArgs { num_new_computed_tokens: BS(), num_tokens: 2 * BS(), ..one };
                    self.a.allocate_slots(h, &args, NewComputed::Explicit(&valid_hit), None).is_err()
                }
                _ => return,
            },
            _ => match tracked {
                Some(h) => {
                    let args = AllocateArgs { num_new_computed_tokens: BS(), num_tokens: 2 * BS(), ..one };
                    self.a.allocate_slots(h, &args, NewComputed::Explicit(&valid_hit), None).is_err()
                }
                None => return,
            },
        };
        assert!(err, "bad input of kind {kind} accepted");
        self.stats.bad += 1;
        assert_eq!(self.snapshot(), before, "bad input of kind {kind} changed the state");
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Add { family, shared, extra, partial, seed, split } => {
                self.add(family, shared, extra, partial, seed, split)
            }
            Op::Admit(o) => self.admit(&o),
            Op::Step(o) => self.step(&o),
            Op::Free { pick } => {
                if let Some(i) = self.pick(pick, |_| true) {
                    self.free(i)
                }
            }
            Op::Preempt { pick } => {
                if let Some(i) = self.pick(pick, |_| true) {
                    self.preempt(i)
                }
            }
            Op::Pop { pick } => {
                if let Some(i) = self.pick(pick, |_| true) {
                    self.pop(i)
                }
            }
            Op::FreePopped { pick } => self.free_popped(pick),
            Op::Cache { pick } => self.cache(pick),
            Op::RemoveSkipped { pick } => self.remove_skipped(pick),
            Op::FindOnly { pick } => self.find_only(pick),
            Op::Evict { ref ids } => self.evict(ids),
            Op::Touch { ref ids } => self.touch(ids),
            Op::Reset => self.reset(),
            Op::Bad { kind, pick } => self.bad(kind, pick),
        }
        self.check_all();
        self.check_events();
    }

    /// Frees everything; the pool must be whole again.
    fn teardown(&mut self) {
        while !self.reqs.is_empty() {
            self.free(self.reqs.len() - 1);
            self.check_all();
        }
        while !self.popped.is_empty() {
            self.free_popped(0);
            self.check_all();
        }
        self.check_events();
        invariants::check(&self.a).unwrap();
        assert_eq!(self.a.num_free_blocks(), self.num_blocks() - 1);
        assert_eq!(self.a.usage(), 0.0);
        assert_eq!(self.a.num_requests(), 0);
        assert!(self.a.reset_prefix_cache());
        assert!(self.cached_keys().is_empty());
        self.check_events();
    }
}

fn run_case(shape: Shape, caching: bool, events: bool, num_blocks: u32, retention: u8, ops: &[Op]) -> Stats {
    run_case_bs(16, shape, caching, events, num_blocks, retention, ops)
}

fn run_case_bs(
    bs: u32,
    shape: Shape,
    caching: bool,
    events: bool,
    num_blocks: u32,
    retention: u8,
    ops: &[Op],
) -> Stats {
    BLOCK_SIZE.with(|c| c.set(bs));
    let mut h = Harness::new(make_config(shape, caching, events, num_blocks, retention));
    for op in ops {
        h.apply(op);
    }
    h.teardown();
    h.stats
}

/// Sliding windows: multiples of the block size, and 33, where `window - 1` (not `window`)
/// decides how many contiguous blocks a hit needs.
const WINDOWS: [u32; 3] = [32, 48, 33];

/// Block sizes of the random cases (all groups and the hash block share one).
const BLOCK_SIZES: [u32; 3] = [8, 16, 32];

/// Cases per property test: `PROPTEST_CASES`, else 256 in release builds and 48 in debug
/// builds (overflow checks and debug asserts on, about 20 times slower).
fn cases() -> u32 {
    let default = if cfg!(debug_assertions) { 48 } else { 256 };
    common::proptest_cases(default)
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op_strategy(), 1..200)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn ops_full_attention_invariants_hold(
        bs in prop::sample::select(&BLOCK_SIZES[..]), caching in prop::bool::weighted(0.8), events: bool,
        nb in 20u32..80, ret: u8, ops in ops()
    ) {
        run_case_bs(bs, Shape::Full, caching, events, nb, ret, &ops);
    }

    #[test]
    fn ops_full_and_sliding_window_invariants_hold(
        bs in prop::sample::select(&BLOCK_SIZES[..]), window in prop::sample::select(&WINDOWS[..]),
        caching in prop::bool::weighted(0.8), events: bool, nb in 20u32..80, ret: u8, ops in ops()
    ) {
        run_case_bs(bs, Shape::FullSwa(window), caching, events, nb, ret, &ops);
    }

    #[test]
    fn ops_sliding_window_only_invariants_hold(
        bs in prop::sample::select(&BLOCK_SIZES[..]), window in prop::sample::select(&WINDOWS[..]),
        caching in prop::bool::weighted(0.8), events: bool, nb in 20u32..80, ret: u8, ops in ops()
    ) {
        run_case_bs(bs, Shape::Swa(window), caching, events, nb, ret, &ops);
    }

    #[test]
    fn ops_chunked_local_invariants_hold(
        bs in prop::sample::select(&BLOCK_SIZES[..]), with_full: bool, caching in prop::bool::weighted(0.8),
        events: bool, nb in 20u32..80, ret: u8, ops in ops()
    ) {
        let shape = if with_full { Shape::FullChunked64 } else { Shape::Chunked64 };
        run_case_bs(bs, shape, caching, events, nb, ret, &ops);
    }
}

fn admit(pick: u16, chunk: u16, ext: u8) -> AdmitOp {
    AdmitOp {
        pick,
        chunk,
        lookahead: 0,
        use_hit: true,
        ext,
        load_async: false,
        must_fit: false,
        watermark: false,
        reserved: 0,
    }
}

fn step(chunk: u16, lookahead: u8, in_flight: u8, delay_cache: bool) -> StepOp {
    StepOp { pick: 0, chunk, grow: 19, lookahead, reserved: 0, in_flight, delay_cache }
}

/// A fixed sequence exercising every operation once per shape (a smoke test that runs
/// even when proptest's case count is set to 0).
#[test]
fn ops_fixed_sequence_every_shape_invariants_hold() {
    let seq = vec![
        Op::Add { family: 0, shared: 4, extra: 1, partial: 3, seed: 0, split: true },
        Op::Admit(admit(0, 200, 0)),
        Op::Step(step(8, 2, 0, false)),
        Op::Step(step(8, 2, 1, true)),
        Op::Step(step(32, 0, 2, false)),
        Op::Cache { pick: 0 },
        Op::Add { family: 0, shared: 4, extra: 1, partial: 3, seed: 0, split: false },
        Op::FindOnly { pick: 1 },
        Op::Admit(AdmitOp {
            pick: 1,
            chunk: 16,
            lookahead: 1,
            must_fit: true,
            watermark: true,
            reserved: 1,
            ..admit(1, 16, 0)
        }),
        Op::Add { family: 1, shared: 5, extra: 3, partial: 0, seed: 1, split: false },
        Op::Admit(AdmitOp { load_async: true, ..admit(2, 16, 90) }),
        Op::Step(step(64, 0, 0, false)),
        Op::RemoveSkipped { pick: 1 },
        Op::Bad { kind: 13, pick: 0 },
        Op::Pop { pick: 0 },
        Op::Bad { kind: 5, pick: 3 },
        Op::Bad { kind: 4, pick: 3 },
        Op::FreePopped { pick: 0 },
        Op::Evict { ids: vec![1, 2, 3, 200] },
        Op::Preempt { pick: 0 },
        Op::Bad { kind: 1, pick: 0 },
        Op::Reset,
    ];
    let shapes = [
        Shape::Full,
        Shape::FullSwa(32),
        Shape::FullSwa(48),
        Shape::FullSwa(33),
        Shape::Swa(32),
        Shape::Swa(48),
        Shape::Swa(33),
        Shape::FullChunked64,
        Shape::Chunked64,
    ];
    for shape in shapes {
        for caching in [true, false] {
            for kind in 0..17 {
                let mut ops = seq.clone();
                ops.push(Op::Bad { kind, pick: 1 });
                run_case(shape, caching, true, 40, 1, &ops);
            }
        }
    }
}

/// The generator reaches the paths that matter: hits (shared and from the free queue),
/// refusals, recycling, lazy eviction, pops, bad inputs, resets, for every shape.
#[test]
fn ops_generator_reaches_pressure_hits_and_recycling() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let shapes = [
        Shape::Full,
        Shape::FullSwa(32),
        Shape::FullSwa(48),
        Shape::FullSwa(33),
        Shape::Swa(32),
        Shape::Swa(48),
        Shape::Swa(33),
        Shape::FullChunked64,
        Shape::Chunked64,
    ];
    for shape in shapes {
        let mut total = Stats::default();
        for case in 0..16u32 {
            let ops = ops().new_tree(&mut runner).unwrap().current();
            let s = run_case(shape, true, case % 2 == 0, 20 + case, case as u8, &ops);
            total.admitted += s.admitted;
            total.admitted_with_hit += s.admitted_with_hit;
            total.admitted_with_external += s.admitted_with_external;
            total.refused += s.refused;
            total.steps += s.steps;
            total.steps_refused += s.steps_refused;
            total.recycled += s.recycled;
            total.lazy_evictions += s.lazy_evictions;
            total.shared_hits += s.shared_hits;
            total.pops += s.pops;
            total.bad += s.bad;
            total.resets += s.resets;
            total.noops += s.noops;
        }
        eprintln!("{shape:?}: {total:?}");
        let recycles = !matches!(shape, Shape::Full);
        assert!(total.admitted_with_hit > 0 && total.shared_hits > 0, "{shape:?}: {total:?}");
        assert!(total.admitted_with_external > 0, "{shape:?}: {total:?}");
        assert!(total.refused > 0 && total.refused + total.steps_refused > 0, "{shape:?}: {total:?}");
        assert!(total.lazy_evictions > 0 && total.pops > 0 && total.bad > 0, "{shape:?}: {total:?}");
        assert!(total.recycled > 0 || !recycles, "{shape:?}: {total:?}");
        assert!(total.noops > 0, "{shape:?}: {total:?}");
    }
}

// ---- hit-list shapes --------------------------------------------------------------------
//
// Issue 28 item 7: `allocate_slots` takes a hit list per group whose length must be
// `num_new_computed_tokens / block_size` blocks (none for a group that takes no hits). The one
// exception is vLLM's: a KV connector's per-group hit, where a group other than full
// attention lags behind it, in a config with Mamba layers and full attention, adopted with
// external tokens. Every other wrong length is refused with nothing changed.

/// Tokens per block in the hit-shape cases (every group and the hash block).
const HIT_BS: u32 = 16;

/// Every kind a group with prefix caching on can have (cross attention and Mamba "none" are
/// refused with caching on; see [`off_kind`]), each with its hit-list shape.
const ON_KINDS: usize = 9;

fn on_kind(i: usize) -> AttentionKind {
    let mamba = |speculative_blocks, rekey_cached_tail, checkpoint_alignment| AttentionKind::Mamba {
        speculative_blocks,
        align: true,
        rekey_cached_tail,
        checkpoint_alignment,
    };
    match i % ON_KINDS {
        0 => AttentionKind::Full,
        1 => AttentionKind::Rswa { window: 32 },
        2 => swa(32),
        3 => AttentionKind::SlidingWindow { window: 33, extra_retained_tokens: 16 },
        4 => AttentionKind::ChunkedLocal { chunk: 64 },
        5 => mamba(0, true, 0),
        6 => mamba(0, false, 1),
        7 => mamba(1, true, 0),
        _ => AttentionKind::CircularBuffer,
    }
}

/// Every kind a group with prefix caching off can have.
const OFF_KINDS: usize = 8;

fn off_kind(i: usize) -> AttentionKind {
    let none = |speculative_blocks| AttentionKind::Mamba {
        speculative_blocks,
        align: false,
        rekey_cached_tail: false,
        checkpoint_alignment: 0,
    };
    match i % OFF_KINDS {
        0 => AttentionKind::Full,
        1 => AttentionKind::Rswa { window: 32 },
        2 => swa(32),
        3 => AttentionKind::ChunkedLocal { chunk: 64 },
        4 => AttentionKind::Cross,
        5 => none(0),
        6 => none(2),
        _ => AttentionKind::CircularBuffer,
    }
}

fn is_mamba(k: AttentionKind) -> bool {
    matches!(k, AttentionKind::Mamba { .. })
}

fn hit_config(kinds: &[AttentionKind], caching: bool) -> Config {
    let groups = kinds.iter().enumerate().map(|(i, &kind)| GroupSpec { kind, block_size: HIT_BS, spec_key: i as u32 });
    Config { enable_caching: caching, ..common::config(256, groups.collect(), HIT_BS) }
}

/// The observable state a refused call must leave unchanged.
#[derive(Debug, PartialEq)]
struct HitState {
    queue: Vec<BlockId>,
    ref_cnt: Vec<u32>,
    keys: Vec<Option<Key>>,
    /// Per live request: per group its table, cached count and stored hit; its hashes.
    tables: Vec<Vec<Vec<BlockId>>>,
    num_cached: Vec<Vec<u32>>,
    stored_hits: Vec<Vec<Vec<BlockId>>>,
    hashes: Vec<Vec<BlockHash>>,
    events: usize,
}

fn hit_state(a: &Allocator) -> HitState {
    let p = a.pool();
    let n = p.num_blocks();
    let ng = a.num_groups();
    let live: Vec<ReqHandle> = a.live_handles().collect();
    HitState {
        queue: p.free_queue_order(),
        ref_cnt: (0..n).map(|b| p.ref_cnt(b)).collect(),
        keys: (0..n).map(|b| p.block_hash(b).copied()).collect(),
        tables: live.iter().map(|&h| (0..ng).map(|g| a.blocks(h, g).unwrap().to_vec()).collect()).collect(),
        num_cached: live.iter().map(|&h| a.managers().iter().map(|m| m.num_cached(h as u32)).collect()).collect(),
        stored_hits: live.iter().map(|&h| (0..ng).map(|g| a.stored_hit(h, g).unwrap().to_vec()).collect()).collect(),
        hashes: live.iter().map(|&h| a.hashes(h).unwrap().to_vec()).collect(),
        events: a.has_events() as usize,
    }
}

/// How a case breaks the right hit list of one group.
#[derive(Clone, Copy, Debug)]
enum Wrong {
    /// `n` blocks fewer (at least one, at most all).
    Short(usize),
    /// `n` more blocks (ids in range, so only the length is wrong), 1 or 2.
    Long(usize, BlockId),
}

/// One hit-shape case with prefix caching on: `r1` computes `k` blocks of a prompt of `k + 2`
/// blocks (one chunk, so every kind caches up to there, a Mamba group its state at the end);
/// `r2`, the same prompt, finds the `k`-block hit in every group, and `allocate_slots` is
/// given it with group `g`'s list made wrong, with `ext` external tokens. Refused with
/// nothing changed, unless it is a connector's lagging group; the right list is adopted.
/// Returns whether the wrong list was adopted (a lagging group).
fn hit_shape_case(kinds: &[AttentionKind], k: u32, g: usize, wrong: Wrong, ext: u32) -> bool {
    let mut a = Allocator::new(hit_config(kinds, true), Policy::Exact).expect("valid config");
    let prompt = (k + 2) * HIT_BS;
    let hashes: Vec<BlockHash> = (0..k + 2).map(|i| BlockHash::from_u64(mix(0x4817, i as u64))).collect();
    let add = |a: &mut Allocator| {
        let h = a.add_request();
        a.set_hashes(h, &hashes).unwrap();
        h
    };
    let args = |num_new_tokens, num_new_computed_tokens, ext| AllocateArgs {
        num_new_tokens,
        num_new_computed_tokens,
        num_external_computed_tokens: ext,
        num_prompt_tokens: prompt,
        num_tokens: prompt,
        ..Default::default()
    };
    let r1 = add(&mut a);
    assert!(a.allocate_slots(r1, &args(k * HIT_BS, 0, 0), NewComputed::Empty, None).unwrap().is_some());
    a.new_step_starts();
    let r2 = add(&mut a);
    // Every group hits the `k` blocks computed (chunked local attention alone among the groups
    // that take hits, circular buffers beside it or not, may hit more:
    // the blocks of chunks before the hit's are null, cached or not).
    let hit = a.find_longest_cache_hit(r2, prompt - 1).unwrap().num_tokens;
    let only_chunked = kinds.iter().filter(|k| k.takes_hits()).all(|k| matches!(k, AttentionKind::ChunkedLocal { .. }));
    assert!(hit == k * HIT_BS || only_chunked, "{kinds:?}: a hit of {hit} tokens");
    let right: Vec<Vec<BlockId>> = (0..kinds.len()).map(|i| a.stored_hit(r2, i).unwrap().to_vec()).collect();
    for (i, v) in right.iter().enumerate() {
        let want = if kinds[i].takes_hits() { hit / HIT_BS } else { 0 };
        assert_eq!(v.len() as u32, want, "{kinds:?}: the right length of group {i}");
    }
    let mut bad = right.clone();
    let lagging = match wrong {
        Wrong::Short(n) => {
            let len = bad[g].len();
            bad[g].truncate(len - n.min(len));
            bad[g].len() < len
        }
        Wrong::Long(n, id) => {
            bad[g].extend(std::iter::repeat_n(id, n.clamp(1, 2)));
            false
        }
    };
    assert_ne!(bad, right, "{kinds:?} {wrong:?}: the list is wrong (a group with no hit cannot be shorter)");
    // vLLM's exception: a connector's per-group hit (Mamba layers, full attention first,
    // several groups), a group other than full attention shorter, external tokens loaded.
    let per_group = kinds.len() > 1 && kinds.iter().any(|k| is_mamba(*k)) && kinds.iter().any(|k| k.is_full());
    let may_lag = lagging && per_group && !kinds[g].is_full() && ext > 0;
    let x = args(prompt - hit - ext, hit, ext);
    let before = hit_state(&a);
    let res = a.allocate_slots(r2, &x, NewComputed::Explicit(&bad), None);
    invariants::check(&a).unwrap();
    if may_lag {
        assert!(matches!(res, Ok(Some(_))), "{kinds:?} {wrong:?} ext {ext}: a lagging group is adopted: {res:?}");
        let fa = kinds.iter().position(|k| k.is_full()).unwrap();
        assert_eq!(&a.blocks(r2, fa).unwrap()[..right[fa].len()], &right[fa][..], "{kinds:?}: full attention's hit");
        return true;
    }
    match res {
        Err(hybrid_alloc::Error::OutOfRange(m)) => {
            assert!(m.contains(&format!("group {g}")), "{kinds:?} {wrong:?}: {m}")
        }
        other => panic!("{kinds:?} {wrong:?} ext {ext}: a wrong hit list must be refused, got {other:?}"),
    }
    assert_eq!(hit_state(&a), before, "{kinds:?} {wrong:?} ext {ext}: a refused call changes nothing");
    let res = a.allocate_slots(r2, &x, NewComputed::Explicit(&right), None);
    assert!(matches!(res, Ok(Some(_))), "{kinds:?} ext {ext}: the right hit is adopted: {res:?}");
    for (i, v) in right.iter().enumerate() {
        let t = a.blocks(r2, i).unwrap();
        assert!(v.iter().zip(t).all(|(&h, &b)| h == b || h == NULL_BLOCK || b == NULL_BLOCK), "{kinds:?} group {i}");
    }
    invariants::check(&a).unwrap();
    false
}

/// With prefix caching off no group takes hit blocks: an empty list in every group is
/// adopted, a block in any group refused with nothing changed.
fn hit_shape_case_caching_off(kinds: &[AttentionKind], g: usize, n: usize, id: BlockId) {
    let mut a = Allocator::new(hit_config(kinds, false), Policy::Exact).expect("valid config");
    let h = a.add_request();
    let x = AllocateArgs {
        num_new_tokens: 40,
        num_prompt_tokens: 40,
        num_tokens: 40,
        num_encoder_tokens: 32,
        ..Default::default()
    };
    let right = vec![Vec::new(); kinds.len()];
    let mut bad = right.clone();
    bad[g].extend(std::iter::repeat_n(id, n.clamp(1, 2)));
    let before = hit_state(&a);
    let res = a.allocate_slots(h, &x, NewComputed::Explicit(&bad), None);
    assert!(matches!(res, Err(hybrid_alloc::Error::InvalidState(_))), "{kinds:?} group {g}: {res:?}");
    assert_eq!(hit_state(&a), before, "{kinds:?}: a refused call changes nothing");
    invariants::check(&a).unwrap();
    assert!(matches!(a.allocate_slots(h, &x, NewComputed::Explicit(&right), None), Ok(Some(_))), "{kinds:?}");
    invariants::check(&a).unwrap();
}

/// The groups of a hit-shape case: full attention first or not, kinds drawn by index, a Mamba
/// "align" group appended or not (so a connector's per-group hit is served or not).
fn hit_kinds(lead_full: bool, picks: &[usize], with_mamba: bool) -> Vec<AttentionKind> {
    let mut kinds: Vec<AttentionKind> = lead_full.then_some(AttentionKind::Full).into_iter().collect();
    kinds.extend(picks.iter().map(|&i| on_kind(i)));
    if with_mamba && !kinds.iter().any(|k| is_mamba(*k)) {
        kinds.push(on_kind(5));
    }
    if !kinds.iter().any(|k| k.takes_hits()) {
        kinds.insert(0, AttentionKind::Full);
    }
    kinds
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn allocate_slots_wrong_hit_length_refused_unchanged_every_kind(
        lead_full: bool, picks in prop::collection::vec(0..ON_KINDS, 1..4), with_mamba: bool,
        k in 1u32..6, g: prop::sample::Index, short: bool, n in 1usize..6, id in 1u32..256, ext in 0u32..17,
    ) {
        let kinds = hit_kinds(lead_full, &picks, with_mamba);
        let g = g.index(kinds.len());
        let takes = kinds[g].takes_hits();
        // A group with no hit cannot be shorter: it gets a block instead.
        let wrong = if short && takes { Wrong::Short(n) } else { Wrong::Long(n, id) };
        hit_shape_case(&kinds, k, g, wrong, ext);
    }

    #[test]
    fn allocate_slots_hit_blocks_caching_off_refused_unchanged_every_kind(
        picks in prop::collection::vec(0..OFF_KINDS, 1..4), g: prop::sample::Index, n in 1usize..3, id in 1u32..256,
    ) {
        let kinds: Vec<AttentionKind> = picks.iter().map(|&i| off_kind(i)).collect();
        hit_shape_case_caching_off(&kinds, g.index(kinds.len()), n, id);
    }
}

/// Every kind once per layout, short and long, with and without external tokens (runs even
/// with `PROPTEST_CASES=0`): the lagging lists adopted are exactly vLLM's exception.
#[test]
fn allocate_slots_wrong_hit_length_every_kind_fixed() {
    let mut lagged = Vec::new();
    for i in 0..ON_KINDS {
        for (lead_full, with_mamba) in [(true, true), (true, false), (false, true), (false, false)] {
            let kinds = hit_kinds(lead_full, &[i], with_mamba);
            for g in 0..kinds.len() {
                for ext in [0, 5] {
                    let wrong = [Wrong::Short(1), Wrong::Long(1, 1)];
                    for w in wrong.into_iter().filter(|w| kinds[g].takes_hits() || matches!(w, Wrong::Long(..))) {
                        if hit_shape_case(&kinds, 3, g, w, ext) {
                            lagged.push((kinds[g], kinds.len(), ext));
                        }
                    }
                }
            }
        }
    }
    // Some lagging groups were adopted (a Mamba group, a sliding window beside Mamba), and
    // each with external tokens, beside full attention and Mamba, in a group not full.
    assert!(lagged.iter().any(|(k, ..)| is_mamba(*k)), "{lagged:?}");
    assert!(lagged.iter().any(|(k, ..)| matches!(k, AttentionKind::SlidingWindow { .. })), "{lagged:?}");
    assert!(lagged.iter().all(|&(k, n, ext)| !k.is_full() && n > 1 && ext > 0), "{lagged:?}");
    for i in 0..OFF_KINDS {
        let kinds = [AttentionKind::Full, off_kind(i)];
        for g in 0..2 {
            hit_shape_case_caching_off(&kinds, g, 1, 3);
        }
    }
}
