//! One manager per KV cache group, with the rules of its attention type (vLLM's
//! `SingleTypeKVCacheManager` and subclasses). The shared bookkeeping (block tables,
//! `num_cached_block`, the null prefix, zeroing records) lives in [`SingleTypeManager`]
//! (vLLM's base class); each attention kind's rules live in the kind's own file, as one
//! struct implementing [`KindRules`] (vLLM's subclass: it overrides only what differs from
//! the trait's defaults, which are full attention's). One dispatch, `kind::with_rules!`
//! (vLLM's `spec_manager_map`), maps a group's [`AttentionKind`](crate::AttentionKind) to its rules: the
//! manager's operations and the kind predicates the coordinator and the config read all go
//! through it, statically (a `match`, inlined). The per-request state only some kinds keep
//! lives in the manager's [`KindState`] (one arm per such kind, its struct in the kind's file).
//!
//! | file | kind | rules | per-request state |
//! |---|---|---|---|
//! | [`full`] | full attention, MLA | [`full::Full`] (the defaults) | [`full::FullState`] (partial tails, partial hash hits) |
//! | [`rswa`] | R-SWA (full attention plus a gap freed between prompt and window) | [`rswa::Rswa`] | [`rswa::RswaState`] |
//! | [`sliding_window`] | sliding window | [`sliding_window::SlidingWindow`] | none (the null prefix) |
//! | [`swa_replay`] | sliding window kept out of prefix caching (DeepSeek-V4.1's bounded replay) | [`swa_replay::SlidingWindowReplay`] | none (the null prefix) |
//! | [`chunked_local`] | chunked local attention | [`chunked_local::ChunkedLocal`] | none (the null prefix) |
//! | [`cross`] | cross attention (static, from the encoder length; never cached) | [`cross::Cross`] | none |
//! | [`mamba`] | Mamba "none" and "align" | [`mamba::MambaNone`], [`mamba::MambaAlign`] | [`mamba::AlignState`] ("align") |
//! | [`circular_buffer`] | circular buffer | [`circular_buffer::CircularBuffer`] | none (one block) |
//!
//! Beside the kinds: [`kind`] (the [`KindRules`] trait, its defaults, and the dispatch),
//! `boundary` (Mamba "align" boundary-state offloads for a KV connector), `hit` (the search's
//! inputs), `noop` (the decode fast path's limits), `retention` (the hit-aware policy's
//! rules per group, Mamba "align"'s included, with its per-request state and the named
//! hooks the kinds' files call), `zeroing` (KV cache zeroing records).
//!
//! A kind's operations that need its per-request state are methods of that state (Mamba
//! "align"'s of [`mamba::AlignState`], full attention's partial tails of
//! [`full::FullState`]); the manager lends them one request's share of its bookkeeping.
//!
//! Per request (by handle) a manager keeps its block table and `num_cached_block`.
//! Invariants: every non-null block in a table holds one reference for that slot; a
//! table's first `num_cached` blocks are cached or null; tables only grow, except that
//! out-of-window blocks become the null block in place (tables stay positional).
//!
//! Cost: every method is O(blocks it touches); `remove_skipped_blocks` stops at the first
//! null block it meets walking backwards, so a decode step costs O(1) amortised. The
//! dispatch is one `match` per operation, as a hand-written one.
//!
//! # Adding a kind
//! Fifteen edits in eight files for a kind without per-request state, six of them in Rust
//! (before the [`KindRules`] trait: thirteen in Rust, in six files). vLLM needs its spec
//! class, its manager subclass and its `spec_manager_map` entry. Listed for chunked local
//! attention (a kind with a parameter no other kind has also adds a
//! [`crate::api::KindParam`] variant, with its name, vLLM name and default):
//! 1. `rust/config.rs`: the [`AttentionKind`](crate::AttentionKind) variant with its
//!    parameters (vLLM's spec class).
//! 2. `rust/manager/<kind>.rs`: the rules struct and its `impl KindRules`, overriding what
//!    differs from full attention (chunked local: `num_skipped_tokens`,
//!    `find_longest_cache_hit`, `noop_processed`, `max_admission_blocks`, `check_params`,
//!    `check_with_caching`) (vLLM's manager subclass).
//! 3. `rust/manager/mod.rs`: its `pub mod` line;
//! 4. and its row in the table above.
//! 5. `rust/manager/kind.rs`: its arm in `with_rules!` (vLLM's `spec_manager_map` entry).
//! 6. `rust/api.rs`: its `KINDS` entry (name, named parameters, how to build the variant).
//! 7. `python/hybrid_alloc/specs.py`: its frozen dataclass (fields named as in the registry);
//! 8. its name in `__all__`;
//! 9. and in the `GroupSpec` union.
//! 10. `python/hybrid_alloc/vllm/spec_table.py`: the import of vLLM's spec class;
//! 11. the import of the named spec;
//! 12. the translator from one to the other;
//! 13. its `SPEC_TABLE` entry (vLLM's `spec_manager_map` shape).
//! 14. `docs/compatibility.md`: its row in the compatibility matrix;
//! 15. and its row in the spec table (with the test that proves it against vLLM).
//!
//! Optional: a `case` in `spec_table.describe` to show its parameters in the serving log.
//! A kind that keeps per-request state also overrides `new_state` and adds its [`KindState`]
//! variant (with its arms in `KindState::ensure_slot` and `clear`).
#![forbid(unsafe_code)]

