//! Human-readable reports: the `bespoke plan` tables.

use crate::kernels::{self, Kernels, COMPILED_ISAS};
use crate::plan::{self, Format, Isa, Plan, PlannedModel};
use std::fmt::Write as _;

/// The plan build.rs used (embedded in the binary).
pub fn build_plan() -> Plan {
    serde_json::from_str(kernels::BUILD_PLAN_JSON).expect("build.rs writes a valid plan.json")
}

/// Short name of a model source (its directory name, or the file name).
pub fn short_source(source: &str) -> String {
    let p = std::path::Path::new(source);
    let name = if p.file_name().and_then(|f| f.to_str()) == Some("config.json") {
        p.parent().and_then(|d| d.file_name())
    } else {
        p.file_name()
    };
    name.and_then(|n| n.to_str()).unwrap_or(source).to_string()
}

fn table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::from("  ");
        for (i, c) in cells.iter().enumerate() {
            let pad = width[i] - c.chars().count();
            s += c;
            if i + 1 < cells.len() {
                s += &" ".repeat(pad + 2);
            }
        }
        s.trim_end().to_string()
    };
    writeln!(
        out,
        "{}",
        line(header.iter().map(|s| s.to_string()).collect())
    )
    .unwrap();
    writeln!(
        out,
        "{}",
        line(width.iter().map(|w| "-".repeat(*w)).collect())
    )
    .unwrap();
    for r in rows {
        writeln!(out, "{}", line(r.clone())).unwrap();
    }
}

/// The ISA / dispatch / threads section.
pub fn variants_report(
    choice: &Result<kernels::Choice, kernels::KernelError>,
    threads: usize,
) -> String {
    let mut out = String::new();
    writeln!(
        out,
        "CPU: {} ({})",
        crate::cpu::cpu_name(),
        std::env::consts::ARCH
    )
    .unwrap();
    let rows: Vec<Vec<String>> = COMPILED_ISAS
        .iter()
        .map(|&isa| {
            let d = isa.desc();
            let missing = crate::cpu::missing_features(isa);
            let status = if missing.is_empty() {
                "runnable".to_string()
            } else {
                format!("not on this CPU (lacks {})", missing.join(", "))
            };
            let feats = if d.cpu_features.is_empty() {
                "-".to_string()
            } else {
                d.cpu_features.join("+")
            };
            vec![d.name.to_string(), d.score.to_string(), feats, status]
        })
        .collect();
    writeln!(out, "\nkernel variants compiled into this binary:").unwrap();
    table(&mut out, &["variant", "score", "needs", "status"], &rows);
    match choice {
        Ok(c) => writeln!(out, "\ndispatch uses: {} — {}", c.kernels.isa(), c.reason).unwrap(),
        Err(e) => writeln!(out, "\ndispatch: error: {e}").unwrap(),
    }
    writeln!(
        out,
        "(BESPOKE_KERNELS=scalar|avx2|avx512|neon|neon_base forces one variant)"
    )
    .unwrap();
    match kernels::fp8_scaled() {
        Ok(f) if !f.isas.is_empty() => writeln!(
            out,
            "FP8 \"s\" tiles (x times 2^120; subnormal codes become f32 subnormals): {} — {} (BESPOKE_FP8_SCALED=auto|on|off)",
            f.summary(),
            f.reason
        )
        .unwrap(),
        Ok(_) => {}
        Err(e) => writeln!(out, "FP8 \"s\" tiles: error: {e}").unwrap(),
    }
    let status = match kernels::Kernels::bf16dot_available() {
        Ok(()) => "runnable".to_string(),
        Err(why) => format!("not runnable: {why}"),
    };
    for (format, flag) in [
        (crate::plan::Format::Bf16, "--bf16-act bf16"),
        (crate::plan::Format::Fp8, "--fp8-act bf16"),
    ] {
        let ks: Vec<_> = kernels::BF16DOT_KERNELS
            .iter()
            .filter(|k| k.format == format)
            .collect();
        if ks.is_empty() {
            continue;
        }
        let shapes = ks.iter().filter(|k| k.shape.is_some()).count();
        writeln!(
            out,
            "{} ({flag}: {} weights, BF16 activations; needs the avx512 features + avx512bf16): generic + {shapes} specialised, {status}",
            crate::plan::dot_family(format),
            format.name().to_uppercase()
        )
        .unwrap();
    }
    if !kernels::AMX_KERNELS.is_empty() {
        let status = match kernels::Kernels::amx_available() {
            Ok(()) => "runnable".to_string(),
            Err(why) => format!("not runnable: {why}"),
        };
        let shapes = |f: Format| {
            kernels::AMX_KERNELS
                .iter()
                .filter(|k| k.format == f && k.shape.is_some())
                .count()
        };
        writeln!(
            out,
            "amx (--bf16-act amx: BF16 weights, for products of {}+ tokens; --fp8-act amx: FP8 weights decoded to BF16, {}+ tokens; --fp4-act amx: FP4 weights decoded to BF16, {}+ tokens; BF16 activations, AMX tiles; needs the avx512 features + AMX-BF16 and Linux 5.16+): generic + {} BF16, {} FP8 and {} FP4 specialised, {status}",
            crate::bf16act::AMX_MIN_TOKENS,
            crate::bf16act::AMX_FP8_MIN_TOKENS,
            crate::bf16act::AMX_FP4_MIN_TOKENS,
            shapes(Format::Bf16),
            shapes(Format::Fp8),
            shapes(Format::Fp4),
        )
        .unwrap();
    }
    writeln!(
        out,
        "threads: {threads} (--threads N or BESPOKE_THREADS; default: physical cores = {})",
        crate::cpu::physical_cores()
    )
    .unwrap();
    out
}

