//! The eval hook: llama.cpp's `cb_eval`, narrowed to the few graph nodes where Hypura must act.
//!
//! ggml's scheduler asks the callback about every node; each node it answers "yes" for ends a
//! compute segment and synchronises the device before `observe` runs. So `wants` must say yes
//! only where a decision is due (one node per layer), never for every node.
//!
//! A stop also ends what a backend may fuse: CUDA computes a router's softmax, top-k, weights
//! and their normalisation as one kernel only where they lie in one segment, and its fused
//! kernel's last bits differ from the separate ones'. So a hook may *keep* a node it needs
//! (the router's ids) without stopping there, and stop at a later node, past the fused run,
//! where `ObservedNode::kept` hands the kept node back.
use std::ffi::{c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};

use llama_cpp_sys_2 as raw;

/// Decisions at chosen graph nodes. Called from llama.cpp's compute thread.
///
/// A hook cannot fail the graph by itself: ggml treats a "no" from the callback as "skip the
/// rest of this split" and still reports success, so later nodes would be missing and the
/// logits garbage. A hook that must stop the decode sets an abort flag registered with
/// `Context::set_abort_flags`; the CPU backend then aborts before the next node and the decode
/// returns `SysError::Aborted`.
pub trait EvalHook: Send + Sync {
    /// Whether to stop at this node (by its name, e.g. `ffn_norm-7`). Called for every node of
    /// every graph: it must be cheap.
    fn wants(&self, name: &str) -> bool;
    /// Where `wants` said no: whether to keep this node for the next stop's `observe`
    /// (`ObservedNode::kept`). Called for every such node: it must be cheap.
    fn keeps(&self, _name: &str) -> bool {
        false
    }
    /// The node has been computed; the graph continues when this returns.
    fn observe(&self, node: &ObservedNode<'_>);
    /// A decode begins: whatever the hook tracked between a kept node and its stop in an
    /// earlier decode (one aborted between them) is void.
    fn begin_decode(&self) {}
}

/// What llama.cpp's callback data points at: the hook, and the nodes it kept since its last
/// stop (by address; only within the graph being computed, see `HookCell::begin_decode`).
pub(crate) struct HookCell {
    hook: Arc<dyn EvalHook>,
    kept: Mutex<Vec<usize>>,
    /// The context's backends (by address, set once it exists): an input the hook rewrites is
    /// written through the backend whose buffers hold it, in that backend's own queue, ahead
    /// of the nodes that read it, instead of in a copy the host waits for (`Span::write`).
    backends: OnceLock<Vec<usize>>,
    /// The bytes of the last write queued on a backend, kept until the next stop: ggml's
    /// scheduler synchronises the backend before it calls the hook again.
    queued: Mutex<Vec<u8>>,
}

unsafe extern "C" {
    fn hypura_context_backends(
        context: *mut raw::llama_context,
        out: *mut raw::ggml_backend_t,
        max: std::ffi::c_int,
    ) -> std::ffi::c_int;
}

impl HookCell {
    pub(crate) fn new(hook: Arc<dyn EvalHook>) -> HookCell {
        HookCell { hook, kept: Mutex::new(Vec::new()), backends: OnceLock::new(), queued: Mutex::new(Vec::new()) }
    }

    /// Learn `context`'s backends (once, before its first decode; a context without a
    /// scheduler leaves writes synchronous).
    pub(crate) fn attach(&self, context: *mut raw::llama_context) {
        let mut backends: Vec<raw::ggml_backend_t> = vec![std::ptr::null_mut(); 16];
        // SAFETY: the context is live (just created by the caller); the shim writes at most
        // `backends.len()` pointers into the vector.
        let count =
            unsafe { hypura_context_backends(context, backends.as_mut_ptr(), backends.len() as std::ffi::c_int) };
        let found = backends.into_iter().take(count.max(0) as usize).filter(|backend| !backend.is_null());
        let _ = self.backends.set(found.map(|backend| backend as usize).collect());
    }

    /// The backend whose default buffer type holds `tensor`'s buffer, if the context has one
    /// (the one that computes it; its asynchronous writes accept that buffer).
    fn backend_for(&self, tensor: &raw::ggml_tensor) -> Option<raw::ggml_backend_t> {
        let buffer = buffer_of(tensor);
        if buffer.is_null() {
            return None;
        }
        // SAFETY: a live tensor's buffer; the backends are the live context's (the cell lives
        // no longer than the context that attached it).
        unsafe {
            let buffer_type = raw::ggml_backend_buffer_get_type(buffer);
            self.backends
                .get()?
                .iter()
                .map(|&backend| backend as raw::ggml_backend_t)
                .find(|&backend| raw::ggml_backend_get_default_buffer_type(backend) == buffer_type)
        }
    }

