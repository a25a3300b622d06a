/* bespoke's CPU emulator of its CUDA-core kernels: the runtime (fibers, the
 * per-block scheduler, launches by kernel name). The device side is
 * kernels/bs_cuda_emu.h; build.rs compiles the rendered templates/cuda.cu.tera
 * against it into a table of kernels (bs_emu_find), and src/gpu.rs calls
 * bs_emu_launch with the arguments it would give the driver.
 *
 * A launch runs its blocks one after another. A block's threads are fibers
 * on stacks of their own, run one at a time: each runs until it waits
 * (__syncthreads, a warp shuffle, __syncwarp) or returns; then the waits
 * that are complete are released. A wait that can never complete (a
 * shuffle whose warp has lanes that returned, threads waiting at different
 * kinds of barrier) fails the launch with a message instead of hanging. */
#include <mutex>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "bs_cuda_emu.h"

#if !(defined(__x86_64__) && defined(__linux__))
#include <ucontext.h>
#endif

/* Under AddressSanitizer (BESPOKE_SANITIZE): a fiber stack is heap memory
 * that instrumented frames poison and unpoison as they come and go; a fiber
 * abandoned mid-kernel (a failed launch) leaves its poison behind, so each
 * stack is cleared before it is used again. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define BS_EMU_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define BS_EMU_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

bs_emu_thread *bs_emu_cur;
bs_dim3 bs_emu_block, bs_emu_bdim, bs_emu_gdim;

/* The rendered kernels' table (the generated emu.cpp). */
extern "C" bs_emu_thunk bs_emu_find(const char *name);

namespace {

enum State { RUN, AT_WARP, AT_BLOCK, DONE };

/* 64 KiB per thread: the kernels keep small arrays (at most a few hundred
 * bytes) in locals. */
const size_t STACK = 64 << 10;

/* The most 32-bit words a lane gives bs_emu_warp_gather. */
const int GATHER_WORDS = 16;

struct Fiber {
    bs_emu_thread t; /* first: bs_emu_cur points here */
    State state;
    unsigned lane, warp, shfl_n, gather_n;
#if defined(__x86_64__) && defined(__linux__)
    void *sp;
#else
    ucontext_t ctx;
#endif
    char *stack;
};

/* An array bs_emu_cvta_shared gave a slot of the shared window. */
struct Smem {
    const unsigned char *p;
    size_t bytes;
};
const uint32_t SMEM_SLOT = 16 << 10, SMEM_SLOTS = 16;
const uint32_t TMEM_LANES = 128, TMEM_COLS = 512;

struct Emu {
    std::vector<Fiber> fibers;
    std::vector<Smem> smem;
    /* Tensor memory [lane][column], the columns allocated and the block
     * (its number in the launch, from 1) that allocated them. */
    std::vector<uint32_t> tmem;
    uint32_t tmem_cols = 0;
    unsigned long block_n = 0, tmem_block = 0;
    /* Set by bs_emu_trap: the launch fails with this. */
    bool trapped = false;
    char trap[160];
    std::vector<uint32_t> slots;  /* [warp][parity][lane] */
    std::vector<uint32_t> gather; /* [warp][parity][lane][GATHER_WORDS] */
    Fiber *cur = nullptr;
    bs_emu_thunk thunk = nullptr;
    void **args = nullptr;
#if defined(__x86_64__) && defined(__linux__)
    void *sched_sp = nullptr;
#else
    ucontext_t sched;
#endif
};

Emu emu;
std::mutex emu_lock;

} // namespace

#if defined(__x86_64__) && defined(__linux__)
/* bs_emu_swap(save, load): push the callee-saved registers, MXCSR and the
 * x87 control word on this stack, store the stack pointer at *save, switch to
 * the stack `load` and pop the same from it. A new fiber's stack is laid out
 * as if it had called bs_emu_swap, with bs_emu_entry as the return address.
 * (The System V ABI: rbx, rbp, r12-r15 and the two control words are the
 * state a caller may rely on across a call; everything else is clobbered by
 * the call itself.) */
