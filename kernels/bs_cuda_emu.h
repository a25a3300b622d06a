/* The device side of bespoke's CPU emulator of its CUDA-core kernels
 * (BESPOKE_CUDA=emu; src/gpu.rs). Included before the rendered
 * templates/cuda.cu.tera, it makes that CUDA C++ plain C++: the CUDA
 * keywords go, the built-in variables read the emulated thread's, and
 * __syncthreads and the warp shuffles wait for the other threads of the
 * block or warp (kernels/bs_cuda_emu.cpp runs a block's threads as fibers,
 * one at a time, switching at these points).
 *
 * What it does not emulate: tensor-core instructions (the rendered source
 * has every tensor-core path compiled out), the memory model beyond "every
 * thread sees every write made before the last barrier", and nvcc's code
 * generation. */
#ifndef BS_CUDA_EMU_H
#define BS_CUDA_EMU_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
/* Shared memory: one copy per kernel, and blocks run one after another. */
#define __shared__ static

struct bs_dim3 {
    unsigned x, y, z;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

/* The running fiber's thread index and the launch's geometry
 * (kernels/bs_cuda_emu.cpp). */
struct bs_emu_thread {
    bs_dim3 tid;
};
extern bs_emu_thread *bs_emu_cur;
extern bs_dim3 bs_emu_block, bs_emu_bdim, bs_emu_gdim;
#define threadIdx (bs_emu_cur->tid)
#define blockIdx (bs_emu_block)
#define blockDim (bs_emu_bdim)
#define gridDim (bs_emu_gdim)

/* Wait for every other live thread of the block / of this warp. */
void __syncthreads();
void bs_emu_warp_wait();
/* This thread's 32-bit slot for the warp shuffle in flight (double-buffered
 * by the shuffle's parity, so one wait per shuffle suffices: a lane can only
 * write the same buffer again after the next shuffle's wait, which every lane
 * reaches after reading this one), and the slot of lane `src` in it. */
uint32_t *bs_emu_shfl_slot(int src);
void bs_emu_shfl_put(uint32_t v);
int bs_emu_lane();

static inline float __int_as_float(int i)
{
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}
static inline int __float_as_int(float f)
{
    int i;
    memcpy(&i, &f, sizeof i);
    return i;
}
static inline float __uint_as_float(unsigned u) { return __int_as_float((int)u); }
static inline unsigned __float_as_uint(float f) { return (unsigned)__float_as_int(f); }

template <class T> static inline T bs_emu_shfl(T v, int src_lane)
{
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bs_emu_shfl_put(bits);
    bs_emu_warp_wait();
    const uint32_t got = *bs_emu_shfl_slot(src_lane);
    T r;
    memcpy(&r, &got, 4);
    return r;
}
/* The kernels shuffle with the full mask only (a partial mask is a wait on
 * fewer lanes, which this emulator does not model). */
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask)
{
    (void)mask;
    return bs_emu_shfl(v, (bs_emu_lane() ^ lane_mask) & 31);
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta)
{
    (void)mask;
    const int src = bs_emu_lane() + (int)delta;
    const T r = bs_emu_shfl(v, src & 31);
    return src < 32 ? r : v;
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src_lane)
{
    (void)mask;
    return bs_emu_shfl(v, src_lane & 31);
}
static inline void __syncwarp(unsigned mask = 0xFFFFFFFFu)
{
    (void)mask;
    bs_emu_warp_wait();
}

/* A kernel called with the driver's argument convention: args[i] points at
 * parameter i's value (the generated table in emu.cpp wraps each kernel in
 * one of these). */
typedef void (*bs_emu_thunk)(void **args);
template <class... A, size_t... I>
static inline void bs_emu_call_(void (*k)(A...), void **args, std::index_sequence<I...>)
{
    k(*static_cast<typename std::remove_reference<A>::type *>(args[I])...);
}
template <class... A> static inline void bs_emu_call(void (*k)(A...), void **args)
{
    bs_emu_call_(k, args, std::index_sequence_for<A...>{});
}

#endif
