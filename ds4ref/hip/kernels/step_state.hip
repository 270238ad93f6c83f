// Kernels of the HIP backend's gathered pass that touch the per-slot and paged state.
//
// One pass holds L lanes (rows): 16 for a decode pass, more for a prompt pass (the
// kernels take L as an argument or as their grid). Several lanes may belong to one slot
// (consecutive positions). Every kernel here reads the state as it was BEFORE
// the pass plus the pass's own per-lane buffers ("snapshot + pass"), and the
// state is written back only by the commit kernels at the end of each layer.
// So a later lane of a slot sees its earlier lanes' KV and compressor inputs
// (taken from the pass buffers) and never a later lane's writes, whatever the
// order the GPU runs blocks in. This is what lets one kernel serve all lanes.
//
// Per-lane inputs (int32[L] each, written by the host before every replay):
//   slot    -1 for a padding lane
//   pos     the lane's position
//   pstart  position of the slot's first lane in this pass
//   flane   lane index of that first lane (lane of position q = flane + q - pstart)
//   last    position of the slot's last lane in this pass
//   nvis    compressed rows visible to the lane for a given ratio: (pos + 1) / ratio
#include "ds4_hip.h"
#include "ds4_q8.h"

// ---- stored rows: float32, or the compact lossless form of official numerics ----
// docs/paging.md defines the bytes (ds4ref/paging/compact.py is the host side):
//   KV row (ROW_KV):     E4M3FN codes of dims 0..nope-1, one exponent byte (e + 127) per 64,
//                        zero pad to 4 bytes, then the n_rot RoPE dims as float32
//   indexer row (ROW_IX): E2M1 codes two per byte (low nibble = even dim), one exponent
//                        byte per 32, zero pad to 4 bytes
// Every official-numerics row is an FP8 (resp. FP4) grid value times a power of two per
// block, so the compact form holds it exactly: reading gives back the float32 bits.
#define ROW_F32 0
#define ROW_KV 1
#define ROW_IX 2

struct RowFmt {
    int kind, D, nrot;  // D: the row's width; nrot: float32 RoPE tail of a KV row
};

__device__ __forceinline__ int kv_tail_at(int D, int nrot) {  // byte offset of the RoPE floats
    int nope = D - nrot;
    return (nope + nope / 64 + 3) & ~3;
}

__device__ __forceinline__ float pow2_biased(int b) {  // 2^(b - 127), b in 1..254; 0 for b = 0
    return __uint_as_float((ds4_u32)b << 23);
}

