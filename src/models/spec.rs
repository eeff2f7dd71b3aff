//! What speculative decoding asks of a model family (`generate`'s speculation loop drives
//! it): passes that keep their hidden states for a multi-token prediction (MTP) block, a
//! verify pass whose rows have the bits of one-token decode steps, and a rollback of the
//! state past a rejected draft.

use super::Seq;
use crate::forward::{Logits, Want};
use crate::Result;

/// Which hidden states an MTP pass reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hidden {
    /// The rows read the hidden states of the last rows (as many as the pass has tokens)
    /// of the sequence's last [`Speculate::feed`], [`Speculate::verify`] or
    /// [`Speculate::rollback`] pass, at their positions. The last
    /// [`crate::gpu::matvec::MAX_TOKENS`] rows of each sequence's pass are kept per
    /// sequence (other sequences' passes may run in between); more only until the next pass.
    Trunk,
    /// One token after the last MTP row of the sequence, reading that row's output: the
    /// next draft of a chain.
    Chain,
}

pub trait Speculate {
    /// Whether the model runs an MTP block.
    fn has_mtp(&self) -> bool;
    /// Most tokens of one [`Speculate::verify`] pass.
    fn max_verify(&self) -> usize;
    /// Most tokens of one pass: a longer [`Speculate::feed`] runs in several and keeps no
    /// trunk rows beyond the saved ones.
    fn pass_rows(&self) -> usize;
    /// Feed `tokens` as a forward does (the same passes; the logits `want` asks for, one
    /// item), keeping the rows for [`Hidden::Trunk`] when they fit one pass.
    fn feed(&mut self, seq: &mut Seq, tokens: &[u32], want: Want) -> Result<Vec<Logits>>;
    /// Feed `tokens` through the decode kernels, after saving the recurrent state: row `j`'s
    /// logits (per row what `want` asks: `Top` or full) have the bits of a one-token decode
    /// step at that position.
    fn verify(&mut self, seq: &mut Seq, tokens: &[u32], want: Want) -> Result<Vec<Logits>>;
    /// [`Speculate::verify`] of several sequences (each at most [`Speculate::max_verify`]
    /// tokens), in as few passes as keep each row's one-token bits; each sequence can be
    /// rolled back afterwards. Per item its rows' logits.
    fn verify_batch(&mut self, items: &mut [(&mut Seq, &[u32], Want)]) -> Result<Vec<Vec<Logits>>> {
        items
            .iter_mut()
            .map(|(s, t, w)| self.verify(s, t, *w))
            .collect()
    }
    /// Back to the state before the sequence's last verify pass, then `keep` (its accepted
    /// tokens) fed again through the decode kernels.
    fn rollback(&mut self, seq: &mut Seq, keep: &[u32]) -> Result<()>;
    /// [`Speculate::rollback`] of several sequences, the kept tokens fed again in shared
    /// passes where the model can.
    fn rollback_batch(&mut self, items: &mut [(&mut Seq, &[u32])]) -> Result<()> {
        items
            .iter_mut()
            .try_for_each(|(s, keep)| self.rollback(s, keep))
    }
    /// The MTP block over `tokens` at the positions `hidden` implies; `Want::Top`: the last
    /// row's best logits, `All`: every row's.
    fn mtp(&mut self, seq: &Seq, hidden: Hidden, tokens: &[u32], want: Want)
        -> Result<Vec<Logits>>;
    /// The hidden states (`[rows, n_embd]`) the last MTP pass read.
    fn mtp_hidden(&self, rows: usize) -> Result<Vec<f32>>;
    /// `k` greedy MTP drafts in one submission: [`Speculate::mtp`] over `tokens` with
    /// [`Hidden::Trunk`], then `k - 1` chained rows each fed the previous row's pick.
    fn mtp_drafts(&mut self, seq: &Seq, tokens: &[u32], k: usize) -> Result<Vec<u32>>;
    /// Drafts pick among the first `n` tokens only (`None`: the whole vocabulary).
    fn set_draft_vocab(&mut self, n: Option<usize>) -> Result<()>;
}
