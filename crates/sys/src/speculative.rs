//! llama.cpp's speculative decoding (`common/speculative.h`) through the C shim in
//! `csrc/speculative.cpp`: drafters that propose the next tokens of a sequence, a draft model
//! (`draft-simple`) or n-grams of the sequence's own tokens (`ngram-*`, prompt lookup), for the
//! engine to verify with one decode of the target. The engine owns the verification; the
//! drafters follow every batch the target decoded (`process`) and learn how much of each
//! draft was accepted (`accept`).
use std::ffi::{c_char, CString};
use std::ptr::NonNull;

use llama_cpp_sys_2 as raw;

use crate::batch::Batch;
use crate::chat::take_string;
use crate::context::Context;
use crate::error::SysError;
use crate::model::Model;
use crate::vocab::Token;

#[repr(C)]
struct RawSpeculator {
    _private: [u8; 0],
}

#[repr(C)]
struct RawRequest {
    seq: i32,
    n_max: i32,
    pos_last: i32,
    last: Token,
    history: *const Token,
    n_history: usize,
}

unsafe extern "C" {
    fn hypura_spec_init(
        target: *mut raw::llama_context,
        draft: *mut raw::llama_context,
        types: *const c_char,
        n_seq: i32,
        n_max: i32,
        n_min: i32,
        p_min: f32,
        ngram_n: i32,
        error: *mut *mut c_char,
    ) -> *mut RawSpeculator;
    fn hypura_spec_free(spec: *mut RawSpeculator);
    fn hypura_spec_begin(
        spec: *mut RawSpeculator,
        seq: i32,
        prompt: *const Token,
        n_prompt: usize,
        error: *mut *mut c_char,
    ) -> bool;
    fn hypura_spec_process(spec: *mut RawSpeculator, batch: *const raw::llama_batch, error: *mut *mut c_char) -> bool;
    fn hypura_spec_draft(
        spec: *mut RawSpeculator,
        requests: *const RawRequest,
        n_requests: usize,
        out: *mut Token,
        stride: usize,
        counts: *mut i32,
        error: *mut *mut c_char,
    ) -> bool;
    fn hypura_spec_accept(spec: *mut RawSpeculator, seq: i32, n_accepted: u16, error: *mut *mut c_char) -> bool;
    fn hypura_spec_compatible(target: *const raw::llama_model, draft: *const raw::llama_model) -> bool;
}

/// The drafters llama.cpp offers here, by its names (`--spec-type`).
pub const SPECULATIVE_TYPES: [&str; 7] =
    ["draft-simple", "draft-mtp", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"];

/// How drafts are made: llama.cpp's drafter types, tried in its order of preference, and the
/// limits of a draft.
#[derive(Clone, Debug, PartialEq)]
pub struct SpeculativeParams {
    pub types: Vec<String>,
    /// Most tokens drafted at once (`--spec-draft-n-max`).
    pub n_max: u32,
    /// A shorter draft is dropped (`--spec-draft-n-min`).
    pub n_min: u32,
    /// A draft model stops drafting below this probability of its best token (greedy).
    pub p_min: f32,
    /// The n-gram drafters look up the sequence's last this many tokens in its history.
    pub ngram_n: u32,
}

/// One sequence's request for a draft: propose at most `n_max` tokens to follow `last` (sampled,
/// not yet decoded, at position `history.len()`), given the tokens before it.
pub struct DraftRequest<'a> {
    pub seq_id: i32,
    pub n_max: usize,
    pub last: Token,
    pub history: &'a [Token],
}

/// The drafters of a context's sequences, with the draft model's context when there is one.
pub struct Speculator {
    pointer: NonNull<RawSpeculator>,
    /// Decoded by the drafters on every call; dropped after them (field order).
    draft: Option<Context>,
    n_seq: usize,
    n_max: usize,
}

// SAFETY: the drafters' state is only touched through &mut self, and the draft context may
// move between threads like any context; the target context is not held (read at init only).
unsafe impl Send for Speculator {}

fn speculative_error(error: *mut c_char) -> SysError {
    SysError::Speculative(
        take_string(error).unwrap_or_else(|| "llama.cpp's speculative decoding failed without a message".into()),
    )
}

