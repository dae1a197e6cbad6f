//! How fast ggml's CPU kernels compute a split layer's CPU share on this machine, as one call of
//! `CpuExperts::compute`: per call, one pick whole or in parts, with zeroed weights of a Qwen3
//! expert's shape (gate and up Q4_K, down Q6_K). Prints the time per call and the weight bytes a
//! second.
//!
//! `cargo run --release --example cpu_experts -- [N_EMBD N_FF PICKS PARTS CALLS]`
use std::time::Instant;

use hypura_sys::{CpuExperts, ExpertShape, HostExpert};

fn main() -> anyhow::Result<()> {
    let numbers: Vec<usize> = std::env::args().skip(1).map(|a| a.parse()).collect::<Result<_, _>>()?;
    let get = |i: usize, default: usize| numbers.get(i).copied().unwrap_or(default);
    let (n_embd, n_ff, picks, parts, calls) = (get(0, 2048), get(1, 512), get(2, 1), get(3, 1), get(4, 2000));
    let shape = ExpertShape { gate_type: 12, up_type: 12, down_type: 14, n_embd, n_ff };
    let sizes = shape.slice_bytes().expect("sizes");
    let experts: Vec<[Vec<u8>; 3]> = (0..picks).map(|_| sizes.map(|size| vec![0u8; size])).collect();
    let x = vec![vec![0.5f32; n_embd]];
    let ff = shape.parts(parts);
    let mut cpu = CpuExperts::new(1)?;
    let jobs: Vec<HostExpert<'_>> = experts
        .iter()
        .flat_map(|[gate, up, down]| {
            ff.iter().map(move |ff| HostExpert { gate, up, down, token: 0, weight: 1.0, ff: ff.clone() })
        })
        .collect();
    let bytes: usize = sizes.iter().sum::<usize>() * picks;
    for _ in 0..50 {
        cpu.compute(&shape, &x, &jobs)?;
    }
    let started = Instant::now();
    for _ in 0..calls {
        cpu.compute(&shape, &x, &jobs)?;
    }
    let per_call = started.elapsed().as_secs_f64() / calls as f64;
    println!(
        "{picks} picks in {} parts each ({} jobs), {:.2} MB: {:.1} us a call, {:.2} GB/s",
        ff.len(),
        jobs.len(),
        bytes as f64 / 1e6,
        per_call * 1e6,
        bytes as f64 / per_call / 1e9
    );
    Ok(())
}
