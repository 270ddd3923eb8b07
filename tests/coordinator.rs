//! Deterministic integration tests of the coordinator, one scenario each: cache hits for
//! full attention, sliding window and chunked local attention and their hybrids, positional
//! tables with null blocks after recycling, `None` on a pool too small, the free-queue order,
//! events, and bad inputs that must fail without changing anything.

mod common;

use common::{chain_hashes, groups, hash_bytes};
use hybrid_alloc::invariants;
use hybrid_alloc::policy::LEVEL_NORMAL;
use hybrid_alloc::{
    AllocateArgs, Allocator, AttentionKind, BlockHash, BlockId, Config, Error, Event, GroupId, NewComputed, Policy,
    ReqHandle, NULL_BLOCK,
};

const BS: u32 = 16;

fn full() -> AttentionKind {
    AttentionKind::Full
}

fn swa(window: u32) -> AttentionKind {
    AttentionKind::SlidingWindow { window, extra_retained_tokens: 0 }
}

fn chunked(chunk: u32) -> AttentionKind {
    AttentionKind::ChunkedLocal { chunk }
}

/// A config with block size 16 everywhere, caching on, events off, no watermark.
fn config(kinds: &[AttentionKind], num_blocks: u32) -> Config {
    Config { max_model_len: 8192, max_in_flight_tokens: 8192, ..common::config(num_blocks, groups(kinds, BS), BS) }
}

fn alloc(cfg: Config) -> Allocator {
    Allocator::new(cfg, Policy::Exact).expect("valid config")
}

/// Chained hashes of the full blocks of a request whose blocks have these contents.
fn chain(contents: &[u64], num_tokens: u32) -> Vec<BlockHash> {
    chain_hashes(contents, num_tokens / BS)
}

/// A new request of `num_tokens` tokens whose blocks have these contents.
fn add(a: &mut Allocator, contents: &[u64], num_tokens: u32) -> ReqHandle {
    let h = a.add_request();
    a.append_hashes(h, &hash_bytes(&chain(contents, num_tokens)), 8).unwrap();
    h
}

fn args(num_new: u32, computed: u32, prompt: u32, num_tokens: u32) -> AllocateArgs {
    AllocateArgs {
        num_new_tokens: num_new,
        num_computed_tokens: computed,
        num_prompt_tokens: prompt,
        num_tokens,
        ..Default::default()
    }
}

/// Schedules the whole prompt of a new request, without looking for a hit.
fn prefill(a: &mut Allocator, h: ReqHandle, num_tokens: u32) -> Option<u32> {
    a.allocate_slots(h, &args(num_tokens, 0, num_tokens, num_tokens), NewComputed::Empty, None).unwrap()
}

/// `get_computed_blocks` then `allocate_slots` for the whole prompt, as the scheduler does.
fn admit(a: &mut Allocator, h: ReqHandle, num_tokens: u32) -> (u32, Option<u32>) {
    let hit = a.find_longest_cache_hit(h, num_tokens - 1).unwrap().num_tokens;
    let mut x = args(num_tokens - hit, 0, num_tokens, num_tokens);
    x.num_new_computed_tokens = hit;
    (hit, a.allocate_slots(h, &x, NewComputed::Stored, None).unwrap())
}

fn table(a: &Allocator, h: ReqHandle, g: usize) -> Vec<BlockId> {
    a.blocks(h, g).unwrap().to_vec()
}

fn ok(a: &Allocator) {
    invariants::check(a).unwrap();
}

// ---- full attention -------------------------------------------------------------------

#[test]
fn find_longest_cache_hit_full_after_cache_blocks_hits_cached_prefix() {
    let mut a = alloc(config(&[full()], 64));
    let contents = [1, 2, 3, 4, 5];
    let r1 = add(&mut a, &contents, 65);
    assert_eq!(prefill(&mut a, r1, 65), Some(5));
    let t1 = table(&a, r1, 0);
    assert_eq!(a.managers()[0].num_cached(r1 as u32), 4);

    // Same 65 tokens: the 4 full blocks hit (the limit is num_tokens - 1 = 64).
    let r2 = add(&mut a, &contents, 65);
    let hit = a.find_longest_cache_hit(r2, 64).unwrap();
    assert_eq!(hit.num_tokens, 64);
    assert_eq!(hit.num_uncached_common_prefix_tokens, 0);
    assert_eq!(a.stored_hit(r2, 0).unwrap(), &t1[..4]);
    let free = a.num_free_blocks();
    let mut x = args(1, 0, 65, 65);
    x.num_new_computed_tokens = 64;
    assert_eq!(a.allocate_slots(r2, &x, NewComputed::Stored, None).unwrap(), Some(1));
    let t2 = table(&a, r2, 0);
    assert_eq!(&t2[..4], &t1[..4]);
    assert_ne!(t2[4], t1[4]);
    assert_eq!(a.num_free_blocks(), free - 1, "shared blocks were in use: only the tail is new");
    for &b in &t1[..4] {
        assert_eq!(a.pool().ref_cnt(b), 2);
    }
    assert!(a.stored_hit(r2, 0).unwrap().is_empty(), "a used hit is cleared");

    // Exactly 64 tokens: the last block cannot hit (limit 63).
    let r3 = add(&mut a, &contents, 64);
    assert_eq!(a.find_longest_cache_hit(r3, 63).unwrap().num_tokens, 48);
    // A different second block: only the first block hits.
    let r4 = add(&mut a, &[1, 9, 3, 4, 5], 65);
    assert_eq!(a.find_longest_cache_hit(r4, 64).unwrap().num_tokens, 16);
    ok(&a);
}

#[test]
fn find_longest_cache_hit_after_free_takes_blocks_from_free_queue() {
    let mut a = alloc(config(&[full()], 16));
    let contents = [1, 2, 3];
    let r1 = add(&mut a, &contents, 40);
    prefill(&mut a, r1, 40);
    let t1 = table(&a, r1, 0);
    a.free(r1, LEVEL_NORMAL).unwrap();
    assert_eq!(a.num_free_blocks(), 15);
    let r2 = add(&mut a, &contents, 40);
    let (hit, res) = admit(&mut a, r2, 40);
    assert_eq!((hit, res), (32, Some(1)));
    assert_eq!(&table(&a, r2, 0)[..2], &t1[..2]);
    assert_eq!(a.num_free_blocks(), 12, "two hit blocks left the free queue, one block is new");
    ok(&a);
}

#[test]
fn free_puts_unhashed_tail_first_and_hashed_blocks_last_in_lru_order() {
    let mut a = alloc(config(&[full()], 8));
    let r = add(&mut a, &[1, 2, 3], 40);
    prefill(&mut a, r, 40);
    assert_eq!(table(&a, r, 0), vec![1, 2, 3]);
    a.free(r, LEVEL_NORMAL).unwrap();
    // Block 3 (partial, unhashed) is reused first; hashed 2 then 1 (tail first) go last.
    assert_eq!(a.pool().free_queue_order(), vec![3, 4, 5, 6, 7, 2, 1]);
    ok(&a);
}

// ---- sliding window -------------------------------------------------------------------