mod boundary;
pub mod chunked_local;
pub mod circular_buffer;
pub mod cross;
pub mod full;
mod hit;
pub mod kind;
pub mod mamba;
mod noop;
mod retention;
pub mod rswa;
pub mod sliding_window;
pub mod swa_replay;
mod zeroing;

pub use hit::{find_longest_cache_hit, HashView, HitQuery};
pub use kind::KindRules;

use crate::block_pool::{BlockPool, TableRef};
use crate::config::{AttentionKind, GroupSpec};
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, Slot, NULL_BLOCK};
use kind::with_rules;

/// Marker for "no `num_cached_block` entry" (vLLM: request id absent from the dict).
const ABSENT: u32 = u32::MAX;

#[inline]
pub(crate) fn cdiv(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// Frees the non-null blocks of a table's slots `first..last` walking back from `last`,
/// putting the null block in their slots (vLLM's `_remove_blocks_in_range` and the loop of
/// `remove_skipped_blocks`); `scratch` is the manager's buffer for the freed blocks. With
/// `stop_at_null` the walk ends at the first null block it meets and returns that slot;
/// without, null slots are passed over.
pub(super) fn null_out_backwards(
    table: &mut [BlockId],
    scratch: &mut Vec<BlockId>,
    pool: &mut BlockPool,
    first: usize,
    last: usize,
    stop_at_null: bool,
) -> Option<usize> {
    let mut stop = None;
    for i in (first..last).rev() {
        let b = table[i];
        if b == NULL_BLOCK {
            if stop_at_null {
                stop = Some(i);
                break;
            }
            continue;
        }
        scratch.push(b);
        table[i] = NULL_BLOCK;
    }
    if !scratch.is_empty() {
        pool.free_blocks(scratch.iter().copied());
    }
    scratch.clear();
    stop
}

/// The per-request state of the kinds that keep one beyond the shared bookkeeping (static
/// dispatch: one arm per such kind, its struct in the kind's file).
// One per manager (not per request): the align arm's size costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum KindState {
    /// The kind needs nothing beyond the shared bookkeeping.
    Stateless,
    /// Full attention: the prompt's partial tail and the junction keyed inside a block
    /// (partial hash hits; see [`full`]).
    Full(full::FullState),
    /// R-SWA: the prompt length and the known-null gap (see [`rswa`]).
    Rswa(rswa::RswaState),
    /// Mamba "align": state blocks, retired range, checkpoints (see [`mamba`]).
    MambaAlign(mamba::AlignState),
}

impl KindState {
    fn ensure_slot(&mut self, n: usize) {
        match self {
            KindState::Stateless => {}
            KindState::Full(st) => st.ensure_slot(n),
            KindState::Rswa(st) => st.ensure_slot(n),
            KindState::MambaAlign(st) => st.ensure_slot(n),
        }
    }

