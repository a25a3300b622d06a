//! The generated kernels: FFI declarations (bindgen), the dispatch table
//! (build.rs), and safe wrappers that check every length and shape before
//! calling C, split rows across threads, and pick specialised or generic.

use crate::bf16act::{AmxX, Bf16Act, Bf16X};
use crate::linevec::{LineVec, LINE};
use crate::plan::{AttnShape, Format, Isa};
use crate::q8::{Fp4Act, Q8Act};
use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

#[allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    clippy::all
)]
mod ffi {
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}

pub type MatvecFn = unsafe extern "C" fn(
    *const c_void,
    *const u8,
    *const f32,
    *mut f32,
    usize,
    usize,
    usize,
    usize,
);
pub type MatmulFn = unsafe extern "C" fn(
    *const c_void,
    *const u8,
    *const f32,
    *mut f32,
    usize,
    usize,
    usize,
    usize,
    usize,
);
pub type MatvecPxFn = unsafe extern "C" fn(
    *const c_void,
    *const u8,
    *const f32,
    c_int,
    *mut f32,
    usize,
    usize,
    usize,
    usize,
);

/// The matvec of a format whose kernels put x in an order (and scale) of
/// their own first, with that preparation split off: `len(cols)` floats of
/// prepared x (0: these columns take x as it is, through `MatKernel::matvec`),
/// which `prep(x, cols, xp)` writes, returning a flag; then any number of
/// `matvec(w, scale, xp, flag, y, rows, cols, r0, r1)` calls over parts of
/// the rows. The same bits as `MatKernel::matvec`, which prepares its own
/// copy of x on every call: decode's threads make about 20 to 40 calls a
/// product at the DeepSeek V4 Flash expert shapes.
#[derive(Clone, Copy)]
pub struct Prepared {
    pub len: unsafe extern "C" fn(usize) -> usize,
    pub prep: unsafe extern "C" fn(*const f32, usize, *mut f32) -> c_int,
    pub matvec: MatvecPxFn,
}

pub type AttnFn = unsafe extern "C" fn(
    *const f32,
    *const f32,
    *const f32,
    *const f32,
    *mut f32,
    *mut f32,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    f32,
    usize,
    usize,
);

/// A compiled matrix kernel pair (matvec + matmul) for one ISA and format,
/// specialised on `shape` = (rows, cols) or generic.
pub struct MatKernel {
    pub isa: Isa,
    pub format: Format,
    pub shape: Option<(usize, usize)>,
    pub matvec: MatvecFn,
    pub matmul: MatmulFn,
    /// The matvec with x prepared once a product (FP4, FP8, and BF16 where
    /// the ISA permutes x), which `Kernels::matvec_with` uses.
    pub prepared: Option<Prepared>,
}

pub type Q8Fn = unsafe extern "C" fn(
    *const u8,
    *const u8,
    *const i8,
    *const f32,
    *const i32,
    *mut f32,
    usize,
    usize,
    usize,
    usize,
);

/// A compiled fp4×q8 matvec (FP4 weights, int8 activations: src/q8.rs),
/// specialised on `shape` = (rows, cols) or generic.
pub struct Q8Kernel {
    pub isa: Isa,
    pub shape: Option<(usize, usize)>,
    pub f: Q8Fn,
}

pub type Bf16DotFn = unsafe extern "C" fn(
    *const c_void,
    *const u8,
    *const u16,
    usize,
    *mut f32,
    usize,
    usize,
    usize,
    usize,
    usize,
);

/// A compiled bf16dot or fp8dot matmul (BF16 or FP8 weights, activations
/// rounded to BF16: src/bf16act.rs; AVX-512 BF16), specialised on `shape` =
/// (rows, cols) or generic.
pub struct Bf16DotKernel {
    /// The weights' format: BF16 (bf16dot) or FP8 (fp8dot).
    pub format: Format,
    pub shape: Option<(usize, usize)>,
    pub f: Bf16DotFn,
}

pub type AmxFn = unsafe extern "C" fn(
    *const std::os::raw::c_void,
    *const u8,
    *const u32,
    *mut f32,
    usize,
    usize,
    usize,
    usize,
    usize,
);

/// A compiled amx matmul (BF16, FP8 or FP4 weights, activations rounded to
/// BF16, on AMX tiles: templates/amx.c.tera), specialised on `shape` =
/// (rows, cols) or generic.
pub struct AmxKernel {
    /// The weights' format: BF16, or FP8 or FP4 (decoded into BF16 tiles).
    pub format: Format,
    pub shape: Option<(usize, usize)>,
    pub f: AmxFn,
}

/// A compiled attention-decode kernel.
pub struct AttnKernel {
    pub isa: Isa,
    pub shape: Option<AttnShape>,
    pub f: AttnFn,
}

include!(concat!(env!("OUT_DIR"), "/dispatch_table.rs"));

/// The plan build.rs used, as JSON.
pub const BUILD_PLAN_JSON: &str = include_str!(concat!(env!("OUT_DIR"), "/plan.json"));

/// Sum of the words of `buf`: a plain streaming read, compiled like the
/// kernels (the benchmark's bandwidth reference), as `streams` (1..=8)
/// contiguous parts read side by side.
pub fn stream_read(buf: &[u64], streams: usize) -> u64 {
    // SAFETY: bs_stream_read reads words 0..buf.len() of a live slice and
    // nothing else, whatever `streams` is (it clamps it to 1..=8).
    unsafe { ffi::bs_stream_read(buf.as_ptr(), buf.len(), streams) }
}

/// The benchmark's read of data held in cache (kernels/bs_read.c): the sum
/// of a buffer's words with the widest vector loads this CPU has, 8 of them
/// in flight. The plain [`stream_read`] is compiled for the baseline (8 or 16
/// bytes a load), which is enough to measure memory but not L1 or L2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VectorRead {
    kind: u32,
    name: &'static str,
}

impl VectorRead {
    /// The widest read this CPU runs (AVX-512, else AVX2 on x86-64; NEON on
    /// aarch64), if this build could compile it.
    pub fn best() -> Option<VectorRead> {
        let mut kinds: Vec<(u32, &'static str)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                kinds.push((2, "avx512"));
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                kinds.push((1, "avx2"));
            }
        }
        #[cfg(target_arch = "aarch64")]
        kinds.push((4, "neon"));
        let ones = [1u64; 100];
        kinds
            .into_iter()
            .map(|(kind, name)| VectorRead { kind, name })
            // A kind the compiler could not make returns 0.
            .find(|v| v.sum(&ones) == 100)
    }

    /// The instruction set it reads with, e.g. "avx512".
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The wrapping sum of `buf`'s words.
    pub fn sum(&self, buf: &[u64]) -> u64 {
        // SAFETY: a VectorRead is only made by best(), which checked that
        // this CPU has the kind's instructions (AVX-512F, AVX2; NEON is in
        // every aarch64 core); bs_vector_read reads words 0..buf.len() of a
        // live slice and nothing else.
        unsafe { ffi::bs_vector_read(buf.as_ptr(), buf.len(), self.kind) }
    }
}

/// A compute-roof probe (kernels/bs_peak.c): independent chains of the
/// vector multiply-add a kernel family is built on, nothing else. Only
/// [`PeakProbe::for_kernels`] makes one, after checking that this CPU has
/// the instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeakProbe {
    kind: u32,
    name: &'static str,
}

impl PeakProbe {
    /// The probe for the f32 kernels of `isa` (`bf16dot`: for the bf16dot
    /// kernels, whose instruction is VDPBF16PS), if this build has that
    /// variant, this CPU runs it, and there is a probe for it (none for the
    /// scalar variant).
    pub fn for_kernels(isa: Isa, bf16dot: bool) -> Option<PeakProbe> {
        let (kind, name) = match (isa, bf16dot) {
            (Isa::Avx2, false) => (1, "avx2 f32 fma"),
            (Isa::Avx512, false) => (2, "avx512 f32 fma"),
            (Isa::Avx512, true) => (3, "avx512 bf16 dot"),
            (Isa::Neon, false) => (4, "neon f32 fma"),
            _ => return None,
        };
        Kernels::with_isa(isa).ok()?;
        if bf16dot {
            Kernels::bf16dot_available().ok()?;
        }
        let p = PeakProbe { kind, name };
        // A build whose compiler could not make the probe has it return 0.
        (p.run(1) > 0.0).then_some(p)
    }

    /// What it times, e.g. "avx512 f32 fma".
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// `iters` steps of the probe on the calling thread; the flops done.
    pub fn run(&self, iters: usize) -> f64 {
        let mut sink = 0f32;
        // SAFETY: a PeakProbe is only made by for_kernels, which checked
        // that this CPU has the probe's instructions (the ISA variant's
        // features, and AVX512_BF16 for the dot product); the probe reads
        // nothing and writes one float to `sink`.
        let flops = unsafe { ffi::bs_compute_peak(self.kind, iters, &mut sink) };
        std::hint::black_box(sink);
        flops
    }
}

/// Whether the FP8 kernels' "s" tiles are on, per ISA that has them
/// (AVX2, AVX-512), and why. In those tiles x is copied times 2^120 and
/// each code's bits go straight into an f32 (w times 2^-120), so that
/// subnormal codes become f32 subnormals; on cores that take a
/// microcode assist for a subnormal multiply-add operand (Intel's) every
/// vector that holds one costs about 100 cycles. Off, the ISA's "p" tiles
/// take every x: on AVX-512 they are exact for every code with no
/// subnormal, at 0.78-0.86x the "s" tiles' speed cache-resident on a
/// matrix without any, the same streamed (the same bits either way, by the
/// numerics contract).
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Scaled {
    /// Every compiled ISA with "s" tiles, and whether they are on.
    pub isas: Vec<(Isa, bool)>,
    /// Why, for `bespoke plan`.
    pub reason: String,
}

