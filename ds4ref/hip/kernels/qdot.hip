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

// Rows of row block rblk (8*R rows, rb bytes apart from Wb) for na inputs: input a's codes at
// xq + xoff[a] (K bytes), its scales at dx + doff[a] and half sums at xs + soff[a] (element
// offsets), and y[ybase[a] + r] receives row r's product. xoff/doff/soff/ybase live in shared
// memory and are written before the first barrier here.
template <int WT, int R>
__device__ __forceinline__ void mq_rows(const ds4_u8* __restrict__ Wb, long long rb, int N, int K, int na,
                                        const ds4_i8* __restrict__ xq, const float* __restrict__ dx,
                                        const short* __restrict__ xs, const long long* xoff, const long long* doff,
                                        const long long* soff, const long long* ybase, float* __restrict__ y,
                                        ds4_u8* smem, int rblk) {
    __shared__ Iq2Tables iq2[1];  // unused (and dropped) for the other types
    if (WT == WT_IQ2_XXS) iq2_tables_fill(iq2);  // visible after the chunk loop's first barrier
    const bool has_min = QHasMin<WT>::value;
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int row0 = rblk * (MQ_WARPS * R) + warp * R;
    // bytes staged per column and input: the code, a quarter of the block scale, and (with
    // mins) an eighth of the half sum
    int per16 = has_min ? 20 : 18;  // per 16 columns: 16 codes + 2 (scale) + 2 (half sum)
    int KC = (MQ_SMEM / na) / per16 * 16 / MQ_CHUNK_UNIT * MQ_CHUNK_UNIT;
    if (KC > K) KC = K;
    float acc[R][MV_LANES];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int a = 0; a < MV_LANES; ++a) acc[i][a] = 0.0f;
    const ds4_u8* rowp[R];
