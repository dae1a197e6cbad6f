pub mod bench;
pub mod inspect;
pub mod profile;
pub mod pull;
pub mod rpc_server;
pub mod run;
pub mod serve;
pub mod simulate;
