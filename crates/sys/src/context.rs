//! An inference context: KV cache, compute buffers, decode and logits.
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use llama_cpp_sys_2 as raw;

use crate::batch::Batch;
use crate::error::SysError;
use crate::eval_hook::{eval_callback, EvalHook, HookCell};
use crate::model::Model;
use crate::vocab::Token;

/// Options for `Context::new`. Zero means "llama.cpp's default" where llama.cpp allows it.
#[derive(Clone)]
pub struct ContextParams {
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_ubatch: u32,
    pub n_seq_max: u32,
    pub n_threads: i32,
    pub n_threads_batch: i32,
    pub embeddings: bool,
    /// Let ggml move large host-weight ops (prefill batches) to a GPU by itself.
    pub op_offload: bool,
    /// One KV buffer for all sequences instead of one per sequence. Then llama.cpp never splits
    /// a batch of several sequences into several graphs (one pass over the weights per step);
    /// the caller keeps each sequence within its share.
    pub kv_unified: bool,
    /// Decisions at chosen graph nodes (streaming modes).
    pub eval_hook: Option<Arc<dyn EvalHook>>,
    /// Batch-invariant CPU kernels (ggml's reference path): a token's logits are then the same
    /// bits whatever else its batch holds, so a greedy answer repeats whether its prefix was
    /// cached or not and whatever requests share the batch. Costs the tiled kernels' speed.
    pub batch_invariant: bool,
    /// The KV cache's element types, as ggml type ids (`GGML_TYPE_F16` is llama.cpp's
    /// default). llama.cpp refuses a quantized V cache without flash attention.
    pub type_k: u32,
    pub type_v: u32,
    /// The CPU threads poll for the next graph before they sleep (ggml's default). Off where
    /// other threads compute beside the context's graphs (a split pool's CPU lanes, while the
    /// graph waits on the device): polling threads would hold the cores those need.
    pub cpu_threads_poll: bool,
}

impl std::fmt::Debug for ContextParams {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ContextParams")
            .field("n_ctx", &self.n_ctx)
            .field("n_batch", &self.n_batch)
            .field("n_ubatch", &self.n_ubatch)
            .field("n_seq_max", &self.n_seq_max)
            .field("n_threads", &self.n_threads)
            .field("eval_hook", &self.eval_hook.is_some())
            .field("batch_invariant", &self.batch_invariant)
            .field("type_k", &self.type_k)
            .field("type_v", &self.type_v)
            .field("cpu_threads_poll", &self.cpu_threads_poll)
            .finish()
    }
}

impl Default for ContextParams {
    fn default() -> Self {
        let threads = std::thread::available_parallelism().map(|count| count.get() as i32).unwrap_or(4);
        ContextParams {
            n_ctx: 4096,
            n_batch: 512,
            n_ubatch: 512,
            n_seq_max: 1,
            n_threads: threads,
            n_threads_batch: threads,
            embeddings: false,
            op_offload: true,
            kv_unified: false,
            eval_hook: None,
            batch_invariant: false,
            type_k: raw::GGML_TYPE_F16,
            type_v: raw::GGML_TYPE_F16,
            cpu_threads_poll: true,
        }
    }
}

/// A llama.cpp context. Keeps its model alive. Not shared between threads.
pub struct Context {
    pointer: NonNull<raw::llama_context>,
    model: Model,
    n_vocab: i32,
    /// Tokens in the last decoded batch; logits are addressed by batch index.
    batch_tokens: i32,
    params: ContextParams,
    /// Flags that stop a decode between graph nodes when any is set; boxed and kept here
    /// because llama.cpp holds a raw pointer to them.
    #[allow(clippy::box_collection)] // llama.cpp points at the Vec itself; the box keeps it in place.
    abort: Box<Vec<Arc<AtomicBool>>>,
    /// The eval hook, boxed so llama.cpp can hold a thin pointer to it.
    hook: Option<Box<HookCell>>,
    /// The CPU threads every graph of this context runs on (shared with a context made
    /// `beside` it); freed after the last context that uses it.
    threadpool: Option<Arc<ThreadPool>>,
}

