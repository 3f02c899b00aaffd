"""Target features for head training: computed online from the frozen target, or stored offline on disk.

A head's loss needs, per token, some of the target's hidden states (index -1 = the final normed state;
EAGLE-3 also its low/mid/high layer inputs) and the target's logits, which are ``lm_head(h[-1])``. Both
paths produce the same ``{index: (batch, seq, hidden)}`` dict and the logits are recomputed from the
last state by the target's lm_head in both, so a head trains the same either way.

Offline layout (a folder): ``shard-00000.safetensors`` ... each holding ``{i}.input_ids``,
``{i}.loss_mask`` and ``{i}.h{index}`` (seq, hidden) for its samples, and ``manifest.json`` (indices,
dtype, samples per shard, target info), rewritten after each completed shard so an interrupted dump
resumes at the first missing shard, and a dump of data that has grown (replies appended) keeps its
complete shards and writes only the rest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from selfdraft.data import TokenizedSample
from selfdraft.heads.artifact import write_text_atomic
from selfdraft.kernels import matmul_mode

MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.no_grad()
def target_features(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, indices: Iterable[int]) -> dict[int, Tensor]:
    """{index: (batch, seq, hidden)} hidden states of the frozen target (-1 = final normed state).

    A bf16 target's products run in fp32 where bf16 ones are slow (CPUs without native bf16): the
    same route for online training and for a feature dump, so both store the same features."""
    indices = sorted(set(indices) | {-1})
    with matmul_mode(next(model.parameters()).dtype, input_ids.device, input_ids.numel()):
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=indices, logits_to_keep=1)
    return {i: out.hidden_states[i] for i in indices}


def estimate_bytes(samples: list[TokenizedSample], hidden_size: int, num_states: int, dtype: str) -> int:
    """Disk size of a dump: tokens x states x hidden x element size, plus ids and masks."""
    tokens = sum(len(s.input_ids) for s in samples)
    return tokens * (num_states * hidden_size * DTYPES[dtype].itemsize + 16)


def write_features(
    folder: str | Path,
    model: nn.Module,
    samples: list[TokenizedSample],
    indices: Iterable[int],
    target: dict,
    dtype: str = "bfloat16",
    per_shard: int = 64,
    batch_size: int = 4,
    pad_id: int = 0,
    progress=None,
) -> Path:
    """Write the features of ``samples`` (in order) as shards; resumes after the last complete shard
    (of the same samples, or of a prefix of them: see ``kept_shards``)."""
    from selfdraft.data import collate

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    indices = sorted(set(indices) | {-1})
    meta = {"indices": indices, "dtype": dtype, "per_shard": per_shard, "num_samples": len(samples),
            "target": target, "shards": []}
    manifest = folder / MANIFEST
    if manifest.is_file():
        meta["shards"] = kept_shards(folder, json.loads(manifest.read_text()), meta, samples)
    device = next(model.parameters()).device
    for shard, start in enumerate(range(0, len(samples), per_shard)):
        name = f"shard-{shard:05d}.safetensors"
        if name in meta["shards"]:
            if progress:
                progress.update(min(per_shard, len(samples) - start))
            continue
        tensors: dict[str, Tensor] = {}
        chunk = samples[start : start + per_shard]
        for b in range(0, len(chunk), batch_size):
            part = chunk[b : b + batch_size]
            batch = collate(part, pad_id)
            ids = batch["input_ids"].to(device)
            feats = target_features(model, ids, batch["attention_mask"].to(device), indices)
            for j, s in enumerate(part):
                key, n = start + b + j, len(s.input_ids)
                tensors[f"{key}.input_ids"] = torch.tensor(s.input_ids, dtype=torch.int64)
                tensors[f"{key}.loss_mask"] = torch.tensor(s.loss_mask, dtype=torch.int8)
                for i in indices:
                    tensors[f"{key}.h{i}"] = feats[i][j, :n].to(DTYPES[dtype]).cpu().contiguous()
            if progress:
                progress.update(len(part))
        tmp = folder / f".{name}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, folder / name)
        meta["shards"].append(name)
        write_text_atomic(manifest, json.dumps(meta, indent=2))
    return folder


def kept_shards(folder: Path, old: dict, meta: dict, samples: list[TokenizedSample]) -> list[str]:
    """The shards of an earlier dump in ``folder`` that ``samples`` can keep.

    The same samples (an interrupted dump) keep every complete shard; samples appended to the data
    (a grown distillation) keep the earlier shards and redo only the last partial one. Anything else
    (other samples, fewer of them, other states, dtype or target) is a different dump: refused, not
    overwritten. Checked on the stored token ids, not only the counts."""
    fixed = ("indices", "dtype", "per_shard", "target")
    if {k: old.get(k) for k in fixed} != {k: meta[k] for k in fixed} or old.get("num_samples", 0) > len(samples):
        raise ValueError(f"{folder} holds a different feature dump ({old.get('num_samples')} samples, "
                         f"indices {old.get('indices')}, dtype {old.get('dtype')}); use another features_dir or delete it")
    per, kept = meta["per_shard"], []
    for shard, name in enumerate(old.get("shards", [])):
        start = shard * per
        with safe_open(str(folder / name), framework="pt") as f:
            keys = sorted(int(k.split(".")[0]) for k in f.keys() if k.endswith(".input_ids"))
            if keys != list(range(start, start + len(keys))):
                raise ValueError(f"{folder / name} holds samples {keys[:3]}...; expected them from {start}: "
                                 "the dump is damaged, delete the folder and dump again")
            for i in keys:
                if f.get_tensor(f"{i}.input_ids").tolist() != samples[i].input_ids:
                    raise ValueError(f"{folder} holds a different feature dump (sample {i} has other tokens than "
                                     "the configured data); use another features_dir or delete it")
        if len(keys) == min(per, len(samples) - start):
            kept.append(name)
        else:  # the last partial shard of a smaller dump: rewritten with the appended samples
            break
    if old.get("num_samples") != len(samples):
        print(f"[features] {folder}: the data grew from {old.get('num_samples')} to {len(samples)} samples; "
              f"keeping {len(kept)} shards, writing the rest")
    return kept


class FeatureStore:
    """Reads a feature dump: samples in dump order and their stored hidden states."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        manifest = self.folder / MANIFEST
        if not manifest.is_file():
            raise FileNotFoundError(f"{self.folder} has no {MANIFEST}: write it with train/dump_features.py first")
        self.meta = json.loads(manifest.read_text())
        n, per = self.meta["num_samples"], self.meta["per_shard"]
        expected = -(-n // per)
        if len(self.meta["shards"]) != expected:
            raise ValueError(f"{self.folder}: the dump is incomplete ({len(self.meta['shards'])} of {expected} "
                             "shards); rerun train/dump_features.py with the same config to finish it")
        self.indices = [int(i) for i in self.meta["indices"]]
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return self.meta["num_samples"]

    def _shard(self, i: int):
        s = i // self.meta["per_shard"]
        if s not in self._open:
            self._open[s] = safe_open(str(self.folder / self.meta["shards"][s]), framework="pt")
        return self._open[s]

    def sample(self, i: int) -> TokenizedSample:
        f = self._shard(i)
        return TokenizedSample(f.get_tensor(f"{i}.input_ids").tolist(), f.get_tensor(f"{i}.loss_mask").tolist())

    def samples(self) -> list[TokenizedSample]:
        return [self.sample(i) for i in range(len(self))]

    def batch_features(self, ids: list[int], seq: int) -> dict[int, Tensor]:
        """{index: (len(ids), seq, hidden)} float32, zero-padded on the right to ``seq``."""
        out = {}
        for idx in self.indices:
            rows = [self._shard(i).get_tensor(f"{i}.h{idx}").float() for i in ids]
            t = torch.zeros(len(rows), seq, rows[0].shape[-1])
            for r, h in enumerate(rows):
                t[r, : h.shape[0]] = h
            out[idx] = t
        return out
