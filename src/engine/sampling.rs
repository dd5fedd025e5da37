//! Next-token choice: greedy at temperature 0, else temperature + nucleus (top-p) sampling
//! with one seeded generator per sample, so sample `i` is reproducible on its own.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub struct Sampler {
    temperature: f32,
    top_p: f32,
    rng: StdRng,
}

impl Sampler {
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Self {
        Self {
            temperature,
            top_p,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// Picks a token id; tokens in `banned` are never chosen.
    pub fn sample(&mut self, logits: &[f32], banned: &[u32]) -> u32 {
        let is_banned = |i: usize| banned.contains(&(i as u32));
        if self.temperature <= 0.0 {
            return greedy(logits, &is_banned);
        }
        let inv_t = 1.0 / self.temperature;
        let max = logits
            .iter()
            .enumerate()
            .filter(|(i, _)| !is_banned(*i))
            .map(|(_, &l)| l)
            .fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(i, l)| !is_banned(*i) && l.is_finite())
            .map(|(i, &l)| (i as u32, ((l - max) * inv_t).exp()))
            .filter(|(_, p)| *p > 0.0)
            .collect();
        if probs.is_empty() {
            return greedy(logits, &is_banned);
        }
        if self.top_p < 1.0 {
            probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
            let total: f32 = probs.iter().map(|p| p.1).sum();
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (k, p) in probs.iter().enumerate() {
                acc += p.1 / total;
                if acc >= self.top_p {
                    keep = k + 1;
                    break;
                }
            }
            probs.truncate(keep);
        }
        let total: f32 = probs.iter().map(|p| p.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for &(id, p) in &probs {
            if r < p {
                return id;
            }
            r -= p;
        }
        probs[probs.len() - 1].0
    }
}

/// The first index of the largest logit that is not banned (NaN never wins; all −∞: 0).
fn greedy(logits: &[f32], is_banned: &dyn Fn(usize) -> bool) -> u32 {
    // The largest value in a pass that vectorizes (49k logits a row, a row per request each
    // step), then its first position, which stops there; the scan below when the winner is
    // banned.
    let best = largest(logits);
    if best > f32::NEG_INFINITY {
        if let Some(i) = logits.iter().position(|&v| v == best) {
            if !is_banned(i) {
                return i as u32;
            }
        }
    }
    greedy_scan(logits, is_banned)
}

/// The largest value of `logits` ignoring NaN (−∞ when there is none).
#[inline(always)]
fn largest_any(logits: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut max = [f32::NEG_INFINITY; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (m, &v) in max.iter_mut().zip(chunk) {
            *m = if v > *m { v } else { *m };
        }
    }
    chunks
        .remainder()
        .iter()
        .chain(&max)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

crate::engine::simd::dispatch!(largest, largest_any, (logits: &[f32]) -> f32);

fn greedy_scan(logits: &[f32], is_banned: &dyn Fn(usize) -> bool) -> u32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l > best.1 && !is_banned(i) {
            best = (i, l);
        }
    }
    best.0 as u32
}

/// Softmax of the entries of `logits` at `ids`, over the whole vocabulary then renormalised
/// over `ids` (the probabilities a judge gives to each allowed score token).
pub fn restricted_probs(logits: &[f32], ids: &[u32]) -> Vec<f64> {
    let max = ids
        .iter()
        .map(|&i| logits[i as usize])
        .fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f64> = ids
        .iter()
        .map(|&i| f64::from(logits[i as usize] - max).exp())
        .collect();
    let total: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / total).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn largest_gives_the_same_bits_on_every_isa() {
        use crate::engine::simd::{assert_same_bits_on_every_isa, test_values};
        for n in [1usize, 15, 64, 49_153] {
            let logits = test_values(n, 15);
            assert_same_bits_on_every_isa("largest", |isa| vec![largest::on(isa, &logits)]);
        }
    }

    #[test]
    fn vectorized_greedy_picks_what_the_scan_picks() {
        let mut rng = StdRng::seed_from_u64(3);
        for n in [1usize, 15, 16, 17, 100, 49152] {
            for case in 0..40 {
                let mut logits: Vec<f32> = (0..n).map(|_| rng.random_range(-4.0..4.0)).collect();
                // Ties, NaNs, infinities and a banned winner.
                if case % 4 == 1 && n > 3 {
                    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let j = rng.random_range(0..n);
                    logits[j] = m;
                }
                if case % 5 == 2 {
                    logits[rng.random_range(0..n)] = f32::NAN;
                }
                if case % 7 == 3 {
                    logits.iter_mut().for_each(|l| *l = f32::NEG_INFINITY);
                }
                if case % 9 == 4 {
                    logits[rng.random_range(0..n)] = f32::INFINITY;
                }
                let banned = [greedy_scan(&logits, &|_| false)];
                for ban in [&[][..], &banned[..]] {
                    let is_banned = |i: usize| ban.contains(&(i as u32));
                    assert_eq!(
                        greedy(&logits, &is_banned),
                        greedy_scan(&logits, &is_banned),
                        "n {n} case {case} banned {ban:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn greedy_at_zero_temperature_and_bans_respected() {
        let logits = [0.1, 3.0, 2.0, -1.0];
        let mut s = Sampler::new(0.0, 1.0, 0);
        assert_eq!(s.sample(&logits, &[]), 1);
        assert_eq!(s.sample(&logits, &[1]), 2);
    }

    #[test]
    fn same_seed_same_samples_and_top_p_truncates() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32) * 0.1).collect();
        let draw = |seed| {
            let mut s = Sampler::new(1.0, 1.0, seed);
            (0..20).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        // A dominant token and top_p below its mass: only it can be drawn.
        let peaked = [10.0, 0.0, 0.0, 0.0];
        let mut s = Sampler::new(1.0, 0.5, 1);
        assert!((0..100).all(|_| s.sample(&peaked, &[]) == 0));
    }

    #[test]
    fn restricted_probs_sum_to_one() {
        let p = restricted_probs(&[0.0, 1.0, 2.0, 5.0], &[1, 2]);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(p[1] > p[0]);
    }
}