#[test]
fn remove_skipped_blocks_sliding_window_frees_exactly_out_of_window_blocks() {
    let mut cfg = config(&[swa(32)], 16);
    cfg.enable_caching = false;
    let mut a = alloc(cfg);
    let r = add(&mut a, &[], 128);
    assert_eq!(prefill(&mut a, r, 128), Some(8));
    let t = table(&a, r, 0);
    let free = a.num_free_blocks();
    // The next token (128) sees tokens 97..=128: blocks 0..6 (tokens 0..96) are out.
    a.remove_skipped_blocks(r, 128, None).unwrap();
    let after = table(&a, r, 0);
    assert_eq!(&after[..6], &[NULL_BLOCK; 6]);
    assert_eq!(&after[6..], &t[6..]);
    assert_eq!(a.num_free_blocks(), free + 6);
    // Freed tail first, to the front (unhashed): block 5 is reused first.
    let q = a.pool().free_queue_order();
    assert_eq!(&q[..6], &[t[5], t[4], t[3], t[2], t[1], t[0]]);
    ok(&a);
    // Idempotent; block 6 (tokens 96..112) falls out once 143 tokens are computed.
    a.remove_skipped_blocks(r, 128, None).unwrap();
    a.remove_skipped_blocks(r, 142, None).unwrap();
    assert_eq!(table(&a, r, 0), after);
    a.remove_skipped_blocks(r, 143, None).unwrap();
    assert_eq!(table(&a, r, 0)[6], NULL_BLOCK);
    assert_eq!(table(&a, r, 0)[7], t[7]);
    ok(&a);
}

#[test]
fn allocate_slots_sliding_window_decode_keeps_table_positional() {
    let mut a = alloc(config(&[swa(32)], 12));
    let r = add(&mut a, &[1, 2], 20);
    prefill(&mut a, r, 20);
    let mut computed = 20;
    while computed < 400 {
        let res = a.allocate_slots(r, &args(1, computed, 20, computed + 1), NewComputed::Empty, None).unwrap();
        assert!(res.is_some(), "a sliding window decode never runs out at token {computed}");
        computed += 1;
        let t = table(&a, r, 0);
        assert_eq!(t.len() as u32, computed.div_ceil(BS), "positional table");
        let live = t.iter().filter(|&&b| b != NULL_BLOCK).count();
        assert!(live <= 4, "window 32 holds at most 4 blocks, got {t:?}");
        let first_live = t.iter().position(|&b| b != NULL_BLOCK).unwrap();
        assert!(t[first_live..].iter().all(|&b| b != NULL_BLOCK), "nulls form a prefix: {t:?}");
        ok(&a);
    }
}

#[test]
fn find_longest_cache_hit_hybrid_full_swa_is_min_and_swa_starts_with_nulls() {
    let mut a = alloc(config(&[full(), swa(32)], 64));
    let contents: Vec<u64> = (1..=11).collect();
    let r1 = add(&mut a, &contents, 161);
    prefill(&mut a, r1, 161);
    let (f1, s1) = (table(&a, r1, 0), table(&a, r1, 1));
    a.free(r1, LEVEL_NORMAL).unwrap();

    let r2 = add(&mut a, &contents, 161);
    let hit = a.find_longest_cache_hit(r2, 160).unwrap();
    assert_eq!((hit.num_tokens, hit.num_uncached_common_prefix_tokens), (160, 0));
    assert_eq!(a.stored_hit(r2, 0).unwrap(), &f1[..10]);
    let mut swa_hit = vec![NULL_BLOCK; 8];
    swa_hit.extend_from_slice(&s1[8..10]);
    assert_eq!(a.stored_hit(r2, 1).unwrap(), &swa_hit[..], "window 32 needs the last 2 blocks only");

    // Drop the SWA block 9: SWA now hits at 144 (blocks 7, 8), and so does the hybrid.
    a.evict_blocks(&[s1[9]]).unwrap();
    let hit = a.find_longest_cache_hit(r2, 160).unwrap();
    assert_eq!((hit.num_tokens, hit.num_uncached_common_prefix_tokens), (144, 16));
    assert_eq!(a.stored_hit(r2, 0).unwrap(), &f1[..9], "full attention is cut to the hybrid hit");
    let mut swa_hit = vec![NULL_BLOCK; 7];
    swa_hit.extend_from_slice(&s1[7..9]);
    assert_eq!(a.stored_hit(r2, 1).unwrap(), &swa_hit[..]);

    let mut x = args(17, 0, 161, 161);
    x.num_new_computed_tokens = 144;
    assert_eq!(a.allocate_slots(r2, &x, NewComputed::Stored, None).unwrap(), Some(4));
    // 144 computed: tokens 0..113 are out of the window, so blocks 0..7 are null.
    let t = table(&a, r2, 1);
    assert_eq!(&t[..7], &[NULL_BLOCK; 7]);
    assert_eq!(&t[7..9], &s1[7..9]);
    assert_eq!(t.len(), 11);
    assert_eq!(&table(&a, r2, 0)[..9], &f1[..9]);
    ok(&a);
}

#[test]
fn swa_bounded_replay_takes_no_hit_caches_nothing_and_starts_with_nulls() {
    // DeepSeek-V4.1: full attention + a sliding window kept out of prefix caching.
    let replay = AttentionKind::SlidingWindowReplay { window: 32, extra_retained_tokens: 0 };
    let mut a = alloc(Config { enable_events: true, ..config(&[full(), replay], 64) });
    let contents: Vec<u64> = (1..=11).collect();
    let r1 = add(&mut a, &contents, 161);
    prefill(&mut a, r1, 161);
    let f1 = table(&a, r1, 0);
    assert_eq!(table(&a, r1, 1).len(), 11);
    a.free(r1, LEVEL_NORMAL).unwrap();
    // Only full attention's blocks were stored (one event per stored run, its group's blocks).
    let stored: usize = a
        .take_events()
        .iter()
        .map(|e| match e {
            Event::Stored { group, hashes, .. } => {
                assert_eq!(*group, 0, "a stored event of the replay window");
                hashes.len()
            }
            _ => 0,
        })
        .sum();
    assert_eq!(stored, 10, "the replay window caches nothing");

    // The hit is full attention's alone; the window's group takes none, however long.
    let r2 = add(&mut a, &contents, 161);
    let hit = a.find_longest_cache_hit(r2, 160).unwrap();
    assert_eq!(hit.num_tokens, 160);
    assert_eq!(a.stored_hit(r2, 0).unwrap(), &f1[..10]);
    assert!(a.stored_hit(r2, 1).unwrap().is_empty());
    let mut x = args(1, 0, 161, 161);
    x.num_new_computed_tokens = 160;
    // New blocks: full attention's for token 160, and the window's three (tokens 128..160,
    // recomputed by the replay, and the new token's), none from the hit.
    assert_eq!(a.allocate_slots(r2, &x, NewComputed::Stored, None).unwrap(), Some(1 + 3));
    let t = table(&a, r2, 1);
    assert_eq!(&t[..8], &[NULL_BLOCK; 8], "the blocks before the window are null");
    assert!(t[8..].iter().all(|&b| b != NULL_BLOCK && !f1.contains(&b)));
    assert_eq!(t.len(), 11);
    ok(&a);
}

#[test]
fn cache_blocks_swa_retention_zero_caches_only_replay_tail() {
    let mut cfg = config(&[full(), swa(32)], 64);
    cfg.retention_interval = Some(0);
    cfg.enable_events = true;
    let mut a = alloc(cfg);
    let contents: Vec<u64> = (1..=11).collect();
    let r = add(&mut a, &contents, 161);
    prefill(&mut a, r, 161);
    let hashes = chain(&contents, 161);
    let ev = a.take_events();
    assert_eq!(ev.len(), 2);
    assert_eq!(
        ev[1],
        Event::Stored {
            req: r,
            group: 1,
            block_size: BS,
            start_token: 0,
            end_token: 160,
            parent: None,
            hashes: hashes[8..10].to_vec(),
            block_indices: vec![8, 9],
        },
        "the prompt boundary 160 is reachable from blocks 8 and 9 only"
    );
    let s = table(&a, r, 1);
    assert!(s[..8].iter().all(|&b| a.pool().block_hash(b).is_none()));
    assert!(s[8..10].iter().all(|&b| a.pool().block_hash(b).is_some()));
    ok(&a);
}

