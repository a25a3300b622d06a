//! Model directories: a corpus of broken ones, generated here, each of which
//! must give its own clear error (never a panic); synthetic valid ones in
//! both DeepSeek V4 namings; the memory mapping.

mod common;

use bespoke::model::layout::{self, Kind, Naming};
use bespoke::model::{ModelDir, ModelError};
use bespoke::plan::ModelConfig;
use bespoke::safetensors::{self, parse_header, Dtype, HeaderError};
use common::Rng;
use std::path::{Path, PathBuf};

/// A fresh empty directory under the target dir, unique per test case.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("model_dirs")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const TINY_LLAMA: &str = r#"{
  "model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
  "vocab_size": 32, "tie_word_embeddings": false, "torch_dtype": "bfloat16"
}"#;

/// A tiny DeepSeek V4 in the release layout: FP8 dense, FP4 experts, one
/// layer of each attention kind, one hash-routed layer.
const TINY_DSV4: &str = r#"{
  "model_type": "deepseek_v4", "hidden_size": 64, "num_hidden_layers": 3,
  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
  "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_lora_rank": 16, "o_groups": 2,
  "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
  "n_shared_experts": 1, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 4,
  "compress_ratios": [0, 4, 8, 0], "num_hash_layers": 1, "sliding_window": 8,
  "vocab_size": 32, "expert_dtype": "fp4",
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                          "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
}"#;

fn dtype_for(kind: &Kind) -> Dtype {
    match kind {
        Kind::Float => Dtype::BF16,
        Kind::Fp8 { .. } => Dtype::F8E4M3,
        Kind::Fp4 { .. } => Dtype::I8,
        Kind::Scale { .. } => Dtype::F8E8M0,
        Kind::Index => Dtype::I64,
    }
}

/// The expected tensors of `config` in `naming`, zero-filled.
fn tensors_for(config: &str, naming: Naming) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let cfg = ModelConfig::from_json_str("config.json", config).unwrap();
    layout::expected(&cfg, naming, false)
        .unwrap()
        .into_iter()
        .map(|x| {
            let dt = dtype_for(&x.kind);
            let n: usize = x.shape.iter().product();
            (x.name, dt, x.shape, vec![0u8; n * dt.size()])
        })
        .collect()
}

fn write_file(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let refs: Vec<(&str, Dtype, &[usize], &[u8])> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    std::fs::write(path, safetensors::write_bytes(&refs, &[("format", "pt")])).unwrap();
}

/// A valid model directory: config + one safetensors file of the right tensors.
fn valid_dir(name: &str, config: &str, naming: Naming) -> PathBuf {
    let dir = scratch(name);
    std::fs::write(dir.join("config.json"), config).unwrap();
    write_file(&dir.join("model.safetensors"), &tensors_for(config, naming));
    dir
}

/// A raw safetensors file: header text as given, then `data`.
fn raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    v
}

/// Open `dir` expecting an error whose message contains every `needle`.
fn expect_error(dir: &Path, needles: &[&str]) -> ModelError {
    let err = ModelDir::open(dir).expect_err("a broken model directory must not load");
    let msg = err.to_string();
    for n in needles {
        assert!(
            msg.contains(n),
            "error for {} should mention {n:?}; got: {msg}",
            dir.display()
        );
    }
    err
}

#[test]
fn valid_synthetic_dirs_load() {
    let d = valid_dir("valid-llama", TINY_LLAMA, Naming::Hf);
    let m = ModelDir::open(&d).unwrap();
    assert_eq!(m.naming, Naming::Hf);
    assert!(m.unused().is_empty());
    let d = valid_dir("valid-dsv4", TINY_DSV4, Naming::Dsv4Release);
    let m = ModelDir::open(&d).unwrap();
    assert_eq!(m.naming, Naming::Dsv4Release);
    // Layer 0 sliding (no compressor), 1 CSA (indexer), 2 HCA (compressor only).
    assert!(!m.weights.contains("layers.0.attn.compressor.wkv.weight"));
    assert!(m.weights.contains("layers.1.attn.indexer.wq_b.scale"));
    assert!(m.weights.contains("layers.2.attn.compressor.ape"));
    assert!(!m.weights.contains("layers.2.attn.indexer.wq_b.weight"));
    assert!(m.weights.contains("layers.0.ffn.gate.tid2eid"));
    assert!(m.weights.contains("layers.1.ffn.gate.bias"));
    let fp4 = m.weights.get("layers.1.ffn.experts.3.w2.weight").unwrap();
    assert_eq!((fp4.dtype(), fp4.shape()), (Dtype::I8, &[64usize, 16][..]));
}

