//! Criterion benches of the core's hot operations, on the shapes vLLM serves.
//!
//! - `pool/*`: one pool operation: `get_new_blocks` + `free_blocks` of 1 and 16 blocks, and
//!   `touch` + `free_blocks` (a cache hit taken from the free queue and given back).
//! - `pool/admission_323k/2x96`: an admission's pool work on the serve loop's pool size
//!   (323,000 blocks, every free block cached, 32-byte random-looking hashes): 192 blocks
//!   taken from the queue's front (each evicting its old prefix-index entry), cached in two
//!   groups of 96 under fresh hashes, then freed to the back. The pool recycles in FIFO
//!   order, so the blocks and index slots touched are cold as in a real serve loop.
//! - `find_longest_cache_hit/*`: a 6144-token prompt whose 384 blocks are all cached, for
//!   full attention alone and for the gemma-2 shape (full + sliding window 4096).
//! - `decode/*`: `allocate_slots` for one decoding request on the gemma-2 shape, when the
//!   token fits in the last block and when it opens a new one.
//! - `scheduler_step/*`: N running requests with ~6144-token contexts each decode one token:
//!   per request `append_hashes` when a block fills, `allocate_slots(1)`, `cache_blocks`.
//!   Reported per step and, through `Throughput::Elements(N)`, per request.
//! - `free/*`: `free` of a request holding 400 blocks (full attention) and of a 6400-token
//!   gemma-2 request.
//! - `prefill_burst/*`: admitting 16 requests of 6144 tokens sharing a 2048-token prefix
//!   (hashes, hit search, `allocate_slots` with the hit), from an empty cache.
//! - `*/*_hit_aware/*`: the same operations under [`Policy::HitAware`] (the cases above are
//!   all [`Policy::Exact`]): `decode` (a block fills; a new block opens), `free` and
//!   `prefill_burst`, on the gemma-2 shape and on the align shape. On the align shape the
//!   requests run as vLLM's scheduler runs them in Mamba cache mode "align": a new scheduler
//!   step before each allocation, and the prefill in chunks that end at the junction the
//!   lookup reported (and each one an allocation moved it to: hit-aware's first-sighting
//!   stops) and at the prompt's checkpoint (`(prompt - 1)` rounded down to a block). The
//!   hit-aware `free` admits a request of new content each time (not timed), so the pool
//!   holds the units earlier requests left and the admission evicts the oldest.
//!
//! The gemma-2 shape: groups full bs 16 + sliding window 4096 bs 16 (distinct spec keys),
//! `hash_block_size` = `scheduler_block_size` = 16, `max_model_len` 8192,
//! `max_in_flight_tokens` 8192, `prefix_cache_retention_interval` `Some(0)`. The align shape
//! (a state-space hybrid: Qwen3-Next, Nemotron-H): full bs 16 + Mamba "align" bs 16 (no
//! speculative blocks, no prefill checkpoint blocks), otherwise the same.
//!
//! Run: `cargo bench --bench core_ops` (about two minutes); `-- --test` runs each once.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hybrid_alloc::block_pool::{BlockPool, TableRef};
use hybrid_alloc::policy::LEVEL_NORMAL;
use hybrid_alloc::{
    AllocateArgs, Allocator, AttentionKind, BlockHash, BlockId, CacheBlocksArgs, Config, GroupSpec, NewComputed,
    Policy, ReqHandle,
};

const BS: u32 = 16;
const PROMPT: u32 = 6144;
const MAX_MODEL_LEN: u32 = 8192;

fn full_only(num_blocks: u32) -> Config {
    Config {
        max_model_len: MAX_MODEL_LEN,
        max_in_flight_tokens: 8192,
        ..Config::new(num_blocks, vec![GroupSpec { kind: AttentionKind::Full, block_size: BS, spec_key: 0 }], BS)
    }
}

/// Gemma-2: full attention + sliding window 4096, both block size 16.
fn gemma2(num_blocks: u32) -> Config {
    let mut cfg = full_only(num_blocks);
    cfg.groups.push(GroupSpec {
        kind: AttentionKind::SlidingWindow { window: 4096, extra_retained_tokens: 0 },
        block_size: BS,
        spec_key: 1,
    });
    cfg.retention_interval = Some(0);
    cfg
}

