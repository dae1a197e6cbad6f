//! ggml tensor types and GGUF metadata values.

/// A ggml tensor element type. Discriminant ids are exactly those of `enum ggml_type` in
/// `ggml.h`; ids of removed types (4, 5, 31-33, 36-38) have no variant, so files using them
/// are rejected the same way llama.cpp rejects them.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
    Q2_0,
}

/// (type, ggml id, ggml type_name, blck_size, type_size).
///
/// Block sizes and byte sizes were taken from `type_traits` in `ggml.c` and checked against
/// `sizeof(block_*)` from `ggml-common.h` by compiling it (llama.cpp as vendored by
/// llama-cpp-sys-2 0.1.161).
const TABLE: [(GgmlType, u32, &str, u64, u64); 35] = [
    (GgmlType::F32, 0, "f32", 1, 4),
    (GgmlType::F16, 1, "f16", 1, 2),
    (GgmlType::Q4_0, 2, "q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "q8_1", 32, 36),
    (GgmlType::Q2_K, 10, "q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "q6_K", 256, 210),
    (GgmlType::Q8_K, 15, "q8_K", 256, 292),
    (GgmlType::IQ2_XXS, 16, "iq2_xxs", 256, 66),
    (GgmlType::IQ2_XS, 17, "iq2_xs", 256, 74),
    (GgmlType::IQ3_XXS, 18, "iq3_xxs", 256, 98),
    (GgmlType::IQ1_S, 19, "iq1_s", 256, 50),
    (GgmlType::IQ4_NL, 20, "iq4_nl", 32, 18),
    (GgmlType::IQ3_S, 21, "iq3_s", 256, 110),
    (GgmlType::IQ2_S, 22, "iq2_s", 256, 82),
    (GgmlType::IQ4_XS, 23, "iq4_xs", 256, 136),
    (GgmlType::I8, 24, "i8", 1, 1),
    (GgmlType::I16, 25, "i16", 1, 2),
    (GgmlType::I32, 26, "i32", 1, 4),
    (GgmlType::I64, 27, "i64", 1, 8),
    (GgmlType::F64, 28, "f64", 1, 8),
    (GgmlType::IQ1_M, 29, "iq1_m", 256, 56),
    (GgmlType::BF16, 30, "bf16", 1, 2),
    (GgmlType::TQ1_0, 34, "tq1_0", 256, 54),
    (GgmlType::TQ2_0, 35, "tq2_0", 256, 66),
    (GgmlType::MXFP4, 39, "mxfp4", 32, 17),
    (GgmlType::NVFP4, 40, "nvfp4", 64, 36),
    (GgmlType::Q1_0, 41, "q1_0", 128, 18),
    (GgmlType::Q2_0, 42, "q2_0", 64, 18),
];

impl GgmlType {
    /// Every supported type, in ggml id order.
    pub const ALL: [GgmlType; 35] = {
        let mut all = [GgmlType::F32; 35];
        let mut i = 0;
        while i < TABLE.len() {
            all[i] = TABLE[i].0;
            i += 1;
        }
        all
    };

    fn entry(self) -> &'static (GgmlType, u32, &'static str, u64, u64) {
        // The enum and TABLE are in the same order, so the discriminant indexes the table.
        &TABLE[self as usize]
    }

    /// The type with ggml id `id`, or `None` for unknown and removed ids.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|entry| entry.1 == id).map(|entry| entry.0)
    }

    /// The ggml id (`enum ggml_type`).
    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// ggml's `type_name` for this type, e.g. `"q4_K"`.
    pub fn name(self) -> &'static str {
        self.entry().2
    }

    /// Elements per block (`blck_size`).
    pub fn block_size(self) -> u64 {
        self.entry().3
    }

    /// Bytes per block (`type_size`).
    pub fn type_size(self) -> u64 {
        self.entry().4
    }

    /// Bytes of one row of `ne0` elements; `None` when `ne0` is not a whole number of blocks or
    /// the size overflows.
    pub fn row_bytes(self, ne0: u64) -> Option<u64> {
        if ne0 % self.block_size() != 0 {
            return None;
        }
        (ne0 / self.block_size()).checked_mul(self.type_size())
    }

    /// Bytes of a contiguous tensor with dimensions `dims` (ne0 first), like `ggml_nbytes`.
    /// An empty `dims` is a scalar. `None` when the row is not a whole number of blocks or
    /// the size overflows.
    pub fn tensor_bytes(self, dims: &[u64]) -> Option<u64> {
        let (ne0, rest) = match dims.split_first() {
            Some((ne0, rest)) => (*ne0, rest),
            None => (1, &[][..]),
        };
        rest.iter().try_fold(self.row_bytes(ne0)?, |bytes, &dim| bytes.checked_mul(dim))
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.name())
    }
}

