/* AVX-512 (F/BW/VL/VBMI/VNNI): 16 lanes, one vector per lane group. Byte and
 * word permutes do the spreading and the look-ups; every decoder yields the
 * logical lane order (lane l = column l of the group, or for FP4 lane l of
 * the chunk). */
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
#include "bs_x86_xt.h"

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
/* BF16: one word permute puts column l's 16 bits in the top half of f32
 * lane l, the mask zeroes the low halves. */
static inline __m512i bs_bf16_idx(void) {
    return _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                            7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
}
static inline void bs_dec16_bf16(const void *p, bs_vf o[BS_G]) {
    const __m512i h = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    o[0] = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, bs_bf16_idx(), h));
}
/* BF16, 32 columns (one 64-byte line) from one load: columns 0-15 into o[0],
 * 16-31 into o[1], each as bs_dec16_bf16 puts them. */
static inline void bs_dec32_bf16(const void *p, bs_vf o[2 * BS_G]) {
    const __m512i idx = bs_bf16_idx(), h = _mm512_loadu_si512(p);
    o[0] = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, h));
    o[1] = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, _mm512_add_epi16(idx, _mm512_set1_epi16(16)), h));
}

/* E4M3, 64 codes at once, exact for every code. Every E4M3 value (normal,
 * subnormal, zero, NaN) is a BF16 value; two 128-entry byte tables (two
 * registers each, vpermi2b) give the high and low byte of the BF16 of each
 * magnitude, the sign is or-ed into the high byte, and one masked vpermi2b
 * per lane group puts column 16j + l's two bytes at the top of f32 lane l. */
static const uint8_t BS_E4M3_BF16_HI[128] = {
    0x00, 0x3B, 0x3B, 0x3B, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C,
    0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D,
    0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E,
    0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F,
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
    0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
    0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
    0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x7F,
};
static const uint8_t BS_E4M3_BF16_LO[128] = {
    0x00, 0x00, 0x80, 0xC0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xC0,
};
/* Step j of the codes (bs_formats.h: chunk j / 2, step j % 2), column
 * 32 (j / 2) + 2l + j % 2, to f32 lane l: byte 2 from the low bytes (index
 * < 64), byte 3 from the high bytes (index | 64); bytes 0 and 1 are masked
 * to 0. */
static inline __m512i bs_e4m3_place(int j) {
    const __m512i l = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i c = _mm512_add_epi32(l, _mm512_set1_epi32(32 * (j / 2) + j % 2));
    return _mm512_or_si512(_mm512_slli_epi32(c, 16), _mm512_slli_epi32(_mm512_or_si512(c, _mm512_set1_epi32(64)), 24));
}
/* The BF16 high bytes (sign included) and low bytes of 64 codes. */
static inline void bs_e4m3_bf16_bytes(__m512i b, __m512i *hi, __m512i *lo) {
    const __m512i h0 = _mm512_loadu_si512(BS_E4M3_BF16_HI), h1 = _mm512_loadu_si512(BS_E4M3_BF16_HI + 64);
    const __m512i l0 = _mm512_loadu_si512(BS_E4M3_BF16_LO), l1 = _mm512_loadu_si512(BS_E4M3_BF16_LO + 64);
    /* table | (b & 0x80): ternary-logic truth table A | (B & C) = 0xF8 */
    *hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(h0, b, h1), b, _mm512_set1_epi8((char)0x80), 0xF8);
    *lo = _mm512_permutex2var_epi8(l0, b, l1);
}
static inline bs_vf bs_e4m3_group(__m512i hi, __m512i lo, int j) {
    return _mm512_castsi512_ps(_mm512_maskz_permutex2var_epi8(0xCCCCCCCCCCCCCCCCull, lo, bs_e4m3_place(j), hi));
}
/* Two FP8 chunks (bs_formats.h), exact for every code. */
static inline void bs_dec64p_e4m3(const void *p, bs_vf o[4][BS_G], bs_chk *chk) {
    (void)chk;
    __m512i hi, lo;
    bs_e4m3_bf16_bytes(_mm512_loadu_si512(p), &hi, &lo);
    for (int j = 0; j < 4; ++j) o[j][0] = bs_e4m3_group(hi, lo, j);
}
/* One chunk (a block's chunks outside whole 64-column pairs). */
static inline void bs_dec32p_e4m3(const void *p, bs_vf o[2][BS_G], bs_chk *chk) {
    (void)chk;
    __m512i hi, lo;
    bs_e4m3_bf16_bytes(_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_loadu_si256((const __m256i *)p), 0), &hi, &lo);
    for (int j = 0; j < 2; ++j) o[j][0] = bs_e4m3_group(hi, lo, j);
}

