//! Retention policies: which cached blocks stay in the prefix cache and in what order free
//! cached blocks are evicted.
//!
//! - [`Policy::Exact`] (the default) is vLLM's: sliding-window groups cache only the blocks
//!   their retention mask keeps (`prefix_cache_retention_interval`), and free cached blocks
//!   are evicted in one LRU order, whatever their group.
//! - [`Policy::HitAware`] keeps every prefix the full-attention group can serve servable by
//!   the window groups too, without letting window blocks push full-attention prefixes out:
//!   1. *Dense, tiered window caching.* A window group hashes every full block, but the
//!      blocks vLLM's mask would skip are cached at [`LEVEL_SPECULATIVE`]: the free queue
//!      hands out every free speculative block before any block at [`LEVEL_NORMAL`]. So they
//!      only ever use memory nothing else wants (with `exact` those blocks would be
//!      unhashed and free anyway): they cannot flood the LRU as dense retention (`None`)
//!      does. Those within one window before a boundary's tail go to [`LEVEL_NEAR`],
//!      evicted after the other speculative blocks: a prefix shared up to a little before a
//!      prompt's end stays servable longest.
//!   2. *The window tail where the next turn resumes.* When a request ends (`free`), the
//!      window tail ending at its last cached block (its whole sequence: prompt and reply)
//!      is promoted to [`LEVEL_NORMAL`], so a chat's next turn, which re-sends the
//!      conversation, hits all of it instead of resuming at the previous prompt's end.
//!   3. *A junction the first time it is used.* When a request adopts a hit, the window
//!      blocks of the hit (the tail that made it servable) are promoted to
//!      [`LEVEL_NORMAL`]: a shared prefix found by a second request through speculative
//!      blocks stays as well kept as the full-attention prefix it completes.
//!   4. *Hit units evicted together.* A request's blocks are freed in token-position order
//!      (tail first) across all groups, not group after group, so the LRU evicts a window
//!      tail together with the full-attention blocks of the same span instead of leaving one
//!      group holding blocks the other can no longer complete.
//!
//!   5. *State-space hybrids (Mamba "align"): only the states a hit resumes from keep their
//!      level.* A state its request has passed (a chat's previous turn, once the next turn
//!      computes on from it; the prompt's tail state, once decode passes the next boundary)
//!      goes to [`LEVEL_SPECULATIVE`] unless it is a branch point (a junction the lookup found
//!      shared with another request, or pinned; a prefix where a finished request's sequence
//!      ended, which a chat's next turn continues, is no junction). A full-attention block
//!      that duplicates the one lookups find for its key (recomputed because no state served
//!      it) is freed speculative. So under pressure the pool holds whole hit units, not
//!      dominated states and unreachable copies.
//!
//!   6. *Hit units (state-space hybrids).* A hit needs a state in every Mamba group and the
//!      full-attention blocks before it: a *unit* (`HitUnits`). When a request is freed,
//!      its furthest position where a state is cached in every Mamba group forms a unit with
//!      the full-attention blocks before it; its full-attention blocks past that state serve
//!      no hit and are evicted first. When any member of a unit is evicted, the members no
//!      other live unit needs go to the front of the queue (a state set is useless without
//!      its prefix, and a prefix without a state at or past it), so the pool loses one whole
//!      unit at a time instead of damaging many. A full-attention block where another state
//!      set is cached (a shared prefix's junction) and branch points keep their level.
//!   7. *The running session's unit goes first (state-space hybrids).* A state a request
//!      resumed from in its own conversation (no junction shared with another request, no
//!      pin) waits below every finished unit while the request runs: at [`LEVEL_NEAR`], or at
//!      [`LEVEL_RESUMED`] when it was on probation. Under round-robin chat the running
//!      session comes back last. When the request is freed its furthest state is raised again.
//!
//!   8. *Junctions inside a block (`--prefix-match-unit`, vLLM's partial hash hits).* With
//!      a Mamba block larger than the hash block, a prefix shorter than one block hits only
//!      where a state was kept inside the block. The coordinator remembers which hash-block
//!      prefixes earlier prompts passed through ([`crate::Allocator`]'s sightings, recorded
//!      at a request's first lookup, bounded). A lookup reports the longest prefix another
//!      prompt went on past as the shared prefix's end; vLLM's scheduler ends a prefill chunk
//!      there (our manager sets vLLM's `mamba_shared_prefix_checkpoint`, which vLLM's own
//!      manager turns on only for EAGLE), the Mamba groups key their state there and full
//!      attention keys the block there too (a second key, as vLLM keeps one per block). So
//!      the 3rd prompt sharing a system prompt of any length of at least one unit hits all of
//!      it, and the 2nd hits up to its first-sighting stop. A prefix where earlier prompts
//!      only ended (a chat's previous turn) is no junction: the partial tail serves it. A
//!      hit whose end another prompt went on past marks its states branch points. Every
//!      branch point a request passes on its way to its hit (with the full-attention block
//!      keyed there, when it is still cached) goes to at least [`LEVEL_NORMAL`] and to the
//!      back of its level, as a hit on it would: under `exact` every sibling hits the shared
//!      system prompt's state and keeps it recent, while a hit-aware sibling resumes further
//!      on (its own previous turn), and without this the shared state aged out first under
//!      pressure. A partial tail is kept at its level with the tail block in its hit unit.
//!      Cost: a junction costs the request one more prefill chunk (one scheduler step) and
//!      one state page per Mamba group while cached; the sightings cost O(prompt hashes) at
//!      a request's first lookup and a binary search, O(log(prompt)), at each; adopting a
//!      hit costs O(hit / hash block x groups) lookups.
//!
//!   User controls ride on the same levels: blocks of a request freed with a retention
//!   priority and blocks of a pinned prefix go to [`LEVEL_PINNED`] (bounded share of the
//!   pool; see [`crate::Allocator::pin_prefix`]).
//!
//!   9. *KV hints (issue 38, `hints.rs`).* An application's per-request hints ride on the
//!      same levels, each for a TTL of the manager's clock: a *pin lease* holds the
//!      request's prefix keys at [`LEVEL_LEASED`] (above [`LEVEL_PINNED`]; a key stays leased
//!      until its last lease ends, leases on the same keys sharing one count; a lease past
//!      the pinned share is refused, never demoting another);
//!      a *retain* frees the request's prefix and the state at its end at a chosen level
//!      (high: pinned, normal: kept from the policy's demotions, low: speculative); a
//!      session's *release* demotes what its requests retained or leased to the speculative
//!      level; a *checkpoint* is a junction the application names (rule 8's path). At
//!      its TTL a lease or retain ends and the blocks still under its keys go back to
//!      [`LEVEL_NORMAL`] (`HitAware::advance_clock`, a heap by expiry).
//!
//! Where the rules live, one room a layer: this folder (the levels here; the per-block
//! state, the pool's six hooks and the decisions in `retention.rs`, reached through the one
//! handle the pool lends, `BlockPool::hit_aware`, `None` under `exact`; the hit units in
//! `units.rs`; the KV hints' leases, retains and clock in `hints.rs`), `manager/retention.rs` (the rules per group, Mamba "align"'s included) and
//! `coordinator/hit_aware.rs` (per request: junctions, sightings, a freed request's levels,
//! pinning).
//!
//! Correctness does not depend on the policy: blocks are only ever found by their chained
//! hash (the full prefix up to and including the block, in that group), and a block keeps
//! a hash only while it holds the KV of exactly those tokens, so a hit is what recomputation
//! would produce. The policy only changes which hashes are kept and how long; every hash
//! entering the index emits `BlockStored`, every hash leaving it `BlockRemoved`.
//!
//! Cost: the levels add nothing to a decode step; `free` sorts the request's blocks
//! (O(table log table)); promotion is O(window blocks). With Mamba groups, `free` forms a
//! unit (O(table x Mamba groups) lookups) and evicting a block of a unit dissolves it
//! (O(members)).
#![forbid(unsafe_code)]

