"""Which DeepSeek-V4-Flash a file holds: the original release or the 0731 refresh.

0731's main model is the original architecture (spec §1); what differs is around it:

* its checkpoint's `compress_ratios` has an entry per DSpark draft stage after the layers'
  (43 + 3 zeros), where the original's has one for its MTP block (43 + 1); llama.cpp's
  converter writes the array whole, so its 0731 files say so in
  `deepseek4.attention.compress_ratios`;
* it has no NextN MTP head: `mtp.0..2` hold the DSpark draft (gguf.dspark);
* its chat template maps reasoning effort anew: `high` gives the text the original's `max`
  gave, and `max` a new one (serve.chat);
* llama.cpp's converter names it after the checkpoint (`general.name`, e.g.
  "DeepSeek V4 Flash 0731") and picks the 0731 template when the name says 0731.

`model_version(metadata)` reads these signs; any one of them makes a file 0731.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

ORIGINAL, V0731 = "original", "0731"
VERSIONS = (ORIGINAL, V0731)

DSPARK_STAGES = 3  # 0731's draft stages (mtp.0..2), each with a ratio-0 entry after the layers'

# Text only 0731's template carries: its new `max` instruction (both templates carry the
# original's `max` text, 0731's under `high`).
_TEMPLATE_0731 = "Reasoning Effort: Beyond maximum"
_TEMPLATE_ANY = "Reasoning Effort: Absolute maximum"
_NAME_0731 = re.compile(r"(?<![0-9])0731(?![0-9])")


def template_version(template: Any) -> str | None:
    """The version whose chat template `template` is (its effort instructions), else None:
    a template that says nothing about reasoning effort is neither."""
    if not isinstance(template, str):
        return None
    if _TEMPLATE_0731 in template:
        return V0731
    if _TEMPLATE_ANY in template:
        return ORIGINAL
    return None


def version_signs(meta: Mapping[str, Any], arch: str = "deepseek4") -> list[str]:
    """Why a file's metadata says 0731 (empty: the original)."""
    signs = []
    ratios, blocks = meta.get(f"{arch}.attention.compress_ratios"), meta.get(f"{arch}.block_count")
    nextn = meta.get(f"{arch}.nextn_predict_layers", 0) or 0
    # the layers' entries then the stages': llama.cpp's files count the layers in block_count;
    # antirez's say nextn_predict_layers = 1 with no MTP block in the file, so both counts are read
    if isinstance(ratios, list) and isinstance(blocks, int) and len(ratios) - DSPARK_STAGES in (blocks, blocks - nextn):
        signs.append(f"{arch}.attention.compress_ratios has {len(ratios)} entries for {blocks} blocks "
                     f"(+{DSPARK_STAGES} DSpark stages)")
    if any(k.startswith(f"{arch}.dspark.") for k in meta):
        signs.append(f"{arch}.dspark.* keys")
    if template_version(meta.get("tokenizer.chat_template")) == V0731:
        signs.append("tokenizer.chat_template is 0731's")
    name = meta.get("general.name")
    if isinstance(name, str) and _NAME_0731.search(name):
        signs.append(f"general.name {name!r}")
    return signs


def model_version(meta: Mapping[str, Any], arch: str = "deepseek4") -> str:
    """ORIGINAL or V0731 (module docstring)."""
    return V0731 if version_signs(meta, arch) else ORIGINAL


def chat_version(meta: Mapping[str, Any], arch: str = "deepseek4") -> str:
    """The version whose chat rules a model's prompts follow: those of the template the file
    carries, when it is one of the two, else the model's version."""
    return template_version(meta.get("tokenizer.chat_template")) or model_version(meta, arch)
