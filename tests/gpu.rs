//! The CUDA kernels against the CPU reference, on a GPU (`cuda` builds).
//!
//! The CUDA-core kernels (and the VRAM tier through the CLI) also run on the
//! CPU emulator of those kernels (`BESPOKE_CUDA=emu`, kernels/bs_cuda_emu.*),
//! GPU or not: with no GPU (CI) that is what checks them. The tensor-core
//! paths need a GPU: without one, those tests check that the runtime says
//! why, in one line, and stop. `BESPOKE_REQUIRE_GPU=1` (tools/gpu-check.sh
//! sets it) makes a missing GPU a failure instead.
//!
//! The GPU contract is a bound, not bit identity (the CUDA cores sum in a
//! different order): |y_gpu - y_ref| <= (cols + 64) * 2^-24 * sum|w x| for the
//! CUDA-core kernels; the tensor-core paths round their inputs (BF16, E4M3,
//! MXFP4) and each has its own bound below. fp4×q8 on INT8 tensor cores is
//! defined as the CPU's fp4×q8 and must match it bit for bit.
#![cfg(feature = "cuda")]

mod common;
use bespoke::devcheck::{self, magnitudes, CheckMatrix};
use bespoke::gpu;
use bespoke::plan::Format;
use bespoke::{Matrix, Weights};
use common::Rng;

/// The GPU, or None after checking the no-GPU reason (unless one is required).
fn gpu_or_reason() -> Option<&'static gpu::Gpu> {
    match gpu::gpu() {
        Ok(g) if g.emulated() => {
            assert!(
                std::env::var("BESPOKE_REQUIRE_GPU").is_err(),
                "BESPOKE_REQUIRE_GPU is set but BESPOKE_CUDA=emu asks for the emulator"
            );
            println!("BESPOKE_CUDA=emu: no GPU; GPU-only checks not run");
            None
        }
        Ok(g) => {
            println!(
                "GPU: {} sm_{}{} (image {})",
                g.name, g.cc.0, g.cc.1, g.image.arch
            );
            Some(g)
        }
        Err(why) => {
            assert!(
                std::env::var("BESPOKE_REQUIRE_GPU").is_err(),
                "BESPOKE_REQUIRE_GPU is set but: {why}"
            );
            // The reasons a GPU-less machine gives; anything else is a bug.
            assert!(
                why.contains("no NVIDIA driver library")
                    || why.contains("no usable CUDA device")
                    || why.contains("no GPU kernels")
                    || why.contains("BESPOKE_CUDA=off"),
                "unexpected reason: {why}"
            );
            println!("no GPU ({why}): GPU kernels not run");
            None
        }
    }
}

/// Where the CUDA-core checks run: the GPU when there is one, and the CPU
/// emulator of the CUDA-core kernels always.
fn core_devices() -> Vec<&'static gpu::Gpu> {
    let mut v: Vec<&'static gpu::Gpu> = gpu_or_reason().into_iter().collect();
    v.push(gpu::emulator());
    v
}

fn device_name(g: &gpu::Gpu) -> &'static str {
    if g.emulated() {
        "emulator"
    } else {
        "GPU"
    }
}

/// The start-up check turned no tensor-core path off (a path it turned
/// off is a finding: `tensor_core_paths_match_within_their_bounds` still
/// runs it, to show how it fails), and ran on the emulator as on a GPU.
#[test]
fn the_start_up_check_passes() {
    if let Some(g) = gpu_or_reason() {
        assert!(
            g.checked > 0 && g.tc_off.is_empty(),
            "the GPU's start-up check: {:?}",
            g.tc_off
        );
        println!(
            "GPU: start-up check, {} launches against the CPU: ok",
            g.checked
        );
    }
    let out = common::bespoke_command()
        .arg("plan")
        .env("BESPOKE_CUDA", "emu")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && text.contains("start-up check: 32 launches against the CPU reference")
            && !text.contains(" off, "),
        "{text}"
    );
}

#[test]
fn the_emulator_keeps_cuda_semantics() {
    match gpu::emulator_selftest() {
        Ok(what) => println!("{what}"),
        Err(e) => panic!("emulator self-test: {e}"),
    }
}

/// A random matrix of `format` from the test's generator.
fn random_matrix(format: Format, rows: usize, cols: usize, rng: &mut Rng) -> CheckMatrix {
    CheckMatrix::random(format, rows, cols, &mut || rng.next_u64())
}

fn check(what: &str, got: &[f32], want: &[f32], mag: &[f32], rel: f64) {
    match devcheck::compare(got, want, mag, rel) {
        Ok(worst) => println!("{what}: ok, worst |Δ| / Σ|wx| = {worst:.2e} (bound {rel:.2e})"),
        Err(e) => panic!("{what}: {e}"),
    }
}

const SHAPES: &[(usize, usize)] = &[(64, 64), (130, 256), (256, 1024), (1, 4096)];

#[test]
fn cuda_core_kernels_match_the_reference() {
    for g in core_devices() {
        cuda_core_kernels_on(g);
    }
}

fn cuda_core_kernels_on(g: &gpu::Gpu) {
    let mut rng = Rng(7);
    let dev = device_name(g);
    for f in [Format::F32, Format::Bf16, Format::Fp8, Format::Fp4] {
        for &(rows, cols) in SHAPES {
            let o = random_matrix(f, rows, cols, &mut rng);
            let m = o.matrix().unwrap();
            let d = g.upload_matrix(&m).unwrap();
            for n in [1usize, 3, 9] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.unit() * 4.0).collect();
                let want = bespoke::reference::matmul(&m, &x, n);
                let mag = magnitudes(&m, &x, n);
                let got = g.matmul(&gpu::core_kernel(f, n, None), &d, &x, n).unwrap();
                let rel = (cols + 64) as f64 * 2f64.powi(-24);
                check(
                    &format!("{dev}: {f} {rows}x{cols} n={n} CUDA cores"),
                    &got,
                    &want,
                    &mag,
                    rel,
                );
            }
        }
    }
}

#[test]
fn specialised_cuda_kernels_run_for_the_build_shapes() {
    for g in core_devices() {
        specialised_kernels_on(g);
    }
}

fn specialised_kernels_on(g: &gpu::Gpu) {
    let dev = device_name(g);
    let plan = bespoke::report::build_plan();
    let mut rng = Rng(11);
    // A few of the build's shapes per format (not the largest: the reference is slow).
    for f in [Format::F32, Format::Bf16, Format::Fp8, Format::Fp4] {
        for s in plan
            .mat_shapes
            .iter()
            .filter(|s| s.format == f && s.rows * s.cols <= 1 << 20)
            .take(2)
        {
            let o = random_matrix(f, s.rows, s.cols, &mut rng);
            let m = o.matrix().unwrap();
            let d = g.upload_matrix(&m).unwrap();
            for n in [1usize, 4] {
                let x: Vec<f32> = (0..n * s.cols).map(|_| rng.unit()).collect();
                let got = g
                    .matmul(&gpu::core_kernel(f, n, Some((s.rows, s.cols))), &d, &x, n)
                    .unwrap();
                let rel = (s.cols + 64) as f64 * 2f64.powi(-24);
                check(
                    &format!("{dev}: {f} {}x{} n={n} specialised", s.rows, s.cols),
                    &got,
                    &bespoke::reference::matmul(&m, &x, n),
                    &magnitudes(&m, &x, n),
                    rel,
                );
            }
        }
    }
}

/// X rounded to MXFP4 as bs_cu_quant_mxf4 rounds it (templates/cuda.cu.tera):
/// per 32 values the scale 2^(floor(log2 max|x|) - 2), each x / scale to the
/// nearest E2M1, ties to the even code. Returns the decoded values.
fn mxf4_round(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for b in x.chunks(32) {
        let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert!(amax.is_finite(), "the test's X is finite");
        let s = if amax > 0.0 {
            // floor(log2 amax), exactly: the exponent field (amax is normal
            // for the test's X).
            assert!(amax.is_normal());
            let e = ((amax.to_bits() >> 23) & 0xFF) as i32 - 127 - 2 + 127;
            bespoke::formats::e8m0_to_f32(e.clamp(0, 254) as u8)
        } else {
            1.0
        };
        for &v in b {
            let a = (v / s).abs();
            let m = if a <= 0.25 {
                0.0
            } else if a < 0.75 {
                0.5
            } else if a <= 1.25 {
                1.0
            } else if a < 1.75 {
                1.5
            } else if a <= 2.5 {
                2.0
            } else if a < 3.5 {
                3.0
            } else if a <= 5.0 {
                4.0
            } else {
                6.0
            };
            out.push(if v.is_sign_negative() { -m } else { m } * s);
        }
    }
    out
}