/// A persistent ggml CPU threadpool, as llama.cpp's own tools attach one. Without it ggml's CPU
/// backend creates and joins its worker threads for every graph it computes, and with an eval
/// hook the scheduler computes each split as several graphs (a piece up to each observed node),
/// so a streaming decode started threads twice per layer and its main thread spun at the first
/// barrier of each piece until the new thread was scheduled (60% of a streaming run's CPU
/// samples). The workers poll for the next graph at ggml's default level before they sleep:
/// pausing them while the hook waits for a read was slower, since waking a sleeping thread on
/// a virtual CPU costs more than its polling does.
pub(crate) struct ThreadPool {
    pointer: NonNull<raw::ggml_threadpool>,
    n_threads: i32,
    /// Held while a graph runs on the pool: contexts that share it compute one at a time,
    /// whichever threads they are used from.
    turn: std::sync::Mutex<()>,
    free: unsafe extern "C" fn(*mut raw::ggml_threadpool),
}

impl ThreadPool {
    /// `n_threads` workers (the caller's thread counts as one), polling for the next graph at
    /// ggml's default level before they sleep, or (`poll` false) sleeping at once. None where
    /// this build's CPU backend offers no threadpool (ggml then creates threads per graph, as
    /// before).
    pub(crate) fn new(n_threads: i32, poll: bool) -> Option<ThreadPool> {
        type New = unsafe extern "C" fn(*mut raw::ggml_threadpool_params) -> *mut raw::ggml_threadpool;
        type Free = unsafe extern "C" fn(*mut raw::ggml_threadpool);
        // SAFETY: the CPU device and its registry live for the process; the names are C strings;
        // the addresses the registry returns are the functions of those names, with the
        // signatures of ggml-cpu.h, which `New` and `Free` spell out.
        unsafe {
            let device = raw::ggml_backend_dev_by_type(raw::GGML_BACKEND_DEVICE_TYPE_CPU);
            if device.is_null() {
                return None;
            }
            let registry = raw::ggml_backend_dev_backend_reg(device);
            let new = raw::ggml_backend_reg_get_proc_address(registry, c"ggml_threadpool_new".as_ptr());
            let free = raw::ggml_backend_reg_get_proc_address(registry, c"ggml_threadpool_free".as_ptr());
            if new.is_null() || free.is_null() {
                return None;
            }
            let (new, free): (New, Free) =
                (std::mem::transmute::<*mut c_void, New>(new), std::mem::transmute::<*mut c_void, Free>(free));
            let n_threads = n_threads.max(1);
            let mut params = raw::ggml_threadpool_params_default(n_threads);
            if !poll {
                params.poll = 0;
            }
            NonNull::new(new(&mut params)).map(|pointer| ThreadPool {
                pointer,
                n_threads,
                turn: std::sync::Mutex::new(()),
                free,
            })
        }
    }

    /// Held while a graph computes on the pool.
    fn turn(&self) -> std::sync::MutexGuard<'_, ()> {
        self.turn.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Run every graph of `context` on this pool. The caller keeps the pool alive until after
    /// `llama_free(context)`.
    pub(crate) fn attach(&self, context: NonNull<raw::llama_context>) {
        // SAFETY: both pointers are valid; the caller keeps the pool alive past the context's
        // llama_free, and llama.cpp only hands the pool to its CPU backends.
        unsafe { raw::llama_attach_threadpool(context.as_ptr(), self.pointer.as_ptr(), self.pointer.as_ptr()) };
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        // SAFETY: the pool came from ggml_threadpool_new and is freed once, after every context
        // that used it (each holds an Arc, and Context's Drop frees the context first).
        unsafe { (self.free)(self.pointer.as_ptr()) };
    }
}

unsafe extern "C" {
    /// `csrc/context_kernels.cpp`: switch the context's CPU backends to ggml's reference
    /// kernels (or back); returns how many backends it set, or -1 for a null context.
    fn hypura_context_set_reference_kernels(context: *mut raw::llama_context, use_ref: bool) -> i32;
}

unsafe extern "C" fn should_abort(data: *mut c_void) -> bool {
    // SAFETY: `data` is the boxed flag list owned by the Context that registered this
    // callback; the Context outlives every decode that can call it, and the list is replaced
    // only between decodes (&mut self).
    unsafe { &*(data as *const Vec<Arc<AtomicBool>>) }.iter().any(|flag| flag.load(Ordering::Relaxed))
}

