// ds4_q8.h - one 32-column block of an activation row quantised to int8 (docs/exactness.md,
// "Activation quantisation"; canon.quantize_q8). Shared by the stand-alone quantiser
// (qdot.hip) and the kernels that quantise the rows they produce (the norms and the SwiGLU
// activation feeding quantised products), so every producer writes the same codes.
#pragma once
#include "ds4_hip.h"

#define QB 32  // columns per quantised block

// One warp quantises one block: lane i holds v, column i of the block, and every lane of the
// warp calls this. Writes the 32 codes at xq, the block's scale at *dx and the sums of the
// codes of its two 16-column halves at xs[0], xs[1] (the K-quants' min terms need them).
// amax is a max and the half sums are integer sums, so the order the lanes combine in cannot
// matter. A block holding inf or NaN gets dx = NaN and zero codes, so the NaN reaches every
// product of that row; a block whose dx is 0 (all zeros, or amax / 127 underflowing) gets zero
// codes.
__device__ __forceinline__ void ds4_q8_warp(float v, ds4_i8* __restrict__ xq, float* __restrict__ dx,
                                            short* __restrict__ xs) {
    int lane = threadIdx.x % DS4_WARP;
    float a = fabsf(v);
    int bad = !(a <= 3.402823466e38f);
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) bad |= DS4_SHFL_XOR(bad, m);
    float amax = ds4_warp_max(a);  // every lane takes part; with a bad lane the value is unused
    float d = bad ? DS4_NAN : amax == 0.0f ? 0.0f : amax / 127.0f;
    bool zero = bad || d == 0.0f;  // d is 0 also where amax / 127 underflows
    int q = zero ? 0 : __float2int_rn(v / d);
    q = q > 127 ? 127 : q < -127 ? -127 : q;
    xq[lane] = (ds4_i8)q;
    for (int m = QB / 4; m > 0; m >>= 1) q += DS4_SHFL_XOR(q, m);  // within each 16-lane half
    if (lane == 0) {
        *dx = d;
        xs[0] = (short)q;
    } else if (lane == 16) {
        xs[1] = (short)q;
    }
}
