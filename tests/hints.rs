//! KV hints (issue 38): pin leases, retains, session releases and checkpoints under the
//! `hit-aware` policy, and the clock that ends leases and retains.
//!
//! Deterministic scenarios check each action's levels, its TTL, its refusal and its errors;
//! a proptest drives random requests with leases and retains, clock steps and releases
//! against a model of the running leases, with `invariants::check` after every operation,
//! and checks that the pool's leased keys are exactly the model's, that a lease past the
//! pinned share is refused exactly when the model says, and that a block under a running
//! lease is never evicted while a free block of a lower level remains.

use std::collections::HashSet;

mod common;

use common::chain;
use hybrid_alloc::block_pool::BlockPool;
use hybrid_alloc::invariants;
use hybrid_alloc::policy::{Level, Policy, LEVEL_LEASED, LEVEL_NORMAL, LEVEL_PINNED, LEVEL_SPECULATIVE, MAX_TTL_MS};
use hybrid_alloc::{
    AllocateArgs, Allocator, AttentionKind, BlockHash, BlockId, Config, Error, Hit, NewComputed, PinHint, PinOutcome,
    ReqHandle, RequestHints, RetainHint, RetainPriority,
};
use proptest::prelude::*;

const BS: u32 = 4;

fn swa(window: u32) -> AttentionKind {
    AttentionKind::SlidingWindow { window, extra_retained_tokens: 0 }
}

fn mamba_align() -> AttentionKind {
    AttentionKind::Mamba { speculative_blocks: 0, align: true, rekey_cached_tail: false, checkpoint_alignment: 0 }
}

fn config(kinds: &[AttentionKind], num_blocks: u32) -> Config {
    Config { retention_interval: Some(0), ..common::config(num_blocks, common::groups(kinds, BS), BS) }
}

fn hit_aware(kinds: &[AttentionKind], num_blocks: u32) -> Allocator {
    Allocator::new(config(kinds, num_blocks), Policy::HitAware).unwrap()
}

fn hashes_of(contents: &[u64]) -> Vec<BlockHash> {
    chain(contents).into_iter().map(BlockHash::from_u64).collect()
}

/// Registers a request with these block hashes.
fn request(a: &mut Allocator, hashes: &[BlockHash]) -> ReqHandle {
    let h = a.add_request();
    a.append_hashes(h, &common::hash_bytes(hashes), 8).unwrap();
    h
}

fn level(a: &Allocator, b: BlockId) -> Level {
    a.pool().retention().map_or(LEVEL_NORMAL, |r| r.level(b))
}

/// Group `g`'s cached block for the first `tokens` tokens of `hashes`.
fn cached(a: &Allocator, hashes: &[BlockHash], tokens: u32, g: u32) -> Option<BlockId> {
    let mut out = Vec::new();
    a.pool().get_cached_block(&hashes[(tokens / BS - 1) as usize], &[g], &mut out);
    out.first().copied()
}

/// The full-attention (group 0) blocks of the first `n` blocks of `hashes`, all cached.
fn full_blocks(a: &Allocator, hashes: &[BlockHash], n: u32) -> Vec<BlockId> {
    (1..=n).map(|i| cached(a, hashes, i * BS, 0).expect("cached")).collect()
}

fn pin(ttl_ms: u64) -> RequestHints<'static> {
    RequestHints { pin: Some(PinHint { ttl_ms, tokens: 0 }), ..Default::default() }
}

fn retain(priority: RetainPriority, ttl_ms: u64, tokens: u32) -> Option<RetainHint> {
    Some(RetainHint { priority, ttl_ms, tokens })
}

/// Prefills `prompt` tokens of `h` from its lookup `hit`, as vLLM's scheduler does with a
/// Mamba "align" group (without one: in one chunk): a chunk ends at the reported junction
/// and each one an allocation moves it to, at `tail` (the prompt's checkpoint) and at the
/// prompt's end. Returns the chunk ends.
fn prefill(a: &mut Allocator, h: ReqHandle, hit: Hit, prompt: u32, tail: u32, mamba: bool) -> Vec<u32> {
    let mut junction = if hit.num_uncached_common_prefix_tokens > 0 {
        hit.num_tokens + hit.num_uncached_common_prefix_tokens
    } else {
        0
    };
    let (mut start, mut ends) = (hit.num_tokens, Vec::new());
    while start < prompt {
        let end = [junction, tail].into_iter().filter(|&e| mamba && e > start && e < prompt).min().unwrap_or(prompt);
        let first = ends.is_empty();
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
        assert!(a.allocate_slots(h, &args, nc, None).unwrap().is_some(), "chunk to {end}");
        a.take_kv_cache_block_copies();
        if let Some(j) = a.take_moved_junction(h).unwrap() {
            assert!(j > end && j < prompt, "junction moved to {j} by a chunk ending at {end}");
            junction = j;
        }
        ends.push(end);
        start = end;
    }
    ends
}

