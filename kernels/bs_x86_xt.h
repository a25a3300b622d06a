/* x into the FP4 kernels' step order (templates/matmul.c.tera, fp4_xt),
 * for both x86 variants: AVX2 instructions only, so the avx512 variant,
 * compiled with -mavx2 too, takes the same code. */
#ifndef BS_X86_XT_H
#define BS_X86_XT_H

/* x of one whole FP4 chunk into its step order, times m: t[16k + l] =
 * x[8l + k] * m, as two 8 x 8 transposes (the kernels' fp4_xt; the plain
 * loop it replaces took about 3500 cycles per 4096 columns on a Zen 3, this
 * about 1000, once per call and so per 128 rows a thread takes at a time;
 * the avx512 variant had only the plain loop until it took this too). */
#define BS_FP4_XT_CHUNK
static inline void bs_fp4_xt_chunk(const float *x, float *t, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    for (int h = 0; h < 2; ++h) {
        __m256 r[8], u[8], v[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(_mm256_loadu_ps(x + 64 * h + 8 * i), mv);
        /* u: pairs of rows interleaved; v: columns k and k + 4 of 4 rows. */
        for (int i = 0; i < 8; i += 2) {
            u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
            u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
            v[i] = _mm256_shuffle_ps(u[i], u[i + 2], 0x44);
            v[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], 0xEE);
            v[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0x44);
            v[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0xEE);
        }
        for (int k = 0; k < 4; ++k) {
            _mm256_storeu_ps(t + 16 * k + 8 * h, _mm256_permute2f128_ps(v[k], v[4 + k], 0x20));
            _mm256_storeu_ps(t + 16 * (k + 4) + 8 * h, _mm256_permute2f128_ps(v[k], v[4 + k], 0x31));
        }
    }
}

#endif