// SAFETY: a context may move between threads as long as only one uses it at a time, which
// `&mut self` on every mutating method enforces.
unsafe impl Send for Context {}

impl ContextParams {
    /// llama.cpp's parameters for these (without the eval hook).
    pub(crate) fn to_raw(&self) -> raw::llama_context_params {
        // SAFETY: returns a plain struct by value.
        let mut raw_params = unsafe { raw::llama_context_default_params() };
        raw_params.n_ctx = self.n_ctx;
        raw_params.n_batch = self.n_batch;
        raw_params.n_ubatch = self.n_ubatch;
        raw_params.n_seq_max = self.n_seq_max.max(1);
        raw_params.n_threads = self.n_threads;
        raw_params.n_threads_batch = self.n_threads_batch;
        raw_params.embeddings = self.embeddings;
        raw_params.op_offload = self.op_offload;
        raw_params.kv_unified = self.kv_unified;
        raw_params.type_k = self.type_k;
        raw_params.type_v = self.type_v;
        raw_params.no_perf = true;
        raw_params
    }
}

impl Context {
    pub fn new(model: &Model, params: &ContextParams) -> Result<Context, SysError> {
        Context::with_threads(
            model,
            params,
            ThreadPool::new(params.n_threads.max(params.n_threads_batch), params.cpu_threads_poll).map(Arc::new),
            raw::LLAMA_CONTEXT_TYPE_DEFAULT,
        )
    }

    /// A context whose graphs run on `other`'s CPU threads, for contexts one thread uses in
    /// turn (a draft model's beside its target's): with a pool each, the idle pool's threads
    /// would poll on the cores the busy one computes on.
    pub fn new_beside(model: &Model, params: &ContextParams, other: &Context) -> Result<Context, SysError> {
        Context::beside(model, params, other, raw::LLAMA_CONTEXT_TYPE_DEFAULT)
    }

    /// A multi-token-prediction context on `target`'s model (loaded with
    /// `ModelParams::load_mtp`): its graphs run the model's own MTP layers, which draft tokens
    /// for `target` (llama.cpp's `draft-mtp`). It computes on `target`'s threads.
    pub fn new_mtp(params: &ContextParams, target: &Context) -> Result<Context, SysError> {
        Context::beside(&target.model, params, target, raw::LLAMA_CONTEXT_TYPE_MTP)
    }

    fn beside(
        model: &Model,
        params: &ContextParams,
        other: &Context,
        context_type: raw::llama_context_type,
    ) -> Result<Context, SysError> {
        let wanted = params.n_threads.max(params.n_threads_batch);
        let shared = other.threadpool.as_ref().filter(|pool| pool.n_threads >= wanted).cloned();
        let new = || ThreadPool::new(wanted, params.cpu_threads_poll).map(Arc::new);
        Context::with_threads(model, params, shared.or_else(new), context_type)
    }

