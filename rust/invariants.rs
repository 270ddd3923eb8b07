//! Whole-state consistency checks, run by the property tests after every operation.
//! O(`num_blocks` + table sizes + index size): for tests and debugging, never on a hot path.
#![forbid(unsafe_code)]

use crate::block_pool::BlockPool;
use crate::coordinator::Allocator;
use crate::ids::{BlockId, NULL_BLOCK};

/// Checks every invariant of the allocator; returns the first violation found. Each
/// block's reference count equals the table slots holding it plus its loose references
/// (popped with `pop_blocks_for_free`, not yet freed by id).
pub fn check(a: &Allocator) -> Result<(), String> {
    let pool = a.pool();
    match pool.page_pool() {
        None => check_pool(pool, |_, rc| rc == 0)?,
        Some(s) => {
            // Two-level pages: a free slot is queued only while its page is open.
            let k = pool.slots_per_page();
            check_pool(pool, |b, rc| rc == 0 && pool.page_used(b / k) > 0).map_err(|e| format!("slot pool: {e}"))?;
            check_pool(s, |_, rc| rc == 0).map_err(|e| format!("page pool: {e}"))?;
            check_pages(a)?;
        }
    }
    check_tables(a)
}

/// One pool's own invariants: the free queue holds exactly the blocks `queued(b, ref_cnt)`
/// says; the hit-aware levels; the null block; keys and the index agree.
fn check_pool(pool: &BlockPool, queued_when: impl Fn(BlockId, u32) -> bool) -> Result<(), String> {
    let n = pool.num_blocks();
    if pool.queue().contains(NULL_BLOCK) {
        return Err("the null block is in the free queue".into());
    }
    let mut queued = 0u32;
    for b in 1..n {
        let q = pool.queue().contains(b);
        let rc = pool.ref_cnt(b);
        if q != queued_when(b, rc) {
            return Err(format!("block {b}: queued={q} but ref_cnt={rc}"));
        }
        queued += q as u32;
    }
    if queued != pool.queue().len() || pool.queue().iter().count() as u32 != queued {
        return Err(format!("free queue length {} but {queued} blocks should be queued", pool.queue().len()));
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
        r.check_pin_filter()?;
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
    Ok(())
}

/// The two-level page layout (see `block_pool/pages.rs`): every page 1..P-1 is exactly one
/// of free (in the page queue; if the slot side owned it last, all its slots free and out of
/// the slot queue), a state page (references in the page pool, no slot in use or keyed), or
/// an open slot page (a slot in use; the page pool holds one reference for it, and no key);
/// `used` counts the slots in use; pages a state group took are settled.
fn check_pages(a: &Allocator) -> Result<(), String> {
    let pool = a.pool();
    let s = pool.page_pool().expect("two-level pages");
    let k = pool.slots_per_page();
    if !pool.pages_settled() {
        return Err("pages a state group took are not settled (their slots may keep keys)".into());
    }
    for slot in 1..k {
        if pool.ref_cnt(slot) != 0 || pool.block_hash(slot).is_some() || pool.queue().contains(slot) {
            return Err(format!("slot {slot} of the null page is in use, keyed or queued"));
        }
    }
    let (mut free, mut state, mut open) = (0u32, 0u32, 0u32);
    for p in 1..s.num_blocks() {
        let slots = p * k..(p + 1) * k;
        let in_use = slots.clone().filter(|&x| pool.ref_cnt(x) > 0).count() as u32;
        let keyed = slots.clone().any(|x| pool.block_hash(x).is_some());
        if in_use != pool.page_used(p) {
            return Err(format!("page {p}: {in_use} slots in use, counted {}", pool.page_used(p)));
        }
        if s.queue().contains(p) {
            free += 1;
            if in_use > 0 || slots.clone().any(|x| pool.queue().contains(x)) {
                return Err(format!("free page {p} has a slot in use or queued"));
            }
            if keyed && !pool.is_slot_page(p) {
                return Err(format!("free page {p} keeps slot keys but the slot side did not own it"));
            }
            if pool.is_slot_page(p) && s.block_hash(p).is_some() {
                return Err(format!("free page {p} holds a state key and the slot side owned it last"));
            }
        } else if in_use > 0 {
            open += 1;
            if !pool.is_slot_page(p) || s.ref_cnt(p) != 1 || s.loose_refs(p) != 0 || s.block_hash(p).is_some() {
                return Err(format!(
                    "open slot page {p}: slot_page={}, page refs {} (loose {}), keyed {}",
                    pool.is_slot_page(p),
                    s.ref_cnt(p),
                    s.loose_refs(p),
                    s.block_hash(p).is_some()
                ));
            }
        } else {
            state += 1;
            if pool.is_slot_page(p) || keyed || s.ref_cnt(p) == 0 {
                return Err(format!(
                    "state page {p}: slot_page={}, slots keyed {keyed}, page refs {}",
                    pool.is_slot_page(p),
                    s.ref_cnt(p)
                ));
            }
        }
    }
    if free + state + open != s.num_blocks() - 1 || free != a.num_free_blocks() {
        return Err(format!("{free} free + {state} state + {open} open pages of {}", s.num_blocks() - 1));
    }
    Ok(())
}

/// The tables against their pools: live requests only, ids in range, no freed block held,
/// each block's references = table slots + loose references (+ 1 for the slot side's hold
/// on an open slot page in the page pool), the no-op limits, the count of requests holding
/// slots (two-level pages' admission headroom).
fn check_tables(a: &Allocator) -> Result<(), String> {
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
        let n = a.pool_for(m.group_id()).num_blocks();
        for &(h, b, tokens) in m.pending_boundary_offloads() {
            if !a.is_live(h) || b == NULL_BLOCK || b >= n || tokens == 0 {
                return Err(format!("group {}: boundary offload ({h}, {b}, {tokens}) is stale", m.group_id()));
            }
        }
    }
    a.check_noop_limits()?;
    a.check_slot_holders()?;
    let pools: Vec<&BlockPool> = std::iter::once(a.pool()).chain(a.pool().page_pool()).collect();
    let mut refs: Vec<Vec<u32>> = pools.iter().map(|p| vec![0u32; p.num_blocks() as usize]).collect();
    for m in a.managers() {
        let pool = a.pool_for(m.group_id());
        let which = usize::from(!std::ptr::eq(pool, a.pool()));
        let n = pool.num_blocks();
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
                    if which == 0 && pools.len() == 2 && a.pool().page_used(b / a.pool().slots_per_page()) == 0 {
                        return Err(format!("handle {h}: slot {b} of a page that is not an open slot page"));
                    }
                    refs[which][b as usize] += 1;
                }
            }
        }
    }
    for (i, pool) in pools.iter().enumerate() {
        if pool.loose_refs(NULL_BLOCK) != 0 {
            return Err("the null block has loose references".into());
        }
        for b in 1..pool.num_blocks() {
            let rc = pool.ref_cnt(b);
            // The page pool: an open slot page holds one reference for the slot side.
            let held = u32::from(i == 1 && a.pool().page_used(b) > 0);
            let r = refs[i][b as usize] + pool.loose_refs(b) + held;
            if rc != r {
                return Err(format!(
                    "pool {i} block {b}: ref_cnt {rc} but held {} times by tables and {} times popped",
                    refs[i][b as usize],
                    pool.loose_refs(b)
                ));
            }
        }
    }
    Ok(())
}
