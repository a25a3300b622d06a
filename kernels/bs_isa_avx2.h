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
/* Make the compiler hold v in a register (a load it would otherwise fold
 * into each FMA that uses v is done once). */
static inline void bs_keep(bs_vf *v) { __asm__("" : "+x"(*v)); }
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
/* E4M3 -> F16 bits by shifting (every E4M3 value, subnormals included, is
 * an F16 value / 256), NaN codes -> F16 NaN, then F16C converts 8 at a time
 * and one exact multiply by 256 rescales: no f32 subnormal is ever touched. */
static inline __m256i bs_e4m3_to_f16x16(__m128i b16) {
    __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b16), 7);        /* s at bit 14, magnitude at 7..13 */
    t = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000))); /* sign to bit 15 */
    __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(t, _mm256_set1_epi16(0x7FFF)), _mm256_set1_epi16(0x3F80));
    return _mm256_or_si256(t, _mm256_and_si256(nan, _mm256_set1_epi16(0x7C00)));
}
static inline void bs_dec16_e4m3(const void *p, bs_vf o[BS_G]) {
    __m256i h = bs_e4m3_to_f16x16(_mm_loadu_si128((const __m128i *)p));
    o[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_set1_ps(256.0f));
    o[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), _mm256_set1_ps(256.0f));
}
/* E2M1 values are F16 values whose low byte is zero: one pshufb looks up the
 * high byte of 16 codes (sign included, so code 8 is -0), F16C converts. */
static inline void bs_dec16_e2m1(const void *p, bs_vf o[BS_G]) {
    const __m128i f16_hi = _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, (char)0x80, (char)0xB8,
                                         (char)0xBC, (char)0xBE, (char)0xC0, (char)0xC2, (char)0xC4, (char)0xC6);
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    __m128i h = _mm_shuffle_epi8(f16_hi, _mm_unpacklo_epi8(lo, hi));
    o[0] = _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), h));
    o[1] = _mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), h));
}

/* 32 codes at once: one 256-bit pshufb (128-bit lane 0 holds columns 0..15,
 * lane 1 columns 16..31), then F16C on each quarter. */
#define BS_HAVE_DEC32_E2M1 1
static inline void bs_dec32_e2m1(const void *p, bs_vf o[2][BS_G]) {
    const __m256i f16_hi = _mm256_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, (char)0x80, (char)0xB8,
                                            (char)0xBC, (char)0xBE, (char)0xC0, (char)0xC2, (char)0xC4, (char)0xC6,
                                            0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, (char)0x80, (char)0xB8,
                                            (char)0xBC, (char)0xBE, (char)0xC0, (char)0xC2, (char)0xC4, (char)0xC6);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    __m256i codes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(lo, hi)), _mm_unpackhi_epi8(lo, hi), 1);
    __m256i h = _mm256_shuffle_epi8(f16_hi, codes);
    __m256i a = _mm256_unpacklo_epi8(_mm256_setzero_si256(), h); /* columns 0..7 | 16..23 */
    __m256i c = _mm256_unpackhi_epi8(_mm256_setzero_si256(), h); /* columns 8..15 | 24..31 */
    o[0][0] = _mm256_cvtph_ps(_mm256_castsi256_si128(a));
    o[0][1] = _mm256_cvtph_ps(_mm256_castsi256_si128(c));
    o[1][0] = _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1));
    o[1][1] = _mm256_cvtph_ps(_mm256_extracti128_si256(c, 1));
}

/* ---- Permuted lane orders (templates/matmul.c.tera, "permuted" formats) ----
 * Building each f32 straight from its bytes (no F16C, no rescale) leaves the
 * columns of a 16-column group in a shuffled order: physical slot p holds
 * logical lane BS_LANES_*[p]. The kernels permute x to match once per call
 * and un-permute each accumulator before the reduction tree, so the sums are
 * the same operations in the same order as the logical layout. */

/* Two vectors of 16-bit f32 tops (the high halves, low halves zero) into
 * two lane groups: the even 16-bit slots of each 32-bit pair, shifted up,
 * and the odd ones, masked in place. */
static inline void bs_tops_to_f32(__m256i u0, __m256i u1, bs_vf o[2][BS_G]) {
    const __m256i top = _mm256_set1_epi32((int)0xFFFF0000);
    o[0][0] = _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16));
    o[0][1] = _mm256_castsi256_ps(_mm256_and_si256(u0, top));
    o[1][0] = _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16));
    o[1][1] = _mm256_castsi256_ps(_mm256_and_si256(u1, top));
}

