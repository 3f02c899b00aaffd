"""A preallocated KV cache with in-place compaction for tree verification.

The target writes the KV of every tree node during verification; afterwards only the accepted
root-to-node path may stay. :meth:`SpecCache.compact` moves those entries to sit right after the
prefix, in order, and shrinks the length: no tensors are rebuilt, no memory is reallocated. The
cache plugs into an unmodified Hugging Face model through its public ``cache`` argument.
"""

from __future__ import annotations

from collections.abc import Sequence

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

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more positions after ``length`` (an initialized layer; for writers that fill
        the buffers themselves)."""
        if self.length + n > self.max_len:
            self._grow(max(self.length + n, 2 * self.max_len))

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.reserve(n)
        end = self.length + n
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

    def ensure_capacity(self, max_len: int) -> None:
        """Room for ``max_len`` positions in all, allocated now rather than by doubling mid-generation
        (for a cache reused by a longer sequence)."""
        for layer in self.layers:
            if max_len > layer.max_len:
                if layer.is_initialized:
                    layer._grow(max_len)
                else:
                    layer.max_len = max_len

    def compact(self, start: int, keep: Tensor) -> None:
        """After verifying a tree written at ``start``: keep the nodes ``keep`` (k,) (sorted, root first)."""
        k = keep.numel()
        if k and int(keep[-1]) == k - 1:  # sorted and distinct, so keep is 0 .. k-1: already in place
            for layer in self.layers:
                layer.length = start + k
            return
        for layer in self.layers:
            layer.compact(start, keep)

    def key_value(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        """(batch, kv_heads, length, head_dim) views of one layer's committed keys and values."""
        layer = self.layers[layer_idx]
        return layer.keys[:, :, : layer.length], layer.values[:, :, : layer.length]


class RaggedLayer(CacheLayerMixin):
    """One layer's K/V for a batch whose rows have their own committed lengths.

    Buffers are (batch, kv_heads, max_len, head_dim). Row b's committed entries sit at ``0 ..
    lengths[b]``; a forward over (batch, n) tokens writes row b's new entries at ``lengths[b] ..
    lengths[b] + n`` (a scatter) and attends over the first ``max(lengths) + n`` slots, so rows shorter
    than the longest hide the slots in between through the attention mask.
    """

    is_sliding = False  # sliding windows are applied through the attention mask, the cache keeps everything
    is_compileable = False
    is_croppable = False

    def __init__(self, batch: int, max_len: int):
        super().__init__()
        self.batch, self.max_len = batch, max_len
        self.lengths = torch.zeros(batch, dtype=torch.long)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        _, h, _, d = key_states.shape
        self.device = key_states.device
        self.keys = torch.zeros(self.batch, h, self.max_len, d, dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(
            self.batch, h, self.max_len, value_states.shape[-1], dtype=value_states.dtype, device=self.device
        )
        self.is_initialized = True

    def _grow(self, new_len: int) -> None:
        """Reallocate to ``new_len`` positions (amortised doubling; rare when sized up front)."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], new_len, old.shape[-1])
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)
        self.max_len = new_len

    def _rows(self, slots: Tensor, heads: int) -> Tensor:
        """(batch, n) slot indices -> the matching rows of the buffers' (batch * heads * max_len, dim) view,
        ordered (batch, head, n) like a (batch, heads, n, dim) tensor's rows. Whole rows of ``dim``
        elements move with one index each (an element-wise scatter reads one int64 per element)."""
        batch, n = slots.shape
        row = torch.arange(batch)[:, None, None] * heads + torch.arange(heads)[None, :, None]
        return (row * self.max_len + slots[:, None, :]).reshape(batch * heads * n).to(self.device)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = int(self.lengths.max()) + n
        if end > self.max_len:
            self._grow(max(end, 2 * self.max_len))
        rows = self._rows(self.lengths[:, None] + torch.arange(n), key_states.shape[1])
        for buf, new in ((self.keys, key_states), (self.values, value_states)):
            buf.view(-1, buf.shape[-1]).index_copy_(0, rows, new.reshape(-1, buf.shape[-1]))
        self.lengths = self.lengths + n
        return self.keys[:, :, :end], self.values[:, :, :end]

    def load_row(self, row: int, keys: Tensor, values: Tensor) -> None:
        """Put one sequence's (1, kv_heads, length, head_dim) keys/values in ``row`` (a newcomer's prefill)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        n = keys.shape[2]
        if n > self.max_len:
            self._grow(max(n, 2 * self.max_len))
        self.keys[row, :, :n] = keys[0]
        self.values[row, :, :n] = values[0]
        self.lengths[row] = n

    def keep_rows(self, rows: Tensor) -> None:
        """Keep only the batch rows ``rows`` (k,), in that order (drops finished rows; one copy)."""
        if self.is_initialized:
            self.keys = self.keys.index_select(0, rows.to(self.device))
            self.values = self.values.index_select(0, rows.to(self.device))
        self.lengths = self.lengths[rows]
        self.batch = rows.numel()

    def compact(self, starts: Tensor, keep: Tensor, counts: Tensor) -> None:
        """Row b keeps entries ``starts[b] + keep[b, :counts[b]]`` at ``starts[b] .. starts[b] + counts[b]``.

        starts, counts: (batch,); keep: (batch, k) sorted offsets, right-padded with anything in ``0 .. n``.
        """
        k = keep.shape[1]
        if self.is_initialized and k:
            heads = self.keys.shape[1]
            src = self._rows(starts[:, None] + keep, heads)
            dst = self._rows(starts[:, None] + torch.arange(k), heads)
            for buf in (self.keys, self.values):
                flat = buf.view(-1, buf.shape[-1])
                # index_select copies first, so overlapping source and destination are safe
                flat.index_copy_(0, dst, flat.index_select(0, src))
        self.lengths = starts + counts

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self.lengths.max()) + query_length, 0

    def get_seq_length(self) -> int:
        return int(self.lengths.max())

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.lengths.zero_()