    fn clear(&mut self, h: Slot) {
        match self {
            KindState::Stateless => {}
            KindState::Full(st) => st.clear(h),
            KindState::Rswa(st) => st.clear(h),
            KindState::MambaAlign(st) => st.clear(h),
        }
    }
}

/// What [`SingleTypeManager::get_num_blocks_to_allocate`] counts for.
#[derive(Clone, Copy, Debug, Default)]
pub struct CountArgs<'a> {
    /// Token slots the table must hold.
    pub num_tokens: u32,
    /// Of them, the slots of the target model (Mamba "align" sizes by these).
    pub num_tokens_main_model: u32,
    /// Cache-hit blocks being adopted (this group's).
    pub new_computed: &'a [BlockId],
    /// Tokens of the local cache hit (`num_local_computed_tokens`): with partial hash hits a
    /// hit ending inside a block reserves one more block, its copy-on-write copy.
    pub num_local_computed_tokens: u32,
    /// Tokens computed once the hit and the external tokens are adopted.
    pub total_computed_tokens: u32,
    /// Cap the count at the group's admission cap (the admission gate).
    pub apply_admission_cap: bool,
    /// The allocation adopts computed tokens into an untracked request's table.
    pub adopting: bool,
    /// Where the request's prefill ends (Mamba prefill checkpoints, retention interval 0).
    pub prefill_end: u32,
}

/// What [`SingleTypeManager::cache_blocks`] caches.
#[derive(Clone, Copy, Debug)]
pub struct CacheArgs<'a> {
    /// The request's handle (events name it).
    pub req: ReqHandle,
    /// The request's hashes at `hash_block_size` granularity.
    pub hashes: &'a [BlockHash],
    /// Tokens whose full blocks are cached.
    pub num_tokens: u32,
    /// `Config::retention_interval`.
    pub retention_interval: Option<u32>,
    /// Token positions a later request may resume at (the retention mask keeps them).
    pub reachable_boundaries: &'a [u32],
    /// `request.num_prompt_tokens`.
    pub num_prompt_tokens: u32,
    /// `request.shared_prefix_boundary`.
    pub shared_prefix_boundary: u32,
    /// `request.num_computed_tokens` (vLLM's shared-prefix checkpoint keys the junction only
    /// past it).
    pub request_computed_tokens: u32,
    /// The group's manager is vLLM's `use_eagle` one ([`SingleTypeManager::eagle`]): its
    /// retention mask keeps the block matched past each boundary, and full attention keys
    /// the prompt's partial tail at the whole prompt.
    pub eagle: bool,
}

