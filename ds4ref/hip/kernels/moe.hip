// MoE pieces: router (sqrt-softplus scores, bias for selection only, or hash ids),
// clamped SwiGLU activation, and argmax over logits.
#include "ds4_hip.h"
#include "ds4_q8.h"

#define RT_MAXE 1024
#define RT_MAXK 32


// One block per token. ids/w are (L, k); bias may be null (no bias); hash_ids
// (L, k) non-null selects those experts instead. ids come out ascending so the
// expert sum has one fixed order.
extern "C" __global__ void ds4_route(const float* __restrict__ logits, const float* __restrict__ bias,
                                     const int* __restrict__ hash_ids, int E, int k, float scale,
                                     int normalise, int* __restrict__ ids, float* __restrict__ w) {
    DS4_KERNEL_ENTRY;
    __shared__ float s[RT_MAXE];
    __shared__ float sel[RT_MAXE];
    __shared__ ds4_u8 chosen[RT_MAXE];
    __shared__ int by_rank[RT_MAXK];
    __shared__ int winners;
    __shared__ int sel_ids[RT_MAXK];  // thread 0's sort, indexed at run time: LDS, not scratch
    int l = blockIdx.x;
    const float* x = logits + (long long)l * E;
    if (threadIdx.x == 0) winners = 0;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        float v = sqrtf(ds4_softplus(x[i]));
        s[i] = v;
        sel[i] = bias ? v + bias[i] : v;
    }
    __syncthreads();
    if (!hash_ids) {
        // rank of i = how many beat it (higher score, or equal score at a lower index). Without
        // NaNs the ranks are distinct and the k winners each own a slot of by_rank, so no thread
        // scans all E flags; a NaN ranks 0 against everything, and then the winners are the
        // first k flagged in index order.
        for (int i = threadIdx.x; i < E; i += blockDim.x) {
            float vi = sel[i];
            int rank = 0;
            for (int j = 0; j < E; ++j) rank += (sel[j] > vi || (sel[j] == vi && j < i)) ? 1 : 0;
            chosen[i] = rank < k ? 1 : 0;
            if (rank < k) {
                by_rank[rank] = i;
                atomicAdd(&winners, 1);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (hash_ids || winners == k) {
        for (int t = 0; t < k; ++t) {  // insertion sort: ascending ids
            int v = hash_ids ? hash_ids[(long long)l * k + t] : by_rank[t], p = t;
            while (p > 0 && sel_ids[p - 1] > v) { sel_ids[p] = sel_ids[p - 1]; --p; }
            sel_ids[p] = v;
        }
    } else {
        int c = 0;
        for (int i = 0; i < E && c < k; ++i)
            if (chosen[i]) sel_ids[c++] = i;
    }
    float sum = 0.0f;
    for (int t = 0; t < k; ++t) sum += s[sel_ids[t]];
    for (int t = 0; t < k; ++t) {
        float v = s[sel_ids[t]];
        if (normalise) v = v / sum;
        ids[(long long)l * k + t] = sel_ids[t];
        w[(long long)l * k + t] = v * scale;
    }
}

// h = silu(min(g, clamp)) * clip(u, -clamp, clamp), elementwise over n values.
// min(g, clamp) and clip(u, +-clamp) as NumPy's: a NaN stays NaN (fminf would return the clamp)
__device__ __forceinline__ float swiglu_act(float g, float u, float clamp) {
    float gv = !(g < clamp) && g == g ? clamp : g;
    float uv = !(u > -clamp) && u == u ? -clamp : u;
    uv = !(uv < clamp) && uv == uv ? clamp : uv;
    return (gv * ds4_sigmoid(gv)) * uv;
}

extern "C" __global__ void ds4_swiglu_act(const float* __restrict__ g, const float* __restrict__ u,
                                          float* __restrict__ h, long long n, float clamp) {
    DS4_KERNEL_ENTRY;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    h[i] = swiglu_act(g[i], u[i], clamp);
}

// ds4_swiglu_act whose h feeds a quantised down product: h and its int8 rows (ds4_q8.h), one
// thread per value and one warp per 32-value block of the flat h (rows are a multiple of 32
// wide, so block b of the flat array is block b of the row-major quantised rows).
extern "C" __global__ void ds4_swiglu_act_q8(const float* __restrict__ g, const float* __restrict__ u,
                                             float* __restrict__ h, long long n_blocks, float clamp,
                                             ds4_i8* __restrict__ xq, float* __restrict__ dx,
                                             short* __restrict__ xs) {
    DS4_KERNEL_ENTRY;
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n_blocks * QB) return;  // a warp's lanes leave together
    float v = swiglu_act(g[e], u[e], clamp);
    h[e] = v;
    long long b = e / QB;
    ds4_q8_warp(v, xq + b * QB, dx + b, xs + 2 * b);
}

// Index of the largest value per row (lower index wins ties), one block per row.
// (value, index) pairs combine by an associative rule, so the result is exact.
__device__ __forceinline__ void am_pick(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}

// What ds4_argmax writes for a row holding a NaN or an infinity (ops.NON_FINITE_ROW): the
// host ends that row's request (backend.StepResult.non_finite) instead of sampling noise.
#define DS4_NON_FINITE_ROW (-2)

// lane_slot (or null): rows whose entry is negative are padding and are skipped.
extern "C" __global__ void ds4_argmax(const float* __restrict__ x, int V, int* __restrict__ out,
                                      const int* __restrict__ lane_slot) {
    DS4_KERNEL_ENTRY;
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int sb[32];
    if (lane_slot && lane_slot[blockIdx.x] < 0) return;
    const float* xr = x + (long long)blockIdx.x * V;
    float bv = -DS4_INF;
    int bi = 0x7fffffff;
    int bad = 0;  // a NaN or an infinity seen: the exponent bits all ones (no float compare to trust)
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float v = xr[i];
        bad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
        am_pick(bv, bi, v, i);
    }
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) {
        float ov = DS4_SHFL_XOR(bv, m);
        int oi = DS4_SHFL_XOR(bi, m);
        am_pick(bv, bi, ov, oi);
        bad |= DS4_SHFL_XOR(bad, m);
    }
    int lane = threadIdx.x % DS4_WARP, warp = threadIdx.x / DS4_WARP;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; sb[warp] = bad; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x / DS4_WARP); ++w) {
            am_pick(bv, bi, sv[w], si[w]);
            bad |= sb[w];
        }
        out[blockIdx.x] = bad ? DS4_NON_FINITE_ROW : bi;
    }
}
