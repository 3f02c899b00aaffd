"""Progress bars for the long steps of the command line (loading, benchmarking), on stderr.

One switch: ``enabled=False`` (``--quiet``) turns off these bars and the Hugging Face ones.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: int, desc: str, enabled: bool = True, unit: str = "it", leave: bool = False) -> tqdm:
    """A tqdm bar on stderr; a no-op object with the same methods when disabled."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled, leave=leave,
                dynamic_ncols=True)


def quiet_libraries() -> None:
    """Silence the progress bars and warnings that transformers prints while loading a model."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