impl Fp8Scaled {
    /// Each ISA and whether its "s" tiles are on: "avx2 on, avx512 off".
    pub fn summary(&self) -> String {
        self.isas
            .iter()
            .map(|(isa, on)| format!("{isa} {}", if *on { "on" } else { "off" }))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A subnormal multiply-add operand costs this many times a normal one or
/// more: "slow" (on an Intel Xeon VM, Granite Rapids class: about 100; on
/// the AMD cores the "s" tiles were written on, none).
const SUBNORMAL_SLOW: f64 = 4.0;

/// How many times a multiply-add with a subnormal operand takes as long as
/// one without, on this core, with the FMA of `isa` (kernels/bs_peak.c);
/// None where there is no probe for it (every ISA but AVX-512, whose
/// switch it informs) or the CPU lacks it.
pub fn subnormal_cost(isa: Isa) -> Option<f64> {
    let kind = match isa {
        Isa::Avx512 => 2,
        _ => return None,
    };
    Kernels::with_isa(isa).ok()?;
    let time = |sub: i32| {
        (0..3)
            .map(|_| {
                let t = std::time::Instant::now();
                // SAFETY: with_isa checked that this CPU has the ISA's
                // features (the probe's FMA); the probe reads and writes
                // nothing but its registers.
                let s = unsafe { ffi::bs_subnormal_probe(kind, sub, 2000) };
                std::hint::black_box(s);
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let (sub, normal) = (time(1), time(0));
    (normal > 0.0).then(|| sub / normal)
}

/// The process-wide [`Fp8Scaled`], from BESPOKE_FP8_SCALED (`auto`, the
/// default: AVX-512's off where [`subnormal_cost`] is 4 or more, AVX2's on,
/// as its "p" tiles redo a block with such a code code by code, which costs
/// more than the assists; `on`; `off`), worked out and handed to the
/// kernels once, the first time an FP8 kernel is looked up.
pub fn fp8_scaled() -> &'static Result<Fp8Scaled, KernelError> {
    static SETTING: OnceLock<Result<Fp8Scaled, KernelError>> = OnceLock::new();
    SETTING.get_or_init(|| {
        let forced = fp8_scaled_forced()?;
        let mut reason = String::new();
        let isas = FP8_SCALED_SWITCHES
            .iter()
            .map(|&(isa, switch)| {
                let on = forced.unwrap_or_else(|| {
                    match subnormal_cost(isa) {
                        Some(c) if c >= SUBNORMAL_SLOW => {
                            reason = format!("a subnormal multiply-add operand costs {c:.0}x a normal one on this core, so AVX-512 takes the \"p\" tiles");
                            false
                        }
                        Some(c) => {
                            reason = format!("a subnormal multiply-add operand costs {c:.1}x a normal one on this core");
                            true
                        }
                        None => true,
                    }
                });
                // SAFETY: the switch stores one int with a relaxed atomic;
                // any value is valid, and a kernel reads it once a call.
                unsafe { switch(on as c_int) };
                (isa, on)
            })
            .collect();
        if let Some(on) = forced {
            reason = format!("BESPOKE_FP8_SCALED={}", if on { "on" } else { "off" });
        } else if reason.is_empty() {
            reason = "auto".to_string();
        } else {
            reason = format!("auto: {reason}");
        }
        Ok(Fp8Scaled { isas, reason })
    })
}

/// BESPOKE_FP8_SCALED as asked: None for `auto` (or unset), else on / off.
/// Only the variable is read (no probe), so that [`Kernels::from_env`] can
/// check it at start-up and leave the probe to the first FP8 kernel.
fn fp8_scaled_forced() -> Result<Option<bool>, KernelError> {
    match std::env::var("BESPOKE_FP8_SCALED")
        .ok()
        .as_deref()
        .map(str::trim)
    {
        None | Some("") | Some("auto") => Ok(None),
        Some("on") => Ok(Some(true)),
        Some("off") => Ok(Some(false)),
        Some(other) => Err(KernelError::BadFp8Scaled(other.to_string())),
    }
}

/// Switch `isa`'s FP8 "s" tiles on or off for the rest of the process
/// (tests and benchmarks comparing the two; every call after it sees it).
/// False where the ISA has none in this build.
pub fn set_fp8_scaled(isa: Isa, on: bool) -> bool {
    // The setting first, so that its first use cannot undo this one.
    let _ = fp8_scaled();
    match FP8_SCALED_SWITCHES.iter().find(|(i, _)| *i == isa) {
        Some(&(_, switch)) => {
            // SAFETY: as in fp8_scaled.
            unsafe { switch(on as c_int) };
            true
        }
        None => false,
    }
}

/// Errors from the kernel layer: always say what was expected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    #[error("{what}: expected {expected} elements, found {found}")]
    Length {
        what: String,
        expected: usize,
        found: usize,
    },
    #[error("{0}")]
    Shape(String),
    #[error("BESPOKE_KERNELS={0:?} is not a kernel variant; expected one of: scalar, avx2, avx512, neon, neon_base (or auto)")]
    UnknownVariant(String),
    #[error("the {isa} kernels were not compiled into this binary (compiled: {compiled}); rebuild with the `{isa}` feature on a target that has it")]
    NotCompiled { isa: Isa, compiled: String },
    #[error("this CPU lacks {missing} needed by the {isa} kernels; the variants this CPU can run: {runnable}")]
    CpuLacks {
        isa: Isa,
        missing: String,
        runnable: String,
    },
    #[error("--bf16-act bf16 needs the bf16dot kernels: {0}; run without it (f32 activations, the default)")]
    NoBf16Dot(String),
    #[error("--fp8-act bf16 needs the fp8dot kernels: {0}; run without it (f32 activations, the default)")]
    NoFp8Dot(String),
    #[error("--bf16-act amx needs the amx kernels: {0}; use --bf16-act bf16 (AVX-512 BF16) or run without it (f32 activations, the default)")]
    NoAmx(String),
    #[error("--fp4-act amx needs the amx kernels: {0}; use --fp4-act q8 or run without it (f32 activations, the default)")]
    NoAmxFp4(String),
    #[error("--fp8-act amx needs the amx kernels: {0}; use --fp8-act bf16 (AVX-512 BF16) or run without it (f32 activations, the default)")]
    NoAmxFp8(String),
    #[error("BESPOKE_SPECIALISED={0:?}: expected `on` (the default: a matrix gets the kernel this build specialised for its shape, if any) or `off` (generic kernels only)")]
    BadSpecialised(String),
    #[error("BESPOKE_FP8_SCALED={0:?}: expected `auto` (the default: off for AVX-512 where a subnormal multiply-add operand is slow), `on` or `off`")]
    BadFp8Scaled(String),
}

impl KernelError {
    /// The error for BF16-activation products on `format` weights that
    /// cannot run: `why` said by bf16dot for BF16, by fp8dot for FP8.
    fn no_dot(format: Format, why: String) -> KernelError {
        match format {
            Format::Fp8 => KernelError::NoFp8Dot(why),
            _ => KernelError::NoBf16Dot(why),
        }
    }

    /// The error for amx products on `format` weights that cannot run,
    /// naming the option that asks for them.
    fn no_amx(format: Format, why: String) -> KernelError {
        match format {
            Format::Fp8 => KernelError::NoAmxFp8(why),
            Format::Fp4 => KernelError::NoAmxFp4(why),
            _ => KernelError::NoAmx(why),
        }
    }
}

/// Weight data of a matrix, in one of the kernel formats.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    /// BF16 bit patterns.
    Bf16(&'a [u16]),
    /// E4M3FN codes [rows, cols] and UE8M0 scales [ceil(rows/128), ceil(cols/128)].
    Fp8 {
        w: &'a [u8],
        scale: &'a [u8],
    },
    /// Packed E2M1 codes [rows, cols/2] (low nibble = even column) and UE8M0 scales [rows, cols/32].
    Fp4 {
        w: &'a [u8],
        scale: &'a [u8],
    },
}

impl Weights<'_> {
    pub fn format(&self) -> Format {
        match self {
            Weights::F32(_) => Format::F32,
            Weights::Bf16(_) => Format::Bf16,
            Weights::Fp8 { .. } => Format::Fp8,
            Weights::Fp4 { .. } => Format::Fp4,
        }
    }
}

/// A weight matrix whose buffers have been checked against its shape.
#[derive(Clone, Copy)]
pub struct Matrix<'a> {
    rows: usize,
    cols: usize,
    weights: Weights<'a>,
    /// FP8 only: every code was scanned and none is NaN (magnitude 127), so
    /// the kernels may skip their own check ([`Matrix::with_fp8_scanned`]).
    fp8_clean: bool,
}

/// Whether FP8 codes hold no NaN (E4M3FN's only NaN: magnitude 0x7F). A
/// plain loop the compiler vectorizes: one read of the codes.
pub fn fp8_codes_clean(w: &[u8]) -> bool {
    w.chunks(4096)
        .all(|c| c.iter().fold(0u8, |a, &b| a.max(b & 0x7F)) != 0x7F)
}

fn check_len(what: &str, expected: usize, found: usize) -> Result<(), KernelError> {
    if expected != found {
        return Err(KernelError::Length {
            what: what.into(),
            expected,
            found,
        });
    }
    Ok(())
}

impl<'a> Matrix<'a> {
    /// Check the buffers against [rows, cols] in the format's layout.
    pub fn new(rows: usize, cols: usize, weights: Weights<'a>) -> Result<Self, KernelError> {
        let format = weights.format();
        if let Some(p) = format.shape_problem(rows, cols) {
            return Err(KernelError::Shape(p));
        }
        let n = rows
            .checked_mul(cols)
            .ok_or_else(|| KernelError::Shape(format!("{rows}×{cols} overflows")))?;
        match weights {
            Weights::F32(w) => check_len("f32 weights", n, w.len())?,
            Weights::Bf16(w) => check_len("bf16 weights", n, w.len())?,
            Weights::Fp8 { w, scale } => {
                check_len("fp8 weights", n, w.len())?;
                let (sr, sc) = format.scale_shape(rows, cols).unwrap_or((0, 0));
                check_len(&format!("fp8 scales [{sr}, {sc}]"), sr * sc, scale.len())?;
            }
            Weights::Fp4 { w, scale } => {
                check_len("fp4 packed weights (two per byte)", n / 2, w.len())?;
                let (sr, sc) = format.scale_shape(rows, cols).unwrap_or((0, 0));
                check_len(&format!("fp4 scales [{sr}, {sc}]"), sr * sc, scale.len())?;
            }
        }
        Ok(Matrix {
            rows,
            cols,
            weights,
            fp8_clean: false,
        })
    }
    /// This matrix after a scan of its FP8 codes: marked clean when none is
    /// NaN, which lets the FP8 matvec's "s" tiles skip their check (about a
    /// ninth of the call on a Zen 4; the "t" tiles, templates/matmul.c.tera).
    /// The scan reads every code, so a caller that meets the same weights
    /// often keeps its answer ([`Matrix::with_fp8_scan_result`]). Other
    /// formats: unchanged.
    pub fn with_fp8_scanned(self) -> Self {
        let clean = match self.weights {
            Weights::Fp8 { w, .. } => fp8_codes_clean(w),
            _ => false,
        };
        Matrix {
            fp8_clean: clean,
            ..self
        }
    }
    /// This matrix with the answer of an earlier scan of these same codes
    /// ([`fp8_codes_clean`]; the engine keeps one per matrix it loaded). Only
    /// that answer may be passed: a matrix marked clean that holds a NaN
    /// code gets a finite wrong value where the reference has NaN.
    pub fn with_fp8_scan_result(self, clean: bool) -> Self {
        Matrix {
            fp8_clean: clean && matches!(self.weights, Weights::Fp8 { .. }),
            ..self
        }
    }
    /// Whether the FP8 codes were scanned and hold no NaN.
    pub fn fp8_clean(&self) -> bool {
        self.fp8_clean
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn weights(&self) -> Weights<'a> {
        self.weights
    }
    pub fn format(&self) -> Format {
        self.weights.format()
    }
    /// Bytes of weights and scales.
    pub fn bytes(&self) -> usize {
        match self.weights {
            Weights::F32(w) => w.len() * 4,
            Weights::Bf16(w) => w.len() * 2,
            Weights::Fp8 { w, scale } | Weights::Fp4 { w, scale } => w.len() + scale.len(),
        }
    }
    fn ptrs(&self) -> (*const c_void, *const u8) {
        match self.weights {
            Weights::F32(w) => (w.as_ptr().cast(), std::ptr::null()),
            Weights::Bf16(w) => (w.as_ptr().cast(), std::ptr::null()),
            Weights::Fp8 { w, scale } | Weights::Fp4 { w, scale } => {
                (w.as_ptr().cast(), scale.as_ptr())
            }
        }
    }
}

/// Raw pointers handed to worker threads. Each worker writes a disjoint
/// range of output rows, so sharing them is sound.
#[derive(Clone, Copy)]
struct SendPtr<T>(T);
// SAFETY: only used to pass buffers to rayon workers that touch disjoint
// output rows (or heads) and read shared inputs; the borrow of the originals
// outlives the parallel section (rayon joins before returning).
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// Split 0..n into about `parts` ranges whose length is a multiple of `align`.
fn split(n: usize, parts: usize, align: usize) -> Vec<(usize, usize)> {
    let chunk = n.div_ceil(parts.max(1)).div_ceil(align).max(1) * align;
    (0..n)
        .step_by(chunk)
        .map(|s| (s, (s + chunk).min(n)))
        .collect()
}

/// A row range r0..r1 of a `rows`-row matrix: 0 <= r0 <= r1 <= rows.
fn check_row_range(r0: usize, r1: usize, rows: usize) -> Result<(), KernelError> {
    if r0 > r1 || r1 > rows {
        return Err(KernelError::Shape(format!(
            "rows {r0}..{r1} of a {rows}-row matrix"
        )));
    }
    Ok(())
}

/// A `family` kernel specialised for `shape` (None: generic) on matrix `m`
/// with packed activations of `x_cols` columns: the shapes agree.
fn check_dot_shape(
    family: &str,
    shape: Option<(usize, usize)>,
    m: &Matrix,
    x_cols: usize,
) -> Result<(), KernelError> {
    if let Some((r, c)) = shape {
        if (r, c) != (m.rows, m.cols) {
            return Err(KernelError::Shape(format!(
                "{family} kernel specialised for {r}×{c} used on a {}×{} matrix",
                m.rows, m.cols
            )));
        }
    }
    if x_cols != m.cols {
        return Err(KernelError::Shape(format!(
            "{family} activations of {x_cols} columns against a {}×{} matrix",
            m.rows, m.cols
        )));
    }
    Ok(())
}

/// Rows per chunk when the threads share a one-token product (see
/// `Kernels::par_rows`): about 8 chunks a thread, a multiple of 16 (whole
/// tiles of every variant), from 16 to 128 rows (of chunks of 32, 64 and
/// 128 rows, 128 was best most often on the Zen 4 VM).
fn decode_chunk_rows(rows: usize, threads: usize) -> usize {
    (rows / (threads * 8).max(1) / 16 * 16).clamp(16, 128)
}

/// How the threads share a one-token product (`Kernels::par_rows`). The
/// rows go in units of a quarter of [`decode_chunk_rows`] (at least 16),
/// and thread t has the region of units `ends[t]..ends[t + 1]`. Each
/// thread takes its own region's units from the front, `per` at a time (a
/// whole chunk) while more than twice that are left, then one at a time;
/// then it goes to the next regions and takes what is left there one unit
/// at a time, from the same counter, so that a thread the host holds up
/// leaves its rows to the others and a thread out of work waits for at
/// most a unit of another's. Each thread so reads one stretch of the matrix
/// front to back: on the Intel Xeon VM, 2 threads, a C harness over 1 GiB
/// of copies of the generated FP8 and FP4 matvecs gave 3-15 points more of
/// the read bandwidth than whole chunks taken in turn from one counter, the
/// threads side by side (which re-started the prefetchers at every chunk).
struct DecodeSplit {
    unit: usize,
    per: usize,
    rows: usize,
    ends: Vec<usize>,
}

impl DecodeSplit {
    fn new(rows: usize, threads: usize) -> Self {
        let threads = threads.max(1);
        let chunk = decode_chunk_rows(rows, threads);
        let unit = (chunk / 4).max(16);
        let units = rows.div_ceil(unit);
        DecodeSplit {
            unit,
            per: (chunk / unit).max(1),
            rows,
            ends: (0..=threads).map(|t| t * units / threads).collect(),
        }
    }