/// A state-space hybrid: full attention + Mamba "align", both block size 16.
fn align(num_blocks: u32) -> Config {
    let mut cfg = full_only(num_blocks);
    cfg.groups.push(GroupSpec {
        kind: AttentionKind::Mamba {
            speculative_blocks: 0,
            align: true,
            rekey_cached_tail: false,
            checkpoint_alignment: 0,
        },
        block_size: BS,
        spec_key: 1,
    });
    cfg.retention_interval = Some(0);
    cfg
}

fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.rotate_left(17) ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Content id of block `i` of request family `seed`; blocks before `shared` are common.
fn content(seed: u64, shared: u32, i: u32) -> u64 {
    if i < shared {
        i as u64
    } else {
        mix(seed, i as u64)
    }
}

/// Chained hashes (8 bytes each) of the first `n` blocks of request family `seed`.
fn hash_bytes(seed: u64, shared: u32, n: u32) -> Vec<u8> {
    let mut prev = 0x5EEDu64;
    let mut out = Vec::with_capacity(n as usize * 8);
    for i in 0..n {
        prev = mix(prev, content(seed, shared, i));
        out.extend_from_slice(BlockHash::from_u64(prev).as_bytes());
    }
    out
}

/// A request of `num_tokens` tokens (family `seed`), prefilled in one step: it holds
/// `cdiv(num_tokens, 16)` blocks per group and caches its full ones.
fn prefilled(a: &mut Allocator, seed: u64, num_tokens: u32) -> Running {
    let h = a.add_request();
    let bytes = hash_bytes(seed, 0, num_tokens / BS);
    a.append_hashes(h, &bytes, 8).unwrap();
    let args =
        AllocateArgs { num_new_tokens: num_tokens, num_prompt_tokens: num_tokens, num_tokens, ..Default::default() };
    a.allocate_slots(h, &args, NewComputed::Empty, None).unwrap().expect("pool large enough");
    let last = bytes.last_chunk::<8>().map_or(0x5EED, |b| u64::from_be_bytes(*b));
    Running { h, seed, prompt: num_tokens, computed: num_tokens, last_hash: last, align: false }
}

/// Admits request `h` (its hashes sent) with a prompt of `prompt` tokens as vLLM's scheduler
/// does under Mamba "align": the lookup, then one prefill chunk a scheduler step, ending at
/// the junction the lookup reported (and each one an allocation moved it to) and at the
/// prompt's checkpoint, then at its end. Returns the hit's tokens.
fn admit_align(a: &mut Allocator, h: ReqHandle, prompt: u32) -> u32 {
    let hit = a.find_longest_cache_hit(h, prompt - 1).unwrap();
    let mut junction = if hit.num_uncached_common_prefix_tokens > 0 {
        hit.num_tokens + hit.num_uncached_common_prefix_tokens
    } else {
        0
    };
    let mut start = hit.num_tokens;
    while start < prompt {
        let first = start == hit.num_tokens;
        let end =
            [junction, (prompt - 1) / BS * BS].into_iter().filter(|&e| e > start && e < prompt).min().unwrap_or(prompt);
        a.new_step_starts();
        let args = AllocateArgs {
            num_new_tokens: end - start,
            num_new_computed_tokens: if first { hit.num_tokens } else { 0 },
            num_computed_tokens: if first { 0 } else { start },
            num_prompt_tokens: prompt,
            num_tokens: prompt,
            shared_prefix_boundary: junction,
            ..Default::default()
        };
        let nc = if first && hit.num_tokens > 0 { NewComputed::Stored } else { NewComputed::Empty };
        a.allocate_slots(h, &args, nc, None).unwrap().expect("pool large enough");
        if let Some(j) = a.take_moved_junction(h).unwrap() {
            junction = j;
        }
        start = end;
    }
    hit.num_tokens
}