    /// Forget nodes kept by an earlier decode (one a stop never followed, as where a decode
    /// was aborted): their graph is gone.
    pub(crate) fn begin_decode(&self) {
        self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clear();
        self.hook.begin_decode();
    }
}

/// A computed graph node, as the hook sees it.
pub struct ObservedNode<'a> {
    tensor: &'a raw::ggml_tensor,
    name: &'a str,
    kept: &'a [usize],
    /// The callback's cell (None in tests that make nodes by hand): its backends take writes.
    cell: Option<&'a HookCell>,
}

impl ObservedNode<'_> {
    pub fn name(&self) -> &str {
        self.name
    }

    /// The node named `name` that the hook kept since its last stop (computed: it came
    /// earlier in this graph), else None.
    pub fn kept(&self, name: &str) -> Option<ObservedNode<'_>> {
        self.kept.iter().rev().find_map(|&address| {
            // SAFETY: kept addresses are nodes of the graph being computed, kept by this
            // callback since its last stop (`HookCell::begin_decode` drops those of earlier
            // decodes); ggml frees a graph only after its compute returns.
            let tensor = unsafe { &*(address as *const raw::ggml_tensor) };
            let node = ObservedNode { tensor, name: tensor_name(tensor), kept: &[], cell: self.cell };
            (node.name == name).then_some(node)
        })
    }

    /// Element counts per dimension (ggml's `ne`).
    pub fn shape(&self) -> [i64; 4] {
        self.tensor.ne
    }

    /// The rows of an I32 node (e.g. `ffn_moe_topk-L`: expert ids per token) honouring its
    /// strides: the top-k tensor is a view whose rows are `nb[1]` bytes apart. Returns None for
    /// other types or a tensor without data.
    pub fn i32_rows(&self) -> Option<Vec<Vec<i32>>> {
        rows(self.tensor, raw::GGML_TYPE_I32, i32::from_ne_bytes)
    }

    /// The node's own rows where it is an F32 matrix (e.g. `ffn_norm-L`: the FFN's input, one
    /// row per token), else None.
    pub fn f32_rows(&self) -> Option<Vec<Vec<f32>>> {
        rows(self.tensor, raw::GGML_TYPE_F32, f32::from_ne_bytes)
    }

    /// The rows of the node's I32 input `input` (from `ffn_moe_weights-L`, input 1 is the
    /// router's expert ids per token), else None.
    pub fn input_i32_rows(&self, input: usize) -> Option<Vec<Vec<i32>>> {
        rows(self.input(input)?, raw::GGML_TYPE_I32, i32::from_ne_bytes)
    }

    /// Overwrite the node's I32 input `input` with `values`, which must have its shape (one
    /// row per token). Nodes that read that input later in the graph see the new values:
    /// the store rewrites expert ids to the slots of a device's expert pool so. One copy to the
    /// backend: a strided input's span is read, patched and written whole (the bytes between
    /// its rows, another view's, written back as they were). The copy is queued on the
    /// context's backend that computes the input (`HookCell::backend_for`), ahead of the nodes
    /// that read it, where there is one; else the host waits for it.
    pub fn write_input_i32_rows(&self, input: usize, values: &[Vec<i32>]) -> Result<(), crate::SysError> {
        let bad = || crate::SysError::State(format!("{}: input {input} is not an I32 matrix of that shape", self.name));
        let tensor = self.input(input).ok_or_else(bad)?;
        self.write_rows(tensor, raw::GGML_TYPE_I32, values, i32::to_ne_bytes).ok_or_else(bad)
    }

    /// Overwrite this node's own F32 rows with `values` (its shape: one row per token), as
    /// `write_input_i32_rows` writes an input: the nodes after this stop read the new values.
    pub fn write_f32_rows(&self, values: &[Vec<f32>]) -> Result<(), crate::SysError> {
        self.write_rows(self.tensor, raw::GGML_TYPE_F32, values, f32::to_ne_bytes)
            .ok_or_else(|| crate::SysError::State(format!("{} is not an F32 matrix of that shape", self.name)))
    }

    /// `values` into `tensor`'s rows, where it is a computed 2-D tensor of `ggml_type` of
    /// their shape (else None, nothing written).
    fn write_rows<T: Copy>(
        &self,
        tensor: &raw::ggml_tensor,
        ggml_type: raw::ggml_type,
        values: &[Vec<T>],
        encode: fn(T) -> [u8; 4],
    ) -> Option<()> {
        let [columns, rows, ..] = tensor.ne;
        let shaped = values.len() as i64 == rows && values.iter().all(|row| row.len() as i64 == columns);
        let span = Span::of(tensor, ggml_type).filter(|_| shaped)?;
        let mut bytes = if span.packed() { vec![0u8; span.bytes] } else { span.read(tensor) };
        for (index, row) in values.iter().enumerate() {
            let at = index * span.row_stride;
            for (slot, &value) in bytes[at..at + span.row_bytes].chunks_exact_mut(4).zip(row) {
                slot.copy_from_slice(&encode(value));
            }
        }
        match self.cell.and_then(|cell| Some((cell.backend_for(tensor)?, cell))) {
            Some((backend, cell)) => {
                let mut queued = cell.queued.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                *queued = bytes;
                span.write_queued(tensor, &queued, backend);
            }
            None => span.write(tensor, &bytes),
        }
        Some(())
    }

    /// The node's F32 values in memory order, where it is a computed contiguous F32 tensor of
    /// any shape (the router's final weights are `[1, n_expert_used, n_tokens]`), else None.
    pub fn f32_values(&self) -> Option<Vec<f32>> {
        let tensor = self.tensor;
        // SAFETY: a live graph node; ggml_is_contiguous only reads its header.
        let contiguous = unsafe { raw::ggml_is_contiguous(tensor) };
        if tensor.type_ != raw::GGML_TYPE_F32 || tensor.data.is_null() || buffer_of(tensor).is_null() || !contiguous {
            return None;
        }
        // SAFETY: as above.
        let count = unsafe { raw::ggml_nelements(tensor) }.max(0) as usize;
        let mut values = vec![0f32; count];
        if count > 0 {
            // SAFETY: a computed contiguous F32 tensor with a buffer holds `count` floats from its
            // data; `values` holds as many. ggml waits for this callback before reusing memory.
            unsafe {
                raw::ggml_backend_tensor_get(
                    tensor as *const raw::ggml_tensor as *mut raw::ggml_tensor,
                    values.as_mut_ptr() as *mut c_void,
                    0,
                    count * 4,
                );
            }
        }
        Some(values)
    }

    /// The node the hook kept last since its last stop, else None.
    pub fn last_kept(&self) -> Option<ObservedNode<'_>> {
        let &address = self.kept.last()?;
        // SAFETY: as in `kept`.
        let tensor = unsafe { &*(address as *const raw::ggml_tensor) };
        Some(ObservedNode { tensor, name: tensor_name(tensor), kept: &[], cell: self.cell })
    }

    fn input(&self, input: usize) -> Option<&raw::ggml_tensor> {
        let source = *self.tensor.src.get(input)?;
        // SAFETY: a non-null source of a live graph node is a live tensor of the same graph.
        (!source.is_null()).then(|| unsafe { &*source })
    }

    /// The F32 rows of input `input` of the node named `ancestor`, found among this node's
    /// sources at most `max_depth` steps up. From `ffn_moe_weights-L`, ancestor
    /// `ffn_moe_logits-L` input 1 is the hidden state the router was applied to (still live:
    /// the expert matmuls read it after this node). None if there is no such node or it is not
    /// an F32 matrix.
    pub fn ancestor_input_f32_rows(&self, ancestor: &str, input: usize, max_depth: usize) -> Option<Vec<Vec<f32>>> {
        let found = find_source(self.tensor, ancestor, max_depth)?;
        let source = *found.src.get(input)?;
        if source.is_null() {
            return None;
        }
        // SAFETY: a non-null source of a live graph node is a live tensor of the same graph.
        rows(unsafe { &*source }, raw::GGML_TYPE_F32, f32::from_ne_bytes)
    }
}

