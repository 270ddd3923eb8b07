"""R-SWA (Reference Sliding Window Attention, vLLM's ``RSWASpec`` + ``RSWAManager``) for the
differential tests: Unlimited-OCR-shaped configurations (DeepSeek-V2 with multi-head, not MLA,
attention layers: ``RSWAAttention`` reports an ``RSWASpec`` with the cache block size and
``rswa_window``, 128 by default) and ``RswaParityRun``, which decodes long enough for the window
to leave the prompt (so the gap between them is freed, a null run in the middle of the table),
re-sends whole finished conversations (full-attention hits over blocks the gap freed, still
cached) and calls ``remove_skipped_blocks`` with ``num_prompt_tokens`` as the scheduler does
before a connector reads the table. Every spec object is vLLM's own."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_cache_interface import RSWASpec
from vllm.v1.request import Request

from parity_driver import ParityRun
from vllm_harness import Setup, full, swa


def rswa(window: int = 128, bs: int = 16) -> RSWASpec:
    """An Unlimited-OCR decoder layer (DeepSeek-V2 multi-head attention, 10 KV heads of 128)."""
    return RSWASpec(block_size=bs, num_kv_heads=10, head_size=128, dtype=torch.bfloat16, rswa_window=window)


RSWA_SETUPS: list[Setup] = [
    # Unlimited-OCR as vLLM runs it: every decoder layer R-SWA with the default window, one
    # group; vLLM turns prefix caching off for this model.
    Setup("unlimited_ocr_rswa128_nocache", [rswa(128)], num_blocks=200, enable_caching=False),
    # The same with prefix caching on (the unitary coordinator; R-SWA hits as full attention).
    Setup("unlimited_ocr_rswa128", [rswa(128)], num_blocks=200),
    # A short window: gaps open after a few decode steps, many per request.
    Setup("rswa32", [rswa(32)], num_blocks=160),
    Setup("rswa32_nocache", [rswa(32)], num_blocks=160, enable_caching=False),
    # R-SWA next to full attention: two groups that the hybrid hit search both treats as
    # full attention (RSWASpec is a FullAttentionSpec), in separate spec groups.
    Setup("full_rswa48", [full(16), rswa(48)], num_blocks=340),
    Setup("full_rswa48_nocache", [full(16), rswa(48)], num_blocks=340, enable_caching=False),
    # R-SWA first, then full attention and a sliding window: three spec groups, the hybrid
    # search iterates.
    Setup("rswa64_full_swa", [rswa(64), full(16), swa(48, 16)], num_blocks=360, retention_interval=None),
]


class RswaParityRun(ParityRun):
    """``ParityRun`` with long decodes, re-sent conversations and the scheduler's
    ``remove_skipped_blocks(..., num_prompt_tokens=...)``."""

    def __init__(self, setup: Setup, seed: int, full_check_every: int = 64) -> None:
        super().__init__(setup, seed, full_check_every)
        self.finished_tokens: list[list[int]] = []
        self.stats["gapped"] = 0
        self.stats["resends"] = 0

    def new_request(self) -> Request:
        r = self.rng
        toks: list[int] = []
        if self.finished_tokens and r.random() < 0.2:
            # A chat's next turn: the whole previous conversation (prompt and reply) again.
            toks += self.finished_tokens[r.randrange(len(self.finished_tokens))]
            self.stats["resends"] += 1
        elif r.random() < 0.8:
            toks += self.prefixes[r.randrange(len(self.prefixes))]
        toks += [r.randrange(1, 5000) for _ in range(r.randrange(1, 200))]
        toks = toks[: self.setup.max_model_len - 600]
        self.next_id += 1
        return self.setup.make_request(
            f"r{self.next_id}", toks, max_tokens=r.randrange(1, 400), report_full=r.random() < 0.2
        )

    def admit(self) -> None:
        # A bounded batch, so requests live long enough to decode past the window.
        if len(self.running) < 6:
            super().admit()
        else:
            super().run_one()

    def abort(self) -> None:
        # Rarer aborts than the base trace's: most requests finish.
        if len(self.running) + len(self.waiting) > 48 or self.rng.random() < 0.2:
            super().abort()

    def maybe_sample(self, req: Request) -> None:
        # Several tokens per step (accepted speculative tokens), so decodes pass the window
        # in a trace of this length.
        if req.num_computed_tokens >= req.num_tokens:
            for _ in range(self.rng.randrange(1, 9)):
                req.append_output_token_ids(self.rng.randrange(1, 5000))
                if req.num_output_tokens >= req.max_tokens:
                    self.finish(req)
                    return

    def finish(self, req: Request) -> None:
        self.finished_tokens.append(list(req.all_token_ids))
        if len(self.finished_tokens) > 16:
            self.finished_tokens.pop(0)
        super().finish(req)

    def misc(self) -> None:
        r = self.rng
        if self.running and r.random() < 0.15:
            # The scheduler before a KV connector reads the table: the processed tokens and
            # the prompt length (the R-SWA gap is freed here too).
            req = r.choice(self.running)
            kw: dict[str, Any] = dict(num_prompt_tokens=req.num_prompt_tokens)
            self.ref.remove_skipped_blocks(req.request_id, req.num_computed_tokens, **kw)
            self.ours.remove_skipped_blocks(req.request_id, req.num_computed_tokens, **kw)
            self.after_op()
            return
        super().misc()

    def run_one(self) -> None:
        super().run_one()
        # Running requests seen with a freed gap in an R-SWA table (null blocks after the
        # prompt), counted after every step.
        rswa_groups = [g for g, spec in enumerate(self.setup.specs) if isinstance(spec, RSWASpec)]
        for req in self.running:
            ids = self.ref.get_block_ids(req.request_id)
            self.stats["gapped"] += any(0 in ids[g] for g in rswa_groups)
