//! The bf16dot variant: BF16 weights times activations rounded to BF16, with
//! VDPBF16PS (AVX-512 BF16), which does two multiply-adds per f32 lane per
//! instruction where the f32 kernels' FMA does one.
//!
//! This is a separately named variant (DESIGN.md, numerics contract), off
//! unless asked for (`--bf16-act bf16`): it is not token-exact, because x is
//! rounded to BF16 (8 significant bits, relative error at most 2⁻⁹) before
//! the products, and the instruction flushes subnormal inputs and sums to
//! zero. Its exact definition is in templates/bf16dot.c.tera; [`row_dot`]
//! computes it in Rust (the conformance tests hold the kernels to it bit for
//! bit), and [`error_bound`] bounds its distance from the exact product.
//!
//! The fp8dot variant (`--fp8-act bf16`) is the same for FP8 weights, whose
//! E4M3 values are all exact BF16 values, summed per 128-column scale block:
//! [`fp8_row_dot`] and [`fp8_error_bound`].

use crate::formats;
use crate::kernels::KernelError;
use crate::linevec::LineVec;

/// Columns per chunk: one 64-byte vector of BF16 values.
pub const CHUNK: usize = 32;

/// Selects how BF16 matrices (`--bf16-act`) or FP8 matrices (`--fp8-act`)
/// meet their activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Bf16Act {
    /// f32 activations: bit-identical to the scalar reference (the default).
    #[default]
    F32,
    /// Activations rounded to BF16, VDPBF16PS pair products (the bf16dot
    /// or fp8dot kernels; AVX-512 BF16 CPUs only).
    Bf16,
    /// Products of 8 or more tokens with a BF16 matrix, of 3 or more
    /// with an FP8 one (prefill) on AMX tiles, activations rounded to BF16
    /// and FP8 weights decoded to BF16 exactly (the amx kernels; Intel
    /// CPUs with AMX-BF16); fewer tokens (decode) through the f32 kernels,
    /// bit-identical to the reference.
    Amx,
}

impl Bf16Act {
    pub fn name(self) -> &'static str {
        match self {
            Bf16Act::F32 => "f32",
            Bf16Act::Bf16 => "bf16",
            Bf16Act::Amx => "amx",
        }
    }
}

/// The row stride of packed activations for `cols` columns: whole chunks,
/// plus one more, so that the kernel's 6 token rows, read side by side, do
/// not all start on multiples of 4 KiB and share L1 sets (at 2048 columns
/// on a Zen 5 core: 300 → 330 GFLOP/s).
pub fn stride(cols: usize) -> usize {
    cols.div_ceil(CHUNK) * CHUNK + CHUNK
}

/// x rounded to BF16 as the kernels read it: to nearest even, a subnormal to
/// zero of its sign (VDPBF16PS would read it as zero anyway), NaN stays NaN.
pub fn round(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x0040) as u16;
    }
    if x.is_subnormal() {
        return ((b >> 16) & 0x8000) as u16;
    }
    // To nearest even on the upper 16 bits (plain integer arithmetic, which
    // the compiler vectorizes: this runs on every activation of every BF16
    // product); past BF16's largest value it carries into infinity.
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// Activations for the bf16dot kernels: n tokens of `cols` columns, rounded
/// to BF16, each token's row zero-padded to [`stride`]. Built only by
/// [`Bf16X::pack_from`], so the fields always agree.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Bf16X {
    pub(crate) h: LineVec<u16>,
    pub(crate) n: usize,
    pub(crate) cols: usize,
}

