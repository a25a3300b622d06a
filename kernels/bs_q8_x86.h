/* fp4×q8 primitives for x86 (templates/q8.c.tera); the AVX2 and AVX-512
 * variants both include this, AVX-512 after defining BS_Q8_XGROUP for its
 * VNNI block step. Eight block accumulators in one __m256. */
#ifndef BS_Q8_X86_H
#define BS_Q8_X86_H

typedef __m256 bs_q8acc;
static inline bs_q8acc bs_q8_zero(void) { return _mm256_setzero_ps(); }

/* 2*E2M1 + 12 (0..24): unsigned, so maddubs takes the codes as they are and
 * x as the signed operand; the offset is taken back once per block as
 * 12 * sum(xq), from the per-block sums the caller passes. */
static const int8_t BS_E2M1_X2_OFF12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* One block: sixteen int16 sums of two products, (2w + 12) * x. The 16
 * packed bytes go to both halves; the low half keeps the low nibbles (even
 * columns), the high half the high ones (odd columns), as xq is laid out.
 * |pair| <= 2 * 24 * 128: no saturation. */
static inline __m256i bs_q8_block(const uint8_t *w, const int8_t *x, __m256i lut) {
    const __m256i y = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w));
    const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(y, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
    return _mm256_maddubs_epi16(_mm256_shuffle_epi8(lut, c), _mm256_loadu_si256((const __m256i *)x));
}
/* Lane-pair sums of two vectors' int16s, interleaved (transposing add). */
static inline __m256i bs_q8_pair16(__m256i a, __m256i b) {
    return _mm256_add_epi16(_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b));
}
static inline __m256i bs_q8_pair32(__m256i a, __m256i b) {
    return _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
/* [k0..k3 k0..k3 | k0..k3 k0..k3] int16 -> the eight int32 [k0..k3 k0..k3]
 * summed over the two halves. */
static inline __m256i bs_q8_widen(__m256i r) {
    return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(r)),
                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(r, 1)));
}

/* The eight blocks' int32 totals t (offset already taken back) into the
 * accumulators: acc = fma((float)t, (e8m0(ws) * 0.5) * xd, acc). */
static inline void bs_q8_apply8(bs_q8acc *acc, __m256i t, const uint8_t *ws, const float *xd) {
    /* scales: UE8M0 bits (0 -> 2^-127, 0xFF -> NaN), halved, times d */
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)ws));
    __m256i bits = _mm256_slli_epi32(e, 23);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32((int)BS_NAN_BITS), _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
    const __m256 s = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f)), _mm256_loadu_ps(xd));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), s, *acc);
}

/* xs: the blocks' sums of xq. A transposing add tree brings the eight
 * blocks' int16 pair sums to per-block totals (each int16 partial holds at
 * most 8 pairs: |sum| <= 24576, no overflow), widened to int32 at the end. */
static inline void bs_q8_step8(bs_q8acc *acc, const uint8_t *w, const uint8_t *ws, const int8_t *xq, const float *xd,
                               const int32_t *xs) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)BS_E2M1_X2_OFF12));
    __m256i p[8];
    for (int k = 0; k < 8; ++k) p[k] = bs_q8_block(w + 16 * k, xq + 32 * k, lut);
    const __m256i e0 = bs_q8_widen(bs_q8_pair32(bs_q8_pair16(p[0], p[1]), bs_q8_pair16(p[2], p[3])));
    const __m256i e1 = bs_q8_widen(bs_q8_pair32(bs_q8_pair16(p[4], p[5]), bs_q8_pair16(p[6], p[7])));
    __m256i t = _mm256_add_epi32(_mm256_permute2x128_si256(e0, e1, 0x20), _mm256_permute2x128_si256(e0, e1, 0x31));
    t = _mm256_sub_epi32(t, _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)xs), _mm256_set1_epi32(12)));
    bs_q8_apply8(acc, t, ws, xd);
}

#ifdef BS_Q8_XGROUP
/* AVX-512 VNNI (the ISA header defines BS_Q8_XGROUP): the kernel regroups xq
 * once per call so that each 4 blocks' 128 bytes are their 4 even halves,
 * then their 4 odd halves, and one 64-byte load of packed weights (4 blocks)
 * meets x directly: the low nibbles (2w + 12 by vpermb) against the even
 * halves, the high ones against the odd, four products a dword by vpdpbusd
 * (exact int32), so 128-bit lane k holds block k's four partial sums.
 * vpermb reads the low 6 bits of each index byte and lut holds the 16
 * entries four times over, so a byte's high nibble (or, shifted, the next
 * byte's bits) changes nothing: no mask needed. */
