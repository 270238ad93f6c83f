// ds4_qblock.h - one weight block of a quantised product as uniform integer codes, and the
// int8 MMA step: what qdot.hip's kernels and qgemm.hip share (docs/exactness.md §2a).
#pragma once
#include "ds4_mv3.h"
#include "ds4_q8.h"

__device__ __forceinline__ int ds4_dp4a(int a, int b, int c) {
#if DS4_IS_HIP
// gfx11 and gfx12 have v_dot4_i32_iu8 (signedness per operand) instead of gfx9/10's sdot4;
// clang and HIPRTC name the family in capitals (__GFX11__), the chip in lower case (__gfx1151__)
#if defined(__GFX11__) || defined(__GFX12__)
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
    DS4_KERNEL_ENTRY;
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

// IQ2_XXS's grid as packed int8 words, built in shared memory once per block: a group of 8
// codes is then one table read and a few word operations instead of unpacking 16 bits of grid
// element by element (the unpacking cost more than the weight reads). vals[i]: the 8 magnitudes
// of grid row i (8, 25 or 43), one byte each.
struct Iq2Tables {
    uint2 vals[256];
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
}

// A group's 8 magnitudes v (words of 4 bytes) with its signs applied: s7 holds the signs of
// columns 0..6, and column 7's makes the parity even (ggml's ksigns_iq2xs). Computed, not read
// from a table: a random 8-byte shared read per group conflicts across the warp's lanes, and
// measured slower. Bit e of a nibble times 0x00204081 lands on bit 8e (no two products share a
// bit), so n01 has 0x01 in each negated byte; a byte g in 1..127 is negated as (g ^ 0xff) + 1,
// which cannot carry out of its byte.
__device__ __forceinline__ uint2 iq2_signed(uint2 v, ds4_u32 s7) {
    ds4_u32 s8 = s7 | ((ds4_u32)(__popc(s7) & 1) << 7);
    ds4_u32 n01lo = ((s8 & 15u) * 0x00204081u) & 0x01010101u, n01hi = ((s8 >> 4) * 0x00204081u) & 0x01010101u;
    return make_uint2((v.x ^ (n01lo * 0xffu)) + n01lo, (v.y ^ (n01hi * 0xffu)) + n01hi);
}

// The bytes of block b (columns 32b .. 32b+31) of the row at rp (K columns) as loaded, before
// decoding: loading a lane's blocks first and decoding them after puts every load in flight at once.
template <int WT>
struct QRaw {
    uint4 a, c;   // codes: Q8_0 32 bytes, Q4_K 32 bytes of nibbles, MXFP4 16 bytes; IQ2_XXS and Q2_K in a.x, a.y
    ds4_u32 s;    // f16 scale (Q8_0, IQ2_XXS), E8M0 byte (MXFP4), 16-bit scale pair (Q2_K), scale bytes (Q4_K)
    ds4_u32 dd;   // Q2_K and Q4_K: f16 d, f16 dmin
};

// Byte offset of half h (columns 16h .. 16h+15) of Q8_0 block b in a packed row of K columns:
// the codes go in runs of 32 blocks (ops.pack_qrows), each run's first halves, then its second
// halves, so the 32 lanes of a warp, one block each, read 512 consecutive bytes per load.
__device__ __forceinline__ long long q8_half(int K, int b, int h) {
    int b0 = b & ~31, m = K / QB - b0 < 32 ? K / QB - b0 : 32;
    return (long long)b0 * QB + (h * m + (b - b0)) * 16;
}

template <int WT>
__device__ __forceinline__ void qr_load(const ds4_u8* __restrict__ rp, int K, int b, QRaw<WT>& r) {
    if (WT == WT_Q8_0) {
        r.a = *(const uint4*)(rp + q8_half(K, b, 0));
        r.c = *(const uint4*)(rp + q8_half(K, b, 1));
        r.s = ((const ds4_u16*)(rp + K))[b];
    } else if (WT == WT_MXFP4) {
        r.a = *(const uint4*)(rp + (long long)b * 16);
        r.s = rp[K / 2 + b];
    } else if (WT == WT_IQ2_XXS) {
        uint2 sub = *(const uint2*)(rp + (long long)b * 8);
        r.a.x = sub.x;
        r.a.y = sub.y;
        r.s = ((const ds4_u16*)(rp + K / 4))[b / 8];
    } else if (WT == WT_Q2_K) {
        uint2 cw = *(const uint2*)(rp + (long long)b * 8);
        r.a.x = cw.x;
        r.a.y = cw.y;
        r.s = ((const ds4_u16*)(rp + K / 4))[b];
        r.dd = ((const ds4_u32*)(rp + K / 4 + K / 16))[b / 8];
    } else {  // Q4_K: the super-block's d, dmin, and the scale bytes j, j + 4 and j - 4 (or j) of sub-block j
        const ds4_u8* blk = rp + (long long)(b / 8) * 144;
        int j = b % 8;
        const uint4* qp = (const uint4*)(blk + 16 + 32 * (j / 2));
        r.a = qp[0];
        r.c = qp[1];
        const ds4_u8* s = blk + 4;
        r.s = (ds4_u32)s[j] | ((ds4_u32)s[j + 4] << 8) | ((ds4_u32)s[j < 4 ? j : j - 4] << 16);
        r.dd = *(const ds4_u32*)blk;
    }
}

// A loaded block decoded to QBlock.
template <int WT>
__device__ __forceinline__ void qr_decode(const QRaw<WT>& r, int b, QBlock& q, const Iq2Tables* iq2) {
    if (WT == WT_Q8_0) {
        q.c[0] = r.a.x; q.c[1] = r.a.y; q.c[2] = r.a.z; q.c[3] = r.a.w;
        q.c[4] = r.c.x; q.c[5] = r.c.y; q.c[6] = r.c.z; q.c[7] = r.c.w;
        q.mul0 = q.mul1 = 1; q.mn0 = q.mn1 = 0;
        q.s1 = ds4_f16_to_f32((ds4_u16)r.s);
        q.s2 = 0.0f;
    } else if (WT == WT_MXFP4) {  // byte i: element i in the low nibble, element i + 16 in the high
        ds4_u32 by[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
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
        q.s1 = mv3_e8m0_half(r.s);
        q.s2 = 0.0f;
    } else if (WT == WT_IQ2_XXS) {  // group l of 8 columns: grid row (aux0 byte l), signs (aux1 >> 7l)
        ds4_u32 aux0 = r.a.x, aux1 = r.a.y;
        float d = ds4_f16_to_f32((ds4_u16)r.s);
        q.s1 = (d * (0.5f + (float)(aux1 >> 28))) * 0.25f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            uint2 v = iq2_signed(iq2->vals[(aux0 >> (8 * l)) & 0xffu], (aux1 >> (7 * l)) & 127u);
            q.c[2 * l] = (int)v.x;
            q.c[2 * l + 1] = (int)v.y;
        }
        q.mul0 = q.mul1 = 1; q.mn0 = q.mn1 = 0;
        q.s2 = 0.0f;
    } else if (WT == WT_Q2_K) {  // [K/32 x 8 code bytes][K/16 scales][K/256 x (d, dmin)]: ops.q2k_block_codes
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            q.c[k] = (int)((r.a.x >> (2 * k)) & 0x03030303u);
            q.c[4 + k] = (int)((r.a.y >> (2 * k)) & 0x03030303u);
        }
        ds4_u32 sc = r.s;  // the block's halves: scales[2b], scales[2b + 1]
        q.mul0 = (int)(sc & 15u); q.mn0 = (int)((sc >> 4) & 15u);
        q.mul1 = (int)((sc >> 8) & 15u); q.mn1 = (int)((sc >> 12) & 15u);
        q.s1 = ds4_f16_to_f32((ds4_u16)(r.dd & 0xffffu));
        q.s2 = ds4_f16_to_f32((ds4_u16)(r.dd >> 16));
    } else {  // Q4_K: block j of 8 = nibble j%2 of the 32 bytes at 32(j/2); ggml's get_scale_min_k4
        int j = b % 8;
        ds4_u32 w[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.c.x, r.c.y, r.c.z, r.c.w};
        int sh = 4 * (j % 2);
#pragma unroll
        for (int k = 0; k < 8; ++k) q.c[k] = (int)((w[k] >> sh) & 0x0f0f0f0fu);
        ds4_u32 sj = r.s & 0xffu, sj4 = (r.s >> 8) & 0xffu, sjm = (r.s >> 16) & 0xffu;
        ds4_u32 sc = j < 4 ? sj & 63u : (sj4 & 0xfu) | ((sjm >> 6) << 4);
        ds4_u32 mn = j < 4 ? sj4 & 63u : (sj4 >> 4) | ((sj >> 6) << 4);
        q.mul0 = q.mul1 = (int)sc;
        q.mn0 = q.mn1 = (int)mn;
        q.s1 = ds4_f16_to_f32((ds4_u16)(r.dd & 0xffffu));
        q.s2 = ds4_f16_to_f32((ds4_u16)(r.dd >> 16));
    }
}

