// qgemm.hip - prompt passes' quantised products as a tiled int8 GEMM, in docs/exactness.md §2a's
// order, the dense ones and the routed experts' (tiles of one expert's pairs); its own file,
// compiled a type at a time: the unrolled chains take NVRTC seconds per type.
#include "ds4_mv3.h"
#include "ds4_q8.h"
#include "ds4_qblock.h"

#define MQ_WARPS 8
// Tuning macros (DS4REF_KERNEL_DEFINES; neither changes a bit): QG_AHEAD blocks of the walk
// fetched before the one staged, QG_MIN_BLOCKS blocks a multiprocessor the registers must allow.
#ifndef QG_AHEAD
#define QG_AHEAD 1
#endif
#ifndef QG_MIN_BLOCKS
#define QG_MIN_BLOCKS 1
#endif
// QG_DOT4 1: a block's integer sums by dot4 on register tiles (qg_chain_dot4), AMD's path
// (docs/rocm.md says why not WMMA); 0: NVIDIA's m16n8k16 MMA, its default. The same integers
// either way, so the same bits: forced to 1 on NVIDIA, the H200 twins check that.
#ifndef QG_DOT4
#define QG_DOT4 DS4_IS_HIP
#endif
#if DS4_IS_HIP && !QG_DOT4
#error "qgemm.hip: AMD builds the dot4 tiles (QG_DOT4 1); the MMA path is NVIDIA's"
#endif

// ---- prompt passes: a tiled int8 GEMM in §2a's order -----------------------------------------
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
    int K, nb, so, sp, r0, ob, g, t;  // QG_DOT4: rows r0.. r0 + 3, weight rows ob, ob + 16, ...
    bool a_ok;
    bool hi;  // the warp stores rows 8..15 of its 16 (else their products are skipped)
};

struct QgStage {
    ds4_u8 a[QG_TILE * QG_STRIDE];
    ds4_u8 b[QG_TILE * QG_STRIDE];
    float d[QG_TILE], s1[QG_TILE], s2[QG_TILE];
    int x[QG_TILE], m[QG_TILE];
};

// This thread's share of block b as loaded: input bytes, block scale and half sums, weight bytes
// (decoded at staging, qm_decode). The half sums are one word (2 b shorts in, so 4-byte aligned).
template <int WT>
__device__ __forceinline__ void qg_fetch(const QgCtx& c, int b, const Iq2Tables* iq2, uint2& av, float& dv,
                                         int& xv, QmRaw& w) {
    av = c.a_ok ? *(const uint2*)(c.arow + (long long)b * QB + 8 * c.sp) : make_uint2(0u, 0u);
    dv = c.a_ok ? c.drow[b] : 0.0f;
    xv = QHasMin<WT>::value && c.a_ok ? *(const int*)(c.srow + 2 * b) : 0;
    qm_fetch<WT>(c.brow, c.K, b, c.sp, w, iq2);
}

// This thread's share of a block to stage, fetched QG_AHEAD blocks of the walk before it is
// staged (a ring of QG_AHEAD slots: the block at walk step i sits in slot i % QG_AHEAD).
struct QgNext {
    uint2 av;
    float dv;
    int xv;
    QmRaw w;
};

// The walk: leaves Q = 0 .. 31 in order (chain qg_bitrev5(Q)), each chain's blocks increasing.
// The cursor names the walk's next block to fetch (b >= nb once there is none).
struct QgCursor {
    int q, b;
};
__device__ __forceinline__ void qg_advance(QgCursor& f, int nb) {
    f.b += DS4_WARP;
    while (f.b >= nb && f.q < DS4_WARP - 1) f.b = qg_bitrev5(++f.q);
}

// Walk step i: stage slot i % QG_AHEAD into st, then refill that slot with the cursor's block.
// Each slot is its own warp-uniform branch, so a slot's registers are read only when its load is
// the one being staged (a select over the slots would wait on every slot's load).
template <int WT>
__device__ __forceinline__ void qg_step(const QgCtx& c, QgStage& st, const Iq2Tables* iq2, QgNext (&nx)[QG_AHEAD],
                                        QgCursor& f, int i) {
    int slot = i % QG_AHEAD;
    __syncthreads();  // the previous block is consumed
#pragma unroll
    for (int k = 0; k < QG_AHEAD; ++k)
        if (k == slot) {
            QBlock w;
            qm_decode<WT>(nx[k].w, c.sp, w, iq2);
            *(uint2*)(st.a + c.so * QG_STRIDE + 8 * c.sp) = nx[k].av;
            *(int*)(st.b + c.so * QG_STRIDE + 4 * c.sp) = w.c[0];
            *(int*)(st.b + c.so * QG_STRIDE + 16 + 4 * c.sp) = w.c[4];
            if (c.sp == 0) {
                st.d[c.so] = nx[k].dv;
                st.x[c.so] = nx[k].xv;
                st.s1[c.so] = w.s1;
                st.s2[c.so] = w.s2;
                st.m[c.so] = (w.mul0 & 0xff) | ((w.mul1 & 0xff) << 8) | ((w.mn0 & 0xff) << 16) | ((w.mn1 & 0xff) << 24);
            }
        }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < QG_AHEAD; ++k)
        if (k == slot && f.b < c.nb) qg_fetch<WT>(c, f.b, iq2, nx[k].av, nx[k].dv, nx[k].xv, nx[k].w);
    qg_advance(f, c.nb);
}

