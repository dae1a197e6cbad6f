//! The placement planner: `(inventory, machine facts, options) -> Plan`. Pure: no I/O, no ggml.
//!
//! It decides the mode (resident, dense-stream, expert-stream), the tier of every tensor, the
//! dense layout (which FFN layers are pinned in RAM, which stream through a window of `D`
//! layers), and checks that weights + window + KV cache + compute buffers fit the budget. For a
//! cyclic sweep over layers, LRU caching gets nothing; a fixed pinned set gets exactly its share,
//! so the planner pins a fixed set and streams the rest.
//!
//! The entry points are `plan` (one context and prompt batch) and `choose` (`search`: the
//! context, the prompt batch and the plan a run gets); the parts live in submodules: `types`
//! (the options, facts, plan and errors), `sizing` (what tensors cost, which may stream), `gpu` (the GPU tier and how
//! llama.cpp is told about it), `dense` (the dense-stream window and its cost model), `experts`
//! (the expert cache) and `render` (the explanation `inspect` prints). The planner depends on
//! `crate::model` and the pure formatting helpers in `crate::format` alone.
mod dense;
mod experts;
mod gpu;
mod pool;
mod predict;
mod remote;
mod render;
mod reuse;
mod search;
mod sizing;
#[cfg(test)]
pub(crate) mod test_support;
mod types;

pub use dense::{limit_tokens_per_sec, DenseLayout, READ_CHUNK_BYTES};
pub use experts::{ExpertLayout, HUGE_SLICE_MIN_BYTES};
pub use gpu::{GpuExpertsOption, GpuLayout};
pub use pool::{ExpertPoolLayout, POOL_ALIGNMENT};
pub use predict::{cached_units, predict, Prediction, CPU_BYTES_PER_SEC_UNMEASURED, REAL_ROUTING_FROM};
pub use remote::{RemoteDeviceFacts, RemoteLayout, RemoteShare, REMOTE_RESERVE_BYTES};
pub use reuse::{uniform_hit_rate, ReuseDepths, ReuseTracker, REAL_ROUTING_BELOW, REAL_ROUTING_FIRST};
pub use search::{choose, context_for, plan_for, Ask, Choice, DRAFT_UBATCH};
pub use sizing::{compute_buffer_bytes, context_memory_bytes, device_compute_bytes, kv_cache_bytes, KvTypes};
pub use types::{
    BudgetUse, CachePolicy, GpuExperts, MachineFacts, Mode, ModeChoice, Plan, PlanError, PlanOptions, TensorPlacement,
    Tier,
};

use crate::model::{Inventory, Role, TensorEntry};
use dense::plan_dense;
use experts::plan_experts;
use gpu::{gpu_tier, place};
use remote::remote_tier;
use sizing::ffn_bytes_by_layer;

/// The plan for `inventory` on `machine` at the options' one context and prompt batch: the GPU
/// tier first, then the mode (resident where the host holds the rest), then that mode's
/// layout. With remote devices, their tier is weighed against the host alone (`weigh`).
/// `choose` searches the context and the prompt batch around it.
pub fn plan(inventory: &Inventory, machine: &MachineFacts, options: &PlanOptions) -> Result<Plan, PlanError> {
    if machine.remote_devices.is_empty() {
        return plan_reaching(inventory, machine, options, Reach::Host);
    }
    let candidate = |reach| {
        plan_reaching(inventory, machine, options, reach).map(|plan| Choice {
            n_ctx_seq: options.n_ctx / options.n_sequences.max(1),
            n_batch: options.n_ubatch,
            plan,
        })
    };
    weigh(machine, candidate(Reach::Host), candidate(Reach::Remote)).map(|choice| choice.plan)
}

/// Which devices beside the host a plan may put layers on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// The host and its GPU.
    Host,
    /// The host and the remote devices: their tier, or an error where none holds a layer.
    Remote,
}

