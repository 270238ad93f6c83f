// qdot.hip - products with block-quantised weights in `official` numerics
// (docs/exactness.md, "Quantised products"; canon.quantize_q8 / canon.qlinear):
//   * every input row is quantised per 32-column block to int8 (ds4_quantize_q8);
//   * each block's dot with a weight block is an exact integer sum (dp4a), so its order
//     cannot matter and any integer unit gives the same bits;
//   * block b of a row ends as t_b = s1 * A_b - s2 * B_b (three roundings) and goes into
//     partial b % 32 as fma(dx_b, t_b, partial) in increasing b; the 32 partials are
//     combined by the warp's xor butterfly. Warp lane t owns partial t, so the lane that
//     computes block b is the lane that adds it: no exchange, no other order.
// A row's result depends only on its own data: never on its lane, on the other rows of
// the pass, on how many rows are active or on how the columns are staged.
//
// Weights are the GGUF blocks, the unaligned ones repacked at upload so that a lane's
// block is one aligned load (ops.pack_qrows): Q8_0 rows as [K int8][K/32 f16 d],
// IQ2_XXS as [K/32 x (u32 grid indices, u32 signs + scale)][K/256 f16 d], MXFP4 as
// [K/32 x 16 code bytes][K/32 E8M0 bytes], Q2_K as [K/32 x 8 code bytes][K/16 scale
// bytes][K/256 x (f16 d, f16 dmin)], each row padded to 16 bytes. Q4_K keeps the file's
// (16-byte aligned) super-blocks.
#include "ds4_mv3.h"
#include "ds4_q8.h"
#include "ds4_qblock.h"

#define MQ_WARPS 8
#define MQ_SMEM 40960     // staged bytes per block: int8 codes, their scales and half sums
#define MQ_CHUNK_UNIT 1024  // a chunk starts at a multiple of 32 blocks, so lane t keeps block b % 32 == t

// Blocks per lane whose weight bytes are loaded before any is used.
// 1, 2 and 4 measured within a few per cent of each other on the H200 (the expert products at
// 1, 16 and 256 lanes), 2 the fastest for IQ2_XXS at 1 and 16; more cost registers.
#ifndef MQ_AHEAD
#define MQ_AHEAD 2
#endif
// Blocks a multiprocessor the registers must allow: 1 measured 20-60 % slower.
#ifndef MQ_MIN_BLOCKS
#define MQ_MIN_BLOCKS 2
#endif
// A routed-expert block's work items: a contiguous run (1), reusing an entry's staged inputs,
// or every gridDim.x-th (0), so that the blocks running at once share an expert. Measured on
// the H200 (op-case table, 1 / 16 / 256 lanes): IQ2_XXS gate 34.7 / 271 / 1623 us strided against
// 37.7 / 264 / 2049 contiguous, Q2_K down 35.4 / 332 / 2202 against 33.1 / 257 / 2021.
#ifndef QX_CONTIGUOUS_NARROW
#define QX_CONTIGUOUS_NARROW 0  // IQ2_XXS, MXFP4
#endif
#ifndef QX_CONTIGUOUS_WIDE
#define QX_CONTIGUOUS_WIDE 1    // Q8_0, Q2_K, Q4_K
#endif

// Rows of row block rblk (8*R rows, rb bytes apart from Wb) for na inputs: input a's codes at
// xq + xoff[a] (K bytes), its scales at dx + doff[a] and half sums at xs + soff[a] (element
// offsets), and y[ybase[a] + r] receives row r's product. xoff/doff/soff/ybase live in shared
// memory and are written before the first barrier here. With reuse, smem already holds these
// inputs from the previous call (same inputs, all of K staged): nothing is staged again.
// A lane loads the weight bytes of up to MQ_AHEAD of its blocks before decoding any, and the
// first of those loads are issued before the inputs are staged, so the memory latencies overlap;
// the lane's blocks still enter its partial in increasing order.
template <int WT, int R>
__device__ __forceinline__ void mq_rows(const ds4_u8* __restrict__ Wb, long long rb, int N, int K, int na,
                                        const ds4_i8* __restrict__ xq, const float* __restrict__ dx,
                                        const short* __restrict__ xs, const long long* xoff, const long long* doff,
                                        const long long* soff, const long long* ybase, float* __restrict__ y,
                                        ds4_u8* smem, int rblk, const Iq2Tables* iq2, bool reuse) {
    const bool has_min = QHasMin<WT>::value;
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int row0 = rblk * (MQ_WARPS * R) + warp * R;
    // bytes staged per column and input: the code, a quarter of the block scale, and (with
    // mins) an eighth of the half sum
    int per16 = has_min ? 20 : 18;  // per 16 columns: 16 codes + 2 (scale) + 2 (half sum)
    int KC = (MQ_SMEM / na) / per16 * 16 / MQ_CHUNK_UNIT * MQ_CHUNK_UNIT;
    if (KC > K) KC = K;
    bool stage = !reuse || KC < K;
    float acc[R][MV_LANES];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int a = 0; a < MV_LANES; ++a) acc[i][a] = 0.0f;
    const ds4_u8* rowp[R];
