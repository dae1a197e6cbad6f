//! The inventory on the real Gemma file and on every forge architecture.
use hypura::model::{Inventory, ModelError, Role};
use hypura_gguf::{GgmlType, GgufWriter, Value};

use crate::common;

#[test]
fn gemma_inventory_matches_the_file() {
    let _machine = common::shared_machine();
    let inventory = Inventory::open(&common::gemma_path()).unwrap();
    assert_eq!(inventory.arch, "gemma3");
    assert_eq!(inventory.hparams.n_layer, 18);
    assert_eq!(inventory.tensors.len(), 236);
    assert_eq!(inventory.hparams.n_embd, 640);
    assert_eq!(inventory.hparams.n_vocab, 262_144);
    let by_role: u64 = inventory.bytes_by_role().values().sum();
    assert_eq!(by_role, inventory.tensor_data_bytes(), "role totals must add up to the tensor data");
    let by_layer: u64 = inventory.bytes_by_layer().iter().sum();
    let outside_layers: u64 =
        inventory.tensors.iter().filter(|tensor| tensor.layer.is_none()).map(|tensor| tensor.bytes).sum();
    assert_eq!(by_layer + outside_layers, inventory.tensor_data_bytes());
    assert!(inventory.tensor_data_bytes() < inventory.file_bytes);
    // Gemma 3: 13 tensors per layer (q/k norms, post-attention and post-FFN norms included).
    for layer in 0..18 {
        let count = inventory.tensors.iter().filter(|tensor| tensor.layer == Some(layer)).count();
        assert_eq!(count, 13, "layer {layer}");
    }
    assert_eq!(inventory.tensors.iter().filter(|tensor| tensor.role.is_dense_ffn()).count(), 54);
    assert_eq!(inventory.tensors.iter().filter(|tensor| tensor.role == Role::Other).count(), 0);
    assert!(inventory.expert_tensors().next().is_none());
}

#[test]
fn forged_moe_has_expert_slices_that_tile_each_tensor() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    for (preset, arch, n_expert, n_used) in [("tiny-moe-8x", "llama", 8, 2), ("tiny-moe-30b", "qwen3moe", 16, 4)] {
        let path = common::forge(preset, directory.path());
        let inventory = Inventory::open(&path).unwrap();
        assert_eq!(inventory.arch, arch);
        assert_eq!(inventory.hparams.n_expert, n_expert);
        assert_eq!(inventory.hparams.n_expert_used, n_used);
        let experts: Vec<_> = inventory.expert_tensors().collect();
        assert_eq!(experts.len() as u64, 3 * inventory.hparams.n_layer, "{preset}: gate, up, down per layer");
        for tensor in experts {
            let slices = tensor.experts.unwrap();
            assert_eq!(slices.n_expert, n_expert);
            assert_eq!(slices.slice_bytes * n_expert, tensor.bytes);
            let last = slices.range(tensor.file_offset, n_expert - 1);
            assert_eq!(
                last.end,
                tensor.file_offset + tensor.bytes,
                "{}: slices must end at the tensor's end",
                tensor.name
            );
            // A slice is exactly one expert's rows: [ne0, ne1] elements of the tensor's type.
            let per_expert = tensor.ggml_type.tensor_bytes(&tensor.dims[..2]).unwrap();
            assert_eq!(slices.slice_bytes, per_expert);
        }
        assert_eq!(
            inventory.tensors.iter().filter(|tensor| tensor.role == Role::Router).count() as u64,
            inventory.hparams.n_layer
        );
        assert_eq!(inventory.tensors.iter().filter(|tensor| tensor.role == Role::Other).count(), 0, "{preset}");
    }
}

