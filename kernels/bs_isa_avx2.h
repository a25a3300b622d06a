/* AVX2 + FMA: 8 lanes per vector, two vectors per 16-lane group. */
#ifndef BS_ISA_H
#define BS_ISA_H
#include <immintrin.h>
#include "bs_formats.h"

#define BS_W 8
#define BS_G 2
typedef __m256 bs_vf;

static inline bs_vf bs_zero(void) { return _mm256_setzero_ps(); }
static inline bs_vf bs_set1(float x) { return _mm256_set1_ps(x); }
static inline bs_vf bs_loadu(const float *p) { return _mm256_loadu_ps(p); }
static inline void bs_storeu(float *p, bs_vf v) { _mm256_storeu_ps(p, v); }
static inline bs_vf bs_fma(bs_vf a, bs_vf b, bs_vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline bs_vf bs_add(bs_vf a, bs_vf b) { return _mm256_add_ps(a, b); }
static inline bs_vf bs_sub(bs_vf a, bs_vf b) { return _mm256_sub_ps(a, b); }
static inline bs_vf bs_mul(bs_vf a, bs_vf b) { return _mm256_mul_ps(a, b); }
static inline bs_vf bs_round(bs_vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline bs_vf bs_pow2i(bs_vf n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
static inline bs_vf bs_select_lt(bs_vf x, bs_vf c, bs_vf a, bs_vf b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, c, _CMP_LT_OQ));
}

static inline void bs_dec16_f32(const void *p, bs_vf o[BS_G]) {
    o[0] = _mm256_loadu_ps((const float *)p);
    o[1] = _mm256_loadu_ps((const float *)p + 8);
}
static inline bs_vf bs_bf16x8(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void bs_dec16_bf16(const void *p, bs_vf o[BS_G]) {
    o[0] = bs_bf16x8(_mm_loadu_si128((const __m128i *)p));
    o[1] = bs_bf16x8(_mm_loadu_si128((const __m128i *)p + 1));
}
static inline bs_vf bs_e4m3x8(__m128i b8) {
    __m256i v = _mm256_cvtepu8_epi32(b8);
    __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), _mm256_set1_ps(0x1p120f));
    f = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sign));
    __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32((int)BS_NAN_BITS));
    return _mm256_blendv_ps(f, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F))));
}
static inline void bs_dec16_e4m3(const void *p, bs_vf o[BS_G]) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    o[0] = bs_e4m3x8(b);
    o[1] = bs_e4m3x8(_mm_srli_si128(b, 8));
}
/* Magnitude by vpermps on the low 3 bits, sign from bit 3. */
static inline bs_vf bs_e2m1x8(__m128i codes8) {
    const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    __m256i idx = _mm256_cvtepu8_epi32(codes8);
    __m256 m = _mm256_permutevar8x32_ps(mag, idx);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(m), sign));
}
static inline void bs_dec16_e2m1(const void *p, bs_vf o[BS_G]) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    __m128i codes = _mm_unpacklo_epi8(lo, hi);
    o[0] = bs_e2m1x8(codes);
    o[1] = bs_e2m1x8(_mm_srli_si128(codes, 8));
}

static inline void bs_store16(float *t, const bs_vf a[BS_G]) { _mm256_storeu_ps(t, a[0]); _mm256_storeu_ps(t + 8, a[1]); }
static inline void bs_load16(bs_vf a[BS_G], const float *t) { a[0] = _mm256_loadu_ps(t); a[1] = _mm256_loadu_ps(t + 8); }

static inline float bs_reduce16(const bs_vf a[BS_G]) {
    __m256 s8 = _mm256_add_ps(a[0], a[1]);                                      /* l + l+8 */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); /* l + l+4 */
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                         /* l + l+2 */
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));                      /* 0 + 1 */
    return _mm_cvtss_f32(s1);
}
#endif