__device__ __forceinline__ float e4m3_value(ds4_u32 c) {
    ds4_u32 E = (c >> 3) & 15u, m = c & 7u;
    float mag = E ? __uint_as_float(((E + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;  // m * 2^-9
    return (c & 0x80u) ? -mag : mag;
}

__device__ __forceinline__ float e2m1_value(ds4_u32 c) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float v = mag[c & 7u];
    return (c & 8u) ? -v : v;
}

// Element d of a stored row.
__device__ __forceinline__ float row_get(const ds4_u8* row, const RowFmt& f, int d) {
    if (f.kind == ROW_F32) return ((const float*)row)[d];
    if (f.kind == ROW_KV) {
        int nope = f.D - f.nrot;
        if (d >= nope) return ((const float*)(row + kv_tail_at(f.D, f.nrot)))[d - nope];
        return e4m3_value(row[d]) * pow2_biased(row[nope + d / 64]);
    }
    return e2m1_value((row[d / 2] >> (4 * (d & 1))) & 15u) * pow2_biased(row[f.D / 2 + d / 32]);
}

__device__ __forceinline__ int row_bytes(const RowFmt& f) {
    if (f.kind == ROW_F32) return 4 * f.D;
    if (f.kind == ROW_KV) return kv_tail_at(f.D, f.nrot) + 4 * f.nrot;
    return (f.D / 2 + f.D / 32 + 3) & ~3;
}

// e with 2^e the block scale: the smallest power of two with amax / qmax <= 2^e, from the
// float32 quotient (frexp: x = f * 2^k, f in [0.5, 1); e = k unless f is exactly 0.5).
__device__ __forceinline__ int block_exponent(float amax, float floor_, float qmax) {
    int k;
    float f = frexpf(fmaxf(amax, floor_) / qmax, &k);
    return f > 0.5f ? k : k - 1;
}

__device__ __forceinline__ ds4_u32 e4m3_code(float q) {  // q on the E4M3FN grid
    ds4_u32 sign = q < 0.0f || (q == 0.0f && signbit(q)) ? 0x80u : 0u;
    float a = fabsf(q);
    if (a < 0.015625f) return sign | (ds4_u32)(a * 512.0f);  // subnormal: m * 2^-9
    int k;
    float f = frexpf(a, &k);  // a = 2f * 2^(k-1), 2f = 1 + m/8
    return sign | ((ds4_u32)(k + 6) << 3) | (ds4_u32)(16.0f * f - 8.0f);
}

__device__ __forceinline__ ds4_u32 e2m1_code(float q) {  // q on the E2M1 grid
    ds4_u32 sign = q < 0.0f || (q == 0.0f && signbit(q)) ? 8u : 0u;
    float a = fabsf(q);
    if (a == 0.0f) return sign;
    if (a < 1.0f) return sign | 1u;
    int k;
    float f = frexpf(a, &k);
    return sign | (ds4_u32)(2 * k + (f > 0.5f ? 1 : 0));
}

// Write one row (v: D floats) in format f. Called by a whole block.
DS4_BODY void row_put(ds4_u8* dst, const float* v, const RowFmt& f) {
    __shared__ int ex[64];
    if (f.kind == ROW_F32) {
        for (int i = threadIdx.x; i < f.D; i += blockDim.x) ((float*)dst)[i] = v[i];
        return;
    }
    int bs = f.kind == ROW_KV ? 64 : 32, n = f.kind == ROW_KV ? f.D - f.nrot : f.D, nb = n / bs;
    __syncthreads();  // ex[] is free
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        float amax = 0.0f;
        for (int i = 0; i < bs; ++i) amax = fmaxf(amax, fabsf(v[b * bs + i]));
        ex[b] = f.kind == ROW_KV ? block_exponent(amax, 1e-4f, 448.0f)
                                 : block_exponent(amax, 7.052966104933725e-38f, 6.0f);
    }
    __syncthreads();
    int cbytes = f.kind == ROW_KV ? n : n / 2, head = f.kind == ROW_KV ? kv_tail_at(f.D, f.nrot) : row_bytes(f);
    for (int j = threadIdx.x; j < head; j += blockDim.x) {
        ds4_u32 byte = 0;
        if (j < cbytes && f.kind == ROW_KV) {
            byte = e4m3_code(ldexpf(v[j], -ex[j / 64]));
        } else if (j < cbytes) {
            byte = e2m1_code(ldexpf(v[2 * j], -ex[2 * j / 32])) |
                   (e2m1_code(ldexpf(v[2 * j + 1], -ex[(2 * j + 1) / 32])) << 4);
        } else if (j < cbytes + nb) {
            byte = (ds4_u32)(ex[j - cbytes] + 127);
        }
        dst[j] = (ds4_u8)byte;
    }
    if (f.kind == ROW_KV)
        for (int i = threadIdx.x; i < f.nrot; i += blockDim.x) ((float*)(dst + head))[i] = v[n + i];
}

// ---- compressor: candidates of the window a lane completes ----------------

struct CompArgs {
    const float* proj_kv;   // (L, CW) this pass's a @ kv.T, CW = coff * D
    const float* proj_sc;   // (L, CW) this pass's a @ gate.T (ape not yet added)
    const float* ape;       // (ratio, CW)
    const float* cur_kv;    // (n_slots, ratio, CW) state before the pass
    const float* cur_sc;
    int ratio, CW;
};

// kv and score of column `col` at position q of the lane's slot: from the pass when
// q >= pstart, else from the compressor's current-window state.
__device__ __forceinline__ void comp_fetch(const CompArgs& a, int slot, int pstart, int flane, int q, int col,
                                           float* kv, float* sc) {
    int j = q % a.ratio;
    if (q >= pstart) {
        int ln = flane + (q - pstart);
        *kv = a.proj_kv[(long long)ln * a.CW + col];
        *sc = a.proj_sc[(long long)ln * a.CW + col] + a.ape[(long long)j * a.CW + col];
    } else {
        long long o = ((long long)slot * a.ratio + j) * a.CW + col;
        *kv = a.cur_kv[o];
        *sc = a.cur_sc[o];
    }
}

// One thread per (lane, candidate, channel). For a lane whose position ends a
// window (and is valid) write the pooling candidates as ops.pool_window expects:
// ratio 4: the previous window's lane A (4 rows, cols 0..D) then this window's
// lane B (cols D..2D); ratio 128: the window's 128 rows. Other lanes get score
// -inf (pooled to 0, never stored). Ratio 4 also writes this window's lane A
// (the next prev state) to nprev_kv/sc, and emit_pos = the window's first position.
extern "C" __global__ void step_comp_gather(const float* proj_kv, const float* proj_sc, const float* ape,
                                            const float* cur_kv, const float* cur_sc, const float* prev_kv,
                                            const float* prev_sc, int ratio, int D, int coff, int L,
                                            const int* slot, const int* pos, const int* pstart,
                                            const int* flane, float* cand_kv, float* cand_sc,
                                            float* nprev_kv, float* nprev_sc, int* emit_pos) {
    DS4_KERNEL_ENTRY;
    CompArgs a = {proj_kv, proj_sc, ape, cur_kv, cur_sc, ratio, coff * D};
    int C = ratio == 4 ? 8 : ratio;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)L * C * D) return;
    int d = (int)(idx % D);
    int c = (int)((idx / D) % C);
    int l = (int)(idx / ((long long)D * C));
    int s = slot[l], p = pos[l], ps = pstart[l], fl = flane[l];
    bool emit = s >= 0 && (p + 1) % ratio == 0;
    int w = p / ratio;
    if (c == 0 && d == 0) emit_pos[l] = w * ratio;
    float kv = 0.0f, sc = -DS4_INF;
    if (emit) {
        if (ratio != 4) {
            comp_fetch(a, s, ps, fl, w * ratio + c, d, &kv, &sc);
        } else if (c >= 4) {
            comp_fetch(a, s, ps, fl, w * 4 + (c - 4), D + d, &kv, &sc);
        } else if (w > 0) {
            int q = (w - 1) * 4 + c;
            if (w * 4 - 1 >= ps) {  // the previous window ended inside this pass
                comp_fetch(a, s, ps, fl, q, d, &kv, &sc);
            } else {                // it ended before: the prev state holds its lane A
                long long o = ((long long)s * 4 + c) * D + d;
                kv = prev_kv[o];
                sc = prev_sc[o];
            }
        }
        if (ratio == 4 && c < 4) {
            float nk, ns;
            comp_fetch(a, s, ps, fl, w * 4 + c, d, &nk, &ns);
            long long o = ((long long)l * 4 + c) * D + d;
            nprev_kv[o] = nk;
            nprev_sc[o] = ns;
        }
    }
    long long o = ((long long)l * C + c) * D + d;
    cand_kv[o] = kv;
    cand_sc[o] = sc;
}

