// ds4_hip.h - the one portability header for the ds4ref kernels.
//
// Every kernel file is written in the HIP dialect and compiled two ways:
//   * as HIP by HIPRTC (ROCm; gfx1151 runs wave32, so a warp is 32 lanes), and
//   * as CUDA by NVRTC (NVIDIA; warps are 32 lanes).
// Kernel bodies use only what is common to both; the differences live here.
// No system headers: NVRTC has none, and the runtime inlines this file into
// each kernel source before compiling (see ds4ref/hip/runtime.py load_source).
#pragma once

#if defined(__HIPCC_RTC__) || defined(__HIP_DEVICE_COMPILE__) || defined(__HIP_PLATFORM_AMD__)
#define DS4_IS_HIP 1
#else
#define DS4_IS_HIP 0
#endif

// Fixed-width integers without <stdint.h>.
typedef unsigned char ds4_u8;
typedef signed char ds4_i8;
typedef unsigned short ds4_u16;
typedef unsigned int ds4_u32;
typedef int ds4_i32;
typedef unsigned long long ds4_u64;

// Kernels assume 32-lane warps on both vendors (wave32 on RDNA).
#define DS4_WARP 32

// Warp shuffle: HIP has no *_sync variants on all ROCm versions; CUDA requires them.
#if DS4_IS_HIP
#define DS4_SHFL_XOR(v, m) __shfl_xor((v), (m), DS4_WARP)
#define DS4_SHFL(v, src) __shfl((v), (src), DS4_WARP)
#else
#define DS4_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m), DS4_WARP)
#define DS4_SHFL(v, src) __shfl_sync(0xffffffffu, (v), (src), DS4_WARP)
#endif

// A kernel's body (the code its __global__ entries share): AMD's compiler may leave a large
// body a real call, and a call's arrays live in scratch (off-chip memory), so it is forced
// inline there; NVIDIA's compiler keeps its own choice (the code measured on the H200).
#if DS4_IS_HIP
#define DS4_BODY __device__ __forceinline__
#else
#define DS4_BODY __device__
#endif
// Leaving an unrolled loop early where every later iteration would be skipped too: AMD's compiler
// turns a break there into a loop whose arrays it indexes in scratch, and keeps them in registers
// with a per-iteration guard; NVIDIA's compiles the break to faster code (qdot.hip, on the H200).
#if DS4_IS_HIP
#define DS4_UNROLLED_EXIT continue
#else
#define DS4_UNROLLED_EXIT break
#endif

// Every kernel body starts with DS4_KERNEL_ENTRY. On NVIDIA sm_90 and later a kernel launched
// with programmatic stream serialization (runtime.py, DS4REF_PDL) may start before the kernel
// ahead of it in the stream has finished: griddepcontrol.wait holds it, before it reads anything,
// until that kernel has finished and its writes are visible; launch_dependents then lets the
// next kernel's blocks be scheduled while this one runs. Only launch latency moves: every kernel
// still reads what the one before it wrote, so no result changes. Elsewhere it is empty.
#if !DS4_IS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DS4_KERNEL_ENTRY                                    \
    asm volatile("griddepcontrol.wait;" ::: "memory");     \
    asm volatile("griddepcontrol.launch_dependents;")
#else
#define DS4_KERNEL_ENTRY
#endif

// DS4_KERNEL_ENTRY_PREFETCH(W, N, rows, rb): DS4_KERNEL_ENTRY, and before it, where
// DS4_PDL_PREFETCH is 1 (DS4REF_KERNEL_DEFINES; it changes no bit), one thread asks L2 for this
// block's weight rows: rows blockIdx.x * rows .. (at most N) of group blockIdx.y, rb bytes each,
// in whole 16-byte units. Weights are never written, so the block may read them before the kernel
// ahead of it has finished, and with DS4REF_PDL=1 they stream in while it runs.
#ifndef DS4_PDL_PREFETCH
#define DS4_PDL_PREFETCH 0
#endif
#if !DS4_IS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void ds4_prefetch_rows(const void* W, int N, int rows, long long rb) {
    int r0 = (int)blockIdx.x * rows, n = N - r0 < rows ? N - r0 : rows;
    unsigned long long p = (unsigned long long)W + ((long long)blockIdx.y * N + r0) * rb;
    unsigned long long a = (p + 15ull) & ~15ull, e = (p + n * rb) & ~15ull;
    if (DS4_PDL_PREFETCH && threadIdx.x == 0 && e > a)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((unsigned)(e - a)) : "memory");
}
#else
__device__ __forceinline__ void ds4_prefetch_rows(const void*, int, int, long long) {}
#endif
#define DS4_KERNEL_ENTRY_PREFETCH(W, N, rows, rb) \
    ds4_prefetch_rows((W), (N), (rows), (rb));    \
    DS4_KERNEL_ENTRY

