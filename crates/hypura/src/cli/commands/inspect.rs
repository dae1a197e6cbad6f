//! `hypura inspect MODEL`: the inventory of a model file, read from its index only.
use std::fmt::Write as _;

use anyhow::Context;
use serde::Serialize;

use crate::cli::args::InspectArgs;
use crate::format::format_bytes;
use crate::model::url::{self, Fetched};
use crate::model::{Inventory, Role};

#[derive(Serialize)]
struct InspectReport<'a> {
    path: &'a std::path::Path,
    arch: &'a str,
    name: Option<&'a str>,
    file_bytes: u64,
    tensor_data_bytes: u64,
    tensor_count: usize,
    n_params: u64,
    hparams: &'a crate::model::Hparams,
    quantization: Vec<QuantRow>,
    bytes_by_role: Vec<(Role, u64)>,
    bytes_by_layer: Vec<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tensors: Option<&'a [crate::model::TensorEntry]>,
    plan: &'a crate::plan::Plan,
    /// The prompt batch the run gets.
    n_batch: u32,
    /// The plan's predicted speed (`plan.prediction` says what it was made from).
    predicted_decode_tokens_per_sec: Option<f64>,
    predicted_prompt_tokens_per_sec: Option<f64>,
    /// For a model on a server: the bytes its index took to fetch.
    #[serde(skip_serializing_if = "Option::is_none")]
    fetched: Option<Fetched>,
}

#[derive(Serialize)]
struct QuantRow {
    ggml_type: &'static str,
    tensors: usize,
    bytes: u64,
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    let model = args.model.as_deref().or(args.model_flag.as_deref());
    // A hub name not yet pulled is planned from its first file's index on the hub.
    let hub_address = match model.and_then(crate::hub::Source::parse).transpose()? {
        Some(source @ crate::hub::Source::Repo { .. }) => {
            let hub = crate::cli::models::hub();
            match hub.pulled(&source) {
                Some(_) => None,
                None => Some(hub.resolve(&source)?.remove(0).url),
            }
        }
        _ => None,
    };
    let model = match &hub_address {
        Some(address) => Some(address.as_str()),
        None => model,
    };
    let (inventory, fetched) = match model.filter(|model| url::is_url(model)) {
        // Planned as the same file on this machine's disk would be.
        Some(address) => {
            let address = url::resolve(address)?;
            let (files, fetched) = url::open(&address)?;
            (Inventory::from_files(std::path::Path::new(&address), &files)?, Some(fetched))
        }
        None => (Inventory::open(&crate::cli::settings::model_path(model)?)?, None),
    };
    let spec = crate::cli::settings::run_spec(&args.model_args)?;
    let facts = crate::setup::machine_facts(&spec, &inventory)?;
    if let Some(svg) = &args.svg {
        let picture = budget_picture(&inventory, &spec, &facts)?;
        std::fs::write(svg, picture).with_context(|| format!("writing {}", svg.display()))?;
    }
    let crate::plan::Choice { n_batch, plan, .. } = crate::setup::choose(&inventory, &spec, &facts)?;
    let output = if args.json {
        let report = InspectReport {
            path: &inventory.path,
            arch: &inventory.arch,
            name: inventory.name.as_deref(),
            file_bytes: inventory.file_bytes,
            tensor_data_bytes: inventory.tensor_data_bytes(),
            tensor_count: inventory.tensors.len(),
            n_params: inventory.n_params(),
            hparams: &inventory.hparams,
            quantization: inventory
                .quantization_mix()
                .into_iter()
                .map(|(ggml_type, tensors, bytes)| QuantRow { ggml_type: ggml_type.name(), tensors, bytes })
                .collect(),
            bytes_by_role: inventory.bytes_by_role().into_iter().collect(),
            bytes_by_layer: inventory.bytes_by_layer(),
            tensors: args.tensors.then_some(inventory.tensors.as_slice()),
            plan: &plan,
            n_batch,
            predicted_decode_tokens_per_sec: plan
                .prediction
                .as_ref()
                .and_then(|prediction| prediction.decode_tokens_per_sec),
            predicted_prompt_tokens_per_sec: plan
                .prediction
                .as_ref()
                .and_then(|prediction| prediction.prompt_tokens_per_sec),
            fetched,
        };
        serde_json::to_string_pretty(&report).context("serialising the report")? + "\n"
    } else {
        render(&inventory, args.tensors)
            + "\n"
            + &plan.render()
            + &format!("batch        prompt batches of {n_batch} tokens\n")
            + &fetched.map_or(String::new(), |fetched| {
                format!(
                    "fetched      {} of the {} file in {} range requests ({:.2}%), for its index of {}\n",
                    format_bytes(fetched.bytes),
                    format_bytes(inventory.file_bytes),
                    fetched.requests,
                    100.0 * fetched.bytes as f64 / inventory.file_bytes.max(1) as f64,
                    format_bytes(fetched.index_bytes)
                )
            })
    };
    print!("{output}");
    Ok(())
}

