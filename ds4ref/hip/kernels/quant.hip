// `official` numerics: the indexer's Hadamard rotation + FP4 E2M1 (blocks of 32). (The KV
// rows' FP8 E4M3 round trip is norm.hip's ds4_norm_rope epilogue.)
// The rounding is exact (power-of-two scales, ties to even), so given identical
// f32 inputs these kernels agree with reference/ops.py bit for bit.
#include "ds4_hip.h"

// The indexer's QAT (ops.qat) of rows of n (n % 32 == 0): r[row, j] = sum_i v[row, i] * h[j, i]
// summed in index order, one thread per output, then FP4 E2M1 in blocks of 32, one warp per
// block (a warp's 32 threads are one block's consecutive j). ht is h transposed (ht[i, j] =
// h[j, i]): consecutive threads (consecutive j) then read consecutive words of the table at
// every step, where h's rows would put each on its own line.
extern "C" __global__ void ds4_qat_rows(const float* __restrict__ v, const float* __restrict__ ht,
                                        float* __restrict__ out, int R, int n, const int* lane_slot,
                                        int rows_per_lane) {
    DS4_KERNEL_ENTRY;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)R * n) return;  // whole warps leave together: the shuffles below stay full
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
    float amax = fmaxf(ds4_warp_max(fabsf(acc)), 7.052966104933725e-38f);
    float s = ds4_pow2_ceil(amax / 6.0f);
    float q = fminf(fmaxf(acc / s, -6.0f), 6.0f);
    out[idx] = ds4_round_to_grid(q, 0, 1) * s;
}