// Store the finished compressed row of each emitting lane at row index pos/ratio of
// its slot's pages: page = block_table[slot][idx / per], offset idx % per.
extern "C" __global__ void step_comp_store(const float* rows, ds4_u8* store, const int* btab, int maxp, int per,
                                           int ratio, int D, int kind, int nrot, const int* slot, const int* pos) {
    DS4_KERNEL_ENTRY;
    int l = blockIdx.x;
    int s = slot[l], p = pos[l];
    if (s < 0 || (p + 1) % ratio) return;
    RowFmt f = {kind, D, nrot};
    int w = p / ratio;
    int page = btab[(long long)s * maxp + w / per];
    row_put(store + ((long long)page * per + (w % per)) * row_bytes(f), rows + (long long)l * D, f);
}

// Write the pass back into the compressor state, as token-by-token feeding would
// leave it: cur[pos % ratio] from the last lane of the slot with that remainder
// (pos > last - ratio), and for ratio 4 prev = lane A of the slot's last completed
// window in this pass. One thread per (lane, column).
extern "C" __global__ void step_comp_commit(const float* proj_kv, const float* proj_sc, const float* ape,
                                            float* cur_kv, float* cur_sc, const float* nprev_kv,
                                            const float* nprev_sc, float* prev_kv, float* prev_sc, int ratio,
                                            int D, int coff, int L, const int* slot, const int* pos,
                                            const int* last) {
    DS4_KERNEL_ENTRY;
    int CW = coff * D;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)L * CW) return;
    int col = (int)(idx % CW), l = (int)(idx / CW);
    int s = slot[l], p = pos[l], lp = last[l];
    if (s < 0) return;
    int j = p % ratio;
    if (p > lp - ratio) {
        long long o = ((long long)s * ratio + j) * CW + col;
        cur_kv[o] = proj_kv[(long long)l * CW + col];
        cur_sc[o] = proj_sc[(long long)l * CW + col] + ape[(long long)j * CW + col];
    }
    if (ratio == 4 && (p + 1) % 4 == 0 && p + 4 > lp && col < D) {
        for (int jj = 0; jj < 4; ++jj) {
            long long o = ((long long)s * 4 + jj) * D + col;
            long long n = ((long long)l * 4 + jj) * D + col;
            prev_kv[o] = nprev_kv[n];
            prev_sc[o] = nprev_sc[n];
        }
    }
}

// Raw window ring: ring[slot][pos % W] = kv of the lane, for the last W positions of
// the slot in this pass. ring points at this layer's rows; slot stride in bytes.
extern "C" __global__ void step_ring_commit(const float* kv, ds4_u8* ring, long long slot_stride, int W, int D,
                                            int kind, int nrot, const int* slot, const int* pos, const int* last) {
    DS4_KERNEL_ENTRY;
    int l = blockIdx.x;
    int s = slot[l], p = pos[l];
    if (s < 0 || p <= last[l] - W) return;
    RowFmt f = {kind, D, nrot};
    row_put(ring + s * slot_stride + (long long)(p % W) * row_bytes(f), kv + (long long)l * D, f);
}