#[test]
fn dsv4_release_names_map_to_transformers_names() {
    let cases = [
        ("embed.weight", "model.embed_tokens.weight"),
        ("head.weight", "lm_head.weight"),
        ("norm.weight", "model.norm.weight"),
        ("hc_head_fn", "model.hc_head.hc_fn"),
        ("hc_head_scale", "model.hc_head.hc_scale"),
        (
            "layers.7.attn_norm.weight",
            "model.layers.7.input_layernorm.weight",
        ),
        (
            "layers.7.ffn_norm.weight",
            "model.layers.7.post_attention_layernorm.weight",
        ),
        ("layers.7.hc_attn_fn", "model.layers.7.attn_hc.fn"),
        ("layers.7.hc_ffn_base", "model.layers.7.ffn_hc.base"),
        (
            "layers.7.attn.wq_a.weight",
            "model.layers.7.self_attn.q_a_proj.weight",
        ),
        (
            "layers.7.attn.wq_a.scale",
            "model.layers.7.self_attn.q_a_proj.weight_scale_inv",
        ),
        (
            "layers.7.attn.q_norm.weight",
            "model.layers.7.self_attn.q_a_norm.weight",
        ),
        (
            "layers.7.attn.wq_b.weight",
            "model.layers.7.self_attn.q_b_proj.weight",
        ),
        (
            "layers.7.attn.wkv.weight",
            "model.layers.7.self_attn.kv_proj.weight",
        ),
        (
            "layers.7.attn.wo_a.weight",
            "model.layers.7.self_attn.o_a_proj.weight",
        ),
        (
            "layers.7.attn.wo_b.scale",
            "model.layers.7.self_attn.o_b_proj.weight_scale_inv",
        ),
        ("layers.7.attn.attn_sink", "model.layers.7.self_attn.sinks"),
        (
            "layers.7.attn.compressor.wkv.weight",
            "model.layers.7.self_attn.compressor.kv_proj.weight",
        ),
        (
            "layers.7.attn.compressor.ape",
            "model.layers.7.self_attn.compressor.position_bias",
        ),
        (
            "layers.7.attn.compressor.norm.weight",
            "model.layers.7.self_attn.compressor.kv_norm.weight",
        ),
        (
            "layers.7.attn.indexer.wq_b.weight",
            "model.layers.7.self_attn.compressor.indexer.q_b_proj.weight",
        ),
        (
            "layers.7.attn.indexer.weights_proj.weight",
            "model.layers.7.self_attn.compressor.indexer.scorer.weights_proj.weight",
        ),
        (
            "layers.7.attn.indexer.compressor.wgate.weight",
            "model.layers.7.self_attn.compressor.indexer.gate_proj.weight",
        ),
        (
            "layers.7.attn.indexer.compressor.ape",
            "model.layers.7.self_attn.compressor.indexer.position_bias",
        ),
        ("layers.7.ffn.gate.weight", "model.layers.7.mlp.gate.weight"),
        (
            "layers.7.ffn.gate.bias",
            "model.layers.7.mlp.gate.e_score_correction_bias",
        ),
        (
            "layers.7.ffn.gate.tid2eid",
            "model.layers.7.mlp.gate.tid2eid",
        ),
        (
            "layers.7.ffn.shared_experts.w1.weight",
            "model.layers.7.mlp.shared_experts.gate_proj.weight",
        ),
        (
            "layers.7.ffn.shared_experts.w2.scale",
            "model.layers.7.mlp.shared_experts.down_proj.weight_scale_inv",
        ),
        (
            "layers.7.ffn.shared_experts.w3.weight",
            "model.layers.7.mlp.shared_experts.up_proj.weight",
        ),
    ];
    for (release, hf) in cases {
        assert_eq!(
            layout::dsv4_release_to_hf(release),
            hf,
            "mapping of {release}"
        );
    }
}