// The block's terms of weight row oo of the tile for one input from their integer sums: S the
// whole block's (Q2_K: already mul0 * S0 + mul1 * S1, pk = st.m[oo] its multipliers and mins), X0
// and X1 the input's half sums.
template <int WT>
__device__ __forceinline__ float qg_term(const QgStage& st, int oo, int pk, int S, int X0, int X1) {
    const bool has_min = QHasMin<WT>::value, halves = WT == WT_Q2_K;
    int A = !halves && has_min ? (pk & 0xff) * S : S;
    float tb = st.s1[oo] * (float)A;
    if (has_min) {
        int B = halves ? ((pk >> 16) & 0xff) * X0 + ((pk >> 24) & 0xff) * X1 : ((pk >> 16) & 0xff) * (X0 + X1);
        tb = tb - st.s2[oo] * (float)B;
    }
    return tb;
}

// An input row's packed half sums (QgStage::x) as X0, X1.
__device__ __forceinline__ void qg_halves(int x, int& X0, int& X1) {
    X0 = (short)(x & 0xffff);
    X1 = (short)(x >> 16);
}

#if !QG_DOT4
// Chain p (blocks p, p + 32, ... in increasing order, fma from +0, as mq_rows) of the warp's
// 16 x 32 tile into acc[ni][e] (element e of C fragment ni, as in qm_mma16816); i counts the
// walk's steps (qg_step). The fetches run QG_AHEAD blocks ahead across chains too, so a chain
// of one block (K = 1024) waits on no load.
// Only Q2_K gives its two 16-column halves their own multipliers; the other types' block dot is
// one integer sum (Q4_K's halves share a multiplier and a min), so one MMA accumulator holds it:
// the same integers as mq_rows' mul0 * S0 + mul1 * S1.
template <int WT>
__device__ __forceinline__ void qg_chain(const QgCtx& c, QgStage& st, const Iq2Tables* iq2, int p,
                                         QgNext (&nx)[QG_AHEAD], QgCursor& f, int& i, float (&acc)[4][4]) {
    const bool halves = WT == WT_Q2_K;
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[ni][e] = 0.0f;
    for (int b = p; b < c.nb; b += DS4_WARP) {
        qg_step<WT>(c, st, iq2, nx, f, i++);
        int r1 = c.r0 + 8;
        int a[2][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            a[h][0] = *(const int*)(st.a + c.r0 * QG_STRIDE + 16 * h + 4 * c.t);
            a[h][1] = *(const int*)(st.a + r1 * QG_STRIDE + 16 * h + 4 * c.t);
        }
        float d[2] = {st.d[c.r0], st.d[r1]};
        int X[2][2] = {{0, 0}, {0, 0}};
        if (QHasMin<WT>::value) {
            qg_halves(st.x[c.r0], X[0][0], X[0][1]);
            qg_halves(st.x[r1], X[1][0], X[1][1]);
        }
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            int ob8 = c.ob + 8 * ni;
            int S[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
            for (int h = 0; h < 2; ++h)
                qm_mma16816(S[halves ? h : 0], a[h][0], a[h][1],
                            *(const int*)(st.b + (ob8 + c.g) * QG_STRIDE + 16 * h + 4 * c.t));
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int oo = ob8 + 2 * c.t + e % 2, hr = e / 2;
                if (hr == 1 && !c.hi) continue;  // rows 8..15 of the warp are not stored
                int pk = st.m[oo];
                int A = halves ? (pk & 0xff) * S[0][e] + ((pk >> 8) & 0xff) * S[1][e] : S[0][e];
                acc[ni][e] = fmaf(d[hr], qg_term<WT>(st, oo, pk, A, X[hr][0], X[hr][1]), acc[ni][e]);
            }
        }
    }
}

