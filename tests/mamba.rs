//! Deterministic integration tests of Mamba groups (vLLM's `MambaManager`), circular
//! buffers and KV cache zeroing in the coordinator: the positional align-mode table (null
//! padding, the running state block, the previous state recycled one step later), hits on
//! the last cached state, the same-step deferral, a KV connector's per-group hit (full
//! attention deeper than Mamba) and its adoption, mode "none" with speculative state
//! blocks, zeroing records, and bad inputs that must fail without changing anything.

mod common;

use common::{chain_from, hash_bytes};
use hybrid_alloc::invariants;
use hybrid_alloc::policy::LEVEL_NORMAL;
use hybrid_alloc::{
    AllocateArgs, Allocator, AttentionKind, BlockCountArgs, BlockHash, BlockId, CacheBlocksArgs, Config, Error,
    GroupSpec, NewComputed, Policy, ReqHandle, NULL_BLOCK,
};

const BS: u32 = 16;

fn mamba(align: bool, speculative_blocks: u32) -> AttentionKind {
    AttentionKind::Mamba { speculative_blocks, align, rekey_cached_tail: true, checkpoint_alignment: 0 }
}

fn config(kinds: &[(AttentionKind, u32)], num_blocks: u32, caching: bool, zero: bool) -> Config {
    let groups = kinds
        .iter()
        .enumerate()
        .map(|(i, &(kind, block_size))| GroupSpec { kind, block_size, spec_key: i as u32 })
        .collect();
    Config {
        scheduler_block_size: kinds.iter().map(|k| k.1).max().unwrap(),
        enable_caching: caching,
        zero_new_blocks: zero,
        ..common::config(num_blocks, groups, BS)
    }
}

/// The hash bytes of a request of `n` tokens whose prefix is identified by `seed`.
fn chain(n: u32, seed: u64) -> Vec<u8> {
    let contents: Vec<u64> = (1..=(n / BS) as u64).collect();
    let hashes: Vec<BlockHash> = chain_from(seed, &contents).into_iter().map(BlockHash::from_u64).collect();
    hash_bytes(&hashes)
}

