/* AVX2 + FMA: 8 lanes per vector, two vectors per 16-lane group. */
#ifndef BS_ISA_H
#define BS_ISA_H
#include <immintrin.h>
#define BS_FP8_CHECKED /* BS_LANES_FP8, bs_chk: below */
#include "bs_formats.h"
#include "bs_x86_xt.h"

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

/* FP4 chunk (bs_formats.h), lane group g = lanes 8g..8g+7 = bytes 32g..32g+31,
 * lanes 4h..4h+3 of the group in 128-bit half h. One pshufb reorders each
 * half's 16 bytes to (lane 0 bytes 0, 1; lane 1 bytes 0, 1; ...; lane 0
 * bytes 2, 3; ...); low and high nibbles are split, two pshufb per nibble
 * vector give each code's f32 bytes 3 and 2 (every E2M1 value is exact in
 * the top 16 bits of an f32), and the unpacks pair them so that the 32-bit
 * slot t of each result holds two steps of lane t, split by a shift and a
 * mask (bs_tops_to_f32): all eight steps in lane order. */
static inline void bs_fp4_steps_of(__m256i raw, bs_vf o[8]) {
    const __m256i th = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)BS_E2M1_F32_B3));
    const __m256i tl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)BS_E2M1_F32_B2));
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i m = _mm256_set1_epi8(0x0F);
    const __m256i d = _mm256_shuffle_epi8(raw, order);
    const __m256i e = _mm256_and_si256(d, m), od = _mm256_and_si256(_mm256_srli_epi16(d, 4), m);
    const __m256i eh = _mm256_shuffle_epi8(th, e), el = _mm256_shuffle_epi8(tl, e);
    const __m256i oh = _mm256_shuffle_epi8(th, od), ol = _mm256_shuffle_epi8(tl, od);
    bs_vf t[2][BS_G];
    bs_tops_to_f32(_mm256_unpacklo_epi8(el, eh), _mm256_unpackhi_epi8(el, eh), t); /* steps 0, 2 | 4, 6 */
    o[0] = t[0][0], o[2] = t[0][1], o[4] = t[1][0], o[6] = t[1][1];
    bs_tops_to_f32(_mm256_unpacklo_epi8(ol, oh), _mm256_unpackhi_epi8(ol, oh), t); /* steps 1, 3 | 5, 7 */
    o[1] = t[0][0], o[3] = t[0][1], o[5] = t[1][0], o[7] = t[1][1];
}
static inline void bs_fp4_steps(const uint8_t *p, int g, bs_vf o[8]) {
    bs_fp4_steps_of(_mm256_loadu_si256((const __m256i *)(p + 32 * g)), o);
}
/* Lane group g of a partial chunk: only its nblk (1..3) blocks are read (a
 * masked load of whole dwords), the rest is zero. */
static inline __m256i bs_fp4_load_part(const uint8_t *p, int g, size_t nblk) {
    const __m256i dw = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int have = (int)(4 * nblk) - 8 * g; /* dwords of this group's 8 that exist */
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(have), dw);
    return _mm256_maskload_epi32((const int *)(p + 32 * g), m);
}
static inline void bs_fp4_steps_part(const uint8_t *p, int g, size_t nblk, bs_vf o[8]) {
    bs_fp4_steps_of(bs_fp4_load_part(p, g, nblk), o);
}

/* FP4 for x scaled by 2^-25 (the "c" tiles, IsaDesc::fp4_scaled): each
 * weight as w * 2^25, an integer converted to f32. One pshufb per 32 codes
 * looks up each nibble's 2w as an int8 (BS_E2M1_X2) and leaves it in the
 * nibble's byte: bs_fp4c holds, per lane group, the low nibbles (steps 0,
 * 2, 4, 6 of each lane: byte i of lane t's dword is step 2i) and the high
 * ones (steps 1, 3, 5, 7). Step k is then one pshufb that moves byte k / 2
 * of each dword to its top byte with zeros below, and vcvtdq2ps: 2w * 2^24,
 * exact. Against the look-up and unpack decoder above (bs_fp4_steps) it
 * issues 11 shuffles and shifts per 64 weights where that one issues 14, and
 * its 8 conversions go to the two pipes the FMAs and shuffles do not use
 * on a Zen 3; it also leaves the steps packed, 4 registers per chunk, until
 * each step is taken, so a chunk's two lane groups can run their FMA
 * chains side by side without spilling. The kernels use it when every x is
 * 0 or finite with |x| >= 2^-101 (fp4_x_scalable), so that x * 2^-25 is
 * exact: the products w * 2^25 * x * 2^-25 are then the reference's own. */