/// [`prefilled`] on the align shape: the prompt admitted as [`admit_align`] does.
fn prefilled_align(a: &mut Allocator, seed: u64, num_tokens: u32) -> Running {
    let h = a.add_request();
    let bytes = hash_bytes(seed, 0, num_tokens / BS);
    a.append_hashes(h, &bytes, 8).unwrap();
    admit_align(a, h, num_tokens);
    let last = bytes.last_chunk::<8>().map_or(0x5EED, |b| u64::from_be_bytes(*b));
    Running { h, seed, prompt: num_tokens, computed: num_tokens, last_hash: last, align: true }
}

fn decode_args(computed: u32, prompt: u32) -> AllocateArgs {
    AllocateArgs {
        num_new_tokens: 1,
        num_computed_tokens: computed,
        num_prompt_tokens: prompt,
        num_tokens: computed + 1,
        ..Default::default()
    }
}

/// A running request as the scheduler sees it.
#[derive(Clone, Copy, Debug)]
struct Running {
    h: ReqHandle,
    seed: u64,
    prompt: u32,
    /// `num_computed_tokens`; the request has `computed` tokens before a step.
    computed: u32,
    /// Hash of its last full block (the next one chains on it).
    last_hash: u64,
    /// Mamba "align": a new scheduler step starts before each allocation.
    align: bool,
}

impl Running {
    /// One decode step: the sampled token joins, its block's hash is sent when the block
    /// fills, then its slot is allocated and the full blocks cached.
    #[inline]
    fn step(&mut self, a: &mut Allocator) {
        let num_tokens = self.computed + 1;
        if num_tokens % BS == 0 {
            self.last_hash = mix(self.last_hash, content(self.seed, 0, num_tokens / BS - 1));
            a.append_hashes(self.h, BlockHash::from_u64(self.last_hash).as_bytes(), 8).unwrap();
        }
        if self.align {
            a.new_step_starts();
        }
        let res = a.allocate_slots(self.h, &decode_args(self.computed, self.prompt), NewComputed::Empty, None).unwrap();
        black_box(res.expect("pool large enough"));
        a.cache_blocks(
            self.h,
            &CacheBlocksArgs {
                num_computed_tokens: num_tokens,
                num_prompt_tokens: self.prompt,
                shared_prefix_boundary: 0,
                ..Default::default()
            },
            None,
        )
        .unwrap();
        self.computed = num_tokens;
    }
}

/// Decodes `steps` tokens one by one, so the sliding window has recycled what it can.
fn decode_steps(a: &mut Allocator, r: &mut Running, steps: u32) {
    for _ in 0..steps {
        r.step(a);
    }
}

fn bench_pool(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    for n in [1u32, 16] {
        let mut pool = BlockPool::new(4096, true, false);
        let mut out: Vec<BlockId> = Vec::with_capacity(16);
        g.bench_function(format!("get_new_blocks+free_blocks/{n}"), |b| {
            b.iter(|| {
                pool.get_new_blocks(black_box(n), &mut out);
                pool.free_blocks(out.drain(..).rev());
            })
        });
        // A cache hit's blocks: free, pulled out of the middle of the queue, then given back.
        let mut pool = BlockPool::new(4096, true, false);
        let blocks: Vec<BlockId> = (0..n).map(|i| 1000 + 7 * i).collect();
        g.bench_function(format!("touch+free_blocks/{n}"), |b| {
            b.iter(|| {
                pool.touch(black_box(&blocks));
                pool.free_blocks(blocks.iter().rev().copied());
            })
        });
    }
    g.finish();
}

/// A fresh 32-byte hash (sha256-like: every byte random-looking) from a counter.
fn fresh_hash(ctr: &mut u64) -> BlockHash {
    *ctr += 1;
    let mut b = [0u8; 32];
    for (k, w) in b.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&mix(*ctr, k as u64).to_le_bytes());
    }
    BlockHash::from_bytes(&b).expect("32 bytes")
}

