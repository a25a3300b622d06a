/* Device helpers shared by the generated CUDA kernels (templates/cuda.cu.tera):
 * format decoders with the exact semantics of src/formats.rs, warp and block
 * reductions, and BF16 packing for the tensor-core paths. */
#ifndef BS_CUDA_CUH
#define BS_CUDA_CUH
#include <stdint.h>

#define BS_FULL 0xFFFFFFFFu

/* UE8M0: 2^(b-127); 0 is 2^-127 (an f32 subnormal), 0xFF is NaN. */
__device__ __forceinline__ float bs_e8m0(uint32_t b)
{
    if (b == 0xFFu) return __int_as_float(0x7FC00000);
    if (b == 0u) return __int_as_float(0x00400000);
    return __int_as_float((int)(b << 23));
}

/* E2M1 code (low 4 bits): 0, .5, 1, 1.5, 2, 3, 4, 6 and the negatives (code 8 is -0). */
__device__ __forceinline__ float bs_e2m1(uint32_t c)
{
    const uint32_t m = c & 7u;
    float v = m < 2u ? (float)m * 0.5f : __int_as_float((int)((((m >> 1) + 126u) << 23) | ((m & 1u) << 22)));
    return (c & 8u) ? -v : v;
}

/* Doubled E2M1 as an integer (0, 1, 2, 3, 4, 6, 8, 12 and negatives). */
__device__ __forceinline__ int bs_e2m1x2(uint32_t c)
{
    const int m = (int)(c & 7u);
    const int v = m < 4 ? m : (m == 4 ? 4 : (m == 5 ? 6 : (m == 6 ? 8 : 12)));
    return (c & 8u) ? -v : v;
}

/* E4M3FN: no infinities, 0x7F / 0xFF NaN, subnormals m * 2^-9. */
__device__ __forceinline__ float bs_e4m3(uint32_t b)
{
    const uint32_t s = (b & 0x80u) << 24, e = (b >> 3) & 0xFu, m = b & 7u;
    if (e == 15u && m == 7u) return __int_as_float((int)(0x7FC00000u | s));
    const float v = e ? __int_as_float((int)(((e + 120u) << 23) | (m << 20))) : (float)m * 0x1p-9f;
    return __int_as_float(__float_as_int(v) | (int)s);
}

__device__ __forceinline__ float bs_bf16(uint32_t h) { return __int_as_float((int)(h << 16)); }

/* f32 -> bf16 bits, round to nearest even (NaN kept quiet). */
__device__ __forceinline__ uint32_t bs_to_bf16(float f)
{
    uint32_t u = (uint32_t)__float_as_int(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ uint32_t bs_pack_bf16(float lo, float hi)
{
    return bs_to_bf16(lo) | (bs_to_bf16(hi) << 16);
}

__device__ __forceinline__ float bs_warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(BS_FULL, v, o);
    return v;
}

__device__ __forceinline__ float bs_warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(BS_FULL, v, o));
    return v;
}

/* Sum / max over a block of blockDim.x threads (a multiple of 32, at most
 * 1024), through sh[32]; every thread gets the result. */
struct BsSum {
    __device__ float warp(float v) const { return bs_warp_sum(v); }
    __device__ float identity() const { return 0.0f; }
};
struct BsMax {
    __device__ float warp(float v) const { return bs_warp_max(v); }
    __device__ float identity() const { return -__int_as_float(0x7F800000); }
};

template <class Op> __device__ __forceinline__ float bs_block_reduce(float v, float *sh, Op op)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = op.warp(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    return op.warp(lane < nw ? sh[lane] : op.identity());
}

__device__ __forceinline__ float bs_block_sum(float v, float *sh) { return bs_block_reduce(v, sh, BsSum()); }
__device__ __forceinline__ float bs_block_max(float v, float *sh) { return bs_block_reduce(v, sh, BsMax()); }

#endif
