//! The rules of the direct API that a front end (the Python binding, `rust/py`) would
//! otherwise have to hold: which attention kinds there are and the named parameters each
//! takes (the kind registry), what the token counts of `allocate_slots`, `cache_blocks` and
//! `get_num_blocks_to_allocate` default to, which group ids a zeroing filter keeps, and the
//! retention level `free(retain=...)` means. Everything here takes caller values unchecked
//! (`i64`, as a front end receives them) and checks them, so a front end only converts.
//!
//! Cost: every function is O(its arguments); nothing allocates except [`cached_block_groups`]
//! (one `Vec` of the given length).
#![forbid(unsafe_code)]

use crate::config::{AttentionKind, GroupSpec};
use crate::coordinator::{token_count, AllocateArgs};
use crate::error::{Error, Result};
use crate::ids::GroupId;
use crate::policy::{Level, LEVEL_NORMAL, LEVEL_PINNED};

/// A named parameter of an attention kind: one field of the kind's group spec (the Python
/// spec classes of `hybrid_alloc.specs` use [`KindParam::name`] as the attribute name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KindParam {
    /// The window in tokens (sliding window).
    Window,
    /// R-SWA's window in tokens (field `window`, vLLM's `rswa_window`).
    RswaWindow,
    /// Tokens a sliding window keeps beyond its window (vLLM 0.33's retention).
    ExtraRetainedTokens,
    /// The attention chunk in tokens (chunked local).
    Chunk,
    /// Extra Mamba state blocks for speculative decoding.
    SpeculativeBlocks,
    /// Mamba "align": vLLM 0.32's rule re-keying the prompt's cached checkpoint state (a bool).
    RekeyCachedTail,
    /// Mamba "align": the prefill checkpoint alignment (0: no prefill checkpoint blocks).
    CheckpointAlignment,
}

impl KindParam {
    /// The field name in a group spec.
    pub fn name(self) -> &'static str {
        match self {
            KindParam::Window | KindParam::RswaWindow => "window",
            KindParam::ExtraRetainedTokens => "extra_retained_tokens",
            KindParam::Chunk => "chunk",
            KindParam::SpeculativeBlocks => "speculative_blocks",
            KindParam::RekeyCachedTail => "rekey_cached_tail",
            KindParam::CheckpointAlignment => "checkpoint_alignment",
        }
    }

    /// vLLM's name for the value, used in range errors.
    fn vllm_name(self) -> &'static str {
        match self {
            KindParam::Window => "sliding_window",
            KindParam::RswaWindow => "rswa_window",
            KindParam::ExtraRetainedTokens => "extra_retained_tokens",
            KindParam::Chunk => "attention_chunk_size",
            KindParam::SpeculativeBlocks => "num_speculative_blocks",
            KindParam::RekeyCachedTail => "rekey_cached_tail",
            KindParam::CheckpointAlignment => "prefill_checkpoint_alignment",
        }
    }

    /// The value a spec that leaves the field out means, or `None` when it is required.
    pub fn default_value(self) -> Option<i64> {
        match self {
            KindParam::Window | KindParam::RswaWindow | KindParam::Chunk => None,
            _ => Some(0),
        }
    }
}

/// One attention kind a group can name.
#[derive(Clone, Copy, Debug)]
pub struct KindEntry {
    /// The kind's name (`kind` of a group spec).
    pub name: &'static str,
    /// Its parameters, in the order of the legacy positional tuple's `param1, param2, param3`.
    pub params: &'static [KindParam],
    /// The kind from its parameters' checked values, in [`Self::params`] order (a flag is 0 or 1).
    pub build: fn(&[u32]) -> AttentionKind,
}

