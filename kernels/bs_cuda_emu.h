/* The device side of bespoke's CPU emulator of its CUDA-core kernels
 * (BESPOKE_CUDA=emu; src/gpu.rs). Included before the rendered
 * templates/cuda.cu.tera, it makes that CUDA C++ plain C++: the CUDA
 * keywords go, the built-in variables read the emulated thread's, and
 * __syncthreads and the warp shuffles wait for the other threads of the
 * block or warp (kernels/bs_cuda_emu.cpp runs a block's threads as fibers,
 * one at a time, switching at these points).
 *
 * The tensor-core paths it computes (plan::cuda::EMU_TC: the mma.sync of
 * BF16, INT8, FP8 and block-scaled MXFP4, wgmma m64n8k16 BF16 with a
 * no-swizzle shared-memory descriptor, and the tcgen05 operations of the
 * block-scaled FP4 kernel: tensor memory, its loads and stores, mbarriers
 * and tcgen05.mma kind::mxf4) follow the PTX ISA's fragment, descriptor and
 * tensor-memory layouts as the kernels read them. What it does not
 * emulate: swizzled layouts, the tensor cores' own summation order, the
 * memory model beyond "every thread sees every write made before the last
 * barrier", and nvcc's code generation. */
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
#define __align__(n) __attribute__((aligned(n)))
/* Shared memory: one copy per kernel, and blocks run one after another. */
#define __shared__ static
/* The rendered source's tensor-core wrappers call the emulator's mma. */
#define BS_CUDA_EMU 1

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
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

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
/* Round-to-nearest products and sums that nvcc does not contract into an
 * FMA (the emulator is compiled with -ffp-contract=off anyway). */
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
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

/* The tensor-core mma.sync shapes the kernels use, computed from the whole
 * warp's fragments (the PTX ISA's layouts for m16n8k16 .bf16, m16n8k32
 * 8-bit types and m16n8k64 .e2m1, with g = lane / 4 and t = lane % 4):
 *   A (16 x K, row-major): register 0 holds row g, register 1 row g + 8,
 *     registers 2 and 3 the same rows K/2 columns on; within a register the
 *     columns E t .. E t + E - 1, low bits first (E values per register: 2
 *     for BF16, 4 for 8-bit types, 8 for E2M1);
 *   B (K x 8): register 0 holds column g's rows E t .., register 1 the
 *     same K/2 rows on;
 *   C, D (16 x 8): rows g (c[0], c[1]) and g + 8 (c[2], c[3]), columns 2t
 *     and 2t + 1.
 * The products are exact and summed in double, then rounded once to f32
 * (the hardware's summation order and internal precision are not
 * specified; the tests hold tensor-core results to bounds, and INT8 is
 * exact either way). */
void bs_emu_warp_gather(const uint32_t *mine, int words, uint32_t *all);

static inline double bs_emu_e4m3(uint32_t b)
{
    const int e = (int)((b >> 3) & 15u), m = (int)(b & 7u);
    const double sign = (b & 0x80u) ? -1.0 : 1.0;
    if (e == 15 && m == 7) return NAN;
    return sign * (e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp((double)m, -9));
}

/* E-valued fragments as doubles: A[16][K], B[K][8], from the gathered
 * registers (`words` a lane, the first six a0..a3, b0, b1). */
template <int E, class Dec>
static inline void bs_emu_fragments(const uint32_t *all, int words, double A[16][64], double B[64][8], Dec dec)
{
    const int K = 8 * E, bits = 32 / E;
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        const uint32_t *f = all + words * l;
        for (int h = 0; h < E; ++h) {
            const int sh = bits * h;
            const uint32_t mask = bits == 32 ? 0xFFFFFFFFu : ((1u << bits) - 1u);
            A[g][E * t + h] = dec((f[0] >> sh) & mask);
            A[g + 8][E * t + h] = dec((f[1] >> sh) & mask);
            A[g][K / 2 + E * t + h] = dec((f[2] >> sh) & mask);
            A[g + 8][K / 2 + E * t + h] = dec((f[3] >> sh) & mask);
            B[E * t + h][g] = dec((f[4] >> sh) & mask);
            B[K / 2 + E * t + h][g] = dec((f[5] >> sh) & mask);
        }
    }
}

/* The accumulator's result: f32 rounded once; s32 exact (every sum of
 * 8-bit products and an s32 is an integer a double holds) and wrapping. */
