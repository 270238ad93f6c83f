"""tqdm progress bars for long work (conversion, weight upload, generation).

Bars go to stderr and only show on a terminal (tqdm's disable=None), so logs,
pipes and tests see nothing; DS4REF_PROGRESS=0 turns them off everywhere.
"""
from __future__ import annotations

import sys
from typing import Iterable, Optional

from .settings import getenv


def progress(iterable: Optional[Iterable] = None, desc: str = "", total: Optional[int] = None, unit: str = "it"):
    from tqdm import tqdm

    off = getenv("DS4REF_PROGRESS") == "0"
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False, mininterval=0.5,
                disable=True if off else None)