    /// One counter a region, each at the region's first unit.
    fn counters(&self) -> Vec<AtomicUsize> {
        let regions = self.ends.len() - 1;
        self.ends[..regions]
            .iter()
            .map(|&u| AtomicUsize::new(u))
            .collect()
    }

    /// Thread t's share: its own region, then what is left of the others'.
    fn drain(&self, next: &[AtomicUsize], t: usize, mut f: impl FnMut(usize, usize)) {
        let regions = next.len();
        for k in 0..regions {
            let region = (t + k) % regions;
            while let Some((r0, r1)) = self.claim(&next[region], region, k == 0) {
                f(r0, r1);
            }
        }
    }

    /// The next rows of `region` (its counter `next`) for its owner or for
    /// another thread; None once the region is done.
    fn claim(&self, next: &AtomicUsize, region: usize, owner: bool) -> Option<(usize, usize)> {
        let end = self.ends[region + 1];
        let take = if owner && next.load(Ordering::Relaxed) + 2 * self.per <= end {
            self.per
        } else {
            1
        };
        let a = next.fetch_add(take, Ordering::Relaxed);
        (a < end).then(|| {
            let b = (a + take).min(end);
            (a * self.unit, (b * self.unit).min(self.rows))
        })
    }
}

/// Below this many weight elements per call, threads cost more than they save.
const PARALLEL_MIN_ELEMS: usize = 1 << 15;

/// Whether a rows × cols product met by `tokens` tokens is shared among the
/// current pool's threads (`Kernels::par_rows`; else one call on the
/// calling thread does it all).
pub(crate) fn shares_rows(rows: usize, cols: usize, tokens: usize) -> bool {
    let work = rows.saturating_mul(cols).saturating_mul(tokens);
    rayon::current_num_threads() > 1 && work >= PARALLEL_MIN_ELEMS && rows >= 32
}

/// Whether attention over `n_heads` heads of `head_dim`, `t_len` positions,
/// is shared among the current pool's threads, a range of heads each.
pub(crate) fn shares_heads(n_heads: usize, t_len: usize, head_dim: usize) -> bool {
    rayon::current_num_threads() > 1
        && n_heads > 1
        && t_len * head_dim * n_heads >= PARALLEL_MIN_ELEMS
}

/// Run `f` on X, or on a copy of it that starts on a cache line when X does
/// not and the kernels read it in place (`direct`: the F32 and BF16
/// formats; the FP8 and FP4 kernels permute X into buffers of their own or
/// were level either way). With `cols` a multiple of 16, every token's row
/// then starts on a line and no 64-byte load of X straddles two. On an
/// Intel Xeon VM (AVX-512, 1 thread, 128 tokens) the BF16 matmul ran at
/// 0.85-0.87 of its speed with X 16 bytes past a line, where a `Vec<f32>`
/// from the system allocator usually starts; the copy costs one pass over
/// X, under 1 % of a matmul. The copy goes into a buffer kept per thread; a
/// nested call on the same thread (a rayon worker taking another task while
/// it waits) finds it in use and copies into one of its own.
fn with_aligned_x<R>(x: &[f32], cols: usize, direct: bool, f: impl FnOnce(&[f32]) -> R) -> R {
    let aligned = (x.as_ptr() as usize) % LINE == 0;
    if !direct || aligned || cols % (LINE / 4) != 0 || x.is_empty() {
        return f(x);
    }
    with_x_buf(|buf| f(buf.copy_of(x)))
}

/// Run `f` with this thread's buffer for a copy of x (kept from call to
/// call); a nested call on the same thread (a rayon worker taking another
/// task while it waits) finds it in use and gets one of its own.
fn with_x_buf<R>(f: impl FnOnce(&mut LineVec<f32>) -> R) -> R {
    thread_local! {
        static XA: std::cell::RefCell<LineVec<f32>> = std::cell::RefCell::new(LineVec::default());
    }
    XA.with(|b| match b.try_borrow_mut() {
        Ok(mut b) => f(&mut b),
        Err(_) => f(&mut LineVec::default()),
    })
}

/// Arguments of one attention-decode call.
pub struct AttnArgs<'a> {
    /// Query [n_heads, head_dim].
    pub q: &'a [f32],
    /// Keys: position t, KV head g at t * kv_stride + g * kv_head_stride
    /// (position-major: kv_head_stride = head_dim; KV-head-major, as the
    /// Llama engine's cache: kv_stride = head_dim).
    pub k: &'a [f32],
    /// Values, same layout as the keys (may be the same buffer).
    pub v: &'a [f32],
    /// Per-head sink logits `[n_heads]` that join the softmax denominator.
    pub sinks: Option<&'a [f32]>,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Floats from one position's row to the next.
    pub kv_stride: usize,
    /// Floats from one KV head's rows to the next one's.
    pub kv_head_stride: usize,
    /// Positions in the cache (the query attends to 0..t_len, or the last `window`).
    pub t_len: usize,
    /// Sliding window (0 = none).
    pub window: usize,
    pub scale: f32,
}

/// A chosen kernel variant: every call goes to this ISA's kernels. With
/// `fp4_act` = Q8, FP4 matrices go through the fp4×q8 kernels (a separately
/// named variant that is not bit-identical to the f32 reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    isa: Isa,
    fp4_act: Fp4Act,
    bf16_act: Bf16Act,
    /// How FP8 matrices meet their activations (`Bf16`: the fp8dot kernels).
    fp8_act: Bf16Act,
    /// The VRAM tier these kernels send resident matrices to (0: none; see
    /// [`crate::gpu::tier`]).
    tier: u32,
    /// Whether a matrix whose shape the build specialised for gets that
    /// kernel (the default) or the generic one like any other
    /// (`BESPOKE_SPECIALISED=off`, `bench e2e --vs-generic`).
    specialised: bool,
}

/// Where a product goes on the CPU ([`Kernels::route`]): fp4×q8, the
/// bf16dot / fp8dot kernels, the amx kernels, or the f32 kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Q8,
    Dot,
    Amx,
    F32,
}

/// Why a variant was chosen (for `bespoke plan` and the run banner).
#[derive(Debug, Clone)]
pub struct Choice {
    pub kernels: Kernels,
    pub reason: String,
}

