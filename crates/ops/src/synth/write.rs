//! Checkpoint writing: config.json, generation_config.json, tokenizer.json and the weights (one
//! safetensors file or shards with an index), drawn and written tensor by tensor, renamed into place.

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use serde_json::json;

use super::tensors::{PlannedTensor, tensor_plan};
use super::tokenizer::{bytelevel_style, synth_bytelevel_tokenizer, synth_tokenizer};
use super::{MAX_BYTES, Storage, SynthReport, builtin_features};
use base::error::{Context, Error, Result};

/// Write `config` (possibly edited after [`synth_config`]), its tensors and a tokenizer into `out`,
/// atomically: everything goes to a temporary directory beside `out`, which is then renamed.
///
/// # Errors
/// When `out` exists and is not an empty directory, or a file cannot be written.
pub fn write_checkpoint(out: &Path, config: &serde_json::Value, seed: u64) -> Result<SynthReport> {
    let features = builtin_features(config["model_type"].as_str().unwrap_or("llama"));
    write_checkpoint_with(out, config, &features, seed)
}

/// As [`write_checkpoint`], with the tensors of a family with these `features` ([`synth_tensors_with`]).
///
/// # Errors
/// As [`write_checkpoint`].
pub fn write_checkpoint_with(
    out: &Path,
    config: &serde_json::Value,
    features: &[String],
    seed: u64,
) -> Result<SynthReport> {
    write_checkpoint_opts(out, config, features, seed, &Storage::default())
}

/// As [`write_checkpoint_with`], stored as `storage` says: weights rounded to its dtype (nearest even)
/// in one file or `shards` files with an index, its tokenizer kind, and generation_config.json (the
/// config's bos and eos ids; the qwen families stop at `<|im_end|>` and `<|endoftext|>`). Tensors are
/// drawn and written one at a time, so memory holds one tensor however large the model.
///
/// # Errors
/// As [`write_checkpoint`]; more shards than tensors.
pub fn write_checkpoint_opts(
    out: &Path,
    config: &serde_json::Value,
    features: &[String],
    seed: u64,
    storage: &Storage,
) -> Result<SynthReport> {
    write_planned(out, config, tensor_plan(config, features), seed, storage)
}

/// Write the checkpoint of `plan` (see [`write_checkpoint_opts`]).
pub(super) fn write_planned(
    out: &Path,
    config: &serde_json::Value,
    plan: Vec<PlannedTensor>,
    seed: u64,
    storage: &Storage,
) -> Result<SynthReport> {
    if out.exists() {
        let empty = out.is_dir() && std::fs::read_dir(out).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !empty {
            return Err(Error::usage(format!(
                "{} exists and is not an empty directory; pass a new --out",
                out.display()
            )));
        }
    }
    let params: usize = plan.iter().map(PlannedTensor::len).sum();
    if params.saturating_mul(storage.bytes_per_weight()) > MAX_BYTES {
        return Err(Error::usage(format!(
            "the checkpoint would hold {params} parameters, {:.2} GB of weights at {} bytes each, more than synth writes ({} GB); \
             choose smaller sizes (--hidden, --layers, --intermediate, --vocab, and for a mixture of experts --experts or --expert-intermediate) or --dtype bf16",
            (params * storage.bytes_per_weight()) as f64 / 1e9,
            storage.bytes_per_weight(),
            MAX_BYTES / 1_000_000_000
        )));
    }
    if storage.shards > plan.len() {
        return Err(Error::usage(format!(
            "--shards {} exceeds the checkpoint's {} tensors; every shard holds at least one",
            storage.shards,
            plan.len()
        )));
    }
    let vocab = config["vocab_size"].as_u64().unwrap_or(0) as usize;
    let model_type = config["model_type"].as_str().unwrap_or("llama");
    // The tokenizer first: training a large byte-level vocabulary is the other slow part, and a
    // failure should come before gigabytes are written.
    let tokenizer = match storage.tokenizer.as_str() {
        "bytelevel" => synth_bytelevel_tokenizer(vocab, bytelevel_style(model_type), seed)?,
        _ => synth_tokenizer(vocab),
    };
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).ctx(|| format!("cannot create {}", parent.display()))?;
    let io = |what: &Path, e: std::io::Error| Error::input(format!("cannot write {}: {e}", what.display()));
    // The parent resolved once: every later step goes through its handle (`/proc/self/fd/N`), so a
    // directory swapped for a symlink meanwhile cannot redirect the checkpoint.
    let held = base::beneath::Dir::open(&parent)?;
    let name = out.file_name().ok_or_else(|| Error::usage(format!("{}: not a directory name", out.display())))?;
    let (parent, out_at) = (held.fd_path(), held.fd_path().join(name));
    let tmp = tempfile::Builder::new().prefix(".synth-").tempdir_in(&parent).map_err(|e| io(&parent, e))?;
    let mut config = config.clone();
    config["torch_dtype"] = json!(storage.torch_dtype());
    let cfg_text = serde_json::to_string_pretty(&config).expect("json serialises");
    std::fs::write(tmp.path().join("config.json"), cfg_text).map_err(|e| io(out, e))?;
    let mut generation = serde_json::Map::new();
    generation.insert("bos_token_id".into(), config["bos_token_id"].clone());
    let eos = match (model_type, storage.tokenizer.as_str(), config["eos_token_id"].as_u64()) {
        // Qwen's generation_config.json lists <|im_end|> and <|endoftext|>.
        ("qwen2" | "qwen3", "bytelevel", Some(e)) => json!([e, e.saturating_sub(2)]),
        _ => config["eos_token_id"].clone(),
    };
    generation.insert("eos_token_id".into(), eos);
    std::fs::write(
        tmp.path().join("generation_config.json"),
        serde_json::to_string_pretty(&generation).expect("json serialises"),
    )
    .map_err(|e| io(out, e))?;
    let tok = serde_json::to_string_pretty(&tokenizer).expect("json serialises");
    std::fs::write(tmp.path().join("tokenizer.json"), tok).map_err(|e| io(out, e))?;
    let parameters = write_weights(tmp.path(), &plan, seed, storage)?;
    if std::fs::symlink_metadata(&out_at).is_ok() {
        std::fs::remove_dir(&out_at).map_err(|e| io(out, e))?;
    }
    let kept = tmp.keep();
    std::fs::rename(&kept, &out_at).map_err(|e| {
        let _ = std::fs::remove_dir_all(&kept);
        io(out, e)
    })?;
    Ok(SynthReport {
        dir: out.display().to_string(),
        family: config["model_type"].as_str().unwrap_or_default().into(),
        config,
        tensors: plan.len(),
        parameters,
    })
}

