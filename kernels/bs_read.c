/* The benchmark's plain streaming read: the sum of n 64-bit words, 256 bytes
 * per step into independent accumulators, so the loads and not the adds are
 * the limit. Compiled with the baseline flags; `bespoke bench` compares every
 * kernel's GB/s to what this reaches on the same buffer size and threads. */
#include <stddef.h>
#include <stdint.h>

uint64_t bs_stream_read(const uint64_t *p, size_t n) {
    uint64_t acc[32] = {0};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 32; ++j) acc[j] += p[i + j];
    for (; i < n; ++i) acc[0] += p[i];
    uint64_t s = 0;
    for (int j = 0; j < 32; ++j) s += acc[j];
    return s;
}