#[test]
fn dsv4_transformers_naming_loads_with_fused_experts() {
    // The same architecture unquantized, in transformers' names.
    let cfg = TINY_DSV4.replace(r#""expert_dtype": "fp4","#, "").replace(
        r#""quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                          "weight_block_size": [128, 128], "activation_scheme": "dynamic"}"#,
        r#""torch_dtype": "bfloat16""#,
    );
    let d = valid_dir("valid-dsv4-hf", &cfg, Naming::Hf);
    let m = ModelDir::open(&d).unwrap();
    assert_eq!(m.naming, Naming::Hf);
    let gu = m
        .weights
        .get("model.layers.1.mlp.experts.gate_up_proj")
        .unwrap();
    assert_eq!(gu.shape(), &[4, 64, 64]);
    assert!(m
        .weights
        .contains("model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"));
    // Every release name (other than per-expert ones) has its HF twin here.
    let parsed = ModelConfig::from_json_str("c", &cfg).unwrap();
    for x in layout::expected(&parsed, Naming::Dsv4Release, false).unwrap() {
        if !x.name.contains(".experts.") {
            assert!(
                m.weights.contains(&layout::dsv4_release_to_hf(&x.name)),
                "{}",
                x.name
            );
        }
    }
}

#[test]
fn views_point_into_the_mapping() {
    let d = valid_dir("mapped", TINY_LLAMA, Naming::Hf);
    let m = ModelDir::open(&d).unwrap();
    for name in m.weights.names() {
        let t = m.weights.get(name).unwrap();
        assert!(
            m.weights.is_mapped(t.bytes),
            "{name} is not a view into the file mapping"
        );
        assert!(
            t.is_aligned(),
            "{name}: 8-aligned data section, 2-byte elements"
        );
        let v = t.u16s().unwrap();
        assert!(
            matches!(v, std::borrow::Cow::Borrowed(_)),
            "{name}: aligned BF16 must be borrowed, not copied"
        );
        assert!(m.weights.is_mapped(bytemuck::cast_slice::<u16, u8>(&v)));
    }
}

#[test]
fn unaligned_tensors_are_copied_not_misread() {
    // A 1-byte tensor first puts the F32 one at an odd offset.
    let dir = scratch("unaligned");
    let bytes = safetensors::write_bytes(
        &[
            ("a", Dtype::U8, &[1], &[7]),
            ("b", Dtype::F32, &[2], &[0, 0, 128, 63, 0, 0, 0, 64]),
        ],
        &[],
    );
    let p = dir.join("x.safetensors");
    std::fs::write(&p, bytes).unwrap();
    let f = safetensors::SafetensorsFile::open(&p).unwrap();
    let b = f.tensor("b").unwrap();
    assert!(!b.is_aligned());
    assert_eq!(&*b.f32s().unwrap(), &[1.0, 2.0]);
    assert!(b.u16s().is_err(), "F32 read as BF16 must be refused");
}

