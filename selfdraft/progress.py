"""Progress bars for the long steps of the command line (loading, benchmarking), on stderr.

One switch: ``enabled=False`` (``--quiet``) turns off these bars and the Hugging Face ones. The
training programs, which may run in processes started by ``accelerate launch``, read the same switch
from the environment (``SELFDRAFT_QUIET=1``, set by ``selfdraft train --quiet``) through :func:`quiet`.
"""

from __future__ import annotations

import os
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


QUIET_ENV = "SELFDRAFT_QUIET"


def quiet() -> bool:
    """True when the command line asked for no progress bars (``--quiet``), also in launched processes."""
    return os.environ.get(QUIET_ENV) == "1"
