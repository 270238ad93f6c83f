"""GPU guardrails, checked on a CPU-only machine: no GPU, no fake GPU."""
from __future__ import annotations

import importlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ds4ref.hip import guards
from ds4ref.hip.runtime import NoGpuError, get_runtime, pack_args, reset_runtime


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
    code = ("import sys, ds4ref.hip, ds4ref.hip.launch, ds4ref.harness.twins, ds4ref.hip.guards; "
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


def test_layouts_module_importable_and_host_encodings_roundtrip():
    import numpy as np
    layouts = importlib.import_module("ds4ref.hip.layouts")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 64)).astype(np.float32)
    raw = layouts.quantize_q8_0(w)
    assert raw.shape == (3, 2 * 34)
    assert np.max(np.abs(layouts.dequantize_q8_0(raw) - w)) <= np.max(np.abs(w)) / 127
    b = layouts.f32_to_bf16_bits(w)
    assert np.max(np.abs(layouts.bf16_bits_to_f32(b) - w) / np.abs(w)) <= 2 ** -8
