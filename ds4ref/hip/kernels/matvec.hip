// Batched matvec for up to 16 lanes: y[l, g*N + r] = sum_k W[g*N + r, k] * x[l, g*xg + k].
//
// Each weight row is read ONCE for all lanes: the lanes' activations are staged
// in shared memory a chunk of MV_KC columns at a time, and every weight load
// (8 values: 16 bytes of f16/bf16, 32 of f32, 8 quants + scale of Q8_0) is
// multiplied into all lanes' accumulators.
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
#define MV_KC 512   // columns staged per chunk: 16 lanes * 512 * 4 B = 32 KiB
#define MV_WARPS 8
#define MV_RPW 2    // rows per warp: 16 rows per block

#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
#define WT_Q8_0 3

// 8 consecutive weights of row `row` starting at column `col` (col % 8 == 0).
template <int WT>
__device__ __forceinline__ void mv_load8(const ds4_u8* __restrict__ W, long long row, int K, int col, float* w) {
    if (WT == WT_F32) {
        const float4* p = (const float4*)(W + (row * K + col) * 4);
        float4 a = p[0], b = p[1];
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    } else if (WT == WT_F16 || WT == WT_BF16) {
        uint4 u = *(const uint4*)(W + (row * K + col) * 2);
        ds4_u32 parts[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            ds4_u16 lo = (ds4_u16)(parts[t] & 0xffffu), hi = (ds4_u16)(parts[t] >> 16);
            w[2 * t] = WT == WT_F16 ? ds4_f16_to_f32(lo) : ds4_bf16_to_f32(lo);
            w[2 * t + 1] = WT == WT_F16 ? ds4_f16_to_f32(hi) : ds4_bf16_to_f32(hi);
        }
    } else {  // Q8_0: blocks of 32 values, f16 scale then 32 int8; 34 bytes, 2-byte aligned
        long long row_bytes = (long long)(K / 32) * 34;
        const ds4_u8* blk = W + row * row_bytes + (long long)(col / 32) * 34;
        float d = ds4_f16_to_f32(*(const ds4_u16*)blk);
        const ds4_u16* q = (const ds4_u16*)(blk + 2 + (col % 32));
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            ds4_u16 pair = q[t];
            // d * q is exact in f32 (11-bit * 8-bit mantissas): same as dequantising first
            w[2 * t] = d * (float)(ds4_i8)(pair & 0xffu);
            w[2 * t + 1] = d * (float)(ds4_i8)(pair >> 8);
        }
    }
}

