//! The architecture matrix: every tiny MoE preset of the forge (one per llama.cpp architecture)
//! gives plain libllama's logits and greedy tokens in resident mode (repacking off), and the
//! same bits again in expert-stream with a cache smaller than one layer's experts, and in
//! dense-stream (whole FFN layers, experts included). Expert-stream on a model with dense FFN
//! layers among its MoE layers streams both in one plan.
use std::path::Path;
use std::sync::Arc;

use hypura::bench::peer::PlainLlama;
use hypura::engine::{Control, Engine, EngineOptions, GenerateRequest, Prompt, SamplerParams, Session};
use hypura::model::{Inventory, Role};
use hypura::plan::{self, MachineFacts, Mode, ModeChoice, PlanOptions, Tier};
use hypura::store::CachePolicy;

use crate::common;

const PROMPT: &str = "the king of paris and the queen of the sea walked to the river";
const TOKENS: u32 = 24;

fn engine(path: &Path, mode: Mode, n_ubatch: u32, cache_units: Option<usize>) -> Arc<Engine> {
    let inventory = Inventory::open(path).unwrap();
    let options = PlanOptions {
        mode: ModeChoice::Forced(mode),
        n_ctx: 512,
        n_ubatch,
        window_layers: Some(1),
        expert_cache_units: cache_units,
        expert_prefetch: Some(false),
        cache_policy: Some(CachePolicy::Lru),
        ..PlanOptions::default()
    };
    let plan =
        plan::plan(&inventory, &MachineFacts { memory_budget_bytes: 8 << 30, ..MachineFacts::default() }, &options)
            .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    let engine = open_planned(path, plan, n_ubatch);
    assert_eq!(engine.mode(), mode);
    engine
}

/// An engine of `path` on `plan`: the matrix's context, one thread, no repacking.
fn open_planned(path: &Path, plan: plan::Plan, n_ubatch: u32) -> Arc<Engine> {
    let options = EngineOptions {
        n_ctx_seq: 512,
        n_ubatch,
        n_threads: Some(1),
        repack: false,
        plan: Some(plan),
        ..EngineOptions::default()
    };
    Arc::new(Engine::open(path, options).unwrap_or_else(|error| panic!("{}: {error}", path.display())))
}

/// The prompt's logits and 24 greedy tokens, each from an empty cache.
fn run(engine: &Arc<Engine>) -> (Vec<f32>, Vec<i32>, hypura::engine::GenerateOutput) {
    let logits = Session::new(engine.clone()).unwrap().prompt_logits(&Prompt::Raw(PROMPT.into())).unwrap();
    let request = GenerateRequest {
        max_tokens: Some(TOKENS),
        sampling: SamplerParams::greedy(),
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Raw(PROMPT.into()))
    };
    let output = Session::new(engine.clone()).unwrap().generate(&request, &mut |_| Control::Continue).unwrap();
    (logits, output.tokens.clone(), output)
}

