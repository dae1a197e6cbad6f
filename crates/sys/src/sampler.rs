//! The sampler chain: penalties, top-k, top-p, min-p, temperature, then a seeded draw, or
//! greedy at temperature 0. Values are checked here, because llama.cpp asserts on some.
use std::ptr::NonNull;

use llama_cpp_sys_2 as raw;

use crate::context::Context;
use crate::error::SysError;
use crate::grammar::Grammar;
use crate::vocab::Token;

/// Sampling settings with llama.cpp's meanings. `temperature <= 0` is greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: i32,
    /// 1 disables top-p.
    pub top_p: f32,
    /// 0 disables min-p.
    pub min_p: f32,
    /// 1 disables the repeat penalty.
    pub repeat_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at; 0 disables them, -1 means the context.
    pub penalty_last_n: i32,
    pub seed: u32,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0xFFFF_FFFF,
        }
    }
}

impl SamplerParams {
    pub fn greedy() -> SamplerParams {
        SamplerParams { temperature: 0.0, ..SamplerParams::default() }
    }

    /// Reject values llama.cpp would assert on or silently misuse.
    pub fn validate(&self) -> Result<(), SysError> {
        let bad =
            |name: &'static str, value: f64, allowed: &'static str| Err(SysError::BadSampling { name, value, allowed });
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", self.temperature.into(), ">= 0");
        }
        if self.top_k < 0 {
            return bad("top_k", self.top_k.into(), ">= 0 (0 disables)");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad("top_p", self.top_p.into(), "in 0..=1");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p.into(), "in 0..=1");
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            return bad("repeat_penalty", self.repeat_penalty.into(), "> 0 (1 disables)");
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty", self.presence_penalty.into(), "finite");
        }
        if !self.frequency_penalty.is_finite() {
            return bad("frequency_penalty", self.frequency_penalty.into(), "finite");
        }
        if self.penalty_last_n < -1 {
            return bad("penalty_last_n", self.penalty_last_n.into(), ">= -1");
        }
        Ok(())
    }
}

/// Candidates a grammar checks before it checks the whole vocabulary (see
/// `Sampler::sample_constrained`). Sampling under a grammar therefore never picks a token
/// outside the 512 most likely unless none of those is allowed; top-k and top-p keep far fewer.
const GRAMMAR_CANDIDATES: usize = 512;

/// An owned sampler chain. Freed on drop.
pub struct Sampler {
    chain: NonNull<raw::llama_sampler>,
    /// Greedy without penalties: take the first maximum of the logits directly. llama.cpp's
    /// chain would copy all n_vocab candidates per token first (3 MB for a 262k vocabulary),
    /// which costs several percent of decode time on small models. Same choice, bit for bit.
    plain_greedy: bool,
}

// SAFETY: the chain is owned and only used through &mut self.
unsafe impl Send for Sampler {}

impl Sampler {
    /// Build a chain for a context (whose vocabulary size and context length it needs).
    pub fn new(params: &SamplerParams, context: &Context) -> Result<Sampler, SysError> {
        params.validate()?;
        // SAFETY: returns a plain struct by value.
        let mut chain_params = unsafe { raw::llama_sampler_chain_default_params() };
        chain_params.no_perf = true;
        // SAFETY: chain_init returns a new owned chain (or null on allocation failure).
        let chain = NonNull::new(unsafe { raw::llama_sampler_chain_init(chain_params) })
            .ok_or(SysError::Allocation("a sampler chain"))?;
        let penalty_last_n = if params.penalty_last_n < 0 { context.n_ctx() as i32 } else { params.penalty_last_n };
        let penalties_active = penalty_last_n > 0
            && (params.repeat_penalty != 1.0 || params.presence_penalty != 0.0 || params.frequency_penalty != 0.0);
        let sampler = Sampler { chain, plain_greedy: params.temperature <= 0.0 && !penalties_active };
        // SAFETY: every llama_sampler_init_* returns a new sampler that chain_add takes
        // ownership of; the chain is valid (created above); values were validated.
        unsafe {
            let add = |stage: *mut raw::llama_sampler| raw::llama_sampler_chain_add(sampler.chain.as_ptr(), stage);
            if penalties_active {
                add(raw::llama_sampler_init_penalties(
                    context.n_vocab(),
                    penalty_last_n,
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                ));
            }
            if params.temperature <= 0.0 {
                add(raw::llama_sampler_init_greedy());
            } else {
                if params.top_k > 0 {
                    add(raw::llama_sampler_init_top_k(params.top_k));
                }
                if params.top_p < 1.0 {
                    add(raw::llama_sampler_init_top_p(params.top_p, 1));
                }
                if params.min_p > 0.0 {
                    add(raw::llama_sampler_init_min_p(params.min_p, 1));
                }
                add(raw::llama_sampler_init_temp(params.temperature));
                add(raw::llama_sampler_init_dist(params.seed));
            }
        }
        Ok(sampler)
    }

