/* Runs one ISA variant's generic kernels against the scalar variant on
 * awkward shapes and inputs (zeros, -0, subnormals, huge values, NaN scale
 * bytes) and reports mismatches; the two must agree bit for bit. Built by
 * tools/isa-check.sh with -DISA=<name> for variants this machine cannot run
 * natively (AVX-512 through SIMDe, NEON under qemu-aarch64). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CAT3(a, b, c) a##b##c
#define SYM(op, fmt, isa) CAT3(bs_##op##_##fmt##_, isa, _generic)
#define ATTN(isa) CAT3(bs_attn_decode_, isa, _generic)
#define STR2(x) #x
#define STR(x) STR2(x)

typedef void mv_fn(const void *, const uint8_t *, const float *, float *, size_t, size_t, size_t, size_t);
typedef void mm_fn(const void *, const uint8_t *, const float *, float *, size_t, size_t, size_t, size_t, size_t);
typedef void at_fn(const float *, const float *, const float *, const float *, float *, float *, size_t, size_t,
                   size_t, size_t, size_t, size_t, size_t, float, size_t, size_t);

#define DECL(fmt, isa) mv_fn SYM(matvec, fmt, isa); mm_fn SYM(matmul, fmt, isa);
DECL(f32, scalar) DECL(bf16, scalar) DECL(fp8, scalar) DECL(fp4, scalar)
DECL(f32, ISA) DECL(bf16, ISA) DECL(fp8, ISA) DECL(fp4, ISA)
at_fn ATTN(scalar);
at_fn ATTN(ISA);
typedef void q8_fn(const uint8_t *, const uint8_t *, const int8_t *, const float *, const int32_t *, float *, size_t,
                   size_t, size_t, size_t);
#define Q8(isa) CAT3(bs_q8_fp4_, isa, _generic)
q8_fn Q8(scalar);
q8_fn Q8(ISA);

#ifdef BF16DOT
/* bf16dot and fp8dot (AVX-512 BF16 only): against their definition
 * (templates/bf16dot.c.tera). */
#include "bs_formats.h"
typedef void dot_fn(const void *w, const uint8_t *s, const uint16_t *x, size_t xs, float *y, size_t rows, size_t cols,
                    size_t n, size_t r0, size_t r1);
dot_fn bs_bf16dot_avx512_generic, bs_fp8dot_avx512_generic;
static float bd_ftz_ref(float v) { return v != 0.0f && fabsf(v) < 0x1p-126f ? 0.0f : v; }
static float bd_val(uint16_t h) {
    const uint32_t b = (uint32_t)h << 16;
    float v;
    memcpy(&v, &b, 4);
    return bd_ftz_ref(v);
}
static float bd_reduce16(const float *a) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}
/* Weight c of a row as the instruction reads it: BF16 bits (w16) or an E4M3
 * code (w8; every E4M3 value is a normal BF16 value, zero or NaN). */
static float bd_w(const uint16_t *w16, const uint8_t *w8, size_t c) {
    return w8 ? bs_e4m3_to_f32(w8[c]) : bd_val(w16[c]);
}
/* Chunks k0..k1 of the definition into the lane sums acc. */
static void bd_chunks(float *acc, const uint16_t *w16, const uint8_t *w8, const uint16_t *x, size_t cols, size_t k0,
                      size_t k1) {
    for (size_t k = k0; k < k1; ++k)
        for (size_t l = 0; l < 16; ++l) {
            const size_t c0 = 32 * k + 2 * l, c1 = c0 + 1;
            const float w0 = c0 < cols ? bd_w(w16, w8, c0) : 0.0f, w1 = c1 < cols ? bd_w(w16, w8, c1) : 0.0f;
            acc[l] = bd_ftz_ref(fmaf(w1, c1 < cols ? bd_val(x[c1]) : 0.0f, acc[l]));
            acc[l] = bd_ftz_ref(fmaf(w0, c0 < cols ? bd_val(x[c0]) : 0.0f, acc[l]));
        }
}
static float bd_row(const uint16_t *w, const uint16_t *x, size_t cols) {
    float acc[16] = {0};
    bd_chunks(acc, w, NULL, x, cols, 0, (cols + 31) / 32);
    return bd_reduce16(acc);
}
/* fp8dot: per 128-column scale block, lane sums from +0, then
 * acc = fma(sum, scale, acc). */