/// The routed experts' tensors of a layer as the CPU computes them: their ggml types and the
/// FFN's widths (`CpuExperts::compute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    pub gate_type: i32,
    pub up_type: i32,
    pub down_type: i32,
    pub n_embd: usize,
    pub n_ff: usize,
}

impl ExpertShape {
    /// One expert's bytes of gate, up and down; None for a type ggml does not know.
    pub fn slice_bytes(&self) -> Option<[usize; 3]> {
        let row = |ggml_type: i32, width: usize| -> Option<usize> {
            let count = u32::try_from(ggml_type).ok().filter(|&value| value < raw::GGML_TYPE_COUNT)?;
            // SAFETY: a type below GGML_TYPE_COUNT is one of ggml's; the call only reads its
            // traits table.
            let block = unsafe { raw::ggml_blck_size(count as raw::ggml_type) };
            if block <= 0 || width as i64 % block != 0 {
                return None;
            }
            // SAFETY: as above.
            Some(unsafe { raw::ggml_row_size(count as raw::ggml_type, width as i64) })
        };
        Some([
            row(self.gate_type, self.n_embd)? * self.n_ff,
            row(self.up_type, self.n_embd)? * self.n_ff,
            row(self.down_type, self.n_ff)? * self.n_embd,
        ])
    }

