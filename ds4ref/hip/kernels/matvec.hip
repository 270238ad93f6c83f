// Batched matvec for any number of lanes: y[l, g*N + r] = sum_k W[g*N + r, k] * x[l, g*xg + k].
//
// Each weight row is read ONCE for all lanes of a group of 16: the lanes' activations are
// staged in shared memory a chunk at a time, and every weight load is multiplied into all
// lanes' accumulators.
//
// Fixed reduction order: lane `t` of a warp sums columns t*8 .. t*8+7 of each
// 256-column step, chunk after chunk, then the warp butterfly combines the 32
// partials. Nothing depends on L, on the row's block, or on the launch size, so
// a lane's result is bitwise identical alone or among 16 lanes.
//
// Groups (blockIdx.y) serve the grouped output projection: group g uses rows
// g*N .. g*N+N-1 and reads its input at offset g*xg. A plain matvec is G = 1.
#include "ds4_hip.h"

#define MV_LANES 16

#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
#define WT_Q8_0 3

// ---------------------------------------------------------------------------
// The kernel's arrangement, chosen so the shared-memory traffic per weight is small and
// padding lanes cost nothing:
//   * activations are staged swizzled: for one 256-column step, the first float4 of
//     every warp lane's 8 columns sits in 128 contiguous floats and the second float4
//     in the next 128, so each LDS.128 of a warp reads 512 contiguous bytes (no bank
//     conflict);
//   * R rows per warp share each staged activation load (R = 4: 8 FMAs per float loaded);
//   * U steps x R rows of raw weight words are loaded before any FMA (R*U 16-byte loads
//     in flight per thread) and stay raw (4 registers for 8 bf16/f16 values) until used;
//   * the staged chunk is as wide as 12288 floats over the number of ACTIVE lanes na,
//     so a lone lane stages a 4096-wide row in one go;
//   * na comes from `lane_slot` (the backend's per-lane slot ids, -1 = padding) when it
//     is given: na = 1 + the last lane with a slot. Padding lanes past it are neither
//     staged, multiplied nor written, so a pass with one row pays for one row while
//     the captured graph stays the same. A lane's column order and FMA sequence do not
//     depend on na, KC, R or U, so its result is bitwise the same alone or among 16.
// The body (mv3_rows) lives in ds4_mv3.h: the routed-expert kernel (step_ops.hip) runs
// the same code with its own list of inputs.
// ---------------------------------------------------------------------------
#include "ds4_mv3.h"

// Lane groups: a pass of L > 16 lanes (a prompt pass) runs in groups of MV_LANES, one
// group per blockIdx.z (blockIdx.y for the K-split, whose z is the slice), so a decode
// pass (one group) runs the 16-lane kernel's code unchanged. A lane's arithmetic is the
// 16-lane kernel's whatever its group, so its sum is the same in a pass of 1, 16 or 256.
__device__ __forceinline__ int mv3_groups(int L) { return (L + MV_LANES - 1) / MV_LANES; }

__device__ __forceinline__ int mv3_group_active(int L, const int* lane_slot, int l0) {
    int n = L - l0 < MV_LANES ? L - l0 : MV_LANES;
    return mv3_active(n, lane_slot ? lane_slot + l0 : lane_slot);
}

// y[l*ldy + g*gs + r] = W[g*N + r] . x[l, g*xg : g*xg + K]. Grid (ceil(N / (8R)), groups, lane groups).
// gs = N lays the groups side by side in a row (the grouped output projection); gs past the
// lanes' rows gives each group an output of its own (matrices that share an input: one launch).
template <int WT, int R, int U>
DS4_BODY void mv3_body(const ds4_u8* W, const float* x, float* y, int N, int K, int L, int ldx, int xg,
                         int ldy, long long gs, const int* lane_slot) {
    __shared__ float4 xs4[MV3_XS / 4];
    __shared__ const float* xrow[MV_LANES];
    __shared__ long long ybase[MV_LANES];
    int l0 = (int)blockIdx.z * MV_LANES;
    int na = mv3_group_active(L, lane_slot, l0);
    if (na == 0) return;
    int g = blockIdx.y;
    if (threadIdx.x < na) {
        xrow[threadIdx.x] = x + (long long)(l0 + threadIdx.x) * ldx + (long long)g * xg;
        ybase[threadIdx.x] = (long long)(l0 + threadIdx.x) * ldy + g * gs;
    }
    long long rb = mv3_row_bytes(WT, K);
    mv3_rows<WT, R, U>(W + (long long)g * N * rb, rb, N, 0, K, na, xrow, ybase, y, xs4, blockIdx.x);
}

