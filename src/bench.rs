//! `bespoke bench kernels` / `cargo bench`: what specialisation buys on this
//! machine, measured side by side in one run. The machine's read bandwidth is
//! measured first (a plain streaming read, same thread counts), then every
//! selected matvec: each compiled ISA variant this CPU runs, specialised and
//! generic, 1 thread and all threads, weights resident in cache and streamed
//! from memory (cycling through copies larger than the last-level cache).

use crate::kernels::{Kernels, MatKernel, Matrix, Q8Kernel, Weights, COMPILED_ISAS};
use crate::plan::Format;
use crate::q8::Q8Act;
use serde::Serialize;
use std::hint::black_box;
use std::time::{Duration, Instant};

pub struct Options {
    pub threads: usize,
    pub quick: bool,
    pub formats: Vec<Format>,
    /// Time this model's matrices instead of the default set (see
    /// [`ShapeSet`]).
    pub shapes: ShapeSet,
    /// Also time the fp4×q8 variant (FP4 weights, int8 activations; shown as
    /// format "fp4q8") on every FP4 case, the activation quantization included.
    pub fp4_q8: bool,
    /// Also time the bf16dot variant (BF16 weights, activations rounded to
    /// BF16; shown as format "bf16dot", under the avx512 variant) on every
    /// BF16 case, the rounding of x included, where this CPU has AVX512_BF16.
    pub bf16dot: bool,
    /// Also time the fp8dot variant (FP8 weights, activations rounded to
    /// BF16; format "fp8dot", under the avx512 variant) on every FP8 case,
    /// likewise.
    pub fp8dot: bool,
    /// Also time the amx variant (BF16 weights, activations rounded to BF16,
    /// on AMX tiles; format "amx", under the avx512 variant) on every BF16
    /// case, rounding and packing included, where this CPU has AMX-BF16.
    pub amx: bool,
    /// Also time the amx variant on every FP4 case (the weights decoded to
    /// BF16 tiles; format "fp4amx", under the avx512 variant), likewise.
    pub fp4_amx: bool,
    /// The same on every FP8 case (format "fp8amx").
    pub fp8_amx: bool,
    /// Only these ISA variants (all compiled ones this CPU runs if empty).
    pub isas: Vec<crate::plan::Isa>,
    /// The weights start this many bytes past a 64-byte boundary (0..64, a
    /// multiple of 8); see [`check_weight_offset`].
    pub weight_offset: usize,
    /// This fraction of the FP8 weights' codes made subnormal (magnitude
    /// 1..7, sign kept), 0 to 0.5; see [`check_fp8_subnormal`].
    pub fp8_subnormal: f64,
    /// Tokens per call: 1 times the matvec kernels (decode), more the
    /// matmul kernels Y = W·X with that many columns of X (prefill, several
    /// tokens of an expert); see [`check_tokens`].
    pub tokens: usize,
    /// Also time the attention-decode kernel (format "attn") at the shape
    /// set's attention shapes.
    pub attention: bool,
    /// Positions in the KV cache for the attention cases (None: 4096, or
    /// 512 with `quick`); see [`check_context`].
    pub context: Option<usize>,
}

/// `--fp8-subnormal`: the fraction of FP8 codes made subnormal.
pub fn check_fp8_subnormal(f: f64) -> Result<(), String> {
    if (0.0..=0.5).contains(&f) {
        Ok(())
    } else {
        Err(format!(
            "--fp8-subnormal {f}: expected a fraction from 0 to 0.5 (e.g. 0.001: 1 code in 1000)"
        ))
    }
}

/// `--context`: positions in the attention cases' KV cache.
pub fn check_context(n: usize) -> Result<(), String> {
    if (1..=1 << 20).contains(&n) {
        Ok(())
    } else {
        Err(format!("--context {n}: expected 1 to 1048576 positions"))
    }
}

/// Which matrix shapes to time.
#[derive(Debug, Clone)]
pub enum ShapeSet {
    /// DeepSeek V4 Flash's expert shapes (2048×4096, 4096×2048) and the
    /// bundled fixtures' shapes, where this build specialised them.
    Default,
    /// Every matrix of DeepSeek V4 Flash (the bundled config), specialised
    /// where the build made a kernel for it, else generic only.
    Dsv4Flash,
    /// Every matrix of DeepSeek V4 Pro (fixtures/configs/deepseek-v4-pro.json,
    /// built in; generic kernels unless the build planned for it).
    Dsv4Pro,
    /// Every matrix of the model whose directory or config.json this is.
    Model(std::path::PathBuf),
}

impl ShapeSet {
    /// From `--model DIR` / `--shapes dsv4-flash|dsv4-pro` (clap checked the names).
    pub fn from_args(model: Option<std::path::PathBuf>, shapes: Option<&str>) -> ShapeSet {
        match (model, shapes) {
            (Some(dir), _) => ShapeSet::Model(dir),
            (None, Some("dsv4-flash")) => ShapeSet::Dsv4Flash,
            (None, Some("dsv4-pro")) => ShapeSet::Dsv4Pro,
            _ => ShapeSet::Default,
        }
    }
}

/// DeepSeek V4 Flash's config.json (shapes only), built in.
const DSV4_FLASH_CONFIG: &str = include_str!("../fixtures/configs/deepseek-v4-flash.json");
/// DeepSeek V4 Pro's shapes (see fixtures/configs/README.md), built in.
const DSV4_PRO_CONFIG: &str = include_str!("../fixtures/configs/deepseek-v4-pro.json");

/// Larger matrices are skipped (their streamed copies would not fit a
/// sensible memory budget); the run says which.
const MAX_BENCH_MATRIX_BYTES: usize = 256 << 20;

