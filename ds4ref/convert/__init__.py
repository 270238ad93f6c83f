"""Checkpoint conversion: a DeepSeek-V4 safetensors directory (transformers' or the official
FP8/FP4 release) to a deepseek4 GGUF. `hf` reads the checkpoint's config and names, `fp8` decodes
the official quantised weights, `to_gguf` maps and writes the tensors.

    python -m ds4ref.convert --hf DIR --out FILE.gguf [--dtype f32|f16|bf16|q8_0]
"""
