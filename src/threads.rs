//! The worker thread count: `--threads`, else BESPOKE_THREADS, else the
//! number of physical cores.

/// Element-wise work (prefill's activations, not decode's) of at least
/// this many elements is split across the threads, in chunks of
/// [`PAR_ELEMENTWISE_CHUNK`]; below it a thread does it alone.
pub const PAR_ELEMENTWISE_MIN: usize = 1 << 16;
pub const PAR_ELEMENTWISE_CHUNK: usize = 1 << 14;

/// Whether element-wise work on `len` values is split across the threads
/// (see [`PAR_ELEMENTWISE_MIN`]).
pub fn split_elementwise(len: usize) -> bool {
    len >= PAR_ELEMENTWISE_MIN && rayon::current_num_threads() > 1
}

/// Resolve the thread count from a CLI value and the environment.
pub fn resolve(cli: Option<usize>) -> Result<usize, String> {
    if let Some(n) = cli {
        return if n == 0 {
            Err("--threads must be at least 1".into())
        } else {
            Ok(n)
        };
    }
    match std::env::var("BESPOKE_THREADS") {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "BESPOKE_THREADS={v:?}: expected a positive integer"
            )),
        },
        _ => Ok(crate::cpu::physical_cores()),
    }
}

/// Size rayon's global pool (once per process; later calls keep the first size).
pub fn init(n: usize) -> usize {
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
    rayon::current_num_threads()
}

/// A separate pool of `n` threads (benchmarks compare 1 thread and all).
pub fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .expect("creating a rayon thread pool")
}