static inline __m512i bs_q8_dot4g(const uint8_t *w, const int8_t *xg, __m512i lut) {
    const __m512i v = _mm512_loadu_si512(w);
    const __m512i lo = _mm512_permutexvar_epi8(v, lut);
    const __m512i hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), lut);
    const __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xg));
    return _mm512_dpbusd_epi32(a, hi, _mm512_loadu_si512(xg + 64));
}
static inline __m512i bs_q8_lut512(void) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)BS_E2M1_X2_OFF12));
}
/* xo: 12 * the blocks' sums of xq, formed once per call (q8.c.tera). */
static inline void bs_q8_step8g(bs_q8acc *acc, const uint8_t *w, const uint8_t *ws, const int8_t *xq, const float *xd,
                                const int32_t *xo) {
    const __m512i lut = bs_q8_lut512();
    const __m512i t0 = bs_q8_dot4g(w, xq, lut), t1 = bs_q8_dot4g(w + 64, xq + 128, lut);
    /* per 128-bit lane k, blocks k (t0) and 4 + k (t1): pair sums, then the
     * two halves, leaving [T_k, T_4+k, T_k, T_4+k] */
    __m512i p = _mm512_add_epi32(_mm512_unpacklo_epi32(t0, t1), _mm512_unpackhi_epi32(t0, t1));
    p = _mm512_add_epi32(p, _mm512_shuffle_epi32(p, _MM_PERM_BADC));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256i t = _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, p));
    t = _mm256_sub_epi32(t, _mm256_loadu_si256((const __m256i *)xo));
    bs_q8_apply8(acc, t, ws, xd);
}
/* Sixteen blocks at once: the same T_b and the same two 8-block fmas as two
 * bs_q8_step8g, with one transposing tree for the sixteen totals and the
 * scales decoded 16 at a time (fewer instructions a block: the step is bound
 * by the core, not the read, on a Zen 4). */
static inline void bs_q8_step16g(bs_q8acc *acc, const uint8_t *w, const uint8_t *ws, const int8_t *xq, const float *xd,
                                 const int32_t *xo) {
    const __m512i lut = bs_q8_lut512();
    const __m512i t0 = bs_q8_dot4g(w, xq, lut), t1 = bs_q8_dot4g(w + 64, xq + 128, lut);
    const __m512i t2 = bs_q8_dot4g(w + 128, xq + 256, lut), t3 = bs_q8_dot4g(w + 192, xq + 384, lut);
    /* lane k: [t0 k0+k2, t1 k0+k2, t0 k1+k3, t1 k1+k3], the same for t2, t3,
     * then the halves: [T_k, T_4+k, T_8+k, T_12+k]; one permute to block order */
    const __m512i u01 = _mm512_add_epi32(_mm512_unpacklo_epi32(t0, t1), _mm512_unpackhi_epi32(t0, t1));
    const __m512i u23 = _mm512_add_epi32(_mm512_unpacklo_epi32(t2, t3), _mm512_unpackhi_epi32(t2, t3));
    const __m512i v = _mm512_add_epi32(_mm512_unpacklo_epi64(u01, u23), _mm512_unpackhi_epi64(u01, u23));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i t = _mm512_sub_epi32(_mm512_permutexvar_epi32(order, v), _mm512_loadu_si512(xo));
    /* scales as bs_q8_apply8 forms them: UE8M0 bits, halved, times d */
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)ws));
    __m512i bits = _mm512_slli_epi32(e, 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_epi32((int)BS_NAN_BITS));
    const __m512 s = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0.5f)), _mm512_loadu_ps(xd));
    const __m512 tf = _mm512_cvtepi32_ps(t);
    *acc = _mm256_fmadd_ps(_mm512_castps512_ps256(tf), _mm512_castps512_ps256(s), *acc);
    *acc = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(tf), 1)),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)), *acc);
}
#endif

/* ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) */
static inline float bs_q8_reduce(bs_q8acc a) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif
