/* The benchmark's plain streaming read: the sum of n 64-bit words, split
 * into `streams` equal, contiguous parts read side by side (one 64-byte line
 * of each part per step, 8 independent accumulators per part), so the loads
 * and not the adds are the limit. One stream is the simplest read; several
 * let one core keep more cache-line fetches in flight, as a kernel reading a
 * few rows at once does (on a 2-vCPU EPYC VM: about 13.5 GB/s with one
 * stream, 16-18 GB/s with four). Compiled with the baseline flags;
 * `bespoke bench` compares every kernel's GB/s to the best this reaches on
 * the same buffer size and threads. */
#include <stddef.h>
#include <stdint.h>

#define BS_READ_MAX_STREAMS 8

uint64_t bs_stream_read(const uint64_t *p, size_t n, size_t streams) {
    if (streams < 1) streams = 1;
    if (streams > BS_READ_MAX_STREAMS) streams = BS_READ_MAX_STREAMS;
    const size_t part = n / streams / 8 * 8; /* words per stream, whole lines */
    uint64_t acc[BS_READ_MAX_STREAMS][8] = {{0}};
    for (size_t i = 0; i < part; i += 8)
        for (size_t s = 0; s < streams; ++s)
            for (int j = 0; j < 8; ++j) acc[s][j] += p[s * part + i + j];
    uint64_t sum = 0;
    for (size_t i = streams * part; i < n; ++i) sum += p[i]; /* the tail */
    for (size_t s = 0; s < streams; ++s)
        for (int j = 0; j < 8; ++j) sum += acc[s][j];
    return sum;
}

/* The benchmark's read of data held in cache: the sum of n 64-bit words with
 * the widest loads the CPU has, 8 independent vector accumulators, one load
 * and one add a vector. `bespoke bench kernels` times it on a buffer the size
 * of a cache-resident case's weights (same threads), kept hot by reading it
 * over and over, so that such a case's GB/s is set against what the caches
 * deliver rather than against memory. The plain read above, compiled for the
 * baseline, adds 8 or 16 bytes a load: enough for memory, not for L1 or L2.
 * kind: 1 AVX2, 2 AVX-512, 4 NEON, as bs_compute_peak numbers its probes;
 * the caller checked that the CPU has the instructions. Returns the words'
 * sum (wrapping), or 0 for a kind this build lacks. */
#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2"))) static uint64_t vread_avx2(const uint64_t *p, size_t n)
{
    __m256i a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 8; ++j)
            a[j] = _mm256_add_epi64(a[j], _mm256_loadu_si256((const __m256i *)(p + i + 4 * j)));
    uint64_t l[4], sum = 0;
    for (int j = 0; j < 8; ++j) {
        _mm256_storeu_si256((__m256i *)l, a[j]);
        sum += l[0] + l[1] + l[2] + l[3];
    }
    for (; i < n; ++i) sum += p[i];
    return sum;
}

__attribute__((target("avx512f"))) static uint64_t vread_avx512(const uint64_t *p, size_t n)
{
    __m512i a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int j = 0; j < 8; ++j) a[j] = _mm512_add_epi64(a[j], _mm512_loadu_si512(p + i + 8 * j));
    uint64_t sum = 0;
    for (int j = 0; j < 8; ++j) sum += (uint64_t)_mm512_reduce_add_epi64(a[j]);
    for (; i < n; ++i) sum += p[i];
    return sum;
}
#endif

#if defined(__aarch64__)
#include <arm_neon.h>

static uint64_t vread_neon(const uint64_t *p, size_t n)
{
    uint64x2_t a[8];
    for (int j = 0; j < 8; ++j) a[j] = vdupq_n_u64(0);
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 8; ++j) a[j] = vaddq_u64(a[j], vld1q_u64(p + i + 2 * j));
    uint64_t sum = 0;
    for (int j = 0; j < 8; ++j) sum += vaddvq_u64(a[j]);
    for (; i < n; ++i) sum += p[i];
    return sum;
}
#endif

uint64_t bs_vector_read(const uint64_t *p, size_t n, unsigned kind)
{
    switch (kind) {
#if defined(__x86_64__)
    case 1:
        return vread_avx2(p, n);
    case 2:
        return vread_avx512(p, n);
#endif
#if defined(__aarch64__)
    case 4:
        return vread_neon(p, n);
#endif
    default:
        (void)p;
        (void)n;
        return 0;
    }
}
