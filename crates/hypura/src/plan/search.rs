//! The planner's search: the context, the prompt batch and the plan a run gets (`choose`),
//! around the one-shot `plan`. A draft model's memory comes out of the budget first; the
//! context is the asked one or the longest the budget affords; the prompt batch shrinks to
//! what the budget holds, then grows where streaming gains from it; with remote devices, their
//! tier and the host alone are each searched at their own batch and weighed once (`weigh`).
//! Pure, like the rest of the planner: the caller reads the machine and opens the draft's index.
use std::collections::{BTreeSet, HashSet};

use super::{
    compute_buffer_bytes, context_memory_bytes, kv_cache_bytes, plan, plan_reaching, weigh, MachineFacts, Mode, Plan,
    PlanError, PlanOptions, Reach, Tier,
};
use crate::format::format_bytes;
use crate::model::Inventory;

/// What a run asks of the planner: the planning half of a run's spec. `choose` answers it.
#[derive(Clone, Debug)]
pub struct Ask {
    /// Context length of each sequence in tokens: None chooses it from the budget
    /// (`auto_context`), Some(0) is the model's training context.
    pub n_ctx_seq: Option<u32>,
    /// Sequences decoded together (the server's parallel requests): the KV cache is planned for
    /// each.
    pub n_sequences: u32,
    /// The prompt batch asked for.
    pub n_batch: u32,
    /// The user did not choose `n_batch`: a streaming plan may take a larger prompt batch where
    /// the budget holds it (`grow_batch`), and a budget that does not hold the compute buffers
    /// of `n_batch` gets a smaller one before it is refused (`fit_batch`).
    pub grow_batch: bool,
    /// Mode, window, expert cache, prefetch and MTP choices; the search sets their context,
    /// sequences and prompt batch.
    pub options: PlanOptions,
    /// A draft model for speculative decoding, resident beside the target.
    pub draft: Option<Inventory>,
}

/// What `choose` answers: the context of each sequence, the prompt batch and the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub n_ctx_seq: u32,
    pub n_batch: u32,
    pub plan: Plan,
}

/// The prompt batch of a draft model's context: its prompt batches are split into ubatches
/// this size, which keeps its compute buffer (the logits of a ubatch) small.
pub const DRAFT_UBATCH: u32 = 64;

/// The context, the prompt batch and the plan for `ask` on `facts` (what a run loads and
/// `inspect` prints): a draft model set aside, the batch shrunk to what the budget holds
/// (`fit_batch`), then grown where streaming gains from it (`grow_batch`), for a batch the user
/// did not choose. With remote devices, their tier is weighed against streaming locally alone,
/// each searched at its own batch: local streaming may only fit a smaller batch (the compute
/// buffers of 512 tokens of Qwen2.5's vocabulary are 311 MB).
pub fn choose(inventory: &Inventory, facts: &MachineFacts, ask: &Ask) -> Result<Choice, PlanError> {
    let (facts, ask, draft_bytes) = set_aside_draft(inventory, facts, ask)?;
    let mut choice = if facts.remote_devices.is_empty() {
        Search { inventory, facts: &facts, ask: &ask, reach: Reach::Host }.run()?
    } else {
        let host = MachineFacts { remote_devices: Vec::new(), ..facts.clone() };
        let local = Search { inventory, facts: &host, ask: &ask, reach: Reach::Host }.run();
        let remote = Search { inventory, facts: &facts, ask: &ask, reach: Reach::Remote }.run();
        weigh(&facts, local, remote)?
    };
    choice.plan.budget.set_aside(draft_bytes, |budget| &mut budget.draft_bytes);
    let touched = super::predict::touched(inventory, &choice.plan);
    choice.plan.prediction = Some(super::predict(&choice.plan, &facts, choice.n_batch, touched));
    Ok(choice)
}

/// The plan at the ask's own prompt batch and context (the context chosen as `context_for`
/// does), every sequence's KV cache counted. A budget too small says how long a context it
/// holds, so that a client can ask for that.
pub fn plan_for(inventory: &Inventory, facts: &MachineFacts, ask: &Ask) -> Result<Plan, PlanError> {
    plan_at(inventory, facts, ask, context_for(inventory, facts, ask), ask.n_batch, None)
}

/// The context each sequence gets: the ask's, the training context for 0, or by default the
/// one the budget affords (`auto_context`). Never more than the training context.
pub fn context_for(inventory: &Inventory, facts: &MachineFacts, ask: &Ask) -> u32 {
    context_reaching(inventory, facts, ask, None)
}

/// `context_for` for plans that reach `reach`'s devices (None: either, as `plan` weighs them).
fn context_reaching(inventory: &Inventory, facts: &MachineFacts, ask: &Ask, reach: Option<Reach>) -> u32 {
    let trained = trained_context(inventory);
    match ask.n_ctx_seq {
        Some(0) => trained,
        Some(n_ctx_seq) => n_ctx_seq.min(trained),
        None => auto_context(inventory, facts, ask, reach),
    }
}

/// Take a draft model's memory out of the budget the target is planned in: its weights and
/// compute buffer first, then, once the target's context is chosen in what is left, its KV
/// cache for that context and every sequence. The ask comes back with that context fixed, with
/// the draft's bytes.
fn set_aside_draft(
    inventory: &Inventory,
    facts: &MachineFacts,
    ask: &Ask,
) -> Result<(MachineFacts, Ask, u64), PlanError> {
    let Some(draft) = &ask.draft else { return Ok((facts.clone(), ask.clone(), 0)) };
    let n_sequences = ask.n_sequences.max(1);
    let weights: u64 = draft.tensors.iter().map(|tensor| tensor.bytes).sum();
    let compute = compute_buffer_bytes(draft, 0, DRAFT_UBATCH.min(ask.n_batch));
    let too_large =
        |needed: u64| PlanError::DraftTooLarge { model: draft.path.clone(), needed, budget: facts.memory_budget_bytes };
    let mut left = MachineFacts {
        memory_budget_bytes: facts
            .memory_budget_bytes
            .checked_sub(weights + compute)
            .ok_or_else(|| too_large(weights + compute))?,
        ..facts.clone()
    };
    let n_ctx_seq = context_for(inventory, &left, ask);
    let kv = context_memory_bytes(draft, n_ctx_seq.saturating_mul(n_sequences), n_sequences, ask.options.kv);
    left.memory_budget_bytes =
        left.memory_budget_bytes.checked_sub(kv).ok_or_else(|| too_large(weights + compute + kv))?;
    tracing::info!(
        "the draft model takes {} ({} of weights, {} of KV cache, {} of compute buffer); the target is planned in the {} left",
        format_bytes(weights + compute + kv),
        format_bytes(weights),
        format_bytes(kv),
        format_bytes(compute),
        format_bytes(left.memory_budget_bytes)
    );
    Ok((left, Ask { n_ctx_seq: Some(n_ctx_seq), ..ask.clone() }, weights + compute + kv))
}

/// The plan at one context and prompt batch, reaching `reach`'s devices (None: weighing the
/// remote tier against the host, as `plan` does).
fn plan_at(
    inventory: &Inventory,
    facts: &MachineFacts,
    ask: &Ask,
    n_ctx_seq: u32,
    n_batch: u32,
    reach: Option<Reach>,
) -> Result<Plan, PlanError> {
    let n_sequences = ask.n_sequences.max(1);
    let options = PlanOptions {
        n_ctx: n_ctx_seq.saturating_mul(n_sequences),
        n_sequences,
        n_ubatch: n_batch,
        ..ask.options.clone()
    };
    plan_with(inventory, facts, &options, reach).map_err(|error| match error {
        PlanError::BudgetTooSmall { budget, needed, kv, .. } => {
            let per_token = kv_cache_bytes(inventory, 1, options.kv).max(1) * u64::from(n_sequences);
            let rest = needed.saturating_sub(kv);
            if rest >= budget {
                return PlanError::TooSmallWithoutContext { reason: Box::new(error), needed: rest };
            }
            PlanError::ContextTooLong {
                reason: Box::new(error),
                n_ctx_seq,
                n_sequences,
                fits: (budget - rest) / per_token,
            }
        }
        other => other,
    })
}