/// One admission's pool work: 192 blocks recycled from the front of the queue and cached as
/// two groups of 96 under fresh hashes, then freed (hashed: to the back).
#[inline(always)]
fn recycle_and_cache(pool: &mut BlockPool, ctr: &mut u64, out: &mut Vec<BlockId>, hashes: &mut Vec<BlockHash>) {
    out.clear();
    pool.get_new_blocks(192, out);
    for (g, table) in out.chunks(96).enumerate() {
        hashes.clear();
        hashes.extend((0..96).map(|_| fresh_hash(ctr)));
        let t = TableRef { req: 1, group: g as u32, block_size: BS, blocks: table };
        pool.cache_full_blocks(&t, 0..96, None, |i| hashes[i as usize]);
    }
    pool.free_blocks(out.iter().rev().copied());
}

/// The measured call of `pool/admission_323k` (not inlined, so that callgrind can count it
/// alone: `--toggle-collect='*admission_step*'`).
#[inline(never)]
fn admission_step(pool: &mut BlockPool, ctr: &mut u64, out: &mut Vec<BlockId>, hashes: &mut Vec<BlockHash>) {
    recycle_and_cache(pool, ctr, out, hashes)
}

fn bench_admission_pool(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    let num_blocks = 323_000u32;
    let mut pool = BlockPool::new(num_blocks, true, false);
    let (mut ctr, mut out, mut hashes) = (0u64, Vec::with_capacity(192), Vec::with_capacity(96));
    // Warm up until every block is cached once (and then some): the steady state.
    for _ in 0..(num_blocks / 192 + 10) {
        recycle_and_cache(&mut pool, &mut ctr, &mut out, &mut hashes);
    }
    assert_eq!(pool.num_free_blocks(), num_blocks - 1);
    g.throughput(Throughput::Elements(192));
    g.bench_function("admission_323k/2x96", |b| b.iter(|| admission_step(&mut pool, &mut ctr, &mut out, &mut hashes)));
    g.finish();
}

fn bench_find(c: &mut Criterion) {
    let mut g = c.benchmark_group("find_longest_cache_hit");
    for (name, cfg) in [("full/6144", full_only(2048)), ("gemma2/6144", gemma2(2048))] {
        let mut a = Allocator::new(cfg, Policy::Exact).unwrap();
        let first = prefilled(&mut a, 1, PROMPT + 1);
        a.free(first.h, LEVEL_NORMAL).unwrap();
        let h = a.add_request();
        a.append_hashes(h, &hash_bytes(1, 0, PROMPT / BS), 8).unwrap();
        assert_eq!(a.find_longest_cache_hit(h, PROMPT).unwrap().num_tokens, PROMPT, "{name}: a full hit");
        g.bench_function(name, |b| b.iter(|| black_box(a.find_longest_cache_hit(h, black_box(PROMPT)).unwrap())));
    }
    g.finish();
}

impl Running {
    /// Sends the hash of the block the next token fills, if it fills one (and under Mamba
    /// "align" starts the scheduler step).
    fn prepare(&mut self, a: &mut Allocator) {
        let num_tokens = self.computed + 1;
        if num_tokens % BS == 0 {
            self.last_hash = mix(self.last_hash, content(self.seed, 0, num_tokens / BS - 1));
            a.append_hashes(self.h, BlockHash::from_u64(self.last_hash).as_bytes(), 8).unwrap();
        }
        if self.align {
            a.new_step_starts();
        }
    }

    /// The `allocate_slots` of a decode step (after [`Running::prepare`]).
    #[inline]
    fn allocate(&mut self, a: &mut Allocator) {
        let args = decode_args(self.computed, self.prompt);
        let res = a.allocate_slots(self.h, black_box(&args), NewComputed::Empty, None).unwrap();
        black_box(res.expect("pool large enough"));
        self.computed += 1;
    }
}

