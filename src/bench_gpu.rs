//! `bespoke bench gpu`: the CUDA kernels at the benchmark's shapes on the GPU
//! in this machine: time per call, GB/s of weights read against the card's
//! peak memory bandwidth (memory clock × bus width), and GFLOP/s for the
//! batched and tensor-core paths; then the attention kernels at the set's
//! attention shapes over a VRAM tier's cache length (GB/s of keys and values).

use crate::bench::ShapeSet;
use crate::plan::Format;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct GpuRow {
    pub format: String,
    pub rows: usize,
    pub cols: usize,
    pub kernel: String,
    pub n: usize,
    pub us: f64,
    pub gbps: f64,
    /// Weight GB/s ÷ peak bandwidth (None when the device does not say).
    pub frac_peak: Option<f64>,
    pub gflops: f64,
}

/// One attention kernel timed: the shape, the keys each query sees, the
/// queries a launch takes, and GB/s of distinct keys and values read.
#[derive(Debug, Clone, Serialize)]
pub struct GpuAttnRow {
    pub head_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub origin: String,
    pub kernel: String,
    pub t_len: usize,
    pub n_q: usize,
    pub us: f64,
    pub gbps: f64,
    pub frac_peak: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuReport {
    pub device: String,
    pub image: String,
    pub peak_gbps: Option<f64>,
    pub rows: Vec<GpuRow>,
    pub attention: Vec<GpuAttnRow>,
}

pub fn bench_gpu(set: &ShapeSet, formats: &[Format], quick: bool) -> Result<GpuReport, String> {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (set, formats, quick);
        Err("bench gpu: this build has no CUDA (build with --features cuda)".into())
    }
    #[cfg(feature = "cuda")]
    {
        let g = crate::gpu::gpu().map_err(|why| format!("bench gpu: {why}"))?;
        if g.emulated() {
            return Err(
                "bench gpu: BESPOKE_CUDA=emu is the CPU emulator of the CUDA kernels: \
                 its timings say nothing about a GPU"
                    .into(),
            );
        }
        let plan = crate::report::build_plan();
        let tc_on = |key: &str| g.has_tc(key);
        let peak = g.peak_bandwidth();
        let iters = if quick { 5 } else { 50 };
        let mut rows_out = Vec::new();
        let cases = crate::bench::shape_cases(set, formats)?;
        eprintln!(
            "GPU: {} (sm_{}{}, image {}), peak memory bandwidth {}",
            g.name,
            g.cc.0,
            g.cc.1,
            g.image.arch,
            peak.map_or("unknown".into(), |p| format!("{:.0} GB/s", p / 1e9))
        );
        for (i, (format, rows, cols, _origin)) in cases.iter().enumerate() {
            let (format, rows, cols) = (*format, *rows, *cols);
            eprint!(
                "\r[{}/{}] {format} {rows}x{cols}          ",
                i + 1,
                cases.len()
            );
            let w = crate::bench::make_weights(format, rows, cols, i as u64 + 1, 0, 0.0);
            let m = crate::bench::matrix(format, rows, cols, &w);
            let d = g.upload_matrix(&m)?;
            let wbytes = m.bytes() as f64;
            let specialised = plan
                .mat_shapes
                .iter()
                .any(|m| (m.format, m.rows, m.cols) == (format, rows, cols));
            let mut kernels: Vec<(String, usize)> =
                vec![(crate::gpu::core_kernel(format, 1, None), 1)];
            if specialised {
                kernels.push((crate::gpu::core_kernel(format, 1, Some((rows, cols))), 1));
            }
            kernels.push((crate::gpu::core_kernel(format, 8, None), 8));
            if cols % 32 == 0 {
                for n in [8usize, 64] {
                    if tc_on("mma_bf16") {
                        kernels.push((format!("bs_tc_bf16_{}", format.name()), n));
                    }
                    if tc_on("wgmma") {
                        kernels.push((format!("bs_tc_wgmma_{}", format.name()), n));
                    }
                    if format == Format::Fp8 && tc_on("mma_fp8") {
                        kernels.push(("bs_tc_fp8_fp8".into(), n));
                    }
                    if format == Format::Fp4 && tc_on("mma_int8") {
                        kernels.push(("bs_tc_q8_fp4".into(), n));
                    }
                    if format == Format::Fp4 && tc_on("mma_mxf4") && cols % 64 == 0 {
                        kernels.push(("bs_tc_mxf4_fp4".into(), n));
                    }
                    if format == Format::Fp4 && tc_on("tcgen05_mxf4") && cols % 64 == 0 {
                        kernels.push(("bs_tc_tcgen05_fp4".into(), n));
                    }
                }
            }
            for (k, n) in kernels {
                let t = g.time_product(&k, &d, n, iters)?;
                let gbps = wbytes / t / 1e9;
                rows_out.push(GpuRow {
                    format: format.name().into(),
                    rows,
                    cols,
                    kernel: k,
                    n,
                    us: t * 1e6,
                    gbps,
                    frac_peak: peak.map(|p| gbps * 1e9 / p),
                    gflops: 2.0 * (rows * cols * n) as f64 / t / 1e9,
                });
            }
        }
        eprintln!();
        // Attention at the set's shapes, over the keys a VRAM tier's cache
        // holds (GPU_KV_TOKENS): a decode step, a causal launch of a
        // prefill step's GPU_QUERIES queries, and (one KV head, DeepSeek
        // V4) the row-list kernel with as many queries.
        let t_len = if quick {
            1024
        } else {
            crate::gpu::GPU_KV_TOKENS
        };
        let q = crate::gpu::GPU_QUERIES;
        let mut attention = Vec::new();
        for c in crate::bench::attn_cases(set)? {
            let s = c.shape;
            let specialised = plan.attn_shapes.contains(&s);
            let mut families = vec![("decode", 1), ("causal", q)];
            if s.n_kv_heads == 1 {
                families.push(("rows", q));
            }
            for (f, n_q) in families {
                let mut kernels = vec![format!("bs_cu_attn_{f}")];
                if specialised {
                    kernels.push(if f == "rows" {
                        format!("bs_cu_attn_rows_d{}_h{}", s.head_dim, s.n_heads)
                    } else {
                        format!(
                            "bs_cu_attn_{f}_d{}_h{}_kv{}",
                            s.head_dim, s.n_heads, s.n_kv_heads
                        )
                    });
                }
                for k in kernels {
                    eprint!("\r{k} t{t_len}                    ");
                    let t = g.time_attention(&k, s, c.sinks, t_len, n_q, iters)?;
                    // Distinct key and value bytes (K = V for the row list).
                    let kv = if f == "rows" { 1 } else { 2 };
                    let keys = if f == "causal" {
                        t_len + n_q - 1
                    } else {
                        t_len
                    };
                    let bytes = (kv * keys * s.n_kv_heads * s.head_dim * 4) as f64;
                    let gbps = bytes / t / 1e9;
                    attention.push(GpuAttnRow {
                        head_dim: s.head_dim,
                        n_heads: s.n_heads,
                        n_kv_heads: s.n_kv_heads,
                        origin: c.origin.clone(),
                        kernel: k,
                        t_len,
                        n_q,
                        us: t * 1e6,
                        gbps,
                        frac_peak: peak.map(|p| gbps * 1e9 / p),
                    });
                }
            }
        }
        eprintln!();
        Ok(GpuReport {
            device: g.name.clone(),
            image: g.image.arch.to_string(),
            peak_gbps: peak.map(|p| p / 1e9),
            rows: rows_out,
            attention,
        })
    }
}

