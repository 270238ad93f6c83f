"""The numerics both backends build on: the canonical float32 arithmetic (canon.py, the function
the kernels compute bit for bit; docs/exactness.md), the FP8/FP4 grids of `official` numerics
(grids.py) and the tables derived from the model's config (tables.py: RoPE, Hadamard)."""
