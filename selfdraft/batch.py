"""Continuous batching for tree speculative decoding: many prompts, one target forward per step.

Requests wait in a queue; ``batch_size`` slots decode together. Each step: 1. every row's drafter
proposes its own tree (trimmed by a :class:`TreePolicy` budget that shrinks as the batch grows);
2. one target forward verifies all rows' trees, right-padded to the largest with dummy nodes that
see only themselves; 3. each row runs its own acceptance rule (greedy-exact, lossless tree rejection
sampling, or typical) and so accepts its own number of tokens; 4. each row's KV cache is compacted
to its accepted path. A row ends on its own EOS / stop string / max_new_tokens and its slot is
refilled from the queue (newcomers admitted together share prefill forwards, grouped so padding
stays small, whose KV is then copied into their slots).

Tree size versus batch size: at batch 1 the target forward is memory-bound and a wide tree is
nearly free; with many rows it turns compute-bound and every verified node costs. :func:`draft_budget`
caps the nodes verified per step over all rows (and can switch drafting off above a batch size);
with ``TreePolicy.auto_off`` a :class:`SpeculationGate` measures speculative and plain steps per
batch size online and runs whichever commits tokens faster. While it runs plain steps, a drafter
that proposes for free (prompt lookup) keeps drafting in the shadow: each row's draft is scored
against the tokens the row then commits, and each step reports the mean over the rows it scored.

Ragged lengths: a per-row length vector, not left padding. The :class:`~selfdraft.cache.RaggedCache`
keeps row b's committed KV at slots ``0 .. lengths[b]``; a step writes row b's tree right after it
and attends over ``max(lengths) + n`` slots with a per-row mask hiding the gap, with per-row position
ids ``lengths[b] + depth``. Rows accept different numbers of tokens, so left padding would have to
shift every row's cache by its own amount after every step (or let padding grow without bound);
with per-row offsets compaction is one gather/scatter per layer and a newcomer just overwrites its
slot. When the queue is empty, finished rows are dropped from the batch (one copy) so the tail does
not compute dead rows.

Each row is exactly what :func:`selfdraft.generate.generate` would produce alone: greedy rows equal
plain greedy decoding token for token (fp32), sampling rows follow the target distribution.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from selfdraft.adapter import num_layers, ragged_tree_forward
from selfdraft.cache import RaggedCache
from selfdraft.drafters.base import Draft, Drafter, StepResult, root_only
from selfdraft.gate import ShadowDraft, SpeculationGate
from selfdraft.generate import (
    CACHE_SLACK,
    GenerationConfig,
    accept_draft,
    append_until_stop,
    fit_budget,
    fit_draft,
)
from selfdraft.sampling import choose
from selfdraft.stats import GenerationStats
from selfdraft.tree import chain_tree, select_nodes

DEFAULT_CONFIG = GenerationConfig()


@dataclass(frozen=True)
class TreePolicy:
    """How much each row may draft as the batch grows.

    At batch 1 the target forward is memory-bound, so verifying a wide tree costs about as much as
    one token; as rows are added the forward becomes compute-bound and every extra verified node
    costs real time, so speculation pays less. The policy caps the nodes verified per step over all
    rows and can switch speculation off above a batch size.
    """

    max_step_tokens: int | None = 64
    """Cap on tree nodes (roots included) verified per step over all rows; each of r rows may then
    verify ``max_step_tokens // r`` nodes, i.e. draft one fewer. None: no cap."""
    max_draft_per_row: int | None = None
    """Cap on draft nodes per row at any batch size. None: whatever the drafter proposes."""
    speculate_up_to: int | None = None
    """Batch sizes above this decode plainly (no drafting at all). None: always speculate."""
    auto_off: bool = False
    """Measure online and decode plainly at batch sizes where plain steps commit tokens faster than
    speculative ones (see :class:`SpeculationGate`); applies on top of the limits above."""
    probe_every: int = 64
    """With auto_off: while drafting at a batch size, one plain step in this many re-measures the plain step time."""

    def __post_init__(self) -> None:
        if self.probe_every < 2:
            raise ValueError(f"TreePolicy.probe_every must be >= 2, got {self.probe_every}")
        for name in ("max_step_tokens", "max_draft_per_row", "speculate_up_to"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"TreePolicy.{name} must be >= 0 or None, got {value}")


