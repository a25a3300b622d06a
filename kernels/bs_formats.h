/* Scalar definitions of the weight formats, shared by every ISA variant.
 * They agree bit for bit with src/formats.rs (the oracle). */
#ifndef BS_FORMATS_H
#define BS_FORMATS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bs_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t bs_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The NaN every decoder returns. */
#define BS_NAN_BITS 0x7FC00000u

/* BF16: the high half of an f32. */
static inline float bs_bf16_to_f32(uint16_t h) { return bs_bits_f32((uint32_t)h << 16); }

/* E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities;
 * 0x7F / 0xFF are NaN; exponent 0 is subnormal (m * 2^-9). Computed without
 * touching f32 subnormals (slow on many cores). */
static inline float bs_e4m3_to_f32(uint8_t b) {
    uint32_t mag = b & 0x7Fu;
    if (mag == 0x7Fu) return bs_bits_f32(BS_NAN_BITS);
    float v = (mag >> 3) ? bs_bits_f32((mag << 20) + (120u << 23)) : (float)mag * 0x1p-9f;
    return bs_bits_f32(bs_f32_bits(v) | ((uint32_t)(b & 0x80u) << 24));
}

/* E2M1 codes 0..15: 0 .5 1 1.5 2 3 4 6, then the same negated. */
static const float BS_E2M1[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

/* Every E2M1 value is exact in the top 16 bits of an f32: its byte 3 (sign
 * and exponent) and byte 2, per code, for byte look-ups (AVX2 pshufb, NEON
 * tbl). */
static const uint8_t BS_E2M1_F32_B3[16] = {0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                           0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0};
static const uint8_t BS_E2M1_F32_B2[16] = {0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0,
                                           0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0};

/* E2M1 code of column c of a packed row: low nibble = even column. */
static inline float bs_e2m1_at(const uint8_t *row, size_t c) {
    uint8_t b = row[c >> 1];
    return BS_E2M1[(c & 1) ? (b >> 4) : (b & 0xF)];
}

/* UE8M0 scale: 2^(b-127); 0xFF is NaN; b = 0 is the subnormal 2^-127. */
static inline float bs_e8m0_to_f32(uint8_t b) {
    uint32_t bits = (uint32_t)b << 23;
    bits = b == 0 ? 0x00400000u : bits;
    bits = b == 0xFF ? BS_NAN_BITS : bits;
    return bs_bits_f32(bits);
}

/* The same scales as f32 bit patterns, for vector code that broadcasts one
 * from memory: entry b is b << 23 for 1..254, 2^-127 for 0, NaN for 255. */
#define BS_E8M0_1(b) ((uint32_t)(b) << 23)
#define BS_E8M0_2(b) BS_E8M0_1(b), BS_E8M0_1((b) + 1)
#define BS_E8M0_4(b) BS_E8M0_2(b), BS_E8M0_2((b) + 2)
#define BS_E8M0_8(b) BS_E8M0_4(b), BS_E8M0_4((b) + 4)
#define BS_E8M0_16(b) BS_E8M0_8(b), BS_E8M0_8((b) + 8)
#define BS_E8M0_32(b) BS_E8M0_16(b), BS_E8M0_16((b) + 16)
#define BS_E8M0_64(b) BS_E8M0_32(b), BS_E8M0_32((b) + 32)
static const uint32_t BS_E8M0_BITS[] = {
    0x00400000u, BS_E8M0_1(1), BS_E8M0_2(2), BS_E8M0_4(4), BS_E8M0_8(8), BS_E8M0_16(16), BS_E8M0_32(32),
    BS_E8M0_64(64), BS_E8M0_64(128), BS_E8M0_32(192), BS_E8M0_16(224), BS_E8M0_8(240), BS_E8M0_4(248),
    BS_E8M0_2(252), BS_E8M0_1(254), BS_NAN_BITS,
};
_Static_assert(sizeof BS_E8M0_BITS == 256 * sizeof(uint32_t), "one entry per scale byte");

/* ---- FP4 chunks (templates/matmul.c.tera) ----
 * The FP4 kernels take a row 128 columns (64 bytes, 4 scale blocks) at a
 * time: lane l (0..15) of a chunk holds the 8 consecutive columns 8l..8l+7,
 * the 4 bytes 4l..4l+3, all in block l / 4; step k (0..7) of lane l is
 * column 8l + k, byte 4l + k / 2, the low nibble for even k. Each ISA's
 * bs_fp4_steps(p, g, o) decodes lane group g's 8 steps into o[0..7] in lane
 * order, and bs_fp4s_get its per-lane scales. */
static const float BS_FP4_LANE_BLOCK[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
/* The next (up to) 16 scale bytes of a row, 4 chunks' worth, zero-padded. */
typedef struct {
    uint8_t b[16];
} bs_fp4s_bytes;
static inline void bs_fp4s_copy(bs_fp4s_bytes *st, const uint8_t *s, size_t n) {
    if (n >= 16) {
        memcpy(st->b, s, 16);
    } else {
        for (size_t i = 0; i < 16; ++i) st->b[i] = i < n ? s[i] : 0;
    }
}

/* Element c of a row, per format (used for lane tails). */
static inline float bs_w1_f32(const void *row, size_t c) { return ((const float *)row)[c]; }
static inline float bs_w1_bf16(const void *row, size_t c) { return bs_bf16_to_f32(((const uint16_t *)row)[c]); }
static inline float bs_w1_e4m3(const void *row, size_t c) { return bs_e4m3_to_f32(((const uint8_t *)row)[c]); }
static inline float bs_w1_e2m1(const void *row, size_t c) { return bs_e2m1_at((const uint8_t *)row, c); }
/* An FP8 column times 2^-120, exactly (E4M3's least magnitude, 2^-9, goes
 * to 2^-129, an f32 subnormal that holds it), for the FP8 "s" tiles'
 * redone blocks and partial chunks (the ISAs with fp8_scaled). */
static inline float bs_w1s_e4m3(const void *row, size_t c) { return bs_w1_e4m3(row, c) * 0x1p-120f; }

/* ---- FP8 in the matrix kernels' order (templates/matmul.c.tera) ----
 * Each ISA's bs_dec32p_e4m3 decodes a 32-column chunk as two steps of the
 * 16 lanes: step h holds column 2l + h of lane l, slot p of each step lane
 * BS_LANES_FP8[p]. An ISA whose decoder is exact for every code (all but
 * AVX2, which defines BS_FP8_CHECKED and its own) keeps the lanes in order
 * and checks nothing: bs_chk_ok is the constant 1, so the kernels' redo of
 * a block is dead code there. A decoder may read the byte before p (AVX2
 * does); the kernels decode a row's first chunk, where that byte can lie
 * outside the matrix, with bs_dec32p0_e4m3 (and bs_dec64p0_e4m3), which
 * read p[0..n-1] only: the same as the plain ones where those do too.
 * bs_dec32pt_e4m3(p, m, o, chk) decodes a row's last, partial chunk: its m
 * (1..31) codes at p, the rest taken as code 0x38 (1.0), reading p[0..m-1]
 * only; BS_FP8_TAIL_COPY does it with a padded copy, for an ISA that has
 * nothing better. The ISAs with IsaDesc::fp8_scaled (AVX2, AVX-512) also
 * define the "s" decoders (bs_dec32s_e4m3 and the rest, with bs_chks),
 * for x scaled by 2^120: w * 2^-120, exact for every code but NaN. */
#define BS_FP8_TAIL_COPY(dec, p, m, o, chk)          \
    do {                                             \
        uint8_t t_[32];                              \
        memset(t_, 0x38, sizeof t_);                 \
        memcpy(t_, (p), (m));                        \
        dec(t_, (o), (chk));                         \
    } while (0)
#ifndef BS_FP8_CHECKED
static const float BS_LANES_FP8[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
typedef int bs_chk;
static inline bs_chk bs_chk_init(void) { return 1; }
static inline int bs_chk_ok(bs_chk c) { (void)c; return 1; }
#define bs_dec32p0_e4m3 bs_dec32p_e4m3
#define bs_dec64p0_e4m3 bs_dec64p_e4m3
#define bs_dec32pt_e4m3(p, m, o, chk) BS_FP8_TAIL_COPY(bs_dec32p_e4m3, p, m, o, chk)
#endif

/* ---- The fp4×q8 variant (templates/q8.c.tera) ----
 * E2M1 codes times two, as int8: 0 1 2 3 4 6 8 12 and the negatives (code 8,
 * -0, is 0). Every E2M1 value is an integer after doubling, so a block's dot
 * product with int8 activations is exact in int32. */
static const int8_t BS_E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Scale of one block's integer dot product: (2^(b-127) * 0.5) * d. The first
 * product is exact (a power of two halved); every ISA then rounds once. */
static inline float bs_q8_scale(uint8_t b, float d) { return (bs_e8m0_to_f32(b) * 0.5f) * d; }

#endif
