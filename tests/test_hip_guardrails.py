"""GPU guardrails, checked on a CPU-only machine: no GPU, no fake GPU."""
from __future__ import annotations

import importlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ds4ref.config import DS4Config
from ds4ref.hip import guards
from ds4ref.hip.runtime import NoGpuError, get_runtime, pack_args, reset_runtime


def _cfg(**kw) -> DS4Config:
    base = dict(n_layer=3, n_embd=64, vocab_size=100, n_head=4, head_dim=128, n_rot=64, q_lora_rank=32,
                o_lora_rank=16, o_groups=2, n_expert=4, n_expert_used=2, n_expert_shared=1, expert_ff=32,
                n_hash_layers=1, expert_weights_scale=1.5, sliding_window=8, indexer_heads=2,
                indexer_head_dim=64, indexer_top_k=4, hc_mult=2, hc_sinkhorn_iters=3, hc_eps=1e-6,
                rms_eps=1e-6, compress_ratios=[0, 4, 128], swiglu_clamp=[7.0, 7.0, 7.0],
                rope_freq_base=10000.0, compress_rope_freq_base=160000.0, yarn_factor=4.0,
                yarn_orig_ctx=64, yarn_beta_fast=32.0, yarn_beta_slow=1.0)
    base.update(kw)
    return DS4Config(**base)


def _has_gpu() -> bool:
    try:
        reset_runtime()
        get_runtime()
        return True
    except NoGpuError:
        return False
    finally:
        reset_runtime()