    /// The FFN's width in up to `wanted` parts of whole blocks of down's type (an expert's
    /// parts are computed apart and summed: `HostExpert::ff`).
    pub fn parts(&self, wanted: usize) -> Vec<std::ops::Range<usize>> {
        let block = u32::try_from(self.down_type)
            .ok()
            .filter(|&value| value < raw::GGML_TYPE_COUNT)
            // SAFETY: a type below GGML_TYPE_COUNT is one of ggml's; the call only reads its
            // traits table.
            .map_or(0, |value| unsafe { raw::ggml_blck_size(value as raw::ggml_type) } as usize);
        if block == 0 || !self.n_ff.is_multiple_of(block) {
            return std::iter::once(0..self.n_ff).collect();
        }
        let blocks = self.n_ff / block;
        let parts = wanted.clamp(1, blocks);
        (0..parts).map(|part| (blocks * part / parts) * block..(blocks * (part + 1) / parts) * block).collect()
    }
}

/// One token's one expert for the CPU: its slices in host memory, its router weight, and the
/// part of the FFN's width to compute (`ExpertShape::parts`): the parts of an expert sum to it.
pub struct HostExpert<'a> {
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
    pub token: usize,
    pub weight: f32,
    pub ff: std::ops::Range<usize>,
}

/// `struct hypura_expert_job` of `csrc/expert_ffn.c`.
#[repr(C)]
struct RawExpertJob {
    gate: *const c_void,
    up: *const c_void,
    down: *const c_void,
    token: i32,
    weight: f32,
    ff_start: i64,
    ff_len: i64,
}

unsafe extern "C" {
    fn hypura_backend_set_threads(backend: raw::ggml_backend_t, n_threads: std::ffi::c_int) -> std::ffi::c_int;
    fn hypura_expert_ffn(
        cpu: raw::ggml_backend_t,
        gate_type: i32,
        up_type: i32,
        down_type: i32,
        n_embd: i64,
        n_ff: i64,
        x: *const f32,
        n_tokens: i64,
        jobs: *const RawExpertJob,
        n_jobs: i32,
        out: *mut f32,
    ) -> std::ffi::c_int;
}

/// A CPU backend of its own (ggml's kernels, its own threads) that computes routed experts
/// from their bytes in host memory, beside a device that computes the others: the split of a
/// pooled MoE layer. It runs on a thread of its own, while the context's graph computes.
pub struct CpuExperts {
    backend: std::ptr::NonNull<raw::ggml_backend>,
}

// SAFETY: the backend is owned by this value and used by one thread at a time (`&mut self`).
unsafe impl Send for CpuExperts {}

impl CpuExperts {
    /// A CPU backend computing with `threads` threads.
    pub fn new(threads: usize) -> Result<CpuExperts, crate::SysError> {
        // SAFETY: ggml's CPU device is always registered; a null return is checked.
        let backend = unsafe { raw::ggml_backend_init_by_type(raw::GGML_BACKEND_DEVICE_TYPE_CPU, std::ptr::null()) };
        let backend = std::ptr::NonNull::new(backend).ok_or(crate::SysError::Allocation("a CPU backend"))?;
        let experts = CpuExperts { backend };
        // SAFETY: a live CPU backend, just made (freed by `experts` if this fails).
        let set = unsafe { hypura_backend_set_threads(experts.backend.as_ptr(), threads.max(1) as std::ffi::c_int) };
        if set != 0 {
            return Err(crate::SysError::State("the CPU backend takes no thread count".into()));
        }
        Ok(experts)
    }

