// Stateless kernels of the HIP backend's gathered pass that ds4ref/hip/kernels/*
// (one family per op) does not provide: embedding gather, RoPE at per-lane
// positions read from device memory (so a captured graph serves any positions),
// hash-routing ids, the routed-expert matvec (each selected expert's weights read
// once for all lanes that chose it), the expert combine, the hc head, and a
// random-weight initialiser for the benchmark.
#include "ds4_hip.h"

#define SO_LANES 16
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

// streams[l, h, :] = E[tok[l], :] for every hyper-connection stream h. Grid (16).
extern "C" __global__ void step_embed(const ds4_u8* E, int wt, int d, int hc, const int* tok, float* streams) {
    int l = blockIdx.x;
    const ds4_u8* row = E + (long long)tok[l] * so_row_bytes(wt, d);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = so_elem(row, wt, i);
        for (int h = 0; h < hc; ++h) streams[((long long)l * hc + h) * d + i] = v;
    }
}

// In-place RoPE of the last 2*half dims of rows (16 * rows_per_lane, D), interleaved
// pairs, with cos/sin read from the host's table cs[pos][p] = (cos, sin) (canon.rope_cos_sin).
extern "C" __global__ void step_rope_pos(float* v, const int* pos, const float* cs, int rows_per_lane,
                                         int D, int half, int inverse) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)SO_LANES * rows_per_lane * half) return;
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
extern "C" __global__ void step_hash_ids(const int* tid2eid, const int* tok, int k, int* ids) {
    int i = threadIdx.x;
    if (i >= SO_LANES * k) return;
    ids[i] = tid2eid[(long long)tok[i / k] * k + i % k];
}

// ---- routed experts --------------------------------------------------------
// y[l, t, :] = W[e] @ x_l for every valid lane l whose t-th selected expert is e.
// Grid (row blocks of 8*R, E): the block for expert e finds the lanes that chose it,
// stages their inputs and reads each weight row once for all of them. Blocks of
// experts nobody chose return at once. x_l = x[l] (gate/up) or x[l, t] (down,
// x_per_choice). A lane's sum runs over columns in a fixed order, so its result
// never depends on the other lanes.
// The kernel runs matvec v3's body (ds4_mv3.h): swizzled staging, R rows per warp,
// R*U raw weight loads in flight. Thread 0 lists the (lane, choice) pairs that chose
// expert e, in lane order; each pair's column order and operation sequence are the dense
// matvec's, so a lane's result never depends on which other lanes chose e.
template <int WT, int R, int U>
__device__ void ex3_body(const ds4_u8* __restrict__ W, const float* __restrict__ x, int x_per_choice,
                         const int* __restrict__ ids, const int* __restrict__ slot, float* __restrict__ y,
                         int N, int K, int kk) {
    __shared__ float4 xs4[MV3_XS / 4];
    __shared__ const float* xrow[SO_LANES];
    __shared__ long long ybase[SO_LANES];
    __shared__ int n_act;
    int e = blockIdx.y;
    if (threadIdx.x == 0) {
        int c = 0;
        for (int l = 0; l < SO_LANES; ++l) {
            if (slot[l] < 0) continue;
            for (int t = 0; t < kk; ++t)
                if (ids[l * kk + t] == e) {
                    long long lt = (long long)l * kk + t;
                    xrow[c] = x + (x_per_choice ? lt : (long long)l) * K;
                    ybase[c] = lt * N;
                    ++c;
                    break;
                }
        }
        n_act = c;
    }
    __syncthreads();
    int na = n_act;
    if (na == 0) return;
    long long rb = mv3_row_bytes(WT, K);
    mv3_rows<WT, R, U>(W + (long long)e * N * rb, rb, N, 0, K, na, xrow, ybase, y, xs4);
}

#define STEP_EXPERTS3(NAME, WT, R, U)                                                                 \
    extern "C" __global__ void __launch_bounds__(MV3_WARPS * DS4_WARP)                               \
        NAME(const ds4_u8* W, const float* x, int x_per_choice, const int* ids, const int* slot,     \
             float* y, int N, int K, int kk) {                                                        \
        ex3_body<WT, R, U>(W, x, x_per_choice, ids, slot, y, N, K, kk);                               \
    }

STEP_EXPERTS3(step_experts3_f32_r1, WT_F32, 1, 4)
STEP_EXPERTS3(step_experts3_f32_r2, WT_F32, 2, 2)
STEP_EXPERTS3(step_experts3_f16_r1, WT_F16, 1, 8)
STEP_EXPERTS3(step_experts3_f16_r2, WT_F16, 2, 4)
STEP_EXPERTS3(step_experts3_bf16_r1, WT_BF16, 1, 8)
STEP_EXPERTS3(step_experts3_bf16_r2, WT_BF16, 2, 4)
STEP_EXPERTS3(step_experts3_bf16_r4, WT_BF16, 4, 2)
STEP_EXPERTS3(step_experts3_q8_0_r1, WT_Q8_0, 1, 8)
STEP_EXPERTS3(step_experts3_q8_0_r2, WT_Q8_0, 2, 4)
STEP_EXPERTS3(step_experts3_q2_k_r1, WT_Q2_K, 1, 4)
STEP_EXPERTS3(step_experts3_q2_k_r2, WT_Q2_K, 2, 2)
STEP_EXPERTS3(step_experts3_q4_k_r1, WT_Q4_K, 1, 4)
STEP_EXPERTS3(step_experts3_q4_k_r2, WT_Q4_K, 2, 2)
STEP_EXPERTS3(step_experts3_iq2_xxs_r1, WT_IQ2_XXS, 1, 4)
STEP_EXPERTS3(step_experts3_iq2_xxs_r2, WT_IQ2_XXS, 2, 2)
STEP_EXPERTS3(step_experts3_mxfp4_r1, WT_MXFP4, 1, 4)
STEP_EXPERTS3(step_experts3_mxfp4_r2, WT_MXFP4, 2, 2)

// y[l] = sum_t w[l, t] * down[l, t] (t ascending = expert ids ascending) + shared[l].
extern "C" __global__ void step_moe_combine(const float* down, const float* w, const float* shared, float* y,
                                            int kk, int d) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)SO_LANES * d) return;
    int l = (int)(idx / d), e = (int)(idx % d);
    float acc = 0.0f;
    for (int t = 0; t < kk; ++t) acc += w[l * kk + t] * down[((long long)l * kk + t) * d + e];
    y[idx] = shared ? acc + shared[idx] : acc;
}

// hc head per lane: r = 1/sqrt(mean(f^2) + eps), pre = sigmoid(mix * r * scale + base) + hc_eps,
// out = sum_k pre_k * streams[k]. mix = f @ fn.T comes from the matvec kernel. Grid (16).
extern "C" __global__ void step_hc_head(const float* streams, const float* mix, const float* base,
                                        const float* scale, int hc, int d, float rms_eps, float hc_eps,
                                        float* out) {
    __shared__ float scratch[32];
    __shared__ float pre[16];
    int l = blockIdx.x;
    const float* f = streams + (long long)l * hc * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hc * d; i += blockDim.x) { float v = f[i]; ss += v * v; }
    ss = ds4_block_sum(ss, scratch);
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

// Benchmark weights made on the device: uniform in [-scale, scale) from a counter
// hash, rounded to bf16 (nearest even).
extern "C" __global__ void step_init_bf16(ds4_u16* out, long long n, ds4_u64 seed, float scale) {
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