// Leaves Q .. 31 of the butterfly's tree in post-order: leaf Q is chain qg_bitrev5(Q); after it
// the pending sums are a binary counter's (pop as many as Q has trailing ones, each added on the
// left, push the result), every index known at compile time.
template <int WT, int Q>
__device__ __forceinline__ void qg_leaves(const QgCtx& c, QgStage& st, const Iq2Tables* iq2, QgNext (&nx)[QG_AHEAD],
                                          QgCursor& f, int& i, float (&stack)[5][4][4]) {
    if constexpr (Q < DS4_WARP) {
        constexpr int depth = qg_popc(Q), pops = qg_trailing_ones(Q);
        float acc[4][4];
        qg_chain<WT>(c, st, iq2, qg_bitrev5(Q), nx, f, i, acc);
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
        qg_leaves<WT, Q + 1>(c, st, iq2, nx, f, i, stack);
    }
}

#else
// qg_chain without MMA fragments: thread (rg, cg) = (tid / 16, tid % 16) owns rows 4 rg .. 4 rg + 3
// and weight rows cg, cg + 16, cg + 32, cg + 48 of the tile, and forms each block's integer sums
// with dot4 from 16-byte reads of the staged tile, a half at a time (no fragment exchange, 64
// code words live at most). acc[i][j]: row r0 + i, weight row ob + 16 j.
template <int WT>
__device__ __forceinline__ void qg_chain_dot4(const QgCtx& c, QgStage& st, const Iq2Tables* iq2, int p,
                                              QgNext (&nx)[QG_AHEAD], QgCursor& f, int& i, float (&acc)[4][4]) {
    const bool halves = WT == WT_Q2_K;
#pragma unroll
    for (int ri = 0; ri < 4; ++ri)
#pragma unroll
        for (int oj = 0; oj < 4; ++oj) acc[ri][oj] = 0.0f;
    for (int b = p; b < c.nb; b += DS4_WARP) {
        qg_step<WT>(c, st, iq2, nx, f, i++);
        int S[4][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint4 a[4], w[4];
#pragma unroll
            for (int ri = 0; ri < 4; ++ri) a[ri] = *(const uint4*)(st.a + (c.r0 + ri) * QG_STRIDE + 16 * h);
#pragma unroll
            for (int oj = 0; oj < 4; ++oj) w[oj] = *(const uint4*)(st.b + (c.ob + 16 * oj) * QG_STRIDE + 16 * h);
#pragma unroll
            for (int oj = 0; oj < 4; ++oj) {
                int mul = halves ? (st.m[c.ob + 16 * oj] >> (8 * h)) & 0xff : 1;
#pragma unroll
                for (int ri = 0; ri < 4; ++ri) {
                    int s = ds4_dp4a((int)a[ri].x, (int)w[oj].x, 0);
                    s = ds4_dp4a((int)a[ri].y, (int)w[oj].y, s);
                    s = ds4_dp4a((int)a[ri].z, (int)w[oj].z, s);
                    s = ds4_dp4a((int)a[ri].w, (int)w[oj].w, s);
                    S[ri][oj] = (h ? S[ri][oj] : 0) + (halves ? mul * s : s);
                }
            }
        }
        int X[4][2] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}};
        if (QHasMin<WT>::value)
#pragma unroll
            for (int ri = 0; ri < 4; ++ri) qg_halves(st.x[c.r0 + ri], X[ri][0], X[ri][1]);
#pragma unroll
        for (int oj = 0; oj < 4; ++oj) {
            int oo = c.ob + 16 * oj, pk = st.m[oo];
#pragma unroll
            for (int ri = 0; ri < 4; ++ri)
                acc[ri][oj] = fmaf(st.d[c.r0 + ri], qg_term<WT>(st, oo, pk, S[ri][oj], X[ri][0], X[ri][1]), acc[ri][oj]);
        }
    }
}

