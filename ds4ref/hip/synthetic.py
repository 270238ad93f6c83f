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
