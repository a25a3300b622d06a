//! Conformance: every compiled kernel variant, specialised and generic, every
//! format, against the Rust scalar reference — bit for bit (NaN = NaN).
//! Shapes: the ones this build specialised for (the bundled models) and
//! awkward ones. Run with `--nocapture` to see which variants ran.

mod common;

use bespoke::bf16act::{self, AmxX, Bf16Act, Bf16X};
use bespoke::kernels::{
    AttnArgs, Kernels, MatKernel, Matrix, Weights, AMX_KERNELS, ATTN_KERNELS, BF16DOT_KERNELS,
    COMPILED_ISAS, MAT_KERNELS, Q8_KERNELS,
};
use bespoke::plan::{Format, Isa, FORMATS};
use bespoke::q8::{Fp4Act, Q8Act};
use bespoke::{formats, reference};
use common::{first_diff, Rng};

/// Variants this CPU can run; prints which were compiled but cannot run here.
/// BESPOKE_REQUIRE_VARIANTS=a,b makes a variant that did not run a failure.
fn runnable() -> Vec<Kernels> {
    let mut ks = Vec::new();
    let mut lines = Vec::new();
    for &isa in COMPILED_ISAS {
        match Kernels::with_isa(isa) {
            Ok(k) => {
                lines.push(format!("  {isa}: RUN"));
                ks.push(k);
            }
            Err(e) => lines.push(format!("  {isa}: compiled, NOT run here: {e}")),
        }
    }
    eprintln!("kernel variants:\n{}", lines.join("\n"));
    if let Ok(req) = std::env::var("BESPOKE_REQUIRE_VARIANTS") {
        for name in req
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty() && *s != "bf16dot" && *s != "amx")
        {
            let isa = Isa::parse(name)
                .unwrap_or_else(|| panic!("BESPOKE_REQUIRE_VARIANTS: unknown variant {name}"));
            assert!(
                ks.iter().any(|k| k.isa() == isa),
                "required variant {name} did not run:\n{}",
                lines.join("\n")
            );
        }
    }
    ks
}

/// Owned random weights in one format.
struct Owned {
    rows: usize,
    cols: usize,
    format: Format,
    f: Vec<f32>,
    h: Vec<u16>,
    b: Vec<u8>,
    s: Vec<u8>,
    /// `matrix()` scans the FP8 codes for NaN, as the engine does
    /// (`Matrix::with_fp8_scanned`).
    scanned: bool,
}

impl Owned {
    fn random(rng: &mut Rng, format: Format, rows: usize, cols: usize) -> Owned {
        let n = rows * cols;
        let mut o = Owned {
            rows,
            cols,
            format,
            f: vec![],
            h: vec![],
            b: vec![],
            s: vec![],
            scanned: false,
        };
        match format {
            Format::F32 => o.f = (0..rows).flat_map(|_| rng.activations(cols)).collect(),
            Format::Bf16 => {
                o.h = (0..n)
                    .map(|_| match rng.below(60) {
                        0 => 0x8000,                          // -0
                        1 => 0x0001 + rng.below(0x7F) as u16, // subnormal
                        // largest finite
                        2 if rng.keep_extreme(cols) => 0x7F7F,
                        3 if rng.keep_extreme(cols) => 0xFF7F,
                        _ => formats::f32_to_bf16(rng.unit() * 2.0),
                    })
                    .collect()
            }
            Format::Fp8 => {
                // Every code, NaN codes rarely.
                o.b = (0..n)
                    .map(|_| {
                        let c = rng.below(256) as u8;
                        if c & 0x7F == 0x7F && (rng.below(20) != 0 || !rng.keep_extreme(cols)) {
                            c ^ 1
                        } else {
                            c
                        }
                    })
                    .collect();
                // (one scale row serves 128 rows: thinner still)
                let (sr, sc) = format.scale_shape(rows, cols).unwrap();
                o.s = (0..sr * sc).map(|_| rng.scale_byte_of(8 * sc)).collect();
            }
            Format::Fp4 => {
                o.b = (0..n / 2).map(|_| rng.below(256) as u8).collect();
                let (sr, sc) = format.scale_shape(rows, cols).unwrap();
                o.s = (0..sr * sc).map(|_| rng.scale_byte_of(sc)).collect();
            }
        }
        o
    }
    fn matrix(&self) -> Matrix<'_> {
        let w = match self.format {
            Format::F32 => Weights::F32(&self.f),
            Format::Bf16 => Weights::Bf16(&self.h),
            Format::Fp8 => Weights::Fp8 {
                w: &self.b,
                scale: &self.s,
            },
            Format::Fp4 => Weights::Fp4 {
                w: &self.b,
                scale: &self.s,
            },
        };
        let m = Matrix::new(self.rows, self.cols, w).expect("valid test matrix");
        if self.scanned {
            m.with_fp8_scanned()
        } else {
            m
        }
    }
}

fn awkward_shapes(format: Format) -> Vec<(usize, usize)> {
    match format {
        Format::F32 | Format::Bf16 => vec![
            (1, 1),
            (1, 17),
            (3, 15),
            (5, 16),
            (37, 100),
            (130, 33),
            (64, 64),
            (9, 257),
            // AVX-512 BF16 one-token tiles step whole 64-byte lines (32
            // columns), then one 16-column group, then a partial one; rows of
            // up to 2048 columns go two at a time, half the range apart (an
            // odd count leaves one), longer ones 12 at a time, then 4, then
            // single rows (17 = 12 + 4 + 1), and rows a whole number of 4 KiB
            // pages long 8 at a time, then single rows (19 = 8 + 8 + 3).
            (21, 120),
            (10, 1024),
            (10, 2048),
            (17, 2048),
            (17, 2048 + 16 + 5),
            (19, 4096),
            (11, 8192),
            // Rows of 8 KiB and more (BF16): the matmul takes them in blocks
            // of 16 rows, X put in the permuted order once for all blocks.
            (40, 4100),
        ],
        Format::Fp8 => vec![
            (1, 1),
            (1, 16),
            (3, 250),
            (129, 130),
            (128, 128),
            (200, 300),
            (17, 17),
        ],
        // FP4 takes 128-column chunks, 4 at a time (16 scale bytes): rows
        // of 1-3 blocks only, a partial last chunk after whole ones, a last
        // group of 4 with fewer chunks, with and without a partial one.
        Format::Fp4 => vec![
            (1, 32),
            (7, 96),
            (33, 160),
            (2, 2048),
            (130, 64),
            (3, 224),
            (9, 640),
            (4, 2048 + 96),
        ],
    }
}

fn specialised_shapes(format: Format) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = MAT_KERNELS
        .iter()
        .filter(|k| k.format == format)
        .filter_map(|k| k.shape)
        .collect();
    v.sort();
    v.dedup();
    v
}

/// Full check of matvec and matmul for one matrix on every variant.
fn check_full(
    ks: &[Kernels],
    rng: &mut Rng,
    format: Format,
    rows: usize,
    cols: usize,
    ns: &[usize],
) -> usize {
    let o = Owned::random(rng, format, rows, cols);
    check_owned(ks, rng, &o, ns)
}

thread_local! {
    /// This test's checks on rows of 64+ columns: (values, finite values,
    /// checks, checks with no finite value). See `FiniteTally`.
    static TALLY: std::cell::Cell<(usize, usize, usize, usize)> =
        const { std::cell::Cell::new((0, 0, 0, 0)) };
}

/// Counts a check's outputs (rows of `cols` columns) for `FiniteTally`.
fn note_finite(what: &str, y: &[f32], cols: usize) {
    if cols < 64 {
        return;
    }
    let finite = y.iter().filter(|v| v.is_finite()).count();
    if finite == 0 {
        eprintln!("note: {what}: no finite output");
    }
    TALLY.with(|t| {
        let (v, f, c, d) = t.get();
        t.set((v + y.len(), f + finite, c + 1, d + usize::from(finite == 0)));
    });
}

/// Held for a test's length: when the test ends, its checks on rows of 64
/// columns and more must have compared sums, not only NaN and infinity (see
/// `Rng::keep_extreme`): at least half of their outputs finite, and no
/// finite output at all in at most a quarter of the checks (or one). Counted
/// over the test, since an input shared by every row (x, an FP8 scale row)
/// may by chance overflow one whole check, and which draw meets which check
/// depends on how many variants the CPU runs.
struct FiniteTally;

impl FiniteTally {
    fn start() -> FiniteTally {
        TALLY.with(|t| t.set((0, 0, 0, 0)));
        FiniteTally
    }
}

impl Drop for FiniteTally {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let (values, finite, checks, dead) = TALLY.with(|t| t.get());
        assert!(
            finite * 2 >= values && dead <= (checks / 4).max(1),
            "only {finite} of {values} outputs finite, and {dead} of {checks} checks with none: \
             the test inputs overflow the sums"
        );
    }
}

/// Matvec and matmul of one given matrix on every variant, generic and
/// specialised, against the scalar reference, bit for bit.
fn check_owned(ks: &[Kernels], rng: &mut Rng, o: &Owned, ns: &[usize]) -> usize {
    let x = rng.activations(o.cols);
    let want = reference::matvec(&o.matrix(), &x);
    note_finite(
        &format!("{} {}x{}", o.format, o.rows, o.cols),
        &want,
        o.cols,
    );
    check_owned_with(ks, rng, o, &x, ns)
}

/// The kernels a variant has for a matrix: generic, and specialised when
/// the build made one for the shape.
fn kernels_for(k: &Kernels, o: &Owned) -> Vec<(&'static str, &'static MatKernel)> {
    let mut v = vec![("generic", k.mat_kernel_generic(o.format))];
    if let Some(s) = k.mat_kernel_specialised(o.format, o.rows, o.cols) {
        v.push(("specialised", s));
    }
    v
}

/// `check_owned` for a given x (the matmul's tokens still random).
fn check_owned_with(ks: &[Kernels], rng: &mut Rng, o: &Owned, x: &[f32], ns: &[usize]) -> usize {
    let (format, rows, cols) = (o.format, o.rows, o.cols);
    let m = o.matrix();
    let want = reference::matvec(&m, x);
    let mut checked = 0;
    for k in ks {
        for (kind, kern) in kernels_for(k, o) {
            let mut y = vec![f32::NAN; rows];
            k.matvec_with(kern, &m, x, &mut y).unwrap();
            if let Some((i, a, b)) = first_diff(&y, &want) {
                panic!("{} {format} {kind} matvec {rows}x{cols}: row {i}: kernel {a:e} ({:#x}), reference {b:e} ({:#x})", k.isa(), a.to_bits(), b.to_bits());
            }
            checked += 1;
        }
    }
    for &n in ns {
        check_matmul_with(ks, o, &rng.activations(n * cols), n);
    }
    checked
}

/// Matmul of one matrix by given tokens on every variant, generic and
/// specialised, against the scalar reference, bit for bit.
fn check_matmul_with(ks: &[Kernels], o: &Owned, xs: &[f32], n: usize) -> usize {
    let (format, rows, cols) = (o.format, o.rows, o.cols);
    let m = o.matrix();
    let want = reference::matmul(&m, xs, n);
    let mut checked = 0;
    for k in ks {
        for (kind, kern) in kernels_for(k, o) {
            let mut ys = vec![f32::NAN; n * rows];
            k.matmul_with(kern, &m, xs, n, &mut ys).unwrap();
            if let Some((i, a, b)) = first_diff(&ys, &want) {
                panic!("{} {format} {kind} matmul {rows}x{cols} n={n}: token {} row {}: kernel {a:e}, reference {b:e}", k.isa(), i / rows, i % rows);
            }
            checked += 1;
        }
    }
    checked
}

