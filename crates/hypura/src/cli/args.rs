//! Clap definitions only: no logic, no defaults that need the environment.
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "hypura",
    version,
    about = "Run GGUF models larger than memory: placement across GPU, RAM and NVMe, with streaming"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Measure this machine: CPU, RAM (cgroup-aware), ggml devices, disk bandwidth. Cached.
    Profile(ProfileArgs),
    /// Show what a model file holds, without loading tensor data.
    Inspect(InspectArgs),
    /// Generate text from a prompt, or chat interactively.
    Run(RunArgs),
    /// Benchmark Hypura against plain llama.cpp on the same file, in one process.
    Bench(BenchArgs),
    /// Replay a routing trace against expert-cache policies and sizes.
    Simulate(SimulateArgs),
    /// Serve models over HTTP with Ollama's API and OpenAI's.
    Serve(ServeArgs),
    /// Lend this machine's devices to other Hypura (or llama.cpp) processes over ggml's RPC
    /// protocol, every request checked; with a key, to those that hold it, encrypted.
    RpcServer(RpcServerArgs),
    /// Download a model from the hub by name (hf.co/ORG/REPO[:QUANT], hf://ORG/REPO/FILE.gguf
    /// or an https:// URL), after showing the plan it would get here.
    Pull(PullArgs),
    /// List the models pulled.
    #[command(alias = "ls")]
    List,
    /// Remove pulled models.
    #[command(alias = "remove")]
    Rm(RemoveArgs),
    /// Draw a `scripts/bench/bench-limited` summary (its summary.json) as an SVG picture.
    #[command(hide = true)]
    SummaryPicture(SummaryPictureArgs),
}

#[derive(Args, Debug)]
pub struct PullArgs {
    /// hf.co/ORG/REPO[:QUANT] (the repository's GGUF with that quantization, Q4_K_M by
    /// default; split files together), hf://ORG/REPO/FILE.gguf, or an https:// URL. The hub is
    /// HF_ENDPOINT (or huggingface.co), HF_TOKEN its token; files land in HYPURA_MODELS (or
    /// ~/.cache/hypura/models).
    pub model: String,
    /// Pull without asking, even where the model would not run on this machine.
    #[arg(short = 'y', long)]
    pub yes: bool,
    /// The plan shown before the download is the one `run` gives with these flags.
    #[command(flatten)]
    pub model_args: ModelArgs,
}

#[derive(Args, Debug)]
pub struct RemoveArgs {
    /// Names as `hypura list` shows them.
    #[arg(required = true)]
    pub models: Vec<String>,
}

#[derive(Args, Debug)]
pub struct SummaryPictureArgs {
    /// The summary.json that scripts/bench/bench-summary.py writes.
    pub summary: PathBuf,
    /// Where to write the picture.
    #[arg(long)]
    pub svg: PathBuf,
}

#[derive(Args, Debug)]
pub struct RpcServerArgs {
    /// Address to bind. The default serves this machine only; another address needs a key
    /// (or --insecure-no-auth).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 50052)]
    pub port: u16,
    /// Keep tensors clients send in this directory (ggml's cache: a later load of the same
    /// model sends hashes instead of bytes).
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// ggml devices to lend, comma-separated (default: CPU).
    #[arg(long, value_delimiter = ',')]
    pub device: Vec<String>,
    /// Memory to lend, e.g. 4GiB (default: available memory, cgroup-aware, minus headroom).
    #[arg(long)]
    pub mem: Option<String>,
    /// CPU threads (default: every core).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Serve only clients that prove this key (64 hexadecimal digits, e.g. from `openssl rand
    /// -hex 32`), over an encrypted link; clients pass the same file as --rpc-key-file.
    /// Default: HYPURA_RPC_KEY, else no key (loopback only).
    #[arg(long, value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// Bind an address other than loopback without a key: anyone who reaches the port may use
    /// the lent devices (every request is still checked).
    #[arg(long)]
    pub insecure_no_auth: bool,
    /// On SIGTERM or Ctrl-C, how long connected clients may go on before the server exits (new
    /// connections are closed meanwhile; a second signal exits at once), e.g. 10s, 1m.
    #[arg(long, default_value = "10s", value_name = "DURATION")]
    pub shutdown_timeout: String,
    /// Serve one client with ggml's own server, unchecked, on a loopback address (how the
    /// front starts each client's server; not for direct use).
    #[arg(long, hide = true)]
    pub serve_one_client: bool,
}

