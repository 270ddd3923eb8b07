//! The cache-hit search (vLLM's coordinator `find_longest_cache_hit`: one group, or the
//! hybrid fixed point over spec groups, full attention first), the per-group search a KV
//! connector's scheduler takes (`find_longest_cache_hit_per_group`, and
//! `get_computed_blocks_for_connector` over it) and the validation of a hit before
//! `allocate_slots` adopts it (explicit ids or the stored hit, checked block by block against
//! the request's hashes).
//!
//! Cost: the search is O(blocks scanned); validation O(hit blocks).
#![forbid(unsafe_code)]

use super::{page_side, Allocator, HashSource, Hit, SpecGroup};

use crate::config::CoordinatorKind;
use crate::error::{Error, Result};
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, Slot, NULL_BLOCK};
use crate::manager::{cdiv, find_longest_cache_hit, HashView, HitQuery};

/// The local hit a KV connector's scheduler takes (vLLM's
/// `KVCacheManager.get_computed_blocks_for_connector`): see
/// [`Allocator::get_computed_blocks_for_connector`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectorHit {
    /// The hit: full attention's per-group hit (no uncached shared prefix) when
    /// `per_group` is given, else the reconciled hit of `get_computed_blocks`.
    pub hit: Hit,
    /// Every group's own hit length (0 for a group that takes no hits) when the per-group
    /// hit was taken; `None` when the reconciled hit was.
    pub per_group: Option<Vec<u32>>,
}

impl ConnectorHit {
    /// vLLM's `hit_diverged`: a per-group hit some group lags behind full attention in.
    pub fn diverged(&self) -> bool {
        self.per_group.as_ref().is_some_and(|v| v.iter().any(|&n| n < self.hit.num_tokens))
    }
}