#[test]
fn matrix_kernels_match_reference_on_awkward_shapes() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(1);
    let mut count = 0;
    for format in FORMATS {
        for (rows, cols) in awkward_shapes(format) {
            count += check_full(&ks, &mut rng, format, rows, cols, &[1, 2, 3, 5, 8]);
        }
    }
    eprintln!("awkward shapes: {count} kernel checks passed");
}

/// The values the random inputs thin out of long rows (see
/// `Rng::keep_extreme`), planted in rows of 512 columns: a NaN and a 2^127
/// and a 2^-127 scale byte, NaN codes, largest-finite and subnormal weights,
/// and then activations of f32::MAX. Every kernel against the reference bit
/// for bit, and the planted NaNs must come out.
#[test]
fn extremes_in_long_rows() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(17);
    let (rows, cols) = (260, 512);
    let nan_rows: &[usize] = &[5, 9];
    for format in FORMATS {
        let mut o = Owned::random(&mut rng, format, rows, cols);
        let nb = cols / 32;
        match format {
            Format::F32 => {
                o.f[5 * cols + 3] = f32::NAN;
                o.f[9 * cols] = f32::INFINITY;
                o.f[9 * cols + 1] = f32::NEG_INFINITY;
                o.f[12 * cols + 7] = f32::MAX;
                o.f[13 * cols + 8] = f32::MIN_POSITIVE / 3.0;
            }
            Format::Bf16 => {
                o.h[5 * cols + 3] = 0x7FC1; // NaN
                o.h[9 * cols + 511] = 0xFFC0;
                o.h[12 * cols + 7] = 0x7F7F; // largest finite
                o.h[13 * cols + 8] = 0xFF7F;
                o.h[14 * cols + 9] = 0x0003; // subnormal
            }
            Format::Fp8 => {
                // One scale row per 128 rows (4 blocks a row): NaN for rows
                // 128..256 (block 1), 2^127 and 2^-127 for rows 256..260.
                o.s[4 + 1] = 0xFF;
                o.s[2 * 4] = 254;
                o.s[2 * 4 + 3] = 0;
                o.b[5 * cols + 3] = 0x7F; // NaN codes
                o.b[9 * cols + 300] = 0xFF;
                o.b[12 * cols + 7] = 0x7E; // largest finite
                o.b[13 * cols + 8] = 0x01; // subnormal
            }
            Format::Fp4 => {
                o.s[5 * nb + 3] = 0xFF;
                o.s[9 * nb + nb - 1] = 0xFF;
                o.s[12 * nb] = 254;
                o.s[13 * nb + 1] = 0;
                o.s[14 * nb + 2] = 1;
            }
        }
        let m = o.matrix();
        let x = rng.activations(cols);
        let want = reference::matvec(&m, &x);
        let mut expect_nan: Vec<usize> = nan_rows.to_vec();
        if format == Format::Fp8 {
            expect_nan.extend(128..256);
        }
        for &r in &expect_nan {
            assert!(
                want[r].is_nan(),
                "{format}: row {r} holds a NaN: {}",
                want[r]
            );
        }
        note_finite(&format!("{format} {rows}x{cols} planted"), &want, cols);
        check_owned_with(&ks, &mut rng, &o, &x, &[1, 3]);
        if format == Format::Fp4 {
            let y = check_q8(&ks, &o, &x);
            for &r in nan_rows {
                assert!(y[r].is_nan(), "fp4×q8: row {r} has a NaN scale: {}", y[r]);
            }
        }
        if format == Format::Bf16 && bf16dot_runs() {
            let y = check_bf16dot(&o, &x, 1);
            for &r in nan_rows {
                assert!(y[r].is_nan(), "bf16dot: row {r} holds a NaN: {}", y[r]);
            }
        }
        // The largest activations, of both signs, in a long row.
        let mut xm = x.clone();
        xm[100] = f32::MAX;
        xm[301] = f32::MIN;
        xm[302] = -1e30;
        check_owned_with(&ks, &mut rng, &o, &xm, &[1]);
    }
}

/// FP8 codes as a real checkpoint has them: nearly all normal, with a zero,
/// subnormal or NaN code in some 128-column blocks only. AVX2 decodes
/// all-normal blocks by a shortcut and redoes the others exactly; both kinds
/// of block occur here, in every row range and tile.
fn fp8_mostly_normal(rng: &mut Rng, rows: usize, cols: usize, one_in: u64) -> Owned {
    let mut o = Owned::random(rng, Format::Fp8, rows, cols);
    for b in o.b.iter_mut() {
        let sign = *b & 0x80;
        *b = sign
            | if rng.below(one_in) != 0 {
                8 + rng.below(119) as u8 // magnitude 8..=126: a normal value
            } else {
                match rng.below(3) {
                    0 => 0,                      // ±0
                    1 => 1 + rng.below(7) as u8, // subnormal
                    _ => 0x7F,                   // NaN
                }
            };
    }
    o
}

#[test]
fn fp8_fast_and_exact_blocks() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(7);
    let mut count = 0;
    for (rows, cols, one_in) in [
        (64, 512, 3000),
        (130, 384, 600),
        (3, 250, 300),
        (17, 1024, 1 << 40),
    ] {
        let o = fp8_mostly_normal(&mut rng, rows, cols, one_in);
        count += check_owned(&ks, &mut rng, &o, &[1, 2, 3, 8]);
    }
    eprintln!("fp8 normal/special blocks: {count} kernel checks passed");
}

/// An FP8 matrix scanned and found free of NaN codes (`with_fp8_scanned`,
/// as the engine's are) lets the "s" tiles skip their NaN check: the same
/// bits as the reference on every variant, matvec and matmul, with x in
/// range of the "s" tiles and not. A scan that meets a NaN code leaves the
/// matrix unmarked, and a call after a marked one on the same threads checks
/// again (the flag is per call).
#[test]
fn fp8_scanned_matrices_keep_the_reference_bits() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(29);
    let mut count = 0;
    for (rows, cols) in [(64, 512), (130, 384), (3, 250), (17, 1024), (256, 4096)] {
        let mut o = fp8_mostly_normal(&mut rng, rows, cols, 50);
        let mut nan = o.b.clone();
        for b in o.b.iter_mut() {
            if *b & 0x7F == 0x7F {
                *b ^= 1; // 0x7E: 448, the largest normal value
            }
        }
        o.scanned = true;
        assert!(
            o.matrix().fp8_clean(),
            "{rows}x{cols}: no NaN code, yet not marked clean"
        );
        let small: Vec<f32> = (0..cols).map(|_| rng.unit() * 8.0).collect();
        count += check_owned_with(&ks, &mut rng, &o, &small, &[2, 8]);
        let x = rng.activations(cols);
        count += check_owned_with(&ks, &mut rng, &o, &x, &[]);
        // Put a NaN code back: the scan must see it, and the kernels, called
        // right after the marked matrix, must check again and give NaN.
        if !nan.iter().any(|b| b & 0x7F == 0x7F) {
            nan[rows * cols / 2] = 0x7F;
        }
        o.b = nan;
        assert!(
            !o.matrix().fp8_clean(),
            "{rows}x{cols}: a NaN code, yet marked clean"
        );
        let x: Vec<f32> = (0..cols).map(|_| rng.unit() * 8.0).collect();
        assert!(reference::matvec(&o.matrix(), &x)
            .iter()
            .any(|v| v.is_nan()));
        count += check_owned_with(&ks, &mut rng, &o, &x, &[]);
    }
    // Only FP8 is ever marked.
    let o = Owned::random(&mut rng, Format::Bf16, 4, 64);
    assert!(!o.matrix().with_fp8_scanned().fp8_clean());
    assert!(!o.matrix().with_fp8_scan_result(true).fp8_clean());
    eprintln!("fp8 scanned matrices: {count} kernel checks passed");
}

/// AVX2 and AVX-512 take FP8 rows against x scaled by 2^120 when every
/// |x| < 256 (their "s" tiles: zero and subnormal codes become f32
/// subnormals, a block with a NaN code is redone, for every row of the tile)
/// and their other decoder otherwise. Both sides of that bound, with
/// x as small as an f32 subnormal and as large as the bound allows, must
/// give the reference's bits.
#[test]
fn fp8_scaled_x_bound() {
    let _tally = FiniteTally::start();
    // With the "s" tiles switched on, then off (kernels::fp8_scaled: the
    // default on an Intel core for AVX-512), every ISA that has them; the
    // bits must be the reference's either way. (Another test meeting the
    // switch mid-way gets the same bits too.)
    for on in [true, false] {
        let switched: Vec<Isa> = COMPILED_ISAS
            .iter()
            .copied()
            .filter(|&isa| bespoke::kernels::set_fp8_scaled(isa, on))
            .collect();
        eprintln!(
            "fp8 \"s\" tiles {}: {switched:?}",
            if on { "on" } else { "off" }
        );
        fp8_scaled_x_bound_checks();
    }
    // Back to this process's setting for the tests after it.
    if let Ok(f) = bespoke::kernels::fp8_scaled() {
        for &(isa, on) in &f.isas {
            bespoke::kernels::set_fp8_scaled(isa, on);
        }
    }
}

fn fp8_scaled_x_bound_checks() {
    let ks = runnable();
    let mut rng = Rng(11);
    let below = f32::from_bits(256f32.to_bits() - 1); // the largest f32 under 256
    let edges = [
        None,
        Some(below),
        Some(-below),
        Some(256.0),
        Some(-256.0),
        Some(f32::INFINITY),
        Some(f32::NAN),
    ];
    let mut count = 0;
    for (rows, cols, one_in) in [
        (40, 512, 200),
        (9, 300, 50),
        (33, 128, 1 << 40),
        (5, 48, 20),
    ] {
        let o = fp8_mostly_normal(&mut rng, rows, cols, one_in);
        // Subnormal values, signed zeros, values up to 255, and the edge.
        // (The matmul's first 4-token tile holds one x at the bound and
        // three under it.)
        count += check_x_edges(&ks, &mut rng, &o, &edges, |rng, c| match c % 7 {
            0 => f32::from_bits(1 + rng.below(0x7F_FFFF) as u32),
            1 => -0.0,
            2 => 0.0,
            3 => rng.unit() * 255.0,
            _ => rng.unit() * 2.0,
        });
    }
    eprintln!("fp8 x at the 2^120 scaling bound: {count} kernel checks passed");
}

/// One x per edge (`value(rng, column)`, then the edge, if any, at the
/// middle column), each as a matvec, then all of them as the tokens of one
/// matmul, on every variant against the reference.
fn check_x_edges(
    ks: &[Kernels],
    rng: &mut Rng,
    o: &Owned,
    edges: &[Option<f32>],
    mut value: impl FnMut(&mut Rng, usize) -> f32,
) -> usize {
    let mut count = 0;
    let mut xs = Vec::new();
    for edge in edges {
        let mut x: Vec<f32> = (0..o.cols).map(|c| value(rng, c)).collect();
        if let Some(v) = edge {
            x[o.cols / 2] = *v;
        }
        count += check_owned_with(ks, rng, o, &x, &[]);
        xs.extend(x);
    }
    count + check_matmul_with(ks, o, &xs, edges.len())
}