template <int WT>
__device__ void mv_body(const ds4_u8* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
                        int N, int K, int L, int ldx, int xg, int ldy) {
    __shared__ __align__(16) float xs[MV_LANES * MV_KC];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int g = blockIdx.y;
    int row0 = blockIdx.x * (MV_WARPS * MV_RPW) + warp * MV_RPW;
    float acc[MV_RPW][MV_LANES];
#pragma unroll
    for (int i = 0; i < MV_RPW; ++i)
#pragma unroll
        for (int l = 0; l < MV_LANES; ++l) acc[i][l] = 0.0f;
    const float* xg_base = x + (long long)g * xg;

    for (int c0 = 0; c0 < K; c0 += MV_KC) {
        int kc = K - c0 < MV_KC ? K - c0 : MV_KC;
        __syncthreads();  // previous chunk fully consumed
        for (int l = 0; l < L; ++l)
            for (int j = threadIdx.x; j < kc; j += blockDim.x)
                xs[l * MV_KC + j] = xg_base[(long long)l * ldx + c0 + j];
        __syncthreads();
#pragma unroll
        for (int i = 0; i < MV_RPW; ++i) {
            int r = row0 + i;
            if (r >= N) break;
            long long grow = (long long)g * N + r;
            for (int j0 = lane * 8; j0 < kc; j0 += DS4_WARP * 8) {
                float w[8];
                mv_load8<WT>(W, grow, K, c0 + j0, w);
#pragma unroll
                for (int l = 0; l < MV_LANES; ++l) {
                    if (l < L) {
                        const float4* xp = (const float4*)(xs + l * MV_KC + j0);
                        float4 a = xp[0], b = xp[1];
                        float s = acc[i][l];
                        s += w[0] * a.x; s += w[1] * a.y; s += w[2] * a.z; s += w[3] * a.w;
                        s += w[4] * b.x; s += w[5] * b.y; s += w[6] * b.z; s += w[7] * b.w;
                        acc[i][l] = s;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MV_RPW; ++i) {
        int r = row0 + i;
        if (r >= N) break;
#pragma unroll
        for (int l = 0; l < MV_LANES; ++l) {
            if (l < L) {
                float s = ds4_warp_sum(acc[i][l]);
                if (lane == l) y[(long long)l * ldy + (long long)g * N + r] = s;
            }
        }
    }
}

#define DS4_MATVEC(NAME, WT)                                                                      \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * DS4_WARP)                            \
        NAME(const ds4_u8* W, const float* x, float* y, int N, int K, int L, int ldx, int xg,    \
             int ldy) {                                                                           \
        mv_body<WT>(W, x, y, N, K, L, ldx, xg, ldy);                                              \
    }

DS4_MATVEC(ds4_matvec_f32, WT_F32)
DS4_MATVEC(ds4_matvec_f16, WT_F16)
DS4_MATVEC(ds4_matvec_bf16, WT_BF16)
DS4_MATVEC(ds4_matvec_q8_0, WT_Q8_0)

// ---------------------------------------------------------------------------
// v2: the same per-row arithmetic (so results are bitwise equal to v1), arranged
// for memory-level parallelism:
//   * the staged chunk is KC = 8192 / L columns (a multiple of 256), so one lane
//     stages up to 8192 columns and a 4096-wide row needs one barrier pair;
//   * a warp issues the weight loads of U steps x RPW rows before any FMA, so
//     several 16-byte loads are in flight per lane;
//   * each staged activation is read once per step and used for all RPW rows.
// A lane's column set and order are independent of KC (lane t always takes
// columns t*8 + 256*m in increasing m), so batch invariance is kept.
// ---------------------------------------------------------------------------
template <int WT, int RPW>
__device__ void mv2_body(const ds4_u8* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
                         int N, int K, int L, int ldx, int xg, int ldy, int KC) {
    constexpr int U = 8 / RPW;  // steps whose loads are issued together
    __shared__ __align__(16) float xs[MV_LANES * MV_KC];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int g = blockIdx.y;
    int row0 = blockIdx.x * (MV_WARPS * RPW) + warp * RPW;
    float acc[RPW][MV_LANES];
#pragma unroll
    for (int i = 0; i < RPW; ++i)
#pragma unroll
        for (int l = 0; l < MV_LANES; ++l) acc[i][l] = 0.0f;
    const float* xg_base = x + (long long)g * xg;

    for (int c0 = 0; c0 < K; c0 += KC) {
        int kc = K - c0 < KC ? K - c0 : KC;
        __syncthreads();
        for (int l = 0; l < L; ++l)
            for (int j = threadIdx.x; j < kc; j += blockDim.x)
                xs[l * KC + j] = xg_base[(long long)l * ldx + c0 + j];
        __syncthreads();
        for (int s0 = 0; s0 * DS4_WARP * 8 < kc; s0 += U) {
            float w[RPW][U][8];
#pragma unroll
            for (int i = 0; i < RPW; ++i)
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    int j0 = lane * 8 + (s0 + u) * DS4_WARP * 8;
                    if (row0 + i < N && j0 < kc) {
                        mv_load8<WT>(W, (long long)g * N + row0 + i, K, c0 + j0, w[i][u]);
                    } else {
#pragma unroll
                        for (int t = 0; t < 8; ++t) w[i][u][t] = 0.0f;
                    }
                }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                int j0 = lane * 8 + (s0 + u) * DS4_WARP * 8;
                if (j0 >= kc) continue;
#pragma unroll
                for (int l = 0; l < MV_LANES; ++l) {
                    if (l < L) {
                        const float4* xp = (const float4*)(xs + l * KC + j0);
                        float4 a = xp[0], b = xp[1];
#pragma unroll
                        for (int i = 0; i < RPW; ++i) {
                            float s = acc[i][l];
                            s += w[i][u][0] * a.x; s += w[i][u][1] * a.y; s += w[i][u][2] * a.z; s += w[i][u][3] * a.w;
                            s += w[i][u][4] * b.x; s += w[i][u][5] * b.y; s += w[i][u][6] * b.z; s += w[i][u][7] * b.w;
                            acc[i][l] = s;
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        int r = row0 + i;
        if (r >= N) break;
#pragma unroll
        for (int l = 0; l < MV_LANES; ++l) {
            if (l < L) {
                float s = ds4_warp_sum(acc[i][l]);
                if (lane == l) y[(long long)l * ldy + (long long)g * N + r] = s;
            }
        }
    }
}

#define DS4_MATVEC2(NAME, WT, RPW)                                                                \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * DS4_WARP)                            \
        NAME(const ds4_u8* W, const float* x, float* y, int N, int K, int L, int ldx, int xg,    \
             int ldy, int KC) {                                                                   \
        mv2_body<WT, RPW>(W, x, y, N, K, L, ldx, xg, ldy, KC);                                    \
    }

DS4_MATVEC2(ds4_matvec2_f32_r1, WT_F32, 1)
DS4_MATVEC2(ds4_matvec2_f32_r2, WT_F32, 2)
DS4_MATVEC2(ds4_matvec2_f32_r4, WT_F32, 4)
DS4_MATVEC2(ds4_matvec2_f16_r1, WT_F16, 1)
DS4_MATVEC2(ds4_matvec2_f16_r2, WT_F16, 2)
DS4_MATVEC2(ds4_matvec2_f16_r4, WT_F16, 4)
DS4_MATVEC2(ds4_matvec2_bf16_r1, WT_BF16, 1)
DS4_MATVEC2(ds4_matvec2_bf16_r2, WT_BF16, 2)
DS4_MATVEC2(ds4_matvec2_bf16_r4, WT_BF16, 4)
DS4_MATVEC2(ds4_matvec2_q8_0_r1, WT_Q8_0, 1)
DS4_MATVEC2(ds4_matvec2_q8_0_r2, WT_Q8_0, 2)
DS4_MATVEC2(ds4_matvec2_q8_0_r4, WT_Q8_0, 4)

// ---------------------------------------------------------------------------
// v3: the same per-row arithmetic again (bitwise equal to v1/v2), rebuilt so the
// shared-memory traffic per weight shrinks and padding lanes cost nothing:
//   * activations are staged swizzled: for one 256-column step, the first float4 of
//     every warp lane's 8 columns sits in 128 contiguous floats and the second float4
//     in the next 128, so each LDS.128 of a warp reads 512 contiguous bytes (no bank
//     conflict; v1/v2 read at a 32-byte stride, 2-way conflicted);
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

// y[l, g*N + r] = W[g*N + r] . x[l, g*xg : g*xg + K]. Grid (ceil(N / (8R)), groups, lane groups).
template <int WT, int R, int U>
__device__ void mv3_body(const ds4_u8* W, const float* x, float* y, int N, int K, int L, int ldx, int xg,
                         int ldy, const int* lane_slot) {
    __shared__ float4 xs4[MV3_XS / 4];
    __shared__ const float* xrow[MV_LANES];
    __shared__ long long ybase[MV_LANES];
    int l0 = (int)blockIdx.z * MV_LANES;
    int na = mv3_group_active(L, lane_slot, l0);
    if (na == 0) return;
    int g = blockIdx.y;
    if (threadIdx.x < na) {
        xrow[threadIdx.x] = x + (long long)(l0 + threadIdx.x) * ldx + (long long)g * xg;
        ybase[threadIdx.x] = (long long)(l0 + threadIdx.x) * ldy + (long long)g * N;
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
__device__ void mv3_split_body(const ds4_u8* W, const float* x, float* part, int N, int K, int L, int ldx,
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
             int ldy, const int* lane_slot) {                                                      \
        mv3_body<WT, R, U>(W, x, y, N, K, L, ldx, xg, ldy, lane_slot);                             \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MV3_WARPS * DS4_WARP)                            \
        NAME##_ks(const ds4_u8* W, const float* x, float* part, int N, int K, int L, int ldx,     \
                  const int* lane_slot, int KS) {                                                  \
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