/// The exact (f64) product of FP4 W and X rounded to MXFP4, and Σ|w·xq|.
fn mxf4_product(m: &Matrix, x: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
    let (rows, cols) = (m.rows(), m.cols());
    let xq = mxf4_round(x);
    let (mut y, mut mag) = (vec![0f32; n * rows], vec![0f32; n * rows]);
    for j in 0..n {
        for r in 0..rows {
            let (mut s, mut a) = (0f64, 0f64);
            for c in 0..cols {
                let w = bespoke::reference::weight(m, r, c) as f64
                    * bespoke::reference::scale(m, r, c / 32) as f64;
                let p = w * xq[j * cols + c] as f64;
                s += p;
                a += p.abs();
            }
            y[j * rows + r] = s as f32;
            mag[j * rows + r] = a as f32;
        }
    }
    (y, mag)
}

/// Which tensor-core kernels the device has (the build plan's for the
/// image, or the emulator's).
/// Whether the device has tensor-core path `key`: in its image (or the
/// emulator's list), also where the start-up check turned it off, so that
/// its failure is shown here in full.
fn tc_on(g: &gpu::Gpu, key: &str) -> bool {
    g.has_tc(key) || g.tc_off.iter().any(|(k, _)| *k == key)
}

/// On the GPU, and on the emulator for the paths it computes
/// (`plan::cuda::EMU_TC`: its `mma.sync`, `wgmma` and `tcgen05` follow the
/// PTX ISA's fragment, descriptor and tensor-memory layouts as we read
/// them, so a kernel that misplaces a row, column, block or scale fails).
#[test]
fn tensor_core_paths_match_within_their_bounds() {
    for g in core_devices() {
        tensor_core_paths_on(g);
    }
}

fn tensor_core_paths_on(g: &gpu::Gpu) {
    let dev = device_name(g);
    let mut rng = Rng(13);
    let u = 2f64.powi(-24);
    // 576 columns: 9 steps of K = 64, so tcgen05's last group of 4 is partial;
    // 40 columns of X: two of its 32-wide tiles.
    for &(rows, cols) in &[(64usize, 256usize), (130, 512), (256, 1024), (130, 576)] {
        for n in [1usize, 8, 13, 40] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.unit() * 4.0).collect();
            for f in [Format::Bf16, Format::Fp8, Format::Fp4] {
                let o = random_matrix(f, rows, cols, &mut rng);
                let m = o.matrix().unwrap();
                let d = g.upload_matrix(&m).unwrap();
                let want = bespoke::reference::matmul(&m, &x, n);
                let mag = magnitudes(&m, &x, n);
                // BF16 activations: one rounding (2^-8 relative) per product.
                let bf16_rel = 2f64.powi(-8) + (cols + 64) as f64 * u;
                for (key, kernel) in [("mma_bf16", "bs_tc_bf16_"), ("wgmma", "bs_tc_wgmma_")] {
                    if tc_on(g, key) {
                        let got = g
                            .matmul(&format!("{kernel}{}", f.name()), &d, &x, n)
                            .unwrap();
                        check(
                            &format!("{dev}: {key} {f} {rows}x{cols} n={n}"),
                            &got,
                            &want,
                            &mag,
                            bf16_rel,
                        );
                    }
                }
                if f == Format::Fp8 && tc_on(g, "mma_fp8") {
                    // E4M3 activations: 2^-4 relative per element.
                    let got = g.matmul("bs_tc_fp8_fp8", &d, &x, n).unwrap();
                    check(
                        &format!("{dev}: mma_fp8 {rows}x{cols} n={n}"),
                        &got,
                        &want,
                        &mag,
                        2f64.powi(-4) + 1e-5,
                    );
                }
                if f == Format::Fp4 && tc_on(g, "mma_int8") {
                    // Bit for bit the CPU's fp4×q8.
                    let got = g.matmul("bs_tc_q8_fp4", &d, &x, n).unwrap();
                    let mut a = bespoke::q8::Q8Act::default();
                    for j in 0..n {
                        a.quantize_from(&x[j * cols..(j + 1) * cols]).unwrap();
                        for r in 0..rows {
                            let cpu = bespoke::reference::q8_row_dot(&m, r, &a).unwrap();
                            let gpu_v = got[j * rows + r];
                            assert!(
                                common::same(cpu, gpu_v),
                                "{dev}: mma_int8 {rows}x{cols} token {j} row {r}: {gpu_v} vs CPU fp4×q8 {cpu}"
                            );
                        }
                    }
                    println!(
                        "{dev}: mma_int8 {rows}x{cols} n={n}: bit-identical to the CPU fp4×q8"
                    );
                }
                for (key, kernel) in [
                    ("mma_mxf4", "bs_tc_mxf4_fp4"),
                    ("tcgen05_mxf4", "bs_tc_tcgen05_fp4"),
                ] {
                    if f != Format::Fp4 || !tc_on(g, key) || cols % 64 != 0 {
                        continue;
                    }
                    let got = g.matmul(kernel, &d, &x, n).unwrap();
                    // Against the f32 reference: MXFP4 activations are up to
                    // one E2M1 step (a quarter of the block's max) off per
                    // element.
                    check(
                        &format!("{dev}: {key} {rows}x{cols} n={n}"),
                        &got,
                        &want,
                        &mag,
                        0.5,
                    );
                    // Against the exact MXFP4 × MXFP4 product (X rounded as
                    // bs_cu_quant_mxf4 rounds it): only the tensor cores'
                    // own summation is left, so a misplaced row, column,
                    // block or scale shows here.
                    let (exact, emag) = mxf4_product(&m, &x, n);
                    check(
                        &format!("{dev}: {key} {rows}x{cols} n={n} vs exact MXFP4"),
                        &got,
                        &exact,
                        &emag,
                        2f64.powi(-10),
                    );
                }
            }
        }
    }
}

#[test]
fn attention_decode_matches_the_reference() {
    for g in core_devices() {
        attention_on(g);
    }
}

fn attention_on(g: &gpu::Gpu) {
    let dev = device_name(g);
    let plan = bespoke::report::build_plan();
    let mut rng = Rng(17);
    for &(hd, h, kvh, t_len, window, sinks) in &[
        (64usize, 8usize, 2usize, 37usize, 0usize, false),
        (128, 4, 1, 300, 128, true),
        (64, 8, 8, 1, 0, true),
        // A build shape (tiny-llama's: the specialised kernels too), odd
        // head_dim, one query more than a causal launch takes.
        (18, 4, 2, 40, 0, false),
    ] {
        let stride = kvh * hd;
        let q: Vec<f32> = (0..h * hd).map(|_| rng.unit()).collect();
        let k: Vec<f32> = (0..t_len * stride).map(|_| rng.unit()).collect();
        let v: Vec<f32> = (0..t_len * stride).map(|_| rng.unit()).collect();
        let s: Vec<f32> = (0..h).map(|_| rng.unit()).collect();
        let args = bespoke::AttnArgs {
            q: &q,
            k: &k,
            v: &v,
            sinks: sinks.then_some(&s[..]),
            n_heads: h,
            n_kv_heads: kvh,
            head_dim: hd,
            kv_stride: stride,
            kv_head_stride: hd,
            t_len,
            window,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let want = bespoke::reference::attn_decode(&args);
        let got = g
            .attn_decode(
                "bs_cu_attn_decode",
                &q,
                &k,
                &v,
                args.sinks,
                h,
                kvh,
                hd,
                stride,
                t_len,
                window,
                args.scale,
            )
            .unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5,
                "{dev}: attention hd{hd} h{h} kv{kvh} t{t_len}: out {i}: {a} vs CPU {b}"
            );
        }
        println!("{dev}: attention hd{hd} h{h} kv{kvh} t{t_len} window {window} sinks {sinks}: ok");
        // The causal kernel a prefill step takes on the GPU (no sinks, no
        // window): n_q queries from position t0, query j over positions
        // 0 .. t0 + j - 1, as one decode call over that many would.
        if window != 0 || sinks {
            continue;
        }
        let n_q = t_len.min(17);
        let t0 = t_len - n_q + 1;
        let qs: Vec<f32> = (0..n_q * h * hd).map(|_| rng.unit()).collect();
        let shape = bespoke::plan::AttnShape {
            head_dim: hd,
            n_heads: h,
            n_kv_heads: kvh,
        };
        let mut kernels = vec!["bs_cu_attn_causal".to_string()];
        if plan.attn_shapes.contains(&shape) {
            kernels.push(format!("bs_cu_attn_causal_d{hd}_h{h}_kv{kvh}"));
        }
        for kernel in kernels {
            let got = g
                .attn_causal(&kernel, &qs, &k, &v, h, kvh, hd, stride, t0, args.scale)
                .unwrap();
            for j in 0..n_q {
                let one = bespoke::AttnArgs {
                    q: &qs[j * h * hd..(j + 1) * h * hd],
                    t_len: t0 + j,
                    sinks: None,
                    ..args
                };
                let want = bespoke::reference::attn_decode(&one);
                for (i, (a, b)) in got[j * h * hd..(j + 1) * h * hd]
                    .iter()
                    .zip(&want)
                    .enumerate()
                {
                    assert!(
                        (a - b).abs() <= 1e-5,
                        "{dev}: {kernel} query {j} from position {t0}: out {i}: {a} vs CPU {b}"
                    );
                }
            }
            println!("{dev}: {kernel} hd{hd} h{h} kv{kvh}, {n_q} queries from position {t0}: ok");
        }
    }
}