mod hints;
pub(crate) mod retention;
mod units;

pub use hints::{HintStats, MAX_TTL_MS};
pub use retention::Retention;
pub(crate) use units::HitUnits;

use crate::error::{Error, Result};

/// Which blocks stay cached and in what order they are evicted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// vLLM's decisions, bit for bit.
    #[default]
    Exact,
    /// Keeps hybrid models' hits (see the module docs).
    HitAware,
}

impl Policy {
    /// Parses `"exact"` or `"hit-aware"` (also `"hit_aware"`), case-insensitive.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the valid values.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "exact" | "" => Ok(Policy::Exact),
            "hit-aware" | "hit_aware" | "hitaware" => Ok(Policy::HitAware),
            other => Err(Error::InvalidConfig(format!("unknown policy {other:?}: use \"exact\" or \"hit-aware\""))),
        }
    }

    /// The name `parse` accepts.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Exact => "exact",
            Policy::HitAware => "hit-aware",
        }
    }
}

/// A free cached block's retention level: lower levels are evicted first.
pub type Level = u8;
/// Window blocks no known boundary needs (the blocks vLLM's mask skips).
pub const LEVEL_SPECULATIVE: Level = 0;
/// Speculative window blocks within one window before a boundary's tail: with them a hit
/// can resume anywhere in the window before the boundary (a shared prefix that ends a little
/// before a prompt's end, as a re-sent context with a new question does).
pub const LEVEL_NEAR: Level = 1;
/// State-space hybrids only: the blocks a finished request computed itself, when its own
/// hit saved less than half its prompt (it has not shown that its conversation comes back).
/// Evicted before [`LEVEL_NORMAL`]: under a cyclic load larger than the cache (round-robin
/// chat sessions) LRU evicts every session just before it returns; with this level the
/// sessions that do hit keep their hit units and the others wait their turn (segmented LRU).
pub const LEVEL_PROBATION: Level = 3;
/// State-space hybrids only: a state on probation that its own conversation's next turn
/// resumed from, while that turn runs (rule 7 above): queued newest first, like probation,
/// and evicted just before it. It served a hit, so it is not on probation; its session comes
/// back last.
pub const LEVEL_RESUMED: Level = 2;
/// Every other cached block (vLLM's single LRU level).
pub const LEVEL_NORMAL: Level = 4;
/// Blocks of a pinned prefix or of a request with a retention priority.
pub const LEVEL_PINNED: Level = 5;
/// Blocks under a running pin lease (a KV hint, see rule 9): evicted after every other
/// cached block, never demoted by the pinned share's overflow (leases are refused past it).
pub const LEVEL_LEASED: Level = 6;
/// Levels of a hit-aware free queue.
pub const NUM_LEVELS: u32 = 7;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_known_names_round_trip() {
        for p in [Policy::Exact, Policy::HitAware] {
            assert_eq!(Policy::parse(p.name()).unwrap(), p);
        }
        assert_eq!(Policy::parse(" HIT_AWARE ").unwrap(), Policy::HitAware);
        assert!(matches!(Policy::parse("lru"), Err(Error::InvalidConfig(_))));
    }
}
