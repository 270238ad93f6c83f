"""ds4ref's side: the reference's intermediates for a prompt, through its tap (reference/tap.py),
one dump file a pass."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..gguf.file import open_gguf
from ..reference import tap
from ..reference.model import Model, check_tokens
from .dumpfile import stack_rows, write_step


class Pass:
    def __init__(self, positions, tokens, emitted):
        self.positions = np.asarray(positions, np.int64).copy()
        self.tokens = np.asarray(tokens, np.int64).copy()
        self.emitted = np.asarray(emitted, np.int64).copy()
        self.tensors: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def put(self, name: str, value, pos) -> None:
        value = np.array(value, copy=True)
        if pos is None:  # the pass's next rows of this name (the head's: the emitted rows)
            rows = self.emitted if name.startswith("output.") else self.positions
            done = sum(len(v) for v, _ in self.tensors.get(name, []))
            if done + len(value) > len(rows):
                raise RuntimeError(f"{name} recorded for more rows than the pass has ({done} + {len(value)})")
            pos = rows[done:done + len(value)]
        self.tensors.setdefault(name, []).append((value, np.asarray(pos, np.int64).reshape(-1).copy()))

    def rows(self) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
        out = {}
        for name, parts in self.tensors.items():
            keys = np.concatenate([p for _, p in parts])
            rows = stack_rows([v for v, _ in parts])
            same = len(keys) == len(self.positions) and np.array_equal(keys, self.positions)
            out[name] = (rows, None if same else keys)
        return out


class Recorder:
    """The tap's recorder: a Pass a pass of rows."""

    def __init__(self):
        self.passes: list[Pass] = []

    def begin(self, positions, tokens, emitted) -> None:
        self.passes.append(Pass(positions, tokens, emitted))

    def put(self, name: str, value, pos) -> None:
        if not self.passes:
            raise RuntimeError(f"{name} recorded outside a pass")
        self.passes[-1].put(name, value, pos)


def traits(numerics: str, dtype) -> list[str]:
    """ds4ref's arithmetic in compare.TRAITS' terms (official float32 quantises activations for its
    integer products, docs/exactness.md section 2a; float64 is plain NumPy over the floats)."""
    if np.dtype(dtype) != np.float32:
        return ["f64"] + (["fp8-kv", "fp4-indexer"] if numerics == "official" else [])
    return ["canonical"] + (["q8-act", "fp8-kv", "fp4-indexer"] if numerics == "official" else [])


def dump_reference(model_path: str | os.PathLike, tokens, out: str | os.PathLike, numerics: str = "official",
                   dtype=np.float32, pass_rows: int = 512, driver: str = "decode") -> list[Path]:
    """Feed `tokens` from position 0 through the reference and write one dump file a pass
    (driver "decode": Model.step_rows in passes of pass_rows; "prefill": the whole-sequence
    forward of prefill.py, float64 only). Returns the files written."""
    from ..reference.prefill import prefill_logits
    model = Model(open_gguf(model_path).weights(dtype), numerics)
    ids = check_tokens(model.config, tokens)
    rec, state = Recorder(), model.new_state()
    with tap.recording(rec):
        if driver == "prefill":
            prefill_logits(model.weights, model.tables, model.numerics, ids)
        else:
            for p in range(0, len(ids), pass_rows):
                chunk = ids[p:p + pass_rows]
                model.step_rows([state] * len(chunk), chunk, p + np.arange(len(chunk)))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("step-*.gguf"):
        old.unlink()
    files = []
    for i, ps in enumerate(rec.passes):
        files.append(out / f"step-{i:05d}.gguf")
        write_step(files[-1], f"ds4ref {driver}", traits(numerics, dtype), Path(model_path).name,
                   ps.positions, ps.tokens, ps.rows())
    return files
