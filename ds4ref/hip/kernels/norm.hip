// RMSNorm, rows of length D: y = w * x / sqrt(mean(x^2) + eps); w == nullptr gives rms0.
// One block per row; the sum of squares has a fixed order (thread-strided partials,
// then the block butterfly), so a row's result never depends on other rows.
// With lane_slot (the backend's per-lane slots), rows of padding lanes (rows_per_lane
// rows per lane) are skipped: a lone decode row pays for its own rows only.
#include "ds4_hip.h"

extern "C" __global__ void ds4_rmsnorm(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ y, int D, float eps, const int* lane_slot,
                                       int rows_per_lane) {
    __shared__ float scratch[32];
    if (lane_slot && lane_slot[blockIdx.x / rows_per_lane] < 0) return;
    const float* xr = x + (long long)blockIdx.x * D;
    float* yr = y + (long long)blockIdx.x * D;
    float s = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = xr[i];
        s += v * v;
    }
    s = ds4_block_sum(s, scratch);
    // divide by the root (not multiply by rsqrt): this is what the reference does
    float den = sqrtf(s / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = xr[i] / den;
        yr[i] = w ? w[i] * v : v;
    }
}
