// `official` numerics: FP8 E4M3 round-trip of KV rows (blocks of 64 over the
// non-RoPE dims) and the indexer's Hadamard rotation + FP4 E2M1 (blocks of 32).
// The rounding is exact (power-of-two scales, ties to even), so given identical
// f32 inputs these kernels agree with reference/ops.py bit for bit.
#include "ds4_hip.h"

// One warp per (row, block of 64); each lane rounds 2 values. The RoPE tail is copied.
extern "C" __global__ void ds4_fp8sim(const float* __restrict__ v, float* __restrict__ out,
                                      int R, int D, int n_rot) {
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int row = blockIdx.x;
    const float* vr = v + (long long)row * D;
    float* orow = out + (long long)row * D;
    int nope = D - n_rot;
    for (int i = nope + threadIdx.x; i < D; i += blockDim.x) orow[i] = vr[i];
    int nblk = nope / 64, nwarps = blockDim.x / DS4_WARP;
    for (int b = warp; b < nblk; b += nwarps) {
        float x0 = vr[b * 64 + lane], x1 = vr[b * 64 + 32 + lane];
        float amax = ds4_warp_max(fmaxf(fabsf(x0), fabsf(x1)));
        amax = fmaxf(amax, 1e-4f);
        float s = ds4_pow2_ceil(amax / 448.0f);
        float q0 = fminf(fmaxf(x0 / s, -448.0f), 448.0f);
        float q1 = fminf(fmaxf(x1 / s, -448.0f), 448.0f);
        orow[b * 64 + lane] = ds4_round_to_grid(q0, -6, 3) * s;
        orow[b * 64 + 32 + lane] = ds4_round_to_grid(q1, -6, 3) * s;
    }
}

// r[row, j] = sum_i v[row, i] * h[j, i], summed in index order (one thread per output).
// ht is h transposed (ht[i, j] = h[j, i]): consecutive threads (consecutive j) then read
// consecutive words of the table at every step, where h's rows would put each on its own line.
extern "C" __global__ void ds4_hadamard_rows(const float* __restrict__ v, const float* __restrict__ ht,
                                             float* __restrict__ r, int R, int n, const int* lane_slot,
                                             int rows_per_lane) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)R * n) return;
    int row = (int)(idx / n), j = (int)(idx % n);
    if (lane_slot && lane_slot[row / rows_per_lane] < 0) return;  // a padding lane's rows
    const float* vr = v + (long long)row * n;
    float acc = 0.0f;
    int i = 0;
    for (; i + 16 <= n; i += 16) {  // sixteen products formed before their adds: no load waits on the add chain
        float p[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) p[k] = vr[i + k] * ht[(long long)(i + k) * n + j];
#pragma unroll
        for (int k = 0; k < 16; ++k) acc += p[k];
    }
    for (; i < n; ++i) acc += vr[i] * ht[(long long)i * n + j];
    r[idx] = acc;
}

// FP4 E2M1 in blocks of 32: one warp per block, one value per lane.
extern "C" __global__ void ds4_e2m1_blocks(const float* __restrict__ r, float* __restrict__ out,
                                           long long n_blocks) {
    int lane = threadIdx.x % DS4_WARP;
    long long b = (long long)blockIdx.x * (blockDim.x / DS4_WARP) + threadIdx.x / DS4_WARP;
    if (b >= n_blocks) return;  // whole warps leave together: the shuffle below stays full
    float x = r[b * 32 + lane];
    float amax = fmaxf(ds4_warp_max(fabsf(x)), 7.052966104933725e-38f);
    float s = ds4_pow2_ceil(amax / 6.0f);
    float q = fminf(fmaxf(x / s, -6.0f), 6.0f);
    out[b * 32 + lane] = ds4_round_to_grid(q, 0, 1) * s;
}
