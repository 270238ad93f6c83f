// Compressor window pooling: per-channel softmax over C candidates.
// kv, score (R, C, D) -> (R, D). Candidates scored -inf weigh 0; all -inf gives 0.
// Ratio 4 pools 8 candidates (the previous window's overlap lane plus the current
// window), ratio 128 pools 128; both are this kernel with a different C.
// Per channel: mx = the max score (fmaxf: any order gives the same value), then
// den = sum e_c and num = sum e_c * kv_c over c in increasing order, e_c = exp(score_c - mx).
// The exps are independent, so a block's 256 threads form them for 32 channels x up to
// PW_CC candidates into shared memory, and one thread per channel runs the in-order sums:
// at one lane a ratio-128 window is then 16 blocks instead of two, and no thread waits out
// 128 exps in a row.
#include "ds4_hip.h"

#define PW_CH 32    // channels a block
#define PW_CC 128   // candidates staged at a time
#define PW_PARTS 8  // threads a channel

// Grid (ceil(D / PW_CH), R), PW_CH * PW_PARTS threads.
extern "C" __global__ void ds4_pool_window(const float* __restrict__ kv, const float* __restrict__ score,
                                           float* __restrict__ out, int R, int C, int D) {
    DS4_KERNEL_ENTRY;
    __shared__ float se[PW_CC][PW_CH];
    __shared__ float sp[PW_CC][PW_CH];
    __shared__ float smx[PW_PARTS][PW_CH];
    int r = blockIdx.y, ch = threadIdx.x % PW_CH, part = threadIdx.x / PW_CH;
    int d = (int)blockIdx.x * PW_CH + ch;
    bool ok = d < D;
    const float* sr = score + (long long)r * C * D + d;
    const float* kr = kv + (long long)r * C * D + d;
    float mx = -DS4_INF;
    if (ok)
        for (int c = part; c < C; c += PW_PARTS) mx = fmaxf(mx, sr[(long long)c * D]);
    smx[part][ch] = mx;
    __syncthreads();
#pragma unroll
    for (int p = 0; p < PW_PARTS; ++p) mx = fmaxf(mx, smx[p][ch]);
    if (!(mx > -DS4_INF && mx < DS4_INF)) mx = 0.0f;
    float den = 0.0f, num = 0.0f;
    for (int c0 = 0; c0 < C; c0 += PW_CC) {
        int cc = C - c0 < PW_CC ? C - c0 : PW_CC;
        __syncthreads();  // the previous candidates are summed
        for (int c = part; c < cc; c += PW_PARTS) {
            float e = ok ? ds4_exp(sr[(long long)(c0 + c) * D] - mx) : 0.0f;
            se[c][ch] = e;
            sp[c][ch] = ok ? e * kr[(long long)(c0 + c) * D] : 0.0f;
        }
        __syncthreads();
        if (part == 0)
            for (int c = 0; c < cc; ++c) {
                den += se[c][ch];
                num += sp[c][ch];
            }
    }
    if (part == 0 && ok) out[(long long)r * D + d] = den > 0.0f ? num / den : 0.0f;
}
