//! `Embedder`: pooled embeddings of a loaded model, one input at a time, on a context of its
//! own in llama.cpp's embedding mode. In streaming modes it carries the engine's eval hook, so
//! streamed weights are made resident as for generation, and a decode that never reached the
//! hook is refused.
use std::sync::Arc;

use hypura_sys::EmbeddingContext;

use super::{Engine, EngineError};

/// What embedding one input gave.
#[derive(Clone, Debug)]
pub struct Embedding {
    /// The pooled vector, not normalised.
    pub vector: Vec<f32>,
    pub tokens: usize,
}

pub struct Embedder {
    engine: Arc<Engine>,
    context: EmbeddingContext,
}

impl Embedder {
    /// An embedding context for inputs of up to `n_ctx` tokens (at most the engine's context).
    pub fn new(engine: Arc<Engine>, n_ctx: u32) -> Result<Embedder, EngineError> {
        let n_ctx = n_ctx.min(engine.n_ctx_seq()).max(8);
        let threads = engine.context_params().n_threads;
        let hook = engine.hooked_streaming().map(|streaming| streaming.driver.hook());
        let context = EmbeddingContext::new(engine.model(), n_ctx, threads, hook)?;
        Ok(Embedder { engine, context })
    }

    /// The longest input, in tokens.
    pub fn n_ctx(&self) -> u32 {
        self.context.n_ctx()
    }

    /// The input's tokens (BOS added when the model wants it; special-token text stays text).
    pub fn tokenize(&self, input: &str) -> Result<Vec<hypura_sys::Token>, EngineError> {
        Ok(self.engine.model().vocab().tokenize(input, true, false)?)
    }

    /// The pooled embedding of `tokens`.
    pub fn embed(&mut self, tokens: &[hypura_sys::Token]) -> Result<Embedding, EngineError> {
        let observations_before = self.engine.hooked_streaming().map(|streaming| streaming.observations());
        let result = self.context.embed(tokens);
        // A remote worker that stopped answering was answered for with zeros by its relay.
        self.engine.check_remote()?;
        // This context has no abort flags: a failed read is caught here, after the decode, and
        // what the graph computed without those weights is thrown away.
        if let Some(failure) = self.engine.streaming().and_then(|streaming| streaming.driver.take_failure()) {
            return Err(crate::store::StoreError::from(failure).into());
        }
        let vector = result?;
        if let (Some(before), Some(streaming)) = (observations_before, self.engine.hooked_streaming()) {
            streaming.ensure_hook_fired(before)?;
        }
        if vector.iter().any(|value| !value.is_finite()) {
            return Err(EngineError::Decode("the embedding holds NaN or infinite values".into()));
        }
        Ok(Embedding { vector, tokens: tokens.len() })
    }
}
