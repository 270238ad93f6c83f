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

#define MQ_WARPS 8
#define MQ_SMEM 40960     // staged bytes per block: int8 codes, their scales and half sums
#define MQ_CHUNK_UNIT 1024  // a chunk starts at a multiple of 32 blocks, so lane t keeps block b % 32 == t

__device__ __forceinline__ int ds4_dp4a(int a, int b, int c) {
#if DS4_IS_HIP
#if defined(__gfx11__) || defined(__gfx12__)
    return __builtin_amdgcn_sudot4(true, a, true, b, c, false);
#else
    return __builtin_amdgcn_sdot4(a, b, c, false);
#endif
#else
    return __dp4a(a, b, c);
#endif
}

// Rows x (rows, ldx floats apart), K columns each: xq (rows, K) int8, dx (rows, K/32) and the
// half sums xs (rows, K/16), one thread per element and one warp per block (ds4_q8.h).
extern "C" __global__ void ds4_quantize_q8(const float* __restrict__ x, long long ldx, int K, int rows,
                                           ds4_i8* __restrict__ xq, float* __restrict__ dx, short* __restrict__ xs) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long long)rows * K) return;  // K % 32 == 0: a warp's lanes leave together
    long long r = e / K;
    int c = (int)(e % K), b = c / QB;
    ds4_q8_warp(x[r * ldx + c], xq + r * K + (long long)b * QB, dx + r * (K / QB) + b, xs + r * (K / 16) + 2 * b);
}

// One weight block as the uniform codes: 32 int8 codes in 8 words, the integer multipliers
// and mins of its two 16-column halves, and its two float scales (ds4ref.quant_codes.quant_codes).
struct QBlock {
    int c[8];
    int mul0, mul1, mn0, mn1;
    float s1, s2;
};

template <int WT>
struct QHasMin { static const bool value = WT == WT_Q2_K || WT == WT_Q4_K; };

// IQ2_XXS's grid and sign patterns as packed int8 words, built in shared memory once per
// block: a group of 8 codes is then two table reads and four word operations instead of
// unpacking 16 bits of grid and 8 sign bits element by element (the unpacking cost more
// than the weight reads). vals[i]: the 8 magnitudes of grid row i (8, 25 or 43), one byte
// each; signs[s]: 0xff in byte e where ggml's ksigns_iq2xs[s] negates element e (bit 7 makes
// the parity even). A byte g of vals is negated as (g ^ 0xff) + 1, which cannot carry out
// of its byte for g in 1..127, so (v ^ m) + (m & 0x01010101) applies a word's signs exactly.
struct Iq2Tables {
    uint2 vals[256];
    uint2 signs[128];
};

__device__ __forceinline__ void iq2_tables_fill(Iq2Tables* t) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        ds4_u32 grid = DS4_IQ2XXS_GRID[i], word[2] = {0, 0};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            ds4_u32 c = (grid >> (2 * e)) & 3u;
            word[e / 4] |= (c == 0u ? 8u : c == 1u ? 25u : c == 2u ? 43u : 0u) << (8 * (e % 4));  // no row holds code 3
        }
        t->vals[i] = make_uint2(word[0], word[1]);
    }
    for (int i = threadIdx.x; i < 128; i += blockDim.x) {
        ds4_u32 sg = (ds4_u32)i | ((ds4_u32)(__popc(i) & 1) << 7), m[2] = {0, 0};
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if ((sg >> e) & 1u) m[e / 4] |= 0xffu << (8 * (e % 4));
        t->signs[i] = make_uint2(m[0], m[1]);
    }
}

