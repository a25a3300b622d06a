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
static inline void bs_dec16_e4m3(const void *p, bs_vf o[BS_G]) {
    for (int i = 0; i < 16; ++i) o[i] = bs_e4m3_to_f32(((const uint8_t *)p)[i]);
}
/* p points at the 8 bytes holding the 16 codes. */
static inline void bs_dec16_e2m1(const void *p, bs_vf o[BS_G]) {
    for (int i = 0; i < 16; ++i) o[i] = bs_e2m1_at((const uint8_t *)p, (size_t)i);
}

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
#endif
