"""A CPU model's weights in transparent huge pages (Linux).

Decoding on a CPU is a stream over every weight per forward. With 4 KiB pages a SmolLM2-135M forward
touches ~66,000 pages (270 MB of bf16 weights, most matrices under 2 MiB and scattered over the
heap), far more than the CPU's TLB holds, so the stream keeps stopping for page walks. Laid out one
after another in memory advised for 2 MiB pages (``madvise(MADV_HUGEPAGE)``), the same weights need
~135 translations. On a 2-core AVX512-BF16 EPYC this made SmolLM2 forwards of 1-16 tokens 3-13%
faster in one process and plain decoding 15% faster (docs/perf_log.md, thirtieth session). PyTorch's own switch (``THP_MEM_ALLOC_ENABLE``) only
advises single allocations of 2 MiB and more, which most of a small model's matrices are not.

:func:`move_to_huge_pages` copies a model's CPU parameters into one such region, in the order the
model registers them (about the order a forward reads them), and points each parameter at its copy:
the same ``nn.Parameter`` objects (tied weights stay tied), bit-identical values, the old storage
freed. Each parameter keeps a storage of its own inside the region, so serialisers that refuse
tensors sharing a storage (safetensors) see what they saw before. Where the kernel has transparent
huge pages off (``never``), on other systems, or with ``SELFDRAFT_HUGE_PAGES=0`` nothing moves.
"""

from __future__ import annotations

import mmap
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

HUGE_PAGES_ENV = "SELFDRAFT_HUGE_PAGES"
HUGE_PAGE = 2 << 20
ALIGN = 64  # each parameter starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode ('always', 'madvise' or 'never'), None where unknown."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_apply() -> bool:
    """Whether :func:`move_to_huge_pages` moves anything here."""
    return (
        sys.platform.startswith("linux")
        and hasattr(mmap, "MADV_HUGEPAGE")
        and os.environ.get(HUGE_PAGES_ENV, "1") != "0"
        and thp_mode() in ("always", "madvise")
    )


def huge_page_region(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with ``nbytes`` from a 2 MiB boundary on, advised for huge pages;
    returns (mapping, offset of that boundary)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = -address % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, offset, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    return region, offset


def to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` in huge pages where they apply (for tensors kernels stream
    on every step, built outside a model's parameters); ``t`` itself elsewhere or when that fails."""
    if not huge_pages_apply() or t.device.type != "cpu" or t.numel() == 0:
        return t
    nbytes = t.numel() * t.element_size()
    try:
        region, base = huge_page_region(nbytes)
    except (OSError, ValueError):
        return t
    out = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=base).view(t.dtype).view(t.shape)
    return out.copy_(t)


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy ``model``'s CPU parameters into one region of huge pages (see the module docstring);
    returns the bytes moved (0 where huge pages do not apply or nothing is on the CPU). Parameters
    that view one storage keep viewing one (shared) copy of it. Call before the first forward: kernels
    that hold weight tensors (the lean forward's layer stack) keep whatever they were built with."""
    if not huge_pages_apply():
        return 0
    storages: dict[int, list[nn.Parameter]] = {}
    for p in model.parameters():  # each Parameter once, in registration order
        if p.device.type == "cpu" and p.numel():
            storages.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    if not storages:
        return 0
    sizes = [params[0].untyped_storage().nbytes() for params in storages.values()]
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // ALIGN) * ALIGN
    try:
        region, base = huge_page_region(total)
    except (OSError, ValueError) as err:  # out of address space or memory: keep the weights where they are
        warnings.warn(f"selfdraft: weights left in normal pages ({type(err).__name__}: {err})", stacklevel=2)
        return 0
    with torch.no_grad():
        for params, start, size in zip(storages.values(), starts, sizes):
            # a storage of its own at this offset (frombuffer keeps the mapping alive)
            storage = torch.frombuffer(region, dtype=torch.uint8, count=size, offset=base + start)
            storage.copy_(torch.empty(0, dtype=torch.uint8).set_(params[0].untyped_storage()))
            for p in params:
                p.data = storage.view(p.dtype).as_strided(p.shape, p.stride(), p.storage_offset())
    return total
