//! # `hybrid_alloc`
//!
//! The KV cache block allocator of vLLM V1 (every supported release, 0.32 to 0.34 as of this
//! writing: `docs/compatibility.md`), in Rust, for models whose layers mix attention types:
//! full attention, R-SWA, sliding window (with a bounded replay too), chunked local, cross attention, Mamba /
//! linear-attention state (cache modes "none" and "align"), circular buffers. Same
//! semantics as vLLM's Python `KVCacheManager` (same block ids, hits, free counts, events),
//! at a fraction of its cost. `rust/py` (feature `python`) exposes it to Python; the vLLM
//! integration lives in `python/hybrid_alloc/vllm`.
//!
//! ## Architecture
//! ```text
//!  Allocator (coordinator/)          one per vLLM KVCacheManager
//!   |- requests: slab of handles     generation, block hashes, pending cache hit, no-op limits,
//!   |                                  hit-aware's per-request state (coordinator/hit_aware.rs)
//!   |- managers[g] (manager/)        one per KV cache group: block tables, num_cached,
//!   |                                  pending copy-on-write, zeroing records; attention-type
//!   |                                  rules, each kind in its file with its per-request state
//!   |                                  (full: partial tails | R-SWA | SWA | SWA replay | chunked | cross |
//!   |                                  Mamba none/align | circular buffer); hit-aware's
//!   |                                  per-group rules (manager/retention.rs)
//!   '- BlockPool (block_pool.rs)     shared by all groups; vLLM's BlockPool, no policy
//!        |- ref_cnt / hash_tokens / loose struct of arrays, indexed by block id
//!        |- FreeQueue (free_queue.rs)     index-linked list = free list + LRU order
//!        |                                  (split into retention levels under `hit-aware`)
//!        |- PrefixIndex (prefix_index.rs) (hash, group) -> blocks, duplicates allowed;
//!        |                                  each block's hash key (one record a block)
//!        |- second keys                    partial hash hits: shorter keys of blocks keyed
//!        |                                  for a longer prefix (vLLM's
//!        |                                  cached_block_hashes_by_block)
//!        |- events                         BlockStored / BlockRemoved / AllBlocksCleared
//!        |- pages: Option<Box<Pages>>     two-level pages only (`block_pool/pages.rs`,
//!        |                                  `Config::slots_per_page > 1`): this pool holds
//!        |                                  slots, `k` a page; the page pool and each page's
//!        |                                  state sit here, called at the slot hooks
//!        '- retention: Option<Retention>  `hit-aware` only (policy/): levels, flags, hit
//!                                           units, pins; called at the pool's hooks
//!                                           (popped, touched, freed, unkeying, keyed,
//!                                           reset); its decisions through one handle
//!                                           the pool lends (hit_aware(): None under exact)
//! ```
//!
//! The policy decides in its rooms, one a layer: `policy/` (`mod.rs`: the rules,
//! [`Policy`], the levels; `retention.rs`: the per-block state, its hooks, and its
//! decisions on the free queue and prefix index the pool lends, the `HitAware` handle;
//! `units.rs`: the hit units; it never names the pool), `manager/retention.rs` (per group,
//! Mamba "align"'s states included: the kinds' files call its named hooks) and
//! `coordinator/hit_aware.rs` (per request: junctions, sightings, the levels a freed
//! request leaves, pinning).
//!
//! ## Partial hash hits
//! With vLLM's `--prefix-match-unit` on a Mamba hybrid ([`Config::partial_hash_hits`]) the
//! full-attention and Mamba blocks are larger than the hash block and are looked up at hash
//! granularity, so a hit may end inside a block:
//! - *copy-on-write*: the next allocation replaces that block in the request's table with a
//!   private copy (the pairs taken by [`Allocator::take_kv_cache_block_copies`]; both
//!   blocks hold a reference until the scheduler gives them back);
//! - *partial tails*: the prompt's last hash boundary inside a block is keyed there
//!   (vLLM's `_cache_partial_tail_block`; full attention's in `manager/full.rs`, Mamba's
//!   on the running state block in `manager/mamba.rs`, its key moved to a copy before the
//!   next forward overwrites it);
//! - *second keys*: a block keyed for a longer prefix keeps a shorter key as a second key
//!   (in the pool); a lookup finds the earliest-keyed block under a key, and evicting a
//!   block drops every key it holds, each with its event;
//! - *junctions* (`hit-aware`): a lookup reports the longest prefix another prompt went on
//!   past as the shared prefix's end, inside a block or not; the scheduler ends a prefill
//!   chunk there and full attention and the Mamba groups key their blocks there, so a third
//!   prompt sharing a system prompt hits all of it (see [`policy`], rule 8). A KV hint's
//!   checkpoint is a junction the application names ([`Allocator::set_hints`], rule 9).
//!   Under `exact`, vLLM's own shared-prefix checkpoint
//!   ([`Config::mamba_shared_prefix_checkpoint`], with EAGLE/MTP groups): the Mamba "align"
//!   groups key the state at the junction vLLM's lookup reported when a prompt chunk computes
//!   it, and the no-op limits prove no prefill step (a step ending there keys it).
//!
//! ## The EAGLE/MTP block drop
//! With vLLM's `use_eagle` ([`Config::eagle_drop_groups`]: EAGLE/MTP on vLLM 0.32 with prefix
//! caching, or with `disable_lookahead_block_hashes`), the hits of a dropping spec group
//! match one block further and drop it (full attention in `manager/full.rs`, sliding windows
//! in `manager/sliding_window.rs`), the hybrid fixed point verifies each drop once per
//! candidate length (`coordinator/hits.rs`), a dropping group caches one of its blocks past
//! the aligned boundary and the retention masks keep the block past each replay boundary
//! (`coordinator/cache_free.rs`). A Mamba group in the drop set matches without dropping
//! (vLLM's Mamba finder never drops) and caches that block past the boundary too; with
//! `use_eagle` every Mamba "align" group's prefill checkpoint positions move one hash block
//! back ([`Config::eagle_checkpoints`], `manager/mamba.rs`). Not with chunked local attention,
//! R-SWA, `hit-aware` or two-level pages ([`Config::validate`] refuses them).
//!
//! Multi-module MTP's re-prefillable tokens ([`Config::reprefillable_tokens`], vLLM's
//! `num_prefill_lookahead - 1`) are left out of the cache target where vLLM's coordinator leaves
//! them out: by a single group, and by a hybrid's dropping groups (`coordinator/cache_free.rs`).
//! The cache target only shrinks, so the no-op limits (`coordinator/noop.rs`) still prove what
//! they prove. Not with `hit-aware` and prefix caching ([`Allocator::new`] refuses it).
//!
//! ## Invariants (checked by `invariants::check`)
//! - Block 0 is the null block: never free-queued, hashed or ref-counted.
//! - A non-null block is in the free queue iff its ref count is 0; its ref count equals the
//!   table slots holding it plus its loose references (popped by `pop_blocks_for_free`, not
//!   yet freed by id; only those can be freed by id).
//! - A handle is `generation << 32 | slot`; a slot's generation changes each time it is
//!   reused, so a stale or foreign handle is refused.
//! - Each live request's stored no-op limits equal those its tables imply.
//! - A block has a hash iff the prefix index maps that hash to it.
//! - Tables are positional: out-of-window blocks become the null block in place (a Mamba
//!   "align" table is null except for its last state blocks, with null gaps between them; an
//!   R-SWA table has one null gap between its prompt and its window, all null as far as the
//!   manager records it).
//! - Two-level pages (`slots_per_page = k > 1`): every page is exactly one of free (in the
//!   page queue), a state page, or an open slot page (a slot in use); the slot pool's free
//!   queue holds exactly the free slots of open pages; no slot of a state page is used or
//!   keyed; a state group's ids are pages, every other group's are slots of open pages; the
//!   count of live requests holding slots (the admission headroom's `R`) equals a recount.
//! - Under the `hit-aware` policy (`policy/`): a free cached block in its pool's free queue
//!   sits in the segment of its retention level (with two-level pages each pool holds its own
//!   levels; a free keyed slot of a free page is in no queue and keeps its level); the free blocks at the pinned and leased levels are
//!   counted and stay within the pinned share; a free block at the leased level is the block
//!   lookups find under a running pin lease's key (KV hints, `policy/hints.rs`).
//!
//! ## Complexity
//! | operation | cost |
//! |---|---|
//! | `allocate_slots` (decode, no new block) | O(groups), no allocation |
//! | `allocate_slots` (new blocks) | O(new blocks + freed out-of-window blocks) |
//! | two-level pages' admission headroom | O(1) (a count of the requests holding slots) |
//! | `find_longest_cache_hit` | O(blocks scanned) (full: hit + 1; SWA, Mamba: right-to-left scan) |
//! | `free` | O(table) |
//! | pool pop / touch / free of one block | O(1) |
//! | `reset_prefix_cache` | O(`num_blocks`) |
//! | `set_hints` (KV hints) | O(prefix blocks) with a pin lease, else O(checkpoints) |
//! | `advance_clock` | O(1) when nothing is due, else O(log holds + keys) per hold ended |
//! | `release_session` | O(keys of the session's holds) |
//!
//! ## Performance notes
//! - Per-request state is dense (handles into a slab, `Vec` tables); the hot decode path
//!   reuses output buffers, so it allocates nothing.
//! - Hashes are stored inline (`[u8; 32]`), once per block, in the prefix index's per-block
//!   record; the index's table holds 8-byte slots (block id + a 32-bit tag of the key's hash),
//!   at least twice as many slots as blocks (at most half full: a 1.5x table, up to 2/3
//!   full, probed about 4 slots an insert and cost more instructions than the map it
//!   replaced), so a 323k-block pool's table is 8 MiB where the `FxHashMap<HashKey, _>`
//!   reserved about 37 MB of buckets; a probe compares tags and reads the block's record for
//!   the full key only on a tag match. An admission's per-block index work (evicting the old
//!   key, inserting the new) fell from about 267 to about 210 instructions, and in a bench
//!   of a 323k-block pool alone its simulated last-level misses (32 MiB) from about 3 a
//!   block to none: the index and the records now fit (`docs/bench-log.md`, "The
//!   prefix-index round").
//! - The Python boundary is crossed at most once per vLLM call, with ints and flat lists;
//!   the scheduler's per-request `allocate_slots` is answered by `Allocator::plain_step`
//!   from the request's stored no-op limits, without running any allocation code, when they
//!   prove the step changes nothing. The figures (dated, with their commands) are in
//!   `docs/benchmarks.md`: 0.62 us per running request per step inside vLLM's scheduler
//!   (gemma-2-27b decode at 1024 running, 2026-12-01, `bash scripts/bench.sh`), of which
//!   `CPython`'s call and the `Request` attribute reads are most; the Rust work is a fraction.
//! - The prefix index is sized for one key per block at construction (a pool never holds
//!   more; its table stays at most 2/3 full), so inserts never rehash inside a scheduler step
//!   (a rehash of ~10^5 keys showed up as a millisecond spike on the step where every request
//!   filled a block).
//!
//! ## The contract at the boundary
//! Every public operation either succeeds or returns an [`Error`], after checking everything
//! it is given before its first change (hash syncs are undone when a later check fails), so
//! a failed call changes nothing. Token sums are computed in 64 bits; caller-supplied block
//! ids, hits and hashes are validated; a panic means a broken internal invariant (our bug).
#![deny(unsafe_code)]

