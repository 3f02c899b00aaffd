"""The one file that knows Hugging Face internals (with its fast path, :mod:`selfdraft.lean_forward`).

Tree verification goes into an unmodified ``AutoModelForCausalLM`` through public inputs only: an
explicit 4D additive attention mask (a ``{layer_type: mask}`` dict for models with sliding-window
layers, as Gemma-3's forward accepts), explicit ``position_ids`` and a :class:`SpecCache` passed as
the model's cache argument. Each supported architecture has a parity test (tests/test_tree_parity.py). With bf16 weights on a CPU
without native bf16, a forward's matrix products go through a fused kernel (few tokens) or fp32
products (many tokens): :func:`selfdraft.kernels.forward_products`; the weights are not touched.
Small bf16 forwards of Llama-family and Gemma-3 targets skip the model's module stack: :func:`tree_forward` hands
them to :func:`selfdraft.lean_forward.lean_forward`, which computes the same values bit for bit.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor, nn

from selfdraft.cache import RaggedCache, SpecCache
from selfdraft.kernels import FUSED_ATTENTION_MAX_QUERIES, forward_products
from selfdraft.lean_forward import lean_applies, lean_forward
from selfdraft.screened_draws import ScreenedDraws
from selfdraft.tree import Tree

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ATTENTION = ("sdpa", "eager")


class UnsupportedModelError(ValueError):
    """The target's architecture or attention backend cannot take tree masks through public inputs."""


