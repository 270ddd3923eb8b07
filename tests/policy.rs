//! The `hit-aware` retention policy: property tests against a model that tracks the content
//! behind every block id, and deterministic scenarios.
//!
//! The model knows each request's token content in advance (one content id per block, the
//! block's KV identity being the chain of content ids up to it). Every block that enters a
//! table is recorded as holding the chain of its position in its owner's sequence. After
//! every operation:
//! - `invariants::check` holds (queue, ref counts, index, tables, retention levels);
//! - every hashed block holds exactly the content its hash names (a block keeps a hash only
//!   while it holds the KV of those tokens);
//! - the KV cache events replayed into a mirror give exactly the prefix index;
//! - a block served in a hit since it was cached (with the content it was served with) is
//!   never on probation (`LEVEL_PROBATION`, the state-space hybrids' rule for requests
//!   whose own hit saved under half their prompt: only the blocks they computed go there);
//! - with a Mamba group, a free full-attention block that duplicates the block a lookup of
//!   its key finds (recomputed because no state served it) is speculative, and a state marked
//!   a branch point (at a junction another request shares) is not;
//!
//! and every hit the allocator serves is checked block by block, in every group, against
//! the request's own content, with the blocks the attention type needs all present.
//!
//! The hit units (a Mamba state set and the full-attention blocks before it, dissolved when a
//! member is evicted) and the level a resumed state waits at while its request runs are
//! checked by deterministic chat scenarios at the end of the file.
//!
//! With a Mamba "align" group the requests run as vLLM's scheduler runs them in that mode
//! (a new scheduler step before each operation; the prefill split at the prompt's checkpoint
//! position), so a state block holds the state after exactly its position's tokens whenever
//! it is cached, and a Mamba hit needs its last block only.

use std::collections::HashMap;

mod common;

use common::{chain, groups};
use hybrid_alloc::block_pool::BlockPool;
use hybrid_alloc::invariants;
use hybrid_alloc::policy::{
    Level, Policy, Retention, LEVEL_NEAR, LEVEL_NORMAL, LEVEL_PINNED, LEVEL_PROBATION, LEVEL_RESUMED, LEVEL_SPECULATIVE,
};
use hybrid_alloc::{
    AllocateArgs, Allocator, AttentionKind, BlockHash, BlockId, Config, Event, Hit, NewComputed, ReqHandle, NULL_BLOCK,
};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

const BS: u32 = 4;

/// The hit-aware policy's state as the tests read it, through the pool's read-only handle
/// (`BlockPool::retention`); under `exact` (no state) what an exact pool answers: every
/// block at the normal level, no flags, no units, no pins, the default pinned share.
trait RetentionView {
    fn level(&self, b: BlockId) -> Level;
    fn is_branch(&self, b: BlockId) -> bool;
    fn unit_support(&self, b: BlockId) -> u32;
    fn is_pinned_key(&self, key: &(BlockHash, u32)) -> bool;
    fn pinned_free(&self) -> u32;
    fn pinned_cap(&self) -> u32;
}

impl RetentionView for BlockPool {
    fn level(&self, b: BlockId) -> Level {
        self.retention().map_or(LEVEL_NORMAL, |r| r.level(b))
    }
    fn is_branch(&self, b: BlockId) -> bool {
        self.retention().is_some_and(|r| r.is_branch(b))
    }
    fn unit_support(&self, b: BlockId) -> u32 {
        self.retention().map_or(0, |r| r.unit_support(b))
    }
    fn is_pinned_key(&self, key: &(BlockHash, u32)) -> bool {
        self.retention().is_some_and(|r| r.is_pinned_key(key))
    }
    fn pinned_free(&self) -> u32 {
        self.retention().map_or(0, |r| r.pinned_free())
    }
    fn pinned_cap(&self) -> u32 {
        self.retention().map_or(Retention::default_pinned_cap(self.num_blocks()), |r| r.pinned_cap())
    }
}

fn swa(window: u32) -> AttentionKind {
    AttentionKind::SlidingWindow { window, extra_retained_tokens: 0 }
}

fn mamba_align() -> AttentionKind {
    AttentionKind::Mamba { speculative_blocks: 0, align: true, rekey_cached_tail: false, checkpoint_alignment: 0 }
}

fn config(kinds: &[AttentionKind], num_blocks: u32, retention: Option<u32>) -> Config {
    Config { enable_events: true, retention_interval: retention, ..common::config(num_blocks, groups(kinds, BS), BS) }
}

#[derive(Clone, Debug)]
struct Req {
    h: ReqHandle,
    /// Content id of every block the request will ever hold.
    contents: Vec<u64>,
    chain: Vec<u64>,
    prompt: u32,
    /// Tokens known (`request.num_tokens`).
    num_tokens: u32,
    computed: u32,
    /// Hashes sent so far.
    hashed: u32,
    max_tokens: u32,
}

struct Model {
    a: Allocator,
    kinds: Vec<AttentionKind>,
    /// The content chain each block id holds (0: nothing known).
    held: Vec<u64>,
    live: Vec<Req>,
    /// Finished requests' contents (full blocks of the whole sequence), to continue as chats.
    finished: Vec<Vec<u64>>,
    families: Vec<Vec<u64>>,
    next_id: u64,
    /// The prefix index as the events describe it: (hash, group) -> blocks cached.
    mirror: HashMap<(BlockHash, u32), u32>,
    hits_served: u64,
    hit_tokens: u64,
    /// Blocks served in an adopted hit since they entered a table, with the content served.
    served: HashMap<BlockId, u64>,
    /// The blocks of the hit just checked, served once the allocation adopts it.
    pending_served: Vec<(BlockId, u64)>,
}

impl Model {
    fn new(kinds: &[AttentionKind], num_blocks: u32, retention: Option<u32>, policy: Policy) -> Self {
        let a = Allocator::new(config(kinds, num_blocks, retention), policy).unwrap();
        let families = (0..3u64).map(|f| (0..24u64).map(|i| 1_000_000 * (f + 1) + i).collect()).collect();
        Self {
            a,
            kinds: kinds.to_vec(),
            held: vec![0; num_blocks as usize],
            live: Vec::new(),
            finished: Vec::new(),
            families,
            next_id: 1,
            mirror: HashMap::new(),
            hits_served: 0,
            hit_tokens: 0,
            served: HashMap::new(),
            pending_served: Vec::new(),
        }
    }

    fn has_mamba(&self) -> bool {
        self.kinds.iter().any(|k| matches!(k, AttentionKind::Mamba { .. }))
    }

    fn fresh(&mut self, n: usize) -> Vec<u64> {
        let v = (0..n as u64).map(|i| self.next_id + i).collect();
        self.next_id += n as u64;
        v
    }

    fn send_hashes(&mut self, i: usize) {
        let r = &mut self.live[i];
        let full = r.num_tokens / BS;
        if full > r.hashed {
            let bytes: Vec<u8> = r.chain[r.hashed as usize..full as usize]
                .iter()
                .flat_map(|&c| BlockHash::from_u64(c).as_bytes().to_vec())
                .collect();
            self.a.append_hashes(r.h, &bytes, 8).unwrap();
            r.hashed = full;
        }
    }

    /// Records the content of blocks that just entered request `i`'s tables.
    fn record_new_blocks(&mut self, i: usize) {
        let counts = self.a.new_block_counts().to_vec();
        let r = &self.live[i];
        for (g, &c) in counts.iter().enumerate() {
            let t = self.a.blocks(r.h, g).unwrap();
            for idx in t.len() - c as usize..t.len() {
                self.held[t[idx] as usize] = r.chain.get(idx).copied().unwrap_or(u64::MAX);
                self.served.remove(&t[idx]);
            }
        }
    }

    fn need(&self, g: usize) -> u32 {
        match self.kinds[g] {
            AttentionKind::SlidingWindow { window, .. } => (window - 1).div_ceil(BS),
            // One state: the block ending the hit.
            AttentionKind::Mamba { .. } => 1,
            _ => u32::MAX,
        }
    }

