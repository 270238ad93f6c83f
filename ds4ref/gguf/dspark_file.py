"""Reading and writing DeepSeek-V4-Flash-0731's DSpark draft (docs/mtp.md "Files and names").

`load_dspark` reads llama.cpp's `dflash` GGUF (its converter's `--dspark`, read by its `dflash`
loader) or antirez/ds4's DSpark support file (either of its key sets, gguf.dspark), after
gguf.draft_target has checked the draft against the model file it drafts for, and gives the
tensors under our `mtp.S.*` names. `write_dflash_gguf` writes llama.cpp's layout: the draft
alone, metadata under `dflash.` (the target's sizes as `deepseek4.*` would give them for a model
of the draft's stages, then block_size, target_layers as official ids + 1, the noise token as
`tokenizer.ggml.mask_token_id`), the target's tokenizer, and the target's fingerprint
(gguf.draft_target) so a reader can tell the draft's model from another.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from .config import ARCH, DS4Config
from .dspark import (DFLASH_ARCH, INLINE, LAYOUTS, DSparkConfig, DSparkError, dflash_name, dspark_tensor_shapes,
                     stage_config)
from .weights import RenamedWeights, check_shapes

SHEXP = "swiglu_clamp_shexp"


class DSparkWeights(RenamedWeights):
    """The draft's tensors under our `mtp.S.*` names, read from a source that holds them under
    other names (`names`: ours -> the source's). `config` is the stages' (gguf.dspark.stage_config),
    `dspark` the draft's own settings."""

    def __init__(self, stages: DS4Config, dspark: DSparkConfig, source, names: Mapping[str, str],
                 dtype=np.float32, where: str = "DSpark") -> None:
        super().__init__(stages, dspark_tensor_shapes(stages, dspark), source, names, dtype, where)
        self.dspark = dspark

    def with_dtype(self, dtype) -> "DSparkWeights":
        return DSparkWeights(self.config, self.dspark, self.source, self.names, dtype, self.where)


def load_dspark(path: str | os.PathLike, model_file, dtype=np.float32) -> DSparkWeights:
    """The DSpark draft of the GGUF at `path` for the model of `model_file` (an opened
    GGUFModelFile): refused, naming both files, when it belongs to another model."""
    from .draft_target import DSPARK, DraftTargetError, check_draft_target, draft_kind
    from .file import MTPFile, check_float_types
    f = MTPFile(path)
    meta, where, arch = f.metadata, f.path, f.metadata.get("general.architecture")
    if draft_kind(meta, f.tensors) != DSPARK:
        raise DSparkError(f"{where}: not a DSpark GGUF: general.architecture is {arch!r}, expected one of "
                          + ", ".join(f"{a!r} ({what})" for a, what in LAYOUTS.items())
                          + f", or {INLINE}* keys")
    found = {n: t.shape for n, t in f.tensors.items()}
    try:
        dcfg = DSparkConfig.from_metadata(meta, found)
    except DSparkError as exc:
        raise DSparkError(f"{where}: {exc}") from None
    try:
        check_draft_target(meta, where, model_file, f, kind=DSPARK)
    except DraftTargetError as exc:
        raise DSparkError(str(exc)) from None
    cfg, clamp = model_file.config, None
    want = dspark_tensor_shapes(cfg, dcfg)
    if arch == DFLASH_ARCH:
        ratios = meta.get(f"{DFLASH_ARCH}.attention.compress_ratios", [0])
        if any(int(r) != 0 for r in ratios):
            raise DSparkError(f"{where}: DSpark stages have compress ratio 0, the file says {list(ratios)}")
        clamps = meta.get(f"{DFLASH_ARCH}.swiglu_clamp_exp", [])
        clamp = clamps[0] if len(clamps) else None
        names = {ours: dflash_name(ours, dcfg) for ours in want}
    else:
        names = {ours: ours for ours in want}
    check_shapes({names[ours]: shape for ours, shape in want.items()}, found, where, DSparkError, "DSpark tensor")
    check_float_types(f, names, where, "DSpark", DSparkError)
    return DSparkWeights(stage_config(cfg, dcfg, clamp), dcfg, f, names, dtype, where)


def dflash_metadata(cfg: DS4Config, dcfg: DSparkConfig) -> dict:
    """The dflash file's metadata for a draft of `dcfg` drafting for a model of `cfg`."""
    stages = stage_config(cfg, dcfg)
    meta = {}
    for key, value in stages.to_metadata().items():
        meta[DFLASH_ARCH + key[len(ARCH):] if key.startswith(ARCH + ".") else key] = value
    meta["general.architecture"] = DFLASH_ARCH
    meta[f"{DFLASH_ARCH}.{SHEXP}"] = list(stages.swiglu_clamp)
    meta.update(dcfg.dflash_metadata())
    return meta


def write_dflash_gguf(path: str | os.PathLike, cfg: DS4Config, dcfg: DSparkConfig, tensors: Mapping[str, Any],
                      tokenizer_meta: Mapping[str, Any] | None = None, dtypes: Mapping[str, str] | None = None,
                      default_dtype: str = "f32", extra_meta: Mapping[str, Any] | None = None,
                      target_fingerprint: str | None = None) -> None:
    """Write the draft's tensors (our `mtp.S.*` names, NumPy shapes of dspark_tensor_shapes;
    `dtypes` by the same names) as llama.cpp's dflash file."""
    from .draft_target import TARGET_FINGERPRINT
    from .file import write_tensor_file
    want = dspark_tensor_shapes(cfg, dcfg)
    check_shapes(want, {n: t.shape for n, t in tensors.items()}, "write_dflash_gguf", DSparkError,
                 whose="the draft's")
    # the draft's own keys last: its noise token is the mask token whatever the tokenizer's keys say
    meta = {**dflash_metadata(cfg, dcfg), **(tokenizer_meta or {}), **(extra_meta or {}), **dcfg.dflash_metadata()}
    if target_fingerprint is not None:
        meta[TARGET_FINGERPRINT] = target_fingerprint
    out = {dflash_name(n, dcfg): tensors[n] for n in want}
    stored = {dflash_name(n, dcfg): t for n, t in (dtypes or {}).items()}
    write_tensor_file(path, meta, out, stored, default_dtype, arch=DFLASH_ARCH)
