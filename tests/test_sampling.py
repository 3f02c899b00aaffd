"""Sampling is lossless (statistically, never by seed equality); typical acceptance is shown lossy."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VOCAB, kernel_or_skip, random_prompt, tiny_model
from scipy.stats import chisquare
from test_eagle3 import make_head

from selfdraft.acceptance import accept_matching, accept_sampling, accept_typical
from selfdraft.drafters import DraftModelDrafter, MergedDrafter, PromptLookupDrafter, layer_skip_drafter
from selfdraft.drafters.eagle import EagleDrafter
from selfdraft.generate import GenerationConfig, generate
from selfdraft.sampling import SamplingConfig, argmax, logits_to_probs, sample
from selfdraft.tree import tree_from_parents

V = 5
P_MIN = 1e-3  # chi-square p-value below which we call the distributions different


def dirichlet(g: torch.Generator, n: int) -> torch.Tensor:
    x = -torch.log(torch.rand(n, V, generator=g))
    return x / x.sum(-1, keepdim=True)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells with expected count < 5 are pooled into one."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)]).double()
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)]).double()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def draw_without_replacement(q: torch.Tensor, k: int, g: torch.Generator) -> list[int]:
    q = q.clone()
    out = []
    for _ in range(k):
        x = int(torch.multinomial(q / q.sum(), 1, generator=g))
        out.append(x)
        q[x] = 0.0
    return out


def two_token_joint(branching: tuple[int, int], deterministic: bool, draws: int, seed: int, matching: bool = False):
    """Sample (x1, x2) through tree rejection sampling (``matching``: deterministic drafts through
    accept_matching); return (counts (V*V,), exact joint (V*V,))."""
    g = torch.Generator().manual_seed(seed)
    p_root = dirichlet(g, 1)[0]
    p_next = dirichlet(g, V)  # target distribution of x2 given x1
    q_root = dirichlet(g, 1)[0]
    q_next = dirichlet(g, V)
    k1, k2 = branching
    parents = [-1] + [0] * k1 + [1 + i for i in range(k1) for _ in range(k2)]
    tree = tree_from_parents(parents)
    counts = torch.zeros(V * V)
    for _ in range(draws):
        if deterministic:  # a fixed proposal order, like prompt lookup or greedy top-k
            level1 = torch.argsort(q_root, descending=True)[:k1].tolist()
            level2 = [torch.argsort(q_next[x], descending=True)[:k2].tolist() for x in level1]
        else:
            level1 = draw_without_replacement(q_root, k1, g)
            level2 = [draw_without_replacement(q_next[x], k2, g) for x in level1]
        tokens = torch.tensor([0] + level1 + [t for kids in level2 for t in kids])
        target = torch.stack([p_root] + [p_next[t] for t in tokens[1:].tolist()])
        draft_q = None
        if not deterministic:
            draft_q = torch.stack([q_root] + [q_next[t] for t in tokens[1:].tolist()])
        if matching:
            acc = accept_matching(tree, tokens, lambda node, p=target: int(torch.multinomial(p[node], 1, generator=g)))
        else:
            acc = accept_sampling(tree, tokens, target, draft_q, g)
        seq = tokens[acc.path[1:]].tolist() + [acc.next_token]
        if len(seq) == 1:  # rejected at depth 1: x2 comes from the next (plain) step
            seq.append(int(torch.multinomial(p_next[seq[0]], 1, generator=g)))
        counts[seq[0] * V + seq[1]] += 1
    exact = (p_root[:, None] * p_next).flatten()
    return counts, exact


@pytest.mark.parametrize(
    "branching,deterministic,matching",
    [((1, 1), False, False), ((3, 2), False, False), ((4, 3), False, False), ((3, 2), True, False),
     ((1, 1), True, True), ((3, 2), True, True)],
    ids=["chain", "tree3x2", "tree4x3", "tree3x2-deterministic", "chain-matching", "tree3x2-matching"],
)
def test_tree_rejection_sampling_is_lossless(branching, deterministic, matching):
    """Guards the recursive rejection rule (residual, sibling removal, bonus) and its form for
    deterministic drafts (accept_matching) against any bias."""
    counts, exact = two_token_joint(branching, deterministic, draws=20000, seed=sum(branching) + deterministic + matching,
                                    matching=matching)
    pval = chi2_pvalue(counts, exact)
    tv = 0.5 * (counts / counts.sum() - exact).abs().sum().item()
    assert pval > P_MIN, f"joint of (x1, x2) differs from p: chi2 p={pval:.2e}, TV={tv:.4f}"
    assert tv < 0.03, f"TV distance {tv:.4f}"


def test_a_biased_rule_is_caught():
    """Guards the test itself: accepting drafts without the p/q ratio must fail the same check."""
    g = torch.Generator().manual_seed(0)
    p = dirichlet(g, 1)[0]
    q = dirichlet(g, 1)[0]
    counts = torch.zeros(V)
    for _ in range(5000):
        x = int(torch.multinomial(q, 1, generator=g))
        keep = torch.rand((), generator=g) < 0.8  # ignores p(x)/q(x): wrong
        counts[x if keep else int(torch.multinomial(p, 1, generator=g))] += 1
    assert chi2_pvalue(counts, p) < P_MIN


def test_typical_acceptance_is_lossy():
    """Guards the 'lossy' label: typical acceptance must visibly change the output distribution."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    tree = tree_from_parents([-1, 0])
    counts = torch.zeros(V)
    for _ in range(5000):
        acc = accept_typical(tree, torch.tensor([0, 0]), torch.stack([p, p]), 0.09, 0.3, g)
        x = 0 if acc.num_accepted else acc.next_token
        counts[x] += 1
    assert chi2_pvalue(counts, p) < P_MIN, f"typical acceptance looked lossless: {counts.tolist()}"


