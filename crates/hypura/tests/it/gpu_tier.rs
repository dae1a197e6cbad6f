//! The GPU tier's placement through llama.cpp: every layer on the device, the host tiers kept in
//! host memory by name, and the streaming hooks only on layers whose weights stream. Without a
//! GPU (CI) llama.cpp puts every layer on the CPU, but the overrides still go through its loader
//! and the hooks must still skip the layers planned for the GPU; on a CUDA machine
//! `hypura bench --baseline-placement same` makes the same comparison on the device.
use std::path::Path;
use std::sync::Arc;

use hypura::bench::peer::PlainLlama;
use hypura::bench::{PeerConfig, PeerPlacement};
use hypura::engine::{Engine, EngineOptions, Prompt, Session};
use hypura::model::{Inventory, Role};
use hypura::plan::{self, GpuExperts, MachineFacts, Mode, ModeChoice, Plan, PlanOptions, Tier};

use crate::common;

const N_CTX: u32 = 512;
const PROMPT: &str = "the king of paris and the queen of the sea walked to the river";

/// Per-layer bytes of FFN and expert tensors.
fn layer_ffn(inventory: &Inventory) -> Vec<u64> {
    (0..inventory.hparams.n_layer as u32)
        .map(|layer| {
            inventory
                .tensors
                .iter()
                .filter(|tensor| tensor.layer == Some(layer) && (tensor.role.is_dense_ffn() || tensor.role.is_expert()))
                .map(|tensor| tensor.bytes)
                .sum()
        })
        .collect()
}

/// The plan for these host and GPU budgets (prefetch on, a window of one layer).
fn plan_with_budgets(inventory: &Inventory, host_bytes: u64, gpu_bytes: u64) -> Plan {
    let options = PlanOptions {
        mode: ModeChoice::Auto,
        n_ctx: N_CTX,
        n_ubatch: 512,
        window_layers: Some(1),
        expert_prefetch: Some(true),
        // Whole layers' experts on the GPU (where the host streams, the plan's own choice is
        // the pool: `pooled_plan`).
        gpu_experts: Some(GpuExperts::Layers),
        ..PlanOptions::default()
    };
    plan::plan(inventory, &machine(host_bytes, gpu_bytes), &options).unwrap()
}

fn machine(host_bytes: u64, gpu_bytes: u64) -> MachineFacts {
    MachineFacts {
        memory_budget_bytes: host_bytes,
        disk_bytes_per_sec: Some(1e9),
        gpu_budget_bytes: gpu_bytes,
        ..MachineFacts::default()
    }
}

/// The token embedding's bytes, and those of its copy on the GPU for a model whose logits use
/// it (no output matrix).
fn embedding_and_tied_copy(inventory: &Inventory) -> (u64, u64) {
    let embedding: u64 =
        inventory.tensors.iter().filter(|tensor| tensor.role == Role::TokenEmbedding).map(|tensor| tensor.bytes).sum();
    let tied = if inventory.tensors.iter().any(|tensor| tensor.role == Role::Output) { 0 } else { embedding };
    (embedding, tied)
}

/// A GPU budget for what every token touches, op offload's copy of the largest host layer's
/// FFN and the FFN of the last `ffn_layers` layers, and a host budget too small for the rest,
/// so the rest streams.
fn plan_with_gpu(inventory: &Inventory, ffn_layers: usize, host_spare: u64) -> Plan {
    let ffn = layer_ffn(inventory);
    let (embedding, tied) = embedding_and_tied_copy(inventory);
    let every_token = inventory.tensor_data_bytes() - ffn.iter().sum::<u64>() - embedding;
    let compute = plan::compute_buffer_bytes(inventory, N_CTX, 512);
    let copy = ffn.iter().copied().max().unwrap();
    let gpu = every_token
        + tied
        + plan::kv_cache_bytes(inventory, N_CTX, Default::default())
        + plan::device_compute_bytes(inventory, N_CTX, 512)
        + copy
        + ffn.iter().rev().take(ffn_layers).sum::<u64>();
    let plan = plan_with_budgets(inventory, embedding + compute + host_spare, gpu);
    let n_layer = ffn.len() as u32;
    assert_eq!(
        plan.gpu.as_ref().unwrap().ffn_layers,
        (n_layer - ffn_layers as u32..n_layer).collect::<Vec<_>>(),
        "{}",
        plan.render()
    );
    plan
}