// A slot's state that is not in pages, to (to_snapshot = 1) or from (0) a snapshot: the
// regions (rings, compressor windows) laid end to end, one launch whatever their number.
// desc holds per region its base address, its bytes a slot (slot s's at s times that) and
// its offset in the snapshot, all multiples of 4; blockIdx.y is the region.
extern "C" __global__ void step_slot_copy(const long long* desc, int slot, unsigned* snap, int to_snapshot) {
    DS4_KERNEL_ENTRY;
    const long long* d = desc + 3 * blockIdx.y;
    long long words = d[1] / 4;
    unsigned* live = (unsigned*)d[0] + slot * words;
    unsigned* copy = snap + d[2] / 4;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (long long)gridDim.x * blockDim.x) {
        if (to_snapshot) copy[i] = live[i];
        else live[i] = copy[i];
    }
}

// ---- lightning indexer over paged rows ------------------------------------

#define IX_WARPS 8
#define IX_QMAX 8192   // Hi * Di staged floats
#define IX_DPL 4       // Di <= 128

// score[l, n] = sum_h (wraw[l, h] * scale) * relu(qi[l, h] . row_n) for n < nvis[l], row_n read
// from the slot's pages; entries from nvis[l] on are not written (ds4_topk reads the first nvis[l]).
// One warp per row, grid-strided over the rows; a block with no row (a padding lane's, or past
// nvis) leaves before staging the query, so a one-row pass in the 16-lane program stages it once a block.
extern "C" __global__ void __launch_bounds__(IX_WARPS * DS4_WARP)
step_indexer_paged(const float* __restrict__ qi, const float* __restrict__ wraw, float scale,
                   const ds4_u8* __restrict__ store, int kind, const int* __restrict__ btab, int maxp, int per,
                   const int* __restrict__ slot, const int* __restrict__ nvis, float* __restrict__ out,
                   int Hi, int Di, int ncap) {
    DS4_KERNEL_ENTRY;
    __shared__ __align__(16) float qs[IX_QMAX];
    __shared__ float ws[64 * 4];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int l = blockIdx.y;
    int s = slot[l], n_ok = s >= 0 ? nvis[l] : 0;
    if ((int)blockIdx.x * IX_WARPS >= n_ok) return;  // no row of this block (all of a padding lane's)
    for (int i = threadIdx.x; i < Hi * Di; i += blockDim.x) qs[i] = qi[(long long)l * Hi * Di + i];
    for (int i = threadIdx.x; i < Hi; i += blockDim.x) ws[i] = wraw[(long long)l * Hi + i] * scale;
    __syncthreads();
    int nd = Di / DS4_WARP;
    for (int n = blockIdx.x * IX_WARPS + warp; n < n_ok; n += gridDim.x * IX_WARPS) {
        RowFmt f = {kind, Di, 0};
        int page = btab[(long long)s * maxp + n / per];
        const ds4_u8* kr = store + ((long long)page * per + n % per) * row_bytes(f);
        float kv[IX_DPL];
        for (int t = 0; t < IX_DPL; ++t) kv[t] = t < nd ? row_get(kr, f, lane + DS4_WARP * t) : 0.0f;
        float total = 0.0f;
        for (int h = 0; h < Hi; ++h) {
            float part = 0.0f;
            for (int t = 0; t < IX_DPL; ++t)
                if (t < nd) part += qs[h * Di + lane + DS4_WARP * t] * kv[t];
            float dot = ds4_warp_sum(part);
            total += fmaxf(dot, 0.0f) * ws[h];
        }
        if (lane == 0) out[(long long)l * ncap + n] = total;
    }
}

// ---- attention with sinks over ring + pass + paged compressed rows ---------

// Tuning macros (DS4REF_KERNEL_DEFINES; none changes a bit): AT_KT key rows decoded into
// shared memory per step (2 KiB each, so at most 16 in static shared memory; 16 halves the
// barriers of 8 at no occupancy cost: registers allow 3 blocks a multiprocessor), AT_HPW
// heads per warp (2: a warp reads each key element once for both heads and a block decodes
// a slice for 16 heads, but 128 registers with spills and 2 blocks a multiprocessor,
// against 80 at 1), AT_SLD float4s of a tile a staging thread loads before storing any.
#define AT_WARPS 8     // warps per block
#ifndef AT_KT
#define AT_KT 16
#endif
#define AT_DMAX 512
#define AT_DPL (AT_DMAX / DS4_WARP)
#ifndef AT_HPW
#define AT_HPW 1
#endif
#ifndef AT_KG
#define AT_KG 4        // keys whose dots and butterflies run side by side (divides AT_KT)
#endif
// Float4s of a key tile a staging thread loads before it decodes and stores any (each load used
// at once costs a memory latency per float4). 4 and 8 measured alike on the full model and 2
// slower at C = 1 (docs/performance.md); 4 holds fewer registers (115 against 126).
#ifndef AT_SLD
#define AT_SLD 4
#endif
static_assert(AT_KT % AT_KG == 0, "AT_KG must divide AT_KT: a group reads only rows of its tile");
#define AT_HPB (AT_WARPS * AT_HPW)  // heads per block; the host's grid covers H in blocks of 8