fn add(a: &mut Allocator, num_tokens: u32, seed: u64) -> ReqHandle {
    let h = a.add_request();
    a.append_hashes(h, &chain(num_tokens, seed), 8).unwrap();
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

fn table(a: &Allocator, h: ReqHandle, g: usize) -> Vec<BlockId> {
    a.blocks(h, g).unwrap().to_vec()
}

fn ok(a: &Allocator) {
    invariants::check(a).unwrap();
}

#[test]
fn allocate_slots_mamba_align_pads_nulls_and_recycles_the_previous_state() {
    let mut a =
        Allocator::new(config(&[(AttentionKind::Full, BS), (mamba(true, 0), BS)], 64, true, true), Policy::Exact)
            .unwrap();
    let h = add(&mut a, 100, 1);
    // A 48-token chunk: full attention takes 3 blocks, Mamba 2 nulls and one state block.
    assert!(a.allocate_slots(h, &args(48, 0, 100, 100), NewComputed::Empty, None).unwrap().is_some());
    let t = table(&a, h, 1);
    assert_eq!(&t[..2], &[NULL_BLOCK, NULL_BLOCK]);
    assert_ne!(t[2], NULL_BLOCK);
    assert_eq!(a.new_block_counts(), &[3, 3], "the null padding is reported as new blocks, as vLLM does");
    assert_eq!(a.new_block_ids()[3..5], [NULL_BLOCK, NULL_BLOCK]);
    // The state at token 48 is cached under the hash of block 2.
    assert!(a.pool().block_hash(t[2]).is_some());
    // Only the attention group's blocks are reported for zeroing.
    let zeroed = a.take_new_block_ids();
    assert_eq!(zeroed, table(&a, h, 0));
    assert!(a.take_new_block_ids().is_empty());
    ok(&a);
    // The next chunk (48 more tokens): nulls up to the new state block; the old state stays
    // one more step (the new one is filled from it).
    assert!(a.allocate_slots(h, &args(48, 48, 100, 100), NewComputed::Empty, None).unwrap().is_some());
    let t2 = table(&a, h, 1);
    assert_eq!(t2.len(), 6);
    assert_eq!(t2[2], t[2]);
    assert_eq!(&t2[3..5], &[NULL_BLOCK, NULL_BLOCK]);
    ok(&a);
    // Once the second chunk is processed, the state block of the first one is freed.
    let free = a.num_free_blocks();
    a.remove_skipped_blocks(h, 96, None).unwrap();
    assert_eq!(table(&a, h, 1)[2], NULL_BLOCK);
    assert_eq!(a.num_free_blocks(), free + 1);
    ok(&a);
    a.free(h, LEVEL_NORMAL).unwrap();
    ok(&a);
    assert_eq!(a.num_free_blocks(), 63);
}

#[test]
fn find_longest_cache_hit_mamba_align_hits_the_last_cached_state_and_defers_it_within_a_step() {
    let mut a =
        Allocator::new(config(&[(AttentionKind::Full, BS), (mamba(true, 0), BS)], 64, true, false), Policy::Exact)
            .unwrap();
    let r1 = add(&mut a, 80, 7);
    assert!(a.allocate_slots(r1, &args(64, 0, 80, 80), NewComputed::Empty, None).unwrap().is_some());
    let state = table(&a, r1, 1)[3];
    let r2 = add(&mut a, 80, 7);
    let hit = a.find_longest_cache_hit(r2, 79).unwrap();
    assert_eq!(hit.num_tokens, 64);
    assert_eq!(a.stored_hit(r2, 1).unwrap(), &[NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, state]);
    let mut x = args(16, 0, 80, 80);
    x.num_new_computed_tokens = 64;
    // The state was cached in this step: the hit waits for the next one (vLLM answers
    // "does not fit" with num_gpu_blocks + 1).
    assert_eq!(
        a.get_num_blocks_to_allocate(
            r2,
            &BlockCountArgs {
                num_tokens: 80,
                num_tokens_main_model: 80,
                num_encoder_tokens: 0,
                total_computed_tokens: 0,
                apply_admission_cap: false,
                prefill_end: 0
            }
        )
        .unwrap(),
        5 + 1
    );
    assert_eq!(a.allocate_slots(r2, &x, NewComputed::Stored, None).unwrap(), None);
    assert!(table(&a, r2, 0).is_empty());
    // Next step: the scheduler looks the hit up again and adopts it.
    a.new_step_starts();
    assert_eq!(a.find_longest_cache_hit(r2, 79).unwrap().num_tokens, 64);
    assert!(a.allocate_slots(r2, &x, NewComputed::Stored, None).unwrap().is_some());
    assert_eq!(&table(&a, r2, 1)[..4], &[NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, state]);
    assert_eq!(a.pool().ref_cnt(state), 2);
    ok(&a);
}

#[test]
fn allocate_slots_mamba_partial_hit_is_refused_unchanged() {
    let mut a =
        Allocator::new(config(&[(AttentionKind::Full, BS), (mamba(true, 0), BS)], 64, true, false), Policy::Exact)
            .unwrap();
    let r1 = add(&mut a, 80, 3);
    a.allocate_slots(r1, &args(64, 0, 80, 80), NewComputed::Empty, None).unwrap();
    a.new_step_starts();
    let r2 = add(&mut a, 80, 3);
    a.find_longest_cache_hit(r2, 79).unwrap();
    let free = a.num_free_blocks();
    let mut x = args(8, 8, 80, 80);
    x.num_new_computed_tokens = 64;
    let e = a.allocate_slots(r2, &x, NewComputed::Stored, None).unwrap_err();
    assert!(matches!(e, Error::OutOfRange(_)), "{e}");
    assert_eq!(a.num_free_blocks(), free);
    assert!(table(&a, r2, 1).is_empty());
    ok(&a);
}

#[test]
fn connector_per_group_hit_lets_full_attention_run_deeper_and_allocate_slots_adopts_it() {
    let mut a =
        Allocator::new(config(&[(AttentionKind::Full, BS), (mamba(true, 0), BS)], 64, true, false), Policy::Exact)
            .unwrap();
    // r1 computes 64 tokens in one chunk: full attention caches 4 blocks, Mamba one state (at 64).
    let r1 = add(&mut a, 80, 7);
    a.allocate_slots(r1, &args(64, 0, 80, 80), NewComputed::Empty, None).unwrap();
    a.new_step_starts();
    let fa1 = table(&a, r1, 0);
    // r2, the first 64 tokens of the same prompt, looks up at most 63 tokens: full attention
    // hits 3 blocks, the Mamba group nothing (its only state is at 64).
    let r2 = add(&mut a, 64, 7);
    assert_eq!(a.find_longest_cache_hit_per_group(r2, None, 63).unwrap(), vec![48, 0]);
    let c = a.get_computed_blocks_for_connector(r2, None, 63).unwrap();
    assert_eq!((c.hit.num_tokens, c.hit.num_uncached_common_prefix_tokens), (48, 0));
    assert_eq!(c.per_group, Some(vec![48, 0]));
    assert!(c.diverged());
    assert_eq!(a.stored_hit(r2, 0).unwrap(), &fa1[..3]);
    assert!(a.stored_hit(r2, 1).unwrap().is_empty());
    // The reconciled hit (`get_computed_blocks`) agrees on nothing, the shared prefix uncached.
    let h = a.get_computed_blocks(r2, None, 63).unwrap();
    assert_eq!((h.num_tokens, h.num_uncached_common_prefix_tokens), (0, 48));
    // A full-attention group shorter than the hit's tokens is refused, unchanged.
    let free = a.num_free_blocks();
    let mut x = args(1, 0, 64, 64);
    x.num_new_computed_tokens = 48;
    x.num_external_computed_tokens = 15;
    x.delay_cache_blocks = true;
    let short = vec![fa1[..2].to_vec(), vec![]];
    let e = a.allocate_slots(r2, &x, NewComputed::Explicit(&short), None).unwrap_err();
    assert!(matches!(e, Error::OutOfRange(_)), "{e}");
    assert_eq!(a.num_free_blocks(), free);
    // Without external tokens nothing would write the lagging Mamba group's state at 48
    // (vLLM's scheduler then takes the reconciled hit instead): refused, unchanged.
    a.get_computed_blocks_for_connector(r2, None, 63).unwrap();
    let mut no_ext = x;
    (no_ext.num_external_computed_tokens, no_ext.num_new_tokens) = (0, 16);
    let e = a.allocate_slots(r2, &no_ext, NewComputed::Stored, None).unwrap_err();
    assert!(matches!(e, Error::OutOfRange(_)) && e.to_string().contains("group 1"), "{e}");
    assert_eq!(a.num_free_blocks(), free);
    assert!(table(&a, r2, 0).is_empty() && table(&a, r2, 1).is_empty());
    // Adopted as vLLM's manager adopts it with 15 external tokens: the lagging Mamba group's
    // (empty) hit is skipped, its table nulls up to the block the external state goes to (the
    // external tokens' blocks are the tables', not the call's new blocks).
    a.get_computed_blocks_for_connector(r2, None, 63).unwrap();
    assert_eq!(a.allocate_slots(r2, &x, NewComputed::Stored, None).unwrap(), Some(0));
    assert_eq!(&table(&a, r2, 0)[..3], &fa1[..3]);
    assert_eq!(table(&a, r2, 0).len(), 4);
    assert_eq!(&table(&a, r2, 1)[..3], &[NULL_BLOCK; 3]);
    assert_ne!(table(&a, r2, 1)[3], NULL_BLOCK);
    assert_eq!(a.num_free_blocks(), free - 2);
    assert_eq!(a.pool().ref_cnt(fa1[0]), 2);
    ok(&a);
    a.free(r2, LEVEL_NORMAL).unwrap();
    a.free(r1, LEVEL_NORMAL).unwrap();
    ok(&a);
}

#[test]
fn allocate_slots_mamba_none_keeps_one_state_and_speculative_blocks() {
    let mut a =
        Allocator::new(config(&[(AttentionKind::Full, BS), (mamba(false, 2), 4096)], 64, false, true), Policy::Exact)
            .unwrap();
    let h = add(&mut a, 40, 1);
    assert_eq!(
        a.get_num_blocks_to_allocate(
            h,
            &BlockCountArgs {
                num_tokens: 40,
                num_tokens_main_model: 40,
                num_encoder_tokens: 0,
                total_computed_tokens: 0,
                apply_admission_cap: false,
                prefill_end: 0
            }
        )
        .unwrap(),
        3 + 3
    );
    assert_eq!(a.allocate_slots(h, &args(40, 0, 40, 40), NewComputed::Empty, None).unwrap(), Some(6));
    assert_eq!(table(&a, h, 1).len(), 3, "one state block and two speculative ones");
    assert_eq!(a.take_new_block_ids(), table(&a, h, 0), "Mamba state blocks are not zeroed");
    // Decoding never needs another state block.
    for n in 40..200 {
        a.allocate_slots(h, &args(1, n, 40, n + 1), NewComputed::Empty, None).unwrap().unwrap();
    }
    assert_eq!(table(&a, h, 1).len(), 3);
    ok(&a);
    // Re-recording for zeroing from a block-aligned token: the attention blocks from there.
    a.take_new_block_ids();
    a.record_blocks_for_zeroing(h, 32).unwrap();
    assert_eq!(a.take_new_block_ids(), table(&a, h, 0)[2..].to_vec());
    assert!(a.record_blocks_for_zeroing(h, 5).is_err());
    assert!(a.take_new_block_ids().is_empty(), "a refused call records nothing");
}

#[test]
fn allocate_slots_circular_buffer_claims_one_block_for_life() {
    let mut a = Allocator::new(
        config(&[(AttentionKind::Full, BS), (AttentionKind::CircularBuffer, 8)], 64, true, true),
        Policy::Exact,
    )
    .unwrap();
    let h = add(&mut a, 64, 1);
    assert_eq!(a.allocate_slots(h, &args(64, 0, 64, 64), NewComputed::Empty, None).unwrap(), Some(5));
    assert_eq!(table(&a, h, 1).len(), 1);
    assert_eq!(a.take_new_block_ids(), table(&a, h, 0), "the ring is not zeroed");
    assert!(a.pool().block_hash(table(&a, h, 1)[0]).is_none(), "the ring is never cached");
    a.allocate_slots(h, &args(16, 64, 64, 80), NewComputed::Empty, None).unwrap().unwrap();
    assert_eq!(table(&a, h, 1).len(), 1);
    ok(&a);
}

#[test]
fn dcp_turns_partial_hits_on_with_a_mamba_block_equal_to_the_hash_block() {
    // Decode context parallelism 2: full attention's block scaled to 2 x BS beside a replicated
    // Mamba "align" group of BS, hashed at BS. vLLM's coordinator accepts the equal Mamba block
    // under DCP (`partial_hash_hits_enabled`): hits end at hash boundaries inside the scaled
    // full-attention block, which is copied on write.
    let base = config(&[(AttentionKind::Full, 2 * BS), (mamba(true, 0), BS)], 64, true, false);
    assert!(!base.partial_hash_hits(), "without DCP an equal Mamba block turns nothing on");
    let c = Config { dcp_world_size: 2, ..base.clone() };
    assert!(c.partial_hash_hits());
    assert_eq!(c.cache_hit_alignment_tokens(), BS);
    let mut a = Allocator::new(c, Policy::Exact).unwrap();
    // A prompt of 3 x BS + 1 tokens, its prefill stopping at 3 x BS (the scheduler's split at
    // the prompt's last hash boundary), then a second request with the same prompt: the hit
    // ends at 3 x BS, inside the second full-attention block (tokens 2 x BS .. 4 x BS).
    let h = add(&mut a, 3 * BS + 1, 1);
    a.allocate_slots(h, &args(3 * BS, 0, 3 * BS + 1, 3 * BS + 1), NewComputed::Empty, None).unwrap().unwrap();
    a.new_step_starts();
    a.allocate_slots(h, &args(1, 3 * BS, 3 * BS + 1, 3 * BS + 1), NewComputed::Empty, None).unwrap().unwrap();
    a.free(h, LEVEL_NORMAL).unwrap();
    a.new_step_starts();
    let g = add(&mut a, 3 * BS + 1, 1);
    let hit = a.get_computed_blocks(g, None, 3 * BS).unwrap();
    assert_eq!(hit.num_tokens, 3 * BS, "the hit ends at a hash boundary inside a full-attention block");
    let mut x = args(1, 0, 3 * BS + 1, 3 * BS + 1);
    x.num_new_computed_tokens = 3 * BS;
    a.allocate_slots(g, &x, NewComputed::Stored, None).unwrap().unwrap();
    assert_eq!(a.take_kv_cache_block_copies().len(), 2, "the partial full-attention block is copied on write");
    ok(&a);
    assert!(Allocator::new(Config { dcp_world_size: 0, ..base }, Policy::Exact).is_err());
}

#[test]
fn config_mamba_align_with_partial_hits_or_checkpoints_inside_a_block_is_unsupported() {
    // A Mamba block over the hash block turns on vLLM's partial hash hits: served.
    let c = config(&[(AttentionKind::Full, BS), (mamba(true, 0), 2 * BS)], 64, true, false);
    assert!(c.partial_hash_hits());
    assert_eq!(c.cache_hit_alignment_tokens(), BS);
    assert!(Allocator::new(c, Policy::Exact).is_ok());
    // ... but not beside a group vLLM cannot look up at hash granularity (a sliding window
    // larger than the hash block): vLLM turns partial hits off, and the Mamba block over the
    // hash block is refused.
    let sw = AttentionKind::SlidingWindow { window: 4 * BS, extra_retained_tokens: 0 };
    let c = config(&[(sw, 2 * BS), (mamba(true, 0), 2 * BS)], 64, true, false);
    assert!(!c.partial_hash_hits());
    assert!(matches!(Allocator::new(c, Policy::Exact), Err(Error::Unsupported(_))));
    // Speculative state blocks are served.
    let c = config(&[(AttentionKind::Full, BS), (mamba(true, 1), BS)], 64, true, false);
    assert!(Allocator::new(c, Policy::Exact).is_ok());
    // Prefill checkpoints need the Mamba block to be the scheduler block.
    let ckpt =
        AttentionKind::Mamba { speculative_blocks: 0, align: true, rekey_cached_tail: false, checkpoint_alignment: 1 };
    let mut c = config(&[(AttentionKind::Full, BS), (ckpt, BS)], 64, true, false);
    c.scheduler_block_size = 2 * BS;
    assert!(matches!(Allocator::new(c, Policy::Exact), Err(Error::Unsupported(_))));
    // Lookahead hashes over one token or more are served (more key some checkpoints one block
    // before the end of the block reserved for them, as vLLM does).
    let mut c = config(&[(AttentionKind::Full, BS), (ckpt, BS)], 64, true, false);
    for lookahead in [1, 2, 3] {
        c.hash_lookahead_tokens = lookahead;
        assert!(Allocator::new(c.clone(), Policy::Exact).is_ok());
    }
    let c = config(&[(AttentionKind::Full, BS), (mamba(false, 0), BS)], 64, true, false);
    assert!(matches!(Allocator::new(c, Policy::Exact), Err(Error::Unsupported(_))));
    let c = config(&[(AttentionKind::Full, BS), (mamba(true, 0), BS)], 64, false, false);
    assert!(matches!(Allocator::new(c, Policy::Exact), Err(Error::Unsupported(_))));
}

#[test]
fn allocate_slots_mamba_align_relocates_speculative_blocks_past_the_new_running_state() {
    let mut a =
        Allocator::new(config(&[(AttentionKind::Full, BS), (mamba(true, 2), BS)], 64, true, false), Policy::Exact)
            .unwrap();
    let h = add(&mut a, 100, 5);
    // First allocation: running state plus two scratch blocks (cap 1 + 2).
    assert!(a.allocate_slots(h, &args(20, 0, 100, 100), NewComputed::Empty, None).unwrap().is_some());
    let t = table(&a, h, 1);
    assert_eq!(t.len(), 1 + 2 + 1, "null, running state, two scratch blocks");
    assert_eq!(t[0], NULL_BLOCK);
    // A decode-sized step within the table allocates nothing.
    let lim = a.noop_limits(h).unwrap();
    assert_eq!(lim.slots, 2 * BS, "the scratch blocks hold no token slots");
    // Into block 2: the first scratch block becomes the running state, one new block
    // completes the two scratch blocks.
    assert!(a.allocate_slots(h, &args(20, 20, 100, 100), NewComputed::Empty, None).unwrap().is_some());
    let t2 = table(&a, h, 1);
    assert_eq!(t2.len(), 3 + 2);
    assert_eq!(t2[2], t[2], "the scratch block at the new running index stays");
    assert_eq!(t2[3], t[3]);
    ok(&a);
    // Into block 4, skipping block 3: the scratch block left at index 3 moves to the end
    // (vLLM's `_relocate_speculative_block`), index 3 becomes null.
    assert!(a.allocate_slots(h, &args(32, 40, 100, 100), NewComputed::Empty, None).unwrap().is_some());
    let t3 = table(&a, h, 1);
    assert_eq!(t3.len(), 5 + 2);
    assert_eq!(t3[3], NULL_BLOCK);
    assert_eq!(t3[4], t2[4]);
    assert_eq!(t3[5], t[3]);
    ok(&a);
    a.free(h, LEVEL_NORMAL).unwrap();
    ok(&a);
    assert_eq!(a.num_free_blocks(), 63);
}

#[test]
fn allocate_slots_mamba_align_reserves_a_prefill_checkpoint_block_before_the_running_state() {
    let ckpt =
        AttentionKind::Mamba { speculative_blocks: 0, align: true, rekey_cached_tail: true, checkpoint_alignment: 1 };
    let mut a =
        Allocator::new(config(&[(AttentionKind::Full, BS), (ckpt, BS)], 64, true, false), Policy::Exact).unwrap();
    let h = add(&mut a, 100, 3);
    // 40 tokens from 0: the checkpoint at 32 (column 1) gets a block of its own before the
    // running state block (vLLM pads nulls only up to it), and is keyed at 32.
    assert_eq!(
        a.get_num_blocks_to_allocate(
            h,
            &BlockCountArgs {
                num_tokens: 40,
                num_tokens_main_model: 40,
                num_encoder_tokens: 0,
                total_computed_tokens: 0,
                apply_admission_cap: true,
                prefill_end: 0
            }
        )
        .unwrap(),
        3 + 2
    );
    assert!(a.allocate_slots(h, &args(40, 0, 100, 100), NewComputed::Empty, None).unwrap().is_some());
    let t = table(&a, h, 1);
    assert_eq!(t.len(), 3);
    assert_eq!(t[0], NULL_BLOCK);
    assert!(t[1] != NULL_BLOCK && t[2] != NULL_BLOCK);
    assert_eq!(a.pool().block_hash_num_tokens(t[1]), 32);
    // The reserved checkpoint is dropped by the next count, which a no-op answer would skip.
    let lim = a.noop_limits(h).unwrap();
    assert_eq!((lim.slots, lim.new_tokens), (0, BS));
    ok(&a);
    // A chunk starting inside a block reserves none: one state block, nulls before it. The
    // checkpoint block is recycled first (it stays cached in the free queue).
    assert!(a.allocate_slots(h, &args(40, 40, 100, 100), NewComputed::Empty, None).unwrap().is_some());
    let t2 = table(&a, h, 1);
    assert_eq!(t2.len(), 5);
    assert_eq!(&t2[..3], &[NULL_BLOCK, NULL_BLOCK, t[2]]);
    assert_eq!(t2[3], NULL_BLOCK);
    assert_eq!(a.pool().block_hash_num_tokens(t[1]), 32);
    assert!(a.noop_limits(h).unwrap().slots > 0);
    ok(&a);
    a.free(h, LEVEL_NORMAL).unwrap();
    ok(&a);
}

#[test]
fn allocate_slots_mamba_align_keys_a_lookahead_checkpoint_a_block_before_its_reserved_block_ends() {
    // vLLM 0.33's lookahead block hashes over two tokens (multi-module MTP): a chunk of 33
    // tokens proves the state at 16 only (`33 - 2` floored to the block), yet reserves its
    // checkpoint block at column `cdiv(33, 16) - 2 = 1`, the block ending at 32. vLLM keys it
    // at 16, replacing the full-block key (32) this step's caching gave it
    // (`cache_partial_block(replace_existing_hashes=True)`).
    let ckpt =
        AttentionKind::Mamba { speculative_blocks: 0, align: true, rekey_cached_tail: false, checkpoint_alignment: 1 };
    let mut c = config(&[(AttentionKind::Full, BS), (ckpt, BS)], 64, true, false);
    c.hash_lookahead_tokens = 2;
    let mut a = Allocator::new(c, Policy::Exact).unwrap();
    let h = add(&mut a, 100, 3);
    assert!(a.allocate_slots(h, &args(33, 0, 100, 100), NewComputed::Empty, None).unwrap().is_some());
    let t = table(&a, h, 1);
    assert_eq!(t.len(), 3);
    assert_eq!(t[0], NULL_BLOCK);
    assert!(t[1] != NULL_BLOCK && t[2] != NULL_BLOCK);
    assert_eq!(a.pool().block_hash_num_tokens(t[1]), 16, "keyed at the checkpoint, not at its block's end");
    ok(&a);
    // A request with the same prefix hits that state at 16 tokens (the block at index 0), not
    // at 32: no Mamba state is keyed for 32 tokens.
    a.new_step_starts();
    let r2 = add(&mut a, 100, 3);
    assert_eq!(a.find_longest_cache_hit(r2, 99).unwrap().num_tokens, 16);
    assert_eq!(a.stored_hit(r2, 1).unwrap(), &[t[1]]);
    let mut x = args(40, 0, 100, 100);
    x.num_new_computed_tokens = 16;
    assert!(a.allocate_slots(r2, &x, NewComputed::Stored, None).unwrap().is_some());
    assert_eq!(table(&a, r2, 1)[0], t[1]);
    ok(&a);
    a.free(h, LEVEL_NORMAL).unwrap();
    a.free(r2, LEVEL_NORMAL).unwrap();
    ok(&a);
    assert_eq!(a.num_free_blocks(), 63);
}

#[test]
fn take_boundary_state_offloads_hands_each_keyed_state_once_and_drops_a_freed_request() {
    let kinds = [(AttentionKind::Full, BS), (mamba(true, 0), BS), (mamba(true, 0), BS)];
    // Off (no KV connector): nothing is recorded.
    let mut off = Allocator::new(config(&kinds, 64, true, false), Policy::Exact).unwrap();
    let h = add(&mut off, 100, 1);
    off.allocate_slots(h, &args(48, 0, 100, 100), NewComputed::Empty, None).unwrap().unwrap();
    assert!(off.take_boundary_state_offloads().is_empty());

    let mut cfg = config(&kinds, 64, true, false);
    cfg.boundary_offloads = true;
    let mut a = Allocator::new(cfg, Policy::Exact).unwrap();
    let r1 = add(&mut a, 100, 1);
    let r2 = add(&mut a, 100, 2);
    // A 48-token chunk each: every Mamba group keys its state at token 48 (the null slots
    // before it are not offered).
    a.allocate_slots(r1, &args(48, 0, 100, 100), NewComputed::Empty, None).unwrap().unwrap();
    a.allocate_slots(r2, &args(48, 0, 100, 100), NewComputed::Empty, None).unwrap().unwrap();
    let (s1, s2) = (table(&a, r1, 1)[2], table(&a, r2, 1)[2]);
    let (t1, t2) = (table(&a, r1, 2)[2], table(&a, r2, 2)[2]);
    // Group by group, each in the order its states were keyed.
    assert_eq!(
        a.take_boundary_state_offloads(),
        vec![r1, 1, s1 as u64, 48, r2, 1, s2 as u64, 48, r1, 2, t1 as u64, 48, r2, 2, t2 as u64, 48]
    );
    assert!(a.take_boundary_state_offloads().is_empty(), "drained");
    // The next chunk of r1 keys its state at 96; r2's is dropped with its blocks (a
    // preemption frees them before the scheduler takes the offloads).
    a.allocate_slots(r1, &args(48, 48, 100, 100), NewComputed::Empty, None).unwrap().unwrap();
    a.allocate_slots(r2, &args(48, 48, 100, 100), NewComputed::Empty, None).unwrap().unwrap();
    a.free(r2, LEVEL_NORMAL).unwrap();
    let s = table(&a, r1, 1)[5];
    let t = table(&a, r1, 2)[5];
    assert_eq!(a.take_boundary_state_offloads(), vec![r1, 1, s as u64, 96, r1, 2, t as u64, 96]);
    // A request adopting a hit offers nothing for the hit's states (already cached).
    a.new_step_starts();
    let r3 = add(&mut a, 100, 1);
    assert_eq!(a.find_longest_cache_hit(r3, 99).unwrap().num_tokens, 96);
    let mut x = args(4, 0, 100, 100);
    x.num_new_computed_tokens = 96;
    a.allocate_slots(r3, &x, NewComputed::Stored, None).unwrap().unwrap();
    assert!(a.take_boundary_state_offloads().is_empty());
    ok(&a);
}

#[test]
fn partial_hash_hits_copy_the_shared_tail_blocks_on_write_and_move_a_running_tail_key() {
    // Full attention and Mamba "align" at two hash blocks each: vLLM's partial hash hits.
    let mut a = Allocator::new(
        config(&[(AttentionKind::Full, 2 * BS), (mamba(true, 0), 2 * BS)], 64, true, false),
        Policy::Exact,
    )
    .unwrap();
    assert!(a.config().partial_hash_hits());
    // r1: a prompt of 3 hash blocks and a token; its first chunk ends at the prompt's last
    // hash boundary (48 tokens, inside block 1): both groups key block 1 there.
    let r1 = add(&mut a, 3 * BS + 1, 11);
    a.allocate_slots(r1, &args(3 * BS, 0, 3 * BS + 1, 3 * BS + 1), NewComputed::Empty, None).unwrap().unwrap();
    let (fa1, st1) = (table(&a, r1, 0), table(&a, r1, 1));
    assert_eq!(a.pool().block_hash_num_tokens(fa1[1]), 3 * BS);
    assert_eq!(a.pool().block_hash_num_tokens(st1[1]), 3 * BS);
    assert!(a.take_kv_cache_block_copies().is_empty());
    a.new_step_starts();
    // r2 shares those 48 tokens: a hit ending inside block 1 in both groups.
    let r2 = add(&mut a, 4 * BS + 1, 11);
    let hit = a.find_longest_cache_hit(r2, 4 * BS).unwrap();
    assert_eq!(hit.num_tokens, 3 * BS);
    assert_eq!(a.stored_hit(r2, 0).unwrap(), &fa1[..2]);
    assert_eq!(a.stored_hit(r2, 1).unwrap(), &[NULL_BLOCK, st1[1]]);
    let free = a.num_free_blocks();
    let mut x = args(BS + 1, 0, 4 * BS + 1, 4 * BS + 1);
    x.num_new_computed_tokens = 3 * BS;
    a.allocate_slots(r2, &x, NewComputed::Stored, None).unwrap().unwrap();
    // Each group's shared tail block is replaced by a private copy; both ends of each copy
    // hold one more reference until given back.
    let (fa2, st2) = (table(&a, r2, 0), table(&a, r2, 1));
    assert_eq!(fa2[0], fa1[0]);
    assert!(fa2[1] != fa1[1] && st2[1] != st1[1]);
    let copies = a.take_kv_cache_block_copies();
    assert_eq!(copies, vec![fa1[1], fa2[1], st1[1], st2[1]]);
    assert_eq!(a.pool().ref_cnt(fa1[1]), 2, "r1's table and the copy's source");
    assert_eq!(a.pool().ref_cnt(fa2[1]), 2, "r2's table and the copy's destination");
    assert_eq!(free - a.num_free_blocks(), 4, "two copies and each group's next block");
    a.free_block_ids(&copies).unwrap();
    assert_eq!(a.pool().ref_cnt(fa1[1]), 1);
    assert!(a.free_block_ids(&copies).is_err(), "a retained reference is given back once");
    ok(&a);
    // r1 runs on: its own partial tail (a state it overwrites next) is copied and the key
    // moves to the copy, r1 staying on its block.
    a.new_step_starts();
    a.allocate_slots(r1, &args(1, 3 * BS, 3 * BS + 1, 3 * BS + 1), NewComputed::Empty, None).unwrap().unwrap();
    let copies = a.take_kv_cache_block_copies();
    assert_eq!(copies.len(), 2);
    assert_eq!(copies[0], st1[1]);
    assert_eq!(table(&a, r1, 1)[1], st1[1]);
    assert_eq!(a.pool().block_hash_num_tokens(copies[1]), 3 * BS);
    assert!(a.pool().block_hash(st1[1]).is_none());
    a.free_block_ids(&copies).unwrap();
    ok(&a);
}

#[test]
fn finalize_partial_tail_offloads_returns_a_producer_tail_once_and_the_copy_on_write_hands_it_over() {
    // Mamba blocks of 32 over a hash block of 16: partial hash hits. A 90-token prompt's last
    // hash boundary is 80, inside its third Mamba block: the request's own running state
    // block is keyed there (a producer's partial tail).
    let kinds = [(AttentionKind::Full, BS), (mamba(true, 0), 2 * BS)];
    let mut cfg = config(&kinds, 64, true, false);
    cfg.boundary_offloads = true;
    assert!(cfg.partial_hash_hits());
    let mut a = Allocator::new(cfg, Policy::Exact).unwrap();
    let r1 = add(&mut a, 90, 1);
    a.allocate_slots(r1, &args(80, 0, 90, 90), NewComputed::Empty, None).unwrap().unwrap();
    let tail = table(&a, r1, 1)[2];
    assert_ne!(tail, NULL_BLOCK);
    // Tokens in flight, or computed past or short of the tail: nothing, and the tail is
    // popped all the same (vLLM's rule).
    assert!(a.finalize_partial_tail_offloads(r1, 80, 1).unwrap().is_empty());
    assert!(a.finalize_partial_tail_offloads(r1, 80, 0).unwrap().is_empty(), "popped");
    let r2 = add(&mut a, 90, 2);
    a.allocate_slots(r2, &args(80, 0, 90, 90), NewComputed::Empty, None).unwrap().unwrap();
    let tail2 = table(&a, r2, 1)[2];
    assert!(a.finalize_partial_tail_offloads(r2, 79, 0).unwrap().is_empty());
    let r3 = add(&mut a, 90, 3);
    a.allocate_slots(r3, &args(80, 0, 90, 90), NewComputed::Empty, None).unwrap().unwrap();
    let tail3 = table(&a, r3, 1)[2];
    assert_eq!(a.finalize_partial_tail_offloads(r3, 80, 0).unwrap(), vec![1, tail3 as u64, 80]);
    assert!(a.finalize_partial_tail_offloads(r3, 80, 0).unwrap().is_empty(), "once");
    a.take_boundary_state_offloads();
    // A fourth producer runs on: its next allocation copies the tail on write and hands the
    // copy over as a boundary state at 80; the finish then finds nothing.
    let r4 = add(&mut a, 90, 4);
    a.allocate_slots(r4, &args(80, 0, 90, 90), NewComputed::Empty, None).unwrap().unwrap();
    a.take_boundary_state_offloads();
    a.new_step_starts();
    a.allocate_slots(r4, &args(10, 80, 90, 90), NewComputed::Empty, None).unwrap().unwrap();
    let copies = a.take_kv_cache_block_copies();
    assert_eq!(copies.len(), 2);
    assert_eq!(copies[0], table(&a, r4, 1)[2]);
    assert_eq!(a.take_boundary_state_offloads(), vec![r4, 1, copies[1] as u64, 80]);
    assert!(a.finalize_partial_tail_offloads(r4, 90, 0).unwrap().is_empty());
    // An unknown handle is refused; freeing drops a tail not yet taken.
    a.free(r2, LEVEL_NORMAL).unwrap();
    assert!(matches!(a.finalize_partial_tail_offloads(r2, 80, 0), Err(Error::UnknownRequest(_))));
    assert_ne!(tail, tail2);
    ok(&a);
}

#[test]
fn shared_prefix_checkpoint_keys_the_junction_state_in_the_chunk_that_computes_it() {
    // Full attention and Mamba "align" at four hash blocks each (vLLM's partial hash hits)
    // with vLLM's shared-prefix checkpoint: the chunk ending at the request's junction (48
    // tokens, inside block 0) keys the Mamba state there, as vLLM's
    // `MambaManager._cache_partial_tail_block` does.
    let base = config(&[(AttentionKind::Full, 4 * BS), (mamba(true, 0), 4 * BS)], 64, true, false);
    let cfg = Config { mamba_shared_prefix_checkpoint: true, ..base.clone() };
    assert!(cfg.shared_prefix_checkpoint());
    assert!(!base.shared_prefix_checkpoint(), "off without the flag");
    assert!(!Config { reprefillable_tokens: 2, ..cfg.clone() }.shared_prefix_checkpoint(), "off with MTP re-prefill");
    let one_block = config(&[(AttentionKind::Full, BS), (mamba(true, 0), BS)], 64, true, false);
    assert!(
        !Config { mamba_shared_prefix_checkpoint: true, ..one_block }.shared_prefix_checkpoint(),
        "no partial hits"
    );
    let prompt = 200;
    let junction = 3 * BS;
    for on in [true, false] {
        let mut a = Allocator::new(if on { cfg.clone() } else { base.clone() }, Policy::Exact).unwrap();
        let r = add(&mut a, prompt, 7);
        let step = |num_new: u32, computed: u32| AllocateArgs {
            shared_prefix_boundary: junction,
            ..args(num_new, computed, prompt, prompt)
        };
        a.allocate_slots(r, &step(BS, 0), NewComputed::Empty, None).unwrap().unwrap();
        let st = table(&a, r, 1);
        assert!(a.pool().block_hash(st[0]).is_none());
        // The next chunk ends at the junction inside the block the table already holds: a
        // step that allocates nothing, which must still key the state (not a no-op).
        a.new_step_starts();
        a.allocate_slots(r, &step(junction - BS, BS), NewComputed::Empty, None).unwrap().unwrap();
        let keyed = a.pool().block_hash(st[0]).is_some();
        assert_eq!(keyed, on, "flag {on}");
        if on {
            assert_eq!(a.pool().block_hash_num_tokens(st[0]), junction);
            assert!(a.pool().block_hash(table(&a, r, 0)[0]).is_none(), "full attention keys only its prompt tail");
        }
        ok(&a);
    }
    // A call that reaches the junction without computing it (the request's own count at or
    // past it, as the scheduler's `cache_blocks(request, request.num_computed_tokens)` after
    // a load) keys nothing there.
    let mut a = Allocator::new(cfg, Policy::Exact).unwrap();
    let r = add(&mut a, prompt, 7);
    let mut x = args(BS, 0, prompt, prompt);
    x.delay_cache_blocks = true;
    x.num_external_computed_tokens = junction;
    a.allocate_slots(r, &x, NewComputed::Empty, None).unwrap().unwrap();
    let c = CacheBlocksArgs {
        num_computed_tokens: junction,
        num_prompt_tokens: prompt,
        shared_prefix_boundary: junction,
        request_computed_tokens: junction,
    };
    a.cache_blocks(r, &c, None).unwrap();
    assert!(a.pool().block_hash(table(&a, r, 1)[0]).is_none());
    a.cache_blocks(r, &CacheBlocksArgs { request_computed_tokens: junction - BS, ..c }, None).unwrap();
    assert_eq!(a.pool().block_hash_num_tokens(table(&a, r, 1)[0]), junction);
    ok(&a);
}
