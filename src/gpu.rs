//! The CUDA runtime (feature `cuda`): find the driver, make a context, pick the
//! kernel image this build embedded for the device's compute capability, and
//! run the generated kernels. Any failure is one line saying why, and the
//! engine carries on on the CPU. Without the feature, the same API says the
//! build has no CUDA.
//!
//! The driver library is loaded at run time (cudarc's dynamic loading), so a
//! `cuda` build needs no driver to build or to run on a machine without one;
//! its presence is checked before any driver call, because calling into a
//! missing library panics.

use crate::plan::Format;

/// One embedded GPU image: a cubin for `arch`, or PTX for the driver to JIT.
#[derive(Debug)]
pub struct Image {
    pub arch: &'static str,
    pub ptx: bool,
    pub bytes: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/cuda_images.rs"));

/// The image for a device of compute capability (major, minor): a cubin built
/// for it (an arch-specific one first), else one its binary compatibility
/// allows (same major, older minor), else PTX from an older arch for the
/// driver to compile. None when nothing fits.
pub fn pick_image(images: &'static [Image], major: u32, minor: u32) -> Option<&'static Image> {
    use crate::plan::cuda::Arch;
    let cubins = || {
        images
            .iter()
            .filter(|i| !i.ptx)
            .filter_map(|i| Arch::parse(i.arch).ok().map(|a| (a, i)))
    };
    let exact = cubins()
        .filter(|(a, _)| a.major == major && a.minor == minor)
        .max_by_key(|(a, _)| a.specific)
        .map(|(_, i)| i);
    let compatible = || {
        cubins()
            .filter(|(a, _)| a.runs_on(major, minor))
            .max_by_key(|(a, _)| a.cc())
            .map(|(_, i)| i)
    };
    let ptx = || {
        images
            .iter()
            .filter(|i| i.ptx)
            .filter_map(|i| Arch::parse(i.arch).ok().map(|a| (a, i)))
            .filter(|(a, _)| a.cc() <= major * 10 + minor)
            .max_by_key(|(a, _)| a.cc())
            .map(|(_, i)| i)
    };
    exact.or_else(compatible).or_else(ptx)
}

/// What the build embedded, for `bespoke plan`.
pub fn images() -> &'static [Image] {
    IMAGES
}

/// `BESPOKE_CUDA=off` keeps a `cuda` build on the CPU.
fn disabled() -> bool {
    std::env::var("BESPOKE_CUDA")
        .map(|v| v.eq_ignore_ascii_case("off") || v == "0")
        .unwrap_or(false)
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use cudarc::driver::{
        CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
    };
    use std::sync::{Arc, OnceLock};

    /// A GPU with this build's kernels loaded.
    pub struct Gpu {
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        module: Arc<CudaModule>,
        pub name: String,
        pub cc: (u32, u32),
        pub image: &'static Image,
        pub total_mem: usize,
    }

    /// The GPU, once per process; Err is the one-line reason the engine runs
    /// on the CPU.
    pub fn gpu() -> Result<&'static Gpu, &'static str> {
        static GPU: OnceLock<Result<Gpu, String>> = OnceLock::new();
        GPU.get_or_init(probe).as_ref().map_err(|e| e.as_str())
    }

    fn probe() -> Result<Gpu, String> {
        if disabled() {
            return Err("BESPOKE_CUDA=off".into());
        }
        if IMAGES.is_empty() {
            return Err("this build has no GPU kernels (see `bespoke plan` for why)".into());
        }
        // SAFETY: only tries to dlopen the driver library by its usual names;
        // nothing from it is called here.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("no NVIDIA driver library (libcuda) on this machine".into());
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(0))
            .map_err(|_| "the CUDA driver failed to start".to_string())?
            .map_err(|e| format!("no usable CUDA device: {e}"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| format!("asking the device its compute capability: {e}"))?;
        let (major, minor) = (major as u32, minor as u32);
        let image = pick_image(IMAGES, major, minor).ok_or_else(|| {
            format!(
                "the device is sm_{major}{minor} and this build has kernels for {} only \
                 (rebuild with BESPOKE_CUDA_ARCH=native)",
                IMAGES.iter().map(|i| i.arch).collect::<Vec<_>>().join(", ")
            )
        })?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(image.bytes.to_vec()))
            .map_err(|e| format!("loading the {} kernels: {e}", image.arch))?;
        let name = ctx.name().unwrap_or_else(|_| "NVIDIA GPU".into());
        let total_mem = ctx.total_mem().unwrap_or(0);
        let stream = ctx.default_stream();
        Ok(Gpu {
            ctx,
            stream,
            module,
            name,
            cc: (major, minor),
            image,
            total_mem,
        })
    }