/// Every tiny MoE architecture under every quantization mix: each expert tensor (3-D, experts
/// last; MXFP4, K-quants, Q5_0, Q8_0, F16) splits into slices of exactly one expert's rows, the
/// per-expert biases and scales stay resident vectors, every tensor has a role, and the MTP
/// layers' tensors are marked.
#[test]
fn every_moe_architecture_slices_its_experts_under_every_mix() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let presets: Vec<&str> = hypura_forge::presets()
        .into_iter()
        .filter(|name| name.starts_with("tiny-") && hypura_forge::preset(name).unwrap().is_moe())
        .collect();
    assert!(presets.len() >= 13, "{presets:?}");
    let mut types_seen = std::collections::BTreeSet::new();
    for preset in presets {
        for quant in [hypura_forge::QuantMix::Q4KM, hypura_forge::QuantMix::Q8_0, hypura_forge::QuantMix::F16] {
            let path = common::forge_with(preset, directory.path(), |spec| spec.quant = quant);
            let inventory = Inventory::open(&path).unwrap();
            let label = format!("{preset} {quant}");
            let others = common::tensors_without_a_role(&inventory);
            assert!(others.is_empty(), "{label}: {others:?}");
            let experts: Vec<_> = inventory.expert_tensors().collect();
            assert!(!experts.is_empty(), "{label}");
            for tensor in experts {
                let slices = tensor.experts.unwrap();
                assert_eq!(tensor.dims.len(), 3, "{label}: {}", tensor.name);
                assert_eq!(slices.n_expert, tensor.dims[2], "{label}: {}", tensor.name);
                assert_eq!(
                    slices.slice_bytes,
                    tensor.ggml_type.tensor_bytes(&tensor.dims[..2]).unwrap(),
                    "{label}: {}",
                    tensor.name
                );
                assert_eq!(
                    slices.range(tensor.file_offset, slices.n_expert - 1).end,
                    tensor.file_offset + tensor.bytes
                );
                types_seen.insert(tensor.ggml_type.name());
            }
            for tensor in inventory.tensors.iter().filter(|tensor| tensor.role == Role::ExpertBias) {
                assert!(tensor.experts.is_none() && tensor.dims.len() <= 2, "{label}: {}", tensor.name);
            }
            let mtp = inventory.hparams.n_layer_mtp;
            for tensor in &inventory.tensors {
                let in_mtp = tensor.layer.is_some_and(|layer| u64::from(layer) + mtp >= inventory.hparams.n_layer);
                assert_eq!(tensor.role == Role::Mtp, in_mtp, "{label}: {}", tensor.name);
            }
        }
    }
    for expected in ["mxfp4", "q4_K", "q6_K", "q8_0", "f16"] {
        assert!(types_seen.contains(expected), "no expert tensor of type {expected}: {types_seen:?}");
    }
}

#[test]
fn forged_dense_models_classify_every_tensor() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    for preset in ["tiny-dense-1b", "tiny-dense-8b", "tiny-qwen3"] {
        let path = common::forge(preset, directory.path());
        let inventory = Inventory::open(&path).unwrap();
        let spec = hypura_forge::preset(preset).unwrap();
        assert_eq!(inventory.hparams.n_layer, spec.shape.n_layer);
        assert_eq!(inventory.hparams.n_head_kv, spec.shape.n_head_kv);
        assert_eq!(inventory.hparams.head_dim_k, spec.shape.head_dim);
        assert_eq!(
            inventory.tensors.iter().filter(|tensor| tensor.role.is_dense_ffn()).count() as u64,
            3 * spec.shape.n_layer
        );
        assert_eq!(inventory.tensors.iter().filter(|tensor| tensor.role == Role::Other).count(), 0, "{preset}");
        let mix = inventory.quantization_mix();
        assert!(mix.iter().any(|(ggml_type, _, _)| *ggml_type == GgmlType::Q4_K), "{preset}: Q4_K_M mix has q4_K");
        assert!(mix.iter().any(|(ggml_type, _, _)| *ggml_type == GgmlType::Q6_K), "{preset}: Q4_K_M mix has q6_K");
        let by_role: u64 = inventory.bytes_by_role().values().sum();
        assert_eq!(by_role, inventory.tensor_data_bytes());
    }
}

#[test]
fn unknown_architecture_is_refused_with_its_name() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("alien.gguf");
    let mut writer = GgufWriter::new();
    writer.add_metadata("general.architecture", Value::String("alien9000".into()));
    writer.add_metadata("alien9000.block_count", Value::U32(1));
    writer.add_metadata("alien9000.embedding_length", Value::U32(32));
    writer.add_tensor("token_embd.weight", &[32, 4], GgmlType::F32);
    writer.write_file(&path, |_| vec![0; 32 * 4 * 4]).unwrap();
    match Inventory::open(&path) {
        Err(ModelError::UnknownArchitecture { arch, .. }) => assert_eq!(arch, "alien9000"),
        other => panic!("expected UnknownArchitecture, got {other:?}"),
    }
}