struct KeySrc {
    const float* pass_kv;  // (L, D) this pass's roped KV rows
    const ds4_u8* ring;    // this layer's ring rows (format fmt); slot stride ring_stride bytes
    long long ring_stride;
    const ds4_u8* store;   // compressed rows of this layer (n_pages, per, row), or null
    const int* btab;
    const int* sel;        // (L, ksel) selected row indices (ascending, -1 padded) or null = all
    int maxp, per, ksel, W, D;
    RowFmt fmt;
};

// Where key number n of the lane is stored, and in which format (*kind): raw positions
// lo..pos first (oldest first; the pass's float32 rows from pstart on, the ring's before),
// then the compressed rows in index order.
__device__ __forceinline__ const ds4_u8* key_row(const KeySrc& k, int l, int s, int lo, int nraw, int pstart,
                                                 int flane, int n, int* kind) {
    if (n < nraw) {
        int q = lo + n;
        if (q >= pstart) {
            *kind = ROW_F32;
            return (const ds4_u8*)(k.pass_kv + (long long)(flane + q - pstart) * k.D);
        }
        *kind = k.fmt.kind;
        return k.ring + s * k.ring_stride + (long long)(q % k.W) * row_bytes(k.fmt);
    }
    int t = n - nraw;
    int r = k.sel ? k.sel[(long long)l * k.ksel + t] : t;
    int page = k.btab[(long long)s * k.maxp + r / k.per];
    *kind = k.fmt.kind;
    return k.store + ((long long)page * k.per + r % k.per) * row_bytes(k.fmt);
}

// Elements d .. d+3 (d % 4 == 0) of a key row, float32 (kind ROW_F32) or ROW_KV (D and nrot
// from f), in two steps so that a thread's loads are all in flight before any is used:
// row_load4 reads the bytes (one 16-byte load, or one word of four codes and its block's
// exponent, where the row's alignment allows; element by element where it does not) and
// row_decode4 gives the bits row_get gives. *fp8: the word holds E4M3 codes still to decode.
__device__ __forceinline__ uint4 row_load4(const ds4_u8* row, int kind, const RowFmt& f, int d, bool* fp8) {
    unsigned long long at = (unsigned long long)row;
    const ds4_u32* w = (const ds4_u32*)row;
    *fp8 = false;
    if (kind == ROW_F32) {
        if ((at & 15ull) == 0) return ((const uint4*)row)[d / 4];
        return make_uint4(w[d], w[d + 1], w[d + 2], w[d + 3]);
    }
    int nope = f.D - f.nrot;
    if ((nope & 3) == 0 && (at & 3ull) == 0) {
        if (d >= nope) {
            const ds4_u32* t = (const ds4_u32*)(row + kv_tail_at(f.D, f.nrot)) + (d - nope);
            return make_uint4(t[0], t[1], t[2], t[3]);
        }
        *fp8 = true;
        return make_uint4(*(const ds4_u32*)(row + d), row[nope + d / 64], 0u, 0u);  // d .. d+3 share a 64-block
    }
    RowFmt g = {ROW_KV, f.D, f.nrot};
    return make_uint4(__float_as_uint(row_get(row, g, d)), __float_as_uint(row_get(row, g, d + 1)),
                      __float_as_uint(row_get(row, g, d + 2)), __float_as_uint(row_get(row, g, d + 3)));
}

__device__ __forceinline__ float4 row_decode4(uint4 r, bool fp8) {
    if (!fp8) return make_float4(__uint_as_float(r.x), __uint_as_float(r.y), __uint_as_float(r.z), __uint_as_float(r.w));
    float sc = pow2_biased(r.y);
    return make_float4(e4m3_value(r.x & 0xffu) * sc, e4m3_value((r.x >> 8) & 0xffu) * sc,
                       e4m3_value((r.x >> 16) & 0xffu) * sc, e4m3_value(r.x >> 24) * sc);
}

