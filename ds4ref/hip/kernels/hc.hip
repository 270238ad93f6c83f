// Hyper-connections (mHC). The projection f @ fn.T runs through the matvec kernel;
// this finishes hc_pre per row and applies hc_post.
#include "ds4_hip.h"

#define HC_MAX 8  // hc_mult limit: mixes <= 2*8 + 64

// Warp 0 of a row's block 0, one comb entry (i, j) per lane k = i*hc + j (HC: hc known at compile
// time, or 0). Every sum runs over the same terms in the same order as the serial version in
// ds4_hc_pre_finish (each lane of a row or column adds the row's/column's entries, fetched by
// shuffle, in index order), and each entry is divided by that sum: identical results, but the
// ~2*iters*hc dependent divisions of one thread become 2*iters.
template <int HC>
__device__ __forceinline__ void hc_comb_warp(const float* mr, float r, const float* scale, const float* base,
                                             float eps32, int iters, int hc_rt, float* out) {
    const int hc = HC ? HC : hc_rt;
    int k = threadIdx.x;
    int hh = hc * hc;
    int i = k < hh ? k / hc : 0, j = k < hh ? k % hc : 0;
    float v = k < hh ? (mr[2 * hc + k] * r) * scale[2] + base[2 * hc + k] : 0.0f;
    float mx = -DS4_INF;
#pragma unroll
    for (int jj = 0; jj < (HC ? HC : HC_MAX); ++jj)
        if (jj < hc) mx = fmaxf(mx, DS4_SHFL(v, i * hc + jj));
    v = ds4_exp(v - mx);
    float sum = 0.0f;
#pragma unroll
    for (int jj = 0; jj < (HC ? HC : HC_MAX); ++jj)
        if (jj < hc) sum += DS4_SHFL(v, i * hc + jj);
    v = v / sum + eps32;
    for (int it = 0; it < iters; ++it) {
        float row[HC ? HC : HC_MAX], col[HC ? HC : HC_MAX];
        if (it > 0) {
#pragma unroll
            for (int jj = 0; jj < (HC ? HC : HC_MAX); ++jj) row[jj] = jj < hc ? DS4_SHFL(v, i * hc + jj) : 0.0f;
            float sr = 0.0f;
#pragma unroll
            for (int jj = 0; jj < (HC ? HC : HC_MAX); ++jj)
                if (jj < hc) sr += row[jj];
            v = v / (sr + eps32);
        }
#pragma unroll
        for (int ii = 0; ii < (HC ? HC : HC_MAX); ++ii) col[ii] = ii < hc ? DS4_SHFL(v, ii * hc + j) : 0.0f;
        float sc = 0.0f;
#pragma unroll
        for (int ii = 0; ii < (HC ? HC : HC_MAX); ++ii)
            if (ii < hc) sc += col[ii];
        v = v / (sc + eps32);
    }
    if (k < hh) out[k] = v;
}

