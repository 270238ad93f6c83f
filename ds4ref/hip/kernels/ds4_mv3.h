// ds4_mv3.h - the v3 batched-matvec body, shared by matvec.hip (dense matrices) and
// step_ops.hip (routed experts). Inlined into a kernel source by runtime.load_source.
// See matvec.hip's v3 section for the design; the per-input reduction order is v1's:
// warp lane t sums columns t*8 .. t*8+7 of every 256-column step in increasing order,
// each term entering its partial as fma(w, x, partial) (docs/exactness.md §2), then the
// xor butterfly combines the 32 partials.
#pragma once
#include "ds4_hip.h"
#include "ds4_iq2xxs.h"

#ifndef WT_F32
#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
#define WT_Q8_0 3
#endif
// GGUF's block quants, dequantised in registers exactly as gguf-py's quants module does
// (the same float32 operations in the same order), so a row's values are the reference's.
#define WT_Q2_K 4    // 256 per 84 bytes: scales[16], qs[64], d, dmin
#define WT_Q4_K 5    // 256 per 144 bytes: d, dmin, scales[12], qs[128]
#define WT_IQ2_XXS 6 // 256 per 66 bytes: d, then 8 x (grid indices u32, signs + scale u32)
#define WT_MXFP4 7   // 32 per 17 bytes: E8M0 exponent, qs[16]
#ifndef MV_LANES
#define MV_LANES 16
#endif

#define MV3_WARPS 8
#define MV3_XS 11904   // staged floats per block: 48 KiB of static shared memory less room for
                       // the per-input pointers and IQ2_XXS's grid (the limit covers all of it);
                       // the chunk width KC changes only the staging, never a lane's sum order

template <int WT>
struct Mv3Raw {
    uint4 v[WT == WT_F32 || WT == WT_Q4_K ? 2 : 1];
};

__device__ __forceinline__ ds4_u32 mv3_u32_at2(const ds4_u8* p) {  // a u32 at a 2-byte aligned address
    const ds4_u16* h = (const ds4_u16*)p;
    return (ds4_u32)h[0] | ((ds4_u32)h[1] << 16);
}

// The 8 4-bit codes of MXFP4 at in-block offset i0 (0, 8, 16 or 24), from a byte-aligned block.
__device__ __forceinline__ void mv3_mxfp4_codes(const ds4_u8* qs, int i0, ds4_u32* lo, ds4_u32* hi) {
    int b = i0 & 15, sh = i0 < 16 ? 0 : 4;
    ds4_u32 c[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) c[e] = (qs[b + e] >> sh) & 0xfu;
    *lo = c[0] | (c[1] << 4) | (c[2] << 8) | (c[3] << 12) | (c[4] << 16) | (c[5] << 20) | (c[6] << 24) | (c[7] << 28);
    *hi = 0;
}