/* x of one whole FP8 chunk in its step order, times m: xp[16h + l] =
 * x[2l + h] * m (the kernels' permute_x; lanes in order here), by two
 * two-source permutes where the plain loop is not vectorized (that loop and
 * the x check together took about 5000 TSC ticks per 4096 columns on a
 * Zen 4, once per call and so per 128 rows a thread takes at a time). */
#define BS_FP8_XP_CHUNK
static inline void bs_fp8_xp_chunk(const float *x, float *xp, float m) {
    const __m512 mv = _mm512_set1_ps(m);
    const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x), mv), b = _mm512_mul_ps(_mm512_loadu_ps(x + 16), mv);
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    _mm512_storeu_ps(xp, _mm512_permutex2var_ps(a, ev, b));
    _mm512_storeu_ps(xp + 16, _mm512_permutex2var_ps(a, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), b));
}
/* FP8 against x scaled by 2^120 (the "s" tiles, for rows whose every |x| <
 * 256; see bs_isa_avx2.h for why w' * x' rounds as w * x). A 16-bit slot
 * of the load at p holds code 2k + 1 in its high byte, of the load at p - 1
 * code 2k: (slot >>arith 4) & 0x87F0 is then the BF16 of w * 2^-120 for
 * every code but NaN, and one zero-masked word permute per step puts lane
 * l's slot in the top half of f32 lane l. Per 64 codes: two shifts, two
 * ands, four permutes (and an and and a maximum for the NaN check), where
 * bs_dec64p_e4m3 takes six two-source byte permutes and a ternary-logic op
 * (which on a Zen 4 issues on the FMA pipes). NaN codes (magnitude 127) are caught by a running byte maximum;
 * a block that holds one is redone. */
typedef __m512i bs_chks; /* max-accumulated code magnitudes */
static inline bs_chks bs_chks_init(void) { return _mm512_setzero_si512(); }
static inline int bs_chks_ok(bs_chks c) { return _mm512_cmpeq_epi8_mask(c, _mm512_set1_epi8(0x7F)) == 0; }
/* Step 0 (even: codes 2l) or 1 (odd: codes 2l + 1) of chunk h of the
 * slots, lane l in the top half of f32 lane l. */
static inline bs_vf bs_e4m3s_step(__m512i v, int h) {
    const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                                         7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, _mm512_add_epi16(idx, _mm512_set1_epi16((short)(16 * h))), v));
}
static inline void bs_e4m3s_of(__m512i even, __m512i odd, bs_vf *o, int nch, bs_chks *chk) {
    const __m512i keep = _mm512_set1_epi16((short)0x87F0);
    *chk = _mm512_max_epu8(*chk, _mm512_and_si512(odd, _mm512_set1_epi8(0x7F)));
    const __m512i e = _mm512_and_si512(_mm512_srai_epi16(even, 4), keep);
    const __m512i d = _mm512_and_si512(_mm512_srai_epi16(odd, 4), keep);
    for (int h = 0; h < nch; ++h) {
        o[2 * h] = bs_e4m3s_step(e, h);
        o[2 * h + 1] = bs_e4m3s_step(d, h);
    }
}
/* Two chunks; reads p[-1] (the kernels take a row's first chunk with the
 * *0 decoders, which shift the codes into place instead). */
