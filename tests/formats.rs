//! The Rust format definitions against an independent oracle: a table that
//! ml_dtypes produced (tools/make_format_table.py), over every code of
//! E2M1, E4M3FN and UE8M0 and a few thousand inputs for encoding.

use bespoke::formats::*;
use serde_json::Value;

fn table() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/formats/ml_dtypes_table.json"
    );
    let text = std::fs::read_to_string(path).expect("fixtures/formats/ml_dtypes_table.json");
    serde_json::from_str(&text).expect("valid JSON")
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check_decode(name: &str, codes: usize, f: impl Fn(u8) -> f32) {
    let t = table();
    let want = u32s(&t["decode"][name]);
    assert_eq!(want.len(), codes, "{name}: table size");
    for (code, &bits) in want.iter().enumerate() {
        let got = f(code as u8);
        let w = f32::from_bits(bits);
        assert!(
            got.to_bits() == bits || (got.is_nan() && w.is_nan()),
            "{name} code {code:#04x}: got {got:e} ({:#010x}), ml_dtypes {w:e} ({bits:#010x})",
            got.to_bits()
        );
    }
}

#[test]
fn e2m1_decode_all_16_codes() {
    check_decode("e2m1", 16, e2m1_to_f32);
}

#[test]
fn e4m3fn_decode_all_256_codes() {
    check_decode("e4m3fn", 256, e4m3_to_f32);
}

#[test]
fn e8m0_decode_all_256_codes() {
    check_decode("e8m0", 256, e8m0_to_f32);
}

#[test]
fn bf16_decode_all_65536_codes() {
    // Independent of the table: bf16 is the top half of an f32.
    for h in 0..=u16::MAX {
        let got = bf16_to_f32(h);
        let want = f32::from_bits((h as u32) << 16);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "bf16 {h:#06x}"
        );
    }
}

fn check_encode(name: &str, f: impl Fn(f32) -> u32, mask: u32) {
    let t = table();
    let inputs = u32s(&t["encode_inputs"]);
    let want = u32s(&t["encode"][name]);
    assert!(inputs.len() > 1000, "table has {} inputs", inputs.len());
    let mut bad = Vec::new();
    for (&x, &w) in inputs.iter().zip(&want) {
        let xf = f32::from_bits(x);
        let got = f(xf) & mask;
        if got != (w & mask) {
            bad.push(format!(
                "{xf:e} ({x:#010x}): got {got:#x}, ml_dtypes {w:#x}"
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{name}: {} of {} encodings differ, e.g.\n{}",
        bad.len(),
        inputs.len(),
        bad[..bad.len().min(10)].join("\n")
    );
}

#[test]
fn e2m1_encode_round_to_nearest_even() {
    check_encode("e2m1", |x| f32_to_e2m1(x) as u32, 0xF);
}

#[test]
fn e4m3fn_encode_round_to_nearest_even() {
    check_encode("e4m3fn", |x| f32_to_e4m3(x) as u32, 0xFF);
}

#[test]
fn e8m0_encode_matches_ml_dtypes() {
    check_encode("e8m0", |x| f32_to_e8m0(x) as u32, 0xFF);
}

#[test]
fn bf16_encode_round_to_nearest_even() {
    check_encode("bf16", |x| f32_to_bf16(x) as u32, 0xFFFF);
}

#[test]
fn encode_decode_round_trip_every_code() {
    for c in 0u8..16 {
        assert_eq!(f32_to_e2m1(e2m1_to_f32(c)), c, "e2m1 {c}");
    }
    for c in 0u8..=255 {
        if c & 0x7F != 0x7F {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(c)), c, "e4m3 {c:#x}");
        }
        assert_eq!(f32_to_e8m0(e8m0_to_f32(c)), c, "e8m0 {c:#x}");
    }
}