#define BS_FP4C_XSCALE 0x1p-25f
typedef struct {
    __m256i v[BS_G][2]; /* [lane group][0: low nibbles (even steps), 1: high] */
} bs_fp4c;
static inline void bs_fp4c_of(__m256i raw, __m256i v[2]) {
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)BS_E2M1_X2));
    const __m256i m = _mm256_set1_epi8(0x0F);
    v[0] = _mm256_shuffle_epi8(t, _mm256_and_si256(raw, m));
    v[1] = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m));
}
static inline void bs_fp4c_load(const uint8_t *p, bs_fp4c *c) {
    for (int g = 0; g < BS_G; ++g) bs_fp4c_of(_mm256_loadu_si256((const __m256i *)(p + 32 * g)), c->v[g]);
}
/* A partial chunk: its nblk (1..3) blocks, the rest zero. */
static inline void bs_fp4c_load_part(const uint8_t *p, size_t nblk, bs_fp4c *c) {
    for (int g = 0; g < BS_G; ++g) bs_fp4c_of(bs_fp4_load_part(p, g, nblk), c->v[g]);
}
/* pshufb controls: byte i of each dword to its top byte, zeros below. */
#define BS_FP4C_SEL_DW(b) ((int32_t)(0x00808080u | ((uint32_t)(b) << 24)))
#define BS_FP4C_SEL(i)                                                                              \
    {BS_FP4C_SEL_DW(i), BS_FP4C_SEL_DW(i + 4), BS_FP4C_SEL_DW(i + 8), BS_FP4C_SEL_DW(i + 12),    \
     BS_FP4C_SEL_DW(i), BS_FP4C_SEL_DW(i + 4), BS_FP4C_SEL_DW(i + 8), BS_FP4C_SEL_DW(i + 12)}
static const int32_t BS_FP4C_SELS[4][8] __attribute__((aligned(32))) = {
    BS_FP4C_SEL(0), BS_FP4C_SEL(1), BS_FP4C_SEL(2), BS_FP4C_SEL(3)};
/* Step k (0..7) of lane group g, lanes in order: w * 2^25. */
static inline bs_vf bs_fp4c_step(const bs_fp4c *c, int g, int k) {
    const __m256i sel = _mm256_load_si256((const __m256i *)BS_FP4C_SELS[k / 2]);
    return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(c->v[g][k & 1], sel));
}
/* Scales of 4 chunks: group g of chunk qq covers blocks 2g and 2g + 1, each
 * broadcast from the f32 table and blended. */
typedef bs_fp4s_bytes bs_fp4s;
static inline void bs_fp4s_load(bs_fp4s *st, const uint8_t *s, size_t n) { bs_fp4s_copy(st, s, n); }
static inline bs_vf bs_fp4s_get(const bs_fp4s *st, int qq, int g) {
    const uint8_t *b = st->b + 4 * qq + 2 * g;
    return _mm256_castsi256_ps(_mm256_blend_epi32(_mm256_set1_epi32((int)BS_E8M0_BITS[b[0]]),
                                                  _mm256_set1_epi32((int)BS_E8M0_BITS[b[1]]), 0xF0));
}

/* FP8 (bs_formats.h: a 32-column chunk as two steps of the 16 lanes, step
 * h = column 2l + h). Two loads put every code in the high byte of a 16-bit
 * slot with no shuffle: 16-bit slot k of the load at p holds code 2k + 1 in
 * its high byte (code 2k below it), and of the load at p - 1 code 2k (code
 * 2k - 1 below it, masked off). A 32-bit pair of slots is then two columns
 * 2 apart: its low slot, shifted up, and its high one, masked in place
 * (bs_tops_to_f32), are steps 0 and 1 of lane 2t (columns 4t, 4t + 1) in
 * group 0 and of lane 2t + 1 (columns 4t + 2, 4t + 3) in group 1. So slot
 * p holds lane BS_LANES_FP8[p], and no lane-crossing shuffle is needed.
 * On a Zen 3 VM the shuffle and shift pipes are the FMAs' two: the byte
 * unpacks this replaced (two per 32 codes, after a vpermq before that) were
 * 1.08-1.09x the time of the second load.
 *
 * The load at p - 1 reads the byte before the chunk, which lies outside the
 * matrix for the first chunk of its first row: the kernels decode a row's
 * first chunk (c = 0) with the *0 decoders, which take code 2k into the
 * high byte by a shift instead. */