    /// Sample from the logits of token `index` of the context's last batch (-1: the last
    /// output) and record the choice in the chain's history (for penalties).
    pub fn sample(&mut self, context: &mut Context, index: i32) -> Result<Token, SysError> {
        // Check that logits exist first: llama.cpp aborts on a missing output.
        let logits = context.logits(index)?;
        if self.plain_greedy {
            let token = first_maximum(logits);
            self.accept(token);
            return Ok(token);
        }
        // SAFETY: the chain and the context are valid and used by this thread only; the index
        // was checked to have logits just above.
        Ok(unsafe { raw::llama_sampler_sample(self.chain.as_ptr(), context.as_ptr(), index) })
    }

    /// Sample as `sample` does, under a grammar. The unconstrained choice is tried first and
    /// kept when the grammar allows it (llama.cpp's own samplers do this: checking one token is
    /// far cheaper than checking the whole vocabulary); otherwise every forbidden token is
    /// masked and the chain samples again. The choice is recorded in both the chain and the
    /// grammar (end-of-generation tokens only in the chain).
    pub fn sample_constrained(
        &mut self,
        context: &mut Context,
        index: i32,
        grammar: &mut Grammar,
    ) -> Result<Token, SysError> {
        let logits = context.logits(index)?;
        let candidates = |logits: &[f32]| -> Vec<raw::llama_token_data> {
            logits
                .iter()
                .enumerate()
                .map(|(id, &logit)| raw::llama_token_data { id: id as Token, logit, p: 0.0 })
                .collect()
        };
        let mut free = candidates(logits);
        let first = self.apply_chain(&mut free, None)?;
        let token = if grammar.allows(first) {
            first
        } else {
            // Masking the whole vocabulary costs a detokenization per token (0.5 s for 262k
            // tokens), so the grammar first sees the most likely candidates only, and the whole
            // vocabulary only if it allows none of them.
            let mut best = candidates(logits);
            let keep = GRAMMAR_CANDIDATES.min(best.len());
            if keep < best.len() {
                best.select_nth_unstable_by(keep - 1, |left, right| right.logit.total_cmp(&left.logit));
                best.truncate(keep);
            }
            let mut probe = best.clone();
            let mut array = raw::llama_token_data_array {
                data: probe.as_mut_ptr(),
                size: probe.len(),
                selected: -1,
                sorted: false,
            };
            grammar.apply(&mut array);
            let mut masked =
                if probe.iter().any(|candidate| candidate.logit.is_finite()) { best } else { candidates(logits) };
            let token = self.apply_chain(&mut masked, Some(grammar))?;
            if !grammar.allows(token) {
                return Err(SysError::Grammar("no token the grammar allows has a finite probability".into()));
            }
            token
        };
        self.accept(token);
        grammar.accept(token);
        Ok(token)
    }

    /// Run the chain (after the grammar's mask, if given) over `candidates` and return the
    /// selected token.
    fn apply_chain(
        &mut self,
        candidates: &mut [raw::llama_token_data],
        grammar: Option<&mut Grammar>,
    ) -> Result<Token, SysError> {
        let mut array = raw::llama_token_data_array {
            data: candidates.as_mut_ptr(),
            size: candidates.len(),
            selected: -1,
            sorted: false,
        };
        if let Some(grammar) = grammar {
            grammar.apply(&mut array);
        }
        // SAFETY: the chain is valid; the array describes `candidates`, which lives for the call.
        // Samplers may shrink `size` or re-point `data` into the same buffer, never past it.
        unsafe { raw::llama_sampler_apply(self.chain.as_ptr(), &mut array) };
        if array.selected < 0 || array.selected as usize >= array.size {
            return Err(SysError::Grammar(format!(
                "the sampler chain selected no candidate (selected {})",
                array.selected
            )));
        }
        // SAFETY: `selected` is inside the array, checked above.
        Ok(unsafe { (*array.data.add(array.selected as usize)).id })
    }

    /// Feed a token into the chain's history without sampling (prompt tokens, for penalties).
    pub fn accept(&mut self, token: Token) {
        // SAFETY: the chain is valid; accept only records the token.
        unsafe { raw::llama_sampler_accept(self.chain.as_ptr(), token) };
    }
}

/// Index of the first maximum, as llama.cpp's greedy sampler picks it.
pub fn first_maximum(logits: &[f32]) -> Token {
    let mut best = 0;
    for (index, &logit) in logits.iter().enumerate() {
        if logit > logits[best] {
            best = index;
        }
    }
    best as Token
}

impl Drop for Sampler {
    fn drop(&mut self) {
        // SAFETY: the chain was created by chain_init and is freed once; it frees its stages.
        unsafe { raw::llama_sampler_free(self.chain.as_ptr()) };
    }
}