    /// Checks the hit stored for request `i`: every block is the request's own content, and
    /// every block the attention type needs is there.
    fn check_hit(&mut self, i: usize, hit: u32) {
        self.pending_served.clear();
        let r = &self.live[i];
        let nb = (hit / BS) as usize;
        for g in 0..self.kinds.len() {
            let v = self.a.stored_hit(r.h, g).unwrap();
            assert_eq!(v.len(), nb, "group {g}: hit of {} blocks for {hit} tokens", v.len());
            let need = self.need(g) as usize;
            for (idx, &b) in v.iter().enumerate() {
                if b == NULL_BLOCK {
                    assert!(idx + need < nb, "group {g}: null block at {idx}, inside what a hit of {nb} blocks needs");
                    continue;
                }
                assert_eq!(
                    self.held[b as usize], r.chain[idx],
                    "group {g}: hit block {b} at {idx} holds other content than the request's"
                );
                self.pending_served.push((b, r.chain[idx]));
            }
        }
    }

    fn add(&mut self, kind: u8, pick: u16, own: u8, out: u8) {
        let mut contents = match kind % 3 {
            0 => Vec::new(),
            1 => {
                let f = &self.families[pick as usize % self.families.len()];
                f[..(pick as usize / 3) % f.len() + 1].to_vec()
            }
            _ => match self.finished.len() {
                0 => Vec::new(),
                n => self.finished[pick as usize % n].clone(),
            },
        };
        let own_blocks = own as usize % 6 + 1;
        let extra = self.fresh(own_blocks + 8);
        let prompt = ((contents.len() + own_blocks) as u32 * BS).saturating_sub(own as u32 % BS).max(2);
        contents.extend(extra);
        let chain = chain(&contents);
        let h = self.a.add_request();
        let max_tokens = (contents.len() as u32 * BS - prompt).min(out as u32 % 12 + 1);
        self.live.push(Req { h, contents, chain, prompt, num_tokens: prompt, computed: 0, hashed: 0, max_tokens });
        let i = self.live.len() - 1;
        self.send_hashes(i);
        let hit = self.a.find_longest_cache_hit(h, prompt - 1).unwrap();
        self.check_hit(i, hit.num_tokens);
        let mut chunks = PrefillChunks::new(hit, prompt, self.has_mamba());
        let mut res = None;
        while let Some((args, nc)) = chunks.next() {
            if !chunks.is_first() {
                self.record_new_blocks(i);
                // A new scheduler step for each chunk (a state is cached at a chunk's end).
                self.a.new_step_starts();
            }
            res = self.a.allocate_slots(h, &args, nc, None).unwrap();
            if res.is_none() {
                break;
            }
            chunks.advance(&mut self.a, h);
        }
        match res {
            Some(_) => {
                self.record_new_blocks(i);
                self.served.extend(self.pending_served.drain(..));
                self.hits_served += (hit.num_tokens > 0) as u64;
                self.hit_tokens += hit.num_tokens as u64;
                let r = &mut self.live[i];
                r.computed = prompt;
                r.num_tokens = prompt + 1;
            }
            None => {
                let r = self.live.pop().unwrap();
                self.a.free(r.h, LEVEL_NORMAL).unwrap();
            }
        }
    }

    fn step(&mut self, pick: u16) {
        if self.live.is_empty() {
            return;
        }
        let i = pick as usize % self.live.len();
        self.send_hashes(i);
        let r = &self.live[i];
        let args = AllocateArgs {
            num_new_tokens: 1,
            num_computed_tokens: r.computed,
            num_prompt_tokens: r.prompt,
            num_tokens: r.num_tokens,
            ..Default::default()
        };
        if self.a.allocate_slots(r.h, &args, NewComputed::Empty, None).unwrap().is_some() {
            self.record_new_blocks(i);
            let r = &mut self.live[i];
            r.computed += 1;
            r.num_tokens += 1;
            if r.num_tokens - r.prompt >= r.max_tokens {
                self.finish(i, false);
            }
        } else {
            // Preempted, as the scheduler would: its blocks go back.
            self.finish(i, false);
        }
    }

    fn finish(&mut self, i: usize, retain: bool) {
        let r = self.live.swap_remove(i);
        let full = (r.computed / BS) as usize;
        self.finished.push(r.contents[..full].to_vec());
        if self.finished.len() > 8 {
            self.finished.remove(0);
        }
        let level = if retain { LEVEL_PINNED } else { LEVEL_NORMAL };
        self.a.free(r.h, level).unwrap();
    }

    /// Pins a family's prefix (refused past the pinned share).
    fn pin(&mut self, pick: u16) {
        let f = &self.families[pick as usize % self.families.len()];
        let k = (pick as usize / 3) % f.len() + 1;
        let hashes: Vec<BlockHash> = chain(&f[..k]).into_iter().map(BlockHash::from_u64).collect();
        let before = self.a.pool().pinned_cap();
        match self.a.pin_prefix(&hashes) {
            Ok(n) => assert!(n <= before),
            Err(e) => assert!(e.to_string().contains("pinned share"), "{e}"),
        }
    }

    fn evict(&mut self, ids: &[u8]) {
        let n = self.a.pool().num_blocks();
        let ids: Vec<BlockId> = ids.iter().map(|&x| x as u32 % n).collect();
        self.a.evict_blocks(&ids).unwrap();
        for b in &ids {
            self.served.remove(b);
        }
    }

