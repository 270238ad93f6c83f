// Deterministic top-k of the lightning indexer's scores (step_state.hip's step_indexer_paged
// computes them over the paged rows).
#include "ds4_hip.h"

// Order-preserving map of f32 to u32 (larger float -> larger key); -0 folds into +0
// so equal scores tie exactly as in NumPy.
__device__ __forceinline__ ds4_u32 ix_key(float x) {
    ds4_u32 u = __float_as_uint(x == 0.0f ? 0.0f : x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum over the block, in thread order. scratch: >= 33 ints.
__device__ __forceinline__ int ix_block_scan(int v, int* scratch, int* total) {
    int lane = threadIdx.x % DS4_WARP, warp = threadIdx.x / DS4_WARP;
    int nw = blockDim.x / DS4_WARP;
    int x = v;
    for (int off = 1; off < DS4_WARP; off <<= 1) {
        int y = DS4_SHFL(x, lane >= off ? lane - off : lane);
        if (lane >= off) x += y;
    }
    __syncthreads();
    if (lane == DS4_WARP - 1) scratch[warp] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        int c = 0;
        for (int w = 0; w < nw; ++w) { int t = scratch[w]; scratch[w] = c; c += t; }
        scratch[32] = c;
    }
    __syncthreads();
    *total = scratch[32];
    return scratch[warp] + x - v;
}

// Top-k per lane (one block each): the indices of the k highest scores among the
// first n_valid[l], ties to the lower index, written ascending; k >= n gives 0..n-1
// then -1. A radix select (4 passes of 8 bits, integer histograms: exact in any
// order) finds the k-th key T; a final pass in index order keeps every key > T and
// the lowest-indexed keys == T until k are taken.
extern "C" __global__ void ds4_topk(const float* __restrict__ scores, const int* __restrict__ n_valid,
                                    int ld, int k, int* __restrict__ out) {
    DS4_KERNEL_ENTRY;
    __shared__ ds4_u32 hist[256];
    __shared__ ds4_u32 sh_prefix;
    __shared__ int sh_need;
    __shared__ int scan_scratch[33];
    int l = blockIdx.x;
    const float* s = scores + (long long)l * ld;
    int n = n_valid[l];
    int* o = out + (long long)l * k;
    if (k >= n) {
        for (int i = threadIdx.x; i < k; i += blockDim.x) o[i] = i < n ? i : -1;
        return;
    }
    if (threadIdx.x == 0) { sh_prefix = 0u; sh_need = k; }
    for (int shift = 24; shift >= 0; shift -= 8) {
        ds4_u32 hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        ds4_u32 prefix = sh_prefix;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            ds4_u32 key = ix_key(s[i]);
            if ((key & hi_mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x < DS4_WARP) {
            // the highest digit d whose count from 255 down reaches need: lane q owns digits
            // 255 - 8q .. 248 - 8q, the lanes' totals are scanned (integers: any order is exact)
            // and the one lane where the running count crosses need walks its own eight
            int q = threadIdx.x, need = sh_need, c[8], tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                c[j] = (int)hist[255 - 8 * q - j];
                tot += c[j];
            }
            int incl = tot;
            for (int m = 1; m < DS4_WARP; m <<= 1) {
                int v = DS4_SHFL(incl, q >= m ? q - m : q);
                if (q >= m) incl += v;
            }
            int cum = incl - tot;
            if (cum < need && incl >= need) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (cum + c[j] >= need) {
                        sh_prefix = prefix | ((ds4_u32)(255 - 8 * q - j) << shift);
                        sh_need = need - cum;
                        break;
                    }
                    cum += c[j];
                }
            }
        }
        __syncthreads();
    }
    ds4_u32 T = sh_prefix;
    int ties = sh_need;  // how many keys == T to take, lowest index first
    int eq_seen = 0, taken = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        int i = base + threadIdx.x;
        ds4_u32 key = i < n ? ix_key(s[i]) : 0u;
        int gt = (i < n && key > T) ? 1 : 0;
        int eq = (i < n && key == T) ? 1 : 0;
        int eq_tot;
        int eq_rank = ix_block_scan(eq, scan_scratch, &eq_tot);
        int take = gt | (eq && eq_seen + eq_rank < ties);
        int take_tot;
        int pos = ix_block_scan(take, scan_scratch, &take_tot);
        if (take) o[taken + pos] = i;
        eq_seen += eq_tot;
        taken += take_tot;
    }
}