/// The bookkeeping of one KV cache group.
#[derive(Clone, Debug)]
pub struct SingleTypeManager {
    /// The group's spec.
    spec: GroupSpec,
    /// The group's index.
    group_id: GroupId,
    /// Recycling-aware admission cap in blocks (SWA, chunked local), if any.
    max_admission_blocks: Option<u32>,
    /// Prefix caching on for this manager.
    enable_caching: bool,
    /// Alignment of cache hits in tokens (the coordinator's).
    cache_hit_alignment_tokens: u32,
    /// Tokens per block hash (the pool's `hash_block_size`).
    hash_block_size: u32,
    /// Tokens past each block its hash covers ([`crate::Config::hash_lookahead_tokens`]).
    hash_lookahead_tokens: u32,
    /// `req_blocks[h]`: the block table of request `h` (empty when it has none).
    req_blocks: Vec<Vec<BlockId>>,
    /// `num_cached[h]`: blocks of the table already cached, or `ABSENT`.
    num_cached: Vec<u32>,
    /// `null_prefix[h]`: table slots `0..null_prefix[h]` hold the null block (out-of-window
    /// blocks only ever become null as a prefix of the table).
    null_prefix: Vec<u32>,
    /// Scratch for freed blocks (reused, so decode steps do not allocate).
    scratch: Vec<BlockId>,
    /// Whether this group records the blocks it hands out for KV cache zeroing (vLLM's
    /// `_record_new_block_ids`: zeroing needed and an attention group).
    records_new_block_ids: bool,
    /// The block ids handed out since the last [`Self::take_new_block_ids`], in order.
    new_block_ids: Vec<BlockId>,
    /// The kind's own per-request state (its arm matches `spec.kind`).
    kind_state: KindState,
    /// `partial_hit[h] = (table index, source block)` of a hit (or a partial tail the
    /// request keyed itself, Mamba) ending inside that block, whose copy-on-write the next
    /// allocation makes (vLLM's `_partial_hit_reqs`); `(NONE, _)`: none.
    partial_hit: Vec<(u32, BlockId)>,
    /// Copy-on-write copies `(source, copy)` made since the last
    /// [`Self::take_pending_cow_copies`] (vLLM's `_pending_cow_copies`); both blocks hold
    /// one extra reference until the scheduler frees them after the copy has run.
    pending_cow: Vec<(BlockId, BlockId)>,
    /// The hit-aware policy's per-request state of this group (Mamba "align" only; see
    /// [`retention`]).
    retention: retention::GroupRetention,
    /// vLLM's `use_eagle` of this group's manager ([`crate::Config::drops_eagle_block`]):
    /// its hits drop the EAGLE block, the coordinator caches one block past the aligned
    /// boundary, and the retention mask keeps the block past each boundary.
    eagle: bool,
    /// vLLM's `MambaManager.drop_eagle_checkpoint_block` ([`crate::Config::eagle_checkpoints`]):
    /// the Mamba "align" prefill checkpoint positions move one hash block back. Read by
    /// Mamba "align" groups only.
    eagle_checkpoints: bool,
    /// vLLM's `MambaManager.shared_prefix_checkpoint`
    /// ([`crate::Config::shared_prefix_checkpoint`]): the state at the request's junction is
    /// keyed by the prompt chunk that computes it. Read by Mamba "align" groups only.
    shared_prefix_checkpoint: bool,
}

/// Marker for "no partial hit" in [`SingleTypeManager`]'s `partial_hit`.
pub(crate) const NO_PARTIAL: u32 = u32::MAX;

impl SingleTypeManager {
    /// A manager for group `group_id`.
    pub(crate) fn new(
        spec: GroupSpec,
        group_id: GroupId,
        max_admission_blocks: Option<u32>,
        enable_caching: bool,
        cache_hit_alignment_tokens: u32,
        hash_block_size: u32,
        hash_lookahead_tokens: u32,
    ) -> Self {
        Self {
            spec,
            group_id,
            max_admission_blocks,
            enable_caching,
            cache_hit_alignment_tokens,
            hash_block_size,
            hash_lookahead_tokens,
            req_blocks: Vec::new(),
            num_cached: Vec::new(),
            null_prefix: Vec::new(),
            scratch: Vec::new(),
            records_new_block_ids: false,
            new_block_ids: Vec::new(),
            kind_state: with_rules!(spec.kind, r => r.new_state()),
            partial_hit: Vec::new(),
            pending_cow: Vec::new(),
            retention: retention::GroupRetention::new(spec.kind.is_mamba_align()),
            eagle: false,
            eagle_checkpoints: false,
            shared_prefix_checkpoint: false,
        }
    }

    /// Gives this group vLLM's `shared_prefix_checkpoint` (at construction; see
    /// [`crate::Config::shared_prefix_checkpoint`]).
    pub(crate) fn set_shared_prefix_checkpoint(&mut self, on: bool) {
        self.shared_prefix_checkpoint = on;
    }

    /// Gives this group vLLM's `drop_eagle_checkpoint_block` (at construction; see
    /// [`crate::Config::eagle_checkpoints`]).
    pub(crate) fn set_eagle_checkpoints(&mut self, on: bool) {
        self.eagle_checkpoints = on;
    }

    /// Gives this group vLLM's `use_eagle` (at construction; see [`Self::eagle`]).
    pub(crate) fn set_eagle(&mut self, use_eagle: bool) {
        self.eagle = use_eagle;
    }

    /// Whether this group's manager is vLLM's `use_eagle` one (its hits drop the EAGLE block).
    #[inline]
    pub fn eagle(&self) -> bool {
        self.eagle
    }