#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// Measure again even if a cached profile exists.
    #[arg(long)]
    pub refresh: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also measure the links to these RPC workers (round trip and upload rate), comma-separated.
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT")]
    pub rpc: Vec<String>,
    /// The key the workers hold (as on `run`).
    #[arg(long, value_name = "FILE")]
    pub rpc_key_file: Option<PathBuf>,
    /// A file or directory on the volume to measure (default: the cache directory). A model
    /// file is read, never written.
    #[arg(long)]
    pub path: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A GGUF file (the first file of a split model), the name of a model pulled by Ollama, or
    /// a URL (http://, https://, hf://ORG/REPO/FILE.gguf): only its index is fetched, by range
    /// requests, and it is planned as the same file on this machine would be.
    #[arg(value_name = "MODEL")]
    pub model: Option<String>,
    /// The model, as llama.cpp's -m gives it.
    #[arg(short = 'm', long = "model", conflicts_with = "model", value_name = "MODEL")]
    pub model_flag: Option<String>,
    /// List every tensor.
    #[arg(long)]
    pub tensors: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Also draw the predicted decode speed and the mode the planner picks at memory budgets
    /// from a sixteenth of the file to twice it, this machine's budget marked, into this SVG
    /// file.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// The run's model and context flags: the plan printed is the plan `run` uses with them.
    #[command(flatten)]
    pub model_args: ModelArgs,
}

/// Sampling flags shared by `run` and `bench`, with llama.cpp's names and defaults.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    /// 0 disables.
    #[arg(long, default_value_t = 40, allow_negative_numbers = true)]
    pub top_k: i32,
    /// 1 disables.
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true)]
    pub top_p: f32,
    /// 0 disables.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// 1 disables.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repeat_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Tokens the penalties look back over (0 disables, -1 the whole context).
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub repeat_last_n: i32,
    /// Seed for sampling (default: random).
    #[arg(long)]
    pub seed: Option<u32>,
}

/// Placement flags: how the planner may use memory.
#[derive(Args, Debug, Clone, Default)]
pub struct PlanArgs {
    /// Memory Hypura may use, e.g. 8GiB, 4.5G, 512MiB (default: available memory, cgroup-aware,
    /// minus headroom).
    #[arg(long)]
    pub memory_budget: Option<String>,
    /// Device memory Hypura may use on the GPU, e.g. 8GiB; 0 keeps everything on the CPU
    /// (default: a dedicated GPU's free memory minus 1 GiB; the smallest GPU's where there are
    /// several).
    #[arg(long)]
    pub gpu_budget: Option<String>,
    /// How routed experts use the GPU budget: layers (whole layers' experts on the GPU, the
    /// rest in host memory or streamed through the host's expert cache, computed on the CPU),
    /// pool (every MoE layer's most used experts in device slots, the rest in the host's expert
    /// cache and on disk, all computed on the GPU, a miss uploaded first), split (the pool, but
    /// at decode the CPU computes the picks no slot holds while the GPU computes the slots';
    /// an expert is uploaded only once picked often), or auto: where whole layers would leave
    /// routed experts with the host, each predicted for this machine and the model's routing
    /// (its record, else real models') and the fastest taken (`inspect` shows them), else layers.
    #[arg(long, default_value = "auto", value_parser = ["auto", "layers", "pool", "split"])]
    pub gpu_experts: String,
    /// auto, resident, dense-stream or expert-stream.
    #[arg(long, default_value = "auto")]
    pub mode: String,
    /// The KV cache's type for K: f16, or to fit a longer context in memory q8_0 (half the
    /// bytes), q4_0, q4_1, q5_0, q5_1, iq4_nl, bf16, f32 (llama.cpp's --cache-type-k). A
    /// quantized cache changes the logits slightly, and on the CPU it slows prompts (1.7× at
    /// q8_0, 2.6× at q4_0 on a 4K prompt). Default: OLLAMA_KV_CACHE_TYPE, else f16.
    #[arg(long, visible_alias = "ctk", env = "OLLAMA_KV_CACHE_TYPE", default_value = "f16", value_name = "TYPE")]
    pub cache_type_k: String,
    /// The KV cache's type for V (a quantized V needs flash attention, which llama.cpp turns
    /// on where the backend has it). Default: OLLAMA_KV_CACHE_TYPE, else f16.
    #[arg(long, visible_alias = "ctv", env = "OLLAMA_KV_CACHE_TYPE", default_value = "f16", value_name = "TYPE")]
    pub cache_type_v: String,
    /// Streamed layers read ahead of the computing one (dense-stream; default: sized from the
    /// disk's queue depth and bandwidth and the measured compute time).
    #[arg(long)]
    pub window: Option<usize>,
    /// Reader threads (queue depth) for streaming (default: the queue depth at which
    /// `hypura profile` measured the best direct reads, at most 4; else 4).
    #[arg(long)]
    pub io_workers: Option<usize>,
    /// Expert cache size in (layer, expert) units (expert-stream; default: what the budget holds).
    #[arg(long)]
    pub expert_cache: Option<usize>,
    /// Expert cache replacement: auto, slru or lru. Auto takes LRU for a cache smaller than one
    /// and a half tokens' picks (MoE layers × experts used), where SLRU serves far fewer of real
    /// routing's picks, and SLRU above.
    #[arg(long, default_value = "auto")]
    pub cache_policy: String,
    /// Read likely next-layer experts ahead (stale gate: the next layer's router applied to
    /// this layer's hidden state): auto, on or off. Auto turns it on where the streamed layers
    /// attend on the CPU (it measured a win for slices of 1 MB and of 8–12 MB once reads went
    /// into reused pages) and off where every layer's attention is on a GPU, where reading the
    /// hidden state back from the device for each layer's prediction cost more than the misses
    /// it hid.
    #[arg(long, default_value = "auto")]
    pub prefetch: String,
    /// Record the router's choices to this file (JSON lines), for `hypura simulate`.
    #[arg(long)]
    pub trace: Option<std::path::PathBuf>,
    /// RPC workers (`hypura rpc-server` on other machines, or llama.cpp's `rpc-server`),
    /// comma-separated: their devices may hold the last layers whole, where the plan predicts
    /// that beats streaming them locally.
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT")]
    pub rpc: Vec<String>,
    /// The key the workers hold (`rpc-server --key-file`): 64 hexadecimal digits; the link is
    /// then authenticated and encrypted. Default: HYPURA_RPC_KEY, else no key.
    #[arg(long, value_name = "FILE")]
    pub rpc_key_file: Option<PathBuf>,
    /// Milliseconds added to every round trip to the RPC workers: an emulated link, for
    /// measuring on one machine what a slower network would cost.
    #[arg(long, value_name = "MS", requires = "rpc")]
    pub rpc_link_delay: Option<f64>,
}

