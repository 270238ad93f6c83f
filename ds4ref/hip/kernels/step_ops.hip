// Stateless kernels of the HIP backend's gathered pass that ds4ref/hip/kernels/*
// (one family per op) does not provide: embedding gather, RoPE at per-lane
// positions read from device memory (so a captured graph serves any positions),
// hash-routing ids, the routed-expert matvec (each selected expert's weights read
// once for all lanes that chose it), the expert combine, the hc head, and a
// random-weight initialiser for the benchmark.
#include "ds4_hip.h"

// A pass holds L lanes (rows): 16 for a decode pass, more for a prompt pass. Kernels
// take L as an argument or as their grid; the routed experts' work entries hold up to
// EL_PAIRS (lane, choice) pairs each (ds4_hip.h).
#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
#define WT_Q8_0 3
#include "ds4_mv3.h"

__device__ __forceinline__ long long so_row_bytes(int wt, int K) {
    return wt == WT_F32 ? (long long)K * 4 : wt == WT_Q8_0 ? (long long)(K / 32) * 34 : (long long)K * 2;
}

// Element i of a stored row (any supported encoding), widened exactly to f32.
__device__ __forceinline__ float so_elem(const ds4_u8* row, int wt, int i) {
    if (wt == WT_F32) return ((const float*)row)[i];
    if (wt == WT_F16) return ds4_f16_to_f32(((const ds4_u16*)row)[i]);
    if (wt == WT_BF16) return ds4_bf16_to_f32(((const ds4_u16*)row)[i]);
    const ds4_u8* blk = row + (long long)(i / 32) * 34;
    float d = ds4_f16_to_f32((ds4_u16)(blk[0] | (blk[1] << 8)));
    return d * (float)(ds4_i8)blk[2 + i % 32];
}

// streams[l, h, :] = E[tok[l], :] for every hyper-connection stream h. Grid (L).
extern "C" __global__ void step_embed(const ds4_u8* E, int wt, int d, int hc, const int* tok, float* streams) {
    DS4_KERNEL_ENTRY;
    int l = blockIdx.x;
    const ds4_u8* row = E + (long long)tok[l] * so_row_bytes(wt, d);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = so_elem(row, wt, i);
        for (int h = 0; h < hc; ++h) streams[((long long)l * hc + h) * d + i] = v;
    }
}

// In-place RoPE of the last 2*half dims of rows (L * rows_per_lane, D), interleaved
// pairs, with cos/sin read from the host's table cs[pos][p] = (cos, sin) (canon.rope_cos_sin).
extern "C" __global__ void step_rope_pos(float* v, const int* pos, const float* cs, int L, int rows_per_lane,
                                         int D, int half, int inverse) {
    DS4_KERNEL_ENTRY;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)L * rows_per_lane * half) return;
    int p = (int)(idx % half);
    long long row = idx / half;
    int l = (int)(row / rows_per_lane);
    const float* t = cs + ((long long)pos[l] * half + p) * 2;
    float c = t[0], s = inverse ? -t[1] : t[1];
    float* r = v + row * D + (D - 2 * half) + 2 * p;
    float a = r[0], b = r[1];
    r[0] = a * c - b * s;
    r[1] = a * s + b * c;
}

// Hash routing: ids[l, t] = tid2eid[tok[l], t].
extern "C" __global__ void step_hash_ids(const int* tid2eid, const int* tok, int L, int k, int* ids) {
    DS4_KERNEL_ENTRY;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= L * k) return;
    ids[i] = tid2eid[(long long)tok[i / k] * k + i % k];
}

// ---- routed experts --------------------------------------------------------
// y[l, t, :] = W[e] @ x_l for every valid lane l whose t-th selected expert is e.
// The work is sized by the experts the pass chose, never by the experts that exist:
// step_expert_list turns the routing ids into a list of chosen experts, each with its
// (lane, choice) pairs in lane order, and the expert kernel's fixed grid of blocks
// walks (chosen expert, row block) work items. With 256 experts a pass of one row
// chooses 6, so 250 experts' weights are neither read nor visited.
// List layout (int32): [0] = number of entries n; entry u (0 <= u < n) at
// 1 + u * EL_STRIDE = {expert id, pair count, lt_0 .. lt_{count-1}} with lt = l*kk + t.
// An expert chosen by more than EL_PAIRS lanes (a prompt pass) gets several entries, one
// per EL_PAIRS of its pairs; entries are in ascending expert id, an expert's pairs in lane
// order, so an expert's entries sit side by side and read its rows at about the same time.