def test_sample_draws_from_the_given_distribution():
    """Guards the inverse-CDF sampler every sampled token goes through: per-row frequencies match the
    probabilities (chi-square), unnormalised weights are normalised, tokens of probability zero (first,
    inner and last positions) are never drawn, a batch keeps its shape, and an all-zero row is an error."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0], [0.0, 0.0, 3.0, 0.0, 1.0, 0.0, 0.0]])
    n = 40000
    draws = sample(probs[:, None, :].expand(2, n, 7), generator)
    assert draws.shape == (2, n) and draws.dtype == torch.int64
    for row in range(2):
        want = probs[row] / probs[row].sum()
        counts = torch.bincount(draws[row], minlength=7).float()
        assert (counts[want == 0] == 0).all(), f"row {row} drew tokens of probability zero: {counts.tolist()}"
        keep = want > 0
        pvalue = chisquare(counts[keep].numpy(), (want[keep] * n).numpy()).pvalue
        assert pvalue > 1e-3, f"row {row}: frequencies {(counts / n).tolist()} vs {want.tolist()} (p={pvalue:.1e})"
    assert int(sample(torch.tensor([0.0, 0.0, 1.0]), generator)) == 2
    with pytest.raises(ValueError, match="sums to zero"):
        sample(torch.zeros(2, 5), generator)


def test_sampling_config_applies_top_k_top_p():
    """Guards the shared p/q transform: top-k and top-p must zero exactly the tail."""
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert logits_to_probs(logits, SamplingConfig(1.0, top_k=2)).nonzero().flatten().tolist() == [0, 1]
    probs = logits_to_probs(logits, SamplingConfig(1.0, top_p=0.8))
    assert probs.nonzero().flatten().tolist() == [0, 1, 2]
    assert abs(float(probs.sum()) - 1) < 1e-6


def exact_third_token(model, prompt: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """P(x3) = sum over x1, x2 of p(x1) p(x2|x1) p(x3|x1,x2), by batched forwards."""
    with torch.no_grad():
        p1 = logits_to_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1], cfg)
        ids = torch.tensor([prompt + [a] for a in range(VOCAB)])
        p2 = logits_to_probs(model(input_ids=ids).logits[:, -1], cfg)  # (V, V) row x1
        pairs = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        p3 = logits_to_probs(model(input_ids=pairs).logits[:, -1], cfg).view(VOCAB, VOCAB, VOCAB)
    return torch.einsum("a,ab,abc->c", p1, p2, p3), torch.einsum("a,ab->b", p1, p2)


@pytest.mark.parametrize("drafter_name", ["draft_model", "layer_skip", "merged", "eagle_sampled"])
def test_generation_tokens_follow_target_distribution(drafter_name):
    """Guards the full engine in sampling mode: x2 and x3 of real generations match the exact marginals."""
    model = tiny_model("llama", seed=3)
    cfg = SamplingConfig(temperature=1.5, top_k=40)
    prompt = random_prompt(6, 11)
    want3, want2 = exact_third_token(model, prompt, cfg)
    draft = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std())
    head = make_head(model, scale=20.0) if drafter_name == "merged" else None
    if drafter_name == "eagle_sampled":  # a broad q, so that which draws a tree keeps matters
        head = make_head(model, scale=3.0)
    counts2, counts3 = torch.zeros(VOCAB), torch.zeros(VOCAB)
    accepted = 0
    for i in range(1500):
        if drafter_name == "draft_model":
            drafter = DraftModelDrafter(draft, gamma=2)
        elif drafter_name == "eagle_sampled":  # children drawn from the head's q, kept in draw order
            drafter = EagleDrafter(head, depth=2, top_k=4, total_tokens=5, sample=True)
        elif drafter_name == "merged":  # an EAGLE tree and prompt lookup (1-grams) in one tree
            drafter = MergedDrafter([EagleDrafter(head, depth=2, top_k=8, total_tokens=12), PromptLookupDrafter(min_ngram=1)])
        else:
            drafter = layer_skip_drafter(model, layers=3, gamma=2)
        out = generate(model, prompt, drafter, GenerationConfig(max_new_tokens=3, sampling=cfg, seed=i))
        counts2[out.tokens[1]] += 1
        counts3[out.tokens[2]] += 1
        accepted += out.stats.accepted
    assert accepted > 50, f"the drafter must get tokens accepted for this test to mean anything ({accepted})"
    for name, counts, want in [("x2", counts2, want2), ("x3", counts3, want3)]:
        pval = chi2_pvalue(counts, want)
        assert pval > P_MIN, f"{drafter_name}: {name} marginal differs from the target's (chi2 p={pval:.2e})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_is_the_first_maximum_like_torch(dtype):
    """The widened argmax picks exactly what ``argmax(-1)`` picks: ties go to the first index, a NaN wins,
    -inf rows pick 0, and any leading shape works."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 4, 1000, generator=g) * 8).to(dtype)
    x[0, 0, 17] = x[0, 0, 900] = 1000  # tie
    x[0, 1, 5] = float("nan")
    x[0, 2] = float("-inf")
    x[1, 0, :] = 3  # all equal
    x[2, 3] = torch.arange(1000, dtype=torch.float32).to(dtype)  # bf16 rounding makes the top values tie
    want = x.argmax(-1)
    got = argmax(x)
    assert got.dtype == torch.int64 and got.shape == (3, 4)
    assert torch.equal(got, want)
    assert (int(got[0, 0]), int(got[0, 1]), int(got[0, 2]), int(got[1, 0])) == (17, 5, 0, 0)
    assert torch.equal(argmax(x[1, 1]), x[1, 1].argmax(-1))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 23, 1000, 4099])
