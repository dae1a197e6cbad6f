//! `hypura inspect MODEL`: the inventory of a model file, read from its index only.
use std::fmt::Write as _;

use anyhow::Context;
use serde::Serialize;

use crate::cli::args::InspectArgs;
use crate::hw::format::format_bytes;
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
}

#[derive(Serialize)]
struct QuantRow {
    ggml_type: &'static str,
    tensors: usize,
    bytes: u64,
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    let inventory = Inventory::open(&crate::cli::settings::model_path(args.model.as_deref().or(args.model_flag.as_deref()))?)?;
    let spec = crate::cli::settings::run_spec(&args.model_args)?;
    let plan = crate::engine::setup::plan_for(&inventory, &spec, &crate::engine::setup::machine_facts(&spec, &inventory.path)?)?;
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
            quantization: inventory.quantization_mix().into_iter().map(|(ggml_type, tensors, bytes)| QuantRow { ggml_type: ggml_type.name(), tensors, bytes }).collect(),
            bytes_by_role: inventory.bytes_by_role().into_iter().collect(),
            bytes_by_layer: inventory.bytes_by_layer(),
            tensors: args.tensors.then_some(inventory.tensors.as_slice()),
            plan: &plan,
        };
        serde_json::to_string_pretty(&report).context("serialising the report")? + "\n"
    } else {
        render(&inventory, args.tensors) + "\n" + &plan.render()
    };
    print!("{output}");
    Ok(())
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
        hparams.n_layer, hparams.n_embd, hparams.n_head, hparams.n_head_kv, hparams.head_dim_k, hparams.n_ff, hparams.n_ctx_train, hparams.n_vocab
    );
    if hparams.n_expert > 0 {
        let _ = writeln!(out, "experts      {} experts, {} used per token, expert n_ff {}", hparams.n_expert, hparams.n_expert_used, hparams.n_ff_expert);
        let mut per_layer = 0;
        for tensor in inventory.expert_tensors().filter(|tensor| tensor.layer == Some(0)) {
            let slices = tensor.experts.expect("expert tensors have slices");
            per_layer += slices.slice_bytes;
            let _ = writeln!(out, "  slice      {:<28} {:>6} {:>12} per expert", tensor.name, tensor.ggml_type.name(), format_bytes(slices.slice_bytes));
        }
        let _ = writeln!(out, "  one expert of layer 0 (all its tensors): {}", format_bytes(per_layer));
    } else {
        let _ = writeln!(out, "experts      none (dense)");
    }
    let _ = writeln!(out, "\nquantization");
    for (ggml_type, count, bytes) in inventory.quantization_mix() {
        let _ = writeln!(out, "  {:<8} {:>5} tensors {:>12} {:>6.1}%", ggml_type.name(), count, format_bytes(bytes), percent(bytes));
    }
    let _ = writeln!(out, "\nbytes by role");
    for (role, bytes) in inventory.bytes_by_role() {
        let _ = writeln!(out, "  {:<18} {:>12} {:>6.1}%", role.name(), format_bytes(bytes), percent(bytes));
    }
    let _ = writeln!(out, "\nbytes by layer");
    for (layer, bytes) in inventory.bytes_by_layer().iter().enumerate() {
        let _ = writeln!(out, "  {layer:>4} {:>12}", format_bytes(*bytes));
    }
    if with_tensors {
        let _ = writeln!(out, "\n{:<40} {:<18} {:>5} {:<7} {:<24} {:>12} {:>14}", "tensor", "role", "layer", "type", "dims", "bytes", "offset");
        for tensor in &inventory.tensors {
            let dims = tensor.dims.iter().map(u64::to_string).collect::<Vec<_>>().join(" x ");
            let layer = tensor.layer.map_or_else(|| "-".to_string(), |layer| layer.to_string());
            let _ = writeln!(out, "{:<40} {:<18} {:>5} {:<7} {:<24} {:>12} {:>14}", tensor.name, tensor.role.name(), layer, tensor.ggml_type.name(), dims, tensor.bytes, tensor.file_offset);
        }
    }
    out
}