// One block of 256 threads; E <= EL_EXPERTS (the host checks), any L. A lane counts once for an
// expert, at its first choice of it. An expert's pair count is the number of its first choices,
// its first entry a scan over the experts. The lanes then run in chunks whose (expert, lane) bit
// set fits shared memory (EL_BITS words: 32 * (EL_BITS / E) lanes a chunk, 1024 at 256 experts):
// a choice's place among its expert's pairs is the pairs the expert had in earlier chunks plus
// the population of the chunk's bits below its lane. Every step runs over all of a chunk's
// choices at once (the walk of every choice per expert that this replaced took 190 us for a
// 256-row pass on the H200), and the list is the same whatever the chunk size.
#define EL_BITS 8192
#define EL_EXPERTS 1024
// A tuning macro (DS4REF_KERNEL_DEFINES; it changes no bit): the most bit words an expert gets in
// a chunk, so the op twins cross chunks at small passes and few experts.
#ifndef EL_CHUNK_WORDS
#define EL_CHUNK_WORDS EL_BITS
#endif
static_assert(EL_BITS >= EL_EXPERTS && EL_CHUNK_WORDS >= 1, "every expert needs a word of a chunk");

// Whether choice i (lane i / kk) is a valid lane's first choice of its expert; *e its expert.
__device__ __forceinline__ bool el_first_choice(const int* __restrict__ ids, const int* __restrict__ slot, int kk,
                                                int E, int i, int* e) {
    int l = i / kk, t = i - l * kk;
    *e = ids[i];
    if (slot[l] < 0 || *e < 0 || *e >= E) return false;
    for (int u = 0; u < t; ++u)
        if (ids[l * kk + u] == *e) return false;
    return true;
}

extern "C" __global__ void step_expert_list(const int* __restrict__ ids, const int* __restrict__ slot, int L,
                                            int kk, int E, int* __restrict__ list) {
    DS4_KERNEL_ENTRY;
    __shared__ unsigned bits[EL_BITS];  // bits[e * CW + w] bit b: lane c0 + 32 w + b of the chunk chose e
    // at[e]: the list place (entry * EL_PAIRS + pair) of e's next pair; left[e]: e's pairs not yet placed
    __shared__ int at[EL_EXPERTS], left[EL_EXPERTS], wsum[32];
    int tid = threadIdx.x, lane = tid % DS4_WARP, warp = tid / DS4_WARP;
    int W = (L + 31) / 32, CW = EL_BITS / E;
    CW = CW < EL_CHUNK_WORDS ? CW : EL_CHUNK_WORDS;
    CW = CW < W ? CW : W;
    for (int e = tid; e < E; e += blockDim.x) left[e] = 0;
    __syncthreads();
    for (int i = tid; i < L * kk; i += blockDim.x) {  // integer counts: the same in any order
        int e;
        if (el_first_choice(ids, slot, kk, E, i, &e)) atomicAdd(&left[e], 1);
    }
    __syncthreads();
    // entries before e (EL_EXPERTS / 256 experts a thread, then a scan)
    const int per = EL_EXPERTS / 256;
    int own = 0;
    for (int j = 0; j < per; ++j) {
        int e = per * tid + j;
        own += e < E ? (left[e] + EL_PAIRS - 1) / EL_PAIRS : 0;
    }
    int incl = own;
    for (int o = 1; o < DS4_WARP; o <<= 1) {
        int v = DS4_SHFL(incl, lane >= o ? lane - o : lane);
        if (lane >= o) incl += v;
    }
    if (lane == DS4_WARP - 1) wsum[warp] = incl;
    __syncthreads();
    int before = incl - own;
    for (int w = 0; w < warp; ++w) before += wsum[w];
    for (int j = 0; j < per; ++j) {
        int e = per * tid + j;
        if (e < E) {
            at[e] = before * EL_PAIRS;
            before += (left[e] + EL_PAIRS - 1) / EL_PAIRS;
        }
    }
    if (tid == blockDim.x - 1) list[0] = before;
    for (int c0 = 0; c0 < L; c0 += 32 * CW) {
        int c1 = c0 + 32 * CW < L ? c0 + 32 * CW : L;
        __syncthreads();  // the previous chunk's places and counts are taken (the scan's, the first time)
        for (int i = tid; i < E * CW; i += blockDim.x) bits[i] = 0u;
        __syncthreads();
        for (int i = c0 * kk + tid; i < c1 * kk; i += blockDim.x) {
            int e, l = i / kk - c0;
            if (el_first_choice(ids, slot, kk, E, i, &e)) atomicOr(&bits[e * CW + l / 32], 1u << (l % 32));
        }
        __syncthreads();
        for (int i = c0 * kk + tid; i < c1 * kk; i += blockDim.x) {
            int e, l = i / kk - c0;
            if (!el_first_choice(ids, slot, kk, E, i, &e)) continue;
            int c = __popc(bits[e * CW + l / 32] & ((1u << (l % 32)) - 1u));
            for (int w = 0; w < l / 32; ++w) c += __popc(bits[e * CW + w]);
            int g = at[e] + c;
            int* ent = list + 1 + (g / EL_PAIRS) * EL_STRIDE;
            if (g % EL_PAIRS == 0) {
                ent[0] = e;
                ent[1] = left[e] - c < EL_PAIRS ? left[e] - c : EL_PAIRS;
            }
            ent[2 + g % EL_PAIRS] = i;
        }
        if (c1 == L) break;  // the same for every thread: nothing reads the counts after the last chunk
        __syncthreads();
        for (int e = tid; e < E; e += blockDim.x) {
            int c = 0;
            for (int w = 0; w < CW; ++w) c += __popc(bits[e * CW + w]);
            at[e] += c;
            left[e] -= c;
        }
    }
}

