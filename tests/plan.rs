//! The plan: configs of each family parse with transformers' defaults, give
//! their shape sets, and bad configs give errors naming file and field.

use bespoke::plan::{self, Family, Format, MatShape, ModelConfig};
use std::collections::BTreeSet;

fn cfg(json: &str) -> Result<ModelConfig, String> {
    ModelConfig::from_json_str("test/config.json", json).map_err(|e| e.to_string())
}

fn shapes(c: &ModelConfig) -> BTreeSet<MatShape> {
    plan::plan(std::slice::from_ref(c), vec![], "test")
        .unwrap()
        .mat_shapes
        .into_iter()
        .collect()
}

fn fixture(path: &str) -> ModelConfig {
    plan::load_config(std::path::Path::new(&format!(
        "{}/{path}",
        env!("CARGO_MANIFEST_DIR")
    )))
    .unwrap()
}

const QWEN3: &str = r#"{"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 384,
  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 48,
  "vocab_size": 1000, "torch_dtype": "float32", "tie_word_embeddings": false}"#;

#[test]
fn two_configs_give_different_specialised_shape_sets() {
    let llama = fixture("fixtures/tiny-llama");
    let qwen = cfg(QWEN3).unwrap();
    let (a, b) = (shapes(&llama), shapes(&qwen));
    assert_ne!(a, b);
    assert!(
        a.contains(&MatShape {
            format: Format::Bf16,
            rows: 72,
            cols: 72
        }),
        "{a:?}"
    );
    // qwen3: q_proj is heads*head_dim x hidden = 192 x 128, f32 weights.
    assert!(
        b.contains(&MatShape {
            format: Format::F32,
            rows: 192,
            cols: 128
        }),
        "{b:?}"
    );
    assert!(
        b.contains(&MatShape {
            format: Format::F32,
            rows: 1000,
            cols: 128
        }),
        "lm_head {b:?}"
    );
    assert_eq!(qwen.family, Family::Qwen3);
    assert_eq!(
        plan::attn_shapes(&qwen)[0],
        plan::AttnShape {
            head_dim: 48,
            n_heads: 4,
            n_kv_heads: 2
        }
    );
}

#[test]
fn deepseek_v4_flash_plans_fp4_experts_and_fp8_dense() {
    let c = fixture("fixtures/configs/deepseek-v4-flash.json");
    assert_eq!(c.family, Family::DeepseekV4);
    let s = shapes(&c);
    for (f, r, k) in [
        (Format::Fp4, 2048, 4096),
        (Format::Fp4, 4096, 2048),
        (Format::Fp8, 1024, 4096),  // wq_a and each wo_a group
        (Format::Fp8, 32768, 1024), // wq_b
        (Format::Fp8, 512, 4096),   // wkv
        (Format::Fp8, 4096, 8192),  // wo_b
        (Format::Bf16, 256, 4096),  // router
        (Format::F32, 24, 16384),   // hyper-connection mix
    ] {
        assert!(
            s.contains(&MatShape {
                format: f,
                rows: r,
                cols: k
            }),
            "missing {f} {r}x{k} in {s:?}"
        );
    }
    let v4 = c.dsv4.as_ref().unwrap();
    assert_eq!(v4.compress_ratios.len(), 43);
    assert_eq!(v4.num_hash_layers, 3);
    assert!(v4.fp4_experts && v4.fp8_dense);
    assert_eq!(
        plan::attn_shapes(&c)[0],
        plan::AttnShape {
            head_dim: 512,
            n_heads: 64,
            n_kv_heads: 1
        }
    );
}

#[test]
fn qwen3_moe_dense_and_sparse_layers() {
    let c = cfg(
        r#"{"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 300, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 2, "mlp_only_layers": [3]}"#,
    )
    .unwrap();
    let m = c.moe.as_ref().unwrap();
    // (l+1) % 2 != 0 -> layers 0 and 2 dense; 3 is in mlp_only_layers.
    assert_eq!(m.dense_layers, vec![0, 2, 3]);
    let mats = plan::matrices(&c);
    let gate = mats.iter().find(|u| u.name.ends_with("mlp.gate")).unwrap();
    assert_eq!((gate.rows, gate.cols, gate.per_token), (8, 64, 1));
    let up = mats
        .iter()
        .find(|u| u.name.ends_with("experts.*.up_proj"))
        .unwrap();
    assert_eq!((up.rows, up.cols, up.per_token), (32, 64, 2));
}

