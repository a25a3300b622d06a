//! bespoke: inference kernels generated at build time for one model and one
//! machine. See README.md for the flow; `plan` is shared with build.rs.

pub mod bench;
pub mod cpu;
pub mod formats;
pub mod kernels;
#[path = "plan/mod.rs"]
pub mod plan;
pub mod reference;
pub mod report;
pub mod threads;

pub use kernels::{AttnArgs, Kernels, Matrix, Weights};
