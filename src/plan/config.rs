//! Typed model configs for the families bespoke runs, parsed from config.json
//! with the defaults transformers applies. Shared by build.rs and the binary.

use super::json::{ConfigError, Fields};
use serde_json::Value;

/// The model families bespoke knows. Anything else is refused by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama, SmolLM2 (`llama`) and Qwen2 (`qwen2`).
    Llama,
    Qwen3,
    Qwen3Moe,
    DeepseekV4,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::DeepseekV4 => "deepseek_v4",
        }
    }
}

/// `model_type` values accepted, with their family.
pub const MODEL_TYPES: &[(&str, Family)] = &[
    ("llama", Family::Llama),
    ("qwen2", Family::Llama),
    ("qwen3", Family::Qwen3),
    ("qwen3_moe", Family::Qwen3Moe),
    ("deepseek_v4", Family::DeepseekV4),
];

/// Storage dtype of the dense (unquantized) weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseDtype {
    F32,
    Bf16,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub moe_intermediate_size: usize,
    pub n_shared_experts: usize,
    /// Layers that use a dense MLP instead of experts.
    pub dense_layers: Vec<usize>,
    pub norm_topk_prob: bool,
}

/// DeepSeek V4 specifics (attention LoRA ranks, compression, hyper-connections).
#[derive(Debug, Clone, PartialEq)]
pub struct Dsv4Config {
    pub q_lora_rank: usize,
    pub o_lora_rank: usize,
    pub o_groups: usize,
    pub qk_rope_head_dim: usize,
    pub sliding_window: usize,
    pub compress_ratios: Vec<usize>,
    /// The ratio that marks a compressed-sparse (indexer) layer; other
    /// nonzero ratios are heavily compressed.
    pub csa_ratio: usize,
    pub compress_rope_theta: f64,
    pub num_hash_layers: usize,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f64,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub routed_scaling_factor: f64,
    pub swiglu_limit: f64,
    /// Block size of the FP8 dense weights' scales (rows, cols).
    pub fp8_block: (usize, usize),
    /// Dense projections stored as FP8 E4M3 with UE8M0 block scales
    /// (quantization_config present); otherwise in `dense_dtype`.
    pub fp8_dense: bool,
    /// Routed experts stored as FP4 E2M1 (needs fp8_dense: the FP4 release).
    pub fp4_experts: bool,
}

/// RoPE frequency scaling (`rope_scaling` in transformers 4 configs,
/// `rope_parameters` in transformers 5). For deepseek_v4 it applies to the
/// compressed layers' rope only (transformers' "compress" table).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Dynamic {
        factor: f64,
    },
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Where it was read from (for messages).
    pub source: String,
    pub model_type: String,
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub bos_token_id: Option<u32>,
    /// One or more end-of-sequence ids (config.json may give a list).
    pub eos_token_ids: Vec<u32>,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub sliding_window: Option<usize>,
    pub dense_dtype: DenseDtype,
    pub moe: Option<MoeConfig>,
    pub dsv4: Option<Dsv4Config>,
}

const MAX_DIM: usize = 1 << 24;
const MAX_VOCAB: usize = 1 << 24;
const MAX_LAYERS: usize = 1024;

impl ModelConfig {
    /// Parse config.json text. `source` names the file in errors.
    pub fn from_json_str(source: &str, text: &str) -> Result<ModelConfig, ConfigError> {
        let root: Value = serde_json::from_str(text).map_err(|e| ConfigError {
            file: source.into(),
            field: String::new(),
            message: format!("not valid JSON: {e}"),
        })?;
        Self::from_json(source, &root)
    }

