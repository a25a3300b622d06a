//! The CUDA half of the build (compiled into build.rs next to codegen.rs, and
//! into tests/cuda_build.rs): find nvcc, decide the archs and tensor-core
//! paths (src/plan/cuda.rs), render templates/cuda.cu.tera once per arch,
//! compile each to PTX and a cubin, and write the Rust table that embeds them.

use crate::plan::cuda::{self, Arch, CudaArchPlan, CudaPlan, TcDecision};
use crate::plan::{AttnShape, MatShape};
use serde::Serialize;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The installed CUDA compiler.
#[derive(Debug, Clone)]
pub struct Toolkit {
    pub nvcc: PathBuf,
    /// The version gating decisions go by (the override when one is set).
    pub version: (u32, u32),
    /// The version nvcc itself reports.
    pub installed: (u32, u32),
}

/// Where to look for nvcc: `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, PATH,
/// /usr/local/cuda/bin, then where tools/setup.sh --cuda installs it
/// (`${XDG_CACHE_HOME:-~/.cache}/bespoke/cuda-home`). `get` reads an
/// environment variable.
pub fn find_nvcc(get: &dyn Fn(&str) -> Option<String>) -> Result<PathBuf, String> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = get(var) {
            candidates.push(Path::new(&d).join("bin").join("nvcc"));
        }
    }
    if let Some(path) = get("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    // Where tools/setup.sh --cuda puts the PyPI wheels' toolkit.
    let cache = get("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| get("HOME").map(|h| Path::new(&h).join(".cache")));
    if let Some(c) = cache {
        candidates.push(c.join("bespoke/cuda-home/bin/nvcc"));
    }
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
    }
    Err(
        "nvcc not found (looked in $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin, \
         ~/.cache/bespoke/cuda-home/bin); install a CUDA toolkit, or the PyPI wheels with \
         tools/setup.sh, or set CUDA_HOME"
            .to_string(),
    )
}

/// Ask nvcc its version; `override_version` (BESPOKE_CUDA_VERSION) replaces
/// it for the gating decisions, to build as an older toolkit would.
pub fn toolkit(nvcc: PathBuf, override_version: Option<&str>) -> Result<Toolkit, String> {
    let out = Command::new(&nvcc)
        .arg("--version")
        .output()
        .map_err(|e| format!("running {} --version: {e}", nvcc.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let installed = cuda::parse_toolkit_version(&text).ok_or_else(|| {
        format!(
            "{} --version did not say which release it is: {}",
            nvcc.display(),
            text.trim()
        )
    })?;
    let version = match override_version {
        Some(v) => cuda::parse_toolkit_version(v)
            .ok_or_else(|| format!("BESPOKE_CUDA_VERSION={v:?}: expected a version like 12.4"))?,
        None => installed,
    };
    Ok(Toolkit {
        nvcc,
        version,
        installed,
    })
}

#[derive(Serialize)]
struct ArchCtx {
    name: String,
    cc: u32,
}

#[derive(Serialize)]
struct TcCtx {
    key: &'static str,
    on: bool,
    why: String,
}

#[derive(Serialize)]
struct ShapeCtx {
    format: &'static str,
    rows: usize,
    cols: usize,
}

/// Render templates/cuda.cu.tera for one arch.
pub fn render(
    template: &str,
    arch: Arch,
    tc: &[TcDecision],
    shapes: &[MatShape],
    attn: &[AttnShape],
) -> Result<String, String> {
    let mut tera = tera::Tera::default();
    tera.add_raw_template("cuda.cu.tera", template)
        .map_err(|e| format!("templates/cuda.cu.tera: {}", err_chain(&e)))?;
    let mut ctx = tera::Context::new();
    ctx.insert(
        "arch",
        &ArchCtx {
            name: arch.name(),
            cc: arch.cc(),
        },
    );
    let flags: std::collections::BTreeMap<&str, bool> =
        tc.iter().map(|d| (d.path.key(), d.on)).collect();
    ctx.insert("tc", &flags);
    ctx.insert("tc_any", &tc.iter().any(|d| d.on));
    ctx.insert(
        "tc_list",
        &tc.iter()
            .map(|d| TcCtx {
                key: d.path.key(),
                on: d.on,
                why: d.why.clone(),
            })
            .collect::<Vec<_>>(),
    );
    ctx.insert("formats", &["f32", "bf16", "fp8", "fp4"]);
    ctx.insert(
        "shapes",
        &shapes
            .iter()
            .map(|s| ShapeCtx {
                format: s.format.name(),
                rows: s.rows,
                cols: s.cols,
            })
            .collect::<Vec<_>>(),
    );
    ctx.insert("attn_shapes", attn);
    tera.render("cuda.cu.tera", &ctx)
        .map_err(|e| format!("rendering templates/cuda.cu.tera: {}", err_chain(&e)))
}

/// An error with its sources, for build messages.
pub fn err_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg += &format!(": {s}");
        src = s.source();
    }
    msg
}

