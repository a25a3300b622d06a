//! Kernel generation, run by build.rs (this file is compiled only into the
//! build script, next to src/plan): read the inputs, plan, render the tera
//! templates into OUT_DIR, compile each ISA variant with its own flags into one
//! static library, run bindgen on the generated header, and write the Rust
//! dispatch table and the plan the binary embeds.

use crate::cuda_build::write_if_changed;
use crate::plan::{self, Format, Isa, MatShape, Op, Plan, Tile, FORMATS};
use serde::Serialize;
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

/// Models planned for when BESPOKE_MODEL is not set: the bundled tiny fixture
/// and DeepSeek V4 Flash's config (shapes only), so the default build and
/// `cargo bench` cover the shapes this toolkit exists for.
pub const DEFAULT_MODELS: &str =
    "fixtures/tiny-llama,fixtures/tiny-qwen3,fixtures/tiny-qwen3-moe,fixtures/tiny-dsv4,fixtures/configs/deepseek-v4-flash.json,fixtures/configs/deepseek-v4-flash-bf16.json";

type BuildResult<T> = Result<T, String>;

fn env_opt(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn expand_home(s: &str) -> PathBuf {
    if let Some(rest) = s.strip_prefix("~/") {
        if let Some(home) = env::var_os("HOME") {
            return PathBuf::from(home).join(rest);
        }
    }
    PathBuf::from(s)
}

/// ISA variants to compile for this target and feature set.
fn isas_for_target(arch: &str) -> Vec<Isa> {
    let feature = |f: &str| env::var_os(format!("CARGO_FEATURE_{}", f.to_uppercase())).is_some();
    let mut isas = vec![Isa::Scalar];
    match arch {
        "x86_64" => {
            if feature("avx2") {
                isas.push(Isa::Avx2);
            }
            if feature("avx512") {
                isas.push(Isa::Avx512);
            }
        }
        "aarch64" if feature("neon") => isas.push(Isa::Neon),
        _ => {}
    }
    isas
}

#[derive(Serialize)]
struct ShapeCtx {
    rows: usize,
    cols: usize,
    matvec: String,
    matmul: String,
}

/// The symbols of one ISA and format's x preparation (see
/// `kernels::Prepared`): its length and preparing functions.
#[derive(Serialize)]
struct PrepCtx {
    len: String,
    prep: String,
}

#[derive(Serialize)]
struct FmtCtx {
    name: &'static str,
    dec: &'static str,
    block_cols: usize,
    block_rows: usize,
}

fn fmt_ctx(f: Format) -> FmtCtx {
    let dec = match f {
        Format::F32 => "f32",
        Format::Bf16 => "bf16",
        Format::Fp8 => "e4m3",
        Format::Fp4 => "e2m1",
    };
    FmtCtx {
        name: f.name(),
        dec,
        block_cols: f.block_cols(),
        block_rows: f.block_rows(),
    }
}

#[derive(Serialize)]
struct FnDecl {
    op: &'static str,
    symbol: String,
}

#[derive(Serialize)]
struct ShapeSymbol {
    rows: usize,
    cols: usize,
    symbol: String,
}

#[derive(Serialize)]
struct AttnCtx {
    head_dim: usize,
    n_heads: usize,
    n_kv_heads: usize,
    symbol: String,
}

/// Dispatch-table rows and header declarations of one kernel family: its
/// generic kernel, then one per shape. `head` opens each row (the struct and
/// the fields before `shape`).
/// The plan's `f` matrix shapes, each with its kernel's symbol.
fn shape_symbols(
    the_plan: &Plan,
    f: Format,
    symbol: impl Fn(&MatShape) -> String,
) -> Vec<ShapeSymbol> {
    the_plan
        .mat_shapes
        .iter()
        .filter(|s| s.format == f)
        .map(|s| ShapeSymbol {
            rows: s.rows,
            cols: s.cols,
            symbol: symbol(s),
        })
        .collect()
}

fn table_rows(
    table: &mut String,
    fns: &mut Vec<FnDecl>,
    head: &str,
    op: &'static str,
    generic: String,
    shapes: &[ShapeSymbol],
) {
    writeln!(table, "    {head}shape: None, f: ffi::{generic} }},").unwrap();
    fns.push(FnDecl {
        op,
        symbol: generic,
    });
    for s in shapes {
        writeln!(
            table,
            "    {head}shape: Some(({}, {})), f: ffi::{} }},",
            s.rows, s.cols, s.symbol
        )
        .unwrap();
        fns.push(FnDecl {
            op,
            symbol: s.symbol.clone(),
        });
    }
}

/// Every input of the build, declared to cargo.
fn declare_inputs(root: &Path) -> BuildResult<()> {
    for dir in ["templates", "kernels", "src/plan"] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
        let entries = fs::read_dir(root.join(dir)).map_err(|e| format!("{dir}: {e}"))?;
        for e in entries.flatten() {
            println!("cargo:rerun-if-changed={}", e.path().display());
        }
    }
    for f in ["src/codegen.rs", "src/cuda_build.rs"] {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
    Ok(())
}

fn load_models(root: &Path) -> BuildResult<Vec<plan::ModelConfig>> {
    let spec = env_opt("BESPOKE_MODEL").unwrap_or_else(|| DEFAULT_MODELS.to_string());
    let mut models = Vec::new();
    for entry in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let mut path = expand_home(entry);
        if path.is_relative() {
            path = root.join(path);
        }
        let cfg_path = plan::config_path(&path);
        println!("cargo:rerun-if-changed={}", cfg_path.display());
        let cfg =
            plan::load_config(&path).map_err(|e| format!("BESPOKE_MODEL entry {entry:?}: {e}"))?;
        models.push(cfg);
    }
    if models.is_empty() {
        return Err("BESPOKE_MODEL is set but names no model directory or config.json".into());
    }
    Ok(models)
}

