//! `Engine`: a loaded model with its inventory and chat template.
use std::path::Path;
use std::time::{Duration, Instant};

use hypura_sys::{Backend, ContextParams, LoadMode, Model, ModelParams};

use super::template::ChatTemplate;
use super::EngineError;
use crate::model::Inventory;

/// How to load and run a model. Defaults match llama.cpp's own.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Context length in tokens; 0 means the model's training context. Capped at that.
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_ubatch: u32,
    /// Parallel sequences one context serves (the server's concurrent requests).
    pub n_seq_max: u32,
    /// CPU threads; None means every core.
    pub n_threads: Option<i32>,
    /// Let llama.cpp repack CPU weights at load ("extra buffer types"). Faster, but streamed
    /// tensors cannot be repacked, so comparisons must use the same setting on both sides.
    pub repack: bool,
    pub load_mode: LoadMode,
    pub n_gpu_layers: i32,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            n_ctx: 4096,
            n_batch: 512,
            n_ubatch: 512,
            n_seq_max: 1,
            n_threads: None,
            repack: true,
            load_mode: LoadMode::Mmap,
            n_gpu_layers: -1,
        }
    }
}

/// A loaded model. Share it between sessions with `Arc`.
pub struct Engine {
    pub(super) model: Model,
    inventory: Inventory,
    template: ChatTemplate,
    options: EngineOptions,
    load_duration: Duration,
}

impl Engine {
    /// Validate the file with the inventory (a typed error for bad or unknown files, before
    /// llama.cpp sees them), then load it.
    pub fn load(path: &Path, options: EngineOptions) -> Result<Engine, EngineError> {
        let started = Instant::now();
        let inventory = Inventory::open(path)?;
        let backend = Backend::get();
        let params = ModelParams {
            n_gpu_layers: options.n_gpu_layers,
            load_mode: options.load_mode,
            use_extra_bufts: options.repack,
            vocab_only: false,
        };
        let model = Model::load(backend, path, &params)?;
        let vocab = model.vocab();
        let token_text = |token| vocab.token_bytes(token, true).map(|bytes| String::from_utf8_lossy(&bytes).into_owned()).unwrap_or_default();
        let template = ChatTemplate::resolve(model.chat_template(), &inventory.arch, token_text(vocab.bos()), token_text(vocab.eos()));
        tracing::debug!("chat template: {}", template.describe());
        Ok(Engine { model, inventory, template, options, load_duration: started.elapsed() })
    }

    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    pub fn load_duration(&self) -> Duration {
        self.load_duration
    }

    /// The context length sessions get: the requested one, capped at the training context.
    pub fn n_ctx(&self) -> u32 {
        let trained = u32::try_from(self.model.n_ctx_train()).unwrap_or(u32::MAX).max(1);
        match self.options.n_ctx {
            0 => trained,
            requested => requested.min(trained),
        }
    }

    pub(super) fn context_params(&self) -> ContextParams {
        let defaults = ContextParams::default();
        let threads = self.options.n_threads.unwrap_or(defaults.n_threads);
        ContextParams {
            n_ctx: self.n_ctx(),
            n_batch: self.options.n_batch,
            n_ubatch: self.options.n_ubatch.min(self.options.n_batch),
            n_seq_max: self.options.n_seq_max,
            n_threads: threads,
            n_threads_batch: threads,
            ..defaults
        }
    }
}