// Block b of the row at rp, loaded and decoded.
template <int WT>
__device__ __forceinline__ void qb_load(const ds4_u8* __restrict__ rp, int K, int b, QBlock& q,
                                        const Iq2Tables* iq2) {
    QRaw<WT> r;
    qr_load<WT>(rp, K, b, r);
    qr_decode<WT>(r, b, q, iq2);
}

// c (4 ints) += A (16x16 int8: a0 row g, a1 row g+8, columns 4t..4t+3) . B (16x8: b0 column g,
// k 4t..4t+3), g = lane / 4, t = lane % 4; c0, c1: row g, columns 2t, 2t+1; c2, c3: row g+8.
// NVIDIA's int8 MMA; AMD builds qgemm.hip's dot4 tiles instead (QG_DOT4) and never this.
#if !DS4_IS_HIP
__device__ __forceinline__ void qm_mma16816(int* c, int a0, int a1, int b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}
#endif

// Block b of the row at rp as qb_load decodes it, but only the words of columns 4t.. of each
// half, in c[0] and c[4]: a lane decodes a quarter of the block (the four lanes of a weight
// row share it), and no register array is indexed by t (that would go to memory). In two steps,
// so that a prefetch's latency is spent elsewhere: qm_fetch loads the quarter's bytes (QmRaw),
// qm_decode decodes them when they are staged. Q4_K and MXFP4 decode at the fetch.
struct QmRaw {
    uint2 u;         // Q8_0: the quarter's code words; IQ2_XXS, Q2_K: the block's 8 bytes
    ds4_u32 v, s;    // the f16 d (Q2_K: the scale byte pair), Q2_K's d and dmin
    QBlock w;        // Q4_K, MXFP4: decoded
};

