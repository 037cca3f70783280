//! Checkpoint tensors as the kernels read them: 2-D weight matrices in the build's weight format
//! (f32 by default; bf16, f16 or int8 with the cargo feature of that name), memory-mapped when the
//! checkpoint already holds that format suitably aligned, converted once otherwise; 1-D tensors
//! as f32. The weights are one `model.safetensors` or the shards `model.safetensors.index.json`
//! names ([`open`], component.weight_loading).

use std::collections::{BTreeSet, HashMap};
use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::{matmul, quant};

/// Element types that may be viewed directly in a little-endian checkpoint file.
pub(crate) trait Plain: Copy + Send + Sync + 'static {}
impl Plain for f32 {}
impl Plain for u16 {}
impl Plain for i8 {}

/// A flat tensor: either a view into the memory-mapped checkpoint or an owned buffer.
pub(crate) enum Data<T: Plain> {
    /// `len` elements at byte `offset` of the mapped file (aligned for T).
    Mapped { map: Arc<Mmap>, offset: usize, len: usize },
    /// Converted at load.
    Owned(Vec<T>),
}

impl<T: Plain> Deref for Data<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            // SAFETY: `map` outlives the returned slice (borrowed from self); offset and len were
            // checked against the mapping and T's alignment when the view was made, and T is plain
            // data valid for every bit pattern.
            Data::Mapped { map, offset, len } => unsafe {
                std::slice::from_raw_parts(map.as_ptr().add(*offset).cast::<T>(), *len)
            },
            Data::Owned(v) => v,
        }
    }
}

/// View `view`'s bytes as `[T]` inside `map` when they are aligned for T and the host is
/// little-endian.
#[cfg_attr(feature = "int8", allow(dead_code))]
fn mapped<T: Plain>(map: &Arc<Mmap>, view: &TensorView) -> Option<Data<T>> {
    let bytes = view.data();
    let base = map.as_ptr() as usize;
    let at = bytes.as_ptr() as usize;
    let size = std::mem::size_of::<T>();
    if cfg!(target_endian = "big")
        || at < base
        || at + bytes.len() > base + map.len()
        || !at.is_multiple_of(std::mem::align_of::<T>())
        || !bytes.len().is_multiple_of(size)
    {
        return None;
    }
    Some(Data::Mapped { map: Arc::clone(map), offset: at - base, len: bytes.len() / size })
}

/// The weight files of a model directory, memory-mapped, by file name.
pub(crate) type Files = Vec<(String, Arc<Mmap>)>;

