//! The optional arguments of the four calls that take more of them than a Rust function
//! should (`Allocator.__new__`, `allocate_slots`, `get_num_blocks_to_allocate`, `set_hints`),
//! and the
//! configuration the first one builds from them: pyo3 maps each
//! Python parameter to one Rust parameter, so these calls take their options as `*args` /
//! `**kwargs` and read them here into a struct with one field per option, with Python's own
//! rules (each at most once, no unknown name, positionals in the declared order).
//! `allocate_slots` takes all of its arguments that way (`*args, **kwargs` and no other
//! parameter, its two required ones included): pyo3 then hands over CPython's own tuple and
//! dict, where any other signature with `**kwargs` has pyo3 match every keyword against the
//! named parameters and copy it into a new dict first (7.6 k instructions of an admission's
//! call with 17 keywords, `benches/binding_calls.py --kind admission`). `set_hints` takes
//! its arguments the same way, and the adapter passes them by position (no name matched).
//! What each
//! option means is the core's ([`crate::api`]); this only finds and converts it. O(options
//! given): each name is matched once, by a `match` on its string.
#![forbid(unsafe_code)]

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use super::convert::u32_arg;
use super::groups::group_spec;
use crate::config::Config;
use crate::policy::Policy;

/// One option of a call: its value if it was given (`None` included), and where it belongs,
/// for error messages.
#[derive(Default)]
pub(super) struct Opt<'py> {
    value: Option<Bound<'py, PyAny>>,
    call: &'static str,
    name: &'static str,
}

impl<'py> Opt<'py> {
    /// Whether it was given (`None` included).
    pub(super) fn given(&self) -> bool {
        self.value.is_some()
    }

    /// As a `T`, or `default` when it was not given or given as `None`.
    pub(super) fn get<T: for<'a> FromPyObject<'a, 'py, Error: Into<PyErr>>>(&self, default: T) -> PyResult<T> {
        Ok(self.opt()?.unwrap_or(default))
    }

    /// As a `T`; a required argument left out raises `TypeError` as Python does, and a
    /// value of the wrong type (`None` included) raises `TypeError` naming the argument.
    pub(super) fn required<T: for<'a> FromPyObject<'a, 'py, Error: Into<PyErr>>>(&self) -> PyResult<T> {
        match &self.value {
            None => Err(PyTypeError::new_err(format!("{}() missing required argument '{}'", self.call, self.name))),
            Some(v) => v.extract::<T>().map_err(|e| {
                let (py, e): (_, PyErr) = (v.py(), e.into());
                if e.is_instance_of::<PyTypeError>(py) {
                    PyTypeError::new_err(format!("{}() argument '{}': {}", self.call, self.name, e.value(py)))
                } else {
                    e
                }
            }),
        }
    }

    /// As a `T`, or `default` when it was not given; given, it must be a `T` (`None`
    /// included: a wrong type raises `TypeError` naming the argument), as for a plain
    /// parameter with a default.
    pub(super) fn given_or<T: for<'a> FromPyObject<'a, 'py, Error: Into<PyErr>>>(&self, default: T) -> PyResult<T> {
        if self.value.is_some() {
            self.required()
        } else {
            Ok(default)
        }
    }

    /// As a `T`, or `None` when it was not given or given as `None`; a value of the wrong
    /// type raises `TypeError` naming the option.
    pub(super) fn opt<T: for<'a> FromPyObject<'a, 'py, Error: Into<PyErr>>>(&self) -> PyResult<Option<T>> {
        match &self.value {
            Some(v) if !v.is_none() => v.extract::<T>().map(Some).map_err(|e| {
                let (py, e): (_, PyErr) = (v.py(), e.into());
                if e.is_instance_of::<PyTypeError>(py) {
                    PyTypeError::new_err(format!("{}() argument '{}': {}", self.call, self.name, e.value(py)))
                } else {
                    e
                }
            }),
            _ => Ok(None),
        }
    }
}