/// Model and context flags shared by `run` and `bench`.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Context length of each sequence in tokens; 0 is the model's training context. Default:
    /// the longest of 32K, 16K, 8K, 4K and 2K (at most the trained length) whose KV cache takes
    /// at most a quarter of the memory budget.
    #[arg(long, short = 'c', value_name = "TOKENS")]
    pub context: Option<u32>,
    /// CPU threads (default: every core).
    #[arg(long, short = 't')]
    pub threads: Option<i32>,
    /// Batch size for prompt processing (llama.cpp's -b and -ub; Hypura uses one size for both).
    /// Default: 512, and in a streaming plan the one from 4096 down to 64 that streams the
    /// fewest bytes for a 2048-token prompt and a 256-token answer (each prompt batch is one
    /// sweep over the streamed weights, and a smaller compute buffer leaves more pinned).
    #[arg(long, short = 'b', visible_alias = "ubatch-size", overrides_with = "batch_size")]
    pub batch_size: Option<u32>,
    /// Turn off llama.cpp's CPU weight repacking.
    #[arg(long)]
    pub no_repack: bool,
    /// Resident mode: read the weights into memory instead of mapping the file.
    #[arg(long)]
    pub no_mmap: bool,
    /// Batch-invariant kernels (ggml's reference CPU kernels, no weight repacking): greedy
    /// output is the same bits whether a prefix was cached and whatever shares the batch.
    /// Prompt processing takes about twice as long (a 2048-token prompt on Qwen2.5-Coder-0.5B:
    /// 52 against 104 tokens/s), which an agent's 16K-token prompts feel. Default: off.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub batch_invariant: Option<bool>,
    #[command(flatten)]
    pub plan: PlanArgs,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
}

