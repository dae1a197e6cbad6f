//! The eval hook: llama.cpp's `cb_eval`, narrowed to the few graph nodes where Hypura must act.
//!
//! ggml's scheduler asks the callback about every node; each node it answers "yes" for ends a
//! compute segment and synchronises the device before `observe` runs. So `wants` must say yes
//! only where a decision is due (one node per layer), never for every node.
use std::ffi::{c_void, CStr};
use std::sync::Arc;

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
    /// The node has been computed; the graph continues when this returns.
    fn observe(&self, node: &ObservedNode<'_>);
}

/// A computed graph node, as the hook sees it.
pub struct ObservedNode<'a> {
    tensor: &'a raw::ggml_tensor,
    name: &'a str,
}

impl ObservedNode<'_> {
    pub fn name(&self) -> &str {
        self.name
    }

    /// Element counts per dimension (ggml's `ne`).
    pub fn shape(&self) -> [i64; 4] {
        self.tensor.ne
    }

    /// The rows of an I32 node (e.g. `ffn_moe_topk-L`: expert ids per token) honouring its
    /// strides: the top-k tensor is a view whose rows are `nb[1]` bytes apart. Returns None for
    /// other types or a non-host tensor without data.
    pub fn i32_rows(&self) -> Option<Vec<Vec<i32>>> {
        if self.tensor.type_ != raw::GGML_TYPE_I32 || self.tensor.data.is_null() {
            return None;
        }
        let [columns, rows, ..] = self.tensor.ne;
        let [element_stride, row_stride, ..] = self.tensor.nb;
        if columns < 0 || rows < 0 || element_stride != 4 {
            return None;
        }
        let mut out = Vec::with_capacity(rows as usize);
        for row in 0..rows as usize {
            let mut values = vec![0i32; columns as usize];
            // SAFETY: the node is computed and its buffer is host memory (CPU backend); ggml
            // guarantees `data + row * nb[1] + column * nb[0]` is inside the tensor for
            // row < ne[1], column < ne[0]. The bytes are copied out while ggml waits for us.
            unsafe {
                let row_start = (self.tensor.data as *const u8).add(row * row_stride);
                std::ptr::copy_nonoverlapping(row_start, values.as_mut_ptr() as *mut u8, columns as usize * 4);
            }
            out.push(values);
        }
        Some(out)
    }
}

pub(crate) unsafe extern "C" fn eval_callback(tensor: *mut raw::ggml_tensor, ask: bool, user_data: *mut c_void) -> bool {
    if tensor.is_null() || user_data.is_null() {
        return !ask;
    }
    // SAFETY: user_data is the Box<Arc<dyn EvalHook>> owned by the Context that registered
    // this callback, alive for the context's life; the tensor is a live graph node.
    let (hook, tensor) = unsafe { (&*(user_data as *const Arc<dyn EvalHook>), &*tensor) };
    // SAFETY: ggml tensor names are NUL-terminated within their fixed array.
    let name = unsafe { CStr::from_ptr(tensor.name.as_ptr()) }.to_str().unwrap_or("");
    if ask {
        hook.wants(name)
    } else {
        hook.observe(&ObservedNode { tensor, name });
        true
    }
}
