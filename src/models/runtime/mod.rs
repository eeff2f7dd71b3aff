//! What every family's GPU forward shares, written once: the chain handoff ([`link`]).

pub mod link;
