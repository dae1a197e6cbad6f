//! Speculative decoding: drafts from a draft model or from the sequence's own n-grams are
//! verified several to a pass, and greedy output is the same tokens as without them, resident
//! and streaming, with one sequence or several in one batch. Bad drafts setups are refused at
//! load with the reason.
use std::path::Path;
use std::sync::{Arc, Mutex};

use hypura::engine::{
    Batcher, Control, Engine, EngineOptions, GenerateOutput, GenerateRequest, Prompt, SamplerParams, SequenceEvent,
    Session, Speculation,
};
use hypura::model::{Inventory, Role};
use hypura::plan::{self, MachineFacts, Mode, ModeChoice, PlanOptions};

use crate::common;

const N_CTX: u32 = 1024;

/// A function to rewrite: an answer that repeats much of its prompt, which prompt lookup drafts.
const REWRITE: &str = "def total_price(items):\n    total = 0\n    for item in items:\n        total = total + item.price * item.quantity\n    return total\n\n# The same function, with a docstring:\ndef total_price(items):";

fn options(speculation: Option<Speculation>) -> EngineOptions {
    // Batch-invariant kernels: a token's logits are the same bits in a verify batch of several
    // tokens as alone, so greedy speculation must give exactly the tokens of plain decoding.
    EngineOptions {
        n_ctx_seq: N_CTX,
        n_threads: Some(2),
        batch_invariant: true,
        speculation,
        ..EngineOptions::default()
    }
}

fn with_draft(draft: &Path, n_max: u32) -> Speculation {
    let mut speculation = Speculation::new(Some(draft.to_path_buf()), Vec::new());
    speculation.params.n_max = n_max;
    speculation
}

fn greedy(engine: &Arc<Engine>, prompt: &str, count: u32) -> GenerateOutput {
    let mut session = Session::new(engine.clone()).unwrap();
    let request = GenerateRequest {
        max_tokens: Some(count),
        sampling: SamplerParams::greedy(),
        ..GenerateRequest::new(Prompt::Raw(prompt.into()))
    };
    session.generate(&request, &mut |_| Control::Continue).unwrap()
}

#[test]
fn a_draft_model_changes_no_greedy_token_and_verifies_several_per_pass() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let plain = Arc::new(Engine::open(&model, options(None)).unwrap());
    let reference = greedy(&plain, REWRITE, 48);
    // The model drafts for itself: nearly every drafted token is the one the target samples.
    let speculative = Arc::new(Engine::open(&model, options(Some(with_draft(&model, 6)))).unwrap());
    assert!(speculative.draft_model().is_some());
    let output = greedy(&speculative, REWRITE, 48);
    assert_eq!(output.tokens, reference.tokens, "{:?} against {:?}", output.text, reference.text);
    assert_eq!(output.text, reference.text);
    let stats = &output.stats;
    assert!(stats.draft_tokens > 0 && stats.draft_accepted * 2 > stats.draft_tokens, "{stats:?}");
    assert!(stats.eval_decodes * 2 < stats.eval_count, "{} passes for {} tokens", stats.eval_decodes, stats.eval_count);
    assert!(stats.tokens_per_pass().unwrap() > 2.0, "{stats:?}");
}

#[test]
fn prompt_lookup_drafts_change_no_greedy_token() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let plain = Arc::new(Engine::open(&model, options(None)).unwrap());
    let reference = greedy(&plain, REWRITE, 40);
    let lookup = Speculation::new(None, vec!["ngram-map-k".into(), "ngram-mod".into()]);
    let speculative = Arc::new(Engine::open(&model, options(Some(lookup))).unwrap());
    assert!(speculative.draft_model().is_none());
    let output = greedy(&speculative, REWRITE, 40);
    assert_eq!(output.tokens, reference.tokens, "{:?} against {:?}", output.text, reference.text);
    // The answer repeats the prompt's loop: the n-grams find it.
    assert!(output.stats.draft_accepted > 0, "{:?}", output.stats);
    assert!(output.stats.eval_decodes < output.stats.eval_count.saturating_sub(1), "{:?}", output.stats);
}

