/* NEON (AArch64 Advanced SIMD): 4 lanes, four vectors per lane group. */
#ifndef BS_ISA_H
#define BS_ISA_H
#include <arm_neon.h>
#include "bs_formats.h"

#define BS_W 4
#define BS_G 4
typedef float32x4_t bs_vf;

static inline bs_vf bs_zero(void) { return vdupq_n_f32(0.0f); }
static inline bs_vf bs_set1(float x) { return vdupq_n_f32(x); }
static inline bs_vf bs_loadu(const float *p) { return vld1q_f32(p); }
/* Register hint: nothing to do on this ISA. */
static inline void bs_keep(bs_vf *v) { (void)v; }
static inline void bs_storeu(float *p, bs_vf v) { vst1q_f32(p, v); }
static inline bs_vf bs_fma(bs_vf a, bs_vf b, bs_vf c) { return vfmaq_f32(c, a, b); }
static inline bs_vf bs_add(bs_vf a, bs_vf b) { return vaddq_f32(a, b); }
static inline bs_vf bs_sub(bs_vf a, bs_vf b) { return vsubq_f32(a, b); }
static inline bs_vf bs_mul(bs_vf a, bs_vf b) { return vmulq_f32(a, b); }
static inline bs_vf bs_round(bs_vf a) { return vrndnq_f32(a); }
static inline bs_vf bs_pow2i(bs_vf n) {
    int32x4_t e = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
    return vreinterpretq_f32_s32(vshlq_n_s32(e, 23));
}
static inline bs_vf bs_select_lt(bs_vf x, bs_vf c, bs_vf a, bs_vf b) { return vbslq_f32(vcltq_f32(x, c), a, b); }

static inline void bs_dec16_f32(const void *p, bs_vf o[BS_G]) {
    for (int i = 0; i < 4; ++i) o[i] = vld1q_f32((const float *)p + 4 * i);
}
static inline void bs_dec16_bf16(const void *p, bs_vf o[BS_G]) {
    uint16x8_t a = vld1q_u16((const uint16_t *)p), b = vld1q_u16((const uint16_t *)p + 8);
    o[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(a), 16));
    o[1] = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(a), 16));
    o[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16));
    o[3] = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(b), 16));
}
/* E4M3 -> F16 bits by shifting (exact for every code, subnormals included:
 * the F16 value is the E4M3 value / 256), NaN codes -> F16 NaN, then the
 * hardware F16 conversion and one exact multiply by 256. */
static inline void bs_f16x8_to_f32(uint16x8_t h, bs_vf *lo, bs_vf *hi) {
    float16x8_t f = vreinterpretq_f16_u16(h);
    *lo = vmulq_f32(vcvt_f32_f16(vget_low_f16(f)), vdupq_n_f32(256.0f));
    *hi = vmulq_f32(vcvt_high_f32_f16(f), vdupq_n_f32(256.0f));
}
static inline uint16x8_t bs_e4m3_to_f16x8(uint8x8_t b) {
    uint16x8_t t = vshlq_n_u16(vmovl_u8(b), 7);                  /* s at bit 14, magnitude at 7..13 */
    t = vaddq_u16(t, vandq_u16(t, vdupq_n_u16(0x4000)));         /* sign to bit 15 */
    uint16x8_t nan = vceqq_u16(vandq_u16(t, vdupq_n_u16(0x7FFF)), vdupq_n_u16(0x3F80));
    return vorrq_u16(t, vandq_u16(nan, vdupq_n_u16(0x7C00)));
}
/* FP8 chunk (bs_formats.h): a de-interleaving load gives the even columns
 * (step 0) and the odd ones (step 1), each 16 in lane order. */
