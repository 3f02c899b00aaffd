"""A preallocated KV cache with in-place compaction for tree verification.

The target writes the KV of every tree node during verification; afterwards only the accepted
root-to-node path may stay. :meth:`SpecCache.compact` moves those entries to sit right after the
prefix, in order, and shrinks the length: no tensors are rebuilt, no memory is reallocated. The
cache plugs into an unmodified Hugging Face model through its public ``cache`` argument.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin


class PreallocatedLayer(CacheLayerMixin):
    """One layer's keys/values in (batch, kv_heads, max_len, head_dim) buffers, filled up to ``length``."""

    is_sliding = False  # sliding windows are applied through the attention mask, the cache keeps everything
    is_compileable = False
    is_croppable = True

    def __init__(self, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.keys = torch.zeros(b, h, self.max_len, d, dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(
            b, h, self.max_len, value_states.shape[-1], dtype=value_states.dtype, device=self.device
        )
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.max_len:
            self._grow(max(end, 2 * self.max_len))
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, new_len: int) -> None:
        """Reallocate to ``new_len`` positions (amortised doubling; rare when sized up front)."""
        keys, values = self.keys, self.values
        shape = (*keys.shape[:2], new_len)
        self.keys = keys.new_zeros(*shape, keys.shape[-1])
        self.values = values.new_zeros(*shape, values.shape[-1])
        self.keys[:, :, : self.length] = keys[:, :, : self.length]
        self.values[:, :, : self.length] = values[:, :, : self.length]
        self.max_len = new_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows on demand, like a dynamic layer

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - tokens_to_remove)

    def reset(self) -> None:
        self.length = 0

    def compact(self, start: int, keep: Tensor) -> None:
        """Keep entries ``start + keep`` (keep: (k,) sorted offsets) at ``start .. start+k``."""
        k = keep.numel()
        if self.is_initialized and k:
            src = keep.to(self.keys.device) + start
            # index_select copies first, so overlapping source and destination are safe
            self.keys[:, :, start : start + k] = self.keys.index_select(2, src)
            self.values[:, :, start : start + k] = self.values.index_select(2, src)
        self.length = start + k


class SpecCache(Cache):
    """KV cache for speculative decoding: preallocated, truncatable, compactable in place.

    ``max_len`` is the initial allocation; a layer that overflows it doubles (a copy), so size it to
    prompt + new tokens + one tree to avoid that on the hot path.
    """

    def __init__(self, num_layers: int, max_len: int):
        super().__init__(layers=[PreallocatedLayer(max_len) for _ in range(num_layers)])

    @property
    def length(self) -> int:
        """Committed sequence length (all layers agree between forwards)."""
        return self.layers[0].length

    def truncate(self, length: int) -> None:
        """Drop everything from position ``length`` on."""
        for layer in self.layers:
            layer.length = min(layer.length, length)

    def compact(self, start: int, keep: Tensor) -> None:
        """After verifying a tree written at ``start``: keep the nodes ``keep`` (k,) (sorted, root first)."""
        for layer in self.layers:
            layer.compact(start, keep)

    def key_value(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        """(batch, kv_heads, length, head_dim) views of one layer's committed keys and values."""
        layer = self.layers[layer_idx]
        return layer.keys[:, :, : layer.length], layer.values[:, :, : layer.length]
