//! The numeric formats, defined in Rust: the oracle every kernel is checked
//! against. Decoding is exact; encoding rounds to nearest, ties to even, with
//! the out-of-range behaviour of ml_dtypes (checked over every code and a few
//! thousand inputs against a table ml_dtypes produced,
//! fixtures/formats/ml_dtypes_table.json).

/// The NaN the decoders return (the C side returns the same bits).
pub const NAN_BITS: u32 = 0x7FC0_0000;

/// E2M1 (FP4) values of codes 0..15: 0 .5 1 1.5 2 3 4 6, then negated.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

pub fn e2m1_to_f32(code: u8) -> f32 {
    E2M1_VALUES[(code & 0xF) as usize]
}

/// Code of column `c` in a packed FP4 row: low nibble = even column.
pub fn e2m1_at(row: &[u8], c: usize) -> f32 {
    let b = row[c / 2];
    e2m1_to_f32(if c % 2 == 1 { b >> 4 } else { b & 0xF })
}

/// E4M3FN (FP8): bias 7, no infinities, 0x7F/0xFF NaN, subnormals m·2^-9.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let mag = b & 0x7F;
    if mag == 0x7F {
        return f32::from_bits(NAN_BITS);
    }
    let e = (mag >> 3) as i32;
    let m = (mag & 7) as f32;
    let v = if e == 0 {
        m * 2f32.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// UE8M0 scale: 2^(b-127); 0xFF is NaN.
pub fn e8m0_to_f32(b: u8) -> f32 {
    match b {
        0xFF => f32::from_bits(NAN_BITS),
        0 => f32::from_bits(0x0040_0000), // 2^-127, an f32 subnormal
        _ => f32::from_bits((b as u32) << 23),
    }
}

pub fn bf16_to_f32(h: u16) -> f32 {
    half::bf16::from_bits(h).to_f32()
}

/// Round-to-nearest-even f32 → bf16 bits (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// Nearest code among sorted non-negative `values` (index = code), ties to
/// the even code. `x` must be finite and non-negative.
fn nearest_code(values: &[f32], x: f32) -> usize {
    // values are increasing; find the first value >= x.
    let hi = values.partition_point(|&v| v < x);
    if hi == 0 {
        return 0;
    }
    if hi == values.len() {
        return values.len() - 1;
    }
    let lo = hi - 1;
    let (dl, dh) = (x as f64 - values[lo] as f64, values[hi] as f64 - x as f64);
    if dl < dh || (dl == dh && lo % 2 == 0) {
        lo
    } else {
        hi
    }
}

/// f32 → E2M1 code, round to nearest even; saturates at ±6 (as ml_dtypes).
/// NaN has no E2M1 code; it maps to +0 here (callers quantizing weights must not pass NaN).
pub fn f32_to_e2m1(x: f32) -> u8 {
    if x.is_nan() {
        return 0;
    }
    let sign = if x.is_sign_negative() { 8 } else { 0 };
    let a = x.abs().min(6.0);
    sign | nearest_code(&E2M1_VALUES[..8], a) as u8
}

/// f32 → E4M3FN code, round to nearest even. Values that round past 448 become
/// NaN (0x7F with the sign), as ml_dtypes does.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs();
    // 464 is halfway between 448 (0x7E) and the NaN slot (would be 480):
    // the tie goes to the even code 0x7E; beyond it, NaN.
    if a > 464.0 {
        return sign | 0x7F;
    }
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| (0u8..0x7F).map(e4m3_to_f32).collect());
    sign | nearest_code(table, a) as u8
}

/// f32 → UE8M0 code: the power of two nearest to x (half-way rounds up, as
/// ml_dtypes does); zero, negatives, NaN and values rounding past 2^127 are
/// NaN (0xFF); f32 subnormals give 2^-127 or 2^-126 (see below).
pub fn f32_to_e8m0(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 || x.is_infinite() {
        return 0xFF;
    }
    let bits = x.to_bits();
    let exp = (bits >> 23) as i32; // biased exponent (0 for subnormals)
    if exp == 0 {
        // f32 subnormals: ml_dtypes sends everything up to 2^-127 to code 0
        // (2^-127) and everything above it to code 1 (2^-126).
        return if bits > 0x0040_0000 { 1 } else { 0 };
    }
    // Normal: mantissa rounding with 0 kept bits; the half-way point rounds up.
    let mant = bits & 0x7F_FFFF;
    let e = if mant >= 0x40_0000 { exp + 1 } else { exp };
    if e >= 255 {
        0xFF
    } else {
        e as u8
    }
}