#pragma unroll
    for (int i = 0; i < R; ++i) rowp[i] = Wb + (long long)(row0 + i < N ? row0 + i : 0) * rb;
    ds4_i8* sq = (ds4_i8*)smem;                    // [na][KC] codes
    float* sd = (float*)(smem + na * KC);          // [na][KC/32] block scales
    short* ss = (short*)(sd + na * (KC / QB));     // [na][KC/16] half sums

    for (int c0 = 0; c0 < K; c0 += KC) {
        int kc = K - c0 < KC ? K - c0 : KC;
        int nb = kc / QB;
        __syncthreads();  // the previous chunk is consumed (and the offsets are visible)
        int n16 = kc / 16;
        for (int e = threadIdx.x; e < na * n16; e += blockDim.x) {  // 16 codes per 16-byte load
            int a = e / n16, j = e - a * n16;
            ((uint4*)(sq + (long long)a * KC))[j] = ((const uint4*)(xq + xoff[a] + c0))[j];
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
        for (int lb = lane; lb < nb; lb += DS4_WARP) {
            int b = c0 / QB + lb;
            QBlock w[R];
#pragma unroll
            for (int i = 0; i < R; ++i) qb_load<WT>(rowp[i], K, b, w[i], iq2);
#pragma unroll
            for (int a = 0; a < MV_LANES; ++a) {
                if (a >= na) break;
                const uint4* xp = (const uint4*)(sq + (long long)a * KC + lb * QB);
                uint4 x0 = xp[0], x1 = xp[1];
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
                    int S1 = ds4_dp4a(w[i].c[4], (int)x1.x, 0);
                    S1 = ds4_dp4a(w[i].c[5], (int)x1.y, S1);
                    S1 = ds4_dp4a(w[i].c[6], (int)x1.z, S1);
                    S1 = ds4_dp4a(w[i].c[7], (int)x1.w, S1);
                    int A = w[i].mul0 * S0 + w[i].mul1 * S1;
                    float t = w[i].s1 * (float)A;
                    if (has_min) t = t - w[i].s2 * (float)(w[i].mn0 * X0 + w[i].mn1 * X1);
                    acc[i][a] = fmaf(d, t, acc[i][a]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
        int r = row0 + i;
        if (r >= N) break;
#pragma unroll
        for (int a = 0; a < MV_LANES; ++a) {
            if (a < na) {
                float s = ds4_warp_sum(acc[i][a]);
                if (lane == a) y[ybase[a] + r] = s;
            }
        }
    }
}

// Dense: y[l, g*N + r] = W[g*N + r] . x[l, g*xg : g*xg + K], x quantised with rows W columns
// wide (xq row l at l*W). Grid (ceil(N / (8R)), groups, lane groups of 16).
template <int WT, int R>
__device__ void mq_body(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs,
                        float* y, int N, int K, int L, int Wx, int xg, int ldy, const int* lane_slot) {
    __shared__ __align__(16) ds4_u8 smem[MQ_SMEM];
    __shared__ long long xoff[MV_LANES], doff[MV_LANES], soff[MV_LANES], ybase[MV_LANES];
    int l0 = (int)blockIdx.z * MV_LANES;
    int n = L - l0 < MV_LANES ? L - l0 : MV_LANES;
    int na = mv3_active(n, lane_slot ? lane_slot + l0 : lane_slot);
    if (na == 0) return;
    int g = blockIdx.y;
    if (threadIdx.x < na) {
        long long l = l0 + threadIdx.x;
        xoff[threadIdx.x] = l * Wx + (long long)g * xg;
        doff[threadIdx.x] = (l * Wx + (long long)g * xg) / QB;
        soff[threadIdx.x] = (l * Wx + (long long)g * xg) / 16;
        ybase[threadIdx.x] = l * ldy + (long long)g * N;
    }
    mq_rows<WT, R>(W + (long long)g * N * rb, rb, N, K, na, xq, dx, xs, xoff, doff, soff, ybase, y, smem,
                   blockIdx.x);
}

#define DS4_QMATVEC(NAME, WT, R)                                                                      \
    extern "C" __global__ void __launch_bounds__(MQ_WARPS * DS4_WARP)                                \
        NAME(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs, float* y,  \
             int N, int K, int L, int Wx, int xg, int ldy, const int* lane_slot) {                       \
        mq_body<WT, R>(W, rb, xq, dx, xs, y, N, K, L, Wx, xg, ldy, lane_slot);                          \
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
#define QX_PAIRS 16
#define QX_STRIDE (2 + QX_PAIRS)

template <int WT, int R>
__device__ void qx_body(const ds4_u8* __restrict__ W, long long rb, const ds4_i8* xq, const float* dx,
                        const short* xs, int x_per_choice, const int* __restrict__ list, float* __restrict__ y,
                        int N, int K, int kk) {
    __shared__ __align__(16) ds4_u8 smem[MQ_SMEM];
    __shared__ long long xoff[QX_PAIRS], doff[QX_PAIRS], soff[QX_PAIRS], ybase[QX_PAIRS];
    int rblocks = (N + MQ_WARPS * R - 1) / (MQ_WARPS * R);
    int n_items = list[0] * rblocks;
    for (int w = blockIdx.x; w < n_items; w += gridDim.x) {
        const int* ent = list + 1 + (w / rblocks) * QX_STRIDE;
        int na = ent[1];
        __syncthreads();  // the previous item no longer reads the offsets
        if (threadIdx.x < na) {
            long long lt = ent[2 + threadIdx.x];
            long long row = x_per_choice ? lt : lt / kk;
            xoff[threadIdx.x] = row * K;
            doff[threadIdx.x] = row * (K / QB);
            soff[threadIdx.x] = row * (K / 16);
            ybase[threadIdx.x] = lt * N;
        }
        mq_rows<WT, R>(W + (long long)ent[0] * N * rb, rb, N, K, na, xq, dx, xs, xoff, doff, soff, ybase, y,
                       smem, w % rblocks);
    }
}

#define DS4_QEXPERTS(NAME, WT, R)                                                                     \
    extern "C" __global__ void __launch_bounds__(MQ_WARPS * DS4_WARP)                                \
        NAME(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs,          \
             int x_per_choice, const int* list, float* y, int N, int K, int kk) {                        \
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

// ---- prompt passes: the same product on integer matrix units ----------------------------------
// Each half-block's integer dot S_h is an m16n8k16 int8 MMA (16 rows x 8 weight rows x 16
// columns), exact like dp4a, so the block results t_b and everything after them are the
// decode kernel's. The 32 partials keep their order too: partial p chains blocks b = p, p+32,
// ... in increasing b, and warp w of the 8 owns partials w, w+8, w+16 and w+24, whose first two
// butterfly steps (h = 16, 8) it adds itself; the last three (h = 4, 2, 1) run over the 8 warps'
// sums in shared memory. A block of the grid owns 32 rows x 16 weight rows; its 8 warps
// split the columns by partial, not the rows, so a row's result is formed exactly as in mq_rows.
#define QM_OUTS 16   // weight rows of a tile: two 8-row MMA tiles

// One partial's chain (blocks b = p, p + 32, ...) of a (16 MT) x 16 tile into acc[mi][ni][e],
// element e of C fragment (mi, ni) as in qm_mma16816. rowp[ni]: weight row g of 8-row tile ni;
// xr / dr / sr[2 mi + hr]: codes, block scales and half sums of input row g + 8 hr of tile mi.
template <int WT, int MT>
__device__ __forceinline__ void qm_chain(int p, int nb, const ds4_u8* const* rowp, int K,
                                         const ds4_i8* const* xr, const float* const* dr,
                                         const short* const* sr, float (&acc)[MT][2][4],
                                         const Iq2Tables* iq2) {
    const bool has_min = QHasMin<WT>::value;
    int t = threadIdx.x % 4;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
    for (int b = p; b < nb; b += DS4_WARP) {
        // this lane holds B words of weight row g; its C elements need the scales of rows
        // 2t and 2t + 1, which come from those rows' lanes
        int bw[2][2];
        float s1[2][2], s2[2][2];
        int mul[2][2][2], mn[2][2][2];
#pragma unroll
        for (int ni = 0; ni < 2; ++ni) {
            QBlock w;
            qm_load<WT>(rowp[ni], K, b, t, w, iq2);
            bw[ni][0] = w.c[0];
            bw[ni][1] = w.c[4];
            int packed = (w.mul0 & 0xff) | ((w.mul1 & 0xff) << 8) | ((w.mn0 & 0xff) << 16) | ((w.mn1 & 0xff) << 24);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                int src = 4 * (2 * t + j);
                s1[ni][j] = DS4_SHFL(w.s1, src);
                s2[ni][j] = DS4_SHFL(w.s2, src);
                int pk = DS4_SHFL(packed, src);
                mul[ni][j][0] = pk & 0xff; mul[ni][j][1] = (pk >> 8) & 0xff;
                mn[ni][j][0] = (pk >> 16) & 0xff; mn[ni][j][1] = (pk >> 24) & 0xff;
            }
        }
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
            int a[2][2];
            float d[2];
            int X[2][2] = {{0, 0}, {0, 0}};
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const ds4_i8* xp = xr[2 * mi + hr] + (long long)b * QB + 4 * t;
                a[hr][0] = *(const int*)xp;
                a[hr][1] = *(const int*)(xp + 16);
                d[hr] = dr[2 * mi + hr][b];
                if (has_min) {
                    X[hr][0] = sr[2 * mi + hr][2 * b];
                    X[hr][1] = sr[2 * mi + hr][2 * b + 1];
                }
            }
#pragma unroll
            for (int ni = 0; ni < 2; ++ni) {
                int S[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
                qm_mma16816(S[0], a[0][0], a[1][0], bw[ni][0]);
                qm_mma16816(S[1], a[0][1], a[1][1], bw[ni][1]);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int j = e % 2, hr = e / 2;
                    int A = mul[ni][j][0] * S[0][e] + mul[ni][j][1] * S[1][e];
                    float tb = s1[ni][j] * (float)A;
                    if (has_min) tb = tb - s2[ni][j] * (float)(mn[ni][j][0] * X[hr][0] + mn[ni][j][1] * X[hr][1]);
                    acc[mi][ni][e] = fmaf(d[hr], tb, acc[mi][ni][e]);
                }
            }
        }
    }
}

// The tile's 32 partials through the butterfly's first two steps into sums[warp] (row-major,
// 16 columns); p[w] + p[w+16] waits there, in this lane's own places, while the other pair runs.
template <int WT, int MT>
__device__ __forceinline__ void qm_tile(int nb, const ds4_u8* const* rowp, int K, const ds4_i8* const* xr,
                                        const float* const* dr, const short* const* sr,
                                        float (*sums)[32 * QM_OUTS], const Iq2Tables* iq2) {
    int warp = threadIdx.x / DS4_WARP, g = (threadIdx.x % DS4_WARP) / 4, t = threadIdx.x % 4;
    float acc[MT][2][4], acc2[MT][2][4];
    qm_chain<WT, MT>(warp + 16, nb, rowp, K, xr, dr, sr, acc2, iq2);
    qm_chain<WT, MT>(warp, nb, rowp, K, xr, dr, sr, acc, iq2);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                sums[warp][(16 * mi + g + 8 * (e / 2)) * QM_OUTS + 8 * ni + 2 * t + e % 2] =
                    acc[mi][ni][e] + acc2[mi][ni][e];
    qm_chain<WT, MT>(warp + 24, nb, rowp, K, xr, dr, sr, acc2, iq2);
    qm_chain<WT, MT>(warp + 8, nb, rowp, K, xr, dr, sr, acc, iq2);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int i = (16 * mi + g + 8 * (e / 2)) * QM_OUTS + 8 * ni + 2 * t + e % 2;
                sums[warp][i] = sums[warp][i] + (acc[mi][ni][e] + acc2[mi][ni][e]);
            }
}

// The butterfly's last three steps (h = 4, 2, 1) over the 8 warps' sums of element i.
__device__ __forceinline__ float qm_finish(float (*sums)[32 * QM_OUTS], int i) {
    float q0 = sums[0][i] + sums[4][i], q1 = sums[1][i] + sums[5][i];
    float q2 = sums[2][i] + sums[6][i], q3 = sums[3][i] + sums[7][i];
    return (q0 + q2) + (q1 + q3);
}

// Dense, as mq_body: a block owns rows 32 by .. 32 by + 31 (two 16-lane groups) x weight rows
// 16 bx .. 16 bx + 15 of group bz.
template <int WT>
__device__ void qm_body(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs,
                        float* y, int N, int K, int L, int Wx, int xg, int ldy, const int* lane_slot) {
    __shared__ float sums[MQ_WARPS][32 * QM_OUTS];
    __shared__ Iq2Tables iq2[1];
    if (WT == WT_IQ2_XXS) iq2_tables_fill(iq2);
    int g = (threadIdx.x % DS4_WARP) / 4;
    int l0 = (int)blockIdx.y * 32, o0 = (int)blockIdx.x * QM_OUTS, grp = blockIdx.z;
    int na[2];  // rows stored: as mq_body, each 16-lane group up to its last active lane
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
        int lm = l0 + 16 * mi, n = L - lm < 16 ? L - lm : 16;
        na[mi] = n <= 0 ? 0 : mv3_active(n, lane_slot ? lane_slot + lm : lane_slot);
    }
    if (na[0] == 0 && na[1] == 0) return;
    const ds4_u8* rowp[2];
#pragma unroll
    for (int ni = 0; ni < 2; ++ni) {
        int o = o0 + 8 * ni + g;
        rowp[ni] = W + ((long long)grp * N + (o < N ? o : 0)) * rb;
    }
    const ds4_i8* xr[4];
    const float* dr[4];
    const short* sr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int l = l0 + 16 * (i / 2) + g + 8 * (i % 2);
        long long base = (long long)(l < L ? l : 0) * Wx + (long long)grp * xg;
        xr[i] = xq + base;
        dr[i] = dx + base / QB;
        sr[i] = xs + base / 16;
    }
    __syncthreads();  // the IQ2_XXS tables
    qm_tile<WT, 2>(K / QB, rowp, K, xr, dr, sr, sums, iq2);
    __syncthreads();
    for (int i = threadIdx.x; i < 32 * QM_OUTS; i += blockDim.x) {
        int r = i / QM_OUTS, o = o0 + i % QM_OUTS;
        if (o < N && r % 16 < na[r / 16])
            y[(long long)(l0 + r) * ldy + (long long)grp * N + o] = qm_finish(sums, i);
    }
}

#define DS4_QMM(NAME, WT)                                                                             \
    extern "C" __global__ void __launch_bounds__(MQ_WARPS * DS4_WARP, 2)                             \
        NAME(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs, float* y,  \
             int N, int K, int L, int Wx, int xg, int ldy, const int* lane_slot) {                       \
        qm_body<WT>(W, rb, xq, dx, xs, y, N, K, L, Wx, xg, ldy, lane_slot);                             \
    }

// Built for the types it measured faster on than the dp4a kernel (ops.MMA_WTYPES,
// docs/performance.md): every instantiation lengthens each start's compile of this file.
DS4_QMM(ds4_qmm_q8_0, WT_Q8_0)
