//! `bespoke inspect`: what a model directory holds and how bespoke reads it.

use crate::model::layout::Kind;
use crate::model::ModelDir;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write;

/// Human-readable byte count (binary units).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

fn config_lines(m: &ModelDir) -> Vec<(String, String)> {
    let c = &m.config;
    let mut v = vec![
        (
            "family".to_string(),
            format!("{} (model_type {:?})", c.family.name(), c.model_type),
        ),
        ("layers".into(), c.num_layers.to_string()),
        ("hidden".into(), c.hidden_size.to_string()),
        (
            "attention".into(),
            format!(
                "{} heads, {} kv heads, head_dim {}",
                c.num_heads, c.num_kv_heads, c.head_dim
            ),
        ),
        ("vocab".into(), c.vocab_size.to_string()),
        ("context".into(), c.max_position_embeddings.to_string()),
        ("rope_theta".into(), c.rope_theta.to_string()),
        ("tied head".into(), c.tie_word_embeddings.to_string()),
    ];
    if let Some(moe) = &c.moe {
        v.push((
            "experts".into(),
            format!(
                "{} routed top-{} x {} wide, {} shared, {} dense layers",
                moe.num_experts,
                moe.top_k,
                moe.moe_intermediate_size,
                moe.n_shared_experts,
                moe.dense_layers.len()
            ),
        ));
    } else {
        v.push((
            "mlp".into(),
            format!("intermediate {}", c.intermediate_size),
        ));
    }
    if let Some(d) = &c.dsv4 {
        let kinds: Vec<String> = (0..c.num_layers)
            .map(|l| match crate::model::layout::dsv4_attn_kind(d, l) {
                crate::model::layout::AttnKind::Sliding => "S".to_string(),
                crate::model::layout::AttnKind::Csa => format!("C{}", d.compress_ratios[l]),
                crate::model::layout::AttnKind::Hca => format!("H{}", d.compress_ratios[l]),
            })
            .collect();
        v.push((
            "attn layers".into(),
            format!(
                "{} (S sliding, C compressed-sparse, H heavily compressed; number = rate)",
                kinds.join(" ")
            ),
        ));
        v.push((
            "deepseek_v4".into(),
            format!(
                "q_lora {}, o_lora {} x {} groups, rope dims {}, window {}, hc {} x {} iters, indexer {} heads x {} top-{}, {} hash layers",
                d.q_lora_rank,
                d.o_lora_rank,
                d.o_groups,
                d.qk_rope_head_dim,
                d.sliding_window,
                d.hc_mult,
                d.hc_sinkhorn_iters,
                d.index_n_heads,
                d.index_head_dim,
                d.index_topk,
                d.num_hash_layers
            ),
        ));
        v.push((
            "quantization".into(),
            match (d.fp8_dense, d.fp4_experts) {
                (true, true) => {
                    "FP8 E4M3 dense (UE8M0 128x128), FP4 E2M1 experts (UE8M0 per 32)".into()
                }
                (true, false) => "FP8 E4M3 dense and experts (UE8M0 128x128)".into(),
                _ => "none".into(),
            },
        ));
    }
    v
}

