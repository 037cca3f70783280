//! One model directory opened once for a gate: every gate (verify_generation, profile_engine,
//! verify_batching, serve_engine) and `bench` reads the checkpoint through [`Checkpoint`], so they
//! read config.json, generation_config.json, tokenizer.json and the weight index once each, through
//! the one held directory, and agree on what they read (the stop tokens above all).
//!
//! ```text
//! Checkpoint::open    confine the path; config.json -> family route -> resolved config -> the
//!                     family's preconditions; generation_config.json (stop tokens); weight index
//! .tokenizer()        tokenizer.json, parsed once
//! .tensors(dtype)     the weights, after the family's dtype policy, checked finite at `dtype`
//! ```

use std::cell::OnceCell;
use std::path::Path;

use serde_json::Value;

use super::Ctx;
use base::beneath::HeldDir;
use base::error::{Error, Result};
use ckb::{Ckb, Contract, ModelFamily};
use model::{self, GenerationConfig, ResolvedConfig, Tensors, WeightLayout};

/// A checkpoint directory, read once.
pub struct Checkpoint {
    /// The directory, held (every read is beneath it).
    pub held: HeldDir,
    /// config.json as written.
    pub config: serde_json::Map<String, Value>,
    /// config.json resolved against the family it routes to.
    pub cfg: ResolvedConfig,
    /// generation_config.json (else config.json): the stop tokens and BOS every gate uses.
    pub generation: GenerationConfig,
    /// The weight files' index: names, dtypes, shapes and byte ranges (no data read).
    pub layout: WeightLayout,
    /// tokenizer.json's bytes, read once on first use.
    tokenizer_bytes: OnceCell<Vec<u8>>,
    tokenizer: OnceCell<tokenizers::Tokenizer>,
}

impl Checkpoint {
    /// Confine `model` (a path the workspace and model roots allow) and read its config.json,
    /// generation config and weight index.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`]: outside the roots, not covered by the knowledge base
    /// (each gap named), a precondition of the family contradicted; Input: a file unreadable or
    /// malformed, naming it.
    pub fn open(ctx: &Ctx, model: &str) -> Result<Checkpoint> {
        let held = ctx.confine_model(Path::new(model))?;
        Checkpoint::read(&ctx.ckb, held)
    }

    /// [`Checkpoint::open`] on a directory already held.
    ///
    /// # Errors
    /// As [`Checkpoint::open`].
    pub fn read(ckb: &Ckb, held: HeldDir) -> Result<Checkpoint> {
        let config = model::read_config(&held)?;
        let cfg = model::resolve_config(ckb, &held, &config)?;
        super::preconditions::check(ckb, held.path(), &cfg, &config)?;
        let generation = model::generation_config_in(&held, Some(&config), cfg.vocab)?;
        let layout = model::weight_layout(&held)?;
        Ok(Checkpoint {
            held,
            config,
            cfg,
            generation,
            layout,
            tokenizer_bytes: OnceCell::new(),
            tokenizer: OnceCell::new(),
        })
    }

    /// The directory's path (for messages and harness requests).
    pub fn path(&self) -> &Path {
        self.held.path()
    }

    /// The family contract config.json routes to.
    ///
    /// # Errors
    /// Usage when the contract is gone from the CKB or is not a model family.
    pub fn family<'c>(&self, ckb: &'c Ckb) -> Result<(&'c Contract, &'c ModelFamily)> {
        let c = ckb.get(&self.cfg.family)?;
        let m = c.model.as_ref().ok_or_else(|| Error::usage(format!("`{}` is not a model family", c.id)))?;
        Ok((c, m))
    }

    /// tokenizer.json's bytes, read on first use (bounded as every tokenizer.json read is).
    ///
    /// # Errors
    /// Input naming the file when it is missing, not a regular file or too large.
    fn tokenizer_bytes(&self) -> Result<&[u8]> {
        if let Some(b) = self.tokenizer_bytes.get() {
            return Ok(b);
        }
        let b = base::beneath::Files::read(&self.held, "tokenizer.json", &base::util::TOKENIZER_JSON)?;
        Ok(self.tokenizer_bytes.get_or_init(|| b))
    }

    /// tokenizer.json as the Hugging Face tokenizer, built on first use.
    ///
    /// # Errors
    /// Input naming the file when it is missing or malformed.
    pub fn tokenizer(&self) -> Result<&tokenizers::Tokenizer> {
        if let Some(t) = self.tokenizer.get() {
            return Ok(t);
        }
        let path = base::beneath::Files::show(&self.held, "tokenizer.json");
        let t = model::hf_tokenizer_from(&path, self.tokenizer_bytes()?)?;
        Ok(self.tokenizer.get_or_init(|| t))
    }

    /// The tokenizer contract tokenizer.json routes to, after its ids are checked against the
    /// model's vocabulary ([`model::tokenizer::check_tokenizer_json`]), from the same bytes as
    /// [`Checkpoint::tokenizer`].
    ///
    /// # Errors
    /// Input: not JSON, ids outside the vocabulary; Usage: not covered by a tokenizer contract.
    pub fn tokenizer_route(&self, ckb: &Ckb) -> Result<(String, model::tokenizer::TokenizerRoute)> {
        let path = base::beneath::Files::show(&self.held, "tokenizer.json");
        let json = model::tokenizer::parse_tokenizer_json(&path, self.tokenizer_bytes()?)?;
        model::tokenizer::check_tokenizer_json(ckb, &self.held, &json, self.cfg.vocab)
    }

    /// Every weight, widened to f32, after the family's dtype policy, each checked finite (and
    /// finite when rounded to `dtype`, [`model::check_weight_range`]).
    ///
    /// # Errors
    /// Input naming the file and tensor: an unsupported dtype, a tensor the policy keeps in f32
    /// stored rounded, a non-finite value, a short file.
    pub fn tensors(&self, ckb: &Ckb, dtype: &str) -> Result<Tensors> {
        let (family, _) = self.family(ckb)?;
        model::check_dtype_policy(family, &self.cfg, &self.config, &self.layout)?;
        let tensors = model::weights::read_layout(&self.held, &self.layout)?;
        model::check_weight_range(&tensors, dtype)?;
        Ok(tensors)
    }
}