fn compiled_list() -> String {
    COMPILED_ISAS
        .iter()
        .map(|i| i.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A BESPOKE_SPECIALISED value: unset, empty or `on` → true, `off` → false.
fn specialised_from(v: Option<&str>) -> Result<bool, KernelError> {
    match v.map(str::trim).unwrap_or("") {
        "" | "on" => Ok(true),
        "off" => Ok(false),
        other => Err(KernelError::BadSpecialised(other.into())),
    }
}

impl Kernels {
    /// Kernels of `isa`, if compiled in and supported by this CPU.
    pub fn with_isa(isa: Isa) -> Result<Kernels, KernelError> {
        if !COMPILED_ISAS.contains(&isa) {
            return Err(KernelError::NotCompiled {
                isa,
                compiled: compiled_list(),
            });
        }
        let missing = crate::cpu::missing_features(isa);
        if !missing.is_empty() {
            let runnable: Vec<&str> = COMPILED_ISAS
                .iter()
                .filter(|i| crate::cpu::missing_features(**i).is_empty())
                .map(|i| i.name())
                .collect();
            return Err(KernelError::CpuLacks {
                isa,
                missing: missing.join(", "),
                runnable: runnable.join(", "),
            });
        }
        Ok(Kernels {
            isa,
            fp4_act: Fp4Act::F32,
            bf16_act: Bf16Act::F32,
            fp8_act: Bf16Act::F32,
            tier: 0,
            specialised: true,
        })
    }

    /// The best compiled variant this CPU supports.
    pub fn best() -> Kernels {
        let isa = COMPILED_ISAS
            .iter()
            .copied()
            .filter(|i| crate::cpu::missing_features(*i).is_empty())
            .max_by_key(|i| i.desc().score)
            .unwrap_or(Isa::Scalar);
        Kernels {
            isa,
            fp4_act: Fp4Act::F32,
            bf16_act: Bf16Act::F32,
            fp8_act: Bf16Act::F32,
            tier: 0,
            specialised: true,
        }
    }

    /// Choose from a BESPOKE_KERNELS value (None / "" / "auto" = best).
    pub fn choose(request: Option<&str>) -> Result<Choice, KernelError> {
        match request
            .map(str::trim)
            .filter(|s| !s.is_empty() && *s != "auto")
        {
            None => {
                let k = Kernels::best();
                let reason = format!(
                    "best of the compiled variants ({}) that this CPU supports (highest score wins)",
                    compiled_list()
                );
                Ok(Choice { kernels: k, reason })
            }
            Some(name) => {
                let isa =
                    Isa::parse(name).ok_or_else(|| KernelError::UnknownVariant(name.into()))?;
                let k = Kernels::with_isa(isa)?;
                Ok(Choice {
                    kernels: k,
                    reason: format!("forced by BESPOKE_KERNELS={name}"),
                })
            }
        }
    }

    /// The process-wide choice from BESPOKE_KERNELS and BESPOKE_SPECIALISED,
    /// made once; a bad BESPOKE_FP8_SCALED is reported here too.
    pub fn from_env() -> Result<Choice, KernelError> {
        static CHOICE: OnceLock<Result<Choice, KernelError>> = OnceLock::new();
        CHOICE
            .get_or_init(|| {
                let mut c = Kernels::choose(std::env::var("BESPOKE_KERNELS").ok().as_deref())?;
                fp8_scaled_forced()?;
                if !specialised_from(std::env::var("BESPOKE_SPECIALISED").ok().as_deref())? {
                    c.kernels = c.kernels.with_specialised(false);
                    c.reason
                        .push_str("; generic kernels only (BESPOKE_SPECIALISED=off)");
                }
                Ok(c)
            })
            .clone()
    }

    /// These kernels with the build's shape-specialised kernels used
    /// (`true`, the default) or passed over for the generic ones (`false`:
    /// the same numbers, bit for bit, by the numerics contract; for
    /// measuring what specialisation buys).
    pub fn with_specialised(self, on: bool) -> Kernels {
        Kernels {
            specialised: on,
            ..self
        }
    }

    pub fn specialised(&self) -> bool {
        self.specialised
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// These kernels with FP4 matrices multiplied as `act` says; `Amx`
    /// needs the amx kernels (see [`Kernels::amx_available`]).
    pub fn with_fp4_act(self, act: Fp4Act) -> Result<Kernels, KernelError> {
        if act == Fp4Act::Amx {
            Self::amx_available().map_err(|why| KernelError::no_amx(Format::Fp4, why))?;
        }
        Ok(Kernels {
            fp4_act: act,
            ..self
        })
    }

    pub fn fp4_act(&self) -> Fp4Act {
        self.fp4_act
    }

    /// These kernels with BF16 matrices multiplied as `act` says; `Bf16`
    /// needs the bf16dot kernels (see [`Kernels::bf16dot_available`]).
    pub fn with_bf16_act(self, act: Bf16Act) -> Result<Kernels, KernelError> {
        self.with_dot_act(Format::Bf16, act)
    }

    pub fn bf16_act(&self) -> Bf16Act {
        self.bf16_act
    }

    /// These kernels with FP8 matrices multiplied as `act` says; `Bf16`
    /// needs the fp8dot kernels (AVX-512 BF16, as bf16dot).
    pub fn with_fp8_act(self, act: Bf16Act) -> Result<Kernels, KernelError> {
        self.with_dot_act(Format::Fp8, act)
    }

    /// `format` (BF16 or FP8) matrices multiplied as `act` says.
    fn with_dot_act(mut self, format: Format, act: Bf16Act) -> Result<Kernels, KernelError> {
        match act {
            Bf16Act::Bf16 => {
                Self::bf16dot_available().map_err(|why| KernelError::no_dot(format, why))?
            }
            Bf16Act::Amx => {
                Self::amx_available().map_err(|why| KernelError::no_amx(format, why))?
            }
            Bf16Act::F32 => {}
        }
        match format {
            Format::Fp8 => self.fp8_act = act,
            _ => self.bf16_act = act,
        }
        Ok(self)
    }

    pub fn fp8_act(&self) -> Bf16Act {
        self.fp8_act
    }

    /// Whether this binary has bf16dot (and fp8dot) kernels and this CPU
    /// can run them (the avx512 variant's features and AVX512_BF16); if
    /// not, why.
    pub fn bf16dot_available() -> Result<(), String> {
        // Asked once: every bf16dot product checks it.
        static AVAILABLE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
        AVAILABLE
            .get_or_init(|| {
                if BF16DOT_KERNELS.is_empty() {
                    return Err(
                        "this build has none (they are built with the avx512 feature, on x86-64)"
                            .into(),
                    );
                }
                let mut missing = crate::cpu::missing_features(Isa::Avx512);
                if !crate::cpu::has_feature("avx512bf16") {
                    missing.push("avx512bf16".into());
                }
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(format!("this CPU lacks {}", missing.join(", ")))
                }
            })
            .clone()
    }

    /// Whether this binary has the amx kernels and this CPU and OS can run
    /// them (the avx512 variant's features, AMX-BF16 and AMX-TILE, and the
    /// tile state granted to this process by Linux); if not, why. The first
    /// call asks Linux for the tile state (arch_prctl), once per process.
    pub fn amx_available() -> Result<(), String> {
        static AVAILABLE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
        AVAILABLE
            .get_or_init(|| {
                let Some(init) = AMX_INIT else {
                    return Err("this build has none (they are built with the avx512 feature, on x86-64, by a C compiler that takes -mamx-bf16)".into());
                };
                let missing = crate::cpu::missing_features(Isa::Avx512);
                if !missing.is_empty() {
                    return Err(format!("this CPU lacks {}", missing.join(", ")));
                }
                // SAFETY: bs_amx_init takes no arguments; it reads CPUID
                // (and XCR0 only once CPUID says OSXSAVE) and makes one
                // arch_prctl system call, touching no memory of ours.
                match unsafe { init() } {
                    0 => Ok(()),
                    1 => Err("this CPU lacks AMX-BF16 (AMX tiles: Intel Sapphire Rapids and later)".into()),
                    2 => Err("the OS has not enabled the AMX tile state (XCR0)".into()),
                    _ => Err("Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM; it needs Linux 5.16 or later)".into()),
                }
            })
            .clone()
    }

    /// The amx kernel for a BF16, FP8 or FP4 shape: specialised when the build
    /// made one (and these kernels use specialised ones).
    pub fn amx_kernel(
        &self,
        format: Format,
        rows: usize,
        cols: usize,
    ) -> Option<&'static AmxKernel> {
        self.specialised
            .then(|| Self::amx_kernel_specialised(format, rows, cols))
            .flatten()
            .or_else(|| Self::amx_kernel_generic(format))
    }

    pub fn amx_kernel_specialised(
        format: Format,
        rows: usize,
        cols: usize,
    ) -> Option<&'static AmxKernel> {
        AMX_KERNELS
            .iter()
            .find(|k| k.format == format && k.shape == Some((rows, cols)))
    }

    pub fn amx_kernel_generic(format: Format) -> Option<&'static AmxKernel> {
        AMX_KERNELS
            .iter()
            .find(|k| k.format == format && k.shape.is_none())
    }

    /// Y = W X for BF16, FP8 or FP4 W and activations packed for the amx kernels, with
    /// a given amx kernel, rows split across threads in whole 32-row blocks.
    pub fn matmul_amx_with(
        &self,
        k: &AmxKernel,
        m: &Matrix,
        x: &AmxX,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let call = self.amx_call(k, m, x, y)?;
        let (rows, threads) = (m.rows, rayon::current_num_threads());
        let work = rows.saturating_mul(m.cols).saturating_mul(x.n);
        if threads <= 1 || work < PARALLEL_MIN_ELEMS || rows < 64 {
            call(0, rows);
        } else {
            use rayon::prelude::*;
            split(rows, threads * 2, 32)
                .into_par_iter()
                .for_each(|(r0, r1)| call(r0, r1));
        }
        Ok(())
    }

    /// Rows r0..r1 of Y = W X only (of every token), on the calling thread.
    pub fn matmul_amx_rows_with(
        &self,
        k: &AmxKernel,
        m: &Matrix,
        x: &AmxX,
        y: &mut [f32],
        r0: usize,
        r1: usize,
    ) -> Result<(), KernelError> {
        check_row_range(r0, r1, m.rows)?;
        let call = self.amx_call(k, m, x, y)?;
        call(r0, r1);
        Ok(())
    }

    /// Check an amx product's operands; then a call computing rows r0..r1
    /// (0 <= r0 <= r1 <= rows; concurrent calls on disjoint rows).
    fn amx_call(
        &self,
        k: &AmxKernel,
        m: &Matrix,
        x: &AmxX,
        y: &mut [f32],
    ) -> Result<impl Fn(usize, usize) + Sync + Send + Copy, KernelError> {
        Self::amx_available().map_err(|why| KernelError::no_amx(m.format(), why))?;
        if !matches!(m.format(), Format::Bf16 | Format::Fp8 | Format::Fp4) {
            return Err(KernelError::Shape(format!(
                "the amx kernels take BF16, FP8 or FP4 weights, not {}",
                m.format()
            )));
        }
        if k.format != m.format() {
            return Err(KernelError::Shape(format!(
                "amx kernel for {} weights used on a {} matrix",
                k.format,
                m.format()
            )));
        }
        let (w, s) = m.ptrs();
        check_dot_shape("amx", k.shape, m, x.cols)?;
        let n = x.n;
        let len = AmxX::len_for(n, m.cols)
            .ok_or_else(|| KernelError::Shape("amx: packed activations overflow".into()))?;
        check_len(&format!("amx input X [{n}, {}]", m.cols), len, x.b.len())?;
        check_len(
            &format!("matmul output Y [{n}, {}]", m.rows),
            n * m.rows,
            y.len(),
        )?;
        let (rows, cols) = (m.rows, m.cols);
        let (wp, sp, xp, yp) = (
            SendPtr(w),
            SendPtr(s),
            SendPtr(x.b.as_ptr()),
            SendPtr(y.as_mut_ptr()),
        );
        let f = k.f;
        Ok(move |r0: usize, r1: usize| {
            let (wp, sp, xp, yp) = (wp, sp, xp, yp);
            if n == 0 || r0 >= r1 {
                return;
            }
            // SAFETY: amx_available checked that this CPU has the avx512
            // variant's features and AMX-BF16, and that Linux granted this
            // process the tile state; Matrix::new checked that w holds
            // rows×cols BF16 values, or for FP8 rows×cols code bytes and
            // ceil(rows/128)×ceil(cols/128) scale bytes, or for FP4
            // rows×cols/2 code bytes and rows×cols/32 scale bytes (cols a
            // multiple of 32), and the kernel is for that format (checked
            // above; the BF16 kernels do not read s, null here); x holds
            // the pair layout for n tokens of cols columns (length checked
            // above) and y n×rows; the kernel's shape matches; the callers
            // pass 0 <= r0 <= r1 <= rows, and concurrent calls write
            // disjoint rows of every token's output.
            unsafe { f(wp.0, sp.0, xp.0, yp.0, rows, cols, n, r0, r1) }
        })
    }

    /// Y = W X through the amx kernels (X rounded to BF16 and packed here).
    fn matmul_amx(
        &self,
        m: &Matrix,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let k = self
            .amx_kernel(m.format(), m.rows, m.cols)
            .ok_or_else(|| KernelError::no_amx(m.format(), "this build has none".into()))?;
        // One buffer per thread, reused across calls; a nested call on the
        // same thread (a rayon worker taking another task while it waits)
        // finds it in use and packs into its own.
        thread_local! {
            static ACT: std::cell::RefCell<AmxX> = std::cell::RefCell::new(AmxX::default());
        }
        let mut run = |a: &mut AmxX| {
            a.pack_from(x, n, m.cols)?;
            self.matmul_amx_with(k, m, a, y)
        };
        ACT.with(|a| match a.try_borrow_mut() {
            Ok(mut a) => run(&mut a),
            Err(_) => run(&mut AmxX::default()),
        })
    }

    /// The bf16dot (BF16 `format`) or fp8dot (FP8) kernel for a shape:
    /// specialised when the build made one (and these kernels use
    /// specialised ones).
    pub fn bf16dot_kernel(
        &self,
        format: Format,
        rows: usize,
        cols: usize,
    ) -> Option<&'static Bf16DotKernel> {
        self.specialised
            .then(|| Self::bf16dot_kernel_specialised(format, rows, cols))
            .flatten()
            .or_else(|| Self::bf16dot_kernel_generic(format))
    }

    pub fn bf16dot_kernel_specialised(
        format: Format,
        rows: usize,
        cols: usize,
    ) -> Option<&'static Bf16DotKernel> {
        BF16DOT_KERNELS
            .iter()
            .find(|k| k.format == format && k.shape == Some((rows, cols)))
    }

    pub fn bf16dot_kernel_generic(format: Format) -> Option<&'static Bf16DotKernel> {
        BF16DOT_KERNELS
            .iter()
            .find(|k| k.format == format && k.shape.is_none())
    }

    /// Y = W X for BF16 (or FP8) W and packed BF16 activations, with a given
    /// bf16dot (fp8dot) kernel (X's n tokens at once), rows split across
    /// threads.
    pub fn matmul_bf16dot_with(
        &self,
        k: &Bf16DotKernel,
        m: &Matrix,
        x: &Bf16X,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let call = self.bf16dot_call(k, m, x, y)?;
        self.par_rows(m.rows, m.cols, x.n, call);
        Ok(())
    }

    /// Rows r0..r1 of Y = W X only (of every token), on the calling thread.
    pub fn matmul_bf16dot_rows_with(
        &self,
        k: &Bf16DotKernel,
        m: &Matrix,
        x: &Bf16X,
        y: &mut [f32],
        r0: usize,
        r1: usize,
    ) -> Result<(), KernelError> {
        check_row_range(r0, r1, m.rows)?;
        let call = self.bf16dot_call(k, m, x, y)?;
        call(r0, r1);
        Ok(())
    }

    /// Check a bf16dot product's operands; then a call computing rows
    /// r0..r1 (0 <= r0 <= r1 <= rows; concurrent calls on disjoint rows).
    fn bf16dot_call(
        &self,
        k: &Bf16DotKernel,
        m: &Matrix,
        x: &Bf16X,
        y: &mut [f32],
    ) -> Result<impl Fn(usize, usize) + Sync + Send + Copy, KernelError> {
        let family = crate::plan::dot_family(k.format);
        Self::bf16dot_available().map_err(|why| KernelError::no_dot(k.format, why))?;
        let (w, s) = match (k.format, &m.weights) {
            (Format::Bf16, Weights::Bf16(w)) => (w.as_ptr().cast::<c_void>(), std::ptr::null()),
            (Format::Fp8, Weights::Fp8 { w, scale }) => (w.as_ptr().cast(), scale.as_ptr()),
            _ => {
                return Err(KernelError::Shape(format!(
                    "the {family} kernels take {} weights, not {}",
                    k.format,
                    m.format()
                )))
            }
        };
        check_dot_shape(family, k.shape, m, x.cols)?;
        let (n, xs) = (x.n, x.stride());
        check_len(&format!("{family} input X [{n}, {xs}]"), n * xs, x.h.len())?;
        check_len(
            &format!("matmul output Y [{n}, {}]", m.rows),
            n * m.rows,
            y.len(),
        )?;
        let (rows, cols) = (m.rows, m.cols);
        let (wp, sp, xp, yp) = (
            SendPtr(w),
            SendPtr(s),
            SendPtr(x.h.as_ptr()),
            SendPtr(y.as_mut_ptr()),
        );
        let f = k.f;
        Ok(move |r0: usize, r1: usize| {
            let (wp, sp, xp, yp) = (wp, sp, xp, yp);
            if n == 0 || r0 >= r1 {
                return;
            }
            // SAFETY: bf16dot_available checked that this CPU has every
            // feature the kernel was compiled for; the kernel's format is the
            // matrix's, and Matrix::new checked that w holds rows×cols values
            // (and, FP8, the scales ceil(rows/128)×ceil(cols/128) bytes; BF16
            // kernels never read s); x holds n rows of xs >= cols rounded up
            // to 32, plus 32, values (Bf16X::pack_from, checked above) and y
            // n×rows; the kernel's shape matches; the callers pass 0 <= r0 <=
            // r1 <= rows, and concurrent calls write disjoint rows of every
            // token's output.
            unsafe { f(wp.0, sp.0, xp.0, xs, yp.0, rows, cols, n, r0, r1) }
        })
    }

    /// Whether products on `format` weights take activations rounded to
    /// BF16 (the bf16dot or fp8dot kernels).
    /// Which kernels a product of `n` tokens on a `format` matrix takes, by
    /// the activations its variant gives it (the GPU picks its kernel by the
    /// same answer, [`Kernels::on_gpu`]).
    fn route(&self, format: Format, n: usize) -> Route {
        if self.fp4_act == Fp4Act::Q8 && format == Format::Fp4 {
            Route::Q8
        } else if self.dot_act(format) {
            Route::Dot
        } else if self.amx_min_tokens(format).is_some_and(|min| n >= min) {
            Route::Amx
        } else {
            Route::F32
        }
    }

    fn dot_act(&self, format: Format) -> bool {
        match format {
            Format::Bf16 => self.bf16_act == Bf16Act::Bf16,
            Format::Fp8 => self.fp8_act == Bf16Act::Bf16,
            _ => false,
        }
    }

    /// Where `format` matrices go to the amx kernels (`--bf16-act amx`,
    /// `--fp8-act amx`, `--fp4-act amx`): the fewest tokens a product takes
    /// to go there.
    pub fn amx_min_tokens(&self, format: Format) -> Option<usize> {
        use crate::bf16act::{AMX_FP4_MIN_TOKENS, AMX_FP8_MIN_TOKENS, AMX_MIN_TOKENS};
        match format {
            Format::Bf16 if self.bf16_act == Bf16Act::Amx => Some(AMX_MIN_TOKENS),
            Format::Fp8 if self.fp8_act == Bf16Act::Amx => Some(AMX_FP8_MIN_TOKENS),
            Format::Fp4 if self.fp4_act == Fp4Act::Amx => Some(AMX_FP4_MIN_TOKENS),
            _ => None,
        }
    }

    /// Y = W X through the bf16dot or fp8dot kernels (X rounded to BF16 here).
    fn matmul_bf16dot(
        &self,
        m: &Matrix,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let k = self
            .bf16dot_kernel(m.format(), m.rows, m.cols)
            .ok_or_else(|| KernelError::no_dot(m.format(), "this build has none".into()))?;
        // One buffer per thread, reused across calls.
        thread_local! {
            static ACT: std::cell::RefCell<Bf16X> = std::cell::RefCell::new(Bf16X::default());
        }
        ACT.with(|a| {
            let mut a = a.borrow_mut();
            a.pack_from(x, n, m.cols)?;
            self.matmul_bf16dot_with(k, m, &a, y)
        })
    }

    /// These kernels with products on matrices resident in VRAM tier `tier`
    /// sent to the GPU (0: none).
    pub fn with_tier(self, tier: u32) -> Kernels {
        Kernels { tier, ..self }
    }

    pub fn tier(&self) -> u32 {
        self.tier
    }

    /// The fp4×q8 kernel for a shape: specialised when the build made one
    /// (and these kernels use specialised ones).
    pub fn q8_kernel(&self, rows: usize, cols: usize) -> &'static Q8Kernel {
        self.specialised
            .then(|| self.q8_kernel_specialised(rows, cols))
            .flatten()
            .unwrap_or_else(|| self.q8_kernel_generic())
    }

    pub fn q8_kernel_specialised(&self, rows: usize, cols: usize) -> Option<&'static Q8Kernel> {
        Q8_KERNELS
            .iter()
            .find(|k| k.isa == self.isa && k.shape == Some((rows, cols)))
    }

    pub fn q8_kernel_generic(&self) -> &'static Q8Kernel {
        Q8_KERNELS
            .iter()
            .find(|k| k.isa == self.isa && k.shape.is_none())
            .expect("build.rs emits a generic fp4×q8 kernel for every compiled ISA")
    }

    /// y = W x for FP4 W and quantized x, with a given fp4×q8 kernel.
    pub fn matvec_q8_with(
        &self,
        k: &Q8Kernel,
        m: &Matrix,
        x: &Q8Act,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let run = self.q8_runner(k, m, x, y)?;
        self.par_rows(m.rows, m.cols, 1, run);
        Ok(())
    }

    /// Rows r0..r1 of the fp4×q8 y = W x only, on the calling thread (tests
    /// of how a kernel walks a range; callers that split rows themselves).
    pub fn matvec_q8_rows_with(
        &self,
        k: &Q8Kernel,
        m: &Matrix,
        x: &Q8Act,
        y: &mut [f32],
        r0: usize,
        r1: usize,
    ) -> Result<(), KernelError> {
        check_row_range(r0, r1, m.rows)?;
        let run = self.q8_runner(k, m, x, y)?;
        run(r0, r1);
        Ok(())
    }

    /// Checks an fp4×q8 call (weights, kernel, lengths) and returns what
    /// runs rows r0..r1 of it (0 <= r0 <= r1 <= rows; disjoint ranges may
    /// run at once). The runner holds y's borrow for as long as it lives.
    fn q8_runner<'y>(
        &self,
        k: &Q8Kernel,
        m: &'y Matrix<'_>,
        x: &'y Q8Act,
        y: &'y mut [f32],
    ) -> Result<impl Fn(usize, usize) + Send + Sync + Copy + 'y, KernelError> {
        let Weights::Fp4 { w, scale } = m.weights else {
            return Err(KernelError::Shape(format!(
                "the fp4×q8 kernels take FP4 weights, not {}",
                m.format()
            )));
        };
        if k.isa != self.isa {
            return Err(KernelError::Shape(format!(
                "fp4×q8 kernel for {} used with the {} variant",
                k.isa, self.isa
            )));
        }
        if let Some((r, c)) = k.shape {
            if (r, c) != (m.rows, m.cols) {
                return Err(KernelError::Shape(format!(
                    "fp4×q8 kernel specialised for {r}×{c} used on a {}×{} matrix",
                    m.rows, m.cols
                )));
            }
        }
        check_len("fp4×q8 input xq", m.cols, x.q.len())?;
        check_len("fp4×q8 input scales", m.cols / crate::q8::BLOCK, x.d.len())?;
        check_len(
            "fp4×q8 input block sums",
            m.cols / crate::q8::BLOCK,
            x.sum.len(),
        )?;

        check_len("matvec output y", m.rows, y.len())?;
        let (rows, cols) = (m.rows, m.cols);
        let (wp, sp, qp, dp, cp, yp) = (
            SendPtr(w.as_ptr()),
            SendPtr(scale.as_ptr()),
            SendPtr(x.q.as_ptr()),
            SendPtr(x.d.as_ptr()),
            SendPtr(x.sum.as_ptr()),
            SendPtr(y.as_mut_ptr()),
        );
        let f = k.f;
        Ok(move |r0: usize, r1: usize| {
            let (wp, sp, qp, dp, cp, yp) = (wp, sp, qp, dp, cp, yp);
            assert!(
                r0 <= r1 && r1 <= rows,
                "fp4×q8 row range {r0}..{r1} outside 0..{rows}"
            );
            // SAFETY: Matrix::new checked w (rows×cols/2 bytes) and scale
            // (rows×cols/32) and that cols is a multiple of 32; xq has cols
            // and xd and xs cols/32 elements, y rows (checked above); the
            // runner borrows m, x and y for its whole life; the kernel's
            // shape matches; 0 <= r0 <= r1 <= rows (asserted) and
            // concurrent calls write disjoint rows of y.
            unsafe { f(wp.0, sp.0, qp.0, dp.0, cp.0, yp.0, rows, cols, r0, r1) }
        })
    }

    /// Y = W X through the fp4×q8 kernels, one token at a time.
    fn matmul_q8(&self, m: &Matrix, x: &[f32], n: usize, y: &mut [f32]) -> Result<(), KernelError> {
        let k = self.q8_kernel(m.rows, m.cols);
        // One buffer per thread, reused across calls (decode calls this for
        // every FP4 matrix of every token).
        thread_local! {
            static ACT: std::cell::RefCell<Q8Act> = std::cell::RefCell::new(Q8Act::default());
        }
        ACT.with(|a| self.matmul_q8_with(k, m, x, n, y, &mut a.borrow_mut()))
    }

    /// Y = W X with a given fp4×q8 kernel, one token at a time, each token
    /// quantized into `act` first (benchmarks: specialised vs generic).
    pub fn matmul_q8_with(
        &self,
        k: &Q8Kernel,
        m: &Matrix,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        act: &mut Q8Act,
    ) -> Result<(), KernelError> {
        check_len(
            &format!("matmul input X [{n}, {}]", m.cols),
            n * m.cols,
            x.len(),
        )?;
        check_len(
            &format!("matmul output Y [{n}, {}]", m.rows),
            n * m.rows,
            y.len(),
        )?;
        for (xt, yt) in x.chunks_exact(m.cols).zip(y.chunks_exact_mut(m.rows)) {
            act.quantize_from(xt)?;
            self.matvec_q8_with(k, m, act, yt)?;
        }
        Ok(())
    }

    /// The kernel for a matrix: specialised on its shape when the build made
    /// one (and these kernels use specialised ones), else generic.
    pub fn mat_kernel(&self, format: Format, rows: usize, cols: usize) -> &'static MatKernel {
        self.specialised
            .then(|| self.mat_kernel_specialised(format, rows, cols))
            .flatten()
            .unwrap_or_else(|| self.mat_kernel_generic(format))
    }

    pub fn mat_kernel_specialised(
        &self,
        format: Format,
        rows: usize,
        cols: usize,
    ) -> Option<&'static MatKernel> {
        if format == Format::Fp8 {
            // An unknown BESPOKE_FP8_SCALED leaves the "s" tiles on; from_env
            // reports it.
            let _ = fp8_scaled();
        }
        MAT_KERNELS
            .iter()
            .find(|k| k.isa == self.isa && k.format == format && k.shape == Some((rows, cols)))
    }

    pub fn mat_kernel_generic(&self, format: Format) -> &'static MatKernel {
        if format == Format::Fp8 {
            let _ = fp8_scaled();
        }
        MAT_KERNELS
            .iter()
            .find(|k| k.isa == self.isa && k.format == format && k.shape.is_none())
            .expect("build.rs emits a generic kernel for every compiled ISA and format")
    }

    /// The attention kernel for a head shape: specialised when the build
    /// made one (and these kernels use specialised ones), else generic.
    pub fn attn_kernel(&self, shape: AttnShape) -> &'static AttnKernel {
        ATTN_KERNELS
            .iter()
            .find(|k| self.specialised && k.isa == self.isa && k.shape == Some(shape))
            .or_else(|| {
                ATTN_KERNELS
                    .iter()
                    .find(|k| k.isa == self.isa && k.shape.is_none())
            })
            .expect("build.rs emits a generic attention kernel for every compiled ISA")
    }

    /// A product whose matrix is resident on the GPU (the `cuda` build's VRAM
    /// tier, [`crate::gpu::tier`]) runs there: Some(result). None: it runs on
    /// the CPU (not resident, or the GPU call failed, which is said once).
    #[cfg(feature = "cuda")]
    fn on_gpu(&self, m: &Matrix, x: &[f32], n: usize, y: &mut [f32]) -> Option<()> {
        let p = self.gpu_product(m, n)?;
        if x.len() != n * m.cols || y.len() != n * m.rows {
            return None; // the CPU path reports the length error
        }
        match crate::gpu::tier::matmul(&p, x, n) {
            Ok(v) => {
                y.copy_from_slice(&v);
                Some(())
            }
            Err(e) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    eprintln!("CUDA: a GPU product failed ({e}); running it on the CPU")
                });
                None
            }
        }
    }

    /// The activations the CPU gives a product of `n` tokens with a
    /// `format` matrix here, which pick its kernel on the GPU.
    #[cfg(feature = "cuda")]
    fn gpu_act(&self, format: Format, n: usize) -> crate::gpu::GpuAct {
        match self.route(format, n) {
            Route::Q8 => crate::gpu::GpuAct::Q8,
            Route::Dot | Route::Amx => crate::gpu::GpuAct::Bf16,
            Route::F32 => crate::gpu::GpuAct::F32,
        }
    }

    /// A SwiGLU expert's (gate, up, down) device products for one job on
    /// the GPU ([`crate::gpu::FfnJob`]): Some where all three matrices are
    /// resident in this engine's VRAM tier and the device can give each
    /// its activations ([`Kernels::gpu_product_q`], `act_quant` as there).
    #[cfg(feature = "cuda")]
    pub fn ffn_mats(
        &self,
        mats: [&Matrix; 3],
        n: usize,
        act_quant: bool,
    ) -> Option<[crate::gpu::DevProduct; 3]> {
        Some([
            self.gpu_product_q(mats[0], n, act_quant)?,
            self.gpu_product_q(mats[1], n, act_quant)?,
            self.gpu_product_q(mats[2], n, act_quant)?,
        ])
    }

    /// [`Kernels::gpu_product`], where `act_quant` (DeepSeek V4's
    /// `--numerics deepseek`) asks for DeepSeek's simulated FP8
    /// activations before an FP8 or FP4 product: the device makes them
    /// (`GpuAct::Fp8Sim`) where the product would take f32 ones. None
    /// where it takes an activation variant's as well (`--fp4-act q8`,
    /// say): that product goes on its own, its activations made on the CPU.
    #[cfg(feature = "cuda")]
    pub fn gpu_product_q(
        &self,
        m: &Matrix,
        n: usize,
        act_quant: bool,
    ) -> Option<crate::gpu::DevProduct> {
        let mut p = self.gpu_product(m, n)?;
        if act_quant && matches!(m.format(), Format::Fp8 | Format::Fp4) {
            if p.act != crate::gpu::GpuAct::F32 {
                return None;
            }
            p.act = crate::gpu::GpuAct::Fp8Sim;
        }
        Some(p)
    }

    /// `m` on the GPU for a product of `n` tokens: its device copy, whether
    /// the build specialised a kernel for its shape, and the activations
    /// the CPU would give it (f32; rounded to BF16 by `--bf16-act` /
    /// `--fp8-act` / `--fp4-act amx`; int8 by `--fp4-act q8`), which the
    /// device makes alike. None: no VRAM tier, or not resident.
    #[cfg(feature = "cuda")]
    pub fn gpu_product(&self, m: &Matrix, n: usize) -> Option<crate::gpu::DevProduct> {
        let act = self.gpu_act(m.format(), n);
        if self.tier == 0 {
            return None;
        }
        Some(crate::gpu::DevProduct {
            mat: crate::gpu::tier::resident(self.tier, m)?,
            specialised: self.mat_kernel(m.format(), m.rows, m.cols).shape.is_some(),
            act,
        })
    }

    /// `ys[i] = ms[i] · X` (`n` tokens) where `xs` holds one X that every
    /// matrix takes (q, k and v) or one X a matrix. With a VRAM tier holding
    /// every one of them they run on the GPU queued together, each with its
    /// activations (`Kernels::gpu_list`); else (or if that fails, said
    /// once) each as [`Kernels::matmul`] runs it.
    pub fn matmul_list(
        &self,
        ms: &[&Matrix],
        xs: &[&[f32]],
        n: usize,
        ys: &mut [&mut [f32]],
    ) -> Result<(), KernelError> {
        if ms.len() != ys.len() {
            return Err(KernelError::Length {
                what: "outputs of a list of products".into(),
                expected: ms.len(),
                found: ys.len(),
            });
        }
        let x_of = |i: usize| xs[if xs.len() == 1 { 0 } else { i }];
        #[cfg(feature = "cuda")]
        if ms.len() > 1 && self.gpu_list(ms, xs, n, ys, false) {
            return Ok(());
        }
        for (i, (m, y)) in ms.iter().zip(ys.iter_mut()).enumerate() {
            if n == 1 {
                self.matvec(m, x_of(i), y)?;
            } else {
                self.matmul(m, x_of(i), n, y)?;
            }
        }
        Ok(())
    }

    /// `ys[i] = ms[i] · X` on the GPU, queued together (each X uploaded
    /// once, one wait for all: `gpu::tier::products`), where this engine's
    /// VRAM tier holds every matrix and the device can give each its
    /// activations ([`Kernels::gpu_product_q`], `act_quant` as there). true:
    /// done; false: not tried, or failed (said once), and the caller runs
    /// them its own way.
    #[cfg(feature = "cuda")]
    pub fn gpu_list(
        &self,
        ms: &[&Matrix],
        xs: &[&[f32]],
        n: usize,
        ys: &mut [&mut [f32]],
        act_quant: bool,
    ) -> bool {
        if self.tier == 0 || ms.len() != ys.len() || !(xs.len() == 1 || xs.len() == ms.len()) {
            return false;
        }
        let x_of = |i: usize| xs[if xs.len() == 1 { 0 } else { i }];
        let fits = ms
            .iter()
            .zip(ys.iter())
            .enumerate()
            .all(|(i, (m, y))| x_of(i).len() == n * m.cols && y.len() == n * m.rows);
        let mats: Option<Vec<_>> = ms
            .iter()
            .map(|m| self.gpu_product_q(m, n, act_quant))
            .collect();
        let (true, Some(mats)) = (fits, mats) else {
            return false;
        };
        match crate::gpu::tier::products(self.tier, &mats, xs, n) {
            Ok(outs) if outs.len() == ys.len() => {
                for (y, o) in ys.iter_mut().zip(outs) {
                    y.copy_from_slice(&o);
                }
                true
            }
            res => {
                let e = res
                    .err()
                    .unwrap_or_else(|| "another count of outputs".into());
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    eprintln!(
                        "CUDA: a list of products on the GPU failed ({e}); running them one by one"
                    )
                });
                false
            }
        }
    }

    /// y = W x.
    pub fn matvec(&self, m: &Matrix, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
        #[cfg(feature = "cuda")]
        if self.on_gpu(m, x, 1, y).is_some() {
            return Ok(());
        }
        match self.route(m.format(), 1) {
            Route::Q8 => self.matmul_q8(m, x, 1, y),
            Route::Dot => self.matmul_bf16dot(m, x, 1, y),
            Route::Amx | Route::F32 => {
                self.matvec_with(self.mat_kernel(m.format(), m.rows, m.cols), m, x, y)
            }
        }
    }

    /// `Y[n][rows] = W X[n][cols]`, X and Y row-major by token.
    pub fn matmul(
        &self,
        m: &Matrix,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        #[cfg(feature = "cuda")]
        if self.on_gpu(m, x, n, y).is_some() {
            return Ok(());
        }
        match self.route(m.format(), n) {
            Route::Q8 => self.matmul_q8(m, x, n, y),
            Route::Dot => self.matmul_bf16dot(m, x, n, y),
            Route::Amx => self.matmul_amx(m, x, n, y),
            Route::F32 => self.matmul_with(self.mat_kernel(m.format(), m.rows, m.cols), m, x, n, y),
        }
    }

    fn check_kernel(&self, k: &MatKernel, m: &Matrix) -> Result<(), KernelError> {
        if k.isa != self.isa || k.format != m.format() {
            return Err(KernelError::Shape(format!(
                "kernel for {} {} used on a {} matrix with the {} variant",
                k.isa,
                k.format,
                m.format(),
                self.isa
            )));
        }
        if let Some((r, c)) = k.shape {
            if (r, c) != (m.rows, m.cols) {
                return Err(KernelError::Shape(format!(
                    "kernel specialised for {r}×{c} used on a {}×{} matrix",
                    m.rows, m.cols
                )));
            }
        }
        Ok(())
    }

    /// y = W x with a given kernel (for benchmarks: specialised vs generic).
    pub fn matvec_with(
        &self,
        k: &MatKernel,
        m: &Matrix,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("matvec input x", m.cols, x.len())?;
        check_len("matvec output y", m.rows, y.len())?;
        // One call (one thread, or a matrix too small to share) prepares
        // its own x at no extra cost, and small calls feel every step here;
        // a scanned FP8 matrix goes the prepared way all the same, the only
        // one that can tell the kernel its codes hold no NaN.
        if let Some(p) = k
            .prepared
            .filter(|_| m.fp8_clean || shares_rows(m.rows, m.cols, 1))
        {
            // SAFETY: a pure function of its argument.
            let len = unsafe { (p.len)(m.cols) };
            if len > 0 {
                return self.matvec_prepared(k, p, len, m, x, y);
            }
        }
        let f = k.matvec;
        // SAFETY (of the call below): run_rows checked the kernel against the
        // matrix; Matrix::new checked the weight and scale lengths for
        // rows×cols; x has cols and y rows elements (checked above);
        // 0 <= r0 <= r1 <= rows; concurrent calls write disjoint rows of y.
        self.run_rows(
            k,
            m,
            x,
            y,
            1,
            move |w, s, x, y, rows, cols, r0, r1| unsafe { f(w, s, x, y, rows, cols, r0, r1) },
        )
    }

    /// y = W x through the kernel's `Prepared` matvec: x prepared once on
    /// this thread into `len` floats, then the rows split as `run_rows`
    /// splits them. The caller has checked x and y.
    fn matvec_prepared(
        &self,
        k: &MatKernel,
        p: Prepared,
        len: usize,
        m: &Matrix,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        with_x_buf(|xp| {
            xp.scratch(len);
            // SAFETY: x has cols elements (checked by the caller) and xp the
            // len = p.len(cols) floats prep writes (all the "_px" kernels
            // read of them).
            let flag = unsafe { (p.prep)(x.as_ptr(), m.cols, xp.as_mut_ptr()) };
            // FP8 x the "s" tiles may take (1), for a matrix scanned and
            // free of NaN codes: 2, the "s" tiles without their check
            // (matvec_px_body, templates/matmul.c.tera).
            let flag = if flag == 1 && m.fp8_clean { 2 } else { flag };
            let f = p.matvec;
            // SAFETY (of the call below): as in matvec_with, with x
            // prepared by this kernel's prep (its flag beside it); xp
            // outlives the calls (run_rows returns after them).
            self.run_rows(
                k,
                m,
                xp,
                y,
                1,
                move |w, s, xp, y, rows, cols, r0, r1| unsafe {
                    f(w, s, xp, flag, y, rows, cols, r0, r1)
                },
            )
        })
    }

    /// Y = W X with a given kernel.
    pub fn matmul_with(
        &self,
        k: &MatKernel,
        m: &Matrix,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let xn = n
            .checked_mul(m.cols)
            .ok_or_else(|| KernelError::Shape("n × cols overflows".into()))?;
        let yn = n
            .checked_mul(m.rows)
            .ok_or_else(|| KernelError::Shape("n × rows overflows".into()))?;
        check_len(&format!("matmul input X [{n}, {}]", m.cols), xn, x.len())?;
        check_len(&format!("matmul output Y [{n}, {}]", m.rows), yn, y.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = k.matmul;
        // SAFETY (of the call below): as in matvec_with; X has n×cols and Y
        // n×rows elements, and concurrent calls write disjoint rows r0..r1 of
        // every token's output.
        self.run_rows(
            k,
            m,
            x,
            y,
            n,
            move |w, s, x, y, rows, cols, r0, r1| unsafe { f(w, s, x, y, rows, cols, n, r0, r1) },
        )
    }

    /// Check the kernel, then call `call(w, scale, x, y, rows, cols, r0, r1)`
    /// over row ranges covering 0..rows, in parallel when worth it. The
    /// caller has checked x and y for `n` tokens.
    #[allow(clippy::type_complexity)]
    fn run_rows(
        &self,
        k: &MatKernel,
        m: &Matrix,
        x: &[f32],
        y: &mut [f32],
        n: usize,
        call: impl Fn(*const c_void, *const u8, *const f32, *mut f32, usize, usize, usize, usize)
            + Sync
            + Send
            + Copy,
    ) -> Result<(), KernelError> {
        self.check_kernel(k, m)?;
        let (w, s) = m.ptrs();
        let (rows, cols) = (m.rows, m.cols);
        let direct = matches!(m.format(), Format::F32 | Format::Bf16);
        with_aligned_x(x, cols, direct, |x| {
            let (w, s, xp, yp) = (
                SendPtr(w),
                SendPtr(s),
                SendPtr(x.as_ptr()),
                SendPtr(y.as_mut_ptr()),
            );
            let run = move |r0: usize, r1: usize| {
                let (w, s, xp, yp) = (w, s, xp, yp);
                call(w.0, s.0, xp.0, yp.0, rows, cols, r0, r1)
            };
            self.par_rows(rows, cols, n, run);
        });
        Ok(())
    }

    /// Rows r0..r1 of y = W x only, on the calling thread (tests of big
    /// specialised shapes; callers that split rows themselves).
    pub fn matvec_rows_with(
        &self,
        k: &MatKernel,
        m: &Matrix,
        x: &[f32],
        y: &mut [f32],
        r0: usize,
        r1: usize,
    ) -> Result<(), KernelError> {
        self.check_kernel(k, m)?;
        check_len("matvec input x", m.cols, x.len())?;
        check_len("matvec output y", m.rows, y.len())?;
        check_row_range(r0, r1, m.rows)?;
        let (w, s) = m.ptrs();
        // SAFETY: lengths checked as in matvec_with and r0 <= r1 <= rows.
        unsafe { (k.matvec)(w, s, x.as_ptr(), y.as_mut_ptr(), m.rows, m.cols, r0, r1) };
        Ok(())
    }

    /// Run `f` over row ranges covering 0..rows of a rows × cols matrix met
    /// by `tokens` tokens, in parallel when worth it. Which thread computes
    /// which rows never changes a result: every row is the same kernel's.
    ///
    /// One token (decode, bound by reading the weights): see
    /// [`DecodeSplit`]; each thread streams a region of its own, front to
    /// back, then helps with the others'. Several tokens (prefill, bound by
    /// arithmetic): about 4 ranges a thread, since each call of a kernel
    /// that permutes x first (FP8, FP4) repeats that work.
    fn par_rows(
        &self,
        rows: usize,
        cols: usize,
        tokens: usize,
        f: impl Fn(usize, usize) + Sync + Send + Copy,
    ) {
        if !shares_rows(rows, cols, tokens) {
            f(0, rows);
            return;
        }
        let threads = rayon::current_num_threads();
        use rayon::prelude::*;
        if tokens == 1 {
            let split = DecodeSplit::new(rows, threads);
            let next = split.counters();
            (0..threads)
                .into_par_iter()
                .for_each(|t| split.drain(&next, t, f));
            return;
        }
        let ranges = split(rows, threads * 4, 16);
        ranges.into_par_iter().for_each(|(r0, r1)| f(r0, r1));
    }

    /// Attention for one query position; `out` is [n_heads, head_dim].
    pub fn attn_decode(&self, a: &AttnArgs, out: &mut [f32]) -> Result<(), KernelError> {
        let shape = AttnShape {
            head_dim: a.head_dim,
            n_heads: a.n_heads,
            n_kv_heads: a.n_kv_heads,
        };
        self.attn_decode_with(self.attn_kernel(shape), a, out)
    }

    pub fn attn_decode_with(
        &self,
        k: &AttnKernel,
        a: &AttnArgs,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let shape = AttnShape {
            head_dim: a.head_dim,
            n_heads: a.n_heads,
            n_kv_heads: a.n_kv_heads,
        };
        if k.isa != self.isa || k.shape.is_some_and(|s| s != shape) {
            return Err(KernelError::Shape(format!(
                "attention kernel {:?} used for {shape:?}",
                k.shape
            )));
        }
        if a.n_heads == 0 || a.n_kv_heads == 0 || a.head_dim == 0 || a.n_heads % a.n_kv_heads != 0 {
            return Err(KernelError::Shape(format!(
                "attention needs n_heads a positive multiple of n_kv_heads and head_dim > 0, found {} heads, {} KV heads, head_dim {}",
                a.n_heads, a.n_kv_heads, a.head_dim
            )));
        }
        if a.t_len == 0 {
            return Err(KernelError::Shape(
                "attention over an empty KV cache (t_len = 0)".into(),
            ));
        }
        // One head's rows, and the KV heads' rows at one position, must not
        // overlap. The kernels would read overlapping rows without
        // complaint, so such a layout is refused as the caller's mistake.
        if a.t_len > 1 && a.kv_stride < a.head_dim {
            return Err(KernelError::Shape(format!(
                "kv_stride {} is smaller than head_dim {}: key/value rows would overlap",
                a.kv_stride, a.head_dim
            )));
        }
        if a.n_kv_heads > 1 && a.kv_head_stride < a.head_dim {
            return Err(KernelError::Shape(format!(
                "kv_head_stride {} is smaller than head_dim {}: the KV heads' rows would overlap",
                a.kv_head_stride, a.head_dim
            )));
        }
        check_len(
            "attention query [n_heads, head_dim]",
            a.n_heads * a.head_dim,
            a.q.len(),
        )?;
        check_len(
            "attention output [n_heads, head_dim]",
            a.n_heads * a.head_dim,
            out.len(),
        )?;
        // The last float read: the last position's row of the last KV head.
        let kv_needed = (a.t_len - 1)
            .checked_mul(a.kv_stride)
            .and_then(|x| x.checked_add((a.n_kv_heads - 1).checked_mul(a.kv_head_stride)?))
            .and_then(|x| x.checked_add(a.head_dim))
            .ok_or_else(|| {
                KernelError::Shape(format!(
                    "attention KV layout overflows: {} positions × kv_stride {}, {} KV heads × kv_head_stride {}",
                    a.t_len, a.kv_stride, a.n_kv_heads, a.kv_head_stride
                ))
            })?;
        for (what, buf) in [("keys", a.k), ("values", a.v)] {
            if buf.len() < kv_needed {
                return Err(KernelError::Length {
                    what: format!("attention {what} (at least, for {} positions)", a.t_len),
                    expected: kv_needed,
                    found: buf.len(),
                });
            }
        }
        if let Some(s) = a.sinks {
            check_len("attention sinks [n_heads]", a.n_heads, s.len())?;
        }
        // Each head's scores rounded up to 16, for up to 4 heads at a time
        // (those sharing a KV head), or for as many of a KV head's heads as
        // the call has where they are more (taken a block of positions at a
        // time), with their maxima and sums.
        let row = a.t_len.div_ceil(16) * 16 + 2;
        let group = a.n_heads / a.n_kv_heads;
        let f = k.f;
        let (q, kp, vp) = (
            SendPtr(a.q.as_ptr()),
            SendPtr(a.k.as_ptr()),
            SendPtr(a.v.as_ptr()),
        );
        let sp = SendPtr(a.sinks.map(|s| s.as_ptr()).unwrap_or(std::ptr::null()));
        let op = SendPtr(out.as_mut_ptr());
        let (nh, nkv, hd, stride, hstride, t_len, window, scale) = (
            a.n_heads,
            a.n_kv_heads,
            a.head_dim,
            a.kv_stride,
            a.kv_head_stride,
            a.t_len,
            a.window,
            a.scale,
        );
        let run = move |h0: usize, h1: usize| {
            let (q, kp, vp, sp, op) = (q, kp, vp, sp, op);
            let mut scratch = vec![0f32; group.min(h1 - h0).max(4) * row];
            // SAFETY: q and out hold n_heads×head_dim floats, k and v at least
            // (t_len-1)×kv_stride + (n_kv_heads-1)×kv_head_stride + head_dim,
            // sinks n_heads or null
            // (all checked above); scratch holds g × (t_len rounded up to 16,
            // plus 2), g the larger of 4 and the most of a group's heads in
            // h0..h1, as the kernels' header asks.
            // Concurrent calls write disjoint heads h0..h1 of out.
            unsafe {
                f(
                    q.0,
                    kp.0,
                    vp.0,
                    sp.0,
                    op.0,
                    scratch.as_mut_ptr(),
                    nh,
                    nkv,
                    hd,
                    stride,
                    hstride,
                    t_len,
                    window,
                    scale,
                    h0,
                    h1,
                )
            }
        };
        if !shares_heads(nh, t_len, hd) {
            run(0, nh);
        } else {
            use rayon::prelude::*;
            split(nh, rayon::current_num_threads(), 1)
                .into_par_iter()
                .for_each(|(h0, h1)| run(h0, h1));
        }
        Ok(())
    }
}

impl fmt::Display for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.isa)?;
        match self.fp4_act {
            Fp4Act::Q8 => write!(f, " (FP4 with int8 activations: fp4×q8)")?,
            Fp4Act::Amx => write!(f, " (FP4 prefill with BF16 activations on AMX tiles: amx)")?,
            Fp4Act::F32 => {}
        }
        match self.bf16_act {
            Bf16Act::Bf16 => write!(f, " (BF16 with BF16 activations: bf16dot)")?,
            Bf16Act::Amx => write!(f, " (BF16 prefill with BF16 activations on AMX tiles: amx)")?,
            Bf16Act::F32 => {}
        }
        match self.fp8_act {
            Bf16Act::Bf16 => write!(f, " (FP8 with BF16 activations: fp8dot)")?,
            Bf16Act::Amx => write!(f, " (FP8 prefill with BF16 activations on AMX tiles: amx)")?,
            Bf16Act::F32 => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The FP8 "s" tiles' switch reaches the kernels: with it on, an x under
    /// 2^8 is prepared for them (prep's flag 1), off it is not (0); the
    /// setting of this process comes back after. And the subnormal probe
    /// gives a ratio wherever the CPU has AVX-512.
    #[test]
    fn fp8_scaled_switch() {
        let setting = fp8_scaled()
            .clone()
            .expect("BESPOKE_FP8_SCALED is unset or valid in tests");
        let x = vec![0.5f32; 256];
        for &(isa, _) in FP8_SCALED_SWITCHES {
            let Ok(k) = Kernels::with_isa(isa) else {
                continue;
            };
            if isa == Isa::Avx512 {
                assert!(subnormal_cost(isa).is_some_and(|c| c > 0.0), "{isa}");
            }
            let p = k
                .mat_kernel_generic(Format::Fp8)
                .prepared
                .expect("FP8 kernels prepare x");
            for on in [true, false, true] {
                assert!(set_fp8_scaled(isa, on));
                // SAFETY: len and prep are this ISA's (the CPU has it:
                // with_isa); xp holds the len(256) floats prep writes, x
                // the 256 it reads.
                let flag = unsafe {
                    let mut xp = vec![0f32; (p.len)(x.len())];
                    (p.prep)(x.as_ptr(), x.len(), xp.as_mut_ptr())
                };
                assert_eq!(flag, on as c_int, "{isa}: \"s\" tiles switched {on}");
            }
        }
        for &(isa, on) in &setting.isas {
            assert!(set_fp8_scaled(isa, on));
        }
        assert!(
            !set_fp8_scaled(Isa::Scalar, true),
            "the scalar kernels have no \"s\" tiles"
        );
    }

    /// X reaches the kernels on a cache line when they read it in place and
    /// its rows are whole lines, unchanged otherwise; a nested call while the
    /// thread's buffer is in use copies into its own.
    #[test]
    fn x_is_handed_on_aligned() {
        let buf: Vec<f32> = (0..4096 + 64).map(|i| i as f32).collect();
        let base = buf.as_ptr().align_offset(LINE);
        for off in 0..16 {
            let x = &buf[base + off..base + off + 2048];
            with_aligned_x(x, 64, true, |xa| {
                assert_eq!(xa.as_ptr() as usize % LINE, 0, "offset {off}");
                assert_eq!(xa, x);
                let inner = &buf[base + 1..base + 1 + 128];
                with_aligned_x(inner, 16, true, |xb| {
                    assert_eq!(xb.as_ptr() as usize % LINE, 0);
                    assert_eq!(xb, inner);
                });
                // The outer copy is untouched by the inner one.
                assert_eq!(xa, x);
            });
            for (cols, direct) in [(64, false), (100, true)] {
                with_aligned_x(x, cols, direct, |xa| assert_eq!(xa.as_ptr(), x.as_ptr()));
            }
        }
    }

    /// Every row of a one-token product is claimed exactly once, in ranges
    /// that start on a unit boundary, whatever order the threads come in.
    #[test]
    fn decode_split_covers_every_row_once() {
        for &rows in &[1usize, 15, 16, 33, 100, 141, 512, 2048, 4096, 7168, 129_280] {
            for threads in 1..=9 {
                let split = DecodeSplit::new(rows, threads);
                assert_eq!(split.ends.len(), threads + 1);
                // Several schedules: thread by thread; round robin, one claim
                // each; and one thread doing everything, its own region first.
                for schedule in 0..3 {
                    let next = split.counters();
                    let mut seen = vec![0u8; rows];
                    let mut mark = |r0: usize, r1: usize| {
                        assert!(r0 < r1 && r1 <= rows, "{rows} rows: claimed {r0}..{r1}");
                        assert_eq!(r0 % split.unit, 0);
                        for s in &mut seen[r0..r1] {
                            *s += 1;
                        }
                    };
                    match schedule {
                        0 => {
                            for t in 0..threads {
                                split.drain(&next, t, &mut mark);
                            }
                        }
                        1 => {
                            let mut take = |t: usize, k: usize| -> bool {
                                let region = (t + k) % threads;
                                split
                                    .claim(&next[region], region, k == 0)
                                    .map(|(r0, r1)| mark(r0, r1))
                                    .is_some()
                            };
                            let mut k = vec![0usize; threads];
                            while k.iter().any(|&k| k < threads) {
                                for (t, kt) in k.iter_mut().enumerate() {
                                    while *kt < threads && !take(t, *kt) {
                                        *kt += 1;
                                    }
                                }
                            }
                        }
                        _ => split.drain(&next, threads / 2, &mut mark),
                    }
                    assert!(
                        seen.iter().all(|&s| s == 1),
                        "{rows} rows, {threads} threads, schedule {schedule}: a row claimed {} times",
                        seen.iter().find(|&&s| s != 1).unwrap()
                    );
                }
            }
        }
    }

    /// An owner reads its region front to back: its claims follow one another.
    #[test]
    fn decode_split_owner_claims_are_contiguous() {
        let split = DecodeSplit::new(4096, 2);
        let next = AtomicUsize::new(split.ends[0]);
        let mut at = 0;
        while let Some((r0, r1)) = split.claim(&next, 0, true) {
            assert_eq!(r0, at);
            at = r1;
        }
        assert_eq!(at, split.ends[1] * split.unit);
        assert!(split.per > 1, "the owner takes whole chunks while it can");
    }
}