impl Speculator {
    /// Drafters for the `n_seq` sequences of `target`. A `draft-simple` type needs `draft`, a
    /// context of the draft model with the target's sequences (`n_seq_max`) and a batch at
    /// least the target's; its vocabulary must match the target's.
    pub fn new(target: &Context, draft: Option<Context>, params: &SpeculativeParams) -> Result<Speculator, SysError> {
        let bad = |reason: String| Err(SysError::Speculative(reason));
        if let Some(unknown) = params.types.iter().find(|name| !SPECULATIVE_TYPES.contains(&name.as_str())) {
            return bad(format!("unknown speculative type {unknown:?}; known: {}", SPECULATIVE_TYPES.join(", ")));
        }
        if params.types.is_empty()
            || params.n_max == 0
            || params.n_min > params.n_max
            || params.n_max > u32::from(u16::MAX)
            || !(1..=1024).contains(&params.ngram_n)
        {
            return bad(format!(
                "a draft needs a type, 0 < n_max (got {}) ≤ 65535 with n_min (got {}) ≤ n_max, and an n-gram of 1 to 1024 tokens (got {})",
                params.n_max, params.n_min, params.ngram_n
            ));
        }
        let n_seq = target.params().n_seq_max.max(1);
        if let Some(draft) = &draft {
            if !Self::compatible(target.model(), draft.model()) {
                return bad("the draft model's vocabulary does not match the target's (llama.cpp's check: same type, same special tokens, nearly the same tokens)".into());
            }
            if draft.params().n_seq_max.max(1) != n_seq || draft.params().n_batch < target.params().n_batch {
                return bad(format!(
                    "the draft context must have the target's {n_seq} sequences and a batch of at least {} tokens (it has {} and {})",
                    target.params().n_batch,
                    draft.params().n_seq_max,
                    draft.params().n_batch
                ));
            }
        }
        let types = CString::new(params.types.join(","))
            .map_err(|_| SysError::Speculative("a speculative type contains a NUL byte".into()))?;
        let draft_pointer = draft.as_ref().map_or(std::ptr::null_mut(), Context::as_ptr);
        let mut error = std::ptr::null_mut();
        // SAFETY: the target context is valid for this call (the shim reads it only here); the
        // draft context, when given, is owned by the Speculator and outlives the drafters; the
        // type list is NUL-terminated; `error` is a valid out pointer.
        let pointer = unsafe {
            hypura_spec_init(
                target.as_ptr(),
                draft_pointer,
                types.as_ptr(),
                n_seq as i32,
                params.n_max as i32,
                params.n_min as i32,
                params.p_min,
                params.ngram_n as i32,
                &mut error,
            )
        };
        let pointer = NonNull::new(pointer).ok_or_else(|| speculative_error(error))?;
        Ok(Speculator { pointer, draft, n_seq: n_seq as usize, n_max: params.n_max as usize })
    }

    /// llama.cpp's test that a draft model can draft for a target (the same vocabulary).
    pub fn compatible(target: &Model, draft: &Model) -> bool {
        // SAFETY: both model pointers are valid while the borrowed Models live.
        unsafe { hypura_spec_compatible(target.as_ptr(), draft.as_ptr()) }
    }

    pub fn n_max(&self) -> usize {
        self.n_max
    }

    /// The draft model's context, if the drafters have one.
    pub fn draft_context(&self) -> Option<&Context> {
        self.draft.as_ref()
    }

    fn check_seq(&self, seq_id: i32) -> Result<(), SysError> {
        if seq_id < 0 || seq_id as usize >= self.n_seq {
            return Err(SysError::BadSequence { seq_id, n_seq_max: self.n_seq as u32 });
        }
        Ok(())
    }

