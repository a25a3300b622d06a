//! The plan: from model configs and the target, the list of kernels to
//! generate. This module is compiled twice — inside build.rs (via `#[path]`)
//! and inside the library — so `bespoke plan` shows exactly what the build
//! generated and the engine can check a loaded model against it. It depends
//! only on std, serde and serde_json.

#![allow(dead_code)]

pub mod config;
pub mod cuda;
pub mod json;

pub use config::{DenseDtype, Family, ModelConfig};
pub use json::ConfigError;

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fmt;

/// Weight storage formats the kernels read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Format {
    F32,
    Bf16,
    /// FP8 E4M3FN weights [out, in] with UE8M0 scales per 128×128 block.
    Fp8,
    /// FP4 E2M1 weights packed two per byte [out, in/2] with UE8M0 scales per 32 columns.
    Fp4,
}

pub const FORMATS: [Format; 4] = [Format::F32, Format::Bf16, Format::Fp8, Format::Fp4];

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::Bf16 => "bf16",
            Format::Fp8 => "fp8",
            Format::Fp4 => "fp4",
        }
    }
    pub fn parse(s: &str) -> Option<Format> {
        FORMATS.iter().copied().find(|f| f.name() == s)
    }
    /// Columns per scale block (0 = no scales).
    pub fn block_cols(self) -> usize {
        match self {
            Format::F32 | Format::Bf16 => 0,
            Format::Fp8 => 128,
            Format::Fp4 => 32,
        }
    }
    /// Rows sharing one scale (0 = no scales).
    pub fn block_rows(self) -> usize {
        match self {
            Format::F32 | Format::Bf16 => 0,
            Format::Fp8 => 128,
            Format::Fp4 => 1,
        }
    }
    /// Bytes of one weight row of `cols` columns.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            Format::F32 => cols * 4,
            Format::Bf16 => cols * 2,
            Format::Fp8 => cols,
            Format::Fp4 => cols / 2,
        }
    }
    /// Shape of the scale tensor for a [rows, cols] weight, if the format has one.
    pub fn scale_shape(self, rows: usize, cols: usize) -> Option<(usize, usize)> {
        match self {
            Format::F32 | Format::Bf16 => None,
            Format::Fp8 => Some((rows.div_ceil(128), cols.div_ceil(128))),
            Format::Fp4 => Some((rows, cols / 32)),
        }
    }
    /// Why a [rows, cols] matrix cannot be stored in this format, if it cannot.
    pub fn shape_problem(self, rows: usize, cols: usize) -> Option<String> {
        if rows == 0 || cols == 0 {
            return Some(format!("empty matrix {rows}×{cols}"));
        }
        if self == Format::Fp4 && cols % 32 != 0 {
            return Some(format!(
                "fp4 needs columns in whole 32-column scale blocks, found {cols} columns"
            ));
        }
        None
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Kernel operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Op {
    /// y = W·x
    Matvec,
    /// Y = W·X for a few columns (tokens)
    Matmul,
    /// one query against a KV cache
    AttnDecode,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Matvec => "matvec",
            Op::Matmul => "matmul",
            Op::AttnDecode => "attn_decode",
        }
    }
}

/// CPU instruction-set variants of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
    Neon,
    /// Baseline Armv8.0 NEON, compiled beside `Neon` when a BESPOKE_CPU
    /// preset tunes that one for extensions (dotprod, fp16, …): what a core
    /// without them runs instead of falling back to scalar.
    NeonBase,
}

pub const ISAS: [Isa; 5] = [
    Isa::Scalar,
    Isa::Avx2,
    Isa::Avx512,
    Isa::Neon,
    Isa::NeonBase,
];

/// Register tiles: rows of W × columns of X computed together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tile {
    pub rows: usize,
    pub cols: usize,
}

