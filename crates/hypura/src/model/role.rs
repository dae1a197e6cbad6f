//! Tensor roles, from llama.cpp's tensor names (`llama-arch.cpp` LLM_TENSOR_NAMES).
use serde::Serialize;

/// What a tensor does in the forward pass. The planner places tensors by role: what every token
/// touches stays close; FFN and expert weights are what may stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    TokenEmbedding,
    Output,
    Norm,
    AttentionQ,
    AttentionK,
    AttentionV,
    /// Fused q/k/v (`attn_qkv`).
    AttentionQkv,
    AttentionOutput,
    /// The MoE router (`ffn_gate_inp`, and its bias `exp_probs_b`).
    Router,
    FfnGate,
    FfnUp,
    FfnDown,
    ExpertGate,
    ExpertUp,
    ExpertDown,
    /// Fused gate and up experts (`ffn_gate_up_exps`).
    ExpertGateUp,
    /// Per-expert biases and scales of routed experts (`ffn_*_exps.bias`, gpt-oss): small,
    /// resident.
    ExpertBias,
    /// Shared experts beside the routed ones, and their gate.
    SharedExpert,
    /// The rest of attention: sinks, output gates, DeepSeek's sparse-attention indexer and KV
    /// compressor, relative-position biases.
    AttentionOther,
    /// Recurrent layers' weights (gated delta-net, Mamba, RWKV, short convolutions).
    Recurrent,
    /// Multi-token-prediction layers (`nextn`), which decode does not run.
    Mtp,
    /// The dense projections around latent experts (Kimi-K3's `ffn_routed_*`).
    MoeLatent,
    /// Small tables and scalars every token touches: rope factors, per-layer output scales,
    /// hyper-connection and residual-attention mixing.
    Auxiliary,
    Other,
}

impl Role {
    pub const ALL: [Role; 24] = [
        Role::TokenEmbedding,
        Role::Output,
        Role::Norm,
        Role::AttentionQ,
        Role::AttentionK,
        Role::AttentionV,
        Role::AttentionQkv,
        Role::AttentionOutput,
        Role::Router,
        Role::FfnGate,
        Role::FfnUp,
        Role::FfnDown,
        Role::ExpertGate,
        Role::ExpertUp,
        Role::ExpertDown,
        Role::ExpertGateUp,
        Role::ExpertBias,
        Role::SharedExpert,
        Role::AttentionOther,
        Role::Recurrent,
        Role::Mtp,
        Role::MoeLatent,
        Role::Auxiliary,
        Role::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Role::TokenEmbedding => "token embedding",
            Role::Output => "output",
            Role::Norm => "norm",
            Role::AttentionQ => "attention q",
            Role::AttentionK => "attention k",
            Role::AttentionV => "attention v",
            Role::AttentionQkv => "attention qkv",
            Role::AttentionOutput => "attention output",
            Role::Router => "router",
            Role::FfnGate => "ffn gate",
            Role::FfnUp => "ffn up",
            Role::FfnDown => "ffn down",
            Role::ExpertGate => "expert gate",
            Role::ExpertUp => "expert up",
            Role::ExpertDown => "expert down",
            Role::ExpertGateUp => "expert gate+up",
            Role::ExpertBias => "expert bias",
            Role::SharedExpert => "shared expert",
            Role::AttentionOther => "attention other",
            Role::Recurrent => "recurrent",
            Role::Mtp => "mtp (unused)",
            Role::MoeLatent => "moe latent",
            Role::Auxiliary => "auxiliary",
            Role::Other => "other",
        }
    }

    /// Dense FFN weights: what dense-stream mode streams.
    pub fn is_dense_ffn(self) -> bool {
        matches!(self, Role::FfnGate | Role::FfnUp | Role::FfnDown)
    }

    /// Routed expert weights: what expert-stream mode streams, one slice per expert.
    pub fn is_expert(self) -> bool {
        matches!(self, Role::ExpertGate | Role::ExpertUp | Role::ExpertDown | Role::ExpertGateUp)
    }

    /// Classify by llama.cpp tensor name, e.g. `blk.3.ffn_up_exps.weight`. Tensors of MTP
    /// layers are named like any layer's; the inventory marks them from the layer count.
    pub fn from_tensor_name(name: &str) -> Role {
        let base = strip_layer(name);
        let (stem, suffix) = base.rsplit_once('.').unwrap_or((base, ""));
        let expert = match stem {
            "ffn_gate_exps" => Some(Role::ExpertGate),
            "ffn_up_exps" => Some(Role::ExpertUp),
            "ffn_down_exps" => Some(Role::ExpertDown),
            "ffn_gate_up_exps" => Some(Role::ExpertGateUp),
            _ => None,
        };
        if let Some(role) = expert {
            // The expert slices are the weights; their biases and scales are small vectors.
            return if suffix == "weight" { role } else { Role::ExpertBias };
        }
        let prefix = |prefixes: &[&str]| prefixes.iter().any(|prefix| stem.starts_with(prefix));
        match stem {
            "token_embd" | "tok_embd" | "per_layer_token_embd" => Role::TokenEmbedding,
            "output" => Role::Output,
            // Multi-head latent attention's low-rank projections count as q, k and v.
            "attn_q" | "attn_q_a" | "attn_q_b" => Role::AttentionQ,
            "attn_k" | "attn_kv_a_mqa" | "attn_kv_b" | "attn_k_b" | "attn_kv" => Role::AttentionK,
            "attn_v" | "attn_v_b" => Role::AttentionV,
            "attn_qkv" => Role::AttentionQkv,
            "attn_output" | "attn_out" | "attn_output_a" | "attn_output_b" => Role::AttentionOutput,
            "attn_sinks" | "attn_gate" | "attn_rel_b" | "attn_rot_embd" | "attn_res_score" => Role::AttentionOther,
            _ if prefix(&["indexer", "attn_compressor", "attn_conv"]) => Role::AttentionOther,
            "ffn_gate_inp" | "exp_probs_b" | "exp_probs_b_vl" | "ffn_gate_tid2eid" => Role::Router,
            "ffn_gate" => Role::FfnGate,
            "ffn_up" => Role::FfnUp,
            "ffn_down" => Role::FfnDown,
            "ffn_gate_shexp" | "ffn_up_shexp" | "ffn_down_shexp" | "ffn_gate_inp_shexp" => Role::SharedExpert,
            _ if stem.starts_with("nextn") => Role::Mtp,
            _ if prefix(&["ssm_", "time_mix_", "channel_mix_", "shortconv", "conv1d"]) => Role::Recurrent,
            "ffn_routed_down" | "ffn_routed_up" | "ffn_routed_norm" => Role::MoeLatent,
            "rope_freqs" | "rope_factors_long" | "rope_factors_short" | "layer_output_scale" => Role::Auxiliary,
            _ if prefix(&["hc_", "output_hc_"]) || stem.ends_with("res_score") => Role::Auxiliary,
            _ if stem.ends_with("norm") || stem.contains("_norm") || stem.starts_with("norm") => Role::Norm,
            _ => Role::Other,
        }
    }
}

