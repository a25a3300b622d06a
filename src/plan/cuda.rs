//! The CUDA side of the plan: which GPU architectures a `cuda` build compiles
//! for, and which tensor-core paths each one gets given the installed toolkit.
//! Shared by build.rs (which decides) and the binary (which reports).
//!
//! A tensor-core path is on for an arch only when the arch has the instruction
//! AND the toolkit can emit it AND `BESPOKE_CUDA_TC` is not `off`; otherwise it
//! is compiled out with the reason recorded, and the CUDA-core kernels (which
//! every arch from sm_80 gets) do that work.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A GPU architecture, `sm_<major><minor>` plus `a` for the arch-specific
/// feature set (wgmma on sm_90a, tcgen05 on sm_100a/sm_103a, block-scaled
/// mma.sync on sm_120a/sm_121a).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
    pub specific: bool,
}

/// Architectures this version knows: (major, minor, first toolkit that can
/// target it, whether it has an arch-specific `a` form).
pub const KNOWN_ARCHS: &[(u32, u32, (u32, u32), bool)] = &[
    (8, 0, (11, 0), false),
    (8, 6, (11, 1), false),
    (8, 7, (11, 4), false),
    (8, 9, (11, 8), false),
    (9, 0, (12, 0), true),
    (10, 0, (12, 8), true),
    (10, 3, (12, 9), true),
    (12, 0, (12, 8), true),
    (12, 1, (12, 9), true),
];

/// `BESPOKE_CUDA_ARCH=portable`: the common data-centre and desktop parts,
/// each in the form that unlocks its tensor-core paths, plus PTX for newer GPUs.
pub const PORTABLE: &str = "sm_80,sm_86,sm_89,sm_90a,sm_100a,sm_120a";

/// The arch whose PTX is embedded for forward compatibility: the driver JIT-
/// compiles it on any later GPU the build has no cubin for. Arch-specific
/// (`a`) PTX does not carry forward, so this is a plain arch.
pub const PTX_ARCH: Arch = Arch {
    major: 8,
    minor: 0,
    specific: false,
};

