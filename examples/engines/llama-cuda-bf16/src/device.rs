//! Phase 1, the device (contract `component.cuda_device`): the CUDA driver loaded at run time, one
//! context on device `ordinal`, one stream, and the engine's CUDA C (`kernels.cu`) compiled once
//! with NVRTC for the device's compute capability. A missing driver library or device is an
//! `Err("no CUDA device: ...")` before any other cudarc call (cudarc panics on a missing library).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};

/// The engine's CUDA C source, compiled at load.
const SOURCE: &str = include_str!("kernels.cu");

/// Every `__global__` function of [`SOURCE`], looked up once.
const FUNCTIONS: &[&str] = &[
    "embedding",
    "rms_norm",
    "rope",
    "linear_f32",
    "linear_bf16",
    "linear_f16",
    "linear_int8",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "softmax",
    "attention",
    "argmax",
    "store_kv",
    "mv_bf16",
    "mv_bf16_norm",
    "mv_bf16_silu",
    "mv_bf16_qkv",
    "mv_bf16_head",
    "attn_decode",
    "split3_bf16",
    "gemm_bf16x3",
    "rope_store_rows",
    "silu_mul_rows",
    "attn_prefill",
    "paged_attention_d1",
    "paged_attention_d2",
    "paged_attention_d4",
    "paged_attention_d8",
    "rope_store_paged",
    "moe_route",
    "moe_gate_up",
    "moe_down",
];

/// The engine's CUDA state: context, one stream, its kernels compiled with NVRTC.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    functions: Vec<CudaFunction>,
    sm_count: usize,
}

/// Whether the driver library can be loaded here (cudarc's dynamic loading panics otherwise).
pub fn driver_present() -> bool {
    // SAFETY: loads the CUDA driver library by name (dlopen) to see whether it exists; calls no
    // function of it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC can be loaded here.
pub fn nvrtc_present() -> bool {
    // SAFETY: as `driver_present`, for libnvrtc.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compile [`SOURCE`] to PTX for `arch` (e.g. `sm_90`). Needs NVRTC only, not a device.
///
/// # Errors
/// NVRTC's log when the source does not compile, or NVRTC is absent.
pub fn compile(arch: &'static str) -> Result<cudarc::nvrtc::Ptx, String> {
    if !nvrtc_present() {
        return Err("NVRTC (libnvrtc) is not present on this machine".into());
    }
    let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| format!("NVRTC: {e}"))
}

impl Device {
    /// Open device `ordinal`: a missing driver library or device is an Err ("no CUDA device: ..."), never a panic.
    pub fn open(ordinal: usize) -> Result<Device, String> {
        if !driver_present() {
            return Err("no CUDA device: the CUDA driver library (libcuda) is not present".into());
        }
        cudarc::driver::result::init().map_err(|e| format!("no CUDA device: the driver failed to start: {e}"))?;
        let n = cudarc::driver::result::device::get_count().map_err(|e| format!("no CUDA device: {e}"))?;
        if ordinal >= n.max(0) as usize {
            return Err(format!("no CUDA device: device {ordinal} asked for, the driver reports {n}"));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
        // One stream carries every operation of the engine in order, so cudarc's per-buffer events
        // (cross-stream synchronisation) are not needed; without them a decode step can be captured
        // as a CUDA graph (a wait on an event recorded outside a capture is not allowed in one).
        // SAFETY: no buffer exists yet in this context object, and all work goes to `stream`.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(|e| format!("compute capability: {e}"))?;
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let module = ctx.load_module(compile(arch)?).map_err(|e| format!("loading the kernels: {e}"))?;
        let functions = FUNCTIONS
            .iter()
            .map(|f| module.load_function(f).map_err(|e| format!("kernel {f}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        // A stream of its own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream().map_err(|e| format!("creating a stream: {e}"))?;
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| format!("multiprocessor count: {e}"))?
            .max(1) as usize;
        Ok(Device { ctx, stream, _module: module, functions, sm_count })
    }

    /// The stream every kernel of this device is launched on, in order.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context (device name, memory).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Streaming multiprocessors of the device (132 on an H100 SXM or H200): grids of the
    /// memory-bound kernels are sized from it.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// The compiled function `name` of [`SOURCE`].
    pub(crate) fn function(&self, name: &str) -> &CudaFunction {
        let i = FUNCTIONS.iter().position(|f| *f == name).expect("a function of kernels.cu");
        &self.functions[i]
    }
}

#[cfg(test)]
mod tests {
    /// The CUDA C compiles with NVRTC for sm_90 and sm_80 wherever libnvrtc is present (no device
    /// needed); elsewhere there is nothing to check.
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !super::nvrtc_present() {
            eprintln!("libnvrtc not present: CUDA C not compiled");
            return;
        }
        for arch in ["sm_80", "sm_90"] {
            let ptx = super::compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
            let text = ptx.to_src();
            for f in super::FUNCTIONS {
                assert!(text.contains(&format!(".entry {f}(")), "{arch}: {f} missing from the PTX");
            }
        }
    }

    /// Without a driver, opening a device is an error that says so, not a panic.
    #[test]
    fn open_without_a_driver_is_an_error() {
        if super::driver_present() {
            return;
        }
        let e = super::Device::open(0).err().expect("no driver: an error");
        assert!(e.starts_with("no CUDA device"), "{e}");
    }
}