#pragma unroll
    for (int i = 0; i < R; ++i) rowp[i] = Wb + (long long)(row0 + i < N ? row0 + i : 0) * rb;
    // [na][KC] codes, each chunk's 16-byte halves apart: [nb first halves][nb second halves], so
    // the lanes' loads of consecutive blocks are consecutive (a 32-byte stride conflicts 2-way)
    ds4_i8* sq = (ds4_i8*)smem;
    float* sd = (float*)(smem + na * KC);          // [na][KC/32] block scales
    short* ss = (short*)(sd + na * (KC / QB));     // [na][KC/16] half sums

    for (int c0 = 0; c0 < K; c0 += KC) {
        int kc = K - c0 < KC ? K - c0 : KC;
        int nb = kc / QB;
        for (int r0 = 0; r0 < nb; r0 += MQ_AHEAD * DS4_WARP) {
            QRaw<WT> raw[MQ_AHEAD][R];
#pragma unroll
            for (int j = 0; j < MQ_AHEAD; ++j) {
                int lb = r0 + j * DS4_WARP + lane;
                if (lb < nb)
#pragma unroll
                    for (int i = 0; i < R; ++i) qr_load<WT>(rowp[i], K, c0 / QB + lb, raw[j][i]);
            }
            if (r0 == 0 && stage) {
                __syncthreads();  // the previous chunk is consumed (and the offsets are visible)
                int n16 = kc / 16;
                for (int e = threadIdx.x; e < na * n16; e += blockDim.x) {  // 16 codes per 16-byte load
                    int a = e / n16, j = e - a * n16;
                    ((uint4*)(sq + (long long)a * KC))[(j & 1) * nb + (j >> 1)] = ((const uint4*)(xq + xoff[a] + c0))[j];
                }
                for (int e = threadIdx.x; e < na * nb; e += blockDim.x) {
                    int a = e / nb, j = e - a * nb;
                    sd[a * (KC / QB) + j] = dx[doff[a] + c0 / QB + j];
                }
                if (has_min)
                    for (int e = threadIdx.x; e < na * n16; e += blockDim.x) {
                        int a = e / n16, j = e - a * n16;
                        ss[a * (KC / 16) + j] = xs[soff[a] + c0 / 16 + j];
                    }
                __syncthreads();
            }
#pragma unroll
            for (int j = 0; j < MQ_AHEAD; ++j) {
                int lb = r0 + j * DS4_WARP + lane;
                if (lb >= nb) DS4_UNROLLED_EXIT;
                int b = c0 / QB + lb;
                QBlock w[R];
#pragma unroll
                for (int i = 0; i < R; ++i) qr_decode<WT>(raw[j][i], b, w[i], iq2);
                const uint4* xp = (const uint4*)sq + lb;
#pragma unroll
                for (int a = 0; a < MV_LANES; ++a) {
                    if (a >= na) DS4_UNROLLED_EXIT;
                    uint4 x0 = xp[a * (KC / 16)], x1 = xp[a * (KC / 16) + nb];
                    float d = sd[a * (KC / QB) + lb];
                    int X0 = 0, X1 = 0;
                    if (has_min) {
                        X0 = ss[a * (KC / 16) + 2 * lb];
                        X1 = ss[a * (KC / 16) + 2 * lb + 1];
                    }
#pragma unroll
                    for (int i = 0; i < R; ++i) {
                        int S0 = ds4_dp4a(w[i].c[0], (int)x0.x, 0);
                        S0 = ds4_dp4a(w[i].c[1], (int)x0.y, S0);
                        S0 = ds4_dp4a(w[i].c[2], (int)x0.z, S0);
                        S0 = ds4_dp4a(w[i].c[3], (int)x0.w, S0);
                        // without per-half multipliers the halves share one integer sum (the same value)
                        int S1 = ds4_dp4a(w[i].c[4], (int)x1.x, has_min ? 0 : S0);
                        S1 = ds4_dp4a(w[i].c[5], (int)x1.y, S1);
                        S1 = ds4_dp4a(w[i].c[6], (int)x1.z, S1);
                        S1 = ds4_dp4a(w[i].c[7], (int)x1.w, S1);
                        int A = has_min ? w[i].mul0 * S0 + w[i].mul1 * S1 : S1;
                        float t = w[i].s1 * (float)A;
                        if (has_min) t = t - w[i].s2 * (float)(w[i].mn0 * X0 + w[i].mn1 * X1);
                        acc[i][a] = fmaf(d, t, acc[i][a]);
                    }
                }
            }
        }
    }
    mv3_store_sums<R>(acc, na, row0, N, ybase, y);
}

