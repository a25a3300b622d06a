//! The tensors each family's checkpoint must hold: names (in each naming
//! found in the wild), shapes, and how bespoke interprets the bytes.

use crate::plan::config::{Dsv4Config, Family, ModelConfig};
use crate::safetensors::Dtype;

/// How a tensor's bytes are used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// F32, BF16 or F16 values.
    Float,
    /// F8_E4M3 codes; `scale` names the UE8M0 tensor with one scale per
    /// `block` (rows, cols).
    Fp8 {
        scale: String,
        block: (usize, usize),
    },
    /// Packed E2M1 pairs in I8/U8 (low nibble = even column); `scale` names
    /// the UE8M0 tensor with one scale per 32 columns.
    Fp4 { scale: String },
    /// F8_E8M0 power-of-two scales of the weight `of`.
    Scale { of: String },
    /// Integer table (I64 or I32), e.g. DeepSeek V4's token → expert map.
    Index,
}

impl Kind {
    pub fn dtypes(&self) -> &'static [Dtype] {
        match self {
            Kind::Float => &[Dtype::BF16, Dtype::F32, Dtype::F16],
            Kind::Fp8 { .. } => &[Dtype::F8E4M3],
            Kind::Fp4 { .. } => &[Dtype::I8, Dtype::U8],
            Kind::Scale { .. } => &[Dtype::F8E8M0],
            Kind::Index => &[Dtype::I64, Dtype::I32],
        }
    }

    /// One line for `bespoke inspect`.
    pub fn describe(&self, dtype: Dtype) -> String {
        match self {
            Kind::Float => format!("{dtype} dense"),
            Kind::Fp8 { block, .. } => {
                format!("FP8 E4M3, UE8M0 scale per {}x{} block", block.0, block.1)
            }
            Kind::Fp4 { .. } => "FP4 E2M1 (2 per byte), UE8M0 scale per 32".into(),
            Kind::Scale { of } => format!("UE8M0 scales of {of}"),
            Kind::Index => format!("{dtype} index table"),
        }
    }

    /// The group the bytes are counted in ("bytes by format").
    pub fn format_label(&self, dtype: Dtype) -> &'static str {
        match self {
            Kind::Float => match dtype {
                Dtype::F32 => "F32",
                Dtype::F16 => "F16",
                _ => "BF16",
            },
            Kind::Fp8 { .. } => "FP8 E4M3",
            Kind::Fp4 { .. } => "FP4 E2M1",
            Kind::Scale { .. } => "UE8M0 scales",
            Kind::Index => "integer tables",
        }
    }
}

/// One tensor the model needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub name: String,
    /// Stored shape (for FP4: [rows, cols / 2]).
    pub shape: Vec<usize>,
    pub kind: Kind,
}

/// Which naming a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// Hugging Face transformers names (`model.layers.N.self_attn.q_proj.weight`).
    Hf,
    /// The released DeepSeek V4 checkpoints' names (`layers.N.attn.wq_a.weight`).
    Dsv4Release,
}

impl Naming {
    pub fn describe(self) -> &'static str {
        match self {
            Naming::Hf => "Hugging Face transformers names",
            Naming::Dsv4Release => "DeepSeek V4 release names",
        }
    }
}

fn float(name: impl Into<String>, shape: &[usize]) -> Expected {
    Expected {
        name: name.into(),
        shape: shape.to_vec(),
        kind: Kind::Float,
    }
}