/// `plan` with only `reach`'s devices. MTP layers, which llama.cpp does not load for decoding,
/// are planned as unused and cost nothing; where they draft (`options.mtp`) they are resident in
/// host memory, taken out of the budget before the rest is planned (`BudgetUse::mtp_bytes`).
pub(crate) fn plan_reaching(
    inventory: &Inventory,
    machine: &MachineFacts,
    options: &PlanOptions,
    reach: Reach,
) -> Result<Plan, PlanError> {
    let plan_loaded = |inventory: &Inventory, machine: &MachineFacts| match reach {
        Reach::Host => plan_local(inventory, machine, options),
        Reach::Remote => plan_remote(inventory, machine, options),
    };
    if !inventory.tensors.iter().any(|tensor| tensor.role == Role::Mtp) {
        return plan_loaded(inventory, machine);
    }
    let loaded = Inventory {
        tensors: inventory.tensors.iter().filter(|tensor| tensor.role != Role::Mtp).cloned().collect(),
        ..inventory.clone()
    };
    let mtp_bytes: u64 = if options.mtp {
        inventory.tensors.iter().filter(|tensor| tensor.role == Role::Mtp).map(|tensor| tensor.bytes).sum()
    } else {
        0
    };
    let machine =
        MachineFacts { memory_budget_bytes: machine.memory_budget_bytes.saturating_sub(mtp_bytes), ..machine.clone() };
    let mut plan = plan_loaded(&loaded, &machine)?;
    plan.budget.set_aside(mtp_bytes, |budget| &mut budget.mtp_bytes);
    let mut placed = std::mem::take(&mut plan.tensors).into_iter();
    plan.tensors = inventory
        .tensors
        .iter()
        .map(|tensor| match tensor.role {
            Role::Mtp => {
                let (tier, why) = if options.mtp {
                    (Tier::Ram, "an MTP layer, resident: it drafts tokens for speculative decoding")
                } else {
                    (Tier::Unused, "an MTP layer: decoding does not run it, and llama.cpp does not load it")
                };
                TensorPlacement { name: tensor.name.clone(), layer: tensor.layer, tier, bytes: tensor.bytes, why }
            }
            _ => placed.next().expect("one placement per loaded tensor"),
        })
        .collect();
    Ok(plan)
}

/// The host's plan with its GPU tier, if any. Forced streaming (tests, benchmarks) streams
/// every FFN layer the host cannot hold: none of them goes to the GPU.
///
/// Left to the plan (`--gpu-experts auto`): where whole layers' experts all fit the GPU, that;
/// where some would stay with the host (streamed, or resident and computed by the CPU), the
/// device's expert pool is planned too, split where the model's experts allow it and unsplit,
/// and each is predicted for this machine and this routing (the model's record, else real
/// models' routing: `plan::predict`); the fastest is taken, and the GPU tier lists every one
/// with its prediction (`GpuLayout::experts_options`).
fn plan_local(inventory: &Inventory, machine: &MachineFacts, options: &PlanOptions) -> Result<Plan, PlanError> {
    if options.gpu_experts.is_some() || machine.gpu_budget_bytes == 0 {
        return plan_local_placed(inventory, machine, options);
    }
    let asked = |choice: GpuExperts| PlanOptions { gpu_experts: Some(choice), ..options.clone() };
    let layers = plan_local_placed(inventory, machine, &asked(GpuExperts::Layers));
    let experts_on_host = |plan: &Plan| {
        inventory.tensors.iter().zip(&plan.tensors).any(|(tensor, placed)| {
            tensor.role.is_expert() && tensor.role != Role::Mtp && !matches!(placed.tier, Tier::Gpu | Tier::Unused)
        })
    };
    let Ok(layers) = layers else { return layers };
    if layers.gpu.is_none() || !experts_on_host(&layers) {
        return Ok(layers);
    }
    let pooled = |choice: GpuExperts| {
        plan_local_placed(inventory, machine, &asked(choice)).ok().filter(|plan| {
            plan.gpu
                .as_ref()
                .and_then(|gpu| gpu.expert_pool.as_ref())
                .is_some_and(|pool| pool.split == (choice == GpuExperts::Split))
        })
    };
    let decode = |plan: &Plan| {
        predict::predict(plan, machine, options.n_ubatch, predict::touched(inventory, plan)).decode_tokens_per_sec
    };
    let mut weighed: Vec<(GpuExperts, Plan, Option<f64>)> = [GpuExperts::Split, GpuExperts::Pool]
        .into_iter()
        .filter_map(|choice| pooled(choice).map(|plan| (choice, plan)))
        .chain(std::iter::once((GpuExperts::Layers, layers)))
        .map(|(choice, plan)| {
            let rate = decode(&plan);
            (choice, plan, rate)
        })
        .collect();
    // The fastest predicted. A GPU plan is always predicted (a CPU or a disk never measured at
    // an assumed rate: S6a's first run on a fresh machine took the split by rule, 0.75 of whole
    // layers); one unpredictable all the same loses to any predicted.
    let best = (0..weighed.len())
        .reduce(|best, next| match (weighed[best].2, weighed[next].2) {
            (Some(rate), Some(other)) if other > rate => next,
            (None, Some(_)) => next,
            _ => best,
        })
        .unwrap_or(0);
    let listed: Vec<gpu::GpuExpertsOption> = weighed
        .iter()
        .enumerate()
        .map(|(index, (choice, _, rate))| gpu::GpuExpertsOption {
            name: choice.name(),
            decode_tokens_per_sec: *rate,
            chosen: index == best,
        })
        .collect();
    let mut chosen = weighed.swap_remove(best).1;
    if let Some(gpu) = chosen.gpu.as_mut() {
        gpu.experts_options = listed;
    }
    Ok(chosen)
}