// Per row n: r = 1/sqrt(mean(f^2) + rms_eps); m = mix_raw * r;
// pre = sigmoid(m[:hc]*scale0 + base) + hc_eps; post = 2*sigmoid(...);
// comb = softmax over j of the hc x hc logits + hc_eps, then Sinkhorn exactly as
// canon.sinkhorn (column pass first; sums in index order, all float32);
// u = sum_k pre_k * streams[k].
// Grid (rows, 1 + ceil(d / cols)): block 0 of a row forms post and comb, block 1 + s the columns
// s*cols.. of u, so a decode pass's few rows spread over the multiprocessors. Every block forms r
// itself, in the same order (256 threads), so they all hold the same bits. With part (non-null)
// the projection ran K-split (ds4_matvec3_*_ks) and mix_raw is unused: each block adds the row's
// nsplit slices itself, in slice order from 0.0f, as ds4_matvec3_ksum would have (ls: the
// slices' lane stride), which saves that launch. lane_slot (or null):
// a row whose entry is negative is a padding lane, whose u, post and comb no kernel reads for a
// real lane: its blocks leave at once (a pass of one row in the 16-lane program runs 1/16 of them).
extern "C" __global__ void ds4_hc_pre_finish(const float* __restrict__ streams, const float* __restrict__ mix_raw,
                                             const float* __restrict__ base, const float* __restrict__ scale,
                                             int hc, int d, float rms_eps, float hc_eps, int iters, int cols,
                                             float* __restrict__ u, float* __restrict__ post,
                                             float* __restrict__ comb, const int* __restrict__ lane_slot,
                                             const float* __restrict__ part, int nsplit, int ls) {
    DS4_KERNEL_ENTRY;
    if (lane_slot && lane_slot[blockIdx.x] < 0) return;
    __shared__ float scratch[32];
    __shared__ float pre_s[HC_MAX];
    __shared__ float mix_s[2 * HC_MAX + HC_MAX * HC_MAX];
    __shared__ float comb_s[HC_MAX * HC_MAX];
    int n = blockIdx.x;
    int mixn = 2 * hc + hc * hc;
    for (int i = threadIdx.x; i < mixn; i += blockDim.x) {
        float s = 0.0f;
        if (part)
            for (int z = 0; z < nsplit; ++z) s += part[((long long)z * ls + n) * mixn + i];
        else
            s = mix_raw[(long long)n * mixn + i];
        mix_s[i] = s;
    }
    __syncthreads();
    const float* f = streams + (long long)n * hc * d;
    float ss = ds4_block_sum(ds4_strided_sumsq<64>(f, hc * d), scratch);
    float r = 1.0f / sqrtf(ss / (float)(hc * d) + rms_eps);
    float eps32 = hc_eps;
    const float* mr = mix_s;
    if (blockIdx.y > 0) {  // u = sum_k pre_k * streams[k] (in k order) on this block's columns
        if (threadIdx.x < hc) {
            int k = threadIdx.x;
            pre_s[k] = ds4_sigmoid((mr[k] * r) * scale[0] + base[k]) + eps32;
        }
        __syncthreads();
        int c0 = (blockIdx.y - 1) * cols, c1 = c0 + cols < d ? c0 + cols : d;
        for (int e0 = c0 + threadIdx.x; e0 < c1; e0 += 2 * 256) {
            float v[2][HC_MAX];
#pragma unroll
            for (int q = 0; q < 2; ++q)  // every load of two columns in flight before the sums
#pragma unroll
                for (int k = 0; k < HC_MAX; ++k)
                    v[q][k] = k < hc && e0 + 256 * q < c1 ? f[(long long)k * d + e0 + 256 * q] : 0.0f;
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                int e = e0 + 256 * q;
                if (e >= c1) break;
                float acc = 0.0f;
#pragma unroll
                for (int k = 0; k < HC_MAX; ++k)  // a constant index: v stays in registers
                    if (k < hc) acc += pre_s[k] * v[q][k];
                u[(long long)n * d + e] = acc;
            }
        }
        return;
    }
    if (threadIdx.x < hc) {
        int k = threadIdx.x;
        post[(long long)n * hc + k] = 2.0f * ds4_sigmoid((mr[hc + k] * r) * scale[1] + base[hc + k]);
    }
    if (hc * hc <= DS4_WARP) {
        if (threadIdx.x < DS4_WARP) {
            float* out = comb + (long long)n * hc * hc;
            // Flash's hc = 4 unrolled: a sum's shuffles issue together, so a Sinkhorn step waits on one
            // shuffle and its adds rather than on hc dependent rounds (the same terms, the same order)
            if (hc == 4)
                hc_comb_warp<4>(mr, r, scale, base, eps32, iters, hc, out);
            else
                hc_comb_warp<0>(mr, r, scale, base, eps32, iters, hc, out);
        }
    } else if (threadIdx.x == 0) {
        float* c = comb_s;  // one thread's matrix, indexed at run time: LDS, not scratch
        for (int i = 0; i < hc; ++i) {  // softmax over j for each i
            float mx = -DS4_INF;
            for (int j = 0; j < hc; ++j) {
                int t = 2 * hc + i * hc + j;
                c[i * hc + j] = (mr[t] * r) * scale[2] + base[t];
                mx = fmaxf(mx, c[i * hc + j]);
            }
            float sum = 0.0f;
            for (int j = 0; j < hc; ++j) { c[i * hc + j] = ds4_exp(c[i * hc + j] - mx); sum += c[i * hc + j]; }
            for (int j = 0; j < hc; ++j) c[i * hc + j] = c[i * hc + j] / sum + eps32;
        }
        for (int it = 0; it < iters; ++it) {
            if (it > 0) {
                for (int i = 0; i < hc; ++i) {
                    float s = 0.0f;
                    for (int j = 0; j < hc; ++j) s += c[i * hc + j];
                    float dd = s + eps32;
                    for (int j = 0; j < hc; ++j) c[i * hc + j] = c[i * hc + j] / dd;
                }
            }
            for (int j = 0; j < hc; ++j) {
                float s = 0.0f;
                for (int i = 0; i < hc; ++i) s += c[i * hc + j];
                float dd = s + eps32;
                for (int i = 0; i < hc; ++i) c[i * hc + j] = c[i * hc + j] / dd;
            }
        }
        for (int t = 0; t < hc * hc; ++t) comb[(long long)n * hc * hc + t] = c[t];
    }
}

// out[n, j, e] = post[n, j] * y[n, e] + sum_i comb[n, i, j] * streams[n, i, e] (i in order).
extern "C" __global__ void ds4_hc_post(const float* __restrict__ streams, const float* __restrict__ y,
                                       const float* __restrict__ post, const float* __restrict__ comb,
                                       float* __restrict__ out, int N, int hc, int d) {
    DS4_KERNEL_ENTRY;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * hc * d) return;
    int e = (int)(idx % d);
    int j = (int)((idx / d) % hc);
    int n = (int)(idx / ((long long)d * hc));
    float acc = post[(long long)n * hc + j] * y[(long long)n * d + e];
    for (int i = 0; i < hc; ++i)
        acc += comb[((long long)n * hc + i) * hc + j] * streams[((long long)n * hc + i) * d + e];
    out[idx] = acc;
}