// ---- a full-attention block over the hash block (partial-block prefix entries) ------------

/// Full attention of block 32 beside a sliding window of 16: hash block 16, scheduler block 32.
fn wide_full_config() -> Config {
    let g = vec![
        hybrid_alloc::GroupSpec { kind: full(), block_size: 32, spec_key: 0 },
        hybrid_alloc::GroupSpec { kind: swa(64), block_size: BS, spec_key: 1 },
    ];
    Config {
        max_model_len: 8192,
        max_in_flight_tokens: 8192,
        scheduler_block_size: 32,
        enable_events: true,
        ..common::config(64, g, BS)
    }
}

#[test]
fn cache_blocks_full_block_over_hash_block_keys_prompt_tail_inside_its_block() {
    let cfg = wide_full_config();
    assert!(cfg.partial_block_entries() && !cfg.partial_hash_hits());
    let mut a = alloc(cfg);
    let contents: Vec<u64> = (1..=4).collect();
    let hashes = chain(&contents, 64);
    // A 50-token prompt: its last hash boundary a resend could hit is 48, inside block 1.
    let r = add(&mut a, &contents, 48);
    prefill(&mut a, r, 50);
    let is_tail = |e: &Event| matches!(e, Event::Stored { group: 0, hashes: h, .. } if h == &[hashes[2]]);
    assert!(!a.take_events().iter().any(is_tail), "the cache target (32) is below the boundary");
    // Decode to 64 tokens: block 1 is full and keyed, then keyed at 48 as well.
    a.append_hashes(r, &hash_bytes(&hashes[3..4]), 8).unwrap();
    let x = args(14, 50, 50, 64);
    assert_eq!(a.allocate_slots(r, &x, NewComputed::Empty, None).unwrap(), Some(0));
    let ev = a.take_events();
    assert_eq!(ev.iter().filter(|e| is_tail(e)).count(), 1, "{ev:?}");
    ok(&a);
}

#[test]
fn new_full_block_over_hash_block_single_group_or_rswa_is_refused() {
    let mut one = wide_full_config();
    one.groups.truncate(1);
    // vLLM's unitary coordinator asserts hash_block_size == block_size with caching on.
    assert!(matches!(Allocator::new(one, Policy::Exact), Err(Error::Unsupported(m)) if m.contains("partial-block")));
    let mut rswa = wide_full_config();
    rswa.groups[0].kind = AttentionKind::Rswa { window: 128 };
    assert!(matches!(Allocator::new(rswa, Policy::Exact), Err(Error::Unsupported(m)) if m.contains("partial-block")));
}

// ---- chunked local attention ----------------------------------------------------------

#[test]
fn remove_skipped_blocks_chunked_local_frees_previous_chunks() {
    let mut a = alloc(config(&[chunked(64)], 32));
    let r = add(&mut a, &[], 100);
    assert_eq!(prefill(&mut a, r, 100), Some(7));
    let t = table(&a, r, 0);
    a.remove_skipped_blocks(r, 100, None).unwrap();
    let after = table(&a, r, 0);
    assert_eq!(&after[..4], &[NULL_BLOCK; 4], "chunk 0 (tokens 0..64) is done");
    assert_eq!(&after[4..], &t[4..]);
    a.remove_skipped_blocks(r, 127, None).unwrap();
    assert_eq!(table(&a, r, 0), after, "still inside chunk 1");
    ok(&a);
}

#[test]
fn find_longest_cache_hit_full_chunked_hit_starts_at_chunk_boundary() {
    let mut a = alloc(config(&[full(), chunked(64)], 64));
    let contents: Vec<u64> = (1..=7).collect();
    let r1 = add(&mut a, &contents, 100);
    prefill(&mut a, r1, 100);
    let c1 = table(&a, r1, 1);
    a.free(r1, LEVEL_NORMAL).unwrap();
    let r2 = add(&mut a, &contents, 100);
    let hit = a.find_longest_cache_hit(r2, 99).unwrap();
    assert_eq!(hit.num_tokens, 96);
    let mut expect = vec![NULL_BLOCK; 4];
    expect.extend_from_slice(&c1[4..6]);
    assert_eq!(a.stored_hit(r2, 1).unwrap(), &expect[..], "chunk 1 starts at block 4");
    assert_eq!(a.stored_hit(r2, 0).unwrap().len(), 6);
    ok(&a);
}

// ---- pressure -------------------------------------------------------------------------

#[test]
fn allocate_slots_pool_too_small_returns_none_without_changing_tables() {
    let mut a = alloc(config(&[full()], 8));
    let r1 = add(&mut a, &[1, 2, 3, 4], 64);
    assert_eq!(prefill(&mut a, r1, 64), Some(4));
    let t1 = table(&a, r1, 0);
    let q = a.pool().free_queue_order();
    // A second request of 4 blocks does not fit in the 3 left.
    let r2 = add(&mut a, &[5, 6, 7, 8], 64);
    assert_eq!(prefill(&mut a, r2, 64), None);
    assert!(table(&a, r2, 0).is_empty());
    // Neither does a 64-token chunk of the first.
    assert_eq!(a.allocate_slots(r1, &args(64, 64, 64, 128), NewComputed::Empty, None).unwrap(), None);
    assert_eq!(table(&a, r1, 0), t1);
    assert_eq!(a.pool().free_queue_order(), q);
    ok(&a);
}

#[test]
fn allocate_slots_none_still_frees_out_of_window_blocks() {
    let mut cfg = config(&[swa(32)], 10);
    cfg.enable_caching = false;
    let mut a = alloc(cfg);
    let r = add(&mut a, &[], 128);
    assert_eq!(prefill(&mut a, r, 128), Some(8));
    assert_eq!(a.num_free_blocks(), 1);
    // 200 more tokens need 13 blocks: recycling 6 is not enough, but happens anyway.
    assert_eq!(a.allocate_slots(r, &args(200, 128, 128, 328), NewComputed::Empty, None).unwrap(), None);
    let t = table(&a, r, 0);
    assert_eq!(t.len(), 8);
    assert_eq!(&t[..6], &[NULL_BLOCK; 6]);
    assert_eq!(a.num_free_blocks(), 7);
    ok(&a);
}

#[test]
fn allocate_slots_full_sequence_must_fit_uses_sliding_window_admission_cap() {
    // Window 32, 64 tokens in flight: a request never holds more than 7 blocks.
    let mut cfg = config(&[swa(32)], 10);
    cfg.max_in_flight_tokens = 64;
    let mut a = alloc(cfg.clone());
    let r = add(&mut a, &[], 1000);
    let mut x = args(64, 0, 1000, 1000);
    x.full_sequence_must_fit = true;
    assert_eq!(a.allocate_slots(r, &x, NewComputed::Empty, None).unwrap(), Some(4));
    // The same request with full attention would need all 63 blocks.
    cfg.groups[0].kind = full();
    let mut b = alloc(cfg);
    let r = add(&mut b, &[], 1000);
    assert_eq!(b.allocate_slots(r, &x, NewComputed::Empty, None).unwrap(), None);
    ok(&a);
    ok(&b);
}

#[test]
fn allocate_slots_watermark_and_reserved_blocks_refuse_admission() {
    let mut cfg = config(&[full()], 8);
    cfg.watermark_blocks = 3;
    let mut a = alloc(cfg);
    let r = add(&mut a, &[], 80);
    let mut x = args(80, 0, 80, 80);
    x.apply_watermark = true;
    assert_eq!(a.allocate_slots(r, &x, NewComputed::Empty, None).unwrap(), None, "5 + watermark 3 > 7");
    x.apply_watermark = false;
    x.reserved_blocks = 3;
    assert_eq!(a.allocate_slots(r, &x, NewComputed::Empty, None).unwrap(), None, "5 > 7 - 3 reserved");
    x.reserved_blocks = 2;
    assert_eq!(a.allocate_slots(r, &x, NewComputed::Empty, None).unwrap(), Some(5));
    ok(&a);
}