/// A GPU budget for llama.cpp's partial offload of the last `layers` layers (attention, FFN
/// and KV cache) and the output (for Gemma, the tied embedding's copy) with the compute buffer
/// and room to copy one host layer, which is less than every layer's attention with the
/// output; a host budget for the embedding, the other layers' attention and KV cache, and
/// `host_spare` bytes of FFN, so the rest streams.
fn plan_with_whole_layers(inventory: &Inventory, layers: usize, host_spare: u64) -> Plan {
    let n_layer = inventory.hparams.n_layer as usize;
    let whole: Vec<u64> = (0..n_layer as u32)
        .map(|layer| {
            inventory.tensors.iter().filter(|tensor| tensor.layer == Some(layer)).map(|tensor| tensor.bytes).sum()
        })
        .collect();
    let ffn = layer_ffn(inventory);
    let (embedding, tied) = embedding_and_tied_copy(inventory);
    let outside = inventory.tensor_data_bytes() - whole.iter().sum::<u64>() - embedding;
    let kv_layer = plan::kv_cache_bytes(inventory, N_CTX, Default::default()) / n_layer as u64;
    let compute = plan::compute_buffer_bytes(inventory, N_CTX, 512);
    let gpu = outside
        + tied
        + plan::device_compute_bytes(inventory, N_CTX, 512)
        + whole.iter().max().unwrap()
        + whole.iter().rev().take(layers).map(|bytes| bytes + kv_layer).sum::<u64>();
    let host_layers = n_layer - layers;
    let host_fixed =
        embedding + (0..host_layers).map(|layer| whole[layer] - ffn[layer] + kv_layer).sum::<u64>() + compute;
    let plan = plan_with_budgets(inventory, host_fixed + host_spare, gpu);
    assert_eq!(plan.gpu.as_ref().unwrap().whole_layers, Some(host_layers as u32..n_layer as u32), "{}", plan.render());
    // The layers and the output, as llama.cpp counts them.
    assert_eq!(plan.n_gpu_layers(), layers as i32 + 1);
    plan
}

fn greedy(engine: &Arc<Engine>, count: u32) -> hypura::engine::GenerateOutput {
    common::greedy(engine, PROMPT, count)
}

/// A tiny model on one thread, as `plan` says (None: resident), without repacking.
fn open_tiny(path: &Path, plan: Option<Plan>) -> Arc<Engine> {
    let options =
        EngineOptions { n_ctx_seq: N_CTX, n_threads: Some(1), repack: false, plan, ..EngineOptions::default() };
    Arc::new(Engine::open(path, options).unwrap())
}

/// Hypura with `plan` against llama.cpp loaded with the plan's placement: the same 32 greedy
/// tokens, and the hook stopped the graph `hooked_layers` times per graph.
fn assert_same_as_llama_cpp(path: &Path, plan: Plan, mode: Mode, hooked_layers: u64) {
    let placement = PeerPlacement::parse("same", Some(&plan), 0).unwrap();
    let whole_layers = plan.gpu.as_ref().unwrap().whole_layers.clone();
    match &placement {
        PeerPlacement::Same { n_gpu_layers, host_patterns } => {
            assert_eq!(*n_gpu_layers, whole_layers.as_ref().map_or(-1, |layers| layers.len() as i32 + 1));
            // The peer keeps every host and streamed tensor that n_gpu_layers would put on the
            // device in host memory, by exact name (none where the device holds whole layers).
            let host = plan
                .tensors
                .iter()
                .filter(|tensor| tensor.tier != Tier::Gpu && tensor.name != "token_embd.weight")
                .filter(|tensor| {
                    whole_layers.as_ref().is_none_or(|layers| tensor.layer.is_some_and(|layer| layers.contains(&layer)))
                })
                .count();
            assert_eq!(host_patterns.len(), host);
            assert_eq!(host > 0, whole_layers.is_none());
        }
        other => panic!("{other:?}"),
    }
    let n_gpu_layers = plan.n_gpu_layers();
    let options = EngineOptions {
        n_ctx_seq: N_CTX,
        n_threads: Some(1),
        repack: false,
        plan: Some(plan),
        ..EngineOptions::default()
    };
    let engine = Arc::new(Engine::open(path, options).unwrap());
    assert_eq!(engine.mode(), mode);
    let ours = greedy(&engine, 32);
    let config = PeerConfig { repack: false, placement, ..PeerConfig::default() };
    let mut peer = PlainLlama::load_configured(path, N_CTX, 1, &config).unwrap();
    assert!(peer.placement().contains(&format!("n_gpu_layers {n_gpu_layers},")), "{}", peer.placement());
    let theirs = peer.greedy(&peer.tokenize(PROMPT).unwrap(), 32).unwrap();
    assert_eq!(ours.tokens, theirs);
    let io = ours.stats.io.expect("streaming stats");
    assert!(io.bytes_read > 0, "{io:?}");
    // The prompt's graph and 31 decodes: the 32nd token ends the answer undecoded.
    assert_eq!(ours.stats.weight_passes(), 32);
    assert_eq!(io.observations, hooked_layers * 32, "{io:?}");
}