/// Everything the templates need to know about an ISA, as data.
#[derive(Debug, Clone, Serialize)]
pub struct IsaDesc {
    pub isa: Isa,
    pub name: &'static str,
    /// f32 lanes in one vector register.
    pub width: usize,
    /// vector registers the ISA has (drives the tile choice).
    pub registers: usize,
    /// C compiler flags for this variant's translation unit.
    pub cflags: &'static [&'static str],
    /// CPU features (as std::arch names) the variant needs at run time.
    pub cpu_features: &'static [&'static str],
    /// target_arch this variant exists on ("any" for scalar).
    pub arch: &'static str,
    /// The ISA header in kernels/ that maps the primitives to intrinsics.
    pub header: &'static str,
    /// Weight formats this ISA decodes into a permuted lane order (its header
    /// defines `BS_LANES_<FMT>` and the `bs_dec*p_*` decoders): the kernels
    /// copy x into that order once per call and put each accumulator back in
    /// the logical order before the reduction, so results stay bit-identical.
    /// FP8 kernels copy x into their chunks' step order on every ISA; "fp8"
    /// listed here means the ISA's FP8 decoder is the checked one (AVX2:
    /// normal codes only, and the "s" tiles against x scaled by 2^120).
    pub permuted: &'static [&'static str],
    /// Scaled formats whose whole blocks this ISA decodes 64 columns at a
    /// time (its header defines `bs_dec64p_<dec>`); the others take 32.
    /// FP4 ignores both entries: its kernels take whole 128-column chunks
    /// in every ISA's natural lane order (`bs_fp4_steps`).
    pub chunk64: &'static [&'static str],
    /// Whether the ISA header has the FP4 decoder for x scaled by 2^-25
    /// (`bs_fp4c_*`: each weight as the integer 2w times 2^24, converted):
    /// the FP4 kernels then also have "c" tiles, taken when every x is 0 or
    /// finite with |x| >= 2^-101, so that x * 2^-25 is exact.
    pub fp4_scaled: bool,
    /// FP4 tiles take their four-chunk groups chunk by chunk, each chunk
    /// against every row of the tile (x of one chunk in registers for all
    /// rows) rather than row by row. Only where a chunk's x fits in
    /// registers beside the tile's accumulators (AVX-512: 8 of 32).
    pub fp4_chunk_outer: bool,
    /// Whether the FP8 kernels have "s" tiles, taken when every |x| < 256:
    /// x is copied times 2^120 and each code's bits go straight into an
    /// f32's fields, w * 2^-120, with no look-up (the header's
    /// `bs_dec32s_e4m3`, `bs_chks`).
    pub fp8_scaled: bool,
    /// Whether the FP8 matmul tiles (NR > 1) take the "s" tiles too; without
    /// it only matvec (and a matmul's single leftover tokens) does. AVX-512's
    /// 2 x 4 "s" tile ran at 0.75x its "p" tile at 128 tokens, specialised
    /// (Zen 4 VM, three alternated runs), though the matvec gains.
    pub fp8_scaled_matmul: bool,
    /// How far ahead, in bytes of each row, the scaled-format matrix kernels
    /// prefetch their rows in the order the tiles read them (rows no longer
    /// than this: the next tile's rows); 0: none, the hardware prefetcher is
    /// left to it (and FP8 asks for the line 2 KiB on in its row). With it,
    /// the BF16 and F32 matvec tiles prefetch their rows the same way.
    pub prefetch_ahead: usize,
    /// Where `prefetch_ahead` is 0: how far ahead, in bytes, the FP4 tiles
    /// ask for their rows' lines (into L2, one per 64-byte chunk), counted
    /// along the row and on into the next rows (FP4 tiles there are one
    /// row, and a matvec takes rows in order); 0: none. On an Intel Xeon VM
    /// (Granite Rapids class) the one-row AVX2 FP4 matvec streamed from
    /// memory at 2.3-3.0 GB/s, latency-bound, against 7.3-8.9 cache-resident:
    /// the out-of-order window of a kernel spending ~60 instructions per line
    /// keeps too few lines in flight, and the hardware prefetcher did not make
    /// up for it. 1-4 KiB ahead into L2 all streamed at 7.2-7.4 GB/s (in a C
    /// loop of the generated kernel, 1 thread), 8 KiB 7.0, into L1 6.9-7.2, with
    /// no loss cache-resident. The fp4×q8 rows (one row at a time, 8 blocks
    /// a step) ask for both of a step's lines the same distance on: there
    /// streamed fp4×q8 went from 6.5-9.9 to 10.9-11.4 GB/s at 1 thread
    /// (`bench kernels --formats fp4q8 --isa avx2`, two alternated runs;
    /// 4 KiB ahead 10.1-10.7).
    pub fp4_prefetch_ahead: usize,
    /// Where those prefetches (and the fp4×q8 and bf16dot kernels' own) put
    /// the line, as `__builtin_prefetch`'s locality: 3 = every level down to
    /// L1 (prefetcht0), 2 = L2 and out (prefetcht1). L2 leaves L1 to the
    /// lines in use: a tile of 8 rows 2 KiB ahead is 16 KiB in flight, half
    /// a 32 KiB L1 (Zen 4).
    pub prefetch_locality: u8,
    /// Row step of the multi-row matvec tiles: with 1 a tile takes rows
    /// r..r+MR-1; with s > 1 the matvec runs s tiles one after the other over
    /// a group of MR·s rows, tile t taking rows r+t, r+t+s, ... (the same
    /// sums row by row, only the rows visited in another order). Not
    /// combined with `prefetch_ahead`, whose distances assume consecutive
    /// rows (a test checks). 1 where not measured.
    pub matvec_row_step: usize,
    /// Matvec rows shorter than this many bytes (a page; 0: off), where the
    /// page holds a whole number ps of rows: the multi-row tiles then take
    /// groups of MR·ps rows as ps tiles whose rows are ps apart (as
    /// `matvec_row_step`, but worked out from the row length, at run time
    /// where the shape is not baked in), so that a tile's MR rows lie in MR
    /// pages and each page is read front to back by one tile after another,
    /// not as ps rows side by side (which the hardware prefetcher, tracking
    /// a stream per page, followed badly). The software prefetch reaches
    /// for the same row of the next group. On an Intel Xeon VM (Granite
    /// Rapids class), 1 thread, 1 GiB of matrices streamed through the
    /// generated kernels in one C program, alternated, same bits: FP8
    /// 4096 x 2048 (2 KiB rows) 11.8 -> 14.3 GB/s, 8192 x 1024 10.4 -> 13.8,
    /// FP4 2048 x 4096 10.4 -> 11.6, 4096 x 2048 9.9 -> 10.7; cache-resident
    /// 0.94-1.02x. `bench kernels --formats fp8,fp4 --isa avx512 --threads
    /// 2`, two alternated runs, % of the read bandwidth streamed: FP8
    /// 4096 x 2048 78-79 -> 90 (1 thread), 74-76 -> 85-88 (2); FP4
    /// 2048 x 4096 72-76 -> 80-83 and 67-69 -> 74-76; FP4 4096 x 2048 67-71
    /// -> 74-76 and 61-63 -> 67-68.
    pub matvec_page_bytes: usize,
    /// Whether the ISA header has `bs_dec32_bf16`, 32 BF16 columns (one
    /// 64-byte line) decoded from one load into two lane groups: the BF16
    /// one-token tiles then step a whole line of each row at a time, every
    /// lane still taking its columns in order. On a Zen 4 VM (AVX-512, 1
    /// thread, 320 MiB of matrices streamed, old and new kernels alternated
    /// in one C program, same bits) the 8-row tile read 4-12 % more at 1024
    /// to 5632 columns.
    pub bf16_line: bool,
    /// BF16 matvecs with at most this many columns take their rows two at a
    /// time, the first half of the range beside the second (a 2-row tile
    /// whose rows are half the range apart, each prefetching its own next
    /// row), a line per step: two sequential streams; 0: never (the 8- or
    /// 12-row tiles). They took one row at a time until 2026-12-06, and
    /// the history below is of that: a row's sum is one dependent FMA chain
    /// (AVX-512: 8 bytes of weights per cycle at most), which pays only while
    /// the out-of-order window reaches into the next row. Two rows far
    /// apart run two chains and read as fast streamed (a Zen 4 VM, `bench
    /// kernels --model` the bench Llama, builds alternated: 2048-column
    /// matrices cache-resident 1.2-1.3x on AVX-512, 1.2-1.5x with bf16dot,
    /// 1.4-1.9x on AVX2, streamed level to 1.2x; decode end to end level at 1 thread,
    /// ten alternations), where two neighbouring rows side by side read
    /// 40 % less streamed (C program, 320 MiB of matrices). One row at a
    /// time, measured as for `bf16_line`, against the 8-row tile: 1024 columns 1.32-1.41x, 2048 1.15-1.31x, 2560 and 3072 0.85-1.24x
    /// (so 2048), 4096 and up slower; cache-resident at 2048 columns 0.66x
    /// (the chain's latency), which a model larger than the last-level
    /// cache never sees in decode. The bf16dot kernels (AVX-512 only) take
    /// the same limit as `BD_ONE_ROW_COLS`: their row sum is one chain of
    /// VDPBF16PS, and 2048 is where they were measured to gain too. AVX2
    /// (slot-order x, two 8-lane chains per row) takes the same limit:
    /// forced on that Zen 4 VM (`BESPOKE_KERNELS=avx2`, `bench kernels
    /// --isa avx2 --threads 1`, builds alternated), 2048-column matrices
    /// streamed at 20-29 GB/s where the 4-row tiles read 15-23, and decode
    /// end to end at 1 thread rose 1.18-1.23x; cache-resident 0.45x (the
    /// chains' latency again). Not measured on a CPU whose best variant
    /// is AVX2. Kept at 2048 on AVX-512 after the 12-row line tile stopped
    /// spilling (2026-12-06, a Zen 4 VM): in a C program over aligned
    /// buffers that tile then streamed 2048-column rows faster than one row
    /// at a time (24.6-27.1 against 20.2-22.4 GB/s), but end to end, over
    /// weights mapped from a file in 4 KiB pages, 1-thread decode of the
    /// 0.92 GiB bench Llama fell from 22.3-23.7 to 20.4-22.6 tok/s with it.
    pub bf16_one_row_cols: usize,
    /// BF16 matvecs whose rows are a whole number of 4 KiB pages long (4096,
    /// 8192, 14336 columns ...) take tiles of this many rows in place of the
    /// matvec tile's (0: the matvec tile for every row over
    /// `bf16_one_row_cols`). In such rows each tile row's line of a step
    /// falls in the same L1 set, which has 8 ways: the AVX-512 12-row tile
    /// then reads past them. On a Zen 4 VM (C program, 1 thread) 8 rows
    /// against 12 at 4096 columns: 1.15-1.4x in L3 and level or better
    /// streamed; 14336 columns level (0.96-1.05x); where rows are not such
    /// a multiple (5632, 11008) 12 rows stay faster (1.06-1.21x). The
    /// generated kernels (2026-12-06, same VM, builds alternated): 4096 x
    /// 4096 cache-resident 1.29-1.34x, streamed level or better; decode of
    /// a 4096-hidden random Llama at 1 thread 1.10-1.22x.
    pub bf16_page_rows: usize,
    /// How many rows the fp4×q8 kernel computes side by side, one from each
    /// part of its call's range (the rows split into this many equal parts;
    /// what is left over one at a time): a row is one sequential stream, and
    /// a core reading one stream left the read short. On an Intel Xeon VM
    /// (Granite Rapids class), 2 GiB of copies of the Flash expert matrices
    /// streamed through the generated kernels in one C program at 1 and 2
    /// threads, whole regions and 128- and 32-row calls, variants alternated,
    /// same bits: AVX-512 81-89 % of the plain read with one row, 98-112 % with
    /// four (two parts 90-101 %, two adjacent rows 76-83 %), cache-resident
    /// level or better; AVX2 76-82 % with one, 81-102 % with two, 75-100 %
    /// with four and cache-resident 0.92-0.95x with four (its 16 registers),
    /// level with two. 1 where not measured.
    pub q8_rows: usize,
    /// Dispatch preference: higher wins among supported variants.
    pub score: u32,
}