#[test]
fn defaults_follow_transformers() {
    // llama: head_dim = hidden / heads, kv heads = heads.
    let c = cfg(r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}"#).unwrap();
    assert_eq!(
        (c.head_dim, c.num_kv_heads, c.vocab_size, c.num_layers),
        (16, 4, 32000, 32)
    );
    // qwen2 always has q/k/v biases.
    let c = cfg(r#"{"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4}"#).unwrap();
    assert!(c.attention_bias);
    assert_eq!(c.family, Family::Llama);
    // rope_theta from transformers 5's rope_parameters.
    let c = cfg(
        r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}"#,
    )
    .unwrap();
    assert_eq!(c.rope_theta, 500000.0);
}

fn err(json: &str) -> String {
    cfg(json).expect_err(&format!("config should be refused: {json}"))
}

#[test]
fn unknown_model_type_is_refused_by_name() {
    let e = err(r#"{"model_type": "mistral", "hidden_size": 64}"#);
    assert!(
        e.contains("test/config.json") && e.contains("model_type") && e.contains("\"mistral\""),
        "{e}"
    );
    assert!(
        e.contains("llama") && e.contains("deepseek_v4"),
        "lists the supported types: {e}"
    );
    let e = err(r#"{"hidden_size": 64}"#);
    assert!(e.contains("model_type") && e.contains("missing"), "{e}");
}

#[test]
fn malformed_configs_give_clear_errors() {
    let cases: &[(&str, &[&str])] = &[
        ("{not json", &["not valid JSON"]),
        ("[1, 2]", &["expected a JSON object"]),
        (r#"{"model_type": 3}"#, &["model_type", "expected a string"]),
        (
            r#"{"model_type": "llama", "hidden_size": "4096"}"#,
            &["hidden_size", "expected an integer", "string"],
        ),
        (
            r#"{"model_type": "llama", "hidden_size": -1}"#,
            &["hidden_size", "-1"],
        ),
        (
            r#"{"model_type": "llama", "hidden_size": 64.5}"#,
            &["hidden_size", "64.5"],
        ),
        (
            r#"{"model_type": "llama", "hidden_size": 1e300}"#,
            &["hidden_size"],
        ),
        (
            r#"{"model_type": "llama", "hidden_size": 0}"#,
            &["hidden_size", "1..="],
        ),
        (
            r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3}"#,
            &["num_key_value_heads", "does not divide"],
        ),
        (
            r#"{"model_type": "llama", "hidden_size": 66, "num_attention_heads": 4}"#,
            &["head_dim", "not a multiple"],
        ),
        (
            r#"{"model_type": "llama", "rms_norm_eps": "small"}"#,
            &["rms_norm_eps", "expected a number"],
        ),
        (
            r#"{"model_type": "llama", "tie_word_embeddings": 1}"#,
            &["tie_word_embeddings", "true or false"],
        ),
        (
            r#"{"model_type": "llama", "torch_dtype": "int4"}"#,
            &["torch_dtype", "int4"],
        ),
        (
            r#"{"model_type": "llama", "quantization_config": {"quant_method": "gptq"}}"#,
            &["quantization_config", "not supported"],
        ),
        (
            r#"{"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 8}"#,
            &["num_experts_per_tok", "1..=4"],
        ),
        (
            r#"{"model_type": "deepseek_v4", "num_hidden_layers": 4, "compress_ratios": [0, 4]}"#,
            &["compress_ratios", "2 entries"],
        ),
        (
            r#"{"model_type": "deepseek_v4", "num_hidden_layers": 2}"#,
            &["compress_ratios", "missing"],
        ),
        (
            r#"{"model_type": "deepseek_v4", "num_hidden_layers": 2, "compress_ratios": [0, 0],
             "quantization_config": {"fmt": "e5m2"}}"#,
            &["quantization_config.fmt", "e5m2"],
        ),
        (
            r#"{"model_type": "deepseek_v4", "num_hidden_layers": 2, "compress_ratios": [0, 0], "num_key_value_heads": 2}"#,
            &["num_key_value_heads"],
        ),
    ];
    for (json, needles) in cases {
        let e = err(json);
        for n in *needles {
            assert!(e.contains(n), "error for {json} should mention {n:?}: {e}");
        }
    }
}

#[test]
fn fp4_matrices_need_whole_scale_blocks() {
    // hidden 4100 is not a multiple of 32: the FP4 experts cannot be stored,
    // and the config is refused naming the field.
    let e = err(
        r#"{"model_type": "deepseek_v4", "num_hidden_layers": 2, "compress_ratios": [0, 4],
        "hidden_size": 4100, "expert_dtype": "fp4",
        "quantization_config": {"fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}}"#,
    );
    assert!(
        e.contains("hidden_size") && e.contains("multiple of 32"),
        "{e}"
    );
}

#[test]
fn missing_config_file_names_the_path() {
    let e = plan::load_config(std::path::Path::new("/nonexistent/model"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/nonexistent/model/config.json") && e.contains("cannot read"),
        "{e}"
    );
}

#[test]
fn rope_scaling_and_token_ids() {
    use bespoke::plan::config::RopeScaling;
    let c = cfg(
        r#"{"model_type": "llama", "vocab_size": 100, "bos_token_id": 1, "eos_token_id": [2, 7],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
    )
    .unwrap();
    assert_eq!(c.bos_token_id, Some(1));
    assert_eq!(c.eos_token_ids, vec![2, 7]);
    assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    // transformers 5 spelling.
    let c = cfg(
        r#"{"model_type": "qwen3", "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
        "rope_theta": 1000000.0, "original_max_position_embeddings": 32768}}"#,
    )
    .unwrap();
    assert_eq!(c.rope_theta, 1e6);
    assert!(
        matches!(c.rope_scaling, RopeScaling::Yarn { factor, beta_fast, .. } if factor == 4.0 && beta_fast == 32.0)
    );
    // deepseek_v4 in transformers 5: main / compress tables; scaling is the compress one.
    let c = cfg(r#"{"model_type": "deepseek_v4", "num_hidden_layers": 2, "head_dim": 512,
        "layer_types": ["sliding_attention", "heavily_compressed_attention"],
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
          "compress": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                       "beta_fast": 32, "beta_slow": 1, "rope_theta": 160000.0}}}"#)
    .unwrap();
    assert_eq!(c.rope_theta, 10000.0);
    assert_eq!(c.dsv4.as_ref().unwrap().qk_rope_head_dim, 64);
    assert!(matches!(
        c.rope_scaling,
        RopeScaling::Yarn {
            original_max_position_embeddings: 65536,
            ..
        }
    ));
    for (json, needles) in [
        (
            r#"{"model_type": "llama", "rope_scaling": {"rope_type": "longrope"}}"#,
            &["rope_scaling.rope_type", "longrope"][..],
        ),
        (
            r#"{"model_type": "llama", "rope_scaling": {"rope_type": "linear"}}"#,
            &["rope_scaling.factor", "missing"][..],
        ),
        (
            r#"{"model_type": "llama", "vocab_size": 10, "eos_token_id": 10}"#,
            &["eos_token_id", "0..=9"][..],
        ),
        (
            r#"{"model_type": "llama", "hidden_size": 60, "num_attention_heads": 4}"#,
            &["head_dim", "odd"][..],
        ),
    ] {
        let e = err(json);
        for n in needles {
            assert!(e.contains(n), "error for {json} should mention {n:?}: {e}");
        }
    }
}