impl Bf16X {
    pub fn n(&self) -> usize {
        self.n
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Row stride of [`Bf16X::bits`].
    pub fn stride(&self) -> usize {
        stride(self.cols)
    }
    /// [n][stride]: the rounded activations, zero past `cols`.
    pub fn bits(&self) -> &[u16] {
        &self.h
    }

    pub fn pack(x: &[f32], n: usize, cols: usize) -> Result<Bf16X, KernelError> {
        let mut a = Bf16X::default();
        a.pack_from(x, n, cols)?;
        Ok(a)
    }

    /// Round x (`[n][cols]`, row-major by token) into these buffers (reused
    /// across calls).
    pub fn pack_from(&mut self, x: &[f32], n: usize, cols: usize) -> Result<(), KernelError> {
        check_activations("bf16dot", x, n, cols)?;
        let xs = stride(cols);
        self.h.reset(n * xs);
        if cols > 0 {
            let pack = |(xt, ht): (&[f32], &mut [u16])| {
                for (h, &v) in ht.iter_mut().zip(xt) {
                    *h = round(v);
                }
            };
            // A prefill step's tokens across the threads (each value is
            // rounded alone, so the split changes nothing).
            if crate::threads::split_elementwise(x.len()) {
                use rayon::prelude::*;
                x.par_chunks_exact(cols)
                    .zip(self.h.par_chunks_exact_mut(xs))
                    .for_each(pack);
            } else {
                x.chunks_exact(cols)
                    .zip(self.h.chunks_exact_mut(xs))
                    .for_each(pack);
            }
        }
        self.n = n;
        self.cols = cols;
        Ok(())
    }
}

/// x holds n tokens of `cols` columns (for the `family` kernels' packing).
fn check_activations(family: &str, x: &[f32], n: usize, cols: usize) -> Result<(), KernelError> {
    let want = n
        .checked_mul(cols)
        .ok_or_else(|| KernelError::Shape(format!("{family}: n × cols overflows")))?;
    if x.len() != want {
        return Err(KernelError::Length {
            what: format!("{family} activations [{n}, {cols}]"),
            expected: want,
            found: x.len(),
        });
    }
    Ok(())
}

/// The fewest tokens a product takes to go to the amx kernels (with
/// `--bf16-act amx`); fewer go through the f32 kernels. The amx kernels
/// copy every weight once per call, so their time hardly moves from 2 to
/// 16 tokens: `bench kernels --model /tmp/bespoke-bench-llama --formats
/// bf16,amx --quick --threads 1 --tokens N` on the Intel Xeon VM, median µs
/// at 2048 × 2048 cache-resident (amx / f32): 504 / 466 at 2 tokens, 533 /
/// 345 at 4, 571 / 610 at 8, 556 / 1244 at 16.
pub const AMX_MIN_TOKENS: usize = 8;

/// The fewest tokens an FP4 product takes to go to the amx kernels (with
/// `--fp4-act amx`). The f32 FP4 kernels decode every weight again for
/// each tile of 4 tokens, the amx kernels once per call; measured in
/// `bench kernels --formats fp4,amx` (see the README's *The amx variant*).
pub const AMX_FP4_MIN_TOKENS: usize = 3;

/// The fewest tokens an FP8 product takes to go to the amx kernels (with
/// `--fp8-act amx`). The amx kernels' time hardly moves from 2 to 8
/// tokens; the f32 FP8 kernels' grows with every tile of 4 tokens, and a
/// leftover tile of 3 costs more than one of 4. Generic kernels, 1 thread,
/// the Intel Xeon VM, median µs f32 / amx at 3 tokens: 2048 × 4096 1402 /
/// 824, 4096 × 2048 1345 / 1003, 8192 × 1024 1430 / 1057; at 4 tokens 992
/// / 827, 951 / 1024, 1020 / 1097; at 2 tokens 910 / 805, 893 / 995, 961 /
/// 1072 (see the README's *The amx variant*).
pub const AMX_FP8_MIN_TOKENS: usize = 3;

/// Tokens per AMX token group (the columns of a sum tile).
const AMX_GROUP: usize = 16;

/// u32 pairs per (token group, 32-column chunk) in [`AmxX`]: 16 pairs × 16
/// tokens.
const AMX_BLOCK: usize = 256;

/// Activations for the amx kernels: n tokens of `cols` columns rounded to
/// BF16 (as [`round`]), in the tiles' pair layout `[ceil(n/16)][ceil(cols/32)]
/// [16 pairs][16 tokens]` of u32, each the BF16 values of columns 2p and
/// 2p + 1 of one token (low half the even column); zero past `cols` and past
/// `n`. Built only by [`AmxX::pack_from`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AmxX {
    pub(crate) b: LineVec<u32>,
    pub(crate) n: usize,
    pub(crate) cols: usize,
}

