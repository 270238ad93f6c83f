"""Writing DeepSeek-V4-Flash-0731's DSpark draft as llama.cpp's `dflash` GGUF (its converter's
`--dspark`, read by its `dflash` loader, src/models/dflash.cpp). docs/gguf.md "The DSpark draft".

The file holds the draft alone, by the names of gguf.dflash_names, and metadata under `dflash.`:
the target's sizes as `deepseek4.*` would give them for a model of the draft's stages
(block_count = stages, compress_ratios all 0, no hash layers, swiglu_clamp_exp and _shexp one
per stage), then block_size, target_layers (official ids + 1) and the noise token as
`tokenizer.ggml.mask_token_id`, beside the target's tokenizer. ds4ref adds the target's
fingerprint (gguf.draft_target) so a reader can tell the draft's model from another.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from .config import ARCH, DS4Config
from .dflash_names import DFLASH_ARCH, DSparkConfig, DSparkError, dflash_name, dspark_tensor_shapes
from .version import ORIGINAL

SHEXP = "swiglu_clamp_shexp"


def dflash_metadata(cfg: DS4Config, dcfg: DSparkConfig) -> dict:
    """The dflash file's metadata for a draft of `dcfg` drafting for a model of `cfg`."""
    n = dcfg.n_stages
    stages = dataclasses.replace(cfg, n_layer=n, compress_ratios=(0,) * n, swiglu_clamp=(cfg.swiglu_clamp[-1],) * n,
                                 n_hash_layers=0, version=ORIGINAL, extra={})
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
    for name, shape in want.items():
        if name not in tensors:
            raise DSparkError(f"write_dflash_gguf: missing tensor {name!r} (expected NumPy shape {shape})")
        if tuple(tensors[name].shape) != tuple(shape):
            raise DSparkError(f"write_dflash_gguf: tensor {name!r} has NumPy shape {tuple(tensors[name].shape)}, "
                              f"expected {tuple(shape)}")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise DSparkError(f"write_dflash_gguf: tensors that are not the draft's: {extra}")
    meta = dflash_metadata(cfg, dcfg)
    meta.update(tokenizer_meta or {})
    meta.update(extra_meta or {})
    meta.update(dcfg.dflash_metadata())
    if target_fingerprint is not None:
        meta[TARGET_FINGERPRINT] = target_fingerprint
    out = {dflash_name(n, dcfg): tensors[n] for n in want}
    stored = {dflash_name(n, dcfg): t for n, t in (dtypes or {}).items()}
    write_tensor_file(path, meta, out, stored, default_dtype, arch=DFLASH_ARCH)