/// Speculative decoding, with llama.cpp's spellings: drafts from a small model of the same
/// vocabulary, or from n-grams of the sequence's own tokens, verified several to a pass over
/// the weights (one read of every streamed weight). Greedy output is the same with or without.
#[derive(Args, Debug, Clone, Default)]
pub struct SpeculativeArgs {
    /// A draft model: a GGUF file (or a pulled Ollama model) with the target's vocabulary,
    /// loaded resident; its memory comes out of the budget.
    #[arg(long = "model-draft", visible_alias = "spec-draft-model", value_name = "MODEL")]
    pub model_draft: Option<String>,
    /// Drafters, comma-separated, in llama.cpp's names: draft-simple (the draft model),
    /// draft-mtp (the model's own multi-token-prediction layers, which are then loaded, in host
    /// memory), ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache (prompt
    /// lookup, no model). Default: draft-simple with --model-draft.
    #[arg(long = "spec-type", value_delimiter = ',', value_name = "TYPES")]
    pub spec_type: Vec<String>,
    /// Most tokens drafted at once (default: 6 when weights stream, where a pass costs a read
    /// of every streamed weight; llama.cpp's 3 when resident).
    #[arg(long = "draft-max", visible_aliases = ["spec-draft-n-max", "draft", "draft-n"], value_name = "N")]
    pub draft_max: Option<u32>,
    /// A shorter draft is not verified (llama.cpp's default: 0).
    #[arg(long = "draft-min", visible_alias = "spec-draft-n-min", value_name = "N", default_value_t = 0)]
    pub draft_min: u32,
    /// The draft model stops drafting where its best token's probability is below this
    /// (default: 0.75 when weights stream, where each drafted token costs a 2-core CPU more
    /// than it saves unless it is likely accepted; llama.cpp's 0 when resident).
    #[arg(long = "draft-p-min", visible_alias = "spec-draft-p-min", value_name = "P")]
    pub draft_p_min: Option<f32>,
    /// The n-gram drafters look up the last this many tokens in the sequence's history.
    #[arg(long = "spec-ngram-size-n", value_name = "N", default_value_t = crate::engine::DEFAULT_NGRAM)]
    pub ngram_size_n: u32,
}