impl AmxX {
    pub fn n(&self) -> usize {
        self.n
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The packed pairs (see [`AmxX`]).
    pub fn pairs(&self) -> &[u32] {
        &self.b
    }
    /// How many u32 the layout holds for n tokens of `cols` columns.
    pub fn len_for(n: usize, cols: usize) -> Option<usize> {
        n.div_ceil(AMX_GROUP)
            .checked_mul(cols.div_ceil(CHUNK))?
            .checked_mul(AMX_BLOCK)
    }

    pub fn pack(x: &[f32], n: usize, cols: usize) -> Result<AmxX, KernelError> {
        let mut a = AmxX::default();
        a.pack_from(x, n, cols)?;
        Ok(a)
    }

    /// Round x (`[n][cols]`, row-major by token) into these buffers (reused
    /// across calls).
    pub fn pack_from(&mut self, x: &[f32], n: usize, cols: usize) -> Result<(), KernelError> {
        check_activations("amx", x, n, cols)?;
        let len = Self::len_for(n, cols)
            .ok_or_else(|| KernelError::Shape("amx: packed activations overflow".into()))?;
        self.b.reset(len);
        let nk = cols.div_ceil(CHUNK);
        let group = AMX_BLOCK * nk;
        if cols > 0 && n > 0 {
            // One token group: its tokens' pairs, chunk by chunk (each value
            // rounded alone, so the split across threads changes nothing).
            let pack = |(g, out): (usize, &mut [u32])| {
                let j0 = g * AMX_GROUP;
                for t in 0..AMX_GROUP.min(n - j0) {
                    let row = &x[(j0 + t) * cols..(j0 + t + 1) * cols];
                    let pairs = row.chunks_exact(2);
                    let last = pairs.remainder().first().copied();
                    let np = pairs.len();
                    for (p, pr) in pairs.enumerate() {
                        let v = u32::from(round(pr[0])) | u32::from(round(pr[1])) << 16;
                        out[(p / 16) * AMX_BLOCK + (p % 16) * AMX_GROUP + t] = v;
                    }
                    if let Some(v) = last {
                        out[(np / 16) * AMX_BLOCK + (np % 16) * AMX_GROUP + t] =
                            u32::from(round(v));
                    }
                }
            };
            if crate::threads::split_elementwise(x.len()) {
                use rayon::prelude::*;
                self.b
                    .par_chunks_exact_mut(group)
                    .enumerate()
                    .for_each(pack);
            } else {
                self.b.chunks_exact_mut(group).enumerate().for_each(pack);
            }
        }
        self.n = n;
        self.cols = cols;
        Ok(())
    }
}

/// Zero of v's sign for a subnormal (AMX's flush of inputs and results), else v.
fn ftz_signed(v: f32) -> f32 {
    if v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    }
}

/// The BF16 an FP4 weight becomes in the amx kernels' tiles
/// (`--fp4-act amx`): E2M1 `code` (low 4 bits) times the UE8M0 scale
/// `scale`, the f32 product cut to its top 16 bits. That is the product
/// itself (it has at most 3 significant bits) wherever it is a normal
/// number, ±0, ±inf or NaN; where the f32 product is subnormal the tiles
/// read it as zero of its sign whatever was cut.
pub fn amx_fp4_weight(code: u8, scale: u8) -> u16 {
    let p = formats::e2m1_to_f32(code) * formats::e8m0_to_f32(scale);
    (p.to_bits() >> 16) as u16
}