static inline void bs_emu_store(float *c, double sum) { *c = (float)sum; }
static inline void bs_emu_store(int *c, double sum) { *c = (int)(uint32_t)(uint64_t)(int64_t)sum; }

/* This lane's four outputs of D = A B + C (K columns of A). */
template <class C>
static inline void bs_emu_accumulate(C c[4], const double A[16][64], const double B[64][8], int K)
{
    const int lane = bs_emu_lane(), g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const int r = g + (i >> 1) * 8, col = 2 * t + (i & 1);
        double sum = (double)c[i];
        for (int k = 0; k < K; ++k) sum += A[r][k] * B[k][col];
        bs_emu_store(&c[i], sum);
    }
}

/* D = A B + C for one warp: every lane's fragments gathered, each lane's
 * four outputs computed from them. */
template <int E, class C, class Dec>
static inline void bs_emu_mma(C c[4], const uint32_t a[4], const uint32_t b[2], Dec dec)
{
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    uint32_t all[32 * 6];
    bs_emu_warp_gather(mine, 6, all);
    double A[16][64], B[64][8];
    bs_emu_fragments<E>(all, 6, A, B, dec);
    bs_emu_accumulate(c, A, B, 8 * E);
}

static inline void bs_emu_mma_bf16(float c[4], const uint32_t a[4], const uint32_t b[2])
{
    bs_emu_mma<2>(c, a, b, [](uint32_t h) { return (double)__uint_as_float(h << 16); });
}

static inline void bs_emu_mma_e4m3(float c[4], const uint32_t a[4], const uint32_t b[2])
{
    bs_emu_mma<4>(c, a, b, bs_emu_e4m3);
}

static inline void bs_emu_mma_s8(int c[4], const uint32_t a[4], const uint32_t b[2])
{
    bs_emu_mma<4>(c, a, b, [](uint32_t v) { return (double)(int8_t)(uint8_t)v; });
}

/* E2M1: sign, two exponent bits (bias 1), one mantissa bit; 0.5 is the
 * subnormal. */
static inline double bs_emu_e2m1(uint32_t c)
{
    static const double mag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
    return (c & 8u) ? -mag[c & 7u] : mag[c & 7u];
}

/* UE8M0: 2^(e - 127), 0xFF NaN. */
static inline double bs_emu_ue8m0(uint32_t e)
{
    return e == 255u ? NAN : ldexp(1.0, (int)e - 127);
}

/* mma.sync m16n8k64 kind::mxf4.block_scale.scale_vec::2X with the scale
 * selectors {byte-id, thread-id} = {0, 0}, as bs_tc_mxf4_fp4 issues it:
 * D = (A · SA) (B · SB) + C. Each row of A and column of B has two UE8M0
 * scales, byte 0 for K 0..31 and byte 1 for K 32..63 of the scale register;
 * row m's comes from lane 4 (m % 8) + m / 8 (the quad's thread 0 for rows
 * 0..7, thread 1 for rows 8..15), column n's from lane 4 n, and the other
 * lanes' scale registers are not read. */
static inline void bs_emu_mma_mxf4(float c[4], const uint32_t a[4], const uint32_t b[2], uint32_t sa, uint32_t sb)
{
    const uint32_t mine[8] = {a[0], a[1], a[2], a[3], b[0], b[1], sa, sb};
    uint32_t all[32 * 8];
    bs_emu_warp_gather(mine, 8, all);
    double A[16][64], B[64][8];
    bs_emu_fragments<8>(all, 8, A, B, bs_emu_e2m1);
    for (int m = 0; m < 16; ++m) {
        const uint32_t s = all[8 * (4 * (m % 8) + m / 8) + 6];
        for (int k = 0; k < 64; ++k) A[m][k] *= bs_emu_ue8m0((s >> (8 * (k / 32))) & 0xFFu);
    }
    for (int n = 0; n < 8; ++n) {
        const uint32_t s = all[8 * (4 * n) + 7];
        for (int k = 0; k < 64; ++k) B[k][n] *= bs_emu_ue8m0((s >> (8 * (k / 32))) & 0xFFu);
    }
    bs_emu_accumulate(c, A, B, 64);
}

/* Fail the launch: the running thread stops here, and bs_emu_launch returns
 * 2 with `why` (a kernel asked for something the emulator does not model, or
 * that would read outside its memory). */
[[noreturn]] void bs_emu_trap(const char *why);

