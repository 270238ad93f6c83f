"""One dump file a step: a GGUF file of named intermediates (docs/diff.md says why GGUF).

Keys: `ds4diff.version` (u32), `ds4diff.engine` (who wrote it), `ds4diff.numerics` (string array
of the arithmetic's traits, compare.TRAITS), `ds4diff.model` (the model file's name). Tensors:
`positions` and `tokens` (i32, one a row of the step), then the names of names.py, each with an
optional `{name}.pos` (i32) keying its rows when they are not the step's rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

VERSION = 1
ARCH = "ds4diff"


def write_step(path: str | os.PathLike, engine: str, numerics: list[str], model: str, positions, tokens,
               tensors: dict[str, tuple[np.ndarray, np.ndarray | None]]) -> None:
    """tensors: name -> (rows, keys or None); floats are written as f32 or f64, ids as i32."""
    w = gguf.GGUFWriter(str(path), arch=ARCH)
    w.add_uint32(f"{ARCH}.version", VERSION)
    w.add_string(f"{ARCH}.engine", engine)
    w.add_array(f"{ARCH}.numerics", list(numerics) or ["none"])
    w.add_string(f"{ARCH}.model", model)
    w.add_tensor("positions", np.asarray(positions, np.int32))
    w.add_tensor("tokens", np.asarray(tokens, np.int32))
    for name, (rows, keys) in tensors.items():
        rows = np.ascontiguousarray(rows)
        if rows.dtype.kind in "iub":
            rows = rows.astype(np.int32)
        elif rows.dtype not in (np.float32, np.float64):
            rows = rows.astype(np.float32)
        w.add_tensor(name, rows)
        if keys is not None:
            w.add_tensor(f"{name}.pos", np.asarray(keys, np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@dataclass
class Dump:
    """Every step of a dump folder, merged: name -> (keys, rows), keys ascending."""
    engine: str
    numerics: list[str]
    model: str
    tensors: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def keys(self) -> set[str]:
        return set(self.tensors)


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields.get(f"{ARCH}.{key}")
    return None if f is None else f.contents()


def read_dump(folder: str | os.PathLike) -> Dump:
    """All `*.gguf` steps of a folder, rows of one name gathered and sorted by key; a key seen
    twice keeps its last step's row (steps in file-name order)."""
    files = sorted(Path(folder).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no dump files (*.gguf) in {folder}")
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    dump = None
    for path in files:
        r = gguf.GGUFReader(str(path))
        if _field(r, "version") != VERSION:
            raise ValueError(f"{path}: not a ds4diff dump of version {VERSION}")
        if dump is None:
            numerics = [n for n in (_field(r, "numerics") or []) if n != "none"]  # optional: plain float32
            dump = Dump(_field(r, "engine") or path.parent.name, numerics, _field(r, "model") or "")
        arrays = {t.name: np.array(t.data) for t in r.tensors}
        positions = arrays.pop("positions").astype(np.int64)
        arrays.pop("tokens")
        for name, rows in arrays.items():
            if name.endswith(".pos"):
                continue
            keys = arrays[f"{name}.pos"].astype(np.int64) if f"{name}.pos" in arrays else positions
            if len(keys) != len(rows):
                raise ValueError(f"{path}: {name} has {len(rows)} rows for {len(keys)} keys")
            parts.setdefault(name, []).append((keys, rows))
    for name, got in parts.items():
        keys = np.concatenate([k for k, _ in got])
        rows = stack_rows([r for _, r in got])
        last = {int(k): i for i, k in enumerate(keys)}  # a key seen twice: its last row
        order = np.array([last[k] for k in sorted(last)], np.int64)
        dump.tensors[name] = (keys[order], rows[order])
    return dump


def stack_rows(parts: list[np.ndarray]) -> np.ndarray:
    """Rows of one name from several steps or calls; rows of scores grow with the position, and the
    shorter ones are padded with -inf (not visible)."""
    shape = max(p.shape[1:] for p in parts)
    return np.concatenate([_pad(p, shape) for p in parts])


def _pad(rows: np.ndarray, shape: tuple) -> np.ndarray:
    if rows.shape[1:] == shape:
        return rows
    out = np.full((len(rows),) + shape, -np.inf if rows.dtype.kind == "f" else -1, rows.dtype)
    out[(slice(None),) + tuple(slice(0, n) for n in rows.shape[1:])] = rows
    return out