// Raw words of 8 consecutive weights of `row` (a pointer to the row's first byte) at column col.
template <int WT>
__device__ __forceinline__ void mv3_load(const ds4_u8* __restrict__ row, int col, Mv3Raw<WT>& r) {
    if (WT == WT_F32) {
        const uint4* p = (const uint4*)(row + (long long)col * 4);
        r.v[0] = p[0];
        r.v[1] = p[1];
    } else if (WT == WT_F16 || WT == WT_BF16) {
        r.v[0] = *(const uint4*)(row + (long long)col * 2);
    } else if (WT == WT_Q8_0) {  // scale bits in .x, the 8 quants in .y/.z (blocks are only 2-byte aligned)
        const ds4_u8* blk = row + (long long)(col / 32) * 34;
        const ds4_u16* q = (const ds4_u16*)(blk + 2 + (col % 32));
        r.v[0].x = *(const ds4_u16*)blk;
        r.v[0].y = (ds4_u32)q[0] | ((ds4_u32)q[1] << 16);
        r.v[0].z = (ds4_u32)q[2] | ((ds4_u32)q[3] << 16);
        r.v[0].w = 0;
    } else if (WT == WT_Q2_K) {  // .x d | dmin, .y the sub-block's scale byte and the shift, .z/.w 8 qs bytes
        const ds4_u8* blk = row + (long long)(col / 256) * 84;
        int i0 = col % 256;
        const ds4_u32* q = (const ds4_u32*)(blk + 16 + (i0 / 128) * 32 + (i0 % 32));
        r.v[0].x = *(const ds4_u32*)(blk + 80);
        r.v[0].y = (ds4_u32)blk[i0 / 16] | ((ds4_u32)(2 * ((i0 % 128) / 32)) << 8);
        r.v[0].z = q[0];
        r.v[0].w = q[1];
    } else if (WT == WT_Q4_K) {  // v[0]: d | dmin, the 12 scale bytes; v[1]: 8 qs bytes, the sub-block
        const ds4_u8* blk = row + (long long)(col / 256) * 144;
        int i0 = col % 256;
        const ds4_u32* w32 = (const ds4_u32*)blk;
        const ds4_u32* q = (const ds4_u32*)(blk + 16 + (i0 / 64) * 32 + (i0 % 32));
        r.v[0] = make_uint4(w32[0], w32[1], w32[2], w32[3]);
        r.v[1] = make_uint4(q[0], q[1], (ds4_u32)(i0 / 32), 0u);
    } else if (WT == WT_IQ2_XXS) {  // .x d, .y grid indices, .z signs + scale, .w the group of 8
        const ds4_u8* blk = row + (long long)(col / 256) * 66;
        int i0 = col % 256;
        const ds4_u8* sub = blk + 2 + (i0 / 32) * 8;
        r.v[0].x = *(const ds4_u16*)blk;
        r.v[0].y = mv3_u32_at2(sub);
        r.v[0].z = mv3_u32_at2(sub + 4);
        r.v[0].w = (ds4_u32)((i0 % 32) / 8);
    } else {  // MXFP4: .x the exponent byte, .y the 8 codes (blocks are byte aligned)
        const ds4_u8* blk = row + (long long)(col / 32) * 17;
        ds4_u32 hi;
        r.v[0].x = blk[0];
        mv3_mxfp4_codes(blk + 1, col % 32, &r.v[0].y, &hi);
        r.v[0].z = r.v[0].w = 0;
    }
}

// MXFP4's E2M1 values doubled, and its E8M0 exponent as half the power of two (ggml's
// ggml_e8m0_to_fp32_half), so that the product is the value.
// (Arithmetic, not a table: a per-lane index into a local array lives in local memory.)
__device__ __forceinline__ float mv3_e2m1_doubled(ds4_u32 c) {
    ds4_u32 m = c & 7u;  // doubled magnitudes 0 1 2 3 4 6 8 12
    float mag = (float)(m < 4u ? m : (2u + (m & 1u)) << ((m >> 1) - 1u));
    return (c & 8u) && m ? -mag : mag;  // code 8 is +0, as gguf-py has it
}

__device__ __forceinline__ float mv3_e8m0_half(ds4_u32 e) {
    return __uint_as_float(e < 2u ? 0x00200000u << e : (e - 1u) << 23);
}