#[test]
fn expert_layers_on_the_gpu_are_not_streamed_and_tokens_equal_llama_cpp_with_that_placement() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-moe-8x", directory.path());
    let inventory = Inventory::open(&path).unwrap();
    let n_expert = inventory.hparams.n_expert;
    let unit: u64 = inventory
        .expert_tensors()
        .filter(|tensor| tensor.layer == Some(0))
        .map(|tensor| tensor.experts.unwrap().slice_bytes)
        .sum();
    // 4 layers: the GPU holds the experts of the last 2, the host streams the first 2 through
    // a cache of one layer's experts (plus the dense parts: routers are on the GPU).
    let plan = plan_with_gpu(&inventory, 2, n_expert * unit + unit / 2);
    assert_eq!(plan.mode, Mode::ExpertStream, "{}", plan.render());
    assert!(plan
        .streamed_tensors()
        .all(|tensor| tensor.name.starts_with("blk.0.") || tensor.name.starts_with("blk.1.")));
    // The expert hook stops only at the streamed layers, none of the GPU's.
    assert_same_as_llama_cpp(&path, plan, Mode::ExpertStream, 2);
}

/// Gemma (18 layers) with `gpu_layers` of them on the GPU as `plan_for` places them and a
/// host budget for 5½ of its largest FFN layers (a window of 2 and 3 pinned): the host streams
/// only layers below the GPU's, the other `streamed` ones, and the tokens equal llama.cpp's.
fn gemma_dense_stream_beside_the_gpu(plan_for: fn(&Inventory, usize, u64) -> Plan, gpu_layers: usize, streamed: usize) {
    let path = common::gemma_path();
    let inventory = Inventory::open(&path).unwrap();
    let largest = layer_ffn(&inventory).into_iter().max().unwrap();
    let plan = plan_for(&inventory, gpu_layers, 5 * largest + largest / 2);
    let dense = plan.dense.as_ref().unwrap_or_else(|| panic!("{}", plan.render()));
    assert_eq!((dense.pinned_layers.len(), dense.streamed_layers.len()), (3, streamed), "{}", plan.render());
    assert!(dense.streamed_layers.iter().all(|&layer| (layer as usize) < 18 - gpu_layers));
    // The dense hook stops at every layer (pinned and GPU layers start the next reads early).
    assert_same_as_llama_cpp(&path, plan, Mode::DenseStream, 18);
}

#[test]
fn gemma_ffn_layers_on_the_gpu_leave_the_dense_window_and_tokens_equal_llama_cpp_with_that_placement() {
    let _machine = common::shared_machine();
    // 4 FFN layers on the GPU (every layer's attention there too): 11 of the 14 host layers stream.
    gemma_dense_stream_beside_the_gpu(plan_with_gpu, 4, 11);
}

#[test]
fn gemma_last_layers_whole_on_the_gpu_leave_the_dense_window_and_tokens_equal_llama_cpp_with_that_placement() {
    let _machine = common::shared_machine();
    // The last 3 layers whole on the GPU with the output: 12 of the 15 host layers stream.
    gemma_dense_stream_beside_the_gpu(plan_with_whole_layers, 3, 12);
}

/// The plan with the device's expert pool asked for, at these budgets.
fn pooled_plan(inventory: &Inventory, gpu_budget: u64, memory_budget: u64) -> Plan {
    pooled_plan_on(inventory, &machine(memory_budget, gpu_budget))
}

fn pooled_plan_on(inventory: &Inventory, facts: &MachineFacts) -> Plan {
    plan_asking(inventory, facts, GpuExperts::Pool)
}