static inline void bs_dec32p_e4m3(const void *p, bs_vf o[2][BS_G], bs_chk *chk) {
    (void)chk;
    uint8x16x2_t b = vld2q_u8((const uint8_t *)p);
    for (int h = 0; h < 2; ++h) {
        bs_f16x8_to_f32(bs_e4m3_to_f16x8(vget_low_u8(b.val[h])), &o[h][0], &o[h][1]);
        bs_f16x8_to_f32(bs_e4m3_to_f16x8(vget_high_u8(b.val[h])), &o[h][2], &o[h][3]);
    }
}
/* FP4 chunk (bs_formats.h), lane group g = lanes 4g..4g+3 = bytes 16g..16g+15
 * = scale block g of the chunk. Table look-ups give each code's f32 bytes 3
 * and 2 (every E2M1 value is exact in the top 16 bits of an f32), for the
 * low nibbles (even steps) and the high ones (odd steps); one two-register
 * look-up per step then puts lane l's pair at the top of f32 lane l. */
static inline void bs_fp4_steps_of(uint8x16_t d, bs_vf o[8]) {
    /* step pair k: bytes 0, 1 out of range (zero), byte 2 = low table at
     * 4l + k, byte 3 = high table (16 on) at 4l + k */
    static const uint8_t place[4][16] = {
        {0xFF, 0xFF, 0, 16, 0xFF, 0xFF, 4, 20, 0xFF, 0xFF, 8, 24, 0xFF, 0xFF, 12, 28},
        {0xFF, 0xFF, 1, 17, 0xFF, 0xFF, 5, 21, 0xFF, 0xFF, 9, 25, 0xFF, 0xFF, 13, 29},
        {0xFF, 0xFF, 2, 18, 0xFF, 0xFF, 6, 22, 0xFF, 0xFF, 10, 26, 0xFF, 0xFF, 14, 30},
        {0xFF, 0xFF, 3, 19, 0xFF, 0xFF, 7, 23, 0xFF, 0xFF, 11, 27, 0xFF, 0xFF, 15, 31},
    };
    const uint8x16_t e = vandq_u8(d, vdupq_n_u8(0x0F)), od = vshrq_n_u8(d, 4);
    const uint8x16_t h = vld1q_u8(BS_E2M1_F32_B3), l = vld1q_u8(BS_E2M1_F32_B2);
    const uint8x16x2_t ev = {{vqtbl1q_u8(l, e), vqtbl1q_u8(h, e)}}, ov = {{vqtbl1q_u8(l, od), vqtbl1q_u8(h, od)}};
    for (int k = 0; k < 4; ++k) {
        const uint8x16_t idx = vld1q_u8(place[k]);
        o[2 * k] = vreinterpretq_f32_u8(vqtbl2q_u8(ev, idx));
        o[2 * k + 1] = vreinterpretq_f32_u8(vqtbl2q_u8(ov, idx));
    }
}
static inline void bs_fp4_steps(const uint8_t *p, int g, bs_vf o[8]) { bs_fp4_steps_of(vld1q_u8(p + 16 * g), o); }
/* A partial chunk: only its nblk (1..3) blocks are read, the rest is zero. */
static inline void bs_fp4_steps_part(const uint8_t *p, int g, size_t nblk, bs_vf o[8]) {
    bs_fp4_steps_of((size_t)g < nblk ? vld1q_u8(p + 16 * g) : vdupq_n_u8(0), o);
}
/* Scales of 4 chunks: group g of chunk qq is block g, one broadcast. */
typedef bs_fp4s_bytes bs_fp4s;
static inline void bs_fp4s_load(bs_fp4s *st, const uint8_t *s, size_t n) { bs_fp4s_copy(st, s, n); }
static inline bs_vf bs_fp4s_get(const bs_fp4s *st, int qq, int g) {
    return vreinterpretq_f32_u32(vld1q_dup_u32(&BS_E8M0_BITS[st->b[4 * qq + g]]));
}

static inline void bs_store16(float *t, const bs_vf a[BS_G]) { for (int i = 0; i < 4; ++i) vst1q_f32(t + 4 * i, a[i]); }
static inline void bs_load16(bs_vf a[BS_G], const float *t) { for (int i = 0; i < 4; ++i) a[i] = vld1q_f32(t + 4 * i); }

static inline float bs_reduce16(const bs_vf a[BS_G]) {
    float32x4_t u0 = vaddq_f32(a[0], a[2]);                  /* lanes 0-3: l + l+8 */
    float32x4_t u1 = vaddq_f32(a[1], a[3]);                  /* lanes 4-7: l + l+8 */
    float32x4_t w = vaddq_f32(u0, u1);                        /* l + l+4 */
    float32x2_t s2 = vadd_f32(vget_low_f32(w), vget_high_f32(w)); /* l + l+2 */
    return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);       /* 0 + 1 */
}

