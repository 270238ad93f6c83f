"""What every `python -m ds4ref.*` command line shares."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, unless its help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.required \
                or action.default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)
