//! `bespoke bench compare A.json B.json`: the ratio table between two runs of
//! `bench kernels` (or two of `bench e2e`) — two builds, two machines, two
//! commits. Rows are matched on what identifies a measurement; a row found in
//! only one file is listed, not guessed at.

use serde_json::Value;
use std::fmt::Write as _;
use std::path::Path;

/// What a results file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Kernels,
    E2e,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Kernels => "`bench kernels`",
            Kind::E2e => "`bench e2e`",
        }
    }
}

/// A results file, read and classified.
pub struct Run {
    pub label: String,
    pub kind: Kind,
    pub v: Value,
}

pub fn load(path: &Path) -> Result<Run, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
    let kind = if v["kernels"].is_array() {
        Kind::Kernels
    } else if v["runs"].is_array() {
        Kind::E2e
    } else {
        return Err(format!(
            "{}: not a `bespoke bench kernels --json` or `bench e2e --json` file \
             (expected a \"kernels\" or a \"runs\" array)",
            path.display()
        ));
    };
    Ok(Run {
        label: path.display().to_string(),
        kind,
        v,
    })
}

fn num(v: &Value, field: &str, what: &str) -> Result<f64, String> {
    v[field]
        .as_f64()
        .ok_or_else(|| format!("{what}: field {field:?} missing or not a number"))
}

fn text(v: &Value, field: &str) -> String {
    match &v[field] {
        Value::String(s) => s.clone(),
        Value::Null => "?".into(),
        other => other.to_string(),
    }
}

/// One kernel row's identity: format, rows×cols (×tokens past 1; attention: heads/KV heads×head_dim @positions), isa,
/// kernel, threads, residency. Files from before `--tokens` have no tokens
/// field: they timed one token.
fn kernel_key(k: &Value) -> String {
    let tokens = match &k["tokens"] {
        Value::Null => "1".to_string(),
        _ => text(k, "tokens"),
    };
    let mut shape = format!("{}×{}", text(k, "rows"), text(k, "cols"));
    // Attention rows: heads×head_dim, then the KV heads and positions.
    if k["attn"].is_object() {
        shape = format!(
            "{}h/{}kv×{} @{}",
            text(k, "rows"),
            text(&k["attn"], "kv_heads"),
            text(k, "cols"),
            text(&k["attn"], "context")
        );
    }
    format!(
        "{:<7} {:>17} {:<7} {:<11} {:>2}t {:<6}",
        text(k, "format"),
        if tokens == "1" {
            shape
        } else {
            format!("{shape}×{tokens}")
        },
        text(k, "isa"),
        text(k, "kernel"),
        text(k, "threads"),
        text(k, "residency")
    )
}