/// Compile `cu` for `arch` into `dir`: PTX (`<arch>.ptx`) by nvcc, then the
/// cubin (`<arch>.cubin`) by ptxas from that PTX (one front-end pass).
/// Returns (ptx, cubin) paths.
pub fn compile(
    tk: &Toolkit,
    include: &Path,
    cu: &Path,
    arch: Arch,
    dir: &Path,
    werror: bool,
) -> Result<(PathBuf, PathBuf), String> {
    let ptx = dir.join(format!("{}.ptx", arch.name()));
    let cubin = dir.join(format!("{}.cubin", arch.name()));
    let mut c = Command::new(&tk.nvcc);
    c.arg("-O3")
        .arg("-std=c++17")
        .arg("-I")
        .arg(include)
        .arg(format!("--gpu-architecture={}", arch.compute()))
        .arg("-ptx")
        .arg(cu)
        .arg("-o")
        .arg(&ptx);
    if werror {
        c.arg("-Werror").arg("all-warnings");
    }
    run(c, &format!("compiling {} to PTX for {arch}", cu.display()))?;
    let ptxas = tk.nvcc.with_file_name("ptxas");
    let mut c = Command::new(if ptxas.is_file() {
        ptxas
    } else {
        PathBuf::from("ptxas")
    });
    c.arg(format!("-arch={}", arch.name()))
        .arg("-O3")
        .arg(&ptx)
        .arg("-o")
        .arg(&cubin);
    if werror {
        c.arg("--warning-as-error");
    }
    run(c, &format!("assembling the {arch} PTX into a cubin"))?;
    Ok((ptx, cubin))
}

fn run(mut c: Command, what: &str) -> Result<(), String> {
    let out = c.output().map_err(|e| format!("{what}: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("{what}: failed:\n{}", stderr.trim()));
    }
    Ok(())
}

/// Everything the `cuda` build does. Returns the CUDA plan and the Rust source
/// of the embedded image table (an empty table when nothing was built, with
/// the reason in the plan). Warnings for cargo are pushed onto `warnings`.
pub struct CudaInputs<'a> {
    pub root: &'a Path,
    pub out: &'a Path,
    pub arch_spec: Option<String>,
    pub tc_off: bool,
    pub version_override: Option<String>,
    pub werror: bool,
    pub env: &'a dyn Fn(&str) -> Option<String>,
    pub shapes: &'a [MatShape],
    pub attn: &'a [AttnShape],
}