fn plan_asking(inventory: &Inventory, facts: &MachineFacts, experts: GpuExperts) -> Plan {
    let options = PlanOptions {
        mode: ModeChoice::Auto,
        n_ctx: N_CTX,
        n_ubatch: 512,
        gpu_experts: Some(experts),
        ..PlanOptions::default()
    };
    plan::plan(inventory, facts, &options).unwrap()
}

/// The tiny MoE preset, forged into a temporary directory, and its inventory.
fn tiny_moe() -> (tempfile::TempDir, std::path::PathBuf, Inventory) {
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-moe-30b", directory.path());
    let inventory = Inventory::open(&path).unwrap();
    (directory, path, inventory)
}

/// With a recorded routing that a few slots serve, the last MoE layers' experts go on the
/// device whole beside the pool: the graph does not stop at them, it stops at each pooled
/// layer, and the greedy tokens equal the resident model's.
#[test]
fn whole_moe_layers_beside_the_pool_are_not_hooked_and_tokens_equal_resident() {
    let _machine = common::shared_machine();
    let (_directory, path, inventory) = tiny_moe();
    let hparams = &inventory.hparams;
    let (n_expert, n_layer) = (hparams.n_expert, hparams.n_layer);
    // Room for half of every layer's experts: a layer whole, and slots for the router's picks
    // in the others.
    let gpu = common::expert_pool_budget(&inventory, N_CTX, 512, n_expert / 2);
    // Every expert picked again before any other: one slot a layer would serve the routing.
    let reuse = plan::ReuseDepths {
        depths: vec![1000],
        bin: 1,
        layers: n_layer,
        first: n_expert * n_layer,
        ..Default::default()
    };
    let plan = pooled_plan_on(&inventory, &MachineFacts { expert_reuse: Some(reuse), ..machine(1 << 30, gpu) });
    let pool = plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.clone()).unwrap_or_else(|| panic!("{}", plan.render()));
    assert!(!pool.layers.is_empty() && !pool.whole_layers.is_empty(), "{}", plan.render());
    assert_eq!(pool.whole_layers.last(), Some(&(n_layer as u32 - 1)), "{}", plan.render());
    assert_eq!(plan.gpu.as_ref().unwrap().ffn_layers, pool.whole_layers, "{}", plan.render());

    let ours = greedy(&open_tiny(&path, Some(plan)), 32);
    let resident = open_tiny(&path, None);
    assert_eq!(resident.mode(), Mode::Resident);
    assert_eq!(ours.tokens, greedy(&resident, 32).tokens);
    assert_eq!(ours.stats.io.expect("io stats").observations, pool.layers.len() as u64 * 32);
    let device = ours.stats.experts.expect("expert stats").device;
    assert!(device.hits > 0, "{device:?}");
}

/// The pool starts warm: at load, the host cache's free room is filled from disk (each unit
/// once, nothing evicted), so that decode's slot misses find their experts in RAM. With a host
/// budget that holds every expert, the load reads them all and the request reads nothing from
/// disk; the tokens are the resident model's.
#[test]
fn the_host_cache_fills_its_free_room_at_load_beside_the_pool() {
    let _machine = common::shared_machine();
    let (_directory, path, inventory) = tiny_moe();
    let hparams = &inventory.hparams;
    let gpu = common::expert_pool_budget(&inventory, N_CTX, 512, hparams.n_expert_used + 1);
    // A host budget that holds every expert: the fill never has to stop.
    let plan = pooled_plan(&inventory, gpu, 1 << 30);
    let pool = plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.clone()).expect("a pool");
    let engine = open_tiny(&path, Some(plan));
    let streaming = engine.streaming().expect("streaming");
    let at_load = streaming.driver.experts().expect("experts").snapshot();
    // Every expert no slot took at load was read once, into the cache.
    let units = hparams.n_layer * hparams.n_expert;
    assert_eq!(at_load.warm_reads, units - at_load.device.preloaded, "{at_load:?}");
    assert!(at_load.warm_bytes > 0 && at_load.warm_bytes <= streaming.load_bytes, "{at_load:?}");
    assert_eq!(pool.layers.len() as u64, hparams.n_layer, "every layer pooled: {pool:?}");
    let ours = common::greedy(&engine, "Hi", 16);
    assert_eq!(ours.tokens, common::greedy(&open_tiny(&path, None), "Hi", 16).tokens);
    let experts = ours.stats.experts.clone().expect("expert stats");
    assert_eq!((experts.misses, experts.warm_reads), (0, 0), "{experts:?}");
    assert_eq!(ours.stats.io.expect("io stats").bytes_read, 0);
}