/// Declares the struct of one call's options (fields in positional order, then after a `;`
/// the keyword-only ones) and its `parse`.
macro_rules! options {
    ($(#[$doc:meta])* $ty:ident($call:literal) { $($field:ident),+ $(,)? $(; $($kw:ident),+ $(,)?)? }) => {
        $(#[$doc])*
        #[derive(Default)]
        pub(super) struct $ty<'py> {
            $(pub(super) $field: Opt<'py>,)+
            $($(pub(super) $kw: Opt<'py>,)+)?
        }

        impl<'py> $ty<'py> {
            /// Reads `positional` (filling the options in order) and `keywords`; raises
            /// `TypeError` as Python does for too many positionals, an unknown name or one
            /// given twice.
            pub(super) fn parse(
                positional: Option<&Bound<'py, PyTuple>>,
                keywords: Option<&Bound<'py, PyDict>>,
            ) -> PyResult<Self> {
                let mut o = Self::default();
                $(o.$field.call = $call; o.$field.name = stringify!($field);)+
                $($(o.$kw.call = $call; o.$kw.name = stringify!($kw);)+)?
                if let Some(args) = positional {
                    let mut slots = [$(&mut o.$field),+];
                    if args.len() > slots.len() {
                        return Err(PyTypeError::new_err(format!(
                            "{}() takes at most {} optional positional arguments ({} given)",
                            $call, slots.len(), args.len()
                        )));
                    }
                    for (slot, v) in slots.iter_mut().zip(args.iter()) {
                        slot.value = Some(v);
                    }
                }
                for (k, v) in keywords.into_iter().flat_map(|kw| kw.iter()) {
                    let key = k.cast::<PyString>()?.to_cow()?;
                    let slot = match &*key {
                        $(stringify!($field) => &mut o.$field,)+
                        $($(stringify!($kw) => &mut o.$kw,)+)?
                        _ => return Err(PyTypeError::new_err(format!(
                            "{}() got an unexpected keyword argument '{key}'", $call
                        ))),
                    };
                    if slot.value.is_some() {
                        return Err(PyTypeError::new_err(format!(
                            "{}() got multiple values for argument '{key}'", $call
                        )));
                    }
                    slot.value = Some(v);
                }
                Ok(o)
            }
        }
    };
}

options! {
    /// `Allocator(...)`'s options after its five required arguments (`slots_per_page` and
    /// `prefix_match_unit` keyword-only).
    NewOptions("Allocator") {
        max_in_flight_tokens, enable_caching, enable_events, watermark_blocks, retention_interval, policy,
        zero_new_blocks, hash_lookahead_tokens, residency_log, boundary_offloads; slots_per_page, prefix_match_unit,
        eagle_drop_groups, eagle_junction_tail, dcp_world_size, admission_headroom_slots, reprefillable_tokens,
        eagle_checkpoints, mamba_shared_prefix_checkpoint,
    }
}

options! {
    /// `allocate_slots`' arguments: its two positional-or-keyword ones (`handle`,
    /// `num_new_tokens`; the caller refuses a third positional) and its keyword-only options.
    AllocateOptions("allocate_slots") {
        handle, num_new_tokens, block_hashes, hit, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens,
        delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit, reserved_blocks, apply_watermark,
        num_computed_tokens, num_in_flight_tokens, num_prompt_tokens, num_tokens, shared_prefix_boundary,
        skip_zeroing_group_ids, as_buffer, request,
    }
}

options! {
    /// `get_num_blocks_to_allocate`'s keyword-only options.
    BlockCountOptions("get_num_blocks_to_allocate") {
        num_encoder_tokens, total_computed_tokens, apply_admission_cap, num_tokens_main_model, prefill_end,
    }
}

options! {
    /// `set_hints`' arguments, each positional-or-keyword, `handle` (required) first.
    HintOptions("set_hints") {
        handle, block_hashes, session, retain, retain_ttl_ms, retain_tokens, pin_ttl_ms, pin_tokens, release_session,
        checkpoints,
    }
}

/// `eagle_drop_groups` (group indices) as the core's bitset; an index outside the groups
/// raises `ValueError`.
fn eagle_groups(ids: &[i64], num_groups: usize) -> PyResult<u64> {
    let mut bits = 0u64;
    for &i in ids {
        if i < 0 || i as u64 >= num_groups.min(64) as u64 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "eagle_drop_groups: group {i} is not one of the {num_groups} groups"
            )));
        }
        bits |= 1 << i;
    }
    Ok(bits)
}

impl NewOptions<'_> {
    /// The core's configuration and policy from `Allocator(...)`'s five required arguments
    /// and these options.
    pub(super) fn config(
        &self,
        num_blocks: i64,
        groups: &[Bound<'_, PyAny>],
        hash_block_size: i64,
        scheduler_block_size: i64,
        max_model_len: i64,
    ) -> PyResult<(Config, Policy)> {
        let policy = Policy::parse(&self.policy.get::<String>("exact".into())?)?;
        let retention_interval = match self.retention_interval.given() {
            // An explicit `None` means "no retention"; left out, it is 0 (vLLM's default).
            true => self.retention_interval.opt::<i64>()?,
            false => Some(0),
        };
        let base = Config::new(
            u32_arg("num_blocks", num_blocks)?,
            groups.iter().enumerate().map(|(i, g)| group_spec(i, g)).collect::<PyResult<_>>()?,
            u32_arg("hash_block_size", hash_block_size)?,
        );
        let cfg = Config {
            scheduler_block_size: u32_arg("scheduler_block_size", scheduler_block_size)?,
            max_model_len: u32_arg("max_model_len", max_model_len)?,
            max_in_flight_tokens: u32_arg(
                "max_in_flight_tokens",
                self.max_in_flight_tokens.opt()?.unwrap_or(max_model_len),
            )?,
            enable_caching: self.enable_caching.get(true)?,
            enable_events: self.enable_events.get(false)?,
            watermark_blocks: u32_arg("watermark_blocks", self.watermark_blocks.get(0)?)?,
            retention_interval: retention_interval.map(|r| u32_arg("retention_interval", r)).transpose()?,
            zero_new_blocks: self.zero_new_blocks.get(false)?,
            hash_lookahead_tokens: u32_arg("hash_lookahead_tokens", self.hash_lookahead_tokens.get(0)?)?,
            residency_log: self.residency_log.get(false)?,
            boundary_offloads: self.boundary_offloads.get(false)?,
            slots_per_page: u32_arg("slots_per_page", self.slots_per_page.given_or(1)?)?,
            admission_headroom_slots: u32_arg("admission_headroom_slots", self.admission_headroom_slots.given_or(0)?)?,
            prefix_match_unit: self
                .prefix_match_unit
                .opt::<i64>()?
                .map(|u| u32_arg("prefix_match_unit", u))
                .transpose()?,
            eagle_drop_groups: eagle_groups(&self.eagle_drop_groups.given_or(Vec::<i64>::new())?, groups.len())?,
            eagle_junction_tail: self.eagle_junction_tail.given_or(false)?,
            dcp_world_size: u32_arg("dcp_world_size", self.dcp_world_size.given_or(1)?)?,
            reprefillable_tokens: u32_arg("reprefillable_tokens", self.reprefillable_tokens.given_or(0)?)?,
            eagle_checkpoints: self.eagle_checkpoints.given_or(false)?,
            mamba_shared_prefix_checkpoint: self.mamba_shared_prefix_checkpoint.given_or(false)?,
            ..base
        };
        Ok((cfg, policy))
    }
}
