"""Does a draft file belong to its target model? An MTP file (llama.cpp's or antirez's) or a
DSpark draft (llama.cpp's `dflash` GGUF, antirez/ds4's support file) is checked against the
model file it would draft for, before any of its tensors is read:

* the sizes both describe (embedding width, heads, experts, hyper-connections, ...);
* the version (gguf.version): 0731 has no NextN MTP head, so an MTP file drafts only for the
  original; a DSpark draft only for 0731, reading target layers the model has;
* the target's own tensors the draft file shows: llama.cpp's MTP file carries a copy of the
  model's `output_norm`, and ds4ref's DSpark files record the target's fingerprint
  (TARGET_FINGERPRINT: a hash of the target's output_norm values); either must be the model's.

Every refusal is a DraftTargetError naming both files and what differs.
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping

import numpy as np

from .config import ARCH
from .dspark import DSPARK_ARCHS, INLINE, DSparkConfig, DSparkError
from .version import ORIGINAL, V0731, model_version, version_signs

MTP, DSPARK = "MTP", "DSpark"
TARGET_FINGERPRINT = "ds4ref.target.fingerprint"
FINGERPRINT_TENSOR = "output_norm.weight"
# sizes a draft shares with its target (key after `<arch>.`)
SIZE_KEYS = ("embedding_length", "vocab_size", "attention.head_count", "attention.key_length",
             "attention.q_lora_rank", "attention.output_lora_rank", "attention.output_group_count",
             "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_count",
             "hyper_connection.count", "rope.dimension_count")


class DraftTargetError(ValueError):
    """A draft file that belongs to another model."""


def fingerprint(values: np.ndarray) -> str:
    """The target's fingerprint: sha256 of its output_norm as little-endian float32 values
    (norms are stored as F32 by every converter, so the hash does not depend on --dtype)."""
    return hashlib.sha256(np.ascontiguousarray(values, "<f4").tobytes()).hexdigest()


def target_fingerprint(model_file) -> str:
    return fingerprint(model_file.read(FINGERPRINT_TENSOR))


def draft_kind(meta: Mapping[str, Any], tensor_names) -> str:
    """DSPARK for a dflash or DSpark support file, or one with `mtp.S.main_proj` /
    `deepseek4.dspark.*`; else MTP."""
    if meta.get("general.architecture") in DSPARK_ARCHS or any(k.startswith(INLINE) for k in meta):
        return DSPARK
    return DSPARK if any(n.endswith(".main_proj.weight") for n in tensor_names) else MTP


def size_difference(draft_meta: Mapping[str, Any], cfg) -> str | None:
    """The first size (SIZE_KEYS) the draft's metadata gives otherwise than a model of config
    `cfg`, said as a refusal; None when all it gives agree."""
    arch = draft_meta.get("general.architecture", ARCH)
    mine = cfg.to_metadata()
    for key in SIZE_KEYS:
        theirs, ours = draft_meta.get(f"{arch}.{key}"), mine.get(f"{ARCH}.{key}")
        if theirs is not None and ours is not None and theirs != ours:
            return f"its {arch}.{key} is {theirs}, the model's {ARCH}.{key} is {ours}"
    return None


def check_draft_target(draft_meta: Mapping[str, Any], draft_path, model_file, draft_tensors=None,
                       kind: str | None = None) -> None:
    """Raise DraftTargetError when the draft (its metadata, file path and, if given, its tensor
    directory: an object with `.tensors` and `.read`) does not belong to `model_file`."""
    tensors = getattr(draft_tensors, "tensors", None) or {}
    kind = kind or draft_kind(draft_meta, tensors)
    target, cfg = model_file.path, model_file.config
    where = f"{kind} draft {draft_path} belongs to another model than {target}"

    def refuse(what: str) -> None:
        raise DraftTargetError(f"{where}: {what}")

    other_size = size_difference(draft_meta, cfg)
    if other_size is not None:
        refuse(other_size)

    if kind == MTP:
        draft_version = model_version(draft_meta)
        if cfg.version != ORIGINAL:
            refuse(f"the model is DeepSeek-V4-Flash-{cfg.version} ({'; '.join(version_signs(model_file.metadata))}), "
                   f"which has no NextN MTP head: its draft is the DSpark draft (a dflash GGUF)")
        if draft_version != ORIGINAL:
            refuse(f"the draft says it is {draft_version} ({'; '.join(version_signs(draft_meta))}), "
                   f"the model is the original")
    else:
        if cfg.version != V0731:
            refuse(f"a DSpark draft drafts for DeepSeek-V4-Flash-0731; the model is the {cfg.version} release "
                   f"(none of 0731's signs: compress_ratios with 3 DSpark entries, 0731's chat template, "
                   f"'0731' in general.name)")
        try:
            dcfg = DSparkConfig.from_metadata(draft_meta, {n: t.shape for n, t in tensors.items()})
        except DSparkError as exc:
            refuse(str(exc))
        beyond = [i for i in dcfg.target_layers if i >= cfg.n_layer]
        if beyond:
            refuse(f"it reads the hidden states after target layers {list(dcfg.target_layers)}, "
                   f"the model has {cfg.n_layer} layers")
        if dcfg.noise_token_id >= cfg.vocab_size:
            refuse(f"its noise token {dcfg.noise_token_id} is outside the model's vocabulary of {cfg.vocab_size}")

    recorded = draft_meta.get(TARGET_FINGERPRINT)
    copy = tensors.get(FINGERPRINT_TENSOR) if kind == MTP else None
    if recorded is not None or copy is not None:
        ours = target_fingerprint(model_file)
        if recorded is not None and recorded != ours:
            refuse(f"it records its target's fingerprint {TARGET_FINGERPRINT} = {recorded[:16]}..., the model's "
                   f"is {ours[:16]}... (a hash of {FINGERPRINT_TENSOR})")
        if copy is not None and fingerprint(draft_tensors.read(FINGERPRINT_TENSOR)) != ours:
            refuse(f"its copy of the model's {FINGERPRINT_TENSOR!r} holds other values than the model's")