impl Allocator {
    /// Finds the longest cache hit of `h` not longer than `max_cache_hit_length` tokens and
    /// stores it as the request's pending hit (vLLM's `coordinator.find_longest_cache_hit`,
    /// called by `get_computed_blocks` with `num_tokens - 1`). Touches nothing.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn find_longest_cache_hit(&mut self, h: ReqHandle, max_cache_hit_length: u32) -> Result<Hit> {
        let s = self.slot(h)?;
        Ok(self.find_hit(s, max_cache_hit_length))
    }

    /// [`Self::find_longest_cache_hit`] after bringing the request's hashes up to `hashes`.
    ///
    /// # Errors
    /// Unknown handle; an invalid hash (nothing changes).
    pub fn get_computed_blocks(
        &mut self,
        h: ReqHandle,
        hashes: Option<&dyn HashSource>,
        max_cache_hit_length: u32,
    ) -> Result<Hit> {
        let s = self.synced_slot(h, hashes)?;
        Ok(self.find_hit(s, max_cache_hit_length))
    }

    /// vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit_per_group`: each spec group's
    /// own longest hit within `max_cache_hit_length` tokens, with no reconciliation between
    /// groups (so their lengths may differ), stored as the request's pending hit after
    /// bringing its hashes up to `hashes`. Returns each group's hit length (0 for a group
    /// that takes no hits, and for every group with prefix caching off). Touches nothing.
    ///
    /// # Errors
    /// Unknown handle; an invalid hash (nothing changes).
    pub fn find_longest_cache_hit_per_group(
        &mut self,
        h: ReqHandle,
        hashes: Option<&dyn HashSource>,
        max_cache_hit_length: u32,
    ) -> Result<Vec<u32>> {
        let s = self.synced_slot(h, hashes)?;
        Ok(self.per_group_hit(s, max_cache_hit_length))
    }

    /// vLLM's `KVCacheManager.get_computed_blocks_for_connector` (both releases) after
    /// bringing the request's hashes up to `hashes`: with Mamba layers, several groups and
    /// a full-attention group, the per-group hit ([`Self::find_longest_cache_hit_per_group`]),
    /// whose tokens are full attention's, unless some group hit deeper than full attention
    /// (its full-attention blocks were evicted), where the reconciled hit of
    /// [`Self::get_computed_blocks`] is taken instead; without them, always the reconciled
    /// hit. Either is stored as the request's pending hit; `allocate_slots` adopts a
    /// per-group one with each group's own blocks (a lagging group's are shorter).
    ///
    /// # Errors
    /// Unknown handle; an invalid hash (nothing changes).
    pub fn get_computed_blocks_for_connector(
        &mut self,
        h: ReqHandle,
        hashes: Option<&dyn HashSource>,
        max_cache_hit_length: u32,
    ) -> Result<ConnectorHit> {
        let s = self.synced_slot(h, hashes)?;
        if let Some(fa) = self.per_group_hit_group() {
            let lens = self.per_group_hit(s, max_cache_hit_length);
            let num_tokens = lens[fa];
            if lens.iter().all(|&n| n <= num_tokens) {
                let hit = Hit { num_tokens, num_uncached_common_prefix_tokens: 0 };
                return Ok(ConnectorHit { hit, per_group: Some(lens) });
            }
        }
        Ok(ConnectorHit { hit: self.find_hit(s, max_cache_hit_length), per_group: None })
    }

    /// The full-attention group whose hit a KV connector's per-group hit reports, when the
    /// config is one vLLM's `get_computed_blocks_for_connector` takes the per-group hit for:
    /// Mamba layers, several groups (the hybrid coordinator) and a full-attention group.
    /// `None` for every other config, where no hit's groups can lag. O(groups).
    fn per_group_hit_group(&self) -> Option<usize> {
        let mamba = self.managers.iter().any(|m| matches!(m.kind(), crate::config::AttentionKind::Mamba { .. }));
        let full = self.spec_groups.first().filter(|sg| sg.kind.is_full()).map(|sg| sg.group_ids[0] as usize);
        full.filter(|_| mamba && self.kind == CoordinatorKind::Hybrid)
    }

    /// The slot of `h` with its hashes brought up to `hashes` (if given).
    fn synced_slot(&mut self, h: ReqHandle, hashes: Option<&dyn HashSource>) -> Result<Slot> {
        let s = self.slot(h)?;
        if let Some(src) = hashes {
            self.sync_hashes(s, src)?;
        }
        Ok(s)
    }

    fn per_group_hit(&mut self, s: Slot, max_len: u32) -> Vec<u32> {
        let mut hit = std::mem::take(&mut self.reqs[s as usize].hit);
        for v in hit.iter_mut() {
            v.clear();
        }
        let mut lens = vec![0u32; self.managers.len()];
        if self.kind != CoordinatorKind::NoPrefixCache {
            let align = self.hit_alignment;
            let hashes = &self.reqs[s as usize].hashes;
            let mut tmp = std::mem::take(&mut self.scratch_spec);
            for sg in &self.spec_groups {
                let max_length = if sg.eagle { self.eagle_lookup_length(sg, max_len, hashes.len()) } else { max_len };
                let q = HitQuery {
                    pool: self.pool.side_ref(page_side(self.state_groups, sg.group_ids[0])),
                    view: HashView { hashes, scale: sg.block_size / self.cfg.hash_block_size },
                    max_length,
                    group_ids: &sg.group_ids,
                    block_size: sg.block_size,
                    alignment_tokens: align,
                    drop_eagle: sg.eagle,
                };
                let n = find_longest_cache_hit(sg.kind, &q, &mut tmp[..sg.group_ids.len()]);
                for (j, &gid) in sg.group_ids.iter().enumerate() {
                    std::mem::swap(&mut hit[gid as usize], &mut tmp[j]);
                    lens[gid as usize] = n;
                }
            }
            self.scratch_spec = tmp;
        }
        self.reqs[s as usize].hit = hit;
        lens
    }

    pub(super) fn find_hit(&mut self, s: Slot, max_cache_hit_length: u32) -> Hit {
        let mut hit = std::mem::take(&mut self.reqs[s as usize].hit);
        for v in hit.iter_mut() {
            v.clear();
        }
        let mut guess_limit = 0;
        let res = match self.kind {
            CoordinatorKind::NoPrefixCache => Hit { num_tokens: 0, num_uncached_common_prefix_tokens: 0 },
            CoordinatorKind::Unitary => Hit {
                num_tokens: self.unitary_search(&self.reqs[s as usize].hashes, max_cache_hit_length, &mut hit[..1]),
                num_uncached_common_prefix_tokens: 0,
            },
            CoordinatorKind::Hybrid => {
                let res = self.hybrid_hit(s, max_cache_hit_length, &mut hit);
                self.place_junction(s, max_cache_hit_length, res, &mut guess_limit)
            }
        };
        let st = &mut self.reqs[s as usize];
        st.hit = hit;
        st.hit_aware.guess_limit = guess_limit;
        st.hit_aware.moved_junction = 0;
        res
    }

    pub(super) fn hybrid_hit(&mut self, s: Slot, max_len: u32, out: &mut [Vec<BlockId>]) -> Hit {
        let mut tmp = std::mem::take(&mut self.scratch_spec);
        let res = self.hybrid_search(&self.reqs[s as usize].hashes, max_len, out, &mut tmp);
        self.scratch_spec = tmp;
        res
    }

    /// vLLM's `UnitaryKVCacheCoordinator.find_longest_cache_hit` over `hashes`: the one
    /// group's hit left in `out[0]`, its tokens returned. Reads the pool only. O(blocks scanned).
    fn unitary_search(&self, hashes: &[BlockHash], max_len: u32, out: &mut [Vec<BlockId>]) -> u32 {
        let m = &self.managers[0];
        let bs = m.block_size();
        let q = HitQuery {
            pool: &self.pool,
            view: HashView { hashes, scale: bs / self.cfg.hash_block_size },
            max_length: max_len,
            group_ids: &[0],
            block_size: bs,
            alignment_tokens: bs,
            drop_eagle: m.eagle(),
        };
        find_longest_cache_hit(m.kind(), &q, out)
    }

    /// vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit` over `hashes`: the fixed
    /// point over the spec groups, full attention first, each group's hit left in `out`
    /// (`tmp`: scratch, one list per group). Reads the pool only. O(blocks scanned).
    fn hybrid_search(
        &self,
        hashes: &[BlockHash],
        max_len: u32,
        out: &mut [Vec<BlockId>],
        tmp: &mut [Vec<BlockId>],
    ) -> Hit {
        let ng = self.managers.len();
        let align = self.hit_alignment;
        let mut hit_length = max_len;
        let mut longest = 0u32;
        let mut computed = 0u64; // bitset of groups with a result
        let mut len_by_group = [0u32; 64];
        let simple = self.spec_groups.len() == 2 && self.spec_groups[0].kind.is_full();
        // vLLM's `eagle_verified`: the spec groups (by index) whose EAGLE drop is verified at
        // the current candidate length; each drops at most once per candidate length.
        let mut eagle_verified = 0u64;
        loop {
            let mut curr = hit_length;
            for (idx, sg) in self.spec_groups.iter().enumerate() {
                let first = sg.group_ids[0] as usize;
                if sg.kind.is_full() && computed & (1 << first) != 0 {
                    curr = curr.min(len_by_group[first]);
                    continue;
                }
                let drop_eagle = sg.eagle && eagle_verified & (1 << idx) == 0;
                let max_length = if drop_eagle { self.eagle_lookup_length(sg, curr, hashes.len()) } else { curr };
                let view = HashView { hashes, scale: sg.block_size / self.cfg.hash_block_size };
                let k = sg.group_ids.len();
                let q = HitQuery {
                    pool: self.pool.side_ref(page_side(self.state_groups, sg.group_ids[0])),
                    view,
                    max_length,
                    group_ids: &sg.group_ids,
                    block_size: sg.block_size,
                    alignment_tokens: align,
                    drop_eagle,
                };
                let new_len = find_longest_cache_hit(sg.kind, &q, &mut tmp[..k]);
                if drop_eagle {
                    eagle_verified |= 1 << idx;
                } else if new_len < curr {
                    // The length shrank: every earlier drop is verified again.
                    eagle_verified = 0;
                }
                curr = new_len;
                for (j, &gid) in sg.group_ids.iter().enumerate() {
                    std::mem::swap(&mut out[gid as usize], &mut tmp[j]);
                    len_by_group[gid as usize] = new_len;
                    computed |= 1 << gid;
                }
                longest = longest.max(curr);
            }
            if curr >= hit_length {
                break;
            }
            hit_length = curr;
            if simple {
                break;
            }
        }
        for sg in &self.spec_groups {
            if !sg.kind.is_full() {
                continue;
            }
            let keep = cdiv(hit_length as u64, sg.block_size as u64) as usize;
            for &gid in &sg.group_ids {
                out[gid as usize].truncate(keep);
            }
        }
        debug_assert!(ng <= 64);
        Hit { num_tokens: hit_length, num_uncached_common_prefix_tokens: longest - hit_length }
    }

    /// How far a dropping spec group `sg` looks for a hit of `len` tokens (vLLM's
    /// `eagle_proof_margin`): one drop unit further (one hash unit where the group looks up
    /// at hash granularity with partial hash hits, else one of its blocks), at most the
    /// `num_hashes` hashes; no margin for Mamba, whose finder never drops. O(1).
    fn eagle_lookup_length(&self, sg: &SpecGroup, len: u32, num_hashes: usize) -> u32 {
        if matches!(sg.kind, crate::config::AttentionKind::Mamba { .. }) {
            return len;
        }
        let hbs = self.cfg.hash_block_size;
        let fine = self.partial_hash_hits && sg.kind.fine_grained_lookup() && sg.block_size > hbs;
        let margin = if fine { hbs } else { sg.block_size };
        let hashed = (num_hashes as u64 * hbs as u64).min(u32::MAX as u64) as u32;
        len.saturating_add(margin).min(hashed)
    }

    /// vLLM 0.34's `KVCacheManager.get_num_cached_tokens` (the probe cache-aware admission
    /// asks of every waiting request it may reorder): the tokens of the longest cache hit of
    /// `hashes` within `max_cache_hit_length`, as `get_computed_blocks` would find it, without
    /// a request: nothing is stored, touched, queued or counted, under either policy (the
    /// hit-aware junctions and first-sighting stops are `get_computed_blocks`' own, not the
    /// hit's). Reads only the hashes a hit that long can use (with the EAGLE drop, one drop
    /// unit longer: a dropping group matches that much further). O(blocks scanned).
    ///
    /// # Errors
    /// An invalid hash (nothing changes).
    pub fn num_cached_tokens(&mut self, hashes: &dyn HashSource, max_cache_hit_length: u32) -> Result<u32> {
        if self.kind == CoordinatorKind::NoPrefixCache {
            return Ok(0);
        }
        let reach = match self.spec_groups.iter().filter(|sg| sg.eagle).map(|sg| sg.block_size).max() {
            Some(margin) => max_cache_hit_length.saturating_add(margin),
            None => max_cache_hit_length,
        };
        let usable = (reach / self.cfg.hash_block_size) as usize;
        let mut staged = std::mem::take(&mut self.scratch_hashes);
        staged.clear();
        for i in 0..usable.min(hashes.len()) {
            match hashes.get(i) {
                Ok(h) => staged.push(h),
                Err(e) => {
                    self.scratch_hashes = staged;
                    return Err(e);
                }
            }
        }
        let mut out = std::mem::take(&mut self.scratch_probe);
        let mut tmp = std::mem::take(&mut self.scratch_spec);
        for v in out.iter_mut() {
            v.clear();
        }
        let n = match self.kind {
            CoordinatorKind::NoPrefixCache => 0,
            CoordinatorKind::Unitary => self.unitary_search(&staged, max_cache_hit_length, &mut out[..1]),
            CoordinatorKind::Hybrid => self.hybrid_search(&staged, max_cache_hit_length, &mut out, &mut tmp).num_tokens,
        };
        self.scratch_spec = tmp;
        self.scratch_probe = out;
        self.scratch_hashes = staged;
        Ok(n)
    }

    /// Checks a hit before it is adopted (see [`Self::allocate_slots`]).
    ///
    /// Every group that takes hits holds exactly `num_new_computed_tokens / block_size`
    /// blocks, with one exception, vLLM's: a KV connector's per-group hit
    /// ([`Self::get_computed_blocks_for_connector`]) reports full attention's tokens with each
    /// group's own blocks, and vLLM's scheduler adopts one where a group lags behind full
    /// attention (`hit_diverged`) only when the connector loads the rest
    /// (`num_external_computed_tokens > 0`; else it takes `get_computed_blocks`' reconciled
    /// hit). So a group holds fewer blocks only when the config takes per-group hits (see
    /// [`Self::per_group_hit_group`]), the group is not full attention and external tokens
    /// come with the hit: their blocks, allocated after the hit's, cover the lagging group's
    /// gap and the connector writes them. Anywhere else the fresh blocks past a short hit
    /// would never be written, yet be cached under the request's hashes for those positions.
    pub(super) fn validate_hit(
        &self,
        s: Slot,
        hit_blocks: &[Vec<BlockId>],
        num_new_computed_tokens: u32,
        num_external_computed_tokens: u32,
        explicit: bool,
    ) -> Result<()> {
        let ng = self.managers.len();
        let may_lag = num_external_computed_tokens > 0 && self.per_group_hit_group().is_some();
        let partial_hits = self.partial_hash_hits;
        if hit_blocks.len() != ng {
            return Err(Error::OutOfRange(format!("{} hit groups given, the config has {ng}", hit_blocks.len())));
        }
        let hashes = &self.reqs[s as usize].hashes;
        for (g, v) in hit_blocks.iter().enumerate() {
            let nb = self.pool_for(g as GroupId).num_blocks();
            if let Some(&b) = v.iter().find(|&&b| b >= nb) {
                return Err(Error::InvalidBlock(format!("block id {b} >= num_blocks {nb} (group {g})")));
            }
        }
        let mut seen: rustc_hash::FxHashSet<u64> = Default::default();
        for (g, (m, v)) in self.managers.iter().zip(hit_blocks).enumerate() {
            if !m.kind().takes_hits() {
                if !v.is_empty() {
                    return Err(Error::OutOfRange(format!(
                        "group {g} (cross attention or circular buffer) cannot have cache-hit blocks"
                    )));
                }
                continue;
            }
            let bs = m.block_size();
            // A group lagging behind full attention: see the doc comment. With partial hash
            // hits a hit may end inside its last block.
            let len = v.len() as u64 * bs as u64;
            let lags = len < num_new_computed_tokens as u64 && may_lag && !m.kind().is_full();
            let partial = partial_hits && num_new_computed_tokens % bs != 0;
            let fits = if partial {
                v.len() as u64 == cdiv(num_new_computed_tokens as u64, bs as u64)
            } else {
                len == num_new_computed_tokens as u64
            };
            if !fits && !lags {
                return Err(Error::OutOfRange(format!(
                    "group {g}: a hit of {} blocks of {bs} tokens for num_new_computed_tokens={num_new_computed_tokens} \
                     (only a group other than full attention of a KV connector's per-group hit, with Mamba \
                     layers and full attention, adopted with external tokens, may hold fewer)",
                    v.len()
                )));
            }
            if v.is_empty() {
                continue;
            }
            let view = HashView { hashes, scale: bs / self.cfg.hash_block_size };
            let partial_tail = (partial && !lags).then(|| num_new_computed_tokens / self.cfg.hash_block_size);
            if let Some(nh) = partial_tail {
                if nh as usize > hashes.len() {
                    return Err(Error::OutOfRange(format!(
                        "group {g}: a hit of {num_new_computed_tokens} tokens, but the request has hashes for {}",
                        hashes.len() as u64 * self.cfg.hash_block_size as u64
                    )));
                }
            } else if v.len() as u64 > view.len() as u64 {
                return Err(Error::OutOfRange(format!(
                    "group {g}: a hit of {} blocks, but the request has hashes for {}",
                    v.len(),
                    view.len()
                )));
            }
            let nulls_allowed = !m.kind().is_full();
            let pool = self.pool_for(g as GroupId);
            let mut leading = true;
            for (i, &b) in v.iter().enumerate() {
                if b == NULL_BLOCK {
                    if !(nulls_allowed && leading) {
                        return Err(Error::InvalidBlock(format!(
                            "group {g}: the null block at hit position {i} (only a sliding-window or \
                             chunked group's hit starts with null blocks)"
                        )));
                    }
                    continue;
                }
                leading = false;
                // Ids of two pools may be equal: only a repeat within one pool is a repeat.
                let tagged = if page_side(self.state_groups, g as GroupId) { b as u64 | 1 << 32 } else { b as u64 };
                if explicit && !seen.insert(tagged) {
                    return Err(Error::InvalidBlock(format!("block {b} appears twice in the hit")));
                }
                let held = match partial_tail {
                    // The last block of a hit ending inside it is keyed at a boundary of this
                    // request's at or past the hit's end within the block (a full-attention
                    // block found further on, its hit then cut back by another group).
                    Some(nh) if i + 1 == v.len() => {
                        let end = ((i as u64 + 1) * view.scale as u64).min(hashes.len() as u64) as usize;
                        (nh as usize..=end).any(|k| k > 0 && pool.holds_key(b, &(hashes[k - 1], g as GroupId)))
                    }
                    _ => pool.holds_key(b, &(view.get(i as u32), g as GroupId)),
                };
                if !held {
                    return Err(Error::InvalidBlock(format!(
                        "block {b} at hit position {i} of group {g} is not cached with this request's \
                         hash for that position{}",
                        if explicit { "" } else { " (it was reused since the hit was found)" }
                    )));
                }
            }
        }
        Ok(())
    }

    /// vLLM's `estimate_cached_tokens`: the minimum over cacheable groups of the longest
    /// prefix any block of the table is hashed for.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn estimate_cached_tokens(&self, h: ReqHandle) -> Result<u32> {
        let s = self.slot(h)?;
        let mut best: Option<u32> = None;
        for m in &self.managers {
            if !m.kind().takes_hits() {
                continue;
            }
            let pool = self.pool_for(m.group_id());
            let t = m.blocks(s).iter().map(|&b| pool.block_hash_num_tokens(b)).max().unwrap_or(0);
            best = Some(best.map_or(t, |x| x.min(t)));
        }
        Ok(best.unwrap_or(0))
    }
}
