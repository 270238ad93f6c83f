"""The tiled GEMM of prompt passes (qgemm.hip, ds4_qgemm_*) adds §2a's 32 partials in the
butterfly's post-order: leaf q is partial bitrev5(q), and after it the pending sums are a binary
counter's. That is the butterfly's result bit for bit, whatever the partials (float32 adds with
the same operands in the same order)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays


def bitrev5(q: int) -> int:
    return int(f"{q:05b}"[::-1], 2)


def butterfly(p: np.ndarray) -> np.float32:
    p = p.copy()
    h = 16
    while h:
        p[:h] = p[:h] + p[h:2 * h]
        h //= 2
    return p[0]


def post_order(p: np.ndarray) -> np.float32:
    stack = []
    for q in range(32):
        v = p[bitrev5(q)]
        while q & 1:
            v = np.float32(stack.pop() + v)
            q >>= 1
        stack.append(v)
    assert len(stack) == 1
    return stack[0]


@settings(max_examples=300, deadline=None)
@given(arrays(np.float32, 32, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
def test_post_order_is_the_butterfly(p):
    assert post_order(p).view(np.uint32) == butterfly(p).view(np.uint32)
