//! Phase 2, weight loading (contract `component.weight_loading`): every tensor of a checkpoint as a
//! named f32 array, F32 copied and BF16 and F16 widened exactly. [`read`] is the one function that
//! knows the checkpoint's file layout (today a single `model.safetensors`); another layout, such as
//! shards listed by an index, is added there and nothing else changes. The model takes its tensors
//! by name and shape with [`Tensors::take`].

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use safetensors::Dtype;
use safetensors::tensor::Metadata;

/// A tensor widened to f32: row-major `data` of `shape`.
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// The tensors of a checkpoint by name.
pub struct Tensors(HashMap<String, Tensor>);

impl Tensors {
    /// Whether the checkpoint holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    /// Remove tensor `name` and return its values, checked to have `shape`.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, String> {
        let t = self.0.remove(name).ok_or_else(|| format!("model.safetensors: missing tensor {name}"))?;
        if t.shape != shape {
            return Err(format!(
                "model.safetensors: tensor {name} has shape {:?}, config.json implies {shape:?}",
                t.shape
            ));
        }
        Ok(t.data)
    }
}

/// Read every tensor of `dir/model.safetensors`, one at a time (memory: the f32 tensors plus one
/// tensor's stored bytes). Layout (component.weight_loading, math): an 8-byte little-endian header
/// length N, N bytes of JSON header (name -> dtype, shape, data_offsets), then the tensors' bytes
/// back to back in offset order.
pub fn read(dir: &Path) -> Result<Tensors, String> {
    let path = dir.join("model.safetensors");
    let fail = |what: String| format!("{}: {what}", path.display());
    let mut file = File::open(&path).map_err(|e| fail(format!("cannot open ({e})")))?;
    let file_len = file.metadata().map_err(|e| fail(e.to_string()))?.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n).map_err(|_| fail("shorter than its 8-byte header length".into()))?;
    let n = u64::from_le_bytes(n);
    if n > file_len - 8 || n > 100_000_000 {
        return Err(fail(format!("header length {n} does not fit the file ({file_len} bytes)")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(|e| fail(format!("cannot read the header ({e})")))?;
    // Deserialising checks that the tensors lie back to back and match their shapes and dtypes.
    let meta: Metadata = serde_json::from_slice(&header).map_err(|e| fail(format!("invalid header ({e})")))?;
    if 8 + n + meta.data_len() as u64 != file_len {
        return Err(fail(format!(
            "the header describes {} data bytes, the file holds {}",
            meta.data_len(),
            file_len - 8 - n
        )));
    }
    let mut tensors = HashMap::new();
    for name in meta.offset_keys() {
        let info = meta.info(&name).expect("offset_keys names tensors of the header");
        let mut bytes = vec![0u8; info.data_offsets.1 - info.data_offsets.0];
        file.read_exact(&mut bytes).map_err(|e| fail(format!("cannot read tensor {name} ({e})")))?;
        let data = widen(info.dtype, &bytes)
            .ok_or_else(|| fail(format!("tensor {name} has dtype {:?}; F32, BF16 or F16 expected", info.dtype)))?;
        tensors.insert(name, Tensor { shape: info.shape.clone(), data });
    }
    Ok(Tensors(tensors))
}

/// Little-endian stored values as f32: F32 as is, BF16 as the high half of an f32, F16 as IEEE
/// binary16; `None` for any other dtype.
fn widen(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let halves = || bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    Some(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::BF16 => halves().map(|h| f32::from_bits((h as u32) << 16)).collect(),
        Dtype::F16 => halves().map(f16_to_f32).collect(),
        _ => return None,
    })
}

/// IEEE 754 binary16 bits as f32, exactly: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits;
/// exponent 0 is subnormal (mantissa * 2^-24), exponent 31 is infinity or NaN.
fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let mantissa = (h & 0x3ff) as f32;
    sign * match (h >> 10) & 0x1f {
        0 => mantissa * 2f32.powi(-24),
        31 if mantissa == 0.0 => f32::INFINITY,
        31 => f32::NAN,
        e => (1.0 + mantissa / 1024.0) * 2f32.powi(e as i32 - 15),
    }
}