/// A kernel under test.
#[derive(Clone, Copy)]
enum Kern {
    Mat(&'static MatKernel),
    Q8(&'static Q8Kernel),
    Bf16Dot(&'static crate::kernels::Bf16DotKernel),
    Amx(&'static crate::kernels::AmxKernel),
}

/// The `--formats` name of the amx variant on `format` matrices.
fn amx_label(format: Format) -> &'static str {
    match format {
        Format::Fp8 => "fp8amx",
        Format::Fp4 => "fp4amx",
        _ => "amx",
    }
}

/// How a case's activations meet the weights.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Act {
    F32,
    /// fp4×q8 (FP4 cases).
    Q8,
    /// bf16dot (BF16 cases) or fp8dot (FP8 cases): activations rounded to
    /// BF16.
    Dot,
    /// amx (BF16, FP8 and FP4 cases): activations rounded to BF16, AMX tiles.
    Amx,
}

#[derive(Serialize)]
pub struct Machine {
    pub cpu: String,
    pub arch: String,
    pub physical_cores: usize,
    pub llc_bytes: usize,
}

#[derive(Serialize)]
pub struct Bandwidth {
    pub threads: usize,
    pub bytes: usize,
    /// The best streaming read (the reference every kernel is compared to).
    pub gb_per_s: f64,
    /// Streams per thread that reached it.
    pub streams: usize,
    /// The same read with one stream per thread.
    pub one_stream_gb_per_s: f64,
}

#[derive(Serialize, Clone)]
pub struct KernelResult {
    pub format: String,
    pub rows: usize,
    pub cols: usize,
    /// Tokens per call (1: matvec; more: matmul with that many columns of X).
    pub tokens: usize,
    pub origin: String,
    pub isa: String,
    pub kernel: String,
    pub threads: usize,
    pub residency: String,
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub gb_per_s: f64,
    pub gflop_per_s: f64,
    /// GB/s over the read beside it (`read_gb_per_s`, described by `read`).
    pub bandwidth_fraction: f64,
    /// The read this case is set against, at the same thread count, timed
    /// with its samples interleaved with this case's kernels so that drift
    /// on a shared machine hits both alike: for streamed weights the plain
    /// streaming read of memory (the streams per thread of the run's best),
    /// for cache-resident ones a read of as many bytes as the weights, held
    /// in cache, with the widest vector loads the CPU has.
    pub read_gb_per_s: f64,
    /// Which read that was: "memory, N streams a thread" or "cache, ISA
    /// loads" ("cache, plain loads" where there is no vector read).
    pub read: String,
    /// The compute roof of this kernel's instruction at the same thread
    /// count (see [`ComputePeak`]); absent where there is no probe for it
    /// (the scalar variant, fp4×q8's integer dot products).
    pub peak_gflop_per_s: Option<f64>,
    /// GFLOP/s over that roof: how near a matmul is to what the core can
    /// multiply and add.
    pub peak_fraction: Option<f64>,
    /// Attention cases (format "attn") only: rows is the query heads, cols
    /// head_dim, tokens 1, GB/s the keys and values read per call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attn: Option<AttnBench>,
}

/// What else identifies an attention case.
#[derive(Serialize, Clone, Copy, PartialEq, Eq, Debug)]
pub struct AttnBench {
    pub kv_heads: usize,
    /// Positions in the KV cache, all read (DeepSeek V4 gathers its window
    /// and the compressed entries it attends to into such a cache).
    pub context: usize,
    /// Whether per-head sink logits were passed (DeepSeek V4).
    pub sinks: bool,
}

impl KernelResult {
    /// Everything that identifies a measurement except the kernel kind.
    #[allow(clippy::type_complexity)]
    fn case(
        &self,
    ) -> (
        &str,
        usize,
        usize,
        usize,
        Option<AttnBench>,
        &str,
        usize,
        &str,
    ) {
        (
            &self.format,
            self.rows,
            self.cols,
            self.tokens,
            self.attn,
            &self.isa,
            self.threads,
            &self.residency,
        )
    }

    /// The shape as the table prints it: rows×cols, or for attention
    /// heads/KV heads×head_dim and the positions read.
    pub fn shape_label(&self) -> String {
        match &self.attn {
            None => format!("{}×{}", self.rows, self.cols),
            Some(a) => format!(
                "{}h/{}kv×{} @{}",
                self.rows, a.kv_heads, self.cols, a.context
            ),
        }
    }
}

/// A compute roof: the GFLOP/s of independent chains of one vector
/// multiply-add instruction and nothing else (kernels/bs_peak.c), on every
/// thread of the pool at once, each thread's best of several runs, summed.
#[derive(Serialize, Clone)]
pub struct ComputePeak {
    /// The instruction, e.g. "avx512 f32 fma".
    pub probe: String,
    pub threads: usize,
    pub gflop_per_s: f64,
}

#[derive(Serialize)]
pub struct Results {
    pub machine: Machine,
    /// Bytes past a 64-byte boundary the weights started at.
    pub weight_offset: usize,
    /// The fraction of FP8 codes made subnormal (`--fp8-subnormal`).
    pub fp8_subnormal: f64,
    /// Whether each ISA's FP8 "s" tiles ran (`kernels::fp8_scaled`).
    pub fp8_scaled: std::collections::BTreeMap<String, bool>,
    /// Tokens per call (1: the matvec kernels).
    pub tokens: usize,
    pub bandwidth: Vec<Bandwidth>,
    /// The compute roofs of the kernels timed, per thread count.
    pub peaks: Vec<ComputePeak>,
    pub kernels: Vec<KernelResult>,
}

/// Size of the last-level cache, from sysfs (32 MiB if unknown).
pub fn llc_bytes() -> usize {
    let mut best = 0;
    for i in 0..8 {
        let p = format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size");
        if let Ok(s) = std::fs::read_to_string(p) {
            let s = s.trim();
            let (num, mul) = match s.strip_suffix('K') {
                Some(n) => (n, 1024),
                None => match s.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (s, 1),
                },
            };
            if let Ok(v) = num.parse::<usize>() {
                best = best.max(v * mul);
            }
        }
    }
    if best == 0 {
        32 << 20
    } else {
        best
    }
}

/// Calls per sample so that one sample takes at least `min_sample`.
fn calibrate(f: &mut dyn FnMut(), min_sample: Duration) -> usize {
    f();
    let mut batch = 1usize;
    loop {
        let t = Instant::now();
        for _ in 0..batch {
            f();
        }
        let e = t.elapsed();
        if e >= min_sample || batch >= 1 << 20 {
            return batch;
        }
        batch = (batch * 2).max(
            (batch as f64 * min_sample.as_secs_f64() / e.as_secs_f64().max(1e-9)) as usize / 2,
        );
    }
}

/// Per-call seconds (median, min, max) of each function, with the samples
/// of all functions interleaved so that drift on a noisy machine hits them
/// alike (an A/B measured side by side).
fn time_interleaved(
    fs: &mut [&mut dyn FnMut()],
    samples: usize,
    min_sample: Duration,
) -> Vec<(f64, f64, f64)> {
    let batches: Vec<usize> = fs.iter_mut().map(|f| calibrate(*f, min_sample)).collect();
    let mut times = vec![Vec::with_capacity(samples); fs.len()];
    for _ in 0..samples {
        for (i, f) in fs.iter_mut().enumerate() {
            let t = Instant::now();
            for _ in 0..batches[i] {
                f();
            }
            times[i].push(t.elapsed().as_secs_f64() / batches[i] as f64);
        }
    }
    times
        .into_iter()
        .map(|mut v| {
            v.sort_by(|a, b| a.total_cmp(b));
            (v[v.len() / 2], v[0], v[v.len() - 1])
        })
        .collect()
}

/// A plain streaming read of `buf` split over the pool's threads, each
/// thread reading its share as `streams` parts side by side.
fn stream_read(buf: &[u64], streams: usize) -> u64 {
    par_read(buf, 1024, |c| crate::kernels::stream_read(c, streams))
}

/// `read` over `buf` in one part a thread of the current pool (parts of at
/// least `min` words), the parts' sums added.
fn par_read(buf: &[u64], min: usize, read: impl Fn(&[u64]) -> u64 + Sync + Send) -> u64 {
    use rayon::prelude::*;
    let chunk = buf.len().div_ceil(rayon::current_num_threads()).max(min);
    buf.par_chunks(chunk)
        .map(read)
        .reduce(|| 0, |a, b| a.wrapping_add(b))
}

/// Streams per thread the read bandwidth is measured with; the best counts.
const READ_STREAMS: [usize; 4] = [1, 2, 4, 8];

/// The machine's read bandwidth with the current pool, GB/s.
#[derive(Debug, Clone, Copy)]
pub struct ReadBandwidth {
    /// The best over READ_STREAMS: what kernels are compared to.
    pub gb_per_s: f64,
    /// Streams per thread that reached it.
    pub streams: usize,
    /// One stream per thread (the simplest read).
    pub one_stream_gb_per_s: f64,
}

/// A buffer of `bytes` (rounded down to whole words) for the streaming read.
pub fn read_buffer(bytes: usize) -> Vec<u64> {
    (0..bytes / 8).map(|i| i as u64).collect()
}

/// Read bandwidth with the current pool: a streaming read of `buf` (see
/// [`read_buffer`]), with 1, 2, 4 and 8 streams per thread, timed interleaved.
pub fn read_bandwidth(buf: &[u64], samples: usize) -> ReadBandwidth {
    let bytes = std::mem::size_of_val(buf);
    let mut reads: Vec<_> = READ_STREAMS
        .iter()
        .map(|&k| {
            move || {
                black_box(stream_read(black_box(buf), k));
            }
        })
        .collect();
    let mut fs: Vec<&mut dyn FnMut()> = reads.iter_mut().map(|f| f as &mut dyn FnMut()).collect();
    let times = time_interleaved(&mut fs, samples, Duration::from_millis(1));
    let gb: Vec<f64> = times.iter().map(|t| bytes as f64 / t.0 / 1e9).collect();
    let best = (0..gb.len())
        .max_by(|&a, &b| gb[a].total_cmp(&gb[b]))
        .unwrap_or(0);
    ReadBandwidth {
        gb_per_s: gb[best],
        streams: READ_STREAMS[best],
        one_stream_gb_per_s: gb[0],
    }
}

/// Owned weights of one format filled with well-behaved values, the weights
/// starting `offset` bytes past a 64-byte boundary (each vector holds a few
/// spare elements in front; `*_at` is where the matrix starts).
pub(crate) struct Weights0 {
    f: Vec<f32>,
    h: Vec<u16>,
    b: Vec<u8>,
    s: Vec<u8>,
    f_at: usize,
    h_at: usize,
    b_at: usize,
}

/// `n` values from `gen` in a fresh vector, placed `offset` bytes past a
/// 64-byte boundary (`offset` a multiple of the element size); returns the
/// vector and the index the values start at.
fn placed<T: Copy + Default>(n: usize, offset: usize, gen: impl FnMut() -> T) -> (Vec<T>, usize) {
    let size = std::mem::size_of::<T>();
    let mut v = vec![T::default(); n + 64 / size];
    let at = (64 + offset - v.as_ptr() as usize % 64) % 64 / size;
    for (d, x) in v[at..at + n].iter_mut().zip(std::iter::repeat_with(gen)) {
        *d = x;
    }
    (v, at)
}

/// The most tokens `bench kernels --tokens` takes (four of the engine's
/// default 256-token prefill steps).
pub const MAX_TOKENS: usize = 1024;

/// `bench kernels --tokens N`: 1 (matvec) to [`MAX_TOKENS`].
pub fn check_tokens(n: usize) -> Result<(), String> {
    if n == 0 || n > MAX_TOKENS {
        return Err(format!(
            "--tokens {n}: expected 1 (the matvec kernels) to {MAX_TOKENS} (the matmul kernels with that many columns of X)"
        ));
    }
    Ok(())
}

/// GFLOP/s of `probe` on every thread of the current pool at once: each
/// thread's best of `samples` runs of about `min_sample`, summed.
pub fn compute_peak(probe: crate::kernels::PeakProbe, samples: usize, min_sample: Duration) -> f64 {
    // Steps for about min_sample on one thread.
    let mut iters = 1usize << 12;
    loop {
        let t = Instant::now();
        probe.run(iters);
        let e = t.elapsed();
        if e >= min_sample || iters >= 1 << 34 {
            break;
        }
        iters = (iters as f64
            * (min_sample.as_secs_f64() / e.as_secs_f64().max(1e-9)).clamp(2.0, 64.0))
            as usize;
    }
    rayon::broadcast(|_| {
        (0..samples.max(1))
            .map(|_| {
                let t = Instant::now();
                let flops = probe.run(iters);
                flops / t.elapsed().as_secs_f64().max(1e-12)
            })
            .fold(0.0f64, f64::max)
    })
    .iter()
    .sum::<f64>()
        / 1e9
}

/// The weight placements `bench kernels --weight-offset` takes: bytes past a
/// 64-byte boundary, a multiple of 8 (a safetensors data section starts
/// 8-aligned, so a memory-mapped tensor lies at one of these).
pub fn check_weight_offset(offset: usize) -> Result<(), String> {
    if offset >= 64 || offset % 8 != 0 {
        return Err(format!(
            "--weight-offset {offset}: expected a multiple of 8 below 64 (bytes past a 64-byte boundary)"
        ));
    }
    Ok(())
}

pub(crate) fn make_weights(
    format: Format,
    rows: usize,
    cols: usize,
    seed: u64,
    offset: usize,
    fp8_subnormal: f64,
) -> Weights0 {
    let n = rows * cols;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut w = Weights0 {
        f: vec![],
        h: vec![],
        b: vec![],
        s: vec![],
        f_at: 0,
        h_at: 0,
        b_at: 0,
    };
    match format {
        Format::F32 => (w.f, w.f_at) = placed(n, offset, || (next() % 1000) as f32 / 1000.0 - 0.5),
        Format::Bf16 => (w.h, w.h_at) = placed(n, offset, || 0x3C00 | (next() % 0x100) as u16),
        Format::Fp8 => {
            // Codes distributed as in a real checkpoint: Gaussian weights
            // scaled so that a 128x128 block's largest lands near 448
            // (sigma = 100), rounded to E4M3 -- nearly all normal, a zero or
            // subnormal code rare. (A 4096-entry table of such codes, then
            // picked at random.)
            let mut unit = || (next() >> 11) as f64 / (1u64 << 53) as f64;
            let table: Vec<u8> = (0..4096)
                .map(|_| {
                    let (u1, u2) = (unit().max(1e-12), unit());
                    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                    crate::formats::f32_to_e4m3((z * 100.0) as f32)
                })
                .collect();
            // With --fp8-subnormal f, each code is made subnormal with
            // probability f (a 53-bit uniform against it).
            let cut = (fp8_subnormal * (1u64 << 53) as f64) as u64;
            (w.b, w.b_at) = placed(n, offset, || {
                let r = next();
                let c = table[(r % 4096) as usize];
                if (r >> 11) < cut {
                    (c & 0x80) | (1 + ((r >> 12) % 7) as u8)
                } else {
                    c
                }
            });
            let (sr, sc) = format.scale_shape(rows, cols).unwrap_or((0, 0));
            w.s = vec![120; sr * sc];
        }
        Format::Fp4 => {
            (w.b, w.b_at) = placed(n / 2, offset, || next() as u8);
            let (sr, sc) = format.scale_shape(rows, cols).unwrap_or((0, 0));
            w.s = vec![120; sr * sc];
        }
    }
    w
}

pub(crate) fn matrix(format: Format, rows: usize, cols: usize, w: &Weights0) -> Matrix<'_> {
    let ws = match format {
        Format::F32 => Weights::F32(&w.f[w.f_at..w.f_at + rows * cols]),
        Format::Bf16 => Weights::Bf16(&w.h[w.h_at..w.h_at + rows * cols]),
        Format::Fp8 => Weights::Fp8 {
            w: &w.b[w.b_at..w.b_at + rows * cols],
            scale: &w.s,
        },
        Format::Fp4 => Weights::Fp4 {
            w: &w.b[w.b_at..w.b_at + rows * cols / 2],
            scale: &w.s,
        },
    };
    // Scanned for NaN codes as the engine's FP8 matrices are (once, on
    // their first product), so the FP8 kernels run as they do there.
    Matrix::new(rows, cols, ws)
        .expect("benchmark matrix")
        .with_fp8_scanned()
}

