"""Where the benchmarks (`shoal bench ...`) put their figures: one JSON file each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_figures(figures: Any, output: str | Path) -> Path:
    """Write `figures` (what `json.dumps` takes) as indented JSON to `output`, creating its
    folder; returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2))
    return out