/// One request over `hashes` with `hints`: looked up, prefilled (`prompt` tokens, one chunk
/// on an attention-only model) and freed. Returns its hit.
fn run(a: &mut Allocator, hashes: &[BlockHash], prompt: u32, hints: Option<&RequestHints<'_>>) -> u32 {
    let h = request(a, hashes);
    if let Some(x) = hints {
        a.set_hints(h, None, x).unwrap();
    }
    let hit = a.find_longest_cache_hit(h, prompt - 1).unwrap();
    let mamba = a.managers().iter().any(|m| matches!(m.kind(), AttentionKind::Mamba { .. }));
    prefill(a, h, hit, prompt, (prompt - 1) / BS * BS, mamba);
    a.free(h, LEVEL_NORMAL).unwrap();
    a.new_step_starts();
    invariants::check(a).unwrap();
    hit.num_tokens
}

/// Unrelated requests, one after the other, filling the pool `rounds` times over.
fn flood(a: &mut Allocator, seed: u64, rounds: u32) {
    for i in 0..rounds as u64 {
        let contents: Vec<u64> = (0..7).map(|k| seed + 100 * i + k).collect();
        run(a, &hashes_of(&contents), 26, None);
    }
}

#[test]
fn lease_holds_its_prefix_at_the_leased_level_until_its_ttl() {
    let mut a = hit_aware(&[AttentionKind::Full, swa(9)], 64);
    assert_eq!(a.advance_clock(1_000).unwrap(), (0, None));
    let hashes = hashes_of(&[1, 2, 3, 4, 5, 6]);
    let h = request(&mut a, &hashes);
    let out = a.set_hints(h, None, &pin(500)).unwrap();
    assert_eq!(out.pin, PinOutcome::Applied);
    // Full attention: 6 keys; the window (2 blocks of a 9-token window): 2 more.
    assert_eq!(a.hint_stats().leased_keys, 8);
    let hit = a.find_longest_cache_hit(h, 25).unwrap();
    prefill(&mut a, h, hit, 26, 24, false);
    a.free(h, LEVEL_NORMAL).unwrap();
    let blocks = full_blocks(&a, &hashes, 6);
    assert!(blocks.iter().all(|&b| level(&a, b) == LEVEL_LEASED));
    assert_eq!(a.hint_stats().leased_free_blocks, 8);
    assert_eq!(a.advance_clock(1_499).unwrap(), (0, Some(1_500)));
    assert!(blocks.iter().all(|&b| level(&a, b) == LEVEL_LEASED));
    assert_eq!(a.advance_clock(1_500).unwrap(), (1, None));
    assert!(blocks.iter().all(|&b| level(&a, b) == LEVEL_NORMAL), "the lease ended: back to normal");
    let s = a.hint_stats();
    assert_eq!((s.leases_applied, s.leases_expired, s.leased_keys, s.leased_free_blocks), (1, 1, 0, 0));
    invariants::check(&a).unwrap();
}

#[test]
fn two_leases_on_one_prefix_hold_it_until_the_later_one_ends() {
    let mut a = hit_aware(&[AttentionKind::Full, swa(9)], 64);
    let hashes = hashes_of(&[1, 2, 3, 4, 5, 6]);
    run(&mut a, &hashes, 26, Some(&pin(100)));
    run(&mut a, &hashes, 26, Some(&pin(300)));
    assert_eq!(a.hint_stats().leased_keys, 8, "one prefix, held twice");
    let blocks = full_blocks(&a, &hashes, 6);
    assert_eq!(a.advance_clock(150).unwrap(), (1, Some(300)));
    assert!(blocks.iter().all(|&b| level(&a, b) == LEVEL_LEASED), "the second lease still runs");
    assert_eq!(a.advance_clock(300).unwrap(), (1, None));
    assert!(blocks.iter().all(|&b| level(&a, b) == LEVEL_NORMAL));
    invariants::check(&a).unwrap();
}