#define DS4_INF (__int_as_float(0x7f800000))
#define DS4_NAN (__int_as_float(0x7fc00000))

// An entry of the routed experts' work list: expert id, pair count and up to EL_PAIRS (lane,
// choice) pairs (the layout: step_ops.hip, step_expert_list; read by every expert kernel).
#define EL_PAIRS 16
#define EL_STRIDE (2 + EL_PAIRS)
// Entries of one expert a tile of the grouped expert GEMM holds (step_expert_tiles; qgemm.hip's
// 64-row tiles): 64 pairs.
#define EL_TILE_ENTRIES 4

// ---- 16-bit floats as raw bits, converted explicitly ----------------------

// bf16 is the top half of an f32: widening is exact.
__device__ __forceinline__ float ds4_bf16_to_f32(ds4_u16 h) {
    return __uint_as_float(((ds4_u32)h) << 16);
}

// IEEE half -> f32, exact for normals, subnormals, inf and NaN.
__device__ __forceinline__ float ds4_f16_to_f32_soft(ds4_u16 h) {
    ds4_u32 sign = ((ds4_u32)(h & 0x8000u)) << 16;
    ds4_u32 exp = (h >> 10) & 0x1fu;
    ds4_u32 man = h & 0x3ffu;
    if (exp == 0x1fu) {  // inf / NaN
        return __uint_as_float(sign | 0x7f800000u | (man << 13));
    }
    if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in f32
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// The hardware conversion where there is one in reach without headers (CUDA's cvt is exact
// for every finite half, as the widening above is); the bit-level one elsewhere.
__device__ __forceinline__ float ds4_f16_to_f32(ds4_u16 h) {
#if DS4_IS_HIP
    return ds4_f16_to_f32_soft(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

// ---- warp and block reductions with a fixed order ------------------------
// The xor butterfly combines lanes in the same pattern every time, so a row's
// result depends only on the row's data, never on which other rows exist.

__device__ __forceinline__ float ds4_warp_sum(float v) {
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) v += DS4_SHFL_XOR(v, m);
    return v;
}

__device__ __forceinline__ double ds4_warp_sum_d(double v) {
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) v += DS4_SHFL_XOR(v, m);
    return v;
}

__device__ __forceinline__ float ds4_warp_max(float v) {
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) v = fmaxf(v, DS4_SHFL_XOR(v, m));
    return v;
}

// This thread's partial of a block's sum of squares (canon.sumsq's order): x[i]^2 for i = t,
// t + nt, ... < n (t the thread, nt the block's threads) added in increasing i. AHEAD loads are
// issued ahead of their adds: a load per add would wait out the memory latency every step (with
// 16, a 4096-wide row is one wait; hc's 4 x 4096 streams take 64 for one).
template <int AHEAD = 16>
__device__ __forceinline__ float ds4_strided_sumsq(const float* __restrict__ x, int n) {
    float s = 0.0f;
    int t = threadIdx.x, nt = blockDim.x;
    for (int i0 = t; i0 < n; i0 += AHEAD * nt) {
        float v[AHEAD];
        if (i0 + (AHEAD - 1) * nt < n) {  // a full group: unguarded, so the loads cannot sink to their adds
#pragma unroll
            for (int k = 0; k < AHEAD; ++k) v[k] = x[i0 + k * nt];
#pragma unroll
            for (int k = 0; k < AHEAD; ++k) s += v[k] * v[k];
            continue;
        }
#pragma unroll
        for (int k = 0; k < AHEAD; ++k) v[k] = i0 + k * nt < n ? x[i0 + k * nt] : 0.0f;
#pragma unroll
        for (int k = 0; k < AHEAD; ++k)
            if (i0 + k * nt < n) s += v[k] * v[k];
    }
    return s;
}

// Block sum: warp butterflies, then warp 0 sums the per-warp partials in
// warp order. `scratch` holds >= 32 floats. All threads get the result.
__device__ __forceinline__ float ds4_block_sum(float v, float* scratch) {
    int lane = threadIdx.x % DS4_WARP, warp = threadIdx.x / DS4_WARP;
    int nwarps = (blockDim.x + DS4_WARP - 1) / DS4_WARP;
    v = ds4_warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nwarps ? scratch[lane] : 0.0f;
        t = ds4_warp_sum(t);
        if (lane == 0) scratch[0] = t;
    }
    __syncthreads();
    return scratch[0];
}

