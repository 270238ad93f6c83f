"""A tap on the reference's named intermediates, for `python -m ds4ref.diff dump`.

Off (the default) every call is one test of a module global and returns: nothing is copied,
computed or stored, and the model's arithmetic never reads the tap, so no bit changes either
way. On (`with recording(r):`), r.begin(positions, tokens, emitted) opens each pass of rows and
r.put(name, value, pos) takes a copy of each intermediate; ds4ref/diff/recorder.py is the
recorder and docs/diff.md names what is recorded. One recording at a time per process.
"""
from __future__ import annotations

from contextlib import contextmanager

_recorder = None


@contextmanager
def recording(recorder):
    global _recorder
    if _recorder is not None:
        raise RuntimeError("a recording is already running in this process")
    _recorder = recorder
    try:
        yield recorder
    finally:
        _recorder = None


def on() -> bool:
    """Is a recording running? Guards what is computed only to be recorded."""
    return _recorder is not None


def begin(positions, tokens, emitted) -> None:
    """A pass of rows starts: row i is tokens[i] at positions[i]; the head runs on the rows at
    `emitted`."""
    if _recorder is not None:
        _recorder.begin(positions, tokens, emitted)


def put(prefix: str, name: str, value, pos=None) -> None:
    """Record `prefix + name` (prefix: a layer's "blk.{il}.", or "output."). pos: the key of each
    row of value (query positions, or a compressed row's window start); None: the pass's next
    rows, in order (a piece computed row by row is put once a row)."""
    if _recorder is not None:
        _recorder.put(prefix + name, value, pos)