/// BESPOKE_CPU presets: flags and required features per preset, the default
/// on aarch64, and clear errors for a wrong name, an x86 target and `native`
/// when cross-compiling.
#[test]
fn cpu_presets() {
    use bespoke::plan::cpu_preset;
    let p = cpu_preset(Some("jetson-orin"), "aarch64", "x86_64", None)
        .unwrap()
        .unwrap();
    assert_eq!(p.features, ["dotprod", "fp16"]);
    assert!(
        p.cflags.iter().any(|f| f.contains("armv8.2-a+dotprod")),
        "{:?}",
        p.cflags
    );
    assert_eq!(p.cuda_arch.as_deref(), Some("sm_87"));
    let p = cpu_preset(Some("dgx-spark"), "aarch64", "x86_64", None)
        .unwrap()
        .unwrap();
    assert!(p.features.contains(&"i8mm".to_string()));
    assert_eq!(p.cuda_arch.as_deref(), Some("sm_121"));
    let p = cpu_preset(None, "aarch64", "x86_64", None)
        .unwrap()
        .unwrap();
    assert_eq!((p.name.as_str(), p.features.len()), ("armv8-a", 0));
    assert_eq!(cpu_preset(None, "x86_64", "x86_64", None).unwrap(), None);
    let e = cpu_preset(Some("jetson-orin"), "x86_64", "x86_64", None).unwrap_err();
    assert!(e.contains("aarch64 targets"), "{e}");
    let e = cpu_preset(Some("pentium"), "aarch64", "aarch64", None).unwrap_err();
    assert!(
        e.contains("unknown preset") && e.contains("dgx-spark"),
        "{e}"
    );
    let e = cpu_preset(Some("native"), "aarch64", "x86_64", None).unwrap_err();
    assert!(e.contains("not the aarch64 target"), "{e}");
    let line = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp";
    let p = cpu_preset(Some("native"), "aarch64", "aarch64", Some(line))
        .unwrap()
        .unwrap();
    assert_eq!(
        (p.cflags[0].as_str(), p.features.clone()),
        (
            "-mcpu=native",
            vec!["dotprod".to_string(), "fp16".to_string()]
        )
    );
}