def test_import_needs_no_gpu_library():
    # a fresh interpreter, so nothing imported earlier can mask a top-level GPU import
    code = ("import sys, ds4ref.hip, ds4ref.hip.ops, ds4ref.hip.guards; "
            "bad = [m for m in ('hip', 'cuda', 'cuda.bindings', 'cupy', 'torch', 'gguf') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(_has_gpu(), reason="a GPU runtime is present here")
def test_no_gpu_error_names_what_was_tried(monkeypatch):
    monkeypatch.delenv("DS4REF_GPU_RUNTIME", raising=False)
    reset_runtime()
    with pytest.raises(NoGpuError) as e:
        get_runtime()
    msg = str(e.value)
    assert "hip:" in msg and "cuda:" in msg and "DS4REF_GPU_RUNTIME" in msg


def test_forced_runtime_is_validated(monkeypatch):
    monkeypatch.setenv("DS4REF_GPU_RUNTIME", "opencl")
    reset_runtime()
    with pytest.raises(NoGpuError, match="opencl"):
        get_runtime()
    reset_runtime()


@pytest.mark.skipif(_has_gpu(), reason="a GPU runtime is present here")
def test_forced_cuda_only_tries_cuda(monkeypatch):
    monkeypatch.setenv("DS4REF_GPU_RUNTIME", "cuda")
    reset_runtime()
    with pytest.raises(NoGpuError) as e:
        get_runtime()
    assert "cuda:" in str(e.value) and "hip:" not in str(e.value)
    reset_runtime()


def test_pack_args_refuses_plain_python_numbers():
    import numpy as np
    ptrs, holders = pack_args([np.int32(3), np.float32(1.5), None])
    assert len(ptrs) == 3 and holders[0][0] == 3
    with pytest.raises(TypeError, match="argument 0"):
        pack_args([3])


# ---- device refusal (a description object, not a fake GPU) ------------------

def _dev(vendor, arch, warp=32):
    return SimpleNamespace(vendor=vendor, arch=arch, name=f"test {arch}", warp_size=warp)


def test_gfx1151_and_nvidia_accepted():
    guards.check_device(_dev("amd", "gfx1151"))
    guards.check_device(_dev("nvidia", "sm_90"))


def test_other_rocm_arch_refused_unless_allowed():
    with pytest.raises(guards.UnsupportedDeviceError, match="gfx1100.*--allow-untested-arch"):
        guards.check_device(_dev("amd", "gfx1100"))
    guards.check_device(_dev("amd", "gfx1100"), allow_untested_arch=True)


def test_wave64_refused_even_when_allowed():
    with pytest.raises(guards.UnsupportedDeviceError, match="64-lane"):
        guards.check_device(_dev("amd", "gfx942", warp=64), allow_untested_arch=True)


def test_cli_flag():
    import argparse
    p = argparse.ArgumentParser()
    guards.add_guard_args(p)
    assert p.parse_args(["--allow-untested-arch"]).allow_untested_arch
    assert not p.parse_args([]).allow_untested_arch


def test_weight_type_refusal_names_tensor():
    guards.check_weight_types({"blk.0.attn_kv.weight": "Q8_0", "output_norm.weight": "F32",
                               "blk.3.ffn_gate_exps.weight": "IQ2_XXS", "blk.3.ffn_down_exps.weight": "Q2_K",
                               "blk.4.ffn_up_exps.weight": "Q4_K", "blk.5.ffn_up_exps.weight": "MXFP4"})
    with pytest.raises(guards.UnsupportedWeightError, match="blk.3.ffn_gate_exps.weight.*Q3_K"):
        guards.check_weight_types({"blk.0.attn_kv.weight": "Q8_0", "blk.3.ffn_gate_exps.weight": "Q3_K"})


# ---- memory estimate against a hand count ----------------------------------

def test_estimate_matches_hand_count():
    cfg = _cfg()
    est = guards.estimate_device_bytes(cfg, {"*": "F32"}, n_slots=2, n_pages=5, page_tokens=128)
    D, ihd, W = 128, 64, 8
    # pages: ratio-4 layer holds 32 rows of (KV 128 + indexer 64); ratio-128 layer holds 1 row of 128
    page = 32 * (D + ihd) + 1 * D
    assert est.paged == 5 * page * 4
    # per slot: 3 raw rings of 8 x 128; ratio-4 compressor: kv+score x 8 candidates x 2D wide,
    # and the indexer compressor 2 x 8 x (2 * ihd) (the upstream estimate had 1 * ihd);
    # ratio-128: kv+score x 128 x D
    slot = 3 * W * D + 2 * 8 * 2 * D + 2 * 8 * 2 * ihd + 2 * 128 * D
    assert est.per_slot == 2 * slot * 4
    n_weights = sum(int(__import__("numpy").prod(s)) for s in
                    __import__("ds4ref.tensors", fromlist=["x"]).tensor_shapes(cfg).values())
    assert est.weights == 4 * n_weights
    assert est.workspace == 16 * (2 * 64 + 100) * 4
    assert est.total == est.weights + est.paged + est.per_slot + est.workspace


def test_estimate_q8_0_bytes_and_missing_type():
    assert guards.tensor_bytes((4, 64), "Q8_0") == 4 * 2 * 34
    with pytest.raises(guards.UnsupportedWeightError, match="no weight type given"):
        guards.estimate_device_bytes(_cfg(), {"output.weight": "F32"}, 1, 1)


def test_refuses_before_allocating_when_too_big():
    est = guards.MemoryEstimate(weights=10 << 30, paged=2 << 30, per_slot=1 << 30, workspace=0)
    with pytest.raises(guards.DeviceMemoryError, match="fewer slots or pages"):
        guards.check_fits(est, free_bytes=12 << 30)
    guards.check_fits(est, free_bytes=20 << 30)


def test_ops_module_importable_and_host_encodings_roundtrip():
    import numpy as np
    ops = importlib.import_module("ds4ref.hip.ops")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 64)).astype(np.float32)
    raw = ops.quantize_q8_0(w)
    assert raw.shape == (3, 2 * 34)
    assert np.max(np.abs(ops.dequantize_q8_0(raw) - w)) <= np.max(np.abs(w)) / 127
    b = ops.f32_to_bf16_bits(w)
    assert np.max(np.abs(ops.bf16_bits_to_f32(b) - w) / np.abs(w)) <= 2 ** -8
