"""transformers' eager DeepseekV4 decode speed on the same Flash-shaped config as
benchmarks/decode_gpu.py, for a side-by-side ratio.

    python benchmarks/hf_eager_gpu.py [--device cuda] [--lanes 1,16] [--ctx 256]

The model is built from ds4ref.convert.hf.hf_config(flash_config()) in bf16 on the device with
transformers' own random init (loading our random weights would cost minutes of host
time and does not change the speed). Decode: a prompt of `ctx` tokens per sequence is
prefilled, then each timed step feeds one token per sequence with the cache
(batch = C sequences). Times: host clock around a synchronized step, median of the steps.
Prints one markdown row per C.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lanes", default="1,16")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tiny", action="store_true", help="tiny config (a CPU smoke test)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON (benchmarks/plot_decode.py)")
    args = ap.parse_args()
    import torch
    import transformers
    from transformers import DeepseekV4ForCausalLM

    from ds4ref.convert.hf import hf_config
    if args.tiny:
        from ds4ref.gguf.tiny import tiny_config
        cfg = tiny_config(n_layer=4)
    else:
        from decode_gpu import flash_config
        cfg = flash_config()
    import dataclasses
    # transformers has one SwiGLU clamp for all layers: use the first layer's everywhere
    # (speed does not depend on it)
    cfg = dataclasses.replace(cfg, swiglu_clamp=[cfg.swiglu_clamp[0]] * cfg.n_layer)
    hc = hf_config(cfg)
    dev = torch.device(args.device)
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: 256 experts in f32 would not fit
    with torch.device(dev):
        torch.manual_seed(0)
        model = DeepseekV4ForCausalLM(hc).eval()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"transformers {transformers.__version__}: model built in {time.time() - t0:.1f} s, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} G parameters (bf16, random init)", flush=True)
    rows, records = [], []
    for C in [int(x) for x in args.lanes.split(",")]:
        g = torch.Generator(device="cpu").manual_seed(C)
        ids = torch.randint(0, cfg.vocab_size, (C, args.ctx), generator=g).to(dev)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for _ in range(args.steps):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
        ms = 1e3 * statistics.median(times[1:] if len(times) > 1 else times)
        row = f"| transformers eager DeepseekV4 | {args.ctx} | {C} | {ms:.2f} | {C / (ms * 1e-3):.0f} |"
        print(row, flush=True)
        rows.append(row)
        records.append(dict(ctx=args.ctx, C=C, step_ms=ms, tok_s=C / (ms * 1e-3)))
    if args.json:
        import json
        Path(args.json).write_text(json.dumps(dict(model=f"transformers {transformers.__version__} eager "
                                                   f"DeepseekV4, {cfg.name}, bf16", rows=records), indent=1))
    print("| engine | context | C | step ms | tok/s |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