    fn derr(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
        move |e| format!("{what}: {e}")
    }

    /// Weights, scales and activations on the device for one product.
    pub struct DevMat {
        pub w: CudaSlice<u8>,
        pub scale: CudaSlice<u8>,
        pub format: Format,
        pub rows: usize,
        pub cols: usize,
    }

    impl Gpu {
        pub fn function(&self, name: &str) -> Result<CudaFunction, String> {
            self.module
                .load_function(name)
                .map_err(|e| format!("kernel {name} in the {} image: {e}", self.image.arch))
        }

        /// Upload one matrix (bytes as the CPU kernels take them).
        pub fn upload(
            &self,
            format: Format,
            w: &[u8],
            scale: &[u8],
            rows: usize,
            cols: usize,
        ) -> Result<DevMat, String> {
            let w = self
                .stream
                .clone_htod(w)
                .map_err(derr("copying weights to the GPU"))?;
            // A zero-length allocation is not allowed: give unscaled formats one byte.
            let scale = if scale.is_empty() { &[0u8][..] } else { scale };
            let scale = self
                .stream
                .clone_htod(scale)
                .map_err(derr("copying scales to the GPU"))?;
            Ok(DevMat {
                w,
                scale,
                format,
                rows,
                cols,
            })
        }

        /// Y[n][rows] = W X[n][cols] with the CUDA-core kernel `kernel`
        /// (`bs_cu_matvec_<fmt>` for n = 1, `bs_cu_matmul_<fmt>` otherwise, or a
        /// specialised name), or with a tensor-core kernel (`bs_tc_*`).
        pub fn matmul(
            &self,
            kernel: &str,
            m: &DevMat,
            x: &[f32],
            n: usize,
        ) -> Result<Vec<f32>, String> {
            let f = self.function(kernel)?;
            let xd = self
                .stream
                .clone_htod(x)
                .map_err(derr("copying activations"))?;
            let mut y = self
                .stream
                .alloc_zeros::<f32>(m.rows * n)
                .map_err(derr("allocating the output"))?;
            let (rows, cols, nn) = (m.rows as i32, m.cols as i32, n as i32);
            let tc = kernel.starts_with("bs_tc_");
            let quantized = matches!(kernel, "bs_tc_q8_fp4" | "bs_tc_fp8_fp8" | "bs_tc_mxf4_fp4");
            let q = if quantized {
                Some(self.quantize(kernel, &xd, m.cols, n)?)
            } else {
                None
            };
            let cfg = if tc {
                LaunchConfig {
                    grid_dim: (m.rows.div_ceil(64) as u32, n.div_ceil(8) as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                }
            } else {
                LaunchConfig {
                    grid_dim: (m.rows.div_ceil(4) as u32, 1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                }
            };
            let mut b = self.stream.launch_builder(&f);
            b.arg(&m.w).arg(&m.scale);
            match &q {
                Some((codes, scales)) => b.arg(codes).arg(scales),
                None => b.arg(&xd),
            };
            b.arg(&mut y).arg(&rows).arg(&cols);
            if kernel.contains("matmul") || tc {
                b.arg(&nn);
            }
            // SAFETY: the kernel's parameters are exactly the ones pushed above
            // (templates/cuda.cu.tera), every buffer holds what the grid reads
            // and writes for these rows, cols and n, checked by the caller.
            unsafe { b.launch(cfg) }.map_err(derr("launching the kernel"))?;
            self.stream
                .clone_dtoh(&y)
                .map_err(derr("copying the result back"))
        }

        /// Activations for the quantized tensor-core paths: (codes, scales).
        fn quantize(
            &self,
            kernel: &str,
            x: &CudaSlice<f32>,
            cols: usize,
            n: usize,
        ) -> Result<(CudaSlice<u8>, CudaSlice<u8>), String> {
            let (qname, qbytes, sbytes, blocks) = match kernel {
                "bs_tc_q8_fp4" => (
                    "bs_cu_quant_q8",
                    cols * n,
                    4 * (cols / 32) * n,
                    (cols / 32) * n,
                ),
                "bs_tc_fp8_fp8" => (
                    "bs_cu_quant_e4m3",
                    cols * n,
                    4 * cols.div_ceil(128) * n,
                    cols.div_ceil(128) * n,
                ),
                _ => (
                    "bs_cu_quant_mxf4",
                    cols / 2 * n,
                    (cols / 32) * n,
                    (cols / 32) * n,
                ),
            };
            let f = self.function(qname)?;
            let mut q = self
                .stream
                .alloc_zeros::<u8>(qbytes.max(1))
                .map_err(derr("allocating"))?;
            let mut s = self
                .stream
                .alloc_zeros::<u8>(sbytes.max(1))
                .map_err(derr("allocating"))?;
            let (c, nn) = (cols as i32, n as i32);
            let cfg = LaunchConfig {
                grid_dim: (blocks.div_ceil(4).max(1) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(&f);
            b.arg(x).arg(&mut q).arg(&mut s).arg(&c).arg(&nn);
            // SAFETY: (x, codes, scales, cols, n) as the quantize kernels take
            // them; the buffers are sized for cols x n above.
            unsafe { b.launch(cfg) }.map_err(derr("launching the quantize kernel"))?;
            Ok((q, s))
        }

        /// Attention decode on the GPU (the CPU kernel's arguments).
        #[allow(clippy::too_many_arguments)]
        pub fn attn_decode(
            &self,
            kernel: &str,
            q: &[f32],
            k: &[f32],
            v: &[f32],
            sinks: Option<&[f32]>,
            n_heads: usize,
            n_kv_heads: usize,
            head_dim: usize,
            kv_stride: usize,
            t_len: usize,
            window: usize,
            scale: f32,
        ) -> Result<Vec<f32>, String> {
            let f = self.function(kernel)?;
            let up = |s: &[f32]| {
                self.stream
                    .clone_htod(s)
                    .map_err(derr("copying to the GPU"))
            };
            let (qd, kd, vd) = (up(q)?, up(k)?, up(v)?);
            let sd = up(sinks.unwrap_or(&[0.0]))?;
            let mut out = self
                .stream
                .alloc_zeros::<f32>(n_heads * head_dim)
                .map_err(derr("allocating"))?;
            let mut scratch = self
                .stream
                .alloc_zeros::<f32>((n_heads * t_len).max(1))
                .map_err(derr("allocating"))?;
            let null = 0u64;
            let ints = [
                n_heads as i32,
                n_kv_heads as i32,
                head_dim as i32,
                kv_stride as i32,
                t_len as i32,
                window as i32,
            ];
            let mut b = self.stream.launch_builder(&f);
            b.arg(&qd).arg(&kd).arg(&vd);
            if sinks.is_some() {
                b.arg(&sd);
            } else {
                b.arg(&null);
            }
            b.arg(&mut out).arg(&mut scratch);
            for i in &ints {
                b.arg(i);
            }
            b.arg(&scale);
            let cfg = LaunchConfig {
                grid_dim: (n_heads as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match bs_cu_attn_decode*; q, k, v hold what
            // the shapes say (checked by the caller), sinks is n_heads long or
            // a null pointer, out and scratch are sized above.
            unsafe { b.launch(cfg) }.map_err(derr("launching attention"))?;
            self.stream
                .clone_dtoh(&out)
                .map_err(derr("copying the result back"))
        }

        pub fn synchronize(&self) -> Result<(), String> {
            self.ctx.synchronize().map_err(derr("synchronizing"))
        }
    }
}

#[cfg(feature = "cuda")]
pub use imp::{gpu, DevMat, Gpu};

/// One line for banners and `bespoke plan`: the device in use, or why the
/// engine runs on the CPU.
pub fn status_line() -> String {
    #[cfg(feature = "cuda")]
    {
        match imp::gpu() {
            Ok(g) => format!(
                "CUDA: {} (sm_{}{}, {:.0} GiB), kernels from the {} image",
                g.name,
                g.cc.0,
                g.cc.1,
                g.total_mem as f64 / (1u64 << 30) as f64,
                g.image.arch
            ),
            Err(why) => format!("CUDA: running on the CPU: {why}"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = disabled;
        "CUDA: not built with CUDA (the `cuda` feature is off); running on the CPU".into()
    }
}

/// The CUDA kernel name for a matrix product on the CUDA cores.
pub fn core_kernel(format: Format, n: usize, shape: Option<(usize, usize)>) -> String {
    let op = if n == 1 { "matvec" } else { "matmul" };
    match shape {
        Some((r, c)) => format!("bs_cu_{op}_{}_{r}x{c}", format.name()),
        None => format!("bs_cu_{op}_{}", format.name()),
    }
}