/// Each broken safetensors header → its own error.
#[test]
fn malformed_headers() {
    let good = r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let data = [0u8; 8];
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("too short", vec![1, 2, 3], "too short"),
        (
            "header past end",
            {
                let mut v = raw(good, &data);
                v[..8].copy_from_slice(&1000u64.to_le_bytes());
                v
            },
            "runs past the end of the file",
        ),
        (
            "header too large",
            {
                let mut v = raw(good, &data);
                v[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
                v
            },
            "larger than",
        ),
        (
            "invalid json",
            raw(r#"{"t": {"dtype": "F32", "#, &data),
            "not valid JSON",
        ),
        (
            "not utf8",
            {
                let mut v = raw("{\"x\": 1}", &data);
                v[10] = 0xFF;
                v
            },
            "UTF-8",
        ),
        ("array header", raw("[1,2]", &data), "must be a JSON object"),
        (
            "entry not object",
            raw(r#"{"t": 5}"#, &data),
            "expected an object",
        ),
        (
            "dtype number",
            raw(
                r#"{"t":{"dtype":4,"shape":[2],"data_offsets":[0,8]}}"#,
                &data,
            ),
            "dtype must be a string",
        ),
        (
            "shape string",
            raw(
                r#"{"t":{"dtype":"F32","shape":"2","data_offsets":[0,8]}}"#,
                &data,
            ),
            "shape must be an array",
        ),
        (
            "shape negative",
            raw(
                r#"{"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}"#,
                &data,
            ),
            "negative",
        ),
        (
            "offset negative",
            raw(
                r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}"#,
                &data,
            ),
            "negative",
        ),
        (
            "offset fractional",
            raw(
                r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,7.5]}}"#,
                &data,
            ),
            "not an integer",
        ),
        (
            "offset overflowing",
            raw(
                r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,1e30]}}"#,
                &data,
            ),
            "not an integer",
        ),
        (
            "offset beyond u64",
            raw(
                r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551616]}}"#,
                &data,
            ),
            "not an integer",
        ),
        (
            "offsets reversed",
            raw(
                r#"{"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}"#,
                &data,
            ),
            "end before they begin",
        ),
        (
            "three offsets",
            raw(
                r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}}"#,
                &data,
            ),
            "[begin, end]",
        ),
        (
            "out of file",
            raw(
                r#"{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
                &data,
            ),
            "past the end of the data",
        ),
        (
            "shape x dtype mismatch",
            raw(
                r#"{"t":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}}"#,
                &data,
            ),
            "needs 4 bytes",
        ),
        (
            "shape overflow",
            raw(
                r#"{"t":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}"#,
                &data,
            ),
            "more elements than fit",
        ),
        (
            "unknown dtype",
            raw(
                r#"{"t":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,8]}}"#,
                &data,
            ),
            "unknown dtype \"Q4_K\"",
        ),
        (
            "overlap",
            raw(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
                &data,
            ),
            "overlap",
        ),
        (
            "metadata not strings",
            raw(r#"{"__metadata__":{"format":1}}"#, &data),
            "__metadata__",
        ),
        (
            "missing offsets",
            raw(r#"{"t":{"dtype":"F32","shape":[2]}}"#, &data),
            "no data_offsets",
        ),
    ];
    for (what, bytes, needle) in cases {
        let err = parse_header(&bytes).expect_err(what);
        assert!(
            err.to_string().contains(needle),
            "{what}: expected {needle:?} in: {err}"
        );
    }
    assert!(parse_header(&raw(good, &data)).is_ok());
    // Through the file API the message names the file.
    let dir = scratch("bad-header");
    std::fs::write(dir.join("config.json"), TINY_LLAMA).unwrap();
    std::fs::write(
        dir.join("model.safetensors"),
        raw(
            r#"{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            &data,
        ),
    )
    .unwrap();
    expect_error(&dir, &["model.safetensors", "tensor \"t\"", "past the end"]);
}

/// Random corruptions of a valid file never panic the parser.
#[test]
fn mutated_headers_never_panic() {
    let cfg = TINY_LLAMA;
    let tensors = tensors_for(cfg, Naming::Hf);
    let refs: Vec<(&str, Dtype, &[usize], &[u8])> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    let base = safetensors::write_bytes(&refs, &[]);
    let header_end = 8 + u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
    let mut rng = Rng(42);
    let mut errors = 0;
    for _ in 0..20_000 {
        let mut v = base.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(header_end.min(v.len()) as u64) as usize;
            match rng.below(4) {
                0 => v[at] = rng.below(256) as u8,
                1 => v[at] = b"0123456789-.e,[]{}\":"[rng.below(20) as usize],
                2 => {
                    v.truncate(at.max(1));
                }
                _ => v[at] ^= 1 << rng.below(8),
            }
        }
        if parse_header(&v).is_err() {
            errors += 1;
        }
    }
    assert!(
        errors > 10_000,
        "most corruptions must be caught ({errors} of 20000)"
    );
}