// The 8 weights as f32, each widened exactly (Q8_0: d * q is exact in f32). Rows past N are never loaded but
// still unpacked (their sums are never written): every index taken from the raw words is
// masked to its range, so such garbage cannot reach outside a table.
template <int WT>
__device__ __forceinline__ void mv3_unpack(const Mv3Raw<WT>& r, float* w, const ds4_u16* iq2_grid) {
    if (WT == WT_F32) {
        w[0] = __uint_as_float(r.v[0].x); w[1] = __uint_as_float(r.v[0].y);
        w[2] = __uint_as_float(r.v[0].z); w[3] = __uint_as_float(r.v[0].w);
        w[4] = __uint_as_float(r.v[1].x); w[5] = __uint_as_float(r.v[1].y);
        w[6] = __uint_as_float(r.v[1].z); w[7] = __uint_as_float(r.v[1].w);
    } else if (WT == WT_F16 || WT == WT_BF16) {
        ds4_u32 parts[4] = {r.v[0].x, r.v[0].y, r.v[0].z, r.v[0].w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            ds4_u16 lo = (ds4_u16)(parts[t] & 0xffffu), hi = (ds4_u16)(parts[t] >> 16);
            w[2 * t] = WT == WT_F16 ? ds4_f16_to_f32(lo) : ds4_bf16_to_f32(lo);
            w[2 * t + 1] = WT == WT_F16 ? ds4_f16_to_f32(hi) : ds4_bf16_to_f32(hi);
        }
    } else if (WT == WT_Q8_0) {
        float d = ds4_f16_to_f32((ds4_u16)r.v[0].x);
        ds4_u32 parts[2] = {r.v[0].y, r.v[0].z};
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            ds4_u32 p = parts[t];
            w[4 * t + 0] = d * (float)(ds4_i8)(p & 0xffu);
            w[4 * t + 1] = d * (float)(ds4_i8)((p >> 8) & 0xffu);
            w[4 * t + 2] = d * (float)(ds4_i8)((p >> 16) & 0xffu);
            w[4 * t + 3] = d * (float)(ds4_i8)(p >> 24);
        }
    } else if (WT == WT_Q2_K) {  // (d * scale) * q - (dmin * min), q two bits
        ds4_u32 sc = r.v[0].y & 0xffu, sh = (r.v[0].y >> 8) & 7u;
        float dl = ds4_f16_to_f32((ds4_u16)(r.v[0].x & 0xffffu)) * (float)(sc & 0xfu);
        float ml = ds4_f16_to_f32((ds4_u16)(r.v[0].x >> 16)) * (float)(sc >> 4);
        ds4_u32 parts[2] = {r.v[0].z, r.v[0].w};
#pragma unroll
        for (int e = 0; e < 8; ++e) w[e] = dl * (float)((parts[e / 4] >> (8 * (e % 4) + sh)) & 3u) - ml;
    } else if (WT == WT_Q4_K) {  // (d * scale) * q - (dmin * min), 6-bit scales and mins packed in 12 bytes
        ds4_u32 sw[3] = {r.v[0].y, r.v[0].z, r.v[0].w};
        int s = (int)(r.v[1].z & 7u);
        auto byte = [&](int i) { return (sw[i / 4] >> (8 * (i % 4))) & 0xffu; };
        ds4_u32 sc = s < 4 ? byte(s) & 63u : (byte(s + 4) & 0xfu) | ((byte(s - 4) >> 6) << 4);
        ds4_u32 mn = s < 4 ? byte(s + 4) & 63u : (byte(s + 4) >> 4) | ((byte(s) >> 6) << 4);
        float dl = ds4_f16_to_f32((ds4_u16)(r.v[0].x & 0xffffu)) * (float)sc;
        float ml = ds4_f16_to_f32((ds4_u16)(r.v[0].x >> 16)) * (float)mn;
        int sh = 4 * (s % 2);
        ds4_u32 parts[2] = {r.v[1].x, r.v[1].y};
#pragma unroll
        for (int e = 0; e < 8; ++e) w[e] = dl * (float)((parts[e / 4] >> (8 * (e % 4) + sh)) & 0xfu) - ml;
    } else if (WT == WT_IQ2_XXS) {  // ((d * (0.5 + s)) * 0.25 * grid) * sign
        ds4_u32 aux1 = r.v[0].z, l = r.v[0].w & 3u;
        float db = (ds4_f16_to_f32((ds4_u16)r.v[0].x) * (0.5f + (float)(aux1 >> 28))) * 0.25f;
        // the grid from shared memory: lanes index it independently, which serialises a
        // __constant__ table
        ds4_u32 grid = iq2_grid[(r.v[0].y >> (8 * l)) & 0xffu];
        ds4_u32 sg = (aux1 >> (7 * l)) & 127u;
        sg |= (ds4_u32)(__popc(sg) & 1) << 7;  // ggml's ksigns: the eighth sign makes the parity even
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            ds4_u32 c = (grid >> (2 * e)) & 3u;
            float mag = c == 0u ? 8.0f : c == 1u ? 25.0f : c == 2u ? 43.0f : 0.0f;
            w[e] = (db * mag) * ((sg >> e) & 1u ? -1.0f : 1.0f);
        }
    } else {  // MXFP4: (2^(e-128)) * (2 * E2M1 value)
        float d = mv3_e8m0_half(r.v[0].x);
#pragma unroll
        for (int e = 0; e < 8; ++e) w[e] = d * mv3_e2m1_doubled((r.v[0].y >> (4 * e)) & 0xfu);
    }
}