extern "C" void bs_emu_swap(void **save, void *load);
extern "C" void bs_emu_entry();
__asm__(".text\n"
        ".p2align 4\n"
        ".globl bs_emu_swap\n"
        ".hidden bs_emu_swap\n"
        ".type bs_emu_swap,@function\n"
        "bs_emu_swap:\n"
        "  pushq %rbp\n"
        "  pushq %rbx\n"
        "  pushq %r12\n"
        "  pushq %r13\n"
        "  pushq %r14\n"
        "  pushq %r15\n"
        "  subq $8, %rsp\n"
        "  stmxcsr (%rsp)\n"
        "  fnstcw 4(%rsp)\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  ldmxcsr (%rsp)\n"
        "  fldcw 4(%rsp)\n"
        "  addq $8, %rsp\n"
        "  popq %r15\n"
        "  popq %r14\n"
        "  popq %r13\n"
        "  popq %r12\n"
        "  popq %rbx\n"
        "  popq %rbp\n"
        "  ret\n"
        ".size bs_emu_swap, .-bs_emu_swap\n"
        /* A new fiber starts here with rsp 16-byte aligned, as before a call. */
        ".p2align 4\n"
        ".globl bs_emu_entry\n"
        ".hidden bs_emu_entry\n"
        ".type bs_emu_entry,@function\n"
        "bs_emu_entry:\n"
        "  call bs_emu_fiber_main\n"
        "  ud2\n"
        ".size bs_emu_entry, .-bs_emu_entry\n");
#endif

/* A fiber's life: run the kernel for its thread, then hand back for good. */
extern "C" __attribute__((used, visibility("hidden"))) void bs_emu_fiber_main()
{
    emu.thunk(emu.args);
    emu.cur->state = DONE;
#if defined(__x86_64__) && defined(__linux__)
    bs_emu_swap(&emu.cur->sp, emu.sched_sp);
#else
    swapcontext(&emu.cur->ctx, &emu.sched);
#endif
    abort(); /* a finished fiber is never resumed */
}

