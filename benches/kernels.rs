//! `cargo bench`: the kernel benchmark (same as `bespoke bench kernels`).
//! BESPOKE_BENCH_QUICK=1 for a short run; BESPOKE_THREADS for the thread count.

fn main() {
    // cargo passes --bench (and filters); this benchmark takes no arguments.
    let threads = bespoke::threads::resolve(None).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let quick = std::env::var_os("BESPOKE_BENCH_QUICK").is_some();
    let opts = bespoke::bench::Options {
        threads,
        quick,
        formats: vec![
            bespoke::plan::Format::Bf16,
            bespoke::plan::Format::Fp8,
            bespoke::plan::Format::Fp4,
        ],
        fp4_q8: true,
        bf16dot: true,
        fp8dot: true,
        // amx is a prefill kernel; this benchmark times one token.
        amx: false,
        fp8_amx: false,
        fp4_amx: false,
        shapes: bespoke::bench::ShapeSet::Default,
        isas: vec![],
        weight_offset: 0,
        fp8_subnormal: 0.0,
        tokens: 1,
        attention: true,
        context: None,
    };
    if let Err(e) = bespoke::bench::kernels(&opts) {
        eprintln!("bench: {e}");
        std::process::exit(1);
    }
}