#[test]
fn lease_past_the_pinned_share_is_refused_counted_and_never_demotes_another() {
    let mut a = hit_aware(&[AttentionKind::Full, swa(9)], 41);
    a.set_pinned_share(0.25).unwrap(); // 10 blocks
    let first = hashes_of(&[1, 2, 3, 4, 5, 6]);
    run(&mut a, &first, 26, Some(&pin(10_000)));
    let leased = full_blocks(&a, &first, 6);
    // A second prefix's 8 keys would make 16 pinned keys: refused.
    let second = hashes_of(&[7, 8, 9, 10, 11, 12]);
    let h = request(&mut a, &second);
    assert_eq!(a.set_hints(h, None, &pin(10_000)).unwrap().pin, PinOutcome::RefusedOverCap);
    a.free(h, LEVEL_NORMAL).unwrap();
    let s = a.hint_stats();
    assert_eq!((s.leases_applied, s.leases_refused_over_cap, s.leased_keys), (1, 1, 8));
    // A retain at the high level past the share demotes the oldest pinned blocks, not leased ones.
    let third = hashes_of(&[13, 14, 15, 16, 17, 18]);
    let hints = RequestHints { retain: retain(RetainPriority::High, 10_000, 0), ..Default::default() };
    run(&mut a, &third, 26, Some(&hints));
    assert!(leased.iter().all(|&b| level(&a, b) == LEVEL_LEASED), "a retain never demotes a lease");
    let r = a.pool().retention().unwrap();
    assert!(r.pinned_free() <= r.pinned_cap());
    invariants::check(&a).unwrap();
}

#[test]
fn leased_prefix_survives_a_flood_that_evicts_it_without_the_lease_or_once_it_expired() {
    let hashes = hashes_of(&[1, 2, 3, 4, 5, 6, 7]);
    let mut results = Vec::new();
    for (lease, expire) in [(true, false), (false, false), (true, true)] {
        let mut a = hit_aware(&[AttentionKind::Full, swa(9)], 64);
        run(&mut a, &hashes[..6], 26, lease.then(|| pin(1_000)).as_ref());
        if expire {
            a.advance_clock(1_000).unwrap();
        }
        flood(&mut a, 10_000, 12);
        results.push(run(&mut a, &hashes, 30, None));
    }
    assert_eq!(results[0], 24, "the leased 6-block prefix hits whole after the flood");
    assert!(results[1] < 24, "the flood does not evict: the test proves nothing");
    assert!(results[2] < 24, "an expired lease still kept the prefix");
}

#[test]
fn retain_frees_the_prefix_at_its_priority_until_its_ttl() {
    let mut a = hit_aware(&[AttentionKind::Full, swa(9)], 128);
    a.set_pinned_share(1.0).unwrap();
    let mut cases = Vec::new();
    for (k, (priority, lvl)) in [
        (RetainPriority::High, LEVEL_PINNED),
        (RetainPriority::Normal, LEVEL_NORMAL),
        (RetainPriority::Low, LEVEL_SPECULATIVE),
    ]
    .into_iter()
    .enumerate()
    {
        let hashes = hashes_of(&(0..6).map(|i| 100 * k as u64 + i).collect::<Vec<_>>());
        let hints = RequestHints { retain: retain(priority, 50, 0), ..Default::default() };
        run(&mut a, &hashes, 26, Some(&hints));
        cases.push((hashes, lvl));
    }
    let r = |a: &Allocator| a.pool().retention().unwrap().clone();
    for (hashes, lvl) in &cases {
        for b in full_blocks(&a, hashes, 6) {
            assert_eq!(level(&a, b), *lvl);
            assert!(r(&a).is_held(b));
        }
    }
    let s = a.hint_stats();
    assert_eq!((s.retains_applied, s.live_holds), (3, 3));
    assert_eq!(s.retained_blocks, 3 * 8, "6 full-attention blocks and the window's 2 each");
    assert_eq!(a.advance_clock(50).unwrap(), (3, None));
    for (hashes, _) in &cases {
        for b in full_blocks(&a, hashes, 6) {
            assert_eq!(level(&a, b), LEVEL_NORMAL, "a retain ended: back to normal");
            assert!(!r(&a).is_held(b));
        }
    }
    assert_eq!(a.hint_stats().retained_blocks, 0);
    invariants::check(&a).unwrap();
}

#[test]
fn retain_of_some_tokens_holds_only_that_prefix() {
    let mut a = hit_aware(&[AttentionKind::Full, swa(9)], 64);
    a.set_pinned_share(1.0).unwrap();
    let hashes = hashes_of(&[1, 2, 3, 4, 5, 6]);
    let hints = RequestHints { retain: retain(RetainPriority::High, 50, 10), ..Default::default() };
    run(&mut a, &hashes, 26, Some(&hints));
    let blocks = full_blocks(&a, &hashes, 6);
    let levels: Vec<Level> = blocks.iter().map(|&b| level(&a, b)).collect();
    assert_eq!(&levels[..2], &[LEVEL_PINNED; 2], "the first 10 tokens: 2 whole blocks");
    assert!(levels[2..].iter().all(|&l| l < LEVEL_PINNED));
}