template <int WT>
__device__ __forceinline__ void qm_fetch(const ds4_u8* __restrict__ rp, int K, int b, int t, QmRaw& r,
                                         const Iq2Tables* iq2) {
    if (WT == WT_Q8_0) {
        r.u = make_uint2(((const ds4_u32*)(rp + q8_half(K, b, 0)))[t], ((const ds4_u32*)(rp + q8_half(K, b, 1)))[t]);
        r.v = ((const ds4_u16*)(rp + K))[b];
    } else if (WT == WT_IQ2_XXS) {
        r.u = *(const uint2*)(rp + (long long)b * 8);
        r.v = ((const ds4_u16*)(rp + K / 4))[b / 8];
    } else if (WT == WT_Q2_K) {
        r.u = *(const uint2*)(rp + (long long)b * 8);
        r.v = ((const ds4_u16*)(rp + K / 4))[b];
        r.s = ((const ds4_u32*)(rp + K / 4 + K / 16))[b / 8];
    } else {
        QBlock& q = r.w;
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

template <int WT>
__device__ __forceinline__ void qm_decode(const QmRaw& r, int t, QBlock& q, const Iq2Tables* iq2) {
    if (WT == WT_Q8_0) {
        q.c[0] = (int)r.u.x;
        q.c[4] = (int)r.u.y;
        q.mul0 = q.mul1 = 1; q.mn0 = q.mn1 = 0;
        q.s1 = ds4_f16_to_f32((ds4_u16)r.v);
        q.s2 = 0.0f;
    } else if (WT == WT_IQ2_XXS) {  // word k: half k % 2 of group k / 2 (qb_load's c[2l], c[2l+1])
        ds4_u32 aux0 = r.u.x, aux1 = r.u.y;
        float d = ds4_f16_to_f32((ds4_u16)r.v);
        q.s1 = (d * (0.5f + (float)(aux1 >> 28))) * 0.25f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int k = 4 * h + t, l = k / 2;
            uint2 v = iq2_signed(iq2->vals[(aux0 >> (8 * l)) & 0xffu], (aux1 >> (7 * l)) & 127u);
            q.c[4 * h] = (int)(k % 2 ? v.y : v.x);
        }
        q.mul0 = q.mul1 = 1; q.mn0 = q.mn1 = 0;
        q.s2 = 0.0f;
    } else if (WT == WT_Q2_K) {  // the repacked row of qb_load: word k is byte lanes of cw >> 2(k % 4)
        q.c[0] = (int)((r.u.x >> (2 * t)) & 0x03030303u);
        q.c[4] = (int)((r.u.y >> (2 * t)) & 0x03030303u);
        ds4_u32 sc = r.v;
        q.mul0 = (int)(sc & 15u); q.mn0 = (int)((sc >> 4) & 15u);
        q.mul1 = (int)((sc >> 8) & 15u); q.mn1 = (int)((sc >> 12) & 15u);
        q.s1 = ds4_f16_to_f32((ds4_u16)(r.s & 0xffffu));
        q.s2 = ds4_f16_to_f32((ds4_u16)(r.s >> 16));
    } else {
        q = r.w;
    }
}
