//! Token-level sentence BLEU-4, bit-for-bit the definition of sacrebleu's
//! `sentence_bleu(hypothesis, [reference])` with its defaults (tokenizer `13a`, smoothing `exp`,
//! case-sensitive, effective order on), but on the [0, 1] scale instead of sacrebleu's [0, 100].
//!
//! BLEU counts **word** n-grams: both sides are tokenized with [`tokenize_13a`] first. Handing raw
//! strings to a function that expects token lists silently computes character-level BLEU, a
//! mistake of an earlier implementation. That number is still what upstream
//! CollabLLM reports (its BLEU metric hands raw strings to NLTK's `sentence_bleu`), so
//! [`char_bleu`] computes it under its own name (`bleu_char`), never as `bleu`, for comparison
//! with the paper.

use std::collections::HashMap;
use std::sync::LazyLock;

use regex::Regex;

/// Highest n-gram order (BLEU-4).
pub const MAX_NGRAM_ORDER: usize = 4;

/// The four substitutions of sacrebleu's `TokenizerRegexp`, applied in order to the whole line.
static RULES_13A: LazyLock<[(Regex, &'static str); 4]> = LazyLock::new(|| {
    let re = |pattern: &str| Regex::new(pattern).expect("static 13a pattern compiles");
    [
        // Language-dependent part (assuming Western languages): pad ASCII punctuation except
        // apostrophe, comma, hyphen and period. (sacrebleu: `[\{-\~\[-\` -\&\(-\+\:-\@\/]`.)
        (
            re(r"([\x7B-\x7E\x5B-\x60\x20-\x26\x28-\x2B\x3A-\x40/])"),
            " ${1} ",
        ),
        // Tokenize period and comma unless preceded by a digit.
        (re(r"([^0-9])([.,])"), "${1} ${2} "),
        // Tokenize period and comma unless followed by a digit.
        (re(r"([.,])([^0-9])"), " ${1} ${2}"),
        // Tokenize dash when preceded by a digit.
        (re(r"([0-9])(-)"), "${1} ${2} "),
    ]
});