// Block b (columns 32b .. 32b+31) of the row at rp (K columns), decoded to QBlock.
template <int WT>
__device__ __forceinline__ void qb_load(const ds4_u8* __restrict__ rp, int K, int b, QBlock& q,
                                        const Iq2Tables* iq2) {
    if (WT == WT_Q8_0) {
        const uint4* p = (const uint4*)(rp + (long long)b * 32);
        uint4 a = p[0], c = p[1];
        q.c[0] = a.x; q.c[1] = a.y; q.c[2] = a.z; q.c[3] = a.w;
        q.c[4] = c.x; q.c[5] = c.y; q.c[6] = c.z; q.c[7] = c.w;
        q.mul0 = q.mul1 = 1; q.mn0 = q.mn1 = 0;
        q.s1 = ds4_f16_to_f32(((const ds4_u16*)(rp + K))[b]);
        q.s2 = 0.0f;
    } else if (WT == WT_MXFP4) {  // byte i: element i in the low nibble, element i + 16 in the high
        uint4 a = *(const uint4*)(rp + (long long)b * 16);
        ds4_u32 by[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            ds4_u32 lo = 0, hi = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                ds4_u32 byte = (by[k] >> (8 * e)) & 0xffu;
                lo |= ((ds4_u32)(int)mv3_e2m1_doubled(byte & 0xfu) & 0xffu) << (8 * e);
                hi |= ((ds4_u32)(int)mv3_e2m1_doubled(byte >> 4) & 0xffu) << (8 * e);
            }
            q.c[k] = (int)lo;
            q.c[4 + k] = (int)hi;
        }
        q.mul0 = q.mul1 = 1; q.mn0 = q.mn1 = 0;
        q.s1 = mv3_e8m0_half(rp[K / 2 + b]);
        q.s2 = 0.0f;
    } else if (WT == WT_IQ2_XXS) {  // group l of 8 columns: grid row (aux0 byte l), signs (aux1 >> 7l)
        uint2 sub = *(const uint2*)(rp + (long long)b * 8);
        ds4_u32 aux0 = sub.x, aux1 = sub.y;
        float d = ds4_f16_to_f32(((const ds4_u16*)(rp + K / 4))[b / 8]);
        q.s1 = (d * (0.5f + (float)(aux1 >> 28))) * 0.25f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            uint2 v = iq2->vals[(aux0 >> (8 * l)) & 0xffu];
            uint2 m = iq2->signs[(aux1 >> (7 * l)) & 127u];
            q.c[2 * l] = (int)((v.x ^ m.x) + (m.x & 0x01010101u));
            q.c[2 * l + 1] = (int)((v.y ^ m.y) + (m.y & 0x01010101u));
        }
        q.mul0 = q.mul1 = 1; q.mn0 = q.mn1 = 0;
        q.s2 = 0.0f;
    } else if (WT == WT_Q2_K) {  // [K/32 x 8 code bytes][K/16 scales][K/256 x (d, dmin)]: ops.q2k_block_codes
        uint2 cw = *(const uint2*)(rp + (long long)b * 8);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            q.c[k] = (int)((cw.x >> (2 * k)) & 0x03030303u);
            q.c[4 + k] = (int)((cw.y >> (2 * k)) & 0x03030303u);
        }
        ds4_u32 sc = ((const ds4_u16*)(rp + K / 4))[b];  // the block's halves: scales[2b], scales[2b + 1]
        q.mul0 = (int)(sc & 15u); q.mn0 = (int)((sc >> 4) & 15u);
        q.mul1 = (int)((sc >> 8) & 15u); q.mn1 = (int)((sc >> 12) & 15u);
        ds4_u32 dd = ((const ds4_u32*)(rp + K / 4 + K / 16))[b / 8];
        q.s1 = ds4_f16_to_f32((ds4_u16)(dd & 0xffffu));
        q.s2 = ds4_f16_to_f32((ds4_u16)(dd >> 16));
    } else {  // Q4_K: d, dmin, scales[12], qs[128]; block j of 8 = nibble j%2 of the 32 bytes at 32(j/2)
        const ds4_u8* blk = rp + (long long)(b / 8) * 144;
        int j = b % 8;
        const uint4* qp = (const uint4*)(blk + 16 + 32 * (j / 2));
        uint4 a = qp[0], c = qp[1];
        ds4_u32 w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        int sh = 4 * (j % 2);
#pragma unroll
        for (int k = 0; k < 8; ++k) q.c[k] = (int)((w[k] >> sh) & 0x0f0f0f0fu);
        const ds4_u8* s = blk + 4;  // ggml's get_scale_min_k4
        ds4_u32 sc = j < 4 ? s[j] & 63u : (s[j + 4] & 0xfu) | ((s[j - 4] >> 6) << 4);
        ds4_u32 mn = j < 4 ? s[j + 4] & 63u : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        q.mul0 = q.mul1 = (int)sc;
        q.mn0 = q.mn1 = (int)mn;
        ds4_u32 dd = *(const ds4_u32*)blk;
        q.s1 = ds4_f16_to_f32((ds4_u16)(dd & 0xffffu));
        q.s2 = ds4_f16_to_f32((ds4_u16)(dd >> 16));
    }
}

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

