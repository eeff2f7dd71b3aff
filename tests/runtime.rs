//! The runtime's batch round scheduler (`models::runtime::rounds`), without a GPU: how it
//! splits a batch into rounds, where positions advance, and what each item gets back.

use lathe::forward::{Logits, Want};
use lathe::models::runtime::rounds::{run_batch, RoundSeq};
use lathe::models::SeqState;
use lathe::Error;

struct S {
    slot: u32,
    pos: usize,
}
impl SeqState for S {
    fn pos(&self) -> usize {
        self.pos
    }
}
impl RoundSeq for S {
    fn slot(&self) -> u32 {
        self.slot
    }
    fn set_pos(&mut self, pos: usize) {
        self.pos = pos;
    }
}

/// A long prefill is chunked, multi-token parts first and single tokens after; positions
/// advance per round (a failing round leaves the ones before it counted); each item gets
/// what it wants, in order.
#[test]
fn rounds_chunk_and_advance_positions_per_round() {
    let (mut a, mut b) = (S { slot: 0, pos: 3 }, S { slot: 1, pos: 7 });
    let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..5).collect(), vec![9]);
    let mut seen = Vec::new();
    let out = run_batch(
        &mut [(&mut a, &ta, Want::All), (&mut b, &tb, Want::Last)],
        10,
        4,
        true,
        |r| {
            seen.push(
                r.parts
                    .iter()
                    .map(|p| (p.item, p.pos0, p.n, p.row))
                    .collect::<Vec<_>>(),
            );
            // Logits of row r of the pass: every value = the token of that row.
            let mut l = Vec::new();
            for &(r0, n) in &r.wants {
                for row in r0..r0 + n {
                    l.extend(std::iter::repeat_n(r.toks[row] as f32, 10));
                }
            }
            Ok((l, Vec::new()))
        },
    )
    .unwrap();
    // Round 1: the prefill fills the pass; round 2: its last token and the decode step,
    // both single tokens, share one.
    assert_eq!(seen, [vec![(0, 3, 4, 0)], vec![(0, 7, 1, 0), (1, 7, 1, 1)]]);
    assert_eq!((a.pos, b.pos), (8, 8));
    let Logits::Full(la) = &out[0] else { panic!() };
    let rows: Vec<f32> = la.chunks(10).map(|c| c[0]).collect();
    assert_eq!(rows, [0.0, 1.0, 2.0, 3.0, 4.0]);
    let Logits::Full(lb) = &out[1] else { panic!() };
    assert_eq!(lb, &vec![9.0; 10]);

    // The second round fails: the first one's tokens stay counted.
    let mut c = S { slot: 2, pos: 0 };
    let mut calls = 0;
    let r = run_batch(&mut [(&mut c, &ta, Want::None)], 10, 4, true, |_| {
        calls += 1;
        match calls {
            1 => Ok((Vec::new(), Vec::new())),
            _ => Err(Error::Gpu("boom".into())),
        }
    });
    assert!(r.is_err());
    assert_eq!(c.pos, 4);
}