/// The plan reaching `reach`'s devices, or with None the one `plan` weighs between them.
fn plan_with(
    inventory: &Inventory,
    facts: &MachineFacts,
    options: &PlanOptions,
    reach: Option<Reach>,
) -> Result<Plan, PlanError> {
    match reach {
        Some(reach) => plan_reaching(inventory, facts, options, reach),
        None => plan(inventory, facts, options),
    }
}

/// One search over prompt batches at one context, reaching one set of devices.
struct Search<'a> {
    inventory: &'a Inventory,
    facts: &'a MachineFacts,
    ask: &'a Ask,
    reach: Reach,
}

impl Search<'_> {
    fn run(&self) -> Result<Choice, PlanError> {
        // The default context does not depend on the batch (`auto_context`): choose it once for
        // every plan weighed below.
        let n_ctx_seq = context_reaching(self.inventory, self.facts, self.ask, Some(self.reach));
        let (n_batch, plan) = self.fit_batch(n_ctx_seq)?;
        let (n_batch, plan) = self.grow_batch(n_ctx_seq, n_batch, plan);
        Ok(Choice { n_ctx_seq, n_batch, plan })
    }

    fn plan_at(&self, n_ctx_seq: u32, n_batch: u32) -> Result<Plan, PlanError> {
        plan_at(self.inventory, self.facts, self.ask, n_ctx_seq, n_batch, Some(self.reach))
    }

    /// The plan at the ask's prompt batch or, where the budget does not hold that batch's
    /// compute buffers and the user did not choose the batch, at the largest smaller one it does
    /// hold, said in the log. Refused with the first plan's reason when none fits.
    fn fit_batch(&self, n_ctx_seq: u32) -> Result<(u32, Plan), PlanError> {
        let n_batch = self.ask.n_batch;
        let refusal = match self.plan_at(n_ctx_seq, n_batch) {
            Ok(plan) => return Ok((n_batch, plan)),
            Err(refusal) => refusal,
        };
        // A smaller batch does not help an expert cache asked for below one token's picks.
        if !self.ask.grow_batch || matches!(refusal, PlanError::ExpertCacheTooSmall { .. }) {
            return Err(refusal);
        }
        let mut smallest = None;
        for smaller in SMALLER_BATCHES.into_iter().filter(|&smaller| smaller < n_batch) {
            match self.plan_at(n_ctx_seq, smaller) {
                Ok(plan) => {
                    tracing::info!(
                        "prompt batches of {smaller} tokens: the budget does not hold the compute buffers of {n_batch}"
                    );
                    return Ok((smaller, plan));
                }
                Err(error) => smallest = Some((smaller, error)),
            }
        }
        // The refusal at the smallest batch says what the budget lacks after every shrink.
        Err(match smallest {
            Some((n_batch, error)) => PlanError::BatchShrunk { reason: Box::new(error), n_batch },
            None => refusal,
        })
    }

    /// The prompt batch for a streaming plan. Each batch of prompt tokens is one sweep over the
    /// streamed weights, and each generated token another, so a larger batch sweeps a prompt
    /// fewer times but its compute buffer (the logits alone are 4 bytes × vocabulary × batch)
    /// takes memory from the pinned layers or the expert cache, and every generated token then
    /// streams more. The batch (at most the context, the same mode) that streams the fewest
    /// bytes for a reference request, `streamed per token × (prompt ÷ batch + answer)`, is
    /// taken: on Qwen2.5-Coder-1.5B in 1.2 GiB, 512-token batches stream 436 MiB per token and
    /// 128-token ones 162 MiB, so 128 wins even for prompts of 16K tokens. An expert cache serves
    /// part of the picks, so an expert plan's bytes are weighed with its misses
    /// (`reference_request_bytes`). A resident plan, or a batch the user chose, stays as it is.
    fn grow_batch(&self, n_ctx_seq: u32, n_batch: u32, plan: Plan) -> (u32, Plan) {
        if !self.ask.grow_batch || plan.mode == Mode::Resident {
            return (n_batch, plan);
        }
        let cost = |n_batch: u32, plan: &Plan| reference_request_bytes(self.inventory, plan, n_batch);
        let mut best = (n_batch, cost(n_batch, &plan), plan);
        let candidates = STREAMING_BATCHES.into_iter().filter(|&candidate| {
            candidate != n_batch && candidate <= n_ctx_seq && candidate >= MIN_STREAMING_BATCH.min(n_batch)
        });
        for candidate in candidates {
            let Ok(plan) = self.plan_at(n_ctx_seq, candidate) else { continue };
            let candidate_cost = cost(candidate, &plan);
            // A larger batch wins ties: its prompts take fewer graphs.
            let better = candidate_cost < best.1 * 0.99 || (candidate_cost <= best.1 && candidate > best.0);
            if plan.mode == best.2.mode && better {
                best = (candidate, candidate_cost, plan);
            }
        }
        if best.0 != n_batch {
            tracing::info!("prompt batches of {} tokens: the fewest bytes streamed for a {REFERENCE_PROMPT_TOKENS}-token prompt and a {REFERENCE_ANSWER_TOKENS}-token answer", best.0);
        }
        (best.0, best.2)
    }
}

/// Prompt batch sizes a budget too small for the default's compute buffers may shrink to,
/// largest first: the logits of a batch alone take 4 bytes × vocabulary × batch (311 MB for
/// Qwen2.5's 152K tokens at 512).
const SMALLER_BATCHES: [u32; 4] = [256, 128, 64, 32];

/// Prompt batch sizes a streaming plan weighs, largest first.
const STREAMING_BATCHES: [u32; 8] = [4096, 2048, 1024, 512, 256, 128, 64, 32];

/// The smallest prompt batch a streaming plan takes for the sake of its cache or pinned
/// layers: below it, a long prompt's graphs cost more than the bytes they save.
const MIN_STREAMING_BATCH: u32 = 64;

/// The request a streaming plan's prompt batch is chosen for: a prompt of this many tokens
/// (a system prompt, some history) and an answer of this many.
const REFERENCE_PROMPT_TOKENS: f64 = 2048.0;
const REFERENCE_ANSWER_TOKENS: f64 = 256.0;

/// Bytes `plan` streams for the reference request in prompt batches of `n_batch`. A dense
/// window reads all it streams for every pass. An expert plan's passes read the picks its
/// cache misses: routing spread over the experts hits about the share of the streamed experts
/// the cache holds, so the cache's size counts (weighing the worst case alone, every pick a
/// miss, let a larger compute buffer win and shrink the cache to a few units). A prompt batch
/// of `b` tokens picks a share `1 − (1 − k/n)^b` of each layer's experts, a decode `k`; prompt
/// batches are at most what the cache holds the picks of (`max_ubatch`).
fn reference_request_bytes(inventory: &Inventory, plan: &Plan, n_batch: u32) -> f64 {
    let per_pass = plan.streamed_bytes_per_token.max(1) as f64;
    let Some(experts) = plan.experts.as_ref().filter(|experts| experts.n_expert > 0) else {
        return per_pass * (REFERENCE_PROMPT_TOKENS / f64::from(n_batch.max(1)) + REFERENCE_ANSWER_TOKENS);
    };
    let streamed: HashSet<&str> =
        plan.tensors.iter().filter(|tensor| tensor.tier == Tier::Stream).map(|tensor| tensor.name.as_str()).collect();
    let mut layers = BTreeSet::new();
    let mut expert_bytes = 0u64;
    for tensor in inventory.expert_tensors().filter(|tensor| streamed.contains(tensor.name.as_str())) {
        expert_bytes += tensor.bytes;
        layers.extend(tensor.layer);
    }
    let k = experts.n_expert_used.clamp(1, experts.n_expert) as f64;
    let decode_experts = layers.len() as f64 * k * experts.unit_bytes as f64;
    let dense = (per_pass - decode_experts).max(0.0);
    let misses = 1.0 - (experts.cache_units as f64 * experts.unit_bytes as f64 / (expert_bytes.max(1) as f64)).min(1.0);
    let ubatch = experts.max_ubatch.map_or(n_batch, |most| most.min(n_batch)).max(1);
    let picked = 1.0 - (1.0 - k / experts.n_expert as f64).powi(ubatch.min(4096) as i32);
    let prompt_pass = dense + expert_bytes as f64 * picked * misses;
    let decode_pass = dense + decode_experts * misses;
    (REFERENCE_PROMPT_TOKENS / f64::from(ubatch)).ceil() * prompt_pass + REFERENCE_ANSWER_TOKENS * decode_pass
}

