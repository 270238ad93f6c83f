// RMSNorm, rows of length D: y = w * x / sqrt(mean(x^2) + eps); w == nullptr gives rms0.
// One block per row; the sum of squares has a fixed order (thread-strided partials,
// then the block butterfly), so a row's result never depends on other rows.
// With lane_slot (the backend's per-lane slots), rows of padding lanes (rows_per_lane
// rows per lane) are skipped: a lone decode row pays for its own rows only.
#include "ds4_hip.h"
#include "ds4_q8.h"

// sqrt(sumsq(x) / D + eps) over a row, the block's threads taking strided partials (canon.sumsq's
// order for 256 threads); the root is divided by, never multiplied as rsqrt: as the reference.
__device__ __forceinline__ float rms_den(const float* __restrict__ xr, int D, float eps, float* scratch) {
    float s = ds4_block_sum(ds4_strided_sumsq(xr, D), scratch);
    return sqrtf(s / (float)D + eps);
}

extern "C" __global__ void ds4_rmsnorm(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ y, int D, float eps, const int* lane_slot,
                                       int rows_per_lane) {
    __shared__ float scratch[32];
    if (lane_slot && lane_slot[blockIdx.x / rows_per_lane] < 0) return;
    const float* xr = x + (long long)blockIdx.x * D;
    float* yr = y + (long long)blockIdx.x * D;
    float den = rms_den(xr, D, eps, scratch);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = xr[i] / den;
        yr[i] = w ? w[i] * v : v;
    }
}

// ds4_rmsnorm for rows that feed quantised products: the same y, and y's int8 rows
// (ds4_q8.h: xq row n at n*D, dx at n*D/32, xs at n*D/16; D % 32 == 0), so the products
// reading this norm's output share one quantisation instead of each making its own.
// A warp per 32-column block of y, a column per lane.
extern "C" __global__ void ds4_rmsnorm_q8(const float* __restrict__ x, const float* __restrict__ w,
                                          float* __restrict__ y, int D, float eps, const int* lane_slot,
                                          ds4_i8* __restrict__ xq, float* __restrict__ dx, short* __restrict__ xs) {
    __shared__ float scratch[32];
    if (lane_slot && lane_slot[blockIdx.x] < 0) return;
    long long n = blockIdx.x;
    const float* xr = x + n * D;
    float* yr = y + n * D;
    float den = rms_den(xr, D, eps, scratch);
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP, nwarps = blockDim.x / DS4_WARP;
    for (int b = warp; b < D / QB; b += nwarps) {
        int c = b * QB + lane;
        float t = xr[c] / den;
        float v = w ? w[c] * t : t;
        yr[c] = v;
        ds4_q8_warp(v, xq + n * D + (long long)b * QB, dx + n * (D / QB) + b, xs + n * (D / 16) + 2 * b);
    }
}
