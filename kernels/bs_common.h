/* ISA-agnostic helpers written once on top of the primitives of the
 * included bs_isa_*.h. Each has a scalar twin that performs the same IEEE
 * operations in the same order, so tails computed one lane at a time agree
 * bit for bit with full vectors. */
#ifndef BS_COMMON_H
#define BS_COMMON_H

#ifndef BS_ISA_H
#error "include an ISA header (bs_isa_*.h) first"
#endif

#define BS_ALWAYS_INLINE static inline __attribute__((always_inline))

/* Unroll the loop that follows n times, no more (GCC's pragma, which clang
 * also takes). */
#define BS_PRAGMA(x) _Pragma(#x)
#define BS_UNROLL(n) BS_PRAGMA(GCC unroll n)

/* How far past a tile row's current position (pos bytes into a row of
 * row_bytes) to prefetch, for tiles whose row i is `span` rows on from the
 * previous tile's row i (MR, or MR times the row step for tiles of rows a
 * step apart, taken in groups): ahead bytes on in the same row; past the
 * row's end, that far into row i + span; rows no longer than ahead take
 * row i + span at the same column. */
BS_ALWAYS_INLINE size_t bs_pf_dist(size_t row_bytes, size_t pos, size_t ahead, size_t span)
{
    const size_t d = row_bytes < ahead ? row_bytes : ahead;
    return pos + d < row_bytes ? d : d + (span - 1) * row_bytes;
}

/* The row step of a matvec tile whose rows are shorter than a page of
 * `page` bytes (IsaDesc::matvec_page_bytes): the number of rows a page
 * holds, where that is a whole number above 1; else 1 (rows in order). */
BS_ALWAYS_INLINE size_t bs_page_step(size_t row_bytes, size_t page)
{
    return row_bytes > 0 && row_bytes < page && page % row_bytes == 0 ? page / row_bytes : 1;
}

/* exp(x) for the softmax (x <= 0, or NaN): Cody-Waite reduction by ln 2 and
 * a degree-6 polynomial (the Cephes expf coefficients); about 1 ulp.
 * x < -87 gives exactly 0. */
#define BS_EXP_LOG2E 1.44269504088896341f
#define BS_EXP_C1 0.693359375f
#define BS_EXP_C2 -2.12194440e-4f
#define BS_EXP_P0 1.9875691500e-4f
#define BS_EXP_P1 1.3981999507e-3f
#define BS_EXP_P2 8.3334519073e-3f
#define BS_EXP_P3 4.1665795894e-2f
#define BS_EXP_P4 1.6666665459e-1f
#define BS_EXP_P5 5.0000001201e-1f

BS_ALWAYS_INLINE bs_vf bs_exp(bs_vf x) {
    bs_vf n = bs_round(bs_mul(x, bs_set1(BS_EXP_LOG2E)));
    n = bs_select_lt(n, bs_set1(-126.0f), bs_set1(-126.0f), n);
    n = bs_select_lt(bs_set1(127.0f), n, bs_set1(127.0f), n);
    bs_vf r = bs_fma(n, bs_set1(-BS_EXP_C1), x);
    r = bs_fma(n, bs_set1(-BS_EXP_C2), r);
    bs_vf p = bs_set1(BS_EXP_P0);
    p = bs_fma(p, r, bs_set1(BS_EXP_P1));
    p = bs_fma(p, r, bs_set1(BS_EXP_P2));
    p = bs_fma(p, r, bs_set1(BS_EXP_P3));
    p = bs_fma(p, r, bs_set1(BS_EXP_P4));
    p = bs_fma(p, r, bs_set1(BS_EXP_P5));
    p = bs_fma(p, bs_mul(r, r), r);
    p = bs_add(p, bs_set1(1.0f));
    return bs_select_lt(x, bs_set1(-87.0f), bs_set1(0.0f), bs_mul(p, bs_pow2i(n)));
}