#[test]
fn attention_over_rows_matches_the_reference() {
    for g in core_devices() {
        attention_rows_on(g);
    }
}

/// bs_cu_attn_rows (DeepSeek V4's attention on the GPU): GPU_QUERIES queries,
/// each over its own list of rows of one K = V store with sinks, against the
/// CPU reference over the same rows gathered in order; and the lists the
/// kernel must never see refused.
fn attention_rows_on(g: &gpu::Gpu) {
    let dev = device_name(g);
    let plan = bespoke::report::build_plan();
    let mut rng = Rng(29);
    // tiny-dsv4's shape (specialised too), and an odd one.
    for &(hd, h, have) in &[(64usize, 8usize, 60usize), (40, 3, 9)] {
        let kv: Vec<f32> = (0..have * hd).map(|_| rng.unit()).collect();
        let sinks: Vec<f32> = (0..h).map(|_| rng.unit()).collect();
        let n_q = gpu::GPU_QUERIES;
        let qs: Vec<f32> = (0..n_q * h * hd).map(|_| rng.unit()).collect();
        // Query j: 1 + (7j mod 23) rows, from a walk over the store (rows
        // out of order, some twice in a list).
        let (mut rows, mut offs) = (Vec::new(), vec![0i32]);
        for j in 0..n_q {
            for i in 0..1 + (7 * j) % 23 {
                rows.push(((j * 13 + i * 5) % have) as i32);
            }
            offs.push(rows.len() as i32);
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut kernels = vec!["bs_cu_attn_rows".to_string()];
        let shape = bespoke::plan::AttnShape {
            head_dim: hd,
            n_heads: h,
            n_kv_heads: 1,
        };
        if plan.attn_shapes.contains(&shape) {
            kernels.push(format!("bs_cu_attn_rows_d{hd}_h{h}"));
        }
        for kernel in &kernels {
            let got = g
                .attn_rows(kernel, &qs, &kv, &sinks, &rows, &offs, h, hd, scale)
                .unwrap();
            for j in 0..n_q {
                let list = &rows[offs[j] as usize..offs[j + 1] as usize];
                let keys: Vec<f32> = list
                    .iter()
                    .flat_map(|&r| kv[r as usize * hd..(r as usize + 1) * hd].iter().copied())
                    .collect();
                let want = bespoke::reference::attn_decode(&bespoke::AttnArgs {
                    q: &qs[j * h * hd..(j + 1) * h * hd],
                    k: &keys,
                    v: &keys,
                    sinks: Some(&sinks),
                    n_heads: h,
                    n_kv_heads: 1,
                    head_dim: hd,
                    kv_stride: hd,
                    kv_head_stride: hd,
                    t_len: list.len(),
                    window: 0,
                    scale,
                });
                for (i, (a, b)) in got[j * h * hd..(j + 1) * h * hd]
                    .iter()
                    .zip(&want)
                    .enumerate()
                {
                    assert!(
                        (a - b).abs() <= 1e-5,
                        "{dev}: {kernel} query {j} over {list:?}: out {i}: {a} vs CPU {b}"
                    );
                }
            }
            println!("{dev}: {kernel} hd{hd} h{h}, {n_q} queries over rows of {have}: ok");
        }
        // Lists the kernel would read outside its buffers with.
        let run = |rows: &[i32], offs: &[i32], q: &[f32]| {
            g.attn_rows("bs_cu_attn_rows", q, &kv, &sinks, rows, offs, h, hd, scale)
        };
        let one = &qs[..h * hd];
        let two = &qs[..2 * h * hd];
        for (what, e) in [
            ("a row past the store", run(&[have as i32], &[0, 1], one)),
            ("a negative row", run(&[-1], &[0, 1], one)),
            ("offsets that fall", run(&[0, 1], &[0, 2, 1], two)),
            ("offsets short of the rows", run(&[0, 1], &[0, 1], one)),
            ("offsets not from 0", run(&[0, 1], &[1, 2], one)),
            ("q for another count", run(&[0, 1], &[0, 1, 2], one)),
            (
                "more queries than a launch takes",
                run(
                    &vec![0; n_q + 1],
                    &(0..=n_q as i32 + 1).collect::<Vec<_>>(),
                    &qs[..h * hd]
                        .iter()
                        .cycle()
                        .take((n_q + 1) * h * hd)
                        .copied()
                        .collect::<Vec<_>>(),
                ),
            ),
        ] {
            let e = e.expect_err(what);
            assert!(
                e.contains("rows") || e.contains("queries"),
                "{dev}: {what}: {e}"
            );
        }
        let e = g
            .attn_rows(
                "bs_cu_attn_causal",
                one,
                &kv,
                &sinks,
                &[0],
                &[0, 1],
                h,
                hd,
                scale,
            )
            .unwrap_err();
        assert!(e.contains("not the row attention kernel"), "{e}");
    }
}

#[test]
fn indexer_scores_are_the_cpu_s_bit_for_bit() {
    for g in core_devices() {
        index_scores_on(g);
    }
}

/// bs_cu_index_scores (DeepSeek V4's lightning indexer on the GPU): every
/// score equal, bit for bit, to `reference::index_scores` (which the
/// engine's CPU path gives too), so the top-k made from them picks the same
/// entries; GPU_QUERIES queries over different counts of entries (none
/// included), with awkward entries (zeros, −0, subnormals, large values) and
/// a dim that is not a multiple of 16; and the inputs the kernel must never
/// see refused.
fn index_scores_on(g: &gpu::Gpu) {
    let dev = device_name(g);
    let mut rng = Rng(31);
    // tiny-dsv4's indexer (8 heads of 32), DeepSeek V4 Flash's dim, an odd one.
    for &(heads, dim, have) in &[(8usize, 32usize, 37usize), (2, 128, 70), (3, 20, 9)] {
        let entries: Vec<f32> = (0..have * dim).map(|_| rng.activation()).collect();
        let n_q = gpu::GPU_QUERIES;
        let q: Vec<f32> = (0..n_q * heads * dim).map(|_| rng.unit()).collect();
        let w: Vec<f32> = (0..n_q * heads).map(|_| rng.unit()).collect();
        let mut offs = vec![0i32];
        for j in 0..n_q {
            let seen = if j == 1 { have } else { (5 * j) % (have + 1) };
            offs.push(offs[j] + seen as i32);
        }
        let scale = 1.0 / (dim as f32).sqrt();
        let got = g
            .index_scores(&entries, &q, &w, &offs, heads, dim, scale)
            .unwrap();
        assert_eq!(got.len(), offs[n_q] as usize, "{dev}");
        let (mut finite, mut positive) = (0, 0);
        for j in 0..n_q {
            let seen = (offs[j + 1] - offs[j]) as usize;
            let want = bespoke::reference::index_scores(
                &entries[..seen * dim],
                &q[j * heads * dim..(j + 1) * heads * dim],
                &w[j * heads..(j + 1) * heads],
                dim,
                scale,
            );
            for (e, (a, b)) in got[offs[j] as usize..offs[j + 1] as usize]
                .iter()
                .zip(&want)
                .enumerate()
            {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{dev}: {heads} heads of {dim}, query {j}, entry {e}: {a:e} vs CPU {b:e}"
                );
                finite += a.is_finite() as usize;
                positive += (*a > 0.0) as usize;
            }
        }
        assert!(
            finite > got.len() / 2 && positive > 0 && positive < finite,
            "{dev}: {finite} finite and {positive} positive of {} scores",
            got.len()
        );
        println!("{dev}: index scores, {heads} heads of {dim}, {n_q} queries over up to {have} entries: bit for bit");
        let run = |offs: &[i32], q: &[f32], w: &[f32]| {
            g.index_scores(&entries, q, w, offs, heads, dim, scale)
        };
        let (q1, w1) = (&q[..heads * dim], &w[..heads]);
        let (q2, w2) = (&q[..2 * heads * dim], &w[..2 * heads]);
        let many = |n: usize, v: &[f32]| -> Vec<f32> {
            v.iter().cycle().take(n * v.len()).copied().collect()
        };
        for (what, e) in [
            (
                "more entries than there are",
                run(&[0, have as i32 + 1], q1, w1),
            ),
            ("offsets that fall", run(&[0, 2, 1], q2, w2)),
            ("offsets not from 0", run(&[1, 2], q1, w1)),
            ("no query", run(&[0], &[], &[])),
            ("q for another count", run(&[0, 1, 2], q1, w2)),
            ("w for another count", run(&[0, 1, 2], q2, w1)),
            (
                "more queries than a launch takes",
                run(&vec![0; n_q + 2], &many(n_q + 1, q1), &many(n_q + 1, w1)),
            ),
        ] {
            let e = e.expect_err(what);
            assert!(e.contains("indexer scores"), "{dev}: {what}: {e}");
        }
    }
}

