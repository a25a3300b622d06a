/* Scalar "ISA": one lane per vector, sixteen vectors per lane group.
 * The reference every SIMD variant must match bit for bit. */
#ifndef BS_ISA_H
#define BS_ISA_H
#include "bs_formats.h"

#define BS_W 1
#define BS_G 16
typedef float bs_vf;

static inline bs_vf bs_zero(void) { return 0.0f; }
static inline bs_vf bs_set1(float x) { return x; }
static inline bs_vf bs_loadu(const float *p) { return *p; }
/* Register hint: nothing to do on this ISA. */
static inline void bs_keep(bs_vf *v) { (void)v; }
static inline void bs_storeu(float *p, bs_vf v) { *p = v; }
static inline bs_vf bs_fma(bs_vf a, bs_vf b, bs_vf c) { return fmaf(a, b, c); }
static inline bs_vf bs_add(bs_vf a, bs_vf b) { return a + b; }
static inline bs_vf bs_sub(bs_vf a, bs_vf b) { return a - b; }
static inline bs_vf bs_mul(bs_vf a, bs_vf b) { return a * b; }
static inline bs_vf bs_round(bs_vf a) { return rintf(a); }
/* 2^n for integral n in [-126, 127]. */
static inline bs_vf bs_pow2i(bs_vf n) {
    int32_t k = (n == n) ? (int32_t)n : 0; /* NaN: the caller's result is NaN anyway */
    return bs_bits_f32((uint32_t)(k + 127) << 23);
}
/* x < c ? a : b, lane-wise; false for NaN x. */
static inline bs_vf bs_select_lt(bs_vf x, bs_vf c, bs_vf a, bs_vf b) { return x < c ? a : b; }

/* Sixteen consecutive columns into BS_G vectors. */
static inline void bs_dec16_f32(const void *p, bs_vf o[BS_G]) {
    for (int i = 0; i < 16; ++i) o[i] = ((const float *)p)[i];
}
static inline void bs_dec16_bf16(const void *p, bs_vf o[BS_G]) {
    for (int i = 0; i < 16; ++i) o[i] = bs_bf16_to_f32(((const uint16_t *)p)[i]);
}
/* FP8 chunk (bs_formats.h): step h, lane l = column 2l + h. */
static inline void bs_dec32p_e4m3(const void *p, bs_vf o[2][BS_G], bs_chk *chk) {
    (void)chk;
    for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 16; ++l) o[h][l] = bs_e4m3_to_f32(((const uint8_t *)p)[2 * l + h]);
}

/* FP4 chunk (bs_formats.h): lane g's 8 columns, in order. */
static inline void bs_fp4_steps(const uint8_t *p, int g, bs_vf o[8]) {
    for (int k = 0; k < 8; ++k) o[k] = bs_e2m1_at(p + 4 * g, (size_t)k);
}
/* A partial chunk: only its nblk (1..3) blocks are read, the rest is zero. */
static inline void bs_fp4_steps_part(const uint8_t *p, int g, size_t nblk, bs_vf o[8]) {
    if ((size_t)g / 4 < nblk) {
        bs_fp4_steps(p, g, o);
    } else {
        for (int k = 0; k < 8; ++k) o[k] = 0.0f;
    }
}
/* Scales of 4 chunks; chunk qq's scale for lane g is byte 4 qq + g / 4. */
typedef bs_fp4s_bytes bs_fp4s;
static inline void bs_fp4s_load(bs_fp4s *st, const uint8_t *s, size_t n) { bs_fp4s_copy(st, s, n); }
static inline bs_vf bs_fp4s_get(const bs_fp4s *st, int qq, int g) { return bs_e8m0_to_f32(st->b[4 * qq + g / 4]); }

/* Lane group <-> float[16]. */
static inline void bs_store16(float *t, const bs_vf a[BS_G]) { for (int i = 0; i < 16; ++i) t[i] = a[i]; }
static inline void bs_load16(bs_vf a[BS_G], const float *t) { for (int i = 0; i < 16; ++i) a[i] = t[i]; }

/* The fixed reduction tree: (l, l+8), then (l, l+4), (l, l+2), (0, 1). */
static inline float bs_reduce16(const bs_vf a[BS_G]) {
    float t[8];
    for (int l = 0; l < 8; ++l) t[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; ++l) t[l] = t[l] + t[l + 4];
    for (int l = 0; l < 2; ++l) t[l] = t[l] + t[l + 2];
    return t[0] + t[1];
}

/* ---- fp4×q8 (templates/q8.c.tera): eight block accumulators ---- */
typedef struct { float a[8]; } bs_q8acc;
static inline bs_q8acc bs_q8_zero(void) {
    bs_q8acc z;
    for (int k = 0; k < 8; ++k) z.a[k] = 0.0f;
    return z;
}
/* Blocks k = 0..7 (16 packed bytes of w and 32 bytes of xq each):
 * acc[k] = fma(T_k, scale_k, acc[k]) with T_k the exact integer dot. */
static inline void bs_q8_step8(bs_q8acc *acc, const uint8_t *w, const uint8_t *ws, const int8_t *xq, const float *xd,
                               const int32_t *xs) {
    (void)xs; /* the per-block sums of xq are for offset encodings (x86) */
    for (int k = 0; k < 8; ++k) {
        int32_t t = 0;
        for (int i = 0; i < 16; ++i) {
            const uint8_t b = w[16 * k + i];
            t += BS_E2M1_X2[b & 15] * xq[32 * k + i] + BS_E2M1_X2[b >> 4] * xq[32 * k + 16 + i];
        }
        acc->a[k] = fmaf((float)t, bs_q8_scale(ws[k], xd[k]), acc->a[k]);
    }
}
/* ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) */
static inline float bs_q8_reduce(bs_q8acc c) {
    return ((c.a[0] + c.a[4]) + (c.a[2] + c.a[6])) + ((c.a[1] + c.a[5]) + (c.a[3] + c.a[7]));
}
#endif