    pub fn from_json(source: &str, root: &Value) -> Result<ModelConfig, ConfigError> {
        let f = Fields::new(source, root)?;
        let model_type = f.string("model_type")?.ok_or_else(|| {
            f.err(
                "model_type",
                "required field is missing (it names the architecture, e.g. \"llama\")",
            )
        })?;
        let family = MODEL_TYPES
            .iter()
            .find(|(name, _)| *name == model_type)
            .map(|(_, fam)| *fam)
            .ok_or_else(|| {
                let known: Vec<&str> = MODEL_TYPES.iter().map(|(n, _)| *n).collect();
                f.err(
                    "model_type",
                    format!(
                        "unknown model type {model_type:?}; bespoke supports {}",
                        known.join(", ")
                    ),
                )
            })?;
        match family {
            Family::DeepseekV4 => parse_dsv4(&f, model_type),
            _ => parse_llama_like(&f, model_type, family),
        }
    }

    /// Total linear-layer parameters of the attention projections per layer etc.
    /// are derived in `plan::matrices`; this is just the family label.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} ({}): {} layers, hidden {}, {} heads / {} kv heads × {}, vocab {}",
            self.model_type,
            self.family.name(),
            self.num_layers,
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size
        );
        if let Some(m) = &self.moe {
            s += &format!(
                ", {} experts top-{} × {}",
                m.num_experts, m.top_k, m.moe_intermediate_size
            );
        }
        s
    }
}

fn dense_dtype(f: &Fields) -> Result<DenseDtype, ConfigError> {
    // transformers ≥ 4.56 writes `dtype`, older versions `torch_dtype`.
    let (field, value) = match (f.string("dtype")?, f.string("torch_dtype")?) {
        (Some(v), _) => ("dtype", v),
        (None, Some(v)) => ("torch_dtype", v),
        (None, None) => return Ok(DenseDtype::Bf16),
    };
    match value {
        "bfloat16" => Ok(DenseDtype::Bf16),
        "float32" => Ok(DenseDtype::F32),
        other => Err(f.err(field, format!("weights of dtype {other:?} are not supported (expected \"bfloat16\" or \"float32\")"))),
    }
}

/// Fields common to every family: sizes, heads, head_dim, vocab.
struct Common {
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    max_pos: usize,
    eps: f64,
    rope_theta: f64,
    tie: bool,
    bos: Option<u32>,
    eos: Vec<u32>,
}

struct Defaults {
    vocab: usize,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    max_pos: usize,
    eps: f64,
    /// None: hidden_size / num_attention_heads.
    head_dim: Option<usize>,
    /// None: num_attention_heads.
    kv_heads: Option<usize>,
    tie: bool,
}

// transformers' defaults per configuration class.
const LLAMA_DEFAULTS: Defaults = Defaults {
    vocab: 32000,
    hidden: 4096,
    inter: 11008,
    layers: 32,
    heads: 32,
    max_pos: 2048,
    eps: 1e-6,
    head_dim: None,
    kv_heads: None,
    tie: false,
};
const QWEN2_DEFAULTS: Defaults = Defaults {
    vocab: 151936,
    inter: 22016,
    max_pos: 32768,
    ..LLAMA_DEFAULTS
};
const QWEN3_DEFAULTS: Defaults = Defaults {
    head_dim: Some(128),
    ..QWEN2_DEFAULTS
};
const QWEN3_MOE_DEFAULTS: Defaults = Defaults {
    hidden: 2048,
    inter: 6144,
    layers: 24,
    ..QWEN2_DEFAULTS
};
const DSV4_DEFAULTS: Defaults = Defaults {
    vocab: 129280,
    inter: 2048,
    layers: 43,
    heads: 64,
    max_pos: 1048576,
    head_dim: Some(512),
    kv_heads: Some(1),
    ..LLAMA_DEFAULTS
};