#[test]
fn experts_run_whole_on_the_gpu() {
    for g in core_devices() {
        ffn_on(g);
    }
}

/// Gpu::ffn_start / ffn_finish (an MoE layer's resident experts queued
/// together): each job's output against the same three products launched
/// one by one with the activation made on the CPU (the engine's silu and
/// clamps), within the f32 rounding of silu's exp; in one batch, in order;
/// an expert whose matrices do not chain refused.
fn ffn_on(g: &gpu::Gpu) {
    use std::sync::Arc;
    let dev = device_name(g);
    let mut rng = Rng(37);
    // (format, hidden, intermediate, tokens, DeepSeek V4's clamp)
    let cases = [
        (Format::Bf16, 64usize, 96usize, 3usize, None),
        (Format::Fp8, 128, 256, 1, Some(0.5f32)),
        (Format::Fp4, 64, 32, 5, Some(2.0)),
        (Format::F32, 40, 24, 2, None),
    ];
    let mut owned = Vec::new();
    for &(f, hidden, inter, n, _) in &cases {
        let mats = [
            random_matrix(f, inter, hidden, &mut rng),
            random_matrix(f, inter, hidden, &mut rng),
            random_matrix(f, hidden, inter, &mut rng),
        ];
        let x: Vec<f32> = (0..n * hidden).map(|_| rng.unit() * 2.0).collect();
        owned.push((mats, x));
    }
    let dev_mats: Vec<[Arc<gpu::DevMat>; 3]> = owned
        .iter()
        .map(|(m, _)| {
            m.each_ref()
                .map(|o| Arc::new(g.upload_matrix(&o.matrix().unwrap()).unwrap()))
        })
        .collect();
    let jobs: Vec<gpu::FfnJob> = cases
        .iter()
        .zip(&owned)
        .zip(&dev_mats)
        .map(|((&(_, _, _, n, limit), (_, x)), d)| gpu::FfnJob {
            mats: d.clone().map(|m| gpu::DevProduct::f32(m, false)),
            x,
            n,
            limit,
        })
        .collect();
    let got = g.ffn_finish(g.ffn_start(&jobs).unwrap()).unwrap();
    assert_eq!(got.len(), cases.len(), "{dev}: one output a job");
    for (((&(f, hidden, inter, n, limit), (mats, x)), d), y) in
        cases.iter().zip(&owned).zip(&dev_mats).zip(&got)
    {
        let kernel = gpu::core_kernel(f, n, None);
        let gate = g.matmul(&kernel, &d[0], x, n).unwrap();
        let up = g.matmul(&kernel, &d[1], x, n).unwrap();
        let act: Vec<f32> = gate
            .iter()
            .zip(&up)
            .map(|(&a, &b)| match limit {
                None => bespoke::engine::silu(a) * b,
                Some(l) => bespoke::engine::silu(a.min(l)) * b.clamp(-l, l),
            })
            .collect();
        if limit.is_some() {
            assert!(
                gate.iter().chain(&up).any(|&v| v.abs() > limit.unwrap()),
                "{dev}: the clamp is exercised"
            );
        }
        let want = g.matmul(&kernel, &d[2], &act, n).unwrap();
        let down = mats[2].matrix().unwrap();
        let mag = magnitudes(&down, &act, n);
        check(
            &format!("{dev}: {f} expert {hidden}→{inter}→{hidden}, {n} tokens, clamp {limit:?}, whole on the GPU"),
            y,
            &want,
            &mag,
            8.0 * 2f64.powi(-24),
        );
    }
    // Products sharing one X (this BF16 expert's gate and up, the FP4 one's
    // gate, which takes 64 columns too): each output the same, bit for
    // bit, as launched on its own; a matrix of another width refused.
    let (hidden, n, x) = (cases[0].1, cases[0].3, &owned[0].1);
    let mats = [
        gpu::DevProduct::f32(dev_mats[0][0].clone(), false),
        gpu::DevProduct::f32(dev_mats[0][1].clone(), false),
        gpu::DevProduct::f32(dev_mats[2][0].clone(), false),
    ];
    assert!(mats.iter().all(|p| p.mat.cols == hidden));
    let shared = g
        .ffn_finish(g.products_start(&mats, &[x], n).unwrap())
        .unwrap();
    for (i, p) in mats.iter().enumerate() {
        let kernel = gpu::core_kernel(p.mat.format, n, None);
        let one = g.matmul(&kernel, &p.mat, x, n).unwrap();
        assert_eq!(shared[i], one, "{dev}: product {i} sharing X ({kernel})");
    }
    let other = [
        mats[0].clone(),
        gpu::DevProduct::f32(dev_mats[3][0].clone(), false),
    ];
    let e = g
        .products_start(&other, &[x], n)
        .err()
        .expect("X of another width");
    assert!(e.contains("expected n × cols"), "{dev}: {e}");
    // One X each: the BF16 gate with its X, the F32 gate (40 columns) with
    // another; and a count of X that is neither one nor one each refused.
    let x2: Vec<f32> = (0..n * dev_mats[3][0].cols)
        .map(|i| ((i % 7) as f32 - 3.0) / 4.0)
        .collect();
    let each = [
        mats[0].clone(),
        gpu::DevProduct::f32(dev_mats[3][0].clone(), false),
    ];
    let xs: [&[f32]; 2] = [x, &x2];
    let got = g
        .ffn_finish(g.products_start(&each, &xs, n).unwrap())
        .unwrap();
    for ((p, xi), y) in each.iter().zip(xs).zip(&got) {
        let one = g
            .matmul(&gpu::core_kernel(p.mat.format, n, None), &p.mat, xi, n)
            .unwrap();
        assert_eq!(y, &one, "{dev}: a product with its own X");
    }
    let e = g
        .products_start(&mats, &[x, x], n)
        .err()
        .expect("two X for three products");
    assert!(e.contains("one, or one each"), "{dev}: {e}");
    // Down's columns must be gate's rows.
    let bad = gpu::FfnJob {
        mats: [
            gpu::DevProduct::f32(dev_mats[0][0].clone(), false),
            gpu::DevProduct::f32(dev_mats[0][1].clone(), false),
            gpu::DevProduct::f32(dev_mats[1][2].clone(), false),
        ],
        x: &owned[0].1,
        n: cases[0].3,
        limit: None,
    };
    let e = g
        .ffn_start(&[bad])
        .err()
        .expect("a job whose shapes do not chain");
    assert!(e.contains("do not chain"), "{dev}: {e}");
    variant_products_on(g, dev, &dev_mats[0][0], x, n, gpu::GpuAct::Bf16);
    let (n4, x4) = (cases[2].3, &owned[2].1);
    variant_products_on(g, dev, &dev_mats[2][0], x4, n4, gpu::GpuAct::Q8);
    // DeepSeek's simulated FP8 activations (`--numerics deepseek`), on FP4
    // and FP8 weights.
    variant_products_on(g, dev, &dev_mats[2][0], x4, n4, gpu::GpuAct::Fp8Sim);
    variant_products_on(g, dev, &dev_mats[1][0], &owned[1].1, 1, gpu::GpuAct::Fp8Sim);
    bf16_rounding_on(g, dev);
    fp8sim_rounding_on(g, dev);
}

