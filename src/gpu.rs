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

use crate::plan::{Format, Plan};

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

/// A matrix's weight and scale bytes, as the GPU kernels take them.
pub fn matrix_bytes<'a>(m: &crate::Matrix<'a>) -> (&'a [u8], &'a [u8]) {
    use crate::Weights;
    match m.weights() {
        Weights::F32(w) => (bytemuck::cast_slice(w), &[]),
        Weights::Bf16(w) => (bytemuck::cast_slice(w), &[]),
        Weights::Fp8 { w, scale } | Weights::Fp4 { w, scale } => (w, scale),
    }
}

/// Whether this build turned tensor-core path `key` (a `TcPath::key`) on for
/// the image `arch` (from the plan the build embedded).
pub fn image_has_tc(arch: &str, key: &str) -> bool {
    // Parsed once: the engine asks for each prefill product of a variant.
    static PLAN: std::sync::OnceLock<Plan> = std::sync::OnceLock::new();
    PLAN.get_or_init(crate::report::build_plan)
        .cuda
        .as_ref()
        .and_then(|c| c.archs.iter().find(|a| a.arch.name() == arch))
        .is_some_and(|a| a.tc.iter().any(|d| d.on && d.path.key() == key))
}

/// The activations the CPU would give a product (its `--bf16-act`,
/// `--fp8-act`, `--fp4-act` choice for the matrix's format and the token
/// count), which picks the GPU kernel with the same numerics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuAct {
    /// f32 activations: the CUDA-core kernels.
    F32,
    /// Activations rounded to BF16 (bf16dot, fp8dot, amx): the BF16
    /// tensor-core kernel, weights decoded to BF16 exactly, f32 sums.
    Bf16,
    /// int8 activations (fp4×q8): the INT8 tensor-core kernel, which is the
    /// CPU's fp4×q8 bit for bit.
    Q8,
    /// DeepSeek's simulated FP8 activations of an FP8 or FP4 product
    /// (`--numerics deepseek`: `engine::fp8_act_quant`), made on the device
    /// (`bs_cu_round_fp8sim`) for the CUDA-core kernels.
    Fp8Sim,
}

impl GpuAct {
    /// How the start-up check and the errors name the activations.
    pub fn label(self) -> &'static str {
        match self {
            GpuAct::F32 => "f32",
            GpuAct::Bf16 => "BF16",
            GpuAct::Q8 => "int8",
            GpuAct::Fp8Sim => "DeepSeek's FP8-simulated",
        }
    }
}

/// X as the CPU variant of `act` sees it, for a product that runs on the
/// CUDA cores (f32 sums): rounded to BF16 (bf16dot, fp8dot, amx), or
/// quantized to int8 per 32 columns and taken back as q · d (fp4×q8). So a
/// variant's numerics on the GPU do not change with the token count or the
/// shape, only the order of its sums. DeepSeek's FP8-simulated ones:
/// `engine::fp8_act_quant`. None: f32 activations, X as it is. The
/// definition the device's `bs_cu_round_bf16`, `bs_cu_round_q8` and
/// `bs_cu_round_fp8sim` are held to, bit for bit (tests/gpu.rs).
pub fn variant_activations(
    act: GpuAct,
    x: &[f32],
    cols: usize,
) -> Result<Option<Vec<f32>>, String> {
    match act {
        GpuAct::F32 => Ok(None),
        GpuAct::Bf16 => Ok(Some(
            x.iter()
                .map(|&v| f32::from_bits((crate::bf16act::round(v) as u32) << 16))
                .collect(),
        )),
        GpuAct::Q8 => {
            let mut out = vec![0f32; x.len()];
            let mut a = crate::q8::Q8Act::default();
            for (xt, ot) in x.chunks(cols.max(1)).zip(out.chunks_mut(cols.max(1))) {
                a.quantize_from(xt).map_err(|e| e.to_string())?;
                a.dequantize_into(ot);
            }
            Ok(Some(out))
        }
        GpuAct::Fp8Sim => Ok(Some(crate::engine::fp8_act_quant(x, cols))),
    }
}

/// The fewest tokens a product takes to a tensor-core kernel. A decode
/// step's matvec (one token) stays on the CUDA cores: it is bound by reading
/// the weights, and a tensor-core tile would use one of its 8 columns.
pub const TC_MIN_TOKENS: usize = 2;

/// The tensor-core kernel for a product of `n` tokens over `cols` columns
/// with activations `act`, where the image has it (`has`: a `TcPath::key`
/// is on); None: the CUDA-core kernel.
pub fn tc_kernel(
    format: Format,
    n: usize,
    cols: usize,
    act: GpuAct,
    has: impl Fn(&str) -> bool,
) -> Option<String> {
    if n < TC_MIN_TOKENS || cols % 32 != 0 {
        return None;
    }
    match act {
        GpuAct::Q8 if format == Format::Fp4 && has("mma_int8") => Some("bs_tc_q8_fp4".into()),
        GpuAct::Bf16 if format != Format::F32 && has("mma_bf16") => {
            Some(format!("bs_tc_bf16_{}", format.name()))
        }
        _ => None,
    }
}

