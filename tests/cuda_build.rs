//! The CUDA kernel build, without a GPU: templates/cuda.cu.tera rendered by the
//! build's own code (src/cuda_build.rs) and compiled by the installed nvcc for
//! every supported arch, tensor-core paths on and off; the PTX must contain each
//! tensor-core instruction exactly when the plan gated it on; a simulated
//! older toolkit compiles the paths it lacks out and still builds.
//!
//! Needs nvcc (tools/setup.sh --cuda installs it from PyPI, or CUDA_HOME).
//! Set BESPOKE_SKIP_CUDA_TESTS=1 to skip these tests on a machine without it;
//! they then say loudly that they did not run.

mod plan {
    pub use bespoke::plan::*;
}
#[path = "../src/cuda_build.rs"]
#[allow(dead_code)]
mod cuda_build;

use bespoke::plan::cuda::{self, Arch, TcPath, TC_PATHS};
use bespoke::plan::{AttnShape, Format, MatShape};
use cuda_build::Toolkit;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn env(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.is_empty())
}

/// The toolkit, or None when skipping was asked for.
fn toolkit(version: Option<&str>) -> Option<Toolkit> {
    match cuda_build::find_nvcc(&env) {
        Ok(nvcc) => Some(cuda_build::toolkit(nvcc, version).expect("nvcc --version")),
        Err(e) => {
            if env("BESPOKE_SKIP_CUDA_TESTS").is_some() {
                eprintln!("SKIPPED (BESPOKE_SKIP_CUDA_TESTS): {e}");
                None
            } else {
                panic!(
                    "{e}\n(run tools/setup.sh --cuda, or set BESPOKE_SKIP_CUDA_TESTS=1 to skip)"
                );
            }
        }
    }
}