__device__ __forceinline__ float ds4_block_max(float v, float* scratch) {
    int lane = threadIdx.x % DS4_WARP, warp = threadIdx.x / DS4_WARP;
    int nwarps = (blockDim.x + DS4_WARP - 1) / DS4_WARP;
    v = ds4_warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nwarps ? scratch[lane] : -DS4_INF;
        t = ds4_warp_max(t);
        if (lane == 0) scratch[0] = t;
    }
    __syncthreads();
    return scratch[0];
}

// ---- exact FP8 E4M3 / FP4 E2M1 grid rounding (mirrors reference/ops.py) ----

// Nearest value with `mant_bits` mantissa bits and exponent >= min_exp, ties to even.
__device__ __forceinline__ float ds4_round_to_grid(float x, int min_exp, int mant_bits) {
    int e;
    frexpf(fabsf(x), &e);  // |x| = m * 2^e, m in [0.5, 1)
    int ex = e - 1 > min_exp ? e - 1 : min_exp;
    int q = ex - mant_bits;
    return ldexpf(rintf(ldexpf(x, -q)), q);
}

// 2^ceil(log2(y)) for y > 0, exact.
__device__ __forceinline__ float ds4_pow2_ceil(float y) {
    int e;
    float m = frexpf(y, &e);
    if (m == 0.5f) e -= 1;
    return ldexpf(1.0f, e);
}

// FP8 E4M3 round trip of one block of 64 held by a warp, element lane in x0 and lane + 32 in x1
// (reference ops.fp8sim's block): the scale is the power of two at or above amax / 448.
__device__ __forceinline__ float2 ds4_e4m3_block64(float x0, float x1) {
    float amax = ds4_warp_max(fmaxf(fabsf(x0), fabsf(x1)));
    amax = fmaxf(amax, 1e-4f);
    float s = ds4_pow2_ceil(amax / 448.0f);
    float q0 = fminf(fmaxf(x0 / s, -448.0f), 448.0f);
    float q1 = fminf(fmaxf(x1 / s, -448.0f), 448.0f);
    return make_float2(ds4_round_to_grid(q0, -6, 3) * s, ds4_round_to_grid(q1, -6, 3) * s);
}

// ---- the canonical exp / log1p (numerics/canon.py, docs/exactness.md) -----
// Built only from correctly rounded + - * /, so NumPy and both GPU vendors give the
// same bits. Kernels are compiled with contraction off (runtime.py), so no
// multiply-add below is fused. Constants are hexadecimal floats, as canon.py has them.

__device__ __forceinline__ float ds4_exp(float x) {
    if (x != x) return x;
    if (x > 88.0f) return DS4_INF;
    if (x < -86.5f) return 0.0f;  // results below 2^-125 flush to 0: 2^n below stays normal
    float n = (x * 0x1.715476p+0f + 0x1.8p+23f) - 0x1.8p+23f;  // round to integer, ties to even
    float r = (x - n * 0x1.63p-1f) - n * -0x1.bd0106p-13f;
    float z = r * r;
    float p = 0x1.a0d2cep-13f * r + 0x1.6e879cp-10f;
    p = p * r + 0x1.111210p-7f;
    p = p * r + 0x1.555382p-5f;
    p = p * r + 0x1.555554p-3f;
    p = p * r + 0x1p-1f;
    p = (p * z + r) + 1.0f;
    return p * __int_as_float(((int)n + 127) << 23);
}

__device__ __forceinline__ float ds4_log1p(float x) {
    if (x != x || x == DS4_INF) return x;
    if (x <= -1.0f) return x == -1.0f ? -DS4_INF : DS4_NAN;
    float u = 1.0f + x;
    int k;
    float m = frexpf(u, &k);
    if (m < 0x1.6a09e6p-1f) { m = m * 2.0f; k -= 1; }
    float c = k > 0 ? (1.0f - (u - x)) / u : (x - (u - 1.0f)) / u;
    float f = m - 1.0f;
    float s = f / (2.0f + f);
    float z = s * s, w = z * z;
    float R = z * (0x1.555554p-1f + w * 0x1.23d3dcp-2f) + w * (0x1.999c26p-2f + w * 0x1.f13c4cp-3f);
    float hfsq = 0.5f * f * f;
    float kf = (float)k;
    return kf * 0x1.62e3p-1f - ((hfsq - (s * (hfsq + R) + (kf * 0x1.2fefa2p-17f + c))) - f);
}

__device__ __forceinline__ float ds4_sigmoid(float x) { return 1.0f / (1.0f + ds4_exp(-x)); }

__device__ __forceinline__ float ds4_softplus(float x) { return fmaxf(x, 0.0f) + ds4_log1p(ds4_exp(-fabsf(x))); }
