"""load_target: specs resolve or fail with a message that says what to do."""

from __future__ import annotations

import pytest
import torch

from selfdraft.target import TargetNotFoundError, load_target, resolve


def test_missing_inputs_say_what_to_do(tmp_path):
    """Guards against opaque hub errors for local typos."""
    with pytest.raises(TargetNotFoundError, match="GGUF file not found"):
        resolve(str(tmp_path / "x.gguf"))
    with pytest.raises(TargetNotFoundError, match="no config.json"):
        resolve(str(tmp_path))
    with pytest.raises(TargetNotFoundError, match="alias"):
        resolve("./nope")


def test_local_folder_loads_frozen(tiny_target_dir):
    """Guards the frozen-target contract: eval mode, no gradients, EOS ids collected."""
    target = load_target(str(tiny_target_dir), dtype="float32")
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    assert 2 in target.eos_token_ids
    ids = target.encode_chat("hi")
    assert ids[0] == 1 and len(ids) == 5, ids
    assert target.model.dtype == torch.float32