/// `bs_cu_round_fp8sim` through an identity matrix, bit for bit
/// `engine::fp8_act_quant`: a block of 128 whose largest is 448 (scale 1),
/// with E4M3 ties (17 to 16, 19 to 20), subnormals, signed zeros and the
/// clamp; and a partial block of 32 below the 1e-4 floor of its scale.
fn fp8sim_rounding_on(g: &gpu::Gpu, dev: &str) {
    use bespoke::gpu::{DevProduct, GpuAct};
    let cols = 160;
    let mut vals: Vec<f32> = (0..cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
        .collect();
    let edge = [
        448.0f32,
        -448.0,
        17.0,
        19.0,
        -0.0,
        0.0,
        1.5 * 2f32.powi(-9),
        2.5 * 2f32.powi(-9),
        1e-3,
        -300.0,
        0.1,
    ];
    vals[..edge.len()].copy_from_slice(&edge);
    for (i, v) in vals[128..].iter_mut().enumerate() {
        *v = (i as f32 - 15.5) * 3e-8;
    }
    let mut eye = vec![0f32; cols * cols];
    for i in 0..cols {
        eye[i * cols + i] = 1.0;
    }
    let m = Matrix::new(cols, cols, Weights::F32(&eye)).unwrap();
    let id = DevProduct {
        mat: std::sync::Arc::new(g.upload_matrix(&m).unwrap()),
        specialised: false,
        act: GpuAct::Fp8Sim,
    };
    let got = g
        .ffn_finish(g.products_start(&[id], &[&vals], 1).unwrap())
        .unwrap();
    let want = gpu::variant_activations(GpuAct::Fp8Sim, &vals, cols)
        .unwrap()
        .unwrap();
    assert_ne!(want, vals, "{dev}: FP8-simulated activations change X");
    assert_eq!((want[2], want[3]), (16.0, 20.0), "the ties, to even");
    for (i, (&y, &w)) in got[0].iter().zip(&want).enumerate() {
        assert_eq!(
            y.to_bits(),
            (w + 0.0).to_bits(),
            "{dev}: FP8-simulated value {i} ({:e}): {y:e}, expected {w:e}",
            vals[i]
        );
    }
    println!("{dev}: DeepSeek's FP8-simulated activations: bit for bit");
}

/// Queued products with an activation variant's activations (for a layer
/// or a block run whole on the device): one token on the CUDA cores reads X
/// as the CPU variant gives it, made on the device (`bs_cu_round_bf16`,
/// `bs_cu_round_q8`), bit for bit the product of `variant_activations`' X;
/// more tokens go to the variant's tensor-core kernel where the image has
/// it, bit for bit that kernel launched on its own.
fn variant_products_on(
    g: &gpu::Gpu,
    dev: &str,
    mat: &std::sync::Arc<gpu::DevMat>,
    x: &[f32],
    n: usize,
    act: gpu::GpuAct,
) {
    let p = gpu::DevProduct {
        mat: mat.clone(),
        specialised: false,
        act,
    };
    let cols = mat.cols;
    let run = |x: &[f32], n: usize| {
        g.ffn_finish(g.products_start(std::slice::from_ref(&p), &[x], n).unwrap())
            .unwrap()
            .remove(0)
    };
    let x1 = &x[..cols];
    let xr = gpu::variant_activations(act, x1, cols).unwrap().unwrap();
    assert_ne!(xr, x1, "{dev}: {act:?} activations change X");
    let want = g
        .matmul(&gpu::core_kernel(mat.format, 1, None), mat, &xr, 1)
        .unwrap();
    assert_eq!(
        run(x1, 1),
        want,
        "{dev}: one token, {act:?} activations on the CUDA cores"
    );
    let kernel = gpu::tc_kernel(mat.format, n, cols, act, |k| g.has_tc(k))
        .unwrap_or_else(|| gpu::core_kernel(mat.format, n, None));
    let want = match kernel.starts_with("bs_tc_") {
        true => g.matmul(&kernel, mat, x, n).unwrap(),
        false => {
            let xr = gpu::variant_activations(act, x, cols).unwrap().unwrap();
            g.matmul(&kernel, mat, &xr, n).unwrap()
        }
    };
    assert_eq!(
        run(x, n),
        want,
        "{dev}: {n} tokens, {act:?} activations ({kernel})"
    );
    println!(
        "{dev}: {} {}×{cols} with {act:?} activations, 1 and {n} tokens ({kernel}): bit for bit",
        mat.format, mat.rows
    );
}

/// `bs_cu_round_bf16` on ties, subnormals, signed zeros and BF16's
/// largest value.
fn bf16_rounding_on(g: &gpu::Gpu, dev: &str) {
    use bespoke::gpu::{DevProduct, GpuAct};
    // The rounding: y = I · x with x's values as BF16 reads them (an
    // infinite one would make the other rows' 0 · x NaN; a zero comes out
    // +0, the sum of zero products).
    let vals: Vec<f32> = [
        1.0f32,
        1.0 + 2f32.powi(-8),                  // a tie, to even: 1
        1.0 + 3.0 * 2f32.powi(-8),            // a tie, to even: 1 + 2^-6
        1.0 + 2f32.powi(-8) + 2f32.powi(-20), // past the tie: up
        -0.0,
        0.0,
        1e-40,  // subnormal: to 0
        -1e-40, // to -0
        f32::MIN_POSITIVE,
        -3.3895314e38, // BF16's largest
        65504.0,
        -2.5e-30,
        std::f32::consts::PI,
        0.1,
        -7.75,
    ]
    .to_vec();
    let k = vals.len();
    let mut eye = vec![0f32; k * k];
    for i in 0..k {
        eye[i * k + i] = 1.0;
    }
    let m = Matrix::new(k, k, Weights::F32(&eye)).unwrap();
    let id = DevProduct {
        mat: std::sync::Arc::new(g.upload_matrix(&m).unwrap()),
        specialised: false,
        act: GpuAct::Bf16,
    };
    let got = g
        .ffn_finish(g.products_start(&[id], &[&vals], 1).unwrap())
        .unwrap();
    for (i, (&v, &y)) in vals.iter().zip(&got[0]).enumerate() {
        let want = f32::from_bits((bespoke::bf16act::round(v) as u32) << 16) + 0.0;
        assert_eq!(
            y.to_bits(),
            want.to_bits(),
            "{dev}: value {i}: {v:e} read as {y:e}, expected {want:e}"
        );
    }
    // `bs_cu_round_q8` the same way, over two blocks of 32: one all zeros
    // (scale 0), one with amax 127 and halves (ties, to even) below it.
    let mut vals = vec![0f32; 64];
    for (i, v) in vals[32..].iter_mut().enumerate() {
        *v = [127.0, -2.5, 3.5, -0.5, 0.5, 1.25, -126.75, 64.0][i % 8]
            * if i > 8 { 0.75 } else { 1.0 };
    }
    vals[32] = 127.0;
    let mut eye = vec![0f32; 64 * 64];
    for i in 0..64 {
        eye[i * 64 + i] = 1.0;
    }
    let m = Matrix::new(64, 64, Weights::F32(&eye)).unwrap();
    let id = DevProduct {
        mat: std::sync::Arc::new(g.upload_matrix(&m).unwrap()),
        specialised: false,
        act: GpuAct::Q8,
    };
    let got = g
        .ffn_finish(g.products_start(&[id], &[&vals], 1).unwrap())
        .unwrap();
    let want = gpu::variant_activations(GpuAct::Q8, &vals, 64)
        .unwrap()
        .unwrap();
    assert_ne!(want, vals, "{dev}: int8 activations change X");
    for (i, (&y, &w)) in got[0].iter().zip(&want).enumerate() {
        assert_eq!(
            y.to_bits(),
            (w + 0.0).to_bits(),
            "{dev}: int8 value {i}: {y:e}, expected {w:e}"
        );
    }
}

/// `bench gpu`'s attention timing (run on a GPU by tools/gpu-check.sh): each
/// kernel family times on every device, and a kernel of another family or
/// another shape is refused before anything is launched.
/// The layer kernels of a forward with every layer on the GPU, against the
/// engine's CPU code: RoPE and the additions bit for bit, RMSNorm within the
/// bound of its reordered sum of squares (each sum of d squares is within
/// (d − 1)·2^-24 of the exact one, whatever the order), in place or not.
#[test]
fn layer_kernels_match_the_engine() {
    use bespoke::engine::{rms_norm, Rope};
    use bespoke::plan::config::RopeScaling;
    for g in core_devices() {
        let dev = device_name(g);
        let mut rng = Rng(0x5EED_1A7E);
        // (rows, width): one row, widths under, at and past a block's 128
        // threads and a wide one.
        for (rows, d) in [(1usize, 64usize), (3, 96), (2, 128), (5, 130), (2, 4096)] {
            let mut x: Vec<f32> = (0..rows * d)
                .map(|i| rng.unit() * [1e-3, 1.0, 1e3][i / d % 3])
                .collect();
            x[..d].fill(0.0); // a zero row: inv = 1 / sqrt(eps)
            if rows > 2 {
                x[2 * d + 1] = 1e18; // one large value among small ones
            }
            let w: Vec<f32> = (0..d).map(|_| rng.unit() * 2.0).collect();
            let mut want = x.clone();
            rms_norm(&mut want, &w, 1e-6);
            let got = g.layer_ops(&x, Some((&w, 1e-6, false)), None, &[]).unwrap();
            let inplace = g.layer_ops(&x, Some((&w, 1e-6, true)), None, &[]).unwrap();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                inplace.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{dev}: RMSNorm {rows}×{d} in place differs"
            );
            let rel = (d as f64 + 8.0) * 2f64.powi(-24);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                let err = (*a as f64 - *b as f64).abs();
                assert!(
                    err <= rel * (*b as f64).abs() + 1e-37,
                    "{dev}: RMSNorm {rows}×{d} [{i}]: {a} against the CPU's {b}"
                );
            }
        }
        // RoPE over whole heads and over half of each (a partial rotary
        // factor), GQA-like head counts, positions far apart.
        for (heads, hd, dim) in [(4usize, 16usize, 16usize), (2, 64, 32), (3, 128, 128)] {
            let rope = Rope::new(dim, 10000.0, &RopeScaling::None, 4096);
            let rows = 3;
            let x: Vec<f32> = (0..rows * heads * hd).map(|_| rng.unit() * 4.0).collect();
            let mut tbl = vec![0.0f32; rows * hd];
            for (r, t) in tbl.chunks_exact_mut(hd).enumerate() {
                rope.table([0, 7, 3001][r], t);
            }
            let mut want = x.clone();
            for (r, row) in want.chunks_exact_mut(heads * hd).enumerate() {
                for head in row.chunks_exact_mut(hd) {
                    rope.rotate(head, &tbl[r * hd..(r + 1) * hd]);
                }
            }
            let got = g
                .layer_ops(&x, None, Some((&tbl, heads, hd, dim)), &[])
                .unwrap();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{dev}: RoPE {heads} heads of {hd} over {dim}"
            );
        }
        // A residual (as long as x) and a bias (a row's width), exactly.
        let x: Vec<f32> = (0..6 * 40).map(|_| rng.activation()).collect();
        for y in [
            (0..6 * 40).map(|_| rng.activation()).collect::<Vec<f32>>(),
            (0..40).map(|_| rng.unit()).collect(),
        ] {
            let want: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, v)| v + y[i % y.len()])
                .collect();
            let got = g.layer_ops(&x, None, None, &y).unwrap();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{dev}: adding {} values",
                y.len()
            );
        }
        // Refused: a weight of another width, RoPE wider than a head, a bias
        // that does not divide the rows.
        assert!(g
            .layer_ops(&x, Some((&[1.0; 7], 1e-6, true)), None, &[])
            .is_err());
        assert!(g
            .layer_ops(&x, None, Some((&[0.0; 40], 1, 40, 42)), &[])
            .is_err());
        assert!(g.layer_ops(&x, None, None, &[1.0; 7]).is_err());
        println!("{dev}: RMSNorm within its bound, RoPE and additions bit for bit");
    }
}

