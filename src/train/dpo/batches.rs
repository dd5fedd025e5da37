//! Which training examples make each micro-batch.
//!
//! Every epoch is a seeded permutation of the examples, so a resumed run sees exactly the
//! batches the interrupted one would have. The permutation is cut either into batches of a
//! fixed count (`--batch-size`) or into batches whose tokens come nearest a target
//! (`--batch-tokens`, as fairseq's `--max-tokens` groups by tokens): arms whose examples differ
//! in length then read the same tokens in the same number of steps.

use rand::seq::SliceRandom;
use rand::SeedableRng;

/// How an epoch's permutation is cut.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum BatchBy {
    /// This many examples a batch (the last of an epoch may hold fewer).
    Count(usize),
    /// Add the next example while the batch's tokens come nearer this target by it (at least
    /// one example a batch; the last of an epoch may fall short).
    Tokens(usize),
}

/// The micro-batches of a training run, epoch after epoch.
pub(crate) struct BatchPlan {
    /// Tokens of each example, as the step logs count them.
    tokens: Vec<usize>,
    by: BatchBy,
    seed: u64,
}

impl BatchPlan {
    pub(crate) fn new(tokens: Vec<usize>, by: BatchBy, seed: u64) -> Self {
        Self { tokens, by, seed }
    }

    /// The micro-batches of epoch `epoch`, as example indices.
    pub(crate) fn epoch(&self, epoch: usize) -> Vec<Vec<usize>> {
        let n = self.tokens.len();
        let mut order: Vec<usize> = (0..n).collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed.wrapping_add(epoch as u64));
        order.shuffle(&mut rng);
        match self.by {
            BatchBy::Count(b) => order.chunks(b.max(1)).map(<[usize]>::to_vec).collect(),
            BatchBy::Tokens(target) => self.fill_to(&order, target),
        }
    }

    fn fill_to(&self, order: &[usize], target: usize) -> Vec<Vec<usize>> {
        let mut batches = Vec::new();
        let mut batch: Vec<usize> = Vec::new();
        let mut sum = 0usize;
        for &i in order {
            let t = self.tokens[i];
            // Adding `t` brings the sum nearer the target when 2·sum + t ≤ 2·target: batches
            // then straddle the target instead of all falling short of it.
            if !batch.is_empty() && 2 * sum + t > 2 * target {
                batches.push(std::mem::take(&mut batch));
                sum = 0;
            }
            batch.push(i);
            sum += t;
        }
        if !batch.is_empty() {
            batches.push(batch);
        }
        batches
    }

    /// Micro-batches in the first epoch (epochs cut by tokens may differ by one or two).
    pub(crate) fn per_epoch(&self) -> usize {
        match self.by {
            BatchBy::Count(b) => self.tokens.len().div_ceil(b.max(1)),
            BatchBy::Tokens(_) => self.epoch(0).len(),
        }
    }

    /// Micro-batch `k`, counted from the start of the run.
    pub(crate) fn micro_batch(&self, k: usize) -> Vec<usize> {
        if self.tokens.is_empty() {
            return Vec::new();
        }
        if let BatchBy::Count(_) = self.by {
            let per = self.per_epoch();
            return self.epoch(k / per).swap_remove(k % per);
        }
        let mut k = k;
        for epoch in 0.. {
            let mut batches = self.epoch(epoch);
            if k < batches.len() {
                return batches.swap_remove(k);
            }
            k -= batches.len();
        }
        unreachable!("every epoch holds at least one batch")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_batches_cut_each_epoch_in_order() {
        let plan = BatchPlan::new(vec![1; 5], BatchBy::Count(2), 7);
        let epoch = plan.epoch(0);
        assert_eq!(epoch.iter().map(Vec::len).collect::<Vec<_>>(), [2, 2, 1]);
        assert_eq!(plan.per_epoch(), 3);
        assert_eq!(plan.micro_batch(1), epoch[1]);
        assert_eq!(plan.micro_batch(3), plan.epoch(1)[0]);
        let mut seen: Vec<usize> = epoch.concat();
        seen.sort();
        assert_eq!(seen, [0, 1, 2, 3, 4]);
    }

    #[test]
    fn token_batches_come_nearest_the_target() {
        // Targets of 10 tokens from examples of 4 and 7: 4+4 (8) is nearer 10 than 4+4+4
        // (12)? |8-10| = 2 = |12-10|: ties add. 7 then 4 (11) is nearer than 7 alone (3 off).
        let tokens = vec![4, 4, 4, 7, 7, 4, 4, 4];
        let plan = BatchPlan::new(tokens.clone(), BatchBy::Tokens(10), 3);
        for epoch in 0..5 {
            let batches = plan.epoch(epoch);
            let mut seen = batches.concat();
            seen.sort();
            assert_eq!(
                seen,
                (0..8).collect::<Vec<_>>(),
                "each example once an epoch"
            );
            for (j, b) in batches.iter().enumerate() {
                let sum: usize = b.iter().map(|&i| tokens[i]).sum();
                assert!(!b.is_empty());
                let last = j + 1 == batches.len();
                if !last {
                    let next = batches[j + 1][0];
                    // Adding the next example would have moved the sum away from the target.
                    assert!(2 * sum + tokens[next] > 20, "{b:?} then {next}");
                }
                // No example was added that moved the sum away from the target.
                let before = sum - tokens[*b.last().unwrap()];
                assert!(b.len() == 1 || 2 * before + tokens[*b.last().unwrap()] <= 20);
            }
        }
    }

    #[test]
    fn token_batches_continue_across_epochs() {
        let tokens = vec![3, 9, 5, 2, 8, 6, 1];
        let plan = BatchPlan::new(tokens, BatchBy::Tokens(8), 11);
        let all: Vec<Vec<usize>> = (0..3).flat_map(|e| plan.epoch(e)).collect();
        for (k, batch) in all.iter().enumerate() {
            assert_eq!(&plan.micro_batch(k), batch, "micro-batch {k}");
        }
    }

    #[test]
    fn one_long_example_is_a_batch_of_its_own() {
        let plan = BatchPlan::new(vec![50, 50, 50], BatchBy::Tokens(10), 0);
        assert_eq!(plan.epoch(0).len(), 3);
    }
}