// ---- attention split over keys (v3) -------------------------------------------
// The lane's keys cut into fixed slices of AT3_SPLIT keys (z of the grid's third dimension;
// the grid covers the most keys any lane can have). Block (head set, lane, z) runs the
// online softmax over its slice for AT_HPB heads, AT_HPW a warp, and writes (m, den, acc)
// per head; step_attention_combine merges a lane's slices in z order, then the sink.
// Slices depend only on the lane's own key count, so a lane's result is the same alone or
// among 16. Each key tile is decoded once into shared memory for all the block's heads
// (where a key row is stored is worked out once per slice); a warp reads each key element
// once for its AT_HPW heads. A head's operations are those of one head alone, in the same
// order, so AT_HPW and the grid's head blocks change no bit (any gridDim.x is correct:
// blocks stride over the head sets). `pos` is where a lane's raw keys end: its position, or for
// a DSpark block row the block's last row (every row of a block sees the whole block).
#define AT3_SPLIT 32

__device__ __forceinline__ int at_lane_keys(int s, int p, int W, const void* store, const int* nvis,
                                            const int* sel, int ksel, int l, int* lo, int* nraw) {
    *lo = p - W + 1 > 0 ? p - W + 1 : 0;
    *nraw = s >= 0 ? p - *lo + 1 : 0;
    int ncomp = 0;
    if (s >= 0 && store) {
        ncomp = nvis[l];
        if (sel && ncomp > ksel) ncomp = ksel;
    }
    return *nraw + ncomp;
}

// A key tile sits in shared memory lane-major: dims lane + 32t for t = 4u .. 4u + 3 are one
// float4 at [u][lane], so a lane reads its dims of a key in AT_DPL / 4 loads instead of AT_DPL
// (the same values, summed in the same order).
#define AT_AT(d) ((((d) / DS4_WARP) / 4) * (4 * DS4_WARP) + ((d) % DS4_WARP) * 4 + ((d) / DS4_WARP) % 4)
// A lane's dims lane + 32t (t < nd) of a key row staged lane-major (AT_AT).
__device__ __forceinline__ void at_key_dims(const float* kt, int lane, int nd, float* out) {
#pragma unroll
    for (int u = 0; u < AT_DPL / 4; ++u) {
        float4 v = 4 * u < nd ? *(const float4*)(kt + u * 4 * DS4_WARP + 4 * lane) : make_float4(0.f, 0.f, 0.f, 0.f);
        out[4 * u] = v.x; out[4 * u + 1] = v.y; out[4 * u + 2] = v.z; out[4 * u + 3] = v.w;
    }
}