// Bytes per row of K weights, and weights per block, of each encoding.
__device__ __forceinline__ long long mv3_row_bytes(int wt, int K) {
    switch (wt) {
        case WT_F32: return (long long)K * 4;
        case WT_Q8_0: return (long long)(K / 32) * 34;
        case WT_Q2_K: return (long long)(K / 256) * 84;
        case WT_Q4_K: return (long long)(K / 256) * 144;
        case WT_IQ2_XXS: return (long long)(K / 256) * 66;
        case WT_MXFP4: return (long long)(K / 32) * 17;
        default: return (long long)K * 2;
    }
}

// Raw weight words of one group of U steps (256 columns each) for the warp's R rows,
// starting at step s0 of the chunk that begins at column c (kc columns long).
template <int WT, int R, int U>
__device__ __forceinline__ void mv3_load_group(const ds4_u8* const* rowp, int row0, int N, int c, int kc, int s0,
                                               int lane, Mv3Raw<WT> (&raw)[R][U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        int j0 = lane * 8 + (s0 + u) * DS4_WARP * 8;
#pragma unroll
        for (int i = 0; i < R; ++i) {
            if (row0 + i < N && j0 < kc) mv3_load<WT>(rowp[i], c + j0, raw[i][u]);
        }
    }
}

// Weight groups (256-column steps) a warp's rows keep in flight, for the 8-bit and the
// 2-to-4-bit encodings at 2 rows per warp (twice as many at 1). A warp-step of IQ2_XXS reads
// one 66-byte block a row, so it takes many steps in flight to cover the memory latency.
#ifndef MV3_U_Q8
#define MV3_U_Q8 4
#endif
#ifndef MV3_U_LOWBIT
#define MV3_U_LOWBIT 2
#endif

#ifndef MV3_LG
#define MV3_LG 4  // inputs per guarded group in the FMA loop
#endif
#define MV3_STG 4  // float4 staging loads a thread keeps in flight per batch (8 would need ~174
                   // registers for bf16 r2 with the weight group also in flight: one block per SM)

// A lane's eight terms of one 256-column step, in column order, each entering the partial as
// fma(w, x, s): one rounding a term (docs/exactness.md §2). MV3_TWO_ROUNDINGS=1 builds the
// two-rounding s + w * x instead, only to time the two side by side: it changes the bits, so no
// check runs with it.
#ifndef MV3_TWO_ROUNDINGS
#define MV3_TWO_ROUNDINGS 0
#endif
__device__ __forceinline__ float mv3_terms8(float s, const float (&w)[8], float4 p, float4 q) {
    const float x[8] = {p.x, p.y, p.z, p.w, q.x, q.y, q.z, q.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) s = MV3_TWO_ROUNDINGS ? s + w[e] * x[e] : fmaf(w[e], x[e], s);
    return s;
}

