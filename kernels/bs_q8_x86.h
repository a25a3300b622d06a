/* fp4×q8 primitives for x86 (templates/q8.c.tera), AVX2 instructions; the
 * AVX2 and AVX-512 variants both include this. Eight block accumulators in
 * one __m256. */
#ifndef BS_Q8_X86_H
#define BS_Q8_X86_H

typedef __m256 bs_q8acc;
static inline bs_q8acc bs_q8_zero(void) { return _mm256_setzero_ps(); }

/* One block: eight int32 partial dot products (their sum is exact). The 16
 * packed bytes go to both halves; the low half keeps the low nibbles (even
 * columns), the high half the high ones (odd columns), as xq is laid out.
 * pshufb maps codes to 2*E2M1 in int8; maddubs needs an unsigned operand, so
 * it gets |w| and x with w's sign (|pair sum| <= 2 * 12 * 127: no saturation). */
static inline __m256i bs_q8_block(const uint8_t *w, const int8_t *x) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)BS_E2M1_X2));
    const __m256i y = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w));
    const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(y, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
    const __m256i wv = _mm256_shuffle_epi8(lut, c);
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static inline void bs_q8_step8(bs_q8acc *acc, const uint8_t *w, const uint8_t *ws, const int8_t *xq, const float *xd) {
    __m256i v[8];
    for (int k = 0; k < 8; ++k) v[k] = bs_q8_block(w + 16 * k, xq + 32 * k);
    /* hadd tree: q0 = [T0..T3 of lanes 0-3 | T0..T3 of lanes 4-7], q1 the same for T4..T7 */
    const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    const __m256i t = _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
    /* scales: UE8M0 bits (0 -> 2^-127, 0xFF -> NaN), halved, times d */
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)ws));
    __m256i bits = _mm256_slli_epi32(e, 23);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32((int)BS_NAN_BITS), _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
    const __m256 s = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f)), _mm256_loadu_ps(xd));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), s, *acc);
}

/* ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) */
static inline float bs_q8_reduce(bs_q8acc a) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif
