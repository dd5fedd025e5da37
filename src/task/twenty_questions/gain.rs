//! Information gain under the table: binary entropy, a question's expected and realised gain,
//! the objects consistent with answers, and the optimal expected number of questions.

use super::{Query, World};

/// Binary entropy in bits.
pub fn binary_entropy(p: f64) -> f64 {
    if p <= 0.0 || p >= 1.0 {
        0.0
    } else {
        -(p * p.log2() + (1.0 - p) * (1.0 - p).log2())
    }
}

/// Expected gain of a question: binary entropy of the yes-fraction among the consistent objects.
pub fn expected_gain(world: &World, query: &Query, consistent: &[usize]) -> f64 {
    if consistent.is_empty() {
        return 0.0;
    }
    binary_entropy(world.yes_count(query, consistent) as f64 / consistent.len() as f64)
}

/// Realised gain: log2(|before| / |after|) (0 when `after` is 0).
pub fn realised_gain(before: usize, after: usize) -> f64 {
    if before == 0 || after == 0 {
        0.0
    } else {
        (before as f64 / after as f64).log2()
    }
}

/// Objects consistent with all (query, answer) pairs.
pub fn consistent_objects(world: &World, answered: &[(Query, bool)]) -> Vec<usize> {
    (0..world.objects.len())
        .filter(|&o| answered.iter().all(|(q, a)| world.eval(q, o) == *a))
        .collect()
}

/// Minimum possible expected number of questions to name one of `n` equally likely objects
/// when any yes/no split may be asked and the game ends on the correct guess (the anchor
/// 7.785 for n = 158).
pub fn optimal_expected_questions(n: usize) -> f64 {
    let mut f = vec![0.0f64; n + 1];
    if n >= 1 {
        f[1] = 1.0;
    }
    for m in 2..=n {
        let mut best = 1.0 + (m - 1) as f64 / m as f64 * f[m - 1];
        for k in 1..m {
            let c = 1.0 + (k as f64 * f[k] + (m - k) as f64 * f[m - k]) / m as f64;
            if c < best {
                best = c;
            }
        }
        f[m] = best;
    }
    f[n]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::twenty_questions::chat::default_world;

    #[test]
    fn entropy_and_realised_gain_have_their_anchors() {
        assert_eq!(binary_entropy(0.5), 1.0);
        assert_eq!(binary_entropy(0.0), 0.0);
        assert_eq!(binary_entropy(1.0), 0.0);
        assert!((binary_entropy(0.25) - 0.811_278).abs() < 1e-6);
        assert_eq!(realised_gain(8, 2), 2.0);
        assert_eq!(realised_gain(8, 0), 0.0);
        assert_eq!(optimal_expected_questions(1), 1.0);
        assert_eq!(optimal_expected_questions(2), 1.5);
        assert!((optimal_expected_questions(158) - 7.785).abs() < 1e-3);
    }

    #[test]
    fn expected_gain_and_consistency_follow_the_table() {
        let w = default_world().expect("bundled world");
        let ix = |n: &str| w.find(n).expect(n).index;
        let four = [ix("Cat"), ix("Dog"), ix("Basketball"), ix("Football")];
        let animal = Query::Attribute {
            index: w.table.attribute_index("is_animal").unwrap(),
            negated: false,
        };
        // Two of four are animals: one bit; a guess of one of four: H(1/4).
        assert_eq!(expected_gain(w, &animal, &four), 1.0);
        let guess = Query::Guess(vec![ix("Cat")]);
        assert_eq!(expected_gain(w, &guess, &four), binary_entropy(0.25));
        assert_eq!(expected_gain(w, &animal, &[]), 0.0);
        let animals = consistent_objects(w, &[(animal.clone(), true)]);
        assert!(animals.contains(&ix("Cat")) && !animals.contains(&ix("Basketball")));
        assert_eq!(
            consistent_objects(w, &[(animal, true), (guess, true)]),
            [ix("Cat")]
        );
    }
}