#[test]
fn release_demotes_what_the_session_retained_or_leased_to_the_front_and_ends_its_holds() {
    let mut a = hit_aware(&[AttentionKind::Full, swa(9)], 64);
    a.set_pinned_share(1.0).unwrap();
    let own = hashes_of(&[1, 2, 3, 4, 5, 6]);
    let hints = RequestHints {
        session: 7,
        retain: retain(RetainPriority::High, 10_000, 0),
        pin: Some(PinHint { ttl_ms: 10_000, tokens: 0 }),
        ..Default::default()
    };
    run(&mut a, &own, 26, Some(&hints));
    // Another session leases another prefix: it keeps it.
    let other = hashes_of(&[21, 22, 23]);
    run(&mut a, &other, 14, Some(&RequestHints { session: 8, ..pin(10_000) }));
    // The session's last turn releases it when freed.
    let last = hashes_of(&[1, 2, 3, 4, 5, 6, 31, 32]);
    run(&mut a, &last, 34, Some(&RequestHints { session: 7, release_session: 7, ..Default::default() }));
    let s = a.hint_stats();
    assert_eq!((s.sessions_released, s.leases_released, s.retains_released, s.live_holds), (1, 1, 1, 1));
    for b in full_blocks(&a, &own, 6) {
        assert_eq!(level(&a, b), LEVEL_SPECULATIVE, "block {b}, released");
    }
    assert!(full_blocks(&a, &other, 3).iter().all(|&b| level(&a, b) == LEVEL_LEASED));
    // Evicted first: the released blocks (6 full-attention blocks, the window's 2) lead the
    // free queue.
    let order = a.pool().free_queue_order();
    let cached: Vec<BlockId> = order.into_iter().filter(|&b| a.pool().block_hash(b).is_some()).collect();
    for &b in &cached[..8] {
        let key = a.pool().block_hash(b).unwrap();
        assert!(own.contains(&key.0), "block {b}, among the first 8 cached blocks to go, is not a released one");
    }
    assert_eq!(a.release_session(7).unwrap(), 0, "released already");
    invariants::check(&a).unwrap();
}

#[test]
fn clear_hints_drops_the_retain_and_release_a_lease_runs_on() {
    let mut a = hit_aware(&[AttentionKind::Full, swa(9)], 64);
    let hashes = hashes_of(&[1, 2, 3, 4, 5, 6]);
    let h = request(&mut a, &hashes);
    let hints = RequestHints {
        session: 3,
        retain: retain(RetainPriority::Low, 100, 0),
        pin: Some(PinHint { ttl_ms: 100, tokens: 8 }),
        release_session: 3,
        ..Default::default()
    };
    assert_eq!(a.set_hints(h, None, &hints).unwrap().pin, PinOutcome::Applied);
    assert_eq!(a.hint_stats().leased_keys, 2 + 2, "8 tokens: 2 full-attention blocks and the window's 2");
    a.clear_hints(h).unwrap();
    a.free(h, LEVEL_NORMAL).unwrap();
    let s = a.hint_stats();
    assert_eq!((s.retains_applied, s.sessions_released, s.live_holds), (0, 0, 1));
    invariants::check(&a).unwrap();
}

#[test]
fn checkpoint_is_a_junction_the_second_sighting_hits_whole_mamba_align() {
    // Full attention + Mamba "align" at the block (4 tokens): a 3-block system prompt
    // (12 tokens) then 3-4 own blocks, 26-token prompts. Without hints the 2nd sighting hits
    // 8 tokens (the first-sighting stops: 4, 8, 16); with a checkpoint at 14 (rounded down
    // to 12) the 1st sighting stops at 12 and the 2nd, with no hint, hits all 12.
    let kinds = [AttentionKind::Full, mamba_align()];
    let prompt = 26;
    let prefix = [9_000u64, 9_001, 9_002];
    let with = |own: u64| -> Vec<BlockHash> {
        hashes_of(&prefix.iter().copied().chain(own..own + 4).collect::<Vec<_>>())[..6].to_vec()
    };
    for checkpoint in [None, Some(14)] {
        let mut a = hit_aware(&kinds, 64);
        let h = request(&mut a, &with(100));
        if let Some(c) = checkpoint {
            let cps = [c, 3];
            let out = a.set_hints(h, None, &RequestHints { checkpoints: &cps, ..Default::default() }).unwrap();
            assert_eq!((out.checkpoints_applied, out.checkpoints_refused), (1, 1), "3 rounds down to 0");
        }
        let hit = a.find_longest_cache_hit(h, prompt - 1).unwrap();
        let ends = prefill(&mut a, h, hit, prompt, 24, true);
        a.free(h, LEVEL_NORMAL).unwrap();
        a.new_step_starts();
        let second = run(&mut a, &with(200), prompt, None);
        match checkpoint {
            None => assert_eq!((hit.num_uncached_common_prefix_tokens, second), (4, 8)),
            Some(_) => {
                assert_eq!(hit.num_uncached_common_prefix_tokens, 12, "the checkpoint is the junction");
                assert_eq!(ends, vec![12, 24, 26]);
                assert_eq!(second, 12, "the 2nd sighting hits the system prompt whole");
                let st = cached(&a, &with(100), 12, 1).expect("the state at the checkpoint");
                assert!(a.pool().retention().unwrap().is_branch(st), "a checkpoint's state is a branch point");
                assert!(level(&a, st) >= LEVEL_NORMAL);
                assert_eq!(a.hint_stats().checkpoint_states, 1);
            }
        }
    }
}