extern "C" __global__ void __launch_bounds__(AT_WARPS * DS4_WARP)
step_attention_split(const float* __restrict__ q, const float* pass_kv, const ds4_u8* ring, long long ring_stride,
                     const ds4_u8* store, int kind, int nrot, const int* btab, int maxp, int per, const int* sel, int ksel,
                     const int* slot, const int* pos, const int* pstart, const int* flane, const int* nvis,
                     int H, int D, int W, float scale, float* __restrict__ part_m,
                     float* __restrict__ part_den, float* __restrict__ part_acc) {
    DS4_KERNEL_ENTRY;
    __shared__ __align__(16) float ks[AT_KT * AT_DMAX];
    __shared__ const ds4_u8* krow[AT3_SPLIT];
    __shared__ int kkind[AT3_SPLIT];
    KeySrc k = {pass_kv, ring, ring_stride, store, btab, sel, maxp, per, ksel, W, D, {kind, D, nrot}};
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int l = blockIdx.y, z = blockIdx.z, nz = gridDim.z;
    int s = slot[l], p = pos[l];
    int lo, nraw;
    int total = at_lane_keys(s, p, W, store, nvis, sel, ksel, l, &lo, &nraw);
    int nbeg = z * AT3_SPLIT;
    // the combine reads only this lane's slices
    if (s < 0 || nbeg >= total || (int)blockIdx.x * AT_HPB >= H) return;
    int nend = nbeg + AT3_SPLIT < total ? nbeg + AT3_SPLIT : total;
    int nd = D / DS4_WARP, g4 = D / 4;
    const int rr0 = threadIdx.x / g4, c40 = threadIdx.x % g4;
    const int rstep = (AT_WARPS * DS4_WARP) / g4, cstep = (AT_WARPS * DS4_WARP) % g4;
    if (threadIdx.x < nend - nbeg) {  // visible after the first tile's barrier
        int kd;
        krow[threadIdx.x] = key_row(k, l, s, lo, nraw, pstart[l], flane[l], nbeg + threadIdx.x, &kd);
        kkind[threadIdx.x] = kd;
    }
    for (int hb = blockIdx.x * AT_HPB; hb < H; hb += gridDim.x * AT_HPB) {
        int h0 = hb + warp * AT_HPW;
        bool active = h0 < H;  // heads past H in an active warp run on zeros and are not written
        float qv[AT_HPW][AT_DPL], acc[AT_HPW][AT_DPL], m[AT_HPW], den[AT_HPW];
#pragma unroll
        for (int j = 0; j < AT_HPW; ++j) {
#pragma unroll
            for (int t = 0; t < AT_DPL; ++t) {
                qv[j][t] = (h0 + j < H && t < nd) ? q[((long long)l * H + h0 + j) * D + lane + DS4_WARP * t] : 0.0f;
                acc[j][t] = 0.0f;
            }
            m[j] = -DS4_INF;
            den[j] = 0.0f;
        }
        for (int n0 = nbeg; n0 < nend; n0 += AT_KT) {
            int nk = nend - n0 < AT_KT ? nend - n0 : AT_KT;
            __syncthreads();  // the previous tile is consumed
            // float4 e of the tile is (row e / g4, dims 4 (e % g4) ..); a thread's e step by the block's
            // size, (rr, c4) kept by adding its quotient and remainder (no division a float4)
            int rr = rr0, c4 = c40;
            for (int e0 = 0; e0 < nk * g4; e0 += AT_SLD * AT_WARPS * DS4_WARP) {
                uint4 raw[AT_SLD];
                int dst[AT_SLD];  // the float4's first element in the tile, -1 past its rows
                unsigned fp8 = 0u;
#pragma unroll
                for (int i = 0; i < AT_SLD; ++i) {
                    dst[i] = -1;
                    if (rr < nk) {
                        bool f8;
                        raw[i] = row_load4(krow[n0 - nbeg + rr], kkind[n0 - nbeg + rr], k.fmt, 4 * c4, &f8);
                        fp8 |= (unsigned)f8 << i;
                        dst[i] = rr * AT_DMAX + AT_AT(4 * c4);
                    }
                    rr += rstep;
                    c4 += cstep;
                    if (c4 >= g4) { c4 -= g4; ++rr; }
                }
#pragma unroll
                for (int i = 0; i < AT_SLD; ++i) {
                    if (dst[i] < 0) break;
                    float4 v = row_decode4(raw[i], (fp8 >> i) & 1u);
                    float* kt = ks + dst[i];  // AT_AT(4 c4 + j) = AT_AT(4 c4) + 4 j
                    kt[0] = v.x;
                    kt[4] = v.y;
                    kt[8] = v.z;
                    kt[12] = v.w;
                }
            }
            __syncthreads();
            if (!active) continue;
            for (int r0 = 0; r0 < nk; r0 += AT_KG) {
                // AT_KG keys' dots and butterflies (ds4_warp_sum's) side by side, then their online-
                // softmax steps in key order: a shuffle's latency is spent on the other keys' dots
                // (rows of the tile past nk give dots nobody reads)
                float dot[AT_KG][AT_HPW];
#pragma unroll
                for (int u = 0; u < AT_KG; ++u) {
                    float kv[AT_DPL];
                    at_key_dims(ks + (r0 + u) * AT_DMAX, lane, nd, kv);
#pragma unroll
                    for (int j = 0; j < AT_HPW; ++j) {
                        dot[u][j] = 0.0f;
#pragma unroll
                        for (int t = 0; t < AT_DPL; ++t)
                            if (t < nd) dot[u][j] += qv[j][t] * kv[t];
                    }
                }
#pragma unroll
                for (int mask = DS4_WARP / 2; mask > 0; mask >>= 1)
#pragma unroll
                    for (int u = 0; u < AT_KG; ++u)
#pragma unroll
                        for (int j = 0; j < AT_HPW; ++j) dot[u][j] += DS4_SHFL_XOR(dot[u][j], mask);
#pragma unroll
                for (int u = 0; u < AT_KG; ++u) {
                    if (r0 + u >= nk) break;
                    float kr[AT_DPL];
                    at_key_dims(ks + (r0 + u) * AT_DMAX, lane, nd, kr);
#pragma unroll
                    for (int j = 0; j < AT_HPW; ++j) {
                        float sc = dot[u][j] * scale;
                        if (sc > m[j]) {
                            float c = ds4_exp(m[j] - sc);  // 0 while m is -inf (acc and den are 0 then)
                            den[j] = den[j] * c + 1.0f;
#pragma unroll
                            for (int t = 0; t < AT_DPL; ++t)
                                if (t < nd) acc[j][t] = acc[j][t] * c + kr[t];
                            m[j] = sc;
                        } else {
                            float e = ds4_exp(sc - m[j]);
                            den[j] += e;
#pragma unroll
                            for (int t = 0; t < AT_DPL; ++t)
                                if (t < nd) acc[j][t] += e * kr[t];
                        }
                    }
                }
            }
        }
        if (!active) continue;
#pragma unroll
        for (int j = 0; j < AT_HPW; ++j) {
            if (h0 + j >= H) break;
            long long pi = ((long long)l * H + h0 + j) * nz + z;
            if (lane == 0) { part_m[pi] = m[j]; part_den[pi] = den[j]; }
#pragma unroll
            for (int t = 0; t < AT_DPL; ++t)
                if (t < nd) part_acc[pi * D + lane + DS4_WARP * t] = acc[j][t];
        }
    }
}