/// The FP4 "_c" tiles (AVX2): weights as w * 2^25 against x * 2^-25, taken
/// when every x is 0 or finite with |x| >= 2^-101. The usual activations
/// hold subnormals and take the other tiles, so here x has none: ordinary
/// values, signed zeros, values near 1e6; or all of it tiny (down to the
/// bound itself, where a scaling one step too far would lose bits); or
/// nearly all zeros. Each also with one value at the edge of the bound
/// (2^-101, the float under it, a subnormal, infinity, NaN). Shapes: partial chunks, a row over the
/// 16384-column x buffer (x copied inside the tile), the build's FP4 shapes.
#[test]
fn fp4_scaled_x_bound() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(12);
    let bound = 2f32.powi(-101);
    let under = f32::from_bits(bound.to_bits() - 1);
    let edges = [
        None,
        Some(bound),
        Some(-bound),
        Some(under),
        Some(f32::from_bits(3)),
        Some(f32::INFINITY),
        Some(f32::NAN),
    ];
    let mut shapes = vec![(5, 32), (9, 160), (33, 128), (40, 512), (3, 16384 + 128)];
    shapes.extend(specialised_shapes(Format::Fp4));
    let mut count = 0;
    for (rows, cols) in shapes {
        let o = Owned::random(&mut rng, Format::Fp4, rows, cols);
        // 0: ordinary, 1: tiny, 2: zeros but the edge and a few tiny ones
        // (so that the edge's own products reach the output).
        // (The matmul's 2-token tiles pair vectors on both sides of the
        // bound.)
        for kind in 0..3 {
            count += check_x_edges(&ks, &mut rng, &o, &edges, |rng, c| match (kind, c % 6) {
                (_, 0) => 0.0,
                (_, 1) => -0.0,
                (0, 2) => rng.unit() * 1e6,
                (0, _) => rng.unit() * 4.0,
                (2, _) if rng.below(64) != 0 => 0.0,
                _ => {
                    let m = 1.0 + rng.below(8) as f32 / 8.0;
                    let s = if rng.below(2) == 0 { 1.0 } else { -1.0 };
                    s * m * bound * (1u32 << rng.below(4)) as f32
                }
            });
        }
    }
    eprintln!("fp4 x at the 2^-25 scaling bound: {count} kernel checks passed");
}

/// Rows wider than the kernels' permuted-x buffer (16384 columns) take the
/// logical-order path; it must give the same bits.
#[test]
fn very_wide_rows() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(8);
    // Zero and subnormal codes in some blocks (AVX2 redoes those blocks
    // exactly), no NaN codes: a NaN in each of three rows this wide would
    // leave nothing but NaN to compare.
    let mut o = fp8_mostly_normal(&mut rng, 3, 16384 + 160, 5000);
    for b in o.b.iter_mut().filter(|b| **b & 0x7F == 0x7F) {
        *b &= 0x80;
    }
    assert!(o.b.iter().filter(|&&b| b & 0x7F < 8).count() >= 6);
    check_owned(&ks, &mut rng, &o, &[1, 3]);
    for format in [Format::Fp4, Format::Bf16] {
        check_full(&ks, &mut rng, format, 3, 16384 + 64, &[1, 3]);
    }
}

#[test]
fn matmul_up_to_64_columns() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(2);
    for format in FORMATS {
        let (rows, cols) = if format == Format::Fp4 {
            (19, 64)
        } else {
            (19, 40)
        };
        // 35: FP4's 4-token tiles leave 3 (one 3-token tile after 32 tokens).
        check_full(&ks, &mut rng, format, rows, cols, &[17, 33, 35, 64]);
    }
}

/// Wide rows: the matmul kernels work through the rows in blocks of about
/// 128 KiB of weights (every column tile of X per block), so these shapes
/// cross several blocks, with a last partial one.
#[test]
fn matmul_across_row_blocks() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(5);
    for format in FORMATS {
        check_full(&ks, &mut rng, format, 150, 4096, &[5, 9]);
    }
}

/// Many tokens of long rows: the F32 and BF16 matmul kernels take X in
/// slabs of about 768 KiB, every row block against one slab before the next
/// (here 26 tokens of 8192 columns: slabs of 18 and 8 with the AVX-512 tile
/// of 6 tokens), and the tokens left over after the whole column tiles as
/// one narrower tile (2, 4, 5 here; 3 in `matmul_up_to_64_columns`).
#[test]
fn matmul_token_slabs() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(6);
    for format in FORMATS {
        check_full(&ks, &mut rng, format, 20, 8192, &[2, 26, 29]);
    }
}

/// X anywhere: the F32 and BF16 kernels read X in place, so
/// `Kernels::matvec_with` and `matmul_with` hand them a copy that starts on a
/// cache line when X does not (and its rows are whole lines). X at every
/// float offset from a line, 0 to 16, with rows of whole lines (64, 2048
/// columns) and not (100): the same bits as the reference every time.
#[test]
fn x_off_a_cache_line() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(12);
    for format in [Format::F32, Format::Bf16] {
        for (rows, cols) in [(37, 64), (24, 2048), (19, 100)] {
            let o = Owned::random(&mut rng, format, rows, cols);
            for n in [1, 7] {
                let x = rng.activations(n * cols);
                let mut buf = vec![0f32; x.len() + 32];
                let base = buf.as_ptr().align_offset(64);
                for off in 0..=16 {
                    let at = base + off;
                    buf[at..at + x.len()].copy_from_slice(&x);
                    check_matmul_with(&ks, &o, &buf[at..at + x.len()], n);
                    if n == 1 {
                        check_owned_with(&ks, &mut rng, &o, &buf[at..at + x.len()], &[]);
                    }
                }
            }
        }
    }
}

/// Matvec rows shorter than a page (AVX-512: rows of 512 B, 1 KiB and 2 KiB
/// here) go in groups of MR x ps rows, ps = 4096 / row bytes, as ps tiles
/// whose rows are ps apart (`IsaDesc::matvec_page_bytes`); 141 rows make two
/// groups at every ps with rows left for the plain tiles and single rows,
/// and a range starting at row 3 puts the groups off the matrix's start.
#[test]
fn matvec_rows_in_page_groups() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(7);
    let rows = 141;
    for format in FORMATS {
        for row_bytes in [512, 1024, 2048] {
            let cols = match format {
                Format::F32 => row_bytes / 4,
                Format::Bf16 => row_bytes / 2,
                Format::Fp8 => row_bytes,
                Format::Fp4 => row_bytes * 2,
            };
            let o = Owned::random(&mut rng, format, rows, cols);
            let m = o.matrix();
            let x = rng.activations(cols);
            let want: Vec<f32> = (0..rows).map(|r| reference::row_dot(&m, r, &x)).collect();
            note_finite(&format!("{format} {rows}x{cols}"), &want, cols);
            for k in &ks {
                for (kind, kern) in kernels_for(k, &o) {
                    for (r0, r1) in [(0, rows), (3, rows - 2)] {
                        let mut y = vec![f32::NAN; rows];
                        k.matvec_rows_with(kern, &m, &x, &mut y, r0, r1).unwrap();
                        let what = format!("{} {format} {kind} matvec {rows}x{cols}", k.isa());
                        check_rows(&what, &y, &want, r0, r1);
                    }
                }
            }
        }
    }
}

/// FP4 and FP8 (and BF16 where the ISA permutes x) prepare x once a
/// product (`MatKernel::prepared`), up to 16384 columns, where the threads
/// share the rows; `matvec_with` then runs the "_px" kernels over the
/// threads' claims. Their bits are the plain matvec's, which prepares x
/// itself, and the reference's, with x both in and out of the range the
/// scaled tiles take (FP8: |x| < 256; FP4: no nonzero |x| below 2^-101), at
/// 2 threads; generic on an awkward shape, and specialised (with its own
/// "_prep") on the build's shapes big enough to share, up to 8M weights.
#[test]
fn prepared_x_matches_per_call() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(11);
    let pool = bespoke::threads::pool(2);
    let mut shapes = 0;
    for format in [Format::Fp4, Format::Fp8, Format::Bf16] {
        for k in &ks {
            let kern = k.mat_kernel_generic(format);
            let Some(p) = kern.prepared else {
                assert_eq!(format, Format::Bf16, "{} {format}: no prepared x", k.isa());
                continue;
            };
            // SAFETY: a pure function of the column count.
            let (short, wide) = unsafe { ((p.len)(4096), (p.len)(16384 + 128)) };
            assert!(
                short >= 4096 && wide == 0,
                "{} {format}: lengths {short}, {wide}",
                k.isa()
            );
        }
        let built = specialised_shapes(format)
            .into_iter()
            .filter(|&(r, c)| r >= 32 && r * c >= 1 << 15 && r * c <= 1 << 23);
        for (rows, cols) in std::iter::once((330, 160)).chain(built) {
            shapes += 1;
            let o = Owned::random(&mut rng, format, rows, cols);
            let m = o.matrix();
            for odd in [None, Some(300.0), Some(1e-35)] {
                let mut x = rng.activations(cols);
                if let Some(v) = odd {
                    x[cols / 3] = v;
                }
                let want = (rows == 330).then(|| reference::matvec(&m, &x));
                for k in &ks {
                    for (kind, kern) in kernels_for(k, &o) {
                        let what = format!("{} {format} {kind} {rows}x{cols} {odd:?}", k.isa());
                        let generic = k.mat_kernel_generic(format);
                        assert_eq!(
                            kern.prepared.is_some(),
                            generic.prepared.is_some(),
                            "{what}"
                        );
                        let mut y = vec![f32::NAN; rows];
                        pool.install(|| k.matvec_with(kern, &m, &x, &mut y))
                            .unwrap();
                        let mut plain = vec![f32::NAN; rows];
                        k.matvec_rows_with(kern, &m, &x, &mut plain, 0, rows)
                            .unwrap();
                        assert!(
                            first_diff(&y, &plain).is_none(),
                            "{what}: prepared ≠ per call"
                        );
                        if let Some(want) = &want {
                            assert!(first_diff(&y, want).is_none(), "{what}: ≠ reference");
                        }
                    }
                }
            }
        }
    }
    eprintln!("prepared x: {shapes} shapes");
}

/// y, computed for rows r0..r1 only into a buffer of NaNs: those rows are
/// `want`'s bits, and no other row was written.
fn check_rows(what: &str, y: &[f32], want: &[f32], r0: usize, r1: usize) {
    for r in r0..r1 {
        assert!(
            common::same(y[r], want[r]),
            "{what} rows {r0}..{r1}: row {r}: kernel {:e}, reference {:e}",
            y[r],
            want[r]
        );
    }
    let outside = (0..r0).chain(r1..y.len()).find(|&r| !y[r].is_nan());
    assert!(
        outside.is_none(),
        "{what} rows {r0}..{r1} wrote row {outside:?}"
    );
}

