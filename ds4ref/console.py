"""What the package's messages and command lines share: counts that read right, --help with
defaults, and tqdm progress bars for long work (conversion, weight upload, generation).

Bars go to stderr and only show on a terminal (tqdm's disable=None), so logs,
pipes and tests see nothing; DS4REF_PROGRESS=0 turns them off everywhere.
"""
from __future__ import annotations

import argparse
import sys
from typing import Iterable, Optional

from .settings import getenv


def plural(n: int, word: str) -> str:
    """'1 token', '2 tokens': counts in messages read right."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, unless its help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.required \
                or action.default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def progress(iterable: Optional[Iterable] = None, desc: str = "", total: Optional[int] = None, unit: str = "it"):
    from tqdm import tqdm

    off = getenv("DS4REF_PROGRESS") == "0"
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False, mininterval=0.5,
                disable=True if off else None)