/// The BF16 an FP8 weight becomes in the amx kernels' tiles
/// (`--fp8-act amx`): E4M3 `code` times the UE8M0 `scale` of its 128×128
/// block, the f32 product cut to its top 16 bits. E4M3 values have at most
/// 4 significant bits, so that is the product itself wherever it is a
/// normal number or ±0; where it is an f32 subnormal the tiles read it as
/// zero of its sign. A NaN code or scale gives a NaN, of either sign (the
/// kernels keep a NaN code's sign bit).
pub fn amx_fp8_weight(code: u8, scale: u8) -> u16 {
    let p = formats::e4m3_to_f32(code) * formats::e8m0_to_f32(scale);
    (p.to_bits() >> 16) as u16
}

/// One output of the amx definition (templates/amx.c.tera): row `w` (BF16
/// bits, `cols` long) against one token's activations `x` already rounded
/// (at least `cols` values; read as zero past `cols`). Per 32-column chunk,
/// the even columns' products and the odd columns' each in their own chain
/// from +0, one rounding per step; then acc += (even + odd).
pub fn amx_row_dot(w: &[u16], x: &[u16]) -> f32 {
    let cols = w.len();
    let get = |c: usize| -> (f32, f32) {
        if c < cols {
            (
                ftz_signed(formats::bf16_to_f32(w[c])),
                ftz_signed(formats::bf16_to_f32(x[c])),
            )
        } else {
            (0.0, 0.0)
        }
    };
    let mut acc = 0.0f32;
    for k in 0..cols.div_ceil(CHUNK) {
        let (mut e, mut o) = (0.0f32, 0.0f32);
        for l in 0..CHUNK / 2 {
            let c0 = CHUNK * k + 2 * l;
            let (w0, x0) = get(c0);
            let (w1, x1) = get(c0 + 1);
            e = ftz_signed(w0.mul_add(x0, e));
            o = ftz_signed(w1.mul_add(x1, o));
        }
        acc = ftz_signed(acc + ftz_signed(e + o));
    }
    acc
}

/// Zero for a subnormal (VDPBF16PS's flush of its inputs and of each sum,
/// which gives +0 on the Zen 5 measured whatever the sign), else v.
fn ftz(v: f32) -> f32 {
    if v.is_subnormal() {
        0.0
    } else {
        v
    }
}

/// Lane sums `s` of the definition over chunks `ks` (in order): for each
/// chunk k and lane l, the odd column's product then the even one's, each
/// added with one rounding and the sum flushed if subnormal. `get(c)` gives
/// column c's weight and (rounded) activation, both already read as the
/// instruction reads them.
fn chunk_sums(s: &mut [f32; 16], ks: std::ops::Range<usize>, get: impl Fn(usize) -> (f32, f32)) {
    for k in ks {
        for (l, a) in s.iter_mut().enumerate() {
            let c0 = CHUNK * k + 2 * l;
            let (w0, x0) = get(c0);
            let (w1, x1) = get(c0 + 1);
            // Each step rounds once, as an FMA does: the product is exact
            // (VDPBF16PS keeps it whole, even past f32's range), only the
            // sum is rounded and, if subnormal, flushed.
            *a = ftz(w1.mul_add(x1, *a));
            *a = ftz(w0.mul_add(x0, *a));
        }
    }
}

/// One output of the bf16dot definition: row `w` (BF16 bits, `cols` long)
/// against one token's packed activations `x` (at least cols rounded up to
/// 32 values, zero past cols).
pub fn row_dot(w: &[u16], x: &[u16]) -> f32 {
    let cols = w.len();
    let get = |c: usize| -> (f32, f32) {
        if c < cols {
            (
                ftz(formats::bf16_to_f32(w[c])),
                ftz(formats::bf16_to_f32(x[c])),
            )
        } else {
            (0.0, 0.0)
        }
    };
    let mut acc = [0.0f32; 16];
    chunk_sums(&mut acc, 0..cols.div_ceil(CHUNK), get);
    crate::reference::reduce16(&acc)
}