/// A GGUF metadata value type; discriminants are the `gguf_type` ids 0..=12.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The value type with `gguf_type` id `id`.
    pub fn from_id(id: u32) -> Option<ValueType> {
        Some(match id {
            0 => ValueType::U8,
            1 => ValueType::I8,
            2 => ValueType::U16,
            3 => ValueType::I16,
            4 => ValueType::U32,
            5 => ValueType::I32,
            6 => ValueType::F32,
            7 => ValueType::Bool,
            8 => ValueType::String,
            9 => ValueType::Array,
            10 => ValueType::U64,
            11 => ValueType::I64,
            12 => ValueType::F64,
            _ => return None,
        })
    }

    /// The `gguf_type` id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Encoded size of one value of a fixed-size type; `None` for strings and arrays.
    pub fn fixed_size(self) -> Option<u64> {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => Some(1),
            ValueType::U16 | ValueType::I16 => Some(2),
            ValueType::U32 | ValueType::I32 | ValueType::F32 => Some(4),
            ValueType::U64 | ValueType::I64 | ValueType::F64 => Some(8),
            ValueType::String | ValueType::Array => None,
        }
    }

    /// The fewest bytes one encoded value of this type can take: a string is at least its
    /// 8-byte length, an array at least its 4-byte element type and 8-byte count. Used to
    /// reject counts that the rest of the file could not possibly hold.
    pub fn min_encoded_size(self) -> u64 {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            fixed => fixed.fixed_size().unwrap_or(1),
        }
    }
}