// ---- the routed experts of a prompt pass as a grouped GEMM (qgemm.hip) ------------------------
// step_expert_tiles cuts step_expert_list's entries into the GEMM's row tiles: a tile is up to
// EL_TILE_ENTRIES consecutive entries of one expert, counted from the expert's first entry, so up
// to 64 pairs of one expert. An expert's entries are full but its last, so row r of a tile is pair
// r % EL_PAIRS of entry u0 + r / EL_PAIRS. Layout (int32): [0] = number of tiles n; tile t at
// 1 + 2t = {first entry u0, pair count}, tiles in list order. An expert of c pairs takes
// ceil(c / 64) tiles: a pass has at most ceil(L*kk / 64) + min(E, L*kk) (launch.expert_tiles).
// Which pairs share a tile changes no bit: each row of the GEMM sums its own input row alone.

// The first entry of entry u's expert: the entries are in ascending expert id.
__device__ __forceinline__ int et_first_entry(const int* __restrict__ list, int u) {
    int e = list[1 + u * EL_STRIDE], lo = 0, hi = u;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (list[1 + mid * EL_STRIDE] < e)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

// One block of 256 threads over the entries in chunks of 256: an entry whose place among its
// expert's entries is a multiple of EL_TILE_ENTRIES starts a tile, placed by a scan of the starts.
extern "C" __global__ void step_expert_tiles(const int* __restrict__ list, int* __restrict__ tiles) {
    DS4_KERNEL_ENTRY;
    __shared__ int wsum[32];
    int tid = threadIdx.x, lane = tid % DS4_WARP, warp = tid / DS4_WARP, nwarps = blockDim.x / DS4_WARP;
    int n = list[0], before = 0;  // tiles of the chunks before
    for (int c0 = 0; c0 < n; c0 += blockDim.x) {
        int u = c0 + tid;
        int start = u < n && (u - et_first_entry(list, u)) % EL_TILE_ENTRIES == 0;
        int incl = start;
        for (int o = 1; o < DS4_WARP; o <<= 1) {
            int v = DS4_SHFL(incl, lane >= o ? lane - o : lane);
            if (lane >= o) incl += v;
        }
        if (lane == DS4_WARP - 1) wsum[warp] = incl;
        __syncthreads();
        int t = before + incl - start;
        for (int w = 0; w < warp; ++w) t += wsum[w];
        if (start) {
            const int* ent = list + 1 + u * EL_STRIDE;
            int pairs = 0;
            for (int k = 0; k < EL_TILE_ENTRIES && u + k < n && ent[k * EL_STRIDE] == ent[0]; ++k)
                pairs += ent[k * EL_STRIDE + 1];
            tiles[1 + 2 * t] = u;
            tiles[2 + 2 * t] = pairs;
        }
        for (int w = 0; w < nwarps; ++w) before += wsum[w];
        __syncthreads();  // every thread has read wsum before the next chunk writes it
    }
    if (tid == 0) tiles[0] = before;
}

// Grid (any number of blocks): block b takes work items b, b + gridDim.x, ... of
// n_chosen * row_blocks, item w = (chosen expert w / row_blocks, row block w % row_blocks),
// so consecutive blocks read consecutive rows of one expert. x_l = x[l] (gate/up) or
// x[l, t] (down, x_per_choice). Each item runs matvec v3's body (ds4_mv3.h) over the
// expert's pairs in lane order: a pair's column order and operation sequence are the dense
// matvec's, so a lane's result never depends on which other lanes chose the expert. Nor on how
// the list cuts an expert's pairs into entries (so not on the pass's size or the list kernel's
// chunks): each pair has its own accumulators, the staged chunk KC is a multiple of 256 columns
// for any pair count na, so a thread meets its columns in one order, and mv3_store_sums reduces
// each pair's accumulators alone. qdot.hip's qx_body holds to the same (MQ_CHUNK_UNIT).
template <int WT, int R, int U>
DS4_BODY void ex3_body(const ds4_u8* __restrict__ W, const float* __restrict__ x, int x_per_choice,
                         const int* __restrict__ list, float* __restrict__ y, int N, int K, int kk) {
    __shared__ float4 xs4[MV3_XS / 4];
    __shared__ const float* xrow[EL_PAIRS];
    __shared__ long long ybase[EL_PAIRS];
    int n_items = list[0] * ((N + MV3_WARPS * R - 1) / (MV3_WARPS * R));
    int rblocks = (N + MV3_WARPS * R - 1) / (MV3_WARPS * R);
    long long rb = mv3_row_bytes(WT, K);
    for (int w = blockIdx.x; w < n_items; w += gridDim.x) {
        const int* ent = list + 1 + (w / rblocks) * EL_STRIDE;
        int na = ent[1];
        __syncthreads();  // the previous item no longer reads xrow / ybase
        if (threadIdx.x < na) {
            long long lt = ent[2 + threadIdx.x];
            xrow[threadIdx.x] = x + (x_per_choice ? lt : lt / kk) * K;
            ybase[threadIdx.x] = lt * N;
        }
        mv3_rows<WT, R, U>(W + (long long)ent[0] * N * rb, rb, N, 0, K, na, xrow, ybase, y, xs4, w % rblocks);
    }
}

#define STEP_EXPERTS3(NAME, WT, R, U)                                                                 \
    extern "C" __global__ void __launch_bounds__(MV3_WARPS * DS4_WARP)                               \
        NAME(const ds4_u8* W, const float* x, int x_per_choice, const int* list, float* y, int N,    \
             int K, int kk) {                                                                         \
        DS4_KERNEL_ENTRY;                                                                             \
        ex3_body<WT, R, U>(W, x, x_per_choice, list, y, N, K, kk);                                    \
    }

STEP_EXPERTS3(step_experts3_f32_r1, WT_F32, 1, 4)
STEP_EXPERTS3(step_experts3_f32_r2, WT_F32, 2, 2)
STEP_EXPERTS3(step_experts3_f16_r1, WT_F16, 1, 8)
STEP_EXPERTS3(step_experts3_f16_r2, WT_F16, 2, 4)
STEP_EXPERTS3(step_experts3_bf16_r1, WT_BF16, 1, 8)
STEP_EXPERTS3(step_experts3_bf16_r2, WT_BF16, 2, 4)
STEP_EXPERTS3(step_experts3_bf16_r4, WT_BF16, 4, 2)
STEP_EXPERTS3(step_experts3_q8_0_r1, WT_Q8_0, 1, 2 * MV3_U_Q8)
STEP_EXPERTS3(step_experts3_q8_0_r2, WT_Q8_0, 2, MV3_U_Q8)
STEP_EXPERTS3(step_experts3_q2_k_r1, WT_Q2_K, 1, 2 * MV3_U_LOWBIT)
STEP_EXPERTS3(step_experts3_q2_k_r2, WT_Q2_K, 2, MV3_U_LOWBIT)
STEP_EXPERTS3(step_experts3_q4_k_r1, WT_Q4_K, 1, 2 * MV3_U_LOWBIT)
STEP_EXPERTS3(step_experts3_q4_k_r2, WT_Q4_K, 2, MV3_U_LOWBIT)
STEP_EXPERTS3(step_experts3_iq2_xxs_r1, WT_IQ2_XXS, 1, 2 * MV3_U_LOWBIT)
STEP_EXPERTS3(step_experts3_iq2_xxs_r2, WT_IQ2_XXS, 2, MV3_U_LOWBIT)
STEP_EXPERTS3(step_experts3_mxfp4_r1, WT_MXFP4, 1, 2 * MV3_U_LOWBIT)
STEP_EXPERTS3(step_experts3_mxfp4_r2, WT_MXFP4, 2, MV3_U_LOWBIT)

// y[l] = sum_t w[l, t] * down[l, t] (t ascending = expert ids ascending) + shared[l].
extern "C" __global__ void step_moe_combine(const float* down, const float* w, const float* shared, float* y,
                                            int L, int kk, int d) {
    DS4_KERNEL_ENTRY;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)L * d) return;
    int l = (int)(idx / d), e = (int)(idx % d);
    float acc = 0.0f;
    for (int t = 0; t < kk; ++t) acc += w[l * kk + t] * down[((long long)l * kk + t) * d + e];
    y[idx] = shared ? acc + shared[idx] : acc;
}