/// The expert pool: every MoE layer's routed experts in `slots` device slots (here the CPU's
/// memory, where llama.cpp computes "GPU" layers without a GPU), uploaded from the host's
/// expert cache as the router picks them, the ids rewritten to slots; a prompt batch that picks
/// more experts than a layer has slots computes from the staging area. The same kernels on the
/// same bytes: the greedy tokens equal the resident model's.
#[test]
fn pooled_experts_are_served_from_slots_and_staging_and_tokens_equal_resident() {
    let _machine = common::shared_machine();
    let (_directory, path, inventory) = tiny_moe();
    let hparams = &inventory.hparams;
    let (n_expert, k) = (hparams.n_expert, hparams.n_expert_used);
    let (per_slot, staging) = common::expert_pool_costs(&inventory);
    let (embedding, _) = embedding_and_tied_copy(&inventory);
    let compute = plan::compute_buffer_bytes(&inventory, N_CTX, 512);
    // Room for k + 1 slots per layer: a decode's picks fit, the prompt's do not.
    let slots = k + 1;
    let gpu = common::expert_pool_budget(&inventory, N_CTX, 512, slots);
    // The host cache holds two layers' experts: the rest of the model streams.
    let plan = pooled_plan(&inventory, gpu, embedding + compute + 2 * n_expert * per_slot / hparams.n_layer);
    let pool = plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.clone()).unwrap_or_else(|| panic!("{}", plan.render()));
    // At least k + 1 slots (the budget's other terms are the plan's own estimates), fewer
    // than the experts.
    assert!((slots..n_expert).contains(&(pool.slots as u64)), "{}", plan.render());
    assert_eq!(pool.layers, (0..hparams.n_layer as u32).collect::<Vec<_>>());
    assert_eq!(plan.mode, Mode::ExpertStream);
    assert!(
        plan.render().contains(&format!("expert pool  {} slots in each of 4 MoE layers", pool.slots)),
        "{}",
        plan.render()
    );

    let pooled = open_tiny(&path, Some(plan));
    let ours = greedy(&pooled, 32);
    let resident = open_tiny(&path, None);
    assert_eq!(resident.mode(), Mode::Resident);
    let theirs = greedy(&resident, 32);
    assert_eq!(ours.tokens, theirs.tokens);
    let experts = ours.stats.experts.expect("expert stats");
    let device = &experts.device;
    // The prompt's graph stages the layers where it picks more experts than the slots; each
    // decode serves every layer from slots, uploading what they do not hold.
    assert!((1..=hparams.n_layer).contains(&device.staged_layers), "{experts:?}");
    assert!(device.hits > 0 && device.uploads > 0, "{experts:?}");
    // Slots gave experts back to the host cache (copied from the device): later picks of them
    // uploaded those copies, and the tokens still agree.
    assert!(device.evictions > 0, "{experts:?}");
    let decode_picks = 31 * hparams.n_layer * k;
    let prompt_slot_picks = device.hits + device.uploads - decode_picks;
    assert!(prompt_slot_picks <= (hparams.n_layer - device.staged_layers) * pool.slots as u64, "{experts:?}");
    // The first prompt found every slot empty: each staged layer filled its slots with the
    // batch's most picked experts, on the device.
    assert_eq!(device.staged_into_slots, device.staged_layers * pool.slots as u64, "{experts:?}");
    // Staging uploads at most a layer whole each time; slots took the rest.
    assert!(device.staged_bytes <= device.staged_layers * staging, "{experts:?}");
    assert!(device.upload_bytes > device.staged_bytes, "{experts:?}");
    // At most one expert copied back per eviction (none where the host cache still held it);
    // the moves are timed within the host's work at the stops.
    assert!(device.copied_back_bytes > 0, "{experts:?}");
    let largest_expert = (0..hparams.n_layer as u32)
        .map(|layer| {
            let slices = inventory.expert_tensors().filter(|tensor| tensor.layer == Some(layer));
            slices.map(|tensor| tensor.experts.map_or(0, |experts| experts.slice_bytes)).sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    assert!(device.copied_back_bytes <= device.evictions * largest_expert, "{experts:?}");
    assert!(device.transfer_seconds > 0.0 && device.host_seconds >= device.transfer_seconds, "{experts:?}");
    // One stop per layer per graph, after the router's weights.
    assert_eq!(ours.stats.io.expect("io stats").observations, hparams.n_layer * 32);
    // Each stop is timed apart: its ids within the host's work, its segment, and (but for a
    // graph's first stop) the callback's questions about the nodes since the stop before.
    assert_eq!(device.stops, hparams.n_layer * 32, "{experts:?}");
    assert_eq!(device.asked_stops, (hparams.n_layer - 1) * 32, "{experts:?}");
    assert!(device.asked_nodes >= device.asked_stops * 4 && device.asks_seconds > 0.0, "{experts:?}");
    assert!(device.ids_seconds > 0.0 && device.ids_seconds < device.host_seconds, "{experts:?}");
    assert!(device.segment_seconds > 0.0, "{experts:?}");
    // A second prompt after the decodes filled the slots: its staged layers take the picks
    // the slots hold from them on the device's side, and the tokens still agree.
    let again = greedy(&pooled, 8);
    assert_eq!(again.tokens, theirs.tokens[..8]);
    let device = again.stats.experts.expect("expert stats").device;
    assert!(device.staged_layers > 0 && device.staged_on_device_bytes > 0, "{device:?}");
    assert!(device.staged_bytes + device.staged_on_device_bytes <= device.staged_layers * staging, "{device:?}");
}

/// The split pool (decision 33): at decode a pick no slot holds is computed by the CPU from the
/// host cache (its id at the layer's zero slot) while the device computes the slots' picks, and
/// the CPU's sum is added at the layer's `ffn_moe_out`; an expert is uploaded only once its picks
/// earn it a slot. The prompt's graph, staged, shows the layers compute plain SwiGLU experts
/// first. The same kernels, summed in another order: the greedy tokens equal the resident
/// model's.
#[test]
fn a_split_pool_computes_misses_on_the_cpu_and_tokens_equal_resident() {
    let _machine = common::shared_machine();
    let (_directory, path, inventory) = tiny_moe();
    let hparams = &inventory.hparams;
    let (n_expert, k, n_layer) = (hparams.n_expert, hparams.n_expert_used, hparams.n_layer);
    let (per_slot, _) = common::expert_pool_costs(&inventory);
    let (embedding, _) = embedding_and_tied_copy(&inventory);
    let compute = plan::compute_buffer_bytes(&inventory, N_CTX, 512);
    // About 2k slots that hold experts, and the zero slot (the plan may take a layer whole).
    let gpu = common::expert_pool_budget(&inventory, N_CTX, 512, 2 * k + 1);
    let facts = machine(embedding + compute + 2 * n_expert * per_slot / n_layer, gpu);
    let plan = plan_asking(&inventory, &facts, GpuExperts::Split);
    let pool = plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.clone()).unwrap_or_else(|| panic!("{}", plan.render()));
    assert!(pool.split && (k + 2..n_expert).contains(&(pool.slots as u64)), "{}", plan.render());
    assert!(plan.render().contains("split: the CPU computes"), "{}", plan.render());

    let split = open_tiny(&path, Some(plan.clone()));
    let ours = greedy(&split, 32);
    let resident = open_tiny(&path, None);
    let theirs = greedy(&resident, 32);
    assert_eq!(ours.tokens, theirs.tokens);
    let experts = ours.stats.experts.expect("expert stats");
    let device = &experts.device;
    // The decodes' misses went to the CPU: their bytes, the CPU's time for them, and a stop at
    // each such layer's sum beside the one after its router.
    assert!(device.cpu_picks > 0 && device.hits > 0, "{experts:?}");
    let largest_expert = per_slot / n_layer;
    assert!(device.cpu_bytes > 0 && device.cpu_bytes <= device.cpu_picks * 31 * largest_expert, "{experts:?}");
    assert!(device.cpu_seconds > 0.0, "{experts:?}");
    let pooled_layers = pool.layers.len() as u64;
    let observations = ours.stats.io.expect("io stats").observations;
    assert!(
        observations > pooled_layers * 32 && observations <= 2 * pooled_layers * 32,
        "{observations} stops, {experts:?}"
    );
    // Each decode batch of a layer picks k experts: the slots served some, the CPU some, and the
    // rest were uploaded; far fewer uploads than misses.
    let decode_picks = 31 * pooled_layers * k;
    assert!(device.uploads < device.cpu_picks, "{experts:?}");
    assert!(device.hits + device.cpu_picks + device.uploads >= decode_picks, "{experts:?}");
    // A prompt evaluated a token a graph is served like decodes (its misses computed by the
    // CPU, but for its first token's graph, before the layers' names were seen): its logits are
    // the resident model's but for the order of the sums. Without the CPU's share they would
    // lack some experts' outputs.
    let token_a_graph = |plan: Option<Plan>| {
        let options = EngineOptions {
            n_ctx_seq: N_CTX,
            n_ubatch: 1,
            n_threads: Some(1),
            repack: false,
            plan,
            ..EngineOptions::default()
        };
        Arc::new(Engine::open(&path, options).unwrap())
    };
    let (one_by_one, resident_one_by_one) = (token_a_graph(Some(plan)), token_a_graph(None));
    let prompt = Prompt::Raw(PROMPT.into());
    let logits = Session::new(one_by_one.clone()).unwrap().prompt_logits(&prompt).unwrap();
    let reference = Session::new(resident_one_by_one).unwrap().prompt_logits(&prompt).unwrap();
    let scale = reference.iter().fold(0f32, |most, value| most.max(value.abs()));
    let apart = logits.iter().zip(&reference).fold(0f32, |most, (a, b)| most.max((a - b).abs()));
    assert!(apart <= 1e-4 * scale, "logits {apart} apart at a scale of {scale}");
    let stream = one_by_one.streaming().and_then(|streaming| streaming.driver.experts.clone()).expect("experts");
    let device = stream.snapshot().device;
    assert!(device.cpu_picks > 0 && device.staged_layers == 0, "{device:?}");
    // The unsplit pool on the same budget uploads every miss instead.
    let pooled = greedy(&open_tiny(&path, Some(pooled_plan_on(&inventory, &facts))), 32);
    assert_eq!(pooled.tokens, theirs.tokens);
    let unsplit = pooled.stats.experts.expect("expert stats").device;
    assert!(unsplit.cpu_picks == 0 && unsplit.uploads > experts.device.uploads, "{unsplit:?} against {experts:?}");
}