/// The kind registry: every kind the core serves, with how to build it from its named
/// parameters (the manager that serves it is the kind's rules, `crate::manager::KindRules`).
/// "mla" allocates as "full".
pub const KINDS: &[KindEntry] = &[
    KindEntry { name: "full", params: &[], build: |_| AttentionKind::Full },
    KindEntry { name: "mla", params: &[], build: |_| AttentionKind::Full },
    KindEntry { name: "rswa", params: &[KindParam::RswaWindow], build: |p| AttentionKind::Rswa { window: p[0] } },
    KindEntry {
        name: "sliding_window",
        params: &[KindParam::Window, KindParam::ExtraRetainedTokens],
        build: |p| AttentionKind::SlidingWindow { window: p[0], extra_retained_tokens: p[1] },
    },
    KindEntry {
        name: "chunked_local",
        params: &[KindParam::Chunk],
        build: |p| AttentionKind::ChunkedLocal { chunk: p[0] },
    },
    KindEntry { name: "cross", params: &[], build: |_| AttentionKind::Cross },
    KindEntry {
        name: "mamba",
        params: &[KindParam::SpeculativeBlocks],
        build: |p| AttentionKind::Mamba {
            speculative_blocks: p[0],
            align: false,
            rekey_cached_tail: false,
            checkpoint_alignment: 0,
        },
    },
    KindEntry {
        name: "mamba_align",
        params: &[KindParam::SpeculativeBlocks, KindParam::RekeyCachedTail, KindParam::CheckpointAlignment],
        build: |p| AttentionKind::Mamba {
            speculative_blocks: p[0],
            align: true,
            rekey_cached_tail: p[1] != 0,
            checkpoint_alignment: p[2],
        },
    },
    KindEntry { name: "circular_buffer", params: &[], build: |_| AttentionKind::CircularBuffer },
    KindEntry {
        name: "sliding_window_replay",
        params: &[KindParam::Window, KindParam::ExtraRetainedTokens],
        build: |p| AttentionKind::SlidingWindowReplay { window: p[0], extra_retained_tokens: p[1] },
    },
];

/// The registry entry of `kind`.
///
/// # Errors
/// [`Error::Unsupported`] for a kind the core does not serve, naming those it does.
pub fn kind_entry(kind: &str) -> Result<&'static KindEntry> {
    KINDS.iter().find(|k| k.name == kind).ok_or_else(|| {
        let names: Vec<&str> = KINDS.iter().map(|k| k.name).collect();
        Error::Unsupported(format!("attention kind {kind:?} is not served ({} are)", names.join(", ")))
    })
}

/// Builds the attention kind `kind` from its named parameters: `param` is asked once for
/// each parameter of the kind (see [`KINDS`]) and answers its value.
///
/// # Errors
/// [`Error::Unsupported`] for an unknown kind; whatever `param` returns; [`Error::OutOfRange`]
/// for a value that is negative or above `u32::MAX`.
pub fn attention_kind(kind: &str, mut param: impl FnMut(KindParam) -> Result<i64>) -> Result<AttentionKind> {
    let entry = kind_entry(kind)?;
    // A flag is any int (non-zero: set); every other parameter is a count.
    let mut n = |p: KindParam| -> Result<u32> {
        let v = param(p)?;
        match p {
            KindParam::RekeyCachedTail => Ok(u32::from(v != 0)),
            _ => token_count(p.vllm_name(), v),
        }
    };
    let mut values = [0u32; 3];
    for (v, &p) in values.iter_mut().zip(entry.params) {
        *v = n(p)?;
    }
    Ok((entry.build)(&values[..entry.params.len()]))
}

/// A group from its named fields (see [`attention_kind`] for `param`).
///
/// # Errors
/// Those of [`attention_kind`]; a block size or spec key outside `u32`.
pub fn group_spec(
    kind: &str,
    block_size: i64,
    spec_key: i64,
    param: impl FnMut(KindParam) -> Result<i64>,
) -> Result<GroupSpec> {
    Ok(GroupSpec {
        kind: attention_kind(kind, param)?,
        block_size: token_count("block_size", block_size)?,
        spec_key: token_count("spec_key", spec_key)?,
    })
}

/// A group from the legacy positional tuple `(kind, block_size, spec_key, param1, param2,
/// param3)`: `param1..3` are the kind's parameters in [`KindEntry::params`] order (unused
/// ones are ignored).
///
/// # Errors
/// Those of [`group_spec`].
pub fn positional_group_spec(kind: &str, block_size: i64, spec_key: i64, params: [i64; 3]) -> Result<GroupSpec> {
    let entry = kind_entry(kind)?;
    group_spec(kind, block_size, spec_key, |p| {
        let i = entry.params.iter().position(|&q| q == p).unwrap_or(0);
        Ok(params[i])
    })
}