/// Every specialised shape of this build. Shapes up to 1M weights are checked
/// whole; bigger ones on row ranges at the start, an unaligned middle and the
/// end (the rest of the buffer stays zero and untouched by the kernel).
#[test]
fn specialised_kernels_match_reference_on_build_shapes() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(3);
    let mut report = Vec::new();
    for format in FORMATS {
        for (rows, cols) in specialised_shapes(format) {
            if rows * cols <= 1 << 20 {
                check_full(&ks, &mut rng, format, rows, cols, &[1, 3, 4]);
                report.push(format!("{format} {rows}x{cols} (whole)"));
                continue;
            }
            let mut o = Owned::random(&mut rng, format, 1, cols);
            let row = |o: &Owned| (o.f.clone(), o.h.clone(), o.b.clone(), o.s.clone());
            let (f1, h1, b1, s1) = row(&o);
            // Tile one random row over the whole matrix: cheap to build, and
            // every row still gets its own scales below.
            o.rows = rows;
            o.f = f1.repeat(rows.min(if f1.is_empty() { 0 } else { rows }));
            o.h = h1.repeat(if h1.is_empty() { 0 } else { rows });
            o.b = b1.repeat(if b1.is_empty() { 0 } else { rows });
            let _ = s1;
            if let Some((sr, sc)) = format.scale_shape(rows, cols) {
                o.s = (0..sr * sc).map(|_| rng.scale_byte_of(sc)).collect();
            }
            let m = o.matrix();
            let x = rng.activations(cols);
            let mid = rows / 2 + 7;
            let ranges = [(0, 9), (mid, (mid + 21).min(rows)), (rows - 5, rows)];
            let wants: Vec<f32> = ranges
                .iter()
                .flat_map(|&(r0, r1)| r0..r1)
                .map(|r| reference::row_dot(&m, r, &x))
                .collect();
            note_finite(&format!("{format} {rows}x{cols} row ranges"), &wants, cols);
            for k in &ks {
                let kern = k
                    .mat_kernel_specialised(format, rows, cols)
                    .expect("specialised kernel of the build");
                let generic = k.mat_kernel_generic(format);
                for (r0, r1) in ranges {
                    for kk in [kern, generic] {
                        let mut y = vec![0f32; rows];
                        k.matvec_rows_with(kk, &m, &x, &mut y, r0, r1).unwrap();
                        for (r, &got) in y.iter().enumerate().take(r1).skip(r0) {
                            let want = reference::row_dot(&m, r, &x);
                            assert!(
                                common::same(got, want),
                                "{} {format} {rows}x{cols} row {r}: {got} vs reference {want}",
                                k.isa(),
                            );
                        }
                    }
                }
            }
            report.push(format!("{format} {rows}x{cols} (row ranges)"));
        }
    }
    eprintln!("specialised shapes checked: {}", report.join(", "));
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(4);
    for format in FORMATS {
        let (rows, cols) = (300, 256);
        let o = Owned::random(&mut rng, format, rows, cols);
        let m = o.matrix();
        let xs = rng.activations(3 * cols);
        let want = reference::matmul(&m, &xs, 3);
        note_finite(&format!("{format} {rows}x{cols}"), &want, cols);
        for k in &ks {
            for threads in [1, 2, 3] {
                let pool = bespoke::threads::pool(threads);
                let mut y = vec![0f32; 3 * rows];
                pool.install(|| k.matmul(&m, &xs, 3, &mut y)).unwrap();
                assert!(
                    first_diff(&y, &want).is_none(),
                    "{} {format} with {threads} threads",
                    k.isa()
                );
                // One token: the threads share the rows in 16-row chunks
                // taken in turn (the last one short: 300 = 18 * 16 + 12).
                let mut y1 = vec![0f32; rows];
                pool.install(|| k.matvec(&m, &xs[..cols], &mut y1)).unwrap();
                assert!(
                    first_diff(&y1, &want[..rows]).is_none(),
                    "{} {format} matvec with {threads} threads",
                    k.isa()
                );
            }
        }
        // Enough rows for whole chunks and the quarter chunks of the end
        // (2 threads: 14 chunks of 128 rows, then 10 of 32, the last 20).
        let (rows, cols) = (2100, 32);
        let o = Owned::random(&mut rng, format, rows, cols);
        let m = o.matrix();
        let x = rng.activations(cols);
        let want = reference::matmul(&m, &x, 1);
        for k in &ks {
            for threads in [2, 3] {
                let mut y = vec![0f32; rows];
                bespoke::threads::pool(threads)
                    .install(|| k.matvec(&m, &x, &mut y))
                    .unwrap();
                assert!(
                    first_diff(&y, &want).is_none(),
                    "{} {format} {rows}x{cols} matvec with {threads} threads",
                    k.isa()
                );
            }
        }
    }
}

struct AttnCase {
    hd: usize,
    h: usize,
    kv: usize,
    t: usize,
    window: usize,
    sinks: bool,
    stride_pad: usize,
    /// KV-head-major (the Llama engine's cache: each KV head's rows one
    /// after another, room for more positions than t) instead of
    /// position-major (every KV head of a position in one row).
    head_major: bool,
}

fn check_attn(ks: &[Kernels], rng: &mut Rng, c: &AttnCase, specialised_expected: bool) {
    let (stride, head_stride, len) = if c.head_major {
        let stride = c.hd + c.stride_pad;
        let head_stride = (c.t + 2) * stride;
        (stride, head_stride, c.kv * head_stride)
    } else {
        let stride = c.kv * c.hd + c.stride_pad;
        (stride, c.hd, c.t * stride)
    };
    let q: Vec<f32> = (0..c.h * c.hd).map(|_| rng.unit() * 2.0).collect();
    let kbuf: Vec<f32> = (0..len).map(|_| rng.unit() * 2.0).collect();
    let vbuf: Vec<f32> = (0..len).map(|_| rng.activation()).collect();
    let sinks: Vec<f32> = (0..c.h).map(|_| rng.unit() * 3.0).collect();
    let scale = 1.0 / (c.hd as f32).sqrt();
    let a = AttnArgs {
        q: &q,
        k: &kbuf,
        v: &vbuf,
        sinks: c.sinks.then_some(&sinks[..]),
        n_heads: c.h,
        n_kv_heads: c.kv,
        head_dim: c.hd,
        kv_stride: stride,
        kv_head_stride: head_stride,
        t_len: c.t,
        window: c.window,
        scale,
    };
    let want = reference::attn_decode(&a);
    for k in ks {
        let shape = bespoke::plan::AttnShape {
            head_dim: c.hd,
            n_heads: c.h,
            n_kv_heads: c.kv,
        };
        let chosen = k.attn_kernel(shape);
        assert_eq!(
            chosen.shape.is_some(),
            specialised_expected,
            "specialised attention kernel for {shape:?}"
        );
        let generic = ATTN_KERNELS
            .iter()
            .find(|x| x.isa == k.isa() && x.shape.is_none())
            .unwrap();
        for kern in [chosen, generic] {
            let mut out = vec![f32::NAN; c.h * c.hd];
            k.attn_decode_with(kern, &a, &mut out).unwrap();
            if let Some((i, x, y)) = first_diff(&out, &want) {
                panic!(
                    "{} attention hd={} h={} kv={} t={} window={} sinks={} head_major={}: element {i}: kernel {x:e}, reference {y:e}",
                    k.isa(), c.hd, c.h, c.kv, c.t, c.window, c.sinks, c.head_major
                );
            }
        }
    }
}

#[test]
fn attention_matches_reference() {
    let ks = runnable();
    let mut rng = Rng(5);
    let specialised = |hd, h, kv| {
        ATTN_KERNELS.iter().any(|x| {
            x.shape
                == Some(bespoke::plan::AttnShape {
                    head_dim: hd,
                    n_heads: h,
                    n_kv_heads: kv,
                })
        })
    };
    // Awkward shapes through the generic kernel.
    // Groups of 1, 2, 3, 4, 6 and 8 query heads per KV head: the kernels
    // take up to 4 heads of a group at a time, then 2, then 1.
    for &(hd, h, kv) in &[
        (1, 1, 1),
        (16, 8, 8),
        (33, 6, 3),
        (64, 4, 1),
        (80, 2, 2),
        (40, 9, 3),
        (24, 12, 2),
        (16, 16, 2),
        // AVX-512 takes groups of 2 and 4 heads 16 (head, key) pairs at a
        // time where head_dim is a multiple of 16: 2 and 6 per KV head.
        (32, 6, 3),
        (48, 12, 2),
        // AVX-512 takes the values 64 columns a pass, then 16, then one
        // at a time: 64 + 16 + 16 + 16, and 64 + 8.
        (112, 4, 2),
        (72, 2, 1),
    ] {
        for &t in &[1, 5, 16, 17, 100] {
            for &(window, sinks) in &[(0, false), (7, false), (0, true), (40, true)] {
                for head_major in [false, true] {
                    let c = AttnCase {
                        hd,
                        h,
                        kv,
                        t,
                        window,
                        sinks,
                        stride_pad: 3,
                        head_major,
                    };
                    check_attn(&ks, &mut rng, &c, specialised(hd, h, kv));
                }
            }
        }
    }
    // Long caches (values past 256 KiB a KV head), a window that starts
    // far into the cache, and head_dim 512.
    for &(hd, h, kv, t, window) in &[
        (64, 8, 2, 1100, 0),
        (48, 6, 3, 1400, 0),
        (40, 4, 1, 1700, 1650),
        (512, 4, 1, 150, 0),
        // More than 4 heads over a KV head and more than one block of 128
        // positions: every batch of heads takes a block of keys, then of
        // values, the sums carried from block to block (a partial last
        // block; 129 positions: one of 1; a window of 170; head_dim 72's
        // last 8 columns; groups of 5, 6, 8 and 64).
        (64, 16, 2, 300, 0),
        (512, 64, 1, 200, 0),
        (80, 6, 1, 400, 170),
        (72, 10, 2, 129, 0),
        (48, 12, 2, 1000, 0),
    ] {
        for head_major in [false, true] {
            let c = AttnCase {
                hd,
                h,
                kv,
                t,
                window,
                sinks: head_major,
                stride_pad: 1,
                head_major,
            };
            check_attn(&ks, &mut rng, &c, specialised(hd, h, kv));
        }
    }
    // 12 heads over 2 KV heads shared among threads: 3 threads (4 heads
    // each), so that a thread's range starts and ends inside a KV head's
    // group of 6; 2 threads, each with a whole group, taken a block of
    // positions at a time.
    for (threads, cases) in [
        (3, [(100, 0, false, false), (120, 50, true, true)]),
        (2, [(300, 0, true, false), (400, 200, false, true)]),
    ] {
        bespoke::threads::pool(threads).install(|| {
            for &(t, window, sinks, head_major) in &cases {
                let c = AttnCase {
                    hd: 64,
                    h: 12,
                    kv: 2,
                    t,
                    window,
                    sinks,
                    stride_pad: 1,
                    head_major,
                };
                check_attn(&ks, &mut rng, &c, specialised(64, 12, 2));
            }
        });
    }
    // The build's specialised shapes.
    let mut shapes: Vec<_> = ATTN_KERNELS.iter().filter_map(|x| x.shape).collect();
    shapes.sort();
    shapes.dedup();
    for s in shapes {
        for &(t, window, sinks) in &[(1, 0, false), (37, 0, true), (150, 128, true)] {
            let c = AttnCase {
                hd: s.head_dim,
                h: s.n_heads,
                kv: s.n_kv_heads,
                t,
                window,
                sinks,
                stride_pad: 0,
                // The engines' layouts: Llama's cache is KV-head-major,
                // DeepSeek V4's single KV head is both.
                head_major: true,
            };
            check_attn(&ks, &mut rng, &c, true);
        }
    }
}