// c (4 ints) += A (16x16 int8: a0 row g, a1 row g+8, columns 4t..4t+3) . B (16x8: b0 column g,
// k 4t..4t+3), g = lane / 4, t = lane % 4; c0, c1: row g, columns 2t, 2t+1; c2, c3: row g+8.
__device__ __forceinline__ void qm_mma16816(int* c, int a0, int a1, int b0) {
#if DS4_IS_HIP
    // no MMA instruction assumed: the same integers by dp4a over the shuffled fragments
    int g = (threadIdx.x % DS4_WARP) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        int x0 = DS4_SHFL(a0, 4 * g + j), x1 = DS4_SHFL(a1, 4 * g + j);
        int w0 = DS4_SHFL(b0, 4 * (2 * t) + j), w1 = DS4_SHFL(b0, 4 * (2 * t + 1) + j);
        c[0] = ds4_dp4a(x0, w0, c[0]); c[1] = ds4_dp4a(x0, w1, c[1]);
        c[2] = ds4_dp4a(x1, w0, c[2]); c[3] = ds4_dp4a(x1, w1, c[3]);
    }
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
#endif
}

// Block b of the row at rp as qb_load decodes it, but only the words of columns 4t.. of each
// half, in c[0] and c[4]: a lane decodes a quarter of the block (the four lanes of a weight
// row share it), and no register array is indexed by t (that would go to memory).
template <int WT>
__device__ __forceinline__ void qm_load(const ds4_u8* __restrict__ rp, int K, int b, int t, QBlock& q,
                                        const Iq2Tables* iq2) {
    if (WT == WT_Q8_0) {
        const int* p = (const int*)(rp + (long long)b * 32);
        q.c[0] = p[t];
        q.c[4] = p[4 + t];
        q.mul0 = q.mul1 = 1; q.mn0 = q.mn1 = 0;
        q.s1 = ds4_f16_to_f32(((const ds4_u16*)(rp + K))[b]);
        q.s2 = 0.0f;
    } else if (WT == WT_IQ2_XXS) {  // word k: half k % 2 of group k / 2 (qb_load's c[2l], c[2l+1])
        uint2 sub = *(const uint2*)(rp + (long long)b * 8);
        ds4_u32 aux0 = sub.x, aux1 = sub.y;
        float d = ds4_f16_to_f32(((const ds4_u16*)(rp + K / 4))[b / 8]);
        q.s1 = (d * (0.5f + (float)(aux1 >> 28))) * 0.25f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int k = 4 * h + t, l = k / 2;
            uint2 v = iq2->vals[(aux0 >> (8 * l)) & 0xffu];
            uint2 m = iq2->signs[(aux1 >> (7 * l)) & 127u];
            ds4_u32 vv = k % 2 ? v.y : v.x, mm = k % 2 ? m.y : m.x;
            q.c[4 * h] = (int)((vv ^ mm) + (mm & 0x01010101u));
        }
        q.mul0 = q.mul1 = 1; q.mn0 = q.mn1 = 0;
        q.s2 = 0.0f;
    } else if (WT == WT_Q2_K) {  // the repacked row of qb_load: word k is byte lanes of cw >> 2(k % 4)
        uint2 cw = *(const uint2*)(rp + (long long)b * 8);
        q.c[0] = (int)((cw.x >> (2 * t)) & 0x03030303u);
        q.c[4] = (int)((cw.y >> (2 * t)) & 0x03030303u);
        ds4_u32 sc = ((const ds4_u16*)(rp + K / 4))[b];
        q.mul0 = (int)(sc & 15u); q.mn0 = (int)((sc >> 4) & 15u);
        q.mul1 = (int)((sc >> 8) & 15u); q.mn1 = (int)((sc >> 12) & 15u);
        ds4_u32 dd = ((const ds4_u32*)(rp + K / 4 + K / 16))[b / 8];
        q.s1 = ds4_f16_to_f32((ds4_u16)(dd & 0xffffu));
        q.s2 = ds4_f16_to_f32((ds4_u16)(dd >> 16));
    } else {
        qb_load<WT>(rp, K, b, q, iq2);
        int lo = q.c[0], hi = q.c[4];
#pragma unroll
        for (int k = 1; k < 4; ++k) {
            lo = t == k ? q.c[k] : lo;
            hi = t == k ? q.c[4 + k] : hi;
        }
        q.c[0] = lo;
        q.c[4] = hi;
    }
}

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