fn matrix(preset: &str) {
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge(preset, directory.path());
    let inventory = Inventory::open(&path).unwrap();
    let others = common::tensors_without_a_role(&inventory);
    assert!(others.is_empty(), "{preset}: tensors without a role: {others:?}");
    let hparams = &inventory.hparams;

    // Resident against plain libllama, both with llama.cpp's default prompt batch.
    let resident = engine(&path, Mode::Resident, 512, None);
    let (logits, tokens, _) = run(&resident);
    let mut peer = PlainLlama::load(&path, 512, 1, false).unwrap();
    let prompt = peer.tokenize(PROMPT).unwrap();
    peer.prefill(&prompt).unwrap();
    assert!(logits == peer.last_logits().unwrap(), "{preset}: resident logits differ from libllama's");
    assert_eq!(
        tokens,
        peer.greedy(&prompt, TOKENS as usize).unwrap(),
        "{preset}: resident tokens differ from libllama's"
    );

    // Expert-stream with half of one layer's experts: the plan takes prompt batches of what
    // the cache holds the picks of, and resident runs with the same batch for the reference.
    let cache = (hparams.n_expert / 2) as usize;
    let streaming = engine(&path, Mode::ExpertStream, 512, Some(cache));
    let n_ubatch = streaming.n_ubatch();
    assert_eq!(u64::from(n_ubatch), (cache as u64 / hparams.n_expert_used).max(1), "{preset}");
    let (reference_logits, reference_tokens, _) = run(&engine(&path, Mode::Resident, n_ubatch, None));
    let (logits, tokens, output) = run(&streaming);
    assert!(logits == reference_logits, "{preset}: expert-stream logits differ from resident at a batch of {n_ubatch}");
    assert_eq!(tokens, reference_tokens, "{preset}: expert-stream tokens");
    let passes = output.stats.weight_passes();
    let experts = output.stats.experts.expect("expert stats");
    let io = output.stats.io.expect("io stats");
    assert!(experts.misses > 0 && io.units_released > 0, "{preset}: the cache must miss and evict: {experts:?} {io:?}");
    let moe_layers = inventory
        .expert_tensors()
        .filter_map(|tensor| tensor.layer)
        .filter(|&layer| u64::from(layer) + hparams.n_layer_mtp < hparams.n_layer)
        .collect::<std::collections::BTreeSet<_>>()
        .len() as u64;
    // One router call per MoE layer per graph (the counters are the engine's, so they include
    // the logits run before).
    assert!(
        experts.layer_visits % moe_layers == 0 && experts.layer_visits >= moe_layers * u64::from(passes),
        "{preset}: {} router calls, {moe_layers} MoE layers",
        experts.layer_visits
    );

    // Dense FFN layers among the MoE layers stream in the same expert-stream plan.
    let has_dense = inventory.tensors.iter().any(|tensor| tensor.role.is_dense_ffn() && tensor.role != Role::Mtp);
    let plan = streaming.options().plan.as_ref().unwrap();
    assert_eq!(plan.dense.is_some(), has_dense, "{preset}: a dense window exactly where there are dense FFN layers");
    let streamed_dense = plan
        .tensors
        .iter()
        .zip(&inventory.tensors)
        .filter(|(placement, tensor)| placement.tier == Tier::Stream && tensor.role.is_dense_ffn())
        .count();
    assert_eq!(streamed_dense > 0, has_dense, "{preset}");
    // MTP layers are planned unused and never read.
    let mtp = inventory.tensors.iter().filter(|tensor| tensor.role == Role::Mtp).count();
    assert_eq!(plan.tensors.iter().filter(|placement| placement.tier == Tier::Unused).count(), mtp, "{preset}");
    assert_eq!(mtp > 0, hparams.n_layer_mtp > 0, "{preset}");

    // The dense window's hook stops the graph too, at each layer's FFN entry.
    assert_eq!(io.observations > experts.layer_visits, has_dense, "{preset}: {io:?} {experts:?}");

    // The GPU's expert pool (computed on the CPU here, as llama.cpp places the "GPU" layers
    // without a GPU): routed experts in k + 1 slots per MoE layer, staged whole for the prompt,
    // uploaded from the host cache at decode, ids rewritten to slots. The same bits as resident
    // at the same prompt batch, or no pool where the layers have per-expert biases (their ids
    // index those too).
    let has_biases = inventory.tensors.iter().any(|tensor| tensor.role == Role::ExpertBias);
    let facts = MachineFacts {
        memory_budget_bytes: 8 << 30,
        gpu_budget_bytes: common::expert_pool_budget(&inventory, 512, 512, hparams.n_expert_used + 1),
        ..MachineFacts::default()
    };
    let pool_options = PlanOptions {
        n_ctx: 512,
        n_ubatch: 512,
        expert_prefetch: Some(false),
        gpu_experts: Some(hypura::plan::GpuExperts::Pool),
        ..PlanOptions::default()
    };
    let plan = plan::plan(&inventory, &facts, &pool_options).unwrap_or_else(|error| panic!("{preset}: {error}"));
    let pool = plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.clone());
    assert_eq!(pool.is_none(), has_biases, "{preset}: {}", plan.render());
    if let Some(pool) = pool {
        assert!(u64::from(pool.slots) < hparams.n_expert, "{preset}: {}", plan.render());
        let pooled = open_planned(&path, plan, pool_options.n_ubatch);
        let (reference_logits, reference_tokens, _) = run(&engine(&path, Mode::Resident, pooled.n_ubatch(), None));
        let (logits, tokens, output) = run(&pooled);
        assert!(logits == reference_logits, "{preset}: pooled logits differ from resident");
        assert_eq!(tokens, reference_tokens, "{preset}: pooled tokens");
        let device = output.stats.experts.expect("expert stats").device;
        assert!(device.hits + device.uploads > 0 && device.staged_layers > 0, "{preset}: {device:?}");

        // Split on the same budget (decision 33): planned where the experts are separate gate,
        // up and down without biases; a layer splits once its graph showed plain SwiGLU experts.
        // The greedy tokens agree with resident's (two partial sums: not the same bits).
        let split_options = PlanOptions { gpu_experts: Some(hypura::plan::GpuExperts::Split), ..pool_options.clone() };
        // One slot more: the zero slot.
        let split_facts = MachineFacts {
            gpu_budget_bytes: common::expert_pool_budget(&inventory, 512, 512, hparams.n_expert_used + 2),
            ..facts.clone()
        };
        let plan =
            plan::plan(&inventory, &split_facts, &split_options).unwrap_or_else(|error| panic!("{preset}: {error}"));
        let split_planned = plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.as_ref()).is_some_and(|pool| pool.split);
        let fused_or_biased =
            inventory.tensors.iter().any(|tensor| matches!(tensor.role, Role::ExpertGateUp | Role::ExpertBias));
        assert_eq!(split_planned, !fused_or_biased, "{preset}: {}", plan.render());
        if split_planned {
            let split = open_planned(&path, plan, pool_options.n_ubatch);
            let (_, tokens, output) = run(&split);
            assert_eq!(tokens, reference_tokens, "{preset}: split tokens");
            let device = output.stats.experts.expect("expert stats").device;
            // llama4 applies the router's weights before the FFN: never split.
            if preset == "tiny-llama4" {
                assert_eq!(device.cpu_picks, 0, "{preset}: {device:?}");
            }
        }
    }

    // Dense-stream: every FFN tensor (experts whole) through a window of one layer ahead, so
    // layers rotate through it and the hook at each layer's FFN entry node must fire.
    let (logits, tokens, output) = run(&engine(&path, Mode::DenseStream, 512, None));
    let (resident_logits, resident_tokens, _) = run(&resident);
    assert!(logits == resident_logits, "{preset}: dense-stream logits differ from resident");
    assert_eq!(tokens, resident_tokens, "{preset}: dense-stream tokens");
    let io = output.stats.io.expect("io stats");
    assert!(
        io.units_released > 0 && io.units_loaded > moe_layers,
        "{preset}: layers must rotate through the window: {io:?}"
    );
}

macro_rules! matrix {
    ($($test:ident => $preset:literal),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                let _machine = common::shared_machine();
                matrix($preset);
            }
        )*

        /// Every tiny MoE preset is in the matrix.
        #[test]
        fn every_tiny_moe_preset_is_in_the_matrix() {
            let _machine = common::shared_machine();
            let tested = [$($preset),*];
            let moe: Vec<&str> = hypura_forge::presets().into_iter().filter(|name| name.starts_with("tiny-") && hypura_forge::preset(name).unwrap().is_moe()).collect();
            assert_eq!(moe, tested);
        }
    };
}

hypura_forge::with_tiny_moe_presets!(matrix);