/// Columns per FP8 scale block.
pub const FP8_BLOCK: usize = 128;

/// One output of the fp8dot definition: a row of E4M3 `codes` (`cols`
/// long) with its UE8M0 scale bytes (one per 128 columns) against one
/// token's packed activations `x`. Per scale block, lane sums from +0 over
/// the block's chunks as in [`row_dot`], then acc = fma(sum, scale, acc) per
/// lane (an ordinary f32 fma); then the 16-lane tree.
pub fn fp8_row_dot(codes: &[u8], scales: &[u8], x: &[u16]) -> f32 {
    let cols = codes.len();
    // Every E4M3 value is a normal BF16 value (or zero, or NaN), so the
    // instruction reads the weights unflushed.
    let get = |c: usize| -> (f32, f32) {
        if c < cols {
            (
                formats::e4m3_to_f32(codes[c]),
                ftz(formats::bf16_to_f32(x[c])),
            )
        } else {
            (0.0, 0.0)
        }
    };
    let chunks = cols.div_ceil(CHUNK);
    let per_block = FP8_BLOCK / CHUNK;
    let mut acc = [0.0f32; 16];
    for (b, &sb) in scales.iter().enumerate().take(cols.div_ceil(FP8_BLOCK)) {
        let mut s = [0.0f32; 16];
        chunk_sums(
            &mut s,
            b * per_block..((b + 1) * per_block).min(chunks),
            get,
        );
        let sc = formats::e8m0_to_f32(sb);
        for (a, v) in acc.iter_mut().zip(s) {
            *a = v.mul_add(sc, *a);
        }
    }
    crate::reference::reduce16(&acc)
}

/// A bound on |y_bf16dot − Σ w·x| (exact) for one output, from the row's
/// weights (BF16 bits) and the token's f32 activations:
/// - rounding x to BF16: 2⁻⁹·Σ|w·x|, or 2⁻¹²⁶·|w| where x is subnormal;
/// - subnormal weights read as zero: 2⁻¹²⁶·|x| each;
/// - f32 additions, 2 per chunk per lane and 4 in the lane tree:
///   (2·chunks + 4)·2⁻²⁴·(1 + 2⁻²⁴)^… ≈ (2·chunks + 5)·2⁻²⁴·Σ|w·x̂|;
/// - every flushed sum: under 2⁻¹²⁶ each, 2 per column pair (3 allowed).
pub fn error_bound(w: &[u16], x: &[f32]) -> f64 {
    let chunks = w.len().div_ceil(CHUNK) as f64;
    bound_with_adds(w, x, 2.0 * chunks + 5.0)
}

/// The same bound for the amx definition ([`amx_row_dot`]): a product
/// meets at most 16 additions in its chain, one joining the two chains and
/// one per chunk into acc, (chunks + 17 (+1 allowed))·2⁻²⁴·Σ|w·x̂|; the
/// other terms as [`error_bound`].
pub fn amx_error_bound(w: &[u16], x: &[f32]) -> f64 {
    let chunks = w.len().div_ceil(CHUNK) as f64;
    bound_with_adds(w, x, chunks + 18.0)
}

/// [`error_bound`] with `adds` f32 additions on a product's way to y.
fn bound_with_adds(w: &[u16], x: &[f32], adds: f64) -> f64 {
    let two = |e: i32| f64::powi(2.0, e);
    let mut round_err = 0.0f64;
    let mut mass_hat = 0.0f64;
    for (&h, &v) in w.iter().zip(x) {
        let w32 = formats::bf16_to_f32(h);
        let (wv, xv) = (w32 as f64, v as f64);
        let xh = formats::bf16_to_f32(round(v)) as f64;
        round_err += if v.is_subnormal() {
            wv.abs() * two(-126)
        } else {
            (wv * xv).abs() * two(-9)
        };
        if w32.is_subnormal() {
            round_err += xv.abs() * two(-126);
        }
        mass_hat += (wv * xh).abs();
    }
    round_err + adds * two(-24) * 1.001 * mass_hat + 3.0 * w.len() as f64 * two(-126)
}