    /// vLLM's `_has_partial_local_hit`: the local hit ends inside one of this group's blocks.
    #[inline]
    pub(crate) fn has_partial_local_hit(&self, new_computed: &[BlockId], num_local_computed_tokens: u32) -> bool {
        !new_computed.is_empty() && num_local_computed_tokens % self.spec.block_size != 0
    }

    /// The pending partial hit of `h` (`(table index, source block)`), if any.
    #[inline]
    pub(crate) fn partial_hit(&self, h: Slot) -> Option<(u32, BlockId)> {
        let p = self.partial_hit[h as usize];
        (p.0 != NO_PARTIAL).then_some(p)
    }

    /// Records the pending partial hit of `h`.
    #[inline]
    pub(crate) fn set_partial_hit(&mut self, h: Slot, idx: u32, source: BlockId) {
        self.partial_hit[h as usize] = (idx, source);
    }

    /// Takes the pending partial hit of `h`.
    #[inline]
    pub(crate) fn take_partial_hit(&mut self, h: Slot) -> Option<(u32, BlockId)> {
        let p = self.partial_hit(h)?;
        self.partial_hit[h as usize] = (NO_PARTIAL, NULL_BLOCK);
        Some(p)
    }

    /// vLLM's `_apply_cow`: `h`'s table slot `idx` (holding `source`) now holds `cow`; the
    /// copy is queued, and `cow` takes one more reference (held until the copy has run).
    pub(crate) fn apply_cow(&mut self, pool: &mut BlockPool, h: Slot, idx: u32, source: BlockId, cow: BlockId) {
        let slot = &mut self.req_blocks[h as usize][idx as usize];
        debug_assert_eq!(*slot, source);
        *slot = cow;
        self.pending_cow.push((source, cow));
        // `source` keeps the hit's reference, which no table holds now.
        pool.loosen(&[source]);
        pool.incref(cow);
    }

    /// After an eviction by id: every request's partial-tail boundary is watched again by the
    /// no-op limits (full attention with partial hash hits; see [`full::FullState::rearm`]).
    pub(crate) fn rearm_partial_tails(&mut self) {
        if let KindState::Full(st) = &mut self.kind_state {
            st.rearm();
        }
    }

    /// Drains the copy-on-write copies queued since the last call into `out` (vLLM's
    /// `take_pending_cow_copies`).
    pub(crate) fn take_pending_cow_copies(&mut self, out: &mut Vec<(BlockId, BlockId)>) {
        out.append(&mut self.pending_cow);
    }

    /// Whether this is a Mamba group in cache mode "align".
    #[inline]
    pub(crate) fn is_mamba_align(&self) -> bool {
        self.spec.kind.is_mamba_align()
    }

    /// A new scheduler step starts (vLLM's `new_step_starts`): hits on states cached in the
    /// previous step are no longer deferred.
    pub(crate) fn new_step_starts(&mut self) {
        if let KindState::MambaAlign(st) = &mut self.kind_state {
            st.new_step_starts();
        }
    }

    /// Tokens per block.
    #[inline]
    pub fn block_size(&self) -> u32 {
        self.spec.block_size
    }

    /// The group's attention kind.
    #[inline]
    pub fn kind(&self) -> AttentionKind {
        self.spec.kind
    }

    /// The group's index.
    #[inline]
    pub fn group_id(&self) -> GroupId {
        self.group_id
    }

    /// Whether this group records the blocks it hands out for KV cache zeroing.
    #[inline]
    pub(crate) fn records_new_block_ids(&self) -> bool {
        self.records_new_block_ids
    }

    /// Makes this group record the blocks it hands out for KV cache zeroing, or not (at
    /// construction).
    pub(crate) fn set_records_new_block_ids(&mut self, on: bool) {
        self.records_new_block_ids = on;
    }

    /// Makes room for handle `h` (a new request slot).
    pub(crate) fn ensure_slot(&mut self, h: Slot) {
        let n = h as usize + 1;
        if self.req_blocks.len() < n {
            self.req_blocks.resize_with(n, Vec::new);
            self.num_cached.resize(n, ABSENT);
            self.null_prefix.resize(n, 0);
            self.partial_hit.resize(n, (NO_PARTIAL, NULL_BLOCK));
            self.kind_state.ensure_slot(n);
            self.retention.ensure_slot(n);
        }
    }