/// `blk.12.attn_q.weight` -> `attn_q.weight`; names without a layer are returned unchanged.
fn strip_layer(name: &str) -> &str {
    name.strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .filter(|(number, _)| number.bytes().all(|byte| byte.is_ascii_digit()))
        .map_or(name, |(_, rest)| rest)
}

/// The layer of a `blk.N.*` tensor.
pub fn layer_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("blk.")?;
    let (number, _) = rest.split_once('.')?;
    number.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_llama_cpp_names() {
        let cases = [
            ("token_embd.weight", Role::TokenEmbedding),
            ("output.weight", Role::Output),
            ("output_norm.weight", Role::Norm),
            ("blk.0.attn_norm.weight", Role::Norm),
            ("blk.7.post_ffw_norm.weight", Role::Norm),
            ("blk.3.attn_q_norm.weight", Role::Norm),
            ("blk.3.attn_q.weight", Role::AttentionQ),
            ("blk.3.attn_k.bias", Role::AttentionK),
            ("blk.3.attn_qkv.weight", Role::AttentionQkv),
            ("blk.3.attn_output.weight", Role::AttentionOutput),
            ("blk.3.ffn_gate_inp.weight", Role::Router),
            ("blk.3.exp_probs_b.bias", Role::Router),
            ("blk.3.ffn_up.weight", Role::FfnUp),
            ("blk.3.ffn_down_exps.weight", Role::ExpertDown),
            ("blk.3.ffn_gate_up_exps.weight", Role::ExpertGateUp),
            ("blk.3.ffn_up_shexp.weight", Role::SharedExpert),
            ("blk.3.ffn_gate_inp_shexp.weight", Role::SharedExpert),
            ("blk.3.ffn_gate_up_exps.bias", Role::ExpertBias),
            ("blk.3.ffn_down_exps.bias", Role::ExpertBias),
            ("blk.3.ffn_down_exps.scale", Role::ExpertBias),
            ("blk.3.attn_sinks.weight", Role::AttentionOther),
            ("blk.3.attn_q_a.weight", Role::AttentionQ),
            ("blk.3.attn_q_a_norm.weight", Role::Norm),
            ("blk.3.attn_kv_a_mqa.weight", Role::AttentionK),
            ("blk.3.attn_k_b.weight", Role::AttentionK),
            ("blk.3.attn_v_b.weight", Role::AttentionV),
            ("blk.3.ssm_conv1d.weight", Role::Recurrent),
            ("blk.3.ssm_a", Role::Recurrent),
            ("blk.3.ssm_norm.weight", Role::Recurrent),
            ("blk.46.nextn.eh_proj.weight", Role::Mtp),
            ("rope_freqs.weight", Role::Auxiliary),
            ("blk.3.hc_ffn_fn.weight", Role::Auxiliary),
            ("output_hc_base.weight", Role::Auxiliary),
            ("blk.3.ffn_res_score.weight", Role::Auxiliary),
            ("blk.3.ffn_routed_up.weight", Role::MoeLatent),
            ("blk.3.ffn_gate_inp.scale", Role::Router),
            ("blk.3.unknown_thing.weight", Role::Other),
        ];
        for (name, role) in cases {
            assert_eq!(Role::from_tensor_name(name), role, "{name}");
        }
    }

    #[test]
    fn parses_layers() {
        assert_eq!(layer_of("blk.17.ffn_up.weight"), Some(17));
        assert_eq!(layer_of("token_embd.weight"), None);
        assert_eq!(layer_of("blk.x.ffn_up.weight"), None);
    }
}
