"""Reuse of one generation's KV cache by the next prompt that extends it (a chat's history).

Each chat turn's prompt is the previous prompt, the reply and a new user message, so re-running the
target over all of it costs a prefill that grows every turn. A :class:`PrefixCache` passed to
:func:`selfdraft.generate.generate` keeps the target's KV of the finished sequence, and the hidden
states a feature-level drafter (EAGLE) reads; the next call prefills only the prompt's tokens after
the longest prefix it shares with that sequence. Tokens are compared, not text: where the chat
template re-tokenizes a reply differently, only the reused part gets shorter.

The reused KV was computed by the forwards that generated it (one token or one tree at a time)
instead of one prefill, so logits agree with a fresh prefill to rounding, like any KV cache reuse.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfdraft.cache import SpecCache
from selfdraft.stats import common_prefix


@dataclass
class Reuse:
    """What a generation starts from: ``length`` prompt tokens already in ``cache``, and their hidden
    states per requested layer, (1, length, H) each (None where no layer was requested)."""

    length: int
    cache: SpecCache | None
    hidden: dict[int, Tensor] | None


class PrefixCache:
    """The KV (and drafter hidden states) of the last sequence one model generated, for the next call.

    A generation takes the cache out (:meth:`take`) and puts it back when it finishes (:meth:`keep`): a
    generation that fails in between leaves the prefix cache empty, never holding KV that does not
    match its tokens. One model per prefix cache; another model (or dtype) starts it afresh.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.tokens: list[int] = []
        self.cache: SpecCache | None = None
        self.hidden: dict[int, Tensor] = {}
        self._model: weakref.ref | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def take(self, model: nn.Module, prompt: Sequence[int], hidden_layers: tuple[int, ...]) -> Reuse:
        """Take the cache for a generation of ``prompt``: the longest shared prefix stays in it (at most
        all but the last prompt token, whose logits the generation needs). Empties this prefix cache."""
        cache, tokens, hidden = self.cache, self.tokens, self.hidden
        same_model = self._model is not None and self._model() is model
        self.clear()
        if cache is None or not same_model or not _dtype_matches(cache, model):
            return Reuse(0, None, None)
        n = min(common_prefix(tokens, prompt), len(prompt) - 1)
        if any(i not in hidden for i in hidden_layers):  # this drafter reads states the last one did not keep
            cache.truncate(0)
            return Reuse(0, cache, None)
        n = min([n] + [hidden[i].shape[1] for i in hidden_layers])
        cache.truncate(n)
        return Reuse(n, cache, {i: hidden[i][:, :n] for i in hidden_layers} if hidden_layers else None)

    def keep(self, model: nn.Module, tokens: Sequence[int], cache: SpecCache,
             hidden: dict[int, list[Tensor]] | None) -> None:
        """Hold ``cache`` after a generation of ``tokens`` (the prompt and what it committed). The cache
        may hold more positions (draft tokens past a stop) or one fewer (the last token was never
        forwarded); ``hidden`` holds per layer chunks (1, k, H) covering the cache's positions in order."""
        n = min(len(tokens), cache.length)
        cache.truncate(n)
        self.tokens = list(tokens[:n])
        self.cache = cache
        self.hidden = {i: torch.cat(chunks, 1)[:, :n] for i, chunks in hidden.items()} if hidden else {}
        self._model = weakref.ref(model)


def _dtype_matches(cache: SpecCache, model: nn.Module) -> bool:
    layer = cache.layers[0]
    if not getattr(layer, "is_initialized", False):
        return True
    param = model.get_input_embeddings().weight
    return layer.keys.dtype == param.dtype and layer.keys.device == param.device