// y[ybase[a] + row0 + i] <- the sum over the warp of acc[i][a] (ds4_warp_sum's butterfly) for the
// na inputs and the rows below N. The butterflies of MV_SUMG inputs x R rows run side by side, so a
// shuffle's latency is spent on the others' instead of being waited out one sum at a time; the
// inputs past na in a group shuffle values nobody stores.
#define MV_SUMG 4
template <int R>
__device__ __forceinline__ void mv3_store_sums(float (&acc)[R][MV_LANES], int na, int row0, int N,
                                               const long long* ybase, float* __restrict__ y) {
    int lane = threadIdx.x % DS4_WARP;
#pragma unroll
    for (int a0 = 0; a0 < MV_LANES; a0 += MV_SUMG) {
        if (a0 >= na) break;
#pragma unroll
        for (int mask = DS4_WARP / 2; mask > 0; mask >>= 1)
#pragma unroll
            for (int i = 0; i < R; ++i)
#pragma unroll
                for (int a = a0; a < a0 + MV_SUMG; ++a) acc[i][a] += DS4_SHFL_XOR(acc[i][a], mask);
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int a = a0; a < a0 + MV_SUMG; ++a)
                if (a < na && row0 + i < N && lane == a) y[ybase[a] + row0 + i] = acc[i][a];
    }
}

// Rows of row block rblk (8*R rows) of one matrix (Wb: its first byte, rb bytes per row) over columns
// [cbeg, cbeg + clen) for na active inputs: xrow[a] is input a's row (column 0),
// y[ybase[a] + r] receives row r's dot for input a. xrow/ybase live in shared memory
// and are written before the first barrier here.
//
// Latency (why the chunk loop is laid out like this): a block's time at 16 lanes was
// set by round trips, not by bandwidth: the old staging loop issued one scalar load per
// thread and waited for it before the next (32 round trips per 512-column chunk, ~75 µs
// for any 4096-wide matrix whatever its row count), and the chunk's weight loads were
// issued only after the staging barrier. Now the first weight group of a chunk is loaded
// before the barrier, and the chunk is staged with 16-byte loads, MV3_STG per thread all
// in flight before any store: one round trip per 1024 staged float4 (two for a 16-lane chunk), which
// overlaps the weights' own. The arithmetic (which columns each lane sums, in which
// order, with which FMA sequence) is unchanged, so results stay bitwise v1's.
template <int WT, int R, int U>
__device__ __forceinline__ void mv3_rows(const ds4_u8* __restrict__ Wb, long long rb, int N, int cbeg, int clen,
                                         int na, const float* const* xrow, const long long* ybase,
                                         float* __restrict__ y, float4* xs4, int rblk) {
    float* xs = (float*)xs4;
    __shared__ ds4_u16 iq2_grid[WT == WT_IQ2_XXS ? 256 : 1];
    if (WT == WT_IQ2_XXS)  // visible after the chunk loop's first barrier, before any unpack
        for (int i = threadIdx.x; i < 256; i += blockDim.x) iq2_grid[i] = DS4_IQ2XXS_GRID[i];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int row0 = rblk * (MV3_WARPS * R) + warp * R;
    int KC = (MV3_XS / na) / 256 * 256;  // >= 512 for na <= 16; a multiple of 256 (see swizzle)
    float acc[R][MV_LANES];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int a = 0; a < MV_LANES; ++a) acc[i][a] = 0.0f;
    const ds4_u8* rowp[R];