/// What `BESPOKE_CUDA` asks for: `off` (or `0`) keeps a `cuda` build on the
/// CPU, `emu` runs the CUDA-core kernels on the CPU emulator, anything else
/// (or unset) the GPU when there is one.
#[cfg(feature = "cuda")]
fn mode() -> Option<&'static str> {
    match std::env::var("BESPOKE_CUDA") {
        Ok(v) if v.eq_ignore_ascii_case("off") || v == "0" => Some("off"),
        Ok(v) if v.eq_ignore_ascii_case("emu") => Some("emu"),
        _ => None,
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use cudarc::driver::{
        CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig,
        PushKernelArg, ValidAsZeroBits,
    };
    use std::sync::{Arc, OnceLock};

    /// The emulator's stand-in for an image: no code, no tensor-core paths
    /// (`image_has_tc` finds no arch of this name in the build plan).
    static EMU_IMAGE: Image = Image {
        arch: "emu",
        ptx: false,
        bytes: &[],
    };

    /// What the emulated device says it holds (placement's default budget is
    /// this less 1 GiB).
    const EMU_MEM: usize = 4 << 30;

    mod emu_ffi {
        use std::ffi::{c_char, c_int, c_uint, c_void};
        extern "C" {
            /// kernels/bs_cuda_emu.cpp.
            pub fn bs_emu_launch(
                name: *const c_char,
                grid: *const c_uint,
                block: *const c_uint,
                args: *mut *mut c_void,
                err: *mut c_char,
                errlen: usize,
            ) -> c_int;
        }
    }

    /// The emulator's fault injection, `BESPOKE_CUDA_EMU_FAIL=KERNEL[:N[+]]`
    /// (a test hook: the emulator only, never a GPU): the Nth launch
    /// (default the first) of a kernel whose name starts with KERNEL (`*`:
    /// any kernel) fails, as a launch on a faulting GPU would, and with `+`
    /// every matching launch from the Nth on (a device that went away).
    /// tests/gpu.rs uses it to check that each GPU path falls back to the
    /// CPU with nothing lost or counted twice.
    fn emu_fault(kernel: &str) -> Result<(), String> {
        use std::sync::atomic::{AtomicU64, Ordering};
        /// (prefix, N, from N on), or what is wrong with the setting.
        type Spec = Result<(String, u64, bool), String>;
        static SPEC: OnceLock<Option<Spec>> = OnceLock::new();
        static SEEN: AtomicU64 = AtomicU64::new(0);
        let spec = SPEC.get_or_init(|| {
            let v = std::env::var("BESPOKE_CUDA_EMU_FAIL").ok()?;
            let (name, at) = v.split_once(':').unwrap_or((&v, "1"));
            let (at, on) = at.strip_suffix('+').map_or((at, false), |a| (a, true));
            let name = if name == "*" { "" } else { name };
            Some(match at.parse::<u64>() {
                Ok(n) if n >= 1 => Ok((name.to_string(), n, on)),
                _ => Err(format!(
                    "BESPOKE_CUDA_EMU_FAIL={v}: expected KERNEL, KERNEL:N or KERNEL:N+ \
                     (N a launch count from 1; KERNEL a kernel name's start, or *)"
                )),
            })
        });
        match spec {
            None => Ok(()),
            Some(Err(e)) => Err(e.clone()),
            Some(Ok((name, at, on))) if kernel.starts_with(name.as_str()) => {
                let seen = SEEN.fetch_add(1, Ordering::Relaxed) + 1;
                if seen == *at || (*on && seen > *at) {
                    Err(format!(
                        "{kernel}: injected failure of launch {seen} (BESPOKE_CUDA_EMU_FAIL)"
                    ))
                } else {
                    Ok(())
                }
            }
            Some(Ok(_)) => Ok(()),
        }
    }

    thread_local! {
        /// Set while this thread runs the start-up check, whose launches
        /// `BESPOKE_CUDA_EMU_FAIL` does not count or fail.
        static CHECKING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// The emulator's wrong answers, `BESPOKE_CUDA_EMU_WRONG=KERNEL`: every
    /// launch of a kernel whose name starts with KERNEL (`*`: any) returns
    /// its output (the first it writes) off by a quarter and a half, as a
    /// kernel that misreads a layout would on a GPU. What the start-up
    /// check ([`Gpu::startup_check`]) is there to catch. A GPU ignores it.
    fn emu_wrong(kernel: &str) -> bool {
        static SPEC: OnceLock<Option<String>> = OnceLock::new();
        SPEC.get_or_init(|| {
            let v = std::env::var("BESPOKE_CUDA_EMU_WRONG").ok()?;
            Some(if v == "*" { String::new() } else { v })
        })
        .as_deref()
        .is_some_and(|p| kernel.starts_with(p))
    }

    /// Where the kernels run.
    enum Dev {
        Cuda {
            ctx: Arc<CudaContext>,
            stream: Arc<CudaStream>,
            module: Arc<CudaModule>,
        },
        /// The CPU emulator of the CUDA-core kernels (kernels/bs_cuda_emu.*):
        /// "device" memory is host memory.
        Emu,
    }

    /// Tensor-core paths turned off (`TcPath::key`), each with why.
    pub type TcOff = Vec<(&'static str, String)>;

    /// A GPU with this build's kernels loaded (or the emulator, `BESPOKE_CUDA=emu`).
    pub struct Gpu {
        dev: Dev,
        pub name: String,
        pub cc: (u32, u32),
        pub image: &'static Image,
        pub total_mem: usize,
        /// The tensor-core paths (`TcPath::key`) the start-up check turned
        /// off, each with what it found: their products run on the CUDA
        /// cores.
        pub tc_off: TcOff,
        /// How many launches the start-up check compared with the CPU.
        pub checked: usize,
    }

    /// A sequence's KV cache mirrored in device memory, so that attention
    /// runs where its keys are: per layer, keys and values position-major
    /// (`capacity` rows of n_kv_heads × head_dim floats), appended as the
    /// engine appends to its own cache, and one call's query, output and
    /// score buffers. Its bytes come out of the VRAM tier's KV reservation
    /// ([`crate::placement`]) and go back when it is dropped.
    pub struct KvMirror {
        g: &'static Gpu,
        k: Vec<DevBuf<f32>>,
        v: Vec<DevBuf<f32>>,
        q: DevBuf<f32>,
        out: DevBuf<f32>,
        scratch: DevBuf<f32>,
        /// bs_cu_attn_causal, or its specialisation for these shapes.
        kernel: String,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        tier: u32,
        bytes: u64,
        /// [`KvMirror::layers_forward`]'s activations, kept from step to step
        /// (grown when a step needs more), so that a decode step allocates
        /// nothing on the device.
        work: Vec<DevBuf<f32>>,
        /// An MoE layer's experts' outputs in such a step, one buffer each.
        expert_out: Vec<DevBuf<f32>>,
        /// And its routing: the experts' tokens and weights.
        routing: (DevBuf<i32>, DevBuf<f32>),
    }

    impl KvMirror {
        /// A mirror on the GPU of VRAM tier `tier`. `specialised`: the build
        /// has an attention kernel for these shapes. Err: no GPU, sizes the
        /// kernel cannot take, the tier's KV reservation too small, or out
        /// of memory (the caller keeps attention on the CPU).
        pub fn new(
            tier: u32,
            layers: usize,
            n_heads: usize,
            n_kv_heads: usize,
            head_dim: usize,
            capacity: usize,
            specialised: bool,
        ) -> Result<KvMirror, String> {
            let g = gpu().map_err(str::to_string)?;
            let (w, qb) = (n_kv_heads * head_dim, GPU_QUERIES);
            if layers == 0
                || capacity == 0
                || head_dim == 0
                || n_kv_heads == 0
                || n_heads == 0
                || n_heads % n_kv_heads != 0
            {
                return Err(format!(
                    "attention on the GPU: {layers} layers, {capacity} positions, {n_heads} heads over {n_kv_heads} KV heads of {head_dim}"
                ));
            }
            if [
                capacity.checked_mul(w),
                (qb * n_heads).checked_mul(capacity),
                (qb * n_heads).checked_mul(head_dim),
            ]
            .iter()
            .any(|v| v.map_or(true, |v| v > i32::MAX as usize))
            {
                return Err("attention on the GPU: the kernel takes sizes below 2^31".into());
            }
            let bytes = kv_mirror_bytes(layers, n_heads, n_kv_heads, head_dim, capacity);
            tier::take_kv(tier, bytes)?;
            let alloc = || -> Result<_, String> {
                let mut k = Vec::with_capacity(layers);
                let mut v = Vec::with_capacity(layers);
                for _ in 0..layers {
                    k.push(g.zeros::<f32>(capacity * w)?);
                    v.push(g.zeros::<f32>(capacity * w)?);
                }
                Ok((
                    k,
                    v,
                    g.zeros::<f32>(qb * n_heads * head_dim)?,
                    g.zeros::<f32>(qb * n_heads * head_dim)?,
                    g.zeros::<f32>(qb * n_heads * capacity)?,
                ))
            };
            let (k, v, q, out, scratch) = alloc().inspect_err(|_| tier::give_kv(tier, bytes))?;
            let kernel = if specialised {
                format!("bs_cu_attn_causal_d{head_dim}_h{n_heads}_kv{n_kv_heads}")
            } else {
                "bs_cu_attn_causal".to_string()
            };
            Ok(KvMirror {
                g,
                k,
                v,
                q,
                out,
                scratch,
                kernel,
                work: Vec::new(),
                expert_out: Vec::new(),
                routing: (DevBuf::empty(), DevBuf::empty()),
                n_heads,
                n_kv_heads,
                head_dim,
                capacity,
                tier,
                bytes,
            })
        }

        /// Write positions pos0.. of layer `layer`: `k` and `v` hold whole
        /// rows of n_kv_heads × head_dim floats, position-major.
        pub fn append(
            &mut self,
            layer: usize,
            pos0: usize,
            k: &[f32],
            v: &[f32],
        ) -> Result<(), String> {
            let w = self.n_kv_heads * self.head_dim;
            let n = k.len() / w;
            if layer >= self.k.len()
                || k.len() != v.len()
                || k.len() % w != 0
                || pos0 + n > self.capacity
            {
                return Err(format!(
                    "KV mirror: layer {layer} of {}, {} / {} floats at position {pos0} (rows of {w}, room for {})",
                    self.k.len(),
                    k.len(),
                    v.len(),
                    self.capacity
                ));
            }
            self.g.htod_into(k, &mut self.k[layer], pos0 * w)?;
            self.g.htod_into(v, &mut self.v[layer], pos0 * w)
        }

        /// Attention of n consecutive queries `q` [n][n_heads × head_dim] of
        /// layer `layer`, causal: query i over positions 0 .. t_len + i - 1
        /// (no sinks, no window), into `out` (the same shape). A decode step
        /// is n = 1; a prefill step's queries go GPU_QUERIES to a launch.
        pub fn attend(
            &mut self,
            layer: usize,
            q: &[f32],
            t_len: usize,
            scale: f32,
            out: &mut [f32],
        ) -> Result<(), String> {
            let hw = self.n_heads * self.head_dim;
            let n = q.len() / hw;
            if layer >= self.k.len()
                || q.len() % hw != 0
                || out.len() != q.len()
                || n == 0
                || t_len == 0
                || t_len + n - 1 > self.capacity
            {
                return Err(format!(
                    "KV mirror: layer {layer} of {}, q {} and out {} floats (rows of {hw}), queries from position {t_len} of {}",
                    self.k.len(),
                    q.len(),
                    out.len(),
                    self.capacity
                ));
            }
            let step = GPU_QUERIES * hw;
            for (g, (qg, og)) in q.chunks(step).zip(out.chunks_mut(step)).enumerate() {
                self.g.htod_into(qg, &mut self.q, 0)?;
                self.causal(layer, t_len + g * GPU_QUERIES, qg.len() / hw, scale)?;
                self.g.dtoh_into(&self.out, og)?;
            }
            Ok(())
        }

        /// Causal attention of the `n_q` (≤ GPU_QUERIES) queries in `self.q`
        /// of layer `layer`, query j over positions 0 .. t_len + j − 1, into
        /// `self.out`. The callers check that t_len + n_q − 1 ≤ capacity.
        fn causal(
            &mut self,
            layer: usize,
            t_len: usize,
            n_q: usize,
            scale: f32,
        ) -> Result<(), String> {
            let geo = AttnGeo {
                n_heads: self.n_heads,
                n_kv_heads: self.n_kv_heads,
                head_dim: self.head_dim,
                kv_stride: self.n_kv_heads * self.head_dim,
                t_len,
                window: 0,
                scale,
                n_q: Some(n_q),
            };
            // Checked: q and out hold GPU_QUERIES ≥ n_q rows of n_heads ×
            // head_dim, k and v capacity ≥ t_len + n_q − 1 rows of kv_stride
            // (the callers), scratch GPU_QUERIES × n_heads × capacity, every
            // size below 2^31 (new).
            self.g.attn_launch(
                &self.kernel,
                &self.q,
                &self.k[layer],
                &self.v[layer],
                None,
                &mut self.out,
                &mut self.scratch,
                geo,
            )
        }
    }

    /// A dense Llama-family model's geometry, as a forward on the GPU
    /// ([`KvMirror::layers_forward`]) takes it.
    #[derive(Clone, Copy, Debug)]
    pub struct DenseGeo {
        pub d: usize,
        pub heads: usize,
        pub kv_heads: usize,
        pub head_dim: usize,
        /// Rotated values of each head (RoPE): even, at most head_dim.
        pub rope_dim: usize,
        pub eps: f32,
        /// The attention's scale (1 / sqrt(head_dim)).
        pub scale: f32,
    }

    /// One layer's norm weights and biases as the engine holds them.
    pub struct LayerVectors<'a> {
        pub in_norm: &'a [f32],
        pub post_norm: &'a [f32],
        /// Qwen3's per-head RMSNorm weights on q and k.
        pub qk_norm: Option<(&'a [f32], &'a [f32])>,
        /// q, k, v and o biases.
        pub bias: [Option<&'a [f32]>; 4],
    }

    /// A dense model's norm weights and biases on the device, with its
    /// geometry: what a forward on the GPU takes besides the resident
    /// matrices ([`Gpu::dense_vectors`]). A few vectors of the model's
    /// width a layer.
    pub struct DenseVectors {
        geo: DenseGeo,
        layers: Vec<DeviceLayerVectors>,
        norm: DevBuf<f32>,
    }

    struct DeviceLayerVectors {
        in_norm: DevBuf<f32>,
        post_norm: DevBuf<f32>,
        qk_norm: Option<(DevBuf<f32>, DevBuf<f32>)>,
        bias: [Option<DevBuf<f32>>; 4],
    }

    impl DenseVectors {
        pub fn geo(&self) -> DenseGeo {
            self.geo
        }

        /// Device bytes they take.
        pub fn bytes(&self) -> u64 {
            let mut n = self.norm.len();
            for l in &self.layers {
                n += l.in_norm.len() + l.post_norm.len();
                n += l.qk_norm.as_ref().map_or(0, |(q, k)| q.len() + k.len());
                n += l.bias.iter().flatten().map(DevBuf::len).sum::<usize>();
            }
            4 * n as u64
        }
    }

    /// A resident matrix for a product on the device: its device copy,
    /// whether the build specialised a CUDA-core kernel for its shape, and
    /// the activations the CPU would give the product ([`GpuAct`]), which
    /// pick the kernel (`Gpu::product`).
    #[derive(Clone)]
    pub struct DevProduct {
        pub mat: Arc<DevMat>,
        pub specialised: bool,
        pub act: GpuAct,
    }

    impl DevProduct {
        /// A product with f32 activations.
        pub fn f32(mat: Arc<DevMat>, specialised: bool) -> DevProduct {
            DevProduct {
                mat,
                specialised,
                act: GpuAct::F32,
            }
        }
    }

    /// One layer's resident matrices for [`KvMirror::layers_forward`].
    pub struct LayerMats {
        /// q, k, v and o.
        pub attn: [DevProduct; 4],
        pub ffn: LayerFfn,
    }

    /// A layer's feed-forward block in [`KvMirror::layers_forward`].
    pub enum LayerFfn {
        /// A dense SwiGLU MLP: gate, up and down.
        Dense([DevProduct; 3]),
        /// Routed SwiGLU experts of intermediate width `inter`: the router
        /// (resident) runs on the device, and for each step the engine
        /// ([`MoeHost`]) says which experts its tokens chose and which of
        /// them are resident.
        Moe { router: DevProduct, inter: usize },
    }

    /// An expert a step's tokens chose in an MoE layer ([`MoeHost::route`]).
    pub struct RoutedExpert {
        pub expert: usize,
        /// Its tokens, ascending, each below the step's count, with their
        /// weights.
        pub tokens: Vec<(usize, f32)>,
        /// Gate, up and down where all three are resident (it runs on the
        /// device); None: it runs on the CPU ([`MoeHost::run_expert`]).
        pub mats: Option<[DevProduct; 3]>,
    }

    /// The engine's side of its MoE layers in a forward on the GPU: the
    /// routing (made on the CPU from the router's logits, as the CPU path
    /// makes it, usage counted) and the experts that are not resident.
    pub trait MoeHost {
        /// The experts layer `layer`'s router logits `[n][experts]` choose,
        /// in the order their outputs add up.
        fn route(
            &self,
            layer: usize,
            logits: &[f32],
            n: usize,
        ) -> Result<Vec<RoutedExpert>, String>;
        /// Expert `expert` of layer `layer` on the CPU: `y` `[rows][d]` from
        /// its tokens' rows `x` `[rows][d]`.
        fn run_expert(
            &self,
            layer: usize,
            expert: usize,
            x: &[f32],
            y: &mut [f32],
        ) -> Result<(), String>;
    }

    /// A step's experts of one MoE layer, checked, with their tokens
    /// flattened: indices and weights, expert i's from `offs[i]`.
    struct Routing {
        experts: Vec<RoutedExpert>,
        idx: Vec<i32>,
        weights: Vec<f32>,
        offs: Vec<usize>,
    }

    fn check_routing(
        experts: Vec<RoutedExpert>,
        n: usize,
        d: usize,
        inter: usize,
    ) -> Result<Routing, String> {
        let (mut idx, mut weights, mut offs) = (Vec::new(), Vec::new(), vec![0]);
        for r in &experts {
            let ascending = r.tokens.windows(2).all(|w| w[0].0 < w[1].0);
            if r.tokens.is_empty() || !ascending || r.tokens.last().is_some_and(|t| t.0 >= n) {
                return Err(format!(
                    "expert {}: tokens {:?} for a step of {n} (one or more, ascending, below {n})",
                    r.expert,
                    r.tokens.iter().map(|t| t.0).collect::<Vec<_>>()
                ));
            }
            if let Some([g, u, dn]) = &r.mats {
                let (g, u, dn) = (&g.mat, &u.mat, &dn.mat);
                let i = g.rows;
                if i > inter || (g.cols, u.rows, u.cols, dn.rows, dn.cols) != (d, i, d, d, i) {
                    return Err(format!(
                        "expert {}: gate {}×{}, up {}×{} and down {}×{} do not chain at width {d} \
                         within {inter}",
                        r.expert, g.rows, g.cols, u.rows, u.cols, dn.rows, dn.cols
                    ));
                }
            }
            idx.extend(r.tokens.iter().map(|t| t.0 as i32));
            weights.extend(r.tokens.iter().map(|t| t.1));
            offs.push(idx.len());
        }
        Ok(Routing {
            experts,
            idx,
            weights,
            offs,
        })
    }

    impl KvMirror {
        /// One forward of a Llama-family model (Llama, Qwen2, Qwen3,
        /// Qwen3-MoE) with every layer on the GPU: `x` the tokens'
        /// embeddings `[n][d]`, uploaded once, `rope` each token's rotary
        /// table (rows of head_dim floats: cos then sin of rope_dim / 2
        /// frequencies, as `Rope::table` makes them), positions pos0 ..
        /// pos0 + n − 1. Per layer, on the device: RMSNorm, q/k/v, biases,
        /// the q/k norms, RoPE, the keys and values into this mirror, causal
        /// attention, o, the residual, RMSNorm; then a dense MLP (gate, up,
        /// SwiGLU, down) or an MoE block, and the residual. An MoE block
        /// runs its router on the device and sends the logits back (the one
        /// wait of such a layer): `moe` routes them, the chosen resident
        /// experts are queued on the device (their tokens' rows gathered
        /// there), the others run on the CPU meanwhile (`moe.run_expert`,
        /// on the normalised rows, which then come back too) and go up, and
        /// every expert's output is added, weighted, in the routing's order
        /// (`bs_cu_scatter_add`, as the CPU adds). Then the final RMSNorm of
        /// the last `out_rows` rows and, with a resident `head`, the
        /// logits: Ok(logits `[out_rows][vocab]`), or without a head the
        /// normalised rows `[out_rows][d]` (the caller applies its head), with
        /// `kv` `[layers][k, v][n][kv_heads × head_dim]` the new keys and
        /// values for the CPU's copy of the cache. The products are the
        /// CUDA-core kernels of the per-product path; RoPE, biases,
        /// residuals and the experts' weighted sums are the CPU's bit for
        /// bit; the norms' sums of squares go in a tree (`bs_cu_rmsnorm`).
        /// Err: shapes that do not chain or do not fit the mirror, a routing
        /// that does not fit the step, or a failed launch or copy (the
        /// caller runs the step on the CPU, whose cache this step has not
        /// touched).
        #[allow(clippy::too_many_arguments)]
        pub fn layers_forward(
            &mut self,
            vecs: &DenseVectors,
            mats: &[LayerMats],
            moe: Option<&dyn MoeHost>,
            head: Option<&DevProduct>,
            x: &[f32],
            rope: &[f32],
            pos0: usize,
            out_rows: usize,
            kv: &mut [f32],
        ) -> Result<Vec<f32>, String> {
            let g = self.g;
            let geo = vecs.geo;
            let (d, h, kvh, hd) = (geo.d, geo.heads, geo.kv_heads, geo.head_dim);
            let (hw, kvw, layers) = (h * hd, kvh * hd, self.k.len());
            let n = x.len().checked_div(d).unwrap_or(0);
            if (h, kvh, hd) != (self.n_heads, self.n_kv_heads, self.head_dim)
                || mats.len() != layers
                || vecs.layers.len() != layers
                || n == 0
                || x.len() != n * d
                || pos0 + n > self.capacity
                || rope.len() != n * hd
                || out_rows == 0
                || out_rows > n
                || kv.len() != layers * 2 * n * kvw
            {
                return Err(format!(
                    "a forward on the GPU: {} layers of {h} heads over {kvh} of {hd} for a mirror of {layers} \
                     layers of {} over {} of {}, {} values of x (rows of {d}) at position {pos0} of {}, \
                     {} of rotary table, {out_rows} rows out, {} of keys and values",
                    mats.len(),
                    self.n_heads,
                    self.n_kv_heads,
                    self.head_dim,
                    x.len(),
                    self.capacity,
                    rope.len(),
                    kv.len()
                ));
            }
            let (mut inter, mut experts_out) = (0, 0);
            for (li, m) in mats.iter().enumerate() {
                let want = [(hw, d), (kvw, d), (kvw, d), (d, hw)];
                let got: Vec<(usize, usize)> =
                    m.attn.iter().map(|p| (p.mat.rows, p.mat.cols)).collect();
                let ffn = match &m.ffn {
                    LayerFfn::Dense(f) => {
                        let i = f[0].mat.rows;
                        inter = inter.max(i);
                        let fg: Vec<(usize, usize)> =
                            f.iter().map(|p| (p.mat.rows, p.mat.cols)).collect();
                        fg == [(i, d), (i, d), (d, i)]
                    }
                    LayerFfn::Moe { router, inter: i } => {
                        inter = inter.max(*i);
                        experts_out = experts_out.max(router.mat.rows);
                        router.mat.cols == d && moe.is_some()
                    }
                };
                if got != want || !ffn {
                    return Err(format!(
                        "a forward on the GPU: layer {li}'s q, k, v and o are {got:?} and its feed-forward \
                         block does not chain (or has no router host) for {h} heads over {kvh} of {hd} at \
                         width {d}"
                    ));
                }
            }
            if let Some(p) = head {
                if p.mat.cols != d {
                    return Err(format!(
                        "a forward on the GPU: a head of {} columns for width {d}",
                        p.mat.cols
                    ));
                }
            }
            let vocab = head.map_or(0, |p| p.mat.rows);
            let widest = [d, hw, inter, vocab, experts_out]
                .into_iter()
                .max()
                .unwrap_or(0);
            if n.checked_mul(widest)
                .map_or(true, |v| v > i32::MAX as usize)
                || kv.len() > i32::MAX as usize
            {
                return Err("a forward on the GPU: the kernels take sizes below 2^31".into());
            }
            let sizes = [
                n * d,
                n * hd,
                n * d,
                n * hw,
                n * kvw,
                n * kvw,
                n * hw,
                n * d,
                n * inter.max(1),
                n * inter.max(1),
                kv.len(),
                out_rows * vocab.max(1),
                n * experts_out.max(1),
                n * d,
                n * [d, hw, inter].into_iter().max().unwrap_or(d),
            ];
            // The step's buffers: the last step's where they are long
            // enough (each is written before it is read, and every launch
            // below is given its length, not the buffer's) and not much
            // longer (a prefill's, all logits kept, would hold n × vocab
            // floats through every decode step after it).
            let mut work = std::mem::take(&mut self.work);
            work.resize_with(sizes.len(), DevBuf::empty);
            for (b, &len) in work.iter_mut().zip(&sizes) {
                if b.len() < len || b.len() > len.saturating_mul(4).max(1 << 20) {
                    *b = g.zeros::<f32>(len)?;
                }
            }
            let [xd, tbl, hb, qd, kd, vd, att, od, gd, ud, stage, logits, rl, xe, xr] =
                &mut work[..]
            else {
                return Err("a forward on the GPU: its buffers".into());
            };
            g.htod_into(x, xd, 0)?;
            g.htod_into(rope, tbl, 0)?;
            let mut ys = std::mem::take(&mut self.expert_out);
            let mut gpu_experts = 0u64;
            for (li, (m, lv)) in mats.iter().zip(&vecs.layers).enumerate() {
                let [mq, mk, mv, mo] = &m.attn;
                g.rmsnorm(Some(xd), &lv.in_norm, hb, n, d, geo.eps)?;
                g.product_in(mq, hb, qd, n, Some(&mut *xr))?;
                g.product_in(mk, hb, kd, n, Some(&mut *xr))?;
                g.product_in(mv, hb, vd, n, Some(&mut *xr))?;
                for (buf, b) in [
                    (&mut *qd, &lv.bias[0]),
                    (&mut *kd, &lv.bias[1]),
                    (&mut *vd, &lv.bias[2]),
                ] {
                    if let Some(b) = b {
                        g.add(buf, b, n * b.len(), b.len())?;
                    }
                }
                if let Some((qn, kn)) = &lv.qk_norm {
                    g.rmsnorm(None, qn, qd, n * h, hd, geo.eps)?;
                    g.rmsnorm(None, kn, kd, n * kvh, hd, geo.eps)?;
                }
                g.rope(qd, tbl, n, h, hd, geo.rope_dim)?;
                g.rope(kd, tbl, n, kvh, hd, geo.rope_dim)?;
                g.dtod(kd, 0, &mut self.k[li], pos0 * kvw, n * kvw)?;
                g.dtod(vd, 0, &mut self.v[li], pos0 * kvw, n * kvw)?;
                g.dtod(kd, 0, stage, 2 * li * n * kvw, n * kvw)?;
                g.dtod(vd, 0, stage, (2 * li + 1) * n * kvw, n * kvw)?;
                for c0 in (0..n).step_by(GPU_QUERIES) {
                    let c = GPU_QUERIES.min(n - c0);
                    g.dtod(qd, c0 * hw, &mut self.q, 0, c * hw)?;
                    // Positions up to pos0 + n − 1 written above.
                    self.causal(li, pos0 + c0 + 1, c, geo.scale)?;
                    g.dtod(&self.out, 0, att, c0 * hw, c * hw)?;
                }
                g.product_in(mo, att, od, n, Some(&mut *xr))?;
                if let Some(b) = &lv.bias[3] {
                    g.add(od, b, n * d, d)?;
                }
                g.add(xd, od, n * d, 0)?;
                g.rmsnorm(Some(xd), &lv.post_norm, hb, n, d, geo.eps)?;
                match &m.ffn {
                    LayerFfn::Dense([mg, mu, mdn]) => {
                        g.product_in(mg, hb, gd, n, Some(&mut *xr))?;
                        g.product_in(mu, hb, ud, n, Some(&mut *xr))?;
                        g.swiglu_launch(gd, ud, n * mg.mat.rows, None)?;
                        g.product_in(mdn, gd, od, n, Some(&mut *xr))?;
                    }
                    LayerFfn::Moe { router, inter } => {
                        let host = moe.ok_or("an MoE layer and no router host")?;
                        g.product_in(router, hb, rl, n, Some(&mut *xr))?;
                        let mut scores = vec![0.0f32; n * router.mat.rows];
                        g.dtoh_into(rl, &mut scores)?;
                        let r = check_routing(host.route(li, &scores, n)?, n, d, *inter)?;
                        // The normalised rows, for the experts the CPU runs
                        // (before the device's experts are queued, so that
                        // the CPU's run beside them).
                        let mut rows = Vec::new();
                        if r.experts.iter().any(|e| e.mats.is_none()) {
                            rows = vec![0.0f32; n * d];
                            g.dtoh_into(hb, &mut rows)?;
                        }
                        let (idx, wts) = &mut self.routing;
                        if idx.len() < r.idx.len() {
                            *idx = g.zeros::<i32>(r.idx.len())?;
                            *wts = g.zeros::<f32>(r.idx.len())?;
                        }
                        g.htod_into(&r.idx, idx, 0)?;
                        g.htod_into(&r.weights, wts, 0)?;
                        let (idx, wts) = (&*idx, &*wts);
                        if ys.len() < r.experts.len() {
                            ys.resize_with(r.experts.len(), DevBuf::empty);
                        }
                        for (i, e) in r.experts.iter().enumerate() {
                            let c = e.tokens.len();
                            // (Not kept much longer than needed either:
                            // a prefill's would stay through decode.)
                            if ys[i].len() < c * d || ys[i].len() > (4 * c * d).max(1 << 16) {
                                ys[i] = g.zeros::<f32>(c * d)?;
                            }
                            let Some([eg, eu, edn]) = &e.mats else {
                                continue;
                            };
                            // A step whose every token chose it takes the
                            // rows as they are (a decode step: always).
                            let input: &DevBuf<f32> = if c == n {
                                hb
                            } else {
                                g.gather(xe, hb, idx, r.offs[i], c, d)?;
                                xe
                            };
                            g.product_in(eg, input, gd, c, Some(&mut *xr))?;
                            g.product_in(eu, input, ud, c, Some(&mut *xr))?;
                            g.swiglu_launch(gd, ud, c * eg.mat.rows, None)?;
                            g.product_in(edn, gd, &mut ys[i], c, Some(&mut *xr))?;
                            gpu_experts += 1;
                        }
                        for (i, e) in r
                            .experts
                            .iter()
                            .enumerate()
                            .filter(|(_, e)| e.mats.is_none())
                        {
                            let c = e.tokens.len();
                            let mut xr = Vec::with_capacity(c * d);
                            for &(t, _) in &e.tokens {
                                xr.extend_from_slice(&rows[t * d..(t + 1) * d]);
                            }
                            let mut y = vec![0.0f32; c * d];
                            host.run_expert(li, e.expert, &xr, &mut y)?;
                            g.htod_into(&y, &mut ys[i], 0)?;
                        }
                        g.zero(od, n * d)?;
                        for (i, e) in r.experts.iter().enumerate() {
                            g.scatter_add(od, &ys[i], idx, wts, r.offs[i], e.tokens.len(), d)?;
                        }
                    }
                }
                g.add(xd, od, n * d, 0)?;
            }
            let m = out_rows;
            g.dtod(xd, (n - m) * d, hb, 0, m * d)?;
            g.rmsnorm(None, &vecs.norm, hb, m, d, geo.eps)?;
            let out = match head {
                Some(hm) => {
                    g.product_in(hm, hb, logits, m, Some(&mut *xr))?;
                    let mut v = vec![0.0f32; m * vocab];
                    g.dtoh_into(logits, &mut v)?;
                    v
                }
                None => {
                    let mut v = vec![0.0f32; m * d];
                    g.dtoh_into(hb, &mut v)?;
                    v
                }
            };
            g.dtoh_into(stage, kv)?;
            self.work = work;
            self.expert_out = ys;
            tier::count_layers(self.tier, layers as u64);
            tier::count_experts(self.tier, gpu_experts);
            Ok(out)
        }
    }

    impl Drop for KvMirror {
        fn drop(&mut self) {
            tier::give_kv(self.tier, self.bytes);
        }
    }

    /// Keys kept on the device as rows, and attention of each query over a
    /// list of them: DeepSeek V4's attention, whose keys (= values) are a
    /// query's sliding window plus the compressed entries it sees or its
    /// indexer picked. Per layer `geo.layer_rows` rows of head_dim floats
    /// (the engine decides which row holds what) and the layer's sink logits;
    /// one launch's queries, outputs, scores and row lists. Its bytes come
    /// out of the VRAM tier's KV reservation and go back when it is dropped.
    pub struct RowKv {
        g: &'static Gpu,
        kv: Vec<DevBuf<f32>>,
        sinks: Vec<DevBuf<f32>>,
        q: DevBuf<f32>,
        out: DevBuf<f32>,
        scratch: DevBuf<f32>,
        rows: DevBuf<i32>,
        offs: DevBuf<i32>,
        /// bs_cu_attn_rows, or its specialisation for these shapes.
        kernel: String,
        /// The lightning indexer's entries and launch buffers (geo.index).
        index: Option<IndexBufs>,
        geo: RowKvGeo,
        tier: u32,
        bytes: u64,
    }

    /// [`RowKv`]'s indexer side: per layer its compressed entries (an empty
    /// buffer where the layer has no indexer); one launch's query heads,
    /// head weights, offsets and scores.
    struct IndexBufs {
        entries: Vec<DevBuf<f32>>,
        q: DevBuf<f32>,
        w: DevBuf<f32>,
        offs: DevBuf<i32>,
        scores: DevBuf<f32>,
    }

    impl RowKv {
        /// Room on the GPU of VRAM tier `tier` for `geo`, with each layer's
        /// sink logits (n_heads each). `specialised`: the build has an
        /// attention kernel for these shapes. Err: no GPU, sizes the kernel
        /// cannot take, the tier's KV reservation too small, or out of
        /// memory (the caller keeps attention on the CPU).
        pub fn new(
            tier: u32,
            geo: RowKvGeo,
            sinks: &[&[f32]],
            specialised: bool,
        ) -> Result<RowKv, String> {
            let g = gpu().map_err(str::to_string)?;
            let RowKvGeo {
                ref layer_rows,
                n_heads,
                head_dim,
                max_keys,
                ref index,
            } = geo;
            let index_ok = index.as_ref().map_or(true, |ix| {
                let most = ix.layer_entries.iter().copied().max().unwrap_or(0);
                ix.layer_entries.len() == layer_rows.len()
                    && ix.heads > 0
                    && ix.dim > 0
                    && [
                        most.checked_mul(ix.dim),
                        (GPU_QUERIES * ix.heads).checked_mul(ix.dim),
                        GPU_QUERIES.checked_mul(most),
                    ]
                    .iter()
                    .all(|v| v.is_some_and(|v| v <= i32::MAX as usize))
            });
            if !index_ok {
                return Err(format!(
                    "the indexer on the GPU: {index:?} for {} layers (sizes below 2^31)",
                    layer_rows.len()
                ));
            }
            if layer_rows.is_empty()
                || layer_rows.contains(&0)
                || n_heads == 0
                || head_dim == 0
                || max_keys == 0
                || sinks.len() != layer_rows.len()
                || sinks.iter().any(|s| s.len() != n_heads)
            {
                return Err(format!(
                    "attention on the GPU: {} layers of {layer_rows:?} rows, {n_heads} heads of {head_dim},                      {max_keys} keys a query, {} layers of sinks",
                    layer_rows.len(),
                    sinks.len()
                ));
            }
            let qb = GPU_QUERIES;
            let most = layer_rows.iter().copied().max().unwrap_or(0);
            if [
                most.checked_mul(head_dim),
                (qb * n_heads).checked_mul(head_dim),
                (qb * n_heads).checked_mul(max_keys),
                qb.checked_mul(max_keys),
            ]
            .iter()
            .any(|v| v.map_or(true, |v| v > i32::MAX as usize))
            {
                return Err("attention on the GPU: the kernel takes sizes below 2^31".into());
            }
            let bytes = geo.bytes();
            tier::take_kv(tier, bytes)?;
            let alloc = || -> Result<_, String> {
                let mut kv = Vec::with_capacity(layer_rows.len());
                let mut sk = Vec::with_capacity(layer_rows.len());
                for (r, s) in layer_rows.iter().zip(sinks) {
                    kv.push(g.zeros::<f32>(r * head_dim)?);
                    sk.push(g.htod(s, "copying the sinks to the GPU")?);
                }
                let index = match index {
                    Some(ix) => {
                        let most = ix.layer_entries.iter().copied().max().unwrap_or(0);
                        let mut entries = Vec::with_capacity(ix.layer_entries.len());
                        for &e in &ix.layer_entries {
                            entries.push(g.zeros::<f32>(e * ix.dim)?);
                        }
                        Some(IndexBufs {
                            entries,
                            q: g.zeros::<f32>(qb * ix.heads * ix.dim)?,
                            w: g.zeros::<f32>(qb * ix.heads)?,
                            offs: g.zeros::<i32>(qb + 1)?,
                            scores: g.zeros::<f32>((qb * most).max(1))?,
                        })
                    }
                    None => None,
                };
                Ok((
                    (kv, sk),
                    g.zeros::<f32>(qb * n_heads * head_dim)?,
                    g.zeros::<f32>(qb * n_heads * head_dim)?,
                    g.zeros::<f32>(qb * n_heads * max_keys)?,
                    g.zeros::<i32>(qb * max_keys)?,
                    g.zeros::<i32>(qb + 1)?,
                    index,
                ))
            };
            let ((kv, sinks), q, out, scratch, rows, offs, index) =
                alloc().inspect_err(|_| tier::give_kv(tier, bytes))?;
            let kernel = if specialised {
                format!("bs_cu_attn_rows_d{head_dim}_h{n_heads}")
            } else {
                "bs_cu_attn_rows".to_string()
            };
            Ok(RowKv {
                g,
                kv,
                sinks,
                q,
                out,
                scratch,
                rows,
                offs,
                kernel,
                index,
                geo,
                tier,
                bytes,
            })
        }

        /// Whether layer `layer` keeps indexer entries here.
        pub fn has_index(&self, layer: usize) -> bool {
            self.geo
                .index
                .as_ref()
                .is_some_and(|ix| ix.layer_entries.get(layer).is_some_and(|&e| e > 0))
        }

        /// Write whole indexer entries (rows of the indexer's dim floats)
        /// into layer `layer` from entry `e0` on.
        pub fn write_index(&mut self, layer: usize, e0: usize, data: &[f32]) -> Result<(), String> {
            let (Some(ix), Some(bufs)) = (&self.geo.index, &mut self.index) else {
                return Err("row KV: no indexer entries kept".into());
            };
            let have = ix.layer_entries.get(layer).copied().unwrap_or(0);
            if data.len() % ix.dim != 0 || e0 + data.len() / ix.dim > have {
                return Err(format!(
                    "indexer entries: layer {layer}, {} floats at entry {e0} (entries of {}, room for {have})",
                    data.len(),
                    ix.dim
                ));
            }
            if data.is_empty() {
                return Ok(());
            }
            self.g
                .htod_into(data, &mut bufs.entries[layer], e0 * ix.dim)
        }

        /// The lightning indexer's scores for up to GPU_QUERIES queries of
        /// layer `layer` (as [`crate::reference::index_scores`], bit for
        /// bit): query j, with heads `q[j][heads × dim]` and head weights
        /// `w[j][heads]`, against the layer's first `offs[j + 1] − offs[j]`
        /// entries, into `scores[offs[j] ..]` (`scores` is resized to
        /// `offs[n]`). A query with no entries (an empty range) costs nothing.
        pub fn index_scores(
            &mut self,
            layer: usize,
            q: &[f32],
            w: &[f32],
            offs: &[i32],
            scale: f32,
            scores: &mut Vec<f32>,
        ) -> Result<(), String> {
            let (Some(ix), Some(bufs)) = (&self.geo.index, &mut self.index) else {
                return Err("row KV: no indexer entries kept".into());
            };
            let have = ix.layer_entries.get(layer).copied().unwrap_or(0);
            let most = check_index(q, w, offs, (ix.heads, ix.dim), have)?;
            let n = offs.len() - 1;
            scores.clear();
            scores.resize(offs[n] as usize, 0.0);
            if most == 0 {
                return Ok(());
            }
            self.g.htod_into(q, &mut bufs.q, 0)?;
            self.g.htod_into(w, &mut bufs.w, 0)?;
            self.g.htod_into(offs, &mut bufs.offs, 0)?;
            // Checked (check_index): n ≤ GPU_QUERIES queries of heads × dim
            // and heads floats, offs ascending from 0 with no range past the
            // layer's entries, so the scores (GPU_QUERIES × the most entries
            // of a layer) hold offs[n].
            self.g.index_launch(
                [&bufs.entries[layer], &bufs.q, &bufs.w],
                &bufs.offs,
                &mut bufs.scores,
                (ix.heads, ix.dim, n, most),
                scale,
            )?;
            self.g.dtoh_into(&bufs.scores, scores)
        }

        /// Write whole rows of head_dim floats into layer `layer` from row
        /// `row0` on.
        pub fn write(&mut self, layer: usize, row0: usize, data: &[f32]) -> Result<(), String> {
            let hd = self.geo.head_dim;
            let fits = self
                .geo
                .layer_rows
                .get(layer)
                .is_some_and(|&r| data.len() % hd == 0 && row0 + data.len() / hd <= r);
            if !fits {
                return Err(format!(
                    "row KV: layer {layer} of {}, {} floats at row {row0} (rows of {hd}, room for {:?})",
                    self.geo.layer_rows.len(),
                    data.len(),
                    self.geo.layer_rows.get(layer)
                ));
            }
            if data.is_empty() {
                return Ok(());
            }
            self.g.htod_into(data, &mut self.kv[layer], row0 * hd)
        }

        /// Attention of up to GPU_QUERIES queries `q[n][n_heads × head_dim]`
        /// of layer `layer`: query j over the rows
        /// `rows[offs[j] .. offs[j + 1]]` in order (offs: n + 1 ascending, from 0 to
        /// rows.len()), with the layer's sinks, into `out` (q's shape).
        pub fn attend(
            &mut self,
            layer: usize,
            q: &[f32],
            rows: &[i32],
            offs: &[i32],
            scale: f32,
            out: &mut [f32],
        ) -> Result<(), String> {
            let RowKvGeo {
                n_heads, head_dim, ..
            } = self.geo;
            let hw = n_heads * head_dim;
            let n = offs.len().saturating_sub(1);
            let have = self.geo.layer_rows.get(layer).copied().unwrap_or(0);
            check_rows(rows, offs, have, self.geo.max_keys)?;
            if have == 0 || n == 0 || n > GPU_QUERIES || q.len() != n * hw || out.len() != q.len() {
                return Err(format!(
                    "row KV: layer {layer} of {}, q {} and out {} floats for {n} queries (rows of {hw}, at most {GPU_QUERIES})",
                    self.geo.layer_rows.len(),
                    q.len(),
                    out.len()
                ));
            }
            self.g.htod_into(q, &mut self.q, 0)?;
            self.g.htod_into(rows, &mut self.rows, 0)?;
            self.g.htod_into(offs, &mut self.offs, 0)?;
            // Checked: n ≤ GPU_QUERIES queries, so q and out hold n rows of
            // n_heads × head_dim; offs ascends from 0 to rows.len() ≤
            // GPU_QUERIES × max_keys with every row below the layer's
            // (check_rows), so scratch (GPU_QUERIES × n_heads × max_keys)
            // holds n_heads × rows.len(); sinks hold n_heads (new).
            self.g.rows_launch(
                &self.kernel,
                [&self.q, &self.kv[layer], &self.sinks[layer]],
                (&self.rows, &self.offs),
                &mut self.out,
                &mut self.scratch,
                (n_heads, head_dim, n),
                scale,
            )?;
            self.g.dtoh_into(&self.out, out)
        }
    }

    impl Drop for RowKv {
        fn drop(&mut self) {
            tier::give_kv(self.tier, self.bytes);
        }
    }

    /// A row list for bs_cu_attn_rows*: offs ascends from 0 to rows.len(),
    /// no query has more than `max_keys` rows (nor rows.len() more than
    /// GPU_QUERIES × max_keys), and every row is below `have`.
    fn check_rows(rows: &[i32], offs: &[i32], have: usize, max_keys: usize) -> Result<(), String> {
        let ascending = offs
            .windows(2)
            .all(|w| w[0] <= w[1] && (w[1] - w[0]) as usize <= max_keys);
        if offs.first() != Some(&0)
            || !ascending
            || offs.last().map(|&o| o as usize) != Some(rows.len())
            || rows.len() > GPU_QUERIES * max_keys
        {
            return Err(format!(
                "attention over rows: offsets {offs:?} for {} rows (at most {max_keys} a query)",
                rows.len()
            ));
        }
        match rows.iter().find(|&&r| r < 0 || r as usize >= have) {
            Some(r) => Err(format!("attention over rows: row {r} of {have}")),
            None => Ok(()),
        }
    }

    /// Queries for bs_cu_index_scores: 1 to GPU_QUERIES of them, q of
    /// n × heads × dim floats and w of n × heads, offs n + 1 ascending from
    /// 0 with no query over more than `have` entries. Ok: the most entries
    /// of a query.
    fn check_index(
        q: &[f32],
        w: &[f32],
        offs: &[i32],
        (heads, dim): (usize, usize),
        have: usize,
    ) -> Result<usize, String> {
        let n = offs.len().saturating_sub(1);
        let ranges: Option<Vec<usize>> = offs
            .windows(2)
            .map(|p| {
                p[1].checked_sub(p[0])
                    .and_then(|d| usize::try_from(d).ok())
                    .filter(|&r| r <= have)
            })
            .collect();
        match ranges {
            Some(r)
                if offs.first() == Some(&0)
                    && (1..=GPU_QUERIES).contains(&n)
                    && q.len() == n * heads * dim
                    && w.len() == n * heads =>
            {
                Ok(r.into_iter().max().unwrap_or(0))
            }
            _ => Err(format!(
                "indexer scores: offsets {offs:?} over {have} entries (at most {GPU_QUERIES} queries), \
                 q {} and w {} floats (want {n} × {heads}×{dim} and {n} × {heads})",
                q.len(),
                w.len()
            )),
        }
    }

    /// Device memory: the driver's, or the emulator's host memory.
    pub struct DevBuf<T: DeviceRepr>(Buf<T>);
    enum Buf<T: DeviceRepr> {
        Cuda(CudaSlice<T>),
        Host(Vec<T>),
    }

    impl<T: DeviceRepr> DevBuf<T> {
        /// Elements it holds.
        pub fn len(&self) -> usize {
            match &self.0 {
                Buf::Cuda(s) => s.len(),
                Buf::Host(v) => v.len(),
            }
        }

        pub fn is_empty(&self) -> bool {
            self.len() == 0
        }

        /// A buffer of nothing (no device memory): a placeholder.
        fn empty() -> DevBuf<T> {
            DevBuf(Buf::Host(Vec::new()))
        }
    }

    /// An attention call's geometry (the kernel's integer and scale
    /// parameters).
    #[derive(Clone, Copy)]
    struct AttnGeo {
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        kv_stride: usize,
        t_len: usize,
        window: usize,
        scale: f32,
        /// Queries of a causal launch (bs_cu_attn_causal*); None: one, decode.
        n_q: Option<usize>,
    }

    /// One kernel argument, as the driver takes them.
    enum Arg<'a> {
        U8(&'a DevBuf<u8>),
        F32(&'a DevBuf<f32>),
        I32s(&'a DevBuf<i32>),
        U8Out(&'a mut DevBuf<u8>),
        F32Out(&'a mut DevBuf<f32>),
        I32(i32),
        F32Val(f32),
        /// A null pointer.
        Null,
    }

    /// The GPU, once per process; Err is the one-line reason the engine runs
    /// on the CPU. `BESPOKE_CUDA=emu`: the emulator.
    pub fn gpu() -> Result<&'static Gpu, &'static str> {
        static GPU: OnceLock<Result<Gpu, String>> = OnceLock::new();
        GPU.get_or_init(probe).as_ref().map_err(|e| e.as_str())
    }

    /// The CPU emulator of the CUDA-core kernels, whatever `BESPOKE_CUDA`
    /// says (the tests run the GPU checks on it where there is no GPU).
    pub fn emulator() -> &'static Gpu {
        static EMU: OnceLock<Gpu> = OnceLock::new();
        EMU.get_or_init(emu_gpu)
    }

    /// Check the emulator itself with its self-test kernels
    /// (kernels/bs_cuda_emu_selftest.cuh): shared memory across a
    /// `__syncthreads`, the xor and down shuffles, block indices over 3 blocks,
    /// and a failed launch (not a hang) for a wait that can never complete.
    /// Ok: what was checked.
    pub fn emulator_selftest() -> Result<String, String> {
        let g = emulator();
        let cfg = |blocks: u32| blocks128(blocks, 1);
        let n = 128usize;
        let mut out = g.zeros::<f32>(3 * 4 * n)?;
        g.run(
            "bs_emu_selftest_exchange",
            cfg(3),
            &mut [Arg::F32Out(&mut out)],
        )?;
        let out = g.dtoh(&out)?;
        for b in 0..3 {
            for t in 0..n {
                let lane = t % 32;
                let want = [
                    (n - 1 - t) as f32,
                    (lane ^ 5) as f32,
                    (if lane + 3 < 32 { lane + 3 } else { lane }) as f32,
                    b as f32,
                ];
                for (i, w) in want.iter().enumerate() {
                    let got = out[(b * 4 + i) * n + t];
                    if got != *w {
                        return Err(format!(
                            "bs_emu_selftest_exchange: block {b} thread {t} check {i}: {got}, expected {w}"
                        ));
                    }
                }
            }
        }
        for (k, want) in [
            ("bs_emu_selftest_deadlock", "deadlock"),
            ("bs_emu_selftest_early_exit", "returned"),
        ] {
            let mut out = g.zeros::<f32>(n)?;
            match g.run(k, cfg(1), &mut [Arg::F32Out(&mut out)]) {
                Err(e) if e.contains(want) => {}
                other => {
                    return Err(format!(
                        "{k}: expected a failed launch ({want}), got {other:?}"
                    ))
                }
            }
        }
        Ok(
            "the emulator's barriers, shuffles and block indices are CUDA's; \
            a deadlock and a shuffle over returned lanes fail the launch"
                .into(),
        )
    }

    fn emu_gpu() -> Gpu {
        Gpu {
            dev: Dev::Emu,
            name: "the CPU emulator of the CUDA-core kernels".into(),
            cc: (8, 0),
            image: &EMU_IMAGE,
            total_mem: EMU_MEM,
            tc_off: Vec::new(),
            checked: 0,
        }
    }

    /// `g` after its start-up check ([`Gpu::startup_check`]): with the
    /// tensor-core paths that failed it off, or Err (the engine runs on the
    /// CPU) when a CUDA-core product failed it.
    fn checked(mut g: Gpu) -> Result<Gpu, String> {
        CHECKING.with(|c| c.set(true));
        let r = g.startup_check();
        CHECKING.with(|c| c.set(false));
        let (off, n) = r.map_err(|e| format!("the device failed its start-up check: {e}"))?;
        g.tc_off = off;
        g.checked = n;
        Ok(g)
    }

    fn probe() -> Result<Gpu, String> {
        match mode() {
            Some("off") => return Err("BESPOKE_CUDA=off".into()),
            Some("emu") => return checked(emu_gpu()),
            _ => {}
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
        checked(Gpu {
            dev: Dev::Cuda {
                ctx,
                stream,
                module,
            },
            name,
            cc: (major, minor),
            image,
            total_mem,
            tc_off: Vec::new(),
            checked: 0,
        })
    }

    /// A launch of 128-thread blocks on an x × y grid (every kernel here
    /// takes 128 threads a block).
    fn blocks128(x: u32, y: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (x, y, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn derr(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
        move |e| format!("{what}: {e}")
    }

    /// Weights, scales and activations on the device for one product.
    /// One SwiGLU expert for [`Gpu::ffn_start`]: down(silu(gate·x) ⊙
    /// up·x) for `n` tokens `x[n][cols]`, with DeepSeek V4's clamps at
    /// `limit`. `mats`: gate, up and down, resident, each product with
    /// its kernel and activations (`Gpu::product`).
    pub struct FfnJob<'a> {
        pub mats: [DevProduct; 3],
        pub x: &'a [f32],
        pub n: usize,
        pub limit: Option<f32>,
    }

    /// Experts queued on the GPU by [`Gpu::ffn_start`] whose outputs are not
    /// yet copied back ([`Gpu::ffn_finish`]), with the device buffers their
    /// work reads and writes.
    pub struct FfnBatch {
        outs: Vec<DevBuf<f32>>,
        _work: Vec<DevBuf<f32>>,
    }

    pub struct DevMat {
        pub w: DevBuf<u8>,
        pub scale: DevBuf<u8>,
        pub format: Format,
        pub rows: usize,
        pub cols: usize,
        /// Device bytes (weights + scales).
        pub bytes: usize,
    }

    impl Gpu {
        /// Whether the loaded kernels have tensor-core path `key` (a
        /// `TcPath::key`): the build plan's decision for the image, or the
        /// emulator's list.
        pub fn has_tc(&self, key: &str) -> bool {
            if self.tc_off.iter().any(|(k, _)| *k == key) {
                return false;
            }
            match self.dev {
                Dev::Emu => crate::plan::cuda::EMU_TC.contains(&key),
                Dev::Cuda { .. } => image_has_tc(self.image.arch, key),
            }
        }

        /// Whether this is the CPU emulator (`BESPOKE_CUDA=emu`), not a GPU.
        pub fn emulated(&self) -> bool {
            matches!(self.dev, Dev::Emu)
        }

        fn function(&self, name: &str) -> Result<CudaFunction, String> {
            match &self.dev {
                Dev::Cuda { module, .. } => module
                    .load_function(name)
                    .map_err(|e| format!("kernel {name} in the {} image: {e}", self.image.arch)),
                Dev::Emu => Err("the emulator has no driver functions".into()),
            }
        }

        fn htod<T: DeviceRepr + Clone>(&self, s: &[T], what: &str) -> Result<DevBuf<T>, String> {
            Ok(DevBuf(match &self.dev {
                Dev::Cuda { stream, .. } => Buf::Cuda(stream.clone_htod(s).map_err(derr(what))?),
                Dev::Emu => Buf::Host(s.to_vec()),
            }))
        }

        fn zeros<T: DeviceRepr + ValidAsZeroBits + Default + Clone>(
            &self,
            n: usize,
        ) -> Result<DevBuf<T>, String> {
            Ok(DevBuf(match &self.dev {
                Dev::Cuda { stream, .. } => {
                    Buf::Cuda(stream.alloc_zeros::<T>(n).map_err(derr("allocating"))?)
                }
                Dev::Emu => Buf::Host(vec![T::default(); n]),
            }))
        }

        fn dtoh<T: DeviceRepr + Clone + Default>(&self, b: &DevBuf<T>) -> Result<Vec<T>, String> {
            match (&self.dev, &b.0) {
                (Dev::Cuda { stream, .. }, Buf::Cuda(s)) => stream
                    .clone_dtoh(s)
                    .map_err(derr("copying the result back")),
                (Dev::Emu, Buf::Host(v)) => Ok(v.clone()),
                _ => Err("a buffer of another device".into()),
            }
        }

        /// Launch `kernel` with `args` (its parameters in order).
        fn run(&self, kernel: &str, cfg: LaunchConfig, args: &mut [Arg]) -> Result<(), String> {
            let foreign = || format!("{kernel}: a buffer of another device");
            match &self.dev {
                Dev::Cuda { stream, .. } => {
                    let f = self.function(kernel)?;
                    let null = 0u64;
                    let mut b = stream.launch_builder(&f);
                    for a in args.iter_mut() {
                        match a {
                            Arg::U8(DevBuf(Buf::Cuda(s))) => b.arg(s),
                            Arg::F32(DevBuf(Buf::Cuda(s))) => b.arg(s),
                            Arg::I32s(DevBuf(Buf::Cuda(s))) => b.arg(s),
                            Arg::U8Out(DevBuf(Buf::Cuda(s))) => b.arg(s),
                            Arg::F32Out(DevBuf(Buf::Cuda(s))) => b.arg(s),
                            Arg::I32(v) => b.arg(&*v),
                            Arg::F32Val(v) => b.arg(&*v),
                            Arg::Null => b.arg(&null),
                            _ => return Err(foreign()),
                        };
                    }
                    // SAFETY: every caller passes the kernel's parameters in
                    // order (templates/cuda.cu.tera) after checking that the
                    // buffers hold what the kernel reads and writes for this
                    // geometry (see each caller).
                    unsafe { b.launch(cfg) }
                        .map(|_| ())
                        .map_err(derr(&format!("launching {kernel}")))
                }
                Dev::Emu => {
                    if !CHECKING.with(|c| c.get()) {
                        emu_fault(kernel)?;
                    }
                    // Each argument's value in a slot of its own (pointers,
                    // and 32-bit scalars in the slot's low bytes: x86-64 and
                    // aarch64 are little-endian), and a pointer to each slot:
                    // the driver's convention, which bs_emu_launch takes.
                    let mut slots: Vec<u64> = Vec::with_capacity(args.len());
                    for a in args.iter_mut() {
                        slots.push(match a {
                            Arg::U8(DevBuf(Buf::Host(v))) => v.as_ptr() as u64,
                            Arg::F32(DevBuf(Buf::Host(v))) => v.as_ptr() as u64,
                            Arg::I32s(DevBuf(Buf::Host(v))) => v.as_ptr() as u64,
                            Arg::U8Out(DevBuf(Buf::Host(v))) => v.as_mut_ptr() as u64,
                            Arg::F32Out(DevBuf(Buf::Host(v))) => v.as_mut_ptr() as u64,
                            Arg::I32(v) => *v as u32 as u64,
                            Arg::F32Val(v) => v.to_bits() as u64,
                            Arg::Null => 0,
                            _ => return Err(foreign()),
                        });
                    }
                    let mut ptrs: Vec<*mut std::ffi::c_void> = slots
                        .iter_mut()
                        .map(|s| s as *mut u64 as *mut std::ffi::c_void)
                        .collect();
                    let name = std::ffi::CString::new(kernel).map_err(|e| e.to_string())?;
                    let grid = [cfg.grid_dim.0, cfg.grid_dim.1, cfg.grid_dim.2];
                    let block = [cfg.block_dim.0, cfg.block_dim.1, cfg.block_dim.2];
                    let mut err = [0u8; 256];
                    // SAFETY: the FFI edge to kernels/bs_cuda_emu.cpp. name is
                    // NUL-terminated, grid and block hold 3 values, ptrs points
                    // at one live slot per kernel parameter (pointers into
                    // Vecs that `args` borrows for this call: the kernel's
                    // writes land in the mutably borrowed ones), err is
                    // `err.len()` bytes. The kernel runs on these host buffers,
                    // so its reads and writes stay inside them by the same
                    // checks that make the GPU launch sound (each caller's).
                    let rc = unsafe {
                        emu_ffi::bs_emu_launch(
                            name.as_ptr(),
                            grid.as_ptr(),
                            block.as_ptr(),
                            ptrs.as_mut_ptr(),
                            err.as_mut_ptr().cast(),
                            err.len(),
                        )
                    };
                    if rc == 0 {
                        if emu_wrong(kernel) {
                            if let Some(Arg::F32Out(DevBuf(Buf::Host(v)))) =
                                args.iter_mut().find(|a| matches!(a, Arg::F32Out(_)))
                            {
                                v.iter_mut().for_each(|y| *y = *y * 1.25 + 0.5);
                            }
                        }
                        Ok(())
                    } else {
                        let end = err.iter().position(|&c| c == 0).unwrap_or(err.len());
                        Err(format!(
                            "emulator: {}",
                            String::from_utf8_lossy(&err[..end])
                        ))
                    }
                }
            }
        }

        /// Upload one matrix (bytes as the CPU kernels take them), checked
        /// against rows × cols in the format's layout: every launch relies on it.
        pub fn upload(
            &self,
            format: Format,
            w: &[u8],
            scale: &[u8],
            rows: usize,
            cols: usize,
        ) -> Result<DevMat, String> {
            if let Some(p) = format.shape_problem(rows, cols) {
                return Err(p);
            }
            if rows > i32::MAX as usize || cols > i32::MAX as usize {
                return Err(format!(
                    "{rows}×{cols}: the GPU kernels take dimensions below 2^31"
                ));
            }
            let want_w = rows
                .checked_mul(format.row_bytes(cols))
                .ok_or("matrix size overflows")?;
            let want_s = format.scale_shape(rows, cols).map_or(0, |(r, c)| r * c);
            if w.len() != want_w || scale.len() != want_s {
                return Err(format!(
                    "{format} {rows}×{cols}: expected {want_w} weight and {want_s} scale bytes, found {} and {}",
                    w.len(),
                    scale.len()
                ));
            }
            let bytes = w.len() + scale.len();
            let w = self.htod(w, "copying weights to the GPU")?;
            // A zero-length allocation is not allowed: give unscaled formats one byte.
            let scale = if scale.is_empty() { &[0u8][..] } else { scale };
            let scale = self.htod(scale, "copying scales to the GPU")?;
            Ok(DevMat {
                w,
                scale,
                format,
                rows,
                cols,
                bytes,
            })
        }

        /// Upload a checked matrix.
        pub fn upload_matrix(&self, m: &crate::Matrix) -> Result<DevMat, String> {
            let (w, s) = matrix_bytes(m);
            self.upload(m.format(), w, s, m.rows(), m.cols())
        }

        /// `Y[n][rows] = W X[n][cols]` with the CUDA-core kernel `kernel`
        /// (`bs_cu_matvec_<fmt>` for n = 1, `bs_cu_matmul_<fmt>` otherwise, or a
        /// specialised name), or with a tensor-core kernel (`bs_tc_*`).
        pub fn matmul(
            &self,
            kernel: &str,
            m: &DevMat,
            x: &[f32],
            n: usize,
        ) -> Result<Vec<f32>, String> {
            self.check_product(kernel, m, x.len(), n)?;
            let xd = self.htod(x, "copying activations")?;
            let mut y = self.zeros::<f32>(m.rows * n)?;
            self.launch(kernel, m, &xd, &mut y, n)?;
            self.dtoh(&y)
        }

        /// Queue SwiGLU experts on the GPU: per job one upload of x, then
        /// gate and up, the activation (bs_cu_swiglu) and down, all on the
        /// device, with nothing copied back; [`Gpu::ffn_finish`] copies the
        /// outputs back, waiting for the work. Until then the GPU works on
        /// its own, so the caller can run the other experts on the CPU. Err:
        /// a job whose shapes do not chain, or a launch that failed.
        pub fn ffn_start(&self, jobs: &[FfnJob]) -> Result<FfnBatch, String> {
            let mut batch = FfnBatch {
                outs: Vec::with_capacity(jobs.len()),
                _work: Vec::with_capacity(3 * jobs.len()),
            };
            for j in jobs {
                let [pg, pu, pd] = &j.mats;
                let (g, u, dn) = (&pg.mat, &pu.mat, &pd.mat);
                let (n, i) = (j.n, g.rows);
                if u.rows != i
                    || u.cols != g.cols
                    || dn.cols != i
                    || n.checked_mul(i).map_or(true, |v| v > i32::MAX as usize)
                {
                    return Err(format!(
                        "an expert on the GPU: gate {}×{}, up {}×{} and down {}×{} do not chain for {n} tokens",
                        g.rows, g.cols, u.rows, u.cols, dn.rows, dn.cols
                    ));
                }
                // Every product's kernel and shape checked before any runs.
                for (p, xlen) in [(pg, j.x.len()), (pu, j.x.len()), (pd, n * i)] {
                    self.check_product(&self.product_kernel(p, n)?, &p.mat, xlen, n)?;
                }
                let xd = self.htod(j.x, "copying activations")?;
                let mut gd = self.zeros::<f32>(n * i)?;
                let mut ud = self.zeros::<f32>(n * i)?;
                let mut y = self.zeros::<f32>(n * dn.rows)?;
                self.product(pg, &xd, &mut gd, n)?;
                self.product(pu, &xd, &mut ud, n)?;
                self.swiglu_launch(&mut gd, &ud, n * i, j.limit)?;
                self.product(pd, &gd, &mut y, n)?;
                batch.outs.push(y);
                batch._work.extend([xd, gd, ud]);
            }
            Ok(batch)
        }

        /// The outputs of [`Gpu::ffn_start`]'s jobs (each n × down's rows)
        /// or of [`Gpu::products_start`]'s products, in order, once the GPU
        /// has made them.
        pub fn ffn_finish(&self, batch: FfnBatch) -> Result<Vec<Vec<f32>>, String> {
            batch.outs.iter().map(|y| self.dtoh(y)).collect()
        }

        /// Products of resident matrices, queued: `xs` holds one X (`n`
        /// tokens, `x[n][cols]`) that every matrix takes, uploaded once, or
        /// one X per matrix; each runs its kernel (`Gpu::product`), and
        /// nothing comes back until [`Gpu::ffn_finish`]. Err: another count
        /// of X, an X that does not fit its matrix, or a failed launch.
        pub fn products_start(
            &self,
            mats: &[DevProduct],
            xs: &[&[f32]],
            n: usize,
        ) -> Result<FfnBatch, String> {
            if xs.len() != 1 && xs.len() != mats.len() {
                return Err(format!(
                    "{} products on the GPU with {} X (one, or one each)",
                    mats.len(),
                    xs.len()
                ));
            }
            let x_of = |i: usize| if xs.len() == 1 { 0 } else { i };
            for (i, p) in mats.iter().enumerate() {
                self.check_product(&self.product_kernel(p, n)?, &p.mat, xs[x_of(i)].len(), n)?;
            }
            let mut batch = FfnBatch {
                outs: Vec::with_capacity(mats.len()),
                _work: Vec::with_capacity(xs.len()),
            };
            for x in xs {
                batch._work.push(self.htod(x, "copying activations")?);
            }
            for (i, p) in mats.iter().enumerate() {
                let mut y = self.zeros::<f32>(n * p.mat.rows)?;
                self.product(p, &batch._work[x_of(i)], &mut y, n)?;
                batch.outs.push(y);
            }
            Ok(batch)
        }

        /// A dense model's norm weights and biases on the device
        /// ([`DenseVectors`]), checked against `geo`.
        pub fn dense_vectors(
            &self,
            geo: DenseGeo,
            layers: &[LayerVectors],
            norm: &[f32],
        ) -> Result<DenseVectors, String> {
            let (d, h, kvh, hd) = (geo.d, geo.heads, geo.kv_heads, geo.head_dim);
            if d == 0
                || kvh == 0
                || hd == 0
                || h % kvh != 0
                || geo.rope_dim % 2 != 0
                || geo.rope_dim > hd
                || d > i32::MAX as usize
            {
                return Err(format!(
                    "a forward on the GPU: width {d}, {h} heads over {kvh} of {hd}, RoPE over {}",
                    geo.rope_dim
                ));
            }
            let up = |what: String, v: &[f32], len: usize| {
                if v.len() != len {
                    return Err(format!("{what}: {} values, expected {len}", v.len()));
                }
                self.htod(v, "copying norm weights and biases")
            };
            let mut out = Vec::with_capacity(layers.len());
            for (li, l) in layers.iter().enumerate() {
                let widths = [h * hd, kvh * hd, kvh * hd, d];
                let mut bias: [Option<DevBuf<f32>>; 4] = Default::default();
                for (i, b) in l.bias.iter().enumerate() {
                    if let Some(b) = b {
                        bias[i] = Some(up(format!("layer {li}'s bias {i}"), b, widths[i])?);
                    }
                }
                out.push(DeviceLayerVectors {
                    in_norm: up(format!("layer {li}'s input norm"), l.in_norm, d)?,
                    post_norm: up(format!("layer {li}'s post-attention norm"), l.post_norm, d)?,
                    qk_norm: match l.qk_norm {
                        Some((q, k)) => Some((
                            up(format!("layer {li}'s q norm"), q, hd)?,
                            up(format!("layer {li}'s k norm"), k, hd)?,
                        )),
                        None => None,
                    },
                    bias,
                });
            }
            Ok(DenseVectors {
                geo,
                layers: out,
                norm: up("the final norm".into(), norm, d)?,
            })
        }

        /// Before the engine trusts the device: every kind of product it
        /// would run there, on a small random matrix of each format (136 ×
        /// 256: a partial last tile, two FP8 scale blocks each way), for 1,
        /// 3 and 11 tokens (the tensor cores' 8-token tiles: one partial,
        /// then one whole and one partial), f32 activations and each
        /// variant's (BF16; int8 on FP4; DeepSeek's FP8-simulated on FP8
        /// and FP4), through the kernel the engine would pick (CUDA cores,
        /// `mma.sync` BF16 and INT8 where this image has them), against
        /// the CPU reference on the same activations within
        /// [`devcheck::core_rel`] (the tensor cores within 2^-10, as they
        /// may sum in an order and a rounding of their own); then
        /// attention ([`Gpu::check_attention`]). So a kernel that misreads
        /// a layout on this device (none of this code ran on a GPU before
        /// it was shipped) is caught before it gives a wrong answer. Ok:
        /// the tensor-core paths that failed (to be turned off) with what
        /// each did, and how many launches ran. Err: a CUDA-core product or
        /// attention failed (the device is not used).
        fn startup_check(&self) -> Result<(TcOff, usize), String> {
            use crate::devcheck::{compare, core_rel, magnitudes, splitmix64, unit, CheckMatrix};
            let mut next = splitmix64(0x5EED);
            let (rows, cols, nmax) = (136usize, 256usize, 11usize);
            let x: Vec<f32> = (0..nmax * cols).map(|_| unit(next()) * 4.0).collect();
            let xd = self.htod(&x, "copying the check's activations")?;
            let mut y = self.zeros::<f32>(nmax * rows)?;
            let mut off = TcOff::new();
            let mut count = 0;
            for f in [Format::F32, Format::Bf16, Format::Fp8, Format::Fp4] {
                let o = CheckMatrix::random(f, rows, cols, &mut next);
                let m = o.matrix()?;
                let mat = Arc::new(self.upload_matrix(&m)?);
                let acts: &[GpuAct] = match f {
                    Format::F32 => &[GpuAct::F32],
                    Format::Bf16 => &[GpuAct::F32, GpuAct::Bf16],
                    Format::Fp8 => &[GpuAct::F32, GpuAct::Bf16, GpuAct::Fp8Sim],
                    Format::Fp4 => &[GpuAct::F32, GpuAct::Bf16, GpuAct::Q8, GpuAct::Fp8Sim],
                };
                for &act in acts {
                    let p = DevProduct {
                        mat: mat.clone(),
                        specialised: false,
                        act,
                    };
                    for n in [1, 3, nmax] {
                        let k = self.product_kernel(&p, n)?;
                        let xs = &x[..n * cols];
                        let xr = variant_activations(act, xs, cols)?;
                        let xr = xr.as_deref().unwrap_or(xs);
                        let want = crate::reference::matmul(&m, xr, n);
                        let mag = magnitudes(&m, xr, n);
                        let tc = k.starts_with("bs_tc_");
                        let rel = if tc { 2f64.powi(-10) } else { core_rel(cols) };
                        count += 1;
                        let got = self
                            .product(&p, &xd, &mut y, n)
                            .and_then(|()| self.dtoh(&y))
                            .and_then(|y| compare(&y[..n * rows], &want, &mag, rel));
                        let Err(e) = got else { continue };
                        let what = format!(
                            "{k} ({f} {rows}×{cols}, {n} token{}, {} activations): {e}",
                            if n == 1 { "" } else { "s" },
                            act.label()
                        );
                        match (tc, act) {
                            (false, _) => return Err(what),
                            (true, a) => {
                                let key = if a == GpuAct::Q8 {
                                    "mma_int8"
                                } else {
                                    "mma_bf16"
                                };
                                if !off.iter().any(|(k, _)| *k == key) {
                                    off.push((key, what));
                                }
                            }
                        }
                    }
                }
            }
            count += self.check_attention(&mut next)?;
            Ok((off, count))
        }

        /// The start-up check's attention: a decode step (grouped heads,
        /// sinks) and a causal prefill step of 3 queries, against the CPU
        /// reference within 1e-4 (outputs are averages of values in
        /// [-1, 1)). Ok: how many it ran.
        fn check_attention(&self, next: &mut dyn FnMut() -> u64) -> Result<usize, String> {
            use crate::devcheck::unit;
            let (hd, h, kvh, t_len) = (64usize, 8usize, 2usize, 37usize);
            let stride = kvh * hd;
            let mut draw = |n: usize| -> Vec<f32> { (0..n).map(|_| unit(next())).collect() };
            let (q, k, v, sinks) = (
                draw(3 * h * hd),
                draw(t_len * stride),
                draw(t_len * stride),
                draw(h),
            );
            let base = crate::AttnArgs {
                q: &q[..h * hd],
                k: &k,
                v: &v,
                sinks: None,
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: hd,
                kv_stride: stride,
                kv_head_stride: hd,
                t_len,
                window: 0,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let close = |what: &str, got: &[f32], want: &[f32]| -> Result<(), String> {
                let bad = |(a, b): (&f32, &f32)| (a - b).abs().is_nan() || (a - b).abs() > 1e-4;
                match got.iter().zip(want).position(bad) {
                    _ if got.len() != want.len() => Err(format!(
                        "{what}: {} outputs, expected {}",
                        got.len(),
                        want.len()
                    )),
                    Some(i) => Err(format!(
                        "{what} (head_dim {hd}, {h} heads, {kvh} KV heads): output {i}: {} \
                         where the CPU gives {} (bound 1e-4)",
                        got[i], want[i]
                    )),
                    None => Ok(()),
                }
            };
            let got = self.attn_decode(
                "bs_cu_attn_decode",
                base.q,
                &k,
                &v,
                Some(&sinks),
                h,
                kvh,
                hd,
                stride,
                t_len,
                0,
                base.scale,
            )?;
            let want = crate::reference::attn_decode(&crate::AttnArgs {
                sinks: Some(&sinks),
                ..base
            });
            close("bs_cu_attn_decode", &got, &want)?;
            // Query j over positions 0 .. t0 + j - 1.
            let t0 = t_len - 2;
            let got = self.attn_causal(
                "bs_cu_attn_causal",
                &q,
                &k,
                &v,
                h,
                kvh,
                hd,
                stride,
                t0,
                base.scale,
            )?;
            let want: Vec<f32> = (0..3)
                .flat_map(|j| {
                    crate::reference::attn_decode(&crate::AttnArgs {
                        q: &q[j * h * hd..(j + 1) * h * hd],
                        t_len: t0 + j,
                        ..base
                    })
                })
                .collect();
            close("bs_cu_attn_causal", &got, &want)?;
            Ok(2)
        }

        /// The kernel a product of `n` tokens runs: the tensor-core kernel
        /// of its activations' numerics where this image has one
        /// ([`tc_kernel`]), else its CUDA-core kernel (specialised where the
        /// build has one). Err: int8 activations over columns that are not
        /// whole blocks of 32 (the CPU refuses them too).
        fn product_kernel(&self, p: &DevProduct, n: usize) -> Result<String, String> {
            let m = &p.mat;
            if let Some(k) = tc_kernel(m.format, n, m.cols, p.act, |k| self.has_tc(k)) {
                return Ok(k);
            }
            if p.act == GpuAct::Q8 && m.cols % 32 != 0 {
                return Err(format!(
                    "{} {}×{}: int8 activations take whole blocks of 32 columns",
                    m.format, m.rows, m.cols
                ));
            }
            Ok(super::core_kernel(
                m.format,
                n,
                p.specialised.then_some((m.rows, m.cols)),
            ))
        }

        /// y = W · x for `n` tokens on the device with the product's kernel
        /// ([`Gpu::product_kernel`]); a CUDA-core product of an activation
        /// variant reads x as the CPU variant gives it, made on the device
        /// (`bs_cu_round_bf16`, `bs_cu_round_q8`, `bs_cu_round_fp8sim`:
        /// [`variant_activations`] bit for bit) into a buffer of its own.
        fn product(
            &self,
            p: &DevProduct,
            x: &DevBuf<f32>,
            y: &mut DevBuf<f32>,
            n: usize,
        ) -> Result<(), String> {
            self.product_in(p, x, y, n, None)
        }

        /// [`Gpu::product`], making a variant's activations in `scratch`
        /// where it holds them (a forward's kept buffer: a decode step then
        /// allocates nothing).
        fn product_in(
            &self,
            p: &DevProduct,
            x: &DevBuf<f32>,
            y: &mut DevBuf<f32>,
            n: usize,
            scratch: Option<&mut DevBuf<f32>>,
        ) -> Result<(), String> {
            let (m, k) = (&p.mat, self.product_kernel(p, n)?);
            self.check_product(&k, m, n * m.cols, n)?;
            if x.len() < n * m.cols || y.len() < n * m.rows {
                return Err(format!(
                    "{k}: buffers of {} and {} values for {n} tokens of {}×{}",
                    x.len(),
                    y.len(),
                    m.rows,
                    m.cols
                ));
            }
            // Checked: x holds n × cols, y n × rows (the kernel reads and
            // writes no more), and check_product the kernel's needs.
            if p.act != GpuAct::F32 && !k.starts_with("bs_tc_") {
                let mut own;
                let xr = match scratch {
                    Some(b) if b.len() >= n * m.cols => b,
                    _ => {
                        own = self.zeros::<f32>(n * m.cols)?;
                        &mut own
                    }
                };
                self.variant_x(p.act, x, xr, m.cols, n)?;
                return self.launch(&k, m, xr, y, n);
            }
            self.launch(&k, m, x, y, n)
        }

        /// out = x (`n` rows of `cols`) as activations `act` give it:
        /// rounded to BF16 as `bf16act::round` rounds (`bs_cu_round_bf16`),
        /// or quantized to int8 per 32 columns and taken back, q · d, as
        /// `q8::Q8Act` does (`bs_cu_round_q8`), or as DeepSeek's inference
        /// simulates FP8 (`bs_cu_round_fp8sim`); f32: copied.
        fn variant_x(
            &self,
            act: GpuAct,
            x: &DevBuf<f32>,
            out: &mut DevBuf<f32>,
            cols: usize,
            n: usize,
        ) -> Result<(), String> {
            let len = cols.saturating_mul(n);
            if len > x.len() || len > out.len() || len > i32::MAX as usize {
                return Err(format!(
                    "activations of {n} × {cols} from {} values into {}",
                    x.len(),
                    out.len()
                ));
            }
            // The kernels' parameters in order; x and out hold n × cols
            // (checked), which bs_cu_round_q8 takes in whole blocks of 32.
            match act {
                GpuAct::F32 => self.dtod(x, 0, out, 0, len),
                GpuAct::Bf16 => {
                    let mut args = vec![Arg::F32(x), Arg::F32Out(out), Arg::I32(len as i32)];
                    self.run("bs_cu_round_bf16", Self::spread(len), &mut args)
                }
                GpuAct::Q8 if cols % 32 == 0 => {
                    let mut args = vec![
                        Arg::F32(x),
                        Arg::F32Out(out),
                        Arg::I32(cols as i32),
                        Arg::I32(n as i32),
                    ];
                    let blocks = (len / 32).div_ceil(4).max(1) as u32;
                    self.run("bs_cu_round_q8", blocks128(blocks, 1), &mut args)
                }
                GpuAct::Q8 => Err(format!(
                    "int8 activations of {cols} columns: whole blocks of 32 only"
                )),
                GpuAct::Fp8Sim => {
                    let mut args = vec![
                        Arg::F32(x),
                        Arg::F32Out(out),
                        Arg::I32(cols as i32),
                        Arg::I32(n as i32),
                    ];
                    let blocks = (cols.div_ceil(128) * n).div_ceil(4).max(1) as u32;
                    self.run("bs_cu_round_fp8sim", blocks128(blocks, 1), &mut args)
                }
            }
        }

        /// RMSNorm (`bs_cu_rmsnorm`) of `rows` rows of `d` floats: from `x`
        /// into `out`, or in place in `out` (x None).
        fn rmsnorm(
            &self,
            x: Option<&DevBuf<f32>>,
            w: &DevBuf<f32>,
            out: &mut DevBuf<f32>,
            rows: usize,
            d: usize,
            eps: f32,
        ) -> Result<(), String> {
            let n = rows.saturating_mul(d);
            if rows == 0
                || w.len() != d
                || out.len() < n
                || x.is_some_and(|x| x.len() < n)
                || n > i32::MAX as usize
            {
                return Err(format!(
                    "RMSNorm of {rows} rows of {d} with {} weights into {} values",
                    w.len(),
                    out.len()
                ));
            }
            // bs_cu_rmsnorm's parameters in order; x (or out) holds rows × d
            // and w d (checked).
            let mut args = vec![
                x.map_or(Arg::Null, Arg::F32),
                Arg::F32(w),
                Arg::F32Out(out),
                Arg::I32(d as i32),
                Arg::F32Val(eps),
            ];
            self.run("bs_cu_rmsnorm", blocks128(rows as u32, 1), &mut args)
        }

        /// x[i] += y[i] for i < n (`period` 0), or x[i] += y[i % period]
        /// (a bias on every row of `period`, y that long).
        fn add(
            &self,
            x: &mut DevBuf<f32>,
            y: &DevBuf<f32>,
            n: usize,
            period: usize,
        ) -> Result<(), String> {
            if n > i32::MAX as usize
                || n > x.len()
                || (period == 0 && y.len() < n)
                || (period > 0 && (y.len() != period || n % period != 0))
            {
                return Err(format!(
                    "adding {} values to {n} (rows of {period})",
                    y.len()
                ));
            }
            let cfg = blocks128(n.div_ceil(128).clamp(1, 65535) as u32, 1);
            // bs_cu_add's parameters in order; y holds what it reads (checked).
            let mut args = vec![
                Arg::F32Out(x),
                Arg::F32(y),
                Arg::I32(n as i32),
                Arg::I32(period as i32),
            ];
            self.run("bs_cu_add", cfg, &mut args)
        }

        /// RoPE (`bs_cu_rope`) in place on `rows` rows of `heads` × `hd`
        /// floats, row r by row r of `tbl` (rows of hd floats).
        fn rope(
            &self,
            x: &mut DevBuf<f32>,
            tbl: &DevBuf<f32>,
            rows: usize,
            heads: usize,
            hd: usize,
            dim: usize,
        ) -> Result<(), String> {
            let n = rows.saturating_mul(heads * hd);
            if dim % 2 != 0
                || dim > hd
                || x.len() < n
                || tbl.len() < rows * hd
                || n > i32::MAX as usize
            {
                return Err(format!(
                    "RoPE over {dim} of {hd} for {rows} rows of {heads} heads: {} values and {} of table",
                    x.len(),
                    tbl.len()
                ));
            }
            if dim == 0 {
                return Ok(());
            }
            let cfg = blocks128((n / hd * (dim / 2)).div_ceil(128).clamp(1, 65535) as u32, 1);
            // bs_cu_rope's parameters in order; x holds rows × heads × hd and
            // tbl rows × hd with dim ≤ hd (checked).
            let mut args = vec![
                Arg::F32Out(x),
                Arg::F32(tbl),
                Arg::I32(rows as i32),
                Arg::I32(heads as i32),
                Arg::I32(hd as i32),
                Arg::I32(dim as i32),
                Arg::I32(hd as i32),
            ];
            self.run("bs_cu_rope", cfg, &mut args)
        }

        /// The layer kernels of [`KvMirror::layers_forward`] on host slices
        /// (the tests' form), each step where asked: `norm` (w, eps,
        /// in_place) RMSNorm of `x`'s rows of w.len() floats, in place on
        /// the device or into another buffer; then `rope` (tbl, heads, hd,
        /// dim) RoPE of rows of heads × hd by `tbl` (a row of hd floats a
        /// row); then `add` added (as long as x, or a bias of a row's width).
        pub fn layer_ops(
            &self,
            x: &[f32],
            norm: Option<(&[f32], f32, bool)>,
            rope: Option<(&[f32], usize, usize, usize)>,
            add: &[f32],
        ) -> Result<Vec<f32>, String> {
            if x.is_empty() {
                return Err("no x".into());
            }
            let mut out = self.htod(x, "copying x")?;
            if let Some((w, eps, in_place)) = norm {
                let d = w.len();
                if d == 0 || x.len() % d != 0 {
                    return Err(format!("{} values in rows of {d}", x.len()));
                }
                let wd = self.htod(w, "copying norm weights")?;
                if in_place {
                    self.rmsnorm(None, &wd, &mut out, x.len() / d, d, eps)?;
                } else {
                    let xd = self.htod(x, "copying x")?;
                    self.rmsnorm(Some(&xd), &wd, &mut out, x.len() / d, d, eps)?;
                }
            }
            if let Some((tbl, heads, hd, dim)) = rope {
                let width = heads * hd;
                if width == 0 || x.len() % width != 0 {
                    return Err(format!("{} values in rows of {heads} × {hd}", x.len()));
                }
                let t = self.htod(tbl, "copying the rotary table")?;
                self.rope(&mut out, &t, x.len() / width, heads, hd, dim)?;
            }
            if !add.is_empty() {
                let y = self.htod(add, "copying y")?;
                let period = if add.len() == x.len() { 0 } else { add.len() };
                self.add(&mut out, &y, x.len(), period)?;
            }
            self.dtoh(&out)
        }

        /// The launch for `n` elements, one a thread, at most 65535 blocks
        /// (the element-wise kernels loop over the rest).
        fn spread(n: usize) -> LaunchConfig {
            blocks128(n.div_ceil(128).clamp(1, 65535) as u32, 1)
        }

        /// Checks the rows `idx[off .. off + count]` of an MoE step: the
        /// list holds them, and each is a row of a buffer of `rows` × `d`.
        fn check_rows(
            idx: &DevBuf<i32>,
            off: usize,
            count: usize,
            d: usize,
            elems: usize,
        ) -> Result<(), String> {
            let n = count.saturating_mul(d);
            if count == 0
                || off + count > idx.len()
                || n > i32::MAX as usize
                || elems > i32::MAX as usize
            {
                return Err(format!(
                    "{count} rows of {d} from {off} of a list of {} (over {elems} values)",
                    idx.len()
                ));
            }
            Ok(())
        }

        /// dst row j = src row idx[off + j] (`bs_cu_gather`), rows of `d`.
        /// The indices are the routing's, checked below the step's token
        /// count, which src and dst hold.
        fn gather(
            &self,
            dst: &mut DevBuf<f32>,
            src: &DevBuf<f32>,
            idx: &DevBuf<i32>,
            off: usize,
            count: usize,
            d: usize,
        ) -> Result<(), String> {
            Self::check_rows(idx, off, count, d, src.len())?;
            if dst.len() < count * d || src.len() < count * d {
                return Err(format!(
                    "gathering {count} rows of {d} into {} values",
                    dst.len()
                ));
            }
            // bs_cu_gather's parameters in order; dst holds count × d, idx
            // off + count entries, each a row of src (check_routing).
            let mut args = vec![
                Arg::F32Out(dst),
                Arg::F32(src),
                Arg::I32s(idx),
                Arg::I32(off as i32),
                Arg::I32(count as i32),
                Arg::I32(d as i32),
            ];
            self.run("bs_cu_gather", Self::spread(count * d), &mut args)
        }

        /// out row idx[off + j] += y row j · w[off + j] (`bs_cu_scatter_add`).
        #[allow(clippy::too_many_arguments)]
        fn scatter_add(
            &self,
            out: &mut DevBuf<f32>,
            y: &DevBuf<f32>,
            idx: &DevBuf<i32>,
            w: &DevBuf<f32>,
            off: usize,
            count: usize,
            d: usize,
        ) -> Result<(), String> {
            Self::check_rows(idx, off, count, d, out.len())?;
            if y.len() < count * d || w.len() != idx.len() {
                return Err(format!(
                    "adding {count} rows of {d} from {} values with {} weights for {} rows",
                    y.len(),
                    w.len(),
                    idx.len()
                ));
            }
            // bs_cu_scatter_add's parameters in order; y holds count × d,
            // idx and w off + count entries, each index a row of out
            // (check_routing: below the step's token count, which out holds).
            let mut args = vec![
                Arg::F32Out(out),
                Arg::F32(y),
                Arg::I32s(idx),
                Arg::F32(w),
                Arg::I32(off as i32),
                Arg::I32(count as i32),
                Arg::I32(d as i32),
            ];
            self.run("bs_cu_scatter_add", Self::spread(count * d), &mut args)
        }

        /// x[..n] = 0.
        fn zero(&self, x: &mut DevBuf<f32>, n: usize) -> Result<(), String> {
            if n > x.len() || n > i32::MAX as usize {
                return Err(format!("zeroing {n} of {} values", x.len()));
            }
            // bs_cu_zero's parameters in order; x holds n (checked).
            let mut args = vec![Arg::F32Out(x), Arg::I32(n as i32)];
            self.run("bs_cu_zero", Self::spread(n), &mut args)
        }

        /// Copy `len` floats of `src` from `at` into `dst` from `to`, on the device.
        fn dtod(
            &self,
            src: &DevBuf<f32>,
            at: usize,
            dst: &mut DevBuf<f32>,
            to: usize,
            len: usize,
        ) -> Result<(), String> {
            let fits = |o: usize, b: usize| o.checked_add(len).is_some_and(|e| e <= b);
            if !fits(at, src.len()) || !fits(to, dst.len()) {
                return Err(format!(
                    "copying {len} floats on the GPU from {at} of {} to {to} of {}",
                    src.len(),
                    dst.len()
                ));
            }
            match (&self.dev, &src.0, &mut dst.0) {
                (Dev::Cuda { stream, .. }, Buf::Cuda(s), Buf::Cuda(d)) => stream
                    .memcpy_dtod(&s.slice(at..at + len), &mut d.slice_mut(to..to + len))
                    .map_err(derr("copying on the GPU")),
                (Dev::Emu, Buf::Host(s), Buf::Host(d)) => {
                    d[to..to + len].copy_from_slice(&s[at..at + len]);
                    Ok(())
                }
                _ => Err("a buffer of another device".into()),
            }
        }

        /// g = silu(g) ⊙ u over `n` elements (clamped at `limit`).
        fn swiglu_launch(
            &self,
            g: &mut DevBuf<f32>,
            u: &DevBuf<f32>,
            n: usize,
            limit: Option<f32>,
        ) -> Result<(), String> {
            if n > g.len() || n > u.len() || n > i32::MAX as usize {
                return Err(format!(
                    "swiglu over {n} of {} and {} values",
                    g.len(),
                    u.len()
                ));
            }
            let cfg = blocks128(n.div_ceil(128).clamp(1, 65535) as u32, 1);
            // bs_cu_swiglu's parameters in order; g and u hold n (checked).
            let mut args = vec![
                Arg::F32Out(g),
                Arg::F32(u),
                Arg::I32(n as i32),
                Arg::F32Val(limit.unwrap_or(0.0)),
                Arg::I32(limit.is_some() as i32),
            ];
            self.run("bs_cu_swiglu", cfg, &mut args)
        }

        /// Seconds per launch of an attention kernel at `shape` over t_len
        /// keys: `kernel` bs_cu_attn_decode* (one query, sinks if `sinks`),
        /// bs_cu_attn_causal* (n_q queries from position t_len, so query j
        /// sees t_len + j) or bs_cu_attn_rows* (one KV head, n_q queries
        /// each over rows 0 .. t_len − 1 in order, with sinks). Inputs are
        /// uploaded once; `iters` launches, then one synchronize.
        pub fn time_attention(
            &self,
            kernel: &str,
            shape: crate::plan::AttnShape,
            sinks: bool,
            t_len: usize,
            n_q: usize,
            iters: usize,
        ) -> Result<f64, String> {
            let crate::plan::AttnShape {
                head_dim,
                n_heads,
                n_kv_heads,
            } = shape;
            // The kernel must be one of these (its parameters and, for a
            // specialisation, its baked-in shape are what is launched).
            let shaped = |f: &str| {
                if f == "rows" {
                    format!("bs_cu_attn_rows_d{head_dim}_h{n_heads}")
                } else {
                    format!("bs_cu_attn_{f}_d{head_dim}_h{n_heads}_kv{n_kv_heads}")
                }
            };
            let family = ["decode", "causal", "rows"]
                .into_iter()
                .find(|f| kernel == format!("bs_cu_attn_{f}") || kernel == shaped(f))
                .ok_or_else(|| format!("{kernel} is not an attention kernel for this shape"))?;
            let rows = family == "rows";
            let n_q = if family == "decode" { 1 } else { n_q };
            let kvw = n_kv_heads * head_dim;
            let keys = t_len + n_q;
            if head_dim == 0
                || n_heads == 0
                || n_kv_heads == 0
                || n_heads % n_kv_heads != 0
                || t_len == 0
                || n_q == 0
                || (rows && (n_kv_heads != 1 || n_q > GPU_QUERIES))
                || [keys * kvw, n_q * n_heads * keys, n_q * n_heads * head_dim]
                    .iter()
                    .any(|&v| v > i32::MAX as usize)
            {
                return Err(format!(
                    "timing {kernel}: {n_heads} heads over {n_kv_heads} of {head_dim}, {t_len} keys, {n_q} queries"
                ));
            }
            let fill = |n: usize, seed: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| (((i * 7 + seed) % 23) as f32 - 11.0) / 16.0)
                    .collect()
            };
            let q = self.htod(&fill(n_q * n_heads * head_dim, 1), "copying to the GPU")?;
            let k = self.htod(&fill(keys * kvw, 2), "copying to the GPU")?;
            let v = self.htod(&fill(keys * kvw, 3), "copying to the GPU")?;
            let sk = self.htod(&fill(n_heads, 4), "copying to the GPU")?;
            let mut out = self.zeros::<f32>(n_q * n_heads * head_dim)?;
            let mut scratch = self.zeros::<f32>(n_q * n_heads * keys)?;
            let scale = 1.0 / (head_dim as f32).sqrt();
            let list: Vec<i32> = (0..n_q).flat_map(|_| 0..t_len as i32).collect();
            let offs: Vec<i32> = (0..=n_q).map(|j| (j * t_len) as i32).collect();
            let (rd, od) = (
                self.htod(&list, "copying to the GPU")?,
                self.htod(&offs, "copying to the GPU")?,
            );
            let launch = |out: &mut DevBuf<f32>, scratch: &mut DevBuf<f32>| {
                // Sound by construction: q and out hold n_q rows of n_heads ×
                // head_dim; k and v t_len + n_q rows of n_kv_heads × head_dim
                // (every query of a causal launch sees at most t_len + n_q − 1
                // of them; a row list t_len); sinks n_heads; scratch n_q ×
                // n_heads × (t_len + n_q), at least what any of the three
                // writes; offs ascend from 0 by t_len to list.len(), every
                // row below t_len; all below 2^31 (checked above).
                if rows {
                    self.rows_launch(
                        kernel,
                        [&q, &k, &sk],
                        (&rd, &od),
                        out,
                        scratch,
                        (n_heads, head_dim, n_q),
                        scale,
                    )
                } else {
                    let causal = family == "causal";
                    self.attn_launch(
                        kernel,
                        &q,
                        &k,
                        &v,
                        (sinks && !causal).then_some(&sk),
                        out,
                        scratch,
                        AttnGeo {
                            n_heads,
                            n_kv_heads,
                            head_dim,
                            kv_stride: kvw,
                            t_len,
                            window: 0,
                            scale,
                            n_q: causal.then_some(n_q),
                        },
                    )
                }
            };
            launch(&mut out, &mut scratch)?; // warm-up
            self.synchronize()?;
            let t = std::time::Instant::now();
            for _ in 0..iters {
                launch(&mut out, &mut scratch)?;
            }
            self.synchronize()?;
            Ok(t.elapsed().as_secs_f64() / iters.max(1) as f64)
        }

        /// Seconds per call of `kernel` on `m` with n columns of X (inputs
        /// uploaded once; `iters` launches, then one synchronize).
        pub fn time_product(
            &self,
            kernel: &str,
            m: &DevMat,
            n: usize,
            iters: usize,
        ) -> Result<f64, String> {
            self.check_product(kernel, m, n * m.cols, n)?;
            let x: Vec<f32> = (0..n * m.cols)
                .map(|i| ((i % 17) as f32 - 8.0) * 0.125)
                .collect();
            let xd = self.htod(&x, "copying activations")?;
            let mut y = self.zeros::<f32>(m.rows * n)?;
            self.launch(kernel, m, &xd, &mut y, n)?; // warm-up
            self.synchronize()?;
            let t = std::time::Instant::now();
            for _ in 0..iters {
                self.launch(kernel, m, &xd, &mut y, n)?;
            }
            self.synchronize()?;
            Ok(t.elapsed().as_secs_f64() / iters.max(1) as f64)
        }

        /// Peak memory bandwidth from the device's memory clock and bus width,
        /// bytes/s (None for the emulator).
        pub fn peak_bandwidth(&self) -> Option<f64> {
            use cudarc::driver::sys::CUdevice_attribute as A;
            let Dev::Cuda { ctx, .. } = &self.dev else {
                return None;
            };
            let clock_khz = ctx
                .attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
                .ok()? as f64;
            let bus_bits = ctx
                .attribute(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
                .ok()? as f64;
            (clock_khz > 0.0 && bus_bits > 0.0).then(|| 2.0 * clock_khz * 1e3 * bus_bits / 8.0)
        }
        /// The checks that make a launch sound: X's length, n, the shapes the
        /// tensor-core kernels need, the kernel's specialised shape.
        fn check_product(
            &self,
            kernel: &str,
            m: &DevMat,
            x_len: usize,
            n: usize,
        ) -> Result<(), String> {
            if n == 0 || n > i32::MAX as usize || x_len != n * m.cols {
                return Err(format!(
                    "{kernel}: X has {x_len} values, expected n × cols = {n} × {} (n ≥ 1)",
                    m.cols
                ));
            }
            if n > 1 && kernel.starts_with("bs_cu_matvec") {
                return Err(format!(
                    "{kernel}: a matvec kernel takes one column of X, not {n}"
                ));
            }
            // bs_cu_<op>_<fmt>[_<rows>x<cols>] and bs_tc_<path>_<fmt>.
            let parts: Vec<&str> = kernel.split('_').collect();
            if parts.len() < 4 || parts[3] != m.format.name() {
                return Err(format!("{kernel} does not take {} weights", m.format));
            }
            if let Some((r, c)) = parts.get(4).and_then(|s| s.split_once('x')) {
                let shape = (r.parse::<usize>(), c.parse::<usize>());
                if shape != (Ok(m.rows), Ok(m.cols)) {
                    return Err(format!(
                        "{kernel} is specialised for {r}×{c}, not {}×{}",
                        m.rows, m.cols
                    ));
                }
            }
            if kernel.starts_with("bs_tc_") {
                let k = if matches!(kernel, "bs_tc_mxf4_fp4" | "bs_tc_tcgen05_fp4") {
                    64
                } else {
                    32
                };
                if m.cols % k != 0 {
                    return Err(format!(
                        "{kernel} needs cols a multiple of {k}, not {}",
                        m.cols
                    ));
                }
            }
            Ok(())
        }

        fn launch(
            &self,
            kernel: &str,
            m: &DevMat,
            xd: &DevBuf<f32>,
            y: &mut DevBuf<f32>,
            n: usize,
        ) -> Result<(), String> {
            let (rows, cols, nn) = (m.rows as i32, m.cols as i32, n as i32);
            let tc = kernel.starts_with("bs_tc_");
            let quantized = matches!(
                kernel,
                "bs_tc_q8_fp4" | "bs_tc_fp8_fp8" | "bs_tc_mxf4_fp4" | "bs_tc_tcgen05_fp4"
            );
            let q = if quantized {
                Some(self.quantize(kernel, xd, m.cols, n)?)
            } else {
                None
            };
            let cfg = if kernel == "bs_tc_tcgen05_fp4" {
                // One CTA per 128 rows × 32 columns of X (BS_T5_N).
                blocks128(m.rows.div_ceil(128) as u32, n.div_ceil(32) as u32)
            } else if tc {
                blocks128(m.rows.div_ceil(64) as u32, n.div_ceil(8) as u32)
            } else {
                blocks128(m.rows.div_ceil(4) as u32, 1)
            };
            // The kernel's parameters in order (templates/cuda.cu.tera); m was
            // uploaded from a checked Matrix (its weights and scales hold rows
            // × cols in its format), check_product checked X (n × cols) and
            // the kernel's format, shape and tile needs, and y holds n × rows.
            let mut args = vec![Arg::U8(&m.w), Arg::U8(&m.scale)];
            match &q {
                Some((codes, scales)) => args.extend([Arg::U8(codes), Arg::U8(scales)]),
                None => args.push(Arg::F32(xd)),
            };
            args.extend([Arg::F32Out(y), Arg::I32(rows), Arg::I32(cols)]);
            if kernel.contains("matmul") || tc {
                args.push(Arg::I32(nn));
            }
            self.run(kernel, cfg, &mut args)
        }

        /// Activations for the quantized tensor-core paths: (codes, scales).
        fn quantize(
            &self,
            kernel: &str,
            x: &DevBuf<f32>,
            cols: usize,
            n: usize,
        ) -> Result<(DevBuf<u8>, DevBuf<u8>), String> {
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
            let mut q = self.zeros::<u8>(qbytes.max(1))?;
            let mut s = self.zeros::<u8>(sbytes.max(1))?;
            let cfg = blocks128(blocks.div_ceil(4).max(1) as u32, 1);
            // (x, codes, scales, cols, n) as the quantize kernels take them;
            // the buffers are sized for cols × n above.
            let mut args = [
                Arg::F32(x),
                Arg::U8Out(&mut q),
                Arg::U8Out(&mut s),
                Arg::I32(cols as i32),
                Arg::I32(n as i32),
            ];
            self.run(qname, cfg, &mut args)?;
            Ok((q, s))
        }

        /// Attention decode on the GPU (the CPU kernel's arguments):
        /// bs_cu_attn_decode or its specialisation for these shapes.
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
            let geo = AttnGeo {
                n_heads,
                n_kv_heads,
                head_dim,
                kv_stride,
                t_len,
                window,
                scale,
                n_q: None,
            };
            self.attn_host(kernel, q, k, v, sinks, geo)
        }

        /// Causal attention on the GPU for consecutive queries (q: rows of
        /// n_heads × head_dim), query j over positions 0 .. t_len + j - 1 of
        /// k and v (rows of kv_stride floats, position-major), no sinks and
        /// no window: what attention on the GPU runs a prefill step with
        /// ([`KvMirror`]). `kernel`: bs_cu_attn_causal or its specialisation
        /// for these shapes.
        #[allow(clippy::too_many_arguments)]
        pub fn attn_causal(
            &self,
            kernel: &str,
            q: &[f32],
            k: &[f32],
            v: &[f32],
            n_heads: usize,
            n_kv_heads: usize,
            head_dim: usize,
            kv_stride: usize,
            t_len: usize,
            scale: f32,
        ) -> Result<Vec<f32>, String> {
            let geo = AttnGeo {
                n_heads,
                n_kv_heads,
                head_dim,
                kv_stride,
                t_len,
                window: 0,
                scale,
                n_q: Some(q.len().checked_div(n_heads * head_dim).unwrap_or(0)),
            };
            self.attn_host(kernel, q, k, v, None, geo)
        }

        /// [`Gpu::attn_decode`] (`geo.n_q` None) and [`Gpu::attn_causal`]
        /// from host slices: what the kernel reads checked, the inputs
        /// uploaded, the output copied back.
        fn attn_host(
            &self,
            kernel: &str,
            q: &[f32],
            k: &[f32],
            v: &[f32],
            sinks: Option<&[f32]>,
            geo: AttnGeo,
        ) -> Result<Vec<f32>, String> {
            let AttnGeo {
                n_heads,
                n_kv_heads,
                head_dim,
                kv_stride,
                t_len,
                window,
                ..
            } = geo;
            let family = if geo.n_q.is_some() {
                "causal"
            } else {
                "decode"
            };
            let shaped = format!("bs_cu_attn_{family}_d{head_dim}_h{n_heads}_kv{n_kv_heads}");
            if kernel != format!("bs_cu_attn_{family}") && kernel != shaped {
                return Err(format!(
                    "{kernel} is not the {family} attention kernel for these shapes ({shaped})"
                ));
            }
            let (hw, n_q) = (n_heads * head_dim, geo.n_q.unwrap_or(1));
            // Positions the last query sees, and the scores of all of them.
            let last = (t_len + n_q).saturating_sub(1);
            let scores = n_q.checked_mul(n_heads).and_then(|v| v.checked_mul(last));
            let span = last.checked_mul(kv_stride);
            if [hw, kv_stride, last, n_q, window]
                .iter()
                .any(|&v| v > i32::MAX as usize)
                || scores.map_or(true, |v| v > i32::MAX as usize)
                || span.is_none()
            {
                return Err("attention: the GPU kernel takes sizes below 2^31".into());
            }
            let span = span.unwrap_or(usize::MAX);
            if head_dim == 0
                || n_heads == 0
                || n_kv_heads == 0
                || n_heads % n_kv_heads != 0
                || kv_stride < n_kv_heads * head_dim
                || n_q == 0
                || t_len == 0
                || q.len() != n_q * hw
                || k.len() < span
                || v.len() < span
                || sinks.is_some_and(|s| s.len() != n_heads)
            {
                return Err(format!(
                    "attention: q {} (want {n_q} × {n_heads}×{head_dim}), k {} / v {} (want ≥ {last}×{kv_stride}), \
                     {n_heads} heads over {n_kv_heads} KV heads, from position {t_len}, sinks {:?}",
                    q.len(),
                    k.len(),
                    v.len(),
                    sinks.map(<[f32]>::len)
                ));
            }
            let up = |s: &[f32]| self.htod(s, "copying to the GPU");
            let (qd, kd, vd) = (up(q)?, up(k)?, up(v)?);
            let sd = match sinks {
                Some(s) => Some(up(s)?),
                None => None,
            };
            let mut out = self.zeros::<f32>(n_q * hw)?;
            let mut scratch = self.zeros::<f32>(scores.unwrap_or(0).max(1))?;
            // Checked above: q and out hold n_q rows of n_heads × head_dim, k
            // and v t_len + n_q - 1 rows of kv_stride, sinks n_heads, scratch
            // n_q × n_heads × (t_len + n_q - 1), every size below 2^31.
            self.attn_launch(
                kernel,
                &qd,
                &kd,
                &vd,
                sd.as_ref(),
                &mut out,
                &mut scratch,
                geo,
            )?;
            self.dtoh(&out)
        }

        /// Launch an attention kernel on device buffers: bs_cu_attn_decode*
        /// (`a.n_q` None) or bs_cu_attn_causal* (`a.n_q` queries). The caller
        /// has checked that q and out hold n_q rows of n_heads × head_dim
        /// floats, k and v t_len + n_q - 1 rows of kv_stride ≥ n_kv_heads ×
        /// head_dim floats, sinks (if any) n_heads, scratch n_q × n_heads ×
        /// (t_len + n_q - 1), and that every size is below 2^31 (n_q = 1 for
        /// decode).
        #[allow(clippy::too_many_arguments)]
        fn attn_launch(
            &self,
            kernel: &str,
            q: &DevBuf<f32>,
            k: &DevBuf<f32>,
            v: &DevBuf<f32>,
            sinks: Option<&DevBuf<f32>>,
            out: &mut DevBuf<f32>,
            scratch: &mut DevBuf<f32>,
            a: AttnGeo,
        ) -> Result<(), String> {
            let cfg = blocks128(a.n_heads as u32, a.n_q.unwrap_or(1) as u32);
            // The parameters of bs_cu_attn_decode* (and n_q last for
            // bs_cu_attn_causal*) in order.
            let mut args = vec![
                Arg::F32(q),
                Arg::F32(k),
                Arg::F32(v),
                match sinks {
                    Some(s) => Arg::F32(s),
                    None => Arg::Null,
                },
                Arg::F32Out(out),
                Arg::F32Out(scratch),
            ];
            for i in [
                a.n_heads,
                a.n_kv_heads,
                a.head_dim,
                a.kv_stride,
                a.t_len,
                a.window,
            ] {
                args.push(Arg::I32(i as i32));
            }
            args.push(Arg::F32Val(a.scale));
            if let Some(n_q) = a.n_q {
                args.push(Arg::I32(n_q as i32));
            }
            self.run(kernel, cfg, &mut args)
        }

        /// Attention over listed rows on the GPU from host slices (what
        /// [`RowKv::attend`] launches on its device rows): up to GPU_QUERIES
        /// queries `q[n][n_heads × head_dim]`, query j over
        /// `rows[offs[j] .. offs[j + 1]]` of kv (rows of head_dim floats, K = V), with sinks
        /// (n_heads). `kernel`: bs_cu_attn_rows or its specialisation.
        #[allow(clippy::too_many_arguments)]
        pub fn attn_rows(
            &self,
            kernel: &str,
            q: &[f32],
            kv: &[f32],
            sinks: &[f32],
            rows: &[i32],
            offs: &[i32],
            n_heads: usize,
            head_dim: usize,
            scale: f32,
        ) -> Result<Vec<f32>, String> {
            let shaped = format!("bs_cu_attn_rows_d{head_dim}_h{n_heads}");
            if kernel != "bs_cu_attn_rows" && kernel != shaped {
                return Err(format!(
                    "{kernel} is not the row attention kernel for these shapes ({shaped})"
                ));
            }
            let n = offs.len().saturating_sub(1);
            let hw = n_heads * head_dim;
            let have = kv.len().checked_div(head_dim).unwrap_or(0);
            let max_keys = offs
                .windows(2)
                .map(|w| w[1].saturating_sub(w[0]) as usize)
                .max()
                .unwrap_or(0);
            check_rows(rows, offs, have, max_keys.max(1))?;
            if head_dim == 0
                || n_heads == 0
                || n == 0
                || n > GPU_QUERIES
                || q.len() != n * hw
                || sinks.len() != n_heads
                || [hw, kv.len(), n_heads * rows.len().max(1)]
                    .iter()
                    .any(|&v| v > i32::MAX as usize)
            {
                return Err(format!(
                    "attention over rows: q {} (want {n} × {n_heads}×{head_dim}, at most {GPU_QUERIES} queries),                      kv {}, sinks {}",
                    q.len(),
                    kv.len(),
                    sinks.len()
                ));
            }
            let up = |s: &[f32]| self.htod(s, "copying to the GPU");
            let (qd, kd, sd) = (up(q)?, up(kv)?, up(sinks)?);
            let (rd, od) = (
                self.htod(rows, "copying to the GPU")?,
                self.htod(offs, "copying to the GPU")?,
            );
            let mut out = self.zeros::<f32>(n * hw)?;
            let mut scratch = self.zeros::<f32>((n_heads * rows.len()).max(1))?;
            // Checked above: n queries of n_heads × head_dim in q and out,
            // sinks n_heads, offs ascending from 0 to rows.len() with every
            // row below kv's (check_rows), scratch n_heads × rows.len().
            self.rows_launch(
                kernel,
                [&qd, &kd, &sd],
                (&rd, &od),
                &mut out,
                &mut scratch,
                (n_heads, head_dim, n),
                scale,
            )?;
            self.dtoh(&out)
        }

        /// The lightning indexer's scores on the GPU from host slices (what
        /// [`RowKv::index_scores`] launches on its device entries): query j
        /// (`q[j][heads × dim]`, `w[j][heads]`) against the first
        /// `offs[j + 1] − offs[j]` entries (rows of dim floats), into
        /// `[offs[j] ..]` of the result.
        #[allow(clippy::too_many_arguments)]
        pub fn index_scores(
            &self,
            entries: &[f32],
            q: &[f32],
            w: &[f32],
            offs: &[i32],
            heads: usize,
            dim: usize,
            scale: f32,
        ) -> Result<Vec<f32>, String> {
            let have = entries.len().checked_div(dim).unwrap_or(0);
            let most = check_index(q, w, offs, (heads, dim), have)?;
            if [entries.len(), q.len()]
                .iter()
                .any(|&v| v > i32::MAX as usize)
            {
                return Err("indexer scores: sizes below 2^31".into());
            }
            let n = offs.len() - 1;
            let total = offs[n] as usize;
            if most == 0 {
                return Ok(vec![0.0; total]);
            }
            let up = |s: &[f32]| self.htod(s, "copying to the GPU");
            let (ed, qd, wd) = (up(entries)?, up(q)?, up(w)?);
            let od = self.htod(offs, "copying to the GPU")?;
            let mut out = self.zeros::<f32>(total)?;
            // Checked above: n queries of heads × dim and heads floats, offs
            // ascending from 0 to total with no range past the entries.
            self.index_launch([&ed, &qd, &wd], &od, &mut out, (heads, dim, n, most), scale)?;
            self.dtoh(&out)
        }

        /// Launch bs_cu_index_scores for `n` queries: `bufs` = entries, q, w.
        /// The caller has checked the sizes ([`check_index`]): `most` is the
        /// most entries of a query, and the scores hold offs[n].
        fn index_launch(
            &self,
            bufs: [&DevBuf<f32>; 3],
            offs: &DevBuf<i32>,
            scores: &mut DevBuf<f32>,
            (heads, dim, n, most): (usize, usize, usize, usize),
            scale: f32,
        ) -> Result<(), String> {
            let cfg = blocks128(most.div_ceil(8) as u32, n as u32);
            // The parameters of bs_cu_index_scores in order.
            let mut args = vec![
                Arg::F32(bufs[0]),
                Arg::F32(bufs[1]),
                Arg::F32(bufs[2]),
                Arg::I32s(offs),
                Arg::F32Out(scores),
                Arg::I32(heads as i32),
                Arg::I32(dim as i32),
                Arg::F32Val(scale),
                Arg::I32(n as i32),
            ];
            self.run("bs_cu_index_scores", cfg, &mut args)
        }

        /// Launch bs_cu_attn_rows* for `n` queries: `bufs` = q, kv, sinks;
        /// `list` = rows, offs. The caller has checked that q and out hold n
        /// rows of n_heads × head_dim floats, sinks n_heads, offs n + 1
        /// ascending from 0 to the rows' count with every row inside kv,
        /// scratch n_heads × that count, and every size below 2^31.
        #[allow(clippy::too_many_arguments)]
        fn rows_launch(
            &self,
            kernel: &str,
            bufs: [&DevBuf<f32>; 3],
            list: (&DevBuf<i32>, &DevBuf<i32>),
            out: &mut DevBuf<f32>,
            scratch: &mut DevBuf<f32>,
            (n_heads, head_dim, n): (usize, usize, usize),
            scale: f32,
        ) -> Result<(), String> {
            let cfg = blocks128(n_heads as u32, n as u32);
            // The parameters of bs_cu_attn_rows* in order.
            let mut args = vec![
                Arg::F32(bufs[0]),
                Arg::F32(bufs[1]),
                Arg::F32(bufs[2]),
                Arg::I32s(list.0),
                Arg::I32s(list.1),
                Arg::F32Out(out),
                Arg::F32Out(scratch),
                Arg::I32(n_heads as i32),
                Arg::I32(head_dim as i32),
                Arg::F32Val(scale),
                Arg::I32(n as i32),
            ];
            self.run(kernel, cfg, &mut args)
        }

        /// Copy the first `dst.len()` elements of `src` back.
        fn dtoh_into(&self, src: &DevBuf<f32>, dst: &mut [f32]) -> Result<(), String> {
            let n = dst.len();
            if n > src.len() {
                return Err(format!(
                    "copying {n} floats back from a buffer of {}",
                    src.len()
                ));
            }
            match (&self.dev, &src.0) {
                (Dev::Cuda { stream, .. }, Buf::Cuda(s)) => stream
                    .memcpy_dtoh(&s.slice(..n), dst)
                    .map_err(derr("copying the result back")),
                (Dev::Emu, Buf::Host(v)) => {
                    dst.copy_from_slice(&v[..n]);
                    Ok(())
                }
                _ => Err("a buffer of another device".into()),
            }
        }

        /// Copy `src` into `dst` from element `at` on.
        fn htod_into<T: DeviceRepr + Copy>(
            &self,
            src: &[T],
            dst: &mut DevBuf<T>,
            at: usize,
        ) -> Result<(), String> {
            let end = at
                .checked_add(src.len())
                .filter(|&e| e <= dst.len())
                .ok_or_else(|| {
                    format!(
                        "copying {} values to the GPU at {at}: the buffer holds {}",
                        src.len(),
                        dst.len()
                    )
                })?;
            match (&self.dev, &mut dst.0) {
                (Dev::Cuda { stream, .. }, Buf::Cuda(d)) => stream
                    .memcpy_htod(src, &mut d.slice_mut(at..end))
                    .map_err(derr("copying to the GPU")),
                (Dev::Emu, Buf::Host(d)) => {
                    d[at..end].copy_from_slice(src);
                    Ok(())
                }
                _ => Err("a buffer of another device".into()),
            }
        }

        /// Free device memory now.
        pub fn free_mem(&self) -> Result<usize, String> {
            match &self.dev {
                Dev::Cuda { ctx, .. } => ctx
                    .mem_get_info()
                    .map(|(free, _)| free)
                    .map_err(derr("asking for free memory")),
                Dev::Emu => Ok(self.total_mem),
            }
        }

        pub fn synchronize(&self) -> Result<(), String> {
            match &self.dev {
                Dev::Cuda { ctx, .. } => ctx.synchronize().map_err(derr("synchronizing")),
                Dev::Emu => Ok(()),
            }
        }
    }
}

#[cfg(feature = "cuda")]
pub use imp::{
    emulator, emulator_selftest, gpu, DenseGeo, DenseVectors, DevBuf, DevMat, DevProduct, FfnBatch,
    FfnJob, Gpu, KvMirror, LayerFfn, LayerMats, LayerVectors, MoeHost, RoutedExpert, RowKv,
};

/// The VRAM tier: matrices made resident on the GPU, found again by the
/// address and length of their weight bytes (the model's memory map, which
/// outlives every call). [`crate::Kernels`] sends a product whose matrix is
/// resident to the GPU and every other product to the CPU kernels.
#[cfg(feature = "cuda")]
pub mod tier {
    use super::*;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    /// (tier, address, length) of the weight bytes.
    type Key = (u32, usize, usize);

    struct Tiers {
        next: u32,
        map: HashMap<Key, Arc<DevMat>>,
        /// Per tier: bytes reserved for KV mirrors, and how many are free.
        kv: HashMap<u32, (u64, u64)>,
    }

    fn tiers() -> &'static Mutex<Tiers> {
        static M: OnceLock<Mutex<Tiers>> = OnceLock::new();
        M.get_or_init(|| {
            Mutex::new(Tiers {
                next: 1,
                map: HashMap::new(),
                kv: HashMap::new(),
            })
        })
    }

    fn key(tier: u32, m: &crate::Matrix) -> Key {
        let (w, _) = matrix_bytes(m);
        (tier, w.as_ptr() as usize, w.len())
    }

    /// A new, empty tier. Tiers are never reused, and an engine releases
    /// its own when it is dropped ([`release`]), before the mapping its
    /// matrices borrow goes: a freed and reused mapping can never meet stale
    /// device copies.
    pub fn new_tier() -> u32 {
        let mut t = tiers().lock().unwrap_or_else(|e| e.into_inner());
        let id = t.next;
        t.next += 1;
        id
    }

    /// Free tier `id`'s device copies.
    pub fn release(id: u32) {
        let mut t = tiers().lock().unwrap_or_else(|e| e.into_inner());
        t.map.retain(|k, _| k.0 != id);
        t.kv.remove(&id);
    }

    /// Set aside `bytes` of tier `id`'s budget for the KV caches that
    /// attention on the GPU keeps ([`KvMirror`]).
    pub fn reserve_kv(id: u32, bytes: u64) {
        let mut t = tiers().lock().unwrap_or_else(|e| e.into_inner());
        t.kv.insert(id, (bytes, bytes));
    }

    pub(super) fn take_kv(id: u32, bytes: u64) -> Result<(), String> {
        let mut t = tiers().lock().unwrap_or_else(|e| e.into_inner());
        let (all, free) = t.kv.get(&id).copied().unwrap_or((0, 0));
        if bytes > free {
            let h = crate::inspect::human_bytes;
            return Err(format!(
                "its KV cache needs {} of VRAM and the tier's reservation has {} free (of {})",
                h(bytes),
                h(free),
                h(all)
            ));
        }
        t.kv.insert(id, (all, free - bytes));
        Ok(())
    }

    pub(super) fn give_kv(id: u32, bytes: u64) {
        let mut t = tiers().lock().unwrap_or_else(|e| e.into_inner());
        if let Some((all, free)) = t.kv.get_mut(&id) {
            *free = (*free + bytes).min(*all);
        }
    }

    /// Copy `m` to the GPU into `tier` (once). Err: no GPU, or out of memory.
    pub fn make_resident(tier: u32, m: &crate::Matrix) -> Result<(), String> {
        let g = gpu().map_err(str::to_string)?;
        let k = key(tier, m);
        if tiers()
            .lock()
            .map_err(|_| "tier lock poisoned")?
            .map
            .contains_key(&k)
        {
            return Ok(());
        }
        let d = Arc::new(g.upload_matrix(m)?);
        tiers()
            .lock()
            .map_err(|_| "tier lock poisoned")?
            .map
            .insert(k, d);
        Ok(())
    }

    pub fn resident(tier: u32, m: &crate::Matrix) -> Option<Arc<DevMat>> {
        let t = tiers().lock().ok()?;
        t.map.get(&key(tier, m)).cloned()
    }

    /// Bytes resident in tier `id`.
    pub fn bytes(id: u32) -> u64 {
        tiers()
            .lock()
            .map(|t| {
                t.map
                    .iter()
                    .filter(|(k, _)| k.0 == id)
                    .map(|(_, d)| d.bytes as u64)
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Per VRAM tier: SwiGLU blocks whose outputs came back from
    /// [`ffn_finish`], batches of products ([`products`]), and layers run
    /// whole on the GPU ([`KvMirror::layers_forward`]).
    fn counts() -> &'static Mutex<HashMap<u32, [u64; 3]>> {
        static C: OnceLock<Mutex<HashMap<u32, [u64; 3]>>> = OnceLock::new();
        C.get_or_init(Default::default)
    }

    fn count(id: u32, what: usize, by: u64) {
        if let Ok(mut c) = counts().lock() {
            c.entry(id).or_default()[what] += by;
        }
    }

    fn counted(id: u32, what: usize) -> u64 {
        counts()
            .lock()
            .map(|c| c.get(&id).map_or(0, |v| v[what]))
            .unwrap_or(0)
    }

    pub(super) fn count_layers(id: u32, layers: u64) {
        count(id, 2, layers);
    }

    pub(super) fn count_experts(id: u32, experts: u64) {
        count(id, 0, experts);
    }

    /// Queue SwiGLU experts on the GPU ([`Gpu::ffn_start`]).
    pub fn ffn_start(jobs: &[FfnJob]) -> Result<FfnBatch, String> {
        gpu().map_err(str::to_string)?.ffn_start(jobs)
    }

    /// Their outputs ([`Gpu::ffn_finish`]), counted for tier `id`.
    pub fn ffn_finish(id: u32, batch: FfnBatch) -> Result<Vec<Vec<f32>>, String> {
        let out = gpu().map_err(str::to_string)?.ffn_finish(batch)?;
        count(id, 0, out.len() as u64);
        Ok(out)
    }

    /// Products of tier `id`'s resident `mats`, queued together and waited
    /// for once ([`Gpu::products_start`]: one X for all, or one each):
    /// their outputs in order.
    pub fn products(
        id: u32,
        mats: &[DevProduct],
        xs: &[&[f32]],
        n: usize,
    ) -> Result<Vec<Vec<f32>>, String> {
        let g = gpu().map_err(str::to_string)?;
        let out = g.ffn_finish(g.products_start(mats, xs, n)?)?;
        count(id, 1, 1);
        Ok(out)
    }

    /// How many SwiGLU blocks (experts, dense MLPs) of tier `id` ran whole
    /// on the GPU (gate, up and down queued together): the tests' witness
    /// that the engines use [`ffn_start`].
    pub fn ffn_blocks(id: u32) -> u64 {
        counted(id, 0)
    }

    /// How many batches of products ran for tier `id` ([`products`]).
    pub fn product_batches(id: u32) -> u64 {
        counted(id, 1)
    }

    /// How many layers of tier `id`'s dense models ran whole on the GPU
    /// ([`KvMirror::layers_forward`]), a forward's layers counted once each.
    pub fn whole_layers(id: u32) -> u64 {
        counted(id, 2)
    }

    /// Y = W X on the GPU for one resident product, as every queued
    /// product runs (`Gpu::product`: a prefill product of an activation
    /// variant on the tensor-core kernel of the same numerics where the
    /// image has one, the variant's activations made on the device for the
    /// CUDA cores). Err: the launch failed (the caller falls back).
    pub fn matmul(p: &DevProduct, x: &[f32], n: usize) -> Result<Vec<f32>, String> {
        let g = gpu().map_err(str::to_string)?;
        let mut out = g.ffn_finish(g.products_start(std::slice::from_ref(p), &[x], n)?)?;
        out.pop().ok_or_else(|| "no output from the GPU".into())
    }
}

/// What ran on the GPU for VRAM tier `id` so far, one line for the end of
/// a run (None without a tier): the layers of forwards with every layer
/// there, the SwiGLU blocks (MLPs, experts) run whole, the batches of
/// products queued together.
pub fn work_line(id: u32) -> Option<String> {
    #[cfg(feature = "cuda")]
    if id != 0 {
        return Some(format!(
            "CUDA: ran on the GPU: {} layers in forwards with every layer there, {} SwiGLU blocks whole, \
             {} batches of products",
            tier::whole_layers(id),
            tier::ffn_blocks(id),
            tier::product_batches(id)
        ));
    }
    let _ = id;
    None
}

/// Free VRAM tier `id` (a no-op without the `cuda` feature, where there
/// are no tiers).
pub fn release_tier(id: u32) {
    #[cfg(feature = "cuda")]
    tier::release(id);
    #[cfg(not(feature = "cuda"))]
    let _ = id;
}

/// What a tensor-core path the start-up check turned off is said as.
#[cfg(feature = "cuda")]
fn tc_off_note(key: &str, why: &str) -> String {
    format!("tensor-core path {key} off, its products on the CUDA cores: the start-up check found {why}")
}

/// One line for banners and `bespoke plan`: the device in use, or why the
/// engine runs on the CPU.
pub fn status_line() -> String {
    #[cfg(feature = "cuda")]
    {
        match imp::gpu() {
            Ok(g) => {
                let what = if g.emulated() {
                    "CUDA: emulated on the CPU (BESPOKE_CUDA=emu): the CUDA-core kernels and the \
                     tensor-core paths it computes, for testing; no speed"
                        .to_string()
                } else {
                    format!(
                        "CUDA: {} (sm_{}{}, {:.0} GiB), kernels from the {} image",
                        g.name,
                        g.cc.0,
                        g.cc.1,
                        g.total_mem as f64 / (1u64 << 30) as f64,
                        g.image.arch
                    )
                };
                let mut line = format!(
                    "{what}; start-up check: {} launches against the CPU reference",
                    g.checked
                );
                for (key, why) in &g.tc_off {
                    line += &format!("; {}", tc_off_note(key, why));
                }
                line
            }
            Err(why) => format!("CUDA: running on the CPU: {why}"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        "CUDA: not built with CUDA (the `cuda` feature is off); running on the CPU".into()
    }
}

/// The longest sequence whose KV cache the VRAM tier sets room aside for
/// (attention on the GPU); a longer one keeps its attention on the CPU.
pub const GPU_KV_TOKENS: usize = 4096;

/// Queries one attention launch takes: a prefill step's go this many at a
/// time ([`KvMirror`], [`RowKv`]).
pub const GPU_QUERIES: usize = 16;

/// What attention on the GPU sets aside for a model: device room for the
/// keys of one sequence of up to `tokens` positions, `bytes` in all.
#[derive(Debug, Clone, Copy)]
pub struct GpuAttention {
    pub tokens: usize,
    pub bytes: u64,
}

impl GpuAttention {
    /// Room for a sequence of min(context, GPU_KV_TOKENS) tokens, whose keys
    /// take `bytes_for(tokens)`.
    pub fn for_context(context: usize, bytes_for: impl FnOnce(usize) -> u64) -> GpuAttention {
        let tokens = context.min(GPU_KV_TOKENS);
        GpuAttention {
            tokens,
            bytes: bytes_for(tokens),
        }
    }
}

/// Device bytes a [`KvMirror`] of `layers` layers for `capacity` positions
/// takes: the keys and values, and one launch's queries, outputs and scores.
pub fn kv_mirror_bytes(
    layers: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    capacity: usize,
) -> u64 {
    let w = (n_kv_heads * head_dim) as u64;
    let qb = GPU_QUERIES as u64;
    4 * (2 * layers as u64 * capacity as u64 * w
        + 2 * qb * (n_heads * head_dim) as u64
        + qb * n_heads as u64 * capacity.max(1) as u64)
}

/// The shape of a [`RowKv`]: per layer, how many rows of `head_dim` floats
/// it keeps; the heads of a query; the most keys one query attends to; and
/// where the model has one, its lightning indexer's side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowKvGeo {
    pub layer_rows: Vec<usize>,
    pub n_heads: usize,
    pub head_dim: usize,
    pub max_keys: usize,
    pub index: Option<IndexGeo>,
}

/// The lightning indexer's part of a [`RowKv`] (DeepSeek V4's CSA layers):
/// per layer room for `layer_entries` compressed entries of `dim` floats (0:
/// the layer has no indexer), and `heads` query heads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexGeo {
    pub layer_entries: Vec<usize>,
    pub heads: usize,
    pub dim: usize,
}

impl IndexGeo {
    /// Device floats: the entries, and one launch's query heads, head
    /// weights and scores (plus its offsets, as many i32).
    fn floats(&self) -> u64 {
        let (q, h, d) = (GPU_QUERIES as u64, self.heads as u64, self.dim as u64);
        let entries: u64 = self.layer_entries.iter().map(|&e| e as u64).sum();
        let most = self.layer_entries.iter().copied().max().unwrap_or(0).max(1) as u64;
        entries * d + q * h * d + q * h + q * most + q + 1
    }
}

impl RowKvGeo {
    /// Device bytes: the rows and each layer's sinks, and one launch's
    /// queries, outputs, scores and row lists.
    pub fn bytes(&self) -> u64 {
        let (q, h, hd) = (
            GPU_QUERIES as u64,
            self.n_heads as u64,
            self.head_dim as u64,
        );
        let rows: u64 = self.layer_rows.iter().map(|&r| r as u64).sum();
        let layers = self.layer_rows.len() as u64;
        let keys = self.max_keys.max(1) as u64;
        let index = self.index.as_ref().map_or(0, IndexGeo::floats);
        4 * (rows * hd + layers * h + 2 * q * h * hd + q * h * keys + q * keys + q + 1 + index)
    }
}

/// Without the `cuda` feature there is no GPU to keep a KV cache on: no
/// value of this type exists.
#[cfg(not(feature = "cuda"))]
pub enum KvMirror {}

#[cfg(not(feature = "cuda"))]
impl KvMirror {
    pub fn new(
        _tier: u32,
        _layers: usize,
        _n_heads: usize,
        _n_kv_heads: usize,
        _head_dim: usize,
        _capacity: usize,
        _specialised: bool,
    ) -> Result<KvMirror, String> {
        Err("not built with CUDA".into())
    }

    pub fn append(
        &mut self,
        _layer: usize,
        _pos0: usize,
        _k: &[f32],
        _v: &[f32],
    ) -> Result<(), String> {
        match *self {}
    }

    pub fn attend(
        &mut self,
        _layer: usize,
        _q: &[f32],
        _t_len: usize,
        _scale: f32,
        _out: &mut [f32],
    ) -> Result<(), String> {
        match *self {}
    }
}

/// Without the `cuda` feature there is no GPU to keep key rows on: no
/// value of this type exists.
#[cfg(not(feature = "cuda"))]
pub enum RowKv {}

#[cfg(not(feature = "cuda"))]
impl RowKv {
    pub fn new(
        _tier: u32,
        _geo: RowKvGeo,
        _sinks: &[&[f32]],
        _specialised: bool,
    ) -> Result<RowKv, String> {
        Err("not built with CUDA".into())
    }

    pub fn write(&mut self, _layer: usize, _row0: usize, _data: &[f32]) -> Result<(), String> {
        match *self {}
    }

    pub fn has_index(&self, _layer: usize) -> bool {
        match *self {}
    }

    pub fn write_index(&mut self, _layer: usize, _e0: usize, _data: &[f32]) -> Result<(), String> {
        match *self {}
    }

    pub fn index_scores(
        &mut self,
        _layer: usize,
        _q: &[f32],
        _w: &[f32],
        _offs: &[i32],
        _scale: f32,
        _scores: &mut Vec<f32>,
    ) -> Result<(), String> {
        match *self {}
    }

    pub fn attend(
        &mut self,
        _layer: usize,
        _q: &[f32],
        _rows: &[i32],
        _offs: &[i32],
        _scale: f32,
        _out: &mut [f32],
    ) -> Result<(), String> {
        match *self {}
    }
}

/// Whether a Llama-family model whose layers are all resident runs each forward
/// with every layer on the GPU (`KvMirror::layers_forward`); not with
/// `BESPOKE_CUDA_LAYERS=off`, which keeps the block-by-block path (for
/// measuring what the whole-layer path buys).
pub fn whole_layers_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !std::env::var("BESPOKE_CUDA_LAYERS")
            .is_ok_and(|v| v.eq_ignore_ascii_case("off") || v == "0")
    })
}

/// Put the model's weights in the VRAM tier ([`crate::placement`]): Ok(None)
/// when there is no GPU (the status line already said why) and no budget was
/// asked for; Ok(Some(line)) says what went where.
pub fn place_model(
    eng: &mut crate::generate::AnyModel,
    vram_gib: Option<f64>,
) -> Result<Option<String>, String> {
    #[cfg(feature = "cuda")]
    {
        let g = match imp::gpu() {
            Ok(g) => g,
            Err(_) if vram_gib.is_none() => return Ok(None),
            Err(why) => return Err(format!("--vram given, but {why}")),
        };
        let free = g.free_mem().unwrap_or(g.total_mem) as u64;
        let budget = match vram_gib {
            Some(v) => (v * (1u64 << 30) as f64) as u64,
            None => free.saturating_sub(1 << 30),
        };
        let id = tier::new_tier();
        // Attention on the GPU keeps its keys there: room for one sequence
        // of up to GPU_KV_TOKENS positions is set aside after the dense
        // matrices.
        let kv_geo = eng.gpu_attention();
        let kv_reserve = kv_geo.bytes;
        let p = {
            let items = eng.placement_items();
            let only: Vec<crate::placement::Item> = items.iter().map(|(i, _)| i.clone()).collect();
            let p = crate::placement::place(
                &only,
                &eng.usage().snapshot(),
                budget.min(free),
                kv_reserve,
            );
            let upload = || -> Result<(), String> {
                for ((_, mats), on) in items.iter().zip(&p.on_gpu) {
                    if *on {
                        for m in mats {
                            let mm = m.matrix().map_err(|e| e.to_string())?;
                            tier::make_resident(id, &mm)?;
                        }
                    }
                }
                Ok(())
            };
            if let Err(e) = upload() {
                tier::release(id);
                return Err(e);
            }
            p
        };
        tier::reserve_kv(id, p.kv);
        eng.set_tier(id);
        let attention = match kv_geo {
            a if p.kv > 0 => format!(
                "attention on the GPU for sequences of up to {} tokens ({} set aside for their KV cache)",
                a.tokens,
                crate::inspect::human_bytes(p.kv)
            ),
            a => format!(
                "attention on the CPU (its KV cache for {} tokens, {}, does not fit after the dense matrices)",
                a.tokens,
                crate::inspect::human_bytes(kv_reserve)
            ),
        };
        // A Llama-family model whose dense matrices are all resident, its
        // attention included, runs each forward with every layer on the GPU
        // (LlamaModel::forward_on_gpu; routed experts where they are).
        let llama = matches!(eng, crate::generate::AnyModel::Llama(_));
        let attention = if llama && p.dense.0 == p.dense.1 && p.kv > 0 {
            let k = eng.kernels();
            // The activation variants asked for, which the device's
            // products take (Kernels::gpu_product).
            let variants: Vec<String> = [
                ("--bf16-act", k.bf16_act().name()),
                ("--fp8-act", k.fp8_act().name()),
                ("--fp4-act", k.fp4_act().name()),
            ]
            .into_iter()
            .filter(|(_, v)| *v != "f32")
            .map(|(f, v)| format!("{f} {v}"))
            .collect();
            let acts = match variants.is_empty() {
                true => "f32 activations".to_string(),
                false => format!("the activations of {}", variants.join(" ")),
            };
            if !whole_layers_enabled() {
                format!("{attention}; layers block by block (BESPOKE_CUDA_LAYERS=off)")
            } else {
                let experts = if p.experts.1 > 0 {
                    ", routed experts where they are"
                } else {
                    ""
                };
                format!("{attention}; each forward with every layer on the GPU ({acts}{experts})")
            }
        } else {
            attention
        };
        let mut line = format!(
            "CUDA: VRAM tier {} of a {} budget: {} of {} dense matrices, {} of {} routed experts (most used first per layer); {attention}; the rest on the CPU",
            crate::inspect::human_bytes(tier::bytes(id)),
            crate::inspect::human_bytes(budget),
            p.dense.0,
            p.dense.1,
            p.experts.0,
            p.experts.1
        );
        for (key, why) in &g.tc_off {
            line += &format!("\nCUDA: {}", tc_off_note(key, why));
        }
        Ok(Some(line))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = eng;
        match vram_gib {
            Some(_) => Err("--vram: this build has no CUDA (build with --features cuda)".into()),
            None => Ok(None),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_core_products_see_the_variants_activations() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.3) * 0.731).collect();
        assert_eq!(variant_activations(GpuAct::F32, &x, 64).unwrap(), None);
        let b = variant_activations(GpuAct::Bf16, &x, 64).unwrap().unwrap();
        for (v, r) in x.iter().zip(&b) {
            assert_eq!(r.to_bits() & 0xFFFF, 0, "{v} -> {r}: not a BF16 value");
            assert!((v - r).abs() <= v.abs() * 2f32.powi(-8), "{v} -> {r}");
        }
        // Two tokens of 32 columns: each block's own scale, codes within ±127.
        let q = variant_activations(GpuAct::Q8, &x, 32).unwrap().unwrap();
        for (xt, qt) in x.chunks(32).zip(q.chunks(32)) {
            let amax = xt.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            for (v, r) in xt.iter().zip(qt) {
                let k = r / d;
                assert!(
                    (k - k.round()).abs() < 1e-3 && k.abs() <= 127.5,
                    "{v} -> {r}"
                );
                assert!((v - r).abs() <= d * 0.5001, "{v} -> {r} (d {d})");
            }
        }
        // The largest |x| of a block is exactly 127 codes.
        assert!(q[..32]
            .iter()
            .any(|r| (r.abs() - 20.3 * 0.731).abs() < 1e-4));
    }

    #[test]
    fn prefill_products_take_the_tensor_cores_of_their_numerics() {
        let all = |_: &str| true;
        let none = |_: &str| false;
        let k = |f, n, cols, act, has: &dyn Fn(&str) -> bool| tc_kernel(f, n, cols, act, has);
        // f32 activations, or one token: the CUDA cores.
        assert_eq!(k(Format::Bf16, 64, 256, GpuAct::F32, &all), None);
        assert_eq!(k(Format::Bf16, 1, 256, GpuAct::Bf16, &all), None);
        // BF16 activations: the BF16 mma for every weight format but F32.
        assert_eq!(
            k(Format::Fp8, 8, 256, GpuAct::Bf16, &all).as_deref(),
            Some("bs_tc_bf16_fp8")
        );
        assert_eq!(k(Format::F32, 8, 256, GpuAct::Bf16, &all), None);
        // fp4×q8: the INT8 mma, for FP4 only.
        assert_eq!(
            k(Format::Fp4, 2, 4096, GpuAct::Q8, &all).as_deref(),
            Some("bs_tc_q8_fp4")
        );
        assert_eq!(k(Format::Bf16, 2, 4096, GpuAct::Q8, &all), None);
        // The image lacks the path, or the columns do not fill its K steps.
        assert_eq!(k(Format::Fp4, 8, 4096, GpuAct::Q8, &none), None);
        assert_eq!(k(Format::Bf16, 8, 100, GpuAct::Bf16, &all), None);
        assert_eq!(
            k(Format::Bf16, 8, 256, GpuAct::Bf16, &|p: &str| p
                == "mma_int8"),
            None
        );
    }
}