// Dense: y[l*ldy + g*gs + r] = W[g*N + r] . x[l, g*xg : g*xg + K], x quantised with rows W columns
// wide (xq row l at l*W). Grid (up to ceil(N / (8R)), groups, lane groups of 16): a block takes row
// blocks blockIdx.x, + gridDim.x, ..., staging its inputs once where they fit whole (ops.qmatvec_grid);
// gs as matvec.hip's.
template <int WT, int R>
DS4_BODY void mq_body(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs,
                        float* y, int N, int K, int L, int Wx, int xg, int ldy, long long gs, const int* lane_slot) {
    __shared__ __align__(16) ds4_u8 smem[MQ_SMEM];
    __shared__ long long xoff[MV_LANES], doff[MV_LANES], soff[MV_LANES], ybase[MV_LANES];
    __shared__ Iq2Tables iq2[1];  // unused (and dropped) for the other types
    int l0 = (int)blockIdx.z * MV_LANES;
    int n = L - l0 < MV_LANES ? L - l0 : MV_LANES;
    int na = mv3_active(n, lane_slot ? lane_slot + l0 : lane_slot);
    if (na == 0) return;
    if (WT == WT_IQ2_XXS) iq2_tables_fill(iq2);  // visible after the staging's first barrier
    int g = blockIdx.y;
    if (threadIdx.x < na) {
        long long l = l0 + threadIdx.x;
        xoff[threadIdx.x] = l * Wx + (long long)g * xg;
        doff[threadIdx.x] = (l * Wx + (long long)g * xg) / QB;
        soff[threadIdx.x] = (l * Wx + (long long)g * xg) / 16;
        ybase[threadIdx.x] = l * ldy + g * gs;
    }
    int rblocks = (N + MQ_WARPS * R - 1) / (MQ_WARPS * R);
    for (int rblk = blockIdx.x; rblk < rblocks; rblk += gridDim.x)
        mq_rows<WT, R>(W + (long long)g * N * rb, rb, N, K, na, xq, dx, xs, xoff, doff, soff, ybase, y, smem,
                       rblk, iq2, rblk != (int)blockIdx.x);
}

#define DS4_QMATVEC(NAME, WT, R)                                                                      \
    extern "C" __global__ void __launch_bounds__(MQ_WARPS * DS4_WARP, MQ_MIN_BLOCKS)                              \
        NAME(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs, float* y,  \
             int N, int K, int L, int Wx, int xg, int ldy, long long gs, const int* lane_slot) {          \
        DS4_KERNEL_ENTRY_PREFETCH(W, N, MQ_WARPS * R, rb);                                              \
        mq_body<WT, R>(W, rb, xq, dx, xs, y, N, K, L, Wx, xg, ldy, gs, lane_slot);                      \
    }

DS4_QMATVEC(ds4_qmatvec_q8_0_r1, WT_Q8_0, 1)
DS4_QMATVEC(ds4_qmatvec_q8_0_r2, WT_Q8_0, 2)
DS4_QMATVEC(ds4_qmatvec_q2_k_r1, WT_Q2_K, 1)
DS4_QMATVEC(ds4_qmatvec_q2_k_r2, WT_Q2_K, 2)
DS4_QMATVEC(ds4_qmatvec_q4_k_r1, WT_Q4_K, 1)
DS4_QMATVEC(ds4_qmatvec_q4_k_r2, WT_Q4_K, 2)
DS4_QMATVEC(ds4_qmatvec_iq2_xxs_r1, WT_IQ2_XXS, 1)
DS4_QMATVEC(ds4_qmatvec_iq2_xxs_r2, WT_IQ2_XXS, 2)
DS4_QMATVEC(ds4_qmatvec_mxfp4_r1, WT_MXFP4, 1)
DS4_QMATVEC(ds4_qmatvec_mxfp4_r2, WT_MXFP4, 2)

