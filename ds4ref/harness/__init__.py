"""The GPU op test harness, above both backends: the op twins (twins.py: each device launcher
wrapped numpy in, numpy out) and the op-case table (op_cases.py) that compares them bit for bit
with the NumPy reference's ops and times them (tests/test_op_cases.py, tests/gpu/test_ops_gpu.py,
benchmarks/ops_gpu.py, `python -m ds4ref.harness.op_cases`)."""
