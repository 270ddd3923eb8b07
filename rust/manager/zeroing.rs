//! KV cache zeroing records of a group (vLLM's `_record_new_block_ids`,
//! `take_new_block_ids`, `record_blocks_for_zeroing`): the block ids an attention group
//! hands out, kept in order until the model runner takes them.
//!
//! Cost: O(blocks recorded).
#![forbid(unsafe_code)]

use super::SingleTypeManager;
use crate::ids::{BlockId, Slot};

impl SingleTypeManager {
    /// Records `h`'s table from slot `from` on for KV cache zeroing, when this group records.
    #[inline]
    pub(super) fn record_new(&mut self, from: usize, h: Slot) {
        if self.records_new_block_ids {
            self.new_block_ids.extend_from_slice(&self.req_blocks[h as usize][from..]);
        }
    }

    /// Drains the block ids recorded for zeroing (vLLM's `take_new_block_ids`).
    pub(crate) fn take_new_block_ids(&mut self, out: &mut Vec<BlockId>) {
        out.append(&mut self.new_block_ids);
    }

    /// Records `h`'s table from slot `start_idx` on for zeroing again, null blocks included
    /// (vLLM's `record_blocks_for_zeroing`); nothing when this group does not record.
    pub(crate) fn record_blocks_for_zeroing(&mut self, h: Slot, start_idx: usize) {
        if self.records_new_block_ids {
            let t = &self.req_blocks[h as usize];
            self.new_block_ids.extend_from_slice(t.get(start_idx..).unwrap_or(&[]));
        }
    }

    /// Block ids recorded for zeroing and not yet taken.
    pub(crate) fn pending_new_block_ids(&self) -> &[BlockId] {
        &self.new_block_ids
    }
}