/// Python's `str.isspace()`: Unicode White_Space plus the ASCII separators U+001C..U+001F, which
/// Python's `str.split()` / `str.rstrip()` also treat as whitespace.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The tokens sacrebleu's `13a` tokenizer (mteval-v13a, the WMT standard) produces for one
/// segment, after sacrebleu's segment preprocessing (`rstrip`).
///
/// Removes `<skipped>` and line-end hyphenation (`"-\n"`), turns newlines into spaces, unescapes
/// `&quot; &amp; &lt; &gt;`, separates punctuation (keeping `,`/`.` inside numbers, apostrophes
/// inside words, and hyphens unless they follow a digit), then splits on whitespace.
pub fn tokenize_13a(s: &str) -> Vec<String> {
    let mut line = s.trim_end_matches(is_py_space).replace("<skipped>", "");
    line = line.replace("-\n", "").replace('\n', " ");
    if line.contains('&') {
        line = line
            .replace("&quot;", "\"")
            .replace("&amp;", "&")
            .replace("&lt;", "<")
            .replace("&gt;", ">");
    }
    let mut line = format!(" {line} ");
    for (re, replacement) in RULES_13A.iter() {
        line = re.replace_all(&line, *replacement).into_owned();
    }
    line.split(is_py_space)
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Counts of every n-gram of order 1..=`MAX_NGRAM_ORDER`.
fn ngram_counts(tokens: &[String]) -> HashMap<&[String], usize> {
    let mut counts = HashMap::new();
    for n in 1..=MAX_NGRAM_ORDER {
        for gram in tokens.windows(n) {
            *counts.entry(gram).or_insert(0) += 1;
        }
    }
    counts
}

/// Sufficient statistics of sentence BLEU, as sacrebleu computes them.
#[derive(Clone, Debug, PartialEq)]
pub struct BleuStats {
    /// Clipped matching n-grams per order (index 0 = unigrams).
    pub correct: [usize; MAX_NGRAM_ORDER],
    /// Hypothesis n-grams per order.
    pub total: [usize; MAX_NGRAM_ORDER],
    /// Hypothesis length in tokens.
    pub hyp_len: usize,
    /// Reference length in tokens.
    pub ref_len: usize,
}

impl BleuStats {
    /// Statistics of already tokenized hypothesis and reference.
    pub fn from_tokens(hypothesis: &[String], reference: &[String]) -> Self {
        let hyp = ngram_counts(hypothesis);
        let refs = ngram_counts(reference);
        let mut correct = [0; MAX_NGRAM_ORDER];
        let mut total = [0; MAX_NGRAM_ORDER];
        for (gram, &count) in &hyp {
            let n = gram.len() - 1;
            total[n] += count;
            if let Some(&r) = refs.get(gram) {
                correct[n] += count.min(r);
            }
        }
        Self {
            correct,
            total,
            hyp_len: hypothesis.len(),
            ref_len: reference.len(),
        }
    }

    /// BLEU in [0, 1] with `exp` smoothing (mteval's NIST method) and effective order, following
    /// sacrebleu's `BLEU.compute_bleu` step by step (precisions on its 0–100 scale, divided by
    /// 100 at the end) so that results agree to the last few ulps.
    pub fn score(&self) -> f64 {
        if self.correct.iter().all(|&c| c == 0) {
            return 0.0;
        }
        let bp = if self.hyp_len < self.ref_len {
            if self.hyp_len > 0 {
                (1.0 - self.ref_len as f64 / self.hyp_len as f64).exp()
            } else {
                0.0
            }
        } else {
            1.0
        };
        let mut precisions = [0.0f64; MAX_NGRAM_ORDER];
        let mut smooth_mteval = 1.0f64;
        let mut eff_order = MAX_NGRAM_ORDER;
        for (n, precision) in precisions.iter_mut().enumerate() {
            let (correct, total) = (self.correct[n], self.total[n]);
            if total == 0 {
                break;
            }
            eff_order = n + 1;
            if correct == 0 {
                smooth_mteval *= 2.0;
                *precision = 100.0 / (smooth_mteval * total as f64);
            } else {
                *precision = 100.0 * correct as f64 / total as f64;
            }
        }
        let log_sum: f64 = precisions[..eff_order]
            .iter()
            .map(|&p| if p == 0.0 { -9_999_999_999.0 } else { p.ln() })
            .sum();
        bp * (log_sum / eff_order as f64).exp() / 100.0
    }
}

/// Sentence BLEU-4 of `hypothesis` against one `reference`, in [0, 1]: sacrebleu's
/// `sentence_bleu(hypothesis, [reference]).score / 100` with default settings.
///
/// Both texts are tokenized with [`tokenize_13a`]; multi-line documents are one segment
/// (newlines become spaces), as in sacrebleu. An empty hypothesis, or one that shares no token
/// with the reference, scores 0.
pub fn sentence_bleu(hypothesis: &str, reference: &str) -> f64 {
    let hyp = tokenize_13a(hypothesis);
    let reference = tokenize_13a(reference);
    BleuStats::from_tokens(&hyp, &reference).score()
}

/// Character-level BLEU-4 of `hypothesis` against one `reference`, in [0, 1]: what upstream
/// CollabLLM's `nltk.translate.bleu_score.sentence_bleu([reference], hypothesis)` computes when
/// both are plain strings (NLTK then iterates them as sequences of characters). NLTK's
/// defaults: uniform weights over orders 1–4, no smoothing (an order without a match
/// contributes `ln(f64::MIN_POSITIVE)`, so the score is practically 0), brevity penalty
/// `exp(1 − r/c)` when the hypothesis is not longer than the reference; 0 when no character
/// matches.
pub fn char_bleu(hypothesis: &str, reference: &str) -> f64 {
    let hyp: Vec<char> = hypothesis.chars().collect();
    let reference: Vec<char> = reference.chars().collect();
    fn counts(seq: &[char], n: usize) -> HashMap<&[char], usize> {
        let mut m = HashMap::new();
        for gram in seq.windows(n) {
            *m.entry(gram).or_insert(0) += 1;
        }
        m
    }
    let mut log_sum = Vec::with_capacity(MAX_NGRAM_ORDER);
    for n in 1..=MAX_NGRAM_ORDER {
        let hyp_counts = counts(&hyp, n);
        let ref_counts = counts(&reference, n);
        let matched: usize = hyp_counts
            .iter()
            .map(|(g, &c)| c.min(ref_counts.get(g).copied().unwrap_or(0)))
            .sum();
        let total = hyp_counts.values().sum::<usize>().max(1);
        if n == 1 && matched == 0 {
            return 0.0;
        }
        let p = if matched == 0 {
            f64::MIN_POSITIVE
        } else {
            matched as f64 / total as f64
        };
        log_sum.push(p.ln() / MAX_NGRAM_ORDER as f64);
    }
    let (c, r) = (hyp.len(), reference.len());
    let bp = if c > r {
        1.0
    } else if c == 0 {
        0.0
    } else {
        (1.0 - r as f64 / c as f64).exp()
    };
    bp * log_sum.iter().sum::<f64>().exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-computed character BLEU (NLTK's `sentence_bleu([r], h)` on raw strings).
    #[test]
    fn char_bleu_matches_hand_computed_values() {
        // Orders 1–4 match 4/5, 3/4, 2/3, 1/2: (0.8 · 0.75 · 2/3 · 0.5)^(1/4) = 0.2^(1/4).
        let expected = 0.2f64.powf(0.25);
        assert!((char_bleu("abcde", "abcdf") - expected).abs() < 1e-12);
        // Clipping: five `a` against four match 4/5, 3/4, 2/3, 1/2 as well; longer: no penalty.
        assert!((char_bleu("aaaaa", "aaaa") - expected).abs() < 1e-12);
        // All orders match, the hypothesis is one character short: exp(1 − 5/4).
        assert!((char_bleu("abcd", "abcdx") - (-0.25f64).exp()).abs() < 1e-12);
        // No common character: 0; an order without a match: practically 0 (no smoothing).
        assert_eq!(char_bleu("xyz", "abc"), 0.0);
        assert!(char_bleu("abcd", "abce") < 1e-70);
        assert_eq!(char_bleu("", "abc"), 0.0);
        assert!((char_bleu("same text", "same text") - 1.0).abs() < 1e-12);
        // Characters, not tokens: the word-shuffled pair that token BLEU scores 0.
        assert!(char_bleu("tac god", "cat dog") > 0.0);
        assert_eq!(sentence_bleu("tac god", "cat dog"), 0.0);
        // NLTK 3.10.4's `sentence_bleu([r], h)` on these raw strings (code points, newlines kept).
        let h = "Dear team,\nThe meeting is moved to Friday at 3pm. Caf\u{e9} na\u{ef}ve.";
        let r = "Dear team,\n\nThe meeting has been moved to Friday at 3 pm. Caf\u{e9}!";
        assert!((char_bleu(h, r) - 0.7789881866230725).abs() < 1e-12);
        assert!((char_bleu("abcd", "abce") - 8.636168555094496e-78).abs() < 1e-88);
    }

    /// Golden values from sacrebleu 2.6.0: `sacrebleu.sentence_bleu(h, [r]).score / 100`.
    const GOLDEN: &[(&str, &str, &str, f64)] = &[
        (
            "identical",
            "The quick brown fox jumps over the lazy dog.",
            "The quick brown fox jumps over the lazy dog.",
            1.0000000000000004,
        ),
        ("empty_hyp", "", "The quick brown fox jumps over the lazy dog.", 0.0),
        (
            "punctuation",
            "Hello, world! How are you? I'm fine -- thanks (really).",
            "Hello world, how are you? I am fine - thanks (really)!",
            0.2533654946448646,
        ),
        (
            "numbers",
            "The price rose 1,234.5 dollars in 2023-2024, i.e. 12.5% more.",
            "The price rose by 1,234.50 dollars in 2023 - 2024, or 12.5 % more.",
            0.4718372009351201,
        ),
        ("brevity", "the cat sat", "the cat sat on the mat today", 0.2635971381157268),
        ("no_4gram", "cat the mat on sat", "the cat sat on the mat", 0.21994586237921104),
        (
            "multiline",
            "Dear team,\nThe meeting is moved to Friday at 3pm.\nPlease bring the quar-\nterly report.\n\nBest,\nAnna\n",
            "Dear team,\n\nThe meeting has been moved to Friday at 3 pm.\nPlease bring the quarterly report and your laptop.\n\nBest regards,\nAnna",
            0.42258673683841264,
        ),
        (
            "unicode",
            "Caf\u{e9} na\u{ef}ve \u{2014} r\u{e9}sum\u{e9} \u{201c}quoted\u{201d} \u{6771}\u{4eac} is gro\u{df}e \u{fc}ber stra\u{df}e.",
            "Caf\u{e9} na\u{ef}ve \u{2013} r\u{e9}sum\u{e9} \"quoted\" \u{6771}\u{4eac} is gro\u{df}e \u{fc}ber Stra\u{df}e!",
            0.24177037175577332,
        ),
        (
            "html_entities",
            "a &amp; b &lt;c&gt; &quot;d&quot; <skipped> e",
            "a & b <c> \"d\" e",
            1.0000000000000004,
        ),
        (
            "whitespace",
            "  tabs\there\u{1c}and\u{a0}nbsp  \r\n",
            "tabs here and nbsp",
            1.0000000000000004,
        ),
        (
            "longer_hyp",
            "the cat sat on the mat and then the cat sat on the mat again",
            "the cat sat on the mat",
            0.3237722713145643,
        ),
        ("empty_both", "", "", 0.0),
        ("empty_ref", "something here", "", 0.0),
    ];

    #[test]
    fn matches_sacrebleu_golden_values() {
        for &(name, hyp, reference, expected) in GOLDEN {
            let got = sentence_bleu(hyp, reference);
            assert!(
                (got - expected).abs() < 1e-6,
                "{name}: got {got}, sacrebleu {expected}"
            );
            assert!(
                (0.0..=1.0 + 1e-12).contains(&got),
                "{name}: {got} out of range"
            );
        }
    }

    /// Golden token lists from sacrebleu 2.6.0's `Tokenizer13a` (after `rstrip`).
    #[test]
    fn tokenizer_matches_sacrebleu() {
        let cases: &[(&str, &[&str])] = &[
            ("Hello, world!", &["Hello", ",", "world", "!"]),
            (
                "It's 3.14, not 3,14.",
                &["It's", "3.14", ",", "not", "3,14", "."],
            ),
            (
                "x-y 1-2 a.b 1.b a.1 ...",
                &[
                    "x-y", "1", "-", "2", "a", ".", "b", "1", ".", "b", "a", ".", "1", ".", ".",
                    ".",
                ],
            ),
            ("  ab\u{a0}cd\u{1c} ef  ", &["ab", "cd", "ef"]),
            ("quar-\nterly", &["quarterly"]),
            (
                "{[(a)]}|~`^_\\",
                &[
                    "{", "[", "(", "a", ")", "]", "}", "|", "~", "`", "^", "_", "\\",
                ],
            ),
            (
                "e.g., U.S.A.",
                &["e", ".", "g", ".", ",", "U", ".", "S", ".", "A", "."],
            ),
            ("1,000,000.00$", &["1,000,000.00", "$"]),
            (
                "&amp;&lt;&gt;&quot;&apos;",
                &["&", "<", ">", "\"", "&", "apos", ";"],
            ),
            (
                "na\u{ef}ve caf\u{e9} \u{6771}\u{4eac}\u{3002}",
                &["na\u{ef}ve", "caf\u{e9}", "\u{6771}\u{4eac}\u{3002}"],
            ),
            ("a.,b", &["a", ".", ",", "b"]),
        ];
        for &(input, expected) in cases {
            assert_eq!(tokenize_13a(input), expected, "input {input:?}");
        }
    }

    /// BLEU must count word n-grams. These two strings use exactly the same
    /// characters (so every character n-gram of order 1 matches) but share no word.
    #[test]
    fn bleu_is_token_level_not_character_level() {
        let hyp = "tac god";
        let reference = "cat dog";
        assert_eq!(sentence_bleu(hyp, reference), 0.0);
        // The same text with the words in place scores 1, and one wrong word of four lowers it.
        assert!((sentence_bleu("cat dog", "cat dog") - 1.0).abs() < 1e-9);
        let partial = sentence_bleu("the big cat dog", "the big cat sat");
        assert!(partial > 0.0 && partial < 1.0);
        // Stats are counted over tokens: 4 hypothesis tokens → 4 unigrams, not 15 characters.
        let stats = BleuStats::from_tokens(
            &tokenize_13a("the big cat dog"),
            &tokenize_13a("the big cat sat"),
        );
        assert_eq!(stats.total, [4, 3, 2, 1]);
        assert_eq!(stats.correct, [3, 2, 1, 0]);
    }

    #[test]
    fn word_order_matters_and_score_is_bounded() {
        let a = sentence_bleu("the cat sat on the mat", "the cat sat on the mat");
        let b = sentence_bleu("mat the on sat cat the", "the cat sat on the mat");
        assert!(a > 0.999 && b < a);
    }
}