/// The caller's arguments of `allocate_slots`, unchecked; the request's own counts default
/// to a request whose tokens are exactly those computed and scheduled now.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllocateRequest<'a> {
    /// See [`AllocateArgs::num_new_tokens`].
    pub num_new_tokens: i64,
    /// See [`AllocateArgs::num_new_computed_tokens`].
    pub num_new_computed_tokens: i64,
    /// See [`AllocateArgs::num_lookahead_tokens`].
    pub num_lookahead_tokens: i64,
    /// See [`AllocateArgs::num_external_computed_tokens`].
    pub num_external_computed_tokens: i64,
    /// See [`AllocateArgs::delay_cache_blocks`].
    pub delay_cache_blocks: bool,
    /// See [`AllocateArgs::num_encoder_tokens`].
    pub num_encoder_tokens: i64,
    /// See [`AllocateArgs::full_sequence_must_fit`].
    pub full_sequence_must_fit: bool,
    /// See [`AllocateArgs::reserved_blocks`].
    pub reserved_blocks: i64,
    /// See [`AllocateArgs::apply_watermark`].
    pub apply_watermark: bool,
    /// `request.num_computed_tokens`.
    pub num_computed_tokens: i64,
    /// `request.num_in_flight_tokens`.
    pub num_in_flight_tokens: i64,
    /// `request.num_prompt_tokens`; `None`: the request's `num_tokens`.
    pub num_prompt_tokens: Option<i64>,
    /// `request.num_tokens`; `None`: computed + new computed + external + new tokens.
    pub num_tokens: Option<i64>,
    /// `request.shared_prefix_boundary`.
    pub shared_prefix_boundary: i64,
    /// vLLM's `skip_zeroing_group_ids` (filtered by [`group_mask`]).
    pub skip_zeroing_group_ids: &'a [i64],
    /// Trust `num_computed_tokens` as vLLM's manager does ([`AllocateArgs::trust_computed_tokens`]):
    /// set for an allocator a vLLM adapter drives, unset for the direct API, which checks it.
    pub trust_computed_tokens: bool,
}

impl AllocateRequest<'_> {
    /// The checked arguments, defaults applied.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a count that is negative or above `u32::MAX`.
    pub fn args(&self) -> Result<AllocateArgs> {
        let default_tokens = self
            .num_computed_tokens
            .saturating_add(self.num_new_computed_tokens)
            .saturating_add(self.num_external_computed_tokens)
            .saturating_add(self.num_new_tokens);
        let num_tokens = self.num_tokens.unwrap_or(default_tokens);
        Ok(AllocateArgs {
            num_new_tokens: token_count("num_new_tokens", self.num_new_tokens)?,
            num_new_computed_tokens: token_count("num_new_computed_tokens", self.num_new_computed_tokens)?,
            num_lookahead_tokens: token_count("num_lookahead_tokens", self.num_lookahead_tokens)?,
            num_external_computed_tokens: token_count(
                "num_external_computed_tokens",
                self.num_external_computed_tokens,
            )?,
            delay_cache_blocks: self.delay_cache_blocks,
            num_encoder_tokens: token_count("num_encoder_tokens", self.num_encoder_tokens)?,
            full_sequence_must_fit: self.full_sequence_must_fit,
            reserved_blocks: token_count("reserved_blocks", self.reserved_blocks)?,
            apply_watermark: self.apply_watermark,
            num_computed_tokens: token_count("num_computed_tokens", self.num_computed_tokens)?,
            num_in_flight_tokens: token_count("num_in_flight_tokens", self.num_in_flight_tokens)?,
            num_prompt_tokens: token_count("num_prompt_tokens", self.num_prompt_tokens.unwrap_or(num_tokens))?,
            num_tokens: token_count("num_tokens", num_tokens)?,
            shared_prefix_boundary: token_count("shared_prefix_boundary", self.shared_prefix_boundary)?,
            skip_zeroing_groups: group_mask(self.skip_zeroing_group_ids),
            trust_computed_tokens: self.trust_computed_tokens,
        })
    }
}

/// The checked counts of `cache_blocks`: `(num_computed_tokens, num_prompt_tokens,
/// shared_prefix_boundary)`, the prompt defaulting to the computed tokens.
///
/// # Errors
/// [`Error::OutOfRange`] for a count outside `u32`.
pub fn cache_blocks_counts(
    num_computed_tokens: i64,
    num_prompt_tokens: Option<i64>,
    shared_prefix_boundary: i64,
) -> Result<(u32, u32, u32)> {
    Ok((
        token_count("num_computed_tokens", num_computed_tokens)?,
        token_count("num_prompt_tokens", num_prompt_tokens.unwrap_or(num_computed_tokens))?,
        token_count("shared_prefix_boundary", shared_prefix_boundary)?,
    ))
}

