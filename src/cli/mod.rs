//! Command implementations of the `lathe` binary, one module per command (or family of
//! commands). Each parses nothing itself (clap does, in main.rs) and calls the library.

pub mod bench;
pub mod chat;
pub mod hub;
pub mod load;
pub mod plan;
pub mod run;
pub mod serve;
pub mod synth;
pub mod text;