    /// The block table of `h`.
    #[inline]
    pub fn blocks(&self, h: Slot) -> &[BlockId] {
        &self.req_blocks[h as usize]
    }

    /// Whether `h` has a `num_cached_block` entry (vLLM: "a running request").
    #[inline]
    pub fn is_tracked(&self, h: Slot) -> bool {
        self.num_cached[h as usize] != ABSENT
    }

    /// Leading null slots of `h`'s table.
    #[inline]
    pub fn null_prefix(&self, h: Slot) -> u32 {
        self.null_prefix[h as usize]
    }

    /// `num_cached_block` of `h` (0 when absent).
    #[inline]
    pub fn num_cached(&self, h: Slot) -> u32 {
        let n = self.num_cached[h as usize];
        if n == ABSENT {
            0
        } else {
            n
        }
    }

    pub(crate) fn count_evictable(pool: &BlockPool, blocks: &[BlockId]) -> u32 {
        blocks.iter().filter(|&&b| b != NULL_BLOCK && pool.ref_cnt(b) == 0).count() as u32
    }

    /// Blocks this group must take from the pool to give `h` `c.num_tokens` slots, counting
    /// cache-hit blocks that are still in the free queue (vLLM's `get_num_blocks_to_allocate`).
    ///
    /// vLLM counts a request it does not track yet as if its computed tokens were adopted
    /// (out-of-window ones as null blocks). That is what `allocate_slots` does only when it
    /// adopts something (a hit or external tokens); with `adopting` false the table just
    /// grows from its current length, and the count says exactly that, so the capacity check
    /// and the allocation always agree (a request whose computed tokens run ahead of its
    /// table is not under-counted).
    pub(crate) fn get_num_blocks_to_allocate(&self, pool: &BlockPool, h: Slot, c: &CountArgs<'_>) -> i64 {
        with_rules!(self.spec.kind, r => r.get_num_blocks_to_allocate(self, pool, h, c))
    }

