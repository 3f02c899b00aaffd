"""CPU weights moved into one huge-page region (a target's, a loaded head's own): same parameters, same values, same ties."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import tiny_model
from torch import nn

from selfdraft import hugepages
from selfdraft.hugepages import ALIGN, HUGE_PAGE, move_to_huge_pages
from selfdraft.target import load_target

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")


@pytest.fixture
def huge_pages_on(monkeypatch):
    """Run the move whatever this kernel's THP setting (madvise is accepted either way)."""
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    monkeypatch.delenv(hugepages.HUGE_PAGES_ENV, raising=False)


def laid_out_in_one_region(params: list[nn.Parameter]) -> bool:
    """Each parameter in its own storage, one after another from a 2 MiB boundary, cache-line aligned."""
    ptrs = [p.untyped_storage().data_ptr() for p in params]
    if ptrs[0] % HUGE_PAGE:
        return False
    for p, ptr, nxt in zip(params, ptrs, ptrs[1:]):
        if nxt != ptr + -(-p.untyped_storage().nbytes() // ALIGN) * ALIGN:
            return False
    return True


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_moved_weights_keep_the_parameters_values_and_ties(arch, huge_pages_on):
    model = tiny_model(arch, dtype=torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    ids = torch.tensor([[1, 5, 9, 20, 3]])
    want = model(ids).logits
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    moved = move_to_huge_pages(model)
    assert moved >= sum(p.numel() * p.element_size() for p in params)
    assert list(model.parameters()) == params  # the same Parameter objects, each still once
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert laid_out_in_one_region(params)
    assert torch.equal(model(ids).logits, want)


def test_parameters_viewing_one_storage_still_share_it(huge_pages_on):
    base = nn.Parameter(torch.arange(40, dtype=torch.float32).view(8, 5), requires_grad=False)
    module = nn.Module()
    module.a = base
    module.b = nn.Parameter(base.data[2:5, 1:], requires_grad=False)  # a strided view of a's storage
    move_to_huge_pages(module)
    assert module.b.untyped_storage().data_ptr() == module.a.untyped_storage().data_ptr()
    assert torch.equal(module.b, torch.arange(40, dtype=torch.float32).view(8, 5)[2:5, 1:])
    module.a.data[3, 2] = -1.0  # still one copy
    assert module.b[1, 1] == -1.0


def test_nothing_moves_when_switched_off_or_without_huge_pages(monkeypatch):
    model = tiny_model("llama")
    ptrs = [p.data_ptr() for p in model.parameters()]
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    monkeypatch.setenv(hugepages.HUGE_PAGES_ENV, "0")
    assert move_to_huge_pages(model) == 0
    monkeypatch.delenv(hugepages.HUGE_PAGES_ENV)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    assert move_to_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_load_target_moves_a_cpu_target(tiny_target_dir, huge_pages_on):
    target = load_target(str(tiny_target_dir), dtype="bfloat16")
    assert laid_out_in_one_region(list(target.model.parameters()))


def test_load_head_moves_the_heads_own_weights_only(tmp_path, huge_pages_on):
    """The head's weights join huge pages; the target's embedding it references stays where it was."""
    from selfdraft.heads import Eagle3Config, Eagle3Head, load_head, save
    from selfdraft.heads.eagle3 import select_draft_vocab

    model = tiny_model("llama")
    head = Eagle3Head(Eagle3Config.for_target(model, 64), model.get_input_embeddings())
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    head.set_draft_vocab(select_draft_vocab(torch.arange(model.config.vocab_size).flip(0).float(), 64))
    path = save(tmp_path / "e3", "eagle3", head.cfg, head, model, "tiny")
    target_ptrs = [p.data_ptr() for p in model.parameters()]
    _, loaded, _ = load_head(path, model)
    assert laid_out_in_one_region(list(loaded.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values()))
    assert [p.data_ptr() for p in model.parameters()] == target_ptrs
