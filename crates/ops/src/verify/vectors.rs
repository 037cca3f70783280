//! The tokenizer vectors: the real vocabularies of a tokenizer contract, the harness command
//! `tokenize` over them, and the judgement of the engine's tokenizer on their test vectors.

use std::path::Path;

use super::VectorResult;
use crate::Ctx;
use crate::gate::Gate;
use base::error::Result;
use harness::protocol::{Command, Reply, TokenizeSet};

/// The real vocabularies that route to tokenizer `contract`: those of
/// `model::tokenizer::vectors_dir` (`$METAINFER_TOKENIZERS` or `../shared/tokenizers`), then the
/// ones shipped with the binary that were not found there (written into the cache); and each known
/// vocabulary of that contract found in neither, with why it was not checked.
pub(super) fn vocabulary_sets(ctx: &Ctx, contract: &str) -> (Vec<model::tokenizer::VectorSet>, Vec<String>) {
    vocabulary_sets_in(ctx, contract, &model::tokenizer::vectors_dir())
}

/// As [`vocabulary_sets`], with the vectors directory `dir`.
pub fn vocabulary_sets_in(ctx: &Ctx, contract: &str, dir: &Path) -> (Vec<model::tokenizer::VectorSet>, Vec<String>) {
    let mut sets = model::tokenizer::vector_sets(&ctx.ckb, dir);
    match model::embedded::write_shipped_vectors(&ctx.workshop.root) {
        Ok(shipped) => {
            for d in shipped {
                let name = d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                if !sets.iter().any(|s| s.name == name)
                    && let Ok(s) = model::tokenizer::read_vector_set(&ctx.ckb, &d)
                {
                    sets.push(s);
                }
            }
        }
        Err(e) => tracing::warn!("the shipped tokenizer vectors could not be written: {e}"),
    }
    sets.retain(|s| s.contract == contract);
    sets.sort_by(|a, b| a.name.cmp(&b.name));
    let skipped = model::embedded::VOCABULARIES
        .iter()
        .filter(|v| v.contract == contract && !sets.iter().any(|s| s.name == v.name))
        .map(|v| {
            format!(
                "tokenizer vectors {} ({}): not found in {} ($METAINFER_TOKENIZERS) and not shipped with the binary ({}{})",
                v.name,
                v.contract,
                dir.display(),
                v.licence,
                if v.shipped { "; writing the shipped copy failed" } else { "" }
            )
        })
        .collect();
    (sets, skipped)
}

/// The harness command `tokenize` over `sets`, None when there are none. Run here, it names the
/// vocabularies' own folders; in a bundle, each vocabulary's tokenizer.json is copied into the
/// bundle as `vocab.<i>/tokenizer.json` (an altered copy can only fail: the replies are judged
/// against the server's own files), so the bundle runs on a machine without them.
///
/// # Errors
/// Internal when a copy cannot be written.
pub(super) fn tokenize_command(
    gate: &Gate<'_>,
    h: &crate::gate::Harness,
    sets: &[model::tokenizer::VectorSet],
) -> Result<Option<Command>> {
    if sets.is_empty() {
        return Ok(None);
    }
    let mut request = Vec::new();
    for (i, s) in sets.iter().enumerate() {
        let dir = match &gate.mode {
            crate::gate::Mode::Direct => s.dir.clone(),
            crate::gate::Mode::Write(_) => {
                let to = h.create_dir(&format!("vocab.{i}"))?;
                let bytes = base::util::read_regular(&s.dir.join("tokenizer.json"), &base::util::TOKENIZER_JSON)?;
                h.write_new(&format!("vocab.{i}/tokenizer.json"), &bytes)?;
                to
            }
            crate::gate::Mode::Read(_) => h.path(&format!("vocab.{i}")),
        };
        request.push(TokenizeSet {
            dir,
            texts: s.cases.iter().map(|c| c.0.clone()).collect(),
            decode: s.cases.iter().map(|c| c.1.clone()).collect(),
        });
    }
    Ok(Some(Command::Tokenize { sets: request }))
}

/// Judge the engine's tokenizer (harness command `tokenize`) on every real vocabulary in `sets`:
/// encode each test text and compare with HF's ids with add_special_tokens = true, which are the
/// vector's ids wrapped in the template's special tokens (checked here, so the reference itself is
/// held to the vectors); decode each vector's ids and compare with HF's decoding with
/// skip_special_tokens = true. `called` is the harness's answer, None when it never ran.
///
/// # Errors
/// When a vocabulary's tokenizer.json cannot be loaded by HF.
pub(super) fn judge_vectors(
    sets: &[model::tokenizer::VectorSet],
    called: Option<harness::Called>,
) -> Result<Vec<VectorResult>> {
    if sets.is_empty() {
        return Ok(vec![]);
    }
    let failed = |why: String| -> Vec<VectorResult> {
        sets.iter()
            .map(|s| VectorResult {
                vocabulary: s.name.clone(),
                texts: s.cases.len(),
                encode_ok: 0,
                decode_ok: 0,
                error: why.clone(),
            })
            .collect()
    };
    let Some(called) = called else { return Ok(failed("the engine's tokenizer did not run".into())) };
    let replies = match called.ok("engine's tokenizer", 1000) {
        Ok(Reply::Tokenize { sets: r }) if r.len() == sets.len() => r,
        Ok(other) => return Ok(failed(format!("the harness answered tokenize with an unexpected reply: {other:?}"))),
        Err(why) => return Ok(failed(why)),
    };
    let mut results = Vec::new();
    for (set, reply) in sets.iter().zip(replies) {
        let tok = model::hf_tokenizer(&set.dir)?;
        let mut r = VectorResult {
            vocabulary: set.name.clone(),
            texts: set.cases.len(),
            encode_ok: 0,
            decode_ok: 0,
            error: String::new(),
        };
        if let Some(e) = reply.error {
            r.error = format!("Tokenizer::load on {}: {e}", set.dir.display());
            results.push(r);
            continue;
        }
        let mut first = Vec::new();
        for (i, (text, vector)) in set.cases.iter().enumerate() {
            let plain = model::hf_encode_plain(&tok, text)?;
            if &plain != vector {
                first.push(format!("the reference gives {plain:?} for {text:?}, the vector {vector:?} (server fault)"));
                continue;
            }
            let want = model::hf_encode(&tok, text)?;
            match reply.encoded.get(i) {
                Some(e) if e.panic.is_none() && e.ids == want => r.encode_ok += 1,
                Some(e) if e.panic.is_none() => {
                    first.push(format!("encode {text:?}: engine {:?}, reference {want:?}", e.ids))
                }
                Some(e) => first.push(format!("encode {text:?} panicked: {}", e.panic.clone().unwrap_or_default())),
                None => first.push(format!("encode {text:?}: no output")),
            }
            let want_text = model::hf_decode(&tok, vector)?;
            match reply.decoded.get(i) {
                Some(d) if d.panic.is_none() && d.text == want_text => r.decode_ok += 1,
                Some(d) if d.panic.is_none() => {
                    first.push(format!("decode {vector:?}: engine {:?}, reference {want_text:?}", d.text))
                }
                Some(d) => first.push(format!("decode {vector:?} panicked: {}", d.panic.clone().unwrap_or_default())),
                None => first.push(format!("decode {vector:?}: no output")),
            }
        }
        if let Some(f) = first.first() {
            r.error = format!(
                "{f}{}",
                if first.len() > 1 { format!(" (and {} more)", first.len() - 1) } else { String::new() }
            );
        }
        results.push(r);
    }
    Ok(results)
}