/// A model's matrices, one case per distinct (format, rows, cols), named by
/// the matrices that have that shape.
fn model_cases(
    cfg: &crate::plan::ModelConfig,
    formats: &[Format],
) -> Result<Vec<(Format, usize, usize, String)>, String> {
    let planned = crate::plan::plan_model(cfg).map_err(|e| e.to_string())?;
    let mut out: Vec<(Format, usize, usize, String)> = Vec::new();
    for u in &planned.matrices {
        if !formats.contains(&u.format) {
            continue;
        }
        let bytes = (u.rows * u.format.row_bytes(u.cols)) as f64;
        if bytes > MAX_BENCH_MATRIX_BYTES as f64 {
            eprintln!(
                "skipped {} ({} {}×{}, {:.0} MiB: over the benchmark's {} MiB per matrix)",
                u.name,
                u.format,
                u.rows,
                u.cols,
                bytes / (1u64 << 20) as f64,
                MAX_BENCH_MATRIX_BYTES >> 20
            );
            continue;
        }
        match out
            .iter_mut()
            .find(|c| (c.0, c.1, c.2) == (u.format, u.rows, u.cols))
        {
            Some(c) => {
                c.3 += ", ";
                c.3 += &u.name;
            }
            None => out.push((u.format, u.rows, u.cols, u.name.clone())),
        }
    }
    Ok(out)
}