#[test]
fn checkpoints_stop_each_chunk_in_turn_mamba_align() {
    let kinds = [AttentionKind::Full, mamba_align()];
    let mut a = hit_aware(&kinds, 64);
    let hashes = hashes_of(&(0..7).map(|i| 500 + i).collect::<Vec<_>>());
    let h = request(&mut a, &hashes[..6]);
    let cps = [16, 8];
    a.set_hints(h, None, &RequestHints { checkpoints: &cps, ..Default::default() }).unwrap();
    let hit = a.find_longest_cache_hit(h, 25).unwrap();
    assert_eq!(hit.num_uncached_common_prefix_tokens, 8);
    assert_eq!(prefill(&mut a, h, hit, 26, 24, true), vec![8, 16, 24, 26]);
    a.free(h, LEVEL_NORMAL).unwrap();
    assert_eq!(a.hint_stats().checkpoint_states, 2);
    for tokens in [8, 16] {
        let st = cached(&a, &hashes, tokens, 1).expect("a state at each checkpoint");
        assert!(a.pool().retention().unwrap().is_branch(st));
    }
    invariants::check(&a).unwrap();
}

#[test]
fn checkpoint_inside_a_block_with_partial_hash_hits_is_hit_whole_on_the_second_sighting() {
    // Blocks of 2 hash blocks (vLLM's partial hash hits): a 12-token system prompt ends
    // inside block 1. Without hints the 2nd sighting hits 8 (the 1st's first-sighting stop);
    // with a checkpoint at 13 (rounded down to the hash block: 12) it hits 12.
    let kinds = [AttentionKind::Full, mamba_align()];
    let prompt = 6 * BS + 2;
    let prefix = [9_000u64, 9_001, 9_002];
    for checkpoint in [None, Some(13u32)] {
        let mut cfg = config(&kinds, 64);
        cfg.retention_interval = None;
        for g in &mut cfg.groups {
            g.block_size = 2 * BS;
        }
        cfg.scheduler_block_size = 2 * BS;
        assert!(cfg.partial_hash_hits());
        let mut a = Allocator::new(cfg, Policy::HitAware).unwrap();
        let mut hits = Vec::new();
        for (k, own) in [100u64, 200].into_iter().enumerate() {
            let hashes = hashes_of(&prefix.iter().copied().chain(own..own + 3).collect::<Vec<_>>());
            let h = request(&mut a, &hashes);
            if let (0, Some(c)) = (k, checkpoint) {
                let cps = [c];
                a.set_hints(h, None, &RequestHints { checkpoints: &cps, ..Default::default() }).unwrap();
            }
            let hit = a.find_longest_cache_hit(h, prompt - 1).unwrap();
            prefill(&mut a, h, hit, prompt, prompt / BS * BS, true);
            a.free(h, LEVEL_NORMAL).unwrap();
            a.new_step_starts();
            invariants::check(&a).unwrap();
            hits.push(hit.num_tokens);
        }
        let want = if checkpoint.is_some() { vec![0, 12] } else { vec![0, 8] };
        assert_eq!(hits, want, "checkpoint {checkpoint:?}: hit tokens per sighting");
    }
}

#[test]
fn checkpoint_on_an_attention_only_model_is_taken_and_does_nothing() {
    let mut a = hit_aware(&[AttentionKind::Full, swa(9)], 64);
    let hashes = hashes_of(&[1, 2, 3, 4, 5, 6]);
    let h = request(&mut a, &hashes);
    let cps = [8, 12];
    let out = a.set_hints(h, None, &RequestHints { checkpoints: &cps, ..Default::default() }).unwrap();
    assert_eq!((out.checkpoints_applied, out.checkpoints_refused), (2, 0));
    let hit = a.find_longest_cache_hit(h, 25).unwrap();
    assert_eq!((hit.num_tokens, hit.num_uncached_common_prefix_tokens), (0, 0));
    assert!(!a.may_move_junction(h).unwrap());
}

