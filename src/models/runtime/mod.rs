//! What every family's GPU forward shares, written once: the batch round scheduler with
//! its one rule for positions ([`rounds`]), the per-row tables and attention calls of a
//! round ([`rows`]), the output head and its readback ([`head`]), the KV pools and
//! sequence slots ([`kv`]), the chain handoff ([`link`]), copies between sequence slots
//! ([`state`]), the routed experts of a MoE layer ([`moe`]) and the trace hook
//! ([`trace`]); over a family's [`family::FamilyModel`], the engine's `Forward` and the
//! chain's `Part`. A family provides hyper-parameters, weights and the pass of one round;
//! layers point one way: the families import this module, never the reverse.

pub mod family;
pub mod head;
pub mod kv;
pub mod link;
pub mod moe;
pub mod rounds;
pub mod rows;
pub mod state;
pub mod trace;