/// One pass over the streamed weights verifies several tokens: the same tokens as resident
/// without a draft, in fewer passes, so fewer bytes read per generated token.
#[test]
fn speculation_while_streaming_reads_less_per_token_and_changes_no_token() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let inventory = Inventory::open(&model).unwrap();
    let facts = MachineFacts {
        memory_budget_bytes: common::streaming_budget(&model, Mode::DenseStream, N_CTX),
        disk_bytes_per_sec: Some(1e9),
        ..MachineFacts::default()
    };
    let plan_options = PlanOptions {
        mode: ModeChoice::Forced(Mode::DenseStream),
        n_ctx: N_CTX,
        n_ubatch: 512,
        window_layers: Some(2),
        ..PlanOptions::default()
    };
    let plan = plan::plan(&inventory, &facts, &plan_options).unwrap();
    let streaming = |speculation| {
        Arc::new(Engine::open(&model, EngineOptions { plan: Some(plan.clone()), ..options(speculation) }).unwrap())
    };
    let reference = greedy(&Arc::new(Engine::open(&model, options(None)).unwrap()), REWRITE, 32);
    let plain = greedy(&streaming(None), REWRITE, 32);
    let drafted = greedy(&streaming(Some(with_draft(&model, 8))), REWRITE, 32);
    assert_eq!(plain.tokens, reference.tokens);
    assert_eq!(drafted.tokens, reference.tokens);
    let per_token =
        |output: &GenerateOutput| output.stats.io.unwrap().bytes_read as f64 / f64::from(output.stats.eval_count);
    assert!(
        drafted.stats.eval_decodes * 2 < plain.stats.eval_decodes,
        "{} passes with drafts, {} without",
        drafted.stats.eval_decodes,
        plain.stats.eval_decodes
    );
    assert!(
        per_token(&drafted) * 1.5 < per_token(&plain),
        "{} bytes per token with drafts, {} without",
        per_token(&drafted),
        per_token(&plain)
    );
}

/// Several sequences in one batch each verify their own draft.
#[test]
fn sequences_decoded_together_each_keep_their_greedy_tokens() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let prompts =
        [REWRITE, "The capital of France is", "fn main() {\n    println!(\"hello\");\n}\n// The same in Python:\n"];
    let plain = Arc::new(Engine::open(&model, EngineOptions { n_seq_max: 3, ..options(None) }).unwrap());
    let references: Vec<Vec<i32>> = prompts.iter().map(|prompt| greedy(&plain, prompt, 24).tokens).collect();
    let engine =
        Arc::new(Engine::open(&model, EngineOptions { n_seq_max: 3, ..options(Some(with_draft(&model, 4))) }).unwrap());
    let mut batcher = Batcher::new(engine, 3).unwrap();
    let results: Arc<Mutex<Vec<Option<GenerateOutput>>>> = Arc::new(Mutex::new(vec![None; prompts.len()]));
    for (index, prompt) in prompts.iter().enumerate() {
        let results = results.clone();
        let request = GenerateRequest {
            max_tokens: Some(24),
            sampling: SamplerParams::greedy(),
            ..GenerateRequest::new(Prompt::Raw(prompt.to_string()))
        };
        let sink = Box::new(move |event: SequenceEvent<'_>| {
            match event {
                SequenceEvent::Done(finished) => results.lock().unwrap()[index] = Some(finished.output),
                SequenceEvent::Failed(error) => panic!("sequence {index} failed: {error}"),
                _ => {}
            }
            Control::Continue
        });
        batcher.admit(request, sink).map_err(|(error, _)| error).unwrap();
    }
    while batcher.step() {}
    let results = results.lock().unwrap();
    for (index, reference) in references.iter().enumerate() {
        let output = results[index].as_ref().expect("every sequence finished");
        assert_eq!(&output.tokens, reference, "sequence {index}");
        assert!(output.stats.draft_tokens > 0, "sequence {index}: {:?}", output.stats);
    }
}

#[test]
fn a_draft_that_cannot_draft_for_the_target_is_refused_at_load() {
    let _machine = common::shared_machine();
    let chat = common::chat_model_path();
    // Gemma's vocabulary is not Qwen's.
    let error = Engine::open(&chat, options(Some(with_draft(&common::gemma_path(), 4))))
        .err()
        .expect("an incompatible draft is refused");
    assert!(error.to_string().contains("does not match the target"), "{error}");
    // A recurrent state cannot drop rejected drafts.
    let directory = tempfile::tempdir().unwrap();
    let hybrid = common::forge("tiny-qwen3next", directory.path());
    let lookup = Speculation::new(None, vec!["ngram-simple".into()]);
    let error = Engine::open(&hybrid, options(Some(lookup))).err().expect("a recurrent target is refused");
    assert!(error.to_string().contains("recurrent state"), "{error}");
    // draft-simple without a draft model.
    let error = Engine::open(&chat, options(Some(Speculation::new(None, vec!["draft-simple".into()]))))
        .err()
        .expect("draft-simple needs a model");
    assert!(error.to_string().contains("needs a draft model"), "{error}");
}

