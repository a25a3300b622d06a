//! Any byte string given to the safetensors header parser must yield a
//! header or an error — never a panic, an overflow or an out-of-bounds read —
//! and every tensor of an accepted header must lie inside the file.
#![no_main]

use bespoke::safetensors::parse_header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = parse_header(data) {
        assert_eq!(h.data_start + h.data_len, data.len());
        for t in h.tensors.values() {
            assert!(t.begin <= t.end && t.end <= h.data_len);
            assert_eq!(t.numel() * t.dtype.size(), t.bytes());
        }
    }
});