fn plan_local_placed(inventory: &Inventory, machine: &MachineFacts, options: &PlanOptions) -> Result<Plan, PlanError> {
    let all_layer_ffn = ffn_bytes_by_layer(inventory);
    let forced_stream = matches!(options.mode, ModeChoice::Forced(Mode::DenseStream | Mode::ExpertStream));
    let (gpu, gpu_unused) = match gpu_tier(inventory, options, machine, &all_layer_ffn, !forced_stream) {
        Ok(gpu) => (gpu, None),
        Err(why) => (None, Some(why)),
    };
    plan_host(inventory, machine, options, &all_layer_ffn, gpu, gpu_unused, None)
}

/// The host's plan beside the largest remote tier the devices hold, with its predicted time per
/// token: the host's time for its layers, the remote layers' compute (as the host would take
/// for them) and the links. Remote devices and a local GPU are not combined yet: the host's
/// layers compute on the CPU.
fn plan_remote(inventory: &Inventory, machine: &MachineFacts, options: &PlanOptions) -> Result<Plan, PlanError> {
    let mut remote = remote_tier(inventory, options, machine).ok_or(PlanError::NoRemoteRoom)?;
    let all_layer_ffn = ffn_bytes_by_layer(inventory);
    // Why the GPU, if any, is unused: its tier's own refusal, or the remote devices.
    let forced_stream = matches!(options.mode, ModeChoice::Forced(Mode::DenseStream | Mode::ExpertStream));
    let gpu_unused = match gpu_tier(inventory, options, machine, &all_layer_ffn, !forced_stream) {
        Ok(Some(_)) => Some("remote devices were given: a local GPU tier beside them is not built".to_string()),
        Ok(None) => None,
        Err(why) => Some(why),
    };
    let mut plan = plan_host(inventory, machine, options, &all_layer_ffn, None, gpu_unused, Some(remote.clone()))
        .map_err(|error| PlanError::HostBeforeRemote { remote: remote.describe(), reason: Box::new(error) })?;
    let remote_share = remote.layers.len() as f64 / inventory.hparams.n_layer.max(1) as f64;
    remote.predicted_seconds_per_token =
        remote::host_seconds_per_token(machine, plan.streamed_bytes_per_token, 1.0 - remote_share)
            + machine.compute_seconds_per_token.unwrap_or(0.0) * remote_share
            + remote.link_seconds_per_token;
    plan.remote = Some(remote);
    Ok(plan)
}