/// A weight [rows, cols] stored as `fmt` (plus its scale tensor when quantized).
/// `base` is the name without `.weight`; `scale_suffix` is `scale` (release)
/// or `weight_scale_inv` (transformers).
fn linear(
    out: &mut Vec<Expected>,
    base: &str,
    rows: usize,
    cols: usize,
    fmt: StoredAs,
    scale_suffix: &str,
) {
    let weight = format!("{base}.weight");
    let scale = format!("{base}.{scale_suffix}");
    match fmt {
        StoredAs::Float => out.push(float(weight, &[rows, cols])),
        StoredAs::Fp8 => {
            out.push(Expected {
                name: weight.clone(),
                shape: vec![rows, cols],
                kind: Kind::Fp8 {
                    scale: scale.clone(),
                    block: (128, 128),
                },
            });
            out.push(Expected {
                name: scale,
                shape: vec![rows.div_ceil(128), cols.div_ceil(128)],
                kind: Kind::Scale { of: weight },
            });
        }
        StoredAs::Fp4 => {
            out.push(Expected {
                name: weight.clone(),
                shape: vec![rows, cols / 2],
                kind: Kind::Fp4 {
                    scale: scale.clone(),
                },
            });
            out.push(Expected {
                name: scale,
                shape: vec![rows, cols / 32],
                kind: Kind::Scale { of: weight },
            });
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoredAs {
    Float,
    Fp8,
    Fp4,
}

/// Every tensor `cfg` needs, in the given naming. Errors when the naming
/// does not exist for the family.
pub fn expected(
    cfg: &ModelConfig,
    naming: Naming,
    fused_experts: bool,
) -> Result<Vec<Expected>, String> {
    match (cfg.family, naming) {
        (Family::DeepseekV4, Naming::Dsv4Release) => Ok(dsv4_release(cfg)),
        (Family::DeepseekV4, Naming::Hf) => dsv4_hf(cfg),
        (_, Naming::Hf) => Ok(llama_like(cfg, fused_experts)),
        (f, Naming::Dsv4Release) => Err(format!(
            "{} checkpoints have no DeepSeek V4 release naming",
            f.name()
        )),
    }
}

fn llama_like(cfg: &ModelConfig, fused_experts: bool) -> Vec<Expected> {
    let d = cfg.hidden_size;
    let (h, kv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let mut out = vec![float("model.embed_tokens.weight", &[cfg.vocab_size, d])];
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        out.push(float(format!("{p}.input_layernorm.weight"), &[d]));
        out.push(float(format!("{p}.post_attention_layernorm.weight"), &[d]));
        for (proj, rows) in [("q_proj", h * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)] {
            out.push(float(format!("{p}.self_attn.{proj}.weight"), &[rows, d]));
            if cfg.attention_bias {
                out.push(float(format!("{p}.self_attn.{proj}.bias"), &[rows]));
            }
        }
        out.push(float(format!("{p}.self_attn.o_proj.weight"), &[d, h * hd]));
        // Qwen2 has q/k/v biases only; Llama's attention_bias covers o_proj too.
        if cfg.attention_bias && cfg.model_type == "llama" {
            out.push(float(format!("{p}.self_attn.o_proj.bias"), &[d]));
        }
        if matches!(cfg.family, Family::Qwen3 | Family::Qwen3Moe) {
            out.push(float(format!("{p}.self_attn.q_norm.weight"), &[hd]));
            out.push(float(format!("{p}.self_attn.k_norm.weight"), &[hd]));
        }
        let sparse = cfg.moe.as_ref().filter(|m| !m.dense_layers.contains(&l));
        match sparse {
            None => {
                let i = cfg.intermediate_size;
                out.push(float(format!("{p}.mlp.gate_proj.weight"), &[i, d]));
                out.push(float(format!("{p}.mlp.up_proj.weight"), &[i, d]));
                out.push(float(format!("{p}.mlp.down_proj.weight"), &[d, i]));
            }
            Some(m) => {
                let (e, i) = (m.num_experts, m.moe_intermediate_size);
                out.push(float(format!("{p}.mlp.gate.weight"), &[e, d]));
                if fused_experts {
                    out.push(float(
                        format!("{p}.mlp.experts.gate_up_proj"),
                        &[e, 2 * i, d],
                    ));
                    out.push(float(format!("{p}.mlp.experts.down_proj"), &[e, d, i]));
                } else {
                    for x in 0..e {
                        out.push(float(
                            format!("{p}.mlp.experts.{x}.gate_proj.weight"),
                            &[i, d],
                        ));
                        out.push(float(
                            format!("{p}.mlp.experts.{x}.up_proj.weight"),
                            &[i, d],
                        ));
                        out.push(float(
                            format!("{p}.mlp.experts.{x}.down_proj.weight"),
                            &[d, i],
                        ));
                    }
                }
            }
        }
    }
    out.push(float("model.norm.weight", &[d]));
    if !cfg.tie_word_embeddings {
        out.push(float("lm_head.weight", &[cfg.vocab_size, d]));
    }
    out
}

fn dsv4(cfg: &ModelConfig) -> &Dsv4Config {
    cfg.dsv4
        .as_ref()
        .expect("deepseek_v4 config carries its Dsv4Config")
}

/// Per-layer attention kind of a DeepSeek V4 layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKind {
    Sliding,
    /// Compressed-sparse: overlapping compressor plus the indexer.
    Csa,
    /// Heavily compressed: plain compressor.
    Hca,
}

pub fn dsv4_attn_kind(v: &Dsv4Config, layer: usize) -> AttnKind {
    match v.compress_ratios[layer] {
        0 => AttnKind::Sliding,
        r if r == v.csa_ratio => AttnKind::Csa,
        _ => AttnKind::Hca,
    }
}

/// The released checkpoints' tensors.
fn dsv4_release(cfg: &ModelConfig) -> Vec<Expected> {
    let v = dsv4(cfg);
    let d = cfg.hidden_size;
    let (h, hd) = (cfg.num_heads, cfg.head_dim);
    let moe = cfg.moe.as_ref().expect("deepseek_v4 is MoE");
    let (e, i, k) = (moe.num_experts, moe.moe_intermediate_size, moe.top_k);
    let hc = v.hc_mult;
    let mix = (2 + hc) * hc;
    let dense = if v.fp8_dense {
        StoredAs::Fp8
    } else {
        StoredAs::Float
    };
    let experts = if v.fp4_experts { StoredAs::Fp4 } else { dense };
    let mut out = vec![
        float("embed.weight", &[cfg.vocab_size, d]),
        float("head.weight", &[cfg.vocab_size, d]),
        float("norm.weight", &[d]),
        float("hc_head_fn", &[hc, hc * d]),
        float("hc_head_base", &[hc]),
        float("hc_head_scale", &[1]),
    ];
    for l in 0..cfg.num_layers {
        let p = format!("layers.{l}");
        out.push(float(format!("{p}.attn_norm.weight"), &[d]));
        out.push(float(format!("{p}.ffn_norm.weight"), &[d]));
        for which in ["attn", "ffn"] {
            out.push(float(format!("{p}.hc_{which}_fn"), &[mix, hc * d]));
            out.push(float(format!("{p}.hc_{which}_base"), &[mix]));
            out.push(float(format!("{p}.hc_{which}_scale"), &[3]));
        }
        let a = format!("{p}.attn");
        linear(
            &mut out,
            &format!("{a}.wq_a"),
            v.q_lora_rank,
            d,
            dense,
            "scale",
        );
        out.push(float(format!("{a}.q_norm.weight"), &[v.q_lora_rank]));
        linear(
            &mut out,
            &format!("{a}.wq_b"),
            h * hd,
            v.q_lora_rank,
            dense,
            "scale",
        );
        linear(&mut out, &format!("{a}.wkv"), hd, d, dense, "scale");
        out.push(float(format!("{a}.kv_norm.weight"), &[hd]));
        linear(
            &mut out,
            &format!("{a}.wo_a"),
            v.o_groups * v.o_lora_rank,
            h * hd / v.o_groups,
            dense,
            "scale",
        );
        linear(
            &mut out,
            &format!("{a}.wo_b"),
            d,
            v.o_groups * v.o_lora_rank,
            dense,
            "scale",
        );
        out.push(float(format!("{a}.attn_sink"), &[h]));
        let kind = dsv4_attn_kind(v, l);
        if kind != AttnKind::Sliding {
            let ratio = v.compress_ratios[l];
            // CSA's compressor keeps two overlapping windows side by side.
            let c = if kind == AttnKind::Csa { 2 } else { 1 };
            let cp = format!("{a}.compressor");
            out.push(float(format!("{cp}.wkv.weight"), &[c * hd, d]));
            out.push(float(format!("{cp}.wgate.weight"), &[c * hd, d]));
            out.push(float(format!("{cp}.ape"), &[ratio, c * hd]));
            out.push(float(format!("{cp}.norm.weight"), &[hd]));
            if kind == AttnKind::Csa {
                let (ih, id) = (v.index_n_heads, v.index_head_dim);
                let ip = format!("{a}.indexer");
                linear(
                    &mut out,
                    &format!("{ip}.wq_b"),
                    ih * id,
                    v.q_lora_rank,
                    dense,
                    "scale",
                );
                out.push(float(format!("{ip}.weights_proj.weight"), &[ih, d]));
                out.push(float(format!("{ip}.compressor.wkv.weight"), &[2 * id, d]));
                out.push(float(format!("{ip}.compressor.wgate.weight"), &[2 * id, d]));
                out.push(float(format!("{ip}.compressor.ape"), &[ratio, 2 * id]));
                out.push(float(format!("{ip}.compressor.norm.weight"), &[id]));
            }
        }
        let f = format!("{p}.ffn");
        out.push(float(format!("{f}.gate.weight"), &[e, d]));
        if l < v.num_hash_layers {
            out.push(Expected {
                name: format!("{f}.gate.tid2eid"),
                shape: vec![cfg.vocab_size, k],
                kind: Kind::Index,
            });
        } else {
            out.push(float(format!("{f}.gate.bias"), &[e]));
        }
        if moe.n_shared_experts > 0 {
            let si = i * moe.n_shared_experts;
            linear(
                &mut out,
                &format!("{f}.shared_experts.w1"),
                si,
                d,
                dense,
                "scale",
            );
            linear(
                &mut out,
                &format!("{f}.shared_experts.w2"),
                d,
                si,
                dense,
                "scale",
            );
            linear(
                &mut out,
                &format!("{f}.shared_experts.w3"),
                si,
                d,
                dense,
                "scale",
            );
        }
        for x in 0..e {
            linear(
                &mut out,
                &format!("{f}.experts.{x}.w1"),
                i,
                d,
                experts,
                "scale",
            );
            linear(
                &mut out,
                &format!("{f}.experts.{x}.w2"),
                d,
                i,
                experts,
                "scale",
            );
            linear(
                &mut out,
                &format!("{f}.experts.{x}.w3"),
                i,
                d,
                experts,
                "scale",
            );
        }
    }
    out
}

/// Release name → transformers name (the renames of transformers'
/// deepseek_v4 conversion mapping, plus its FP8 `weight_scale_inv`).
/// Routed experts are fused in transformers and are not mapped one by one:
/// see `dsv4_hf`.
pub fn dsv4_release_to_hf(name: &str) -> String {
    let top = [
        ("embed.weight", "model.embed_tokens.weight"),
        ("head.weight", "lm_head.weight"),
        ("norm.weight", "model.norm.weight"),
        ("hc_head_fn", "model.hc_head.hc_fn"),
        ("hc_head_base", "model.hc_head.hc_base"),
        ("hc_head_scale", "model.hc_head.hc_scale"),
    ];
    if let Some((_, hf)) = top.iter().find(|(r, _)| *r == name) {
        return hf.to_string();
    }
    let Some(rest) = name.strip_prefix("layers.") else {
        return name.to_string();
    };
    let (layer, tail) = rest.split_once('.').unwrap_or((rest, ""));
    // Longest, most specific patterns first.
    let renames: &[(&str, &str)] = &[
        ("attn_norm.", "input_layernorm."),
        ("ffn_norm.", "post_attention_layernorm."),
        ("hc_attn_fn", "attn_hc.fn"),
        ("hc_attn_base", "attn_hc.base"),
        ("hc_attn_scale", "attn_hc.scale"),
        ("hc_ffn_fn", "ffn_hc.fn"),
        ("hc_ffn_base", "ffn_hc.base"),
        ("hc_ffn_scale", "ffn_hc.scale"),
        (
            "attn.indexer.compressor.wkv.",
            "self_attn.compressor.indexer.kv_proj.",
        ),
        (
            "attn.indexer.compressor.wgate.",
            "self_attn.compressor.indexer.gate_proj.",
        ),
        (
            "attn.indexer.compressor.ape",
            "self_attn.compressor.indexer.position_bias",
        ),
        (
            "attn.indexer.compressor.norm.",
            "self_attn.compressor.indexer.kv_norm.",
        ),
        (
            "attn.indexer.wq_b.",
            "self_attn.compressor.indexer.q_b_proj.",
        ),
        (
            "attn.indexer.weights_proj.",
            "self_attn.compressor.indexer.scorer.weights_proj.",
        ),
        ("attn.compressor.wkv.", "self_attn.compressor.kv_proj."),
        ("attn.compressor.wgate.", "self_attn.compressor.gate_proj."),
        ("attn.compressor.ape", "self_attn.compressor.position_bias"),
        ("attn.compressor.norm.", "self_attn.compressor.kv_norm."),
        ("attn.wq_a.", "self_attn.q_a_proj."),
        ("attn.q_norm.", "self_attn.q_a_norm."),
        ("attn.wq_b.", "self_attn.q_b_proj."),
        ("attn.wkv.", "self_attn.kv_proj."),
        ("attn.kv_norm.", "self_attn.kv_norm."),
        ("attn.wo_a.", "self_attn.o_a_proj."),
        ("attn.wo_b.", "self_attn.o_b_proj."),
        ("attn.attn_sink", "self_attn.sinks"),
        ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
        ("ffn.gate.", "mlp.gate."),
        ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
        ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
        ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
    ];
    for (from, to) in renames {
        if let Some(leaf) = tail.strip_prefix(from) {
            let leaf = if leaf == "scale" {
                "weight_scale_inv"
            } else {
                leaf
            };
            return format!("model.layers.{layer}.{to}{leaf}");
        }
    }
    format!("model.layers.{layer}.{tail}")
}

/// transformers' in-memory names: the release list renamed, with each
/// layer's routed experts fused into `gate_up_proj` [E, 2I, D] (all w1 rows,
/// then all w3 rows, per expert) and `down_proj` [E, D, I].
fn dsv4_hf(cfg: &ModelConfig) -> Result<Vec<Expected>, String> {
    let v = dsv4(cfg);
    if v.fp4_experts {
        return Err("FP4 routed experts are only supported in the DeepSeek V4 release naming (transformers fuses experts into one tensor per layer)".into());
    }
    let moe = cfg.moe.as_ref().expect("deepseek_v4 is MoE");
    let (e, i, d) = (moe.num_experts, moe.moe_intermediate_size, cfg.hidden_size);
    let mut out = Vec::new();
    for x in dsv4_release(cfg) {
        if x.name.contains(".ffn.experts.") {
            // Emit the fused pair once per layer, at its first expert.
            if let Some(prefix) = x.name.strip_suffix(".ffn.experts.0.w1.weight") {
                let l = prefix.trim_start_matches("layers.");
                if v.fp8_dense {
                    return Err(
                        "FP8 routed experts are only supported in the DeepSeek V4 release naming"
                            .into(),
                    );
                }
                out.push(float(
                    format!("model.layers.{l}.mlp.experts.gate_up_proj"),
                    &[e, 2 * i, d],
                ));
                out.push(float(
                    format!("model.layers.{l}.mlp.experts.down_proj"),
                    &[e, d, i],
                ));
            }
            continue;
        }
        let name = dsv4_release_to_hf(&x.name);
        let kind = match x.kind {
            Kind::Fp8 { scale, block } => Kind::Fp8 {
                scale: dsv4_release_to_hf(&scale),
                block,
            },
            Kind::Fp4 { scale } => Kind::Fp4 {
                scale: dsv4_release_to_hf(&scale),
            },
            Kind::Scale { of } => Kind::Scale {
                of: dsv4_release_to_hf(&of),
            },
            other => other,
        };
        out.push(Expected {
            name,
            shape: x.shape,
            kind,
        });
    }
    Ok(out)
}