/// The model's own MTP layer drafts (`draft-mtp`, forge GLM-4.5 MoE): loaded and planned in
/// host memory, it drafts every pass, and greedy output is the tokens of plain decoding,
/// resident and with the experts streaming. A model without MTP layers is refused.
#[test]
fn the_models_own_mtp_layer_drafts_and_changes_no_greedy_token() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let model = common::forge("tiny-glm4moe", directory.path());
    let prompt = "The capital of France is";
    let reference = greedy(&Arc::new(Engine::open(&model, options(None)).unwrap()), prompt, 24);
    let mut mtp = Speculation::new(None, vec!["draft-mtp".into()]);
    mtp.params.n_max = 3;
    let resident = greedy(&Arc::new(Engine::open(&model, options(Some(mtp.clone()))).unwrap()), prompt, 24);
    assert_eq!(resident.tokens, reference.tokens, "{:?} against {:?}", resident.text, reference.text);
    assert!(resident.stats.draft_tokens > 0, "the MTP layer drafted nothing: {:?}", resident.stats);
    // The experts stream; the MTP layer's bytes come out of the budget first.
    let inventory = Inventory::open(&model).unwrap();
    let mtp_bytes: u64 =
        inventory.tensors.iter().filter(|tensor| tensor.role == Role::Mtp).map(|tensor| tensor.bytes).sum();
    let budget = common::streaming_budget(&model, Mode::ExpertStream, N_CTX) + mtp_bytes;
    let facts = MachineFacts { memory_budget_bytes: budget, disk_bytes_per_sec: Some(1e9), ..MachineFacts::default() };
    let plan_options = PlanOptions {
        mode: ModeChoice::Forced(Mode::ExpertStream),
        n_ctx: N_CTX,
        n_ubatch: 512,
        mtp: true,
        ..PlanOptions::default()
    };
    let plan = plan::plan(&inventory, &facts, &plan_options).unwrap();
    let mtp_tiers: Vec<plan::Tier> =
        plan.tensors.iter().filter(|tensor| tensor.name.contains("nextn")).map(|tensor| tensor.tier).collect();
    assert!(!mtp_tiers.is_empty() && mtp_tiers.iter().all(|&tier| tier == plan::Tier::Ram), "{mtp_tiers:?}");
    let streamed = greedy(
        &Arc::new(Engine::open(&model, EngineOptions { plan: Some(plan), ..options(Some(mtp.clone())) }).unwrap()),
        prompt,
        24,
    );
    assert_eq!(streamed.tokens, reference.tokens, "{:?} against {:?}", streamed.text, reference.text);
    assert!(streamed.stats.draft_tokens > 0, "{:?}", streamed.stats);
    // Qwen2.5 has no MTP layer.
    let error = Engine::open(&common::chat_model_path(), options(Some(mtp)))
        .err()
        .expect("a model without MTP layers is refused");
    assert!(error.to_string().contains("has none"), "{error}");
}

/// `bench` with a draft model reports how many drafted tokens were accepted and how many tokens
/// a pass gave, next to its tg figure (the model drafts for itself: nearly all are accepted).
#[test]
fn bench_reports_acceptance_and_tokens_per_pass() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let model = model.to_str().unwrap();
    let output = common::hypura_command()
        .args([
            "bench",
            model,
            "--no-baseline",
            "-p",
            "16",
            "-n",
            "24",
            "-r",
            "1",
            "-t",
            "2",
            "--context",
            "512",
            "--model-draft",
            model,
            "--draft-max",
            "4",
        ])
        .env("HYPURA_LOG", "off")
        .output()
        .expect("run hypura bench");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let line = stdout.lines().find(|line| line.starts_with("speculation: ")).unwrap_or_else(|| panic!("{stdout}"));
    let number = |after: &str| -> f64 {
        line.split(after)
            .next()
            .unwrap()
            .rsplit(' ')
            .next()
            .unwrap()
            .trim_end_matches('%')
            .parse()
            .unwrap_or_else(|_| panic!("{line}"))
    };
    assert!(number("% of drafted") > 50.0, "{line}");
    assert!(number(" tokens per pass") > 1.5, "{line}");
}