fn parse_common(f: &Fields, d: &Defaults) -> Result<Common, ConfigError> {
    let hidden = f.usize("hidden_size", Some(d.hidden), 1, MAX_DIM)?;
    let inter = f.usize("intermediate_size", Some(d.inter), 1, MAX_DIM)?;
    let layers = f.usize("num_hidden_layers", Some(d.layers), 1, MAX_LAYERS)?;
    let heads = f.usize("num_attention_heads", Some(d.heads), 1, 4096)?;
    let kv_heads = f.usize(
        "num_key_value_heads",
        Some(d.kv_heads.unwrap_or(heads)),
        1,
        4096,
    )?;
    if heads % kv_heads != 0 {
        return Err(f.err(
            "num_key_value_heads",
            format!("{kv_heads} does not divide num_attention_heads = {heads} (each KV head must serve a whole group of query heads)"),
        ));
    }
    let head_dim = match f.opt_usize("head_dim", 1, 65536)? {
        Some(h) => h,
        None => match d.head_dim {
            Some(h) => h,
            None => {
                if hidden % heads != 0 {
                    return Err(f.err(
                        "head_dim",
                        format!("absent, and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"),
                    ));
                }
                hidden / heads
            }
        },
    };
    let vocab = f.usize("vocab_size", Some(d.vocab), 1, MAX_VOCAB)?;
    let max_pos = f.usize("max_position_embeddings", Some(d.max_pos), 1, 1 << 31)?;
    let eps = f.float("rms_norm_eps", Some(d.eps), 0.0, 1.0)?;
    let rope_theta = rope_theta(f)?;
    let tie = f.boolean("tie_word_embeddings", d.tie)?;
    if head_dim % 2 != 0 {
        return Err(f.err(
            "head_dim",
            format!("{head_dim} is odd; RoPE rotates dimension pairs"),
        ));
    }
    let bos = f.token_ids("bos_token_id", vocab)?.first().copied();
    let eos = f.token_ids("eos_token_id", vocab)?;
    Ok(Common {
        hidden,
        inter,
        layers,
        heads,
        kv_heads,
        head_dim,
        vocab,
        max_pos,
        eps,
        rope_theta,
        tie,
        bos,
        eos,
    })
}

/// The scaling object: `rope_scaling` (legacy), else `rope_parameters`
/// (transformers 5; for deepseek_v4 its "compress" entry).
fn rope_scaling(f: &Fields, max_pos: usize) -> Result<RopeScaling, ConfigError> {
    let obj = match f.nested("rope_scaling")? {
        Some(o) => o,
        None => match f.nested("rope_parameters")? {
            Some(rp) => match rp.nested("compress")? {
                Some(c) => c,
                None => rp,
            },
            None => return Ok(RopeScaling::None),
        },
    };
    let kind = match (obj.string("rope_type")?, obj.string("type")?) {
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) => "default",
    };
    let factor = || obj.float("factor", None, 1e-6, 1e6);
    let orig = || {
        obj.usize(
            "original_max_position_embeddings",
            Some(max_pos),
            1,
            1 << 31,
        )
    };
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "dynamic" => RopeScaling::Dynamic { factor: factor()? },
        "yarn" => RopeScaling::Yarn {
            factor: factor()?,
            original_max_position_embeddings: orig()?,
            beta_fast: obj.float("beta_fast", Some(32.0), 0.0, 1e6)?,
            beta_slow: obj.float("beta_slow", Some(1.0), 0.0, 1e6)?,
            mscale: obj.opt_float("mscale", 0.0, 1e6)?,
            mscale_all_dim: obj.opt_float("mscale_all_dim", 0.0, 1e6)?,
            attention_factor: obj.opt_float("attention_factor", 0.0, 1e6)?,
        },
        "llama3" => {
            let low = obj.float("low_freq_factor", None, 1e-6, 1e6)?;
            let high = obj.float("high_freq_factor", None, 1e-6, 1e6)?;
            if high <= low {
                return Err(obj.err(
                    "high_freq_factor",
                    format!("must be greater than low_freq_factor ({low}), found {high}"),
                ));
            }
            RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: orig()?,
            }
        }
        other => {
            return Err(obj.err(
                "rope_type",
                format!("RoPE scaling {other:?} is not supported (supported: default, linear, dynamic, yarn, llama3)"),
            ))
        }
    })
}