// The public surface: the allocator and its types, re-exported here; documented modules for
// what callers below the allocator legitimately use (a front end's rules, the pool as the
// benches drive it, the configuration, the policy's levels and state as tests read them);
// and the invariant checks the tests run. Everything else is the crate's own.
pub mod api;
pub mod block_pool;
pub mod config;
pub mod invariants;
pub mod policy;

pub(crate) mod coordinator;
pub(crate) mod error;
pub(crate) mod free_queue;
pub(crate) mod ids;
pub(crate) mod manager;
pub(crate) mod prefix_index;

#[cfg(feature = "python")]
mod py;

pub use block_pool::{Event, ResidencyOp};
pub use config::{AttentionKind, Config, CoordinatorKind, GroupSpec};
pub use coordinator::{
    token_count, AllocateArgs, Allocator, BlockCountArgs, CacheBlocksArgs, ConnectorHit, HashSource, HintOutcome, Hit,
    NewComputed, NoopLimits, PinHint, PinOutcome, PlainStep, RequestHints, RetainHint, RetainPriority, StepFields,
    MAX_CHECKPOINTS,
};
pub use error::{Error, Result};
pub use ids::{BlockHash, BlockId, GroupId, ReqHandle, Slot, MAX_HASH_LEN, NULL_BLOCK};
pub use manager::SingleTypeManager;
pub use policy::Policy;