namespace {

void to_sched(Fiber *f)
{
#if defined(__x86_64__) && defined(__linux__)
    bs_emu_swap(&f->sp, emu.sched_sp);
#else
    swapcontext(&f->ctx, &emu.sched);
#endif
}

void to_fiber(Fiber *f)
{
    emu.cur = f;
    bs_emu_cur = &f->t;
#if defined(__x86_64__) && defined(__linux__)
    bs_emu_swap(&emu.sched_sp, f->sp);
#else
    swapcontext(&emu.sched, &f->ctx);
#endif
}

void park(State s)
{
    Fiber *f = emu.cur;
    f->state = s;
    to_sched(f);
}

void prime(Fiber *f)
{
    BS_EMU_UNPOISON(f->stack, STACK);
#if defined(__x86_64__) && defined(__linux__)
    /* The stack as bs_emu_swap leaves it: control words, r15 ... rbp, then
     * the return address (bs_emu_entry) in the top 8 bytes of an aligned top. */
    uintptr_t top = ((uintptr_t)(f->stack + STACK)) & ~(uintptr_t)15;
    uint64_t *sp = (uint64_t *)top - 8;
    uint32_t csr;
    uint16_t cw;
    __asm__ volatile("stmxcsr %0" : "=m"(csr));
    __asm__ volatile("fnstcw %0" : "=m"(cw));
    sp[0] = (uint64_t)csr | ((uint64_t)cw << 32);
    for (int i = 1; i < 7; ++i) sp[i] = 0; /* r15, r14, r13, r12, rbx, rbp */
    sp[7] = (uint64_t)(uintptr_t)&bs_emu_entry;
    f->sp = sp;
#else
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = f->stack;
    f->ctx.uc_stack.ss_size = STACK;
    f->ctx.uc_link = nullptr;
    makecontext(&f->ctx, (void (*)())bs_emu_fiber_main, 0);
#endif
}

void say(char *err, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

/* Run one block; 0, or 1 with a message in err. */
int run_block(size_t nthreads, char *err, size_t errlen)
{
    const size_t nwarps = (nthreads + 31) / 32;
    ++emu.block_n;
    for (size_t i = 0; i < nthreads; ++i) {
        Fiber *f = &emu.fibers[i];
        f->t.tid = bs_dim3{(unsigned)(i % bs_emu_bdim.x), (unsigned)(i / bs_emu_bdim.x % bs_emu_bdim.y),
                           (unsigned)(i / ((size_t)bs_emu_bdim.x * bs_emu_bdim.y))};
        f->state = RUN;
        f->lane = (unsigned)(i % 32);
        f->warp = (unsigned)(i / 32);
        f->shfl_n = 0;
        f->gather_n = 0;
        prime(f);
    }
    for (;;) {
        for (size_t i = 0; i < nthreads; ++i) {
            if (emu.fibers[i].state == RUN) to_fiber(&emu.fibers[i]);
            if (emu.trapped) {
                say(err, errlen, "block (%u,%u,%u) thread %zu: %s", bs_emu_block.x, bs_emu_block.y, bs_emu_block.z,
                    i, emu.trap);
                return 1;
            }
        }
        bool released = false;
        for (size_t w = 0; w < nwarps; ++w) {
            const size_t lo = w * 32, hi = lo + 32 < nthreads ? lo + 32 : nthreads;
            size_t at_warp = 0, done = 0;
            for (size_t i = lo; i < hi; ++i) {
                at_warp += emu.fibers[i].state == AT_WARP;
                done += emu.fibers[i].state == DONE;
            }
            if (at_warp == 0) continue;
            if (at_warp + done == hi - lo) {
                if (done) {
                    say(err, errlen,
                        "block (%u,%u,%u) warp %zu: a shuffle or __syncwarp waits on %zu lanes that have returned",
                        bs_emu_block.x, bs_emu_block.y, bs_emu_block.z, w, done);
                    return 1;
                }
                for (size_t i = lo; i < hi; ++i) emu.fibers[i].state = RUN;
                released = true;
            }
        }
        if (released) continue;
        size_t live = 0, at_block = 0;
        for (size_t i = 0; i < nthreads; ++i) {
            live += emu.fibers[i].state != DONE;
            at_block += emu.fibers[i].state == AT_BLOCK;
        }
        if (live == 0) return 0;
        if (at_block == live) {
            /* Threads that returned do not take part (sm_70 and later). */
            for (size_t i = 0; i < nthreads; ++i)
                if (emu.fibers[i].state == AT_BLOCK) emu.fibers[i].state = RUN;
            continue;
        }
        say(err, errlen,
            "block (%u,%u,%u): deadlock: %zu of %zu live threads at __syncthreads, the others at a warp "
            "shuffle whose warp is not all there",
            bs_emu_block.x, bs_emu_block.y, bs_emu_block.z, at_block, live);
        return 1;
    }
}

} // namespace

void __syncthreads() { park(AT_BLOCK); }
void bs_emu_warp_wait() { park(AT_WARP); }
int bs_emu_lane() { return (int)emu.cur->lane; }
void bs_emu_shfl_put(uint32_t v)
{
    const Fiber *f = emu.cur;
    emu.slots[((size_t)f->warp * 2 + (f->shfl_n & 1)) * 32 + f->lane] = v;
}
uint32_t *bs_emu_shfl_slot(int src)
{
    Fiber *f = emu.cur;
    uint32_t *p = &emu.slots[((size_t)f->warp * 2 + (f->shfl_n & 1)) * 32 + (size_t)src];
    ++f->shfl_n;
    return p;
}

/* Every lane's `words` values, after all have given theirs (double-buffered
 * by parity like the shuffles). */
void bs_emu_warp_gather(const uint32_t *mine, int words, uint32_t *all)
{
    if (words > GATHER_WORDS) abort(); /* the emulator's own mma callers give 6 or 8 */
    Fiber *f = emu.cur;
    uint32_t *buf = &emu.gather[((size_t)f->warp * 2 + (f->gather_n & 1)) * 32 * GATHER_WORDS];
    memcpy(buf + (size_t)f->lane * GATHER_WORDS, mine, sizeof(uint32_t) * (size_t)words);
    park(AT_WARP);
    for (int l = 0; l < 32; ++l) memcpy(all + l * words, buf + (size_t)l * GATHER_WORDS, sizeof(uint32_t) * (size_t)words);
    ++f->gather_n;
}

void bs_emu_trap(const char *why)
{
    snprintf(emu.trap, sizeof emu.trap, "%s", why);
    emu.trapped = true;
    park(DONE); /* never resumed: the launch ends here */
    abort();
}

uint32_t bs_emu_tmem_alloc(uint32_t cols)
{
    if (cols < 32 || cols > TMEM_COLS || (cols & (cols - 1)) != 0)
        bs_emu_trap("tcgen05.alloc: not a power of two from 32 to 512 columns");
    if (emu.cur->warp != 0) bs_emu_trap("tcgen05.alloc: the emulator models warp 0's allocation only");
    /* The warp's 32 lanes each call this for the one allocation. */
    if (emu.tmem_block != emu.block_n) {
        emu.tmem.assign((size_t)TMEM_LANES * TMEM_COLS, 0x7FC00000u);
        emu.tmem_cols = cols;
        emu.tmem_block = emu.block_n;
    } else if (emu.tmem_cols != cols) {
        bs_emu_trap("tcgen05.alloc: a second allocation in one block");
    }
    return 0;
}

void bs_emu_tmem_dealloc(uint32_t taddr, uint32_t cols)
{
    if (emu.tmem_block != emu.block_n || taddr != 0 || cols != emu.tmem_cols)
        bs_emu_trap("tcgen05.dealloc: not the block's allocation");
}

uint32_t *bs_emu_tmem_at(uint32_t lane, uint32_t col)
{
    if (emu.tmem_block != emu.block_n || lane >= TMEM_LANES || col >= emu.tmem_cols)
        bs_emu_trap("tensor memory outside the block's allocation");
    return &emu.tmem[(size_t)lane * TMEM_COLS + col];
}

/* A warp's tcgen05.ld / st reaches its own 32 lanes only. */
static uint32_t tmem_lane(uint32_t taddr)
{
    const uint32_t base = taddr >> 16;
    if (base != 32u * (emu.cur->warp % 4)) bs_emu_trap("tcgen05.ld / st outside the warp's 32 lanes of tensor memory");
    return base + emu.cur->lane;
}

void bs_emu_tmem_st(uint32_t taddr, const uint32_t *v, int n)
{
    const uint32_t lane = tmem_lane(taddr);
    for (int i = 0; i < n; ++i) *bs_emu_tmem_at(lane, (taddr & 0xFFFFu) + (uint32_t)i) = v[i];
}

void bs_emu_tmem_ld(uint32_t taddr, uint32_t *v, int n)
{
    const uint32_t lane = tmem_lane(taddr);
    for (int i = 0; i < n; ++i) v[i] = *bs_emu_tmem_at(lane, (taddr & 0xFFFFu) + (uint32_t)i);
}

/* mbarrier state: bits 0-31 arrivals still due, 32-62 the count, 63 the
 * current phase's parity. */
void bs_emu_mbar_init(uint64_t *bar, uint32_t count)
{
    if (count == 0 || count >= (1u << 30)) bs_emu_trap("mbarrier.init: a count of 0 or over 2^30");
    *bar = (uint64_t)count | ((uint64_t)count << 32);
}

void bs_emu_mbar_arrive(uint64_t *bar)
{
    uint64_t b = *bar;
    const uint32_t due = (uint32_t)b, count = (uint32_t)(b >> 32) & 0x7FFFFFFFu;
    if (count == 0) bs_emu_trap("mbarrier arrive before init");
    if (due == 1)
        b = (uint64_t)count | ((uint64_t)count << 32) | ((b ^ (1ull << 63)) & (1ull << 63));
    else
        b -= 1;
    *bar = b;
}

void bs_emu_mbar_wait(uint64_t *bar, uint32_t parity)
{
    if ((uint32_t)(*bar >> 63) == (parity & 1u))
        bs_emu_trap("mbarrier wait on a phase that has not completed (the emulator completes each operation "
                    "where it is issued, so nothing else would)");
}

uint32_t bs_emu_cvta_shared(const void *p, size_t bytes)
{
    if ((uintptr_t)p % 16 != 0) bs_emu_trap("a shared-memory descriptor's array is not 16-byte aligned");
    if (bytes > SMEM_SLOT) bs_emu_trap("a shared-memory array over the emulator's 16 KiB slot");
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < emu.smem.size(); ++i)
        if (emu.smem[i].p == b && emu.smem[i].bytes == bytes) return (uint32_t)i * SMEM_SLOT;
    if (emu.smem.size() == SMEM_SLOTS) bs_emu_trap("more shared-memory arrays in descriptors than the emulator's 16");
    emu.smem.push_back(Smem{b, bytes});
    return (uint32_t)(emu.smem.size() - 1) * SMEM_SLOT;
}

