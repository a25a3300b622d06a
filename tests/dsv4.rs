//! The DeepSeek V4 engine against transformers (fixtures' ref.json), in both
//! storage formats (release names with FP8 / FP4, and transformers' own
//! names unquantized): teacher-forcing argmax at every position, 24 greedy
//! tokens decoded through the cache, the last logits of the short prompt,
//! and cached decoding equal to a full recompute, for every kernel variant
//! this CPU runs.

mod common;

use bespoke::engine::dsv4::Dsv4Model;
use bespoke::generate::CausalLm;
use bespoke::kernels::Kernels;
use bespoke::model::ModelDir;
use common::{argmaxes, check_context_and_token_errors, check_model, fixture, variants};
use std::path::Path;

#[test]
fn tiny_dsv4_release_matches_transformers() {
    check_model("tiny-dsv4");
}

#[test]
fn tiny_dsv4_hf_matches_transformers() {
    check_model("tiny-dsv4-hf");
}

#[test]
fn context_and_token_errors() {
    let (m, _) = fixture("tiny-dsv4");
    let eng = Dsv4Model::new(&m, Kernels::best()).unwrap();
    let mut c = check_context_and_token_errors(&eng, m.config.max_position_embeddings);
    // Nothing was appended by the refused calls.
    assert_eq!(c.len, 0);
    assert!(eng.forward(&mut c, &[], false).unwrap().is_empty());
}

/// The llama engine refuses a DeepSeek V4 directory and this one refuses the others.
#[test]
fn wrong_family_is_refused() {
    let (m, _) = fixture("tiny-llama");
    let e = Dsv4Model::new(&m, Kernels::best())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("deepseek_v4"), "{e}");
}

/// The rope tables transformers derived for both fixtures (ref.json's
/// `transformers_config`): the sliding layers' plain rope and the compressed
/// layers' YaRN rope, whose attention factor transformers pins to 1.0 when
/// the YaRN parameters come from the legacy `rope_scaling` key.
#[test]
fn rope_tables_match_transformers() {
    use bespoke::engine::Rope;
    use bespoke::plan::config::RopeScaling;
    for name in ["tiny-dsv4", "tiny-dsv4-hf"] {
        let (m, r) = fixture(name);
        let c = &m.config;
        let v = c.dsv4.as_ref().unwrap();
        let tc = &r["transformers_config"];
        let tables = [
            (
                "main",
                Rope::new(
                    v.qk_rope_head_dim,
                    c.rope_theta,
                    &RopeScaling::None,
                    c.max_position_embeddings,
                ),
            ),
            (
                "compress",
                Rope::new(
                    v.qk_rope_head_dim,
                    v.compress_rope_theta,
                    &c.rope_scaling,
                    c.max_position_embeddings,
                ),
            ),
        ];
        for (kind, rope) in tables {
            let want: Vec<f64> = tc["rope_inv_freq"][kind]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(rope.inv_freq.len(), want.len(), "{name} {kind}");
            for (i, (&got, &w)) in rope.inv_freq.iter().zip(&want).enumerate() {
                assert!(
                    ((got as f64 - w) / w).abs() < 2e-6,
                    "{name} {kind}: inv_freq[{i}] = {got}, transformers {w}"
                );
            }
            let s = tc["rope_attention_scaling"][kind].as_f64().unwrap();
            assert_eq!(
                rope.attention_scaling as f64, s,
                "{name} {kind}: attention scaling"
            );
        }
    }
}

