"""Per-op GPU time at DS4 Flash sizes against the memory-bandwidth floor: the perf mode of the
op-case table (ds4ref/harness/op_cases.py), which also drives the bitwise twin tests.

floor = bytes the op must move (each input read once, each output written once)
        / measured device-to-device copy bandwidth (read + write bytes / time).
Times: each op's launches captured 20 times into one graph, replayed; events around the
replays; warm-up first; median of repeats; weights rotated among copies where one copy would
sit in L2. Writes a markdown table to --out (and prints it).

    python3 benchmarks/ops_gpu.py --out docs/results/ops_gpu.md [--lanes 1,16,256] [--ops matvec,attention_paged]
"""
from ds4ref.harness.op_cases import main

if __name__ == "__main__":
    main()