/* ---- fp4×q8 (templates/q8.c.tera): eight block accumulators in two vectors ---- */
typedef struct { float32x4_t lo, hi; } bs_q8acc;
static inline bs_q8acc bs_q8_zero(void) {
    bs_q8acc z = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    return z;
}
/* One block: partial integer dot products (their sum is exact). With dotprod
 * (BESPOKE_CPU=jetson-orin, dgx-spark, ...) two SDOTs; baseline NEON widens
 * with SMULL/SMLAL (|sum of four products| <= 4 * 12 * 127 fits int16). */
static inline int32x4_t bs_q8_block(const uint8_t *w, const int8_t *x) {
    const int8x16_t lut = vld1q_s8(BS_E2M1_X2);
    const uint8x16_t b = vld1q_u8(w);
    const int8x16_t we = vqtbl1q_s8(lut, vandq_u8(b, vdupq_n_u8(15)));
    const int8x16_t wo = vqtbl1q_s8(lut, vshrq_n_u8(b, 4));
    const int8x16_t xe = vld1q_s8(x), xo = vld1q_s8(x + 16);
#ifdef __ARM_FEATURE_DOTPROD
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), we, xe), wo, xo);
#else
    int16x8_t p = vmull_s8(vget_low_s8(we), vget_low_s8(xe));
    p = vmlal_s8(p, vget_high_s8(we), vget_high_s8(xe));
    p = vmlal_s8(p, vget_low_s8(wo), vget_low_s8(xo));
    p = vmlal_s8(p, vget_high_s8(wo), vget_high_s8(xo));
    return vpaddlq_s16(p);
#endif
}
/* UE8M0 bytes to f32 (0 -> 2^-127, 0xFF -> NaN), four at a time. */
static inline float32x4_t bs_e8m0x4(uint16x4_t e) {
    const uint32x4_t u = vmovl_u16(e);
    uint32x4_t bits = vshlq_n_u32(u, 23);
    bits = vbslq_u32(vceqq_u32(u, vdupq_n_u32(0)), vdupq_n_u32(0x00400000u), bits);
    bits = vbslq_u32(vceqq_u32(u, vdupq_n_u32(255)), vdupq_n_u32(BS_NAN_BITS), bits);
    return vreinterpretq_f32_u32(bits);
}
static inline void bs_q8_step8(bs_q8acc *acc, const uint8_t *w, const uint8_t *ws, const int8_t *xq, const float *xd,
                               const int32_t *xs) {
    (void)xs; /* the per-block sums of xq are for offset encodings (x86) */
    int32x4_t v[8];
    for (int k = 0; k < 8; ++k) v[k] = bs_q8_block(w + 16 * k, xq + 32 * k);
    const int32x4_t t0 = vpaddq_s32(vpaddq_s32(v[0], v[1]), vpaddq_s32(v[2], v[3])); /* T0..T3 */
    const int32x4_t t1 = vpaddq_s32(vpaddq_s32(v[4], v[5]), vpaddq_s32(v[6], v[7])); /* T4..T7 */
    const uint16x8_t e = vmovl_u8(vld1_u8(ws));
    const float32x4_t half = vdupq_n_f32(0.5f);
    const float32x4_t s0 = vmulq_f32(vmulq_f32(bs_e8m0x4(vget_low_u16(e)), half), vld1q_f32(xd));
    const float32x4_t s1 = vmulq_f32(vmulq_f32(bs_e8m0x4(vget_high_u16(e)), half), vld1q_f32(xd + 4));
    acc->lo = vfmaq_f32(acc->lo, vcvtq_f32_s32(t0), s0);
    acc->hi = vfmaq_f32(acc->hi, vcvtq_f32_s32(t1), s1);
}
static inline float bs_q8_reduce(bs_q8acc c) {
    const float32x4_t s4 = vaddq_f32(c.lo, c.hi);                         /* k + k+4 */
    const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4)); /* k + k+2 */
    return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
}
#endif