// ---- pop / free / reset -----------------------------------------------------------------

#[test]
fn pop_blocks_for_free_then_free_block_ids_restores_pool() {
    let mut a = alloc(config(&[full(), swa(32)], 32));
    let r = add(&mut a, &[1, 2, 3], 40);
    prefill(&mut a, r, 40);
    let expect = [table(&a, r, 0), table(&a, r, 1)].concat();
    let mut out = Vec::new();
    a.pop_blocks_for_free(r, &mut out).unwrap();
    assert_eq!(out, expect);
    assert!(!a.is_live(r));
    assert_eq!(a.num_free_blocks(), 31 - 6, "popped blocks are not free yet");
    invariants::check(&a).unwrap();
    assert!(out.iter().all(|&b| a.pool().loose_refs(b) == 1), "each popped block holds one loose reference");
    a.free_block_ids(&out).unwrap();
    assert_eq!(a.num_free_blocks(), 31);
    ok(&a);
}

#[test]
fn reset_prefix_cache_refused_while_blocks_in_use() {
    let mut cfg = config(&[full()], 8);
    cfg.enable_events = true;
    let mut a = alloc(cfg);
    let r = add(&mut a, &[1, 2], 32);
    prefill(&mut a, r, 32);
    a.take_events();
    assert!(!a.reset_prefix_cache());
    assert!(!a.has_events());
    a.free(r, LEVEL_NORMAL).unwrap();
    assert!(a.reset_prefix_cache());
    assert_eq!(a.take_events(), vec![Event::AllCleared]);
    assert!((1..8).all(|b| a.pool().block_hash(b).is_none()));
    let r = add(&mut a, &[1, 2], 32);
    assert_eq!(a.find_longest_cache_hit(r, 31).unwrap().num_tokens, 0);
    ok(&a);
}

// ---- events ---------------------------------------------------------------------------

#[test]
fn events_stored_removed_all_cleared_carry_blocks_hashes_and_order() {
    let mut cfg = config(&[full()], 6);
    cfg.enable_events = true;
    let mut a = alloc(cfg);
    let contents = [1, 2, 3];
    let h = chain(&contents, 48);
    let r = add(&mut a, &contents, 40);
    prefill(&mut a, r, 40);
    assert_eq!(
        a.take_events(),
        vec![Event::Stored {
            req: r,
            group: 0,
            block_size: BS,
            start_token: 0,
            end_token: 32,
            parent: None,
            hashes: h[..2].to_vec(),
            block_indices: vec![0, 1],
        }]
    );
    // Decode to 48 tokens: block 2 becomes full, its parent is block 1.
    a.append_hashes(r, h[2].as_bytes(), 8).unwrap();
    assert_eq!(a.allocate_slots(r, &args(8, 40, 40, 48), NewComputed::Empty, None).unwrap(), Some(0));
    assert_eq!(
        a.take_events(),
        vec![Event::Stored {
            req: r,
            group: 0,
            block_size: BS,
            start_token: 32,
            end_token: 48,
            parent: Some(h[1]),
            hashes: vec![h[2]],
            block_indices: vec![2],
        }]
    );
    // Freed tail first: the queue is [4, 5, 3, 2, 1]; a 5-block request evicts 3, 2, 1.
    a.free(r, LEVEL_NORMAL).unwrap();
    assert!(!a.has_events());
    let r2 = add(&mut a, &[], 80);
    assert_eq!(prefill(&mut a, r2, 80), Some(5));
    assert_eq!(table(&a, r2, 0), vec![4, 5, 3, 2, 1]);
    assert_eq!(
        a.take_events(),
        vec![
            Event::Removed { hash: h[2], group: 0 },
            Event::Removed { hash: h[1], group: 0 },
            Event::Removed { hash: h[0], group: 0 },
        ],
        "no Stored: this request sent no hashes"
    );
    a.free(r2, LEVEL_NORMAL).unwrap();
    assert!(a.reset_prefix_cache());
    assert_eq!(a.take_events(), vec![Event::AllCleared]);
    ok(&a);
}

#[test]
fn events_evict_blocks_emits_removed_once() {
    let mut cfg = config(&[full()], 6);
    cfg.enable_events = true;
    let mut a = alloc(cfg);
    let contents = [1, 2];
    let h = chain(&contents, 32);
    let r = add(&mut a, &contents, 33);
    prefill(&mut a, r, 33);
    a.take_events();
    let t = table(&a, r, 0);
    a.evict_blocks(&[t[1], t[1], t[2], NULL_BLOCK]).unwrap();
    assert_eq!(a.take_events(), vec![Event::Removed { hash: h[1], group: 0 }]);
    assert_eq!(a.pool().ref_cnt(t[1]), 1, "an evicted block in use stays allocated");
    ok(&a);
}

// ---- bad inputs -----------------------------------------------------------------------

/// The state observable from outside, to show a failed call changed nothing.
#[derive(Debug, PartialEq)]
struct State {
    queue: Vec<BlockId>,
    ref_cnt: Vec<u32>,
    /// Per block, the key it is cached under in the prefix index (`None`: not cached).
    keys: Vec<Option<(BlockHash, GroupId)>>,
    /// Per live request, per group.
    tables: Vec<Vec<Vec<BlockId>>>,
    /// Per live request, per group: the blocks counted as cached.
    num_cached: Vec<Vec<u32>>,
    /// Per live request: its block hashes and, per group, its stored hit.
    hashes: Vec<Vec<BlockHash>>,
    stored_hits: Vec<Vec<Vec<BlockId>>>,
}

fn state(a: &Allocator) -> State {
    let p = a.pool();
    let n = p.num_blocks();
    let groups = 0..a.num_groups();
    State {
        queue: p.free_queue_order(),
        ref_cnt: (0..n).map(|b| p.ref_cnt(b)).collect(),
        keys: (0..n).map(|b| p.block_hash(b).copied()).collect(),
        tables: a.live_handles().map(|h| groups.clone().map(|g| table(a, h, g)).collect()).collect(),
        num_cached: a.live_handles().map(|h| a.managers().iter().map(|m| m.num_cached(h as u32)).collect()).collect(),
        hashes: a.live_handles().map(|h| a.hashes(h).unwrap().to_vec()).collect(),
        stored_hits: a
            .live_handles()
            .map(|h| groups.clone().map(|g| a.stored_hit(h, g).unwrap().to_vec()).collect())
            .collect(),
    }
}