/* Shared-memory addresses for descriptors. On the GPU a descriptor holds an
 * address in the 256 KiB shared window; here each array a kernel converts
 * (16-byte aligned, `bytes` long, at most 16 KiB) gets a 16 KiB slot of
 * such a window for the launch, and bs_emu_shared_at maps an address back,
 * failing the launch if `bytes` from it leave the array. */
uint32_t bs_emu_cvta_shared(const void *p, size_t bytes);
const unsigned char *bs_emu_shared_at(uint32_t addr, size_t bytes);

/* wgmma.mma_async m64n8k16 .f32.bf16.bf16 with A from registers, B through
 * a shared-memory descriptor, scale-d 1, scale-a and scale-b 1, B not
 * transposed (K-major), as bs_tc_wgmma_* issues it: D = A B + D. A and D
 * are per warp of the warpgroup: warp w holds rows 16 w .. 16 w + 15 in the
 * layout of mma.sync m16n8k16 (above), so each warp's D needs only its own
 * A. The descriptor (the PTX ISA's matrix descriptor): bits 0-13 the start
 * address, 16-29 the leading dimension byte offset (LBO), 32-45 the stride
 * dimension byte offset (SBO), each in 16-byte units; 49-51 the base offset
 * and 62-63 the swizzle mode, both 0 here. B without swizzle, K-major, is
 * made of 8 x 8 core matrices, each 8 rows (N) of 16 contiguous bytes (8
 * values along K): element (k, n) at start + (k / 8) LBO + (n / 8) SBO +
 * 16 (n % 8) + 2 (k % 8). (N = 8: one core matrix along N; SBO unused.) */
static inline void bs_emu_wgmma_bf16(float d[4], const uint32_t a[4], uint64_t desc)
{
    if ((desc >> 62) != 0 || ((desc >> 49) & 7u) != 0)
        bs_emu_trap("wgmma: a swizzled or base-offset descriptor (the emulator reads the no-swizzle layout only)");
    const uint32_t start = (uint32_t)(desc & 0x3FFFu) << 4, lbo = (uint32_t)((desc >> 16) & 0x3FFFu) << 4;
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], 0u, 0u};
    uint32_t all[32 * 6];
    bs_emu_warp_gather(mine, 6, all);
    double A[16][64], B[64][8];
    const auto bf16 = [](uint32_t h) { return (double)__uint_as_float(h << 16); };
    bs_emu_fragments<2>(all, 6, A, B, bf16);
    for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 8; ++n) {
            uint16_t h;
            memcpy(&h, bs_emu_shared_at(start + (uint32_t)(k / 8) * lbo + 16u * (uint32_t)n + 2u * (uint32_t)(k % 8), 2), 2);
            B[k][n] = bf16(h);
        }
    bs_emu_accumulate(d, A, B, 16);
}

/* Tensor memory (tcgen05): per block 128 lanes x 512 columns of 32 bits,
 * an address lane << 16 | column. An allocation (warp 0, a power of two
 * from 32 to 512 columns) starts at column 0 and its columns start as NaN;
 * an access outside it fails the launch, as does a warp's tcgen05.ld / st
 * outside its own 32 lanes (warp w % 4: lanes 32 (w % 4) ..). */
uint32_t bs_emu_tmem_alloc(uint32_t cols);
void bs_emu_tmem_dealloc(uint32_t taddr, uint32_t cols);
uint32_t *bs_emu_tmem_at(uint32_t lane, uint32_t col);
/* 32x32b.xN: this thread's n words into / from lane (taddr >> 16) + its
 * lane, columns (taddr & 0xFFFF) .. + n - 1. */
void bs_emu_tmem_st(uint32_t taddr, const uint32_t *v, int n);
void bs_emu_tmem_ld(uint32_t taddr, uint32_t *v, int n);
/* An mbarrier (its state kept in the 64 bits the kernel gives it): init
 * with an arrival count, arrive (tcgen05.commit: the emulator's operations
 * are done when issued), and wait on a phase parity, which fails the
 * launch if that phase has not completed (nothing else could complete it). */
void bs_emu_mbar_init(uint64_t *bar, uint32_t count);
void bs_emu_mbar_arrive(uint64_t *bar);
void bs_emu_mbar_wait(uint64_t *bar, uint32_t parity);

