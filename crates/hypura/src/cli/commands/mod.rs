pub mod bench;
pub mod inspect;
pub mod profile;
pub mod run;
pub mod serve;
pub mod simulate;
