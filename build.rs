//! Build: plan → render (tera) → compile (cc) → bind (bindgen).
//! The logic lives in src/plan (shared with the binary) and src/codegen.rs;
//! this file only gathers the inputs and declares them to cargo.

#[path = "src/plan/mod.rs"]
mod plan;

#[path = "src/codegen.rs"]
mod codegen;

#[path = "src/cuda_build.rs"]
mod cuda_build;

fn main() {
    if let Err(e) = codegen::build() {
        eprintln!("\nbespoke build error: {e}\n");
        std::process::exit(1);
    }
}