    /// For each job, `weight × down(silu(gate·x) ⊙ (up·x))` of its token's row of `x`, summed
    /// per token into the returned rows (zero where a token has no job). The slices are the
    /// experts' bytes in host memory, of `shape`'s types and widths.
    pub fn compute(
        &mut self,
        shape: &ExpertShape,
        x: &[Vec<f32>],
        jobs: &[HostExpert<'_>],
    ) -> Result<Vec<Vec<f32>>, crate::SysError> {
        // SAFETY: this value's own live CPU backend, used by this call alone (`&mut self`).
        unsafe { experts_on(self.backend.as_ptr(), shape, x, jobs) }
    }
}

impl Drop for CpuExperts {
    fn drop(&mut self) {
        // SAFETY: made in `new`, freed once, here.
        unsafe { raw::ggml_backend_free(self.backend.as_ptr()) };
    }
}

/// `CpuExperts::compute` on `backend`.
///
/// # Safety
/// `backend` is a live CPU backend that computes nothing else during the call.
unsafe fn experts_on(
    backend: raw::ggml_backend_t,
    shape: &ExpertShape,
    x: &[Vec<f32>],
    jobs: &[HostExpert<'_>],
) -> Result<Vec<Vec<f32>>, crate::SysError> {
    let n_embd = shape.n_embd;
    let mut out = vec![0f32; n_embd * x.len()];
    let bad = |why: &str| crate::SysError::State(format!("experts on the CPU: {why}"));
    if n_embd == 0 || x.iter().any(|row| row.len() != n_embd) {
        return Err(bad("an input row is not n_embd wide"));
    }
    if jobs.is_empty() {
        return Ok(out.chunks(n_embd).map(<[f32]>::to_vec).collect());
    }
    let sizes = shape.slice_bytes().ok_or_else(|| bad("unknown tensor types"))?;
    let mut raw_jobs = Vec::with_capacity(jobs.len());
    for job in jobs {
        if job.token >= x.len() || [job.gate.len(), job.up.len(), job.down.len()] != sizes {
            return Err(bad("a job's token or slices do not fit the shape"));
        }
        if job.ff.is_empty() || job.ff.end > shape.n_ff {
            return Err(bad("a job's part is not within the FFN's width"));
        }
        raw_jobs.push(RawExpertJob {
            gate: job.gate.as_ptr().cast(),
            up: job.up.as_ptr().cast(),
            down: job.down.as_ptr().cast(),
            token: job.token as i32,
            weight: job.weight,
            ff_start: job.ff.start as i64,
            ff_len: job.ff.len() as i64,
        });
    }
    let input: Vec<f32> = x.concat();
    // SAFETY: the caller's backend; every job's slices were checked to hold their tensors' bytes
    // and its token to be a row of `input`; `input` and `out` hold `n_embd × rows` floats; the
    // shim reads the slices and writes `out` only during the call.
    let status = unsafe {
        hypura_expert_ffn(
            backend,
            shape.gate_type,
            shape.up_type,
            shape.down_type,
            n_embd as i64,
            shape.n_ff as i64,
            input.as_ptr(),
            x.len() as i64,
            raw_jobs.as_ptr(),
            raw_jobs.len() as i32,
            out.as_mut_ptr(),
        )
    };
    if status != 0 {
        return Err(bad(&format!("ggml's CPU backend failed ({status})")));
    }
    Ok(out.chunks(n_embd).map(<[f32]>::to_vec).collect())
}

/// Depth-first search of `tensor`'s sources for a node named `name`.
fn find_source<'a>(tensor: &'a raw::ggml_tensor, name: &str, depth: usize) -> Option<&'a raw::ggml_tensor> {
    if depth == 0 {
        return None;
    }
    for &source in &tensor.src {
        if source.is_null() {
            continue;
        }
        // SAFETY: the sources of a live graph node are live tensors of the same graph.
        let source = unsafe { &*source };
        if tensor_name(source) == name {
            return Some(source);
        }
        if let Some(found) = find_source(source, name, depth - 1) {
            return Some(found);
        }
    }
    None
}

fn tensor_name(tensor: &raw::ggml_tensor) -> &str {
    // SAFETY: ggml tensor names are NUL-terminated within their fixed array.
    unsafe { CStr::from_ptr(tensor.name.as_ptr()) }.to_str().unwrap_or("")
}

/// The buffer ggml_backend_tensor_get/set go through (`view_src ? view_src->buffer : buffer`);
/// they abort where it is null, so callers check it.
fn buffer_of(tensor: &raw::ggml_tensor) -> raw::ggml_backend_buffer_t {
    if tensor.view_src.is_null() {
        tensor.buffer
    } else {
        // SAFETY: view_src of a live tensor is a live tensor.
        unsafe { &*tensor.view_src }.buffer
    }
}

/// Where a 2-D tensor of 4-byte elements lies in its backend buffer: `rows` rows of
/// `row_bytes`, `row_stride` bytes apart (ggml's `nb[1]`; the top-k ids are a view whose rows are
/// farther apart than they are long), `bytes` from the first row's start to the last one's end.
struct Span {
    rows: usize,
    row_bytes: usize,
    row_stride: usize,
    bytes: usize,
}

