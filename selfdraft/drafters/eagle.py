"""EAGLE drafting with a dynamic tree (EAGLE-2, Li et al. 2024) for EAGLE-1 and EAGLE-3 heads.

The head keeps its own KV cache over committed (feature, next token) pairs. Each step:
1. feed the pairs committed since the last step (target features of the accepted path);
2. expand: depth 1 takes the top-k tokens of the last pair's output; each further depth runs the
   head on the top-k frontier nodes (by cumulative log-probability), each attending to the
   committed cache and its own ancestors, and gives each of them top-k children (nodes the budget
   could never keep are skipped: :meth:`EagleDrafter.children`, :meth:`EagleDrafter.frontier_width`);
3. rerank every generated node by cumulative log-probability and keep the best ``total_tokens``
   (an ancestor-closed set), which is the tree the target verifies;
4. roll the head cache back to the committed pairs (tree entries are dropped).
By default children are a deterministic function of the head's state (q one-hot), which keeps
sampling lossless and lets the drafter be merged with others. With ``sample=True`` and a sampling
(T > 0) step, each node's children are instead drawn from the head's distribution q (processed with
the step's SamplingConfig) one after another without replacement, and the draft carries q: the
acceptance test then accepts with min(1, p/q) (SpecInfer), about sum(min(p, q)) per node instead of
p(x) of a fixed child. Reranking by score after the draws would pick children by their values and
break losslessness, so a sampled tree keeps its first ``total_tokens`` nodes in the order they were
drawn (every node's kept children are then a prefix of its draws); which nodes get children is
still chosen by score, before their children are drawn.
"""

from __future__ import annotations

import torch
from torch import Tensor

from selfdraft.cache import PreallocatedLayer
from selfdraft.drafters.base import Draft, StepResult
from selfdraft.heads.lean_step import lean_step
from selfdraft.kernels import FUSED_ATTENTION_MAX_QUERIES, fused_modules, large_products
from selfdraft.sampling import SamplingConfig, draw_without_replacement, logits_to_probs
from selfdraft.tree import Tree, top_nodes_by_score, tree_from_parents