// Routed experts (step_ops.hip's ex3_body with quantised inputs): work entries of the expert
// list (expert id, pair count, up to 16 (lane, choice) pairs), each item one row block of the
// expert. Input of pair lt: row lt (x_per_choice) or lt / kk of the quantised rows, K wide.
// A pair's sum does not depend on the other pairs of its entry: its own accumulators, its blocks
// in one order for any na (a chunk starts at a multiple of MQ_CHUNK_UNIT columns).

template <int WT, int R>
DS4_BODY void qx_body(const ds4_u8* __restrict__ W, long long rb, const ds4_i8* xq, const float* dx,
                        const short* xs, int x_per_choice, const int* __restrict__ list, float* __restrict__ y,
                        int N, int K, int kk) {
    __shared__ __align__(16) ds4_u8 smem[MQ_SMEM];
    __shared__ long long xoff[EL_PAIRS], doff[EL_PAIRS], soff[EL_PAIRS], ybase[EL_PAIRS];
    __shared__ Iq2Tables iq2[1];
    if (WT == WT_IQ2_XXS) iq2_tables_fill(iq2);  // visible after the first item's staging barrier
    // Consecutive items of a block that share an entry reuse its staged inputs (contiguous runs).
    int rblocks = (N + MQ_WARPS * R - 1) / (MQ_WARPS * R);
    int n_items = list[0] * rblocks;
    const bool contiguous = WT == WT_IQ2_XXS || WT == WT_MXFP4 ? QX_CONTIGUOUS_NARROW : QX_CONTIGUOUS_WIDE;
    int per = contiguous ? (n_items + gridDim.x - 1) / gridDim.x : 1;
    int step = contiguous ? 1 : gridDim.x;
    int w1 = contiguous && (blockIdx.x + 1) * per < n_items ? (blockIdx.x + 1) * per : n_items;
    int staged = -1;
    for (int w = blockIdx.x * per; w < w1; w += step) {
        int u = w / rblocks;
        const int* ent = list + 1 + u * EL_STRIDE;
        int na = ent[1];
        if (u != staged) {
            __syncthreads();  // the previous item no longer reads the offsets or the staged inputs
            if (threadIdx.x < na) {
                long long lt = ent[2 + threadIdx.x];
                long long row = x_per_choice ? lt : lt / kk;
                xoff[threadIdx.x] = row * K;
                doff[threadIdx.x] = row * (K / QB);
                soff[threadIdx.x] = row * (K / 16);
                ybase[threadIdx.x] = lt * N;
            }
        }
        mq_rows<WT, R>(W + (long long)ent[0] * N * rb, rb, N, K, na, xq, dx, xs, xoff, doff, soff, ybase, y,
                       smem, w % rblocks, iq2, u == staged);
        staged = u;
    }
}

#define DS4_QEXPERTS(NAME, WT, R)                                                                     \
    extern "C" __global__ void __launch_bounds__(MQ_WARPS * DS4_WARP, MQ_MIN_BLOCKS)                              \
        NAME(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs,          \
             int x_per_choice, const int* list, float* y, int N, int K, int kk) {                        \
        DS4_KERNEL_ENTRY;                                                                                \
        qx_body<WT, R>(W, rb, xq, dx, xs, x_per_choice, list, y, N, K, kk);                              \
    }

DS4_QEXPERTS(ds4_qexperts_q8_0_r1, WT_Q8_0, 1)
DS4_QEXPERTS(ds4_qexperts_q8_0_r2, WT_Q8_0, 2)
DS4_QEXPERTS(ds4_qexperts_q2_k_r1, WT_Q2_K, 1)
DS4_QEXPERTS(ds4_qexperts_q2_k_r2, WT_Q2_K, 2)
DS4_QEXPERTS(ds4_qexperts_q4_k_r1, WT_Q4_K, 1)
DS4_QEXPERTS(ds4_qexperts_q4_k_r2, WT_Q4_K, 2)
DS4_QEXPERTS(ds4_qexperts_iq2_xxs_r1, WT_IQ2_XXS, 1)
DS4_QEXPERTS(ds4_qexperts_iq2_xxs_r2, WT_IQ2_XXS, 2)
DS4_QEXPERTS(ds4_qexperts_mxfp4_r1, WT_MXFP4, 1)
DS4_QEXPERTS(ds4_qexperts_mxfp4_r2, WT_MXFP4, 2)