/// A bound on |y_fp8dot − Σ w·scale·x| (exact) for one output, from the
/// row's E4M3 codes and scale bytes and the token's f32 activations (the
/// terms of [`error_bound`], with each product scaled):
/// - rounding x to BF16: 2⁻⁹·Σ|w·s·x|, or 2⁻¹²⁶·|w·s| where x is subnormal;
/// - f32 additions, 2 per chunk per lane, one fma per block and 4 in the
///   lane tree: (2·chunks + blocks + 5)·2⁻²⁴·Σ|w·s·x̂|;
/// - every flushed block sum: under 2⁻¹²⁶·s each, 2 per column pair (3
///   allowed).
pub fn fp8_error_bound(codes: &[u8], scales: &[u8], x: &[f32]) -> f64 {
    let two = |e: i32| f64::powi(2.0, e);
    let chunks = codes.len().div_ceil(CHUNK) as f64;
    let blocks = codes.len().div_ceil(FP8_BLOCK) as f64;
    let (mut round_err, mut mass_hat, mut flush) = (0.0f64, 0.0f64, 0.0f64);
    for (c, (&code, &v)) in codes.iter().zip(x).enumerate() {
        let s = formats::e8m0_to_f32(scales[c / FP8_BLOCK]) as f64;
        let wv = formats::e4m3_to_f32(code) as f64 * s;
        let xv = v as f64;
        let xh = formats::bf16_to_f32(round(v)) as f64;
        round_err += if v.is_subnormal() {
            wv.abs() * two(-126)
        } else {
            (wv * xv).abs() * two(-9)
        };
        mass_hat += (wv * xh).abs();
        flush += 3.0 * s * two(-126);
    }
    round_err + (2.0 * chunks + blocks + 5.0) * two(-24) * 1.001 * mass_hat + flush
}

/// A 2×64 BF16 matrix and two tokens of activations (`[2][64]`) on which the
/// definition's flushing (row 0 with token 0) and its odd-before-even order
/// (row 1 with token 1) show: see the unit test; the conformance tests run
/// them through the kernels.
pub fn edge_rows() -> (Vec<u16>, Vec<f32>) {
    let min = f32::MIN_POSITIVE;
    let e = f32::powi(2.0, -24);
    let mut w = vec![0u16; 128];
    let mut x = vec![0.0f32; 128];
    // lane 0 adds columns 1, 0, then 33, 32
    for (c, wv, xv) in [(1, 1.0, 2.0 * min), (0, 1.0, -1.5 * min), (33, 1.0, min)] {
        w[c] = formats::f32_to_bf16(wv);
        x[c] = xv;
    }
    for (c, wv, xv) in [(1, e, 1.0), (33, 1.0, 1.0), (32, e, 1.0)] {
        w[64 + c] = formats::f32_to_bf16(wv);
        x[64 + c] = xv;
    }
    (w, x)
}