class EagleDrafter:
    """Dynamic-tree drafter for an EAGLE head.

    The head provides ``feature_layers``, ``fuse`` (target features -> draft feature), ``project`` /
    ``complete`` (one decoder-layer step split around attention so this drafter owns the KV cache),
    ``key_values`` (``project``'s keys and values alone, for committed inputs no output is read of),
    ``logits`` and ``draft_ids`` (reduced-vocabulary map, or None for the full vocabulary).
    """

    proposes_for_free = False

    def __init__(self, head, depth: int = 5, top_k: int = 4, total_tokens: int = 16, sample: bool = False):
        if depth < 1 or top_k < 1 or total_tokens < 1:
            raise ValueError(f"depth, top_k and total_tokens must be >= 1, got {depth}, {top_k}, {total_tokens}")
        self.head = head
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.sample = bool(sample)
        self.hidden_layers = tuple(head.feature_layers)
        self.param = next(head.parameters())
        self.kv = PreallocatedLayer(1024)  # the head's one-layer KV cache, grown on demand
        self.committed = 0
        self.pending: tuple[Tensor, Tensor] | None = None
        self.step = None  # the head's lean step for this propose (selfdraft.heads.lean_step), if it applies

    def _take(self, step: StepResult) -> None:
        feats = torch.cat([step.hidden_states[i] for i in self.hidden_layers], -1)[0]  # (k, features)
        k = feats.shape[0]
        tokens = step.tokens[-k:]  # the token after each featured position
        if self.pending is not None:  # a step with no propose in between (should not happen) keeps order
            feats = torch.cat([self.pending[0], feats])
            tokens = torch.cat([self.pending[1], tokens])
        self.pending = (feats, tokens)

    def reset(self, step: StepResult) -> None:
        self.kv.reset()
        self.committed = 0
        self.pending = None
        self._take(step)

    def update(self, step: StepResult) -> None:
        self._take(step)

    def _run(self, emb: Tensor, feature: Tensor, positions: Tensor, visible_tree: Tensor | None,
             fuse: bool = False, outputs_from: int = 0) -> tuple[Tensor, Tensor]:
        """Run the layer on n inputs appended to the cache; returns (outputs, logits) of inputs
        ``outputs_from ..``: the ones before only leave their keys and values (committed inputs whose
        output nothing reads: all of a catch-up's but the last).

        visible_tree: (n, n_tree_entries) bool over the tree entries already in the cache after the
        committed prefix, or None for committed (causal) inputs. fuse: ``feature`` holds target
        features for the head's ``fuse`` first.
        """
        n = emb.shape[0]
        if self.step is not None and n <= FUSED_ATTENTION_MAX_QUERIES:  # the same arithmetic in one kernel call
            attn = self.head.midlayer.self_attn
            if not self.kv.is_initialized:
                like = emb.new_empty(1, attn.num_kv_heads, 0, attn.head_dim)
                self.kv.lazy_initialization(like, like)
            self.kv.reserve(n)
            start = self.kv.length
            cos, sin = attn.rope(positions)
            out, logits = self.step.forward(emb, feature, fuse, self.kv.keys, self.kv.values, start, cos, sin,
                                            visible_tree, self.committed, outputs_from)
            self.kv.length = start + n
            return out, logits
        if fuse:
            feature = self.head.fuse(feature)
        if outputs_from:
            keys, values = self.head.key_values(emb[None, :outputs_from], feature[None, :outputs_from],
                                                positions[None, :outputs_from])
            self.kv.update(keys, values)
            emb, feature, positions = emb[outputs_from:], feature[outputs_from:], positions[outputs_from:]
            if visible_tree is not None:
                visible_tree = visible_tree[outputs_from:]
        m = emb.shape[0]
        residual, q, k, v = self.head.project(emb[None], feature[None], positions[None])
        start = self.kv.length
        keys, values = self.kv.update(k, v)
        if visible_tree is None and m == 1:  # one committed input, the last, sees the whole cache
            out = self.head.complete(residual, q, keys, values, None)[0]
            return out, self.head.logits(out)
        mask = torch.ones(m, keys.shape[2], dtype=torch.bool, device=emb.device)
        if visible_tree is None:  # causal among the new committed inputs
            mask[:, start:] = torch.tril(torch.ones(m, m, dtype=torch.bool, device=emb.device))
        else:
            mask[:, self.committed :] = visible_tree
        out = self.head.complete(residual, q, keys, values, mask[None, None])[0]
        return out, self.head.logits(out)

    def children(self, depth: int) -> int:
        """Top-k children per frontier node at loop ``depth`` (0: the root's) of a deterministic tree.

        Only ``total_tokens`` nodes are kept, by cumulative score, and a node is outranked by its
        non-root ancestors and by its better siblings: the c-th child of a node at tree depth d can be
        kept only if d + c <= total_tokens. Children past that are not generated (the kept tree is the
        same, for less work)."""
        return min(self.top_k, self.total_tokens - depth)

    def frontier_width(self, depth: int) -> int:
        """How many of loop ``depth``'s new nodes (tree depth ``depth + 1``) a deterministic tree runs
        through the head for children: top_k, but the r-th best of them is outranked by r - 1 of its
        level, itself and its ``depth`` non-root ancestors, so its children can be kept only if
        depth + r < total_tokens."""
        return min(self.top_k, self.total_tokens - depth - 1)

    def propose(self, tokens: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        backlog = 0 if self.pending is None else self.pending[0].shape[0]  # committed pairs to feed first
        self.step = lean_step(self.head)  # looked up outside FusedModules (it checks the modules' own forwards)
        with (
            fused_modules(self.head, getattr(self.head, "lm_head", None)),
            large_products(self.param.dtype, self.param.device, backlog),
        ):
            drawn = self.sample and not sampling.greedy
            tree, node_tokens, scores, q = self.expand(tokens, sampling if drawn else None, generator)
        # 3. rerank (drawn children: keep the first total_tokens nodes in draw order; parents precede
        # their children, so the kept set is ancestor-closed and each node keeps a prefix of its draws)
        rank = -torch.arange(tree.size, dtype=torch.float) if drawn else scores
        tree, keep = top_nodes_by_score(tree, rank, self.total_tokens)
        return Draft(tree, node_tokens[keep], None if q is None else q[keep])

    @torch.inference_mode()
    def expand(
        self, tokens: Tensor, sampling: SamplingConfig | None = None, generator: torch.Generator | None = None
    ) -> tuple[Tree, Tensor, Tensor, Tensor | None]:
        """Steps 1-2: every generated node as (tree, (n,) tokens, (n,) cumulative log-probabilities, q).

        q is None for top-k children; with ``sampling`` (T > 0) children are drawn from the head's
        distribution instead, and q is (n, V): the distribution each node's children were drawn
        from (zeros for leaves)."""
        head, dev = self.head, self.param.device
        self.kv.length = self.committed  # 4. (of the previous step) drop last step's tree entries
        # 1. feed committed pairs (only the last one's output is read: the root's feature)
        feats, next_tokens = self.pending
        self.pending = None
        n = feats.shape[0]
        positions = torch.arange(self.committed, self.committed + n, device=dev)
        emb = head.embed(next_tokens.to(dev)).to(self.param.dtype)
        out, logits = self._run(emb, feats.to(self.param.dtype), positions, None, fuse=True, outputs_from=n - 1)
        self.committed += n
        last_pos = self.committed - 1
        # 2. expand: node 0 is the root (tokens[-1]); generated nodes follow in order
        parents, node_tokens, scores = [-1], [int(tokens[-1])], [0.0]
        node_hidden: dict[int, Tensor] = {0: out[-1]}  # layer output at a node: its children's feature
        entry_of: list[int] = []  # tree node held by each tree entry in the head cache
        ancestors = [[0]]
        frontier = [0]
        draft_ids = head.draft_ids
        q_rows: dict[int, Tensor] = {}  # node -> q (draft vocabulary) its children were drawn from
        for d in range(self.depth):  # logits: the frontier's rows, in its order
            if sampling is None:
                logp = torch.log_softmax(logits.float(), -1)
                top_lp, top_i = logp.topk(self.children(d), dim=-1)
            else:
                q = logits_to_probs(logits, sampling)
                # draws past the budget would be dropped: draw at most what can still be kept
                top_i = draw_without_replacement(q, min(self.top_k, self.total_tokens - len(parents) + 1), generator)
                top_lp = q.gather(1, top_i.clamp(min=0)).log().masked_fill(top_i < 0, float("-inf"))
                q_rows.update(zip(frontier, q))
            new_nodes = []
            # one conversion to Python lists per depth (per-row tensor indexing cost more than the tree)
            ids = top_i.clamp(min=0) if draft_ids is None else draft_ids[top_i.clamp(min=0)]
            for f, row_ids, row_lps, row_drawn in zip(frontier, ids.tolist(), top_lp.tolist(), (top_i >= 0).tolist()):
                for i, lp, was_drawn in zip(row_ids, row_lps, row_drawn):
                    if not was_drawn:  # fewer draws than asked for (q ran out of mass)
                        continue
                    parents.append(f)
                    node_tokens.append(i)
                    scores.append(scores[f] + lp)
                    ancestors.append(ancestors[f] + [len(parents) - 1])
                    new_nodes.append(len(parents) - 1)
            if d + 1 == self.depth or (sampling is not None and len(parents) - 1 >= self.total_tokens):
                break
            # next frontier: the top-k new nodes by cumulative score (fewer where no child of theirs
            # could be kept), run through the head
            width = self.top_k if sampling is not None else self.frontier_width(d)
            best = sorted(new_nodes, key=lambda x: -scores[x])[: max(width, 0)]
            if not best:
                break
            entry_of.extend(best)
            visible = torch.tensor(
                [[e in ancestors[b] for e in entry_of] for b in best], dtype=torch.bool, device=dev
            )
            emb = head.embed(torch.tensor([node_tokens[b] for b in best], device=dev)).to(self.param.dtype)
            feature = torch.stack([node_hidden[parents[b]] for b in best])
            pos = torch.full((len(best),), last_pos + d + 1, device=dev)
            outs, logits = self._run(emb, feature, pos, visible)
            for b, o in zip(best, outs):
                node_hidden[b] = o
            frontier = best
        tree = tree_from_parents(parents)
        if sampling is None:
            return tree, torch.tensor(node_tokens), torch.tensor(scores), None
        vocab = head.cfg.vocab_size if draft_ids is not None else next(iter(q_rows.values())).shape[-1]
        q_full = torch.zeros(tree.size, vocab)
        for node, q in q_rows.items():
            if draft_ids is None:
                q_full[node] = q
            else:
                q_full[node, draft_ids] = q
        return tree, torch.tensor(node_tokens), torch.tensor(scores), q_full