impl Span {
    /// The span of `tensor` if it is a computed 2-D tensor of `ggml_type` (4-byte elements)
    /// with a buffer, else None.
    fn of(tensor: &raw::ggml_tensor, ggml_type: raw::ggml_type) -> Option<Span> {
        let has_buffer = !buffer_of(tensor).is_null();
        if tensor.type_ != ggml_type || tensor.data.is_null() || !has_buffer {
            return None;
        }
        let [columns, rows, third, fourth] = tensor.ne;
        let [element_stride, row_stride, ..] = tensor.nb;
        if columns < 0 || rows < 0 || third != 1 || fourth != 1 || element_stride != 4 {
            return None;
        }
        let (rows, row_bytes) = (rows as usize, columns as usize * 4);
        let bytes = if rows == 0 { 0 } else { (rows - 1) * row_stride + row_bytes };
        Some(Span { rows, row_bytes, row_stride, bytes })
    }

    /// Whether the rows follow each other with nothing between them.
    fn packed(&self) -> bool {
        self.rows <= 1 || self.row_stride == self.row_bytes
    }

    /// The span's bytes, in one copy from the backend (device memory as well as host memory).
    fn read(&self, tensor: &raw::ggml_tensor) -> Vec<u8> {
        let mut bytes = vec![0u8; self.bytes];
        if self.bytes > 0 {
            // SAFETY: `Span::of` checked the tensor is computed, has a buffer and is 2-D with
            // 4-byte elements; its span, `(ne[1] - 1) * nb[1] + ne[0] * 4` bytes from its
            // start, is ggml_nbytes of such a tensor, so it lies inside it; `bytes` holds
            // exactly that many. ggml waits for this callback before reusing memory.
            unsafe {
                raw::ggml_backend_tensor_get(
                    tensor as *const raw::ggml_tensor as *mut raw::ggml_tensor,
                    bytes.as_mut_ptr() as *mut c_void,
                    0,
                    bytes.len(),
                );
            }
        }
        bytes
    }

    /// Write the span's `bytes` in one copy queued on `backend` (the one whose buffer type
    /// holds the tensor, `HookCell::backend_for`); `bytes` must stay until it synchronises.
    fn write_queued(&self, tensor: &raw::ggml_tensor, bytes: &[u8], backend: raw::ggml_backend_t) {
        assert_eq!(bytes.len(), self.bytes, "a span is written whole");
        if bytes.is_empty() {
            return;
        }
        // SAFETY: as in `write`; the backend's default buffer type is the tensor's buffer's
        // (what its asynchronous write asserts), and the caller keeps `bytes` (the cell's
        // queued write) until the scheduler synchronises the backend at the next stop or at
        // the graph's end, before the nodes after this stop are computed by anything else.
        unsafe {
            raw::ggml_backend_tensor_set_async(
                backend,
                tensor as *const raw::ggml_tensor as *mut raw::ggml_tensor,
                bytes.as_ptr() as *const c_void,
                0,
                bytes.len(),
            );
        }
    }

    /// Write the span's `bytes` (as `read` returned them, patched) in one copy.
    fn write(&self, tensor: &raw::ggml_tensor, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.bytes, "a span is written whole");
        if bytes.is_empty() {
            return;
        }
        // SAFETY: as in `read`: the span lies inside the computed tensor and `bytes` holds
        // exactly its length. ggml runs the nodes that read it only after this callback returns.
        unsafe {
            raw::ggml_backend_tensor_set(
                tensor as *const raw::ggml_tensor as *mut raw::ggml_tensor,
                bytes.as_ptr() as *const c_void,
                0,
                bytes.len(),
            );
        }
    }
}

/// The rows of a 2-D tensor of `ggml_type` with 4-byte elements, read through the backend in
/// one copy (a prompt batch's thousands of rows cost one transfer, not one each), honouring
/// the row stride `nb[1]`.
fn rows<T>(tensor: &raw::ggml_tensor, ggml_type: raw::ggml_type, decode: fn([u8; 4]) -> T) -> Option<Vec<Vec<T>>> {
    let span = Span::of(tensor, ggml_type)?;
    let bytes = span.read(tensor);
    Some(
        (0..span.rows)
            .map(|row| {
                let at = row * span.row_stride;
                bytes[at..at + span.row_bytes]
                    .chunks_exact(4)
                    .map(|chunk| decode([chunk[0], chunk[1], chunk[2], chunk[3]]))
                    .collect()
            })
            .collect(),
    )
}