// The same tree with the leaves in a loop (QG_DOT4): unrolled, 32 chains' code and their live
// ranges overflow AMD's 256 registers into scratch. The pending sums are kept by level instead of
// on a stack: after leaf Q, level k holds a sum iff bit k of Q + 1 is set, so adding a leaf adds
// the levels of Q's trailing ones, lowest (latest) first and each on the left, and parks the
// result at the first clear bit: the stack's pops, in its order. Q is the same in every thread,
// so each test is a uniform branch and every level keeps its own registers.
template <int WT>
__device__ __forceinline__ void qg_leaves_loop(const QgCtx& c, QgStage& st, const Iq2Tables* iq2,
                                               QgNext (&nx)[QG_AHEAD], QgCursor& f, float (&level)[5][4][4]) {
    int i = 0;
#pragma unroll 1
    for (int Q = 0; Q < DS4_WARP; ++Q) {
        float acc[4][4];
        qg_chain_dot4<WT>(c, st, iq2, qg_bitrev5(Q), nx, f, i, acc);
        bool carry = true;
#pragma unroll
        for (int k = 0; k < 5; ++k) {
            if (!carry) continue;
            if ((Q >> k) & 1) {
#pragma unroll
                for (int u = 0; u < 4; ++u)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[u][e] = level[k][u][e] + acc[u][e];
            } else {
#pragma unroll
                for (int u = 0; u < 4; ++u)
#pragma unroll
                    for (int e = 0; e < 4; ++e) level[k][u][e] = acc[u][e];
                carry = false;
            }
        }
        if (carry)  // Q = 31: the root
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int e = 0; e < 4; ++e) level[0][u][e] = acc[u][e];
    }
}

#endif  // QG_DOT4

// The routed experts of a prompt pass as a grouped GEMM (launch.launch_qexperts_gemm): row tile
// blockIdx.y is tile blockIdx.y of step_expert_tiles (step_ops.hip), up to 64 (lane, choice) pairs
// of one expert; row r is pair lt = l * kk + t, which reads int8 row lt (per_choice: the down
// product's inputs) or l and writes y[lt * N + o], and the weight is the expert's N rows. A row's
// arithmetic is the dense GEMM's, so each pair's output is canon.qlinear of its own input row.
struct QgPairs {
    const int* list;   // step_expert_list's entries
    const int* tiles;  // step_expert_tiles' row tiles
    int per_choice, kk;
};

// The pair of row r of a grouped tile whose first entry is ent (the layout: step_expert_tiles).
__device__ __forceinline__ int qg_pair(const int* ent, int r) {
    return ent[(r / EL_PAIRS) * EL_STRIDE + 2 + r % EL_PAIRS];
}
static_assert(EL_TILE_ENTRIES * EL_PAIRS == QG_TILE, "a grouped tile is one row tile of the GEMM");

// GROUPED false: the dense products, row tile blockIdx.y the pass's rows l0 .. l0 + 63, pp unused.
template <int WT, bool GROUPED>
DS4_BODY void qg_body(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs,
                        float* y, int N, int K, int L, int Wx, int xg, int ldy, long long gs, const int* lane_slot,
                        QgPairs pp) {
    __shared__ __align__(16) QgStage st;
    __shared__ Iq2Tables iq2[1];
    if constexpr (GROUPED)
        if ((int)blockIdx.y >= pp.tiles[0]) return;  // the grid holds the most tiles a pass can have
    if (WT == WT_IQ2_XXS) iq2_tables_fill(iq2);
    __syncthreads();  // the tables, before the first block's prefetch decodes with them
    int tid = threadIdx.x, warp = tid / DS4_WARP, lane = tid % DS4_WARP;
    int wr = warp % 4, wc = warp / 4;  // MMA warp tile: rows 16 wr .., weight rows 32 wc ..
    int l0 = (int)blockIdx.y * QG_TILE, o0 = (int)blockIdx.x * QG_TILE, grp = blockIdx.z, wgrp = grp;
    const int* ent = nullptr;  // GROUPED: the tile's first list entry
    if constexpr (GROUPED) {
        ent = pp.list + 1 + (long long)pp.tiles[1 + 2 * blockIdx.y] * EL_STRIDE;
        l0 = 0;
        L = pp.tiles[2 + 2 * blockIdx.y];  // the tile's rows 0 .. L - 1 are its pairs
        wgrp = ent[0];                     // the expert's matrix
    }
    int na;  // rows of this thread's 16-lane group that are stored (as mq_body)
    {
        int lm = l0 + 16 * (QG_DOT4 ? tid / 64 : wr), n = L - lm < 16 ? L - lm : 16;
        na = n <= 0 ? 0 : mv3_active(n, lane_slot ? lane_slot + lm : lane_slot);
    }
    QgCtx c;
    c.so = tid / 4;
    c.sp = tid % 4;
    c.a_ok = l0 + c.so < L;
    long long arow = c.a_ok ? l0 + c.so : 0;
    if constexpr (GROUPED)
        if (c.a_ok) {
            int lt = qg_pair(ent, c.so);
            arow = pp.per_choice ? lt : lt / pp.kk;
        }
    long long abase = arow * Wx + (long long)grp * xg;
    c.arow = xq + abase;
    c.drow = dx + abase / QB;
    c.srow = xs + abase / 16;
    int ob = o0 + c.so < N ? o0 + c.so : N - 1;
    c.brow = W + ((long long)wgrp * N + ob) * rb;
    c.K = K;
    c.nb = K / QB;
    c.g = lane / 4;
    c.t = lane % 4;
    c.r0 = QG_DOT4 ? 4 * (tid / 16) : 16 * wr + c.g;
    c.ob = QG_DOT4 ? tid % 16 : 32 * wc;
    c.hi = na > 8;
    float stack[5][4][4];
    QgNext nx[QG_AHEAD];  // the walk's first QG_AHEAD blocks before it starts
    QgCursor f = {0, 0};
#pragma unroll
    for (int k = 0; k < QG_AHEAD; ++k) {
        nx[k].av = make_uint2(0u, 0u);
        nx[k].dv = 0.0f;
        nx[k].xv = 0;
        if (f.b < c.nb) qg_fetch<WT>(c, f.b, iq2, nx[k].av, nx[k].dv, nx[k].xv, nx[k].w);
        qg_advance(f, c.nb);
    }
#if QG_DOT4
    qg_leaves_loop<WT>(c, st, iq2, nx, f, stack);
#else
    int i = 0;
    qg_leaves<WT, 0>(c, st, iq2, nx, f, i, stack);
#endif
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // QG_DOT4: stack[0][row i][weight row j]; MMA: [fragment ni][element e]
            int r = QG_DOT4 ? c.r0 + u : 16 * wr + c.g + 8 * (e / 2);
            int o = o0 + (QG_DOT4 ? c.ob + 16 * e : 32 * wc + 8 * u + 2 * c.t + e % 2);
            if (o < N && r % 16 < na) {
                long long yrow = l0 + r;
                if constexpr (GROUPED) yrow = qg_pair(ent, r);
                y[yrow * ldy + grp * gs + o] = stack[0][u][e];
            }
        }
}