/// The one place the remote tier is weighed against the host alone, each at its own context
/// and prompt batch: the remote plan where it is predicted faster or the host alone cannot be
/// planned, else the host's plan with the reason the devices went unused.
pub(crate) fn weigh(
    machine: &MachineFacts,
    local: Result<Choice, PlanError>,
    remote: Result<Choice, PlanError>,
) -> Result<Choice, PlanError> {
    let local_seconds = local.as_ref().map_or(f64::INFINITY, |local| local_seconds_per_token(machine, &local.plan));
    let why = match remote {
        Ok(mut chosen) => {
            let tier = chosen.plan.remote.as_mut().expect("a remote plan has a remote tier");
            tier.local_seconds_per_token = local_seconds;
            if tier.predicted_seconds_per_token < local_seconds || local.is_err() {
                return Ok(chosen);
            }
            let n_batch = local.as_ref().map_or(0, |local| local.n_batch);
            format!(
                "streaming locally alone is predicted faster ({} per token, prompt batches of {n_batch}, against {} with {} and {} of links)",
                format_seconds(local_seconds),
                format_seconds(tier.predicted_seconds_per_token),
                tier.describe(),
                format_seconds(tier.link_seconds_per_token)
            )
        }
        Err(error) => error.to_string(),
    };
    local.map(|local| Choice { plan: Plan { remote_unused: Some(why), ..local.plan }, ..local })
}

/// The predicted time per token of a plan without a remote tier: the longer of its streamed
/// bytes at the disk's rate and its measured compute (what the remote tier is weighed against).
pub fn local_seconds_per_token(machine: &MachineFacts, plan: &Plan) -> f64 {
    remote::host_seconds_per_token(machine, plan.streamed_bytes_per_token, 1.0)
}

/// A duration in the unit that reads best: ms below a second.
fn format_seconds(seconds: f64) -> String {
    if seconds.is_infinite() {
        "unbounded".into()
    } else if seconds < 1.0 {
        format!("{:.2} ms", seconds * 1e3)
    } else {
        format!("{seconds:.2} s")
    }
}

/// The host's plan beside a GPU tier or a remote tier: the mode (resident where the host holds
/// what they do not), then that mode's layout.
fn plan_host(
    inventory: &Inventory,
    machine: &MachineFacts,
    options: &PlanOptions,
    all_layer_ffn: &[u64],
    gpu: Option<GpuLayout>,
    gpu_unused: Option<String>,
    remote: Option<RemoteLayout>,
) -> Result<Plan, PlanError> {
    let off_host = |tensor: &TensorEntry| {
        gpu.as_ref().is_some_and(|gpu| gpu.holds(tensor)) || remote.as_ref().is_some_and(|remote| remote.holds(tensor))
    };
    // What the host holds: weights not on the GPU or a remote device, the KV cache of its own
    // layers, and the CPU's compute buffers (the CPU still computes host-resident and streamed
    // layers).
    let weights: u64 = inventory.tensors.iter().filter(|tensor| !off_host(tensor)).map(|tensor| tensor.bytes).sum();
    let kv = context_memory_bytes(inventory, options.n_ctx, options.n_sequences, options.kv)
        - gpu.as_ref().map_or(0, |gpu| gpu.kv_cache_bytes)
        - remote.as_ref().map_or(0, |remote| remote.host_context_bytes_moved);
    let compute = compute_buffer_bytes(inventory, options.n_ctx, options.n_ubatch);
    let budget = machine.memory_budget_bytes;
    let everything = weights + kv + compute;
    let has_experts = inventory.expert_tensors().any(|tensor| !off_host(tensor));
    // Pooled experts stream from the host's expert cache, however much of the model it holds.
    let pooled = gpu.as_ref().is_some_and(|gpu| gpu.expert_pool.is_some());
    let mode = match options.mode {
        ModeChoice::Forced(mode) => mode,
        ModeChoice::Auto if pooled && has_experts => Mode::ExpertStream,
        ModeChoice::Auto if everything <= budget => Mode::Resident,
        ModeChoice::Auto if has_experts => Mode::ExpertStream,
        ModeChoice::Auto => Mode::DenseStream,
    };
    let base = Plan {
        mode,
        budget: BudgetUse {
            budget_bytes: budget,
            resident_weight_bytes: weights,
            window_bytes: 0,
            kv_cache_bytes: kv,
            compute_buffer_bytes: compute,
            total_bytes: everything,
            ..BudgetUse::default()
        },
        tensors: Vec::new(),
        dense: None,
        experts: None,
        gpu: gpu.clone(),
        gpu_unused,
        remote: remote.clone(),
        remote_unused: None,
        streamed_bytes_per_token: 0,
        io_bound_tokens_per_sec: None,
        // The measured compute is that of streaming runs; nothing streams here.
        limit_tokens_per_sec: None,
        prediction: None,
    };
    if mode == Mode::Resident {
        let why = if gpu.is_some() || remote.is_some() {
            "the host holds what the GPU or the remote devices do not"
        } else {
            "the whole model fits"
        };
        return Ok(Plan { tensors: place(inventory, gpu.as_ref(), remote.as_ref(), |_| (Tier::Ram, why)), ..base });
    }
    // A streaming plan leaves the input tables in the file's pages: they cost no budget.
    let tied = sizing::output_is_tied(inventory);
    let mapped: u64 = inventory
        .tensors
        .iter()
        .filter(|tensor| !off_host(tensor) && stays_in_file(tensor, tied))
        .map(|tensor| tensor.bytes)
        .sum();
    let base = Plan {
        budget: BudgetUse { resident_weight_bytes: weights - mapped, total_bytes: everything - mapped, ..base.budget },
        ..base
    };
    let mut plan = if mode == Mode::ExpertStream {
        plan_experts(inventory, machine, options, base)?
    } else {
        plan_dense(inventory, machine, options, all_layer_ffn, base)?
    };
    for (placement, tensor) in plan.tensors.iter_mut().zip(&inventory.tensors) {
        if placement.tier == Tier::Ram && stays_in_file(tensor, tied) {
            placement.tier = Tier::Mapped;
            placement.why = "looked up a row per token: left in the file's pages, outside the budget";
        }
    }
    Ok(plan)
}

