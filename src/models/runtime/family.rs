//! A family's GPU model as the runtime sees it ([`FamilyModel`]): its own sequence type, the
//! round pass behind `forward_batch`, its state copies and its limits. The runtime
//! implements [`Forward`] (the engine's view, sequences of any family) and the chain's
//! [`Part`] once over it, so a family writes neither.

use super::link::{Link, Part};
use super::rounds::{own_items, RoundSeq};
use crate::forward::{Logits, Want, GREEDY};
use crate::gpu::Gpu;
use crate::models::spec::Speculate;
use crate::models::{Forward, Seq};
use crate::moe::Offload;
use crate::Result;
use std::sync::Arc;

/// What a family's GPU model provides; see the module doc.
pub trait FamilyModel: Send {
    /// The family's per-sequence state.
    type Seq: RoundSeq;
    fn gpu(&self) -> &Arc<Gpu>;
    fn n_vocab(&self) -> usize;
    fn new_seq(&self) -> Result<Self::Seq>;
    /// Forget the sequence's history.
    fn reset(&self, seq: &mut Self::Seq) -> Result<()>;
    /// Make `dst` hold exactly what `src` holds, by copies on the GPU.
    fn copy_seq(&self, src: &Self::Seq, dst: &mut Self::Seq) -> Result<()>;
    /// Feed several sequences; per item what it wants ([`Forward::forward_batch`]).
    fn forward_batch(
        &mut self,
        items: &mut [(&mut Self::Seq, &[u32], Want)],
    ) -> Result<Vec<Logits>>;
    /// Where passes append their per-dispatch times while it is `Some`
    /// ([`Forward::profile`]); an error for a family without profiles.
    fn profile_sink(&mut self) -> Result<&mut Option<Vec<(String, f64)>>>;
    /// The expert offload, when the model has one.
    fn offload(&self) -> Option<&Offload> {
        None
    }
    /// Routed experts over all MoE layers (0 for a dense model).
    fn routed_experts(&self) -> usize {
        0
    }
    fn max_context(&self) -> Option<usize>;
    fn pass_rows(&self) -> usize;
    fn speculate(&mut self) -> Option<&mut dyn Speculate> {
        None
    }
    /// The chain ends for the next calls (a family that only runs whole has none).
    fn set_link(&mut self, link: Link);
    /// [`Forward::hidden_out`].
    fn hidden_out(&mut self, on: bool) -> Result<()>;
}

impl<F: FamilyModel> Forward for F {
    fn vocab_size(&self) -> usize {
        self.n_vocab()
    }
    fn new_seq(&self) -> Result<Seq> {
        Ok(Seq::new(FamilyModel::new_seq(self)?))
    }
    fn reset(&self, seq: &mut Seq) -> Result<()> {
        FamilyModel::reset(self, seq.get_mut()?)
    }
    fn copy_seq(&self, src: &Seq, dst: &mut Seq) -> Result<()> {
        FamilyModel::copy_seq(self, src.get()?, dst.get_mut()?)
    }
    fn forward_batch(&mut self, items: &mut [(&mut Seq, &[u32], Want)]) -> Result<Vec<Logits>> {
        FamilyModel::forward_batch(self, &mut own_items(items)?)
    }
    fn forward(&mut self, seq: &mut Seq, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        let want = if all { Want::All } else { Want::Last };
        let mut out = FamilyModel::forward_batch(self, &mut [(seq.get_mut()?, tokens, want)])?;
        Ok(out.pop().map(Logits::into_full).unwrap_or_default())
    }
    fn profile(&mut self, items: &mut [(&mut Seq, &[u32])]) -> Result<Vec<(String, f64)>> {
        // The step a greedy generation takes: argmax on the GPU, a few bytes back.
        *self.profile_sink()? = Some(Vec::new());
        let mut v: Vec<_> = items
            .iter_mut()
            .map(|(s, t)| (&mut **s, *t, GREEDY))
            .collect();
        let r = Forward::forward_batch(self, &mut v);
        let prof = self.profile_sink()?.take().unwrap_or_default();
        r.map(|_| prof)
    }
    fn offload(&self) -> Option<&Offload> {
        FamilyModel::offload(self)
    }
    fn routed_experts(&self) -> usize {
        FamilyModel::routed_experts(self)
    }
    fn max_context(&self) -> Option<usize> {
        FamilyModel::max_context(self)
    }
    fn pass_rows(&self) -> usize {
        FamilyModel::pass_rows(self)
    }
    fn speculate(&mut self) -> Option<&mut dyn Speculate> {
        FamilyModel::speculate(self)
    }
    fn hidden_out(&mut self, on: bool) -> Result<()> {
        FamilyModel::hidden_out(self, on)
    }
}

impl<F: FamilyModel> Part for F {
    fn link(&mut self, link: Link) {
        self.set_link(link)
    }
    fn gpu(&self) -> &Arc<Gpu> {
        FamilyModel::gpu(self)
    }
}
