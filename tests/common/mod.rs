//! Test helpers: a deterministic generator and awkward inputs.
#![allow(dead_code)]

/// SplitMix64: deterministic, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// An f32 activation: mostly ordinary values, sometimes zeros, -0,
    /// subnormals, large values and the largest finite ones.
    pub fn activation(&mut self) -> f32 {
        match self.below(40) {
            0 => 0.0,
            1 => -0.0,
            2 => {
                f32::from_bits(1 + self.below(0x7F_FFFF) as u32)
                    * if self.below(2) == 0 { 1.0 } else { -1.0 }
            }
            3 => self.unit() * 1e30,
            4 => f32::MIN_POSITIVE * self.unit(),
            5 => {
                if self.below(2) == 0 {
                    f32::MAX
                } else {
                    f32::MIN
                }
            }
            _ => self.unit() * 4.0,
        }
    }
    pub fn activations(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.activation()).collect()
    }
    /// A UE8M0 scale byte: mostly moderate, sometimes extreme or NaN (0xFF).
    pub fn scale_byte(&mut self) -> u8 {
        match self.below(50) {
            0 => 0xFF,
            1 => 0,
            2 => 254,
            3 => 1,
            _ => 118 + self.below(16) as u8,
        }
    }
}

/// Bitwise equality, with any NaN equal to any NaN.
pub fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// First index where two outputs differ, with both values.
pub fn first_diff(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(a.len(), b.len(), "output lengths differ");
    a.iter()
        .zip(b)
        .position(|(x, y)| !same(*x, *y))
        .map(|i| (i, a[i], b[i]))
}