// ds4_qgemm_<type>: the dense products; ds4_qexperts_gemm_<type>: the routed experts' grouped tiles
// (grid: column tiles of N, launch.expert_tiles row tiles; inputs K wide, outputs N wide a pair).
#define DS4_QGEMM(DENSE, EXPERTS, WT)                                                                          \
    extern "C" __global__ void __launch_bounds__(MQ_WARPS * DS4_WARP, QG_MIN_BLOCKS)                           \
        DENSE(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs, float* y,     \
              int N, int K, int L, int Wx, int xg, int ldy, long long gs, const int* lane_slot) {              \
        DS4_KERNEL_ENTRY;                                                                                      \
        qg_body<WT, false>(W, rb, xq, dx, xs, y, N, K, L, Wx, xg, ldy, gs, lane_slot, QgPairs{});              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(MQ_WARPS * DS4_WARP, QG_MIN_BLOCKS)                           \
        EXPERTS(const ds4_u8* W, long long rb, const ds4_i8* xq, const float* dx, const short* xs,             \
                int per_choice, const int* list, const int* tiles, float* y, int N, int K, int kk) {           \
        DS4_KERNEL_ENTRY;                                                                                      \
        qg_body<WT, true>(W, rb, xq, dx, xs, y, N, K, 0, K, 0, N, 0, nullptr,                                  \
                          QgPairs{list, tiles, per_choice, kk});                                               \
    }

// Each start compiles only the types it launches (ops.launch_qmatvec passes -DQG_BUILD=<WT_*>): the
// unrolled chains cost NVRTC seconds per type.
#if !defined(QG_BUILD) || QG_BUILD == WT_Q8_0
DS4_QGEMM(ds4_qgemm_q8_0, ds4_qexperts_gemm_q8_0, WT_Q8_0)
#endif
#if !defined(QG_BUILD) || QG_BUILD == WT_Q2_K
DS4_QGEMM(ds4_qgemm_q2_k, ds4_qexperts_gemm_q2_k, WT_Q2_K)
#endif
#if !defined(QG_BUILD) || QG_BUILD == WT_Q4_K
DS4_QGEMM(ds4_qgemm_q4_k, ds4_qexperts_gemm_q4_k, WT_Q4_K)
#endif
#if !defined(QG_BUILD) || QG_BUILD == WT_IQ2_XXS
DS4_QGEMM(ds4_qgemm_iq2_xxs, ds4_qexperts_gemm_iq2_xxs, WT_IQ2_XXS)
#endif
#if !defined(QG_BUILD) || QG_BUILD == WT_MXFP4
DS4_QGEMM(ds4_qgemm_mxfp4, ds4_qexperts_gemm_mxfp4, WT_MXFP4)
#endif