/// The CUDA side: what the build compiled (archs, tensor-core paths on/off and
/// why, the embedded images) and the device found at run time.
pub fn cuda_report(p: &Plan) -> String {
    let mut out = String::new();
    match &p.cuda {
        None => {}
        Some(c) => {
            if let Some(why) = &c.skipped {
                writeln!(out, "CUDA build: {why}").unwrap();
            } else {
                writeln!(
                    out,
                    "CUDA build: toolkit {} (nvcc {}){}",
                    c.toolkit.as_deref().unwrap_or("?"),
                    c.nvcc.as_deref().unwrap_or("?"),
                    if c.tc_off {
                        "; tensor-core paths off (BESPOKE_CUDA_TC=off)"
                    } else {
                        ""
                    }
                )
                .unwrap();
                if let Some(n) = &c.toolkit_note {
                    writeln!(out, "  {n}").unwrap();
                }
                let rows: Vec<Vec<String>> = c
                    .archs
                    .iter()
                    .flat_map(|a| {
                        let head = if a.compiled {
                            a.arch.name()
                        } else {
                            format!(
                                "{} (not built: {})",
                                a.arch,
                                a.why_not.as_deref().unwrap_or("")
                            )
                        };
                        a.tc.iter().enumerate().map(move |(i, d)| {
                            vec![
                                if i == 0 { head.clone() } else { String::new() },
                                d.path.describe().to_string(),
                                if d.on {
                                    "on".into()
                                } else {
                                    format!("off: {}", d.why)
                                },
                            ]
                        })
                    })
                    .collect();
                table(&mut out, &["arch", "tensor-core path", "state"], &rows);
                writeln!(
                    out,
                    "CUDA-core kernels (every format, matvec, matmul, attention) in every arch above{}",
                    match c.ptx {
                        Some(a) => format!("; PTX for {} embedded for newer GPUs", a.compute()),
                        None => String::new(),
                    }
                )
                .unwrap();
            }
        }
    }
    writeln!(out, "{}", crate::gpu::status_line()).unwrap();
    out
}

