"""The speculative decode loop (and, with no drafter, the plain reference decoder).

Each step: 1. the drafter proposes a tree rooted at the last committed token; 2. one target forward
verifies every node under a tree attention mask; 3. an acceptance rule keeps a root-to-node path and
adds one target token after it; 4. the KV cache is compacted to the kept path. With no drafter the
tree is the root alone, which is plain autoregressive decoding on the same engine: the oracle for
the tests and the baseline for the benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from selfdraft.acceptance import Acceptance, accept_greedy, accept_matching, accept_sampling, accept_typical
from selfdraft.adapter import new_cache, tree_forward
from selfdraft.drafters.base import Draft, Drafter, StepResult, root_only
from selfdraft.gate import ShadowDraft, SpeculationGate
from selfdraft.prefix_cache import PrefixCache
from selfdraft.sampling import GREEDY, SamplingConfig, choose, logits_to_probs
from selfdraft.screened_draws import ScreenedDraws, drawable
from selfdraft.stats import GenerationStats
from selfdraft.tree import chain_tree, truncate_depth

ACCEPTANCE_MODES = ("exact", "typical")
CACHE_SLACK = 256
"""Cache positions preallocated beyond prompt + max_new_tokens for the nodes of one draft tree."""


class ContextLengthError(ValueError):
    """The prompt plus the requested new tokens do not fit in the target's context."""


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how to accept draft tokens."""

    max_new_tokens: int = 128
    """Exact cap on generated tokens (EOS and stop strings may end earlier)."""
    sampling: SamplingConfig = GREEDY
    """Temperature / top-k / top-p, applied identically to target p and draft q."""
    acceptance: str = "exact"
    """'exact' (greedy-exact or lossless sampling) or 'typical' (Medusa typical acceptance, LOSSY)."""
    typical_threshold: float = 0.09
    """Typical acceptance: probability cutoff epsilon."""
    typical_alpha: float = 0.3
    """Typical acceptance: entropy-scaled cutoff delta."""
    stop_strings: tuple[str, ...] = ()
    """Generation ends once the decoded text contains one of these (the string is kept)."""
    seed: int | None = None
    """Seed of the sampling generator (None: nondeterministic)."""
    on_context_overflow: str = "error"
    """'error' (raise ContextLengthError) or 'truncate' (lower max_new_tokens to fit)."""
    auto_off: bool = False
    """Measure online and decode plainly while plain steps commit tokens faster than drafting ones
    (:class:`~selfdraft.gate.SpeculationGate`); the output is unchanged, only speed."""
    probe_every: int = 64
    """With auto_off: while drafting, one plain step in this many re-measures the plain step time."""

    def __post_init__(self) -> None:
        if self.probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {self.probe_every}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.acceptance not in ACCEPTANCE_MODES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_MODES}, got '{self.acceptance}'")
        if self.on_context_overflow not in ("error", "truncate"):
            raise ValueError(f"on_context_overflow must be 'error' or 'truncate', got '{self.on_context_overflow}'")


@dataclass
class GenerationOutput:
    tokens: list[int]
    """New tokens (EOS included when it ended generation)."""
    sources: list[str]
    """Per new token: 'draft' (accepted draft token), 'correction' (target token after a rejection),
    'bonus' (target token after a fully accepted path) or 'target' (no draft was proposed)."""
    stop_reason: str
    """'eos', 'stop_string' or 'max_new_tokens'."""
    stats: GenerationStats = field(default_factory=GenerationStats)


def append_until_stop(
    tokens: list[int], new: Sequence[int], eos: frozenset[int], budget: int,
    stop_strings: Sequence[str] = (), tokenizer: object | None = None,
) -> tuple[int, str | None]:
    """Append ``new`` to ``tokens`` up to the first stop (EOS, a stop string in the decoded text, the
    token budget); returns (tokens taken, stop reason or None)."""
    for taken, tok in enumerate(new, 1):
        tokens.append(tok)
        if tok in eos:
            return taken, "eos"
        if stop_strings and any(s in tokenizer.decode(tokens) for s in stop_strings):
            return taken, "stop_string"
        if len(tokens) >= budget:
            return taken, "max_new_tokens"
    return len(new), None


def fit_budget(prompt_len: int, cfg: GenerationConfig, max_positions: int) -> int:
    """New tokens allowed for a prompt: max_new_tokens, or what fits (truncate), or ContextLengthError."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token")
    room = max_positions - prompt_len
    if prompt_len + cfg.max_new_tokens <= max_positions:
        return cfg.max_new_tokens
    if cfg.on_context_overflow == "truncate" and room > 0:
        return room
    raise ContextLengthError(
        f"prompt of {prompt_len} tokens + max_new_tokens {cfg.max_new_tokens} exceeds the target's context "
        f"of {max_positions} positions; shorten the prompt, lower max_new_tokens, or set "
        f"on_context_overflow='truncate'"
    )