/// Map the weight files of `dir`: the shards `model.safetensors.index.json` names (its
/// `weight_map`: tensor name -> shard file beside the index), else `model.safetensors`. Both at once
/// is refused (which one is meant is ambiguous). Errors name the file.
pub(crate) fn open(dir: &Path) -> Result<Files, String> {
    let index = dir.join("model.safetensors.index.json");
    let names: Vec<String> = if index.exists() {
        if dir.join("model.safetensors").exists() {
            return Err(format!("{}: model.safetensors lies beside the index; remove one of them", index.display()));
        }
        let text = std::fs::read_to_string(&index).map_err(|e| format!("cannot read {}: {e}", index.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("cannot parse {}: {e}", index.display()))?;
        let map = v["weight_map"].as_object().ok_or_else(|| format!("{}: no weight_map object", index.display()))?;
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let file = file.as_str().unwrap_or_default();
            if file.is_empty() || file.contains(['/', '\\']) || file.starts_with('.') {
                return Err(format!(
                    "{}: tensor {tensor} maps to {file:?}, not a file beside the index",
                    index.display()
                ));
            }
            files.insert(file.to_string());
        }
        files.into_iter().collect()
    } else {
        vec!["model.safetensors".to_string()]
    };
    names
        .into_iter()
        .map(|name| {
            let path = dir.join(&name);
            let file = std::fs::File::open(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            // SAFETY: the checkpoint is opened read-only and is not expected to change while the
            // model is alive; the mapping is kept alive by every tensor that views it.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| format!("cannot map {}: {e}", path.display()))?;
            Ok((name, Arc::new(map)))
        })
        .collect()
}

/// The tensors of every weight file, parsed, with the file each lies in. A tensor in two files is
/// an error.
pub(crate) struct Checkpoint<'a> {
    files: Vec<(&'a str, &'a Arc<Mmap>, SafeTensors<'a>)>,
    /// Tensor name -> index into `files`.
    at: HashMap<String, usize>,
}

impl<'a> Checkpoint<'a> {
    /// Parse the headers of `files` (see [`open`]).
    pub(crate) fn parse(files: &'a Files) -> Result<Checkpoint<'a>, String> {
        let mut parsed = Vec::new();
        let mut at = HashMap::new();
        for (i, (name, map)) in files.iter().enumerate() {
            let st = SafeTensors::deserialize(&map[..]).map_err(|e| format!("cannot parse {name}: {e}"))?;
            for t in st.names() {
                if let Some(j) = at.insert(t.to_string(), i) {
                    return Err(format!("tensor {t} is stored in both {} and {name}", files[j].0));
                }
            }
            parsed.push((name.as_str(), map, st));
        }
        Ok(Checkpoint { files: parsed, at })
    }

    /// Whether some file holds `name`.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.at.contains_key(name)
    }

    /// The tensor `name` (checked to have `shape`) and the mapping of its file.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<(&'a Arc<Mmap>, TensorView<'_>), String> {
        let Some(&i) = self.at.get(name) else {
            let files: Vec<&str> = self.files.iter().map(|f| f.0).collect();
            return Err(format!("{}: missing tensor {name}", files.join(", ")));
        };
        let (file, map, st) = &self.files[i];
        let view = st.tensor(name).map_err(|e| format!("{file}: tensor {name}: {e}"))?;
        if view.shape() != shape {
            return Err(format!("{file}: tensor {name} has shape {:?}, expected {:?}", view.shape(), shape));
        }
        match view.dtype() {
            Dtype::F32 | Dtype::BF16 | Dtype::F16 => Ok((map, view)),
            other => Err(format!("{file}: tensor {name} has unsupported dtype {other:?} (F32, BF16 or F16 expected)")),
        }
    }

    /// The f32 vector `name` of length `len`.
    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, String> {
        Ok(to_f32(&self.tensor(name, &[len])?.1))
    }

    /// The 2-D tensor `name` of shape [rows, cols] in this build's format (see [`Matrix`]).
    pub(crate) fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, String> {
        let (map, view) = self.tensor(name, &[rows, cols])?;
        let (data, scales) = convert(map, &view, cols);
        Ok(Matrix { rows, cols, data, scales })
    }
}

/// Raw 16-bit values of a BF16 or F16 tensor.
fn u16s(view: &TensorView) -> impl Iterator<Item = u16> {
    view.data().chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]))
}

/// Every value of a F32, BF16 or F16 tensor widened to f32.
pub(crate) fn to_f32(view: &TensorView) -> Vec<f32> {
    match view.dtype() {
        Dtype::F32 => view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::BF16 => u16s(view).map(quant::bf16_to_f32).collect(),
        _ => u16s(view).map(quant::f16_to_f32).collect(),
    }
}

/// Stored element of a weight matrix in this build.
#[cfg(not(any(feature = "bf16", feature = "f16", feature = "int8")))]
pub(crate) type Elem = f32;
/// Stored element of a weight matrix in this build (bf16 bit patterns).
#[cfg(feature = "bf16")]
pub(crate) type Elem = u16;
/// Stored element of a weight matrix in this build (IEEE binary16 bit patterns).
#[cfg(feature = "f16")]
pub(crate) type Elem = u16;
/// Stored element of a weight matrix in this build (symmetric int8, one scale per row).
#[cfg(feature = "int8")]
pub(crate) type Elem = i8;

/// The kernel format of [`Elem`].
#[cfg(not(any(feature = "bf16", feature = "f16", feature = "int8")))]
type Format = matmul::F32;
/// The kernel format of [`Elem`].
#[cfg(feature = "bf16")]
type Format = matmul::Bf16;
/// The kernel format of [`Elem`].
#[cfg(feature = "f16")]
type Format = matmul::F16;
/// The kernel format of [`Elem`].
#[cfg(feature = "int8")]
type Format = matmul::I8;

