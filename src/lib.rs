//! bespoke: inference kernels generated at build time for one model and one
//! machine. See README.md for the flow; `plan` is shared with build.rs.

pub mod bench;
pub mod bench_compare;
pub mod bench_e2e;
pub mod bench_gpu;
pub mod bench_plot;
pub mod bf16act;
pub mod chat;
pub mod commands;
pub mod cpu;
pub mod devcheck;
pub mod engine;
pub mod formats;
pub mod generate;
pub mod gpu;
pub mod inspect;
pub mod kernels;
pub mod linevec;
pub mod model;
pub mod placement;
#[path = "plan/mod.rs"]
pub mod plan;
pub mod q8;
pub mod reference;
pub mod report;
pub mod safetensors;
pub mod sample;
pub mod threads;
pub mod tokenizer;

pub use kernels::{AttnArgs, Kernels, Matrix, Weights};