#pragma unroll
    for (int i = 0; i < R; ++i) rowp[i] = Wb + (long long)(row0 + i < N ? row0 + i : 0) * rb;
    bool vec = true;  // every staged row start 16-byte aligned (checked after the first barrier)

    for (int c0 = 0; c0 < clen; c0 += KC) {
        int kc = clen - c0 < KC ? clen - c0 : KC;
        Mv3Raw<WT> raw[R][U];
        mv3_load_group<WT, R, U>(rowp, row0, N, cbeg + c0, kc, 0, lane, raw);  // in flight across the staging
        __syncthreads();  // the previous chunk is consumed (and xrow/ybase are visible)
        if (c0 == 0) {
            for (int a = 0; a < na; ++a)
                if (((unsigned long long)(xrow[a] + cbeg) & 15ull) != 0) vec = false;
            if (clen % 4 != 0) vec = false;
        }
        if (vec) {
            // 16-byte loads, a batch of MV3_STG per thread issued before any store. A float4
            // at column j (j % 4 == 0) lands contiguously at the swizzled position of j.
            int kc4 = kc / 4, tot = na * kc4;
            for (int b0 = 0; b0 < tot; b0 += MV3_STG * MV3_WARPS * DS4_WARP) {
                float4 v[MV3_STG];
#pragma unroll
                for (int k = 0; k < MV3_STG; ++k) {
                    int e = b0 + threadIdx.x + k * MV3_WARPS * DS4_WARP;
                    if (e < tot) {
                        int a = e / kc4, j4 = e - a * kc4;
                        v[k] = ((const float4*)(xrow[a] + cbeg + c0))[j4];
                    }
                }
#pragma unroll
                for (int k = 0; k < MV3_STG; ++k) {
                    int e = b0 + threadIdx.x + k * MV3_WARPS * DS4_WARP;
                    if (e < tot) {
                        int a = e / kc4, j = 4 * (e - a * kc4);
                        int sw = (j & ~255) + ((j & 4) << 5) + ((j & 248) >> 1);  // swizzle, see matvec.hip
                        xs4[(a * KC + sw) / 4] = v[k];
                    }
                }
            }
        } else {
            for (int a = 0; a < na; ++a) {
                const float* src = xrow[a] + cbeg + c0;
                for (int j = threadIdx.x; j < kc; j += blockDim.x) {
                    int sw = (j & ~255) + ((j & 4) << 5) + ((j & 248) >> 1) + (j & 3);  // swizzle, see above
                    xs[a * KC + sw] = src[j];
                }
            }
        }
        __syncthreads();
        for (int s0 = 0; s0 * (DS4_WARP * 8) < kc; s0 += U) {
            if (s0 > 0) mv3_load_group<WT, R, U>(rowp, row0, N, cbeg + c0, kc, s0, lane, raw);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                int j0 = lane * 8 + (s0 + u) * DS4_WARP * 8;
                if (j0 >= kc) continue;
                float w[R][8];
#pragma unroll
                for (int i = 0; i < R; ++i) mv3_unpack<WT>(raw[i][u], w[i], iq2_grid);
                int xb = (s0 + u) * 64 + lane;  // float4 index of this lane's first half
                if (na == 1) {
                    float4 p = xs4[xb], q = xs4[xb + 32];
#pragma unroll
                    for (int i = 0; i < R; ++i) acc[i][0] = mv3_terms8(acc[i][0], w[i], p, q);
                    continue;
                }
                // Inputs in groups of MV3_LG: one guard per group, so the group's R * MV3_LG
                // FMA chains are independent code the compiler interleaves (one guarded block
                // per input left each 8-FMA chain waiting on its own loads and on itself).
                // Inputs past na in the last group read input na-1's staged row: their sums
                // are never written, and no other input's chain sees them.
#pragma unroll
                for (int a0 = 0; a0 < MV_LANES; a0 += MV3_LG) {
                    if (a0 < na) {
                        float4 p[MV3_LG], q[MV3_LG];
#pragma unroll
                        for (int g = 0; g < MV3_LG; ++g) {
                            int a = a0 + g < na ? a0 + g : na - 1;
                            p[g] = xs4[a * (KC / 4) + xb];
                            q[g] = xs4[a * (KC / 4) + xb + 32];
                        }
#pragma unroll
                        for (int i = 0; i < R; ++i)
#pragma unroll
                            for (int g = 0; g < MV3_LG; ++g) acc[i][a0 + g] = mv3_terms8(acc[i][a0 + g], w[i], p[g], q[g]);
                    }
                }
            }
        }
    }
    mv3_store_sums<R>(acc, na, row0, N, ybase, y);
}

// Active inputs of a pass: L, or 1 + the last lane with a slot when lane_slot is given.
__device__ __forceinline__ int mv3_active(int L, const int* lane_slot) {
    if (!lane_slot) return L;
    int na = 0;
    for (int l = 0; l < L; ++l)
        if (lane_slot[l] >= 0) na = l + 1;
    return na;
}