/// The cases of a shape set for the selected formats; (format, rows, cols, origin).
pub(crate) fn shape_cases(
    set: &ShapeSet,
    formats: &[Format],
) -> Result<Vec<(Format, usize, usize, String)>, String> {
    match set_config(set)? {
        None => Ok(cases(formats)),
        Some(cfg) => model_cases(&cfg, formats),
    }
}

/// The model config of a shape set (None for the default set): a built-in
/// DeepSeek V4 config, or the model directory's.
fn set_config(set: &ShapeSet) -> Result<Option<crate::plan::ModelConfig>, String> {
    let builtin = |name, text| crate::plan::ModelConfig::from_json_str(name, text);
    match set {
        ShapeSet::Default => Ok(None),
        ShapeSet::Dsv4Flash => builtin("built-in deepseek-v4-flash", DSV4_FLASH_CONFIG)
            .map(Some)
            .map_err(|e| e.to_string()),
        ShapeSet::Dsv4Pro => builtin("built-in deepseek-v4-pro", DSV4_PRO_CONFIG)
            .map(Some)
            .map_err(|e| e.to_string()),
        ShapeSet::Model(dir) => crate::plan::load_config(dir)
            .map(Some)
            .map_err(|e| e.to_string()),
    }
}

/// The cases: DeepSeek V4 Flash expert shapes and the fixture's shapes, for
/// each selected format this build specialised; (format, rows, cols, origin).
fn cases(formats: &[Format]) -> Vec<(Format, usize, usize, String)> {
    let plan = crate::report::build_plan();
    let mut out = Vec::new();
    for s in &plan.mat_shapes {
        if !formats.contains(&s.format) {
            continue;
        }
        if (s.rows, s.cols) == (2048, 4096) || (s.rows, s.cols) == (4096, 2048) {
            out.push((s.format, s.rows, s.cols, "dsv4-flash expert".to_string()));
        }
    }
    for m in &plan.models {
        if m.source.contains("fixtures/tiny") {
            for u in &m.matrices {
                if formats.contains(&u.format)
                    && !out
                        .iter()
                        .any(|c| (c.0, c.1, c.2) == (u.format, u.rows, u.cols))
                {
                    out.push((
                        u.format,
                        u.rows,
                        u.cols,
                        format!("{}: {}", crate::report::short_source(&m.source), u.name),
                    ));
                }
            }
        }
    }
    out
}

/// The read a case's kernels are set against (see
/// [`KernelResult::read_gb_per_s`]).
#[derive(Clone, Copy)]
enum Reference<'a> {
    /// Streamed weights: the probe's buffer (larger than the last-level
    /// cache), read plainly with this many streams a thread.
    Memory(&'a [u64], usize),
    /// Cache-resident weights: a buffer of their size, read over and over
    /// so that it stays in cache, with `VectorRead` (plain loads where
    /// none), shared among the threads where the kernel shares its work
    /// (`Sharing`), else read by one.
    Cache(&'a [u64], Option<crate::kernels::VectorRead>, Sharing),
}

/// How a cache-resident case's kernel shares its work among the threads, so
/// that the read beside it does as it does: a small product runs on one
/// thread (see `kernels::shares_rows`).
#[derive(Clone, Copy)]
enum Sharing {
    /// A product: rows, columns, tokens.
    Rows(usize, usize, usize),
    /// Attention: heads, positions, head_dim.
    Heads(usize, usize, usize),
}

impl Sharing {
    fn shared(self) -> bool {
        match self {
            Sharing::Rows(r, c, n) => crate::kernels::shares_rows(r, c, n),
            Sharing::Heads(h, t, d) => crate::kernels::shares_heads(h, t, d),
        }
    }
}

impl Reference<'_> {
    fn describe(&self) -> String {
        match self {
            Reference::Memory(_, k) => {
                format!(
                    "memory, {k} stream{} a thread",
                    if *k == 1 { "" } else { "s" }
                )
            }
            Reference::Cache(_, v, _) => {
                format!("cache, {} loads", v.map_or("plain", |v| v.name()))
            }
        }
    }

    /// One read of the buffer, split over the current pool's threads (a
    /// cache-resident one only where its kernel's work is).
    fn read(&self) -> u64 {
        match *self {
            Reference::Memory(buf, k) => stream_read(buf, k),
            Reference::Cache(buf, v, sharing) => {
                let one =
                    |c: &[u64]| v.map_or_else(|| crate::kernels::stream_read(c, 8), |v| v.sum(c));
                if sharing.shared() {
                    par_read(buf, 8, one)
                } else {
                    one(buf)
                }
            }
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Reference::Memory(b, _) | Reference::Cache(b, _, _) => std::mem::size_of_val(*b),
        }
    }
}

