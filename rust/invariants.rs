//! Whole-state consistency checks, run by the property tests after every operation.
//! O(`num_blocks` + table sizes + index size): for tests and debugging, never on a hot path.
#![forbid(unsafe_code)]

use crate::coordinator::Allocator;
use crate::ids::NULL_BLOCK;

/// Checks every invariant of the allocator; returns the first violation found. Each
/// block's reference count equals the table slots holding it plus its loose references
/// (popped with `pop_blocks_for_free`, not yet freed by id).
pub fn check(a: &Allocator) -> Result<(), String> {
    let pool = a.pool();
    let n = pool.num_blocks();
    if pool.queue().contains(NULL_BLOCK) {
        return Err("the null block is in the free queue".into());
    }
    let mut queued = 0u32;
    for b in 1..n {
        let q = pool.queue().contains(b);
        let rc = pool.ref_cnt(b);
        if q != (rc == 0) {
            return Err(format!("block {b}: queued={q} but ref_cnt={rc}"));
        }
        queued += q as u32;
    }
    if queued != pool.queue().len() || pool.queue().iter().count() as u32 != queued {
        return Err(format!("free queue length {} but {queued} blocks have ref_cnt 0", pool.queue().len()));
    }
    if let Some(r) = pool.retention() {
        // Hit-aware: a free cached block sits in the segment of its retention level.
        let levels = pool.queue().iter_levels();
        let cached_in = |lvl: crate::policy::Level| {
            levels
                .get(lvl as usize)
                .map_or(0, |seg| seg.iter().filter(|&&b| pool.block_hash(b).is_some()).count() as u32)
        };
        let leased = cached_in(crate::policy::LEVEL_LEASED);
        let pinned = cached_in(crate::policy::LEVEL_PINNED) + leased;
        if pinned != r.pinned_free() {
            return Err(format!("{pinned} free pinned or leased cached blocks, counted {}", r.pinned_free()));
        }
        if leased != r.leased_free() {
            return Err(format!("{leased} free leased cached blocks, counted {}", r.leased_free()));
        }
        // KV hints: a free block at the leased level is the block lookups find under a
        // running lease's key.
        for &b in levels.get(crate::policy::LEVEL_LEASED as usize).map_or(&[][..], |v| &v[..]) {
            if let Some(key) = pool.block_hash(b) {
                if !r.is_leased_key(key) || pool.index().get_one(key) != Some(b) {
                    return Err(format!("free block {b} is at the leased level, not under a lease's key"));
                }
            }
        }
        r.check_holds().map_err(|e| format!("KV hints' retains: {e}"))?;
        if pinned > r.pinned_cap() {
            return Err(format!("{pinned} free pinned blocks above the pinned share {}", r.pinned_cap()));
        }
        for (k, seg) in levels.iter().enumerate() {
            for &b in seg {
                if pool.block_hash(b).is_some() && r.level(b) as usize != k {
                    return Err(format!("free cached block {b} of level {} queued at level {k}", r.level(b)));
                }
            }
        }
    }
    if pool.block_hash(NULL_BLOCK).is_some() {
        return Err("the null block is hashed".into());
    }
    for b in 1..n {
        if let Some(key) = pool.block_hash(b) {
            if !pool.index().contains(key, b) {
                return Err(format!("block {b} has a hash the index does not map to it"));
            }
        } else if pool.block_hash_num_tokens(b) != 0 {
            return Err(format!("block {b} has hash tokens but no hash"));
        }
    }
    // The index's own structure: each slot's tag is its key's, every probe run unbroken from
    // the key's home, chains linked both ways under one key, every keyed block on one chain.
    pool.index().check().map_err(|e| format!("prefix index: {e}"))?;
    for (key, b) in pool.index().iter() {
        if pool.block_hash(b) != Some(key) {
            return Err(format!("index maps a key to block {b}, whose hash differs"));
        }
    }
    pool.check_second_keys()?;
    for h in a.live_handles() {
        let s = (h & 0xFFFF_FFFF) as crate::ids::Slot;
        let slots = a.noop_limits(h).map_err(|e| e.to_string())?.slots;
        for (g, m) in a.managers().iter().enumerate() {
            let t = m.blocks(s);
            let np = m.null_prefix(s) as usize;
            if np > t.len() || t[..np].iter().any(|&b| b != NULL_BLOCK) {
                return Err(format!("handle {h} group {g}: null prefix {np} does not match the table"));
            }
            if let Some((p, end)) = m.rswa_gap(s) {
                // R-SWA: the known gap `cdiv(p, bs)..end` is all null and inside the table.
                if p != u32::MAX {
                    let first = (p as u64).div_ceil(m.block_size() as u64) as usize;
                    let end = end as usize;
                    if end > first && (end > t.len() || t[first..end].iter().any(|&b| b != NULL_BLOCK)) {
                        return Err(format!("handle {h} group {g}: R-SWA gap {first}..{end} is not null"));
                    }
                }
            }
            if m.kind().covers_sequence() && slots as usize > t.len() * m.block_size() as usize {
                return Err(format!("handle {h}: slot limit {slots} beyond group {g}'s table"));
            }
        }
    }
    for m in a.managers() {
        // Boundary-state offloads name live requests only (dropped with their blocks).
        for &(h, b, tokens) in m.pending_boundary_offloads() {
            if !a.is_live(h) || b == NULL_BLOCK || b >= n || tokens == 0 {
                return Err(format!("group {}: boundary offload ({h}, {b}, {tokens}) is stale", m.group_id()));
            }
        }
    }
    a.check_noop_limits()?;
    let mut refs = vec![0u32; n as usize];
    for m in a.managers() {
        for (h, table) in m.tables() {
            let live = a.slot_is_live(h);
            if !live && !table.is_empty() {
                return Err(format!("released handle {h} still has blocks in group {}", m.group_id()));
            }
            if !live {
                continue;
            }
            for &b in table {
                if b >= n {
                    return Err(format!("handle {h}: block id {b} out of range"));
                }
                if b != NULL_BLOCK {
                    if pool.ref_cnt(b) == 0 {
                        return Err(format!("handle {h}: freed block {b} in group {}", m.group_id()));
                    }
                    refs[b as usize] += 1;
                }
            }
        }
    }
    if pool.loose_refs(NULL_BLOCK) != 0 {
        return Err("the null block has loose references".into());
    }
    for b in 1..n {
        let rc = pool.ref_cnt(b);
        let r = refs[b as usize] + pool.loose_refs(b);
        if rc != r {
            return Err(format!(
                "block {b}: ref_cnt {rc} but held {} times by tables and {} times popped",
                refs[b as usize],
                pool.loose_refs(b)
            ));
        }
    }
    Ok(())
}