#[test]
fn bad_inputs_return_errors_and_change_nothing() {
    let mut a = alloc(config(&[full(), swa(32)], 32));
    let r = add(&mut a, &[1, 2, 3], 40);
    prefill(&mut a, r, 40);
    let gone = add(&mut a, &[1], 16);
    a.free(gone, LEVEL_NORMAL).unwrap();
    let s = state(&a);
    assert_eq!(a.free(gone, LEVEL_NORMAL), Err(Error::UnknownRequest(gone)), "double free");
    assert!(matches!(
        a.allocate_slots(99, &args(1, 0, 1, 1), NewComputed::Empty, None),
        Err(Error::UnknownRequest(99))
    ));
    assert!(matches!(
        a.allocate_slots(r, &AllocateArgs::default(), NewComputed::Empty, None),
        Err(Error::OutOfRange(_))
    ));
    assert!(matches!(a.evict_blocks(&[1, 32]), Err(Error::InvalidBlock(_))));
    assert!(matches!(a.free_block_ids(&[2, 40]), Err(Error::InvalidBlock(_))));
    let b = table(&a, r, 0)[0];
    assert!(matches!(a.free_block_ids(&[b, b]), Err(Error::InvalidBlock(_))), "one reference, two frees");
    assert!(matches!(a.free_block_ids(&[31]), Err(Error::InvalidBlock(_))), "a free block");
    assert!(matches!(a.append_hashes(r, &[0; 10], 8), Err(Error::OutOfRange(_))));
    assert!(matches!(a.append_hashes(r, &[0; 66], 33), Err(Error::OutOfRange(_))));
    let wrong_groups = vec![vec![1]];
    assert!(a.allocate_slots(r, &args(1, 40, 40, 41), NewComputed::Explicit(&wrong_groups), None).is_err());
    let out_of_range = vec![vec![32], vec![]];
    let w = add(&mut a, &[], 20);
    let s2 = state(&a);
    assert!(matches!(
        a.allocate_slots(w, &args(1, 0, 20, 20), NewComputed::Explicit(&out_of_range), None),
        Err(Error::InvalidBlock(_))
    ));
    assert_eq!(state(&a), s2);
    a.free(w, LEVEL_NORMAL).unwrap();
    assert_eq!(state(&a), s);
    ok(&a);
}

/// Issue 28 item 7: a sliding-window hit one block shorter than `num_new_computed_tokens`
/// (full + sliding window, no Mamba, no external tokens) was adopted: the fresh block after
/// it was cached under the request's hash for a position it never wrote, to serve a wrong
/// hit once the real block was evicted. Refused again, with nothing changed.
#[test]
fn allocate_slots_short_sliding_window_hit_errs_unchanged() {
    let mut a = alloc(config(&[full(), swa(32)], 32));
    let s1 = add(&mut a, &[1, 2, 3], 40);
    assert_eq!(prefill(&mut a, s1, 40), Some(6));
    assert_eq!((table(&a, s1, 0), table(&a, s1, 1)), (vec![1, 2, 3], vec![4, 5, 6]));
    let s2 = add(&mut a, &[1, 2, 3], 40);
    let hit = a.find_longest_cache_hit(s2, 39).unwrap();
    assert_eq!((hit.num_tokens, hit.num_uncached_common_prefix_tokens), (32, 0));
    assert_eq!((a.stored_hit(s2, 0).unwrap(), a.stored_hit(s2, 1).unwrap()), (&[1, 2][..], &[4, 5][..]));
    let before = state(&a);
    let free = a.num_free_blocks();
    let short = vec![vec![1, 2], vec![4]];
    let mut x = args(8, 0, 40, 40);
    x.num_new_computed_tokens = 32;
    let e = a.allocate_slots(s2, &x, NewComputed::Explicit(&short), None).unwrap_err();
    assert!(matches!(e, Error::OutOfRange(_)), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("group 1: a hit of 1 blocks of 16 tokens for num_new_computed_tokens=32"), "{msg}");
    assert_eq!(state(&a), before);
    assert_eq!(a.num_free_blocks(), free);
    assert!(table(&a, s2, 0).is_empty() && table(&a, s2, 1).is_empty());
    ok(&a);
    // External tokens do not make it a connector's per-group hit: there is no Mamba group.
    x.num_external_computed_tokens = 4;
    x.num_new_tokens = 4;
    assert!(matches!(a.allocate_slots(s2, &x, NewComputed::Explicit(&short), None), Err(Error::OutOfRange(_))));
    assert_eq!(state(&a), before);
    // One block too many is refused too; the right hit is adopted.
    let long = vec![vec![1, 2], vec![4, 5, 6]];
    x.num_external_computed_tokens = 0;
    x.num_new_tokens = 8;
    assert!(matches!(a.allocate_slots(s2, &x, NewComputed::Explicit(&long), None), Err(Error::OutOfRange(_))));
    assert_eq!(state(&a), before);
    assert_eq!(a.allocate_slots(s2, &x, NewComputed::Stored, None).unwrap(), Some(2));
    assert_eq!(&table(&a, s2, 1)[..2], &[4, 5]);
    assert_eq!((a.pool().ref_cnt(4), a.pool().ref_cnt(5)), (2, 2));
    ok(&a);
}

#[test]
fn allocate_slots_running_request_adopting_hit_errs_unchanged() {
    let mut a = alloc(config(&[full()], 32));
    let r1 = add(&mut a, &[1, 2, 3], 48);
    prefill(&mut a, r1, 48);
    let r2 = add(&mut a, &[1, 2, 3], 48);
    prefill(&mut a, r2, 48);
    assert!(a.managers()[0].is_tracked(r2 as u32));
    let hit = a.find_longest_cache_hit(r2, 47).unwrap();
    assert_eq!(hit.num_tokens, 32);
    let s = state(&a);
    let mut x = args(1, 48, 48, 49);
    x.num_new_computed_tokens = 32;
    assert!(matches!(a.allocate_slots(r2, &x, NewComputed::Stored, None), Err(Error::InvalidState(_))));
    assert_eq!(state(&a), s);
    assert_eq!(a.stored_hit(r2, 0).unwrap().len(), 2, "a refused hit stays stored");
    ok(&a);
}

#[test]
fn allocate_slots_hit_for_request_holding_uncached_blocks_errs_unchanged() {
    // r2 ran a 10-token chunk: it holds a block but has cached no full block yet, so it is
    // not "tracked". Adopting a hit now would put hit blocks after the block it holds.
    let mut a = alloc(config(&[full(), swa(32)], 32));
    let r1 = add(&mut a, &[1, 2, 3], 48);
    prefill(&mut a, r1, 48);
    let r2 = add(&mut a, &[1, 2, 3], 48);
    assert_eq!(a.allocate_slots(r2, &args(10, 0, 48, 48), NewComputed::Empty, None).unwrap(), Some(2));
    assert!(!a.managers()[0].is_tracked(r2 as u32));
    let hit = a.find_longest_cache_hit(r2, 47).unwrap();
    assert_eq!(hit.num_tokens, 32);
    let s = state(&a);
    let mut x = args(16, 0, 48, 48);
    x.num_new_computed_tokens = 32;
    assert!(matches!(a.allocate_slots(r2, &x, NewComputed::Stored, None), Err(Error::InvalidState(_))));
    assert_eq!(state(&a), s);
    assert_eq!(a.stored_hit(r2, 0).unwrap().len(), 2, "a refused hit stays stored");
    let explicit = vec![table(&a, r1, 0)[..2].to_vec(), vec![]];
    assert!(matches!(a.allocate_slots(r2, &x, NewComputed::Explicit(&explicit), None), Err(Error::OutOfRange(_))));
    x.num_new_computed_tokens = 0;
    x.num_external_computed_tokens = 32;
    assert!(matches!(a.allocate_slots(r2, &x, NewComputed::Empty, None), Err(Error::InvalidState(_))));
    assert_eq!(state(&a), s);
    ok(&a);
}

#[test]
fn allocate_slots_explicit_hit_with_caching_off_errs_unchanged() {
    let mut cfg = config(&[full()], 16);
    cfg.enable_caching = false;
    let mut a = alloc(cfg);
    let r1 = add(&mut a, &[], 32);
    prefill(&mut a, r1, 32);
    let r2 = add(&mut a, &[], 48);
    let s = state(&a);
    let explicit = vec![table(&a, r1, 0)];
    let mut x = args(16, 0, 48, 48);
    x.num_new_computed_tokens = 32;
    assert!(matches!(a.allocate_slots(r2, &x, NewComputed::Explicit(&explicit), None), Err(Error::InvalidState(_))));
    assert_eq!(state(&a), s);
    ok(&a);
}