/// Which decode steps a case times, by position `computed % 16`.
type Positions = fn(u32) -> bool;
/// A shape's config for a pool of so many blocks.
type Shape = fn(u32) -> Config;
/// A decode case: its name and the steps it times.
type DecodeCase = (&'static str, Positions);

/// 1..=14: the token lands in the last block, no block fills; 15: the block fills and is
/// cached; 0: the token opens a new block in every group (and one SWA block falls out).
const NO_NEW_BLOCK: DecodeCase = ("no_new_block", |p| (1..=14).contains(&p));
const BLOCK_FILLS: DecodeCase = ("block_fills", |p| p == 15);
const NEW_BLOCK: DecodeCase = ("new_block", |p| p == 0);

/// One request decoding from 6144 + 16 tokens (a gemma-2 window already recycled) up to
/// `MAX_MODEL_LEN`, then again from a copy (not timed). Only the steps whose position
/// `computed % 16` is selected are timed; the others run between them, as in a server.
fn bench_decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    let setups: [(&str, Shape, Policy, &[DecodeCase]); 3] = [
        ("gemma2", gemma2, Policy::Exact, &[NO_NEW_BLOCK, BLOCK_FILLS, NEW_BLOCK]),
        ("gemma2_hit_aware", gemma2, Policy::HitAware, &[BLOCK_FILLS, NEW_BLOCK]),
        ("align_hit_aware", align, Policy::HitAware, &[BLOCK_FILLS, NEW_BLOCK]),
    ];
    for (shape, cfg, policy, cases) in setups {
        let mut a = Allocator::new(cfg(2048), policy).unwrap();
        let mut r =
            if shape.starts_with("align") { prefilled_align(&mut a, 1, PROMPT) } else { prefilled(&mut a, 1, PROMPT) };
        decode_steps(&mut a, &mut r, BS);
        let base = (a, r);
        for &(case, timed) in cases {
            let (mut a, mut r) = base.clone();
            g.bench_function(format!("{shape}/{case}"), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    let mut n = 0;
                    while n < iters {
                        if r.computed + 2 >= MAX_MODEL_LEN {
                            (a, r) = base.clone();
                        }
                        if !timed(r.computed % BS) {
                            r.step(&mut a);
                            continue;
                        }
                        // Time a run of consecutive selected steps with one pair of clock reads.
                        r.prepare(&mut a);
                        let t = Instant::now();
                        loop {
                            r.allocate(&mut a);
                            n += 1;
                            let p = r.computed % BS;
                            if n == iters || !timed(p) || p == BS - 1 || r.computed + 2 >= MAX_MODEL_LEN {
                                break;
                            }
                        }
                        total += t.elapsed();
                    }
                    total
                })
            });
        }
    }
    g.finish();
}

/// N requests of 6144 + (0..16) tokens, prefilled, then decoded 16 steps so every window
/// has recycled; steps run until `MAX_MODEL_LEN`, then the state is rebuilt (not timed).
#[derive(Clone)]
struct Batch {
    a: Allocator,
    reqs: Vec<Running>,
}

impl Batch {
    fn new(n: u32) -> Self {
        let per_req = MAX_MODEL_LEN / BS + 4096 / BS + 4;
        let mut a = Allocator::new(gemma2(n * per_req + 1), Policy::Exact).unwrap();
        let mut reqs = Vec::with_capacity(n as usize);
        for i in 0..n {
            reqs.push(prefilled(&mut a, 1000 + i as u64, PROMPT + i % BS));
        }
        let mut b = Self { a, reqs };
        for _ in 0..BS {
            b.step();
        }
        b
    }

    fn steps_left(&self) -> u32 {
        MAX_MODEL_LEN - 1 - self.reqs.iter().map(|r| r.computed).max().unwrap()
    }

    #[inline]
    fn step(&mut self) {
        for r in self.reqs.iter_mut() {
            r.step(&mut self.a);
        }
    }
}

