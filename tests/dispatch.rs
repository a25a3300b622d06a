//! Dispatch: forcing each compiled variant works, forcing one the CPU lacks
//! or that was not compiled is a clear error (never SIGILL), both through
//! the API and through the binary's BESPOKE_KERNELS.

use bespoke::kernels::{KernelError, Kernels, COMPILED_ISAS};
use bespoke::plan::ISAS;
mod common;
use common::bespoke_command;

fn bespoke(args: &[&str], kernels: Option<&str>) -> (bool, String, String) {
    let mut c = bespoke_command();
    c.args(args);
    match kernels {
        Some(k) => c.env("BESPOKE_KERNELS", k),
        None => c.env_remove("BESPOKE_KERNELS"),
    };
    let out = c.output().expect("run bespoke");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn forcing_each_variant() {
    for isa in ISAS {
        let r = Kernels::choose(Some(isa.name()));
        let compiled = COMPILED_ISAS.contains(&isa);
        let runnable = compiled && bespoke::cpu::missing_features(isa).is_empty();
        match r {
            Ok(c) => {
                assert!(runnable, "{isa} chosen although not runnable");
                assert_eq!(c.kernels.isa(), isa);
                assert!(c.reason.contains("BESPOKE_KERNELS"));
            }
            Err(KernelError::NotCompiled { .. }) => {
                assert!(!compiled, "{isa} reported not compiled")
            }
            Err(KernelError::CpuLacks { missing, .. }) => {
                assert!(compiled && !runnable, "{isa}: lacks {missing}");
                assert!(!missing.is_empty());
            }
            Err(e) => panic!("{isa}: unexpected error {e}"),
        }
        // The same through the binary: success exactly when runnable, and a
        // clear message otherwise (a SIGILL would be a signal, not exit 1).
        let (ok, stdout, stderr) = bespoke(&["plan"], Some(isa.name()));
        assert_eq!(
            ok, runnable,
            "BESPOKE_KERNELS={isa}: stdout {stdout} stderr {stderr}"
        );
        if runnable {
            assert!(
                stdout.contains(&format!(
                    "dispatch uses: {isa} — forced by BESPOKE_KERNELS={isa}"
                )),
                "{stdout}"
            );
        } else {
            assert!(
                stderr.contains("bespoke: error:") && stderr.contains(isa.name()),
                "{stderr}"
            );
            assert!(
                stderr.contains("lacks") || stderr.contains("not compiled"),
                "{stderr}"
            );
        }
    }
}

#[test]
fn unknown_variant_is_an_error() {
    let e = Kernels::choose(Some("sse9")).unwrap_err().to_string();
    assert!(e.contains("sse9") && e.contains("avx2"), "{e}");
    let (ok, _, stderr) = bespoke(&["plan"], Some("sse9"));
    assert!(!ok && stderr.contains("sse9"), "{stderr}");
}

#[test]
fn auto_picks_the_highest_scoring_runnable_variant() {
    let best = Kernels::choose(None).unwrap().kernels.isa();
    assert_eq!(Kernels::choose(Some("auto")).unwrap().kernels.isa(), best);
    for &isa in COMPILED_ISAS {
        if bespoke::cpu::missing_features(isa).is_empty() {
            assert!(
                isa.desc().score <= best.desc().score,
                "{isa} outranks the choice {best}"
            );
        }
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && COMPILED_ISAS.contains(&bespoke::plan::Isa::Avx2)
    {
        assert_ne!(best, bespoke::plan::Isa::Scalar);
    }
}