pub(crate) unsafe extern "C" fn eval_callback(
    tensor: *mut raw::ggml_tensor,
    ask: bool,
    user_data: *mut c_void,
) -> bool {
    if tensor.is_null() || user_data.is_null() {
        return !ask;
    }
    // SAFETY: user_data is the boxed HookCell owned by the Context that registered this
    // callback, alive for the context's life; the tensor is a live graph node.
    let (cell, tensor) = unsafe { (&*(user_data as *const HookCell), &*tensor) };
    let name = tensor_name(tensor);
    // Asked about every node: the list is locked only for a node kept or a stop.
    let kept = || cell.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if ask {
        if cell.hook.wants(name) {
            return true;
        }
        if cell.hook.keeps(name) {
            kept().push(tensor as *const raw::ggml_tensor as usize);
        }
        false
    } else {
        let mut kept = kept();
        cell.hook.observe(&ObservedNode { tensor, name, kept: &kept, cell: Some(cell) });
        kept.clear();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ggml's objects for one test: a context of tensors (no data) and the CPU buffer under them.
    struct Tensors {
        context: *mut raw::ggml_context,
        buffer: raw::ggml_backend_buffer_t,
    }

    impl Drop for Tensors {
        fn drop(&mut self) {
            // SAFETY: both were made by `strided_ids` and are freed once, here.
            unsafe {
                raw::ggml_backend_buffer_free(self.buffer);
                raw::ggml_free(self.context);
            }
        }
    }

    /// A node whose input 1 is the first `columns` of each of `rows` rows of an 8-column I32
    /// matrix (the router's top-k ids are such a view of its argsort), the matrix holding
    /// `row * 100 + column`: the tensors, the node and the matrix.
    fn strided_ids(columns: i64, rows: i64) -> (Tensors, *mut raw::ggml_tensor, *mut raw::ggml_tensor) {
        // SAFETY: a context without allocation holds tensor headers only; the CPU buffer type
        // then backs them all; every pointer used is one ggml just returned, checked non-null.
        unsafe {
            let context = raw::ggml_init(raw::ggml_init_params {
                mem_size: 16 * raw::ggml_tensor_overhead(),
                mem_buffer: std::ptr::null_mut(),
                no_alloc: true,
            });
            assert!(!context.is_null());
            let matrix = raw::ggml_new_tensor_2d(context, raw::GGML_TYPE_I32, 8, rows);
            let view = raw::ggml_view_2d(context, matrix, columns, rows, (*matrix).nb[1], 0);
            let node = raw::ggml_add(context, view, view);
            let buffer = raw::ggml_backend_alloc_ctx_tensors_from_buft(context, raw::ggml_backend_cpu_buffer_type());
            assert!(!buffer.is_null());
            let values: Vec<i32> =
                (0..rows as i32).flat_map(|row| (0..8).map(move |column| row * 100 + column)).collect();
            raw::ggml_backend_tensor_set(matrix, values.as_ptr() as *const c_void, 0, values.len() * 4);
            (Tensors { context, buffer }, node, matrix)
        }
    }

    fn matrix_rows(matrix: *mut raw::ggml_tensor) -> Vec<Vec<i32>> {
        // SAFETY: the matrix is a live, allocated tensor of `strided_ids`.
        rows(unsafe { &*matrix }, raw::GGML_TYPE_I32, i32::from_ne_bytes).expect("an I32 matrix")
    }

    /// Experts computed by the CPU backend: each job's `weight × down(silu(gate·x) ⊙ (up·x))`
    /// summed per token, as a naive computation of the same F32 weights gives it, an expert
    /// computed in parts of the FFN's width (`ExpertShape::parts`) as whole; a token without a
    /// job gets zeros; slices of the wrong size and parts outside the width are refused.
    #[test]
    fn experts_on_the_cpu_sum_each_tokens_weighted_swiglu() {
        let (n_embd, n_ff) = (8usize, 4usize);
        let value = |seed: usize| ((seed * 7919 % 113) as f32 - 56.0) / 64.0;
        let matrix = |seed: usize, rows: usize, columns: usize| -> Vec<f32> {
            (0..rows * columns).map(|index| value(seed * 1000 + index)).collect()
        };
        let bytes = |values: &[f32]| -> Vec<u8> { values.iter().flat_map(|v| v.to_ne_bytes()).collect() };
        // Two experts: gate and up are n_ff rows of n_embd, down n_embd rows of n_ff.
        let experts: Vec<[Vec<f32>; 3]> = (1..=2)
            .map(|e| [matrix(3 * e, n_ff, n_embd), matrix(3 * e + 1, n_ff, n_embd), matrix(3 * e + 2, n_embd, n_ff)])
            .collect();
        let slices: Vec<[Vec<u8>; 3]> = experts.iter().map(|[g, u, d]| [bytes(g), bytes(u), bytes(d)]).collect();
        let x: Vec<Vec<f32>> = (0..3).map(|t| (0..n_embd).map(|i| value(50 + 10 * t + i)).collect()).collect();
        let jobs = [(0usize, 0usize, 0.75f32), (0, 1, 0.25), (2, 1, 1.5)];
        let f32_type = raw::GGML_TYPE_F32 as i32;
        let shape = ExpertShape { gate_type: f32_type, up_type: f32_type, down_type: f32_type, n_embd, n_ff };
        assert_eq!(shape.parts(3), [0..1, 1..2, 2..4]);
        assert_eq!(shape.parts(9).len(), n_ff);
        // The last job in three parts of the width, the others whole.
        let host: Vec<HostExpert<'_>> = jobs
            .iter()
            .enumerate()
            .flat_map(|(index, &(token, expert, weight))| {
                let parts = if index == 2 { shape.parts(3) } else { shape.parts(1) };
                let [gate, up, down] = &slices[expert];
                parts.into_iter().map(move |ff| HostExpert { gate, up, down, token, weight, ff })
            })
            .collect();
        assert_eq!(host.len(), 5);
        let mut cpu = CpuExperts::new(2).unwrap();
        let out = cpu.compute(&shape, &x, &host).unwrap();
        let [gate, up, down] = &slices[0];
        let short = [HostExpert { gate: &gate[..4], up, down, token: 0, weight: 1.0, ff: 0..n_ff }];
        assert!(cpu.compute(&shape, &x, &short).is_err());
        let outside = [HostExpert { gate, up, down, token: 0, weight: 1.0, ff: 2..n_ff + 1 }];
        assert!(cpu.compute(&shape, &x, &outside).is_err());
        let mut expected = vec![vec![0f32; n_embd]; 3];
        for &(token, expert, weight) in &jobs {
            let [gate, up, down] = &experts[expert];
            let dot = |row: &[f32], v: &[f32]| row.iter().zip(v).map(|(a, b)| a * b).sum::<f32>();
            let hidden: Vec<f32> = (0..n_ff)
                .map(|j| {
                    let g = dot(&gate[j * n_embd..(j + 1) * n_embd], &x[token]);
                    g / (1.0 + (-g).exp()) * dot(&up[j * n_embd..(j + 1) * n_embd], &x[token])
                })
                .collect();
            for i in 0..n_embd {
                expected[token][i] += weight * dot(&down[i * n_ff..(i + 1) * n_ff], &hidden);
            }
        }
        for (got, want) in out.iter().flatten().zip(expected.iter().flatten()) {
            assert!((got - want).abs() < 1e-4, "{out:?} against {expected:?}");
        }
        assert!(out[1].iter().all(|&v| v == 0.0), "a token without a job");
    }

    /// A strided input is read row by row from one copy of its span, and written back the same
    /// way: its own columns take the new values, the columns between them keep theirs.
    #[test]
    fn strided_ids_are_read_and_written_through_their_span() {
        for rows in [1, 5] {
            let (_tensors, node, matrix) = strided_ids(3, rows);
            // SAFETY: the node is a live tensor of `strided_ids`.
            let observed = ObservedNode { tensor: unsafe { &*node }, name: "node", kept: &[], cell: None };
            let expected: Vec<Vec<i32>> =
                (0..rows as i32).map(|row| (0..3).map(|column| row * 100 + column).collect()).collect();
            assert_eq!(observed.input_i32_rows(1), Some(expected));
            let slots: Vec<Vec<i32>> = (0..rows as i32).map(|row| vec![-row, 7, 9]).collect();
            observed.write_input_i32_rows(1, &slots).unwrap();
            assert_eq!(observed.input_i32_rows(1), Some(slots.clone()));
            for (row, values) in matrix_rows(matrix).into_iter().enumerate() {
                let row = row as i32;
                assert_eq!(values, [vec![-row, 7, 9], (3..8).map(|column| row * 100 + column).collect()].concat());
            }
            // A shape other than the input's is refused, and nothing is written.
            assert!(observed.write_input_i32_rows(1, &slots[..rows as usize - 1]).is_err());
            assert!(observed.write_input_i32_rows(1, &vec![vec![1, 2]; rows as usize]).is_err());
            assert_eq!(observed.input_i32_rows(1), Some(slots));
        }
    }
}