#[test]
fn attention_timing_launches_only_its_kernels() {
    let plan = bespoke::report::build_plan();
    for g in core_devices() {
        let dev = device_name(g);
        // tiny-dsv4's shape: one KV head, specialised in this build.
        let s = bespoke::plan::AttnShape {
            head_dim: 64,
            n_heads: 8,
            n_kv_heads: 1,
        };
        assert!(plan.attn_shapes.contains(&s));
        for k in [
            "bs_cu_attn_decode",
            "bs_cu_attn_decode_d64_h8_kv1",
            "bs_cu_attn_causal",
            "bs_cu_attn_causal_d64_h8_kv1",
            "bs_cu_attn_rows",
            "bs_cu_attn_rows_d64_h8",
        ] {
            let t = g.time_attention(k, s, true, 40, 5, 2).unwrap();
            assert!(t.is_finite() && t > 0.0, "{dev}: {k}: {t}");
        }
        let other = bespoke::plan::AttnShape { n_kv_heads: 2, ..s };
        for (k, shape) in [
            ("bs_cu_matvec_f32", s),
            ("bs_cu_attn_decode_d64_h8_kv1", other),
            (
                "bs_cu_attn_rows_d64_h8",
                bespoke::plan::AttnShape { n_heads: 4, ..s },
            ),
            ("bs_cu_attn_rows", other),
        ] {
            assert!(
                g.time_attention(k, shape, false, 40, 5, 1).is_err(),
                "{dev}: {k} at {shape:?}"
            );
        }
        assert!(g
            .time_attention("bs_cu_attn_rows", s, true, 40, 17, 1)
            .is_err());
    }
}

/// `score` of fixture `name` with `flags`, on the emulator and on the GPU
/// where there is one, against `score` on the CPU: the same greedy choices
/// and logits within 1e-3; `check(dev, stderr)` looks at what it said.
fn score_against_the_cpu(
    name: &str,
    flags: &[&str],
    env: &[(&str, &str)],
    check: impl Fn(&str, &str),
) {
    score_prompt_against_the_cpu(name, 0, flags, env, check)
}

/// As `score_against_the_cpu`, of the fixture's reference prompt `prompt`.
fn score_prompt_against_the_cpu(
    name: &str,
    prompt: usize,
    flags: &[&str],
    env: &[(&str, &str)],
    check: impl Fn(&str, &str),
) {
    let mut envs: Vec<(&str, Vec<(&str, &str)>)> =
        vec![("emulator", [&[("BESPOKE_CUDA", "emu")], env].concat())];
    if gpu_or_reason().is_some() {
        envs.push(("GPU", env.to_vec()));
    }
    let (ok, cpu, err) = score_prompt(name, prompt, &[], &[("BESPOKE_CUDA", "off")]);
    assert!(ok, "{name} on the CPU: {err}");
    let cpu = last_logits(&cpu);
    for (dev, env) in &envs {
        let (ok, out, err) = score_prompt(name, prompt, flags, env);
        assert!(ok, "{name} on the {dev}: {err}");
        check(dev, &err);
        let (am, l) = last_logits(&out);
        assert_eq!(am, cpu.0, "{name} on the {dev}: greedy choices");
        let dist = largest_difference(&l, &cpu.1);
        assert!(dist < 1e-3, "{name} on the {dev}: logits moved by {dist}");
        println!(
            "{name} {flags:?} on the {dev}: the CPU's greedy choices, logits within {dist:.1e}"
        );
    }
}

/// The CLI with the VRAM tier: `score` runs with the fixtures' matrices on the
/// GPU (and on the emulator), says so, and gives the CPU's greedy choices
/// with logits within 1e-3 of its own. (The full token-exact oracle checks
/// run in tests/engine.rs and tests/dsv4.rs with BESPOKE_TEST_VRAM set: by
/// tools/gpu-check.sh on a GPU, by .ci/run on the emulator.)
#[test]
fn score_runs_with_every_matrix_in_the_vram_tier() {
    for name in ["tiny-llama", "tiny-qwen3-moe", "tiny-dsv4"] {
        score_against_the_cpu(name, &["--vram", "4"], &[], |dev, err| {
            assert!(
                err.contains("CUDA: VRAM tier"),
                "{name} on the {dev}: {err}"
            );
            // Attention goes with its keys to the GPU (DeepSeek V4's too).
            assert!(
                err.contains("attention on the GPU for sequences of up to"),
                "{name} on the {dev}: {err}"
            );
            assert!(!err.contains("failed"), "{name} on the {dev}: {err}");
            // The Llama family's forwards run with every layer there.
            assert_eq!(
                err.contains("each forward with every layer on the GPU"),
                name != "tiny-dsv4",
                "{name} on the {dev}: {err}"
            );
            assert_eq!(
                whole_layers_run(err) > 0,
                name != "tiny-dsv4",
                "{name} on the {dev}: {err}"
            );
        });
    }
    // And with BESPOKE_CUDA_LAYERS=off block by block, the same tokens.
    score_against_the_cpu(
        "tiny-llama",
        &["--vram", "4"],
        &[("BESPOKE_CUDA_LAYERS", "off")],
        |dev, err| {
            assert!(
                err.contains("layers block by block (BESPOKE_CUDA_LAYERS=off)"),
                "tiny-llama on the {dev}: {err}"
            );
        },
    );
}

