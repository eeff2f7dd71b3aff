//! Routing statistics: how often each expert of each MoE layer was chosen. lathe writes them
//! with `--save-expert-stats FILE`; the planner ([`super::Placement`]) reads them to decide
//! which experts get slots.
//!
//! File format (JSON, one object):
//! ```json
//! { "format": "lathe-expert-stats", "version": 1,
//!   "model": "Qwen3.5-35B-A3B-Q4_K_M.gguf", "n_used": 8,
//!   "layers": [ { "layer": 0, "tokens": 5120, "counts": [12, 0, 301, ...] }, ... ] }
//! ```
//! `counts` has one entry per expert of the layer: how many routed (token, expert) pairs chose
//! it; `tokens` how many tokens passed the layer's router, so `Σ counts = n_used · tokens`
//! and `counts[e] / tokens` is the expected number of picks of expert e per token. `model` is
//! informational (the file name); layers are matched by number and checked against the
//! model's expert counts when loaded for planning ([`ExpertStats::check`]).

use super::MoeInfo;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const FORMAT: &str = "lathe-expert-stats";
pub const VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerStats {
    /// Model layer (`blk.N`).
    pub layer: usize,
    /// Tokens routed through this layer.
    pub tokens: u64,
    /// `[n_expert]` picks per expert.
    pub counts: Vec<u64>,
}

impl LayerStats {
    /// Expected picks of `expert` per token (`Σ_e = n_used`); 0 before any token.
    pub fn picks_per_token(&self, expert: usize) -> f64 {
        if self.tokens == 0 {
            return 0.0;
        }
        self.counts.get(expert).copied().unwrap_or(0) as f64 / self.tokens as f64
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertStats {
    pub format: String,
    pub version: u32,
    pub model: String,
    pub n_used: usize,
    pub layers: Vec<LayerStats>,
}

impl ExpertStats {
    /// Zero counts for every MoE layer of `info`.
    pub fn new(info: &MoeInfo) -> ExpertStats {
        ExpertStats {
            format: FORMAT.into(),
            version: VERSION,
            model: info
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            n_used: info.n_used,
            layers: info
                .layers
                .iter()
                .map(|m| LayerStats {
                    layer: m.layer,
                    tokens: 0,
                    counts: vec![0; m.n_expert],
                })
                .collect(),
        }
    }

    pub fn layer(&self, layer: usize) -> Option<&LayerStats> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Count one router decision of `layer`: `ids` u32 `[n_tokens, n_used]` as the top-k
    /// kernel writes them. Ids outside the layer's experts (padding) are not counted; an
    /// unknown layer is ignored.
    pub fn record(&mut self, layer: usize, ids: &[u32]) {
        let k = self.n_used.max(1);
        let Some(l) = self.layers.iter_mut().find(|l| l.layer == layer) else {
            return;
        };
        l.tokens += (ids.len() / k) as u64;
        for &e in ids {
            if let Some(c) = l.counts.get_mut(e as usize) {
                *c += 1;
            }
        }
    }

    /// Errors unless every layer of the file is a MoE layer of `info` with as many experts.
    pub fn check(&self, info: &MoeInfo, path: &Path) -> Result<()> {
        if self.format != FORMAT || self.version != VERSION {
            return Err(Error::format(
                path,
                format!(
                    "format `{}` version {}: expected `{FORMAT}` version {VERSION}",
                    self.format, self.version
                ),
            ));
        }
        for l in &self.layers {
            match info.layer(l.layer) {
                None => {
                    return Err(Error::format(
                        path,
                        format!(
                            "layer {} is not a MoE layer of {}",
                            l.layer,
                            info.path.display()
                        ),
                    ))
                }
                Some(m) if m.n_expert != l.counts.len() => {
                    return Err(Error::format(
                        path,
                        format!(
                            "layer {}: {} counts for {} experts",
                            l.layer,
                            l.counts.len(),
                            m.n_expert
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let s = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Invalid(format!("expert stats: {e}")))?;
        std::fs::write(path, s + "\n").map_err(|e| Error::io(path, e))
    }

    /// Read a stats file (format and version checked; use [`check`](Self::check) against
    /// the model before planning with it).
    pub fn load(path: &Path) -> Result<ExpertStats> {
        let s = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let st: ExpertStats =
            serde_json::from_str(&s).map_err(|e| Error::format(path, e.to_string()))?;
        if st.format != FORMAT || st.version != VERSION {
            return Err(Error::format(
                path,
                format!(
                    "format `{}` version {}: expected `{FORMAT}` version {VERSION}",
                    st.format, st.version
                ),
            ));
        }
        Ok(st)
    }
}