pub fn build(i: &CudaInputs, warnings: &mut Vec<String>) -> Result<(CudaPlan, String), String> {
    let mut plan = CudaPlan {
        tc_off: i.tc_off,
        ..CudaPlan::default()
    };
    let nvcc = match find_nvcc(i.env) {
        Ok(p) => p,
        Err(e) => {
            let why = format!("no GPU kernels were built: {e}; the binary runs on the CPU");
            warnings.push(format!("feature `cuda`: {why}"));
            plan.skipped = Some(why);
            return Ok((plan, table(&[])));
        }
    };
    let tk = toolkit(nvcc, i.version_override.as_deref())?;
    plan.nvcc = Some(tk.nvcc.display().to_string());
    plan.toolkit = Some(format!("{}.{}", tk.version.0, tk.version.1));
    if i.version_override.is_some() {
        plan.toolkit_note = Some(format!(
            "BESPOKE_CUDA_VERSION: building as CUDA {}.{} would (the installed nvcc is {}.{})",
            tk.version.0, tk.version.1, tk.installed.0, tk.installed.1
        ));
    }
    let caps = native_caps();
    let spec = i.arch_spec.clone().unwrap_or_else(|| {
        if caps.is_some() {
            "native".into()
        } else {
            "portable".into()
        }
    });
    let archs = cuda::parse_arch_list(&spec, || caps)?;
    let template_path = i.root.join("templates/cuda.cu.tera");
    let template = fs::read_to_string(&template_path)
        .map_err(|e| format!("{}: {e}", template_path.display()))?;
    let dir = i.out.join("cuda");
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let include = i.root.join("kernels");
    let mut images: Vec<(String, bool, PathBuf)> = Vec::new();
    let mut jobs: Vec<(Arch, bool, Vec<TcDecision>, PathBuf)> = Vec::new();
    // Each listed arch, then the PTX arch on its own when it is not listed.
    let extra = (!archs.contains(&cuda::PTX_ARCH)).then_some(cuda::PTX_ARCH);
    for (idx, arch) in archs.iter().copied().chain(extra).enumerate() {
        let ptx_only = idx >= archs.len();
        let tc = cuda::decide(arch, tk.version, i.tc_off);
        let (maj, min) = arch.min_toolkit();
        if tk.version < (maj, min) || tk.installed < (maj, min) {
            let why = format!(
                "CUDA {}.{} cannot target {arch} (needs {maj}.{min}+)",
                tk.version.0, tk.version.1
            );
            warnings.push(format!("feature `cuda`: {arch} skipped: {why}"));
            if !ptx_only {
                plan.archs.push(CudaArchPlan {
                    arch,
                    compiled: false,
                    why_not: Some(why),
                    tc,
                });
            }
            continue;
        }
        if !ptx_only {
            for d in tc
                .iter()
                .filter(|d| !d.on && !i.tc_off && d.why.contains("toolkit"))
            {
                warnings.push(format!(
                    "feature `cuda`: {arch}: {} compiled out: {}; the CUDA-core kernels do that work",
                    d.path.describe(),
                    d.why
                ));
            }
        }
        let src = render(&template, arch, &tc, i.shapes, i.attn)?;
        let cu = dir.join(format!("{}.cu", arch.name()));
        write_if_changed(&cu, &src)?;
        jobs.push((arch, ptx_only, tc, cu));
    }
    // nvcc runs for the archs in parallel (each is one front end + ptxas).
    let results: Vec<Result<(PathBuf, PathBuf), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(arch, _, _, cu)| {
                let (tk, include, dir, werror) = (&tk, &include, &dir, i.werror);
                s.spawn(move || compile(tk, include, cu, *arch, dir, werror))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("nvcc thread panicked".into()))
            })
            .collect()
    });
    for ((arch, ptx_only, tc, _), r) in jobs.into_iter().zip(results) {
        let (ptx, cubin) = r.map_err(|e| {
            format!("{e}\n(BESPOKE_CUDA_TC=off compiles the tensor-core paths out; BESPOKE_CUDA_ARCH picks the archs)")
        })?;
        if arch == cuda::PTX_ARCH {
            // The forward-compatible image: PTX text, NUL-terminated for the driver.
            let mut text = fs::read(&ptx).map_err(|e| format!("{}: {e}", ptx.display()))?;
            text.push(0);
            let p = dir.join(format!("{}.ptx0", arch.compute()));
            fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
            images.push((arch.compute(), true, p));
            plan.ptx = Some(arch);
        }
        if !ptx_only {
            images.push((arch.name(), false, cubin));
            plan.archs.push(CudaArchPlan {
                arch,
                compiled: true,
                why_not: None,
                tc,
            });
        }
    }
    Ok((plan, table(&images)))
}