/// A budget that holds only some routed experts: in each MoE layer the
/// resident experts run whole on the GPU while the rest run on the CPU at
/// the same time, and the outputs still add up in expert order: the CPU's
/// greedy choices, logits within 1e-3.
#[test]
fn score_runs_with_some_experts_in_the_vram_tier() {
    // Budgets (GiB) that hold every dense matrix and part of the experts:
    // tiny-qwen3-moe's 0.0002 leaves its attention on the CPU, so its layers
    // go block by block; 0.00058 also holds its KV cache, so each forward
    // runs with every layer on the GPU and the other experts on the CPU.
    for (name, gib) in [
        ("tiny-qwen3-moe", "0.0002"),
        ("tiny-qwen3-moe", "0.00058"),
        ("tiny-dsv4", "0.0007"),
    ] {
        score_against_the_cpu(name, &["--vram", gib], &[], |dev, err| {
            let line = err
                .lines()
                .find(|l| l.contains("CUDA: VRAM tier"))
                .unwrap_or("");
            let counts: Vec<usize> = line
                .split(" routed experts")
                .next()
                .and_then(|h| h.rsplit(", ").next())
                .map(|h| h.split(" of ").filter_map(|v| v.parse().ok()).collect())
                .unwrap_or_default();
            assert!(
                counts.len() == 2 && counts[0] > 0 && counts[0] < counts[1],
                "{name} on the {dev}: some but not all experts resident: {line}"
            );
            assert!(!err.contains("failed"), "{name} on the {dev}: {err}");
            // Qwen3-MoE's forwards run with every layer on the GPU, the
            // experts where they are.
            assert_eq!(
                err.contains(
                    "each forward with every layer on the GPU (f32 activations, routed experts where they are)"
                ),
                gib == "0.00058",
                "{name} on the {dev}: {err}"
            );
        });
    }
    // And block by block with the GPU's attention and part of the experts
    // (BESPOKE_CUDA_LAYERS=off).
    score_against_the_cpu(
        "tiny-qwen3-moe",
        &["--vram", "0.00058"],
        &[("BESPOKE_CUDA_LAYERS", "off")],
        |dev, err| {
            assert!(
                err.contains("4 of 8 routed experts")
                    && err.contains("layers block by block (BESPOKE_CUDA_LAYERS=off)"),
                "tiny-qwen3-moe on the {dev}: {err}"
            );
        },
    );
}

/// A GPU that fails mid-way: the emulator's fault injection
/// (`BESPOKE_CUDA_EMU_FAIL=KERNEL[:N[+]]`) fails a launch as a faulting GPU
/// would, and each path says so once and runs that work on the CPU: the
/// CPU's greedy choices and logits within 1e-3, as without a failure. (On a
/// GPU the setting does nothing, and only the results are checked.)
#[test]
fn gpu_failures_fall_back_to_the_cpu() {
    let injected = "(BESPOKE_CUDA_EMU_FAIL)";
    // (fixture, its reference prompt, BESPOKE_CUDA_EMU_FAIL, whole layers,
    // what stderr must say)
    let cases = [
        // In layer 1 of a forward with every layer on the GPU (its in_norm:
        // layer 0 made 4 norms), after layer 0 routed its tokens.
        (
            "tiny-qwen3-moe",
            0,
            "bs_cu_rmsnorm:5",
            true,
            vec!["a forward on the GPU failed", injected],
        ),
        (
            "tiny-llama",
            0,
            "bs_cu_attn:1",
            false,
            vec!["attention on the GPU failed", injected],
        ),
        (
            "tiny-llama",
            0,
            "bs_cu_m:1",
            false,
            vec!["a list of products on the GPU failed", injected],
        ),
        (
            "tiny-llama",
            0,
            "bs_cu_m:4",
            false,
            vec!["a GPU product failed", injected],
        ),
        (
            "tiny-dsv4",
            0,
            "bs_cu_swiglu:2",
            false,
            vec!["a SwiGLU block on the GPU failed", injected],
        ),
        (
            "tiny-dsv4",
            0,
            "bs_cu_attn_rows:3",
            false,
            vec!["attention on the GPU failed", injected],
        ),
        // DeepSeek V4's lightning indexer, on a prompt long enough (82
        // tokens) for its CSA layers' queries to choose among their entries.
        (
            "tiny-dsv4",
            2,
            "bs_cu_index_scores:2",
            false,
            vec!["attention on the GPU failed (bs_cu_index_scores: injected"],
        ),
        // The device gone for good after 40 launches: everything after
        // fails, and everything runs on the CPU.
        (
            "tiny-qwen3-moe",
            0,
            "*:40+",
            true,
            vec!["a forward on the GPU failed", injected],
        ),
        ("tiny-dsv4", 0, "*:40+", false, vec!["failed", injected]),
        // A setting that makes no sense is named in the failure it causes.
        (
            "tiny-llama",
            0,
            "bs_cu_m:0",
            true,
            vec!["BESPOKE_CUDA_EMU_FAIL=bs_cu_m:0: expected KERNEL"],
        ),
    ];
    for (name, prompt, fail, layers, said) in cases {
        let mut env = vec![("BESPOKE_CUDA_EMU_FAIL", fail)];
        if !layers {
            env.push(("BESPOKE_CUDA_LAYERS", "off"));
        }
        score_prompt_against_the_cpu(name, prompt, &["--vram", "4"], &env, |dev, err| {
            if dev == "emulator" {
                assert!(
                    said.iter().all(|w| err.contains(w)),
                    "{name} with {fail}: {err}"
                );
            }
        });
    }
}