/// The bf16dot kernels' register tiles: (rows, tokens) of the matmul tile and
/// the rows of the one-token tile. 4 × 6 keeps 24 accumulators, 4 weight
/// vectors and one x vector in the 32 registers; on a Zen 5 core at 2048
/// columns and 128 tokens it did 300-330 GFLOP/s, where 6 × 4, 5 × 5 and
/// 4 × 4 did 250-320, 8 × 3 (which spills) 150 and 2 × 12 170-190 (7 × 3, at
/// 4096 columns: 175).
const BF16DOT_TILE: (usize, usize, usize) = (4, 6, 8);

/// The fp8dot kernels' tiles: each (row, token) pair also keeps its scale
/// block's sum beside its accumulator, so the matmul tile is smaller. On an
/// Intel Xeon (Emerald Rapids) VM, 1 thread, 128 tokens, Flash shapes
/// (`bench kernels --formats fp8dot --tokens 128 --quick`, two alternated
/// rounds), GFLOP/s: 2 × 6 50-56, 2 × 8 52-60, 3 × 6 49-57, 4 × 4 45-55,
/// 4 × 3 34-46, 8 × 2 26-38; 2 × 6 needs the fewest remainder tiles.
const FP8DOT_TILE: (usize, usize, usize) = (2, 6, 8);

fn tiles(isa: Isa, f: Format) -> Vec<Tile> {
    let mv = isa.tile(Op::Matvec, f);
    let mm = isa.tile(Op::Matmul, f);
    let mut v: Vec<Tile> = Vec::new();
    let all = [
        Tile { rows: 1, cols: 1 },
        Tile {
            rows: mv.rows,
            cols: 1,
        },
        Tile {
            rows: mm.rows,
            cols: 1,
        },
        Tile {
            rows: 1,
            cols: mm.cols,
        },
        mm,
    ];
    let rest = rest_tiles(isa, f);
    let rest = rest.iter().flat_map(|&q| {
        [
            Tile {
                rows: mm.rows,
                cols: q,
            },
            Tile { rows: 1, cols: q },
        ]
    });
    // BF16 rows of up to bf16_one_row_cols columns go two at a time, half
    // the range apart (templates/matmul.c.tera, row_tiles' spread).
    let desc = isa.desc();
    let spread =
        (f == Format::Bf16 && desc.bf16_one_row_cols > 0).then_some(Tile { rows: 2, cols: 1 });
    // And rows a whole number of pages long take tiles of their own height.
    let paged = (f == Format::Bf16 && desc.bf16_page_rows > 0).then_some(Tile {
        rows: desc.bf16_page_rows,
        cols: 1,
    });
    for t in all.into_iter().chain(rest).chain(spread).chain(paged) {
        if !v.contains(&t) {
            v.push(t);
        }
    }
    v
}

/// Token counts below the matmul tile's that get tiles of their own: the
/// tokens left over after the whole column tiles of X (prefill's 256-token
/// steps leave 4 for the AVX-512 4 × 6 tile) then go through W once, as one
/// narrower tile, where one-token tiles went through it once per token. F32
/// and BF16 where x is read in place, and FP4, whose decode is most of a
/// one-token pass (a mixture-of-experts prefill gives each expert a few
/// tokens). AVX-512 FP4 at 2048×4096, 1 thread, cache-resident: 2 and 3
/// tokens took 2.0-2.3 and 3.1-3.3 times one token's matvec one at a time,
/// 1.5-1.6 and 2.0-2.1 times as one tile. The permuted FP8 and BF16 paths
/// take their own tiles.
fn rest_tiles(isa: Isa, f: Format) -> Vec<usize> {
    let desc = isa.desc();
    let mm = isa.tile(Op::Matmul, f);
    let plain = f.block_cols() == 0 && !desc.permuted.contains(&f.name());
    if (plain || f == Format::Fp4) && mm.cols > 2 {
        (2..mm.cols).collect()
    } else {
        Vec::new()
    }
}