static float fd_row(const uint8_t *w, const uint8_t *s, const uint16_t *x, size_t cols) {
    float acc[16] = {0};
    const size_t nk = (cols + 31) / 32;
    for (size_t b = 0; 128 * b < cols; ++b) {
        float p[16] = {0};
        bd_chunks(p, NULL, w, x, cols, 4 * b, 4 * b + 4 < nk ? 4 * b + 4 : nk);
        const float sc = bs_e8m0_to_f32(s[b]);
        for (size_t l = 0; l < 16; ++l) acc[l] = fmaf(p[l], sc, acc[l]);
    }
    return bd_reduce16(acc);
}
#endif

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}
static float unit(void) { return (float)(rnd() % 2000001) / 1e6f - 1.0f; }
static float activation(void) {
    switch (rnd() % 40) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: {
        uint32_t b = 1 + (uint32_t)(rnd() % 0x7FFFFF);
        float f;
        memcpy(&f, &b, 4);
        return f;
    }
    case 3: return unit() * 1e30f;
    default: return unit() * 4.0f;
    }
}
static uint8_t scale_byte(void) {
    switch (rnd() % 50) {
    case 0: return 0xFF;
    case 1: return 0;
    case 2: return 254;
    default: return (uint8_t)(118 + rnd() % 16);
    }
}
#ifdef BF16DOT
/* n tokens of cols BF16 activations (the high halves of activation()), row
 * stride xs, zero past cols. */
static void bf16_activations(uint16_t *x, size_t n, size_t cols, size_t xs) {
    for (size_t j = 0; j < n; ++j)
        for (size_t c = 0; c < cols; ++c) {
            float v = activation();
            uint32_t b;
            memcpy(&b, &v, 4);
            x[j * xs + c] = (uint16_t)(b >> 16);
        }
}
#endif
static int same(float a, float b) {
    uint32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    return x == y || (isnan(a) && isnan(b));
}

static int mismatches, checks;
static size_t values, finite;

static void compare(const char *what, const float *a, const float *b, size_t n) {
    checks++;
    for (size_t i = 0; i < n; ++i) {
        values++;
        finite += isfinite(a[i]) != 0;
        if (!same(a[i], b[i])) {
            if (mismatches < 10) printf("MISMATCH %s [%zu]: scalar %a, " STR(ISA) " %a\n", what, i, a[i], b[i]);
            mismatches++;
        }
    }
}

struct fmt {
    const char *name;
    int elem_bytes; /* 0 = fp4 */
    mv_fn *mv_ref, *mv;
    mm_fn *mm_ref, *mm;
};

