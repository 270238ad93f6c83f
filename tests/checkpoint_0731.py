"""A small DeepSeek-V4-Flash-0731 checkpoint in the official layout, for the converters' tests:
config.json as 0731's (compress_ratios with the three DSpark stages' zeros, num_nextn_predict_layers
still 1, the dspark_* keys), the main model's tensors, and the DSpark draft as `mtp.0..2` (FP4
routed experts, as llama.cpp's converter requires; F32 the rest), with the tiny tokenizer."""
from __future__ import annotations

from ds4ref.convert.hf import config_to_hf, official_dspark_tensors, to_checkpoint_tensors
from ds4ref.gguf.tiny import random_dspark, random_tensors, tiny_0731_config, tiny_dspark

CFG = tiny_0731_config(n_layer=4, swiglu_clamp=[2.0] * 4)  # a checkpoint's config has one swiglu_limit
DSPARK = tiny_dspark(CFG)


def checkpoint_0731(path, cfg=CFG, dcfg=DSPARK, seed: int = 0):
    """Write the checkpoint to `path` (a new folder); returns (path, the draft's tensors by our names)."""
    from test_llama_cpp_convert import official_checkpoint
    config = config_to_hf(cfg, "legacy")
    config.update(num_nextn_predict_layers=1, compress_ratios=[*cfg.compress_ratios, 0, 0, 0], **dcfg.to_hf())
    draft, _ = random_dspark(cfg, dcfg, seed)
    tensors = {**to_checkpoint_tensors(cfg, random_tensors(cfg, seed), names="official"),
               **official_dspark_tensors(cfg, dcfg, draft)}
    return official_checkpoint(path, config, tensors), draft