/// The text report. `brief` leaves out the per-tensor table.
pub fn text(m: &ModelDir, brief: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "model       {}", m.dir.display());
    for (k, v) in config_lines(m) {
        let _ = writeln!(s, "{k:<11} {v}");
    }
    let _ = writeln!(s, "naming      {}", m.naming.describe());
    let total: u64 = m.weights.data_bytes();
    match &m.weights.index_file {
        Some(ix) => {
            let _ = writeln!(
                s,
                "weights     {} shards from {}, {} tensors, {}",
                m.weights.shards.len(),
                ix.file_name()
                    .map(|f| f.to_string_lossy())
                    .unwrap_or_default(),
                m.weights.len(),
                human_bytes(total)
            );
        }
        None => {
            let _ = writeln!(
                s,
                "weights     {} file(s), {} tensors, {}",
                m.weights.shards.len(),
                m.weights.len(),
                human_bytes(total)
            );
        }
    }
    for shard in &m.weights.shards {
        let _ = writeln!(
            s,
            "  shard     {} ({} tensors, {})",
            shard
                .path
                .file_name()
                .map(|f| f.to_string_lossy())
                .unwrap_or_default(),
            shard.header.tensors.len(),
            human_bytes(shard.header.data_len as u64)
        );
    }
    let _ = writeln!(s, "parameters  {}", human_count(m.parameters()));
    let _ = writeln!(s, "by format");
    let unused_bytes: u64 = m
        .unused()
        .iter()
        .filter_map(|n| m.weights.get(n))
        .map(|t| t.bytes.len() as u64)
        .sum();
    let mut rows = m.bytes_by_format();
    if unused_bytes > 0 {
        rows.push(("unused", unused_bytes));
    }
    for (label, bytes) in rows {
        let _ = writeln!(
            s,
            "  {label:<16} {:>12}  {:5.1}%",
            human_bytes(bytes),
            100.0 * bytes as f64 / total.max(1) as f64
        );
    }
    let _ = writeln!(s, "{}", alignment_line(m));
    match &m.tokenizer {
        Some(t) => {
            let specials: Vec<String> = t
                .special
                .iter()
                .map(|(k, v)| format!("{k} {v:?}"))
                .collect();
            let _ = writeln!(
                s,
                "tokenizer   {} tokens; {}; chat template: {}",
                t.vocab_size(),
                if specials.is_empty() {
                    "no special tokens named".into()
                } else {
                    specials.join(", ")
                },
                match &t.chat_template_source {
                    Some(p) => p
                        .file_name()
                        .map(|f| f.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    None => "none".into(),
                }
            );
        }
        None => {
            let _ = writeln!(
                s,
                "tokenizer   none (no tokenizer.json: prompts must be given as token ids)"
            );
        }
    }
    if let Some(g) = &m.generation {
        let mut parts = Vec::new();
        if !g.eos_token_ids.is_empty() {
            parts.push(format!("eos {:?}", g.eos_token_ids));
        }
        if let Some(v) = g.do_sample {
            parts.push(format!("do_sample {v}"));
        }
        if let Some(v) = g.temperature {
            parts.push(format!("temperature {v}"));
        }
        if let Some(v) = g.top_k {
            parts.push(format!("top_k {v}"));
        }
        if let Some(v) = g.top_p {
            parts.push(format!("top_p {v}"));
        }
        if let Some(v) = g.repetition_penalty {
            parts.push(format!("repetition_penalty {v}"));
        }
        if let Some(v) = g.max_new_tokens {
            parts.push(format!("max_new_tokens {v}"));
        }
        let text = if parts.is_empty() {
            "generation_config.json sets nothing bespoke uses".to_string()
        } else {
            parts.join(", ")
        };
        let _ = writeln!(s, "generation  {text}");
    }
    let unused = m.unused();
    if !unused.is_empty() {
        let mtp = unused.iter().filter(|n| n.starts_with("mtp.")).count();
        let note = if mtp > 0 {
            format!(" ({mtp} of them the MTP block, which bespoke does not run)")
        } else {
            String::new()
        };
        let _ = writeln!(s, "unused      {} tensors{note}", unused.len());
    }
    if !brief {
        let entries = m.entries();
        let w = entries
            .iter()
            .map(|e| e.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let _ = writeln!(
            s,
            "\n{:<w$}  {:<8} {:<18} read as",
            "tensor", "dtype", "shape"
        );
        for e in entries {
            let shape = format!("{:?}", e.shape);
            let role = match &e.kind {
                Some(k) => k.describe(e.dtype),
                None => "unused".into(),
            };
            let _ = writeln!(
                s,
                "{:<w$}  {:<8} {:<18} {}",
                e.name,
                e.dtype.name(),
                shape,
                role
            );
        }
    }
    s += "ok: every tensor the model needs is present with the expected dtype and shape\n";
    s
}

/// How many matrices (2-D tensors other than UE8M0 scales) the model has,
/// and of those whose data starts off a 64-byte line, how many at each
/// offset from the line. A mapping starts on a page, so the offset in the
/// file is the address's.
fn line_offsets(m: &ModelDir) -> (usize, BTreeMap<usize, usize>) {
    let mut matrices = 0;
    let mut off = BTreeMap::new();
    for name in m.weights.names() {
        let Some(t) = m.weights.get(name) else {
            continue;
        };
        if t.shape().len() != 2 || t.dtype() == crate::safetensors::Dtype::F8E8M0 {
            continue;
        }
        matrices += 1;
        let o = t.bytes.as_ptr() as usize % 64;
        if o != 0 {
            *off.entry(o).or_insert(0) += 1;
        }
    }
    (matrices, off)
}

/// One line on where the matrices start (see `line_offsets`).
fn alignment_line(m: &ModelDir) -> String {
    let (n, off) = line_offsets(m);
    let k: usize = off.values().sum();
    if k == 0 {
        return format!("alignment   all {n} matrices start on a 64-byte line");
    }
    // the commonest offsets first, three at most
    let mut by: Vec<(usize, usize)> = off.into_iter().collect();
    by.sort_by_key(|&(o, c)| (std::cmp::Reverse(c), o));
    let mut shown: Vec<String> = by
        .iter()
        .take(3)
        .map(|(o, c)| format!("{c} at +{o}"))
        .collect();
    if by.len() > 3 {
        shown.push(format!("{} more offsets", by.len() - 3));
    }
    format!(
        "alignment   {k} of {n} matrices start off a 64-byte line ({}); their row loads straddle lines, \
         which streamed matvec pays for (FP8 with 4 KiB rows: 15-21 % slower in `bench kernels --weight-offset 16`)",
        shown.join(", ")
    )
}

/// The FP8 (E4M3) codes of every F8_E4M3 tensor, by kind (`inspect
/// --fp8-codes`). Subnormal codes are what the FP8 "s" tiles turn into
/// f32 subnormals, which an Intel core multiplies at about 100 cycles a
/// vector (README, *What bounds each kernel*).
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Fp8Codes {
    pub tensors: usize,
    pub codes: u64,
    /// Magnitude 0 (±0).
    pub zero: u64,
    /// Magnitude 1..7: exponent field 0, mantissa not.
    pub subnormal: u64,
    /// Magnitude 127 (0x7F, 0xFF).
    pub nan: u64,
}

/// Count the codes of every F8_E4M3 tensor (reads all of them).
pub fn fp8_codes(m: &ModelDir) -> Fp8Codes {
    let mut c = Fp8Codes::default();
    let mut hist = [0u64; 256];
    for name in m.weights.names() {
        let Some(t) = m.weights.get(name) else {
            continue;
        };
        if t.dtype() != crate::safetensors::Dtype::F8E4M3 {
            continue;
        }
        c.tensors += 1;
        for &b in t.bytes {
            hist[b as usize] += 1;
        }
    }
    for (b, &n) in hist.iter().enumerate() {
        c.codes += n;
        match b & 0x7F {
            0 => c.zero += n,
            1..=7 => c.subnormal += n,
            0x7F => c.nan += n,
            _ => {}
        }
    }
    c
}

/// `fp8_codes` as a line for `inspect --fp8-codes`.
pub fn fp8_codes_line(c: &Fp8Codes) -> String {
    if c.tensors == 0 {
        return "fp8 codes   no F8_E4M3 tensor".to_string();
    }
    let per = |n: u64| n as f64 / c.codes.max(1) as f64 * 1e4;
    format!(
        "fp8 codes   {} in {} tensors: {} subnormal ({:.2} in 10^4), {} zero ({:.2} in 10^4), {} NaN. \
         From about 3 subnormal in 10^4 the AVX-512 \"p\" tiles (BESPOKE_FP8_SCALED=off, the default on Intel cores) are the faster",
        human_count(c.codes),
        c.tensors,
        c.subnormal,
        per(c.subnormal),
        c.zero,
        per(c.zero),
        c.nan
    )
}

pub fn json(m: &ModelDir) -> Value {
    let tensors: Vec<Value> = m
        .entries()
        .into_iter()
        .map(|e| {
            json!({
                "name": e.name,
                "dtype": e.dtype.name(),
                "shape": e.shape,
                "bytes": e.bytes,
                "shard": e.shard,
                "read_as": e.kind.as_ref().map(|k: &Kind| k.describe(e.dtype)),
            })
        })
        .collect();
    let (matrices, off_line) = line_offsets(m);
    let config: serde_json::Map<String, Value> = config_lines(m)
        .into_iter()
        .map(|(k, v)| (k, Value::String(v)))
        .collect();
    json!({
        "model": m.dir.display().to_string(),
        "family": m.config.family.name(),
        "model_type": m.config.model_type,
        "naming": m.naming.describe(),
        "config": config,
        "parameters": m.parameters(),
        "bytes": m.weights.data_bytes(),
        "bytes_by_format": m.bytes_by_format().into_iter().map(|(k, v)| json!({"format": k, "bytes": v})).collect::<Vec<_>>(),
        "shards": m.weights.shards.iter().map(|s| s.path.display().to_string()).collect::<Vec<_>>(),
        "tokenizer": m.tokenizer.as_ref().map(|t| json!({"vocab": t.vocab_size(), "chat_template": t.chat_template.is_some()})),
        "unused": m.unused(),
        "matrices": {
            "count": matrices,
            "off_line_by_offset": off_line.into_iter().map(|(o, c)| (o.to_string(), json!(c))).collect::<serde_json::Map<_, _>>(),
        },
        "tensors": tensors,
    })
}