/// The stored bytes of f32 values at `dtype`: F32 as is, BF16 and F16 rounded to nearest even.
fn stored_bytes(values: &[f32], dtype: &str) -> Vec<u8> {
    match dtype {
        "bf16" => values.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
        "f16" => values.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Write the planned tensors into `dir`: model.safetensors, or `storage.shards` files
/// `model-0000i-of-0000N.safetensors` of about equal size (tensors in draw order, never split) plus
/// model.safetensors.index.json. Each file's header is written first (sizes are known from the
/// plan), then each tensor at its offset as it is drawn. Returns the parameter count.
fn write_weights(dir: &Path, plan: &[PlannedTensor], seed: u64, storage: &Storage) -> Result<usize> {
    use std::os::unix::fs::FileExt;
    let (dtype_name, width) = match storage.dtype.as_str() {
        "bf16" => ("BF16", 2),
        "f16" => ("F16", 2),
        _ => ("F32", 4),
    };
    let total: usize = plan.iter().map(|t| t.len() * width).sum();
    // Shard boundaries: a tensor goes to the shard where its first byte falls, tensors in order,
    // shards filled one after the other; late tensors move on early enough that no shard stays empty.
    let n = storage.shards;
    let mut groups: Vec<Vec<&PlannedTensor>> = vec![Vec::new(); n];
    let (mut shard, mut start) = (0usize, 0usize);
    for (i, t) in plan.iter().enumerate() {
        let must = n.saturating_sub(plan.len() - i);
        let want = (start * n / total.max(1)).min(n - 1).max(must);
        if want > shard && !groups[shard].is_empty() {
            shard += 1;
        }
        groups[shard].push(t);
        start += t.len() * width;
    }
    let names: Vec<String> = if n == 1 {
        vec![model::weights::SINGLE_FILE.to_string()]
    } else {
        (1..=n).map(|i| format!("model-{i:05}-of-{n:05}.safetensors")).collect()
    };
    let st_dtype = match dtype_name {
        "BF16" => safetensors::Dtype::BF16,
        "F16" => safetensors::Dtype::F16,
        _ => safetensors::Dtype::F32,
    };
    // Each file's header is what the safetensors writer makes of the same tensors (sorted by name,
    // offsets in that order, padded to 8 bytes), so a single F32 file is byte for byte what
    // `safetensors::serialize_to_file` writes; the data is then written at its offsets as drawn.
    let mut files = Vec::new();
    let mut weight_map = serde_json::Map::new();
    for (name, group) in names.iter().zip(&groups) {
        let path = dir.join(name);
        let mut sorted: Vec<&PlannedTensor> = group.clone();
        sorted.sort_by(|a, b| a.name.cmp(&b.name));
        let mut offset = 0usize;
        let mut infos = Vec::new();
        let mut at: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for t in &sorted {
            let bytes = t.len() * width;
            infos.push((
                t.name.clone(),
                safetensors::tensor::TensorInfo {
                    dtype: st_dtype,
                    shape: t.shape.clone(),
                    data_offsets: (offset, offset + bytes),
                },
            ));
            at.insert(t.name.as_str(), offset);
            offset += bytes;
            weight_map.insert(t.name.clone(), json!(name));
        }
        let meta =
            safetensors::tensor::Metadata::new(None, infos).internal_ctx(|| format!("{}: header", path.display()))?;
        let mut header = serde_json::to_vec(&meta).expect("a safetensors header serialises");
        header.resize(header.len().next_multiple_of(8), b' ');
        let io = |e: std::io::Error| Error::input(format!("cannot write {}: {e}", path.display()));
        let f = std::fs::File::create(&path).map_err(io)?;
        let data_start = 8 + header.len();
        f.set_len((data_start + offset) as u64).map_err(io)?;
        f.write_all_at(&(header.len() as u64).to_le_bytes(), 0).map_err(io)?;
        f.write_all_at(&header, 8).map_err(io)?;
        files.push((f, data_start, at));
    }
    // Draw in plan order (the order of the random stream), write where the header put each tensor.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut parameters = 0;
    for (group, (f, data_start, at)) in groups.iter().zip(&files) {
        for t in group {
            let values = t.draw(&mut rng);
            parameters += values.len();
            let off = (data_start + at[t.name.as_str()]) as u64;
            f.write_all_at(&stored_bytes(&values, &storage.dtype), off)
                .ctx(|| format!("cannot write {}", dir.display()))?;
        }
        f.sync_all().ctx(|| format!("cannot write {}", dir.display()))?;
    }
    if n > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = dir.join(model::weights::INDEX_FILE);
        std::fs::write(&path, serde_json::to_string_pretty(&index).expect("json serialises"))
            .ctx(|| format!("cannot write {}", path.display()))?;
    }
    Ok(parameters)
}
