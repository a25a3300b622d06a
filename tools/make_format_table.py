#!/usr/bin/env python3
"""Write fixtures/formats/ml_dtypes_table.json: an independent oracle for the
Rust format definitions (src/formats.rs).

Pinned: ml_dtypes==0.6.0, numpy==2.4.6 (pip install them into any venv).
Run from the repository root:  python3 tools/make_format_table.py

Every value is stored as an integer bit pattern so nothing is lost to JSON
float printing: f32 values as u32 bits, format codes as integers.
"""
import json

import ml_dtypes
import numpy as np

FORMATS = {
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e8m0": ml_dtypes.float8_e8m0fnu,
    "bf16": ml_dtypes.bfloat16,
}


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.int64).tolist()


def codes(a, fmt):
    raw = np.asarray(a, dtype=fmt)
    width = 2 if fmt is ml_dtypes.bfloat16 else 1
    view = raw.view(np.uint16 if width == 2 else np.uint8).astype(np.int64)
    if fmt is ml_dtypes.float4_e2m1fn:
        view = view & 0xF
    return view.tolist()


def decode_table(fmt, n):
    if fmt is ml_dtypes.float4_e2m1fn:
        raw = np.arange(n, dtype=np.uint8).view(fmt)
    else:
        raw = np.arange(n, dtype=np.uint8).view(fmt)
    return bits(raw.astype(np.float32))


def main():
    rng = np.random.default_rng(20261129)
    inputs = []
    # Every representable value of the narrow formats, its neighbours, and the
    # midpoints between consecutive values (the round-half-even ties).
    for name, n in (("e2m1", 16), ("e4m3fn", 256), ("e8m0", 256)):
        vals = np.arange(n, dtype=np.uint8).view(FORMATS[name]).astype(np.float32)
        vals = vals[np.isfinite(vals)]
        uniq = np.unique(vals)
        mids = (uniq[:-1].astype(np.float64) + uniq[1:].astype(np.float64)) / 2
        inputs += vals.tolist() + mids.astype(np.float32).tolist()
        for v in vals:
            inputs.append(float(np.nextafter(np.float32(v), np.float32(np.inf))))
            inputs.append(float(np.nextafter(np.float32(v), np.float32(-np.inf))))
    # bf16 ties and near-ties.
    for e in range(-140, 128, 7):
        base = np.float32(2.0) ** e if e > -149 else np.float32(0)
        for frac in (0x8000, 0x7FFF, 0x8001, 0x18000, 0x17FFF):
            b = np.array([base], dtype=np.float32).view(np.uint32)[0] + frac
            inputs.append(float(np.array([b], dtype=np.uint32).view(np.float32)[0]))
    # Log-uniform random values of both signs across the whole f32 range.
    mag = np.exp2(rng.uniform(-140, 127, 1500)).astype(np.float32)
    sign = np.where(rng.random(1500) < 0.5, -1, 1).astype(np.float32)
    inputs += (mag * sign).tolist()
    specials = [0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1.17549435e-38,
                3.4028235e38, -3.4028235e38, 500.0, -500.0, 464.0, 463.99, 7.0, -7.0, 1e30]
    inputs += specials
    x = np.array(inputs, dtype=np.float32)
    x = np.concatenate([x, -x])
    x = x[~np.isnan(x)]
    _, idx = np.unique(x.view(np.uint32), return_index=True)
    x = x[np.sort(idx)]

    out = {
        "generator": "tools/make_format_table.py",
        "ml_dtypes": ml_dtypes.__version__,
        "numpy": np.__version__,
        "note": "f32 values are u32 bit patterns; NaN inputs are left out (their encoding is checked as 'is NaN' in the Rust tests)",
        "decode": {
            "e2m1": decode_table(ml_dtypes.float4_e2m1fn, 16),
            "e4m3fn": decode_table(ml_dtypes.float8_e4m3fn, 256),
            "e8m0": decode_table(ml_dtypes.float8_e8m0fnu, 256),
        },
        "encode_inputs": bits(x),
        "encode": {name: codes(x, fmt) for name, fmt in FORMATS.items()},
    }
    with open("fixtures/formats/ml_dtypes_table.json", "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(x)} encode inputs")


if __name__ == "__main__":
    main()