def test_bf16_argmax_kernel_is_torch_argmax(n, monkeypatch):
    """Guards the one-pass bf16 argmax kernel (and :func:`argmax` routing bf16 rows to it): on rows full
    of ties (few distinct values, so the maximum repeats across the eight lanes and the tail), NaN in the
    vectorised part or only in the tail, all -inf, +-0 and +inf rows, it answers torch's argmax over the
    widened row; bad input is refused."""
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(n)
    rows = [torch.randint(-3, 4, (n,), generator=g).float() for _ in range(40)]  # many ties
    rows += [torch.randn(n, generator=g) * 100 for _ in range(20)]
    rows.append(torch.full((n,), float("-inf")))
    rows.append(torch.tensor([-0.0, 0.0] * n)[:n])
    for at in {0, n // 2, n - 1, n - (n % 8 or 8), min(n - 1, 8 * (n // 8))}:  # NaN / +inf / late maximum
        for value in (float("nan"), float("inf")):
            r = torch.randint(-3, 4, (n,), generator=g).float()
            r[at] = value
            rows.append(r)
        r = torch.full((n,), -5.0)
        r[at:] = 7.0  # the maximum first appears at `at`, then repeats in every later lane
        rows.append(r)
    x = torch.stack(rows).bfloat16()
    want = x.float().argmax(-1)
    got = kernel.bf16_argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got - want).nonzero()
    for bad in (x.float(), x[:, ::2] if n > 1 else x[None], x[:, :0]):
        with pytest.raises(RuntimeError, match="bf16_argmax"):
            kernel.bf16_argmax(bad)
    calls = []
    real = kernel.bf16_argmax
    monkeypatch.setattr(kernel, "bf16_argmax", lambda t: calls.append(tuple(t.shape)) or real(t))
    assert torch.equal(argmax(x[None]), want[None]) and calls == [tuple(x.shape)]  # bf16 rows take it