/// `nvidia-smi --query-gpu=compute_cap`: one "major.minor" per GPU, or None.
pub fn native_caps() -> Option<Vec<String>> {
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let caps: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    (!caps.is_empty()).then_some(caps)
}

fn table(images: &[(String, bool, PathBuf)]) -> String {
    let mut t = String::from(
        "// The GPU images this build embedded (written by build.rs into OUT_DIR).\n\
         pub static IMAGES: &[Image] = &[\n",
    );
    for (arch, ptx, path) in images {
        writeln!(
            t,
            "    Image {{ arch: {arch:?}, ptx: {ptx}, bytes: include_bytes!({:?}) }},",
            path.display().to_string()
        )
        .unwrap();
    }
    t.push_str("];\n");
    t
}

/// Write only when the content differs, so unchanged sources are not recompiled.
pub fn write_if_changed(path: &Path, text: &str) -> Result<(), String> {
    if fs::read_to_string(path).map(|o| o == text).unwrap_or(false) {
        return Ok(());
    }
    fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The source the CPU emulator compiles (`BESPOKE_CUDA=emu`): the CUDA-core
/// kernels every arch has, and the tensor-core paths the emulator computes
/// ([`cuda::EMU_TC`]: all of them); any other would be off.
pub fn emulator_render(
    template: &str,
    shapes: &[MatShape],
    attn: &[AttnShape],
) -> Result<String, String> {
    let arch = Arch::parse("sm_80")?;
    let tc: Vec<TcDecision> = cuda::decide(arch, (0, 0), true)
        .into_iter()
        .map(|d| {
            let on = cuda::EMU_TC.contains(&d.path.key());
            TcDecision {
                on,
                why: if on {
                    "emulated".into()
                } else {
                    "the CPU emulator does not compute this instruction".into()
                },
                ..d
            }
        })
        .collect();
    render(template, arch, &tc, shapes, attn)
}

/// The kernels a rendered source defines, in order: the name after each
/// `extern "C" __global__ void` (and its `__launch_bounds__(…)`).
pub fn kernel_names(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find("__global__ void") {
        rest = rest[i + "__global__ void".len()..].trim_start();
        if let Some(r) = rest.strip_prefix("__launch_bounds__") {
            // Skip the balanced parentheses.
            let mut depth = 0usize;
            let mut end = r.len();
            for (j, ch) in r.char_indices() {
                match ch {
                    '(' => depth += 1,
                    ')' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            end = j + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            rest = r[end..].trim_start();
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            names.push(name);
        }
    }
    names
}

/// The emulator's translation unit: the device shim, the rendered source at
/// `cu`, the emulator's self-test kernels (kernels/bs_cuda_emu_selftest.cuh)
/// and the table `bs_emu_find` looks kernels up in (kernels/bs_cuda_emu.cpp).
pub fn emulator_unit(cu: &Path, names: &[String]) -> String {
    let mut s = String::from(
        "/* Written into OUT_DIR by bespoke's build.rs: the CUDA-core kernels for the CPU emulator. */\n\
         #include \"bs_cuda_emu.h\"\n",
    );
    let _ = writeln!(s, "#include \"{}\"", cu.display());
    s.push_str("#include \"bs_cuda_emu_selftest.cuh\"\n\n");
    s.push_str("static const struct {\n    const char *name;\n    bs_emu_thunk thunk;\n} bs_emu_table[] = {\n");
    for n in names {
        let _ = writeln!(
            s,
            "    {{\"{n}\", [](void **a) {{ bs_emu_call({n}, a); }}}},"
        );
    }
    s.push_str(
        "};\n\nextern \"C\" bs_emu_thunk bs_emu_find(const char *name)\n{\n    \
         for (const auto &k : bs_emu_table)\n        if (strcmp(k.name, name) == 0) return k.thunk;\n    \
         return nullptr;\n}\n",
    );
    s
}