fn bench_scheduler_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler_step");
    for n in [256u32, 1024] {
        let base = Batch::new(n);
        let mut cur = base.clone();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("gemma2/{n}_requests"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if cur.steps_left() == 0 {
                        cur = base.clone();
                    }
                    let t = Instant::now();
                    cur.step();
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

/// `free` of a request holding 400 blocks (6399 prompt tokens, one decoded, so the window
/// has recycled its part). Each iteration admits it again (not timed), from the same pool:
/// under exact the same request; under hit-aware one of new content each time, so the
/// pool holds what earlier requests left at their levels (and, on the align shape, their
/// hit units), and the admission evicts the oldest.
fn bench_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("free");
    let setups: [(&str, Config, Policy); 5] = [
        ("full/400_blocks", full_only(1024), Policy::Exact),
        ("gemma2/400_blocks_per_group", gemma2(1024), Policy::Exact),
        ("gemma2_hit_aware/400_blocks_per_group", gemma2(1024), Policy::HitAware),
        ("full_hit_aware/400_blocks", full_only(1024), Policy::HitAware),
        ("align_hit_aware/400_blocks", align(1024), Policy::HitAware),
    ];
    for (name, cfg, policy) in setups {
        let is_align = name.starts_with("align");
        let mut a = Allocator::new(cfg, policy).unwrap();
        let mut seed = 1;
        let mut admit = |a: &mut Allocator| {
            if policy == Policy::HitAware {
                seed += 1;
            }
            let prompt = 400 * BS - 1;
            let mut r = if is_align { prefilled_align(a, seed, prompt) } else { prefilled(a, seed, prompt) };
            decode_steps(a, &mut r, 1);
            assert_eq!(a.blocks(r.h, 0).unwrap().len(), 400);
            r.h
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let h = admit(&mut a);
                    let t = Instant::now();
                    a.free(black_box(h), LEVEL_NORMAL).unwrap();
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

/// 16 requests of 6144 tokens sharing a 2048-token prefix admitted one after the other
/// (hashes, hit search, `allocate_slots` with the hit; on the align shape, as vLLM's
/// scheduler admits them in Mamba cache mode "align": [`admit_align`]), from an empty cache.
fn bench_prefill_burst(c: &mut Criterion) {
    const N: u64 = 16;
    const SHARED: u32 = 2048;
    let mut g = c.benchmark_group("prefill_burst");
    let setups: [(&str, Shape, Policy); 3] = [
        ("gemma2/16x6144_shared_2048", gemma2, Policy::Exact),
        ("gemma2_hit_aware/16x6144_shared_2048", gemma2, Policy::HitAware),
        ("align_hit_aware/16x6144_shared_2048", align, Policy::HitAware),
    ];
    let hashes: Vec<Vec<u8>> = (0..N).map(|i| hash_bytes(100 + i, SHARED / BS, PROMPT / BS)).collect();
    for (name, cfg, policy) in setups {
        let is_align = name.starts_with("align");
        let mut a = Allocator::new(cfg(16384), policy).unwrap();
        let admit = |a: &mut Allocator, handles: &mut Vec<ReqHandle>| {
            let mut hits = 0;
            for hs in &hashes {
                let h = a.add_request();
                handles.push(h);
                a.append_hashes(h, hs, 8).unwrap();
                if is_align {
                    hits += admit_align(a, h, PROMPT);
                    continue;
                }
                let hit = a.find_longest_cache_hit(h, PROMPT - 1).unwrap().num_tokens;
                let args = AllocateArgs {
                    num_new_tokens: PROMPT - hit,
                    num_new_computed_tokens: hit,
                    num_prompt_tokens: PROMPT,
                    num_tokens: PROMPT,
                    shared_prefix_boundary: SHARED,
                    ..Default::default()
                };
                a.allocate_slots(h, &args, NewComputed::Stored, None).unwrap().expect("pool large enough");
                hits += hit;
            }
            hits
        };
        // Between iterations (not timed): free the 16 requests and clear the prefix cache, so
        // each burst starts from an empty cache in a warm pool.
        let mut handles: Vec<ReqHandle> = Vec::new();
        let reset = |a: &mut Allocator, handles: &mut Vec<ReqHandle>| {
            for h in handles.drain(..) {
                a.free(h, LEVEL_NORMAL).unwrap();
            }
            assert!(a.reset_prefix_cache());
        };
        assert_eq!(
            admit(&mut a, &mut handles),
            (N as u32 - 1) * SHARED,
            "{name}: every request after the first hits the prefix"
        );
        reset(&mut a, &mut handles);
        g.throughput(Throughput::Elements(N));
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    black_box(admit(&mut a, &mut handles));
                    total += t.elapsed();
                    reset(&mut a, &mut handles);
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_secs(1));
    targets = bench_pool, bench_admission_pool, bench_find, bench_decode, bench_scheduler_step, bench_free, bench_prefill_burst
}
criterion_main!(benches);