#[test]
fn broken_directories() {
    let data = [0u8; 8];
    // Missing tensor.
    let d = scratch("missing-tensor");
    std::fs::write(d.join("config.json"), TINY_LLAMA).unwrap();
    let mut t = tensors_for(TINY_LLAMA, Naming::Hf);
    t.retain(|(n, ..)| n != "model.layers.0.self_attn.k_proj.weight");
    write_file(&d.join("model.safetensors"), &t);
    expect_error(
        &d,
        &[
            "model.layers.0.self_attn.k_proj.weight",
            "missing",
            "[8, 16]",
        ],
    );

    // Misshapen and wrongly typed tensors: expected and found both named.
    let d = scratch("misshapen");
    std::fs::write(d.join("config.json"), TINY_LLAMA).unwrap();
    let mut t = tensors_for(TINY_LLAMA, Naming::Hf);
    for (n, dt, s, b) in t.iter_mut() {
        if n == "model.layers.0.mlp.up_proj.weight" {
            *s = vec![16, 24];
        }
        if n == "model.norm.weight" {
            *dt = Dtype::I32;
            *s = vec![8];
            b.truncate(32);
        }
    }
    write_file(&d.join("model.safetensors"), &t);
    let e = expect_error(
        &d,
        &[
            "model.layers.0.mlp.up_proj.weight",
            "[24, 16]",
            "found BF16 [16, 24]",
            "1 more",
        ],
    );
    assert!(matches!(e, ModelError::TensorMismatch { .. }));

    // FP8 weight whose scale has the wrong block count.
    let d = scratch("bad-scale");
    std::fs::write(d.join("config.json"), TINY_DSV4).unwrap();
    let mut t = tensors_for(TINY_DSV4, Naming::Dsv4Release);
    for (n, _, s, b) in t.iter_mut() {
        if n == "layers.0.attn.wq_b.scale" {
            *s = vec![2, 1];
            b.push(0);
        }
    }
    write_file(&d.join("model.safetensors"), &t);
    expect_error(
        &d,
        &[
            "layers.0.attn.wq_b.scale",
            "F8_E8M0 [1, 1]",
            "found F8_E8M0 [2, 1]",
        ],
    );

    // A token → expert table naming an expert that does not exist.
    let d = scratch("bad-tid2eid");
    std::fs::write(d.join("config.json"), TINY_DSV4).unwrap();
    let mut t = tensors_for(TINY_DSV4, Naming::Dsv4Release);
    for (n, _, _, b) in t.iter_mut() {
        if n == "layers.0.ffn.gate.tid2eid" {
            b[8 * 5..8 * 6].copy_from_slice(&4i64.to_le_bytes());
        }
    }
    write_file(&d.join("model.safetensors"), &t);
    expect_error(
        &d,
        &[
            "layers.0.ffn.gate.tid2eid",
            "expert ids in 0..4",
            "found 4 at [2, 1]",
        ],
    );

    // No weights at all.
    let d = scratch("no-weights");
    std::fs::write(d.join("config.json"), TINY_LLAMA).unwrap();
    expect_error(&d, &["no weights", "model.safetensors"]);

    // Not a directory.
    expect_error(&d.join("config.json"), &["not a directory"]);

    // config.json: NaN, a string where a number belongs, unknown model type, missing.
    for (name, cfg, needles) in [
        (
            "nan",
            TINY_LLAMA.replace("16,", "NaN,"),
            vec!["config.json", "not valid JSON", "NaN"],
        ),
        (
            "string",
            TINY_LLAMA.replace("\"hidden_size\": 16", "\"hidden_size\": \"16\""),
            vec!["hidden_size", "string"],
        ),
        (
            "fraction",
            TINY_LLAMA.replace("\"hidden_size\": 16", "\"hidden_size\": 16.5"),
            vec!["hidden_size", "16.5"],
        ),
        (
            "unknown-type",
            TINY_LLAMA.replace("\"llama\"", "\"gpt_neox\""),
            vec!["unknown model type \"gpt_neox\""],
        ),
        (
            "heads",
            TINY_LLAMA.replace("\"num_key_value_heads\": 1", "\"num_key_value_heads\": 3"),
            vec!["num_key_value_heads", "does not divide"],
        ),
    ] {
        let d = scratch(&format!("config-{name}"));
        std::fs::write(d.join("config.json"), cfg).unwrap();
        std::fs::write(d.join("model.safetensors"), raw("{}", &[])).unwrap();
        expect_error(&d, &needles);
    }
    let d = scratch("no-config");
    std::fs::write(d.join("model.safetensors"), raw("{}", &[])).unwrap();
    expect_error(&d, &["config.json"]);

    // generation_config.json with a bad value.
    let d = valid_dir("bad-generation", TINY_LLAMA, Naming::Hf);
    std::fs::write(d.join("generation_config.json"), r#"{"top_p": 1.5}"#).unwrap();
    expect_error(&d, &["generation_config.json", "top_p"]);
    std::fs::write(
        d.join("generation_config.json"),
        r#"{"eos_token_id": [2, 99]}"#,
    )
    .unwrap();
    expect_error(&d, &["generation_config.json", "eos_token_id"]);
    std::fs::write(
        d.join("generation_config.json"),
        r#"{"eos_token_id": [2, 3], "temperature": 0.7}"#,
    )
    .unwrap();
    let m = ModelDir::open(&d).unwrap();
    assert_eq!(m.generation.unwrap().eos_token_ids, vec![2, 3]);

    // A tokenizer.json that does not parse.
    let d = valid_dir("bad-tokenizer", TINY_LLAMA, Naming::Hf);
    std::fs::write(d.join("tokenizer.json"), "{\"model\": 3}").unwrap();
    expect_error(&d, &["tokenizer.json", "not a valid tokenizers file"]);
    std::fs::write(d.join("tokenizer.json"), "not json").unwrap();
    expect_error(&d, &["tokenizer.json"]);

    // Same tensor in two files.
    let d = scratch("duplicate");
    std::fs::write(d.join("config.json"), TINY_LLAMA).unwrap();
    let t = tensors_for(TINY_LLAMA, Naming::Hf);
    write_file(&d.join("a.safetensors"), &t);
    write_file(&d.join("b.safetensors"), &t[..1]);
    expect_error(&d, &["model.embed_tokens.weight", "in both"]);
    let _ = data;
}

#[test]
fn sharded_checkpoints() {
    let t = tensors_for(TINY_LLAMA, Naming::Hf);
    let (first, second) = t.split_at(t.len() / 2);
    let index = |map: &[(String, String)]| {
        let m: serde_json::Map<String, serde_json::Value> = map
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        serde_json::json!({"metadata": {"total_size": 0}, "weight_map": m}).to_string()
    };
    let mut map: Vec<(String, String)> = first
        .iter()
        .map(|x| (x.0.clone(), "model-00001-of-00002.safetensors".into()))
        .collect();
    map.extend(
        second
            .iter()
            .map(|x| (x.0.clone(), "model-00002-of-00002.safetensors".into())),
    );

    let d = scratch("sharded");
    std::fs::write(d.join("config.json"), TINY_LLAMA).unwrap();
    write_file(&d.join("model-00001-of-00002.safetensors"), first);
    write_file(&d.join("model-00002-of-00002.safetensors"), second);
    std::fs::write(d.join("model.safetensors.index.json"), index(&map)).unwrap();
    let m = ModelDir::open(&d).unwrap();
    assert_eq!(m.weights.shards.len(), 2);
    assert!(m.weights.index_file.is_some());

    // A missing shard.
    std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
    expect_error(
        &d,
        &[
            "model.safetensors.index.json",
            "model-00002-of-00002.safetensors",
            "missing",
        ],
    );

    // A shard path that escapes the directory.
    let d2 = scratch("escape");
    std::fs::write(d2.join("config.json"), TINY_LLAMA).unwrap();
    let mut bad = map.clone();
    bad[0].1 = "../sharded/model-00001-of-00002.safetensors".into();
    std::fs::write(d2.join("model.safetensors.index.json"), index(&bad)).unwrap();
    expect_error(
        &d2,
        &["../sharded", "not a file name inside the model directory"],
    );
    bad[0].1 = "/etc/passwd".into();
    std::fs::write(d2.join("model.safetensors.index.json"), index(&bad)).unwrap();
    expect_error(&d2, &["/etc/passwd", "not a file name inside"]);

    // The index puts a tensor in a shard that does not hold it.
    let d3 = scratch("index-lies");
    std::fs::write(d3.join("config.json"), TINY_LLAMA).unwrap();
    write_file(&d3.join("model-00001-of-00002.safetensors"), first);
    write_file(&d3.join("model-00002-of-00002.safetensors"), second);
    let mut lies = map.clone();
    let last = lies.len() - 1;
    lies[last].1 = "model-00001-of-00002.safetensors".into();
    std::fs::write(d3.join("model.safetensors.index.json"), index(&lies)).unwrap();
    expect_error(&d3, &["does not hold it"]);
    std::fs::write(
        d3.join("model.safetensors.index.json"),
        "{\"weight_map\": [1]}",
    )
    .unwrap();
    expect_error(&d3, &["weight_map"]);
}

#[test]
fn header_errors_are_typed() {
    assert_eq!(parse_header(&[0; 4]), Err(HeaderError::TooShort(4)));
}

/// The layout reproduces the real checkpoints' tensor counts: Flash ships
/// 69,187 tensors and Pro 145,116, of which the MTP block is 1,575 / 2,343
/// (its attention, norms, projections, shared and 256 / 384 routed experts).
#[test]
fn dsv4_layout_matches_the_released_inventories() {
    let flash = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/configs/deepseek-v4-flash.json"
    ))
    .unwrap();
    let cfg = ModelConfig::from_json_str("flash", &flash).unwrap();
    assert_eq!(
        layout::expected(&cfg, Naming::Dsv4Release, false)
            .unwrap()
            .len(),
        69_187 - 1_575
    );
    let mut ratios = vec![128, 128];
    for _ in 0..29 {
        ratios.extend([4, 128]);
    }
    ratios.extend([4, 0]);
    let pro = format!(
        r#"{{"model_type": "deepseek_v4", "hidden_size": 7168, "num_hidden_layers": 61,
        "num_attention_heads": 128, "q_lora_rank": 1536, "o_groups": 16, "o_lora_rank": 1024,
        "moe_intermediate_size": 3072, "n_routed_experts": 384, "index_topk": 1024,
        "compress_ratios": {ratios:?}, "expert_dtype": "fp4",
        "quantization_config": {{"fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}}}}"#
    );
    let cfg = ModelConfig::from_json_str("pro", &pro).unwrap();
    let x = layout::expected(&cfg, Naming::Dsv4Release, false).unwrap();
    assert_eq!(x.len(), 145_116 - 2_343);
    let w1 = x
        .iter()
        .find(|e| e.name == "layers.5.ffn.experts.383.w1.weight")
        .unwrap();
    assert_eq!(w1.shape, vec![3072, 3584]);
    let s = x
        .iter()
        .find(|e| e.name == "layers.5.attn.wo_a.scale")
        .unwrap();
    assert_eq!(s.shape, vec![128, 32]);
}