/// Scores that are zeros (of scale's sign), infinite or NaN, and sinks of
/// ±0, NaN and -inf: the maximum meets the scores in another order in some
/// kernels than in the reference (AVX-512's blocks of 16 pairs), which must
/// not show in a single bit.
#[test]
fn attention_edge_values() {
    let ks = runnable();
    for &(hd, h, kv) in &[(64, 4, 1), (32, 4, 2), (48, 12, 2), (16, 3, 1)] {
        for &t in &[3usize, 16, 37] {
            let stride = kv * hd;
            let mut rng = Rng(11 + t as u64);
            let mut q: Vec<f32> = (0..h * hd).map(|_| rng.unit()).collect();
            // Head 0: a zero query (every score +0, or -0 once scaled by -1
            // below); head 1: one infinite component.
            q[..hd].iter_mut().for_each(|x| *x = 0.0);
            q[hd + 5] = f32::INFINITY;
            let mut kbuf: Vec<f32> = (0..t * stride).map(|_| rng.unit()).collect();
            let vbuf: Vec<f32> = (0..t * stride).map(|_| rng.activation()).collect();
            if t > 2 {
                kbuf[2 * stride + 1] = f32::NAN;
            }
            kbuf[stride - 1] = -0.0;
            let sinks: Vec<f32> = (0..h)
                .map(|i| [-0.0, f32::NAN, 0.0, f32::NEG_INFINITY][i % 4])
                .collect();
            for &scale in &[0.125f32, -1.0] {
                for use_sinks in [false, true] {
                    let a = AttnArgs {
                        q: &q,
                        k: &kbuf,
                        v: &vbuf,
                        sinks: use_sinks.then_some(&sinks[..]),
                        n_heads: h,
                        n_kv_heads: kv,
                        head_dim: hd,
                        kv_stride: stride,
                        kv_head_stride: hd,
                        t_len: t,
                        window: 0,
                        scale,
                    };
                    let want = reference::attn_decode(&a);
                    for k in &ks {
                        let generic = ATTN_KERNELS
                            .iter()
                            .find(|x| x.isa == k.isa() && x.shape.is_none())
                            .unwrap();
                        let mut out = vec![f32::NAN; h * hd];
                        k.attn_decode_with(generic, &a, &mut out).unwrap();
                        if let Some((i, x, y)) = first_diff(&out, &want) {
                            panic!(
                                "{} attention hd={hd} h={h} kv={kv} t={t} scale={scale} sinks={use_sinks}: element {i}: kernel {x:e}, reference {y:e}",
                                k.isa()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn softmax_exp_is_accurate() {
    // The kernels' exp is a defined operation sequence; check it is also a
    // good exp (a few ulp) over the softmax domain.
    let mut worst = 0f64;
    let mut x = -87.0f32;
    while x <= 0.0 {
        let got = reference::exp(x) as f64;
        let want = (x as f64).exp();
        worst = worst.max(((got - want) / want).abs());
        x += 0.0137;
    }
    assert!(worst < 4e-7, "relative error {worst:e}");
    assert_eq!(reference::exp(-100.0), 0.0);
    assert_eq!(reference::exp(f32::NEG_INFINITY), 0.0);
    assert!(reference::exp(f32::NAN).is_nan());
}

#[test]
fn shape_and_length_errors_are_clear() {
    let w = vec![0f32; 12];
    let e = Matrix::new(3, 5, Weights::F32(&w))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("expected 15") && e.contains("found 12"), "{e}");
    let b = vec![0u8; 48];
    let e = Matrix::new(3, 33, Weights::Fp4 { w: &b, scale: &b })
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("32-column"), "{e}");
    let s = vec![0u8; 2];
    let e = Matrix::new(
        3,
        32,
        Weights::Fp4 {
            w: &b[..48],
            scale: &s,
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("fp4"), "{e}");
    let m = Matrix::new(3, 4, Weights::F32(&w)).unwrap();
    let k = Kernels::best();
    let mut y = vec![0f32; 3];
    let e = k.matvec(&m, &[1.0; 5], &mut y).err().unwrap().to_string();
    assert!(e.contains("input x") && e.contains("expected 4"), "{e}");
    let e = k
        .matmul(&m, &[1.0; 8], 2, &mut y)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("output Y"), "{e}");
}

/// fp4×q8 of one matrix on every variant, generic and specialised, against
/// its own Rust reference, bit for bit; returns the outputs.
fn check_q8(ks: &[Kernels], o: &Owned, x: &[f32]) -> Vec<f32> {
    let (rows, cols) = (o.rows, o.cols);
    let m = o.matrix();
    let a = Q8Act::quantize(x).unwrap();
    let want: Vec<f32> = (0..rows)
        .map(|r| reference::q8_row_dot(&m, r, &a).unwrap())
        .collect();
    for k in ks {
        let mut kernels = vec![("generic", k.q8_kernel_generic())];
        if let Some(s) = k.q8_kernel_specialised(rows, cols) {
            kernels.push(("specialised", s));
        }
        for (kind, kern) in kernels {
            let mut y = vec![f32::NAN; rows];
            k.matvec_q8_with(kern, &m, &a, &mut y).unwrap();
            if let Some((i, p, q)) = first_diff(&y, &want) {
                panic!("{} fp4×q8 {kind} {rows}x{cols}: row {i}: kernel {p:e} ({:#x}), reference {q:e} ({:#x})", k.isa(), p.to_bits(), q.to_bits());
            }
        }
        // The engine path (Kernels with FP4 activations as q8) is the same,
        // and its matmul is token by token.
        let kq = k.with_fp4_act(Fp4Act::Q8).unwrap();
        let mut y = vec![f32::NAN; rows];
        kq.matvec(&m, x, &mut y).unwrap();
        assert!(
            first_diff(&y, &want).is_none(),
            "{} fp4×q8 via matvec",
            k.isa()
        );
        let xs: Vec<f32> = x.iter().chain(x.iter().rev()).copied().collect();
        let mut ys = vec![f32::NAN; 2 * rows];
        kq.matmul(&m, &xs, 2, &mut ys).unwrap();
        let a2 = Q8Act::quantize(&xs[cols..]).unwrap();
        let want2: Vec<f32> = (0..rows)
            .map(|r| reference::q8_row_dot(&m, r, &a2).unwrap())
            .collect();
        assert!(
            first_diff(&ys[..rows], &want).is_none() && first_diff(&ys[rows..], &want2).is_none(),
            "{} fp4×q8 via matmul",
            k.isa()
        );
    }
    want
}

#[test]
fn fp4_q8_matches_its_reference() {
    let _tally = FiniteTally::start();
    let ks = runnable();
    let mut rng = Rng(11);
    let mut shapes = awkward_shapes(Format::Fp4);
    // 8-block groups: exact, with a tail of 1 and of 7 blocks; AVX-512's
    // 16-block steps: exact, with one 8-block step, with both and a tail
    shapes.extend([(3, 256), (4, 288), (5, 480), (1, 32 * 17)]);
    shapes.extend([(2, 512), (3, 768), (2, 32 * 27), (3, 32 * 41)]);
    // rows past the widest that AVX-512 regroups x for (32768 columns; its
    // other path) and the widest it does
    shapes.extend([(2, 32768 + 32 * 9), (2, 32768)]);
    shapes.extend(specialised_shapes(Format::Fp4));
    for &(rows, cols) in &shapes {
        let o = Owned::random(&mut rng, Format::Fp4, rows, cols);
        // Every kind of finite activation (zeros, -0, subnormals, 1e30,
        // f32::MAX): most rows finite (a NaN scale byte makes its row NaN),
        // so the bits compared are real sums.
        let mut x = rng.activations(cols);
        let y = check_q8(&ks, &o, &x);
        note_finite(&format!("fp4×q8 {rows}x{cols}"), &y, cols);
        // Then a block holding an infinity and one holding a NaN: every
        // output NaN.
        if cols >= 96 {
            x[40] = f32::INFINITY;
            x[cols - 1] = f32::NAN;
            let y = check_q8(&ks, &o, &x);
            assert!(
                y.iter().all(|v| v.is_nan()),
                "a NaN activation block makes every output NaN"
            );
        }
    }
    let names: Vec<String> = Q8_KERNELS
        .iter()
        .map(|k| {
            format!(
                "{}{}",
                k.isa,
                k.shape
                    .map(|(r, c)| format!(" {r}x{c}"))
                    .unwrap_or_default()
            )
        })
        .collect();
    eprintln!("fp4×q8 kernels checked: {}", names.join(", "));
}

/// The fp4×q8 kernels take their rows several at a time, one from each part
/// of the range they are given (IsaDesc::q8_rows), the rest one by one: on
/// ranges that start past 0, that do and do not split evenly and that are
/// shorter than one row per part, every row of the range is its reference's
/// bits and no row outside it is written.
#[test]
fn fp4_q8_row_ranges() {
    let ks = runnable();
    let mut rng = Rng(13);
    // 8-block steps with a tail (AVX2, scalar), 16-block steps with an
    // 8-block step and a tail (AVX-512), and a whole 16-block row
    for (rows, cols) in [(141, 32 * 11), (67, 32 * 27), (40, 512)] {
        let o = Owned::random(&mut rng, Format::Fp4, rows, cols);
        let m = o.matrix();
        let x = rng.activations(cols);
        let a = Q8Act::quantize(&x).unwrap();
        let want: Vec<f32> = (0..rows)
            .map(|r| reference::q8_row_dot(&m, r, &a).unwrap())
            .collect();
        let ranges = [
            (0, rows),
            (3, rows - 2),
            (5, 6),
            (9, 12),
            (2, 7),
            (11, 11 + 4 * 6 + 3),
        ];
        for k in &ks {
            let kern = k.q8_kernel_generic();
            for &(r0, r1) in &ranges {
                let mut y = vec![f32::NAN; rows];
                k.matvec_q8_rows_with(kern, &m, &a, &mut y, r0, r1).unwrap();
                check_rows(
                    &format!("{} fp4×q8 {rows}x{cols}", k.isa()),
                    &y,
                    &want,
                    r0,
                    r1,
                );
            }
            let mut y = vec![f32::NAN; rows];
            let e = k
                .matvec_q8_rows_with(kern, &m, &a, &mut y, 4, rows + 1)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("rows 4..{} of a {rows}-row matrix", rows + 1)),
                "{e}"
            );
        }
    }
}

/// The fp4×q8 variant stays within its stated error bound of the f32 kernels
/// (finite, moderate scales; activations like a hidden state).
#[test]
fn fp4_q8_error_bound() {
    let ks = runnable();
    let mut rng = Rng(12);
    let mut worst = 0.0f64;
    for &(rows, cols) in &[(64, 2048), (37, 96), (16, 4096)] {
        let mut o = Owned::random(&mut rng, Format::Fp4, rows, cols);
        o.s = o.s.iter().map(|_| 120 + rng.below(12) as u8).collect();
        let m = o.matrix();
        let x: Vec<f32> = (0..cols).map(|_| rng.unit() * 3.0).collect();
        let a = Q8Act::quantize(&x).unwrap();
        let exact = reference::matvec(&m, &x);
        for k in &ks {
            let mut y = vec![0f32; rows];
            k.with_fp4_act(Fp4Act::Q8)
                .unwrap()
                .matvec(&m, &x, &mut y)
                .unwrap();
            for r in 0..rows {
                let w_row: Vec<f32> = (0..cols)
                    .map(|c| {
                        reference::weight(&m, r, c)
                            * formats::e8m0_to_f32(o.s[r * (cols / 32) + c / 32])
                    })
                    .collect();
                let bound = a.error_bound(&w_row, &x);
                let err = (y[r] as f64 - exact[r] as f64).abs();
                assert!(
                    err <= bound,
                    "{} {rows}x{cols} row {r}: |{} - {}| = {err:e} > bound {bound:e}",
                    k.isa(),
                    y[r],
                    exact[r]
                );
                let mag: f64 = w_row
                    .iter()
                    .zip(&x)
                    .map(|(w, v)| (w * v).abs() as f64)
                    .sum();
                worst = worst.max(err / mag);
            }
        }
    }
    // A bound that is never approached would prove little: the rounding
    // of x must show (about 1/254 of a term's size, averaged down).
    assert!(worst > 1e-5, "fp4×q8 error suspiciously small: {worst:e}");
    eprintln!("fp4×q8: worst |y_q8 - y_f32| / sum|w x| = {worst:.2e}");
}

/// Whether the bf16dot kernels can run here; if not, says why, and fails
/// when BESPOKE_REQUIRE_VARIANTS names bf16dot.
fn bf16dot_runs() -> bool {
    match Kernels::bf16dot_available() {
        Ok(()) => {
            eprintln!("  bf16dot: RUN");
            true
        }
        Err(why) => {
            let required = std::env::var("BESPOKE_REQUIRE_VARIANTS")
                .is_ok_and(|v| v.split(',').any(|s| s.trim() == "bf16dot"));
            assert!(!required, "required variant bf16dot did not run: {why}");
            eprintln!("  bf16dot: NOT run here: {why}");
            false
        }
    }
}

/// Row r of a BF16 or FP8 matrix against one token's packed BF16
/// activations, by the bf16dot / fp8dot definition (src/bf16act.rs).
fn dot_reference(o: &Owned, r: usize, x: &[u16]) -> f32 {
    let cols = o.cols;
    match o.format {
        Format::Bf16 => bf16act::row_dot(&o.h[r * cols..(r + 1) * cols], x),
        Format::Fp8 => {
            let nb = cols.div_ceil(128);
            let srow = (r / 128) * nb;
            bf16act::fp8_row_dot(&o.b[r * cols..(r + 1) * cols], &o.s[srow..srow + nb], x)
        }
        f => panic!("no BF16-activation kernels for {f}"),
    }
}

/// bf16dot (BF16 weights) or fp8dot (FP8) of one matrix against n tokens,
/// generic and specialised, against its Rust definition bit for bit (NaN =
/// NaN); also through the engine's path (matvec and matmul with BF16
/// activations). Returns the outputs.
fn check_bf16dot(o: &Owned, x: &[f32], n: usize) -> Vec<f32> {
    let (rows, cols, format) = (o.rows, o.cols, o.format);
    let family = bespoke::plan::dot_family(format);
    let m = o.matrix();
    let a = Bf16X::pack(x, n, cols).unwrap();
    let xs = a.stride();
    let mut want = vec![0f32; n * rows];
    for j in 0..n {
        for r in 0..rows {
            want[j * rows + r] = dot_reference(o, r, &a.bits()[j * xs..(j + 1) * xs]);
        }
    }
    let k = Kernels::best();
    let mut kernels = vec![("generic", Kernels::bf16dot_kernel_generic(format).unwrap())];
    if let Some(s) = Kernels::bf16dot_kernel_specialised(format, rows, cols) {
        kernels.push(("specialised", s));
    }
    for (kind, kern) in kernels {
        let mut y = vec![f32::NAN; n * rows];
        k.matmul_bf16dot_with(kern, &m, &a, &mut y).unwrap();
        if let Some((i, p, q)) = first_diff(&y, &want) {
            panic!(
                "{family} {kind} {rows}x{cols} n={n}: token {} row {}: kernel {p:e} ({:#x}), reference {q:e} ({:#x})",
                i / rows,
                i % rows,
                p.to_bits(),
                q.to_bits()
            );
        }
    }
    let kb = match format {
        Format::Fp8 => k.with_fp8_act(Bf16Act::Bf16),
        _ => k.with_bf16_act(Bf16Act::Bf16),
    }
    .unwrap();
    let mut y = vec![f32::NAN; n * rows];
    kb.matmul(&m, x, n, &mut y).unwrap();
    assert!(first_diff(&y, &want).is_none(), "{family} via matmul");
    let mut y1 = vec![f32::NAN; rows];
    kb.matvec(&m, &x[..cols], &mut y1).unwrap();
    assert!(
        first_diff(&y1, &want[..rows]).is_none(),
        "{family} via matvec"
    );
    want
}

/// A matrix whose every row is the same: rows r0..r1 (the start, an
/// unaligned middle `len` rows long, the end) of all tokens, through
/// `run(kernel, y, r0, r1)` with each kernel, equal `wants` (one per token).
fn check_row_ranges<K: Copy>(
    name: &str,
    rows: usize,
    cols: usize,
    wants: &[f32],
    kernels: &[K],
    len: usize,
    mut run: impl FnMut(K, &mut [f32], usize, usize),
) {
    let mid = rows / 2 + 7;
    for (r0, r1) in [(0, 9), (mid, (mid + len).min(rows)), (rows - 5, rows)] {
        for &kern in kernels {
            let mut y = vec![0f32; wants.len() * rows];
            run(kern, &mut y, r0, r1);
            for (j, want) in wants.iter().enumerate() {
                for r in r0..r1 {
                    assert!(
                        common::same(y[j * rows + r], *want),
                        "{name} {rows}x{cols} token {j} row {r}: {} vs reference {want}",
                        y[j * rows + r]
                    );
                }
            }
        }
    }
}

/// The bf16dot (BF16) or fp8dot (FP8) kernels on big specialised shapes:
/// one random row (and, FP8, its scales) tiled over the matrix, n tokens;
/// row ranges at the start, an unaligned middle and the end, specialised and
/// generic, against the definition.
fn dot_tiled_rows(rng: &mut Rng, format: Format, shapes: &[(usize, usize)], n: usize) {
    let k = Kernels::best();
    let family = bespoke::plan::dot_family(format);
    for &(rows, cols) in shapes {
        let one = Owned::random(rng, format, 1, cols);
        let (h, b) = (one.h.repeat(rows), one.b.repeat(rows));
        let s = one.s.repeat(rows.div_ceil(128));
        let w = match format {
            Format::Bf16 => Weights::Bf16(&h),
            _ => Weights::Fp8 { w: &b, scale: &s },
        };
        let m = Matrix::new(rows, cols, w).unwrap();
        let x = rng.activations(n * cols);
        let a = Bf16X::pack(&x, n, cols).unwrap();
        let xs = a.stride();
        let wants: Vec<f32> = (0..n)
            .map(|j| dot_reference(&one, 0, &a.bits()[j * xs..(j + 1) * xs]))
            .collect();
        note_finite(&format!("{family} {rows}x{cols} tiled row"), &wants, cols);
        let kernels = [
            Kernels::bf16dot_kernel_specialised(format, rows, cols).unwrap(),
            Kernels::bf16dot_kernel_generic(format).unwrap(),
        ];
        check_row_ranges(
            family,
            rows,
            cols,
            &wants,
            &kernels,
            21,
            |kern, y, r0, r1| k.matmul_bf16dot_rows_with(kern, &m, &a, y, r0, r1).unwrap(),
        );
    }
    let names: Vec<String> = BF16DOT_KERNELS
        .iter()
        .filter(|k| k.format == format)
        .map(|k| {
            k.shape
                .map(|(r, c)| format!("{r}x{c}"))
                .unwrap_or_else(|| "generic".into())
        })
        .collect();
    eprintln!("{family} kernels checked: {}", names.join(", "));
}

#[test]
fn bf16dot_matches_its_reference() {
    let _tally = FiniteTally::start();
    if !bf16dot_runs() {
        return;
    }
    let mut rng = Rng(13);
    let mut shapes = awkward_shapes(Format::Bf16);
    // whole chunks, a tail of 1 and of 31 columns; row tiles of 4 with 1-3
    // rows left; rows past one 128 KiB block
    shapes.extend([
        (4, 32),
        (7, 33),
        (6, 63),
        (2, 4096 + 31),
        (70, 1024),
        (5, 1056),
        (13, 2111),
        (300, 1056),
    ]);
    let (small, big): (Vec<_>, Vec<_>) = specialised_shapes(Format::Bf16)
        .into_iter()
        .partition(|&(r, c)| r * c <= 1 << 20);
    shapes.extend(small);
    // every kind of activation (zeros, -0, subnormals, 1e30, f32::MAX) and,
    // at 5 tokens, an infinity and a NaN
    random_sweep(
        &mut rng,
        Format::Bf16,
        &shapes,
        &[1, 5, 6, 13],
        5,
        "bf16dot",
        check_bf16dot,
    );
    dot_tiled_rows(&mut rng, Format::Bf16, &big, 7);
    // The flushing and the order of each pair, which random data rarely
    // shows, on the CPU's own instruction.
    let (w, x) = bf16act::edge_rows();
    let o = Owned {
        rows: 2,
        cols: 64,
        format: Format::Bf16,
        f: vec![],
        h: w,
        b: vec![],
        s: vec![],
        scanned: false,
    };
    let y = check_bf16dot(&o, &x, 2);
    assert_eq!((y[0], y[3]), (f32::MIN_POSITIVE, 1.0));
}

/// The bf16dot variant stays within its stated error bound of the exact
/// products (moderate values, like a hidden state), and the rounding shows.
#[test]
fn bf16dot_error_bound() {
    if !bf16dot_runs() {
        return;
    }
    let k = Kernels::best().with_bf16_act(Bf16Act::Bf16).unwrap();
    let shapes = [(64, 2048, 3), (37, 96, 7), (16, 4096, 1)];
    check_error_bound(&k, Rng(14), &shapes, "bf16dot", bf16act::error_bound);
}

/// A BF16-activation variant's products (through `k`) on random BF16
/// matrices and moderate activations, like a hidden state: every output
/// within `bound` of the exact product, and the rounding shows.
fn check_error_bound(
    k: &Kernels,
    mut rng: Rng,
    shapes: &[(usize, usize, usize)],
    name: &str,
    bound: fn(&[u16], &[f32]) -> f64,
) {
    let mut worst = 0.0f64;
    for &(rows, cols, n) in shapes {
        let w: Vec<u16> = (0..rows * cols)
            .map(|_| bespoke::formats::f32_to_bf16(rng.unit() * 0.1))
            .collect();
        let m = Matrix::new(rows, cols, Weights::Bf16(&w)).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit() * 3.0).collect();
        let mut y = vec![0f32; n * rows];
        k.matmul(&m, &x, n, &mut y).unwrap();
        for j in 0..n {
            let xt = &x[j * cols..(j + 1) * cols];
            for r in 0..rows {
                let wr = &w[r * cols..(r + 1) * cols];
                let exact: f64 = wr
                    .iter()
                    .zip(xt)
                    .map(|(&h, &v)| bespoke::formats::bf16_to_f32(h) as f64 * v as f64)
                    .sum();
                let b = bound(wr, xt);
                let err = (y[j * rows + r] as f64 - exact).abs();
                assert!(
                    err <= b,
                    "{name} {rows}x{cols} token {j} row {r}: |{} - {exact}| = {err:e} > bound {b:e}",
                    y[j * rows + r]
                );
                let mag: f64 = wr
                    .iter()
                    .zip(xt)
                    .map(|(&h, &v)| (bespoke::formats::bf16_to_f32(h) as f64 * v as f64).abs())
                    .sum();
                worst = worst.max(err / mag);
            }
        }
    }
    // The rounding of x (up to 2^-9 of each term) must show.
    assert!(worst > 1e-5, "{name} error suspiciously small: {worst:e}");
    eprintln!("{name}: worst |y_{name} - y_exact| / sum|w x| = {worst:.2e}");
}

/// Random `format` matrices of every shape against every token count in
/// `ns`, through `check` (which holds the kernels to their definition and
/// returns the outputs); at `planted` tokens, on rows of 96 columns or
/// more, token 1 holds an infinity and a NaN, and all its outputs are NaN.
fn random_sweep(
    rng: &mut Rng,
    format: Format,
    shapes: &[(usize, usize)],
    ns: &[usize],
    planted: usize,
    name: &str,
    check: fn(&Owned, &[f32], usize) -> Vec<f32>,
) {
    for &(rows, cols) in shapes {
        let o = Owned::random(rng, format, rows, cols);
        for &n in ns {
            let mut x = rng.activations(n * cols);
            let plant = cols >= 96 && n == planted;
            if plant {
                x[cols + 40] = f32::INFINITY;
                x[2 * cols - 1] = f32::NAN;
            }
            let y = check(&o, &x, n);
            note_finite(
                &format!("{name} {rows}x{cols} n={n} token 0"),
                &y[..rows],
                cols,
            );
            if plant {
                assert!(y[rows..2 * rows].iter().all(|v| v.is_nan()));
            }
        }
    }
}

/// Whether the amx kernels can run here; if not, says why, and fails when
/// BESPOKE_REQUIRE_VARIANTS names amx.
fn amx_runs() -> bool {
    match Kernels::amx_available() {
        Ok(()) => {
            eprintln!("  amx: RUN");
            true
        }
        Err(why) => {
            let required = std::env::var("BESPOKE_REQUIRE_VARIANTS")
                .is_ok_and(|v| v.split(',').any(|s| s.trim() == "amx"));
            assert!(!required, "required variant amx did not run: {why}");
            eprintln!("  amx: NOT run here: {why}");
            false
        }
    }
}

/// The amx definition of Y = W X for a BF16 matrix (row-major `h`) and n
/// tokens, from the rounded activations.
fn amx_want(h: &[u16], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
    let a = Bf16X::pack(x, n, cols).unwrap();
    let xs = a.stride();
    let mut want = vec![0f32; n * rows];
    for j in 0..n {
        for r in 0..rows {
            want[j * rows + r] = bf16act::amx_row_dot(
                &h[r * cols..(r + 1) * cols],
                &a.bits()[j * xs..(j + 1) * xs],
            );
        }
    }
    want
}

/// The BF16 values the amx kernels multiply for a BF16, FP8 or FP4 matrix
/// (row-major): BF16 as stored, FP8 and FP4 as `bf16act::amx_fp8_weight`
/// and `amx_fp4_weight` define.
fn amx_weights(o: &Owned) -> Vec<u16> {
    match o.format {
        Format::Fp8 => {
            let sc = o.cols.div_ceil(128);
            (0..o.rows * o.cols)
                .map(|i| {
                    let (r, c) = (i / o.cols, i % o.cols);
                    bf16act::amx_fp8_weight(o.b[i], o.s[(r / 128) * sc + c / 128])
                })
                .collect()
        }
        Format::Fp4 => (0..o.rows * o.cols)
            .map(|i| {
                let (r, c) = (i / o.cols, i % o.cols);
                let b = o.b[i / 2];
                let code = if c % 2 == 1 { b >> 4 } else { b & 0xF };
                bf16act::amx_fp4_weight(code, o.s[r * (o.cols / 32) + c / 32])
            })
            .collect(),
        _ => o.h.clone(),
    }
}

/// The amx kernels on one BF16, FP8 or FP4 matrix against n tokens,
/// generic and specialised, and through the engine's path (`--bf16-act
/// amx`: matmul of 8+ tokens on AMX; `--fp8-act amx`: of 4+; `--fp4-act
/// amx`: of 3+; fewer and matvec by the f32 kernels), against the
/// definition bit for bit (NaN = NaN). Returns the outputs.
fn check_amx(o: &Owned, x: &[f32], n: usize) -> Vec<f32> {
    let (rows, cols) = (o.rows, o.cols);
    let m = o.matrix();
    let want = amx_want(&amx_weights(o), rows, cols, x, n);
    let a = AmxX::pack(x, n, cols).unwrap();
    let k = Kernels::best();
    let f = o.format;
    let mut kernels = vec![("generic", Kernels::amx_kernel_generic(f).unwrap())];
    if let Some(s) = Kernels::amx_kernel_specialised(f, rows, cols) {
        kernels.push(("specialised", s));
    }
    for (kind, kern) in kernels {
        let mut y = vec![f32::NAN; n * rows];
        k.matmul_amx_with(kern, &m, &a, &mut y).unwrap();
        if let Some((i, p, q)) = first_diff(&y, &want) {
            panic!(
                "amx {kind} {rows}x{cols} n={n}: token {} row {}: kernel {p:e} ({:#x}), reference {q:e} ({:#x})",
                i / rows,
                i % rows,
                p.to_bits(),
                q.to_bits()
            );
        }
    }
    let (ka, min) = match f {
        Format::Fp4 => (
            k.with_fp4_act(Fp4Act::Amx).unwrap(),
            bf16act::AMX_FP4_MIN_TOKENS,
        ),
        Format::Fp8 => (
            k.with_fp8_act(Bf16Act::Amx).unwrap(),
            bf16act::AMX_FP8_MIN_TOKENS,
        ),
        _ => (
            k.with_bf16_act(Bf16Act::Amx).unwrap(),
            bf16act::AMX_MIN_TOKENS,
        ),
    };
    let mut y = vec![f32::NAN; n * rows];
    ka.matmul(&m, x, n, &mut y).unwrap();
    if n >= min {
        assert!(first_diff(&y, &want).is_none(), "amx via matmul");
    } else {
        let exact = reference::matmul(&m, x, n);
        assert!(first_diff(&y, &exact).is_none(), "amx: one token is f32");
    }
    let mut y1 = vec![f32::NAN; rows];
    ka.matvec(&m, &x[..cols], &mut y1).unwrap();
    let exact = reference::matvec(&m, &x[..cols]);
    assert!(first_diff(&y1, &exact).is_none(), "amx: matvec is f32");
    want
}

/// The big specialised amx shapes (BF16, FP8 or FP4): one random row tiled
/// over the matrix (FP8: its scale row over every 128-row block), against
/// n tokens, row ranges at the start, an unaligned middle and the end,
/// specialised and generic.
fn check_amx_big(rng: &mut Rng, f: Format, big: &[(usize, usize)], n: usize) {
    let k = Kernels::best();
    for &(rows, cols) in big {
        let one = Owned::random(rng, f, 1, cols);
        let tiled = Owned {
            rows,
            h: one.h.repeat(rows),
            b: one.b.repeat(rows),
            s: one.s.repeat(if f == Format::Fp8 {
                rows.div_ceil(128)
            } else {
                rows
            }),
            f: vec![],
            cols,
            format: f,
            scanned: false,
        };
        let m = tiled.matrix();
        let x = rng.activations(n * cols);
        let a = AmxX::pack(&x, n, cols).unwrap();
        let wants = amx_want(&amx_weights(&one), 1, cols, &x, n);
        note_finite(&format!("amx {f} {rows}x{cols} tiled row"), &wants, cols);
        let kernels = [
            Kernels::amx_kernel_specialised(f, rows, cols).unwrap(),
            Kernels::amx_kernel_generic(f).unwrap(),
        ];
        check_row_ranges(
            "amx",
            rows,
            cols,
            &wants,
            &kernels,
            41,
            |kern, y, r0, r1| k.matmul_amx_rows_with(kern, &m, &a, y, r0, r1).unwrap(),
        );
    }
}

#[test]
fn amx_matches_its_reference() {
    let _tally = FiniteTally::start();
    if !amx_runs() {
        return;
    }
    let mut rng = Rng(16);
    let mut shapes = awkward_shapes(Format::Bf16);
    // whole chunks, chunk tails of 1 and 31 columns, odd columns; row tiles
    // of 16 and 32 with rows left over (a partial tile after whole ones)
    shapes.extend([
        (16, 32),
        (17, 33),
        (32, 63),
        (33, 64),
        (47, 95),
        (64, 1024),
        (81, 2111),
        (2, 4096 + 31),
    ]);
    let (small, big): (Vec<_>, Vec<_>) = specialised_shapes(Format::Bf16)
        .into_iter()
        .partition(|&(r, c)| r * c <= 1 << 20);
    shapes.extend(small);
    // token groups of 16 in pairs, an odd group, partial groups
    let ns = [1, 2, 15, 16, 17, 33, 48];
    random_sweep(&mut rng, Format::Bf16, &shapes, &ns, 17, "amx", check_amx);
    // Several 32-row blocks per pass over the activations (a slab's
    // activations past 1 MiB: 16 token groups of 65 chunks), two slabs of
    // token groups (the second partial), rows left after the last block.
    let o = Owned::random(&mut rng, Format::Bf16, 200, 2080);
    let x = rng.activations(300 * 2080);
    let y = check_amx(&o, &x, 300);
    note_finite("amx 200x2080 n=300 token 0", &y[..200], 2080);
    // The big specialised shapes: one random row tiled over the matrix, row
    // ranges at the start, an unaligned middle and the end.
    check_amx_big(&mut rng, Format::Bf16, &big, 20);
    let names: Vec<String> = AMX_KERNELS
        .iter()
        .map(|k| {
            k.shape
                .map(|(r, c)| format!("{r}x{c}"))
                .unwrap_or_else(|| "generic".into())
        })
        .collect();
    eprintln!("amx kernels checked: {}", names.join(", "));
    // Signed zeros and flushing, which random data rarely shows, on the
    // CPU's own instruction: the amx definition keeps a flushed result's
    // sign, and each 32-column chunk's two chains meet before acc.
    let (w, x) = bf16act::amx_edge_rows();
    let o = Owned {
        rows: 4,
        cols: 64,
        format: Format::Bf16,
        f: vec![],
        h: w,
        b: vec![],
        s: vec![],
        scanned: false,
    };
    let y = check_amx(&o, &x, 2);
    assert_eq!(y[0].to_bits(), 0x8000_0000, "row 0 flushes to -0");
    assert_eq!(y[1], 1.0 + f32::powi(2.0, -23), "row 1: the two chains");
}

/// The amx kernels with FP8 weights (`--fp8-act amx`): every code at the
/// scale bytes around the kernels' two decoders' border (7..246 the
/// exponent add, else the f32 product: 0, 1, 6, 7, 10, 127, 246, 247, 254,
/// NaN), random codes and scales on awkward and specialised shapes (partial
/// 32-column chunks, 128-row and 128-column scale blocks cut by tiles and
/// panels) and token counts, bit for bit against the definition; fewer
/// than 4 tokens stay f32.
#[test]
fn amx_fp8_matches_its_reference() {
    let _tally = FiniteTally::start();
    if !amx_runs() {
        return;
    }
    let mut rng = Rng(19);
    let mut shapes = awkward_shapes(Format::Fp8);
    // row tiles of 16 and 32 with rows left over; partial chunks; scale
    // blocks cut by a panel (288 columns: 9 chunks) and by row tiles (130,
    // 200 rows)
    shapes.extend([
        (16, 32),
        (17, 33),
        (33, 288),
        (47, 95),
        (130, 300),
        (200, 129),
        (81, 2080),
    ]);
    let (small, big): (Vec<_>, Vec<_>) = specialised_shapes(Format::Fp8)
        .into_iter()
        .partition(|&(r, c)| r * c <= 1 << 20);
    shapes.extend(small);
    let ns = [1, 2, 3, 4, 16, 17, 33];
    random_sweep(&mut rng, Format::Fp8, &shapes, &ns, 17, "fp8amx", check_amx);
    check_amx_big(&mut rng, Format::Fp8, &big, 6);
    // Every code (NaN codes on row 0 only) at each edge scale: 32 rows of
    // 128 columns, one scale block.
    for sb in [0u8, 1, 6, 7, 10, 127, 246, 247, 254, 255] {
        let mut o = Owned::random(&mut rng, Format::Fp8, 32, 128);
        for (i, b) in o.b.iter_mut().enumerate() {
            let c = (i % 256) as u8;
            *b = if c & 0x7F == 0x7F && i >= 128 {
                c ^ 1
            } else {
                c
            };
        }
        o.s[0] = sb;
        let x = rng.activations(5 * 128);
        let y = check_amx(&o, &x, 5);
        assert!(y[0].is_nan(), "scale {sb}: a NaN code gives NaN");
        if sb == 255 {
            assert!(y.iter().all(|v| v.is_nan()), "a NaN scale gives NaN");
        }
        if (7..=127).contains(&sb) {
            assert!(y[1..32].iter().all(|v| v.is_finite()), "scale {sb}");
        }
    }
}

/// The amx kernels with FP4 weights (`--fp4-act amx`): every code, scale
/// bytes 0 (2^-127, products that are subnormal and read as zero), 254
/// (6 · 2^127 is inf) and NaN, on awkward and specialised shapes and token
/// counts, bit for bit against the definition; one token stays f32.
#[test]
fn amx_fp4_matches_its_reference() {
    let _tally = FiniteTally::start();
    if !amx_runs() {
        return;
    }
    let mut rng = Rng(18);
    let mut shapes = awkward_shapes(Format::Fp4);
    // row tiles of 16 and 32 with rows left over; panels of 8 chunks with
    // a partial last one (cols 288: 9 chunks)
    shapes.extend([(16, 32), (17, 64), (33, 288), (47, 96), (81, 2080)]);
    let (small, big): (Vec<_>, Vec<_>) = specialised_shapes(Format::Fp4)
        .into_iter()
        .partition(|&(r, c)| r * c <= 1 << 20);
    shapes.extend(small);
    let ns = [1, 2, 3, 16, 17, 33];
    random_sweep(&mut rng, Format::Fp4, &shapes, &ns, 17, "fp4amx", check_amx);
    check_amx_big(&mut rng, Format::Fp4, &big, 6);
    // Scales at the edges: 2^-127 (row 0 holds only codes 0.5 and 1, whose
    // products are subnormal and read as zero), 2^127 (6 · 2^127 = inf)
    // and NaN, each on its own rows.
    let mut o = Owned::random(&mut rng, Format::Fp4, 48, 128);
    for (r, s) in [(0, 0u8), (1, 254), (2, 255), (3, 1), (4, 253)] {
        o.s[r * 4..(r + 1) * 4].fill(s);
    }
    o.b[..64].fill(0x21);
    let x = rng.activations(3 * 128);
    let y = check_amx(&o, &x, 3);
    assert_eq!(y[0], 0.0, "scale 2^-127: the products read as zero");
    assert!(y[2].is_nan(), "a NaN scale gives NaN");
    // Every scale byte, one per 32-column block.
    let mut o = Owned::random(&mut rng, Format::Fp4, 64, 128);
    for (i, s) in o.s.iter_mut().enumerate() {
        *s = i as u8;
    }
    let x = rng.activations(5 * 128);
    check_amx(&o, &x, 5);
}

/// The amx variant stays within its stated error bound of the exact
/// products (moderate values, like a hidden state), and the rounding shows.
#[test]
fn amx_error_bound() {
    if !amx_runs() {
        return;
    }
    let k = Kernels::best().with_bf16_act(Bf16Act::Amx).unwrap();
    // all at AMX_MIN_TOKENS or more, so that all go through the amx kernels
    let shapes = [(64, 2048, 9), (37, 96, 17), (16, 4096, 8)];
    check_error_bound(&k, Rng(17), &shapes, "amx", bf16act::amx_error_bound);
}

#[test]
fn fp8dot_matches_its_reference() {
    let _tally = FiniteTally::start();
    if !bf16dot_runs() {
        return;
    }
    let mut rng = Rng(15);
    let mut shapes = awkward_shapes(Format::Fp8);
    // chunk and half tails (1, 31, 32, 33, 63 columns past a 64-column
    // load), partial scale blocks, rows across 128-row scale blocks, row
    // tiles of 8 and 4 with rows left over, rows past one 128 KiB block;
    // rows of 512 B, 1 KiB and 2 KiB in the matvec's page groups (260 x
    // 512, 100 x 1024, 70 x 2048: 8 ps rows a group, rows left over)
    shapes.extend([
        (100, 1024),
        (70, 2048),
        (8, 32),
        (9, 33),
        (4, 64),
        (11, 65),
        (5, 127),
        (12, 191),
        (3, 255),
        (140, 288),
        (2, 4096 + 31),
        (260, 512),
        (6, 1056),
        (45, 4160),
    ]);
    let (small, big): (Vec<_>, Vec<_>) = specialised_shapes(Format::Fp8)
        .into_iter()
        .partition(|&(r, c)| r * c <= 1 << 20);
    shapes.extend(small);
    // 1: the matvec tile; 2..7, 13: the 2 x 6 tile and its rests
    let ns = [1, 2, 3, 4, 5, 7, 13];
    random_sweep(
        &mut rng,
        Format::Fp8,
        &shapes,
        &ns,
        4,
        "fp8dot",
        check_bf16dot,
    );
    // Planted extremes in every row block: NaN codes, NaN / 2^127 / 2^-127
    // scales, the largest and the subnormal codes, f32::MAX activations.
    let (rows, cols) = (260, 512);
    let mut o = Owned::random(&mut rng, Format::Fp8, rows, cols);
    let nb = cols.div_ceil(128);
    o.b[3 * cols + 5] = 0x7F; // NaN code: row 3 is NaN
    o.s[nb + 1] = 0xFF; // NaN scale: rows 128..255 are NaN
    o.s[2 * nb] = 254;
    o.s[2 * nb + 2] = 0;
    for c in 0..cols {
        o.b[257 * cols + c] = if c % 2 == 0 { 0x7E } else { 0x01 }; // 448, 2^-9
    }
    let mut x = rng.activations(2 * cols);
    x[cols + 7] = f32::MAX;
    let y = check_bf16dot(&o, &x, 2);
    assert!(y[3].is_nan() && y[128..256].iter().all(|v| v.is_nan()));
    assert!(y[..3].iter().chain(&y[256..rows]).any(|v| v.is_finite()));
    dot_tiled_rows(&mut rng, Format::Fp8, &big, 5);
}

/// The fp8dot variant stays within its stated error bound of the exact
/// products, and the rounding of x shows.
#[test]
fn fp8dot_error_bound() {
    if !bf16dot_runs() {
        return;
    }
    let mut rng = Rng(16);
    let k = Kernels::best().with_fp8_act(Bf16Act::Bf16).unwrap();
    let mut worst = 0.0f64;
    for &(rows, cols, n) in &[(64usize, 2048usize, 3usize), (37, 200, 7), (130, 4096, 1)] {
        let w: Vec<u8> = (0..rows * cols)
            .map(|_| bespoke::formats::f32_to_e4m3(rng.unit() * 300.0))
            .collect();
        let s: Vec<u8> = (0..rows.div_ceil(128) * cols.div_ceil(128))
            .map(|_| 115 + rng.below(10) as u8)
            .collect();
        let m = Matrix::new(rows, cols, Weights::Fp8 { w: &w, scale: &s }).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit() * 3.0).collect();
        let mut y = vec![0f32; n * rows];
        k.matmul(&m, &x, n, &mut y).unwrap();
        let nb = cols.div_ceil(128);
        for j in 0..n {
            let xt = &x[j * cols..(j + 1) * cols];
            for r in 0..rows {
                let wr = &w[r * cols..(r + 1) * cols];
                let sr = &s[(r / 128) * nb..(r / 128 + 1) * nb];
                let term = |c: usize| {
                    bespoke::formats::e4m3_to_f32(wr[c]) as f64
                        * bespoke::formats::e8m0_to_f32(sr[c / 128]) as f64
                        * xt[c] as f64
                };
                let exact: f64 = (0..cols).map(term).sum();
                let mag: f64 = (0..cols).map(|c| term(c).abs()).sum();
                let bound = bf16act::fp8_error_bound(wr, sr, xt);
                let err = (y[j * rows + r] as f64 - exact).abs();
                assert!(
                    err <= bound,
                    "{rows}x{cols} token {j} row {r}: |{} - {exact}| = {err:e} > bound {bound:e}",
                    y[j * rows + r]
                );
                worst = worst.max(err / mag);
            }
        }
    }
    assert!(worst > 1e-5, "fp8dot error suspiciously small: {worst:e}");
    eprintln!("fp8dot: worst |y_fp8dot - y_exact| / sum|w x| = {worst:.2e}");
}

/// Prints which variants were compiled and which ran (CI shows this).
#[test]
fn report_variants() {
    let ks = runnable();
    bf16dot_runs();
    assert!(
        ks.iter().any(|k| k.isa() == Isa::Scalar),
        "the scalar variant always runs"
    );
}

/// A KV layout whose rows overlap, a buffer too short for the last row of
/// the last KV head, or strides whose product overflows: each an error
/// that names the problem, never a call.
#[test]
fn attention_refuses_bad_layouts() {
    let k = runnable()[0];
    let (hd, h, kv, t) = (16usize, 4usize, 2usize, 5usize);
    let q = vec![0.5f32; h * hd];
    // KV-head-major, room for t positions: the last float read is
    // (kv-1)·t·hd + (t-1)·hd + hd = kv·t·hd.
    let full = vec![0.25f32; kv * t * hd];
    let short = full[..full.len() - 1].to_vec();
    // Keys one float short of the last row, or the full buffer.
    let args = |short_keys: bool, kv_stride, kv_head_stride| AttnArgs {
        q: &q,
        k: if short_keys { &short } else { &full },
        v: &full,
        sinks: None,
        n_heads: h,
        n_kv_heads: kv,
        head_dim: hd,
        kv_stride,
        kv_head_stride,
        t_len: t,
        window: 0,
        scale: 0.25,
    };
    let mut out = vec![0f32; h * hd];
    k.attn_decode(&args(false, hd, t * hd), &mut out).unwrap();
    for (a, want) in [
        (
            args(false, hd - 1, t * hd),
            "kv_stride 15 is smaller than head_dim 16",
        ),
        (
            args(false, hd, hd - 1),
            "kv_head_stride 15 is smaller than head_dim 16",
        ),
        (
            args(true, hd, t * hd),
            "attention keys (at least, for 5 positions): expected 160 elements, found 159",
        ),
        (
            args(false, usize::MAX / 2, t * hd),
            "attention KV layout overflows",
        ),
    ] {
        let e = k.attn_decode(&a, &mut out).unwrap_err().to_string();
        assert!(e.contains(want), "{e:?} should say {want:?}");
    }
}