impl Isa {
    pub fn desc(self) -> IsaDesc {
        match self {
            Isa::Scalar => IsaDesc {
                isa: self,
                name: "scalar",
                width: 1,
                registers: 16,
                cflags: &[],
                cpu_features: &[],
                arch: "any",
                header: "bs_isa_scalar.h",
                permuted: &[],
                chunk64: &[],
                fp4_scaled: false,
                fp4_chunk_outer: false,
                fp8_scaled: false,
                fp8_scaled_matmul: false,
                prefetch_ahead: 0,
                fp4_prefetch_ahead: 0,
                prefetch_locality: 3,
                matvec_row_step: 1,
                matvec_page_bytes: 0,
                bf16_line: false,
                bf16_one_row_cols: 0,
                bf16_page_rows: 0,
                q8_rows: 1,
                score: 1,
            },
            Isa::Avx2 => IsaDesc {
                isa: self,
                name: "avx2",
                width: 8,
                registers: 16,
                cflags: &["-mavx2", "-mfma", "-mf16c"],
                cpu_features: &["avx2", "fma", "f16c"],
                arch: "x86_64",
                header: "bs_isa_avx2.h",
                permuted: &["fp8", "bf16"],
                chunk64: &[],
                fp4_scaled: true,
                fp4_chunk_outer: false,
                fp8_scaled: true,
                fp8_scaled_matmul: true,
                prefetch_ahead: 0,
                fp4_prefetch_ahead: 2048,
                prefetch_locality: 3,
                // 4 KiB rows (BF16 4096 x 2048) streamed at 1 thread on a Zen 3 VM:
                // 17-22 GB/s with step 1, 23-27 with 4, wherever the rows start in
                // their pages (2048 x 4096: 21-25 -> 25-29), in a C loop of the
                // generated kernel; 2 was in between.
                matvec_row_step: 4,
                matvec_page_bytes: 0,
                bf16_line: false,
                bf16_one_row_cols: 2048,
                bf16_page_rows: 0,
                q8_rows: 2,
                score: 20,
            },
            Isa::Avx512 => IsaDesc {
                isa: self,
                name: "avx512",
                width: 16,
                registers: 32,
                cflags: &[
                    "-mavx512f",
                    "-mavx512bw",
                    "-mavx512vl",
                    "-mavx512vbmi",
                    "-mavx512vnni",
                    "-mavx2",
                    "-mfma",
                    "-mf16c",
                ],
                cpu_features: &[
                    "avx512f",
                    "avx512bw",
                    "avx512vl",
                    "avx512vbmi",
                    "avx512vnni",
                    "avx2",
                    "fma",
                    "f16c",
                ],
                arch: "x86_64",
                header: "bs_isa_avx512.h",
                permuted: &[],
                chunk64: &["fp8"],
                fp4_scaled: false,
                fp4_chunk_outer: true,
                fp8_scaled: true,
                fp8_scaled_matmul: false,
                // 4 KiB: on an Intel Xeon VM (Granite Rapids class) against
                // 2 KiB, decode of the 0.92 GiB BF16 bench model rose 17.7-18.0
                // -> 19.2-19.3 tok/s at 1 thread and 31.0-31.1 -> 33.7-34.1 at 2
                // (`bench e2e --prompt-len 8 --gen 48`, two alternations); BF16
                // 4096 x 2048 streamed 14.6-15.3 -> 16.5-17.3 GB/s, FP8 and FP4
                // -2 to +8 %. 2 KiB was the Zen 4 setting; not re-measured there.
                prefetch_ahead: 4096,
                fp4_prefetch_ahead: 0,
                prefetch_locality: 2,
                matvec_row_step: 1,
                matvec_page_bytes: 4096,
                bf16_line: true,
                bf16_one_row_cols: 2048,
                bf16_page_rows: 8,
                q8_rows: 4,
                score: 30,
            },
            Isa::Neon => IsaDesc {
                isa: self,
                name: "neon",
                width: 4,
                registers: 32,
                cflags: &[],
                cpu_features: &["neon"],
                arch: "aarch64",
                header: "bs_isa_neon.h",
                permuted: &[],
                chunk64: &[],
                fp4_scaled: false,
                fp4_chunk_outer: false,
                fp8_scaled: false,
                fp8_scaled_matmul: false,
                prefetch_ahead: 0,
                fp4_prefetch_ahead: 0,
                prefetch_locality: 3,
                matvec_row_step: 1,
                matvec_page_bytes: 0,
                bf16_line: false,
                bf16_one_row_cols: 0,
                bf16_page_rows: 0,
                q8_rows: 1,
                score: 20,
            },
            // The same kernels as neon, compiled without the preset's flags.
            Isa::NeonBase => IsaDesc {
                isa: self,
                name: "neon_base",
                score: 19,
                ..Isa::Neon.desc()
            },
        }
    }
    pub fn name(self) -> &'static str {
        self.desc().name
    }
    pub fn parse(s: &str) -> Option<Isa> {
        ISAS.iter().copied().find(|i| i.name() == s)
    }

    /// Register tile for an op and format on this ISA. The numbers never
    /// change results (every output element is computed in the same order
    /// whatever the tile); they only trade registers for reuse.
    pub fn tile(self, op: Op, format: Format) -> Tile {
        let scaled = format.block_cols() != 0;
        let t = |rows, cols| Tile { rows, cols };
        match (self, op, scaled) {
            (Isa::Scalar, _, _) => t(1, 1),
            (Isa::Avx2, Op::Matvec, false) => t(4, 1),
            // FP8's FMA chains are 8 long per scale block and lane, its
            // decode short enough (Zen 3 VM) that two rows' chains side by
            // side run 1.08-1.11x one row's.
            (Isa::Avx2, Op::Matvec, true) if format == Format::Fp8 => t(2, 1),
            (Isa::Avx2, Op::Matvec, true) => t(1, 1),
            // 12 accumulators of the 16 registers (2 x 2 left FMA idle
            // waiting on loads: 128 tokens on a Zen 3 VM, 1.08-1.10x).
            (Isa::Avx2, _, false) => t(2, 3),
            // FP8 decodes at more cost than FP4 per weight read, so its
            // matmul spreads each row's decode over 4 tokens (Zen 3 VM,
            // 128 tokens: 1.2x the 1 x 2 tile; FP4 level or slower).
            (Isa::Avx2, _, true) if format == Format::Fp8 => t(1, 4),
            (Isa::Avx2, _, true) => t(1, 2),
            // BF16 one-token tiles of 12 rows (a line of each per step,
            // `IsaDesc::bf16_line`): on a Zen 4 VM, 1 thread, streamed, a C
            // harness alternating them, 12 rows read 1.00-1.28x what 8 did
            // at 2560 to 18432 columns (the generated kernels: 5632 columns
            // 1.06-1.14x, 11008 1.07-1.21x, 14336 0.96-1.05x); 16 rows
            // more still where a row is not a multiple of 4 KiB, but less
            // where it is (4096, 6144, 8192, 14336: 16 rows' lines in one L1
            // set, more than its 8 ways).
            (Isa::Avx512, Op::Matvec, false) if format == Format::Bf16 => t(12, 1),
            (Isa::Avx512, Op::Matvec, false) => t(8, 1),
            (Isa::Avx512, Op::Matvec, true) => t(8, 1),
            // 4 rows × 6 tokens: 24 accumulators, 4 weight vectors and one
            // x vector of the 32 registers, one BF16 conversion per 6 FMAs.
            // On an Intel Xeon VM (Granite Rapids class), 1 thread, 128
            // tokens, the generated kernels alternated in one C program:
            // 2048 × 2048 1.04-1.13x the 4 × 4 tile, 5632 × 2048 1.07-1.09x;
            // 4 × 5 and 4 × 7 were level with it or below, tiles of 2 or 3
            // rows (3 × 8, 2 × 12, 3 × 6) 0.64-0.80x. Again with X on a
            // cache line (three rounds, 128 tokens, weights past the L3):
            // 4 × 7 0.94-0.99x, 5 × 5 0.91-0.95x, 3 × 8 0.67-0.72x, 2 × 12
            // 0.63-0.69x, so the loads of X, not the conversions, bound it.
            (Isa::Avx512, _, false) => t(4, 6),
            (Isa::Avx512, _, true) => t(2, 4),
            (Isa::Neon | Isa::NeonBase, Op::Matvec, false) => t(4, 1),
            (Isa::Neon | Isa::NeonBase, Op::Matvec, true) => t(2, 1),
            (Isa::Neon | Isa::NeonBase, _, false) => t(2, 2),
            (Isa::Neon | Isa::NeonBase, _, true) => t(1, 2),
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One weight matrix a model multiplies by, as the kernels see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatrixUse {
    /// Tensor name pattern, e.g. `layers.*.attn.wq_a` (release names for deepseek_v4,
    /// Hugging Face names for the others).
    pub name: String,
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
    /// How many such products one token needs (layers × groups × experts used).
    pub per_token: usize,
}

/// A specialised matrix kernel: one (format, rows, cols); matvec and matmul
/// are both generated for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MatShape {
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
}

impl MatShape {
    pub fn key(&self) -> String {
        format!("{}x{}", self.rows, self.cols)
    }
}

/// A specialised attention-decode kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AttnShape {
    pub head_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
}