    fn with_threads(
        model: &Model,
        params: &ContextParams,
        threadpool: Option<Arc<ThreadPool>>,
        context_type: raw::llama_context_type,
    ) -> Result<Context, SysError> {
        let mut raw_params = params.to_raw();
        raw_params.ctx_type = context_type;
        let hook = params.eval_hook.clone().map(|hook| Box::new(HookCell::new(hook)));
        if let Some(hook) = &hook {
            raw_params.cb_eval = Some(eval_callback);
            raw_params.cb_eval_user_data = &**hook as *const HookCell as *mut c_void;
        }
        crate::log::clear_last_error();
        // SAFETY: the model pointer is valid and outlives the context (we keep a clone of the
        // Model, which holds the Arc); raw_params holds no borrowed pointers.
        let pointer = unsafe { raw::llama_init_from_model(model.as_ptr(), raw_params) };
        let pointer = NonNull::new(pointer).ok_or_else(|| SysError::ContextCreate {
            n_ctx: params.n_ctx,
            n_batch: params.n_batch,
            reason: crate::log::take_last_error().unwrap_or_else(|| "unknown reason".to_string()),
        })?;
        let abort: Box<Vec<Arc<AtomicBool>>> = Box::default();
        // SAFETY: the context is valid; the callback data points at the boxed list, which the
        // Context owns and which is dropped only after llama_free (see Drop).
        unsafe {
            raw::llama_set_abort_callback(
                pointer.as_ptr(),
                Some(should_abort),
                &*abort as *const Vec<Arc<AtomicBool>> as *mut c_void,
            );
        }
        if let Some(pool) = &threadpool {
            pool.attach(pointer);
        }
        if let Some(hook) = &hook {
            hook.attach(pointer.as_ptr());
        }
        let context = Context {
            pointer,
            model: model.clone(),
            n_vocab: model.vocab().n_tokens(),
            batch_tokens: 0,
            params: params.clone(),
            abort,
            hook,
            threadpool,
        };
        if params.batch_invariant {
            // SAFETY: the context is valid; the shim only reads its scheduler's backend list and
            // sets a flag in each CPU backend's own context, before any decode runs.
            let set = unsafe { hypura_context_set_reference_kernels(context.pointer.as_ptr(), true) };
            if set < 1 {
                return Err(SysError::ContextCreate {
                    n_ctx: params.n_ctx,
                    n_batch: params.n_batch,
                    reason: "batch-invariant kernels asked for, but the context has no CPU backend that offers them"
                        .to_string(),
                });
            }
        }
        Ok(context)
    }

    pub(crate) fn as_ptr(&self) -> *mut raw::llama_context {
        self.pointer.as_ptr()
    }

    /// Taken around every call that computes a graph on this context (a shared threadpool must
    /// run one graph at a time).
    pub(crate) fn compute_turn(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        self.threadpool.as_deref().map(ThreadPool::turn)
    }

