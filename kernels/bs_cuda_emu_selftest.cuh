/* Kernels that check the CPU emulator itself (kernels/bs_cuda_emu.*): its
 * barriers and shuffles do what CUDA's do, and the waits that can never
 * complete fail the launch. Compiled into the emulator's build only;
 * src/gpu.rs (emulator_selftest) launches them with 128 threads a block. */

/* out[(b * 4 + i) * blockDim.x + t] for block b, thread t:
 * i = 0: the thread mirrored across the block (t' = blockDim.x - 1 - t),
 *        read from shared memory after a __syncthreads;
 * i = 1: lane ^ 5 by __shfl_xor_sync;
 * i = 2: lane + 3 by __shfl_down_sync (its own lane past 31);
 * i = 3: the block index. */
extern "C" __global__ void __launch_bounds__(128) bs_emu_selftest_exchange(float *out)
{
    __shared__ float sh[128];
    const int t = threadIdx.x, lane = t & 31, n = blockDim.x;
    float *o = out + (size_t)blockIdx.x * 4 * n;
    sh[t] = (float)t;
    __syncthreads();
    o[t] = sh[n - 1 - t];
    o[n + t] = __shfl_xor_sync(0xFFFFFFFFu, (float)lane, 5);
    o[2 * n + t] = __shfl_down_sync(0xFFFFFFFFu, (float)lane, 3u);
    o[3 * n + t] = (float)blockIdx.x;
}

/* Half of warp 2 at a shuffle, everyone else at __syncthreads: on a GPU a
 * hang (or undefined behaviour); the emulator must fail the launch. */
extern "C" __global__ void __launch_bounds__(128) bs_emu_selftest_deadlock(float *out)
{
    const int t = threadIdx.x;
    if (t < 64 || t >= 96 || (t & 1)) {
        __syncthreads();
        out[t] = 1.0f;
    } else {
        out[t] = __shfl_xor_sync(0xFFFFFFFFu, 1.0f, 2);
    }
}

/* Lanes 16..31 of each warp return before a full-mask shuffle: undefined on
 * a GPU; the emulator must fail the launch. */
extern "C" __global__ void __launch_bounds__(128) bs_emu_selftest_early_exit(float *out)
{
    const int t = threadIdx.x;
    if ((t & 31) >= 16) return;
    out[t] = __shfl_xor_sync(0xFFFFFFFFu, 1.0f, 1);
}