impl AttnShape {
    pub fn key(&self) -> String {
        format!("d{}_h{}_kv{}", self.head_dim, self.n_heads, self.n_kv_heads)
    }
}

/// The matrices of one model, with the weight formats its checkpoint stores.
pub fn matrices(cfg: &ModelConfig) -> Vec<MatrixUse> {
    let dense = match cfg.dense_dtype {
        DenseDtype::F32 => Format::F32,
        DenseDtype::Bf16 => Format::Bf16,
    };
    let mut out = Vec::new();
    let mut add = |name: &str, format: Format, rows: usize, cols: usize, per_token: usize| {
        if per_token > 0 {
            out.push(MatrixUse {
                name: name.to_string(),
                format,
                rows,
                cols,
                per_token,
            });
        }
    };
    let (h, d, nh, nkv, hd) = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    );
    let layers = cfg.num_layers;
    match cfg.family {
        Family::Llama | Family::Qwen3 | Family::Qwen3Moe => {
            add("model.layers.*.self_attn.q_proj", dense, nh * hd, h, layers);
            add(
                "model.layers.*.self_attn.k_proj",
                dense,
                nkv * hd,
                h,
                layers,
            );
            add(
                "model.layers.*.self_attn.v_proj",
                dense,
                nkv * hd,
                h,
                layers,
            );
            add("model.layers.*.self_attn.o_proj", dense, h, nh * hd, layers);
            let dense_mlp_layers = match &cfg.moe {
                Some(m) => m.dense_layers.len(),
                None => layers,
            };
            add(
                "model.layers.*.mlp.gate_proj",
                dense,
                cfg.intermediate_size,
                h,
                dense_mlp_layers,
            );
            add(
                "model.layers.*.mlp.up_proj",
                dense,
                cfg.intermediate_size,
                h,
                dense_mlp_layers,
            );
            add(
                "model.layers.*.mlp.down_proj",
                dense,
                h,
                cfg.intermediate_size,
                dense_mlp_layers,
            );
            if let Some(m) = &cfg.moe {
                let moe_layers = layers - m.dense_layers.len();
                let mi = m.moe_intermediate_size;
                add(
                    "model.layers.*.mlp.gate",
                    dense,
                    m.num_experts,
                    h,
                    moe_layers,
                );
                add(
                    "model.layers.*.mlp.experts.*.gate_proj",
                    dense,
                    mi,
                    h,
                    moe_layers * m.top_k,
                );
                add(
                    "model.layers.*.mlp.experts.*.up_proj",
                    dense,
                    mi,
                    h,
                    moe_layers * m.top_k,
                );
                add(
                    "model.layers.*.mlp.experts.*.down_proj",
                    dense,
                    h,
                    mi,
                    moe_layers * m.top_k,
                );
            }
            let head = if cfg.tie_word_embeddings {
                "model.embed_tokens (tied head)"
            } else {
                "lm_head"
            };
            add(head, dense, cfg.vocab_size, h, 1);
        }
        Family::DeepseekV4 => {
            let v4 = cfg
                .dsv4
                .as_ref()
                .expect("deepseek_v4 config carries its dsv4 section");
            let m = cfg
                .moe
                .as_ref()
                .expect("deepseek_v4 config carries its moe section");
            let fp8 = if v4.fp8_dense { Format::Fp8 } else { dense };
            let expert = if v4.fp4_experts { Format::Fp4 } else { fp8 };
            let hc = v4.hc_mult;
            let mix = (2 + hc) * hc;
            let csa = v4
                .compress_ratios
                .iter()
                .filter(|&&r| r == v4.csa_ratio)
                .count();
            let hca = v4.compress_ratios.iter().filter(|&&r| r != 0).count() - csa;
            add("layers.*.hc_attn_fn", Format::F32, mix, hc * h, layers);
            add("layers.*.hc_ffn_fn", Format::F32, mix, hc * h, layers);
            add("layers.*.attn.wq_a", fp8, v4.q_lora_rank, h, layers);
            add("layers.*.attn.wq_b", fp8, nh * d, v4.q_lora_rank, layers);
            add("layers.*.attn.wkv", fp8, d, h, layers);
            add(
                "layers.*.attn.wo_a (per group)",
                fp8,
                v4.o_lora_rank,
                nh * d / v4.o_groups,
                layers * v4.o_groups,
            );
            add(
                "layers.*.attn.wo_b",
                fp8,
                h,
                v4.o_groups * v4.o_lora_rank,
                layers,
            );
            // Compressed-sparse layers pool overlapping windows: twice the channels.
            add(
                "layers.*.attn.compressor.{wkv,wgate} (CSA)",
                dense,
                2 * d,
                h,
                2 * csa,
            );
            add(
                "layers.*.attn.compressor.{wkv,wgate} (HCA)",
                dense,
                d,
                h,
                2 * hca,
            );
            let (ih, id) = (v4.index_n_heads, v4.index_head_dim);
            add(
                "layers.*.attn.indexer.wq_b",
                fp8,
                ih * id,
                v4.q_lora_rank,
                csa,
            );
            add("layers.*.attn.indexer.weights_proj", dense, ih, h, csa);
            add(
                "layers.*.attn.indexer.compressor.{wkv,wgate}",
                dense,
                2 * id,
                h,
                2 * csa,
            );
            add("layers.*.ffn.gate", dense, m.num_experts, h, layers);
            let si = m.moe_intermediate_size * m.n_shared_experts;
            add(
                "layers.*.ffn.shared_experts.{w1,w3}",
                fp8,
                si,
                h,
                2 * layers,
            );
            add("layers.*.ffn.shared_experts.w2", fp8, h, si, layers);
            let mi = m.moe_intermediate_size;
            add(
                "layers.*.ffn.experts.*.{w1,w3}",
                expert,
                mi,
                h,
                2 * layers * m.top_k,
            );
            add("layers.*.ffn.experts.*.w2", expert, h, mi, layers * m.top_k);
            add("hc_head_fn", Format::F32, hc, hc * h, 1);
            add("head", dense, cfg.vocab_size, h, 1);
        }
    }
    out
}