// Every type is built and bitwise (the qmatvec twin); the backend takes the MMA path where it
// measured faster than the dp4a kernel (ops.MMA_WTYPES, docs/performance.md).
DS4_QMM(ds4_qmm_q8_0, WT_Q8_0)
DS4_QMM(ds4_qmm_q2_k, WT_Q2_K)
DS4_QMM(ds4_qmm_q4_k, WT_Q4_K)
DS4_QMM(ds4_qmm_iq2_xxs, WT_IQ2_XXS)
DS4_QMM(ds4_qmm_mxfp4, WT_MXFP4)

// ---- prompt passes: a tiled int8 GEMM in §2a's order -----------------------------------------
// Not taken by the backend yet: written without a GPU at hand, it waits for its twin
// (tests/gpu/test_ops_gpu.py::test_qgemm_every_type) to pass before ops.launch_qmatvec uses it.
// The butterfly over the 32 partials is a tree; evaluated in post-order it visits the partials in
// 5-bit bit-reversed order (0, 16, 8, 24, 4, ...), and after leaf q the pending sums are those of
// a binary counter: pop as many as q has trailing ones, add each on the left, push the result.
// So a thread walks its outputs' chains one after another (chain p: blocks p, p + 32, ... in
// increasing order, fma from +0, as mq_rows) holding five pending sums, and the 8 warps partition
// a 64-row x 64-weight-row tile instead of splitting K: each staged block is read once a tile.
#define QG_TILE 64
#define QG_STRIDE 48  // staged row bytes: 32 codes, padded so a fragment load hits 32 banks

__host__ __device__ constexpr int qg_bitrev5(int q) {
    return ((q & 1) << 4) | ((q & 2) << 2) | (q & 4) | ((q & 8) >> 2) | ((q & 16) >> 4);
}
__host__ __device__ constexpr int qg_popc(int q) { return q ? (q & 1) + qg_popc(q >> 1) : 0; }
__host__ __device__ constexpr int qg_trailing_ones(int q) { return q & 1 ? 1 + qg_trailing_ones(q >> 1) : 0; }

// What a thread of qg_body reads from and stages: its input and weight rows (staging roles
// (so, sp): bytes 8 sp.. of input row so, words sp and 4 + sp of weight row so) and its warp tile.
struct QgCtx {
    const ds4_i8* arow;
    const float* drow;
    const short* srow;
    const ds4_u8* brow;
    int K, nb, so, sp, r0, ob, g, t;
    bool a_ok;
};

struct QgStage {
    ds4_u8 a[QG_TILE * QG_STRIDE];
    ds4_u8 b[QG_TILE * QG_STRIDE];
    float d[QG_TILE], s1[QG_TILE], s2[QG_TILE];
    int x[QG_TILE], m[QG_TILE];
};