#[test]
fn free_stale_handle_after_slot_reuse_errs_and_keeps_new_owner() {
    let mut a = alloc(config(&[full()], 32));
    let old = add(&mut a, &[1], 16);
    prefill(&mut a, old, 16);
    a.free(old, LEVEL_NORMAL).unwrap();
    let new = add(&mut a, &[2], 16);
    prefill(&mut a, new, 16);
    assert_eq!(old & 0xFFFF_FFFF, new & 0xFFFF_FFFF, "the slot is reused");
    assert_ne!(old, new, "with another generation");
    let s = state(&a);
    assert_eq!(a.free(old, LEVEL_NORMAL), Err(Error::UnknownRequest(old)));
    assert_eq!(state(&a), s);
    assert_eq!(table(&a, new, 0).len(), 1);
    let other = alloc(config(&[full()], 32));
    assert!(!other.is_live(new), "another allocator never knows this handle");
    ok(&a);
}

#[test]
fn set_hashes_rewritten_list_resyncs_from_first_difference() {
    let mut a = alloc(config(&[full()], 32));
    let h = a.add_request();
    let first = chain(&[1, 2, 3, 4], 64);
    a.set_hashes(h, &first).unwrap();
    assert_eq!(a.hashes(h).unwrap(), &first[..]);
    let grown = chain(&[1, 2, 3, 4, 5], 80);
    a.set_hashes(h, &grown).unwrap();
    assert_eq!(a.hashes(h).unwrap(), &grown[..], "grown: the tail appended");
    let rewritten = chain(&[1, 9, 9], 48);
    a.set_hashes(h, &rewritten).unwrap();
    assert_eq!(a.hashes(h).unwrap(), &rewritten[..], "rewritten from block 1 and shorter");
    a.set_hashes(h, &Vec::new()).unwrap();
    assert_eq!(a.num_hashes(h).unwrap(), 0, "cleared");
}

#[test]
fn allocate_slots_error_after_hash_sync_restores_hashes() {
    let mut a = alloc(config(&[full()], 32));
    let h = add(&mut a, &[1, 2], 32);
    let before = a.hashes(h).unwrap().to_vec();
    let longer = chain(&[1, 2, 3], 48);
    let bad_hit = vec![vec![31]];
    let mut x = args(16, 0, 48, 48);
    x.num_new_computed_tokens = 16;
    let res = a.allocate_slots(h, &x, NewComputed::Explicit(&bad_hit), Some(&longer));
    assert!(matches!(res, Err(Error::InvalidBlock(_))), "{res:?}");
    assert_eq!(a.hashes(h).unwrap(), &before[..]);
    ok(&a);
}

#[test]
fn allocate_slots_stored_hit_reused_since_search_errs_unchanged() {
    let mut a = alloc(config(&[full()], 4));
    let r1 = add(&mut a, &[1, 2], 33);
    prefill(&mut a, r1, 33);
    a.free(r1, LEVEL_NORMAL).unwrap();
    let r2 = add(&mut a, &[1, 2], 33);
    assert_eq!(a.find_longest_cache_hit(r2, 32).unwrap().num_tokens, 32);
    let thief = add(&mut a, &[7, 8, 9], 48);
    prefill(&mut a, thief, 48);
    a.free(thief, LEVEL_NORMAL).unwrap();
    let s = state(&a);
    let mut x = args(1, 0, 33, 33);
    x.num_new_computed_tokens = 32;
    assert!(matches!(a.allocate_slots(r2, &x, NewComputed::Stored, None), Err(Error::InvalidBlock(_))));
    assert_eq!(state(&a), s);
    ok(&a);
}

#[test]
fn free_block_ids_block_held_by_table_errs_popped_block_frees() {
    let mut a = alloc(config(&[full()], 32));
    let r = add(&mut a, &[1, 2], 32);
    prefill(&mut a, r, 32);
    let held = table(&a, r, 0)[0];
    let s = state(&a);
    assert!(matches!(a.free_block_ids(&[held]), Err(Error::InvalidBlock(_))));
    assert_eq!(state(&a), s);
    let mut out = Vec::new();
    a.pop_blocks_for_free(r, &mut out).unwrap();
    a.free_block_ids(&out).unwrap();
    assert!(matches!(a.free_block_ids(&out), Err(Error::InvalidBlock(_))), "freed twice");
    ok(&a);
}

#[test]
fn allocate_slots_token_sum_past_u32_errs_and_past_max_model_len_clamps() {
    let mut a = alloc(config(&[full()], 8));
    let h = a.add_request();
    let s = state(&a);
    let huge = AllocateArgs { num_new_tokens: u32::MAX, num_computed_tokens: 1, ..Default::default() };
    assert!(matches!(a.allocate_slots(h, &huge, NewComputed::Empty, None), Err(Error::OutOfRange(_))));
    let clamped = AllocateArgs { num_new_tokens: u32::MAX, num_tokens: u32::MAX, ..Default::default() };
    assert_eq!(a.allocate_slots(h, &clamped, NewComputed::Empty, None), Ok(None), "8192 tokens do not fit 7 blocks");
    assert_eq!(state(&a), s);
}

#[test]
fn new_huge_pool_errs_out_of_memory() {
    let mut cfg = config(&[full()], hybrid_alloc::config::MAX_NUM_BLOCKS);
    assert!(matches!(Allocator::new(cfg.clone(), Policy::Exact), Err(Error::OutOfMemory(_))));
    cfg.enable_caching = false;
    assert!(matches!(Allocator::new(cfg, Policy::Exact), Err(Error::OutOfMemory(_))));
}

// ---- reference sliding window (R-SWA) -------------------------------------------------

fn rswa(window: u32) -> AttentionKind {
    AttentionKind::Rswa { window }
}

/// Decodes `n` tokens of `h` one step at a time (prompt `p`, `computed` tokens so far).
fn decode(a: &mut Allocator, h: ReqHandle, p: u32, computed: &mut u32, n: u32) {
    for _ in 0..n {
        let x = args(1, *computed, p, *computed + 1);
        assert!(a.allocate_slots(h, &x, NewComputed::Empty, None).unwrap().is_some());
        *computed += 1;
        ok(a);
    }
}

#[test]
fn allocate_slots_rswa_frees_the_gap_between_prompt_and_window() {
    let mut cfg = config(&[rswa(32)], 32);
    cfg.enable_caching = false;
    let mut a = alloc(cfg);
    // Prompt of 40 tokens: blocks 0..3, block 2 partial (the prompt's tail stays).
    let r = add(&mut a, &[], 40);
    assert_eq!(prefill(&mut a, r, 40), Some(3));
    let mut computed = 40;
    // Until the window's start (processed - 32) passes block 3, nothing is freed.
    decode(&mut a, r, 40, &mut computed, 56);
    assert!(!table(&a, r, 0).contains(&NULL_BLOCK));
    let t = table(&a, r, 0);
    let free = a.num_free_blocks();
    // processed 96 (window start 64 = block 4): block 3 is the gap.
    decode(&mut a, r, 40, &mut computed, 1);
    let after = table(&a, r, 0);
    assert_eq!(after[3], NULL_BLOCK);
    assert_eq!(&after[..3], &t[..3], "the prompt's blocks stay");
    assert_eq!(&after[4..t.len()], &t[4..]);
    assert_eq!(a.num_free_blocks(), free + 1 - (after.len() - t.len()) as u32);
    // Far on: the gap is 3..(processed - 32) / 16, everything in it null, the rest kept.
    decode(&mut a, r, 40, &mut computed, 100);
    let t = table(&a, r, 0);
    let end = ((computed - 32) / 16) as usize;
    assert!(t[3..end].iter().all(|&b| b == NULL_BLOCK));
    assert!(t[..3].iter().chain(&t[end..]).all(|&b| b != NULL_BLOCK));
    a.free(r, LEVEL_NORMAL).unwrap();
    assert_eq!(a.num_free_blocks(), 31);
    ok(&a);
}

