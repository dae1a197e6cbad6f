//! Every tiny preset must load in plain libllama as its real architecture and give finite,
//! non-degenerate logits; the file must be deterministic from the seed.
use hypura_forge::{preset, presets, write_model};
use hypura_sys::{Backend, Batch, Context, ContextParams, Model, ModelParams};

fn forge(name: &str, directory: &std::path::Path) -> std::path::PathBuf {
    let spec = preset(name).unwrap_or_else(|| panic!("preset {name}"));
    let path = directory.join(format!("{name}.gguf"));
    write_model(&spec, &path, &|_, _| {}).unwrap_or_else(|error| panic!("forging {name}: {error}"));
    path
}

/// Forge `name`, load it in libllama without repacking, and decode a prompt.
fn loads_with_finite_logits(name: &str) {
    let directory = tempfile::tempdir().unwrap();
    let backend = Backend::get();
    let spec = preset(name).unwrap_or_else(|| panic!("preset {name}"));
    let path = forge(name, directory.path());
    let model = Model::load(backend, &path, &ModelParams { use_extra_bufts: false, ..ModelParams::default() })
        .unwrap_or_else(|error| panic!("{name}: {error}"));
    assert_eq!(model.n_layer() as u64, spec.shape.n_layer, "{name}");
    assert_eq!(model.n_embd() as u64, spec.shape.n_embd, "{name}");
    let vocab = model.vocab();
    let tokens = vocab.tokenize("The capital of France is Paris", true, false).unwrap();
    assert!(tokens.len() >= 3, "{name}: tokenized to {tokens:?}");
    let mut context = Context::new(
        &model,
        &ContextParams { n_ctx: 256, n_threads: 2, n_threads_batch: 2, ..ContextParams::default() },
    )
    .unwrap();
    let mut batch = Batch::new(tokens.len(), 1);
    for (position, &token) in tokens.iter().enumerate() {
        batch.push(token, position as i32, &[0], position + 1 == tokens.len()).unwrap();
    }
    context.decode(&batch).unwrap_or_else(|error| panic!("{name}: {error}"));
    let logits = context.logits(-1).unwrap();
    assert_eq!(logits.len() as i32, vocab.n_tokens());
    assert!(logits.iter().all(|logit| logit.is_finite()), "{name}: non-finite logits");
    let (min, max) = logits.iter().fold((f32::MAX, f32::MIN), |(low, high), &logit| (low.min(logit), high.max(logit)));
    assert!(max - min > 1e-3, "{name}: logits are flat ({min}..{max})");
}

macro_rules! loads {
    ($($test:ident => $preset:literal),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                loads_with_finite_logits($preset);
            }
        )*

        /// Every tiny preset has its test above.
        #[test]
        fn every_tiny_preset_is_tested() {
            let tested = [$($preset),*];
            let tiny: Vec<&str> = presets().into_iter().filter(|name| name.starts_with("tiny-")).collect();
            assert_eq!(tiny, tested, "a tiny preset without a load test, or a test without its preset");
        }
    };
}

hypura_forge::with_tiny_presets!(loads);

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let directory = tempfile::tempdir().unwrap();
    let mut spec = preset("tiny-moe-8x").unwrap();
    let write = |spec: &hypura_forge::ForgeSpec, file: &str| {
        let path = directory.path().join(file);
        write_model(spec, &path, &|_, _| {}).unwrap();
        std::fs::read(path).unwrap()
    };
    let first = write(&spec, "a.gguf");
    let again = write(&spec, "b.gguf");
    assert_eq!(first, again, "same seed must give the same file");
    spec.seed += 1;
    let other = write(&spec, "c.gguf");
    assert_eq!(first.len(), other.len());
    assert_ne!(first, other, "another seed must give other weights");
}
