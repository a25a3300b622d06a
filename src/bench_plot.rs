//! `bespoke bench kernels --plot FILE.svg`: specialised against generic per
//! kernel, ISA, thread count and residency, as a horizontal bar chart (GB/s
//! of weights read), with the read each row was set against (timed beside
//! it: memory for streamed weights, the same bytes in cache for resident
//! ones) marked on it. Plain SVG written by hand: no plotting dependency.

use crate::bench::Results;
use std::fmt::Write as _;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const ROW: f64 = 30.0;
const BAR: f64 = 11.0;
const LEFT: f64 = 300.0;
const PLOT_W: f64 = 560.0;
const TOP: f64 = 70.0;
const KINDS: [(&str, &str); 2] = [("specialised", "#2f6db5"), ("generic", "#e08a2c")];

/// The chart as an SVG document.
pub fn svg(r: &Results) -> String {
    // One row per case (everything but the kernel kind), in the run's order,
    // with the read GB/s it was set against.
    let mut rows: Vec<(String, f64, Vec<Option<f64>>)> = Vec::new();
    for k in &r.kernels {
        let label = format!(
            "{} {} {} {}t {}",
            k.format,
            k.shape_label(),
            k.isa,
            k.threads,
            k.residency
        );
        let i = match rows.iter().position(|(l, _, _)| *l == label) {
            Some(i) => i,
            None => {
                rows.push((label, k.read_gb_per_s, vec![None; KINDS.len()]));
                rows.len() - 1
            }
        };
        if let Some(j) = KINDS.iter().position(|(name, _)| *name == k.kernel) {
            rows[i].2[j] = Some(k.gb_per_s);
        }
    }
    let max = rows
        .iter()
        .flat_map(|(_, b, v)| {
            v.iter()
                .flatten()
                .copied()
                .chain(b.is_finite().then_some(*b))
        })
        .fold(1e-9f64, f64::max)
        * 1.08;
    let x = |v: f64| LEFT + PLOT_W * v / max;
    let height = TOP + ROW * rows.len() as f64 + 50.0;
    let width = LEFT + PLOT_W + 90.0;
    let mut s = String::new();
    writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    )
    .unwrap();
    writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#).unwrap();
    writeln!(
        s,
        r#"<text x="10" y="22" font-size="15" font-weight="bold">bespoke bench kernels: GB/s of weights read, specialised vs generic</text>"#
    )
    .unwrap();
    writeln!(
        s,
        r#"<text x="10" y="42">{} ({}), {} physical cores, last-level cache {} MiB; black tick: the read timed beside each row, same threads (memory, or as many bytes in cache)</text>"#,
        esc(&r.machine.cpu),
        esc(&r.machine.arch),
        r.machine.physical_cores,
        r.machine.llc_bytes >> 20
    )
    .unwrap();
    for (j, (name, colour)) in KINDS.iter().enumerate() {
        let lx = LEFT + 160.0 * j as f64;
        writeln!(
            s,
            r#"<rect x="{lx}" y="52" width="12" height="10" fill="{colour}"/><text x="{}" y="61">{name}</text>"#,
            lx + 16.0
        )
        .unwrap();
    }
    // Grid: five steps.
    for i in 0..=5 {
        let v = max / 1.08 * i as f64 / 5.0;
        let gx = x(v);
        writeln!(
            s,
            r##"<line x1="{gx:.1}" y1="{TOP}" x2="{gx:.1}" y2="{:.1}" stroke="#ddd"/><text x="{gx:.1}" y="{:.1}" text-anchor="middle">{v:.1}</text>"##,
            TOP + ROW * rows.len() as f64,
            TOP + ROW * rows.len() as f64 + 16.0
        )
        .unwrap();
    }
    writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">GB/s</text>"#,
        LEFT + PLOT_W / 2.0,
        TOP + ROW * rows.len() as f64 + 34.0
    )
    .unwrap();
    for (i, (label, read, vals)) in rows.iter().enumerate() {
        let y0 = TOP + ROW * i as f64;
        writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 8.0,
            y0 + ROW / 2.0 + 4.0,
            esc(label)
        )
        .unwrap();
        for (j, v) in vals.iter().enumerate() {
            let Some(v) = v else { continue };
            let by = y0 + 4.0 + BAR * j as f64;
            writeln!(
                s,
                r#"<rect x="{LEFT}" y="{by:.1}" width="{:.1}" height="{BAR}" fill="{}"><title>{} {}: {v:.2} GB/s</title></rect><text x="{:.1}" y="{:.1}" font-size="10">{v:.2}</text>"#,
                (x(*v) - LEFT).max(0.5),
                KINDS[j].1,
                esc(label),
                KINDS[j].0,
                x(*v) + 3.0,
                by + BAR - 2.0
            )
            .unwrap();
        }
        if let Some(b) = read.is_finite().then_some(*read) {
            writeln!(
                s,
                r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black" stroke-width="2"/>"#,
                x(b),
                y0 + 2.0,
                x(b),
                y0 + ROW - 4.0
            )
            .unwrap();
        }
    }
    s.push_str("</svg>\n");
    s
}
