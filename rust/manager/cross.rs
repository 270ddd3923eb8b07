//! Cross attention (encoder-decoder): one static allocation sized by the encoder input,
//! made on the request's first step; never prefix cached, never recycled. The shared
//! bookkeeping in `SingleTypeManager` serves it (the coordinator passes the encoder token
//! count); this file holds what is specific to it.
#![forbid(unsafe_code)]

/// Cross attention caches nothing: the configuration layer refuses it with prefix caching
/// on, as vLLM's `CrossAttentionManager.cache_blocks` raises there.
pub const PREFIX_CACHEABLE: bool = false;
