//! Weight files of a Hugging Face checkpoint: one `model.safetensors`, or shards
//! `model-0000N-of-0000M.safetensors` named by `model.safetensors.index.json`
//! (`{"metadata": {"total_size": N}, "weight_map": {tensor: file}}`). The layout is read from the
//! headers alone ([`weight_layout`]); values are read tensor by tensor and widened exactly to f32
//! ([`read_weights`]), so no file is held in memory whole. Every disagreement between the index and
//! the files is an error naming the file and the tensor.
//!
//! Sources: the safetensors format (header length, JSON header, data_offsets), the HF sharded
//! checkpoint convention (transformers' `SAFE_WEIGHTS_INDEX_NAME`, the index's `weight_map`).

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Files, Tensors};
use base::error::{Context, Error, Result};

/// The single-file weights of a checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where one tensor lives and how it is stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TensorEntry {
    /// The file holding it (a name inside the model directory).
    pub file: String,
    /// Stored dtype as safetensors names it: `F32`, `BF16`, `F16`, ...
    pub dtype: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Byte range of its data inside the file (absolute: header included).
    #[serde(skip)]
    pub bytes: (u64, u64),
}

/// The weights of a checkpoint as its headers describe them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WeightLayout {
    /// Whether the weights are sharded through `model.safetensors.index.json`.
    pub sharded: bool,
    /// The weight files, in the order of their names.
    pub files: Vec<String>,
    /// Every tensor by name.
    pub tensors: BTreeMap<String, TensorEntry>,
}

impl WeightLayout {
    /// Tensors per stored dtype, e.g. `{"BF16": 146, "F32": 0}`.
    pub fn dtype_counts(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for t in self.tensors.values() {
            *out.entry(t.dtype.clone()).or_insert(0) += 1;
        }
        out
    }

    /// Bytes of tensor data over all files.
    pub fn data_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.bytes.1 - t.bytes.0).sum()
    }
}

/// Whether `dir` holds weight files at all (a single file or an index).
pub fn has_weights(dir: &(impl Files + ?Sized)) -> bool {
    dir.has(SINGLE_FILE) || dir.has(INDEX_FILE)
}

/// The layout of `dir`'s weights, from the safetensors headers (and the index when sharded).
///
/// # Errors
/// [`base::error::ErrorKind::Input`] naming the file (and tensor) when: neither weight file exists;
/// both `model.safetensors` and an index exist (ambiguous: HF would load the single file and ignore
/// the index); the index is not valid JSON, names a tensor twice, or names a shard that is missing
/// or outside the directory; a shard lacks a tensor the index maps to it, or holds one the index
/// does not map to it; a header is truncated or inconsistent with the file size.
pub fn weight_layout(dir: &(impl Files + ?Sized)) -> Result<WeightLayout> {
    match (dir.has(SINGLE_FILE), dir.has(INDEX_FILE)) {
        (true, true) => Err(Error::input(format!(
            "{}: both {SINGLE_FILE} and {INDEX_FILE} are present, so the checkpoint is ambiguous (HF transformers would load {SINGLE_FILE} and ignore the shards); remove whichever is stale",
            dir.path().display()
        ))),
        (false, false) => Err(Error::input(format!(
            "{}: no weights: neither {SINGLE_FILE} nor {INDEX_FILE} (sharded) is there; PyTorch .bin checkpoints are not read, convert them to safetensors",
            dir.path().display()
        ))),
        (true, false) => {
            let tensors = read_header(dir, SINGLE_FILE)?;
            Ok(WeightLayout { sharded: false, files: vec![SINGLE_FILE.into()], tensors })
        }
        (false, true) => sharded_layout(dir),
    }
}

/// The index's `weight_map` as (tensor, file) pairs in file order, keeping duplicate keys (a JSON
/// object may repeat a key; serde_json's map would keep only the last).
#[derive(Default)]
struct Pairs(Vec<(String, String)>);

impl<'de> Deserialize<'de> for Pairs {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Pairs, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Pairs;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object mapping tensor names to shard file names")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> std::result::Result<Pairs, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = m.next_entry::<String, String>()? {
                    out.push((k, v));
                }
                Ok(Pairs(out))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
struct Index {
    weight_map: Pairs,
}