/// Rows that tell the amx definition from others, 4 rows of 64 columns
/// against 2 tokens (token 0 all ones, token 1 all zeros):
/// - row 0: acc = −1.5·2⁻¹²⁶ after chunk 0, + 2⁻¹²⁶ in chunk 1: a subnormal
///   result, flushed to −0 (its sign kept; +0 by bf16dot's flush);
/// - row 1: columns 0, 1, 3 = 1, 2⁻²⁴, 2⁻²⁴: the odd chain's 2⁻²³ then
///   meets 1, giving 1 + 2⁻²³ (in column order, or bf16dot's lanes, 1).
pub fn amx_edge_rows() -> (Vec<u16>, Vec<f32>) {
    let min = f32::MIN_POSITIVE;
    let e = f32::powi(2.0, -24);
    let mut w = vec![0u16; 4 * 64];
    for (i, v) in [(0, -1.5 * min), (32, min), (64, 1.0), (65, e), (67, e)] {
        w[i] = formats::f32_to_bf16(v);
    }
    let mut x = vec![0.0f32; 2 * 64];
    x[..64].fill(1.0);
    (w, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--help` says the token count the code uses.
    #[test]
    fn amx_help_names_the_token_threshold() {
        use clap::ValueEnum;
        let v = Bf16Act::Amx.to_possible_value().unwrap();
        let help = v.get_help().unwrap().to_string();
        assert!(
            help.contains(&format!("{AMX_MIN_TOKENS} or more tokens")),
            "{help}"
        );
        let v = crate::q8::Fp4Act::Amx.to_possible_value().unwrap();
        let help = v.get_help().unwrap().to_string();
        assert!(
            help.contains(&format!("{AMX_FP4_MIN_TOKENS} or more tokens")),
            "{help}"
        );
        let v = Bf16Act::Amx.to_possible_value().unwrap();
        let help = v.get_help().unwrap().to_string();
        assert!(
            help.contains(&format!("of {AMX_FP8_MIN_TOKENS} or more with an FP8 one")),
            "{help}"
        );
    }

    /// FP8 weights in the amx tiles: every code at every scale against the
    /// product worked out in f64 (E4M3 times 2^(s-127), exact there): the
    /// same value where it is a normal f32 or ±0, zero of its sign where it
    /// is an f32 subnormal, ±inf past f32's range, NaN for a NaN code or
    /// scale.
    #[test]
    fn amx_fp8_weights_are_the_products() {
        for s in 0..=255u8 {
            for c in 0..=255u8 {
                let w = formats::bf16_to_f32(amx_fp8_weight(c, s));
                if c & 0x7F == 0x7F || s == 0xFF {
                    assert!(w.is_nan(), "code {c:#x} scale {s}");
                    continue;
                }
                let exact = formats::e4m3_to_f32(c) as f64 * 2f64.powi(s as i32 - 127);
                let want = if exact.abs() < f32::MIN_POSITIVE as f64 {
                    0.0f32.copysign(exact as f32)
                } else {
                    // Exact in f32 (at most 4 significant bits), or ±inf.
                    exact as f32
                };
                let got = ftz_signed(w);
                assert_eq!(got.to_bits(), want.to_bits(), "code {c:#x} scale {s}");
            }
        }
    }

    /// FP4 weights in the amx tiles: every code at every scale is the exact
    /// product where that is a normal f32 (or 0, inf, NaN), and reads as
    /// zero of its sign where it is subnormal.
    #[test]
    fn amx_fp4_weights_are_the_products() {
        for s in 0..=255u8 {
            for c in 0..16u8 {
                let p = formats::e2m1_to_f32(c) * formats::e8m0_to_f32(s);
                let w = formats::bf16_to_f32(amx_fp4_weight(c, s));
                if p.is_nan() {
                    assert!(w.is_nan(), "code {c} scale {s}");
                } else if p.is_subnormal() {
                    assert_eq!(ftz_signed(w).to_bits(), (0.0f32).copysign(p).to_bits());
                } else {
                    assert_eq!(w.to_bits(), p.to_bits(), "code {c} scale {s}");
                }
            }
        }
        // 6 * 2^127 overflows to inf, as the f32 kernels' product does.
        assert_eq!(formats::bf16_to_f32(amx_fp4_weight(7, 254)), f32::INFINITY);
    }

    /// The amx layout: token j's columns 2p, 2p + 1 in one u32 at group
    /// j / 16, chunk p / 16, pair p % 16, slot j % 16; zero past cols and n;
    /// and the same packing on 1 and 2 threads.
    #[test]
    fn amx_packing_layout() {
        let (n, cols) = (37, 2051);
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 7919) % 4001) as f32 / 97.0 - 20.0)
            .collect();
        let mut one = AmxX::default();
        crate::threads::pool(1)
            .install(|| one.pack_from(&x, n, cols))
            .unwrap();
        let mut two = AmxX::default();
        crate::threads::pool(2)
            .install(|| two.pack_from(&x, n, cols))
            .unwrap();
        assert_eq!(one, two);
        let nk = cols.div_ceil(CHUNK);
        assert_eq!(one.pairs().len(), 3 * nk * 256);
        for j in 0..48 {
            for c in (0..nk * CHUNK).step_by(2) {
                let p = c / 2;
                let v = one.pairs()[((j / 16 * nk + p / 16) * 16 + p % 16) * 16 + j % 16];
                let at = |c: usize| {
                    if j < n && c < cols {
                        round(x[j * cols + c])
                    } else {
                        0
                    }
                };
                assert_eq!(
                    v,
                    u32::from(at(c)) | u32::from(at(c + 1)) << 16,
                    "token {j} column {c}"
                );
            }
        }
    }

    /// A prefill step's worth of tokens is packed across the threads; the
    /// result is the one-thread packing.
    #[test]
    fn packing_across_threads_matches_one_thread() {
        let (n, cols) = (40, 2050);
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 7919) % 4001) as f32 / 97.0 - 20.0)
            .collect();
        assert!(
            x.len() >= crate::threads::PAR_ELEMENTWISE_MIN,
            "large enough to be split"
        );
        let mut one = Bf16X::default();
        crate::threads::pool(1)
            .install(|| one.pack_from(&x, n, cols))
            .unwrap();
        let mut two = Bf16X::default();
        crate::threads::pool(2)
            .install(|| two.pack_from(&x, n, cols))
            .unwrap();
        assert_eq!(one.h, two.h);
        let xs = stride(cols);
        assert_eq!(one.h[xs + 1], round(x[cols + 1]));
        assert!(one.h[xs - 2..xs].iter().all(|&h| h == 0), "padding zero");
    }

    #[test]
    fn rounding_and_packing() {
        assert_eq!(round(1.0), 0x3F80);
        // halfway between 1 and the next BF16 value: to even (1)
        assert_eq!(round(f32::from_bits(0x3F80_8000)), 0x3F80);
        assert_eq!(round(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(round(-f32::from_bits(1)), 0x8000);
        assert!(formats::bf16_to_f32(round(f32::NAN)).is_nan());
        assert_eq!(round(f32::MAX), 0x7F80);
        assert_eq!(round(-f32::INFINITY), 0xFF80);
        // the same as the format module's rounding off the subnormals
        let mut z = 0x9E37_79B9u32;
        for _ in 0..200_000 {
            z ^= z << 13;
            z ^= z >> 17;
            z ^= z << 5;
            let v = f32::from_bits(z);
            if !v.is_nan() && !v.is_subnormal() {
                assert_eq!(round(v), formats::f32_to_bf16(v), "{v:e}");
            }
        }
        let x: Vec<f32> = (0..2 * 40).map(|i| i as f32).collect();
        let a = Bf16X::pack(&x, 2, 40).unwrap();
        assert_eq!(a.stride(), 96);
        assert_eq!(a.bits().len(), 2 * 96);
        assert_eq!(a.bits()[96 + 1], round(41.0));
        assert!(a.bits()[40..96].iter().all(|&h| h == 0));
        let e = Bf16X::pack(&x, 3, 40).unwrap_err().to_string();
        assert!(e.contains("[3, 40]") && e.contains("120"), "{e}");
    }

    #[test]
    fn definition_flushes_and_orders_pairs() {
        let (w, x) = edge_rows();
        let x = Bf16X::pack(&x, 2, 64).unwrap();
        let xs = x.stride();
        // flush: 2·min − 1.5·min is subnormal → 0, then + min
        assert_eq!(row_dot(&w[..64], &x.bits()[..xs]), f32::MIN_POSITIVE);
        // order: (2⁻²⁴ + 1) + 2⁻²⁴ = 1 (ties to even twice); even column
        // first would give 1 + 2⁻²³
        assert_eq!(row_dot(&w[64..], &x.bits()[xs..]), 1.0);
    }
}