/// rope_theta lives at the top level (transformers 4.x) or in
/// rope_parameters (transformers 5).
fn rope_theta(f: &Fields) -> Result<f64, ConfigError> {
    if let Some(t) = f.opt_float("rope_theta", 1e-3, 1e12)? {
        return Ok(t);
    }
    if let Some(rp) = f.nested("rope_parameters")? {
        if let Some(t) = rp.opt_float("rope_theta", 1e-3, 1e12)? {
            return Ok(t);
        }
        // deepseek_v4 in transformers 5: {"main": {...}, "compress": {...}}.
        if let Some(main) = rp.nested("main")? {
            if let Some(t) = main.opt_float("rope_theta", 1e-3, 1e12)? {
                return Ok(t);
            }
        }
    }
    Ok(10000.0)
}

fn parse_llama_like(
    f: &Fields,
    model_type: &str,
    family: Family,
) -> Result<ModelConfig, ConfigError> {
    if f.get("quantization_config").is_some() {
        return Err(f.err(
            "quantization_config",
            format!("quantized {model_type} checkpoints are not supported; use the bfloat16 or float32 release"),
        ));
    }
    let d = match (model_type, family) {
        ("qwen2", _) => QWEN2_DEFAULTS,
        (_, Family::Qwen3) => QWEN3_DEFAULTS,
        (_, Family::Qwen3Moe) => QWEN3_MOE_DEFAULTS,
        _ => LLAMA_DEFAULTS,
    };
    let c = parse_common(f, &d)?;
    // Qwen2 always has q/k/v biases; the others only when attention_bias is set.
    let attention_bias = model_type == "qwen2" || f.boolean("attention_bias", false)?;
    let sliding_window = match model_type {
        "qwen2" | "qwen3" | "qwen3_moe" if f.boolean("use_sliding_window", false)? => {
            Some(f.usize("sliding_window", Some(4096), 1, 1 << 31)?)
        }
        _ => None,
    };
    let moe = if family == Family::Qwen3Moe {
        let num_experts = f.usize("num_experts", Some(128), 1, 65536)?;
        let top_k = f.usize("num_experts_per_tok", Some(8), 1, num_experts)?;
        let moe_inter = f.usize("moe_intermediate_size", Some(768), 1, MAX_DIM)?;
        let step = f.usize("decoder_sparse_step", Some(1), 1, MAX_LAYERS)?;
        let mlp_only = f
            .usize_list("mlp_only_layers", 0, c.layers - 1)?
            .unwrap_or_default();
        // transformers: a layer is sparse when it is not in mlp_only_layers,
        // num_experts > 0 and (layer_idx + 1) % decoder_sparse_step == 0.
        let dense_layers = (0..c.layers)
            .filter(|l| mlp_only.contains(l) || (l + 1) % step != 0)
            .collect();
        Some(MoeConfig {
            num_experts,
            top_k,
            moe_intermediate_size: moe_inter,
            n_shared_experts: 0,
            dense_layers,
            norm_topk_prob: f.boolean("norm_topk_prob", false)?,
        })
    } else {
        None
    };
    Ok(ModelConfig {
        source: f.file.into(),
        model_type: model_type.into(),
        family,
        hidden_size: c.hidden,
        intermediate_size: c.inter,
        num_layers: c.layers,
        num_heads: c.heads,
        num_kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        vocab_size: c.vocab,
        max_position_embeddings: c.max_pos,
        rms_norm_eps: c.eps,
        rope_theta: c.rope_theta,
        rope_scaling: rope_scaling(f, c.max_pos)?,
        bos_token_id: c.bos,
        eos_token_ids: c.eos.clone(),
        tie_word_embeddings: c.tie,
        attention_bias,
        sliding_window,
        dense_dtype: dense_dtype(f)?,
        moe,
        dsv4: None,
    })
}

