"""Random Flash-shaped models made on the device, for the GPU benchmarks (decode, prompts,
prefix cache, speculation): the 8-layer bf16 model, or Flash's 43 layers in the q2 policy.
The weights never exist on the host; beside them, a namespace of the rest HipBackend is built
from (config, numerics, tables; weights None)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from ..gguf import tiny
from ..numerics.tables import Tables


def flash_config(n_layer: int = 8, n_expert: int = 256, context_length: int = 65536):
    return tiny.flash_config(n_layer, n_expert=n_expert, context_length=context_length,
                             name=f"flash-shaped-{n_layer}L")


def make_mtp(rt, cfg, dw):
    """(MTP stand-in, its device weights): a random MTP block beside make_model(full=True)'s
    model, in the same policy (the stand-in takes the reference MTP's place: its config)."""
    from ..gguf.mtp import mtp_config
    from .device_weights import DeviceWeights
    mcfg = mtp_config(cfg)
    mdw = DeviceWeights.random_policy_mtp(rt, dw, mcfg, "q2", quantised_products=True)
    return SimpleNamespace(config=mcfg, weights=None), mdw


def make_dspark(rt, cfg, dw):
    """(DSpark stand-in, its device weights): a random DSpark draft of 0731's settings (a block of
    5, rank 256, taps after layers 40 to 42) beside make_model(full=True)'s model: its stages in the
    policy's types as main layers, main_proj and markov_w2 Q8_0, markov_w1 and the hc head F16, as
    gguf.tiny.random_dspark stores them (the stand-in takes the draft weights' place: `config` the
    stages, `dspark` its settings)."""
    from ..gguf.dspark import DSparkConfig, dspark_tensor_shapes, stage_config
    from ..gguf.tiny import _DSPARK_DTYPES
    from .device_weights import DeviceWeights
    from .dspark import dspark_device_names
    dcfg = DSparkConfig(block_size=5, noise_token_id=cfg.vocab_size - 1, markov_rank=256,
                        target_layers=(cfg.n_layer - 3, cfg.n_layer - 2, cfg.n_layer - 1))
    stages = stage_config(cfg, dcfg)
    ddw = DeviceWeights.random_policy_draft(rt, dw, stages, dspark_device_names(stages, dcfg),
                                            dspark_tensor_shapes(cfg, dcfg), _DSPARK_DTYPES, "q2", seed=2,
                                            quantised_products=True)
    return SimpleNamespace(config=stages, dspark=dcfg, weights=None), ddw


def make_model(full: bool, experts: int = 256):
    """(runtime, config, device weights, model parts (config, numerics, tables, weights=None: what
    HipBackend is built from), description): the 8-layer bf16 model
    or, with full, Flash in the q2 policy; random weights made on the device."""
    from .device_weights import DeviceWeights
    from .guards import open_device
    t0 = time.time()
    rt = open_device()
    if full:
        cfg = flash_config(43, 256, 1048576)
        dw = DeviceWeights.random_policy(rt, cfg, "q2", quantised_products=True)  # official numerics
        what = "Flash (43 layers) in the q2 policy: IQ2_XXS/Q2_K experts, Q8_0 attention/shared/output, F16 rest"
    else:
        cfg = flash_config(8, experts)
        dw = DeviceWeights.random_flash(rt, cfg)
        what = f"Flash-shaped 8-layer model, every matrix bf16, {cfg.n_expert} experts top-6"
    model = SimpleNamespace(config=cfg, numerics="official", tables=Tables.build(cfg, np.float32), weights=None)
    print(f"weights on device: {dw.bytes / 2**30:.2f} GiB in {time.time() - t0:.1f} s", flush=True)
    return rt, cfg, dw, model, what