/// A forward with every layer on the GPU that fails after its MoE layers
/// routed their tokens is run again on the CPU, and its experts' usage
/// counts once, not twice.
#[test]
fn a_failed_gpu_forward_counts_expert_usage_once() {
    let dir = common::fixture_copy("tiny-qwen3-moe", "gpu-usage");
    let out = common::bespoke_command()
        .args([
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3,4",
        ])
        .args(["--max-new-tokens", "3", "--vram", "4"])
        .envs([
            ("BESPOKE_CUDA", "emu"),
            ("BESPOKE_CUDA_EMU_FAIL", "bs_cu_rmsnorm:5"),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("each forward with every layer on the GPU")
            && err.contains("a forward on the GPU failed")
            && err.contains("injected failure"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join(".bespoke/expert-usage.json")).unwrap(),
    )
    .unwrap();
    let counts: Vec<Vec<u64>> = serde_json::from_value(v["counts"].clone()).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let top_k = cfg["num_experts_per_tok"].as_u64().unwrap();
    // 6 forwarded tokens (the 4 of the prompt, then 2 decode steps).
    for l in counts.iter().filter(|l| !l.is_empty()) {
        assert_eq!(l.iter().sum::<u64>(), 6 * top_k, "{counts:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The layers a run's forwards ran with every layer on the GPU, from its
/// closing `CUDA: ran on the GPU: …` line (0 without one).
fn whole_layers_run(err: &str) -> u64 {
    err.lines()
        .find_map(|l| l.strip_prefix("CUDA: ran on the GPU: "))
        .and_then(|l| l.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// `--numerics deepseek` (DeepSeek V4 with FP8-simulated activations
/// before its FP8 and FP4 products) on the device: its SwiGLU blocks run
/// whole and its lists of products go together, the device making those
/// activations (`bs_cu_round_fp8sim`); the CPU's greedy choices, logits
/// within 1e-3 of the CPU's own `--numerics deepseek`.
#[test]
fn deepseek_numerics_run_whole_on_the_device() {
    let flags = ["--numerics", "deepseek"];
    let (ok, cpu, err) = score_last("tiny-dsv4", &flags, &[("BESPOKE_CUDA", "off")]);
    assert!(ok, "{err}");
    let mut envs = vec![("emulator", vec![("BESPOKE_CUDA", "emu")])];
    if gpu_or_reason().is_some() {
        envs.push(("GPU", vec![]));
    }
    for (dev, env) in envs {
        let (ok, out, err) =
            score_last("tiny-dsv4", &[&flags[..], &["--vram", "4"]].concat(), &env);
        assert!(ok && !err.contains("failed"), "{dev}: {err}");
        let work = err
            .lines()
            .find_map(|l| l.strip_prefix("CUDA: ran on the GPU: "))
            .unwrap_or_default();
        let count = |what: &str| -> u64 {
            let end = work.find(what).unwrap_or(0);
            work[..end]
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        assert!(
            count(" SwiGLU blocks whole") > 0 && count(" batches of products") > 0,
            "{dev}: {err}"
        );
        let ((a, lc), (b, lg)) = (last_logits(&cpu), last_logits(&out));
        let dist = largest_difference(&lc, &lg);
        assert_eq!(a, b, "{dev}: greedy choices");
        assert!(dist < 1e-3, "{dev}: logits moved by {dist}");
        println!("tiny-dsv4 --numerics deepseek on the {dev}: {work}; logits within {dist:.1e}");
    }
}

/// The largest |a_i - b_i|.
fn largest_difference(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

/// `score --json --logits last` output: (argmax per position, last logits).
fn last_logits(out: &str) -> (Vec<serde_json::Value>, Vec<f64>) {
    let v: serde_json::Value = serde_json::from_str(out).unwrap();
    let l = v["last_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    (v["argmax"].as_array().unwrap().clone(), l)
}

/// `score --json --logits last` of a fixture's first reference prompt with
/// `extra` flags and environment: (ok, stdout, stderr).
fn score_last(model: &str, extra: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    score_prompt(model, 0, extra, env)
}

/// As `score_last`, of the fixture's reference prompt `prompt`.
fn score_prompt(
    model: &str,
    prompt: usize,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (bool, String, String) {
    let (_, r) = common::fixture(model);
    let ids: Vec<String> = r["prompts"][prompt]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let dir = format!("fixtures/{model}");
    let ids = ids.join(",");
    let out = common::bespoke_command()
        .args([
            "score", "--model", &dir, "--ids", &ids, "--json", "--logits", "last",
        ])
        .args(extra)
        .envs(env.iter().copied())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// The activation variants with every matrix in VRAM: their prefill products
/// go to the tensor-core kernel of the same numerics (`--bf16-act bf16` and
/// `--fp8-act bf16`: BF16 mma; `--fp4-act q8`: the INT8 mma, the CPU's
/// fp4×q8 bit for bit), and the products that stay on the CUDA cores get the
/// variant's activations too (`gpu::variant_activations`). So only the
/// order of the sums differs from the same variant on the CPU (and, for the
/// Llama family, attention's, which runs on the GPU too). A variant rounds
/// every product's activations, and a last-bit difference that sends one
/// across a rounding boundary moves it by a whole BF16 step (2⁻⁸) or int8
/// step: that is how attention on the GPU, about 10⁻⁷ relative from the
/// CPU's, moved tiny-llama's `--bf16-act bf16` logits by 0.058 of 29. So the
/// logits must stay within 5·10⁻³ of the largest (the variant itself moves
/// them 0.18 from the f32 model) and every greedy choice must agree.
/// (Before the CUDA-core products took the variant's activations, the
/// emulator showed them 0.7 apart for `--fp4-act q8` on tiny-dsv4, whose
/// largest logit is under 30.)
#[test]
fn activation_variants_take_the_tensor_cores() {
    let mut devs: Vec<(&gpu::Gpu, Vec<(&str, &str)>)> =
        vec![(gpu::emulator(), vec![("BESPOKE_CUDA", "emu")])];
    if let Some(g) = gpu_or_reason() {
        devs.push((g, vec![]));
    }
    for (g, env) in devs {
        variants_on(g, &env);
    }
}

/// The start-up check: a device whose kernels give wrong answers
/// (`BESPOKE_CUDA_EMU_WRONG`, the emulator's) is not trusted with them. A
/// tensor-core path that fails is turned off and its products run on the
/// CUDA cores (whole layers still on the device); a CUDA-core product or
/// an attention kernel that fails keeps the engine on the CPU. Each run says which kernel failed,
/// and gives the CPU's answer. Without the check the wrong kernel's products
/// would reach the logits. (Emulator only: a GPU ignores the hook.)
#[test]
fn a_device_that_fails_its_start_up_check_is_not_trusted() {
    let plan = |wrong: &str| {
        let out = common::bespoke_command()
            .arg("plan")
            .envs([("BESPOKE_CUDA", "emu"), ("BESPOKE_CUDA_EMU_WRONG", wrong)])
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = plan("bs_cu_attn_causal");
    assert!(
        text.contains("CUDA: running on the CPU: the device failed its start-up check: bs_cu_attn_causal (head_dim 64"),
        "{text}"
    );
    let text = plan("bs_tc_bf16_fp8");
    assert!(
        text.contains("tensor-core path mma_bf16 off, its products on the CUDA cores: \
             the start-up check found bs_tc_bf16_fp8 (fp8 136×256, 3 tokens, BF16 activations): output 0: "),
        "{text}"
    );
    for (model, flags, wrong, said, on_gpu) in [
        (
            "tiny-qwen3-moe",
            &["--bf16-act", "bf16"][..],
            "bs_tc_bf16",
            "tensor-core path mma_bf16 off, its products on the CUDA cores: the start-up check found bs_tc_bf16_",
            true,
        ),
        (
            "tiny-dsv4",
            &["--fp4-act", "q8"][..],
            "bs_tc_q8",
            "tensor-core path mma_int8 off, its products on the CUDA cores: the start-up check found bs_tc_q8_fp4",
            true,
        ),
        (
            "tiny-llama",
            &[][..],
            "bs_cu_matvec_f32",
            "VRAM tier not used: --vram given, but the device failed its start-up check: \
             bs_cu_matvec_f32 (f32 136×256, 1 token, f32 activations): output 0: ",
            false,
        ),
    ] {
        let (ok, cpu, err) = score_last(model, flags, &[("BESPOKE_CUDA", "off")]);
        if !ok {
            println!("{model} {flags:?}: not available on this CPU ({err}); not run");
            continue;
        }
        let env = [("BESPOKE_CUDA", "emu"), ("BESPOKE_CUDA_EMU_WRONG", wrong)];
        let (ok, out, err) = score_last(model, &[flags, &["--vram", "4"]].concat(), &env);
        assert!(ok && err.contains(said), "{model} with {wrong}: {err}");
        assert_eq!(
            err.contains("CUDA: VRAM tier not used"),
            !on_gpu,
            "{model} with {wrong}: {err}"
        );
        if model == "tiny-qwen3-moe" {
            assert!(whole_layers_run(&err) > 0, "{err}");
        }
        let ((a, lc), (b, lg)) = (last_logits(&cpu), last_logits(&out));
        let dist = largest_difference(&lc, &lg);
        assert_eq!(a, b, "{model} with {wrong}: greedy choices");
        assert!(
            if on_gpu { dist < 1e-3 } else { dist == 0.0 },
            "{model} with {wrong}: logits moved by {dist}"
        );
        println!("{model} {flags:?} with {wrong}: turned away, the CPU's answer within {dist:.1e}");
    }
}

fn variants_on(g: &gpu::Gpu, env: &[(&str, &str)]) {
    let dev = device_name(g);
    for (model, flag, value, key) in [
        ("tiny-llama", "--bf16-act", "bf16", "mma_bf16"),
        ("tiny-qwen3-moe", "--bf16-act", "bf16", "mma_bf16"),
        ("tiny-dsv4", "--fp8-act", "bf16", "mma_bf16"),
        ("tiny-dsv4", "--fp4-act", "q8", "mma_int8"),
    ] {
        if !tc_on(g, key) {
            println!("{dev}: {flag} {value}: no {key}; not run");
            continue;
        }
        let (ok, cpu, err) = score_last(model, &[flag, value], &[("BESPOKE_CUDA", "off")]);
        if !ok {
            // The CPU cannot run the variant (bf16dot needs AVX512_BF16): the
            // engine then never asks the GPU for it either.
            assert!(err.contains(flag), "{err}");
            println!("{flag} {value}: not available on this CPU ({err}); not run");
            continue;
        }
        let (ok, gpu_out, err) = score_last(model, &[flag, value, "--vram", "4"], env);
        assert!(
            ok && err.contains("CUDA: VRAM tier") && !err.contains("failed"),
            "{dev}: {model} {flag} {value}: {err}"
        );
        // The Llama family's forwards run with every layer on the device,
        // each product with the variant's activations.
        assert_eq!(
            err.contains(&format!(
                "each forward with every layer on the GPU (the activations of {flag} {value}"
            )) && whole_layers_run(&err) > 0,
            model != "tiny-dsv4",
            "{dev}: {model} {flag} {value}: {err}"
        );
        let ((a, lc), (b, lg)) = (last_logits(&cpu), last_logits(&gpu_out));
        let dist = largest_difference(&lc, &lg);
        let scale = lc.iter().map(|x| x.abs()).fold(0.0, f64::max);
        assert!(
            dist < 5e-3 * scale,
            "{dev}: {model} {flag} {value}: moved the logits by {dist} (largest {scale})"
        );
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        assert_eq!(
            same,
            a.len(),
            "{dev}: {model} {flag} {value}: {same} of {} greedy choices agree",
            a.len()
        );
        println!(
            "{dev}: {model} {flag} {value}: within {dist:.2e} of the CPU, {same}/{} greedy choices",
            a.len()
        );
    }
}

#[test]
fn mxf4_rounding_of_the_exact_check_follows_its_definition() {
    // Runs without a GPU: the rounding the tensor-core checks compare against.
    // A block with max 4: scale 2^(2 - 2) = 1; ties go to the even code.
    let mut b = vec![0f32; 32];
    b[..9].copy_from_slice(&[4.0, 0.6, -2.9, 1.25, 1.75, 0.25, -0.0, 3.5, 5.5]);
    let q = mxf4_round(&b);
    assert_eq!(&q[..9], &[4.0, 0.5, -3.0, 1.0, 2.0, 0.0, -0.0, 4.0, 6.0]);
    assert!(q[6].is_sign_negative());
    // Max 0.75: scale 2^(-1 - 2) = 1/8, so 0.75 is 6 · 1/8 and 0.1 is 0.8 → 1.
    let mut b = vec![0f32; 32];
    b[0] = 0.75;
    b[1] = 0.1;
    let q = mxf4_round(&b);
    assert_eq!((q[0], q[1]), (0.75, 0.125));
}
