//! Hypura's integration tests, in one binary: each module was a test binary of its own, and
//! each links libllama statically, so one binary is one link instead of sixteen. `common` holds
//! the shared helpers and the turns by which tests share the machine (every test takes one
//! first; see there). Run one former binary's tests with a filter:
//! `cargo test --release -p hypura --test it server_greedy::`.
mod common;

mod agent_openclaw;
mod architectures;
mod cli_inspect;
mod cli_run;
mod dense_stream;
mod engine_vs_llama;
mod expert_stream;
mod floors;
mod gpu_tier;
mod hub;
mod inventory;
mod predictions;
mod prompt_cache;
mod real_routing;
mod remote;
mod server_clients;
mod server_greedy;
mod server_router;
mod server_service;
mod server_tools;
mod speculation;