static const float BS_LANES_FP8[16] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};
static inline __m256i bs_e4m3_odd(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m256i bs_e4m3_even(const void *p) {
    return _mm256_loadu_si256((const __m256i *)((const uint8_t *)p - 1));
}
static inline __m256i bs_e4m3_even0(__m256i odd) { return _mm256_slli_epi16(odd, 8); }
/* A row's last, partial chunk (bs_dec32pt_e4m3): its m codes, the rest
 * 0x38. When m is a whole number of dwords, those by a masked load (which
 * reads nothing past them) and the rest filled in, with no store: the
 * padded copy otherwise used costs a store-forwarding stall per row, a
 * 32-byte load of bytes just written by smaller stores (64 x 48 on the
 * Zen 3 VM, bench kernels, 1 thread: 1.31-1.43 -> 0.58-0.62 us). */
static inline __m256i bs_e4m3_tail(const void *p, size_t m) {
    const __m256i dw = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i have = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(m / 4)), dw);
    return _mm256_blendv_epi8(_mm256_set1_epi8(0x38), _mm256_maskload_epi32((const int *)p, have), have);
}
/* The three decoders of path x ("p" or "s", below) from its bs_e4m3_x_of
 * (even slots, odd slots): a whole chunk (reads p[-1]), a row's first
 * chunk (0: p[0..31] only) and a row's last, partial one (t). */
#define BS_E4M3_DECODERS(x, chk_t)                                                             \
    static inline void bs_dec32##x##_e4m3(const void *p, bs_vf o[2][BS_G], chk_t *chk) {       \
        bs_e4m3_##x##_of(bs_e4m3_even(p), bs_e4m3_odd(p), o, chk);                             \
    }                                                                                          \
    static inline void bs_dec32##x##0_e4m3(const void *p, bs_vf o[2][BS_G], chk_t *chk) {      \
        const __m256i odd = bs_e4m3_odd(p);                                                    \
        bs_e4m3_##x##_of(bs_e4m3_even0(odd), odd, o, chk);                                     \
    }                                                                                          \
    static inline void bs_dec32##x##t_e4m3(const void *p, size_t m, bs_vf o[2][BS_G], chk_t *chk) { \
        if (m % 4 == 0) {                                                                      \
            const __m256i odd = bs_e4m3_tail(p, m);                                            \
            bs_e4m3_##x##_of(bs_e4m3_even0(odd), odd, o, chk);                                 \
        } else {                                                                               \
            BS_FP8_TAIL_COPY(bs_dec32##x##0_e4m3, p, m, o, chk);                               \
        }                                                                                      \
    }
/* Every normal E4M3 value is a BF16 value whose bits are the code's
 * shifted into place plus an exponent rebias: bf16 = (slot >>arith 4 &
 * 0x87F0) + 0x3C00 (120 << 7), code in the slot's high byte. Zero,
 * subnormals and NaN do not follow that rule; *chk records whether all 32
 * codes are normal (magnitude 8..126), and a block where one is not is
 * redone exactly (the kernels' redo_block). */
typedef __m256i bs_chk; /* and-accumulated "code is normal" byte masks */
static inline bs_chk bs_chk_init(void) { return _mm256_set1_epi8(-1); }
static inline int bs_chk_ok(bs_chk c) { return _mm256_movemask_epi8(c) == -1; }
static inline void bs_e4m3_p_of(__m256i even, __m256i odd, bs_vf o[2][BS_G], bs_chk *chk) {
    /* magnitude + 120 as a signed byte is below -9 exactly for magnitudes 8..126 */
    __m256i v = _mm256_add_epi8(_mm256_and_si256(odd, _mm256_set1_epi8(0x7F)), _mm256_set1_epi8(0x78));
    *chk = _mm256_and_si256(*chk, _mm256_cmpgt_epi8(_mm256_set1_epi8(-9), v));
    const __m256i keep = _mm256_set1_epi16((short)0x87F0), bias = _mm256_set1_epi16(0x3C00);
    bs_tops_to_f32(_mm256_add_epi16(_mm256_and_si256(_mm256_srai_epi16(even, 4), keep), bias),
                   _mm256_add_epi16(_mm256_and_si256(_mm256_srai_epi16(odd, 4), keep), bias), o);
}
BS_E4M3_DECODERS(p, bs_chk) /* bs_dec32p_e4m3, bs_dec32p0_e4m3, bs_dec32pt_e4m3 */