/// The attention-decode shapes a model needs.
pub fn attn_shapes(cfg: &ModelConfig) -> Vec<AttnShape> {
    vec![AttnShape {
        head_dim: cfg.head_dim,
        n_heads: cfg.num_heads,
        n_kv_heads: cfg.num_kv_heads,
    }]
}

/// A problem found while planning, naming the model and matrix.
#[derive(Debug, Clone, PartialEq)]
pub enum PlanError {
    Config(ConfigError),
    Io {
        path: String,
        message: String,
    },
    Shape {
        model: String,
        matrix: String,
        message: String,
    },
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::Config(e) => write!(f, "{e}"),
            PlanError::Io { path, message } => write!(f, "{path}: {message}"),
            PlanError::Shape {
                model,
                matrix,
                message,
            } => write!(f, "{model}: matrix {matrix}: {message}"),
        }
    }
}

impl std::error::Error for PlanError {}

impl From<ConfigError> for PlanError {
    fn from(e: ConfigError) -> Self {
        PlanError::Config(e)
    }
}

/// A model the build (or a run) was planned for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlannedModel {
    pub source: String,
    pub summary: String,
    pub matrices: Vec<MatrixUse>,
    pub attn: Vec<AttnShape>,
}

/// What the build generates.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    pub models: Vec<PlannedModel>,
    /// Distinct specialised matrix shapes (matvec + matmul each).
    pub mat_shapes: Vec<MatShape>,
    pub attn_shapes: Vec<AttnShape>,
    /// ISA variants compiled in.
    pub isas: Vec<Isa>,
    /// target triple the kernels were compiled for.
    pub target: String,
    /// Notes from the build (e.g. why CUDA is not in it).
    pub notes: Vec<String>,
    /// The CPU preset the NEON variant was compiled for (aarch64 targets).
    #[serde(default)]
    pub cpu: Option<CpuPreset>,
    /// The CUDA side of a `cuda` build (None without the feature).
    #[serde(default)]
    pub cuda: Option<cuda::CudaPlan>,
}

