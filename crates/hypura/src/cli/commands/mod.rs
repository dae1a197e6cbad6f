pub mod inspect;
pub mod profile;
