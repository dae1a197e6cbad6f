//! PLACEHOLDER: `Qwen3Next` is being written; it has no preset yet.
use super::{Definition, Meta, Tensors};
use crate::spec::{Arch, ForgeSpec};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::Qwen3Next, presets: Vec::new, metadata, tensors };

fn metadata(_: &ForgeSpec, _: &mut Meta) {}

fn tensors(_: &mut Tensors) {
    unreachable!("no preset yet")
}