// Fixed K-split for matrices with few rows and long rows (hc projections, router):
// block z of the grid's third dimension takes columns [z*KS, z*KS + KS) and writes
// part[(z*LS + l)*N + r] (LS = lanes rounded up to whole groups); ds4_matvec3_ksum adds
// the splits in z order. KS depends only on the shape, so a lane's sum is the same alone
// or among 16 or 256.
template <int WT, int R, int U>
DS4_BODY void mv3_split_body(const ds4_u8* W, const float* x, float* part, int N, int K, int L, int ldx,
                               const int* lane_slot, int KS) {
    __shared__ float4 xs4[MV3_XS / 4];
    __shared__ const float* xrow[MV_LANES];
    __shared__ long long ybase[MV_LANES];
    int nlg = mv3_groups(L), l0 = (int)blockIdx.y * MV_LANES;
    int na = mv3_group_active(L, lane_slot, l0);
    if (na == 0) return;
    int z = blockIdx.z;
    if (threadIdx.x < na) {
        xrow[threadIdx.x] = x + (long long)(l0 + threadIdx.x) * ldx;
        ybase[threadIdx.x] = ((long long)z * nlg * MV_LANES + l0 + threadIdx.x) * N;
    }
    int cbeg = z * KS, clen = K - cbeg < KS ? K - cbeg : KS;
    mv3_rows<WT, R, U>(W, mv3_row_bytes(WT, K), N, cbeg, clen, na, xrow, ybase, part, xs4, blockIdx.x);
}

extern "C" __global__ void ds4_matvec3_ksum(const float* __restrict__ part, float* __restrict__ y, int N, int L,
                                            int ldy, int nsplit, const int* lane_slot) {
    DS4_KERNEL_ENTRY;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int a = (int)(idx / N), r = (int)(idx % N);
    if (a >= L || (lane_slot && lane_slot[a] < 0)) return;  // padding lanes sit after the rows
    int ls = mv3_groups(L) * MV_LANES;
    float s = 0.0f;
    for (int z = 0; z < nsplit; ++z) s += part[((long long)z * ls + a) * N + r];
    y[(long long)a * ldy + r] = s;
}

#define DS4_MATVEC3(NAME, WT, R, U)                                                                \
    extern "C" __global__ void __launch_bounds__(MV3_WARPS * DS4_WARP)                            \
        NAME(const ds4_u8* W, const float* x, float* y, int N, int K, int L, int ldx, int xg,     \
             int ldy, long long gs, const int* lane_slot) {                                        \
        DS4_KERNEL_ENTRY_PREFETCH(W, N, MV3_WARPS * R, mv3_row_bytes(WT, K));                         \
        mv3_body<WT, R, U>(W, x, y, N, K, L, ldx, xg, ldy, gs, lane_slot);                         \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MV3_WARPS * DS4_WARP)                            \
        NAME##_ks(const ds4_u8* W, const float* x, float* part, int N, int K, int L, int ldx,     \
                  const int* lane_slot, int KS) {                                                  \
        DS4_KERNEL_ENTRY;                                                                          \
        mv3_split_body<WT, R, U>(W, x, part, N, K, L, ldx, lane_slot, KS);                         \
    }

DS4_MATVEC3(ds4_matvec3_f32_r1, WT_F32, 1, 4)
DS4_MATVEC3(ds4_matvec3_f32_r2, WT_F32, 2, 2)
DS4_MATVEC3(ds4_matvec3_f32_r4, WT_F32, 4, 1)
DS4_MATVEC3(ds4_matvec3_f16_r1, WT_F16, 1, 8)
DS4_MATVEC3(ds4_matvec3_f16_r2, WT_F16, 2, 4)
DS4_MATVEC3(ds4_matvec3_f16_r4, WT_F16, 4, 2)
DS4_MATVEC3(ds4_matvec3_bf16_r1, WT_BF16, 1, 8)
DS4_MATVEC3(ds4_matvec3_bf16_r2, WT_BF16, 2, 4)
DS4_MATVEC3(ds4_matvec3_bf16_r4, WT_BF16, 4, 2)
DS4_MATVEC3(ds4_matvec3_q8_0_r1, WT_Q8_0, 1, 2 * MV3_U_Q8)
DS4_MATVEC3(ds4_matvec3_q8_0_r2, WT_Q8_0, 2, MV3_U_Q8)
DS4_MATVEC3(ds4_matvec3_q8_0_r4, WT_Q8_0, 4, 2)
DS4_MATVEC3(ds4_matvec3_q2_k_r1, WT_Q2_K, 1, 2 * MV3_U_LOWBIT)
DS4_MATVEC3(ds4_matvec3_q2_k_r2, WT_Q2_K, 2, MV3_U_LOWBIT)
DS4_MATVEC3(ds4_matvec3_q4_k_r1, WT_Q4_K, 1, 2 * MV3_U_LOWBIT)
DS4_MATVEC3(ds4_matvec3_q4_k_r2, WT_Q4_K, 2, MV3_U_LOWBIT)
DS4_MATVEC3(ds4_matvec3_iq2_xxs_r1, WT_IQ2_XXS, 1, 2 * MV3_U_LOWBIT)
DS4_MATVEC3(ds4_matvec3_iq2_xxs_r2, WT_IQ2_XXS, 2, MV3_U_LOWBIT)
DS4_MATVEC3(ds4_matvec3_mxfp4_r1, WT_MXFP4, 1, 2 * MV3_U_LOWBIT)
DS4_MATVEC3(ds4_matvec3_mxfp4_r2, WT_MXFP4, 2, MV3_U_LOWBIT)
