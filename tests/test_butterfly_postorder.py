"""The tiled GEMM of prompt passes (qgemm.hip, ds4_qgemm_*) adds §2a's 32 partials in the
butterfly's post-order: leaf Q is partial qg_bitrev5(Q), and after it the pending sums are a
binary counter's (qg_leaves: pop qg_trailing_ones(Q) of them, each added on the left, and store
the result at depth qg_popc(Q) - pops). That is the reference's butterfly (canon._butterfly) bit
for bit, whatever the partials (float32 adds with the same operands in the same order).

The index helpers are the kernel's own: their constexpr bodies, read from qgemm.hip, are integer
expressions that mean the same in Python (no GPU and no C++ compiler needed); the walk over them
is qg_leaves' loop, written out here."""
import re
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import ds4ref.hip
from ds4ref.numerics.canon import LANES, _butterfly

QGEMM = Path(ds4ref.hip.__file__).parent / "kernels" / "qgemm.hip"
HELPERS = ("qg_bitrev5", "qg_popc", "qg_trailing_ones")


def kernel_helpers() -> dict:
    """qgemm.hip's qg_bitrev5, qg_popc and qg_trailing_ones as Python functions. Each body is one
    `return` of &, |, <<, >>, + and at most one `c ? a : b` (written `a if c else b`); with no
    comparison in them, C's and Python's precedences agree."""
    src, ns = QGEMM.read_text(), {}
    for name in HELPERS:
        m = re.search(rf"constexpr int {name}\(int q\) \{{\s*return ([^;]*);\s*\}}", src)
        assert m, f"{name} not found in {QGEMM.name}"
        body = " ".join(m.group(1).split())
        ternary = re.fullmatch(r"(.+?) \? (.+) : (.+)", body)
        if ternary:
            body = f"({ternary.group(2)}) if ({ternary.group(1)}) else ({ternary.group(3)})"
        exec(f"def {name}(q):\n    return {body}\n", ns)
    return {name: ns[name] for name in HELPERS}


K = kernel_helpers()


def post_order(p: np.ndarray) -> np.float32:
    """qg_leaves' walk over one output's 32 chains, the float32 adds as the kernel does them."""
    stack = [None] * 5  # the kernel's five pending sums
    for q in range(LANES):
        depth, pops = K["qg_popc"](q), K["qg_trailing_ones"](q)
        acc = p[K["qg_bitrev5"](q)]
        for j in range(pops):
            acc = np.float32(stack[depth - 1 - j] + acc)
        stack[depth - pops] = acc
    return stack[0]


def test_the_kernels_helpers_name_every_partial_once_within_five_pending_sums():
    assert LANES == 32
    assert sorted(K["qg_bitrev5"](q) for q in range(32)) == list(range(32))
    assert [K["qg_bitrev5"](q) for q in range(6)] == [0, 16, 8, 24, 4, 20]  # docs/exactness.md §2a
    assert all(K["qg_popc"](q) == bin(q).count("1") for q in range(32))
    assert all(K["qg_trailing_ones"](q) == len(bin(q)) - len(bin(q).rstrip("1")) for q in range(32))
    assert max(K["qg_popc"](q) - K["qg_trailing_ones"](q) for q in range(32)) < 5


@settings(max_examples=300, deadline=None)
@given(arrays(np.float32, 32, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
def test_post_order_is_the_reference_butterfly(p):
    assert post_order(p).view(np.uint32) == np.float32(_butterfly(p.copy(), 32)).view(np.uint32)