#[test]
fn remove_skipped_blocks_rswa_without_prompt_is_full_attention() {
    let mut cfg = config(&[rswa(16)], 32);
    cfg.enable_caching = false;
    let mut a = alloc(cfg);
    let r = add(&mut a, &[], 200);
    assert_eq!(prefill(&mut a, r, 200), Some(13));
    let t = table(&a, r, 0);
    // vLLM's other callers pass no prompt length: nothing is freed.
    a.remove_skipped_blocks(r, 200, None).unwrap();
    assert_eq!(table(&a, r, 0), t);
    // With a prompt of 20 tokens, blocks 2..(200 - 16) / 16 = 11 form the gap, freed tail
    // first (to the front of the queue: unhashed).
    a.remove_skipped_blocks(r, 200, Some(20)).unwrap();
    let after = table(&a, r, 0);
    assert!(after[2..11].iter().all(|&b| b == NULL_BLOCK));
    assert_eq!(&after[..2], &t[..2]);
    assert_eq!(&after[11..], &t[11..]);
    let q = a.pool().free_queue_order();
    let freed: Vec<BlockId> = t[2..11].iter().rev().copied().collect();
    assert_eq!(&q[..9], &freed[..]);
    ok(&a);
    // A shorter prompt moves the gap's start down to block 1, but the walk back from the
    // gap's end meets a null block at once: nothing more is freed (as in vLLM).
    a.remove_skipped_blocks(r, 200, Some(5)).unwrap();
    assert_eq!(table(&a, r, 0), after);
    ok(&a);
}

#[test]
fn find_longest_cache_hit_rswa_hits_as_full_attention_over_freed_gap_blocks() {
    // R-SWA next to full attention: both full attention in the hybrid search.
    let mut a = alloc(config(&[full(), rswa(16)], 64));
    let contents: Vec<u64> = (1..=12).collect();
    let r1 = add(&mut a, &contents, 192);
    assert_eq!(prefill(&mut a, r1, 32), Some(4));
    let mut computed = 32;
    // Decode to 176 tokens (the last step with 175 processed): the R-SWA gap
    // 2..(175 - 16) / 16 = 9 is freed, its blocks still cached.
    decode(&mut a, r1, 32, &mut computed, 144);
    ok(&a);
    assert!(table(&a, r1, 1)[2..9].iter().all(|&b| b == NULL_BLOCK));
    assert_ne!(table(&a, r1, 1)[9], NULL_BLOCK);
    // The same 176 tokens again: both groups hit 10 full blocks (the freed gap blocks are
    // found in the free queue by their hash).
    let r2 = add(&mut a, &contents, 176);
    let hit = a.find_longest_cache_hit(r2, 175).unwrap();
    assert_eq!(hit.num_tokens, 160);
    assert_eq!(a.stored_hit(r2, 1).unwrap().len(), 10);
    assert!(!a.stored_hit(r2, 1).unwrap().contains(&NULL_BLOCK));
    let mut x = args(16, 0, 176, 176);
    x.num_new_computed_tokens = 160;
    assert!(a.allocate_slots(r2, &x, NewComputed::Stored, None).unwrap().is_some());
    ok(&a);
}

#[test]
fn allocate_slots_computed_ahead_of_table_is_refused_and_changes_nothing() {
    // Issue 15, defect 8a: a 100-token request has computed 16 tokens; a direct-API call
    // then claims 96 computed. Its blocks past the first were never written, so caching
    // them under the request's hashes would give a second request a 96-token hit on them.
    let contents: Vec<u64> = (0..7).collect();
    let mut a = alloc(config(&[full()], 64));
    let r = add(&mut a, &contents, 100);
    a.allocate_slots(r, &args(16, 0, 100, 100), NewComputed::Empty, None).unwrap().unwrap();
    let free = a.num_free_blocks();
    let order = a.pool().free_queue_order();
    let tables = table(&a, r, 0);
    let limits = a.noop_limits(r).unwrap();
    let res = a.allocate_slots(r, &args(1, 96, 100, 100), NewComputed::Empty, None);
    assert!(matches!(&res, Err(Error::InvalidState(m)) if m.contains("num_computed_tokens=96")), "{res:?}");
    assert_eq!(a.num_free_blocks(), free);
    assert_eq!(a.pool().free_queue_order(), order);
    assert_eq!(table(&a, r, 0), tables);
    assert_eq!(a.noop_limits(r).unwrap(), limits);
    ok(&a);
    let second = add(&mut a, &contents, 100);
    assert_eq!(a.find_longest_cache_hit(second, 99).unwrap().num_tokens, 16, "only the written block hits");
    // At the table's edge the count is accepted: 16 computed, the next step.
    a.allocate_slots(r, &args(1, 16, 100, 100), NewComputed::Empty, None).unwrap().unwrap();
    ok(&a);
}

#[test]
fn allocate_slots_computed_ahead_trusted_is_vllm_exact() {
    // The vLLM adapter's path: vLLM's manager takes the Request's count as it comes, and so
    // does the core when told to trust it (the blocks are allocated and cached, as vLLM's).
    let contents: Vec<u64> = (0..7).collect();
    let mut a = alloc(config(&[full()], 64));
    let r = add(&mut a, &contents, 100);
    a.allocate_slots(r, &args(16, 0, 100, 100), NewComputed::Empty, None).unwrap().unwrap();
    let x = AllocateArgs { trust_computed_tokens: true, ..args(1, 96, 100, 100) };
    assert_eq!(a.allocate_slots(r, &x, NewComputed::Empty, None).unwrap(), Some(6));
    let second = add(&mut a, &contents, 100);
    assert_eq!(a.find_longest_cache_hit(second, 99).unwrap().num_tokens, 96);
    ok(&a);
}

/// vLLM 0.34's `get_num_cached_tokens`: the lookup's hit tokens, for a hybrid and a unitary
/// coordinator, with no request and nothing changed (state, requests, events); 0 with
/// prefix caching off.
#[test]
fn num_cached_tokens_is_the_lookups_hit_and_changes_nothing() {
    for kinds in [&[full(), swa(32)][..], &[full()][..], &[full(), chunked(32)][..]] {
        let mut cfg = config(kinds, 32);
        cfg.enable_events = true;
        let mut a = alloc(cfg);
        let s1 = add(&mut a, &[1, 2, 3], 40);
        prefill(&mut a, s1, 40);
        a.take_events();
        let probe = chain(&[1, 2, 3, 4], 64);
        let before = state(&a);
        let reqs = a.num_requests();
        let n = a.num_cached_tokens(&probe, 63).unwrap();
        assert_eq!(state(&a), before, "{kinds:?}");
        assert_eq!(a.num_requests(), reqs);
        assert!(!a.has_events());
        let s2 = add(&mut a, &[1, 2, 3, 4], 64);
        assert_eq!(n, a.find_longest_cache_hit(s2, 63).unwrap().num_tokens, "{kinds:?}");
        assert!(n > 0, "{kinds:?}");
        // A bound below the hit caps it, as the lookup's does.
        assert_eq!(a.num_cached_tokens(&probe, 16).unwrap(), a.find_longest_cache_hit(s2, 16).unwrap().num_tokens);
        assert_eq!(a.num_cached_tokens(&probe, 0).unwrap(), 0);
        ok(&a);
    }
    let mut off = config(&[full(), swa(32)], 32);
    off.enable_caching = false;
    let mut a = alloc(off);
    let s1 = add(&mut a, &[1, 2, 3], 40);
    prefill(&mut a, s1, 40);
    assert_eq!(a.num_cached_tokens(&chain(&[1, 2, 3], 40), 39).unwrap(), 0);
}

