"""`ds4ref.load()`: a GGUF file (or the embedded tiny model) as a ready model."""
from __future__ import annotations

import os
from functools import cached_property
from typing import Sequence

import numpy as np

from .gguf.config import DS4Config
from .numerics.tables import Tables
from .reference.model import Model

BACKENDS = ("numpy", "hip")


class DS4Model:
    """What `ds4ref.load` returns: config, metadata, the reference math, backends."""

    def __init__(self, metadata: dict, weights, numerics: str = "official", backend: str = "numpy",
                 path: str | None = None, notes: Sequence[str] = (), mtp_weights=None,
                 dspark_weights=None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.metadata, self.path, self.backend_name = metadata, path, backend
        self.notes = list(notes)  # what the loader derived or skipped (gguf/file.effective_metadata)
        self.reference = Model(weights, numerics)
        self.config: DS4Config = self.reference.config
        self.numerics = numerics
        self.mtp = None  # the MTP block's reference (reference/mtp.py) when the model has one
        self.mtp_weights = None  # its MTPWeights (gguf.mtp) in the model's dtype: what HipBackend uploads
        if mtp_weights is not None:
            from .reference.mtp import MTP
            self.mtp = MTP(self.reference, mtp_weights)
            self.mtp_weights = self.mtp.weights
        self.dspark = None  # the DSpark draft's reference (reference/dspark.py): speculation drafts with it
        if dspark_weights is not None:
            from .reference.dspark import DSpark
            self.dspark = DSpark(self.reference, dspark_weights)
        self._device = None
        if backend == "hip":
            self._device = self.make_backend()  # fail at load, naming what is missing, not mid-request

    def describe(self) -> str:
        """One line for a load banner: layers, and anything the loader derived or skipped."""
        c = self.config
        base = f"{c.name}: {c.n_layer} layers, vocab {c.vocab_size}"
        return "; ".join([base, *self.notes])

    @property
    def weights(self):
        return self.reference.weights

    @cached_property
    def tables(self) -> Tables:
        """The tables derived from the config (RoPE frequencies, the indexer's Hadamard)."""
        return Tables.build(self.config, self.weights.dtype)

    @cached_property
    def tokenizer(self):
        from .gguf.tokenizer import Tokenizer
        return Tokenizer.from_gguf(self.metadata)

    def make_backend(self, name: str | None = None, max_pass_rows: int | None = None):
        """A fresh Backend (protocol in ds4ref.backend) for the engine to drive; max_pass_rows: its
        largest pass (None: PREFILL_ROWS)."""
        from .backend import PREFILL_ROWS
        name = name or self.backend_name
        rows = PREFILL_ROWS if max_pass_rows is None else max_pass_rows
        if name == "numpy":
            from .reference.numpy_backend import NumpyBackend
            return NumpyBackend(self.reference, rows, mtp=self.mtp, dspark=self.dspark)
        if name == "hip":
            from .hip.backend import HipBackend
            dspark = self.dspark.weights if self.dspark is not None else None
            if self._device is not None:  # weights are on the device already: share them
                d = self._device
                return HipBackend(self.config, self.weights, self.numerics, self.tables,
                                  runtime=d.rt, device_weights=d.w, prefill_rows=rows,
                                  mtp=self.mtp_weights, mtp_device_weights=d.mtp and d.mtp.w,
                                  dspark=dspark, dspark_device_weights=d.dspark and d.dspark.w)
            return HipBackend(self.config, self.weights, self.numerics, self.tables, prefill_rows=rows,
                              mtp=self.mtp_weights, dspark=dspark)
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")

    def score(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits (T, vocab)."""
        return self.reference.score(token_ids)

    def generate(self, token_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation on this model's backend; returns only the new tokens."""
        if self.backend_name == "numpy":
            return self.reference.generate(token_ids, max_new_tokens, stop_ids)
        from .scheduler.engine import Engine
        from .scheduler.request import Request
        return Engine(self, max_concurrency=1).run([Request(list(token_ids), max_new_tokens,
                                                            stop_ids=tuple(stop_ids), ignore_eos=True)])[0]


def load(path: str | os.PathLike | None = None, backend: str = "numpy", numerics: str = "official",
         dtype=np.float32, mtp: str | os.PathLike | None = None,
         dspark: str | os.PathLike | None = None) -> DS4Model:
    """Open a deepseek4 GGUF (None = the embedded tiny model) as a DS4Model. Its MTP block
    comes from `mtp`, a separate MTP GGUF (llama.cpp's MTP file or antirez's), or from the
    model file itself in ds4ref's former layout; the embedded model's ships beside it.
    `dspark`: a DSpark draft GGUF (llama.cpp's dflash file or antirez's DSpark support file);
    speculative decoding then drafts with it (gguf.dspark_file, reference/dspark.py); it must
    belong to this model (gguf.draft_target: a DeepSeek-V4-Flash-0731 model)."""
    from .gguf.file import open_gguf
    from .gguf.tiny import default_model_path
    path = str(path) if path is not None else str(default_model_path())
    return from_file(open_gguf(path), backend, numerics, dtype, mtp, dspark)


def from_file(model_file, backend: str = "numpy", numerics: str = "official", dtype=np.float32,
              mtp: str | os.PathLike | None = None, dspark: str | os.PathLike | None = None) -> DS4Model:
    """A DS4Model over an opened GGUFModelFile (the server opens it first to plan memory). Weights
    holding a NaN or an infinity are refused here, before any backend exists (gguf.finite)."""
    from .gguf.file import MTPFile
    from .gguf.mtp import MTPError, in_file_mtp, separate_mtp
    from .gguf.tiny import packaged_mtp
    model_file.check_finite()
    notes = list(model_file.notes)
    mtp_weights = in_file_mtp(model_file, dtype, notes)
    if mtp is None:
        mtp = packaged_mtp(model_file.path)
    if mtp is not None:
        MTPFile(mtp).check_finite()
        if model_file.mtp_block is not None:
            raise MTPError(f"{model_file.path} carries its own MTP block (block {model_file.mtp_block}); "
                           f"give no separate MTP file ({os.fspath(mtp)})")
        mtp_weights = separate_mtp(mtp, model_file.config, dtype, model_file)
        notes.append(f"MTP block from {os.fspath(mtp)}")
    dspark_weights = None
    if dspark is not None:
        from .gguf.dspark_file import load_dspark
        MTPFile(dspark).check_finite()
        dspark_weights = load_dspark(dspark, model_file, dtype)
        notes.append(f"DSpark draft from {os.fspath(dspark)}")
    return DS4Model(model_file.metadata, model_file.weights(dtype), numerics=numerics, backend=backend,
                    path=model_file.path, notes=notes, mtp_weights=mtp_weights, dspark_weights=dspark_weights)