/// The terminal table.
pub fn table(r: &GpuReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    writeln!(
        out,
        "{} ({}), peak {}",
        r.device,
        r.image,
        r.peak_gbps
            .map_or("unknown".into(), |p| format!("{p:.0} GB/s"))
    )
    .unwrap();
    writeln!(
        out,
        "{:<5} {:>11} {:<32} {:>3} {:>10} {:>8} {:>7} {:>9}",
        "fmt", "rows×cols", "kernel", "n", "µs", "GB/s", "% peak", "GFLOP/s"
    )
    .unwrap();
    for x in &r.rows {
        writeln!(
            out,
            "{:<5} {:>11} {:<32} {:>3} {:>10.2} {:>8.1} {:>7} {:>9.1}",
            x.format,
            format!("{}×{}", x.rows, x.cols),
            x.kernel,
            x.n,
            x.us,
            x.gbps,
            x.frac_peak
                .map_or("-".into(), |f| format!("{:.0}%", f * 100.0)),
            x.gflops
        )
        .unwrap();
    }
    if !r.attention.is_empty() {
        writeln!(
            out,
            "\n{:<14} {:<32} {:>6} {:>3} {:>10} {:>8} {:>7}",
            "attention", "kernel", "keys", "q", "µs", "GB/s", "% peak"
        )
        .unwrap();
        for a in &r.attention {
            writeln!(
                out,
                "{:<14} {:<32} {:>6} {:>3} {:>10.2} {:>8.1} {:>7}",
                format!("d{} h{} kv{}", a.head_dim, a.n_heads, a.n_kv_heads),
                a.kernel,
                a.t_len,
                a.n_q,
                a.us,
                a.gbps,
                a.frac_peak
                    .map_or("-".into(), |f| format!("{:.0}%", f * 100.0))
            )
            .unwrap();
        }
    }
    out
}