fn sharded_layout(dir: &(impl Files + ?Sized)) -> Result<WeightLayout> {
    let name = INDEX_FILE;
    let index = dir.show(INDEX_FILE);
    let text = dir.read_text(INDEX_FILE, &base::util::SHARD_INDEX)?;
    let parsed: Index = serde_json::from_str(&text).map_err(|e| {
        Error::input(format!(
            "{}: not a valid index ({e}); it must be {{\"metadata\": {{...}}, \"weight_map\": {{tensor: file}}}}",
            index.display()
        ))
    })?;
    let mut by_tensor: BTreeMap<String, String> = BTreeMap::new();
    for (tensor, file) in parsed.weight_map.0 {
        let plain = Path::new(&file).file_name().is_some_and(|f| f == std::ffi::OsStr::new(&file));
        if !plain || file == ".." || file == "." {
            return Err(Error::input(format!(
                "{}: `{tensor}` maps to {file:?}, which is not a file name inside the model directory; shards must lie beside the index",
                index.display()
            )));
        }
        if let Some(first) = by_tensor.get(&tensor) {
            return Err(Error::input(format!(
                "{}: names tensor `{tensor}` twice ({first} and {file}); a tensor lives in exactly one shard: remove the wrong entry",
                index.display()
            )));
        }
        by_tensor.insert(tensor, file);
    }
    if by_tensor.is_empty() {
        return Err(Error::input(format!(
            "{}: weight_map is empty; it must name every tensor's shard",
            index.display()
        )));
    }
    let mut files: Vec<String> = by_tensor.values().cloned().collect();
    files.sort();
    files.dedup();
    let mut tensors = BTreeMap::new();
    for file in &files {
        let path = dir.show(file);
        if !dir.has_file(file) {
            let named: Vec<&str> = by_tensor.iter().filter(|(_, f)| *f == file).map(|(t, _)| t.as_str()).collect();
            return Err(Error::input(format!(
                "{}: missing shard {file}, which {name} names for {} tensor(s) (e.g. `{}`); download it or fix the index",
                dir.path().display(),
                named.len(),
                named[0]
            )));
        }
        for (tensor, entry) in read_header(dir, file)? {
            match by_tensor.get(&tensor) {
                Some(f) if f == file => {}
                Some(f) => {
                    return Err(Error::input(format!(
                        "{}: holds tensor `{tensor}`, which {name} maps to {f}; a tensor lives in exactly one shard: fix the index or re-shard",
                        path.display()
                    )));
                }
                None => {
                    return Err(Error::input(format!(
                        "{}: holds tensor `{tensor}`, which {name} does not name; the index and the shards disagree: regenerate the index",
                        path.display()
                    )));
                }
            }
            tensors.insert(tensor, entry);
        }
    }
    if let Some((tensor, file)) = by_tensor.iter().find(|(t, _)| !tensors.contains_key(*t)) {
        return Err(Error::input(format!(
            "{}: {name} maps tensor `{tensor}` to {file}, which does not hold it; the index and the shards disagree: regenerate the index",
            dir.path().display()
        )));
    }
    Ok(WeightLayout { sharded: true, files, tensors })
}

/// Parse one file's safetensors header without reading its data.
fn read_header(dir: &(impl Files + ?Sized), name: &str) -> Result<BTreeMap<String, TensorEntry>> {
    let path = dir.show(name);
    let corrupt = |why: String| {
        Error::input(format!("{}: not a valid safetensors file ({why}); is it truncated or corrupt?", path.display()))
    };
    let file = dir.open(name, &base::util::SAFETENSORS_FILE)?;
    let len = file.metadata().ctx(|| path.display().to_string())?.len();
    let mut n = [0u8; 8];
    file.read_exact_at(&mut n, 0).map_err(|_| corrupt("shorter than its 8-byte header length".into()))?;
    let n = u64::from_le_bytes(n);
    // The safetensors reference implementation's limit on the header.
    if n > 100_000_000 || 8 + n > len {
        return Err(corrupt(format!("header length {n} does not fit in the file's {len} bytes")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact_at(&mut header, 8).map_err(|e| corrupt(e.to_string()))?;
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(&header).map_err(|e| corrupt(e.to_string()))?;
    let start = 8 + n;
    if start + meta.data_len() as u64 != len {
        return Err(corrupt(format!(
            "the header describes {} data bytes, the file holds {}",
            meta.data_len(),
            len - start
        )));
    }
    Ok(meta
        .tensors()
        .into_iter()
        .map(|(tensor, info)| {
            let (b, e) = info.data_offsets;
            let entry = TensorEntry {
                file: name.to_string(),
                dtype: format!("{:?}", info.dtype),
                shape: info.shape.clone(),
                bytes: (start + b as u64, start + e as u64),
            };
            (tensor, entry)
        })
        .collect())
}

/// Widen stored little-endian values to f32, exactly: F32 as is, BF16 into the upper half of an f32,
/// F16 by IEEE binary16 conversion (subnormals, infinities and NaN included).
///
/// # Errors
/// The dtype's name when it is not one of F32, BF16, F16.
pub fn widen_bytes(dtype: &str, data: &[u8]) -> std::result::Result<Vec<f32>, String> {
    Ok(match dtype {
        "F32" => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        "BF16" => {
            data.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect()
        }
        "F16" => data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        other => return Err(other.to_string()),
    })
}

/// Read every tensor of `dir` (single file or shards), widened exactly to f32, one tensor at a time.
///
/// # Errors
/// As [`weight_layout`]; a tensor stored in a dtype other than F32, BF16 or F16 (named).
pub fn read_weights(dir: &(impl Files + ?Sized)) -> Result<Tensors> {
    let layout = weight_layout(dir)?;
    read_layout(dir, &layout)
}

/// Read the tensors of an already inspected layout.
///
/// # Errors
/// As [`read_weights`].
pub fn read_layout(dir: &(impl Files + ?Sized), layout: &WeightLayout) -> Result<Tensors> {
    let mut out = Tensors::new();
    let mut open: Option<(String, std::fs::File)> = None;
    // File by file, in data order: each file is opened once and read front to back.
    let mut order: Vec<(&String, &TensorEntry)> = layout.tensors.iter().collect();
    order.sort_by(|a, b| (&a.1.file, a.1.bytes.0).cmp(&(&b.1.file, b.1.bytes.0)));
    for (name, t) in order {
        let path = dir.show(&t.file);
        if open.as_ref().is_none_or(|(f, _)| f != &t.file) {
            let f = dir.open(&t.file, &base::util::SAFETENSORS_FILE)?;
            open = Some((t.file.clone(), f));
        }
        let file = &open.as_ref().expect("opened above").1;
        let mut data = vec![0u8; (t.bytes.1 - t.bytes.0) as usize];
        file.read_exact_at(&mut data, t.bytes.0).map_err(|e| {
            Error::input(format!("{}: tensor `{name}` cannot be read ({e}); is the file truncated?", path.display()))
        })?;
        let values = widen_bytes(&t.dtype, &data).map_err(|other| {
            Error::input(format!("{}: tensor `{name}` has dtype {other}; supported: F32, BF16, F16", path.display()))
        })?;
        out.insert(name.clone(), (t.shape.clone(), values));
    }
    Ok(out)
}