// This thread's share of block b: input bytes, block scale and half sums, and weight words.
template <int WT>
__device__ __forceinline__ void qg_fetch(const QgCtx& c, int b, const Iq2Tables* iq2, uint2& av, float& dv,
                                         int& xv, QBlock& w) {
    av = c.a_ok ? *(const uint2*)(c.arow + (long long)b * QB + 8 * c.sp) : make_uint2(0u, 0u);
    dv = c.a_ok ? c.drow[b] : 0.0f;
    xv = QHasMin<WT>::value && c.a_ok ? (int)(ds4_u16)c.srow[2 * b] | ((int)c.srow[2 * b + 1] << 16) : 0;
    qm_load<WT>(c.brow, c.K, b, c.sp, w, iq2);
}

// Chain p (blocks p, p + 32, ... in increasing order, fma from +0, as mq_rows) of the warp's
// 16 x 32 tile into acc[ni][e] (element e of C fragment ni, as in qm_mma16816).
template <int WT>
__device__ __forceinline__ void qg_chain(const QgCtx& c, QgStage& st, const Iq2Tables* iq2, int p,
                                         float (&acc)[4][4]) {
    const bool has_min = QHasMin<WT>::value;
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[ni][e] = 0.0f;
    // block b's staged bytes are loaded while block b - 32 is computed
    uint2 av = make_uint2(0u, 0u);
    float dv = 0.0f;
    int xv = 0;
    QBlock w;
    if (p < c.nb) qg_fetch<WT>(c, p, iq2, av, dv, xv, w);
    for (int b = p; b < c.nb; b += DS4_WARP) {
        __syncthreads();  // the previous block is consumed
        *(uint2*)(st.a + c.so * QG_STRIDE + 8 * c.sp) = av;
        *(int*)(st.b + c.so * QG_STRIDE + 4 * c.sp) = w.c[0];
        *(int*)(st.b + c.so * QG_STRIDE + 16 + 4 * c.sp) = w.c[4];
        if (c.sp == 0) {
            st.d[c.so] = dv;
            st.x[c.so] = xv;
            st.s1[c.so] = w.s1;
            st.s2[c.so] = w.s2;
            st.m[c.so] = (w.mul0 & 0xff) | ((w.mul1 & 0xff) << 8) | ((w.mn0 & 0xff) << 16) | ((w.mn1 & 0xff) << 24);
        }
        __syncthreads();
        if (b + DS4_WARP < c.nb) qg_fetch<WT>(c, b + DS4_WARP, iq2, av, dv, xv, w);
        int r1 = c.r0 + 8;
        int a[2][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            a[h][0] = *(const int*)(st.a + c.r0 * QG_STRIDE + 16 * h + 4 * c.t);
            a[h][1] = *(const int*)(st.a + r1 * QG_STRIDE + 16 * h + 4 * c.t);
        }
        float d[2] = {st.d[c.r0], st.d[r1]};
        int X[2][2] = {{0, 0}, {0, 0}};
        if (has_min) {
            int x0 = st.x[c.r0], x1 = st.x[r1];
            X[0][0] = (short)(x0 & 0xffff); X[0][1] = (short)(x0 >> 16);
            X[1][0] = (short)(x1 & 0xffff); X[1][1] = (short)(x1 >> 16);
        }
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            int ob8 = c.ob + 8 * ni;
            int S[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
            for (int h = 0; h < 2; ++h)
                qm_mma16816(S[h], a[h][0], a[h][1], *(const int*)(st.b + (ob8 + c.g) * QG_STRIDE + 16 * h + 4 * c.t));
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int oo = ob8 + 2 * c.t + e % 2, hr = e / 2;
                int pk = st.m[oo];
                int A = (pk & 0xff) * S[0][e] + ((pk >> 8) & 0xff) * S[1][e];
                float tb = st.s1[oo] * (float)A;
                if (has_min)
                    tb = tb - st.s2[oo] * (float)(((pk >> 16) & 0xff) * X[hr][0] + ((pk >> 24) & 0xff) * X[hr][1]);
                acc[ni][e] = fmaf(d[hr], tb, acc[ni][e]);
            }
        }
    }
}

