// RoPE on the last 2*half dims of each row, interleaved pairs (a, a+1); cos/sin
// tables are per row (R, half). inverse != 0 rotates by -theta.
// Products are rounded separately (__fmul_rn) so no FMA contraction changes the
// rounding: the result matches the NumPy reference bit for bit.
#include "ds4_hip.h"

extern "C" __global__ void ds4_rope(const float* __restrict__ v, const float* __restrict__ cs,
                                    const float* __restrict__ sn, float* __restrict__ out,
                                    int R, int D, int half, int inverse) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)R * D) return;
    int row = (int)(idx / D), i = (int)(idx % D);
    int start = D - 2 * half;
    const float* vr = v + (long long)row * D;
    if (i < start) { out[idx] = vr[i]; return; }
    int p = (i - start) >> 1;
    float a = vr[start + 2 * p], b = vr[start + 2 * p + 1];
    float c = cs[(long long)row * half + p], s = sn[(long long)row * half + p];
    if (inverse) s = -s;
    if (((i - start) & 1) == 0) out[idx] = __fmul_rn(a, c) - __fmul_rn(b, s);
    else out[idx] = __fmul_rn(a, s) + __fmul_rn(b, c);
}