#[test]
fn layer_beyond_block_count_is_refused() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("bad-layer.gguf");
    let mut writer = GgufWriter::new();
    writer.add_metadata("general.architecture", Value::String("llama".into()));
    writer.add_metadata("llama.block_count", Value::U32(1));
    writer.add_metadata("llama.embedding_length", Value::U32(32));
    writer.add_tensor("blk.5.ffn_up.weight", &[32, 4], GgmlType::F32);
    writer.write_file(&path, |_| vec![0; 32 * 4 * 4]).unwrap();
    assert!(matches!(Inventory::open(&path), Err(ModelError::LayerOutOfRange { layer: 5, .. })));
}

/// The context's memory as llama.cpp allocates it (its log, at a 1024-token context and one
/// sequence, for the forged files): Qwen3.5's one attention layer of four keeps a KV cache of
/// 0.50 MiB and its three gated delta-net layers a recurrent state of 0.11 MiB; DeepSeek's
/// latent attention caches the compressed K row only (2.25 MiB for 4 layers, V 0); Kimi-K3's KDA
/// layers do not say their state size, so every layer is counted as attending (more than the
/// 1.12 MiB KV + 0.57 MiB state llama.cpp allocates).
#[test]
fn context_memory_matches_what_llama_cpp_allocates() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let memory = |preset: &str| {
        let inventory = Inventory::open(&common::forge(preset, directory.path())).unwrap();
        (
            hypura::plan::kv_cache_bytes(&inventory, 1024, Default::default()),
            inventory.hparams.recurrent_state_bytes,
            inventory.hparams.n_layer_kv,
        )
    };
    let (kv, state, layers) = memory("tiny-qwen35moe");
    assert_eq!((kv, layers), (512 << 10, 1));
    assert!((0.105..0.115).contains(&(state as f64 / f64::from(1 << 20))), "{state}");
    let (kv, state, layers) = memory("tiny-deepseek2");
    assert_eq!((kv, state, layers), (2304 << 10, 0, 4));
    let (kv, state, _) = memory("tiny-kimi-k3");
    assert!(kv + state >= (1152 + 584) << 10, "{kv} + {state}");
}

/// A quantized KV cache costs what llama.cpp allocates for it (its log for
/// Qwen2.5-Coder-0.5B at a 4096-token context: K (q8_0) 12.75 MiB, V (q4_0) 6.75 MiB; f16
/// 48 MiB), and the planner's budget counts it so.
#[test]
fn a_quantized_kv_cache_costs_what_llama_cpp_allocates() {
    use hypura::plan::KvTypes;
    use hypura_gguf::GgmlType;
    let inventory = Inventory::open(&common::chat_model_path()).unwrap();
    let mixed = KvTypes { k: GgmlType::Q8_0, v: GgmlType::Q4_0 };
    assert_eq!(hypura::plan::kv_cache_bytes(&inventory, 4096, KvTypes::default()), 48 << 20);
    assert_eq!(hypura::plan::kv_cache_bytes(&inventory, 4096, mixed), (12 << 20) + (3 << 18) + (6 << 20) + (3 << 18));
    let facts = hypura::plan::MachineFacts { memory_budget_bytes: 4 << 30, ..Default::default() };
    let options = |kv| hypura::plan::PlanOptions { n_ctx: 4096, kv, ..Default::default() };
    let f16 = hypura::plan::plan(&inventory, &facts, &options(KvTypes::default())).unwrap();
    let quantized = hypura::plan::plan(&inventory, &facts, &options(mixed)).unwrap();
    assert_eq!(f16.budget.kv_cache_bytes - quantized.budget.kv_cache_bytes, (48 << 20) - (19 << 20) - (1 << 19));
    assert_eq!(KvTypes::parse("Q8_0"), Ok(GgmlType::Q8_0));
    assert!(KvTypes::parse("q4_K").unwrap_err().contains("q8_0"), "q4_K is not a KV cache type");
}