    fn check(&mut self) {
        invariants::check(&self.a).unwrap();
        let pool = self.a.pool();
        for b in 1..pool.num_blocks() {
            if let Some((hash, _g)) = pool.block_hash(b) {
                assert_eq!(
                    BlockHash::from_u64(self.held[b as usize]),
                    *hash,
                    "block {b} is cached under a hash that is not its content"
                );
            }
        }
        for ev in self.a.take_events() {
            match ev {
                Event::Stored { group, hashes, .. } => {
                    for h in hashes {
                        *self.mirror.entry((h, group)).or_insert(0) += 1;
                    }
                }
                Event::Removed { hash, group } => {
                    let e = self.mirror.get_mut(&(hash, group)).expect("BlockRemoved of a hash never stored");
                    *e -= 1;
                    if *e == 0 {
                        self.mirror.remove(&(hash, group));
                    }
                }
                Event::AllCleared => self.mirror.clear(),
            }
        }
        let pool = self.a.pool();
        let mut index: HashMap<(BlockHash, u32), u32> = HashMap::new();
        for b in 1..pool.num_blocks() {
            if let Some(k) = pool.block_hash(b) {
                *index.entry(*k).or_insert(0) += 1;
            }
        }
        assert_eq!(index, self.mirror, "the events do not describe what is cached");
        for (&b, &content) in &self.served {
            if pool.block_hash(b).is_some() && self.held[b as usize] == content {
                assert_ne!(pool.level(b), LEVEL_PROBATION, "block {b}, served in a hit, is on probation");
            }
        }
        if self.has_mamba() && pool.is_leveled() {
            let mut first = Vec::new();
            for b in 1..pool.num_blocks() {
                let Some(&(hash, g)) = pool.block_hash(b) else { continue };
                let kind = self.kinds[g as usize];
                pool.get_cached_block(&hash, &[g], &mut first);
                let is_first = first.first() == Some(&b);
                if kind.is_full() && pool.ref_cnt(b) == 0 && !is_first && !pool.is_pinned_key(&(hash, g)) {
                    assert_eq!(
                        pool.level(b),
                        LEVEL_SPECULATIVE,
                        "free block {b} duplicates block {:?}, which lookups find, and is not speculative",
                        first.first()
                    );
                }
                if matches!(kind, AttentionKind::Mamba { .. }) && pool.is_branch(b) && is_first {
                    assert_ne!(pool.level(b), LEVEL_SPECULATIVE, "state block {b}, a branch point, is speculative");
                }
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Add { kind: u8, pick: u16, own: u8, out: u8 },
    Step { pick: u16, n: u8 },
    Free { pick: u16, retain: bool },
    Evict(Vec<u8>),
    Reset,
    Pin { pick: u16 },
    Share(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<u8>(), any::<u16>(), any::<u8>(), any::<u8>())
            .prop_map(|(kind, pick, own, out)| Op::Add { kind, pick, own, out }),
        8 => (any::<u16>(), 1u8..12).prop_map(|(pick, n)| Op::Step { pick, n }),
        2 => (any::<u16>(), any::<bool>()).prop_map(|(pick, retain)| Op::Free { pick, retain }),
        1 => proptest::collection::vec(any::<u8>(), 0..4).prop_map(Op::Evict),
        1 => Just(Op::Reset),
        1 => any::<u16>().prop_map(|pick| Op::Pin { pick }),
        1 => any::<u8>().prop_map(Op::Share),
    ]
}

fn run(kinds: &[AttentionKind], num_blocks: u32, retention: Option<u32>, ops: &[Op]) -> Model {
    run_with(kinds, num_blocks, retention, Policy::HitAware, ops)
}

fn run_with(kinds: &[AttentionKind], num_blocks: u32, retention: Option<u32>, policy: Policy, ops: &[Op]) -> Model {
    let mut m = Model::new(kinds, num_blocks, retention, policy);
    for o in ops {
        // A scheduler step starts (Mamba "align" stops deferring hits on last step's states).
        m.a.new_step_starts();
        match o {
            Op::Add { kind, pick, own, out } => m.add(*kind, *pick, *own, *out),
            Op::Step { pick, n } => {
                for _ in 0..*n {
                    m.step(*pick);
                }
            }
            Op::Free { pick, retain } => {
                if !m.live.is_empty() {
                    let i = *pick as usize % m.live.len();
                    m.finish(i, *retain);
                }
            }
            Op::Evict(ids) => m.evict(ids),
            Op::Reset => {
                if m.a.reset_prefix_cache() {
                    m.served.clear();
                }
            }
            Op::Pin { pick } => m.pin(*pick),
            Op::Share(x) => {
                // Refused (and nothing changes) when below what is pinned.
                let _ = m.a.set_pinned_share(*x as f64 / 255.0);
            }
        }
        m.check();
    }
    while !m.live.is_empty() {
        m.finish(0, false);
        m.check();
    }
    m
}

fn cases() -> u32 {
    common::proptest_cases(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn hit_aware_full_and_window_hits_hold_own_content(
        ops in proptest::collection::vec(op(), 1..120), nb in 24u32..160, r in 0u8..3,
    ) {
        let retention = [Some(0), None, Some(16)][r as usize];
        run(&[AttentionKind::Full, swa(9)], nb, retention, &ops);
    }

    #[test]
    fn hit_aware_two_window_groups_hits_hold_own_content(
        ops in proptest::collection::vec(op(), 1..120), nb in 24u32..200,
    ) {
        run(&[AttentionKind::Full, swa(9), swa(5)], nb, Some(0), &ops);
    }

    #[test]
    fn hit_aware_full_window_and_mamba_align_hits_hold_own_content(
        ops in proptest::collection::vec(op(), 1..120), nb in 24u32..200, r in 0u8..3,
    ) {
        let retention = [Some(0), None, Some(16)][r as usize];
        run(&[AttentionKind::Full, swa(9), mamba_align()], nb, retention, &ops);
    }

    #[test]
    fn hit_aware_full_and_mamba_align_hits_hold_own_content(
        ops in proptest::collection::vec(op(), 1..120), nb in 16u32..160, r in 0u8..3,
    ) {
        let retention = [Some(0), None, Some(16)][r as usize];
        run(&[AttentionKind::Full, mamba_align(), mamba_align()], nb, retention, &ops);
    }

    #[test]
    fn hit_aware_full_and_rswa_hits_hold_own_content(
        ops in proptest::collection::vec(op(), 1..120), nb in 16u32..160, r in 0u8..2,
    ) {
        // R-SWA frees the gap between the prompt and the window while decoding; its blocks
        // stay cached and hit as full attention's.
        let retention = [Some(0), None][r as usize];
        run(&[AttentionKind::Full, AttentionKind::Rswa { window: 6 }], nb, retention, &ops);
    }

    #[test]
    fn hit_aware_window_only_hits_hold_own_content(
        ops in proptest::collection::vec(op(), 1..120), nb in 16u32..120,
    ) {
        run(&[swa(13)], nb, Some(0), &ops);
    }
}

#[test]
fn ops_generator_serves_hits_under_pressure() {
    // The generator must reach what the properties are about: hits served, and eviction.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut hits = 0;
    for _ in 0..32 {
        let ops = proptest::collection::vec(op(), 60..120).new_tree(&mut runner).unwrap().current();
        hits += run(&[AttentionKind::Full, swa(9)], 48, Some(0), &ops).hits_served;
    }
    assert!(hits > 50, "only {hits} hits served over 32 runs");
}

#[test]
fn ops_generator_serves_mamba_hits_and_hit_aware_serves_at_least_exact_in_an_ample_pool() {
    // Full attention, a window and Mamba "align" (dense and sparse state retention): hits
    // are served (every one checked block by block), and with no eviction (an ample pool,
    // no explicit evictions or resets) hit-aware serves at least the tokens exact serves.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let kinds = [AttentionKind::Full, swa(9), mamba_align()];
    let (mut hits, mut aware_tokens, mut exact_tokens) = (0, 0, 0);
    for k in 0..32 {
        let ops: Vec<Op> = proptest::collection::vec(op(), 60..120)
            .new_tree(&mut runner)
            .unwrap()
            .current()
            .into_iter()
            .filter(|o| matches!(o, Op::Add { .. } | Op::Step { .. } | Op::Free { .. }))
            .collect();
        let retention = [Some(0), None][k % 2];
        hits += run(&kinds, 48, retention, &ops).hits_served;
        let aware = run_with(&kinds, 4000, retention, Policy::HitAware, &ops).hit_tokens;
        let exact = run_with(&kinds, 4000, retention, Policy::Exact, &ops).hit_tokens;
        assert!(aware >= exact, "run {k}: hit-aware served {aware} hit tokens, exact {exact}");
        aware_tokens += aware;
        exact_tokens += exact;
    }
    assert!(hits > 50, "only {hits} hits served over 32 runs");
    assert!(aware_tokens > exact_tokens, "hit-aware never served more ({aware_tokens} vs {exact_tokens})");
}

// ---- deterministic scenarios -------------------------------------------------------------

#[test]
fn allocate_hit_aware_mamba_none_mode_is_exact() {
    // Mamba cache mode "none" runs with prefix caching off, where hit-aware has nothing to
    // keep: the pool is not leveled and every decision is exact's.
    let kinds = [
        AttentionKind::Full,
        AttentionKind::Mamba { speculative_blocks: 2, align: false, rekey_cached_tail: false, checkpoint_alignment: 0 },
    ];
    let mut cfg = config(&kinds, 64, None);
    cfg.enable_caching = false;
    cfg.retention_interval = None;
    cfg.groups[1].block_size = 4096;
    cfg.scheduler_block_size = 4096;
    cfg.hash_block_size = 4096;
    let mut e = Allocator::new(cfg.clone(), Policy::Exact).unwrap();
    let mut w = Allocator::new(cfg, Policy::HitAware).unwrap();
    assert!(!w.pool().is_leveled());
    let mut live: Vec<(ReqHandle, ReqHandle, u32)> = Vec::new();
    for k in 0..400u32 {
        if live.len() < 5 && k % 7 == 0 {
            let (he, hw) = (e.add_request(), w.add_request());
            let p = 5 + k % 37;
            let args = AllocateArgs { num_new_tokens: p, num_prompt_tokens: p, num_tokens: p, ..Default::default() };
            let (re, rw) = (
                e.allocate_slots(he, &args, NewComputed::Empty, None).unwrap(),
                w.allocate_slots(hw, &args, NewComputed::Empty, None).unwrap(),
            );
            assert_eq!(re, rw);
            if re.is_some() {
                live.push((he, hw, p));
            } else {
                e.free(he, LEVEL_NORMAL).unwrap();
                w.free(hw, LEVEL_NORMAL).unwrap();
            }
        } else if !live.is_empty() {
            let i = k as usize % live.len();
            let (he, hw, c) = live[i];
            let args = AllocateArgs {
                num_new_tokens: 1,
                num_lookahead_tokens: k % 3,
                num_computed_tokens: c,
                num_prompt_tokens: 5,
                num_tokens: c + 1,
                ..Default::default()
            };
            let (re, rw) = (
                e.allocate_slots(he, &args, NewComputed::Empty, None).unwrap(),
                w.allocate_slots(hw, &args, NewComputed::Empty, None).unwrap(),
            );
            assert_eq!(re, rw);
            if re.is_none() || k % 11 == 0 {
                live.swap_remove(i);
                e.free(he, LEVEL_NORMAL).unwrap();
                w.free(hw, LEVEL_NORMAL).unwrap();
            } else {
                live[i].2 += 1;
            }
        }
        for &(he, hw, _) in &live {
            for g in 0..2 {
                assert_eq!(e.blocks(he, g).unwrap(), w.blocks(hw, g).unwrap());
            }
        }
        assert_eq!(e.pool().free_queue_order(), w.pool().free_queue_order());
        invariants::check(&w).unwrap();
    }
}

/// Runs a chat: one request, then the next turn re-sending its whole sequence plus a new
/// message; returns the second turn's hit.
fn chat_second_turn_hit(policy: Policy) -> u32 {
    let mut m = Model::new(&[AttentionKind::Full, swa(9)], 200, Some(0), policy);
    m.add(0, 0, 5, 11); // a 6-block prompt (24 tokens - 5 % 4), 12 output tokens
    while !m.live.is_empty() {
        m.step(0);
        m.check();
    }
    let before = m.hit_tokens;
    m.add(2, 0, 2, 3); // the whole first conversation + a new message
    m.check();
    (m.hit_tokens - before) as u32
}

#[test]
fn chat_next_turn_hit_aware_hits_the_reply_exact_resumes_at_prompt_end() {
    let exact = chat_second_turn_hit(Policy::Exact);
    let aware = chat_second_turn_hit(Policy::HitAware);
    // Prompt 23 tokens, 12 replies: 34 tokens computed, 8 full blocks = 32 tokens.
    assert_eq!(aware, 32, "hit-aware resumes where the first turn's computation ended");
    assert!(exact < aware, "exact resumes at the previous prompt's end ({exact} tokens)");
    assert_eq!(exact, 20, "exact keeps the window tail at the prompt's last full block");
}

#[test]
fn free_hit_aware_speculative_window_blocks_evicted_before_full_attention_prefix() {
    let mut m = Model::new(&[AttentionKind::Full, swa(9)], 64, Some(0), Policy::HitAware);
    m.add(0, 0, 5, 3);
    while !m.live.is_empty() {
        m.step(0);
    }
    m.check();
    let pool = m.a.pool();
    let levels =
        pool.free_queue_order().iter().map(|&b| (pool.block_hash(b).is_some(), pool.level(b))).collect::<Vec<_>>();
    // Unhashed blocks first, then speculative, then normal: never a lower level after a higher.
    let rank = |(hashed, l): (bool, u8)| if hashed { 1 + l as u32 } else { 0 };
    assert!(levels.windows(2).all(|w| rank(w[0]) <= rank(w[1])), "free queue out of level order: {levels:?}");
    assert!(levels.iter().any(|&(h, l)| h && l == LEVEL_SPECULATIVE), "no speculative window block kept");
    assert!(levels.iter().any(|&(h, l)| h && l == LEVEL_NORMAL));
}

#[test]
fn allocate_hit_aware_pressure_takes_speculative_before_normal() {
    let mut m = Model::new(&[AttentionKind::Full, swa(9)], 40, Some(0), Policy::HitAware);
    m.add(0, 0, 5, 3);
    while !m.live.is_empty() {
        m.step(0);
    }
    m.check();
    let normal_before: Vec<BlockId> = {
        let p = m.a.pool();
        (1..p.num_blocks()).filter(|&b| p.block_hash(b).is_some() && p.level(b) == LEVEL_NORMAL).collect()
    };
    // A fresh request takes every unhashed and speculative block before any normal one.
    let free = m.a.num_free_blocks();
    let normal = normal_before.len() as u32;
    let take = (free - normal) / 2 * BS; // two groups
    let h = m.a.add_request();
    let args = AllocateArgs { num_new_tokens: take, num_prompt_tokens: take, num_tokens: take, ..Default::default() };
    assert!(m.a.allocate_slots(h, &args, NewComputed::Empty, None).unwrap().is_some());
    let p = m.a.pool();
    for b in normal_before {
        assert!(p.block_hash(b).is_some(), "normal block {b} evicted while speculative blocks were free");
    }
}

#[test]
fn allocator_exact_policy_is_default_and_keeps_one_lru_level() {
    let a = Allocator::new(config(&[AttentionKind::Full, swa(9)], 32, Some(0)), Policy::Exact).unwrap();
    assert_eq!(a.policy(), Policy::Exact);
    assert!(!a.pool().is_leveled());
    let b = Allocator::new(config(&[AttentionKind::Full, swa(9)], 32, Some(0)), Policy::HitAware).unwrap();
    assert!(b.pool().is_leveled());
}

#[test]
fn pin_prefix_hit_aware_survives_pressure_that_evicts_unpinned() {
    let mut m = Model::new(&[AttentionKind::Full, swa(9)], 64, Some(0), Policy::HitAware);
    // Pin family 0's first 6 blocks, then run it once and let it finish.
    let fam: Vec<u64> = m.families[0][..6].to_vec();
    let hashes: Vec<BlockHash> = chain(&fam).into_iter().map(BlockHash::from_u64).collect();
    // Full group: 6 blocks; window group (need 2): 2 blocks.
    assert_eq!(m.a.pin_prefix(&hashes).unwrap(), 8);
    m.add(1, 15, 0, 0); // family 0, 6 blocks (pick 15: 15 / 3 % 24 + 1 = 6), 1 own block
    while !m.live.is_empty() {
        m.step(0);
    }
    m.check();
    // Flood the pool with unrelated requests, one after the other.
    for _ in 0..12 {
        m.add(0, 0, 5, 3);
        while !m.live.is_empty() {
            m.step(0);
        }
        m.check();
    }
    // The pinned prefix still hits whole.
    let before = m.hit_tokens;
    m.add(1, 15, 1, 0);
    m.check();
    assert_eq!(m.hit_tokens - before, 24, "the pinned 6-block prefix was evicted");
    // Unpinned: same flood, the prefix is gone.
    let mut u = Model::new(&[AttentionKind::Full, swa(9)], 64, Some(0), Policy::HitAware);
    u.add(1, 15, 0, 0);
    while !u.live.is_empty() {
        u.step(0);
    }
    for _ in 0..12 {
        u.add(0, 0, 5, 3);
        while !u.live.is_empty() {
            u.step(0);
        }
    }
    let before = u.hit_tokens;
    u.add(1, 15, 1, 0);
    assert!(u.hit_tokens - before < 24, "the flood does not evict: the test proves nothing");
}

#[test]
fn pin_prefix_past_share_refused_and_exact_refuses_pinning() {
    let mut a = Allocator::new(config(&[AttentionKind::Full, swa(9)], 41, Some(0)), Policy::HitAware).unwrap();
    a.set_pinned_share(0.1).unwrap(); // 4 blocks
    let hashes: Vec<BlockHash> = chain(&[1, 2, 3, 4]).into_iter().map(BlockHash::from_u64).collect();
    let err = a.pin_prefix(&hashes).unwrap_err();
    assert!(err.to_string().contains("pinned share"), "{err}");
    assert_eq!(a.pin_prefix(&hashes[..2]).unwrap(), 4);
    assert!(a.set_pinned_share(0.05).is_err());
    assert!(a.set_pinned_share(1.5).is_err());
    let mut e = Allocator::new(config(&[AttentionKind::Full, swa(9)], 41, Some(0)), Policy::Exact).unwrap();
    assert!(e.pin_prefix(&hashes).is_err());
}

#[test]
fn free_retained_hit_aware_keeps_within_pinned_share() {
    let mut m = Model::new(&[AttentionKind::Full, swa(9)], 64, Some(0), Policy::HitAware);
    m.a.set_pinned_share(0.1).unwrap(); // 6 blocks
    for _ in 0..4 {
        m.add(0, 0, 5, 3);
        while m.live.len() == 1 && m.live[0].num_tokens - m.live[0].prompt + 1 < m.live[0].max_tokens {
            m.step(0);
        }
        if !m.live.is_empty() {
            m.finish(0, true);
        }
        m.check();
        assert!(m.a.pool().pinned_free() <= 6);
    }
    assert_eq!(m.a.pool().pinned_free(), 6, "retained requests fill the pinned share");
}

#[test]
fn pinned_prefix_junction_reported_on_first_sighting_and_hit_on_second_mamba_align() {
    // Full attention + Mamba "align": a pinned 3-block prefix's end is reported as the shared
    // prefix's end before anything is cached (vLLM's scheduler ends a chunk there), its state
    // is cached at that chunk's end, and the 2nd sighting hits the whole prefix.
    let kinds = [AttentionKind::Full, mamba_align()];
    let mut a = Allocator::new(config(&kinds, 64, Some(0)), Policy::HitAware).unwrap();
    let prefix: Vec<u64> = (0..3).map(|i| 7_000 + i).collect();
    let pinned: Vec<BlockHash> = chain(&prefix).into_iter().map(BlockHash::from_u64).collect();
    assert!(a.pin_prefix(&pinned).unwrap() > 0);
    let sighting = |a: &mut Allocator, own: u64| {
        let contents: Vec<u64> = prefix.iter().copied().chain([own, own + 1]).collect();
        let hashes: Vec<BlockHash> = chain(&contents).into_iter().map(BlockHash::from_u64).collect();
        let h = a.add_request();
        a.append_hashes(h, &common::hash_bytes(&hashes), 8).unwrap();
        (h, a.find_longest_cache_hit(h, 19).unwrap())
    };
    let (h, hit) = sighting(&mut a, 100);
    assert_eq!((hit.num_tokens, hit.num_uncached_common_prefix_tokens), (0, 12));
    for (start, end) in [(0, 12), (12, 20)] {
        a.new_step_starts();
        let args = AllocateArgs {
            num_new_tokens: end - start,
            num_computed_tokens: start,
            num_prompt_tokens: 20,
            num_tokens: 20,
            shared_prefix_boundary: 12,
            ..Default::default()
        };
        assert!(a.allocate_slots(h, &args, NewComputed::Empty, None).unwrap().is_some());
    }
    a.free(h, LEVEL_NORMAL).unwrap();
    a.new_step_starts();
    let (_, hit) = sighting(&mut a, 200);
    assert_eq!((hit.num_tokens, hit.num_uncached_common_prefix_tokens), (12, 0));
    // Without the pin, the 1st sighting reports the first first-sighting stop: 1 block.
    let mut b = Allocator::new(config(&kinds, 64, Some(0)), Policy::HitAware).unwrap();
    let (_, hit) = sighting(&mut b, 100);
    assert_eq!((hit.num_tokens, hit.num_uncached_common_prefix_tokens), (0, 4));
    // Under exact, vLLM's rule: nothing is shared yet, so no junction.
    let mut e = Allocator::new(config(&kinds, 64, Some(0)), Policy::Exact).unwrap();
    let (_, hit) = sighting(&mut e, 100);
    assert_eq!((hit.num_tokens, hit.num_uncached_common_prefix_tokens), (0, 0));
}

/// Where vLLM's scheduler ends a request's prefill chunks, one scheduler step each: with a
/// Mamba "align" group, at the junction the lookup reported (the shared prefix's end) and
/// each one an allocation moved it to (hit-aware's first-sighting stops), and at the prompt's
/// checkpoint ((prompt - 1) rounded down to a block), where each state is cached; always at
/// the prompt's end. Checks every junction: a block boundary inside the prompt's uncached
/// part, a moved one past the junction its chunk reached.
struct PrefillChunks {
    hit: u32,
    prompt: u32,
    /// With a Mamba "align" group: chunks end at the junction and the checkpoint.
    mamba: bool,
    junction: u32,
    start: u32,
    end: u32,
}

impl PrefillChunks {
    fn new(hit: Hit, prompt: u32, mamba: bool) -> Self {
        let junction = if hit.num_uncached_common_prefix_tokens > 0 {
            hit.num_tokens + hit.num_uncached_common_prefix_tokens
        } else {
            0
        };
        if junction > 0 {
            assert!(
                junction % BS == 0 && junction > hit.num_tokens && junction < prompt,
                "junction {junction} reported for a hit of {} in a prompt of {prompt}: not a block boundary \
                 inside the prompt's uncached part",
                hit.num_tokens
            );
        }
        let start = hit.num_tokens;
        Self { hit: start, prompt, mamba, junction, start, end: start }
    }

    /// Whether the next chunk is the first (the one adopting the hit).
    fn is_first(&self) -> bool {
        self.start == self.hit
    }

    /// The next chunk's arguments, `None` once the prompt is computed.
    fn next(&mut self) -> Option<(AllocateArgs, NewComputed<'static>)> {
        if self.start >= self.prompt {
            return None;
        }
        let (start, prompt) = (self.start, self.prompt);
        let stops = [self.junction, (prompt - 1) / BS * BS];
        self.end = stops.into_iter().filter(|&e| self.mamba && e > start && e < prompt).min().unwrap_or(prompt);
        let first = self.is_first();
        let args = AllocateArgs {
            num_new_tokens: self.end - start,
            num_new_computed_tokens: if first { self.hit } else { 0 },
            num_computed_tokens: if first { 0 } else { start },
            num_prompt_tokens: prompt,
            num_tokens: prompt,
            shared_prefix_boundary: self.junction,
            ..Default::default()
        };
        Some((args, if first { NewComputed::Stored } else { NewComputed::Empty }))
    }

    /// After the chunk's allocation fit: takes the junction it moved, if any. Returns the
    /// chunk's end.
    fn advance(&mut self, a: &mut Allocator, h: ReqHandle) -> u32 {
        let (end, prompt, junction) = (self.end, self.prompt, self.junction);
        if let Some(j) = a.take_moved_junction(h).unwrap() {
            assert!(
                j % BS == 0 && j > end && j < prompt && end == junction,
                "junction {junction} moved to {j} by a chunk ending at {end} in a prompt of {prompt}: not the \
                 next block boundary stop inside the prompt after the junction reached"
            );
            self.junction = j;
        }
        self.start = end;
        end
    }
}

/// Allocates the prompt of `h`, looked up with `hit`, chunk by chunk where vLLM's scheduler
/// ends them under Mamba "align" ([`PrefillChunks`]). Returns the chunk ends.
fn prefill_in_chunks(a: &mut Allocator, h: ReqHandle, hit: Hit, prompt: u32) -> Vec<u32> {
    let mut chunks = PrefillChunks::new(hit, prompt, true);
    let mut ends = Vec::new();
    while let Some((args, nc)) = chunks.next() {
        a.new_step_starts();
        assert!(a.allocate_slots(h, &args, nc, None).unwrap().is_some());
        ends.push(chunks.advance(a, h));
    }
    ends
}

#[test]
fn unpinned_prefix_hits_on_second_sighting_mamba_align_hit_aware_only() {
    // Full attention + Mamba "align", a shared prefix of 4 or 3 blocks and 2-3 unique
    // blocks. With hit-aware the 1st sighting's lookup reports the first first-sighting stop
    // (1 block) and each chunk reaching a stop moves it to the next (2, then 4 blocks: the
    // powers of two within the prompt); the scheduler ends a chunk at each and each state is
    // cached, so the 2nd sighting hits the 4-block prefix whole, and 2 of the 3-block one
    // (more than half; the largest stop alone, 4 blocks, lies past it). Under exact (vLLM's
    // rule) the 2nd sighting hits nothing: only its own junction caches the state.
    let kinds = [AttentionKind::Full, mamba_align()];
    for (shared, policy, first_ends, hits) in [
        (4, Policy::HitAware, vec![4, 8, 16, 24, 26], vec![0, 16, 16]),
        (3, Policy::HitAware, vec![4, 8, 16, 24, 26], vec![0, 8, 12]),
        (4, Policy::Exact, vec![24, 26], vec![0, 0, 16]),
        (3, Policy::Exact, vec![24, 26], vec![0, 0, 12]),
    ] {
        let prefix: Vec<u64> = (0..shared).map(|i| 9_000 + i).collect();
        let mut a = Allocator::new(config(&kinds, 64, Some(0)), policy).unwrap();
        let mut got = Vec::new();
        for (k, own) in [100u64, 200, 300].into_iter().enumerate() {
            let contents: Vec<u64> = prefix.iter().copied().chain(own..own + 7 - shared).collect();
            let hashes: Vec<BlockHash> = chain(&contents).into_iter().map(BlockHash::from_u64).collect();
            let prompt = 6 * BS + 2; // 26 tokens: 6 full blocks
            let h = a.add_request();
            a.append_hashes(h, &common::hash_bytes(&hashes[..6]), 8).unwrap();
            let hit = a.find_longest_cache_hit(h, prompt - 1).unwrap();
            got.push(hit.num_tokens);
            let ends = prefill_in_chunks(&mut a, h, hit, prompt);
            if k == 0 {
                assert_eq!(ends, first_ends, "{policy:?}, {shared}-block prefix: the 1st sighting's chunk ends");
            }
            a.free(h, LEVEL_NORMAL).unwrap();
            a.new_step_starts();
        }
        assert_eq!(got, hits, "{policy:?}, {shared}-block prefix: hit tokens per sighting");
    }
}

/// A hit-aware allocator over full attention + Mamba "align" (64 blocks) and the hashes of an
/// 8-block chain whose contents start at `first`.
fn full_and_mamba_align_chain(first: u64) -> (Allocator, Vec<BlockHash>) {
    let kinds = [AttentionKind::Full, mamba_align()];
    let contents: Vec<u64> = (0..8).map(|i| first + i).collect();
    let hashes = chain(&contents).into_iter().map(BlockHash::from_u64).collect();
    (Allocator::new(config(&kinds, 64, Some(0)), Policy::HitAware).unwrap(), hashes)
}

/// Group `group`'s cached block covering the first `tokens` tokens of `hashes`.
fn cached_block(a: &Allocator, hashes: &[BlockHash], tokens: u32, group: u32) -> Option<BlockId> {
    let mut out = Vec::new();
    a.pool().get_cached_block(&hashes[(tokens / BS - 1) as usize], &[group], &mut out);
    out.first().copied()
}

/// The Mamba group's (group 1) cached state block covering the first `tokens` tokens.
fn mamba_state(a: &Allocator, hashes: &[BlockHash], tokens: u32) -> Option<BlockId> {
    cached_block(a, hashes, tokens, 1)
}

#[test]
fn chat_turn_passing_its_hit_state_leaves_it_speculative_mamba_align() {
    // Full attention + Mamba "align", a 2-turn chat: turn 1 (a 10-token prompt decoded to 17
    // tokens) ends with its furthest state at 16 tokens, kept at the normal level. Turn 2
    // re-sends those 16 tokens and 6 more, hits that state and decodes past the next two
    // block boundaries: the state it passed goes speculative, and its own furthest state (at
    // 28) is kept at the normal level. Under exact nothing is leveled.
    let (mut a, hashes) = full_and_mamba_align_chain(5_000);
    let state_level = |a: &Allocator, tokens: u32| mamba_state(a, &hashes, tokens).map(|b| a.pool().level(b));
    assert_eq!(chat_turn(&mut a, &hashes, 10, 17, |_, _| {}, |_| {}), 0);
    assert_eq!(state_level(&a, 16), Some(LEVEL_PROBATION), "turn 1 hit nothing: its state is on probation");
    assert_eq!(
        chat_turn(&mut a, &hashes, 22, 29, |_, _| {}, |_| {}),
        16,
        "turn 2 resumes from turn 1's furthest state"
    );
    assert_eq!(state_level(&a, 16), Some(LEVEL_SPECULATIVE), "the state turn 2 passed");
    assert_eq!(state_level(&a, 28), Some(LEVEL_NORMAL), "turn 2's furthest state");
    invariants::check(&a).unwrap();
}

#[test]
fn running_request_keeps_its_furthest_state_until_it_keys_a_later_one_mamba_align() {
    // Full attention + Mamba "align", one request: a 20-token prompt (a prefill chunk ends at
    // its checkpoint, 16) decoded to 27 tokens. The state at the prompt's end (20) is its
    // furthest: vLLM's mask skips it and vLLM frees it once the step after it is processed,
    // while decode goes on to 24. Until then a re-sent sequence resumes there, so it is not
    // speculative (it was, and was the first block evicted under pressure); once the state
    // at 24 is keyed, the one at 20 is passed and goes speculative.
    let (mut a, hashes) = full_and_mamba_align_chain(7_000);
    let state =
        |a: &Allocator, tokens: u32| mamba_state(a, &hashes, tokens).map(|b| (a.pool().ref_cnt(b), a.pool().level(b)));
    let (prompt, end) = (20u32, 27u32);
    let h = a.add_request();
    a.append_hashes(h, &common::hash_bytes(&hashes[..(end / BS) as usize]), 8).unwrap();
    let mut steps = vec![(0, 16, prompt), (16, prompt, prompt)];
    steps.extend((prompt..end).map(|c| (c, c + 1, c + 1)));
    for (start, stop, num_tokens) in steps {
        a.new_step_starts();
        let args = AllocateArgs {
            num_new_tokens: stop - start,
            num_computed_tokens: start,
            num_prompt_tokens: prompt,
            num_tokens,
            ..Default::default()
        };
        assert!(a.allocate_slots(h, &args, NewComputed::Empty, None).unwrap().is_some());
        if start == 21 {
            let (refs, level) = state(&a, 20).expect("the state at 20 is cached");
            assert_eq!(refs, 0, "the state at 20 is back in the pool while decode goes on");
            assert_ne!(level, LEVEL_SPECULATIVE, "the furthest state, not passed yet, is speculative");
        }
    }
    assert_eq!(state(&a, 20).map(|s| s.1), Some(LEVEL_SPECULATIVE), "the state at 20, passed by the one at 24");
    assert_ne!(state(&a, 24).map(|s| s.1), Some(LEVEL_SPECULATIVE), "the furthest state");
    a.free(h, LEVEL_NORMAL).unwrap();
    invariants::check(&a).unwrap();
}

/// One request of a chat over `hashes`: a `prompt`-token prompt (its hit adopted) decoded
/// one token a step to `end` tokens. `before_free` runs after the last step, before the
/// request is freed. Returns the hit.
fn chat_turn(
    a: &mut Allocator,
    hashes: &[BlockHash],
    prompt: u32,
    end: u32,
    mut during: impl FnMut(&mut Allocator, u32),
    before_free: impl FnOnce(&mut Allocator),
) -> u32 {
    let h = a.add_request();
    a.append_hashes(h, &common::hash_bytes(&hashes[..(end / BS) as usize]), 8).unwrap();
    let hit = a.find_longest_cache_hit(h, prompt - 1).unwrap();
    a.new_step_starts();
    let args = AllocateArgs {
        num_new_tokens: prompt - hit.num_tokens,
        num_new_computed_tokens: hit.num_tokens,
        num_prompt_tokens: prompt,
        num_tokens: prompt,
        ..Default::default()
    };
    let nc = if hit.num_tokens > 0 { NewComputed::Stored } else { NewComputed::Empty };
    assert!(a.allocate_slots(h, &args, nc, None).unwrap().is_some());
    for c in prompt..end {
        during(a, c);
        a.new_step_starts();
        let args = AllocateArgs {
            num_new_tokens: 1,
            num_computed_tokens: c,
            num_prompt_tokens: prompt,
            num_tokens: c + 1,
            ..Default::default()
        };
        assert!(a.allocate_slots(h, &args, NewComputed::Empty, None).unwrap().is_some());
    }
    before_free(a);
    a.free(h, LEVEL_NORMAL).unwrap();
    a.new_step_starts();
    hit.num_tokens
}

/// The full-attention group's (group 0) cached block covering the first `tokens` tokens.
fn full_block(a: &Allocator, hashes: &[BlockHash], tokens: u32) -> Option<BlockId> {
    cached_block(a, hashes, tokens, 0)
}

#[test]
fn unit_losing_its_state_leaves_its_full_attention_blocks_evicted_first_mamba_align() {
    // Full attention + Mamba "align": a finished request (a 10-token prompt decoded to 17,
    // keying states at 12 and 16) leaves a hit unit, its state at 16 and the four
    // full-attention blocks before it. When that state is evicted, the blocks at 4, 8 and 16
    // serve no hit: they go to the front of the queue, speculative, instead of waiting at
    // their level until LRU reaches them. The block at 12 ends where the passed state at 12
    // is still cached (as a shared prefix's junction would be): it keeps its level.
    let (mut a, hashes) = full_and_mamba_align_chain(9_000);
    assert_eq!(chat_turn(&mut a, &hashes, 10, 17, |_, _| {}, |_| {}), 0);
    let full: Vec<BlockId> = (1..=4).map(|i| full_block(&a, &hashes, i * BS).expect("cached")).collect();
    for &b in &full {
        assert_eq!(a.pool().unit_support(b), 1, "block {b} is in the unit of the state at 16");
        assert_ne!(a.pool().level(b), LEVEL_SPECULATIVE);
    }
    assert!(mamba_state(&a, &hashes, 12).is_some(), "the passed state at 12 is cached");
    let state = mamba_state(&a, &hashes, 16).expect("the state at 16 is cached");
    a.evict_blocks(&[state]).unwrap();
    let lost = [full[0], full[1], full[3]];
    for &b in &lost {
        assert_eq!(a.pool().level(b), LEVEL_SPECULATIVE, "block {b}, in the unit of an evicted state");
    }
    assert_ne!(a.pool().level(full[2]), LEVEL_SPECULATIVE, "the block where the state at 12 is cached");
    for &b in &full {
        assert_eq!(a.pool().unit_support(b), 0);
    }
    let mut front: Vec<BlockId> = a.pool().free_queue_order().into_iter().take(lost.len()).collect();
    front.sort_unstable();
    let mut want = lost.to_vec();
    want.sort_unstable();
    assert_eq!(front, want, "the lost unit's blocks are evicted first");
    invariants::check(&a).unwrap();
}

#[test]
fn full_attention_blocks_past_the_furthest_state_are_evicted_first_mamba_align() {
    // Full attention + Mamba "align": a 10-token prompt decoded to 17 tokens keys states at
    // 12 and 16. The state at 16 is evicted before the request is freed: its furthest state
    // is then at 12, and the full-attention block past 12 serves no hit. It goes speculative;
    // the three before 12 form the unit with the state at 12.
    let (mut a, hashes) = full_and_mamba_align_chain(11_000);
    let drop_state = |a: &mut Allocator| {
        let s = mamba_state(a, &hashes, 16).expect("state cached");
        a.evict_blocks(&[s]).unwrap();
    };
    assert_eq!(chat_turn(&mut a, &hashes, 10, 17, |_, _| {}, drop_state), 0);
    assert!(mamba_state(&a, &hashes, 12).is_some(), "the state at 12 is cached");
    for t in [4, 8, 12] {
        let b = full_block(&a, &hashes, t).expect("cached");
        assert_eq!(a.pool().unit_support(b), 1, "block {b} is in the unit of the state at 12");
        assert_ne!(a.pool().level(b), LEVEL_SPECULATIVE, "block {b}, before the state at 12");
    }
    let past = full_block(&a, &hashes, 16).expect("cached");
    assert_eq!(a.pool().level(past), LEVEL_SPECULATIVE, "block {past}, past the furthest state");
    invariants::check(&a).unwrap();
}

#[test]
fn resumed_own_state_waits_below_finished_units_while_its_request_runs_mamba_align() {
    fn sample(at: u32, state: BlockId, seen: &mut Vec<(u32, u8)>) -> impl FnMut(&mut Allocator, u32) + '_ {
        move |a: &mut Allocator, c: u32| {
            if c == at {
                seen.push((a.pool().ref_cnt(state), a.pool().level(state)));
            }
        }
    }
    // Full attention + Mamba "align", a 3-turn chat. Each turn resumes from the previous
    // turn's furthest state (its own conversation: no junction). While the turn runs, that
    // state (free once the step after it is processed) waits below every finished unit: at
    // the resumed level when it was on probation (turn 1 hit nothing), at the near level when
    // it was at the normal level (turn 2 hit more than half its prompt). Under round-robin
    // chat the running session is the one that comes back last.
    let (mut a, hashes) = full_and_mamba_align_chain(13_000);
    assert_eq!(chat_turn(&mut a, &hashes, 10, 17, |_, _| {}, |_| {}), 0);
    let s16 = mamba_state(&a, &hashes, 16).expect("the state at 16 is cached");
    assert_eq!(a.pool().level(s16), LEVEL_PROBATION, "turn 1 hit nothing");
    let mut seen = Vec::new();
    assert_eq!(chat_turn(&mut a, &hashes, 18, 22, sample(19, s16, &mut seen), |_| {}), 16);
    assert_eq!(seen, vec![(0, LEVEL_RESUMED)], "turn 1's state, free while turn 2 runs");
    let s20 = mamba_state(&a, &hashes, 20).expect("the state at 20 is cached");
    assert_eq!(a.pool().level(s20), LEVEL_NORMAL, "turn 2's furthest state");
    let mut seen = Vec::new();
    assert_eq!(chat_turn(&mut a, &hashes, 25, 27, sample(26, s20, &mut seen), |_| {}), 20);
    assert_eq!(seen, vec![(0, LEVEL_NEAR)], "turn 2's state, free while turn 3 runs");
    invariants::check(&a).unwrap();
}

/// Prefills `prompt` tokens of `h` after its lookup `hit`, as vLLM's scheduler does with
/// `mamba_shared_prefix_checkpoint` (hit-aware sets it with partial hash hits): a chunk ends
/// at the reported shared prefix's end, then at the prompt's last hash boundary, then at its
/// end. Returns the chunk ends.
fn prefill_partial(a: &mut Allocator, h: ReqHandle, hit: Hit, prompt: u32, hash_block: u32) -> Vec<u32> {
    let boundary = hit.num_tokens + hit.num_uncached_common_prefix_tokens;
    let mut ends: Vec<u32> = vec![boundary, prompt / hash_block * hash_block, prompt];
    ends.retain(|&e| e > hit.num_tokens);
    ends.dedup();
    let mut start = hit.num_tokens;
    for (k, &end) in ends.iter().enumerate() {
        a.new_step_starts();
        let args = AllocateArgs {
            num_new_tokens: end - start,
            num_new_computed_tokens: if k == 0 { hit.num_tokens } else { 0 },
            num_computed_tokens: if k == 0 { 0 } else { start },
            num_prompt_tokens: prompt,
            num_tokens: prompt,
            shared_prefix_boundary: boundary,
            ..Default::default()
        };
        let nc = if k == 0 && hit.num_tokens > 0 { NewComputed::Stored } else { NewComputed::Empty };
        assert!(a.allocate_slots(h, &args, nc, None).unwrap().is_some(), "chunk to {end}");
        a.take_kv_cache_block_copies();
        start = end;
    }
    ends
}

#[test]
fn partial_hash_hits_sibling_prompts_hit_their_shared_prefix_inside_a_block_and_keep_it_hit_aware() {
    // Full attention + Mamba "align" at blocks of 2 hash blocks (vLLM's partial hash hits,
    // `--prefix-match-unit` = the hash block). Three prompts share 3 hash blocks (12 tokens,
    // inside block 1) and then differ. Hit-aware: the 2nd prompt's lookup finds the prefix the
    // 1st passed through and reports its end, inside a block, as the shared prefix's end; the
    // scheduler ends a chunk there and the state and the full-attention block are keyed at
    // it, so the 3rd prompt hits all 12 tokens (the 2nd hits the 1st's first-sighting stop,
    // one block). Under exact (vLLM) the 2nd hits nothing and keys a state at the first
    // block, the 8 tokens the full-attention search shared, which the 3rd hits.
    let kinds = [AttentionKind::Full, mamba_align()];
    for (policy, hits) in [(Policy::HitAware, vec![0, 8, 12]), (Policy::Exact, vec![0, 0, 8])] {
        let mut cfg = config(&kinds, 64, None);
        for g in &mut cfg.groups {
            g.block_size = 2 * BS;
        }
        cfg.scheduler_block_size = 2 * BS;
        assert!(cfg.partial_hash_hits());
        let mut a = Allocator::new(cfg, policy).unwrap();
        let prefix: Vec<u64> = (0..3).map(|i| 9_000 + i).collect();
        let prompt = 6 * BS + 2;
        let mut got = Vec::new();
        let mut junction_states = Vec::new();
        for own in [100u64, 200, 300] {
            let contents: Vec<u64> = prefix.iter().copied().chain(own..own + 3).collect();
            let hashes: Vec<BlockHash> = chain(&contents).into_iter().map(BlockHash::from_u64).collect();
            let h = a.add_request();
            a.append_hashes(h, &common::hash_bytes(&hashes), 8).unwrap();
            let hit = a.find_longest_cache_hit(h, prompt - 1).unwrap();
            got.push(hit.num_tokens);
            let ends = prefill_partial(&mut a, h, hit, prompt, BS);
            if policy == Policy::HitAware && own == 200 {
                assert_eq!(ends[0], 3 * BS, "the 2nd sighting stops at the shared prefix's end");
            }
            a.free(h, LEVEL_NORMAL).unwrap();
            invariants::check(&a).unwrap();
            junction_states.push(mamba_state(&a, &hashes, 3 * BS));
        }
        assert_eq!(got, hits, "{policy:?}: hit tokens per sighting");
        if policy == Policy::HitAware {
            // The junction's state: keyed by the 2nd sighting, hit by the 3rd (where the 1st
            // went on: a branch point), kept at the normal level.
            let st = junction_states[1].expect("the state at the junction is cached");
            assert_eq!(junction_states[2], Some(st));
            assert!(a.pool().is_branch(st), "a hit where another prompt went on is a branch point");
            assert_eq!(a.pool().level(st), LEVEL_NORMAL);
            assert_eq!(a.pool().block_hash_num_tokens(st), 3 * BS);
        } else {
            assert!(junction_states.iter().all(Option::is_none), "exact keys no state inside the prefix");
        }
    }
}

#[test]
fn sibling_hit_on_a_shared_prefix_state_keeps_it_a_branch_point_mamba_align() {
    // Full attention + Mamba "align" at the hash block. Two prompts share 2 blocks and then
    // differ. The 1st (hit-aware's first-sighting stops at 1 and 2 blocks) caches a state at
    // the shared prefix's end; the 2nd hits exactly there and computes on. That hit's end is
    // where another prompt went on, not where a finished sequence ended: a shared prefix, so
    // the state is a branch point and keeps the normal level once the 2nd passes it (it went
    // speculative, as a chat's own earlier turn does, and under pressure the siblings lost
    // the shared system prompt: 44.5% hits against vLLM's 57.0% on the full-size sysprompt).
    let kinds = [AttentionKind::Full, mamba_align()];
    let mut a = Allocator::new(config(&kinds, 64, Some(0)), Policy::HitAware).unwrap();
    let prefix: Vec<u64> = vec![9_000, 9_001];
    let prompt = 6 * BS + 2;
    let mut shared_state = None;
    for (k, own) in [100u64, 200].into_iter().enumerate() {
        let contents: Vec<u64> = prefix.iter().copied().chain(own..own + 5).collect();
        let hashes: Vec<BlockHash> = chain(&contents).into_iter().map(BlockHash::from_u64).collect();
        let h = a.add_request();
        a.append_hashes(h, &common::hash_bytes(&hashes[..6]), 8).unwrap();
        let hit = a.find_longest_cache_hit(h, prompt - 1).unwrap();
        assert_eq!(hit.num_tokens, if k == 0 { 0 } else { 2 * BS }, "sighting {}", k + 1);
        prefill_in_chunks(&mut a, h, hit, prompt);
        a.free(h, LEVEL_NORMAL).unwrap();
        a.new_step_starts();
        invariants::check(&a).unwrap();
        shared_state = mamba_state(&a, &hashes, 2 * BS);
    }
    let st = shared_state.expect("the state at the shared prefix's end is cached");
    assert!(a.pool().is_branch(st), "a hit where another prompt went on is a branch point");
    assert_eq!(a.pool().level(st), LEVEL_NORMAL, "the shared prefix's state, passed by the 2nd");
}

#[test]
fn partial_tail_keyed_in_a_block_left_pinned_by_its_previous_life_is_freed_at_the_normal_level() {
    // Full attention + Mamba "align" at blocks of 2 hash blocks (partial hash hits), hit-aware,
    // a pool of 6 blocks (and the null block). Request A (a 14-token prompt: its partial tail, 12 tokens, is keyed
    // inside full-attention block 1 and on its state) is freed with a retention priority: its
    // blocks at the pinned level. Evicted, they go back to the pool keeping that level (a
    // level outlives its key). Request B (other content, same length) gets them: its partial
    // tail is keyed by `cache_partial_block` (`cache_one_block`), which must start the block
    // at the normal level as `cache_full_blocks` does, so B, freed without a priority, leaves
    // nothing at the pinned level. Without the `keyed` hook there, B's partial-tail blocks
    // kept A's pinned level and took the pinned share.
    let kinds = [AttentionKind::Full, mamba_align()];
    let mut cfg = config(&kinds, 7, None);
    for g in &mut cfg.groups {
        g.block_size = 2 * BS;
    }
    cfg.scheduler_block_size = 2 * BS;
    assert!(cfg.partial_hash_hits());
    let mut a = Allocator::new(cfg, Policy::HitAware).unwrap();
    a.set_pinned_share(1.0).unwrap();
    let prompt = 3 * BS + 2;
    let run = |a: &mut Allocator, first: u64, level| {
        let contents: Vec<u64> = (first..first + 3).collect();
        let hashes: Vec<BlockHash> = chain(&contents).into_iter().map(BlockHash::from_u64).collect();
        let h = a.add_request();
        a.append_hashes(h, &common::hash_bytes(&hashes), 8).unwrap();
        let hit = a.find_longest_cache_hit(h, prompt - 1).unwrap();
        assert_eq!(hit.num_tokens, 0);
        prefill_partial(a, h, hit, prompt, BS);
        let blocks: Vec<BlockId> = (0..2).flat_map(|g| a.blocks(h, g).unwrap().to_vec()).collect();
        a.free(h, level).unwrap();
        a.take_kv_cache_block_copies();
        invariants::check(a).unwrap();
        blocks
    };
    let first = run(&mut a, 100, LEVEL_PINNED);
    assert!(a.pool().pinned_free() > 0, "A's blocks wait at the pinned level");
    a.evict_blocks(&first).unwrap();
    assert_eq!(a.pool().pinned_free(), 0);
    let second = run(&mut a, 200, LEVEL_NORMAL);
    let reused: Vec<BlockId> = second.iter().copied().filter(|b| *b != NULL_BLOCK && first.contains(b)).collect();
    assert!(!reused.is_empty(), "B got A's blocks");
    for b in reused {
        if a.pool().block_hash(b).is_some() {
            assert!(
                a.pool().level(b) <= LEVEL_NORMAL,
                "block {b}, B's, keyed again after A's life at the pinned level"
            );
        }
    }
    assert_eq!(a.pool().pinned_free(), 0, "B, freed without a priority, pins nothing");
    invariants::check(&a).unwrap();
}