#[test]
fn bad_hints_are_errors_that_change_nothing_and_exact_refuses_them() {
    let mut a = hit_aware(&[AttentionKind::Full, swa(9)], 64);
    let hashes = hashes_of(&[1, 2, 3, 4, 5, 6]);
    let h = request(&mut a, &hashes[..2]);
    let more: Vec<BlockHash> = hashes.clone();
    let too_many: Vec<u32> = (1..=65).map(|i| i * BS).collect();
    let past = [100u32];
    let bad: Vec<RequestHints<'_>> = vec![
        pin(0),
        pin(MAX_TTL_MS + 1),
        RequestHints { retain: retain(RetainPriority::High, 0, 0), ..Default::default() },
        RequestHints { checkpoints: &too_many, ..pin(10) },
        RequestHints { checkpoints: &past, ..pin(10) },
    ];
    let before = a.hint_stats();
    for hints in &bad {
        let err = a.set_hints(h, Some(&more), hints).unwrap_err();
        assert!(matches!(err, Error::OutOfRange(_)), "{err}");
        assert_eq!(a.hint_stats(), before, "{hints:?} changed the counters");
        assert_eq!(a.num_hashes(h).unwrap(), 2, "{hints:?} left the hashes synced");
        invariants::check(&a).unwrap();
    }
    assert!(matches!(a.set_hints(h + 1, None, &pin(10)), Err(Error::UnknownRequest(_))));
    // A clock near the end of time: the expiry overflows.
    a.advance_clock(u64::MAX - 5).unwrap();
    assert!(matches!(a.set_hints(h, None, &pin(10)), Err(Error::OutOfRange(_))));
    a.set_hints(h, None, &pin(5)).unwrap();
    assert!(matches!(a.set_hints(h, None, &pin(5)), Err(Error::InvalidState(_))), "hints set twice");
    let mut e = Allocator::new(config(&[AttentionKind::Full, swa(9)], 64), Policy::Exact).unwrap();
    let h = request(&mut e, &hashes);
    assert!(matches!(e.set_hints(h, None, &pin(10)), Err(Error::Unsupported(_))));
    assert!(matches!(e.advance_clock(1), Err(Error::Unsupported(_))));
    assert!(matches!(e.release_session(1), Err(Error::Unsupported(_))));
    assert_eq!(e.hint_stats(), Default::default());
}

// --- The property test ---

/// A lease as the model sees it.
#[derive(Clone, Debug)]
struct Lease {
    keys: Vec<(BlockHash, u32)>,
    expiry: u64,
    session: u64,
}

/// A live request: handle, hashes, prompt, computed tokens, retain, session, release.
type Live = (ReqHandle, Vec<BlockHash>, u32, u32, Option<RetainHint>, u64, u64);

/// A hash key (hash, group).
type Key = (BlockHash, u32);

struct Model {
    a: Allocator,
    now: u64,
    leases: Vec<Lease>,
    /// Retains as the model sees them: (expiry, session).
    retains: Vec<(u64, u64)>,
    /// Live requests: handle, hashes, prompt, computed, retain, release.
    live: Vec<Live>,
    next: u64,
    /// Free blocks under a running lease's key that an allocation evicted (allowed only once
    /// every free block below their level was taken).
    leased_evictions: u64,
}

const WINDOW: u32 = 9;

impl Model {
    fn running_keys(&self) -> HashSet<(BlockHash, u32)> {
        self.leases.iter().flat_map(|l| l.keys.iter().copied()).collect()
    }

    /// The keys a lease on a prefix of `n` blocks takes (full attention: all; the window: its tail).
    fn lease_keys(hashes: &[BlockHash], n: usize) -> Vec<(BlockHash, u32)> {
        let tail = (WINDOW - 1).div_ceil(BS) as usize;
        let mut keys: Vec<_> = hashes[..n].iter().map(|&x| (x, 0)).collect();
        keys.extend(hashes[n.saturating_sub(tail)..n].iter().map(|&x| (x, 1)));
        keys
    }

    /// Free blocks below the leased level, and the free blocks cached under a running
    /// lease's keys (with their keys).
    fn snapshot(&self) -> (usize, Vec<(Key, BlockId)>) {
        let pool: &BlockPool = self.a.pool();
        let lower = pool.free_queue_order().iter().filter(|&&b| level(&self.a, b) < LEVEL_LEASED).count();
        let mut out = Vec::new();
        for k in self.running_keys() {
            if let Some(b) = pool.index_get(&k) {
                if pool.ref_cnt(b) == 0 {
                    out.push((k, b));
                }
            }
        }
        (lower, out)
    }