impl Arch {
    pub fn parse(s: &str) -> Result<Arch, String> {
        let t = s.trim().to_ascii_lowercase();
        let digits = t
            .strip_prefix("sm_")
            .or_else(|| t.strip_prefix("compute_"))
            .ok_or_else(|| {
                format!("{s:?} is not a CUDA architecture (expected e.g. sm_80, sm_90a)")
            })?;
        let (num, specific) = match digits.strip_suffix('a') {
            Some(n) => (n, true),
            None => (digits, false),
        };
        if num.len() < 2 || !num.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "{s:?} is not a CUDA architecture (expected e.g. sm_80, sm_90a)"
            ));
        }
        let major: u32 = num[..num.len() - 1]
            .parse()
            .map_err(|_| format!("{s:?}: bad number"))?;
        let minor: u32 = num[num.len() - 1..]
            .parse()
            .map_err(|_| format!("{s:?}: bad number"))?;
        let known = KNOWN_ARCHS
            .iter()
            .find(|k| k.0 == major && k.1 == minor)
            .ok_or_else(|| {
                format!(
                    "{s:?}: not an architecture this version builds for (known: {})",
                    KNOWN_ARCHS
                        .iter()
                        .map(|k| format!("sm_{}{}", k.0, k.1))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
        if specific && !known.3 {
            return Err(format!(
                "{s:?}: sm_{major}{minor} has no arch-specific (a) form; use sm_{major}{minor}"
            ));
        }
        Ok(Arch {
            major,
            minor,
            specific,
        })
    }

    /// The arch-specific (`a`) form where the arch has one, else itself.
    pub fn specific_form(self) -> Arch {
        Arch {
            specific: KNOWN_ARCHS
                .iter()
                .any(|k| k.0 == self.major && k.1 == self.minor && k.3),
            ..self
        }
    }

    /// Compute capability as major·10 + minor (90 for sm_90a).
    pub fn cc(self) -> u32 {
        self.major * 10 + self.minor
    }

    pub fn name(self) -> String {
        format!(
            "sm_{}{}{}",
            self.major,
            self.minor,
            if self.specific { "a" } else { "" }
        )
    }

    pub fn compute(self) -> String {
        format!(
            "compute_{}{}{}",
            self.major,
            self.minor,
            if self.specific { "a" } else { "" }
        )
    }

    /// The first toolkit that can compile for this arch.
    pub fn min_toolkit(self) -> (u32, u32) {
        KNOWN_ARCHS
            .iter()
            .find(|k| k.0 == self.major && k.1 == self.minor)
            .map(|k| k.2)
            .unwrap_or((99, 0))
    }

    /// Whether a cubin built for `self` runs on a device of compute capability
    /// (major, minor): same major and not newer minor, and an arch-specific
    /// cubin only on exactly its own capability.
    pub fn runs_on(self, major: u32, minor: u32) -> bool {
        if self.specific {
            self.major == major && self.minor == minor
        } else {
            self.major == major && self.minor <= minor
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// `BESPOKE_CUDA_ARCH`: a comma-separated list of archs, or a preset:
/// `portable` ([`PORTABLE`]) or `native` (the GPUs nvidia-smi reports, as
/// "major.minor" strings passed in by the caller; `None` when nvidia-smi is
/// not there). Duplicates are dropped; order is kept.
pub fn parse_arch_list(
    spec: &str,
    native: impl FnOnce() -> Option<Vec<String>>,
) -> Result<Vec<Arch>, String> {
    let mut archs: Vec<Arch> = Vec::new();
    let mut push = |a: Arch| {
        if !archs.contains(&a) {
            archs.push(a);
        }
    };
    let mut native = Some(native);
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match item.to_ascii_lowercase().as_str() {
            "portable" => {
                for a in PORTABLE.split(',') {
                    push(Arch::parse(a)?);
                }
            }
            "native" => {
                let caps = native.take().and_then(|f| f()).ok_or_else(|| {
                    "BESPOKE_CUDA_ARCH=native: nvidia-smi is not there or found no GPU; \
                     name the archs (e.g. sm_90a) or use `portable`"
                        .to_string()
                })?;
                for cap in caps {
                    let (maj, min) = cap.trim().split_once('.').ok_or_else(|| {
                        format!(
                            "nvidia-smi reported compute capability {cap:?}, expected major.minor"
                        )
                    })?;
                    let a = Arch::parse(&format!("sm_{maj}{min}"))
                        .map_err(|e| format!("BESPOKE_CUDA_ARCH=native: {e}"))?;
                    // The card in this machine: its arch-specific form unlocks
                    // every tensor-core path it has.
                    push(a.specific_form());
                }
            }
            _ => push(Arch::parse(item).map_err(|e| format!("BESPOKE_CUDA_ARCH: {e}"))?),
        }
    }
    if archs.is_empty() {
        return Err("BESPOKE_CUDA_ARCH names no architecture".into());
    }
    Ok(archs)
}

/// The tensor-core paths, each a family of matmul kernels in templates/cuda.cu.tera.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TcPath {
    /// mma.sync m16n8k16 BF16 × BF16 → F32 (sm_80+): every weight format,
    /// decoded to BF16 in registers, activations rounded to BF16.
    MmaBf16,
    /// mma.sync m16n8k32 S8 × S8 → S32 (sm_80+): FP4 weights (doubled E2M1 are
    /// integers) times int8 activations, the fp4×q8 variant.
    MmaInt8,
    /// mma.sync m16n8k32 E4M3 × E4M3 → F32 (sm_89+): FP8 weights as stored,
    /// activations rounded to E4M3 with a power-of-two scale per 128 columns.
    MmaFp8,
    /// wgmma m64n8k16 BF16 (sm_90a): a warpgroup per 64 rows, B from shared memory.
    Wgmma,
    /// Block-scaled mma.sync m16n8k64 kind::mxf4: E2M1 weights with their
    /// UE8M0 scales × activations rounded to E2M1 with UE8M0 scales per 32
    /// columns (MXFP4 × MXFP4; sm_120a, sm_121a).
    MmaMxf4,
    /// tcgen05.mma kind::mxf4.block_scale (sm_100a, sm_103a): the same MXFP4 ×
    /// MXFP4 product on Blackwell's fifth-generation tensor cores, operands
    /// in shared memory, scales and accumulators in tensor memory.
    Tcgen05Mxf4,
}

pub const TC_PATHS: [TcPath; 6] = [
    TcPath::MmaBf16,
    TcPath::MmaInt8,
    TcPath::MmaFp8,
    TcPath::Wgmma,
    TcPath::MmaMxf4,
    TcPath::Tcgen05Mxf4,
];

impl TcPath {
    /// Short name, also the template flag (`tc.<key>`).
    pub fn key(self) -> &'static str {
        match self {
            TcPath::MmaBf16 => "mma_bf16",
            TcPath::MmaInt8 => "mma_int8",
            TcPath::MmaFp8 => "mma_fp8",
            TcPath::Wgmma => "wgmma",
            TcPath::MmaMxf4 => "mma_mxf4",
            TcPath::Tcgen05Mxf4 => "tcgen05_mxf4",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            TcPath::MmaBf16 => "mma.sync BF16 (any weight format, BF16 activations)",
            TcPath::MmaInt8 => "mma.sync INT8 (FP4 weights × int8 activations)",
            TcPath::MmaFp8 => "mma.sync FP8 E4M3 (FP8 weights × E4M3 activations)",
            TcPath::Wgmma => "wgmma BF16 (Hopper warpgroup mma)",
            TcPath::MmaMxf4 => "block-scaled mma.sync MXFP4 (E2M1 × E2M1, UE8M0 scales)",
            TcPath::Tcgen05Mxf4 => "block-scaled tcgen05.mma MXFP4 (E2M1 × E2M1, UE8M0 scales)",
        }
    }

    /// Text the PTX contains exactly when this path is compiled in.
    pub fn ptx_marker(self) -> &'static str {
        match self {
            TcPath::MmaBf16 => "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
            TcPath::MmaInt8 => "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32",
            TcPath::MmaFp8 => "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
            TcPath::Wgmma => "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16",
            TcPath::MmaMxf4 => "mma.sync.aligned.m16n8k64.row.col.kind::mxf4.block_scale",
            TcPath::Tcgen05Mxf4 => "tcgen05.mma.cta_group::1.kind::mxf4.block_scale",
        }
    }

    /// The first toolkit whose PTX ISA has the instruction.
    pub fn min_toolkit(self) -> (u32, u32) {
        match self {
            TcPath::MmaBf16 | TcPath::MmaInt8 => (11, 0),
            TcPath::MmaFp8 => (12, 4),
            TcPath::Wgmma => (12, 0),
            TcPath::MmaMxf4 | TcPath::Tcgen05Mxf4 => (12, 8),
        }
    }

    /// Why `arch` lacks this path, or None when it has it.
    pub fn arch_lacks(self, a: Arch) -> Option<String> {
        let name = a.name();
        match self {
            TcPath::MmaBf16 | TcPath::MmaInt8 => None,
            TcPath::MmaFp8 if a.cc() < 89 => Some(format!("{name} has no FP8 mma (sm_89+)")),
            TcPath::MmaFp8 => None,
            TcPath::Wgmma if a.cc() == 90 && a.specific => None,
            TcPath::Wgmma if a.cc() == 90 => {
                Some("wgmma needs the arch-specific target sm_90a".into())
            }
            TcPath::Wgmma => Some(format!("wgmma exists only on sm_90a, not {name}")),
            TcPath::MmaMxf4 if (a.cc() == 120 || a.cc() == 121) && a.specific => None,
            TcPath::MmaMxf4 if a.cc() == 120 || a.cc() == 121 => Some(format!(
                "block-scaled mma needs the arch-specific target {name}a"
            )),
            TcPath::MmaMxf4 if a.major == 10 => Some(format!(
                "{name} has no block-scaled mma.sync; its block-scaled FP4 is tcgen05.mma"
            )),
            TcPath::MmaMxf4 => Some(format!("{name} has no block-scaled mma (sm_120a, sm_121a)")),
            TcPath::Tcgen05Mxf4 if a.major == 10 && a.specific => None,
            TcPath::Tcgen05Mxf4 if a.major == 10 => {
                Some(format!("tcgen05 needs the arch-specific target {name}a"))
            }
            TcPath::Tcgen05Mxf4 => Some(format!("{name} has no tcgen05 (sm_100a, sm_103a)")),
        }
    }
}