def fit_draft(draft: Draft, remaining: int) -> Draft:
    """Trim a draft so its accepted tokens plus the target's token cannot overshoot the budget."""
    tree, keep = truncate_depth(draft.tree, max(remaining - 1, 0))
    if tree.size == draft.tree.size:
        return draft
    q = draft.q[keep] if draft.q is not None else None
    return Draft(tree, draft.tokens[keep], q)


def accept_draft(
    draft: Draft,
    logits: Tensor | None,
    cfg: GenerationConfig,
    generator: torch.Generator | None,
    draws: ScreenedDraws | None = None,
) -> Acceptance:
    """Apply the configured rule to the (n, V) ``logits`` at the draft's nodes, or to their ``draws``
    (:mod:`selfdraft.screened_draws`; deterministic drafts at a temperature); the small (n, V)
    distributions move to the CPU, where the tree lives."""
    if cfg.acceptance == "typical":
        probs = logits_to_probs(logits, cfg.sampling if not cfg.sampling.greedy else SamplingConfig(1.0)).cpu()
        return accept_typical(draft.tree, draft.tokens, probs, cfg.typical_threshold, cfg.typical_alpha, generator)
    if cfg.sampling.greedy:
        return accept_greedy(draft.tree, draft.tokens, logits)
    if draft.q is None:  # deterministic: draws from p at the nodes visited decide (accept_matching)
        if draws is not None:
            return accept_matching(draft.tree, draft.tokens, lambda node: draws.draw(node, generator))
        return accept_matching(draft.tree, draft.tokens, lambda node: int(choose(logits[node].cpu(), cfg.sampling, generator)))
    return accept_sampling(draft.tree, draft.tokens, logits_to_probs(logits, cfg.sampling).cpu(), draft.q.cpu(), generator)


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompt: Sequence[int] | Tensor,
    drafter: Drafter | None = None,
    cfg: GenerationConfig = GenerationConfig(),
    eos_token_ids: Sequence[int] | frozenset[int] = (),
    tokenizer: object | None = None,
    on_tokens: Callable[[list[int], list[str]], None] | None = None,
    prefix_cache: PrefixCache | None = None,
    gate: SpeculationGate | None = None,
) -> GenerationOutput:
    """Generate up to ``cfg.max_new_tokens`` tokens after ``prompt`` (token ids).

    With ``drafter=None`` this is plain decoding. ``on_tokens(tokens, sources)`` is called with each
    step's newly committed tokens (for streaming). ``tokenizer`` is needed for stop strings.
    ``prefix_cache`` (a chat's): the prompt's longest prefix shared with the sequence it holds is not
    prefilled again, and it holds this call's sequence afterwards. ``gate`` (with ``cfg.auto_off`` and a
    drafter; a chat's or a benchmark's): the speculation gate to consult and update, so what it measured
    on earlier replies with this model, drafter and sampling carries over (each call makes its own by
    default; ``cfg.probe_every`` then applies, a given gate keeps its own).
    """
    if cfg.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode the text")
    prompt_ids = torch.as_tensor(list(prompt) if not isinstance(prompt, Tensor) else prompt, dtype=torch.long)
    prompt_ids = prompt_ids.flatten()
    device = next(model.parameters()).device
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 20))
    budget = fit_budget(prompt_ids.numel(), cfg, max_pos)
    eos = frozenset(int(e) for e in eos_token_ids)
    generator = None
    if not cfg.sampling.greedy or cfg.acceptance == "typical":
        generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    hidden_layers = tuple(getattr(drafter, "hidden_layers", ()))
    if not cfg.auto_off or drafter is None:
        gate = None
    elif gate is None:
        gate = SpeculationGate(cfg.probe_every)
    else:
        gate.bind((id(model), id(drafter), cfg.sampling, cfg.acceptance),
                  f"now {type(drafter).__name__} at {cfg.sampling}, acceptance {cfg.acceptance!r}")
    shadow_free = gate is not None and getattr(drafter, "proposes_for_free", False)
    shadow: ShadowDraft | None = None
    shadow_kind = None
    gate_kind = getattr(drafter, "gate_kind", None) if gate is not None else None
    shadow_draft = getattr(drafter, "shadow_draft", None) if gate is not None else None
    # a merged drafter's free members' draft may also be verified alone (no head forward): an alternative
    # the gate weighs against the whole tree and plain decoding (SpeculationGate.pick)
    free_alone = shadow_draft is not None and getattr(drafter, "free_alone", False)
    stats = GenerationStats()
    out = GenerationOutput(tokens=[], sources=[], stop_reason="max_new_tokens", stats=stats)
    if budget == 0:
        return out

    t_start = time.perf_counter()
    committed: list[int] = prompt_ids.tolist()
    capacity = prompt_ids.numel() + budget + CACHE_SLACK
    reuse = prefix_cache.take(model, committed, hidden_layers) if prefix_cache is not None else None
    if reuse is not None and reuse.cache is not None:
        cache = reuse.cache
        cache.ensure_capacity(capacity)
    else:
        cache = new_cache(model, capacity)
    reused = reuse.length if reuse is not None else 0

    def emit(new: list[int], sources: list[str]) -> bool:
        """Append tokens up to a stop condition; returns True when generation is over."""
        taken, reason = append_until_stop(out.tokens, new, eos, budget, cfg.stop_strings, tokenizer)
        if reason:
            out.stop_reason = reason
        out.sources.extend(sources[:taken])
        committed.extend(new[:taken])
        if on_tokens is not None:
            on_tokens(new[:taken], sources[:taken])
        return reason is not None

    # prefill: the prompt (after a reused prefix) as a chain, then the first token from the last position
    t0 = time.perf_counter()
    rest = prompt_ids[reused:]
    argmax_only = cfg.sampling.greedy and cfg.acceptance == "exact"  # greedy steps use each row's argmax only
    # steps verifying a deterministic draft at a temperature only draw from each row's softmax (accept_matching)
    draw_temperature = cfg.sampling.temperature if cfg.acceptance == "exact" and drawable(cfg.sampling) else 0.0
    fwd = tree_forward(model, cache, rest[None].to(device), chain_tree(rest.numel() - 1), hidden_layers, True, argmax_only,
                       draw_temperature)
    first = fwd.draws.draw(0, generator) if fwd.draws is not None else int(choose(fwd.logits[0, -1], cfg.sampling, generator))
    stats.prefill_s = time.perf_counter() - t0
    stats.reused_tokens = reused
    prompt_hidden = fwd.hidden_states
    if prompt_hidden is not None and reuse is not None and reuse.hidden:
        prompt_hidden = {i: torch.cat([reuse.hidden[i], h], 1) for i, h in prompt_hidden.items()}
    # hidden states of every cached position, in order, for the prefix cache's next call
    kept_hidden = None
    if prefix_cache is not None and prompt_hidden is not None:
        kept_hidden = {i: [h] for i, h in prompt_hidden.items()}
    done = emit([first], ["target"])
    if drafter is not None and not done:
        t0 = time.perf_counter()
        drafter.reset(StepResult(torch.tensor(committed), 0, prompt_hidden))
        stats.draft_s += time.perf_counter() - t0

    while not done:
        prefix = cache.length
        root = committed[-1]
        # 1. draft (unless the gate measured plain steps faster for this kind of step)
        t0 = time.perf_counter()
        context = torch.tensor(committed) if drafter is not None else None
        kind = gate_kind(context, cfg.sampling) if gate_kind is not None else None
        free = shadow_draft(context, cfg.sampling) if shadow_draft is not None else None  # the part costing no forward
        kinds = (kind, ("free alone", kind)) if free_alone and free is not None else (kind,)
        choice = None if drafter is None else 0 if gate is None else gate.pick(1, kinds)
        if choice is None:
            draft = root_only(root)
            if shadow is None and (shadow_free or shadow_draft is not None):  # draft in the shadow: scored
                # once the target has decoded on (the whole draft of a free drafter, else its free part)
                candidate = drafter.propose(context, cfg.sampling, None) if shadow_free else free
                if candidate is not None:  # drew nothing, changed no state
                    shadow = ShadowDraft.of(fit_draft(candidate, budget - len(out.tokens)), len(committed))
                    shadow_kind = kinds[-1]  # the free part alone, where the gate weighs it as an alternative
        elif choice == 1:  # the free members' draft alone: deterministic, so lossless as any member's
            shadow = None
            draft = fit_draft(free, budget - len(out.tokens))
        else:
            shadow = None  # a verified draft measures the drafter itself
            draft = drafter.propose(context, cfg.sampling, generator)
            if int(draft.tokens[0]) != root:
                raise RuntimeError(f"drafter returned a tree rooted at {int(draft.tokens[0])}, expected {root}")
            draft = fit_draft(draft, budget - len(out.tokens))
        t1 = time.perf_counter()
        # 2. verify
        fwd = tree_forward(model, cache, draft.tokens[None].to(device), draft.tree, hidden_layers, argmax_only=argmax_only,
                           draw_temperature=draw_temperature if draft.q is None else 0.0)
        t2 = time.perf_counter()
        # 3. accept
        acc = accept_draft(draft, fwd.logits[0] if fwd.logits is not None else None, cfg, generator, fwd.draws)
        # 4. update cache: keep the root and the accepted nodes, in order
        cache.compact(prefix, acc.path.to(device))
        accepted = draft.tokens[acc.path[1:]].tolist()
        leaf = len(draft.tree.children()[int(acc.path[-1])]) == 0
        last = "target" if draft.tree.size == 1 else ("bonus" if leaf else "correction")
        stats.record_step(draft.tree.max_depth, acc.num_accepted, t1 - t0, t2 - t1)
        if gate is not None:
            ran = 0 if choice is None else choice
            gate.record(1, draft.tree.size > 1, 1 + acc.num_accepted, time.perf_counter() - t0, kinds[ran],
                        kinds[:ran] + kinds[ran + 1 :])
        done = emit(accepted + [acc.next_token], ["draft"] * len(accepted) + [last])
        if shadow is not None:
            score = shadow.score(committed)
            if score is not None:
                gate.record_shadow(1, score, shadow_kind)
                shadow = None
        hidden = None
        if fwd.hidden_states is not None and (kept_hidden is not None or (drafter is not None and not done)):
            hidden = {i: h[:, acc.path.to(device)] for i, h in fwd.hidden_states.items()}
            if kept_hidden is not None:
                for i, h in hidden.items():
                    kept_hidden[i].append(h)
        if drafter is not None and not done:
            t0 = time.perf_counter()
            drafter.update(StepResult(torch.tensor(committed), acc.num_accepted, hidden))
            stats.draft_s += time.perf_counter() - t0
    if prefix_cache is not None:
        prefix_cache.keep(model, committed, cache, kept_hidden)
    stats.new_tokens = len(out.tokens)
    stats.wall_s = time.perf_counter() - t_start
    return out