/// A `BESPOKE_CPU` preset: the flags the NEON variant is compiled with, and
/// the CPU features (std::arch names) those flags let the compiler use, which
/// dispatch then requires of the running CPU along with NEON itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuPreset {
    pub name: String,
    pub cflags: Vec<String>,
    pub features: Vec<String>,
    /// The GPU of the board, for the CUDA backend (sm_87 for Jetson Orin).
    pub cuda_arch: Option<String>,
}

/// A named preset: (name, what it is, flags, features beyond NEON, CUDA arch).
pub type CpuPresetRow = (
    &'static str,
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
    Option<&'static str>,
);

/// The named presets.
pub const CPU_PRESETS: &[CpuPresetRow] = &[
    (
        "armv8-a",
        "any 64-bit Arm core (baseline NEON)",
        &["-march=armv8-a"],
        &[],
        None,
    ),
    (
        "jetson-orin",
        "NVIDIA Jetson AGX Orin: Cortex-A78AE, Armv8.2-A",
        &["-march=armv8.2-a+dotprod+fp16", "-mtune=cortex-a78ae"],
        &["dotprod", "fp16"],
        Some("sm_87"),
    ),
    (
        "dgx-spark",
        "NVIDIA DGX Spark (GB10): Cortex-X925 + A725, Armv9.2-A",
        &["-march=armv9-a+i8mm+bf16"],
        &["dotprod", "fp16", "i8mm", "bf16", "sve2"],
        Some("sm_121"),
    ),
    (
        "graviton3",
        "AWS Graviton3 and other Neoverse V1 servers, Armv8.4-A",
        &["-march=armv8.4-a+sve+i8mm+bf16", "-mtune=neoverse-v1"],
        &["dotprod", "fp16", "i8mm", "bf16", "sve"],
        None,
    ),
];