    /// Adds a request's cache-hit blocks to its (empty) table, touching them; blocks that
    /// are already out of the window become null (vLLM's `add_local_computed_blocks`).
    pub(crate) fn add_local_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        new_computed: &[BlockId],
        num_local_computed_tokens: u32,
        num_external_computed_tokens: u32,
    ) {
        with_rules!(self.spec.kind, r => r.add_local_computed_blocks(
            self,
            pool,
            h,
            new_computed,
            num_local_computed_tokens,
            num_external_computed_tokens
        ))
    }

    /// Allocates blocks for tokens a KV connector computed (vLLM's
    /// `allocate_external_computed_blocks`).
    pub(crate) fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        num_local_computed_tokens: u32,
        num_external_computed_tokens: u32,
        record_for_zeroing: bool,
    ) {
        with_rules!(self.spec.kind, r => r.allocate_external_computed_blocks(
            self,
            pool,
            h,
            num_local_computed_tokens,
            num_external_computed_tokens,
            record_for_zeroing
        ))
    }

    /// Grows `h`'s table to `num_tokens` slots; appends the new block ids to `out`
    /// (vLLM's `allocate_new_blocks`). The caller checked capacity.
    pub(crate) fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        num_tokens: u32,
        num_tokens_main_model: u32,
        out: &mut Vec<BlockId>,
    ) {
        with_rules!(self.spec.kind, r => r.allocate_new_blocks(self, pool, h, num_tokens, num_tokens_main_model, out))
    }

    /// Blocks of `h`'s table that [`Self::cache_blocks`] would treat as full for
    /// `num_tokens` tokens and `num_hashes` hashes (0 for cross attention), and the table's
    /// length: the coordinator refuses a caching call whose full blocks the table lacks.
    pub(crate) fn blocks_to_cache(&self, h: Slot, num_hashes: usize, num_tokens: u32) -> (u32, u32) {
        with_rules!(self.spec.kind, r => r.blocks_to_cache(self, h, num_hashes, num_tokens))
    }

    /// Caches the full blocks of `h` up to `c.num_tokens` (vLLM's `cache_blocks`), with the
    /// retention mask. The caller checked with [`Self::blocks_to_cache`] that the table
    /// holds every full block.
    pub(crate) fn cache_blocks(&mut self, pool: &mut BlockPool, h: Slot, c: &CacheArgs<'_>) {
        with_rules!(self.spec.kind, r => r.cache_blocks(self, pool, h, c))
    }

    /// Caches the full blocks of `h` up to `c.num_tokens` with `r`'s retention mask (the
    /// default `cache_blocks`).
    fn cache_full<R: KindRules + ?Sized>(&mut self, r: &R, pool: &mut BlockPool, h: Slot, c: &CacheArgs<'_>) {
        let bs = self.spec.block_size;
        let num_cached = self.num_cached(h);
        let view = HashView { hashes: c.hashes, scale: bs / self.hash_block_size };
        // vLLM 0.32 indexes the request's hashes without a bound; the scheduler always has
        // them. Capping here (as vLLM 0.33 does) keeps a short hash list from panicking.
        let num_full = (c.num_tokens / bs).min(view.len());
        if num_cached >= num_full {
            return;
        }
        let mask = r.reachable_block_mask(num_cached, num_full, self.cache_hit_alignment_tokens, bs, c);
        // Hit-aware (a leveled pool): cache every block; those the mask skips go to the
        // speculative level (see `crate::policy`).
        let dense = pool.is_leveled() && mask.is_some();
        let table = TableRef { req: c.req, group: self.group_id, block_size: bs, blocks: &self.req_blocks[h as usize] };
        pool.cache_full_blocks(&table, num_cached..num_full, if dense { None } else { mask.as_deref() }, |i| {
            view.get(i)
        });
        if dense {
            if let (Some(mask), Some(mut ha)) = (&mask, pool.hit_aware()) {
                self.level_masked_blocks(&mut ha, h, num_cached, mask, c.reachable_boundaries);
            }
        }
        self.num_cached[h as usize] = num_full;
    }

    /// Frees the blocks of `h` that fell out of the attention window, replacing them with
    /// the null block (vLLM's `remove_skipped_blocks`). `num_prompt_tokens` is what vLLM's
    /// `allocate_slots` passes (`None` from its other callers); only R-SWA reads it.
    pub(crate) fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        processed_computed_tokens: u32,
        num_prompt_tokens: Option<u32>,
    ) {
        with_rules!(self.spec.kind, r => r.remove_skipped_blocks(
            self,
            pool,
            h,
            processed_computed_tokens,
            num_prompt_tokens
        ))
    }

    /// Forgets `h`'s table without freeing its blocks (the caller frees them).
    pub(crate) fn forget(&mut self, h: Slot) {
        self.req_blocks[h as usize].clear();
        self.num_cached[h as usize] = ABSENT;
        self.null_prefix[h as usize] = 0;
        self.partial_hit[h as usize] = (NO_PARTIAL, NULL_BLOCK);
        self.kind_state.clear(h);
        self.retention.clear(h);
    }

    /// Frees every block of `h`, tail first, and forgets its bookkeeping (vLLM's `free`).
    pub(crate) fn free(&mut self, pool: &mut BlockPool, h: Slot) {
        pool.free_blocks(self.req_blocks[h as usize].iter().rev().copied());
        self.forget(h);
    }

    /// Forgets `h`'s bookkeeping and moves its table into `out`, without freeing
    /// (vLLM's `pop_blocks_for_free`).
    pub(crate) fn pop_blocks(&mut self, h: Slot, out: &mut Vec<BlockId>) {
        out.extend_from_slice(&self.req_blocks[h as usize]);
        self.forget(h);
    }

    /// R-SWA: `(prompt length, gap end)` of `h` (invariant checks).
    pub(crate) fn rswa_gap(&self, h: Slot) -> Option<(u32, u32)> {
        match &self.kind_state {
            KindState::Rswa(st) => Some(st.gap(h)),
            _ => None,
        }
    }

    /// Every live table (invariant checks).
    pub(crate) fn tables(&self) -> impl Iterator<Item = (Slot, &[BlockId])> + '_ {
        self.req_blocks.iter().enumerate().map(|(h, t)| (h as Slot, t.as_slice()))
    }
}
