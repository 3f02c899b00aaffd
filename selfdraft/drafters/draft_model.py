"""Speculative sampling with a separate draft model (Leviathan et al., 2023; Chen et al., 2023).

A small LM with the target's tokenizer proposes a chain of gamma tokens, keeping its own KV cache
across steps and prompts (rolled back to the longest prefix it shares with the committed sequence). gamma
adapts to the recent acceptance: up by 2 after a fully accepted chain, down by 1 otherwise (the
heuristic of transformers' assisted generation). The same class drafts with the target's own first
layers for layer-skip self-drafting (see layer_skip.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from selfdraft.adapter import check_supported, new_cache, tree_forward
from selfdraft.drafters.base import Draft, StepResult
from selfdraft.sampling import SamplingConfig, argmax, logits_to_probs, sample
from selfdraft.stats import common_prefix
from selfdraft.tree import chain_tree


class DraftModelDrafter:
    """Chain drafter driven by any causal LM that shares the target's vocabulary."""

    hidden_layers: tuple[int, ...] = ()
    proposes_for_free = False

    def __init__(
        self, model: nn.Module, gamma: int = 4, adaptive: bool = True, min_gamma: int = 1, max_gamma: int = 12
    ):
        if not 1 <= min_gamma <= gamma <= max_gamma:
            raise ValueError(f"need 1 <= min_gamma <= gamma <= max_gamma, got {min_gamma}, {gamma}, {max_gamma}")
        check_supported(model)
        self.model = model
        self.initial_gamma, self.adaptive = gamma, adaptive
        self.min_gamma, self.max_gamma = min_gamma, max_gamma
        self.gamma = gamma
        self.cache = new_cache(model, 0)
        self.cached: list[int] = []
        self.device = next(model.parameters()).device

    def reset(self, step: StepResult) -> None:
        # the draft cache stays: propose rolls it back to the prefix the new sequence shares with it,
        # so a chat's next turn (or any prompt extending the last) does not prefill the draft model again
        self.gamma = self.initial_gamma
        self.cache.ensure_capacity(step.tokens.numel() + 512)

    def _feed(self, tokens: list[int], greedy: bool) -> Tensor:
        """Append tokens to the draft cache; returns the (V,) logits after the last one. ``greedy``: only
        their argmax will be used, so the lm_head may be screened (-inf where a logit cannot be the
        maximum; :mod:`selfdraft.greedy_screen`), the same argmax at about half the vocabulary's bytes."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[None]
        out = tree_forward(self.model, self.cache, ids, chain_tree(len(tokens) - 1), last_logits_only=True,
                           argmax_only=greedy)
        self.cached.extend(tokens)
        return out.logits[0, -1]

    @torch.inference_mode()
    def propose(self, tokens: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        seq = tokens.tolist()
        # roll the cache back to the longest prefix it shares with the committed sequence
        common = min(common_prefix(self.cached, seq), len(seq) - 1)  # always re-feed at least the root
        self.cache.truncate(common)
        del self.cached[common:]
        logits = self._feed(seq[common:], sampling.greedy)
        drafted: list[int] = []
        qs: list[Tensor] = []
        for i in range(self.gamma):
            if sampling.greedy:
                tok = int(argmax(logits))
            else:
                q = logits_to_probs(logits, sampling)
                qs.append(q)
                tok = int(sample(q, generator))
            drafted.append(tok)
            if i + 1 < self.gamma:
                logits = self._feed([tok], sampling.greedy)
        node_tokens = torch.tensor([seq[-1]] + drafted, dtype=torch.long)
        q = None
        if qs:
            q = torch.cat([torch.stack(qs), torch.zeros(1, qs[0].numel())])  # the leaf has no children
        return Draft(chain_tree(len(drafted)), node_tokens, q)

    def update(self, step: StepResult) -> None:
        if not self.adaptive:
            return
        if step.num_accepted >= self.gamma:
            self.gamma = min(self.max_gamma, self.gamma + 2)
        else:
            self.gamma = max(self.min_gamma, self.gamma - 1)