const unsigned char *bs_emu_shared_at(uint32_t addr, size_t bytes)
{
    const uint32_t slot = addr / SMEM_SLOT, off = addr % SMEM_SLOT;
    if (slot >= emu.smem.size() || off + bytes > emu.smem[slot].bytes)
        bs_emu_trap("a descriptor reads shared memory outside the array it was made from");
    return emu.smem[slot].p + off;
}

/* Launch kernel `name` over grid[3] blocks of block[3] threads with the
 * driver's argument convention (args[i] points at parameter i's value).
 * 0: done; 1: unknown kernel or bad geometry; 2: the kernel failed (a wait
 * that cannot complete). err gets the reason. Launches from several threads
 * take turns. */
extern "C" int bs_emu_launch(const char *name, const unsigned grid[3], const unsigned block[3], void **args,
                             char *err, size_t errlen)
{
    std::lock_guard<std::mutex> g(emu_lock);
    const bs_emu_thunk thunk = bs_emu_find(name);
    if (!thunk) {
        say(err, errlen, "no kernel %s in the emulator's build", name);
        return 1;
    }
    const size_t nthreads = (size_t)block[0] * block[1] * block[2];
    if (nthreads == 0 || nthreads > 1024 || grid[0] == 0 || grid[1] == 0 || grid[2] == 0) {
        say(err, errlen, "%s: bad launch geometry: grid %ux%ux%u, block %ux%ux%u (at most 1024 threads)", name,
            grid[0], grid[1], grid[2], block[0], block[1], block[2]);
        return 1;
    }
    if (emu.fibers.size() < nthreads) {
        const size_t old = emu.fibers.size();
        emu.fibers.resize(nthreads);
        for (size_t i = old; i < nthreads; ++i) {
            emu.fibers[i].stack = (char *)malloc(STACK);
            if (!emu.fibers[i].stack) {
                emu.fibers.resize(i);
                say(err, errlen, "out of memory for the emulator's thread stacks");
                return 1;
            }
        }
    }
    emu.slots.assign((nthreads + 31) / 32 * 64, 0);
    emu.gather.assign((nthreads + 31) / 32 * 64 * GATHER_WORDS, 0);
    emu.smem.clear();
    emu.trapped = false;
    emu.thunk = thunk;
    emu.args = args;
    bs_emu_bdim = bs_dim3{block[0], block[1], block[2]};
    bs_emu_gdim = bs_dim3{grid[0], grid[1], grid[2]};
    for (unsigned z = 0; z < grid[2]; ++z)
        for (unsigned y = 0; y < grid[1]; ++y)
            for (unsigned x = 0; x < grid[0]; ++x) {
                bs_emu_block = bs_dim3{x, y, z};
                if (run_block(nthreads, err, errlen)) return 2;
            }
    return 0;
}
