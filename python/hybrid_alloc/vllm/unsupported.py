"""``Unsupported``: what the adapter raises, while it reads a configuration, for anything the
core does not serve exactly. ``HybridKVCacheManager`` turns it into the fallback to vLLM's own
manager, with one log line carrying the message."""

from __future__ import annotations


class Unsupported(Exception):
    """A configuration the core does not serve; the message names the reason."""