/// A matvec row step above 1 visits the rows of a tile out of order, which
/// the software prefetch distances (the next tile's row i + MR) do not
/// follow: no ISA may set both, and every step is at least 1.
#[test]
fn matvec_row_step_is_not_combined_with_prefetch() {
    for isa in plan::ISAS {
        let d = isa.desc();
        assert!(d.matvec_row_step >= 1, "{}: matvec_row_step 0", d.name);
        assert!(
            d.matvec_row_step == 1 || d.prefetch_ahead == 0,
            "{}: matvec_row_step {} with prefetch_ahead {}",
            d.name,
            d.matvec_row_step,
            d.prefetch_ahead
        );
    }
}

/// The page step (`matvec_page_bytes`) works out its own row step from the
/// row length, so it is never set with a fixed `matvec_row_step`; it is a
/// power of two (a page holds a whole number of the rows it takes); and the
/// prefetch reaches a whole row on (`prefetch_ahead` 0 or at least a page),
/// so that rows shorter than a page are prefetched at the same row of the
/// next group (bs_pf_dist with a span of MR times the step).
#[test]
fn matvec_page_step_is_consistent() {
    for (_, d) in isas_setting("matvec_page_bytes", |d| d.matvec_page_bytes) {
        assert!(d.matvec_page_bytes.is_power_of_two(), "{}", d.name);
        assert_eq!(d.matvec_row_step, 1, "{}: both row steps set", d.name);
        assert!(
            d.prefetch_ahead == 0 || d.prefetch_ahead >= d.matvec_page_bytes,
            "{}: prefetch_ahead {} below the page {}",
            d.name,
            d.prefetch_ahead,
            d.matvec_page_bytes
        );
    }
}

/// The FP4 tiles' own prefetch (`fp4_prefetch_ahead`, also taken by the
/// fp4×q8 rows, which are one row at a time) asks for the line a fixed
/// distance on from the chunk being read, which is where the stream goes
/// only when every FP4 tile is one row read in order: it is set only
/// on ISAs whose FP4 matvec and matmul tiles are one row, and never
/// together with `prefetch_ahead` (whose row-aware distances it replaces).
#[test]
fn fp4_prefetch_only_with_one_row_tiles() {
    for (isa, d) in isas_setting("fp4_prefetch_ahead", |d| d.fp4_prefetch_ahead) {
        assert_eq!(d.prefetch_ahead, 0, "{}: both prefetches set", d.name);
        for op in [plan::Op::Matvec, plan::Op::Matmul] {
            let t = isa.tile(op, plan::Format::Fp4);
            assert_eq!(t.rows, 1, "{}: {op:?} FP4 tile of {} rows", d.name, t.rows);
        }
    }
}

/// The ISAs whose descriptor sets `field` (nonzero); at least one must, or
/// the test checking them checks nothing.
fn isas_setting(
    field: &str,
    get: impl Fn(&plan::IsaDesc) -> usize,
) -> Vec<(plan::Isa, plan::IsaDesc)> {
    let set: Vec<_> = plan::ISAS
        .iter()
        .map(|&isa| (isa, isa.desc()))
        .filter(|(_, d)| get(d) != 0)
        .collect();
    assert!(!set.is_empty(), "no ISA sets {field}");
    set
}
