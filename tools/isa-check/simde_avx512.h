/* AVX-512 intrinsics from SIMDe (libsimde-dev), for running the AVX-512
 * kernels on a CPU without AVX-512 (tools/isa-check.sh). */
#ifndef BS_SIMDE_AVX512_H
#define BS_SIMDE_AVX512_H
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

/* SIMDe 0.7 has no 512-bit vcvtph2ps: two 256-bit halves. */
#ifndef _mm512_cvtph_ps
static inline simde__m512 bs_emu_mm512_cvtph_ps(simde__m256i h) {
    simde__m256 lo = simde_mm256_cvtph_ps(simde_mm256_castsi256_si128(h));
    simde__m256 hi = simde_mm256_cvtph_ps(simde_mm256_extracti128_si256(h, 1));
    return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(lo), hi, 1);
}
#define _mm512_cvtph_ps(h) bs_emu_mm512_cvtph_ps(h)
#endif

/* Conversions SIMDe 0.7 lacks at 512 bits, from two 256-bit halves. */
static inline simde__m512i bs_emu_join(simde__m256i lo, simde__m256i hi) {
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(lo), hi, 1);
}
static inline simde__m512i bs_emu_cvtepu16_epi32(simde__m256i a) {
    return bs_emu_join(simde_mm256_cvtepu16_epi32(simde_mm256_castsi256_si128(a)),
                       simde_mm256_cvtepu16_epi32(simde_mm256_extracti128_si256(a, 1)));
}
static inline simde__m512i bs_emu_cvtepu8_epi32(simde__m128i a) {
    return bs_emu_join(simde_mm256_cvtepu8_epi32(a), simde_mm256_cvtepu8_epi32(simde_mm_srli_si128(a, 8)));
}
static inline simde__m512i bs_emu_cvtps_epi32(simde__m512 a) {
    return bs_emu_join(simde_mm256_cvtps_epi32(simde_mm512_castps512_ps256(a)),
                       simde_mm256_cvtps_epi32(simde_mm256_castpd_ps(simde_mm512_extractf64x4_pd(simde_mm512_castps_pd(a), 1))));
}
static inline simde__m512 bs_emu_cvtepi32_ps(simde__m512i a) {
    const simde__m256 lo = simde_mm256_cvtepi32_ps(simde_mm512_castsi512_si256(a));
    const simde__m256 hi = simde_mm256_cvtepi32_ps(simde_mm512_extracti64x4_epi64(a, 1));
    return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(lo), hi, 1);
}
#define _mm512_cvtepu16_epi32(a) bs_emu_cvtepu16_epi32(a)
#define _mm512_cvtepi32_ps(a) bs_emu_cvtepi32_ps(a)
#define _mm512_cvtepu8_epi32(a) bs_emu_cvtepu8_epi32(a)
#define _mm512_cvtps_epi32(a) bs_emu_cvtps_epi32(a)

/* More that SIMDe 0.7 lacks (the fp4xq8 VNNI step's lane sums, the bf16dot
 * and fp8dot kernels' partial last chunk), element by element. */
#include <string.h>
static inline simde__m512i bs_emu_shuffle_epi32(simde__m512i a, int imm) {
    int32_t v[16], r[16];
    memcpy(v, &a, 64);
    for (int i = 0; i < 16; ++i) r[i] = v[(i & ~3) + ((imm >> (2 * (i & 3))) & 3)];
    memcpy(&a, r, 64);
    return a;
}
/* Reads only the selected elements (the others may lie past a buffer). */
static inline simde__m512i bs_emu_maskz_loadu_epi16(simde__mmask32 k, const void *p) {
    int16_t v[32] = {0};
    for (int i = 0; i < 32; ++i)
        if ((k >> i) & 1) memcpy(&v[i], (const char *)p + 2 * i, 2);
    simde__m512i r;
    memcpy(&r, v, 64);
    return r;
}
#define _mm512_shuffle_epi32(a, imm) bs_emu_shuffle_epi32((a), (int)(imm))
/* SIMDe 0.7 has the 128-bit-lane float shuffle (bs_reduce16x4) but no
 * native-name alias for it. */
#ifndef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, imm) simde_mm512_shuffle_f32x4((a), (b), (imm))
#endif
#define _mm512_maskz_loadu_epi16(k, p) bs_emu_maskz_loadu_epi16((k), (p))
/* The selected bytes of n at p, the others zero (fp8dot's partial last 64
 * codes, FP4's last 16 scale bytes of a row). */
static inline void bs_emu_masked_bytes(uint64_t k, const void *p, uint8_t *v, int n) {
    for (int i = 0; i < n; ++i) v[i] = ((k >> i) & 1) ? ((const uint8_t *)p)[i] : 0;
}
static inline simde__m512i bs_emu_maskz_loadu_epi8(simde__mmask64 k, const void *p) {
    uint8_t v[64];
    bs_emu_masked_bytes(k, p, v, 64);
    simde__m512i r;
    memcpy(&r, v, 64);
    return r;
}
#define _mm512_maskz_loadu_epi8(k, p) bs_emu_maskz_loadu_epi8((k), (p))
static inline simde__m128i bs_emu_maskz_loadu_epi8_128(simde__mmask16 k, const void *p) {
    uint8_t v[16];
    bs_emu_masked_bytes(k, p, v, 16);
    simde__m128i r;
    memcpy(&r, v, 16);
    return r;
}
#define _mm_maskz_loadu_epi8(k, p) bs_emu_maskz_loadu_epi8_128((k), (p))
#endif