/// Resolve `BESPOKE_CPU` for a target arch. `None` (unset) is `armv8-a` on
/// aarch64 and nothing elsewhere; `native` is the build machine's own core
/// (`cpu_features`: its /proc/cpuinfo Features line), for native aarch64
/// builds only.
pub fn cpu_preset(
    name: Option<&str>,
    target_arch: &str,
    host_arch: &str,
    cpu_features: Option<&str>,
) -> Result<Option<CpuPreset>, String> {
    let names = || {
        let mut v: Vec<&str> = CPU_PRESETS.iter().map(|p| p.0).collect();
        v.push("native");
        v.join(", ")
    };
    if target_arch != "aarch64" {
        return match name {
            None => Ok(None),
            Some(n) => Err(format!(
                "BESPOKE_CPU={n}: the presets are for aarch64 targets ({}); this build targets {target_arch}, whose variants are chosen at run time",
                names()
            )),
        };
    }
    let name = name.unwrap_or("armv8-a");
    if name == "native" {
        if host_arch != "aarch64" {
            return Err(format!(
                "BESPOKE_CPU=native: the build machine is {host_arch}, not the aarch64 target; name a preset instead ({})",
                names()
            ));
        }
        let line = cpu_features.unwrap_or("");
        let mut features = Vec::new();
        for (cpuinfo, std_name) in [
            ("asimddp", "dotprod"),
            ("asimdhp", "fp16"),
            ("i8mm", "i8mm"),
            ("bf16", "bf16"),
            ("sve", "sve"),
            ("sve2", "sve2"),
        ] {
            if line.split_whitespace().any(|f| f == cpuinfo) {
                features.push(std_name.to_string());
            }
        }
        return Ok(Some(CpuPreset {
            name: "native".into(),
            cflags: vec!["-mcpu=native".into()],
            features,
            cuda_arch: None,
        }));
    }
    let p = CPU_PRESETS.iter().find(|p| p.0 == name).ok_or_else(|| {
        format!(
            "BESPOKE_CPU={name}: unknown preset; expected one of {}",
            names()
        )
    })?;
    Ok(Some(CpuPreset {
        name: p.0.into(),
        cflags: p.2.iter().map(|s| s.to_string()).collect(),
        features: p.3.iter().map(|s| s.to_string()).collect(),
        cuda_arch: p.4.map(str::to_string),
    }))
}