static inline void bs_dec64s_e4m3(const void *p, bs_vf o[4][BS_G], bs_chks *chk) {
    bs_e4m3s_of(_mm512_loadu_si512((const uint8_t *)p - 1), _mm512_loadu_si512(p), &o[0][0], 2, chk);
}
static inline void bs_dec64s0_e4m3(const void *p, bs_vf o[4][BS_G], bs_chks *chk) {
    const __m512i odd = _mm512_loadu_si512(p);
    bs_e4m3s_of(_mm512_slli_epi16(odd, 8), odd, &o[0][0], 2, chk);
}
/* One chunk (the other 32 bytes of the registers are zero). */
static inline void bs_dec32s_e4m3(const void *p, bs_vf o[2][BS_G], bs_chks *chk) {
    bs_e4m3s_of(_mm512_maskz_loadu_epi8(0xFFFFFFFFull, (const uint8_t *)p - 1),
                _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p), &o[0][0], 1, chk);
}
static inline void bs_dec32s0_e4m3(const void *p, bs_vf o[2][BS_G], bs_chks *chk) {
    const __m512i odd = _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p);
    bs_e4m3s_of(_mm512_slli_epi16(odd, 8), odd, &o[0][0], 1, chk);
}
/* A row's last, partial chunk: its m (1..31) codes by a masked load, which
 * reads no byte past them, the rest 0x38 (1.0). */
static inline void bs_dec32st_e4m3(const void *p, size_t m, bs_vf o[2][BS_G], bs_chks *chk) {
    const __mmask64 have = ((__mmask64)1 << m) - 1;
    const __m512i pad = _mm512_maskz_mov_epi8(0xFFFFFFFFull, _mm512_set1_epi8(0x38));
    const __m512i odd = _mm512_mask_blend_epi8(have, pad, _mm512_maskz_loadu_epi8(have, p));
    bs_e4m3s_of(_mm512_slli_epi16(odd, 8), odd, &o[0][0], 1, chk);
}

/* FP4 chunk (bs_formats.h): 64 bytes, lane l's 4 bytes in f32 lane l. vpermps
 * looks up the code in bits 0..3 of each lane (steps 0..3: the chunk shifted
 * right by 0, 4, 8, 12), and a zero-masked vpermw the code in bits 16..19
 * (steps 4..7, the same four registers): the odd 16-bit halves take the BF16
 * of the code (exact for every E2M1 value; the table is written twice over,
 * as vpermw also reads bit 20), the even halves are zeroed. Eight look-ups
 * and three shifts per 128 weights. */
static inline void bs_fp4_steps_of(__m512i d0, bs_vf o[8]) {
    const __m512 t = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    const __m512i tw = _mm512_setr_epi32(0x3F000000, 0x3FC03F80, 0x40404000, 0x40C04080, (int)0xBF008000u,
                                         (int)0xBFC0BF80u, (int)0xC040C000u, (int)0xC0C0C080u, 0x3F000000, 0x3FC03F80,
                                         0x40404000, 0x40C04080, (int)0xBF008000u, (int)0xBFC0BF80u, (int)0xC040C000u,
                                         (int)0xC0C0C080u);
    const __m512i d[4] = {d0, _mm512_srli_epi32(d0, 4), _mm512_srli_epi32(d0, 8), _mm512_srli_epi32(d0, 12)};
    for (int k = 0; k < 4; ++k) {
        o[k] = _mm512_permutexvar_ps(d[k], t);
        o[k + 4] = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, d[k], tw));
    }
}
static inline void bs_fp4_steps(const uint8_t *p, int g, bs_vf o[8]) {
    (void)g;
    bs_fp4_steps_of(_mm512_loadu_si512(p), o);
}
/* A partial chunk: only its nblk (1..3) blocks are read, the rest is zero. */
static inline void bs_fp4_steps_part(const uint8_t *p, int g, size_t nblk, bs_vf o[8]) {
    (void)g;
    bs_fp4_steps_of(_mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * nblk)) - 1, p), o);
}
/* Scales of 4 chunks, converted at once: 2^(b-127) is b << 23 except for
 * b = 0 (2^-127) and 255 (NaN), which both need bit 22 set. Chunk qq's lane
 * l takes byte 4 qq + l / 4 with one vpermps. */