    /// Abort decodes when any of `flags` is set (by another thread, or by an eval hook): the
    /// running decode stops between graph nodes with `SysError::Aborted` (CPU backend; GPU ops
    /// finish first).
    pub fn set_abort_flags(&mut self, flags: Vec<Arc<AtomicBool>>) {
        let abort = Box::new(flags);
        // SAFETY: the context is valid; the new data pointer points at the new box, which we
        // store in self; the old box is dropped only after llama.cpp switched to the new one,
        // and no decode runs meanwhile (&mut self).
        unsafe {
            raw::llama_set_abort_callback(
                self.pointer.as_ptr(),
                Some(should_abort),
                &*abort as *const Vec<Arc<AtomicBool>> as *mut c_void,
            );
        }
        self.abort = abort;
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn params(&self) -> &ContextParams {
        &self.params
    }

    pub fn n_ctx(&self) -> u32 {
        // SAFETY: the context pointer is valid while `self` lives.
        unsafe { raw::llama_n_ctx(self.pointer.as_ptr()) }
    }

    pub fn n_vocab(&self) -> i32 {
        self.n_vocab
    }

    /// Run the model over a batch. On success the batch's outputs have logits.
    pub fn decode(&mut self, batch: &Batch) -> Result<(), SysError> {
        if batch.is_empty() {
            return Ok(());
        }
        crate::log::clear_last_error();
        if let Some(hook) = &self.hook {
            hook.begin_decode();
        }
        let threadpool = self.threadpool.clone();
        let _turn = threadpool.as_deref().map(ThreadPool::turn);
        // SAFETY: the context is valid and used by this thread only (&mut self); the batch's
        // arrays are valid for its n_tokens entries, which `Batch::push` checked.
        let code = unsafe { raw::llama_decode(self.pointer.as_ptr(), batch.raw()) };
        match code {
            0 => {
                self.batch_tokens = batch.len() as i32;
                Ok(())
            }
            2 => Err(SysError::Aborted),
            code => Err(SysError::Decode {
                code,
                reason: crate::log::take_last_error().unwrap_or_else(|| match code {
                    1 => "no KV cache slot for the batch (context full)".to_string(),
                    _ => "see the llama.cpp log (HYPURA_LOG=llama=debug)".to_string(),
                }),
            }),
        }
    }

    /// Logits of the token at `index` in the last decoded batch (it must have asked for
    /// logits); -1 means the last output.
    pub fn logits(&self, index: i32) -> Result<&[f32], SysError> {
        if index < -1 || index >= self.batch_tokens || self.batch_tokens == 0 {
            return Err(SysError::NoLogits { index, batch_tokens: self.batch_tokens });
        }
        // SAFETY: `index` is -1 or inside the last batch (checked above); llama.cpp returns null
        // for a token that asked for no logits, else n_vocab floats that stay valid until the
        // next decode, which needs &mut self and so cannot happen while this borrow lives.
        let pointer = unsafe { raw::llama_get_logits_ith(self.pointer.as_ptr(), index) };
        if pointer.is_null() {
            return Err(SysError::NoLogits { index, batch_tokens: self.batch_tokens });
        }
        // SAFETY: see above; n_vocab floats are readable.
        Ok(unsafe { std::slice::from_raw_parts(pointer, self.n_vocab as usize) })
    }

    /// Wait until the last decode has finished computing. On a GPU `decode` returns once the
    /// work is queued; timings must wait for it (reading logits waits too).
    pub fn synchronize(&mut self) {
        // SAFETY: the context is valid for as long as `self`.
        unsafe { raw::llama_synchronize(self.pointer.as_ptr()) };
    }

    /// Forget every sequence in the KV cache.
    pub fn clear_memory(&mut self) {
        // SAFETY: the context is valid; its memory handle lives as long as the context.
        unsafe {
            let memory = raw::llama_get_memory(self.pointer.as_ptr());
            raw::llama_memory_clear(memory, true);
        }
        self.batch_tokens = 0;
    }

    /// Bytes `sequence_state` would copy for `seq_id`, measured without copying.
    pub fn sequence_state_size(&self, seq_id: i32) -> usize {
        // SAFETY: the context is valid; the size call only measures.
        unsafe { raw::llama_state_seq_get_size(self.pointer.as_ptr(), seq_id) }
    }

    /// One sequence's KV cache as llama.cpp serializes it (`llama_state_seq_get_data`), in
    /// host memory.
    pub fn sequence_state(&mut self, seq_id: i32) -> Result<Vec<u8>, SysError> {
        let size = self.sequence_state_size(seq_id);
        let mut state = vec![0u8; size];
        // SAFETY: `state` has room for the `size` bytes llama.cpp just measured for this
        // sequence, and llama.cpp writes at most `size` (it catches its own exceptions, 0).
        let written = unsafe { raw::llama_state_seq_get_data(self.pointer.as_ptr(), state.as_mut_ptr(), size, seq_id) };
        if size == 0 || written != size {
            return Err(SysError::State(format!(
                "llama.cpp could not copy sequence {seq_id} ({written} of {size} bytes)"
            )));
        }
        Ok(state)
    }

    /// Replace one sequence's KV cache with a copy from `sequence_state` of a context of the
    /// same model and cache types. On failure llama.cpp leaves the sequence empty.
    pub fn set_sequence_state(&mut self, seq_id: i32, state: &[u8]) -> Result<(), SysError> {
        // SAFETY: the context is valid and `state` is readable for its length; llama.cpp checks
        // what it reads against the length and catches its own exceptions (0).
        let read = unsafe { raw::llama_state_seq_set_data(self.pointer.as_ptr(), state.as_ptr(), state.len(), seq_id) };
        if read == 0 {
            self.truncate_sequence(seq_id, 0);
            return Err(SysError::State(format!("llama.cpp could not restore sequence {seq_id}")));
        }
        Ok(())
    }

    /// Write one sequence's KV cache, with the tokens it holds, to `path` (llama.cpp's
    /// sequence state file, whose layout `state` reads). llama.cpp streams it a layer's range at
    /// a time, so this takes no host memory the size of the cache. Returns the bytes written.
    pub fn save_sequence(&mut self, seq_id: i32, path: &std::path::Path, tokens: &[Token]) -> Result<u64, SysError> {
        let c_path = crate::error::c_path(path)?;
        // SAFETY: the context is valid, the path is a NUL-terminated string and `tokens` is
        // readable for its length; llama.cpp catches its own exceptions and returns 0.
        let written = unsafe {
            raw::llama_state_seq_save_file(
                self.pointer.as_ptr(),
                c_path.as_ptr(),
                seq_id,
                tokens.as_ptr(),
                tokens.len(),
            )
        };
        if written == 0 {
            return Err(SysError::State(format!("llama.cpp could not save sequence {seq_id} to {}", path.display())));
        }
        Ok(written as u64)
    }

    /// Replace one sequence's KV cache with the one saved in `path`, returning its tokens (at
    /// most `capacity`). On failure llama.cpp leaves the sequence empty.
    pub fn load_sequence(
        &mut self,
        seq_id: i32,
        path: &std::path::Path,
        capacity: usize,
    ) -> Result<Vec<Token>, SysError> {
        let c_path = crate::error::c_path(path)?;
        let mut tokens: Vec<Token> = vec![0; capacity];
        let mut count = 0usize;
        // SAFETY: the context is valid, the path is NUL-terminated, `tokens` has room for
        // `capacity` tokens and llama.cpp writes at most that many (it refuses larger files);
        // it catches its own exceptions and returns 0.
        let read = unsafe {
            raw::llama_state_seq_load_file(
                self.pointer.as_ptr(),
                c_path.as_ptr(),
                seq_id,
                tokens.as_mut_ptr(),
                capacity,
                &mut count,
            )
        };
        if read == 0 || count > capacity {
            self.truncate_sequence(seq_id, 0);
            return Err(SysError::State(format!("llama.cpp could not load sequence {seq_id} from {}", path.display())));
        }
        tokens.truncate(count);
        Ok(tokens)
    }

    /// Whether the KV cache can move cells to other positions (`shift_sequence`): not with
    /// multi-dimensional positions (M-RoPE), nor sliding windows of another size than the
    /// cache. A recurrent state says it can, and then refuses to drop a middle range.
    pub fn can_shift(&self) -> bool {
        // SAFETY: the context is valid, and so is the memory it owns.
        unsafe { raw::llama_memory_can_shift(raw::llama_get_memory(self.pointer.as_ptr())) }
    }

    /// Drop positions `keep..keep + discard` of one sequence and move the cells after them
    /// `discard` positions back (llama.cpp rotates their keys at the next decode), so the
    /// sequence continues at its length less `discard`. False where the memory refuses, which
    /// leaves it unchanged (a hybrid model's recurrent part refuses before its KV cache is cut).
    pub fn shift_sequence(&mut self, seq_id: i32, keep: i32, discard: i32) -> bool {
        if keep < 0 || discard <= 0 || !self.can_shift() {
            return false;
        }
        // SAFETY: the context is valid; -1 means "to the end".
        unsafe {
            let memory = raw::llama_get_memory(self.pointer.as_ptr());
            if !raw::llama_memory_seq_rm(memory, seq_id, keep, keep + discard) {
                return false;
            }
            raw::llama_memory_seq_add(memory, seq_id, keep + discard, -1, -discard);
        }
        true
    }

    /// The first and last positions one sequence's memory holds (None when it holds none).
    pub fn sequence_positions(&self, seq_id: i32) -> Option<(i32, i32)> {
        // SAFETY: the context is valid, and so is the memory it owns; -1 means empty.
        let (first, last) = unsafe {
            let memory = raw::llama_get_memory(self.pointer.as_ptr());
            (raw::llama_memory_seq_pos_min(memory, seq_id), raw::llama_memory_seq_pos_max(memory, seq_id))
        };
        (first >= 0 && last >= first).then_some((first, last))
    }

    /// Remove positions `from..` of one sequence from the KV cache.
    pub fn truncate_sequence(&mut self, seq_id: i32, from: i32) -> bool {
        // SAFETY: the context is valid; -1 means "to the end".
        unsafe {
            let memory = raw::llama_get_memory(self.pointer.as_ptr());
            raw::llama_memory_seq_rm(memory, seq_id, from, -1)
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the pointer came from llama_init_from_model and is freed exactly once, before
        // our clone of the Model (and so possibly the model itself) is dropped.
        unsafe { raw::llama_free(self.pointer.as_ptr()) };
        drop(self.threadpool.take());
    }
}
