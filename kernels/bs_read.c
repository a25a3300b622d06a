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