/// A GGUF metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Element type and elements. Every element has the element type; for
    /// `ValueType::Array` elements each inner array carries its own element type.
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer type holding a non-negative value. Not bools: a flag is not a count.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(value) => Some(value.into()),
            Value::U16(value) => Some(value.into()),
            Value::U32(value) => Some(value.into()),
            Value::U64(value) => Some(value),
            Value::I8(value) => u64::try_from(value).ok(),
            Value::I16(value) => u64::try_from(value).ok(),
            Value::I32(value) => u64::try_from(value).ok(),
            Value::I64(value) => u64::try_from(value).ok(),
            _ => None,
        }
    }

    /// Any integer type whose value fits in i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(value) => Some(value.into()),
            Value::U16(value) => Some(value.into()),
            Value::U32(value) => Some(value.into()),
            Value::U64(value) => i64::try_from(value).ok(),
            Value::I8(value) => Some(value.into()),
            Value::I16(value) => Some(value.into()),
            Value::I32(value) => Some(value.into()),
            Value::I64(value) => Some(value),
            _ => None,
        }
    }

    /// Floats, and integers converted (64-bit integers may round).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(value) => Some(value.into()),
            Value::F64(value) => Some(value),
            Value::U64(value) => Some(value as f64),
            Value::I64(value) => Some(value as f64),
            _ => self.as_i64().map(|value| value as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(value) => Some(value),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(value) => Some(value),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, values) => Some(values),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_order_matches_enum_discriminants() {
        for (position, entry) in TABLE.iter().enumerate() {
            assert_eq!(entry.0 as usize, position, "{:?}", entry.0);
            assert_eq!(GgmlType::from_id(entry.1), Some(entry.0));
            assert_eq!(entry.0.id(), entry.1);
        }
    }

    #[test]
    fn known_block_and_type_sizes() {
        // (type, id, name, elements per block, bytes per block) from ggml.h / ggml-common.h.
        let expected = [
            (GgmlType::F32, 0, "f32", 1, 4),
            (GgmlType::F16, 1, "f16", 1, 2),
            (GgmlType::BF16, 30, "bf16", 1, 2),
            (GgmlType::Q4_0, 2, "q4_0", 32, 18),
            (GgmlType::Q8_0, 8, "q8_0", 32, 34),
            (GgmlType::Q2_K, 10, "q2_K", 256, 84),
            (GgmlType::Q3_K, 11, "q3_K", 256, 110),
            (GgmlType::Q4_K, 12, "q4_K", 256, 144),
            (GgmlType::Q5_K, 13, "q5_K", 256, 176),
            (GgmlType::Q6_K, 14, "q6_K", 256, 210),
            (GgmlType::Q8_K, 15, "q8_K", 256, 292),
            (GgmlType::IQ4_XS, 23, "iq4_xs", 256, 136),
            (GgmlType::IQ4_NL, 20, "iq4_nl", 32, 18),
            (GgmlType::MXFP4, 39, "mxfp4", 32, 17),
            (GgmlType::Q1_0, 41, "q1_0", 128, 18),
        ];
        for (ggml_type, id, name, block_size, type_size) in expected {
            assert_eq!(ggml_type.id(), id, "{ggml_type:?}");
            assert_eq!(ggml_type.name(), name, "{ggml_type:?}");
            assert_eq!(ggml_type.block_size(), block_size, "{ggml_type:?}");
            assert_eq!(ggml_type.type_size(), type_size, "{ggml_type:?}");
        }
    }

    #[test]
    fn removed_and_unknown_ids_are_rejected() {
        for id in [4, 5, 31, 32, 33, 36, 37, 38, 43, 1000, u32::MAX] {
            assert_eq!(GgmlType::from_id(id), None, "id {id}");
        }
        assert_eq!(GgmlType::ALL.len(), 35);
    }

    #[test]
    fn row_and_tensor_bytes() {
        assert_eq!(GgmlType::Q4_K.row_bytes(640), None);
        assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(GgmlType::F16.tensor_bytes(&[640, 3, 2]), Some(640 * 3 * 2 * 2));
        assert_eq!(GgmlType::Q6_K.tensor_bytes(&[256, 10]), Some(2100));
        assert_eq!(GgmlType::F32.tensor_bytes(&[]), Some(4));
        assert_eq!(GgmlType::Q4_0.tensor_bytes(&[]), None);
        assert_eq!(GgmlType::F64.tensor_bytes(&[u64::MAX / 8 + 1]), None);
        assert_eq!(GgmlType::F32.tensor_bytes(&[1 << 32, 1 << 32]), None);
    }

    #[test]
    fn value_accessors() {
        assert_eq!(Value::I32(-1).as_u64(), None);
        assert_eq!(Value::I32(7).as_u64(), Some(7));
        assert_eq!(Value::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::I8(-3).as_i64(), Some(-3));
        assert_eq!(Value::Bool(true).as_u64(), None);
        assert_eq!(Value::Bool(true).as_bool(), Some(true));
        assert_eq!(Value::U16(3).as_f64(), Some(3.0));
        assert_eq!(Value::F32(0.5).as_f64(), Some(0.5));
        assert_eq!(Value::String("x".into()).as_f64(), None);
        assert_eq!(Value::String("x".into()).as_str(), Some("x"));
        let array = Value::Array(ValueType::U8, vec![Value::U8(1)]);
        assert_eq!(array.as_array(), Some(&[Value::U8(1)][..]));
        assert_eq!(array.value_type(), ValueType::Array);
        for id in 0..=12 {
            assert_eq!(ValueType::from_id(id).map(ValueType::id), Some(id));
        }
        assert_eq!(ValueType::from_id(13), None);
    }
}
