"""What every `python -m ds4ref.*` command line shares."""
from __future__ import annotations

import argparse


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