/// A weight matrix [rows, cols] (PyTorch nn.Linear layout [out_features, in_features]).
pub(crate) struct Matrix {
    rows: usize,
    cols: usize,
    data: Data<Elem>,
    /// Per-row dequantisation scales [rows] (int8 builds only; empty otherwise).
    scales: Vec<f32>,
}

impl Matrix {
    /// out = x W^T. `x`: [m, cols]; `out`: [m, rows].
    pub(crate) fn linear(&self, x: &[f32], m: usize, out: &mut [f32]) {
        Matrix::linear_many(x, m, [self], [out]);
    }

    /// out_j = x W_j^T for matrices with the same number of columns, in one parallel pass.
    /// `x`: [m, cols]; `outs[j]`: [m, mats[j].rows].
    pub(crate) fn linear_many<const N: usize>(x: &[f32], m: usize, mats: [&Matrix; N], outs: [&mut [f32]; N]) {
        let k = mats.first().map_or(0, |w| w.cols);
        let mut outs = outs.into_iter();
        let mut parts: [matmul::Part<Format>; N] = std::array::from_fn(|j| {
            let w = mats[j];
            assert_eq!(w.cols, k, "linear_many: matrices differ in columns");
            let out = outs.next().expect("one output per matrix");
            assert_eq!(out.len(), m * w.rows, "linear: out must be [m, rows]");
            matmul::Part { w: &w.data, scales: &w.scales, out }
        });
        matmul::linear_group(matmul::detected(), x, m, k, &mut parts);
    }

    /// Row `r` widened (and dequantised) to f32. `out`: [cols].
    pub(crate) fn row_into(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} out of range ({} rows)", self.rows);
        let row = &self.data[r * self.cols..(r + 1) * self.cols];
        #[cfg(not(any(feature = "bf16", feature = "f16", feature = "int8")))]
        out.copy_from_slice(row);
        #[cfg(feature = "bf16")]
        for (o, &b) in out.iter_mut().zip(row) {
            *o = quant::bf16_to_f32(b);
        }
        #[cfg(feature = "f16")]
        for (o, &b) in out.iter_mut().zip(row) {
            *o = quant::f16_to_f32(b);
        }
        #[cfg(feature = "int8")]
        {
            let scale = self.scales[r];
            for (o, &q) in out.iter_mut().zip(row) {
                *o = q as f32 * scale;
            }
        }
    }
}

#[cfg(not(any(feature = "bf16", feature = "f16", feature = "int8")))]
fn convert(map: &Arc<Mmap>, view: &TensorView, _cols: usize) -> (Data<f32>, Vec<f32>) {
    let data = match view.dtype() {
        Dtype::F32 => mapped(map, view),
        _ => None,
    };
    (data.unwrap_or_else(|| Data::Owned(to_f32(view))), Vec::new())
}

#[cfg(feature = "bf16")]
fn convert(map: &Arc<Mmap>, view: &TensorView, _cols: usize) -> (Data<u16>, Vec<f32>) {
    let data = match view.dtype() {
        Dtype::BF16 => mapped(map, view).unwrap_or_else(|| Data::Owned(u16s(view).collect())),
        _ => Data::Owned(to_f32(view).into_iter().map(quant::f32_to_bf16).collect()),
    };
    (data, Vec::new())
}

#[cfg(feature = "f16")]
fn convert(map: &Arc<Mmap>, view: &TensorView, _cols: usize) -> (Data<u16>, Vec<f32>) {
    let data = match view.dtype() {
        Dtype::F16 => mapped(map, view).unwrap_or_else(|| Data::Owned(u16s(view).collect())),
        _ => Data::Owned(to_f32(view).into_iter().map(quant::f32_to_f16).collect()),
    };
    (data, Vec::new())
}

#[cfg(feature = "int8")]
fn convert(_map: &Arc<Mmap>, view: &TensorView, cols: usize) -> (Data<i8>, Vec<f32>) {
    let (q, scales) = quant::quantize_int8(&to_f32(view), cols);
    (Data::Owned(q), scales)
}