fn parse_dsv4(f: &Fields, model_type: &str) -> Result<ModelConfig, ConfigError> {
    let d = DSV4_DEFAULTS;
    let c = parse_common(f, &d)?;
    if c.kv_heads != 1 {
        return Err(f.err(
            "num_key_value_heads",
            format!("deepseek_v4 has one shared K=V head, found {}", c.kv_heads),
        ));
    }
    let num_experts = match f.opt_usize("n_routed_experts", 1, 65536)? {
        Some(n) => n,
        None => f.usize("num_local_experts", Some(256), 1, 65536)?,
    };
    let top_k = f.usize("num_experts_per_tok", Some(6), 1, num_experts)?;
    // transformers aliases intermediate_size to moe_intermediate_size here.
    let moe_inter = match f.opt_usize("moe_intermediate_size", 1, MAX_DIM)? {
        Some(n) => n,
        None => f.usize("intermediate_size", Some(2048), 1, MAX_DIM)?,
    };
    let n_shared = f.usize("n_shared_experts", Some(1), 0, 64)?;
    // Legacy key, else transformers 5's partial_rotary_factor of the main rope.
    let from_factor = match f
        .nested("rope_parameters")?
        .map(|rp| rp.nested("main"))
        .transpose()?
        .flatten()
    {
        Some(main) => main
            .opt_float("partial_rotary_factor", 0.0, 1.0)?
            .map(|p| (p * c.head_dim as f64).round() as usize),
        None => None,
    };
    let qk_rope_head_dim = f.usize(
        "qk_rope_head_dim",
        Some(from_factor.unwrap_or(64)),
        0,
        c.head_dim,
    )?;
    if qk_rope_head_dim % 2 != 0 {
        return Err(f.err(
            "qk_rope_head_dim",
            format!("must be even (rotated in pairs), found {qk_rope_head_dim}"),
        ));
    }
    let q_lora_rank = f.usize("q_lora_rank", Some(1024), 1, MAX_DIM)?;
    let o_lora_rank = f.usize("o_lora_rank", Some(1024), 1, MAX_DIM)?;
    let o_groups = f.usize("o_groups", Some(8), 1, c.heads)?;
    if c.heads % o_groups != 0 {
        return Err(f.err(
            "o_groups",
            format!(
                "{o_groups} does not divide num_attention_heads = {}",
                c.heads
            ),
        ));
    }
    let sliding_window = f.usize("sliding_window", Some(128), 1, 1 << 31)?;
    let compress_ratios = dsv4_compress_ratios(f, c.layers)?;
    let csa_ratio = dsv4_csa_ratio(f)?;
    let num_hash_layers = match f.opt_usize("num_hash_layers", 0, c.layers)? {
        Some(n) => n,
        None => match f.get("mlp_layer_types") {
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .filter(|v| v.as_str() == Some("hash_moe"))
                .count(),
            Some(_) => return Err(f.err("mlp_layer_types", "expected a list of strings")),
            None => 3.min(c.layers),
        },
    };
    let compress_rope_theta = f.float("compress_rope_theta", Some(160000.0), 1e-3, 1e12)?;
    let hc_mult = f.usize("hc_mult", Some(4), 1, 64)?;
    let hc_sinkhorn_iters = f.usize("hc_sinkhorn_iters", Some(20), 0, 10000)?;
    let hc_eps = f.float("hc_eps", Some(1e-6), 0.0, 1.0)?;
    let index_n_heads = f.usize("index_n_heads", Some(64), 1, 4096)?;
    let index_head_dim = f.usize("index_head_dim", Some(128), 1, 65536)?;
    let index_topk = f.usize("index_topk", Some(512), 1, 1 << 24)?;
    if qk_rope_head_dim > index_head_dim {
        return Err(f.err(
            "index_head_dim",
            format!("{index_head_dim} is smaller than qk_rope_head_dim = {qk_rope_head_dim} (the indexer ropes its last rope dims)"),
        ));
    }
    let routed_scaling_factor = f.float("routed_scaling_factor", Some(1.5), 0.0, 1e6)?;
    let swiglu_limit = f.float("swiglu_limit", Some(10.0), 0.0, 1e9)?;

    // Quantization: FP8 E4M3 dense weights with UE8M0 block scales; experts
    // FP4 unless expert_dtype says fp8. Absent: an unquantized checkpoint.
    let mut fp8_block = (128, 128);
    let mut fp4_experts = false;
    let mut dense_dtype_v = dense_dtype(f)?;
    if let Some(q) = f.nested("quantization_config")? {
        if let Some(fmt) = q.string("fmt")? {
            if fmt != "e4m3" {
                return Err(q.err("fmt", format!("expected \"e4m3\", found {fmt:?}")));
            }
        }
        if let Some(sf) = q.string("scale_fmt")? {
            if sf != "ue8m0" {
                return Err(q.err(
                    "scale_fmt",
                    format!("expected \"ue8m0\" (power-of-two scales), found {sf:?}"),
                ));
            }
        }
        if let Some(b) = q.usize_list("weight_block_size", 1, 65536)? {
            if b.len() != 2 {
                return Err(q.err(
                    "weight_block_size",
                    format!(
                        "expected two numbers [rows, cols], found {} entries",
                        b.len()
                    ),
                ));
            }
            fp8_block = (b[0], b[1]);
            if fp8_block != (128, 128) {
                return Err(q.err(
                    "weight_block_size",
                    format!("expected [128, 128] (the block size of the released checkpoints), found {b:?}"),
                ));
            }
        }
        let expert_dtype = match q.string("expert_dtype")? {
            Some(e) => Some(e),
            None => f.string("expert_dtype")?,
        };
        fp4_experts = match expert_dtype {
            None | Some("fp4") => true,
            Some("fp8") => false,
            Some(other) => {
                return Err(f.err(
                    "expert_dtype",
                    format!("expected \"fp4\" or \"fp8\", found {other:?}"),
                ));
            }
        };
        dense_dtype_v = DenseDtype::Bf16;
    }
    let quantized = f.get("quantization_config").is_some();
    if quantized && fp4_experts {
        // FP4 scales cover 32 input columns: both expert input widths must be whole blocks.
        for (field, n) in [
            ("hidden_size", c.hidden),
            ("moe_intermediate_size", moe_inter),
        ] {
            if n % 32 != 0 {
                return Err(f.err(
                    field,
                    format!("{n} is not a multiple of 32, the FP4 expert scale block"),
                ));
            }
        }
    }
    let dense_layers = Vec::new();
    Ok(ModelConfig {
        source: f.file.into(),
        model_type: model_type.into(),
        family: Family::DeepseekV4,
        hidden_size: c.hidden,
        intermediate_size: c.inter,
        num_layers: c.layers,
        num_heads: c.heads,
        num_kv_heads: 1,
        head_dim: c.head_dim,
        vocab_size: c.vocab,
        max_position_embeddings: c.max_pos,
        rms_norm_eps: c.eps,
        rope_theta: c.rope_theta,
        rope_scaling: dsv4_rope_scaling(f, c.max_pos)?,
        bos_token_id: c.bos,
        eos_token_ids: c.eos.clone(),
        tie_word_embeddings: c.tie,
        attention_bias: false,
        sliding_window: Some(sliding_window),
        dense_dtype: dense_dtype_v,
        moe: Some(MoeConfig {
            num_experts,
            top_k,
            moe_intermediate_size: moe_inter,
            n_shared_experts: n_shared,
            dense_layers,
            norm_topk_prob: true,
        }),
        dsv4: Some(Dsv4Config {
            q_lora_rank,
            o_lora_rank,
            o_groups,
            qk_rope_head_dim,
            sliding_window,
            compress_ratios,
            csa_ratio,
            compress_rope_theta,
            num_hash_layers,
            hc_mult,
            hc_sinkhorn_iters,
            hc_eps,
            index_n_heads,
            index_head_dim,
            index_topk,
            routed_scaling_factor,
            swiglu_limit,
            fp8_block,
            fp8_dense: quantized,
            fp4_experts: quantized && fp4_experts,
        }),
    })
}