// hc head per lane: r = 1/sqrt(mean(f^2) + eps), pre = sigmoid(mix * r * scale + base) + hc_eps,
// out = sum_k pre_k * streams[k]. mix = f @ fn.T comes from the matvec kernel. Grid (lanes).
// Rows with from[l] < 0 (no row to emit) are skipped.
extern "C" __global__ void step_hc_head(const float* streams, const float* mix, const float* base,
                                        const float* scale, int hc, int d, float rms_eps, float hc_eps,
                                        const int* from, float* out) {
    DS4_KERNEL_ENTRY;
    __shared__ float scratch[32];
    __shared__ float pre[16];
    int l = blockIdx.x;
    if (from[l] < 0) return;
    const float* f = streams + (long long)l * hc * d;
    float ss = ds4_block_sum(ds4_strided_sumsq(f, hc * d), scratch);
    if (threadIdx.x < hc) {
        float r = 1.0f / sqrtf(ss / (float)(hc * d) + rms_eps);
        float m = mix[(long long)l * hc + threadIdx.x] * r;
        pre[threadIdx.x] = ds4_sigmoid(m * scale[0] + base[threadIdx.x]) + hc_eps;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float acc = 0.0f;
        for (int k = 0; k < hc; ++k) acc += pre[k] * f[(long long)k * d + e];
        out[(long long)l * d + e] = acc;
    }
}