fn machine_line(r: &Run) -> String {
    let m = &r.v["machine"];
    let cpu = if m.is_object() {
        text(m, "cpu")
    } else {
        text(&r.v, "cpu")
    };
    let (list, field) = match r.kind {
        Kind::Kernels => ("bandwidth", "gb_per_s"),
        Kind::E2e => ("runs", "read_gb_per_s"),
    };
    let bw: Vec<String> = r.v[list]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|b| {
                    format!(
                        "{}t {:.1} GB/s",
                        text(b, "threads"),
                        b[field].as_f64().unwrap_or(f64::NAN)
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    format!("{}: {cpu}; read bandwidth {}", r.label, bw.join(", "))
}

fn geomean(v: &[f64]) -> f64 {
    let ok: Vec<f64> = v
        .iter()
        .copied()
        .filter(|x| x.is_finite() && *x > 0.0)
        .collect();
    if ok.is_empty() {
        return f64::NAN;
    }
    (ok.iter().map(|x| x.ln()).sum::<f64>() / ok.len() as f64).exp()
}

/// The comparison as text: A is the baseline, ratios are B's speed over A's
/// (> 1: B is faster).
pub fn compare(a: &Run, b: &Run) -> Result<String, String> {
    if a.kind != b.kind {
        return Err(format!(
            "{} is a {} file and {} a {} file: compare like with like",
            a.label,
            a.kind.name(),
            b.label,
            b.kind.name()
        ));
    }
    let mut out = String::new();
    writeln!(out, "A = {}", machine_line(a)).unwrap();
    writeln!(out, "B = {}", machine_line(b)).unwrap();
    writeln!(out, "ratio = B's speed ÷ A's (> 1: B is faster)\n").unwrap();
    match a.kind {
        Kind::Kernels => compare_kernels(a, b, &mut out)?,
        Kind::E2e => compare_e2e(a, b, &mut out)?,
    }
    Ok(out)
}

fn compare_kernels(a: &Run, b: &Run, out: &mut String) -> Result<(), String> {
    let ka = a.v["kernels"].as_array().cloned().unwrap_or_default();
    let kb = b.v["kernels"].as_array().cloned().unwrap_or_default();
    writeln!(
        out,
        "{:<7} {:>17} {:<7} {:<11} {:>3} {:<6} {:>11} {:>11} {:>8} {:>8} {:>7} {:>7} {:>6}",
        "fmt",
        "shape",
        "isa",
        "kernel",
        "thr",
        "where",
        "A µs",
        "B µs",
        "A GB/s",
        "B GB/s",
        "A % bw",
        "B % bw",
        "ratio"
    )
    .unwrap();
    let mut ratios = Vec::new();
    let mut only_a = Vec::new();
    // (A's read, B's read) where a matched row's % bw is of different reads.
    let mut reads: Vec<(String, String)> = Vec::new();
    for x in &ka {
        let key = kernel_key(x);
        let Some(y) = kb.iter().find(|y| kernel_key(y) == key) else {
            only_a.push(key);
            continue;
        };
        let what_a = format!("{}: kernel {key}", a.label);
        let what_b = format!("{}: kernel {key}", b.label);
        let (ta, tb) = (num(x, "median_us", &what_a)?, num(y, "median_us", &what_b)?);
        let r = ta / tb;
        ratios.push(r);
        let (ra, rb) = (read_of(x), read_of(y));
        // "memory, 4 streams a thread" and "memory, 2 …" are the same kind.
        let kind = |r: &str| r.split([',', ' ']).next().unwrap_or_default().to_string();
        if kind(&ra) != kind(&rb) && !reads.contains(&(ra.clone(), rb.clone())) {
            reads.push((ra, rb));
        }
        writeln!(
            out,
            "{key} {ta:>11.2} {tb:>11.2} {:>8.2} {:>8.2} {:>6.0}% {:>6.0}% {r:>5.2}x",
            num(x, "gb_per_s", &what_a)?,
            num(y, "gb_per_s", &what_b)?,
            100.0 * num(x, "bandwidth_fraction", &what_a)?,
            100.0 * num(y, "bandwidth_fraction", &what_b)?,
        )
        .unwrap();
    }
    let only_b: Vec<String> = kb
        .iter()
        .map(kernel_key)
        .filter(|k| !ka.iter().any(|x| &kernel_key(x) == k))
        .collect();
    if ratios.is_empty() {
        return Err(format!(
            "{} and {} have no kernel measurement in common (same formats, shapes, ISAs, threads?)",
            a.label, b.label
        ));
    }
    writeln!(
        out,
        "\n{} matched rows; geometric mean ratio {:.3}x (min {:.2}x, max {:.2}x)",
        ratios.len(),
        geomean(&ratios),
        ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratios.iter().copied().fold(0.0, f64::max)
    )
    .unwrap();
    for (ra, rb) in &reads {
        writeln!(
            out,
            "note: some rows' % bw are of different reads, so not comparable: A {ra}, B {rb}"
        )
        .unwrap();
    }
    for (label, rows) in [(&a.label, &only_a), (&b.label, &only_b)] {
        if !rows.is_empty() {
            writeln!(out, "only in {label} ({}):", rows.len()).unwrap();
            for r in rows {
                writeln!(out, "  {}", r.trim_end()).unwrap();
            }
        }
    }
    Ok(())
}

/// The read a kernel row's % bw is of (`read`); files written before rows
/// named it set every row against the memory read.
fn read_of(k: &serde_json::Value) -> String {
    k["read"].as_str().map_or(
        "memory (a file from before rows named their read)".to_string(),
        str::to_string,
    )
}

fn compare_e2e(a: &Run, b: &Run, out: &mut String) -> Result<(), String> {
    for f in [
        "model",
        "kernels",
        "fp4_act",
        "bf16_act",
        "fp8_act",
        "prompt_len",
        "gen",
        "chunk",
        "weights_paged_in",
    ] {
        let (x, y) = (text(&a.v, f), text(&b.v, f));
        if x != y {
            writeln!(out, "note: {f} differs: A {x}, B {y}").unwrap();
        }
    }
    writeln!(
        out,
        "{:>3} {:>12} {:>12} {:>6} {:>11} {:>11} {:>6} {:>10} {:>10} {:>6}",
        "thr",
        "A prefill",
        "B prefill",
        "ratio",
        "A decode",
        "B decode",
        "ratio",
        "A TTFT ms",
        "B TTFT ms",
        "ratio"
    )
    .unwrap();
    let ra = a.v["runs"].as_array().cloned().unwrap_or_default();
    let rb = b.v["runs"].as_array().cloned().unwrap_or_default();
    let mut matched = 0;
    for x in &ra {
        let t = text(x, "threads");
        let Some(y) = rb.iter().find(|y| text(y, "threads") == t) else {
            writeln!(out, "{t:>3} only in {}", a.label).unwrap();
            continue;
        };
        matched += 1;
        let what_a = format!("{}: {t} threads", a.label);
        let what_b = format!("{}: {t} threads", b.label);
        let (pa, pb) = (
            num(x, "prefill_tok_s", &what_a)?,
            num(y, "prefill_tok_s", &what_b)?,
        );
        let (da, db) = (
            num(x, "decode_tok_s", &what_a)?,
            num(y, "decode_tok_s", &what_b)?,
        );
        let (fa, fb) = (num(x, "ttft_ms", &what_a)?, num(y, "ttft_ms", &what_b)?);
        writeln!(
            out,
            "{t:>3} {pa:>8.1} t/s {pb:>8.1} t/s {:>5.2}x {da:>7.1} t/s {db:>7.1} t/s {:>5.2}x {fa:>10.1} {fb:>10.1} {:>5.2}x",
            pb / pa,
            db / da,
            fa / fb
        )
        .unwrap();
    }
    for y in &rb {
        let t = text(y, "threads");
        if !ra.iter().any(|x| text(x, "threads") == t) {
            writeln!(out, "{t:>3} only in {}", b.label).unwrap();
        }
    }
    if matched == 0 {
        return Err(format!(
            "{} and {} have no thread count in common",
            a.label, b.label
        ));
    }
    Ok(())
}