/// Whether a streaming plan leaves `tensor` in the file's pages (`Tier::Mapped`): the input
/// tables llama.cpp looks up by token (the token embedding: a row per token, 125 MiB of
/// Qwen2.5-Coder-1.5B's 392 MiB of resident weights), unless the token embedding is also the
/// output matrix (`output_is_tied`), which every token reads whole.
fn stays_in_file(tensor: &TensorEntry, output_is_tied: bool) -> bool {
    sizing::on_input_layer(tensor) && !(output_is_tied && tensor.name == sizing::TOKEN_EMBEDDING)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_support::*;
    use proptest::prelude::*;

    #[test]
    fn a_model_that_fits_is_resident() {
        let inventory = inventory(8, 1 << 20, 4 << 20, 8 << 20);
        let plan = plan(
            &inventory,
            &MachineFacts { memory_budget_bytes: 8 << 30, disk_bytes_per_sec: None, ..MachineFacts::default() },
            &options(ModeChoice::Auto, 2),
        )
        .unwrap();
        assert_eq!(plan.mode, Mode::Resident);
        assert!(plan.tensors.iter().all(|tensor| tensor.tier == Tier::Ram));
        assert_eq!(plan.streamed_bytes_per_token, 0);
    }

    #[test]
    fn a_budget_below_the_fixed_part_is_refused_with_the_numbers() {
        let inventory = inventory(8, 64 << 20, 64 << 20, 256 << 20);
        let error = plan(
            &inventory,
            &MachineFacts { memory_budget_bytes: 300 << 20, disk_bytes_per_sec: None, ..MachineFacts::default() },
            &options(ModeChoice::Auto, 2),
        )
        .unwrap_err();
        match &error {
            PlanError::BudgetTooSmall { budget, needed, resident, layers, .. } => {
                assert_eq!(*budget, 300 << 20);
                assert!(needed > budget);
                assert_eq!(*resident, (256 << 20) + 8 * (64 << 20));
                assert_eq!(*layers, 2);
            }
            other => panic!("{other:?}"),
        }
        let message = error.to_string();
        assert!(message.contains("300.0 MiB") && message.contains("768.0 MiB resident weights"), "{message}");
    }

    /// A streaming plan leaves an untied token embedding in the file's pages, outside the
    /// budget; tied to the output it stays resident, and a resident plan keeps it in RAM.
    #[test]
    fn streaming_plans_map_an_untied_token_embedding_from_the_file() {
        let tier_of = |plan: &Plan| plan.tensors.iter().find(|tensor| tensor.name == "token_embd.weight").unwrap().tier;
        let facts =
            MachineFacts { memory_budget_bytes: 1 << 30, disk_bytes_per_sec: Some(1e9), ..MachineFacts::default() };
        let tied = inventory(8, 16 << 20, 32 << 20, 256 << 20);
        let mut untied = tied.clone();
        let offset = untied.file_bytes;
        untied.tensors.push(TensorEntry {
            name: "output.weight".into(),
            role: Role::Output,
            layer: None,
            ggml_type: hypura_gguf::GgmlType::Q6_K,
            dims: vec![256, 1000],
            bytes: 64 << 20,
            split: 0,
            file_offset: offset,
            experts: None,
        });
        untied.file_bytes += 64 << 20;
        let tied_plan = plan(&tied, &facts, &options(ModeChoice::Forced(Mode::DenseStream), 2)).unwrap();
        let untied_plan = plan(&untied, &facts, &options(ModeChoice::Forced(Mode::DenseStream), 2)).unwrap();
        assert_eq!(tier_of(&tied_plan), Tier::Ram);
        assert_eq!(tier_of(&untied_plan), Tier::Mapped);
        // The resident weights are the RAM tier's bytes: the mapped embedding's 256 MiB are not.
        for plan in [&tied_plan, &untied_plan] {
            let in_ram: u64 =
                plan.tensors.iter().filter(|tensor| tensor.tier == Tier::Ram).map(|tensor| tensor.bytes).sum();
            assert_eq!(plan.budget.resident_weight_bytes, in_ram);
        }
        assert!(untied_plan.budget.total_bytes <= 1 << 30);
        let resident =
            plan(&untied, &MachineFacts { memory_budget_bytes: 8 << 30, ..facts }, &options(ModeChoice::Auto, 2))
                .unwrap();
        assert_eq!((resident.mode, tier_of(&resident)), (Mode::Resident, Tier::Ram));
    }

    proptest! {
        /// No plan exceeds its budgets (host and GPU), and every tensor has exactly one tier.
        #[test]
        fn plans_respect_the_budget_and_place_every_tensor(
            n_layer in 1u64..48,
            attention in 1u64..64,
            ffn in 1u64..256,
            embedding in 1u64..512,
            budget_mib in 1u64..40_000,
            window in proptest::option::of(1usize..6),
            forced in any::<bool>(),
            compute in proptest::option::of(0.001f64..10.0),
            queue_depth in 1u32..64,
            gpu_mib in prop_oneof![Just(0u64), 1u64..20_000],
            runtime_mib in 0u64..512,
            remote_mib in prop_oneof![Just(0u64), 1u64..20_000],
            round_trip_ms in 0.01f64..50.0,
        ) {
            let inventory = inventory(n_layer, attention << 20, ffn << 20, embedding << 20);
            let machine = MachineFacts {
                memory_budget_bytes: budget_mib << 20,
                disk_bytes_per_sec: Some(1e9),
                read_queue_depth: Some(queue_depth),
                disk_read_points: queue_hungry_disk(),
                compute_seconds_per_token: compute,
                gpu_budget_bytes: gpu_mib << 20,
                gpu_runtime_bytes: runtime_mib << 20,
                remote_devices: if remote_mib > 0 {
                    vec![RemoteDeviceFacts { name: "RPC0".into(), worker: "10.0.0.2:50052".into(), free_bytes: remote_mib << 20, round_trip_secs: round_trip_ms / 1e3, link_bytes_per_sec: Some(1e9) }]
                } else {
                    Vec::new()
                },
                ..MachineFacts::default()
            };
            let mode = if forced { ModeChoice::Forced(Mode::DenseStream) } else { ModeChoice::Auto };
            let options = PlanOptions { window_layers: window, ..options(mode, 1) };
            match plan(&inventory, &machine, &options) {
                Ok(plan) => {
                    prop_assert!(plan.budget.total_bytes <= plan.budget.budget_bytes, "{:?}", plan.budget);
                    prop_assert_eq!(plan.tensors.len(), inventory.tensors.len());
                    for (placement, tensor) in plan.tensors.iter().zip(&inventory.tensors) {
                        prop_assert_eq!(&placement.name, &tensor.name);
                    }
                    let streamed: u64 = plan.streamed_tensors().map(|tensor| tensor.bytes).sum();
                    prop_assert_eq!(streamed, plan.streamed_bytes_per_token);
                    let on_gpu: u64 = plan.tensors.iter().filter(|tensor| tensor.tier == Tier::Gpu).map(|tensor| tensor.bytes).sum();
                    let remote: u64 = plan.tensors.iter().filter(|tensor| tensor.tier == Tier::Remote).map(|tensor| tensor.bytes).sum();
                    prop_assert_eq!(plan.budget.resident_weight_bytes + streamed + on_gpu + remote, inventory.tensor_data_bytes());
                    // Remote devices hold whole last layers within their memory, and the host's
                    // layers alone stream.
                    match &plan.remote {
                        Some(layout) => {
                            prop_assert_eq!(layout.layers.end, n_layer as u32);
                            prop_assert!(layout.shares.iter().all(|share| share.total_bytes() <= share.free_bytes));
                            prop_assert!(plan.streamed_tensors().all(|tensor| tensor.layer.is_some_and(|layer| layer < layout.layers.start)));
                            prop_assert!(plan.gpu.is_none());
                            prop_assert!(layout.predicted_seconds_per_token < layout.local_seconds_per_token);
                        }
                        None => prop_assert_eq!(remote, 0),
                    }
                    let gpu_layers = match &plan.gpu {
                        Some(gpu) => {
                            prop_assert!(gpu.total_bytes() <= gpu.budget_bytes, "{:?}", gpu);
                            prop_assert_eq!(gpu.weight_bytes, on_gpu + gpu.tied_output_bytes);
                            // The token embedding stays on the host, where tokens are looked up.
                            prop_assert!(plan.tensors.iter().all(|tensor| tensor.name != "token_embd.weight" || tensor.tier == Tier::Ram));
                            if let Some(layers) = &gpu.whole_layers {
                                // llama.cpp's partial offload: the last layers and the output.
                                prop_assert_eq!(layers.end, n_layer as u32);
                                prop_assert_eq!(plan.n_gpu_layers(), layers.len() as i32 + 1);
                                let device_tensors = plan.tensors.iter().filter(|tensor| tensor.tier == Tier::Gpu);
                                prop_assert!(device_tensors.clone().all(|tensor| tensor.layer.is_none_or(|layer| layers.contains(&layer))));
                                prop_assert!(forced || plan.host_patterns(&[Tier::Ram, Tier::Stream]).is_empty());
                            }
                            gpu.ffn_layers.len()
                        }
                        None => {
                            prop_assert_eq!(on_gpu, 0);
                            prop_assert_eq!(plan.gpu_unused.is_some(), gpu_mib > 0);
                            0
                        }
                    };
                    if let Some(dense) = &plan.dense {
                        let remote_layers = plan.remote.as_ref().map_or(0, |layout| layout.layers.len());
                        prop_assert_eq!(dense.pinned_layers.len() + dense.streamed_layers.len() + gpu_layers + remote_layers, n_layer as usize);
                        prop_assert!(plan.streamed_tensors().all(|tensor| inventory.tensors.iter().any(|entry| entry.name == tensor.name && entry.role.is_dense_ffn())));
                    }
                }
                Err(PlanError::BudgetTooSmall { needed, budget, .. }) => prop_assert!(needed > budget),
                Err(other) => prop_assert!(false, "unexpected error {other:?}"),
            }
        }
    }
}
