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
    SharedExpert,
    Other,
}

impl Role {
    pub const ALL: [Role; 18] = [
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
        Role::SharedExpert,
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
            Role::SharedExpert => "shared expert",
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

    /// Classify by llama.cpp tensor name, e.g. `blk.3.ffn_up_exps.weight`.
    pub fn from_tensor_name(name: &str) -> Role {
        let base = strip_layer(name);
        let stem = base.strip_suffix(".weight").or_else(|| base.strip_suffix(".bias")).unwrap_or(base);
        match stem {
            "token_embd" | "tok_embd" | "per_layer_token_embd" => Role::TokenEmbedding,
            "output" => Role::Output,
            "attn_q" => Role::AttentionQ,
            "attn_k" => Role::AttentionK,
            "attn_v" => Role::AttentionV,
            "attn_qkv" => Role::AttentionQkv,
            "attn_output" | "attn_out" => Role::AttentionOutput,
            "ffn_gate_inp" | "exp_probs_b" => Role::Router,
            "ffn_gate" => Role::FfnGate,
            "ffn_up" => Role::FfnUp,
            "ffn_down" => Role::FfnDown,
            "ffn_gate_exps" => Role::ExpertGate,
            "ffn_up_exps" => Role::ExpertUp,
            "ffn_down_exps" => Role::ExpertDown,
            "ffn_gate_up_exps" => Role::ExpertGateUp,
            "ffn_gate_shexp" | "ffn_up_shexp" | "ffn_down_shexp" | "ffn_gate_inp_shexp" => Role::SharedExpert,
            _ if stem.ends_with("norm") || stem.contains("_norm") || stem.starts_with("norm") => Role::Norm,
            _ => Role::Other,
        }
    }
}

/// `blk.12.attn_q.weight` -> `attn_q.weight`; names without a layer are returned unchanged.
fn strip_layer(name: &str) -> &str {
    name.strip_prefix("blk.").and_then(|rest| rest.split_once('.')).filter(|(number, _)| number.bytes().all(|byte| byte.is_ascii_digit())).map_or(name, |(_, rest)| rest)
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
            ("rope_freqs.weight", Role::Other),
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