/// A small specialised set (one shape per format, one attention shape), so
/// the matrix of archs compiles quickly; the generic kernels are always there.
fn shapes() -> (Vec<MatShape>, Vec<AttnShape>) {
    let m = |format, rows, cols| MatShape { format, rows, cols };
    (
        vec![
            m(Format::F32, 64, 64),
            m(Format::Bf16, 64, 128),
            m(Format::Fp8, 256, 256),
            m(Format::Fp4, 128, 256),
        ],
        vec![AttnShape {
            head_dim: 64,
            n_heads: 8,
            n_kv_heads: 2,
        }],
    )
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("bespoke-cuda-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Render + compile one arch; returns the PTX text and the cubin size.
fn build_one(tk: &Toolkit, arch: Arch, tc_off: bool, dir: &Path) -> Result<(String, u64), String> {
    let (mats, attn) = shapes();
    let tc = cuda::decide(arch, tk.version, tc_off);
    let template = std::fs::read_to_string(root().join("templates/cuda.cu.tera")).unwrap();
    let src = cuda_build::render(&template, arch, &tc, &mats, &attn)?;
    let cu = dir.join(format!("{}.cu", arch.name()));
    std::fs::write(&cu, src).unwrap();
    let (ptx, cubin) = cuda_build::compile(tk, &root().join("kernels"), &cu, arch, dir, true)?;
    let text = std::fs::read_to_string(ptx).unwrap();
    let size = std::fs::metadata(cubin).map_err(|e| e.to_string())?.len();
    Ok((text, size))
}

/// Check the PTX against the decisions: each tensor-core instruction present
/// exactly when its path is on; the CUDA-core kernels always.
fn check_ptx(arch: Arch, tc_off: bool, version: (u32, u32), ptx: &str) -> Vec<String> {
    let mut bad = Vec::new();
    for d in cuda::decide(arch, version, tc_off) {
        let has = ptx.contains(d.path.ptx_marker());
        if has != d.on {
            bad.push(format!(
                "{arch} tc_off={tc_off}: {} is {} but its instruction is {} the PTX",
                d.path.key(),
                if d.on { "on" } else { "off" },
                if has { "in" } else { "not in" }
            ));
        }
    }
    for k in [
        "bs_cu_matvec_fp4",
        "bs_cu_matmul_fp8",
        "bs_cu_matvec_bf16_64x128",
        "bs_cu_attn_decode_d64_h8_kv2",
        "bs_cu_attn_causal",
        "bs_cu_attn_causal_d64_h8_kv2",
        "bs_cu_attn_rows",
        "bs_cu_index_scores",
        "bs_cu_rmsnorm",
        "bs_cu_rope",
        "bs_cu_add",
        "bs_cu_round_bf16",
        "bs_cu_round_q8",
        "bs_cu_round_fp8sim",
    ] {
        if !ptx.contains(&format!(".entry {k}(")) {
            bad.push(format!("{arch}: kernel {k} missing from the PTX"));
        }
    }
    bad
}

#[test]
fn every_arch_compiles_with_tensor_cores_on_and_off() {
    let Some(tk) = toolkit(None) else { return };
    let archs = [
        "sm_80", "sm_86", "sm_87", "sm_89", "sm_90a", "sm_100a", "sm_120a", "sm_121", "sm_121a",
    ];
    let jobs: Vec<(Arch, bool)> = archs
        .iter()
        .flat_map(|a| [false, true].map(|off| (Arch::parse(a).unwrap(), off)))
        .collect();
    let par = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .max(2);
    let mut failures = Vec::new();
    let mut seen_on = std::collections::BTreeSet::new();
    for chunk in jobs.chunks(par) {
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = chunk
                .iter()
                .map(|&(arch, off)| {
                    let tk = &tk;
                    s.spawn(move || {
                        let dir = tmpdir(&format!(
                            "{}-{}",
                            arch.name(),
                            if off { "off" } else { "on" }
                        ));
                        let r = build_one(tk, arch, off, &dir);
                        let _ = std::fs::remove_dir_all(&dir);
                        (arch, off, r)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (arch, off, r) in results {
            match r {
                Ok((ptx, cubin)) => {
                    assert!(cubin > 0, "{arch}: empty cubin");
                    failures.extend(check_ptx(arch, off, tk.version, &ptx));
                    for d in cuda::decide(arch, tk.version, off).iter().filter(|d| d.on) {
                        seen_on.insert(d.path.key());
                    }
                    println!(
                        "{arch} tensor cores {}: ok ({} KiB cubin)",
                        if off { "off" } else { "on " },
                        cubin / 1024
                    );
                }
                Err(e) => failures.push(format!("{arch} tc_off={off}: {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // With a current toolkit every path is on somewhere in this matrix.
    if tk.version >= (12, 9) {
        for p in TC_PATHS {
            assert!(seen_on.contains(p.key()), "{} was on for no arch", p.key());
        }
    }
}

#[test]
fn an_older_toolkit_compiles_the_newer_paths_out_and_still_builds() {
    // CUDA 12.6 predates block-scaled mma (12.8): sm_120a keeps its BF16, INT8
    // and FP8 paths, loses MXFP4, and builds. CUDA 12.3 also loses FP8 mma.
    for (version, arch, off_paths, on_paths) in [
        (
            "12.6",
            "sm_120a",
            vec![TcPath::MmaMxf4],
            vec![TcPath::MmaBf16, TcPath::MmaFp8],
        ),
        (
            "12.3",
            "sm_89",
            vec![TcPath::MmaFp8],
            vec![TcPath::MmaBf16, TcPath::MmaInt8],
        ),
    ] {
        let Some(tk) = toolkit(Some(version)) else {
            return;
        };
        let arch = Arch::parse(arch).unwrap();
        let dir = tmpdir(&format!("old-{version}"));
        let (ptx, _) = build_one(&tk, arch, false, &dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(check_ptx(arch, false, tk.version, &ptx).is_empty());
        let d = cuda::decide(arch, tk.version, false);
        for p in off_paths {
            let x = d.iter().find(|x| x.path == p).unwrap();
            assert!(!x.on && x.why.contains(&format!("CUDA {version}")), "{x:?}");
            assert!(!ptx.contains(p.ptx_marker()));
        }
        for p in on_paths {
            assert!(
                ptx.contains(p.ptx_marker()),
                "{arch} with CUDA {version} lost {}",
                p.key()
            );
        }
    }
}

#[test]
fn the_build_step_embeds_images_and_warns_about_what_it_skipped() {
    let Some(_) = toolkit(None) else { return };
    let out = tmpdir("build");
    let (mats, attn) = shapes();
    let inputs = cuda_build::CudaInputs {
        root: &root(),
        out: &out,
        arch_spec: Some("sm_89,sm_120a".into()),
        tc_off: false,
        version_override: Some("12.3".into()),
        werror: true,
        env: &env,
        shapes: &mats,
        attn: &attn,
    };
    let mut warnings = Vec::new();
    let (plan, table) = cuda_build::build(&inputs, &mut warnings).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    assert_eq!(plan.toolkit.as_deref(), Some("12.3"));
    assert!(plan
        .toolkit_note
        .as_deref()
        .unwrap()
        .contains("BESPOKE_CUDA_VERSION"));
    // sm_89 builds without its FP8 path, with a build warning naming it.
    let a89 = plan
        .archs
        .iter()
        .find(|a| a.arch.name() == "sm_89")
        .unwrap();
    assert!(a89.compiled);
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("sm_89") && w.contains("FP8") && w.contains("CUDA 12.3")),
        "{warnings:?}"
    );
    // sm_120a (and with it the block-scaled FP4 path) is out: 12.3 cannot
    // target it. Reported, not fatal.
    let a120 = plan
        .archs
        .iter()
        .find(|a| a.arch.name() == "sm_120a")
        .unwrap();
    assert!(!a120.compiled && a120.why_not.as_deref().unwrap().contains("needs 12.8"));
    assert!(warnings.iter().any(|w| w.contains("sm_120a skipped")));
    // One cubin per built arch, plus PTX for forward compatibility.
    for img in ["\"sm_89\", ptx: false", "\"compute_80\", ptx: true"] {
        assert!(table.contains(img), "{img} not in\n{table}");
    }
    assert!(!table.contains("sm_120a"));
    assert_eq!(plan.ptx.map(|a| a.compute()), Some("compute_80".into()));
}

#[test]
fn no_nvcc_means_no_gpu_kernels_and_says_why() {
    let nothing = |_: &str| None::<String>;
    let out = tmpdir("none");
    let (mats, attn) = shapes();
    let inputs = cuda_build::CudaInputs {
        root: &root(),
        out: &out,
        arch_spec: None,
        tc_off: false,
        version_override: None,
        werror: false,
        env: &nothing,
        shapes: &mats,
        attn: &attn,
    };
    // Only meaningful where /usr/local/cuda is absent (the fallback location).
    if Path::new("/usr/local/cuda/bin/nvcc").exists() {
        eprintln!("/usr/local/cuda/bin/nvcc exists: the no-toolkit case cannot be simulated here");
        return;
    }
    let mut warnings = Vec::new();
    let (plan, table) = cuda_build::build(&inputs, &mut warnings).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    let why = plan.skipped.unwrap();
    assert!(
        why.contains("nvcc not found") && why.contains("runs on the CPU"),
        "{why}"
    );
    assert!(warnings[0].contains("no GPU kernels were built"));
    assert!(!table.contains("include_bytes"));
}

/// The emulator's rendering (BESPOKE_CUDA=emu): every CUDA-core kernel and
/// every tensor-core kernel (cuda::EMU_TC names them all), and the kernel table names exactly the kernels defined.
#[test]
fn the_emulator_gets_the_cuda_core_kernels_and_a_table_of_them() {
    let (shapes, attn) = shapes();
    let template = std::fs::read_to_string(root().join("templates/cuda.cu.tera")).unwrap();
    let src = cuda_build::emulator_render(&template, &shapes, &attn).unwrap();
    // Every tensor-core path goes through the emulator's operations (their
    // asm only in the branch nvcc compiles).
    assert!(src.contains("bs_emu_mma_mxf4(c, a, b, sa, sb)"));
    assert!(src.contains("bs_emu_wgmma_bf16(d, a, desc)"));
    assert!(src.contains("bs_emu_tcgen05_mxf4(tmem, da, db, idesc, acc, tsa, tsb)"));
    for path in TC_PATHS {
        assert!(
            cuda::EMU_TC.contains(&path.key()),
            "{} is not emulated",
            path.key()
        );
    }
    let names = cuda_build::kernel_names(&src);
    for k in [
        "bs_tc_bf16_bf16",
        "bs_tc_bf16_fp4",
        "bs_tc_q8_fp4",
        "bs_cu_quant_q8",
        "bs_tc_fp8_fp8",
        "bs_cu_quant_mxf4",
        "bs_tc_mxf4_fp4",
        "bs_tc_wgmma_bf16",
        "bs_tc_wgmma_fp4",
        "bs_tc_tcgen05_fp4",
    ] {
        assert!(names.iter().any(|n| n == k), "{k} missing from {names:?}");
    }
    for f in ["f32", "bf16", "fp8", "fp4"] {
        for op in ["matvec", "matmul"] {
            let k = format!("bs_cu_{op}_{f}");
            assert!(names.contains(&k), "{k} missing from {names:?}");
        }
    }
    assert!(names.contains(&"bs_cu_attn_decode".to_string()));
    assert!(names.contains(&"bs_cu_attn_causal".to_string()));
    assert!(names.contains(&"bs_cu_attn_rows".to_string()));
    for k in [
        "bs_cu_index_scores",
        "bs_cu_rmsnorm",
        "bs_cu_rope",
        "bs_cu_add",
        "bs_cu_round_bf16",
        "bs_cu_round_q8",
        "bs_cu_round_fp8sim",
    ] {
        assert!(names.contains(&k.to_string()), "{k} missing from {names:?}");
    }
    // Every specialised shape has its kernels.
    for s in &shapes {
        let k = format!("bs_cu_matvec_{}_{}x{}", s.format.name(), s.rows, s.cols);
        assert!(names.contains(&k), "{k} missing");
    }
    // The parser: launch bounds with nested parentheses, several per line.
    assert_eq!(
        cuda_build::kernel_names(
            "extern \"C\" __global__ void __launch_bounds__(32 * (2 + 2)) a_1(int x) {}\n\
             extern \"C\" __global__ void b(float *y) {} __global__ void c2() {}"
        ),
        ["a_1", "b", "c2"]
    );
    let unit = cuda_build::emulator_unit(Path::new("/o/emu.cu"), &names[..2]);
    assert!(unit.contains("#include \"/o/emu.cu\""));
    assert!(unit.contains(&format!("bs_emu_call({}, a)", names[1])));
}