/// The target model's share of `num_tokens` in `get_num_blocks_to_allocate`: all of them
/// unless the caller says otherwise (a draft model's tokens are not its).
///
/// # Errors
/// [`Error::OutOfRange`] for a count outside `u32`.
pub fn num_tokens_main_model(num_tokens: i64, num_tokens_main_model: Option<i64>) -> Result<u32> {
    token_count("num_tokens_main_model", num_tokens_main_model.unwrap_or(num_tokens))
}

/// The zeroing filter's bit mask: bit `g` for each id `g` in `ids`. Ids of groups a config
/// cannot have (negative, or 64 and above) are ignored, as vLLM ignores ids it has no group for.
pub fn group_mask(ids: &[i64]) -> u64 {
    ids.iter().filter(|&&g| (0..64).contains(&g)).fold(0u64, |m, &g| m | 1 << g)
}

/// Group ids for a lookup in every one of them (`get_cached_block`).
///
/// # Errors
/// [`Error::OutOfRange`] for an id that is not a group of the allocator.
pub fn cached_block_groups(ids: &[i64], num_groups: usize) -> Result<Vec<GroupId>> {
    ids.iter()
        .map(|&g| match usize::try_from(g) {
            Ok(i) if i < num_groups => Ok(i as GroupId),
            _ => Err(Error::OutOfRange(format!("group {g} (the allocator has {num_groups})"))),
        })
        .collect()
}

/// The retention level of what a freed request leaves cached: pinned when the caller asks
/// to retain it (hit-aware only; the exact policy ignores levels), else normal.
pub fn free_level(retain: bool) -> Level {
    if retain {
        LEVEL_PINNED
    } else {
        LEVEL_NORMAL
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_kind_unknown_is_unsupported() {
        let e = attention_kind("linear", |_| Ok(0)).unwrap_err();
        assert!(matches!(e, Error::Unsupported(ref m) if m.contains("mamba_align")), "{e}");
    }

    #[test]
    fn attention_kind_asks_each_named_param() {
        let mut asked = Vec::new();
        let k = attention_kind("mamba_align", |p| {
            asked.push(p);
            Ok(match p {
                KindParam::SpeculativeBlocks => 2,
                KindParam::RekeyCachedTail => 1,
                _ => 16,
            })
        })
        .unwrap();
        assert_eq!(asked, KINDS[7].params);
        assert_eq!(
            k,
            AttentionKind::Mamba {
                speculative_blocks: 2,
                align: true,
                rekey_cached_tail: true,
                checkpoint_alignment: 16
            }
        );
    }

    #[test]
    fn positional_group_spec_maps_params_in_order() {
        let g = positional_group_spec("sliding_window", 16, 1, [64, 8, 0]).unwrap();
        assert_eq!(g.kind, AttentionKind::SlidingWindow { window: 64, extra_retained_tokens: 8 });
        assert_eq!((g.block_size, g.spec_key), (16, 1));
        let g = positional_group_spec("chunked_local", 16, 0, [32, 7, 7]).unwrap();
        assert_eq!(g.kind, AttentionKind::ChunkedLocal { chunk: 32 });
        assert!(matches!(positional_group_spec("rswa", 16, 0, [-1, 0, 0]), Err(Error::OutOfRange(_))));
    }

    #[test]
    fn allocate_request_defaults_tokens_to_computed_plus_new() {
        let a = AllocateRequest { num_new_tokens: 5, num_computed_tokens: 10, ..Default::default() }.args().unwrap();
        assert_eq!((a.num_tokens, a.num_prompt_tokens), (15, 15));
        let a = AllocateRequest { num_new_tokens: 5, num_tokens: Some(40), ..Default::default() }.args().unwrap();
        assert_eq!((a.num_tokens, a.num_prompt_tokens), (40, 40));
        assert!(AllocateRequest { num_new_tokens: -1, ..Default::default() }.args().is_err());
    }

    #[test]
    fn group_mask_ignores_ids_out_of_range() {
        assert_eq!(group_mask(&[0, 3, -1, 64, 99]), 0b1001);
    }

    #[test]
    fn cached_block_groups_refuses_unknown_group() {
        assert_eq!(cached_block_groups(&[1, 0], 2).unwrap(), vec![1, 0]);
        assert!(matches!(cached_block_groups(&[2], 2), Err(Error::OutOfRange(_))));
    }

    #[test]
    fn free_level_pins_retained() {
        assert_eq!((free_level(true), free_level(false)), (LEVEL_PINNED, LEVEL_NORMAL));
    }
}