class RaggedCache(Cache):
    """KV cache for a batch of sequences with their own lengths: per-row writes, per-row compaction.

    The batched form of :class:`SpecCache`: no padding is ever shifted; each row's tree is written
    right after its own committed prefix and compacted there.
    """

    def __init__(self, num_layers: int, batch: int, max_len: int):
        super().__init__(layers=[RaggedLayer(batch, max_len) for _ in range(num_layers)])

    @property
    def lengths(self) -> Tensor:
        """(batch,) committed length of each row (all layers agree between forwards)."""
        return self.layers[0].lengths

    @property
    def batch(self) -> int:
        return self.layers[0].batch

    def load_rows(self, rows: Sequence[int], source: RaggedCache, lengths: Sequence[int]) -> None:
        """Copy row b of ``source`` (its first ``lengths[b]`` entries: a newcomer's prefill) into ``rows[b]``."""
        for layer, src in zip(self.layers, source.layers):
            for b, (row, n) in enumerate(zip(rows, lengths)):
                layer.load_row(row, src.keys[b : b + 1, :, :n], src.values[b : b + 1, :, :n])

    def keep_rows(self, rows: Tensor) -> None:
        """Keep the batch rows ``rows`` (k,) in that order."""
        for layer in self.layers:
            layer.keep_rows(rows)

    def compact(self, starts: Tensor, keep: Tensor, counts: Tensor) -> None:
        """After a ragged tree forward written at ``starts`` (batch,): row b keeps its nodes
        ``keep[b, :counts[b]]`` (sorted, root first; keep (batch, k) right-padded)."""
        for layer in self.layers:
            layer.compact(starts, keep, counts)

    def key_value(self, layer_idx: int, row: int) -> tuple[Tensor, Tensor]:
        """(kv_heads, length, head_dim) views of one row's committed keys and values in one layer."""
        layer = self.layers[layer_idx]
        n = int(layer.lengths[row])
        return layer.keys[row, :, :n], layer.values[row, :, :n]
