//! A small SentencePiece-style ("llama") vocabulary: control tokens, 256 byte-fallback tokens,
//! printable ASCII and a few hundred English words. llama.cpp tokenizes any text with it, so
//! forge models take real prompts.
use hypura_gguf::{Value, ValueType};

const WORDS: &str = "the of and to in is was for that on as with by he at from his an were are which \
this be or it had not but have one first also its new after who they has her she been two their \
more all other when there up into time some out so would can about only over than most years year \
made may city during later many world these such under both between then where three while through \
however well being since because part state school film people united would could them used before \
including several until life each series him any game known second following states national team \
became war held against area long high work own four age same day early around north south east west \
what how why yes no good great small large old young man woman child house water fire light dark \
red blue green black white king queen book word name place home road river sea land sky sun moon star \
tree stone gold iron paris france capital hello model token memory disk cache stream expert layer";

pub const UNKNOWN: u32 = 0;
pub const BOS: u32 = 1;
pub const EOS: u32 = 2;

/// Token types as llama.cpp numbers them (`llama_token_type`).
const TYPE_NORMAL: i32 = 1;
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_BYTE: i32 = 6;

pub struct Vocabulary {
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    pub types: Vec<i32>,
}

impl Vocabulary {
    pub fn build() -> Vocabulary {
        let mut vocabulary = Vocabulary { tokens: Vec::new(), scores: Vec::new(), types: Vec::new() };
        let mut push = |text: String, score: f32, kind: i32| {
            vocabulary.tokens.push(text);
            vocabulary.scores.push(score);
            vocabulary.types.push(kind);
        };
        push("<unk>".into(), 0.0, TYPE_UNKNOWN);
        push("<s>".into(), 0.0, TYPE_CONTROL);
        push("</s>".into(), 0.0, TYPE_CONTROL);
        for byte in 0..=255u8 {
            push(format!("<0x{byte:02X}>"), 0.0, TYPE_BYTE);
        }
        // Single characters first (low scores), then words (higher scores win merges).
        push("\u{2581}".into(), -1.0, TYPE_NORMAL);
        for character in (b'!'..=b'~').map(char::from) {
            push(character.to_string(), -2.0, TYPE_NORMAL);
        }
        let mut seen = std::collections::HashSet::new();
        for (rank, word) in WORDS.split_whitespace().enumerate() {
            if seen.insert(word) {
                push(format!("\u{2581}{word}"), -3.0 - rank as f32 * 0.001, TYPE_NORMAL);
            }
        }
        vocabulary
    }

    /// Whether `token` is an ordinary text token (not a control or byte-fallback token).
    pub fn is_ordinary(&self, token: usize) -> bool {
        self.types.get(token) == Some(&TYPE_NORMAL)
    }

    pub fn len(&self) -> u64 {
        self.tokens.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn metadata(&self) -> Vec<(String, Value)> {
        vec![
            ("tokenizer.ggml.model".into(), Value::String("llama".into())),
            ("tokenizer.ggml.pre".into(), Value::String("default".into())),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(ValueType::String, self.tokens.iter().cloned().map(Value::String).collect()),
            ),
            (
                "tokenizer.ggml.scores".into(),
                Value::Array(ValueType::F32, self.scores.iter().copied().map(Value::F32).collect()),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(ValueType::I32, self.types.iter().copied().map(Value::I32).collect()),
            ),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(BOS)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(EOS)),
            ("tokenizer.ggml.unknown_token_id".into(), Value::U32(UNKNOWN)),
            ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
            ("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)),
        ]
    }
}