    /// A new generation starts in `seq_id` with `prompt`.
    pub fn begin(&mut self, seq_id: i32, prompt: &[Token]) -> Result<(), SysError> {
        self.check_seq(seq_id)?;
        let mut error = std::ptr::null_mut();
        let _turn = self.draft.as_ref().and_then(Context::compute_turn);
        // SAFETY: the drafters are valid; `prompt` is a live slice the shim copies.
        let ok = unsafe { hypura_spec_begin(self.pointer.as_ptr(), seq_id, prompt.as_ptr(), prompt.len(), &mut error) };
        if ok {
            Ok(())
        } else {
            Err(speculative_error(error))
        }
    }

    /// The target decoded `batch` (one sequence id per token): the draft model decodes it too,
    /// over its own cells from each sequence's first position in it.
    pub fn process(&mut self, batch: &Batch) -> Result<(), SysError> {
        let raw_batch = batch.raw();
        let mut error = std::ptr::null_mut();
        let _turn = self.draft.as_ref().and_then(Context::compute_turn);
        // SAFETY: the drafters are valid; the batch's arrays hold n_tokens entries, which the
        // shim reads (sequence ids checked against n_seq there) and copies.
        let ok = unsafe { hypura_spec_process(self.pointer.as_ptr(), &raw_batch, &mut error) };
        if ok {
            Ok(())
        } else {
            Err(speculative_error(error))
        }
    }

    /// Drafts for several sequences at once, in the order of `requests`; each at most its
    /// `n_max` (and the drafters' own limit) tokens, possibly none.
    pub fn draft(&mut self, requests: &[DraftRequest<'_>]) -> Result<Vec<Vec<Token>>, SysError> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let mut seen = vec![false; self.n_seq];
        for request in requests {
            self.check_seq(request.seq_id)?;
            if std::mem::replace(&mut seen[request.seq_id as usize], true) {
                return Err(SysError::Speculative(format!("sequence {} asks for two drafts at once", request.seq_id)));
            }
        }
        let stride = self.n_max;
        let raw_requests: Vec<RawRequest> = requests
            .iter()
            .map(|request| RawRequest {
                seq: request.seq_id,
                n_max: request.n_max.clamp(1, stride) as i32,
                pos_last: request.history.len() as i32,
                last: request.last,
                history: request.history.as_ptr(),
                n_history: request.history.len(),
            })
            .collect();
        let mut out = vec![0 as Token; stride * requests.len()];
        let mut counts = vec![0i32; requests.len()];
        let mut error = std::ptr::null_mut();
        let _turn = self.draft.as_ref().and_then(Context::compute_turn);
        // SAFETY: the drafters are valid; each request's history is a live slice; `out` holds
        // `stride` tokens per request and each draft is at most its n_max ≤ stride (checked in
        // the shim); `counts` holds one entry per request.
        let ok = unsafe {
            hypura_spec_draft(
                self.pointer.as_ptr(),
                raw_requests.as_ptr(),
                raw_requests.len(),
                out.as_mut_ptr(),
                stride,
                counts.as_mut_ptr(),
                &mut error,
            )
        };
        if !ok {
            return Err(speculative_error(error));
        }
        Ok(counts
            .iter()
            .enumerate()
            .map(|(index, &count)| out[index * stride..index * stride + count.max(0) as usize].to_vec())
            .collect())
    }

    /// How many tokens of `seq_id`'s last (non-empty) draft the target accepted.
    pub fn accept(&mut self, seq_id: i32, n_accepted: usize) -> Result<(), SysError> {
        self.check_seq(seq_id)?;
        let mut error = std::ptr::null_mut();
        let _turn = self.draft.as_ref().and_then(Context::compute_turn);
        // SAFETY: the drafters are valid; the shim checks that a draft is pending for the
        // sequence and that n_accepted does not exceed it.
        let ok = unsafe {
            hypura_spec_accept(self.pointer.as_ptr(), seq_id, n_accepted.min(u16::MAX as usize) as u16, &mut error)
        };
        if ok {
            Ok(())
        } else {
            Err(speculative_error(error))
        }
    }
}

impl Drop for Speculator {
    fn drop(&mut self) {
        // SAFETY: the pointer came from hypura_spec_init and is freed exactly once, before the
        // draft context it decodes (dropped after this, as a field).
        unsafe { hypura_spec_free(self.pointer.as_ptr()) };
    }
}