/* FP4: one 16-byte block broadcast to both 128-bit halves, low nibbles (even
 * columns) in the low half, high nibbles (odd columns) in the high half; two
 * pshufb give each code's f32 bytes 3 and 2 (every E2M1 value is exact in
 * the top 16 bits of an f32), two unpacks pair them, and a shift / a mask
 * split each 32-bit pair into two f32 vectors. */
static const float BS_LANES_FP4[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

static inline void bs_dec32p_e2m1(const void *p, bs_vf o[2][BS_G]) {
    const __m256i th = _mm256_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, (char)0x80, (char)0xBF,
                                        (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0,
                                        0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, (char)0x80, (char)0xBF,
                                        (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0);
    const __m256i tl = _mm256_setr_epi8(0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0,
                                        0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0,
                                        0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0,
                                        0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0);
    __m256i y = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    __m256i c = _mm256_and_si256(_mm256_srlv_epi32(y, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
    __m256i hi = _mm256_shuffle_epi8(th, c), lo = _mm256_shuffle_epi8(tl, c);
    __m256i u0 = _mm256_unpacklo_epi8(lo, hi); /* columns 0,2,..,14 | 1,3,..,15 as 16-bit tops */
    __m256i u1 = _mm256_unpackhi_epi8(lo, hi); /* columns 16,18,..,30 | 17,19,..,31 */
    bs_tops_to_f32(u0, u1, o);
}

/* FP8: every normal E4M3 value is a BF16 value whose bits are the code's
 * shifted into place plus an exponent rebias: bf16 = ((b << 8) >>arith 4 &
 * 0x87F0) + 0x3C00 (120 << 7). Zero, subnormals and NaN do not follow that
 * rule; *chk records whether all 32 codes are normal (magnitude 8..126), and
 * a block where one is not is redone with the exact bs_dec16p_e4m3. */
static const float BS_LANES_FP8[16] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};
typedef __m256i bs_chk; /* and-accumulated "code is normal" byte masks */
static inline bs_chk bs_chk_init(void) { return _mm256_set1_epi8(-1); }
static inline int bs_chk_ok(bs_chk c) { return _mm256_movemask_epi8(c) == -1; }

static inline void bs_dec32p_e4m3(const void *p, bs_vf o[2][BS_G], bs_chk *chk) {
    __m256i b = _mm256_loadu_si256((const __m256i *)p);
    /* magnitude + 120 as a signed byte is below -9 exactly for magnitudes 8..126 */
    __m256i v = _mm256_add_epi8(_mm256_and_si256(b, _mm256_set1_epi8(0x7F)), _mm256_set1_epi8(0x78));
    *chk = _mm256_and_si256(*chk, _mm256_cmpgt_epi8(_mm256_set1_epi8(-9), v));
    b = _mm256_permute4x64_epi64(b, 0xD8); /* columns 0..7, 16..23 | 8..15, 24..31 */
    __m256i u0 = _mm256_unpacklo_epi8(_mm256_setzero_si256(), b); /* code << 8: columns 0..7 | 8..15 */
    __m256i u1 = _mm256_unpackhi_epi8(_mm256_setzero_si256(), b); /* columns 16..23 | 24..31 */
    const __m256i keep = _mm256_set1_epi16((short)0x87F0), bias = _mm256_set1_epi16(0x3C00);
    u0 = _mm256_add_epi16(_mm256_and_si256(_mm256_srai_epi16(u0, 4), keep), bias);
    u1 = _mm256_add_epi16(_mm256_and_si256(_mm256_srai_epi16(u1, 4), keep), bias);
    bs_tops_to_f32(u0, u1, o);
}

/* 16 E4M3 columns, exact for every code, in the BS_LANES_FP8 order. */
static inline void bs_dec16p_e4m3(const void *p, bs_vf o[BS_G]) {
    bs_vf n[BS_G];
    bs_dec16_e4m3(p, n);
    __m256 ev = _mm256_shuffle_ps(n[0], n[1], _MM_SHUFFLE(2, 0, 2, 0)); /* 0 2 8 10 | 4 6 12 14 */
    __m256 od = _mm256_shuffle_ps(n[0], n[1], _MM_SHUFFLE(3, 1, 3, 1)); /* 1 3 9 11 | 5 7 13 15 */
    o[0] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xD8));
    o[1] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xD8));
}

/* BF16: 16 columns as eight 32-bit pairs; the even column of each pair is
 * its low half (shifted up), the odd one its high half (masked in place):
 * one load, one shift, one and, where the logical order needs two widening
 * loads and two shifts. */
static const float BS_LANES_BF16[16] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};
static inline void bs_dec16p_bf16(const void *p, bs_vf o[BS_G]) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    o[0] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    o[1] = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000)));
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

#include "bs_q8_x86.h"
#endif