/// One tensor-core path for one arch: on, or off and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcDecision {
    pub path: TcPath,
    pub on: bool,
    pub why: String,
}

/// The tensor-core paths the CPU emulator of the CUDA kernels computes
/// (`BESPOKE_CUDA=emu`; kernels/bs_cuda_emu.h): all of them, the `mma.sync`
/// shapes of the BF16, INT8, FP8 and block-scaled MXFP4 kernels, the BF16
/// wgmma and the block-scaled FP4 tcgen05 kernel.
pub const EMU_TC: &[&str] = &[
    "mma_bf16",
    "mma_int8",
    "mma_fp8",
    "mma_mxf4",
    "wgmma",
    "tcgen05_mxf4",
];

/// Decide every tensor-core path for `arch` with toolkit `toolkit`.
/// `tc_off`: `BESPOKE_CUDA_TC=off`.
pub fn decide(arch: Arch, toolkit: (u32, u32), tc_off: bool) -> Vec<TcDecision> {
    TC_PATHS
        .iter()
        .map(|&path| {
            let (on, why) = if tc_off {
                (false, "BESPOKE_CUDA_TC=off".to_string())
            } else if let Some(why) = path.arch_lacks(arch) {
                (false, why)
            } else if toolkit < path.min_toolkit() {
                let (maj, min) = path.min_toolkit();
                (
                    false,
                    format!(
                        "the toolkit is CUDA {}.{}; {} needs CUDA {maj}.{min}+",
                        toolkit.0,
                        toolkit.1,
                        path.describe()
                    ),
                )
            } else {
                (true, String::new())
            };
            TcDecision { path, on, why }
        })
        .collect()
}

