// Attention with sinks over two key sources per lane: the raw ring (L, Wc, D) and
// the gathered compressed rows (L, Cc, D), each with a per-row visibility mask
// (uint8, 1 = visible). Inputs are capacity-padded; masked rows are skipped.
// K and V are the same vector. The sink logit adds only to the denominator.
//
// Block = (head tile of 8 heads, lane, slice of keys); warp w handles head tile*8 + w.
// Key rows are staged in shared memory once for the 8 heads. Each lane of a warp owns
// dims lane, lane+32, ...; per-key dots use the warp butterfly (fixed order), and each
// slice is an online softmax in row order (canon._attention): the same sequence of
// operations whatever else is in the batch.
#include "ds4_hip.h"

#define AT_WARPS 8
#define AT_KT 8        // key rows staged per step
#define AT_DMAX 512    // head_dim limit: 16 dims per lane
#define AT_DPL (AT_DMAX / DS4_WARP)

// ---------------------------------------------------------------------------
// Split over keys: one block per (head tile, lane, split of `split` keys) writes a
// partial (max m, denominator, unnormalised sum); ds4_attention_combine merges the
// splits in split order and adds the sink. Masked rows are skipped, so the result is
// the canonical one when each lane's visible rows come first (ops.attention_ring_comp).
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(AT_WARPS * DS4_WARP)
ds4_attention_split(const float* __restrict__ q, const float* __restrict__ ring,
                    const ds4_u8* __restrict__ ring_mask, int Wc, const float* __restrict__ comp,
                    const ds4_u8* __restrict__ comp_mask, int Cc, int H, int D, float scale, int split,
                    float* __restrict__ part_m, float* __restrict__ part_den, float* __restrict__ part_acc) {
    __shared__ __align__(16) float ks[AT_KT * AT_DMAX];
    __shared__ ds4_u8 vis[AT_KT];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int l = blockIdx.y, z = blockIdx.z, nsplit = gridDim.z;
    int h = blockIdx.x * AT_WARPS + warp;
    bool active = h < H;
    int nd = D / DS4_WARP;
    float qv[AT_DPL], acc[AT_DPL];
#pragma unroll
    for (int t = 0; t < AT_DPL; ++t) {
        qv[t] = (active && t < nd) ? q[((long long)l * H + h) * D + lane + DS4_WARP * t] : 0.0f;
        acc[t] = 0.0f;
    }
    float m = -DS4_INF, den = 0.0f;
    int total = Wc + Cc;
    int nbeg = z * split, nend = nbeg + split < total ? nbeg + split : total;
    for (int n0 = nbeg; n0 < nend; n0 += AT_KT) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < AT_KT * D; idx += blockDim.x) {
            int rr = idx / D, dd = idx % D, n = n0 + rr;
            float v = 0.0f;
            if (n < nend) {
                if (n < Wc) v = ring[((long long)l * Wc + n) * D + dd];
                else v = comp[((long long)l * Cc + (n - Wc)) * D + dd];
            }
            ks[rr * AT_DMAX + dd] = v;
        }
        if (threadIdx.x < AT_KT) {
            int n = n0 + threadIdx.x;
            ds4_u8 v = 0;
            if (n < nend) v = n < Wc ? ring_mask[(long long)l * Wc + n] : comp_mask[(long long)l * Cc + (n - Wc)];
            vis[threadIdx.x] = v;
        }
        __syncthreads();
        if (!active) continue;
        for (int rr = 0; rr < AT_KT; ++rr) {
            if (!vis[rr]) continue;
            const float* kr = ks + rr * AT_DMAX;
            float part = 0.0f;
#pragma unroll
            for (int t = 0; t < AT_DPL; ++t)
                if (t < nd) part += qv[t] * kr[lane + DS4_WARP * t];
            float s = ds4_warp_sum(part) * scale;
            if (s > m) {
                float c = ds4_exp(m - s);
                den = den * c + 1.0f;
#pragma unroll
                for (int t = 0; t < AT_DPL; ++t)
                    if (t < nd) acc[t] = acc[t] * c + kr[lane + DS4_WARP * t];
                m = s;
            } else {
                float e = ds4_exp(s - m);
                den += e;
#pragma unroll
                for (int t = 0; t < AT_DPL; ++t)
                    if (t < nd) acc[t] += e * kr[lane + DS4_WARP * t];
            }
        }
    }
    if (!active) return;
    long long pi = ((long long)l * H + h) * nsplit + z;
    if (lane == 0) { part_m[pi] = m; part_den[pi] = den; }
#pragma unroll
    for (int t = 0; t < AT_DPL; ++t)
        if (t < nd) part_acc[pi * D + lane + DS4_WARP * t] = acc[t];
}

// One block per (head, lane); threads over dims. Splits merged in order, then the sink.
extern "C" __global__ void ds4_attention_combine(const float* __restrict__ part_m, const float* __restrict__ part_den,
                                                 const float* __restrict__ part_acc, const float* __restrict__ sinks,
                                                 float* __restrict__ out, int H, int D, int nsplit) {
    int h = blockIdx.x, l = blockIdx.y;
    long long base = ((long long)l * H + h) * nsplit;
    float sk = sinks[h];
    float mf = sk;
    for (int z = 0; z < nsplit; ++z) mf = fmaxf(mf, part_m[base + z]);
    float dtot = ds4_exp(sk - mf);
    for (int z = 0; z < nsplit; ++z) dtot += part_den[base + z] * ds4_exp(part_m[base + z] - mf);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.0f;
        for (int z = 0; z < nsplit; ++z) a += part_acc[(base + z) * D + d] * ds4_exp(part_m[base + z] - mf);
        out[((long long)l * H + h) * D + d] = a / dtot;
    }
}
