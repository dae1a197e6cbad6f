//! The peer: plain llama.cpp, used the way its own `llama-simple` and `llama-bench` use it —
//! default model parameters (mmap, repacking on), one context, a greedy loop. Benchmarks and
//! tests compare Hypura against this, in the same process and on the same file.
use std::path::Path;
use std::time::{Duration, Instant};

use hypura_sys::{
    first_maximum, Backend, Batch, Context, ContextParams, LoadMode, Model, ModelParams, Placement, SysError, Token,
};

use super::{PeerConfig, PeerPlacement};

pub struct PlainLlama {
    context: Context,
    batch: Batch,
    position: i32,
    load_duration: Duration,
    placement: String,
}

impl PlainLlama {
    /// Load with llama.cpp's defaults (mmap, repacking), except `repack`, which tests set to
    /// match the other side.
    pub fn load(path: &Path, n_ctx: u32, n_threads: i32, repack: bool) -> Result<PlainLlama, SysError> {
        PlainLlama::load_with(path, n_ctx, n_threads, repack, LoadMode::Mmap)
    }

    /// As `load`, choosing mmap or `--no-mmap`.
    pub fn load_with(
        path: &Path,
        n_ctx: u32,
        n_threads: i32,
        repack: bool,
        load_mode: LoadMode,
    ) -> Result<PlainLlama, SysError> {
        PlainLlama::load_configured(path, n_ctx, n_threads, &PeerConfig { load_mode, repack, ..PeerConfig::default() })
    }

    /// Load as `config` says, the GPU placement included (`--fit` asks llama.cpp's fit first,
    /// inside the load time).
    pub fn load_configured(
        path: &Path,
        n_ctx: u32,
        n_threads: i32,
        config: &PeerConfig,
    ) -> Result<PlainLlama, SysError> {
        let started = Instant::now();
        let backend = Backend::get();
        // With RPC devices, llama.cpp's `--rpc`: every layer offloaded, split by free memory.
        let mut model_params = ModelParams {
            use_extra_bufts: config.repack,
            load_mode: config.load_mode,
            devices: config.devices.clone(),
            ..ModelParams::default()
        };
        let params = ContextParams {
            n_ctx,
            n_threads,
            n_threads_batch: n_threads,
            type_k: config.kv.k.id(),
            type_v: config.kv.v.id(),
            ..ContextParams::default()
        };
        let host_patterns = match &config.placement {
            PeerPlacement::Default => Vec::new(),
            PeerPlacement::ExpertsOnHost => vec![PeerPlacement::EXPERTS_PATTERN.to_string()],
            // llama.cpp's own patterns for `--n-cpu-moe N`.
            PeerPlacement::CpuMoe { layers } => {
                (0..*layers).map(|layer| format!("blk\\.{layer}\\.ffn_(up|down|gate|gate_up)_(ch|)exps")).collect()
            }
            PeerPlacement::Same { n_gpu_layers, host_patterns } => {
                model_params.n_gpu_layers = *n_gpu_layers;
                host_patterns.clone()
            }
            PeerPlacement::Fit { gpu_budget_bytes } => {
                // The margin leaves all free memory but the budget on the first dedicated GPU.
                // Free memory is read now, beside Hypura's model when both sides run in one
                // process: where the card cannot hold both, the peer gets only what is left.
                let free = backend
                    .devices()
                    .iter()
                    .find(|device| device.kind == hypura_sys::DeviceKind::Gpu)
                    .map_or(0, |device| device.free_bytes);
                if free < *gpu_budget_bytes {
                    tracing::warn!(
                        "llama.cpp's fit gets the {} free on the GPU, less than the {} budget: run each side in its own process (--no-baseline, --baseline-only) to compare at the same budget",
                        crate::format::format_bytes(free),
                        crate::format::format_bytes(*gpu_budget_bytes)
                    );
                }
                let fit = hypura_sys::fit_placement(
                    backend,
                    path,
                    &model_params,
                    &params,
                    free.saturating_sub(*gpu_budget_bytes),
                )?;
                model_params.n_gpu_layers = fit.n_gpu_layers;
                fit.host_patterns
            }
        };
        let placed = Placement { host_patterns: host_patterns.clone(), ..Placement::default() };
        let model = Model::load_placed(backend, path, &model_params, placed)?;
        let context = Context::new(&model, &params)?;
        let batch = Batch::new(params.n_batch as usize, 1);
        let devices = if config.devices.is_empty() {
            String::new()
        } else {
            format!(", devices {:?}", config.devices.iter().map(hypura_sys::DeviceHandle::name).collect::<Vec<_>>())
        };
        let placement =
            format!("n_gpu_layers {}, host patterns {:?}{devices}", model_params.n_gpu_layers, host_patterns);
        Ok(PlainLlama { context, batch, position: 0, load_duration: started.elapsed(), placement })
    }

    /// The placement llama.cpp got, for reports.
    pub fn placement(&self) -> &str {
        &self.placement
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
