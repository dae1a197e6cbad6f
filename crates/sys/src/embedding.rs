//! Embeddings: a context in llama.cpp's embedding mode with pooling, one sequence at a time.
//!
//! Generative models carry no pooling type, so they get mean pooling (what Ollama and
//! llama.cpp's server do for them). Every token of a pooled sequence must be in one micro-batch,
//! so the context's batch equals its length, and inputs are checked against it here.
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as raw;

use crate::batch::Batch;
use crate::context::ThreadPool;
use crate::error::SysError;
use crate::eval_hook::{eval_callback, EvalHook, HookCell};
use crate::model::Model;
use crate::vocab::Token;

/// A context that returns one pooled vector per input. Not shared between threads.
pub struct EmbeddingContext {
    pointer: NonNull<raw::llama_context>,
    _model: Model,
    n_ctx: u32,
    n_embd: usize,
    n_vocab: i32,
    batch: Batch,
    /// The eval hook (streaming models), boxed so llama.cpp can hold a thin pointer to it.
    hook: Option<Box<HookCell>>,
    /// Its CPU threads (`context::ThreadPool`), freed after the context.
    threadpool: Option<ThreadPool>,
}

// SAFETY: the context may move between threads as long as one uses it at a time (&mut self).
unsafe impl Send for EmbeddingContext {}

impl EmbeddingContext {
    /// A context for inputs of up to `n_ctx` tokens. A streaming model passes its eval hook,
    /// which makes streamed weights resident as the graph reaches them.
    pub fn new(
        model: &Model,
        n_ctx: u32,
        n_threads: i32,
        eval_hook: Option<Arc<dyn EvalHook>>,
    ) -> Result<EmbeddingContext, SysError> {
        let n_ctx = n_ctx.max(8);
        let hook = eval_hook.map(|hook| Box::new(HookCell::new(hook)));
        let create = |pooling: raw::llama_pooling_type| -> Result<NonNull<raw::llama_context>, SysError> {
            // SAFETY: returns a plain struct by value.
            let mut params = unsafe { raw::llama_context_default_params() };
            params.n_ctx = n_ctx;
            params.n_batch = n_ctx;
            params.n_ubatch = n_ctx;
            params.n_seq_max = 1;
            params.n_threads = n_threads;
            params.n_threads_batch = n_threads;
            params.embeddings = true;
            params.pooling_type = pooling;
            params.no_perf = true;
            if let Some(hook) = &hook {
                params.cb_eval = Some(eval_callback);
                params.cb_eval_user_data = &**hook as *const HookCell as *mut c_void;
            }
            crate::log::clear_last_error();
            // SAFETY: the model pointer is valid and outlives the context (we keep a clone of
            // the Model); the hook's data points into a box the context keeps until llama_free.
            let pointer = unsafe { raw::llama_init_from_model(model.as_ptr(), params) };
            NonNull::new(pointer).ok_or_else(|| SysError::ContextCreate {
                n_ctx,
                n_batch: n_ctx,
                reason: crate::log::take_last_error().unwrap_or_else(|| "unknown reason".to_string()),
            })
        };
        let mut pointer = create(raw::LLAMA_POOLING_TYPE_UNSPECIFIED)?;
        // SAFETY: the context is valid.
        let pooling = unsafe { raw::llama_pooling_type(pointer.as_ptr()) };
        if pooling == raw::LLAMA_POOLING_TYPE_NONE {
            // SAFETY: freed once, replaced at once by a context with mean pooling.
            unsafe { raw::llama_free(pointer.as_ptr()) };
            pointer = create(raw::LLAMA_POOLING_TYPE_MEAN)?;
        } else if pooling == raw::LLAMA_POOLING_TYPE_RANK {
            // SAFETY: freed once; we return before using it.
            unsafe { raw::llama_free(pointer.as_ptr()) };
            return Err(SysError::Embedding(
                "this is a reranking model (rank pooling); it returns scores, not embeddings".into(),
            ));
        }
        // SAFETY: the model pointer is valid while `model` lives.
        let n_embd = unsafe { raw::llama_model_n_embd_out(model.as_ptr()) }.max(0) as usize;
        let threadpool = ThreadPool::new(n_threads, true);
        if let Some(pool) = &threadpool {
            pool.attach(pointer);
        }
        if let Some(hook) = &hook {
            hook.attach(pointer.as_ptr());
        }
        Ok(EmbeddingContext {
            pointer,
            _model: model.clone(),
            n_ctx,
            n_embd,
            n_vocab: model.vocab().n_tokens(),
            batch: Batch::new(n_ctx as usize, 1),
            hook,
            threadpool,
        })
    }

    /// The longest input, in tokens.
    pub fn n_ctx(&self) -> u32 {
        self.n_ctx
    }

    pub fn n_embd(&self) -> usize {
        self.n_embd
    }

    /// The pooled embedding of `tokens` (not normalised).
    pub fn embed(&mut self, tokens: &[Token]) -> Result<Vec<f32>, SysError> {
        if tokens.is_empty() {
            return Err(SysError::Embedding("nothing to embed: the input has no tokens".into()));
        }
        if tokens.len() > self.n_ctx as usize {
            return Err(SysError::Embedding(format!(
                "the input is {} tokens but the embedding context holds {}",
                tokens.len(),
                self.n_ctx
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&token| token < 0 || token >= self.n_vocab) {
            return Err(SysError::BadToken { token: bad, n_vocab: self.n_vocab });
        }
        // SAFETY: the context is valid; llama_get_memory returns null for encoder-only models,
        // which llama_memory_clear accepts.
        unsafe { raw::llama_memory_clear(raw::llama_get_memory(self.pointer.as_ptr()), true) };
        self.batch.clear();
        for (position, &token) in tokens.iter().enumerate() {
            // Pooling needs every token as an output.
            self.batch.push(token, position as i32, &[0], true)?;
        }
        if let Some(hook) = &self.hook {
            hook.begin_decode();
        }
        crate::log::clear_last_error();
        // SAFETY: the context is valid and used by this thread only (&mut self); the batch holds
        // tokens.len() <= n_batch checked entries.
        let code = unsafe { raw::llama_decode(self.pointer.as_ptr(), self.batch.raw()) };
        if code != 0 {
            return Err(SysError::Decode {
                code,
                reason: crate::log::take_last_error()
                    .unwrap_or_else(|| "see the llama.cpp log (HYPURA_LOG=llama=debug)".to_string()),
            });
        }
        // SAFETY: the context is valid; the result is null or n_embd_out floats owned by the
        // context, valid until the next decode (we copy them out at once).
        let pointer = unsafe { raw::llama_get_embeddings_seq(self.pointer.as_ptr(), 0) };
        if pointer.is_null() {
            return Err(SysError::Embedding("llama.cpp returned no pooled embedding".into()));
        }
        // SAFETY: see above.
        Ok(unsafe { std::slice::from_raw_parts(pointer, self.n_embd) }.to_vec())
    }
}

impl Drop for EmbeddingContext {
    fn drop(&mut self) {
        // SAFETY: the pointer came from llama_init_from_model and is freed exactly once, before
        // our clone of the Model.
        unsafe { raw::llama_free(self.pointer.as_ptr()) };
        drop(self.threadpool.take());
    }
}