/// vLLM 0.34's `free_blocks(..., evict_first=True)`: the blocks freed go to the front of the
/// free queue in the order given (`prepend_n`), cached ones too, and stay cached.
#[test]
fn free_block_ids_evict_first_queues_freed_blocks_at_the_front_in_order() {
    let mut a = alloc(config(&[full()], 32));
    let r = add(&mut a, &[1, 2, 3], 40);
    prefill(&mut a, r, 40);
    let mut out = Vec::new();
    a.pop_blocks_for_free(r, &mut out).unwrap();
    assert!(a.pool().block_hash(out[0]).is_some(), "the first block is cached");
    a.free_block_ids_ordered(&out, true).unwrap();
    assert_eq!(&a.pool().free_queue_order()[..out.len()], &out[..]);
    assert!(a.pool().block_hash(out[0]).is_some(), "still cached");
    ok(&a);
    // Without evict_first the cached blocks go to the back (vLLM's LRU order).
    let r = add(&mut a, &[1, 2, 3], 40);
    prefill(&mut a, r, 40);
    out.clear();
    a.pop_blocks_for_free(r, &mut out).unwrap();
    a.free_block_ids_ordered(&out, false).unwrap();
    let q = a.pool().free_queue_order();
    assert_ne!(&q[..out.len()], &out[..]);
    assert_eq!(q.last(), Some(&out[1]), "the last cached block freed is last");
    ok(&a);
}

// ---- the EAGLE/MTP prefix-cache block drop (`eagle_drop_groups`) ---------------------------

/// `config` with the EAGLE drop on the groups of `drop` (a bitset).
fn eagle_config(kinds: &[AttentionKind], num_blocks: u32, drop: u64) -> Config {
    Config { eagle_drop_groups: drop, ..config(kinds, num_blocks) }
}

#[test]
fn eagle_drop_full_hit_loses_its_last_block() {
    let mut a = alloc(eagle_config(&[full()], 64, 1));
    let contents = [1, 2, 3, 4, 5];
    let first = add(&mut a, &contents, 80);
    assert_eq!(admit(&mut a, first, 80), (0, Some(5)));
    // A resend matches 4 cached blocks within 79 tokens, then drops the last one.
    let second = add(&mut a, &contents, 80);
    assert_eq!(a.find_longest_cache_hit(second, 79).unwrap().num_tokens, 48);
    // One group: no margin, in the probe too.
    assert_eq!(a.num_cached_tokens(&chain(&contents, 80), 79).unwrap(), 48);
    ok(&a);
}

#[test]
fn eagle_drop_of_the_draft_group_spreads_to_equal_specs_only() {
    let mut cfg = eagle_config(&[full(), swa(64), full()], 64, 0b100);
    // Distinct specs: only the flagged group drops.
    assert!(!cfg.drops_eagle_block(0) && !cfg.drops_eagle_block(1) && cfg.drops_eagle_block(2));
    // The draft group's spec equals the target's (one spec group): both drop.
    cfg.groups[2].spec_key = 0;
    assert!(cfg.drops_eagle_block(0) && !cfg.drops_eagle_block(1) && cfg.drops_eagle_block(2));
    // With prefix caching off nothing drops.
    assert!(!Config { enable_caching: false, ..cfg }.drops_eagle_block(2));
}

#[test]
fn eagle_drop_sliding_window_matches_one_block_further_then_drops_it() {
    // Window 33 needs 2 contiguous blocks; with the drop 3, the last dropped.
    let mut a = alloc(eagle_config(&[full(), swa(33)], 128, 0b11));
    let contents = [1, 2, 3, 4, 5, 6];
    let first = add(&mut a, &contents, 96);
    admit(&mut a, first, 96);
    let second = add(&mut a, &contents, 96);
    // Full attention: 5 blocks within 95 tokens, margin 16 more (6 hashed), dropped to 80;
    // the window then finds blocks 2..5 and drops block 4: 64... until both agree.
    let hit = a.find_longest_cache_hit(second, 95).unwrap().num_tokens;
    assert_eq!(hit % BS, 0);
    assert!(hit < 96 && hit > 0, "{hit}");
    // vLLM 0.34's probe reads the request's hashes past the bound (the drop's margin), as
    // `get_computed_blocks` does: the same hit.
    assert_eq!(a.num_cached_tokens(&chain(&contents, 96), 95).unwrap(), hit);
    ok(&a);
}

#[test]
fn eagle_drop_hybrid_caches_one_block_past_the_scheduler_block() {
    // Scheduler blocks of 32 over groups of 16: a dropping group caches up to one of its
    // blocks past the aligned boundary (vLLM's `get_num_cacheable_tokens`).
    let groups = vec![
        hybrid_alloc::GroupSpec { kind: full(), block_size: 16, spec_key: 0 },
        hybrid_alloc::GroupSpec { kind: swa(64), block_size: 16, spec_key: 1 },
    ];
    let base = common::config(128, groups, 16);
    let cfg = Config { scheduler_block_size: 32, eagle_drop_groups: 0b01, ..base.clone() };
    let mut a = alloc(cfg);
    let mut plain = alloc(Config { scheduler_block_size: 32, ..base });
    let contents = [1, 2, 3, 4];
    for x in [&mut a, &mut plain] {
        let h = add(x, &contents, 64);
        let mut y = args(48, 0, 64, 48);
        y.num_tokens = 48;
        x.allocate_slots(h, &y, NewComputed::Empty, None).unwrap();
    }
    // 48 computed tokens: the plain hybrid caches 32 (one scheduler block); the dropping
    // full-attention group 48, the window (not dropping) 32.
    let probe = |x: &mut Allocator| {
        let h = add(x, &contents, 64);
        let hit = x.find_longest_cache_hit(h, 63).unwrap().num_tokens;
        x.free(h, LEVEL_NORMAL).unwrap();
        hit
    };
    assert_eq!(probe(&mut plain), 32);
    // Full attention finds 3 blocks (48, margin capped by the hashes), drops one: 32.
    assert_eq!(probe(&mut a), 32);
    ok(&a);
    ok(&plain);
}

#[test]
fn eagle_drop_refuses_what_is_not_served() {
    // A Mamba "align" group in the drop set is served (its finder never drops), with its
    // checkpoints moved one block back or not.
    let mamba =
        AttentionKind::Mamba { speculative_blocks: 0, align: true, rekey_cached_tail: false, checkpoint_alignment: 1 };
    assert!(Allocator::new(eagle_config(&[full(), mamba], 64, 0b11), Policy::Exact).is_ok());
    let moved = Config { eagle_checkpoints: true, ..eagle_config(&[full(), mamba], 64, 0b11) };
    assert!(Allocator::new(moved, Policy::Exact).is_ok());
    let e = Allocator::new(eagle_config(&[full(), chunked(64)], 64, 0b11), Policy::Exact).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
    let e = Allocator::new(eagle_config(&[full()], 64, 1), Policy::HitAware).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    let e = Allocator::new(eagle_config(&[full()], 64, 0b10), Policy::Exact).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
    // Only the chunked group dropping is refused: a non-dropping one is served.
    assert!(Allocator::new(eagle_config(&[full(), chunked(64)], 64, 0b01), Policy::Exact).is_ok());
    // With prefix caching off nothing of the drop is read.
    let none =
        AttentionKind::Mamba { speculative_blocks: 0, align: false, rekey_cached_tail: false, checkpoint_alignment: 0 };
    let off = Config { enable_caching: false, ..eagle_config(&[full(), none], 64, 0b11) };
    assert!(Allocator::new(off, Policy::Exact).is_ok());
}
