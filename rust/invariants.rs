//! Whole-state consistency checks, run by the property tests after every operation.
//! O(num_blocks + table sizes + index size): for tests and debugging, never on a hot path.
#![forbid(unsafe_code)]

use crate::coordinator::Allocator;
use crate::ids::NULL_BLOCK;

/// Checks every invariant of the allocator; returns the first violation found.
///
/// With `exact_refs`, each block's reference count must equal the number of table slots
/// holding it (true unless blocks were popped with `pop_blocks_for_free` and not yet freed).
pub fn check(a: &Allocator) -> Result<(), String> {
    check_with(a, true)
}

/// [`check`] with the reference-count equality made optional.
pub fn check_with(a: &Allocator, exact_refs: bool) -> Result<(), String> {
    let pool = a.pool();
    let n = pool.num_blocks();
    if pool.queue.contains(NULL_BLOCK) {
        return Err("the null block is in the free queue".into());
    }
    let mut queued = 0u32;
    for b in 1..n {
        let q = pool.queue.contains(b);
        let rc = pool.ref_cnt(b);
        if q != (rc == 0) {
            return Err(format!("block {b}: queued={q} but ref_cnt={rc}"));
        }
        queued += q as u32;
    }
    if queued != pool.queue.len() || pool.queue.iter().count() as u32 != queued {
        return Err(format!("free queue length {} but {queued} blocks have ref_cnt 0", pool.queue.len()));
    }
    if pool.block_hash(NULL_BLOCK).is_some() {
        return Err("the null block is hashed".into());
    }
    for b in 1..n {
        if let Some(key) = pool.block_hash(b) {
            if !pool.index.contains(key, b) {
                return Err(format!("block {b} has a hash the index does not map to it"));
            }
        } else if pool.block_hash_num_tokens(b) != 0 {
            return Err(format!("block {b} has hash tokens but no hash"));
        }
    }
    for (key, b) in pool.index.iter() {
        if pool.block_hash(b) != Some(key) {
            return Err(format!("index maps a key to block {b}, whose hash differs"));
        }
    }
    for h in a.live_handles() {
        let (slots, _, _) = a.noop_limits(h).map_err(|e| e.to_string())?;
        for (g, m) in a.managers().iter().enumerate() {
            let t = m.blocks(h);
            let np = m.null_prefix(h) as usize;
            if np > t.len() || t[..np].iter().any(|&b| b != NULL_BLOCK) {
                return Err(format!("handle {h} group {g}: null prefix {np} does not match the table"));
            }
            if !matches!(m.spec.kind, crate::config::AttentionKind::Cross)
                && slots as usize > t.len() * m.block_size() as usize
            {
                return Err(format!("handle {h}: slot limit {slots} beyond group {g}'s table"));
            }
        }
    }
    let mut refs = vec![0u32; n as usize];
    for m in a.managers() {
        for (h, table) in m.tables() {
            let live = a.is_live(h);
            if !live && !table.is_empty() {
                return Err(format!("released handle {h} still has blocks in group {}", m.group_id));
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
                        return Err(format!("handle {h}: freed block {b} in group {}", m.group_id));
                    }
                    refs[b as usize] += 1;
                }
            }
        }
    }
    for b in 1..n {
        let rc = pool.ref_cnt(b);
        let r = refs[b as usize];
        if (exact_refs && rc != r) || rc < r {
            return Err(format!("block {b}: ref_cnt {rc} but held {r} times by tables"));
        }
    }
    Ok(())
}