// out[l, k, :] = a[l, k, :] + b[l, :] for the hc streams k of each of L lanes: the MTP block's
// input streams, h_proj of each stream plus the lane's one e_proj row (reference/mtp.py adds
// them in this order). Grid over L * hc * d.
extern "C" __global__ void step_add_rows(const float* __restrict__ a, const float* __restrict__ b,
                                         float* __restrict__ out, int L, int hc, int d) {
    DS4_KERNEL_ENTRY;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)L * hc * d) return;
    long long l = idx / ((long long)hc * d);
    out[idx] = a[idx] + b[l * d + idx % d];
}

// dst[e] = src[from[e]] for the rows e < L with from[e] >= 0 (n floats a row): the rows
// that emit, gathered to the front so the head runs on as many lane groups as emit.
extern "C" __global__ void step_gather_rows(const float* __restrict__ src, const int* __restrict__ from,
                                            float* __restrict__ dst, int n) {
    DS4_KERNEL_ENTRY;
    int e = blockIdx.x, l = from[e];
    if (l < 0) return;
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[(long long)e * n + i] = src[(long long)l * n + i];
}

// ---- DSpark (hip/dspark.py) -------------------------------------------------
// out[l, off .. off + d) = the mean of lane l's hc streams, summed in stream order from +0 and
// divided by hc (ops.stream_mean): what the draft reads of a tapped target layer. Rows are ld wide.
extern "C" __global__ void step_stream_mean(const float* __restrict__ streams, const int* __restrict__ slot,
                                            int hc, int d, float* __restrict__ out, int ld, int off) {
    DS4_KERNEL_ENTRY;
    int l = blockIdx.x;
    if (slot[l] < 0) return;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = 0.0f;
        for (int k = 0; k < hc; ++k) acc += streams[((long long)l * hc + k) * d + i];
        out[(long long)l * ld + off + i] = acc / (float)hc;
    }
}