/// The prompt cache on disk, for `run` and `serve`.
#[derive(Args, Debug, Clone, Default)]
pub struct PromptCacheArgs {
    /// Keep prompts' KV caches in this directory, by prefix in blocks of 64 tokens, so that a
    /// prompt that starts like an earlier one (a system prompt, an agent's tools) loads that
    /// prefix instead of evaluating it, after a restart or a reload too (sliding-window and
    /// recurrent models: whole snapshots at the end of the system prompt and of each answer).
    /// Off by default: without it Hypura writes nothing beside its own small caches.
    #[arg(long, value_name = "DIR")]
    pub prompt_cache: Option<PathBuf>,
    /// Most bytes the prompt cache keeps; the least recently used blocks and snapshots go first.
    #[arg(long, value_name = "SIZE", default_value = "8GiB", requires = "prompt_cache")]
    pub prompt_cache_size: String,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// A GGUF file or the name of a model pulled by Ollama; default: Qwen2.5-Coder-0.5B-Instruct,
    /// fetched by scripts/fetch-model.
    #[arg(value_name = "MODEL")]
    pub model: Option<String>,
    /// The model, as llama.cpp's -m gives it.
    #[arg(short = 'm', long = "model", conflicts_with = "model", value_name = "MODEL")]
    pub model_flag: Option<String>,
    /// The prompt (rendered with the model's chat template unless --raw).
    #[arg(long, short = 'p', conflicts_with = "interactive")]
    pub prompt: Option<String>,
    /// Chat in a loop, keeping the model loaded and the conversation (Ctrl-C stops an answer;
    /// Ctrl-D or /bye quits).
    #[arg(long, short = 'i')]
    pub interactive: bool,
    /// A system prompt for chat.
    #[arg(long)]
    pub system: Option<String>,
    /// Send the prompt to the tokenizer as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Stop after this many tokens (default: until the model stops or the context is full).
    #[arg(long, short = 'n')]
    pub max_tokens: Option<u32>,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print timing statistics after each answer.
    #[arg(long)]
    pub stats: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub model_args: ModelArgs,
    #[command(flatten)]
    pub prompt_cache: PromptCacheArgs,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A GGUF file or the name of a model pulled by Ollama; default: the default model.
    #[arg(value_name = "MODEL")]
    pub model: Option<String>,
    /// The model, as llama.cpp's -m gives it.
    #[arg(short = 'm', long = "model", conflicts_with = "model", value_name = "MODEL")]
    pub model_flag: Option<String>,
    /// Prompt tokens for the prompt-processing test (pp).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Generated tokens for the text-generation test (tg).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions of each test (alternating Hypura and llama.cpp).
    #[arg(short = 'r', long, default_value_t = 5)]
    pub reps: usize,
    /// Only run Hypura; skip the llama.cpp baseline.
    #[arg(long, conflicts_with = "baseline_only")]
    pub no_baseline: bool,
    /// Only run the llama.cpp baseline (each side in its own process, e.g. under a memory limit).
    #[arg(long)]
    pub baseline_only: bool,
    /// Load the llama.cpp baseline with --no-mmap.
    #[arg(long)]
    pub baseline_no_mmap: bool,
    /// Turn off the baseline's weight repacking (on by default, as in llama.cpp).
    #[arg(long)]
    pub baseline_no_repack: bool,
    /// The baseline's GPU placement: default (every layer on the GPU), fit (llama.cpp's
    /// automatic fit to --gpu-budget), exps-cpu (-ot exps=CPU), n-cpu-moe:N (--n-cpu-moe N: the
    /// first N layers' routed experts in host memory) or same (Hypura's plan).
    #[arg(long, default_value = "default")]
    pub baseline_placement: String,
    /// Run the llama.cpp baseline even when the model exceeds available memory minus 4 GiB.
    #[arg(long)]
    pub force: bool,
    /// Also write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also draw the results as an SVG picture: each test's Hypura and llama.cpp side by side,
    /// mean, standard deviation and every sample.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    #[command(flatten)]
    pub model_args: ModelArgs,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Models to serve: GGUF files, directories of GGUF files, or names of models pulled by
    /// Ollama (default: every model in --models-dir and in Ollama's store).
    pub models: Vec<String>,
    /// Address to bind. The default serves this machine only.
    #[arg(long, default_value = "127.0.0.1", env = "HYPURA_HOST")]
    pub host: String,
    #[arg(long, default_value_t = 8080, env = "HYPURA_PORT")]
    pub port: u16,
    /// A directory of GGUF files, or an Ollama model store (holding manifests/ and blobs/).
    #[arg(long)]
    pub models_dir: Vec<PathBuf>,
    /// Requests decoded together per model (parallel sequences of one context).
    #[arg(long, default_value_t = 4)]
    pub parallel: u32,
    /// Requests that may wait per model beyond the running ones; more get 503.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// How long a model stays loaded after its last request (e.g. 5m, 1h, 0, -1 for ever).
    #[arg(long, default_value = "5m")]
    pub keep_alive: String,
    /// Extra origins allowed by CORS (localhost is always allowed; * allows any).
    #[arg(long = "cors-origin")]
    pub cors_origins: Vec<String>,
    /// Require `Authorization: Bearer KEY` on every request but `GET /` and `/api/version`
    /// (401 otherwise), as llama-server's `--api-key` does.
    #[arg(long, env = "HYPURA_API_KEY", hide_env_values = true, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// The API key, read from this file (its first line).
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Largest request body, e.g. 16MiB.
    #[arg(long, default_value = "16MiB")]
    pub max_body: String,
    /// Longest embedding input in tokens.
    #[arg(long, default_value_t = 512)]
    pub embedding_context: u32,
    /// On SIGTERM or Ctrl-C, how long running answers may go on before they are cancelled
    /// (new requests get 503 meanwhile; a second signal exits at once), e.g. 10s, 1m.
    #[arg(long, default_value = "10s", value_name = "DURATION")]
    pub shutdown_timeout: String,
    /// Serve Prometheus metrics at `GET /metrics` (llama-server's names where one exists).
    #[arg(long)]
    pub metrics: bool,
    #[command(flatten)]
    pub model_args: ModelArgs,
    #[command(flatten)]
    pub prompt_cache: PromptCacheArgs,
}

#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// Traces written by `hypura run --trace`, or recorded real routing (one JSON object a
    /// token and layer, `{"pos", "layer", "experts"}`, gzipped or not); each is replayed cold.
    #[arg(required = true)]
    pub trace: Vec<PathBuf>,
    /// The model the traces came from, for its layer and expert counts (default: what the
    /// traces name).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Experts a layer, where no model is given and the traces may not name the last one.
    #[arg(long, conflicts_with = "model")]
    pub n_expert: Option<usize>,
    /// Cache sizes in (layer, expert) units, comma-separated (default: 5 sizes from one layer's
    /// experts to half of all units).
    #[arg(long, value_delimiter = ',')]
    pub capacity: Vec<usize>,
    /// Policies to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "lru,slru")]
    pub policy: Vec<String>,
    /// Replay prompt batches token by token, as decoding the same text would route it (a long
    /// real text as the prompt then gives a decode trace of real text); by default a batch is
    /// one visit to the union of its picks, as the expert store serves it.
    #[arg(long)]
    pub token_by_token: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}
