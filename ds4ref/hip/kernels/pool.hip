// Compressor window pooling: per-channel softmax over C candidates.
// kv, score (R, C, D) -> (R, D). Candidates scored -inf weigh 0; all -inf gives 0.
// Ratio 4 pools 8 candidates (the previous window's overlap lane plus the current
// window), ratio 128 pools 128; both are this kernel with a different C.
// One thread per (row, channel), candidates summed in order. At one lane the kernel is a
// few warps, so its time is each thread's chain of loads: the loops are unrolled by 8
// (NVRTC unrolls by 4 unasked) so more candidates' loads are in flight before the in-order
// adds.
#include "ds4_hip.h"

extern "C" __global__ void ds4_pool_window(const float* __restrict__ kv, const float* __restrict__ score,
                                           float* __restrict__ out, int R, int C, int D) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)R * D) return;
    int r = (int)(idx / D), d = (int)(idx % D);
    const float* sr = score + (long long)r * C * D + d;
    const float* kr = kv + (long long)r * C * D + d;
    float mx = -DS4_INF;
#pragma unroll 8
    for (int c = 0; c < C; ++c) mx = fmaxf(mx, sr[(long long)c * D]);
    if (!(mx > -DS4_INF && mx < DS4_INF)) mx = 0.0f;
    float den = 0.0f, num = 0.0f;
#pragma unroll 8
    for (int c = 0; c < C; ++c) {
        float e = ds4_exp(sr[(long long)c * D] - mx);
        den += e;
        num += e * kr[(long long)c * D];
    }
    out[idx] = den > 0.0f ? num / den : 0.0f;
}