def draft_budget(rows: int, policy: TreePolicy) -> int | None:
    """Draft nodes (root excluded) each of ``rows`` rows may verify this step; None means unlimited."""
    if policy.speculate_up_to is not None and rows > policy.speculate_up_to:
        return 0
    budget = None
    if policy.max_step_tokens is not None:
        budget = max(0, policy.max_step_tokens // max(rows, 1) - 1)
    if policy.max_draft_per_row is not None:
        budget = policy.max_draft_per_row if budget is None else min(budget, policy.max_draft_per_row)
    return budget


def limit_nodes(draft: Draft, max_draft: int) -> Draft:
    """Keep the root and the first ``max_draft`` nodes in tree order.

    Any prefix of the node order is closed under ancestors (``parents[i] < i``), and drafters list
    their best candidates first (the top path of a trie, the shallow levels of a static tree), so
    this keeps a valid, high-value subtree.
    """
    if draft.tree.size <= max_draft + 1:
        return draft
    tree, keep = select_nodes(draft.tree, torch.arange(draft.tree.size) <= max_draft)
    q = draft.q[keep] if draft.q is not None else None
    return Draft(tree, draft.tokens[keep], q)


def prefill_groups(lengths: Sequence[int], max_padding: float = 0.25) -> list[list[int]]:
    """Split prompts (by index) into prefill forwards whose right padding stays under ``max_padding``.

    Prefill is compute-bound, so padding a short prompt to a long one's width is real work; prompts
    are taken longest first and a group closes when adding the next would pad more than this share.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None:
            width = lengths[group[0]]
            real = sum(lengths[j] for j in group) + lengths[i]
            if 1 - real / (width * (len(group) + 1)) <= max_padding:
                group.append(i)
                continue
        groups.append([i])
    return groups


@dataclass
class BatchResult:
    """One request's outcome, in the order the prompts were given."""

    index: int
    """Position of the prompt in the input list."""
    tokens: list[int] = field(default_factory=list)
    """New tokens (EOS included when it ended generation)."""
    sources: list[str] = field(default_factory=list)
    """Per new token: 'draft', 'correction', 'bonus' or 'target' (as in GenerationOutput)."""
    stop_reason: str = "max_new_tokens"
    """'eos', 'stop_string', 'max_new_tokens' or 'error'."""
    stats: GenerationStats = field(default_factory=GenerationStats)
    """Per-request statistics; verify_s counts the batched forwards the row took part in."""
    latency_s: float = 0.0
    """Seconds from the start of :func:`generate_batch` to this request's last token (queueing included)."""
    error: str | None = None
    """The exception message when the request could not run (e.g. prompt over the context limit)."""

    @property
    def ok(self) -> bool:
        return self.error is None


class _Row:
    """A request in a slot: its committed sequence, budget, drafter and stop bookkeeping."""

    def __init__(self, result: BatchResult, prompt: list[int], budget: int, drafter: Drafter | None):
        self.result, self.budget, self.drafter = result, budget, drafter
        self.committed = list(prompt)
        self.started = time.perf_counter()
        self.shadow: ShadowDraft | None = None
        """A draft proposed in the shadow of plain steps, until the committed tokens score it."""

    def emit(self, new: list[int], sources: list[str], eos: frozenset[int], cfg: GenerationConfig, tokenizer) -> bool:
        """Append tokens up to a stop condition; returns True when the request is over."""
        out = self.result
        taken, reason = append_until_stop(out.tokens, new, eos, self.budget, cfg.stop_strings, tokenizer)
        if reason:
            out.stop_reason = reason
        out.sources.extend(sources[:taken])
        self.committed.extend(new[:taken])
        return reason is not None


@torch.inference_mode()
def generate_batch(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    make_drafter: Callable[[], Drafter] | None = None,
    cfg: GenerationConfig = DEFAULT_CONFIG,
    eos_token_ids: Sequence[int] | frozenset[int] = (),
    tokenizer: object | None = None,
    batch_size: int = 8,
    policy: TreePolicy = TreePolicy(),
    on_tokens: Callable[[int, list[int], list[str]], None] | None = None,
) -> list[BatchResult]:
    """Generate for every prompt with continuous batching; returns one result per prompt, in order.

    ``make_drafter()`` builds one drafter per slot (drafters keep per-sequence state such as their
    own KV cache; a slot's drafter is reset for each newcomer). None decodes plainly. Rows that
    cannot run (empty prompt, over the context limit with ``on_context_overflow='error'``) or whose
    drafter raises come back with ``stop_reason='error'`` and ``error`` set (a failed row keeps the
    tokens it had committed); the others are unaffected. A failure of the batched target forward
    itself is not per-row and propagates. ``on_tokens(index, tokens, sources)`` is called with each
    request's newly committed tokens as they come (for streaming; ``index`` is the prompt's position).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if cfg.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode the text")
    t_start = time.perf_counter()
    device = next(model.parameters()).device
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 20))
    eos = frozenset(int(e) for e in eos_token_ids)
    generator = None
    if not cfg.sampling.greedy or cfg.acceptance == "typical":
        generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None

    results = [BatchResult(index=i) for i in range(len(prompts))]
    queue: deque[tuple[int, list[int], int]] = deque()
    for i, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        try:
            budget = fit_budget(len(prompt), cfg, max_pos)
        except ValueError as err:  # ContextLengthError included
            results[i].stop_reason, results[i].error = "error", str(err)
            continue
        if budget == 0:
            continue
        queue.append((i, prompt, budget))
    if not queue:
        return results

    max_len = max(len(p) + b for _, p, b in queue) + CACHE_SLACK
    slots = min(batch_size, len(queue))
    cache = RaggedCache(num_layers(model), slots, max_len)
    drafters: list[Drafter | None] = [make_drafter() if make_drafter else None for _ in range(slots)]
    hidden_layers = tuple(getattr(drafters[0], "hidden_layers", ()))
    rows: list[_Row | None] = [None] * slots
    gate = SpeculationGate(policy.probe_every) if policy.auto_off else None
    shadow_free = gate is not None and getattr(drafters[0], "proposes_for_free", False)

    def finish(row: _Row) -> None:
        row.result.stats.new_tokens = len(row.result.tokens)
        row.result.stats.wall_s = time.perf_counter() - row.started
        row.result.latency_s = time.perf_counter() - t_start

    def emit(row: _Row, new: list[int], sources: list[str]) -> bool:
        """Commit a row's new tokens (up to its stop condition), stream them; True when the row is done."""
        before = len(row.result.tokens)
        done = row.emit(new, sources, eos, cfg, tokenizer)
        if on_tokens is not None:
            on_tokens(row.result.index, row.result.tokens[before:], row.result.sources[before:])
        return done

    def fail(row: _Row, err: Exception) -> None:
        """A row whose drafter raised ends with an error (tokens so far kept); the batch goes on."""
        row.result.stop_reason, row.result.error = "error", f"drafter failed: {type(err).__name__}: {err}"
        finish(row)

    def prefill(newcomers: list[tuple[int, int, list[int], int]]) -> None:
        """Prefill (slot, index, prompt, budget) newcomers in one forward and copy their KV into their slots."""
        t0 = time.perf_counter()
        lengths = [len(prompt) for _, _, prompt, _ in newcomers]
        width = max(lengths)
        tokens = torch.zeros(len(newcomers), width, dtype=torch.long)
        for b, (_, _, prompt, _) in enumerate(newcomers):
            tokens[b, : len(prompt)] = torch.tensor(prompt)
        last = torch.tensor(sorted(set(n - 1 for n in lengths)))
        own = RaggedCache(num_layers(model), len(newcomers), width)
        trees = [chain_tree(n - 1) for n in lengths]
        fwd = ragged_tree_forward(model, own, tokens.to(device), trees, hidden_layers, logits_at=last)
        cache.load_rows([slot for slot, *_ in newcomers], own, lengths)
        elapsed = time.perf_counter() - t0
        for b, (slot, index, prompt, budget) in enumerate(newcomers):
            row = _Row(results[index], prompt, budget, drafters[slot])
            row.started = t0
            row.result.stats.prefill_s = elapsed
            first = int(choose(fwd.logits[b, int((last == lengths[b] - 1).nonzero())], cfg.sampling, generator))
            if emit(row, [first], ["target"]):
                finish(row)
                continue
            if row.drafter is not None:
                hidden = None
                if fwd.hidden_states is not None:
                    hidden = {i: h[b : b + 1, : lengths[b]] for i, h in fwd.hidden_states.items()}
                t1 = time.perf_counter()
                try:
                    row.drafter.reset(StepResult(torch.tensor(row.committed), 0, hidden))
                except Exception as err:  # one request's drafter must not take the batch down
                    fail(row, err)
                    continue
                row.result.stats.draft_s += time.perf_counter() - t1
            rows[slot] = row

    def admit() -> None:
        """Fill free slots from the queue; newcomers done after their first token free their slot again."""
        while queue:
            free = [s for s, row in enumerate(rows) if row is None]
            if not free:
                return
            newcomers = [(slot, *queue.popleft()) for slot in free[: len(queue)]]
            for group in prefill_groups([len(prompt) for _, _, prompt, _ in newcomers]):
                prefill([newcomers[i] for i in group])

    while True:
        admit()
        if any(row is None for row in rows):  # the queue ran dry: drop the empty slots from the batch
            live = [s for s, row in enumerate(rows) if row is not None]
            if not live:
                break
            cache.keep_rows(torch.tensor(live))
            rows = [rows[s] for s in live]
        active: list[_Row] = list(rows)  # type: ignore[arg-type]
        allowed = draft_budget(len(active), policy) if make_drafter else 0
        speculative = allowed != 0 and (gate is None or gate.speculate(len(active)))
        shadowing = shadow_free and allowed != 0 and not speculative
        scores: list[float] = []  # this step's shadow scores, tokens per row
        resolved = 0  # shadow drafts among them (the rest: rows with nothing to propose)
        t_step = time.perf_counter()

        # 1. draft: each row its own tree, trimmed to the policy's budget and the row's remaining tokens
        drafts: list[Draft] = []
        draft_times: list[float] = []
        for b, row in enumerate(active):
            t0 = time.perf_counter()
            root = row.committed[-1]
            draft = root_only(root)
            if row.drafter is not None and (speculative or (shadowing and row.shadow is None)):
                try:  # a shadow draft draws nothing (generator None); a verified one samples as configured
                    proposal = row.drafter.propose(torch.tensor(row.committed), cfg.sampling,
                                                   generator if speculative else None)
                    if int(proposal.tokens[0]) != root:
                        raise RuntimeError(f"drafter returned a tree rooted at {int(proposal.tokens[0])}, expected {root}")
                except Exception as err:  # the row leaves; it verifies a root-only dummy this step
                    fail(row, err)
                    rows[b], proposal = None, root_only(root)
                if allowed is not None:
                    proposal = limit_nodes(proposal, allowed)
                proposal = fit_draft(proposal, row.budget - len(row.result.tokens))
                if speculative:
                    draft, row.shadow = proposal, None  # a verified draft measures the drafter itself
                elif rows[b] is not None:
                    row.shadow = ShadowDraft.of(proposal, len(row.committed))
                    if row.shadow is None:
                        scores.append(1.0)  # nothing to propose: a drafting step would commit one token here
            drafts.append(draft)
            draft_times.append(time.perf_counter() - t0)

        # 2. verify: one forward over every row's tree, right-padded with self-only dummy nodes
        t0 = time.perf_counter()
        width = max(d.tree.size for d in drafts)
        tokens = torch.zeros(len(active), width, dtype=torch.long)
        for b, draft in enumerate(drafts):
            tokens[b, : draft.tree.size] = draft.tokens
            tokens[b, draft.tree.size :] = draft.tokens[0]
        starts = cache.lengths.clone()
        fwd = ragged_tree_forward(model, cache, tokens.to(device), [d.tree for d in drafts], hidden_layers)
        verify_s = time.perf_counter() - t0

        # 3. accept, per row
        accs = [accept_draft(d, fwd.logits[b, : d.tree.size], cfg, generator) for b, d in enumerate(drafts)]

        if gate is not None and make_drafter is not None:
            step_s = time.perf_counter() - t_step
            drafted = any(d.tree.size > 1 for d in drafts)  # no row had anything to propose: a plain step
            gate.record(len(active), drafted, sum(1 + acc.num_accepted for acc in accs), step_s)

        # 4. update cache: each row keeps its root and accepted nodes right after its own prefix
        kept = max(acc.path.numel() for acc in accs)
        keep = torch.zeros(len(active), kept, dtype=torch.long)
        counts = torch.zeros(len(active), dtype=torch.long)
        for b, acc in enumerate(accs):
            keep[b, : acc.path.numel()] = acc.path
            counts[b] = acc.path.numel()
        cache.compact(starts, keep, counts)

        for b, (row, draft, acc) in enumerate(zip(active, drafts, accs)):
            if rows[b] is None:  # failed while drafting
                continue
            accepted = draft.tokens[acc.path[1:]].tolist()
            leaf = len(draft.tree.children()[int(acc.path[-1])]) == 0
            last = "target" if draft.tree.size == 1 else ("bonus" if leaf else "correction")
            row.result.stats.record_step(draft.tree.max_depth, acc.num_accepted, draft_times[b], verify_s)
            done = emit(row, accepted + [acc.next_token], ["draft"] * len(accepted) + [last])
            if row.shadow is not None:
                score = row.shadow.score(row.committed)
                if score is not None:
                    scores.append(float(score))
                    resolved += 1
                    row.shadow = None
            if done:
                finish(row)
                rows[b] = None
            elif row.drafter is not None:
                hidden = None
                if fwd.hidden_states is not None:
                    path = acc.path.to(device)
                    hidden = {i: h[b : b + 1, path] for i, h in fwd.hidden_states.items()}
                t1 = time.perf_counter()
                try:
                    row.drafter.update(StepResult(torch.tensor(row.committed), acc.num_accepted, hidden))
                except Exception as err:
                    fail(row, err)
                    rows[b] = None
                row.result.stats.draft_s += time.perf_counter() - t1
        if resolved:  # one sample per step, like a drafting step's tokens per row
            gate.record_shadow(len(active), sum(scores) / len(scores))
    return results