/// The compress rope's scaling. transformers builds the "compress" table
/// from a legacy (or flat) `rope_scaling` and then defaults YaRN's
/// `attention_factor` to 1.0 (the V4 reference does not scale cos/sin by
/// YaRN's mscale); an already nested `rope_parameters.compress` is taken as
/// written.
fn dsv4_rope_scaling(f: &Fields, max_pos: usize) -> Result<RopeScaling, ConfigError> {
    let mut s = rope_scaling(f, max_pos)?;
    let nested = match f.nested("rope_parameters")? {
        Some(rp) => rp.nested("main")?.is_some() && rp.nested("compress")?.is_some(),
        None => false,
    };
    if let RopeScaling::Yarn {
        attention_factor: a @ None,
        ..
    } = &mut s
    {
        if !nested {
            *a = Some(1.0);
        }
    }
    Ok(s)
}

/// The compressed-sparse-attention rate (`compress_rates` in transformers 5;
/// the released checkpoints use 4).
fn dsv4_csa_ratio(f: &Fields) -> Result<usize, ConfigError> {
    match f.nested("compress_rates")? {
        Some(cr) => cr.usize("compressed_sparse_attention", Some(4), 2, 1 << 20),
        None => Ok(4),
    }
}

/// Per-layer compression ratio (0 = sliding window only). Real checkpoints
/// carry `compress_ratios` (one per layer plus the MTP layer); transformers 5
/// writes `layer_types` with `compress_rates`.
fn dsv4_compress_ratios(f: &Fields, layers: usize) -> Result<Vec<usize>, ConfigError> {
    if let Some(r) = f.usize_list("compress_ratios", 0, 1 << 20)? {
        if r.len() < layers {
            return Err(f.err(
                "compress_ratios",
                format!(
                    "has {} entries, expected one per layer ({layers} layers)",
                    r.len()
                ),
            ));
        }
        for (i, &ratio) in r[..layers].iter().enumerate() {
            if ratio == 1 {
                return Err(f.err(
                    &format!("compress_ratios[{i}]"),
                    "a ratio of 1 compresses nothing; expected 0 or >= 2",
                ));
            }
        }
        return Ok(r[..layers].to_vec());
    }
    let csa = dsv4_csa_ratio(f)?;
    let hca = match f.nested("compress_rates")? {
        Some(cr) => cr.usize("heavily_compressed_attention", Some(128), 2, 1 << 20)?,
        None => 128,
    };
    match f.get("layer_types") {
        Some(serde_json::Value::Array(items)) => {
            if items.len() < layers {
                return Err(f.err("layer_types", format!("has {} entries, expected one per layer ({layers})", items.len())));
            }
            items[..layers]
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("sliding_attention") => Ok(0),
                    Some("compressed_sparse_attention") => Ok(csa),
                    Some("heavily_compressed_attention") => Ok(hca),
                    _ => Err(f.err(
                        &format!("layer_types[{i}]"),
                        "expected \"sliding_attention\", \"compressed_sparse_attention\" or \"heavily_compressed_attention\"",
                    )),
                })
                .collect()
        }
        Some(_) => Err(f.err("layer_types", "expected a list of strings")),
        None => Err(f.err(
            "compress_ratios",
            "missing (and no layer_types): the per-layer attention kinds cannot be guessed reliably",
        )),
    }
}