    /// `allocate_slots`, checking that a free block under a running lease's key is evicted
    /// only when the call took more new blocks than the free blocks below its level (less
    /// those its own hit takes out of the queue).
    fn alloc(&mut self, h: ReqHandle, args: &AllocateArgs, nc: NewComputed<'_>) -> bool {
        let (mut lower, leased) = self.snapshot();
        if matches!(nc, NewComputed::Stored) {
            let mut hit: Vec<BlockId> = (0..2).flat_map(|g| self.a.stored_hit(h, g).unwrap().to_vec()).collect();
            hit.sort_unstable();
            hit.dedup();
            let pool = self.a.pool();
            lower -=
                hit.iter().filter(|&&b| b != 0 && pool.ref_cnt(b) == 0 && level(&self.a, b) < LEVEL_LEASED).count();
        }
        let ok = self.a.allocate_slots(h, args, nc, None).unwrap().is_some();
        let taken: u32 = if ok { self.a.new_block_counts().iter().sum() } else { 0 };
        for (k, b) in leased {
            if self.a.pool().index_get(&k) != Some(b) {
                self.leased_evictions += 1;
                assert!(
                    taken as usize > lower,
                    "block {b} of a running lease evicted by an allocation of {taken} blocks with {lower} free \
                     blocks below its level"
                );
            }
        }
        ok
    }

    fn add(&mut self, family: u8, own: u8, lease: Option<u16>, rt: Option<(u8, u16)>, session: u8, release: bool) {
        let fam = (family % 3) as u64;
        let shared = family as usize / 3 % 5 + 1;
        let mut contents: Vec<u64> = (0..shared as u64).map(|i| 1_000_000 * (fam + 1) + i).collect();
        contents.extend((0..own as u64 % 4 + 1).map(|i| self.next + i));
        self.next += 10;
        let hashes = hashes_of(&contents);
        let prompt = contents.len() as u32 * BS - 1;
        let h = request(&mut self.a, &hashes);
        let session = session as u64 % 3;
        let hints = RequestHints {
            session,
            pin: lease.map(|t| PinHint { ttl_ms: t as u64 % 500 + 1, tokens: 0 }),
            retain: rt.map(|(p, t)| RetainHint {
                priority: [RetainPriority::High, RetainPriority::Normal, RetainPriority::Low][p as usize % 3],
                ttl_ms: t as u64 % 500 + 1,
                tokens: 0,
            }),
            release_session: if release { session } else { 0 },
            checkpoints: &[],
        };
        let n = hashes.len();
        let keys = Self::lease_keys(&hashes, n);
        let running = self.running_keys();
        let new: HashSet<_> = keys.iter().filter(|k| !running.contains(k)).collect();
        let cap = self.a.pool().retention().unwrap().pinned_cap() as usize;
        let out = self.a.set_hints(h, None, &hints).unwrap();
        if let Some(p) = hints.pin {
            let refused = running.len() + new.len() > cap;
            let want = if refused { PinOutcome::RefusedOverCap } else { PinOutcome::Applied };
            assert_eq!(out.pin, want, "{} running keys, {} new, cap {cap}", running.len(), new.len());
            if !refused {
                self.leases.push(Lease { keys, expiry: self.now + p.ttl_ms, session });
            }
        }
        let hit = self.a.find_longest_cache_hit(h, prompt - 1).unwrap();
        self.a.new_step_starts();
        let args = AllocateArgs {
            num_new_tokens: prompt - hit.num_tokens,
            num_new_computed_tokens: hit.num_tokens,
            num_prompt_tokens: prompt,
            num_tokens: prompt,
            ..Default::default()
        };
        let nc = if hit.num_tokens > 0 { NewComputed::Stored } else { NewComputed::Empty };
        if self.alloc(h, &args, nc) {
            self.live.push((h, hashes, prompt, prompt, hints.retain, session, hints.release_session));
        } else {
            self.free_request(h, hints.retain, session, hints.release_session);
        }
    }

    /// Frees a request and records what its hints leave.
    fn free_request(&mut self, h: ReqHandle, rt: Option<RetainHint>, session: u64, release: u64) {
        self.a.free(h, LEVEL_NORMAL).unwrap();
        if let Some(r) = rt {
            self.retains.push((self.now + r.ttl_ms, session));
        }
        if release != 0 {
            self.leases.retain(|l| l.session != release);
            self.retains.retain(|r| r.1 != release);
        }
    }

    fn step(&mut self, pick: u16) -> bool {
        if self.live.is_empty() {
            return true;
        }
        let i = pick as usize % self.live.len();
        let (h, _, prompt, computed, ..) = self.live[i].clone();
        let args = AllocateArgs {
            num_new_tokens: 1,
            num_computed_tokens: computed,
            num_prompt_tokens: prompt,
            num_tokens: computed + 1,
            ..Default::default()
        };
        if self.alloc(h, &args, NewComputed::Empty) {
            self.live[i].3 += 1;
            if self.live[i].3 >= prompt + 6 {
                self.finish(i);
            }
            true
        } else {
            self.finish(i);
            false
        }
    }

    fn finish(&mut self, i: usize) {
        let (h, _, _, _, rt, session, release) = self.live.swap_remove(i);
        self.free_request(h, rt, session, release);
    }

    fn clock(&mut self, dt: u16) {
        self.now += dt as u64;
        self.a.advance_clock(self.now).unwrap();
        let now = self.now;
        self.leases.retain(|l| l.expiry > now);
        self.retains.retain(|r| r.0 > now);
    }