/// Times a case's kernels side by side, their samples interleaved with
/// those of the read they are set against, so that drift on a shared
/// machine hits both alike. Returns each kernel's (median, min, max)
/// seconds and the read's GB/s.
fn time_case<'a>(
    pool: &rayon::ThreadPool,
    mut calls: Vec<Box<dyn FnMut() + Send + 'a>>,
    read: Reference<'a>,
    samples: usize,
    min_sample: Duration,
) -> (Vec<(f64, f64, f64)>, f64) {
    calls.push(Box::new(move || {
        black_box(black_box(read).read());
    }));
    let mut stats = pool.install(|| {
        let mut refs: Vec<&mut dyn FnMut()> = calls
            .iter_mut()
            .map(|c| c.as_mut() as &mut dyn FnMut())
            .collect();
        time_interleaved(&mut refs, samples, min_sample)
    });
    let read_gb = stats
        .pop()
        .map_or(f64::NAN, |r| read.bytes() as f64 / r.0 / 1e9);
    (stats, read_gb)
}

/// What names a measurement: a [`KernelResult`] but its kernel kind and
/// figures.
struct CaseId {
    format: String,
    rows: usize,
    cols: usize,
    tokens: usize,
    origin: String,
    isa: String,
    threads: usize,
    residency: &'static str,
    attn: Option<AttnBench>,
}

impl CaseId {
    /// The results of the case's kernels (their kinds, in the order of
    /// `stats`, each (median, min, max) seconds): `bytes` read and `flops`
    /// done per call.
    fn results<'k>(
        &self,
        kinds: impl Iterator<Item = &'k str>,
        stats: Vec<(f64, f64, f64)>,
        bytes: f64,
        flops: f64,
        read: (f64, String),
        peak: Option<f64>,
    ) -> Vec<KernelResult> {
        kinds
            .zip(stats)
            .map(|(kind, t)| self.result(kind, t, bytes, flops, read.clone(), peak))
            .collect()
    }

    fn result(
        &self,
        kernel: &str,
        t: (f64, f64, f64),
        bytes: f64,
        flops: f64,
        read: (f64, String),
        peak: Option<f64>,
    ) -> KernelResult {
        let (read_gb, read) = read;
        let (med, min, max) = t;
        let (gb, gflop) = (bytes / med / 1e9, flops / med / 1e9);
        KernelResult {
            format: self.format.clone(),
            rows: self.rows,
            cols: self.cols,
            tokens: self.tokens,
            origin: self.origin.clone(),
            isa: self.isa.clone(),
            kernel: kernel.to_string(),
            threads: self.threads,
            residency: self.residency.to_string(),
            median_us: med * 1e6,
            min_us: min * 1e6,
            max_us: max * 1e6,
            gb_per_s: gb,
            gflop_per_s: gflop,
            bandwidth_fraction: gb / read_gb,
            read_gb_per_s: read_gb,
            read,
            peak_gflop_per_s: peak,
            peak_fraction: peak.map(|p| gflop / p),
            attn: self.attn,
        }
    }
}

/// An attention case: the shape, whether it has sinks, where it comes from.
pub(crate) struct AttnCase {
    pub shape: crate::plan::AttnShape,
    pub sinks: bool,
    pub origin: String,
}

/// The attention shapes of a shape set: the build's specialised ones for
/// the default set, else the model's.
pub(crate) fn attn_cases(set: &ShapeSet) -> Result<Vec<AttnCase>, String> {
    if let Some(cfg) = set_config(set)? {
        let origin = match set {
            ShapeSet::Dsv4Flash => "dsv4-flash attention",
            ShapeSet::Dsv4Pro => "dsv4-pro attention",
            _ => "attention",
        };
        return Ok(crate::plan::attn_shapes(&cfg)
            .into_iter()
            .map(|shape| AttnCase {
                shape,
                sinks: cfg.dsv4.is_some(),
                origin: origin.to_string(),
            })
            .collect());
    }
    let plan = crate::report::build_plan();
    Ok(plan
        .attn_shapes
        .iter()
        .map(|&shape| {
            let users: Vec<_> = plan
                .models
                .iter()
                .filter(|m| m.attn.contains(&shape))
                .collect();
            AttnCase {
                shape,
                // The summary starts with the model type (ModelConfig::describe).
                sinks: users.iter().any(|m| m.summary.starts_with("deepseek_v4 ")),
                origin: users
                    .iter()
                    .map(|m| crate::report::short_source(&m.source))
                    .collect::<Vec<_>>()
                    .join(", "),
            }
        })
        .collect())
}

/// What every case of a run shares.
struct Run<'a> {
    variants: &'a [Kernels],
    thread_counts: &'a [usize],
    bandwidth: &'a [Bandwidth],
    read_buf: &'a [u64],
    vread: Option<crate::kernels::VectorRead>,
    stream_bytes: usize,
    samples: usize,
    min_sample: Duration,
}

/// Times the attention-decode kernel of every variant, specialised and
/// generic, for one query against `context` positions (keys and values
/// cache-resident, then cycled through copies larger than the last-level
/// cache): GB/s of keys and values read, GFLOP/s of the score and value
/// multiply-adds against the f32 FMA roof.
fn time_attention(
    run: &Run,
    cases: &[AttnCase],
    context: usize,
    peak_of: &dyn Fn(crate::plan::Isa, usize) -> Option<f64>,
    progress: &mut dyn FnMut(String),
) -> Vec<KernelResult> {
    let mut results = Vec::new();
    for (ci, c) in cases.iter().enumerate() {
        let (h, kv, hd) = (c.shape.n_heads, c.shape.n_kv_heads, c.shape.head_dim);
        // The engines' layout: KV-head-major (each KV head's rows
        // contiguous, as the Llama engine's cache holds them).
        let width = kv * hd;
        let mut seed = 0x2545_F491_4F6C_DD1Du64 ^ ci as u64;
        let mut gen = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % 2001) as f32 / 2000.0 - 0.5
        };
        let q: Vec<f32> = (0..h * hd).map(|_| gen()).collect();
        let sinks: Vec<f32> = (0..h).map(|_| gen()).collect();
        let cache = |gen: &mut dyn FnMut() -> f32| -> (Vec<f32>, Vec<f32>) {
            (
                (0..context * width).map(|_| gen()).collect(),
                (0..context * width).map(|_| gen()).collect(),
            )
        };
        let bytes = 2 * context * width * std::mem::size_of::<f32>();
        let one = cache(&mut gen);
        let hot = read_buffer(bytes.max(64));
        let copies = if bytes >= 1 << 20 {
            (run.stream_bytes / bytes).max(2)
        } else {
            0
        };
        let stream: Vec<(Vec<f32>, Vec<f32>)> = (0..copies).map(|_| cache(&mut gen)).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let info = AttnBench {
            kv_heads: kv,
            context,
            sinks: c.sinks,
        };
        for k in run.variants {
            let mut kinds: Vec<(&str, &'static crate::kernels::AttnKernel)> = Vec::new();
            let chosen = k.attn_kernel(c.shape);
            if chosen.shape.is_some() {
                kinds.push(("specialised", chosen));
            }
            if let Some(g) = crate::kernels::ATTN_KERNELS
                .iter()
                .find(|x| x.isa == k.isa() && x.shape.is_none())
            {
                kinds.push(("generic", g));
            }
            for &t in run.thread_counts {
                let pool = crate::threads::pool(t);
                let read_streams = run
                    .bandwidth
                    .iter()
                    .find(|b| b.threads == t)
                    .map_or(1, |b| b.streams);
                for residency in ["cache", "stream"] {
                    progress(format!(
                        "attn {h}h/{kv}kv×{hd} @{context} {} {t}t {residency}",
                        k.isa()
                    ));
                    if residency == "stream" && stream.is_empty() {
                        continue;
                    }
                    let caches: Vec<&(Vec<f32>, Vec<f32>)> = if residency == "cache" {
                        vec![&one]
                    } else {
                        stream.iter().collect()
                    };
                    let calls: Vec<Box<dyn FnMut() + Send>> = kinds
                        .iter()
                        .map(|&(_, kern)| {
                            let (caches, q, sinks) = (&caches, &q, &sinks);
                            let mut out = vec![0f32; h * hd];
                            let mut i = 0;
                            Box::new(move || {
                                let (kc, vc) = caches[i % caches.len()];
                                i += 1;
                                let a = crate::kernels::AttnArgs {
                                    q,
                                    k: kc,
                                    v: vc,
                                    sinks: c.sinks.then_some(&sinks[..]),
                                    n_heads: h,
                                    n_kv_heads: kv,
                                    head_dim: hd,
                                    kv_stride: hd,
                                    kv_head_stride: context * hd,
                                    t_len: context,
                                    window: 0,
                                    scale,
                                };
                                k.attn_decode_with(kern, &a, &mut out)
                                    .expect("benchmark attention");
                                black_box(&out);
                            }) as Box<dyn FnMut() + Send>
                        })
                        .collect();
                    let read = if residency == "stream" {
                        Reference::Memory(run.read_buf, read_streams)
                    } else {
                        Reference::Cache(&hot, run.vread, Sharing::Heads(h, context, hd))
                    };
                    let (stats, read_gb) =
                        time_case(&pool, calls, read, run.samples, run.min_sample);
                    let id = CaseId {
                        format: "attn".into(),
                        rows: h,
                        cols: hd,
                        tokens: 1,
                        origin: c.origin.clone(),
                        isa: k.isa().to_string(),
                        threads: t,
                        residency,
                        attn: Some(info),
                    };
                    // A multiply-add per head, position and component, for
                    // the scores and again for the values.
                    let flops = 4.0 * (h * context * hd) as f64;
                    let peak = peak_of(k.isa(), t);
                    let names = kinds.iter().map(|k| k.0);
                    let read = (read_gb, read.describe());
                    results.extend(id.results(names, stats, bytes as f64, flops, read, peak));
                }
            }
        }
    }
    results
}