// Leaves Q .. 31 of the butterfly's tree in post-order: leaf Q is chain qg_bitrev5(Q); after it
// the pending sums are a binary counter's (pop as many as Q has trailing ones, each added on the
// left, push the result), every index known at compile time.
template <int WT, int Q>
__device__ __forceinline__ void qg_leaves(const QgCtx& c, QgStage& st, const Iq2Tables* iq2,
                                          float (&stack)[5][4][4]) {
    if constexpr (Q < DS4_WARP) {
        constexpr int depth = qg_popc(Q), pops = qg_trailing_ones(Q);
        float acc[4][4];
        qg_chain<WT>(c, st, iq2, qg_bitrev5(Q), acc);
#pragma unroll
        for (int j = 0; j < pops; ++j)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[ni][e] = stack[depth - 1 - j][ni][e] + acc[ni][e];
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) stack[depth - pops][ni][e] = acc[ni][e];
        qg_leaves<WT, Q + 1>(c, st, iq2, stack);
    }
}

template <int WT>
__device__ void qg_body(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs,
                        float* y, int N, int K, int L, int Wx, int xg, int ldy, const int* lane_slot) {
    __shared__ __align__(16) QgStage st;
    __shared__ Iq2Tables iq2[1];
    if (WT == WT_IQ2_XXS) iq2_tables_fill(iq2);
    __syncthreads();  // the tables, before the first block's prefetch decodes with them
    int tid = threadIdx.x, warp = tid / DS4_WARP, lane = tid % DS4_WARP;
    int wr = warp % 4, wc = warp / 4;  // warp tile: rows 16 wr .., weight rows 32 wc ..
    int l0 = (int)blockIdx.y * QG_TILE, o0 = (int)blockIdx.x * QG_TILE, grp = blockIdx.z;
    int na;  // rows of this warp's 16-lane group that are stored (as mq_body)
    {
        int lm = l0 + 16 * wr, n = L - lm < 16 ? L - lm : 16;
        na = n <= 0 ? 0 : mv3_active(n, lane_slot ? lane_slot + lm : lane_slot);
    }
    QgCtx c;
    c.so = tid / 4;
    c.sp = tid % 4;
    c.a_ok = l0 + c.so < L;
    long long abase = (long long)(c.a_ok ? l0 + c.so : 0) * Wx + (long long)grp * xg;
    c.arow = xq + abase;
    c.drow = dx + abase / QB;
    c.srow = xs + abase / 16;
    int ob = o0 + c.so < N ? o0 + c.so : N - 1;
    c.brow = W + ((long long)grp * N + ob) * rb;
    c.K = K;
    c.nb = K / QB;
    c.g = lane / 4;
    c.t = lane % 4;
    c.r0 = 16 * wr + c.g;
    c.ob = 32 * wc;
    float stack[5][4][4];
    qg_leaves<WT, 0>(c, st, iq2, stack);
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int r = 16 * wr + c.g + 8 * (e / 2), o = o0 + 32 * wc + 8 * ni + 2 * c.t + e % 2;
            if (o < N && r % 16 < na)
                y[(long long)(l0 + r) * ldy + (long long)grp * N + o] = stack[0][ni][e];
        }
}

#define DS4_QGEMM(NAME, WT)                                                                           \
    extern "C" __global__ void __launch_bounds__(MQ_WARPS * DS4_WARP, 1)                             \
        NAME(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs, float* y,  \
             int N, int K, int L, int Wx, int xg, int ldy, const int* lane_slot) {                       \
        qg_body<WT>(W, rb, xq, dx, xs, y, N, K, L, Wx, xg, ldy, lane_slot);                             \
    }

DS4_QGEMM(ds4_qgemm_q8_0, WT_Q8_0)
DS4_QGEMM(ds4_qgemm_q2_k, WT_Q2_K)
DS4_QGEMM(ds4_qgemm_q4_k, WT_Q4_K)
DS4_QGEMM(ds4_qgemm_iq2_xxs, WT_IQ2_XXS)
DS4_QGEMM(ds4_qgemm_mxfp4, WT_MXFP4)
