/* The benchmark's compute roof: how many multiply-adds one core retires when
 * it does nothing else. Each probe runs independent accumulator chains
 * (enough to cover the instruction's latency times the pipes that issue it
 * on the cores measured) of the vector instruction a kernel family is built
 * on, and returns the flops it did; `bespoke bench kernels` times it and
 * sets each matmul's GFLOP/s against it, as it sets each matvec's GB/s
 * against the plain read of bs_read.c.
 *
 * Compiled with the baseline flags, like bs_read.c: the x86 probes carry
 * their instruction sets as function attributes, and src/kernels.rs calls a
 * probe only after checking that the CPU has what it needs (a probe this
 * build or this target does not have returns 0).
 *
 * The chains compute acc = acc * m + c with m just below 1, so they settle
 * at a normal value and never overflow or go subnormal; the sum of the
 * lanes goes to *sink so that the work is not optimised away. */
#include <stddef.h>
#include <stdint.h>

#define BS_PEAK_F32_AVX2 1u
#define BS_PEAK_F32_AVX512 2u
#define BS_PEAK_BF16DOT_AVX512 3u
#define BS_PEAK_F32_NEON 4u

#if defined(__x86_64__)
#include <immintrin.h>

/* 12 chains: 12 of the 16 ymm registers, 4-5 cycles of latency on 2 pipes. */
__attribute__((target("avx2,fma"))) static double peak_avx2(size_t iters, float *sink)
{
    enum { C = 12 };
    __m256 a[C];
    const __m256 m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
    for (int i = 0; i < C; ++i) a[i] = _mm256_set1_ps((float)i);
    for (size_t t = 0; t < iters; ++t)
        for (int i = 0; i < C; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
    float s = 0.0f, l[8];
    for (int i = 0; i < C; ++i) {
        _mm256_storeu_ps(l, a[i]);
        for (int j = 0; j < 8; ++j) s += l[j];
    }
    *sink = s;
    return (double)iters * C * 8 * 2;
}

/* 16 chains of 512-bit FMAs (of 32 zmm registers). */
__attribute__((target("avx512f"))) static double peak_avx512(size_t iters, float *sink)
{
    enum { C = 16 };
    __m512 a[C];
    const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
    for (int i = 0; i < C; ++i) a[i] = _mm512_set1_ps((float)i);
    for (size_t t = 0; t < iters; ++t)
        for (int i = 0; i < C; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
    float s = 0.0f;
    for (int i = 0; i < C; ++i) s += _mm512_reduce_add_ps(a[i]);
    *sink = s;
    return (double)iters * C * 16 * 2;
}

/* 16 chains of VDPBF16PS: 32 BF16 products into 16 f32 lanes each, counted
 * as 64 flops (as the bf16dot kernels' GFLOP/s count them). Each step adds
 * two products of 0.5 by 2^-11 to every lane, 2^-11; past 2^13 the sum
 * stops growing (the addend is half an ulp), so it neither overflows nor
 * goes subnormal however long the probe runs. */
#if defined(__GNUC__) && (__GNUC__ >= 10 || defined(__clang__))
__attribute__((target("avx512f,avx512bf16"))) static double peak_bf16dot(size_t iters, float *sink)
{
    enum { C = 16 };
    __m512 a[C];
    const __m512bh w = (__m512bh)_mm512_set1_epi16(0x3F00);  /* 0.5 */
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3A00);  /* 2^-11 */
    for (int i = 0; i < C; ++i) a[i] = _mm512_setzero_ps();
    for (size_t t = 0; t < iters; ++t)
        for (int i = 0; i < C; ++i) a[i] = _mm512_dpbf16_ps(a[i], w, x);
    float s = 0.0f;
    for (int i = 0; i < C; ++i) s += _mm512_reduce_add_ps(a[i]);
    *sink = s;
    return (double)iters * C * 16 * 4;
}
#define BS_HAVE_PEAK_BF16DOT 1
#endif
#endif

#if defined(__aarch64__)
#include <arm_neon.h>

/* 16 chains: up to 4 pipes with 4 cycles of latency. */
static double peak_neon(size_t iters, float *sink)
{
    enum { C = 16 };
    float32x4_t a[C];
    const float32x4_t m = vdupq_n_f32(0.999f), c = vdupq_n_f32(0.001f);
    for (int i = 0; i < C; ++i) a[i] = vdupq_n_f32((float)i);
    for (size_t t = 0; t < iters; ++t)
        for (int i = 0; i < C; ++i) a[i] = vfmaq_f32(c, a[i], m);
    float s = 0.0f;
    for (int i = 0; i < C; ++i) s += vaddvq_f32(a[i]);
    *sink = s;
    return (double)iters * C * 4 * 2;
}
#endif

/* Whether multiply-adds slow down on a subnormal operand, as the FP8 "s"
 * tiles' weights of subnormal codes are (templates/matmul.c.tera,
 * x_scalable): `iters` steps of 8 independent chains acc = fma(w, x, acc),
 * x = 2^120 and w = 2^-129 (subnormal) or 2^-100 (normal) in every lane, by
 * the AVX-512 FMA (kind BS_PEAK_F32_AVX512, the only kind: the switch it
 * informs is AVX-512's).
 * Every product and sum is normal (2^-9 or 2^20 a step), so only w can be
 * what slows it. Returns the sum of the lanes (0 for a kind this build or
 * target lacks); src/kernels.rs times both and compares. */
#if defined(__x86_64__)
__attribute__((target("avx512f"))) static float subnormal_avx512(int sub, size_t iters)
{
    enum { C = 8 };
    __m512 a[C];
    const __m512 w = _mm512_set1_ps(sub ? 0x1p-129f : 0x1p-100f), x = _mm512_set1_ps(0x1p120f);
    for (int i = 0; i < C; ++i) a[i] = _mm512_setzero_ps();
    for (size_t t = 0; t < iters; ++t)
        for (int i = 0; i < C; ++i) a[i] = _mm512_fmadd_ps(w, x, a[i]);
    float s = 0.0f;
    for (int i = 0; i < C; ++i) s += _mm512_reduce_add_ps(a[i]);
    return s;
}
#endif

float bs_subnormal_probe(unsigned kind, int sub, size_t iters)
{
    switch (kind) {
#if defined(__x86_64__)
    case BS_PEAK_F32_AVX512:
        return subnormal_avx512(sub, iters);
#endif
    default:
        (void)sub;
        (void)iters;
        return 0.0f;
    }
}

double bs_compute_peak(unsigned kind, size_t iters, float *sink)
{
    *sink = 0.0f;
    switch (kind) {
#if defined(__x86_64__)
    case BS_PEAK_F32_AVX2:
        return peak_avx2(iters, sink);
    case BS_PEAK_F32_AVX512:
        return peak_avx512(iters, sink);
#ifdef BS_HAVE_PEAK_BF16DOT
    case BS_PEAK_BF16DOT_AVX512:
        return peak_bf16dot(iters, sink);
#endif
#endif
#if defined(__aarch64__)
    case BS_PEAK_F32_NEON:
        return peak_neon(iters, sink);
#endif
    default:
        (void)iters;
        return 0.0;
    }
}