typedef __m512 bs_fp4s;
static inline void bs_fp4s_load(bs_fp4s *st, const uint8_t *s, size_t n) {
    const __m128i raw = n >= 16 ? _mm_loadu_si128((const __m128i *)s) : _mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), s);
    const __m512i b = _mm512_cvtepu8_epi32(raw);
    const __m512i t = _mm512_slli_epi32(b, 23);
    /* b - 1 >= 254 (unsigned) exactly for b = 0 and b = 255 */
    const __mmask16 odd = _mm512_cmpge_epu32_mask(_mm512_sub_epi32(b, _mm512_set1_epi32(1)), _mm512_set1_epi32(254));
    *st = _mm512_castsi512_ps(_mm512_mask_or_epi32(t, odd, t, _mm512_set1_epi32(0x00400000)));
}
static inline bs_vf bs_fp4s_get(const bs_fp4s *st, int qq, int g) {
    (void)g;
    const __m512i lb = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(_mm512_add_epi32(lb, _mm512_set1_epi32(4 * qq)), *st);
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

/* Four accumulators summed at once, each by exactly bs_reduce16's tree
 * (lane l + lane l+8, then + l+4, + l+2, + l+1; f32 addition commutes, so
 * only the tree decides the result): the same four sums, bit for bit, in 14
 * instructions instead of 4 x 9, stored to y[0..3]. */
#define BS_HAVE_REDUCE16X4
static inline void bs_reduce16x4(float *y, const bs_vf a[BS_G], const bs_vf b[BS_G], const bs_vf c[BS_G],
                                 const bs_vf d[BS_G]) {
    /* 256-bit halves: [a lo | b lo] + [a hi | b hi] is a's s8, then b's */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], b[0], 0x44), _mm512_shuffle_f32x4(a[0], b[0], 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], d[0], 0x44), _mm512_shuffle_f32x4(c[0], d[0], 0xEE));
    /* 128-bit quarters: the s4 of a, b, c and d, one per quarter */
    const __m512 s4 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    /* within each quarter: lanes 0, 1 + lanes 2, 3, then lane 0 + lane 1 */
    const __m512 s2 = _mm512_add_ps(s4, _mm512_shuffle_ps(s4, s4, 0x0E));
    const __m512 s1 = _mm512_add_ps(s2, _mm512_shuffle_ps(s2, s2, 0x01));
    const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12);
    _mm_storeu_ps(y, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, s1)));
}

/* Sixteen accumulators summed at once, each by exactly bs_reduce16's tree
 * (as bs_reduce16x4): lane p of the result is accumulator p's sum. Four
 * rounds of two 128-bit / 32-bit shuffles and an add, each round halving
 * the vectors: 45 instructions for the 16 sums. The last round leaves lane
 * 4k + e holding the sum of the accumulator it was given as number 4e + k,
 * so the accumulators go in transposed (a[4 (p % 4) + p / 4]) and come out
 * in order. */
#define BS_HAVE_REDUCE16X16
static inline bs_vf bs_reduce16x16(const bs_vf a[16][BS_G]) {
    __m512 x[8], y[4], z[2];
    for (int p = 0; p < 8; ++p) {
        /* l + l+8: [first's 8 | second's 8] */
        const __m512 f = a[4 * ((2 * p) % 4) + (2 * p) / 4][0], s = a[4 * ((2 * p + 1) % 4) + (2 * p + 1) / 4][0];
        x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(f, s, 0x44), _mm512_shuffle_f32x4(f, s, 0xEE));
    }
    /* l + l+4: one accumulator per 128-bit quarter */
    for (int r = 0; r < 4; ++r)
        y[r] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * r], x[2 * r + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * r], x[2 * r + 1], 0xDD));
    /* l + l+2: two accumulators per quarter */
    for (int u = 0; u < 2; ++u)
        z[u] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * u], y[2 * u + 1], 0x44), _mm512_shuffle_ps(y[2 * u], y[2 * u + 1], 0xEE));
    /* l + l+1: four per quarter */
    return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

/* fp4×q8 with vpdpbusd (AVX512-VNNI), on x regrouped per 4 blocks (see
 * bs_q8_x86.h and templates/q8.c.tera). */
#define BS_Q8_XGROUP 4
#include "bs_q8_x86.h"
#endif