int main(void) {
    struct fmt fmts[4] = {
        {"f32", 4, SYM(matvec, f32, scalar), SYM(matvec, f32, ISA), SYM(matmul, f32, scalar), SYM(matmul, f32, ISA)},
        {"bf16", 2, SYM(matvec, bf16, scalar), SYM(matvec, bf16, ISA), SYM(matmul, bf16, scalar), SYM(matmul, bf16, ISA)},
        {"fp8", 1, SYM(matvec, fp8, scalar), SYM(matvec, fp8, ISA), SYM(matmul, fp8, scalar), SYM(matmul, fp8, ISA)},
        {"fp4", 0, SYM(matvec, fp4, scalar), SYM(matvec, fp4, ISA), SYM(matmul, fp4, scalar), SYM(matmul, fp4, ISA)},
    };
    static const size_t shapes[][2] = {{1, 1}, {1, 17}, {3, 15}, {5, 16}, {37, 100}, {130, 33}, {9, 257},
                                       {1, 32}, {7, 96}, {33, 160}, {130, 64}, {129, 130}, {200, 300}, {2, 2048}};
    char what[128];
    for (int f = 0; f < 4; ++f)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; ++si) {
            size_t rows = shapes[si][0], cols = shapes[si][1];
            if (fmts[f].elem_bytes == 0 && cols % 32) continue;
            size_t n = rows * cols, wbytes = fmts[f].elem_bytes ? n * (size_t)fmts[f].elem_bytes : n / 2;
            uint8_t *w = malloc(wbytes);
            for (size_t i = 0; i < wbytes; ++i) w[i] = (uint8_t)rnd();
            if (fmts[f].elem_bytes == 4)
                for (size_t i = 0; i < n; ++i) ((float *)w)[i] = activation();
            if (fmts[f].elem_bytes == 2)
                for (size_t i = 0; i < n; ++i) {
                    float a = unit() * 2.0f;
                    uint32_t b;
                    memcpy(&b, &a, 4);
                    ((uint16_t *)w)[i] = (uint16_t)(b >> 16);
                }
            size_t nscale = n + 16;
            uint8_t *sc = malloc(nscale);
            for (size_t i = 0; i < nscale; ++i) sc[i] = scale_byte();
            const size_t tokens = 7;
            float *x = malloc(tokens * cols * 4), *y0 = malloc(tokens * rows * 4), *y1 = malloc(tokens * rows * 4);
            for (size_t i = 0; i < tokens * cols; ++i) x[i] = activation();
            fmts[f].mv_ref(w, sc, x, y0, rows, cols, 0, rows);
            fmts[f].mv(w, sc, x, y1, rows, cols, 0, rows);
            snprintf(what, sizeof what, "%s matvec %zux%zu", fmts[f].name, rows, cols);
            compare(what, y0, y1, rows);
            for (size_t t = 1; t <= tokens; t += 3) {
                fmts[f].mm_ref(w, sc, x, y0, rows, cols, t, 0, rows);
                fmts[f].mm(w, sc, x, y1, rows, cols, t, 0, rows);
                snprintf(what, sizeof what, "%s matmul %zux%zu n=%zu", fmts[f].name, rows, cols, t);
                compare(what, y0, y1, t * rows);
            }
            free(w), free(sc), free(x), free(y0), free(y1);
        }
    /* Query heads per KV head 1, 2, 3, 4 and 6: the kernels take 4 heads of a
     * group at a time, then 2, then 1 (AVX-512: groups of 4 and 2 in blocks
     * of 16 (head, key) pairs where head_dim is a multiple of 16). */
    static const size_t cases[][4] = {{16, 8, 8, 17}, {33, 6, 3, 100}, {64, 4, 1, 5},   {18, 4, 2, 40},
                                      {512, 2, 1, 150}, {40, 9, 3, 30}, {24, 12, 2, 40}, {48, 12, 2, 37},
                                      /* long caches, values past 256 KiB a KV head */
                                      {64, 8, 2, 1100}, {40, 4, 1, 1700}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
        size_t hd = cases[c][0], h = cases[c][1], kv = cases[c][2], t = cases[c][3];
        /* Position-major rows (modes 0-2) and KV-head-major (3, 4: each KV
         * head's rows of hd + 1 floats in a run with room for t + 1). */
        const size_t pm_stride = kv * hd + 3, hm_stride = hd + 1, hm_head = (t + 1) * hm_stride;
        const size_t n = t * pm_stride > kv * hm_head ? t * pm_stride : kv * hm_head;
        float *q = malloc(h * hd * 4), *k = malloc(n * 4), *v = malloc(n * 4);
        float *sinks = malloc(h * 4), *o0 = malloc(h * hd * 4), *o1 = malloc(h * hd * 4), *scratch = malloc(4 * (t + 16) * 4);
        for (size_t i = 0; i < h * hd; ++i) q[i] = unit();
        for (size_t i = 0; i < n; ++i) k[i] = unit(), v[i] = activation();
        for (size_t i = 0; i < h; ++i) sinks[i] = unit() * 3.0f;
        for (int mode = 0; mode < 5; ++mode) {
            const float *s = mode == 1 || mode == 2 || mode == 4 ? sinks : NULL;
            size_t window = mode == 2 || mode == 4 ? 7 : 0;
            size_t stride = mode < 3 ? pm_stride : hm_stride, head = mode < 3 ? hd : hm_head;
            ATTN(scalar)(q, k, v, s, o0, scratch, h, kv, hd, stride, head, t, window, 0.125f, 0, h);
            ATTN(ISA)(q, k, v, s, o1, scratch, h, kv, hd, stride, head, t, window, 0.125f, 0, h);
            snprintf(what, sizeof what, "attention hd=%zu h=%zu kv=%zu t=%zu mode=%d", hd, h, kv, t, mode);
            compare(what, o0, o1, h * hd);
        }
        free(q), free(k), free(v), free(sinks), free(o0), free(o1), free(scratch);
    }
    /* fp4xq8: random codes, scale bytes (NaN included), int8 activations over
     * the quantizer's range -127..127 and activation scales of every size;
     * 1..41 blocks per row covers every tail of the 8-block group and
     * every mix of AVX-512's 16-block and 8-block steps. */
    for (size_t nb = 1; nb <= 41; ++nb) {
        const size_t rows = 5, cols = 32 * nb;
        uint8_t *w = malloc(rows * cols / 2), *sc = malloc(rows * nb);
        int8_t *xq = malloc(cols);
        float *xd = malloc(nb * 4), *y0 = malloc(rows * 4), *y1 = malloc(rows * 4);
        int32_t *xs = calloc(nb, 4);
        for (size_t i = 0; i < rows * cols / 2; ++i) w[i] = (uint8_t)rnd();
        for (size_t i = 0; i < rows * nb; ++i) sc[i] = scale_byte();
        for (size_t i = 0; i < cols; ++i) xq[i] = (int8_t)(rnd() % 255 - 127), xs[i / 32] += xq[i];
        for (size_t i = 0; i < nb; ++i) xd[i] = fabsf(activation());
        Q8(scalar)(w, sc, xq, xd, xs, y0, rows, cols, 0, rows);
        Q8(ISA)(w, sc, xq, xd, xs, y1, rows, cols, 0, rows);
        snprintf(what, sizeof what, "fp4xq8 matvec %zux%zu", rows, cols);
        compare(what, y0, y1, rows);
        free(w), free(sc), free(xq), free(xd), free(xs), free(y0), free(y1);
    }
