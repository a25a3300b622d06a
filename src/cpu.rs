//! What the running CPU supports, asked of the OS/CPUID through std's
//! runtime feature detection (never by trying an instruction).

use crate::plan::Isa;

/// Whether the running CPU has one feature (std::arch names).
pub fn has_feature(name: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match name {
            "avx2" => std::arch::is_x86_feature_detected!("avx2"),
            "fma" => std::arch::is_x86_feature_detected!("fma"),
            "f16c" => std::arch::is_x86_feature_detected!("f16c"),
            "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
            "avx512bw" => std::arch::is_x86_feature_detected!("avx512bw"),
            "avx512vl" => std::arch::is_x86_feature_detected!("avx512vl"),
            "avx512vbmi" => std::arch::is_x86_feature_detected!("avx512vbmi"),
            "avx512vnni" => std::arch::is_x86_feature_detected!("avx512vnni"),
            "avx512bf16" => std::arch::is_x86_feature_detected!("avx512bf16"),
            _ => false,
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        match name {
            "neon" => std::arch::is_aarch64_feature_detected!("neon"),
            "dotprod" => std::arch::is_aarch64_feature_detected!("dotprod"),
            "i8mm" => std::arch::is_aarch64_feature_detected!("i8mm"),
            "fp16" => std::arch::is_aarch64_feature_detected!("fp16"),
            "bf16" => std::arch::is_aarch64_feature_detected!("bf16"),
            "sve" => std::arch::is_aarch64_feature_detected!("sve"),
            "sve2" => std::arch::is_aarch64_feature_detected!("sve2"),
            _ => false,
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = name;
        false
    }
}

/// Features `isa` needs that this CPU lacks (empty: it can run). The NEON
/// variant also needs what its BESPOKE_CPU preset let the compiler use
/// (dotprod, fp16, …), so a Jetson build on a plain Armv8.0 core falls back
/// to the scalar variant instead of stopping on an illegal instruction.
pub fn missing_features(isa: Isa) -> Vec<String> {
    let desc = isa.desc();
    if desc.arch != "any" && desc.arch != std::env::consts::ARCH {
        return vec![desc.arch.to_string()];
    }
    let mut need: Vec<String> = desc.cpu_features.iter().map(|f| f.to_string()).collect();
    if isa == Isa::Neon {
        need.extend(preset_features().iter().cloned());
    }
    need.into_iter().filter(|f| !has_feature(f)).collect()
}

/// The BESPOKE_CPU preset's features, read from the build plan once.
fn preset_features() -> &'static [String] {
    static FEATURES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    FEATURES.get_or_init(|| {
        crate::report::build_plan()
            .cpu
            .map(|p| p.features)
            .unwrap_or_default()
    })
}

/// Physical cores (the default thread count).
pub fn physical_cores() -> usize {
    num_cpus::get_physical().max(1)
}

/// A one-line description of the CPU (model name where the OS tells it).
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| {
                    l.starts_with("model name")
                        || l.starts_with("Model")
                        || l.starts_with("CPU part")
                })
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}
