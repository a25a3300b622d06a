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
static inline bs_vf bs_e4m3x4(uint16x4_t h) {
    uint32x4_t v = vmovl_u16(h);
    uint32x4_t mag = vandq_u32(v, vdupq_n_u32(0x7F));
    uint32x4_t sign = vshlq_n_u32(vandq_u32(v, vdupq_n_u32(0x80)), 24);
    float32x4_t f = vmulq_f32(vreinterpretq_f32_u32(vshlq_n_u32(mag, 20)), vdupq_n_f32(0x1p120f));
    f = vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(f), sign));
    return vbslq_f32(vceqq_u32(mag, vdupq_n_u32(0x7F)), vreinterpretq_f32_u32(vdupq_n_u32(BS_NAN_BITS)), f);
}
static inline void bs_dec16_e4m3(const void *p, bs_vf o[BS_G]) {
    uint8x16_t b = vld1q_u8((const uint8_t *)p);
    uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_u8(vget_high_u8(b));
    o[0] = bs_e4m3x4(vget_low_u16(lo));
    o[1] = bs_e4m3x4(vget_high_u16(lo));
    o[2] = bs_e4m3x4(vget_low_u16(hi));
    o[3] = bs_e4m3x4(vget_high_u16(hi));
}
/* Magnitude codes 0..7 -> doubled values 0 1 2 3 4 6 8 12 by one table look-up
 * (vqtbl1q), halved exactly after conversion; the sign bit (code bit 3) is
 * moved to bit 31 so code 8 decodes to -0. */
static inline void bs_dec16_e2m1(const void *p, bs_vf o[BS_G]) {
    static const uint8_t dbl[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0};
    uint8x8_t b = vld1_u8((const uint8_t *)p);
    uint8x8x2_t z = vzip_u8(vand_u8(b, vdup_n_u8(0x0F)), vshr_n_u8(b, 4));
    uint8x16_t codes = vcombine_u8(z.val[0], z.val[1]);
    uint8x16_t mag = vqtbl1q_u8(vld1q_u8(dbl), vandq_u8(codes, vdupq_n_u8(7)));
    uint8x16_t sgn = vshrq_n_u8(codes, 3);
    uint16x8_t m16[2] = {vmovl_u8(vget_low_u8(mag)), vmovl_u8(vget_high_u8(mag))};
    uint16x8_t s16[2] = {vmovl_u8(vget_low_u8(sgn)), vmovl_u8(vget_high_u8(sgn))};
    for (int i = 0; i < 4; ++i) {
        uint16x4_t mh = (i & 1) ? vget_high_u16(m16[i >> 1]) : vget_low_u16(m16[i >> 1]);
        uint16x4_t sh = (i & 1) ? vget_high_u16(s16[i >> 1]) : vget_low_u16(s16[i >> 1]);
        float32x4_t v = vmulq_f32(vcvtq_f32_u32(vmovl_u16(mh)), vdupq_n_f32(0.5f));
        o[i] = vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(v), vshlq_n_u32(vmovl_u16(sh), 31)));
    }
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
#endif