#ifdef BF16DOT
    /* bf16dot: BF16 weights (zeros, -0, subnormals, the largest values) and
     * BF16 activations, every tail of a 32-column chunk, row tiles of 4 with
     * remainders, 1..13 tokens (every token-tile remainder). */
    {
        const size_t shapes[][2] = {{1, 1}, {3, 17}, {5, 31}, {7, 32}, {9, 33}, {37, 100}, {70, 1024}, {2, 4127}};
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; ++si)
            for (size_t n = 1; n <= 13; n += 3) {
                const size_t rows = shapes[si][0], cols = shapes[si][1], xs = (cols + 31) / 32 * 32 + 32;
                uint16_t *w = malloc(rows * cols * 2), *x = calloc(n * xs, 2);
                float *y0 = malloc(n * rows * 4), *y1 = malloc(n * rows * 4);
                for (size_t i = 0; i < rows * cols; ++i) {
                    float v = activation();
                    uint32_t b;
                    memcpy(&b, &v, 4);
                    w[i] = (uint16_t)(b >> 16);
                }
                bf16_activations(x, n, cols, xs);
                for (size_t j = 0; j < n; ++j)
                    for (size_t r = 0; r < rows; ++r) y0[j * rows + r] = bd_row(w + r * cols, x + j * xs, cols);
                bs_bf16dot_avx512_generic(w, NULL, x, xs, y1, rows, cols, n, 0, rows);
                snprintf(what, sizeof what, "bf16dot %zux%zu n=%zu", rows, cols, n);
                compare(what, y0, y1, n * rows);
                free(w), free(x), free(y0), free(y1);
            }
    }
    /* fp8dot: every E4M3 code (NaN codes only in every fourth row, so that
     * long rows still compare finite sums), the scale bytes of scale_byte,
     * tails of a 32-column chunk and of a 64-code load, partial 128-column
     * blocks, rows across 128-row scale blocks, row tiles of 8 and 2, 1..8
     * tokens (the 2 x 6 tile, its remainders and the one-token tile). */
    {
        const size_t shapes[][2] = {{1, 1}, {3, 17}, {9, 33}, {8, 64}, {5, 127}, {12, 191}, {130, 300}, {2, 4127}};
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; ++si)
            for (size_t n = 1; n <= 8; ++n) {
                const size_t rows = shapes[si][0], cols = shapes[si][1], xs = (cols + 31) / 32 * 32 + 32;
                const size_t nb = (cols + 127) / 128;
                uint8_t *w = malloc(rows * cols), *sc = malloc((rows + 127) / 128 * nb);
                uint16_t *x = calloc(n * xs, 2);
                float *y0 = malloc(n * rows * 4), *y1 = malloc(n * rows * 4);
                for (size_t i = 0; i < rows * cols; ++i) {
                    uint8_t b = (uint8_t)rnd();
                    w[i] = (b & 0x7F) == 0x7F && (i / cols) % 4 != 3 ? 0 : b;
                }
                for (size_t i = 0; i < (rows + 127) / 128 * nb; ++i) sc[i] = scale_byte();
                bf16_activations(x, n, cols, xs);
                for (size_t j = 0; j < n; ++j)
                    for (size_t r = 0; r < rows; ++r)
                        y0[j * rows + r] = fd_row(w + r * cols, sc + r / 128 * nb, x + j * xs, cols);
                bs_fp8dot_avx512_generic(w, sc, x, xs, y1, rows, cols, n, 0, rows);
                snprintf(what, sizeof what, "fp8dot %zux%zu n=%zu", rows, cols, n);
                compare(what, y0, y1, n * rows);
                free(w), free(sc), free(x), free(y0), free(y1);
            }
    }
#endif
    printf("%s vs scalar: %d kernel checks, %zu values (%zu finite), %d mismatching\n", STR(ISA), checks, values,
           finite, mismatches);
    /* Sums that all overflowed would compare only NaN and infinity. */
    if (finite * 2 < values) {
        printf("FAIL: under half the values compared are finite\n");
        return 1;
    }
    return mismatches != 0;
}