// Block (head, lane) of AT_CT threads over dims: the lane's slices in z order, then the sink.
// A slice's weight exp(m_z - mf) is formed once, by one thread, for a chunk of AT_CZ slices
// at a time (every thread forming every weight took half the kernel's time), and every sum
// still runs in z order. Padding lanes write zeros, as step_attention does.
// kend (null: pos) is the position the lane's raw keys end at, as split's `pos` was: a DSpark
// block row's keys end at its block's last row (hip/dspark.py), its RoPE is at its own position.
// Then the output's own epilogue, each the operations of the kernel it replaces: with half > 0
// the inverse RoPE of the head's last 2 * half dims at the lane's position (step_rope_pos;
// pair partners are neighbouring threads), and with xq the row's int8 blocks for the quantised
// product that reads it (ds4_quantize_q8; D % 32 == 0, so a block is one warp at one q).
#define AT_CT 128
#ifndef AT_CZ
#define AT_CZ AT_CT  // a tuning macro <= AT_CT (tests set a small one to cross chunks on short contexts)
#endif
static_assert(AT_CZ >= 1 && AT_CZ <= AT_CT, "a chunk's weights are one a thread");
extern "C" __global__ void __launch_bounds__(AT_CT)
step_attention_combine(const float* __restrict__ part_m, const float* __restrict__ part_den,
                       const float* __restrict__ part_acc, const float* __restrict__ sinks,
                       const int* slot, const int* pos, const int* kend, const ds4_u8* store,
                       const int* nvis, const int* sel, int ksel, int W, int H, int D,
                       int nz, float* __restrict__ out, const float* cs, int half,
                       ds4_i8* __restrict__ xq, float* __restrict__ dx, short* __restrict__ xs) {
    DS4_KERNEL_ENTRY;
    __shared__ float wz[AT_CZ];
    int h = blockIdx.x, l = blockIdx.y;
    int s = slot[l];
    int lo, nraw;
    int total = at_lane_keys(s, kend ? kend[l] : pos[l], W, store, nvis, sel, ksel, l, &lo, &nraw);
    int nsl = (total + AT3_SPLIT - 1) / AT3_SPLIT;
    float* o = out + ((long long)l * H + h) * D;
    long long base = ((long long)l * H + h) * nz;
    float sk = sinks[h];
    float mf = sk;
    if (s < 0) nsl = 0;
    for (int z = 0; z < nsl; ++z) mf = fmaxf(mf, part_m[base + z]);
    float dtot = ds4_exp(sk - mf);
    float a[AT_DMAX / AT_CT];
#pragma unroll
    for (int q = 0; q < AT_DMAX / AT_CT; ++q) a[q] = 0.0f;
    for (int z0 = 0; z0 < nsl; z0 += AT_CZ) {
        int nc = nsl - z0 < AT_CZ ? nsl - z0 : AT_CZ;
        __syncthreads();  // the previous chunk's weights are read
        if (threadIdx.x < nc) wz[threadIdx.x] = ds4_exp(part_m[base + z0 + threadIdx.x] - mf);
        __syncthreads();
        for (int j = 0; j < nc; ++j) dtot += part_den[base + z0 + j] * wz[j];
#pragma unroll
        for (int q = 0; q < AT_DMAX / AT_CT; ++q) {
            int d = threadIdx.x + AT_CT * q;
            if (d < D)
                for (int j = 0; j < nc; ++j) a[q] += part_acc[(base + z0 + j) * D + d] * wz[j];
        }
    }
    int nope = D - 2 * half, warp = threadIdx.x / DS4_WARP;
    const float* t = half ? cs + (long long)pos[l] * half * 2 : nullptr;
#pragma unroll
    for (int q = 0; q < AT_DMAX / AT_CT; ++q) {
        int d = threadIdx.x + AT_CT * q;
        float v = s < 0 ? 0.0f : a[q] / dtot;
        float pv = DS4_SHFL_XOR(v, 1);  // the RoPE pair's other value (nope and AT_CT are even)
        if (half && d >= nope && d < D) {
            int p = (d - nope) / 2;
            float c = t[2 * p], sn = -t[2 * p + 1];
            v = d % 2 == 0 ? v * c - pv * sn : pv * sn + v * c;
        }
        if (d < D) o[d] = v;
        int c0 = AT_CT * q + DS4_WARP * warp;  // the warp's block: columns c0 .. c0 + 31 of the head
        if (xq && c0 < D) {
            long long at = (long long)l * H * D + (long long)h * D + c0;
            ds4_q8_warp(v, xq + at, dx + at / QB, xs + at / 16);
        }
    }
}
