//! `rpc_tensor` as the wire carries it: the fields the checks read, the bytes it spans, and
//! whether its operation is one ggml computes itself.
use super::{le_u32, le_u64, refuse, Refusal, MAX_DIMS, MAX_SRC, TENSOR_BYTES};

/// `rpc_tensor`: the fields the checks read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    pub id: u64,
    pub kind: u32,
    pub buffer: u64,
    pub ne: [u32; MAX_DIMS],
    pub nb: [u32; MAX_DIMS],
    pub op: u32,
    pub op_params: [i32; 16],
    pub src: [u64; MAX_SRC],
    pub view_src: u64,
    pub view_offs: u64,
    pub data: u64,
}

impl Tensor {
    /// Parse the first `TENSOR_BYTES` of `bytes`.
    pub fn parse(bytes: &[u8]) -> Tensor {
        let bytes = &bytes[..TENSOR_BYTES];
        let u32s = |at: usize| -> [u32; MAX_DIMS] { std::array::from_fn(|i| le_u32(&bytes[at + 4 * i..])) };
        Tensor {
            id: le_u64(&bytes[0..]),
            kind: le_u32(&bytes[8..]),
            buffer: le_u64(&bytes[12..]),
            ne: u32s(20),
            nb: u32s(36),
            op: le_u32(&bytes[52..]),
            op_params: std::array::from_fn(|i| le_u32(&bytes[56 + 4 * i..]) as i32),
            src: std::array::from_fn(|i| le_u64(&bytes[124 + 8 * i..])),
            view_src: le_u64(&bytes[204..]),
            view_offs: le_u64(&bytes[212..]),
            data: le_u64(&bytes[220..]),
        }
    }

    /// The bytes the tensor spans from its data pointer, as `ggml_nbytes` counts them (0 when a
    /// dimension is 0); an error for a type ggml does not have or a row that is not whole blocks.
    pub fn nbytes(&self) -> Result<u64, Refusal> {
        if self.kind >= hypura_sys::ggml_ops::TYPE_COUNT {
            return refuse(format!("tensor type {} is past ggml's types", self.kind));
        }
        let (Ok(block), Ok(size)) =
            (hypura_sys::ggml_type_block_size(self.kind), hypura_sys::ggml_type_size(self.kind))
        else {
            return refuse(format!("tensor type {} is not a live ggml type", self.kind));
        };
        if block == 0 || u64::from(self.ne[0]) % block != 0 {
            return refuse(format!("a row of {} elements is not whole blocks of type {}", self.ne[0], self.kind));
        }
        if self.ne.contains(&0) {
            return Ok(0);
        }
        let far = |from: usize| -> u128 {
            (from..MAX_DIMS).map(|i| u128::from(self.ne[i] - 1) * u128::from(self.nb[i])).sum()
        };
        let bytes = if block == 1 {
            u128::from(size) + far(0)
        } else {
            u128::from(self.ne[0]) * u128::from(self.nb[0]) / u128::from(block) + far(1)
        };
        u64::try_from(bytes).or_else(|_| refuse("a tensor larger than the address space"))
    }

    /// The operation is one ggml computes itself: in range, no custom or map operation, and a
    /// unary or gated operation's own number in range.
    pub(super) fn check_op(&self) -> Result<(), Refusal> {
        use hypura_sys::ggml_ops as ops;
        let sub = self.op_params[0];
        if self.op >= ops::COUNT {
            return refuse(format!("operation {} is past ggml's {} operations", self.op, ops::COUNT));
        }
        if ops::CUSTOM.contains(&self.op) {
            return refuse(format!("operation {} is a custom operation (a function pointer)", self.op));
        }
        let (family, count) = match self.op {
            op if op == ops::UNARY => ("unary", ops::UNARY_COUNT),
            op if op == ops::GLU => ("gated", ops::GLU_COUNT),
            _ => return Ok(()),
        };
        if sub < 0 || sub as u32 >= count {
            return refuse(format!("{family} operation {sub} is past ggml's {count}"));
        }
        Ok(())
    }
}