def check_supported(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` with a remedy if ``model`` cannot be verified with trees."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type '{cfg.model_type}' is not supported for tree verification (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}). Add it to selfdraft/adapter.py with a parity test."
        )
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if not layer_types <= set(SUPPORTED_LAYER_TYPES):
        raise UnsupportedModelError(
            f"layer types {sorted(layer_types - set(SUPPORTED_LAYER_TYPES))} cannot take a tree mask"
        )
    impl = cfg._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation '{impl}' ignores custom masks; load the target with "
            f"attn_implementation='sdpa' (or 'eager')"
        )


@cache
def _cache_kwarg(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def num_layers(model: nn.Module) -> int:
    return int(model.config.num_hidden_layers)


def new_cache(model: nn.Module, max_len: int) -> SpecCache:
    """A preallocated cache with room for ``max_len`` positions."""
    return SpecCache(num_layers(model), max_len)


def attention_mask(
    model: nn.Module, visible: Tensor, query_pos: Tensor, key_pos: Tensor, dtype: torch.dtype
) -> Tensor | dict[str, Tensor]:
    """Additive 4D mask(s) of shape (1, 1, q, k) from a (q, k) bool visibility matrix.

    Sliding-window layers additionally hide keys at least ``sliding_window`` positions behind the query.
    """
    masks = _additive_masks(model, visible, query_pos, key_pos, dtype)
    if isinstance(masks, dict):
        return {kind: m[None, None] for kind, m in masks.items()}
    return masks[None, None]


def within_window(model: nn.Module, n: int) -> bool:
    """True when ``n`` consecutive positions fit the model's sliding window (or it has none), so a
    causal mask over them is the whole story for every layer."""
    window = getattr(model.config, "sliding_window", None)
    return window is None or n <= window


def _additive_masks(
    model: nn.Module, visible: Tensor, query_pos: Tensor, key_pos: Tensor, dtype: torch.dtype
) -> Tensor | dict[str, Tensor]:
    """(..., q, k) additive mask(s) from a (..., q, k) visibility, (..., q) query and (..., k) key positions."""
    neg = torch.finfo(dtype).min
    full = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, neg)
    layer_types = getattr(model.config, "layer_types", None)
    if not layer_types or set(layer_types) == {"full_attention"}:
        return full
    window = model.config.sliding_window
    in_window = (query_pos[..., :, None] - key_pos[..., None, :]) < window
    sliding = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    sliding.masked_fill_(~(visible & in_window), neg)
    return {"full_attention": full, "sliding_attention": sliding}


@dataclass
class ForwardOutput:
    logits: Tensor | None
    """(batch, n, vocab) target logits at each input node ((batch, 1, vocab) with last_logits_only); with
    argmax_only, -inf where a logit cannot be its row's maximum; None where ``draws`` stands in for them."""
    hidden_states: dict[int, Tensor] | None
    """(batch, n, hidden) states by requested hidden-state index."""
    draws: ScreenedDraws | None = None
    """With draw_temperature, possibly: draws from each row's softmax(logits / T) (rows in batch-major order)."""


def tree_forward(
    model: nn.Module,
    cache: SpecCache,
    tokens: Tensor,
    tree: Tree,
    hidden_layers: tuple[int, ...] = (),
    last_logits_only: bool = False,
    argmax_only: bool = False,
    draw_temperature: float = 0.0,
) -> ForwardOutput:
    """One target forward over all tree nodes, appended after the cache's committed prefix.

    tokens: (batch, n) node tokens in tree order. The KV of every node is written to the cache at
    ``cache.length + node``; call :meth:`SpecCache.compact` afterwards to keep the accepted path.
    ``hidden_layers`` selects hidden states to return (0 = embeddings, i = input of layer i, -1 =
    final normed state). ``last_logits_only`` projects only the last node to the vocabulary (prefill:
    the lm_head over every prompt position is wasted work). ``argmax_only``: only each row's argmax
    will be used (greedy steps); the lean forward may then screen the lm_head, leaving -inf where a
    logit cannot be its row's maximum (:mod:`selfdraft.greedy_screen`). ``draw_temperature`` T > 0: each
    row will only be drawn from at softmax(logits / T) (no top-k, top-p); the lean forward may then
    return ``draws`` instead of logits (:mod:`selfdraft.screened_draws`).
    """
    device = tokens.device
    prefix = cache.length
    n = tokens.shape[-1]
    positions = (tree.depth + prefix).to(device)
    dtype = model.get_input_embeddings().weight.dtype
    position_ids = positions[None].expand(tokens.shape[0], n)

    def tree_mask() -> Tensor | dict[str, Tensor]:
        key_pos = torch.cat([torch.arange(prefix, device=device), positions])
        visible = torch.ones(n, prefix + n, dtype=torch.bool, device=device)
        visible[:, prefix:] = tree.ancestors.to(device)
        return attention_mask(model, visible, positions, key_pos, dtype)

    # a forward that projects every row verifies a draft: the lean forward at any size (greedy identity)
    verification = not last_logits_only
    if dtype == torch.bfloat16 and (lean := lean_applies(model, cache, tokens, verification)) is not None:
        return ForwardOutput(*lean_forward(*lean, cache, tokens, position_ids, tree_mask(), hidden_layers, last_logits_only,
                                           argmax_only, draw_temperature))
    # a prompt on an empty cache is plain causal attention: without a mask SDPA skips the hidden half
    # of the scores (2x faster attention at 2,048 tokens) and no (n, n) mask is built. Up to
    # FUSED_ATTENTION_MAX_QUERIES queries keep the mask: the fused attention kernel takes those (bf16)
    causal = n > FUSED_ATTENTION_MAX_QUERIES and prefix == 0 and tree.is_chain and within_window(model, n)
    mask = None if causal else tree_mask()
    with forward_products(model, dtype, device, tokens.numel()):
        out = model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            output_hidden_states=list(hidden_layers) if hidden_layers else False,
            logits_to_keep=1 if last_logits_only else 0,
            **{_cache_kwarg(type(model)): cache},
        )
    hidden = {i: out.hidden_states[i] for i in hidden_layers} if hidden_layers else None
    return ForwardOutput(out.logits, hidden)


def ragged_tree_forward(
    model: nn.Module,
    cache: RaggedCache,
    tokens: Tensor,
    trees: list[Tree],
    hidden_layers: tuple[int, ...] = (),
    logits_at: Tensor | None = None,
) -> ForwardOutput:
    """One target forward over a batch of trees, each after its own row's committed prefix.

    tokens: (batch, n) node tokens of each row's tree in tree order, right-padded to n = the largest
    tree. Row b's node i gets position ``lengths[b] + depth`` and its KV lands in cache slot
    ``lengths[b] + i``; it sees the row's prefix and its own ancestors. Padding nodes see only
    themselves (their logits and KV are garbage, dropped by compaction). Returns logits (batch, n, vocab),
    or (batch, k, vocab) at the node indices ``logits_at`` (k,) only (prefill: the last prompt positions).
    """
    device = tokens.device
    batch, n = tokens.shape
    lengths = cache.lengths  # (batch,) on the CPU
    width = int(lengths.max()) + n
    sizes = torch.tensor([t.size for t in trees])
    tree_visible = torch.eye(n, dtype=torch.bool).repeat(batch, 1, 1)  # padding nodes see themselves
    depth = torch.zeros(batch, n, dtype=torch.long)
    for b, tree in enumerate(trees):
        tree_visible[b, : tree.size, : tree.size] = tree.ancestors
        depth[b, : tree.size] = tree.depth
    positions = lengths[:, None] + depth  # (batch, n)
    slots = lengths[:, None] + torch.arange(n)  # (batch, n) cache slot of each node
    real = torch.arange(n)[None, :] < sizes[:, None]
    prefix = torch.arange(width)[None, :] < lengths[:, None]  # (batch, width)
    visible = (prefix[:, None, :] & real[:, :, None]).scatter(2, slots[:, None, :].expand(batch, n, n), tree_visible)
    key_pos = torch.arange(width).repeat(batch, 1).scatter(1, slots, positions)
    dtype = model.get_input_embeddings().weight.dtype
    masks = _additive_masks(model, visible.to(device), positions.to(device), key_pos.to(device), dtype)
    mask = {k: m[:, None] for k, m in masks.items()} if isinstance(masks, dict) else masks[:, None]
    with forward_products(model, dtype, device, tokens.numel()):
        out = model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions.to(device),
            use_cache=True,
            output_hidden_states=list(hidden_layers) if hidden_layers else False,
            logits_to_keep=logits_at.to(device) if logits_at is not None else 0,
            **{_cache_kwarg(type(model)): cache},
        )
    hidden = {i: out.hidden_states[i] for i in hidden_layers} if hidden_layers else None
    return ForwardOutput(out.logits, hidden)


def shallow_view(model: nn.Module, num_kept_layers: int) -> nn.Module:
    """The target's first ``num_kept_layers`` decoder layers + final norm + lm_head, sharing weights.

    Used by layer-skip self-drafting. Returns a new module object whose submodules are the target's
    own (no parameter is copied and the target itself is not modified).
    """
    total = num_layers(model)
    if not 1 <= num_kept_layers < total:
        raise ValueError(f"layer-skip needs 1 <= layers < {total}, got {num_kept_layers}")
    cfg = copy.copy(model.config)
    cfg.num_hidden_layers = num_kept_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:num_kept_layers])
    base = model.get_decoder()
    base_view = copy.copy(base)
    base_view._modules = dict(base._modules)
    base_view._modules["layers"] = nn.ModuleList(list(base.layers[:num_kept_layers]))
    base_view.config = cfg
    view = copy.copy(model)
    view._modules = {
        name: (base_view if module is base else module) for name, module in model._modules.items()
    }
    view.config = cfg
    return view
