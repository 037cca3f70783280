//! Phase 2, weight loading (contract `component.weight_loading`): every tensor of a checkpoint as a
//! named f32 array, F32 copied and BF16 and F16 widened exactly. [`read`] is the one function that
//! knows the checkpoint's file layout (a single `model.safetensors`, or the shards listed by
//! `model.safetensors.index.json`); it reads and checks the headers only. The model takes its
//! tensors by name and shape with [`Tensors::take`], which reads that tensor's bytes then, so loading
//! holds one tensor's stored bytes beside what the model keeps (a GPU engine keeps nothing on the
//! host: a 16 GB checkpoint does not become 32 GB of f32 in host memory first).

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::Metadata;

/// Where a tensor's bytes lie: which weight file, from which byte, how many; stored dtype and shape.
struct Entry {
    file: usize,
    start: u64,
    len: usize,
    dtype: Dtype,
    shape: Vec<usize>,
}

/// The tensors of a checkpoint by name: its weight files, open, and where each tensor lies in them.
pub struct Tensors {
    files: Vec<(PathBuf, File)>,
    entries: HashMap<String, Entry>,
}

impl Tensors {
    /// Whether the checkpoint holds `name` (and it has not been taken).
    pub fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Remove tensor `name` and return its values as f32, row-major, checked to have `shape`; an
    /// error names a missing tensor, another shape, or the file that cannot be read.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, String> {
        let e = self
            .entries
            .remove(name)
            .ok_or_else(|| format!("missing tensor {name} in the checkpoint's weight files"))?;
        if e.shape != shape {
            return Err(format!("tensor {name} has shape {:?}, config.json implies {shape:?}", e.shape));
        }
        let (path, file) = &self.files[e.file];
        let mut bytes = vec![0u8; e.len];
        file.read_exact_at(&mut bytes, e.start)
            .map_err(|err| format!("{}: cannot read tensor {name} ({err})", path.display()))?;
        Ok(widen(e.dtype, &bytes).expect("read checked every tensor's dtype"))
    }
}

/// Open the checkpoint in `dir`: the shards `model.safetensors.index.json` names (its
/// `weight_map`: tensor name -> shard file beside the index), else `model.safetensors`; both at
/// once, a shard path outside the directory, a tensor stored twice, a header that does not describe
/// its file, or a dtype other than F32, BF16 or F16 is an error.
pub fn read(dir: &Path) -> Result<Tensors, String> {
    let index = dir.join("model.safetensors.index.json");
    let mut tensors = Tensors { files: Vec::new(), entries: HashMap::new() };
    if !index.exists() {
        read_header(&dir.join("model.safetensors"), &mut tensors)?;
        return Ok(tensors);
    }
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
            return Err(format!("{}: tensor {tensor} maps to {file:?}, not a file beside the index", index.display()));
        }
        files.insert(file);
    }
    for file in files {
        read_header(&dir.join(file), &mut tensors)?;
    }
    Ok(tensors)
}

/// Add the tensors of the safetensors file `path` to `tensors`, reading its header only. Layout
/// (component.weight_loading, math): an 8-byte little-endian header length N, N bytes of JSON header
/// (name -> dtype, shape, data_offsets), then the tensors' bytes back to back in offset order.
fn read_header(path: &Path, tensors: &mut Tensors) -> Result<(), String> {
    let fail = |what: String| format!("{}: {what}", path.display());
    let mut file = File::open(path).map_err(|e| fail(format!("cannot open ({e})")))?;
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
    let index = tensors.files.len();
    for name in meta.offset_keys() {
        if tensors.entries.contains_key(&name) {
            return Err(fail(format!("tensor {name} is stored in another weight file too")));
        }
        let info = meta.info(&name).expect("offset_keys names tensors of the header");
        if !matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(fail(format!("tensor {name} has dtype {:?}; F32, BF16 or F16 expected", info.dtype)));
        }
        let (start, end) = info.data_offsets;
        let entry = Entry {
            file: index,
            start: 8 + n + start as u64,
            len: end - start,
            dtype: info.dtype,
            shape: info.shape.clone(),
        };
        tensors.entries.insert(name, entry);
    }
    tensors.files.push((path.to_path_buf(), file));
    Ok(())
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