/// The pool starts warm: with a recorded routing that counts which experts decode picked, each
/// pooled layer's slots hold its most picked experts at load, read before the first graph, and a
/// first decode finds them there; the greedy tokens still equal the resident model's.
#[test]
fn the_pool_starts_with_the_recorded_routings_most_picked_experts() {
    let _machine = common::shared_machine();
    let (_directory, path, inventory) = tiny_moe();
    let hparams = &inventory.hparams;
    let (n_expert, k, n_layer) = (hparams.n_expert, hparams.n_expert_used, hparams.n_layer);
    let gpu = common::expert_pool_budget(&inventory, N_CTX, 512, k + 1);
    // Decode picked the even experts, the lower the more; never an odd one.
    let unit_picks: Vec<u64> = (0..n_layer * n_expert)
        .map(|unit| unit % n_expert)
        .map(|expert| if expert % 2 == 0 { 100 - expert } else { 0 })
        .collect();
    let reuse =
        plan::ReuseDepths { depths: vec![10, 10, 10], bin: 4, layers: n_layer, first: n_expert * n_layer, unit_picks };
    let plan = pooled_plan_on(&inventory, &MachineFacts { expert_reuse: Some(reuse), ..machine(1 << 30, gpu) });
    let pool = plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.clone()).unwrap_or_else(|| panic!("{}", plan.render()));
    assert!(
        !pool.layers.is_empty() && pool.warm_order.len() as u64 == pool.layers.len() as u64 * n_expert / 2,
        "{pool:?}"
    );

    let engine = open_tiny(&path, Some(plan));
    let stream = engine.streaming().and_then(|streaming| streaming.driver.experts.clone()).expect("experts");
    let slots = u64::from(pool.slots);
    for &layer in &pool.layers {
        for expert in 0..n_expert {
            let expected = expert % 2 == 0 && expert / 2 < slots;
            assert_eq!(stream.slot_holds(layer as usize, expert as usize), expected, "layer {layer}, expert {expert}");
        }
    }
    let loaded = stream.snapshot().device;
    assert_eq!(loaded.preloaded, pool.layers.len() as u64 * slots, "{loaded:?}");
    assert!(loaded.preloaded_bytes > 0 && loaded.hits == 0, "{loaded:?}");
    let ours = greedy(&engine, 8);
    assert_eq!(ours.tokens, greedy(&open_tiny(&path, None), 8).tokens);
}