    fn check(&self) {
        invariants::check(&self.a).unwrap();
        let r = self.a.pool().retention().unwrap();
        let running = self.running_keys();
        for l in &self.leases {
            for k in &l.keys {
                assert!(r.is_leased_key(k), "key {k:?} of a running lease is not leased");
            }
        }
        let s = self.a.hint_stats();
        assert_eq!(s.leased_keys as usize, running.len(), "leased keys");
        assert_eq!(s.live_holds as usize, self.leases.len() + self.retains.len(), "live holds");
        assert!(running.len() <= r.pinned_cap() as usize, "leased keys past the pinned share");
    }
}

/// The pool's block under `key`, a lookup's (test helper over the public lookup).
trait IndexGet {
    fn index_get(&self, key: &(BlockHash, u32)) -> Option<BlockId>;
}

impl IndexGet for BlockPool {
    fn index_get(&self, key: &(BlockHash, u32)) -> Option<BlockId> {
        let mut out = Vec::new();
        self.get_cached_block(&key.0, &[key.1], &mut out).then(|| out[0])
    }
}

#[derive(Clone, Debug)]
enum Op {
    Add { family: u8, own: u8, lease: Option<u16>, retain: Option<(u8, u16)>, session: u8, release: bool },
    Step { pick: u16, n: u8 },
    Clock(u16),
    Release(u8),
    Share(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<u8>(), any::<u8>(), proptest::option::of(any::<u16>()), proptest::option::of((any::<u8>(), any::<u16>())), any::<u8>(), proptest::bool::weighted(0.15))
            .prop_map(|(family, own, lease, retain, session, release)| Op::Add { family, own, lease, retain, session, release }),
        6 => (any::<u16>(), 1u8..8).prop_map(|(pick, n)| Op::Step { pick, n }),
        3 => (0u16..300).prop_map(Op::Clock),
        1 => any::<u8>().prop_map(Op::Release),
        1 => any::<u8>().prop_map(Op::Share),
    ]
}

/// Runs `ops` on a pool of `blocks` blocks (see the property test), checking after each.
fn run_ops(ops: &[Op], blocks: u32) -> Model {
    let mut m = Model {
        a: hit_aware(&[AttentionKind::Full, swa(WINDOW)], blocks),
        now: 0,
        leases: Vec::new(),
        retains: Vec::new(),
        live: Vec::new(),
        next: 1,
        leased_evictions: 0,
    };
    for o in ops {
        match *o {
            Op::Add { family, own, lease, retain, session, release } => {
                m.add(family, own, lease, retain, session, release)
            }
            Op::Step { pick, n } => {
                for _ in 0..n {
                    m.step(pick);
                }
            }
            Op::Clock(dt) => m.clock(dt),
            Op::Release(s) => {
                let s = s as u64 % 3;
                if s != 0 {
                    m.a.release_session(s).unwrap();
                    m.leases.retain(|l| l.session != s);
                    m.retains.retain(|r| r.1 != s);
                }
            }
            Op::Share(x) => {
                // Refused (and nothing changes) when below the keys pinned.
                let _ = m.a.set_pinned_share(x as f64 / 255.0);
            }
        }
        m.check();
    }
    while !m.live.is_empty() {
        m.finish(0);
        m.check();
    }
    m
}

#[test]
fn ops_generator_takes_refuses_expires_and_releases_leases_and_evicts_leased_blocks() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut total, mut evicted) = (hybrid_alloc::policy::HintStats::default(), 0u64);
    for _ in 0..32 {
        let ops = proptest::collection::vec(op(), 60..120).new_tree(&mut runner).unwrap().current();
        let m = run_ops(&ops, 32);
        let s = m.a.hint_stats();
        total.leases_applied += s.leases_applied;
        total.leases_refused_over_cap += s.leases_refused_over_cap;
        total.leases_expired += s.leases_expired;
        total.leases_released += s.leases_released;
        total.retains_expired += s.retains_expired;
        total.retains_released += s.retains_released;
        evicted += m.leased_evictions;
    }
    assert!(total.leases_applied > 50 && total.leases_refused_over_cap > 5, "{total:?}");
    assert!(total.leases_expired > 10 && total.leases_released > 5, "{total:?}");
    assert!(total.retains_expired > 10 && total.retains_released > 5, "{total:?}");
    assert!(evicted > 0, "no leased block was ever evicted: the eviction check proves nothing");
}

fn cases() -> u32 {
    common::proptest_cases(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn leases_expire_release_and_respect_the_share_and_a_leased_block_outlives_lower_ones(
        ops in proptest::collection::vec(op(), 1..120),
        blocks in 24u32..64,
    ) {
        run_ops(&ops, blocks);
    }
}