/// Budgets `inspect --svg` plans at: geometric from a sixteenth of the file to twice it and
/// 512 MiB more (where a small model is resident with its compute buffers).
const PICTURE_BUDGETS: u32 = 32;

/// `inspect --svg`: the plan at each memory budget (the machine's other facts as they are),
/// its mode and predicted decode speed; where there is a GPU, the same at each GPU budget from
/// none to the file's size with the memory budget as it is.
fn budget_picture(
    inventory: &Inventory,
    spec: &crate::setup::RunSpec,
    facts: &crate::plan::MachineFacts,
) -> anyhow::Result<String> {
    use crate::bench::picture::{BudgetPanel, BudgetPoint};
    let point = |budget_bytes: u64, at: crate::plan::MachineFacts| match crate::setup::choose(inventory, spec, &at) {
        Ok(choice) => BudgetPoint {
            budget_bytes,
            mode: Some(choice.plan.mode.name()),
            tokens_per_sec: choice.plan.prediction.as_ref().and_then(|prediction| prediction.decode_tokens_per_sec),
        },
        Err(_) => BudgetPoint { budget_bytes, mode: None, tokens_per_sec: None },
    };
    let (low, high) = (inventory.file_bytes as f64 / 16.0, inventory.file_bytes as f64 * 2.0 + f64::from(512u32 << 20));
    let memory: Vec<BudgetPoint> = (0..PICTURE_BUDGETS)
        .map(|step| {
            let budget_bytes = (low * (high / low).powf(f64::from(step) / f64::from(PICTURE_BUDGETS - 1))) as u64;
            point(budget_bytes, crate::plan::MachineFacts { memory_budget_bytes: budget_bytes, ..facts.clone() })
        })
        .collect();
    let gpu: Vec<BudgetPoint> = if facts.gpu_budget_bytes > 0 {
        (0..PICTURE_BUDGETS)
            .map(|step| {
                let budget_bytes = inventory.file_bytes / u64::from(PICTURE_BUDGETS - 1) * u64::from(step);
                point(budget_bytes, crate::plan::MachineFacts { gpu_budget_bytes: budget_bytes, ..facts.clone() })
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut panels =
        vec![BudgetPanel { axis: "memory budget", points: &memory, this_machine: facts.memory_budget_bytes }];
    if !gpu.is_empty() {
        panels.push(BudgetPanel { axis: "GPU budget", points: &gpu, this_machine: facts.gpu_budget_bytes });
    }
    let title = format!(
        "{} ({}): predicted decode speed by memory budget",
        inventory.name.as_deref().unwrap_or(&inventory.arch),
        format_bytes(inventory.file_bytes)
    );
    let compute = match (facts.compute_seconds_per_token, facts.resident_seconds_per_token) {
        (Some(streaming), _) => format!("{:.1} ms of compute a token (streaming runs)", streaming * 1e3),
        (None, Some(resident)) => format!("{:.1} ms of compute a token (resident runs)", resident * 1e3),
        (None, None) => "no compute measured yet (run the model once), so no point is drawn".to_string(),
    };
    let disk = facts.disk_bytes_per_sec.map_or("no disk profile yet (`hypura profile`)".to_string(), |rate| {
        format!(
            "the bytes read a token at {:.2} GB/s ({})",
            rate / 1e9,
            if facts.disk_rate_from_runs { "streaming runs" } else { "the profile" }
        )
    });
    let routing = if facts.expert_reuse.is_some() { "recorded routing" } else { "real models' routing" };
    let note = format!("the slower of {compute} and {disk}; expert caches at the hit rate of {routing}");
    crate::bench::picture::budget_svg(&title, &note, &panels)
        .map_err(|error| anyhow::anyhow!("drawing the picture: {error}"))
}

/// The human report. Percentages are of the tensor data.
pub fn render(inventory: &Inventory, with_tensors: bool) -> String {
    let hparams = &inventory.hparams;
    let data_bytes = inventory.tensor_data_bytes();
    let percent = |bytes: u64| 100.0 * bytes as f64 / data_bytes.max(1) as f64;
    let mut out = String::new();
    let _ = writeln!(out, "model        {}", inventory.path.display());
    if let Some(name) = &inventory.name {
        let _ = writeln!(out, "name         {name}");
    }
    let _ = writeln!(out, "architecture {}", inventory.arch);
    let _ = writeln!(
        out,
        "file         {} in {} file(s); tensor data {}; {} tensors; {:.1} M parameters",
        format_bytes(inventory.file_bytes),
        inventory.split_paths.len(),
        format_bytes(data_bytes),
        inventory.tensors.len(),
        inventory.n_params() as f64 / 1e6
    );
    let _ = writeln!(
        out,
        "hparams      n_layer {}  n_embd {}  n_head {}  n_head_kv {}  head_dim {}  n_ff {}  n_ctx_train {}  n_vocab {}",
        hparams.n_layer,
        hparams.n_embd,
        hparams.n_head,
        hparams.n_head_kv,
        hparams.head_dim_k,
        hparams.n_ff,
        hparams.n_ctx_train,
        hparams.n_vocab
    );
    if hparams.n_expert > 0 {
        let moe_layers: std::collections::BTreeSet<u32> = inventory
            .expert_tensors()
            .filter(|tensor| tensor.role != Role::Mtp)
            .filter_map(|tensor| tensor.layer)
            .collect();
        let first = moe_layers.first().copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "experts      {} experts in {} of {} layers, {} used per token, expert n_ff {}",
            hparams.n_expert,
            moe_layers.len(),
            hparams.n_layer,
            hparams.n_expert_used,
            hparams.n_ff_expert
        );
        let mut per_layer = 0;
        for tensor in inventory.expert_tensors().filter(|tensor| tensor.layer == Some(first)) {
            let slices = tensor.experts.expect("expert tensors have slices");
            per_layer += slices.slice_bytes;
            let _ = writeln!(
                out,
                "  slice      {:<28} {:>6} {:>12} per expert",
                tensor.name,
                tensor.ggml_type.name(),
                format_bytes(slices.slice_bytes)
            );
        }
        let _ = writeln!(out, "  one expert of layer {first} (all its tensors): {}", format_bytes(per_layer));
    } else {
        let _ = writeln!(out, "experts      none (dense)");
    }
    let _ = writeln!(out, "\nquantization");
    for (ggml_type, count, bytes) in inventory.quantization_mix() {
        let _ = writeln!(
            out,
            "  {:<8} {:>5} tensors {:>12} {:>6.1}%",
            ggml_type.name(),
            count,
            format_bytes(bytes),
            percent(bytes)
        );
    }
    let _ = writeln!(out, "\nbytes by role");
    let by_role = inventory.bytes_by_role();
    for (role, bytes) in &by_role {
        let _ = writeln!(out, "  {:<18} {:>12} {:>6.1}%", role.name(), format_bytes(*bytes), percent(*bytes));
    }
    let _ = writeln!(
        out,
        "  {:<18} {:>12} {:>6.1}%",
        "total",
        format_bytes(by_role.values().sum()),
        percent(by_role.values().sum())
    );
    let _ = writeln!(out, "\nbytes by layer, by kind");
    for group in layer_groups(inventory) {
        let total: u64 = group.bytes.iter().sum();
        let count = format!("{} layer{}", group.layers.len(), if group.layers.len() == 1 { "" } else { "s" });
        let _ = writeln!(
            out,
            "  {:<10} {count:>10} {:>12} ({})  layers {}",
            group.kind,
            format_bytes(total),
            group.size(),
            layer_ranges(&group.layers)
        );
    }
    if with_tensors {
        let _ = writeln!(
            out,
            "\n{:<40} {:<18} {:>5} {:<7} {:<24} {:>12} {:>14}",
            "tensor", "role", "layer", "type", "dims", "bytes", "offset"
        );
        for tensor in &inventory.tensors {
            let dims = tensor.dims.iter().map(u64::to_string).collect::<Vec<_>>().join(" x ");
            let layer = tensor.layer.map_or_else(|| "-".to_string(), |layer| layer.to_string());
            let _ = writeln!(
                out,
                "{:<40} {:<18} {:>5} {:<7} {:<24} {:>12} {:>14}",
                tensor.name,
                tensor.role.name(),
                layer,
                tensor.ggml_type.name(),
                dims,
                tensor.bytes,
                tensor.file_offset
            );
        }
    }
    out
}

/// Layers of one kind (what their FFN is) and their bytes.
struct LayerGroup {
    kind: &'static str,
    bytes: Vec<u64>,
    layers: Vec<u32>,
}

/// Layers grouped by what their FFN is (experts, dense, MTP), in order of their first layer: a
/// model of 90 layers prints a few lines.
fn layer_groups(inventory: &Inventory) -> Vec<LayerGroup> {
    let bytes = inventory.bytes_by_layer();
    // A layer is what its FFN is: an MTP block, experts, a dense FFN, or attention alone.
    let kind = |layer: usize| {
        let roles: Vec<Role> = inventory
            .tensors
            .iter()
            .filter(|tensor| tensor.layer == Some(layer as u32))
            .map(|tensor| tensor.role)
            .collect();
        if roles.contains(&Role::Mtp) {
            "mtp"
        } else if roles.iter().any(|role| role.is_expert()) {
            "moe"
        } else if roles.iter().any(|role| role.is_dense_ffn()) {
            "dense"
        } else {
            "attention"
        }
    };
    let kinds: Vec<&str> = (0..bytes.len()).map(kind).collect();
    let mut groups: Vec<LayerGroup> = Vec::new();
    for (layer, (&bytes, kind)) in bytes.iter().zip(kinds).enumerate() {
        match groups.iter_mut().find(|group| group.kind == kind) {
            Some(group) => {
                group.layers.push(layer as u32);
                group.bytes.push(bytes);
            }
            None => groups.push(LayerGroup { kind, bytes: vec![bytes], layers: vec![layer as u32] }),
        }
    }
    groups
}

impl LayerGroup {
    /// `524.3 MiB each`, or `450.3–524.3 MiB` where the layers differ (Q4_K_M's Q6_K layers).
    fn size(&self) -> String {
        let (low, high) =
            (self.bytes.iter().copied().min().unwrap_or(0), self.bytes.iter().copied().max().unwrap_or(0));
        if low == high {
            format!("{} each", format_bytes(low))
        } else {
            format!("{}–{}", format_bytes(low), format_bytes(high))
        }
    }
}

/// `0-2, 4-6, 8` for layers 0, 1, 2, 4, 5, 6, 8; at most 8 ranges, then how many more.
fn layer_ranges(layers: &[u32]) -> String {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for &layer in layers {
        match ranges.last_mut() {
            Some((_, end)) if *end + 1 == layer => *end = layer,
            _ => ranges.push((layer, layer)),
        }
    }
    let shown: Vec<String> = ranges
        .iter()
        .take(8)
        .map(|&(start, end)| if start == end { start.to_string() } else { format!("{start}-{end}") })
        .collect();
    let more = ranges.len().saturating_sub(8);
    if more > 0 {
        format!("{} and {more} more ranges", shown.join(", "))
    } else {
        shown.join(", ")
    }
}