/* x of one whole FP8 chunk in its step order, times m: xp[16h + s] =
 * x[2 LANES[s] + h] * m (the kernels' permute_x), that is out_k[i] =
 * x[4i + k] in the order out_0, out_2, out_1, out_3: each 8-column load's
 * pairs (x[4i + k], x[4i + 4 + k]) gathered by one permute, then a 4 x 4
 * transpose of those pairs. The plain loop it replaces is not vectorized. */
#define BS_FP8_XP_CHUNK
static inline void bs_fp8_xp_chunk(const float *x, float *xp, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    const __m256i pairs = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256d p[4];
    for (int j = 0; j < 4; ++j)
        p[j] = _mm256_castps_pd(_mm256_permutevar8x32_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), mv), pairs));
    /* lo: pairs k = 0 (low 128) and 2 (high) of two loads; hi: k = 1 and 3 */
    const __m256d lo01 = _mm256_unpacklo_pd(p[0], p[1]), hi01 = _mm256_unpackhi_pd(p[0], p[1]);
    const __m256d lo23 = _mm256_unpacklo_pd(p[2], p[3]), hi23 = _mm256_unpackhi_pd(p[2], p[3]);
    _mm256_storeu_pd((double *)xp, _mm256_permute2f128_pd(lo01, lo23, 0x20));       /* out_0 */
    _mm256_storeu_pd((double *)(xp + 8), _mm256_permute2f128_pd(lo01, lo23, 0x31)); /* out_2 */
    _mm256_storeu_pd((double *)(xp + 16), _mm256_permute2f128_pd(hi01, hi23, 0x20)); /* out_1 */
    _mm256_storeu_pd((double *)(xp + 24), _mm256_permute2f128_pd(hi01, hi23, 0x31)); /* out_3 */
}

/* FP8 against x scaled by 2^120 (the "s" tiles, for rows whose every
 * |x| < 256, so that x * 2^120 is exact and finite). Each code's bits go
 * straight into an f32's sign, exponent and mantissa fields with no
 * rebias: w' = (slot >>arith 4 & 0x87F0) << 16 is w * 2^-120 exactly for
 * every code but NaN -- normal codes give normal f32s down to 2^-126, zero
 * and subnormal codes (magnitude 0..7) f32 subnormals m * 2^-129
 * (= m * 2^-9 * 2^-120) and +-0 -- so w' * x' is the same real number as
 * w * x and every FMA rounds as the reference's. One operation fewer per 16
 * codes than bs_dec32p_e4m3 (no bias add), and the check left is for NaN
 * codes alone (magnitude 127): a running byte maximum of the magnitudes,
 * two operations per 32 codes where the normal-code test takes four; a
 * block that holds one is redone. On a Zen 3 VM, 64 rows x 4096 columns in
 * L2 at 1 thread: 8.4 -> 6.9 cycles per 32 weights (before the lane order
 * without vpermq), and no slowdown with 1 code in 50 zero or subnormal,
 * where the normal-code test redoes nearly every block (2.7 GB/s). */
typedef __m256i bs_chks; /* max-accumulated code magnitudes */
static inline bs_chks bs_chks_init(void) { return _mm256_setzero_si256(); }
static inline int bs_chks_ok(bs_chks c) {
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(c, _mm256_set1_epi8(0x7F))) == 0;
}
static inline void bs_e4m3_s_of(__m256i even, __m256i odd, bs_vf o[2][BS_G], bs_chks *chk) {
    *chk = _mm256_max_epu8(*chk, _mm256_and_si256(odd, _mm256_set1_epi8(0x7F)));
    const __m256i keep = _mm256_set1_epi16((short)0x87F0);
    bs_tops_to_f32(_mm256_and_si256(_mm256_srai_epi16(even, 4), keep), _mm256_and_si256(_mm256_srai_epi16(odd, 4), keep), o);
}
BS_E4M3_DECODERS(s, bs_chks) /* bs_dec32s_e4m3, bs_dec32s0_e4m3, bs_dec32st_e4m3 */

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
