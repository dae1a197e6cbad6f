//! The peer: plain llama.cpp, used the way its own `llama-simple` and `llama-bench` use it —
//! default model parameters (mmap, repacking on), one context, a greedy loop. Benchmarks and
//! tests compare Hypura against this, in the same process and on the same file.
use std::path::Path;
use std::time::{Duration, Instant};

use hypura_sys::{first_maximum, Backend, Batch, Context, ContextParams, LoadMode, Model, ModelParams, SysError, Token};

pub struct PlainLlama {
    context: Context,
    batch: Batch,
    position: i32,
    load_duration: Duration,
}

impl PlainLlama {
    /// Load with llama.cpp's defaults (mmap, repacking), except `repack`, which tests set to
    /// match the other side.
    pub fn load(path: &Path, n_ctx: u32, n_threads: i32, repack: bool) -> Result<PlainLlama, SysError> {
        PlainLlama::load_with(path, n_ctx, n_threads, repack, LoadMode::Mmap)
    }

    /// As `load`, choosing mmap or `--no-mmap`.
    pub fn load_with(path: &Path, n_ctx: u32, n_threads: i32, repack: bool, load_mode: LoadMode) -> Result<PlainLlama, SysError> {
        let started = Instant::now();
        let model = Model::load(Backend::get(), path, &ModelParams { use_extra_bufts: repack, load_mode, ..ModelParams::default() })?;
        let params = ContextParams { n_ctx, n_threads, n_threads_batch: n_threads, ..ContextParams::default() };
        let context = Context::new(&model, &params)?;
        let batch = Batch::new(params.n_batch as usize, 1);
        Ok(PlainLlama { context, batch, position: 0, load_duration: started.elapsed() })
    }

    pub fn load_duration(&self) -> Duration {
        self.load_duration
    }

    pub fn vocab(&self) -> hypura_sys::Vocab {
        self.context.model().vocab()
    }

    pub fn tokenize(&self, text: &str) -> Result<Vec<Token>, SysError> {
        self.context.model().vocab().tokenize(text, true, true)
    }

    /// Clear the KV cache and evaluate `tokens`; the last one gets logits.
    pub fn prefill(&mut self, tokens: &[Token]) -> Result<(), SysError> {
        self.context.clear_memory();
        self.position = 0;
        self.append(tokens)
    }

    fn append(&mut self, tokens: &[Token]) -> Result<(), SysError> {
        let capacity = self.batch.capacity();
        for (chunk_index, chunk) in tokens.chunks(capacity).enumerate() {
            let last_chunk = (chunk_index + 1) * capacity >= tokens.len();
            self.batch.clear();
            for (offset, &token) in chunk.iter().enumerate() {
                self.batch.push(token, self.position + offset as i32, &[0], last_chunk && offset + 1 == chunk.len())?;
            }
            self.context.decode(&self.batch)?;
            self.position += chunk.len() as i32;
        }
        Ok(())
    }

    /// Logits after the last evaluated token.
    pub fn last_logits(&self) -> Result<Vec<f32>, SysError> {
        Ok(self.context.logits(-1)?.to_vec())
    }

    /// Greedy continuation of `prompt` (first maximum wins, as llama.cpp's greedy sampler).
    pub fn greedy(&mut self, prompt: &[Token], count: usize) -> Result<Vec<Token>, SysError> {
        self.prefill(prompt)?;
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            let token = first_maximum(self.context.logits(-1)?);
            out.push(token);
            self.append(&[token])?;
        }
        Ok(out)
    }

    /// llama-bench's `pp`: time to evaluate `tokens` from an empty cache.
    pub fn time_prefill(&mut self, tokens: &[Token]) -> Result<Duration, SysError> {
        // Clearing the KV cache is not prompt processing: Hypura's side resets outside its
        // clock too.
        self.context.clear_memory();
        self.position = 0;
        let started = Instant::now();
        self.append(tokens)?;
        self.context.logits(-1)?;
        Ok(started.elapsed())
    }

    /// `tg`: time to generate `count` tokens greedily after `prompt` (prompt time excluded).
    pub fn time_generate(&mut self, prompt: &[Token], count: usize) -> Result<Duration, SysError> {
        self.prefill(prompt)?;
        let started = Instant::now();
        for _ in 0..count {
            let token = first_maximum(self.context.logits(-1)?);
            self.append(&[token])?;
        }
        self.context.logits(-1)?;
        Ok(started.elapsed())
    }
}
