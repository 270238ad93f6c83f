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
    DS4_KERNEL_ENTRY;
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
// Grid (rows, ceil(D / 256)): block (n, s) forms row n's denominator (every block of the row
// the same bits, in the same order) and writes columns 256 s .. 256 s + 255, a warp per
// 32-column block: a row's quantisation is spread over the machine instead of one block
// walking D / 256 blocks a warp, each a chain of shuffles.
extern "C" __global__ void ds4_rmsnorm_q8(const float* __restrict__ x, const float* __restrict__ w,
                                          float* __restrict__ y, int D, float eps, const int* lane_slot,
                                          ds4_i8* __restrict__ xq, float* __restrict__ dx, short* __restrict__ xs) {
    DS4_KERNEL_ENTRY;
    __shared__ float scratch[32];
    if (lane_slot && lane_slot[blockIdx.x] < 0) return;
    long long n = blockIdx.x;
    const float* xr = x + n * D;
    float* yr = y + n * D;
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP, nwarps = blockDim.x / DS4_WARP;
    int b = (int)blockIdx.y * nwarps + warp;
    int c = b * QB + lane;
    float xc = b < D / QB ? xr[c] : 0.0f, wc = w && b < D / QB ? w[c] : 1.0f;  // in flight during the sum
    float den = rms_den(xr, D, eps, scratch);
    if (b >= D / QB) return;
    float t = xc / den;
    float v = w ? wc * t : t;
    yr[c] = v;
    ds4_q8_warp(v, xq + n * D + (long long)b * QB, dx + n * (D / QB) + b, xs + n * (D / 16) + 2 * b);
}

// ds4_rmsnorm, then step_rope_pos on the row's last 2 * half dims (the lane's position
// pos[row / rows_per_lane], cs as step_rope_pos reads it) and, with fp8, the FP8 E4M3 round
// trip of the others in blocks of 64 (reference ops.fp8sim): one launch where there were three.
// Every element goes through those operations in their order, so the bits are theirs (op case
// norm_rope); padding lanes' rows are skipped, as ds4_rmsnorm skips them. One block of 256
// threads a row (rms_den's order).
extern "C" __global__ void ds4_norm_rope(const float* __restrict__ x, const float* __restrict__ w,
                                         float* __restrict__ y, int D, float eps, const int* lane_slot,
                                         int rows_per_lane, const int* pos, const float* cs, int half,
                                         int inverse, int fp8) {
    DS4_KERNEL_ENTRY;
    __shared__ float scratch[32];
    int l = blockIdx.x / rows_per_lane;
    if (lane_slot && lane_slot[l] < 0) return;
    const float* xr = x + (long long)blockIdx.x * D;
    float* yr = y + (long long)blockIdx.x * D;
    float den = rms_den(xr, D, eps, scratch);
    auto norm = [&](int i) {
        float v = xr[i] / den;
        return w ? w[i] * v : v;
    };
    int nope = D - 2 * half;
    if (fp8) {
        int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP, nwarps = blockDim.x / DS4_WARP;
        for (int b = warp; b < nope / 64; b += nwarps) {
            float2 q = ds4_e4m3_block64(norm(b * 64 + lane), norm(b * 64 + 32 + lane));
            yr[b * 64 + lane] = q.x;
            yr[b * 64 + 32 + lane] = q.y;
        }
    } else {
        for (int i = threadIdx.x; i < nope; i += blockDim.x) yr[i] = norm(i);
    }
    const float* t = cs + (long long)pos[l] * half * 2;
    for (int p = threadIdx.x; p < half; p += blockDim.x) {
        float a = norm(nope + 2 * p), b = norm(nope + 2 * p + 1);
        float c = t[2 * p], s = inverse ? -t[2 * p + 1] : t[2 * p + 1];
        yr[nope + 2 * p] = a * c - b * s;
        yr[nope + 2 * p + 1] = a * s + b * c;
    }
}