/// What the build generated: models, specialised shapes, ISAs.
pub fn build_report(p: &Plan) -> String {
    let mut out = String::new();
    writeln!(out, "target: {}", p.target).unwrap();
    writeln!(
        out,
        "ISA variants compiled: {}",
        p.isas
            .iter()
            .map(|i| i.name())
            .collect::<Vec<_>>()
            .join(", ")
    )
    .unwrap();
    if let Some(c) = &p.cpu {
        let extra = if c.features.is_empty() {
            "baseline NEON".to_string()
        } else {
            format!("NEON + {}", c.features.join(", "))
        };
        writeln!(
            out,
            "CPU preset (BESPOKE_CPU): {} — the neon variant is built with {} and needs {extra}{}",
            c.name,
            c.cflags.join(" "),
            if c.features.is_empty() {
                ""
            } else {
                "; neon_base (baseline NEON) is there for cores without those"
            }
        )
        .unwrap();
    }
    for n in &p.notes {
        writeln!(out, "note: {n}").unwrap();
    }
    writeln!(
        out,
        "\nmodels this build was specialised for (BESPOKE_MODEL at build time):"
    )
    .unwrap();
    for m in &p.models {
        writeln!(out, "  {} — {}", short_source(&m.source), m.summary).unwrap();
    }
    writeln!(
        out,
        "\nspecialised matrix kernels (matvec + matmul, each ISA variant):"
    )
    .unwrap();
    let rows: Vec<Vec<String>> = p
        .mat_shapes
        .iter()
        .map(|s| {
            let users: Vec<String> = p
                .models
                .iter()
                .flat_map(|m| {
                    m.matrices
                        .iter()
                        .filter(|u| u.format == s.format && u.rows == s.rows && u.cols == s.cols)
                        .map(move |u| format!("{}: {}", short_source(&m.source), u.name))
                })
                .collect();
            let block = match s.format.scale_shape(s.rows, s.cols) {
                Some(_) => format!("{}×{}", s.format.block_rows(), s.format.block_cols()),
                None => "-".into(),
            };
            vec![
                s.format.to_string(),
                s.rows.to_string(),
                s.cols.to_string(),
                block,
                users.join("; "),
            ]
        })
        .collect();
    table(
        &mut out,
        &["format", "rows", "cols", "scale block", "used by"],
        &rows,
    );
    writeln!(out, "\nspecialised attention-decode kernels:").unwrap();
    let rows: Vec<Vec<String>> = p
        .attn_shapes
        .iter()
        .map(|s| {
            let users: Vec<String> = p
                .models
                .iter()
                .filter(|m| m.attn.contains(s))
                .map(|m| short_source(&m.source))
                .collect();
            vec![
                s.head_dim.to_string(),
                s.n_heads.to_string(),
                s.n_kv_heads.to_string(),
                users.join(", "),
            ]
        })
        .collect();
    table(
        &mut out,
        &["head_dim", "heads", "kv heads", "used by"],
        &rows,
    );
    writeln!(
        out,
        "\ngeneric (run-time shape) kernels, each ISA variant: matvec + matmul for {}; attention decode",
        plan::FORMATS.iter().map(|f| f.name()).collect::<Vec<_>>().join(", ")
    )
    .unwrap();
    out
}

/// For a model given at run time: which matrices use a specialised kernel.
pub fn model_report(m: &PlannedModel, k: &Kernels) -> String {
    let mut out = String::new();
    writeln!(out, "model {}: {}", m.source, m.summary).unwrap();
    let mut specialised = 0;
    let rows: Vec<Vec<String>> = m
        .matrices
        .iter()
        .map(|u| {
            let spec = k.mat_kernel(u.format, u.rows, u.cols).shape.is_some();
            specialised += spec as usize;
            vec![
                u.name.clone(),
                u.format.to_string(),
                format!("{}×{}", u.rows, u.cols),
                u.per_token.to_string(),
                if spec {
                    "specialised".into()
                } else {
                    "generic".into()
                },
            ]
        })
        .collect();
    table(
        &mut out,
        &["matrix", "format", "rows×cols", "per token", "kernel"],
        &rows,
    );
    for s in &m.attn {
        let spec = k.attn_kernel(*s).shape.is_some();
        writeln!(
            out,
            "  attention decode: head_dim {}, {} heads, {} KV heads: {}",
            s.head_dim,
            s.n_heads,
            s.n_kv_heads,
            if spec { "specialised" } else { "generic" }
        )
        .unwrap();
    }
    if !k.specialised() {
        writeln!(
            out,
            "note: BESPOKE_SPECIALISED=off: every matrix runs on the generic kernels"
        )
        .unwrap();
    } else if specialised < m.matrices.len() {
        writeln!(
            out,
            "note: {} of {} matrix shapes run on generic kernels; build with BESPOKE_MODEL={} to specialise them",
            m.matrices.len() - specialised,
            m.matrices.len(),
            std::path::Path::new(&m.source).parent().map(|p| p.display().to_string()).unwrap_or_default()
        )
        .unwrap();
    }
    out
}

/// Every ISA the project knows, with whether this build has it.
pub fn isa_names() -> Vec<(Isa, bool)> {
    plan::ISAS
        .iter()
        .map(|i| (*i, COMPILED_ISAS.contains(i)))
        .collect()
}