/// A differently shaped DeepSeek V4 (other widths, hc_mult 2, a CSA first
/// layer, other rates, 3-of-6 routing, FP8 + FP4) runs with no code change:
/// random weights written here, finite logits, and cached decode equal to a
/// full recompute. The plan picks its shapes up from its config.
#[test]
fn a_differently_shaped_config_runs() {
    use bespoke::model::layout::{self, Kind, Naming};
    use bespoke::plan::ModelConfig;
    use bespoke::safetensors::{write_bytes, Dtype};
    let config = r#"{
      "model_type": "deepseek_v4", "hidden_size": 96, "num_hidden_layers": 4,
      "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 32,
      "qk_rope_head_dim": 8, "q_lora_rank": 48, "o_lora_rank": 16, "o_groups": 3,
      "moe_intermediate_size": 64, "n_routed_experts": 6, "num_experts_per_tok": 3,
      "n_shared_experts": 1, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 3,
      "compress_ratios": [4, 0, 16, 4], "num_hash_layers": 1, "sliding_window": 8,
      "hc_mult": 2, "hc_sinkhorn_iters": 5, "vocab_size": 64, "max_position_embeddings": 256,
      "swiglu_limit": 4.0, "expert_dtype": "fp4",
      "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                              "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    }"#;
    let cfg = ModelConfig::from_json_str("config.json", config).unwrap();
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for x in layout::expected(&cfg, Naming::Dsv4Release, false).unwrap() {
        let n: usize = x.shape.iter().product();
        let (dt, bytes): (Dtype, Vec<u8>) = match &x.kind {
            Kind::Float if x.name.ends_with("norm.weight") => {
                (Dtype::BF16, [0x80u8, 0x3F].repeat(n))
            }
            // BF16 ~ ±[2^-7, 2^-4): sign, exponent 120..123, random mantissa.
            Kind::Float => (
                Dtype::BF16,
                (0..n)
                    .flat_map(|_| {
                        let r = next();
                        let bits = ((r & 1) << 15) as u16
                            | ((120 + (r >> 1) % 4) as u16) << 7
                            | ((r >> 8) & 0x7F) as u16;
                        bits.to_le_bytes()
                    })
                    .collect(),
            ),
            // E4M3 codes of magnitude below 2 (no NaN).
            Kind::Fp8 { .. } => (
                Dtype::F8E4M3,
                (0..n).map(|_| (next() as u8) & 0xBF).collect(),
            ),
            Kind::Fp4 { .. } => (Dtype::I8, (0..n).map(|_| next() as u8).collect()),
            Kind::Scale { .. } => (
                Dtype::F8E8M0,
                (0..n).map(|_| 121 + (next() % 3) as u8).collect(),
            ),
            Kind::Index => (
                Dtype::I64,
                (0..n)
                    .flat_map(|_| ((next() % 6) as i64).to_le_bytes())
                    .collect(),
            ),
        };
        tensors.push((x.name, dt, x.shape, bytes));
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dsv4-other-shape");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    let refs: Vec<(&str, Dtype, &[usize], &[u8])> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    std::fs::write(dir.join("model.safetensors"), write_bytes(&refs, &[])).unwrap();
    let m = ModelDir::open(&dir).unwrap();
    let planned = bespoke::plan::plan_model(&m.config).unwrap();
    let dbg = format!("{planned:?}");
    assert!(
        dbg.contains("192") && dbg.contains("48"),
        "the plan has wq_b's 192x48 shape: {dbg}"
    );
    let prompt: Vec<u32> = (0..40).map(|i| (3 + i * 7 % 61) as u32).collect();
    for k in variants() {
        let eng = Dsv4Model::new(&m, k).unwrap();
        let mut full = eng.new_cache(prompt.len()).unwrap();
        let all = eng.prefill(&mut full, &prompt, 7, true).unwrap();
        assert!(
            all.iter().all(|v| v.is_finite()),
            "{}: non-finite logits",
            k.isa()
        );
        let mut inc = eng.new_cache(prompt.len()).unwrap();
        eng.prefill(&mut inc, &prompt[..39], 64, false).unwrap();
        let last = eng.forward(&mut inc, &prompt[39..], false).unwrap();
        assert_eq!(
            &all[all.len() - 64..],
            &last[..],
            "{}: cached decode differs from recompute",
            k.isa()
        );
        assert!(
            argmaxes(&all, 64)
                .iter()
                .collect::<std::collections::BTreeSet<_>>()
                .len()
                > 1
        );
    }
}