// The Markov head's input for request lane r (slot[r] >= 0): e[r] = row tok[r] of markov_w1
// (d wide, encoding wt), tok the token drafted before. A token out of 0 .. V - 1 (the answer of
// an argmax over a non-finite row) reads row 0: a draft, never an output, so any token will do.
extern "C" __global__ void step_markov_gather(const ds4_u8* E, int wt, int d, int V, const int* __restrict__ slot,
                                              const int* __restrict__ tok, float* __restrict__ e) {
    DS4_KERNEL_ENTRY;
    int r = blockIdx.x;
    if (slot[r] < 0) return;
    int t = tok[r];
    const ds4_u8* row = E + (long long)(t >= 0 && t < V ? t : 0) * so_row_bytes(wt, d);
    for (int i = threadIdx.x; i < d; i += blockDim.x) e[(long long)r * d + i] = so_elem(row, wt, i);
}

// out[r] = base[r * B + i] + mk[r] (V logits a row) for the request lanes r < R: block row i's
// logits plus its Markov term, the row the i-th draft is the argmax of. Grid over R * V.
extern "C" __global__ void step_markov_add(const float* __restrict__ base, const float* __restrict__ mk,
                                           const int* __restrict__ slot, int B, int i, int R, int V,
                                           float* __restrict__ out) {
    DS4_KERNEL_ENTRY;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)R * V) return;
    long long r = idx / V, v = idx % V;
    if (slot[r] < 0) return;
    out[idx] = base[(r * B + i) * V + v] + mk[idx];
}

__device__ __forceinline__ ds4_u64 so_mix(ds4_u64 z) {  // splitmix64's finaliser
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Benchmark weights in any stored encoding, made on the device: row i of `out` is row
// so_mix(seed + i) % n_tmpl of a host-made template of valid rows (so every block is one
// the host's quantiser or random_blocks wrote). Rows are row_words 32-bit words.
extern "C" __global__ void step_tile_rows(ds4_u32* out, long long rows, int row_words, const ds4_u32* tmpl,
                                          int n_tmpl, ds4_u64 seed) {
    DS4_KERNEL_ENTRY;
    long long n = rows * row_words;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / row_words;
        ds4_u64 t = so_mix(seed + (ds4_u64)r * 0x9E3779B97F4A7C15ull) % (ds4_u64)n_tmpl;
        out[i] = tmpl[t * row_words + (i - r * row_words)];
    }
}

// Benchmark weights made on the device: uniform in [-scale, scale) from a counter
// hash, rounded to bf16 (nearest even).
extern "C" __global__ void step_init_bf16(ds4_u16* out, long long n, ds4_u64 seed, float scale) {
    DS4_KERNEL_ENTRY;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i < n; i += (long long)gridDim.x * blockDim.x) {
        ds4_u64 z = seed + (ds4_u64)i * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
        ds4_u32 b = __float_as_uint(u * scale);
        b = b + 0x7fffu + ((b >> 16) & 1u);
        out[i] = (ds4_u16)(b >> 16);
    }
}