/// One arch of a `cuda` build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaArchPlan {
    pub arch: Arch,
    /// A cubin was built (false: the toolkit cannot target this arch).
    pub compiled: bool,
    pub why_not: Option<String>,
    pub tc: Vec<TcDecision>,
}

/// What the build did on the CUDA side.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaPlan {
    /// Why no GPU kernels were built (no nvcc, a failed compile), if so.
    pub skipped: Option<String>,
    /// "13.5" (what the build went by; see `toolkit_note`).
    pub toolkit: Option<String>,
    /// Where the toolkit version came from when it was overridden.
    pub toolkit_note: Option<String>,
    pub nvcc: Option<String>,
    pub archs: Vec<CudaArchPlan>,
    /// The arch of the embedded PTX (forward compatibility), if built.
    pub ptx: Option<Arch>,
    pub tc_off: bool,
}

/// Parse "release 12.4" out of `nvcc --version`, or a "12.4" override.
pub fn parse_toolkit_version(text: &str) -> Option<(u32, u32)> {
    let s = match text.find("release ") {
        Some(i) => &text[i + 8..],
        None => text.trim(),
    };
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let mut it = s[..end].split('.');
    let major = it.next()?.parse().ok()?;
    let minor = it.next().unwrap_or("0").parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names_round_trip() {
        for s in [
            "sm_80", "sm_86", "sm_87", "sm_89", "sm_90a", "sm_100a", "sm_120a", "sm_121",
        ] {
            assert_eq!(Arch::parse(s).unwrap().name(), s);
        }
        assert!(Arch::parse("sm_75").unwrap_err().contains("known: sm_80"));
        assert!(Arch::parse("sm_86a")
            .unwrap_err()
            .contains("no arch-specific"));
        assert!(Arch::parse("gfx90a").is_err());
    }

    #[test]
    fn gates_follow_arch_and_toolkit() {
        let on = |a: &str, tk, p: TcPath| {
            decide(Arch::parse(a).unwrap(), tk, false)
                .into_iter()
                .find(|d| d.path == p)
                .unwrap()
                .on
        };
        assert!(on("sm_80", (13, 0), TcPath::MmaBf16));
        assert!(!on("sm_80", (13, 0), TcPath::MmaFp8));
        assert!(on("sm_89", (12, 4), TcPath::MmaFp8));
        assert!(!on("sm_89", (12, 3), TcPath::MmaFp8));
        assert!(on("sm_90a", (12, 0), TcPath::Wgmma));
        assert!(!on("sm_90", (12, 0), TcPath::Wgmma));
        assert!(on("sm_120a", (12, 8), TcPath::MmaMxf4));
        assert!(!on("sm_120a", (12, 6), TcPath::MmaMxf4));
        assert!(!on("sm_121", (13, 0), TcPath::MmaMxf4));
        // Blackwell data-centre parts: FP4 on tcgen05, not on mma.sync.
        assert!(on("sm_100a", (12, 8), TcPath::Tcgen05Mxf4));
        assert!(on("sm_103a", (12, 9), TcPath::Tcgen05Mxf4));
        assert!(!on("sm_100a", (12, 8), TcPath::MmaMxf4));
        assert!(!on("sm_100", (13, 0), TcPath::Tcgen05Mxf4));
        assert!(!on("sm_120a", (13, 0), TcPath::Tcgen05Mxf4));
        assert!(decide(Arch::parse("sm_120a").unwrap(), (13, 0), true)
            .iter()
            .all(|d| !d.on && d.why.contains("BESPOKE_CUDA_TC=off")));
    }

    #[test]
    fn presets_and_versions() {
        let p = parse_arch_list("portable, sm_80", || None).unwrap();
        assert_eq!(p.len(), 6);
        let n = parse_arch_list("native", || Some(vec!["9.0".into(), "8.6".into()])).unwrap();
        assert_eq!(
            n.iter().map(|a| a.name()).collect::<Vec<_>>(),
            ["sm_90a", "sm_86"]
        );
        assert!(parse_arch_list("native", || None)
            .unwrap_err()
            .contains("nvidia-smi"));
        assert_eq!(
            parse_toolkit_version("Cuda compilation tools, release 13.5, V13.5.37"),
            Some((13, 5))
        );
        assert_eq!(parse_toolkit_version("12.4"), Some((12, 4)));
        assert!(Arch::parse("sm_86").unwrap().runs_on(8, 9));
        assert!(!Arch::parse("sm_90a").unwrap().runs_on(10, 0));
    }
}