pub fn kernels(opts: &Options) -> Result<Results, String> {
    // Bad options fail before the slow part (the bandwidth probe).
    check_weight_offset(opts.weight_offset)?;
    check_fp8_subnormal(opts.fp8_subnormal)?;
    check_tokens(opts.tokens)?;
    if let Some(c) = opts.context {
        check_context(c)?;
    }
    let context = opts.context.unwrap_or(if opts.quick { 512 } else { 4096 });
    let n_tok = opts.tokens;
    for i in &opts.isas {
        if let Err(e) = Kernels::with_isa(*i) {
            return Err(format!("--isa {i}: {e}"));
        }
    }
    let llc = llc_bytes();
    let machine = Machine {
        cpu: crate::cpu::cpu_name(),
        arch: std::env::consts::ARCH.into(),
        physical_cores: crate::cpu::physical_cores(),
        llc_bytes: llc,
    };
    let samples = if opts.quick { 3 } else { 9 };
    let min_sample = Duration::from_millis(if opts.quick { 1 } else { 20 });
    let stream_bytes = if opts.quick {
        2 * llc
    } else {
        (4 * llc).max(256 << 20)
    };
    let mut thread_counts = vec![1];
    if opts.threads > 1 {
        thread_counts.push(opts.threads);
    }
    eprintln!(
        "machine: {} ({}), {} physical cores, last-level cache {} MiB",
        machine.cpu,
        machine.arch,
        machine.physical_cores,
        llc >> 20
    );
    eprintln!(
        "weights start {} bytes past a 64-byte boundary{}",
        opts.weight_offset,
        if opts.weight_offset == 0 {
            " (--weight-offset to move them)"
        } else {
            ""
        }
    );
    if opts.fp8_subnormal > 0.0 {
        eprintln!(
            "FP8 weights: {} of the codes subnormal (--fp8-subnormal)",
            opts.fp8_subnormal
        );
    }
    if let Ok(f) = crate::kernels::fp8_scaled() {
        if !f.isas.is_empty() {
            eprintln!(
                "FP8 \"s\" tiles: {} ({}; BESPOKE_FP8_SCALED=on|off to choose)",
                f.summary(),
                f.reason
            );
        }
    }
    let vread = crate::kernels::VectorRead::best();
    eprintln!(
        "cache-resident cases are set against a read of as many bytes held in cache ({} loads)",
        vread.map_or("plain", |v| v.name())
    );
    let mut bandwidth = Vec::new();
    // The probe's buffer, also read beside every streamed case (see
    // KernelResult::read_gb_per_s).
    let read_buf = read_buffer(stream_bytes);
    for &t in &thread_counts {
        let pool = crate::threads::pool(t);
        let rb = pool.install(|| read_bandwidth(&read_buf, samples));
        eprintln!(
            "read bandwidth, {t} thread(s), {} MiB buffer: {:.1} GB/s ({} stream(s) per thread; one stream: {:.1} GB/s)",
            stream_bytes >> 20,
            rb.gb_per_s,
            rb.streams,
            rb.one_stream_gb_per_s
        );
        bandwidth.push(Bandwidth {
            threads: t,
            bytes: stream_bytes,
            gb_per_s: rb.gb_per_s,
            streams: rb.streams,
            one_stream_gb_per_s: rb.one_stream_gb_per_s,
        });
    }
    let variants: Vec<Kernels> = COMPILED_ISAS
        .iter()
        .filter(|i| opts.isas.is_empty() || opts.isas.contains(i))
        .filter_map(|&i| Kernels::with_isa(i).ok())
        .collect();
    let skipped: Vec<&str> = COMPILED_ISAS
        .iter()
        .filter(|i| !variants.iter().any(|k| k.isa() == **i))
        .map(|i| i.name())
        .collect();
    if !skipped.is_empty() && opts.isas.is_empty() {
        eprintln!(
            "compiled but not runnable on this CPU (not benchmarked): {}",
            skipped.join(", ")
        );
    }
    // The compute roofs of the kernels to be timed, per thread count.
    // (isa, bf16dot, probe): the f32 kernels of each variant, and bf16dot.
    let mut probes: Vec<(crate::plan::Isa, bool, crate::kernels::PeakProbe)> = variants
        .iter()
        .filter_map(|k| {
            crate::kernels::PeakProbe::for_kernels(k.isa(), false).map(|p| (k.isa(), false, p))
        })
        .collect();
    if opts.bf16dot || opts.fp8dot {
        let avx512 = crate::plan::Isa::Avx512;
        probes.extend(
            crate::kernels::PeakProbe::for_kernels(avx512, true).map(|p| (avx512, true, p)),
        );
    }
    // (isa, bf16dot, threads, GFLOP/s), and the same for the JSON.
    let mut roofs: Vec<(crate::plan::Isa, bool, usize, f64)> = Vec::new();
    let mut peaks: Vec<ComputePeak> = Vec::new();
    for &t in &thread_counts {
        let pool = crate::threads::pool(t);
        for &(isa, dot, p) in &probes {
            let g = pool.install(|| compute_peak(p, samples.min(5), min_sample));
            eprintln!("compute roof, {}, {t} thread(s): {g:.1} GFLOP/s", p.name());
            roofs.push((isa, dot, t, g));
            peaks.push(ComputePeak {
                probe: p.name().to_string(),
                threads: t,
                gflop_per_s: g,
            });
        }
    }
    let peak_of = |isa: crate::plan::Isa, act: Act, t: usize| -> Option<f64> {
        let dot = match act {
            Act::F32 => false,
            Act::Dot => true,
            Act::Q8 | Act::Amx => return None,
        };
        roofs
            .iter()
            .find(|r| (r.0, r.1, r.2) == (isa, dot, t))
            .map(|r| r.3)
    };
    // (format, rows, cols, origin, activations)
    let mut all: Vec<(Format, usize, usize, String, Act)> =
        shape_cases(&opts.shapes, &opts.formats)?
            .into_iter()
            .map(|(f, r, c, o)| (f, r, c, o, Act::F32))
            .collect();
    if opts.fp4_q8 {
        all.extend(
            shape_cases(&opts.shapes, &[Format::Fp4])?
                .into_iter()
                .map(|(f, r, c, o)| (f, r, c, o, Act::Q8)),
        );
    }
    for (on, f) in [(opts.bf16dot, Format::Bf16), (opts.fp8dot, Format::Fp8)] {
        if !on {
            continue;
        }
        match Kernels::bf16dot_available() {
            Ok(()) => all.extend(
                shape_cases(&opts.shapes, &[f])?
                    .into_iter()
                    .map(|(f, r, c, o)| (f, r, c, o, Act::Dot)),
            ),
            Err(why) => eprintln!("{} not timed: {why}", crate::plan::dot_family(f)),
        }
    }
    for (on, f) in [
        (opts.amx, Format::Bf16),
        (opts.fp8_amx, Format::Fp8),
        (opts.fp4_amx, Format::Fp4),
    ] {
        if !on {
            continue;
        }
        let name = amx_label(f);
        match Kernels::amx_available() {
            Ok(()) => all.extend(
                shape_cases(&opts.shapes, &[f])?
                    .into_iter()
                    .map(|(f, r, c, o)| (f, r, c, o, Act::Amx)),
            ),
            Err(why) => eprintln!("{name} not timed: {why}"),
        }
    }
    let attn = if opts.attention {
        attn_cases(&opts.shapes)?
    } else {
        Vec::new()
    };
    if all.is_empty() && attn.is_empty() {
        return Err(format!(
            "no kernel to time: the shape set ({:?}) has none in the formats asked for",
            opts.shapes
        ));
    }
    let cases = all;
    let total = (cases.len() * 2 + attn.len()) * variants.len() * 2 * thread_counts.len();
    let mut done = 0;
    let mut results = Vec::new();
    for (ci, (format, rows, cols, origin, act)) in cases.iter().enumerate() {
        let (format, rows, cols, act) = (*format, *rows, *cols, *act);
        let label = match act {
            Act::F32 => format.to_string(),
            Act::Q8 => "fp4q8".to_string(),
            Act::Dot => crate::plan::dot_family(format).to_string(),
            Act::Amx => amx_label(format).to_string(),
        };
        let one = make_weights(
            format,
            rows,
            cols,
            ci as u64 + 1,
            opts.weight_offset,
            opts.fp8_subnormal,
        );
        let bytes = matrix(format, rows, cols, &one).bytes();
        // What the cache-resident case is set against: a read of as many bytes.
        let hot = read_buffer(bytes.max(64));
        let copies = if bytes >= 1 << 20 {
            (stream_bytes / bytes).max(2)
        } else {
            0
        };
        let stream: Vec<Weights0> = (0..copies)
            .map(|i| {
                make_weights(
                    format,
                    rows,
                    cols,
                    1000 + i as u64,
                    opts.weight_offset,
                    opts.fp8_subnormal,
                )
            })
            .collect();
        // n_tok tokens of activations, token-major.
        let x: Vec<f32> = (0..n_tok * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        for k in &variants {
            let kinds: Vec<(&str, Kern)> = if act == Act::Dot {
                // One kernel set, listed under the avx512 variant.
                if k.isa() != crate::plan::Isa::Avx512 {
                    continue;
                }
                [
                    Kernels::bf16dot_kernel_specialised(format, rows, cols)
                        .map(|s| ("specialised", Kern::Bf16Dot(s))),
                    Kernels::bf16dot_kernel_generic(format).map(|g| ("generic", Kern::Bf16Dot(g))),
                ]
                .into_iter()
                .flatten()
                .collect()
            } else if act == Act::Amx {
                if k.isa() != crate::plan::Isa::Avx512 {
                    continue;
                }
                [
                    Kernels::amx_kernel_specialised(format, rows, cols)
                        .map(|s| ("specialised", Kern::Amx(s))),
                    Kernels::amx_kernel_generic(format).map(|g| ("generic", Kern::Amx(g))),
                ]
                .into_iter()
                .flatten()
                .collect()
            } else if act == Act::Q8 {
                [
                    k.q8_kernel_specialised(rows, cols)
                        .map(|s| ("specialised", Kern::Q8(s))),
                    Some(("generic", Kern::Q8(k.q8_kernel_generic()))),
                ]
                .into_iter()
                .flatten()
                .collect()
            } else {
                [
                    k.mat_kernel_specialised(format, rows, cols)
                        .map(|s| ("specialised", Kern::Mat(s))),
                    Some(("generic", Kern::Mat(k.mat_kernel_generic(format)))),
                ]
                .into_iter()
                .flatten()
                .collect()
            };
            for &t in &thread_counts {
                let pool = crate::threads::pool(t);
                let read_streams = bandwidth
                    .iter()
                    .find(|b| b.threads == t)
                    .map_or(1, |b| b.streams);
                for residency in ["cache", "stream"] {
                    done += kinds.len();
                    if residency == "stream" && stream.is_empty() {
                        continue;
                    }
                    eprint!(
                        "\r[{done}/{total}] {label} {rows}x{cols}{} {} {t}t {residency}          ",
                        if n_tok > 1 {
                            format!(" ×{n_tok} tokens")
                        } else {
                            String::new()
                        },
                        k.isa()
                    );
                    let mats: Vec<Matrix> = if residency == "cache" {
                        vec![matrix(format, rows, cols, &one)]
                    } else {
                        stream
                            .iter()
                            .map(|w| matrix(format, rows, cols, w))
                            .collect()
                    };
                    // Specialised and generic timed side by side, samples interleaved.
                    let calls: Vec<Box<dyn FnMut() + Send>> = kinds
                        .iter()
                        .map(|(_, kern)| {
                            let (mats, x, k, kern) = (&mats, &x, *k, *kern);
                            let mut y = vec![0f32; n_tok * rows];
                            let mut a = Q8Act::default();
                            let mut bx = crate::bf16act::Bf16X::default();
                            let mut ax = crate::bf16act::AmxX::default();
                            let mut i = 0;
                            Box::new(move || {
                                let m = &mats[i % mats.len()];
                                i += 1;
                                match kern {
                                    Kern::Mat(kern) if n_tok == 1 => {
                                        k.matvec_with(kern, m, x, &mut y)
                                    }
                                    Kern::Mat(kern) => k.matmul_with(kern, m, x, n_tok, &mut y),
                                    // As the engine runs it: a token at a
                                    // time, each quantized first.
                                    Kern::Q8(kern) => {
                                        k.matmul_q8_with(kern, m, x, n_tok, &mut y, &mut a)
                                    }
                                    Kern::Bf16Dot(kern) => bx
                                        .pack_from(x, n_tok, cols)
                                        .and_then(|()| k.matmul_bf16dot_with(kern, m, &bx, &mut y)),
                                    Kern::Amx(kern) => ax
                                        .pack_from(x, n_tok, cols)
                                        .and_then(|()| k.matmul_amx_with(kern, m, &ax, &mut y)),
                                }
                                .expect("benchmark matvec");
                                black_box(&y);
                            }) as Box<dyn FnMut() + Send>
                        })
                        .collect();
                    let read = if residency == "stream" {
                        Reference::Memory(&read_buf, read_streams)
                    } else {
                        Reference::Cache(&hot, vread, Sharing::Rows(rows, cols, n_tok))
                    };
                    let (stats, read_gb) = time_case(&pool, calls, read, samples, min_sample);
                    let id = CaseId {
                        format: label.clone(),
                        rows,
                        cols,
                        tokens: n_tok,
                        origin: origin.clone(),
                        isa: k.isa().to_string(),
                        threads: t,
                        residency,
                        attn: None,
                    };
                    let flops = 2.0 * rows as f64 * cols as f64 * n_tok as f64;
                    let peak = peak_of(k.isa(), act, t);
                    let names = kinds.iter().map(|k| k.0);
                    let read = (read_gb, read.describe());
                    results.extend(id.results(names, stats, bytes as f64, flops, read, peak));
                }
            }
        }
    }
    if !attn.is_empty() {
        let run = Run {
            variants: &variants,
            thread_counts: &thread_counts,
            bandwidth: &bandwidth,
            read_buf: &read_buf,
            vread,
            stream_bytes,
            samples,
            min_sample,
        };
        let mut progress = |what: String| {
            done += 1;
            eprint!("\r[{done}/{total}] {what}          ");
        };
        results.extend(time_attention(
            &run,
            &attn,
            context,
            &|isa, t| peak_of(isa, Act::F32, t),
            &mut progress,
        ));
    }
    eprintln!();
    print_table(&results);
    print_summary(&results);
    Ok(Results {
        machine,
        weight_offset: opts.weight_offset,
        fp8_subnormal: opts.fp8_subnormal,
        fp8_scaled: crate::kernels::fp8_scaled()
            .as_ref()
            .map(|f| f.isas.iter().map(|(i, on)| (i.to_string(), *on)).collect())
            .unwrap_or_default(),
        tokens: n_tok,
        bandwidth,
        peaks,
        kernels: results,
    })
}

fn print_table(r: &[KernelResult]) {
    println!(
        "{:<7} {:>17} {:>4} {:<7} {:<11} {:>3} {:<6} {:>10} {:>21} {:>7} {:>8} {:>6} {:>7} {:>6}",
        "fmt",
        "shape",
        "n",
        "isa",
        "kernel",
        "thr",
        "where",
        "median µs",
        "[min – max] µs",
        "GB/s",
        "GFLOP/s",
        "% bw",
        "read",
        "% peak"
    );
    for x in r {
        println!(
            "{:<7} {:>17} {:>4} {:<7} {:<11} {:>3} {:<6} {:>10.2} {:>21} {:>7.2} {:>8.2} {:>5.0}% {:>7.1} {:>6}",
            x.format,
            x.shape_label(),
            x.tokens,
            x.isa,
            x.kernel,
            x.threads,
            x.residency,
            x.median_us,
            format!("[{:.2} – {:.2}]", x.min_us, x.max_us),
            x.gb_per_s,
            x.gflop_per_s,
            x.bandwidth_fraction * 100.0,
            x.read_gb_per_s,
            x.peak_fraction
                .map_or("-".to_string(), |f| format!("{:.0}%", f * 100.0))
        );
    }
    println!("(shape: rows×cols, or for attn heads/KV heads×head_dim @positions in the cache. n: tokens per call. GB/s: weights, or the keys and values, read per second. % bw: of the read GB/s beside it, timed interleaved with the kernel at the same threads: for streamed weights a plain read of memory, for cache-resident ones a read of as many bytes held in cache with the widest vector loads. % peak: GFLOP/s of the compute roof of the kernel's instruction at the same threads)");
}

/// The two targets: streamed weights at >= 85% of read bandwidth;
/// cache-resident specialised >= 1.2x generic on the same ISA.
fn print_summary(r: &[KernelResult]) {
    println!("\nsummary (specialised kernels):");
    for s in r.iter().filter(|x| x.kernel == "specialised") {
        let generic = r
            .iter()
            .find(|g| g.kernel == "generic" && g.case() == s.case());
        let ratio = generic
            .map(|g| g.median_us / s.median_us)
            .unwrap_or(f64::NAN);
        // fp4×q8 (bf16dot, fp8dot) next to the same FP4 (BF16, FP8) matrix
        // with f32 activations.
        let base = match s.format.as_str() {
            "fp4q8" | "fp4amx" => Some("fp4"),
            "bf16dot" | "amx" => Some("bf16"),
            "fp8dot" | "fp8amx" => Some("fp8"),
            _ => None,
        };
        let vs_f32_act = base
            .and_then(|b| {
                r.iter().find(|f| {
                    f.format == b
                        && f.attn.is_none()
                        && f.kernel == s.kernel
                        && (f.rows, f.cols, &f.isa, f.threads, &f.residency)
                            == (s.rows, s.cols, &s.isa, s.threads, &s.residency)
                })
            })
            .map(|f| {
                format!(
                    ", {:.2}x {} with f32 activations",
                    f.median_us / s.median_us,
                    f.format
                )
            })
            .unwrap_or_default();
        // Matvec is judged by the read bandwidth, matmul by the compute roof.
        let share = match (s.tokens, s.peak_fraction) {
            (1, _) | (_, None) => format!(
                "{:>6.1}% of {}",
                s.bandwidth_fraction * 100.0,
                if s.residency == "cache" {
                    "a read in cache"
                } else {
                    "read bandwidth"
                }
            ),
            (_, Some(f)) => format!("{:>6.1}% of the compute roof", f * 100.0),
        };
        println!(
            "  {:<7} {:>17}{} {:<7} {}t {:<6}  {share}, {:.2}x the generic kernel{vs_f32_act}",
            s.format,
            s.shape_label(),
            if s.tokens > 1 {
                format!(" ×{}", s.tokens)
            } else {
                String::new()
            },
            s.isa,
            s.threads,
            s.residency,
            ratio
        );
    }
}
