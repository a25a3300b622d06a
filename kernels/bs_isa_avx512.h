/* AVX-512 (F/BW/VL): 16 lanes, one vector per lane group. */
#ifndef BS_ISA_H
#define BS_ISA_H
#ifdef BS_EMULATE_AVX512
/* Test hook: tools/isa-check.sh compiles these kernels against SIMDe's
 * portable AVX-512 to run them on CPUs without AVX-512. */
#include "simde_avx512.h"
#else
#include <immintrin.h>
#endif
#include "bs_formats.h"

#define BS_W 16
#define BS_G 1
typedef __m512 bs_vf;

static inline bs_vf bs_zero(void) { return _mm512_setzero_ps(); }
static inline bs_vf bs_set1(float x) { return _mm512_set1_ps(x); }
static inline bs_vf bs_loadu(const float *p) { return _mm512_loadu_ps(p); }
/* Register hint: nothing to do on this ISA. */
static inline void bs_keep(bs_vf *v) { (void)v; }
static inline void bs_storeu(float *p, bs_vf v) { _mm512_storeu_ps(p, v); }
static inline bs_vf bs_fma(bs_vf a, bs_vf b, bs_vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline bs_vf bs_add(bs_vf a, bs_vf b) { return _mm512_add_ps(a, b); }
static inline bs_vf bs_sub(bs_vf a, bs_vf b) { return _mm512_sub_ps(a, b); }
static inline bs_vf bs_mul(bs_vf a, bs_vf b) { return _mm512_mul_ps(a, b); }
static inline bs_vf bs_round(bs_vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline bs_vf bs_pow2i(bs_vf n) {
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
static inline bs_vf bs_select_lt(bs_vf x, bs_vf c, bs_vf a, bs_vf b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, c, _CMP_LT_OQ), b, a);
}

static inline void bs_dec16_f32(const void *p, bs_vf o[BS_G]) { o[0] = _mm512_loadu_ps((const float *)p); }
static inline void bs_dec16_bf16(const void *p, bs_vf o[BS_G]) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    o[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* E4M3 -> F16 bits by shifting (exact for every code, subnormals included,
 * value / 256), NaN codes -> F16 NaN; vcvtph2ps then one exact multiply. */
static inline void bs_dec16_e4m3(const void *p, bs_vf o[BS_G]) {
    __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    t = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
    __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(t, _mm256_set1_epi16(0x7FFF)), _mm256_set1_epi16(0x3F80));
    t = _mm256_or_si256(t, _mm256_and_si256(nan, _mm256_set1_epi16(0x7C00)));
    o[0] = _mm512_mul_ps(_mm512_cvtph_ps(t), _mm512_set1_ps(256.0f));
}
/* All 16 E2M1 values in one register; vpermps looks up 16 codes at once. */
static inline void bs_dec16_e2m1(const void *p, bs_vf o[BS_G]) {
    const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    o[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table);
}

static inline void bs_store16(float *t, const bs_vf a[BS_G]) { _mm512_storeu_ps(t, a[0]); }
static inline void bs_load16(bs_vf a[BS_G], const float *t) { a[0] = _mm512_loadu_ps(t); }

static inline float bs_reduce16(const bs_vf a[BS_G]) {
    __m256 lo = _mm512_castps512_ps256(a[0]);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[0]), 1));
    __m256 s8 = _mm256_add_ps(lo, hi);                                                 /* l + l+8 */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); /* l + l+4 */
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                /* l + l+2 */
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));                             /* 0 + 1 */
    return _mm_cvtss_f32(s1);
}

#include "bs_q8_x86.h"
#endif