/* One tcgen05 operand through its shared-memory descriptor: `rows` rows of
 * 64 E2M1 codes, K-major without swizzle. The descriptor (sm_100): start
 * address, LBO and SBO as wgmma's (16-byte units at bits 0, 16 and 32), the
 * fixed 0b001 at bits 46-48, base offset (49-51) and swizzle (61-63) 0.
 * Core matrices of 8 rows x 16 bytes (32 codes, two a byte, the even
 * column in the low nibble): code (r, k) in byte start + (r / 8) SBO +
 * (k / 32) LBO + 16 (r % 8) + (k % 32) / 2. */
static inline void bs_emu_t5_operand(uint64_t desc, int rows, double (*out)[64])
{
    if (((desc >> 46) & 7u) != 1u || ((desc >> 49) & 7u) != 0u || (desc >> 61) != 0u)
        bs_emu_trap("tcgen05.mma: a descriptor without the fixed 0b001, or with a base offset or swizzle");
    const uint32_t start = (uint32_t)(desc & 0x3FFFu) << 4, lbo = (uint32_t)((desc >> 16) & 0x3FFFu) << 4,
                   sbo = (uint32_t)((desc >> 32) & 0x3FFFu) << 4;
    for (int r = 0; r < rows; ++r)
        for (int k = 0; k < 64; ++k) {
            const uint32_t at = start + (uint32_t)(r / 8) * sbo + (uint32_t)(k / 32) * lbo + 16u * (uint32_t)(r % 8) +
                                (uint32_t)(k % 32) / 2;
            const uint32_t b = *bs_emu_shared_at(at, 1);
            out[r][k] = bs_emu_e2m1((k & 1) ? b >> 4 : b & 15u);
        }
}

/* tcgen05.mma.cta_group::1.kind::mxf4.block_scale.scale_vec::2X, as
 * bs_tc_tcgen05_fp4 issues it: D (tensor memory at d_t, M = 128 lanes by N
 * columns of f32) = (A · SA)(B · SB)^T, plus D when acc. A: 128 x 64 and B:
 * N x 64 E2M1 through their descriptors. The instruction descriptor must
 * be the kernel's: E2M1 x E2M1 (bits 7-9 and 10-12: 1), N >> 3 at bit 17,
 * UE8M0 scales (bit 23), M >> 7 at bit 27, no negation, transpose or
 * sparsity. Scales (scale-factor ID 0): row m of A's two UE8M0 bytes (K
 * 0..31, 32..63) are bytes 0 and 1 of the word at lane (sa_t >> 16) +
 * m % 32, column (sa_t & 0xFFFF) + m / 32; column j of B's likewise from
 * sb_t. Products exact, summed in double, rounded once to f32. */
static inline void bs_emu_tcgen05_mxf4(uint32_t d_t, uint64_t da, uint64_t db, uint32_t idesc, uint32_t acc,
                                       uint32_t sa_t, uint32_t sb_t)
{
    const uint32_t n = ((idesc >> 17) & 0x3Fu) << 3;
    const uint32_t want = (1u << 7) | (1u << 10) | ((n >> 3) << 17) | (1u << 23) | (1u << 27);
    if (n == 0 || n > 256 || idesc != want)
        bs_emu_trap("tcgen05.mma: an instruction descriptor other than the kernel's (M = 128, E2M1 x E2M1, UE8M0)");
    /* The emulator runs one thread at a time (bs_emu_launch holds a lock). */
    static double A[128][64], B[256][64];
    bs_emu_t5_operand(da, 128, A);
    bs_emu_t5_operand(db, (int)n, B);
    const auto scale = [](uint32_t t, int row, int k) {
        const uint32_t word = *bs_emu_tmem_at((t >> 16) + (uint32_t)(row % 32), (t & 0xFFFFu) + (uint32_t)(row / 32));
        return bs_emu_ue8m0((word >> (8 * (k / 32))) & 0xFFu);
    };
    for (int m = 0; m < 128; ++m)
        for (int k = 0; k < 64; ++k) A[m][k] *= scale(sa_t, m, k);
    for (int j = 0; j < (int)n; ++j)
        for (int k = 0; k < 64; ++k) B[j][k] *= scale(sb_t, j, k);
    for (int m = 0; m < 128; ++m)
        for (int j = 0; j < (int)n; ++j) {
            uint32_t *dp = bs_emu_tmem_at((d_t >> 16) + (uint32_t)m, (d_t & 0xFFFFu) + (uint32_t)j);
            double sum = acc ? (double)__uint_as_float(*dp) : 0.0;
            for (int k = 0; k < 64; ++k) sum += A[m][k] * B[j][k];
            *dp = __float_as_uint((float)sum);
        }
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