BS_ALWAYS_INLINE float bs_exp1(float x) {
    float n = rintf(x * BS_EXP_LOG2E);
    n = n < -126.0f ? -126.0f : n;
    n = 127.0f < n ? 127.0f : n;
    float r = fmaf(n, -BS_EXP_C1, x);
    r = fmaf(n, -BS_EXP_C2, r);
    float p = BS_EXP_P0;
    p = fmaf(p, r, BS_EXP_P1);
    p = fmaf(p, r, BS_EXP_P2);
    p = fmaf(p, r, BS_EXP_P3);
    p = fmaf(p, r, BS_EXP_P4);
    p = fmaf(p, r, BS_EXP_P5);
    p = fmaf(p, r * r, r);
    p = p + 1.0f;
    /* NaN n: any exponent will do, p is NaN (and the cast would be undefined). */
    int32_t k = (n == n) ? (int32_t)n : 0;
    float two_n = bs_bits_f32((uint32_t)(k + 127) << 23);
    return x < -87.0f ? 0.0f : p * two_n;
}

/* Four accumulators' sums (bs_reduce16 each) to y[0..3]. ISAs that can do
 * the four trees side by side define BS_HAVE_REDUCE16X4 and their own. */
#ifndef BS_HAVE_REDUCE16X4
BS_ALWAYS_INLINE void bs_reduce16x4(float *y, const bs_vf a[BS_G], const bs_vf b[BS_G], const bs_vf c[BS_G],
                                    const bs_vf d[BS_G]) {
    y[0] = bs_reduce16(a);
    y[1] = bs_reduce16(b);
    y[2] = bs_reduce16(c);
    y[3] = bs_reduce16(d);
}
#endif

/* bs_reduce16x4 for rows `step` apart: the four sums to y[0], y[step],
 * y[2 step], y[3 step] (tiles of a matvec's row or page step). */
BS_ALWAYS_INLINE void bs_reduce16x4_step(float *y, size_t step, const bs_vf a[BS_G], const bs_vf b[BS_G],
                                         const bs_vf c[BS_G], const bs_vf d[BS_G]) {
    if (step == 1) {
        bs_reduce16x4(y, a, b, c, d);
        return;
    }
    float s4[4];
    bs_reduce16x4(s4, a, b, c, d);
    for (int k = 0; k < 4; ++k) y[(size_t)k * step] = s4[k];
}

/* Lane numbers 0..15, for masking a partial lane group. */
static const float BS_LANE_INDEX[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* The fixed reduction tree over an accumulator held in a permuted lane
 * order: physical slot p holds logical lane lanes[p]; the lanes are put back
 * in logical order first, so the sum is the one bs_reduce16 defines. */
BS_ALWAYS_INLINE float bs_reduce16_from(const bs_vf a[BS_G], const float lanes[16]) {
    float t[16], u[16];
    bs_vf b[BS_G];
    bs_store16(t, a);
    for (int p = 0; p < 16; ++p) u[(int)lanes[p]] = t[p];
    bs_load16(b, u);
    return bs_reduce16(b);
}

/* Dot product of two f32 rows in the lane order: lane l takes columns
 * c = l (mod 16) in order with FMA, then the fixed tree. */
BS_ALWAYS_INLINE float bs_dot16(const float *a, const float *b, size_t n) {
    bs_vf acc[BS_G], va[BS_G], vb[BS_G];
    for (int g = 0; g < BS_G; ++g) acc[g] = bs_zero();
    size_t c = 0;
    for (; c + 16 <= n; c += 16) {
        bs_dec16_f32(a + c, va);
        bs_dec16_f32(b + c, vb);
        for (int g = 0; g < BS_G; ++g) acc[g] = bs_fma(va[g], vb[g], acc[g]);
    }
    if (c < n) {
        float t[16];
        bs_store16(t, acc);
        for (size_t l = 0; c + l < n; ++l) t[l] = fmaf(a[c + l], b[c + l], t[l]);
        bs_load16(acc, t);
    }
    return bs_reduce16(acc);
}
#endif