/// The model's training context (4096 where the file does not say).
fn trained_context(inventory: &Inventory) -> u32 {
    match u32::try_from(inventory.hparams.n_ctx_train) {
        Ok(0) => 4096,
        Ok(trained) => trained,
        Err(_) => u32::MAX,
    }
}

/// Context lengths the default tries, longest first: agents' prompts (a system prompt with
/// tool definitions, then the conversation) need 16K and more.
const AUTO_CONTEXTS: [u32; 5] = [32768, 16384, 8192, 4096, 2048];

/// The default context: the longest of `AUTO_CONTEXTS` (at most the training context) whose KV
/// cache, for every sequence, takes at most a quarter of the memory budget, so that the
/// weights keep the rest, and with which the plan fits the budget at some prompt batch (the
/// batch shrinks first, then the context, before the budget is refused). 2048 tokens at least.
fn auto_context(inventory: &Inventory, facts: &MachineFacts, ask: &Ask, reach: Option<Reach>) -> u32 {
    let trained = trained_context(inventory);
    let n_sequences = ask.n_sequences.max(1);
    // A prompt batch the user did not choose shrinks before the context does (`fit_batch`).
    let n_ubatch =
        if ask.grow_batch { SMALLER_BATCHES[SMALLER_BATCHES.len() - 1].min(ask.n_batch) } else { ask.n_batch };
    let fits = |n_ctx_seq: u32| {
        let n_ctx = n_ctx_seq.saturating_mul(n_sequences);
        let options = PlanOptions { n_ctx, n_sequences, n_ubatch, ..ask.options.clone() };
        kv_cache_bytes(inventory, n_ctx, options.kv) <= facts.memory_budget_bytes / 4
            && plan_with(inventory, facts, &options, reach).is_ok()
    };
    AUTO_CONTEXTS
        .iter()
        .map(|&n_ctx_seq| n_ctx_seq.min(trained))
        .find(|&n_ctx_seq| fits(n_ctx_seq))
        .unwrap_or(AUTO_CONTEXTS[AUTO_CONTEXTS.len() - 1].min(trained))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{ModeChoice, PlanOptions};

    fn ask(n_ctx_seq: u32, n_batch: u32) -> Ask {
        Ask {
            n_ctx_seq: Some(n_ctx_seq),
            n_sequences: 1,
            n_batch,
            grow_batch: true,
            options: PlanOptions::default(),
            draft: None,
        }
    }

    #[test]
    fn an_expert_plan_weighs_its_cache_against_a_larger_prompt_batch() {
        // Qwen's vocabulary: the logits of a 4096-token batch alone are 2.5 GB of compute buffer.
        let mut inventory = crate::plan::test_support::moe_inventory(24, 8, 2, 8 << 20);
        inventory.hparams.n_vocab = 152_064;
        let facts =
            MachineFacts { memory_budget_bytes: 4 << 30, disk_bytes_per_sec: Some(2e9), ..MachineFacts::default() };
        let ask = ask(1024, 512);
        let search = Search { inventory: &inventory, facts: &facts, ask: &ask, reach: Reach::Host };
        let (n_batch, chosen) = search.grow_batch(1024, 512, plan_for(&inventory, &facts, &ask).unwrap());
        let largest = plan_for(&inventory, &facts, &Ask { n_batch: 4096, ..ask.clone() }).unwrap();
        let cache = |plan: &Plan| plan.experts.as_ref().expect("an expert plan").cache_units;
        // Weighed by the worst case alone (every pick a miss, the same at every batch) the
        // largest batch won and its compute buffer took the cache.
        assert_eq!(chosen.streamed_bytes_per_token, largest.streamed_bytes_per_token);
        assert!(
            n_batch < 4096 && cache(&chosen) > cache(&largest),
            "batch {n_batch}: {} units against {} at 4096",
            cache(&chosen),
            cache(&largest)
        );
        assert!(
            reference_request_bytes(&inventory, &chosen, n_batch) < reference_request_bytes(&inventory, &largest, 4096)
        );
        // The search takes the same batch.
        assert_eq!(choose(&inventory, &facts, &ask).unwrap().n_batch, n_batch);
        // A cache of every streamed expert reads nothing more once it is warm.
        let all = plan(
            &inventory,
            &MachineFacts { memory_budget_bytes: 64 << 30, ..facts.clone() },
            &PlanOptions {
                n_ctx: 1024,
                n_ubatch: 512,
                mode: ModeChoice::Forced(Mode::ExpertStream),
                ..PlanOptions::default()
            },
        )
        .unwrap();
        assert_eq!(reference_request_bytes(&inventory, &all, 512), 0.0);
    }

    /// A draft model's weights, KV cache and compute buffer are an entry of the budget's use,
    /// and the target is planned in what is left.
    #[test]
    fn a_draft_model_is_set_aside_in_the_budget() {
        let inventory = crate::plan::test_support::inventory(8, 16 << 20, 32 << 20, 64 << 20);
        let draft = crate::plan::test_support::inventory(2, 1 << 20, 2 << 20, 4 << 20);
        let facts =
            MachineFacts { memory_budget_bytes: 2 << 30, disk_bytes_per_sec: Some(2e9), ..MachineFacts::default() };
        let alone = choose(&inventory, &facts, &ask(1024, 256)).unwrap();
        let with_draft = choose(&inventory, &facts, &Ask { draft: Some(draft.clone()), ..ask(1024, 256) }).unwrap();
        let draft_bytes = draft.tensors.iter().map(|tensor| tensor.bytes).sum::<u64>()
            + compute_buffer_bytes(&draft, 0, DRAFT_UBATCH)
            + context_memory_bytes(&draft, 1024, 1, Default::default());
        let budget = &with_draft.plan.budget;
        assert_eq!(budget.draft_bytes, draft_bytes);
        assert_eq!(budget.budget_bytes, 2 << 30);
        assert_eq!(budget.total_bytes, alone.plan.budget.total_bytes + draft_bytes);
        assert!(budget.total_bytes <= budget.budget_bytes);
        assert!(with_draft.plan.render().contains("draft model"), "{}", with_draft.plan.render());
        // A draft larger than the budget is refused by name.
        let tiny = MachineFacts { memory_budget_bytes: 4 << 20, ..facts };
        let error = choose(&inventory, &tiny, &Ask { draft: Some(draft), ..ask(1024, 256) }).unwrap_err();
        assert!(matches!(error, PlanError::DraftTooLarge { .. }), "{error}");
    }

    /// A budget that holds the weights but not the asked context says how long a context fits.
    #[test]
    fn a_context_too_long_for_the_budget_says_what_fits() {
        let inventory = crate::plan::test_support::inventory(8, 1 << 20, 4 << 20, 8 << 20);
        // What streaming needs beside the KV cache, from the refusal of a budget of nothing.
        let refusal = plan_for(
            &inventory,
            &MachineFacts { memory_budget_bytes: 1, ..MachineFacts::default() },
            &Ask { grow_batch: false, ..ask(1 << 20, 32) },
        )
        .unwrap_err();
        let PlanError::TooSmallWithoutContext { needed, .. } = refusal else { panic!("{refusal}") };
        let facts = MachineFacts {
            memory_budget_bytes: needed + 1024 * kv_cache_bytes(&inventory, 1, Default::default()),
            ..MachineFacts::default()
        };
        let error = plan_for(&inventory, &facts, &Ask { grow_batch: false, ..ask(1 << 20, 32) }).unwrap_err();
        let PlanError::ContextTooLong { fits, n_ctx_seq, .. } = &error else { panic!("{error}") };
        assert!(*fits > 0 && *fits < u64::from(*n_ctx_seq), "{error}");
        assert!(error.to_string().contains("does not fit: at most"), "{error}");
        // The context it names fits.
        plan_for(&inventory, &facts, &Ask { grow_batch: false, ..ask(*fits as u32, 32) }).unwrap();
    }
}