/// Resolve a model entry (a directory, or a `.json` config file) to the config file.
pub fn config_path(entry: &std::path::Path) -> std::path::PathBuf {
    if entry.extension().is_some_and(|e| e == "json") && !entry.is_dir() {
        entry.to_path_buf()
    } else {
        entry.join("config.json")
    }
}

/// Read and parse a model's config.json.
pub fn load_config(entry: &std::path::Path) -> Result<ModelConfig, PlanError> {
    let path = config_path(entry);
    let text = std::fs::read_to_string(&path).map_err(|e| PlanError::Io {
        path: path.display().to_string(),
        message: format!("cannot read config: {e}"),
    })?;
    Ok(ModelConfig::from_json_str(
        &path.display().to_string(),
        &text,
    )?)
}

/// Plan one model: its matrices (checked against their formats) and attention shapes.
pub fn plan_model(cfg: &ModelConfig) -> Result<PlannedModel, PlanError> {
    let matrices = matrices(cfg);
    for m in &matrices {
        if let Some(problem) = m.format.shape_problem(m.rows, m.cols) {
            return Err(PlanError::Shape {
                model: cfg.source.clone(),
                matrix: m.name.clone(),
                message: problem,
            });
        }
    }
    Ok(PlannedModel {
        source: cfg.source.clone(),
        summary: cfg.describe(),
        matrices,
        attn: attn_shapes(cfg),
    })
}

/// The whole build plan for a set of models, a target and the ISAs compiled.
pub fn plan(models: &[ModelConfig], isas: Vec<Isa>, target: &str) -> Result<Plan, PlanError> {
    let planned = models
        .iter()
        .map(plan_model)
        .collect::<Result<Vec<_>, _>>()?;
    let mut mats = BTreeSet::new();
    let mut attn = BTreeSet::new();
    for m in &planned {
        for u in &m.matrices {
            mats.insert(MatShape {
                format: u.format,
                rows: u.rows,
                cols: u.cols,
            });
        }
        attn.extend(m.attn.iter().copied());
    }
    Ok(Plan {
        models: planned,
        mat_shapes: mats.into_iter().collect(),
        attn_shapes: attn.into_iter().collect(),
        isas,
        target: target.to_string(),
        notes: Vec::new(),
        cuda: None,
        cpu: None,
    })
}

/// C symbol of a matrix kernel: `bs_{op}_{fmt}_{isa}_{shape|generic}`.
pub fn mat_symbol(op: Op, format: Format, isa: Isa, shape: Option<&MatShape>) -> String {
    let tail = shape.map(|s| s.key()).unwrap_or_else(|| "generic".into());
    format!("bs_{}_{}_{}_{}", op.name(), format.name(), isa.name(), tail)
}

/// C symbol of an fp4×q8 kernel (FP4 weights, int8 activations).
pub fn q8_symbol(isa: Isa, shape: Option<&MatShape>) -> String {
    let tail = shape.map(|s| s.key()).unwrap_or_else(|| "generic".into());
    format!("bs_q8_fp4_{}_{}", isa.name(), tail)
}

/// The name of the kernel family for `format`'s weights times activations
/// rounded to BF16 (AVX-512 BF16 only, templates/bf16dot.c.tera): bf16dot
/// for BF16 weights, fp8dot for FP8 ones.
pub fn dot_family(format: Format) -> &'static str {
    match format {
        Format::Fp8 => "fp8dot",
        _ => "bf16dot",
    }
}

/// C symbol of a bf16dot / fp8dot kernel.
pub fn dot_symbol(format: Format, shape: Option<&MatShape>) -> String {
    let tail = shape.map(|s| s.key()).unwrap_or_else(|| "generic".into());
    format!("bs_{}_avx512_{tail}", dot_family(format))
}

/// C symbol of an amx kernel (BF16, FP8 or FP4 weights on AMX tiles).
pub fn amx_symbol(format: Format, shape: Option<&MatShape>) -> String {
    let tail = shape.map(|s| s.key()).unwrap_or_else(|| "generic".into());
    format!("bs_amx_{}_{tail}", format.name())
}

/// C symbol of an attention kernel.
pub fn attn_symbol(isa: Isa, shape: Option<&AttnShape>) -> String {
    let tail = shape.map(|s| s.key()).unwrap_or_else(|| "generic".into());
    format!("bs_attn_decode_{}_{}", isa.name(), tail)
}