/// Whether the matvec of `f` on this ISA puts x in an order or scale of
/// its own first (FP4 and FP8 always, BF16 where the ISA decodes it into a
/// permuted lane order): those get the prepared-x entry points
/// (templates/matmul.c.tera, `xprep`).
fn prepares_x(f: Format, desc: &plan::IsaDesc) -> bool {
    matches!(f, Format::Fp4 | Format::Fp8) || desc.permuted.contains(&f.name())
}

pub fn build() -> BuildResult<()> {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let out = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let target = env::var("TARGET").unwrap_or_default();
    declare_inputs(&root)?;
    let models = load_models(&root)?;
    let host_arch = env::var("HOST")
        .unwrap_or_default()
        .split('-')
        .next()
        .unwrap_or_default()
        .to_string();
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").ok();
    let features_line = cpuinfo
        .as_deref()
        .and_then(|c| c.lines().find(|l| l.starts_with("Features")));
    let cpu = plan::cpu_preset(
        env_opt("BESPOKE_CPU").as_deref(),
        &arch,
        &host_arch,
        features_line,
    )?;
    let mut isas = isas_for_target(&arch);
    // A preset that tunes NEON for extensions gets a baseline NEON variant
    // beside it, for cores without them.
    if isas.contains(&Isa::Neon) && cpu.as_ref().is_some_and(|c| !c.features.is_empty()) {
        isas.push(Isa::NeonBase);
    }
    let mut the_plan: Plan =
        plan::plan(&models, isas.clone(), &target).map_err(|e| e.to_string())?;
    the_plan.cpu = cpu;
    let cuda_table = if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        // A board preset names its GPU: the default arch list (its
        // arch-specific form, which unlocks every tensor-core path it has).
        let preset_arch = the_plan
            .cpu
            .as_ref()
            .and_then(|c| c.cuda_arch.clone())
            .map(|a| match plan::cuda::Arch::parse(&a) {
                Ok(mut arch) => {
                    arch.specific = plan::cuda::KNOWN_ARCHS
                        .iter()
                        .any(|k| k.0 == arch.major && k.1 == arch.minor && k.3);
                    arch.name()
                }
                Err(_) => a,
            });
        let tc = env_opt("BESPOKE_CUDA_TC");
        let tc_off = match tc.as_deref().map(str::to_ascii_lowercase).as_deref() {
            None | Some("on") => false,
            Some("off") => true,
            Some(other) => return Err(format!("BESPOKE_CUDA_TC={other:?}: expected on or off")),
        };
        for v in ["CUDA_HOME", "CUDA_PATH", "PATH", "HOME", "XDG_CACHE_HOME"] {
            println!("cargo:rerun-if-env-changed={v}");
        }
        let get = |k: &str| env::var(k).ok().filter(|v| !v.is_empty());
        let inputs = crate::cuda_build::CudaInputs {
            root: &root,
            out: &out,
            arch_spec: env_opt("BESPOKE_CUDA_ARCH").or(preset_arch),
            tc_off,
            version_override: env_opt("BESPOKE_CUDA_VERSION"),
            werror: env_opt("BESPOKE_WERROR").is_some(),
            env: &get,
            shapes: &the_plan.mat_shapes,
            attn: &the_plan.attn_shapes,
        };
        let mut warnings = Vec::new();
        let (cuda_plan, table) = crate::cuda_build::build(&inputs, &mut warnings)?;
        for w in warnings {
            println!("cargo:warning={w}");
            the_plan.notes.push(w);
        }
        the_plan.cuda = Some(cuda_plan);
        compile_emulator(&root, &out, &the_plan.mat_shapes, &the_plan.attn_shapes)?;
        table
    } else {
        String::from("pub static IMAGES: &[Image] = &[];\n")
    };

    // Render.
    let gen = out.join("kernels");
    fs::create_dir_all(&gen).map_err(|e| format!("{}: {e}", gen.display()))?;
    let mut tera = tera::Tera::default();
    for name in [
        "matmul.c.tera",
        "attn.c.tera",
        "q8.c.tera",
        "bf16dot.c.tera",
        "amx.c.tera",
        "header.h.tera",
    ] {
        let path = root.join("templates").join(name);
        let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        tera.add_raw_template(name, &text)
            .map_err(|e| format!("templates/{name}: {}", crate::cuda_build::err_chain(&e)))?;
    }
    let render = |name: &str, ctx: &tera::Context| -> BuildResult<String> {
        tera.render(name, ctx).map_err(|e| {
            format!(
                "rendering templates/{name}: {}",
                crate::cuda_build::err_chain(&e)
            )
        })
    };

    let mut mat_fns = Vec::new();
    let mut px_fns = Vec::new();
    let mut attn_fns = Vec::new();
    let mut sources: Vec<(Isa, PathBuf)> = Vec::new();
    let mut table = String::new();
    writeln!(
        table,
        "// Dispatch table of the kernels this build compiled (written by build.rs into OUT_DIR)."
    )
    .unwrap();
    writeln!(table, "pub static MAT_KERNELS: &[MatKernel] = &[").unwrap();
    // Every ISA's sources are rendered (cheap, and tools/isa-check.sh checks
    // the ones this target cannot run under emulation); only the target's
    // are compiled, declared and put in the dispatch table.
    for isa in plan::ISAS {
        let compiled = isas.contains(&isa);
        let desc = isa.desc();
        for f in FORMATS {
            let shapes: Vec<&MatShape> = the_plan
                .mat_shapes
                .iter()
                .filter(|s| s.format == f)
                .collect();
            let mut ctx = tera::Context::new();
            ctx.insert("isa", &desc);
            ctx.insert("fmt", &fmt_ctx(f));
            ctx.insert("mv", &isa.tile(Op::Matvec, f));
            ctx.insert("mm", &isa.tile(Op::Matmul, f));
            ctx.insert("tiles", &tiles(isa, f));
            ctx.insert("rest_tiles", &rest_tiles(isa, f));
            let generic = ShapeCtx {
                rows: 0,
                cols: 0,
                matvec: plan::mat_symbol(Op::Matvec, f, isa, None),
                matmul: plan::mat_symbol(Op::Matmul, f, isa, None),
            };
            let shape_ctx: Vec<ShapeCtx> = shapes
                .iter()
                .map(|s| ShapeCtx {
                    rows: s.rows,
                    cols: s.cols,
                    matvec: plan::mat_symbol(Op::Matvec, f, isa, Some(s)),
                    matmul: plan::mat_symbol(Op::Matmul, f, isa, Some(s)),
                })
                .collect();
            let xprep = prepares_x(f, &desc).then(|| PrepCtx {
                len: format!("bs_xprep_len_{}_{}", f.name(), isa.name()),
                prep: format!("bs_xprep_{}_{}", f.name(), isa.name()),
            });
            if let Some(p) = xprep.as_ref().filter(|_| compiled) {
                for (op, symbol) in [("len", &p.len), ("prep", &p.prep)] {
                    px_fns.push(FnDecl {
                        op,
                        symbol: symbol.clone(),
                    });
                }
            }
            for s in std::iter::once(&generic).chain(shape_ctx.iter()) {
                if !compiled {
                    continue;
                }
                mat_fns.push(FnDecl {
                    op: "matvec",
                    symbol: s.matvec.clone(),
                });
                mat_fns.push(FnDecl {
                    op: "matmul",
                    symbol: s.matmul.clone(),
                });
                let shape = if s.rows == 0 {
                    "None".to_string()
                } else {
                    format!("Some(({}, {}))", s.rows, s.cols)
                };
                let prepared = match &xprep {
                    Some(p) => {
                        px_fns.push(FnDecl {
                            op: "matvec_px",
                            symbol: format!("{}_px", s.matvec),
                        });
                        // A specialised kernel's x preparation has its
                        // column count baked in too.
                        let prep = if s.rows == 0 {
                            p.prep.clone()
                        } else {
                            let prep = format!("{}_prep", s.matvec);
                            px_fns.push(FnDecl {
                                op: "prep",
                                symbol: prep.clone(),
                            });
                            prep
                        };
                        format!(
                            "Some(Prepared {{ len: ffi::{}, prep: ffi::{prep}, matvec: ffi::{}_px }})",
                            p.len, s.matvec
                        )
                    }
                    None => "None".to_string(),
                };
                writeln!(
                    table,
                    "    MatKernel {{ isa: Isa::{isa:?}, format: Format::{f:?}, shape: {shape}, matvec: ffi::{}, matmul: ffi::{}, prepared: {prepared} }},",
                    s.matvec, s.matmul
                )
                .unwrap();
            }
            ctx.insert("xprep", &xprep);
            ctx.insert("generic", &generic);
            ctx.insert("shapes", &shape_ctx);
            let path = gen.join(format!("mat_{}_{}.c", f.name(), isa.name()));
            write_if_changed(&path, &render("matmul.c.tera", &ctx)?)?;
            if compiled {
                sources.push((isa, path));
            }
        }
    }
    writeln!(table, "];\n\npub static ATTN_KERNELS: &[AttnKernel] = &[").unwrap();
    for isa in plan::ISAS {
        let compiled = isas.contains(&isa);
        let generic = plan::attn_symbol(isa, None);
        let shapes: Vec<AttnCtx> = the_plan
            .attn_shapes
            .iter()
            .map(|s| AttnCtx {
                head_dim: s.head_dim,
                n_heads: s.n_heads,
                n_kv_heads: s.n_kv_heads,
                symbol: plan::attn_symbol(isa, Some(s)),
            })
            .collect();
        let mut ctx = tera::Context::new();
        ctx.insert("isa", &isa.desc());
        ctx.insert("generic", &generic);
        ctx.insert("shapes", &shapes);
        let path = gen.join(format!("attn_{}.c", isa.name()));
        write_if_changed(&path, &render("attn.c.tera", &ctx)?)?;
        if !compiled {
            continue;
        }
        sources.push((isa, path));
        writeln!(
            table,
            "    AttnKernel {{ isa: Isa::{isa:?}, shape: None, f: ffi::{generic} }},"
        )
        .unwrap();
        for s in &shapes {
            writeln!(
                table,
                "    AttnKernel {{ isa: Isa::{isa:?}, shape: Some(AttnShape {{ head_dim: {}, n_heads: {}, n_kv_heads: {} }}), f: ffi::{} }},",
                s.head_dim, s.n_heads, s.n_kv_heads, s.symbol
            )
            .unwrap();
            attn_fns.push(FnDecl {
                op: "attn_decode",
                symbol: s.symbol.clone(),
            });
        }
        attn_fns.push(FnDecl {
            op: "attn_decode",
            symbol: generic.clone(),
        });
    }
    writeln!(table, "];\n\npub static Q8_KERNELS: &[Q8Kernel] = &[").unwrap();
    let mut q8_fns = Vec::new();
    let fp4_shapes: Vec<&MatShape> = the_plan
        .mat_shapes
        .iter()
        .filter(|s| s.format == Format::Fp4)
        .collect();
    for isa in plan::ISAS {
        let compiled = isas.contains(&isa);
        let generic = plan::q8_symbol(isa, None);
        let shapes: Vec<ShapeSymbol> = fp4_shapes
            .iter()
            .map(|s| ShapeSymbol {
                rows: s.rows,
                cols: s.cols,
                symbol: plan::q8_symbol(isa, Some(s)),
            })
            .collect();
        let mut ctx = tera::Context::new();
        ctx.insert("isa", &isa.desc());
        ctx.insert("generic", &generic);
        ctx.insert("shapes", &shapes);
        let path = gen.join(format!("q8_fp4_{}.c", isa.name()));
        write_if_changed(&path, &render("q8.c.tera", &ctx)?)?;
        if !compiled {
            continue;
        }
        sources.push((isa, path));
        table_rows(
            &mut table,
            &mut q8_fns,
            &format!("Q8Kernel {{ isa: Isa::{isa:?}, "),
            "q8",
            generic,
            &shapes,
        );
    }
    writeln!(
        table,
        "];\n\npub static BF16DOT_KERNELS: &[Bf16DotKernel] = &["
    )
    .unwrap();
    // bf16dot (BF16 weights) and fp8dot (FP8 weights), both with activations
    // rounded to BF16: AVX-512 BF16 only, their own files and flags (the
    // avx512 variant's plus -mavx512bf16), so no other kernel can use BF16
    // instructions on a CPU that lacks them. One template for both.
    let mut bf16dot_fns = Vec::new();
    let mut bf16dot_sources = Vec::new();
    for f in [Format::Bf16, Format::Fp8] {
        let compiled = isas.contains(&Isa::Avx512);
        let generic = plan::dot_symbol(f, None);
        let shapes = shape_symbols(&the_plan, f, |s| plan::dot_symbol(f, Some(s)));
        let (mr, nr, mv) = if f == Format::Fp8 {
            FP8DOT_TILE
        } else {
            BF16DOT_TILE
        };
        // The main tile, narrower ones for the last n mod nr tokens (2..nr-1),
        // and the one-token (matvec) tile; each with its one-row form.
        let rest_tiles: Vec<usize> = (2..nr).collect();
        let mut tiles: Vec<[usize; 2]> = Vec::new();
        let wanted = std::iter::once([mr, nr])
            .chain(rest_tiles.iter().map(|&q| [mr, q]))
            .chain([[mv, 1]])
            // BF16's short rows two at a time (bd_body, BD_ONE_ROW_COLS).
            .chain((f == Format::Bf16).then_some([2, 1]));
        for t in wanted.flat_map(|t| [t, [1, t[1]]]) {
            if !tiles.contains(&t) {
                tiles.push(t);
            }
        }
        let family = plan::dot_family(f);
        let mut ctx = tera::Context::new();
        ctx.insert("isa", &Isa::Avx512.desc());
        ctx.insert("fmt", f.name());
        ctx.insert("family", family);
        ctx.insert("mr", &mr);
        ctx.insert("nr", &nr);
        ctx.insert("mv", &mv);
        ctx.insert("tiles", &tiles);
        ctx.insert("rest_tiles", &rest_tiles);
        ctx.insert("generic", &generic);
        ctx.insert("shapes", &shapes);
        let path = gen.join(format!("{family}_avx512.c"));
        write_if_changed(&path, &render("bf16dot.c.tera", &ctx)?)?;
        if compiled {
            bf16dot_sources.push(path);
            table_rows(
                &mut table,
                &mut bf16dot_fns,
                &format!("Bf16DotKernel {{ format: Format::{f:?}, "),
                "bf16dot",
                generic,
                &shapes,
            );
        }
    }
    writeln!(table, "];").unwrap();
    // amx (BF16, FP8 or FP4 weights, activations rounded to BF16, on AMX tiles): with
    // the avx512 variant, when the C compiler knows the AMX flags; its own
    // file and flags (-mamx-tile -mamx-bf16), so no other kernel uses AMX.
    writeln!(table, "\npub static AMX_KERNELS: &[AmxKernel] = &[").unwrap();
    let mut amx_fns = Vec::new();
    let mut amx_sources = Vec::new();
    {
        // One file for every weight format (BF16, and FP8 and FP4 decoded
        // into the same tiles), so that bs_amx_init is defined once.
        let mut formats = Vec::new();
        let mut rows_of = Vec::new();
        for f in [Format::Bf16, Format::Fp8, Format::Fp4] {
            let generic = plan::amx_symbol(f, None);
            let shapes = shape_symbols(&the_plan, f, |s| plan::amx_symbol(f, Some(s)));
            formats.push(serde_json::json!({
                "name": f.name(),
                // the template's AMX_BF16, AMX_FP8, AMX_FP4
                "id": format!("AMX_{}", f.name().to_uppercase()),
                "generic": generic,
                "shapes": shapes,
            }));
            rows_of.push((f, generic, shapes));
        }
        let mut ctx = tera::Context::new();
        ctx.insert("formats", &formats);
        ctx.insert("kp", &AMX_PANEL_CHUNKS);
        ctx.insert("rb", &AMX_ROW_BLOCKS);
        let path = gen.join("amx_avx512.c");
        write_if_changed(&path, &render("amx.c.tera", &ctx)?)?;
        if isas.contains(&Isa::Avx512) {
            if amx_flags_supported() {
                amx_sources.push(path);
                for (f, generic, shapes) in rows_of {
                    table_rows(
                        &mut table,
                        &mut amx_fns,
                        &format!("AmxKernel {{ format: Format::{f:?}, "),
                        "amx",
                        generic,
                        &shapes,
                    );
                }
            } else {
                println!(
                    "cargo:warning=bespoke: the C compiler does not take -mamx-tile -mamx-bf16 (GCC 11+ or Clang 12+ do): the amx kernels (--bf16-act amx, --fp8-act amx, --fp4-act amx) are left out"
                );
            }
        }
    }
    writeln!(table, "];").unwrap();
    writeln!(
        table,
        "\npub static AMX_INIT: Option<unsafe extern \"C\" fn() -> std::os::raw::c_int> = {};",
        if amx_fns.is_empty() {
            "None"
        } else {
            "Some(ffi::bs_amx_init)"
        }
    )
    .unwrap();
    // The FP8 "s" tiles' switch (templates/matmul.c.tera, x_scalable) of
    // every compiled ISA that has them.
    let switches: Vec<(Isa, String)> = isas
        .iter()
        .filter(|i| i.desc().fp8_scaled)
        .map(|&i| (i, format!("bs_fp8_scaled_{}", i.name())))
        .collect();
    writeln!(
        table,
        "\npub static FP8_SCALED_SWITCHES: &[(Isa, unsafe extern \"C\" fn(std::os::raw::c_int))] = &[{}];",
        switches
            .iter()
            .map(|(i, f)| format!("(Isa::{i:?}, ffi::{f})"))
            .collect::<Vec<_>>()
            .join(", ")
    )
    .unwrap();
    let fp8_scaled_fns: Vec<&String> = switches.iter().map(|(_, f)| f).collect();
    writeln!(
        table,
        "\npub static COMPILED_ISAS: &[Isa] = &[{}];",
        isas.iter()
            .map(|i| format!("Isa::{i:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    )
    .unwrap();

    let mut hctx = tera::Context::new();
    hctx.insert("mat_fns", &mat_fns);
    hctx.insert("px_fns", &px_fns);
    hctx.insert("attn_fns", &attn_fns);
    hctx.insert("q8_fns", &q8_fns);
    hctx.insert("bf16dot_fns", &bf16dot_fns);
    hctx.insert("amx_fns", &amx_fns);
    hctx.insert("fp8_scaled_fns", &fp8_scaled_fns);
    let header = gen.join("bespoke_kernels.h");
    write_if_changed(&header, &render("header.h.tera", &hctx)?)?;

    let cpu_flags = the_plan
        .cpu
        .as_ref()
        .map(|c| c.cflags.clone())
        .unwrap_or_default();
    compile(
        &root,
        &gen,
        &sources,
        &bf16dot_sources,
        &amx_sources,
        &cpu_flags,
    )?;
    bind(&header, &out)?;
    write_if_changed(&out.join("dispatch_table.rs"), &table)?;
    write_if_changed(&out.join("cuda_images.rs"), &cuda_table)?;
    let plan_json = serde_json::to_string_pretty(&the_plan).map_err(|e| e.to_string())?;
    write_if_changed(&out.join("plan.json"), &plan_json)?;
    Ok(())
}

/// Chunks of 32 columns per panel of the amx kernels (templates/amx.c.tera).
const AMX_PANEL_CHUNKS: usize = 8;

/// Blocks of 32 rows an amx kernel takes per pass over its activations.
const AMX_ROW_BLOCKS: usize = 4;

/// The C flags of the amx kernels (beside the avx512 variant's).
const AMX_FLAGS: [&str; 2] = ["-mamx-tile", "-mamx-bf16"];

/// Whether the C compiler takes [`AMX_FLAGS`].
fn amx_flags_supported() -> bool {
    let mut b = cc::Build::new();
    b.cargo_metadata(false).cargo_warnings(false);
    AMX_FLAGS
        .iter()
        .all(|f| b.is_flag_supported(f).unwrap_or(false))
}

/// Compile each ISA's sources with its own flags (and the bf16dot sources with
/// the avx512 flags plus -mavx512bf16, the amx ones with -mamx-tile
/// -mamx-bf16), then archive all objects into the one static library
/// `bespoke_kernels`.
/// `the_cpu_flags`: the BESPOKE_CPU preset's flags, for the NEON variant.
fn compile(
    root: &Path,
    gen: &Path,
    sources: &[(Isa, PathBuf)],
    bf16dot_sources: &[PathBuf],
    amx_sources: &[PathBuf],
    the_cpu_flags: &[String],
) -> BuildResult<()> {
    let sanitize = env_opt("BESPOKE_SANITIZE");
    let werror = env_opt("BESPOKE_WERROR").is_some();
    let mut objects = Vec::new();
    let isas: Vec<Isa> = {
        let mut v: Vec<Isa> = Vec::new();
        for (i, _) in sources {
            if !v.contains(i) {
                v.push(*i);
            }
        }
        v
    };
    // (isa, extra flags, files): one compilation group each.
    let mut groups: Vec<(Isa, &[&str], Vec<&Path>)> = isas
        .iter()
        .map(|&isa| {
            let files = sources
                .iter()
                .filter(|(i, _)| *i == isa)
                .map(|(_, p)| p.as_path())
                .collect();
            (isa, &[][..], files)
        })
        .collect();
    if !bf16dot_sources.is_empty() {
        groups.push((
            Isa::Avx512,
            &["-mavx512bf16"][..],
            bf16dot_sources.iter().map(PathBuf::as_path).collect(),
        ));
    }
    if !amx_sources.is_empty() {
        groups.push((
            Isa::Avx512,
            &AMX_FLAGS[..],
            amx_sources.iter().map(PathBuf::as_path).collect(),
        ));
    }
    for (isa, extra, files) in groups {
        let mut b = cc::Build::new();
        // Under the sanitizers, -O1 (what their documentation advises): on a
        // 2-vCPU Intel Xeon VM the instrumented AVX-512 FP8 kernels took 224 s
        // to compile at -O3 and 54 s at -O1, and CI's sanitizer step (build
        // and conformance tests) 17m49s at -O3, 10m47s at -O1, the tests
        // slower (352 s against 32) but the build 3.5x faster. The results
        // do not depend on the level (no contraction, no fast-math).
        let opt = if sanitize.is_some() { 1 } else { 3 };
        b.include(root.join("kernels"))
            .include(gen)
            .opt_level(opt)
            .debug(false)
            .warnings(true)
            .extra_warnings(true)
            .warnings_into_errors(werror)
            .flag("-std=c11")
            // The kernels' results are defined by an explicit operation order:
            // no contraction of a*b+c into FMA behind our back, no fast-math.
            .flag("-ffp-contract=off")
            .flag("-fno-fast-math");
        for f in isa.desc().cflags {
            b.flag(f);
        }
        if isa == Isa::Neon {
            for f in the_cpu_flags {
                b.flag(f);
            }
        }
        if let Some(s) = &sanitize {
            b.flag(format!("-fsanitize={s}"))
                .flag("-fno-sanitize-recover=all")
                .flag("-fno-omit-frame-pointer");
        }
        for f in extra {
            b.flag(f);
        }
        for path in files {
            b.file(path);
        }
        if isa == Isa::Scalar && extra.is_empty() {
            b.file(root.join("kernels/bs_read.c"))
                .file(root.join("kernels/bs_peak.c"));
        }
        objects.extend(
            b.try_compile_intermediates()
                .map_err(|e| format!("compiling the {isa} kernels: {e}"))?,
        );
    }
    let mut lib = cc::Build::new();
    lib.objects(objects);
    lib.try_compile("bespoke_kernels")
        .map_err(|e| format!("archiving the kernels: {e}"))?;
    if let Some(s) = &sanitize {
        for part in s.split(',') {
            match part.trim() {
                "address" => println!("cargo:rustc-link-lib=dylib=asan"),
                "undefined" => println!("cargo:rustc-link-lib=dylib=ubsan"),
                other => return Err(format!("BESPOKE_SANITIZE: unsupported sanitizer {other:?} (use address and/or undefined)")),
            }
        }
    }
    // fmaf / rintf for the scalar variant.
    println!("cargo:rustc-link-lib=m");
    Ok(())
}

/// The CPU emulator of the CUDA-core kernels (`BESPOKE_CUDA=emu`, every
/// `cuda` build, nvcc or not): templates/cuda.cu.tera rendered with the
/// tensor-core paths off, compiled as C++ against kernels/bs_cuda_emu.h, with
/// the emulator's runtime, into the static library `bespoke_cuda_emu`.
fn compile_emulator(
    root: &Path,
    out: &Path,
    shapes: &[plan::MatShape],
    attn: &[plan::AttnShape],
) -> BuildResult<()> {
    let template_path = root.join("templates/cuda.cu.tera");
    let template = fs::read_to_string(&template_path)
        .map_err(|e| format!("{}: {e}", template_path.display()))?;
    let src = crate::cuda_build::emulator_render(&template, shapes, attn)?;
    let dir = out.join("cuda");
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let cu = dir.join("emu.cu");
    write_if_changed(&cu, &src)?;
    let selftest = root.join("kernels/bs_cuda_emu_selftest.cuh");
    let selftest =
        fs::read_to_string(&selftest).map_err(|e| format!("{}: {e}", selftest.display()))?;
    let names = crate::cuda_build::kernel_names(&format!("{src}\n{selftest}"));
    let unit = dir.join("emu.cpp");
    write_if_changed(&unit, &crate::cuda_build::emulator_unit(&cu, &names))?;
    let sanitize = env_opt("BESPOKE_SANITIZE");
    let mut b = cc::Build::new();
    b.cpp(true)
        .include(root.join("kernels"))
        .opt_level(if sanitize.is_some() { 1 } else { 2 })
        .debug(false)
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(env_opt("BESPOKE_WERROR").is_some())
        .flag("-std=c++17")
        // The CUDA source reads float memory through float4 / uint4 as nvcc
        // allows; and no contraction behind the explicit fmaf calls.
        .flag("-fno-strict-aliasing")
        .flag("-ffp-contract=off")
        .flag("-fno-fast-math")
        .file(root.join("kernels/bs_cuda_emu.cpp"))
        .file(&unit);
    // Under the sanitizers (as the C kernels): the emulated kernels' loads
    // and stores are host memory accesses, so ASan sees one out of bounds.
    if let Some(s) = &sanitize {
        b.flag(format!("-fsanitize={s}"))
            .flag("-fno-sanitize-recover=all")
            .flag("-fno-omit-frame-pointer");
    }
    b.try_compile("bespoke_cuda_emu")
        .map_err(|e| format!("compiling the CUDA emulator: {e}"))?;
    Ok(())
}

fn bind(header: &Path, out: &Path) -> BuildResult<()> {
    let bindings = bindgen::Builder::default()
        .header(header.display().to_string())
        .allowlist_function("bs_.*")
        .layout_tests(false)
        .generate()
        .map_err(|e| {
            format!(
                "bindgen on {}: {e} (bindgen needs libclang: on Debian/Ubuntu `apt-get install libclang-dev`)",
                header.display()
            )
        })?;
    let text = bindings.to_string();
    write_if_changed(&out.join("bindings.rs"), &text)
}
