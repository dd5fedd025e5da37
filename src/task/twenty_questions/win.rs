//! Names and the win rule: tokenizing, finding object mentions in a question, and LMRL-Gym's
//! `is_done` rule ([`is_win`]) with nouns told by a word list.

use std::collections::HashSet;

use super::Object;

/// Lower-cases and splits into words (letters/digits/apostrophes); everything else separates.
pub fn tokenize(text: &str) -> Vec<String> {
    text.to_lowercase()
        .split(|c: char| !(c.is_alphanumeric() || c == '\''))
        .map(|w| w.trim_matches('\''))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

fn word_matches(word: &str, name_word: &str, last: bool) -> bool {
    word == name_word
        || (last
            && (word.strip_suffix('s') == Some(name_word)
                || word.strip_suffix("es") == Some(name_word)))
}

/// A mention of an object in a question: token span `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Mention {
    pub(super) object: usize,
    pub(super) start: usize,
    pub(super) end: usize,
}

/// Every whole-word mention of any variant of any object (a trailing plural "s"/"es" allowed).
pub(super) fn mentions(tokens: &[String], objects: &[Object]) -> Vec<Mention> {
    let mut out = Vec::new();
    for o in objects {
        for v in &o.variants {
            let vt = tokenize(v);
            if vt.is_empty() || vt.len() > tokens.len() {
                continue;
            }
            for start in 0..=tokens.len() - vt.len() {
                let ok = vt
                    .iter()
                    .enumerate()
                    .all(|(k, w)| word_matches(&tokens[start + k], w, k + 1 == vt.len()));
                if ok {
                    let m = Mention {
                        object: o.index,
                        start,
                        end: start + vt.len(),
                    };
                    if !out.contains(&m) {
                        out.push(m);
                    }
                }
            }
        }
    }
    out
}

/// Words the win rule never counts as nouns (`~word`: a noun only right after a determiner or
/// possessive), embedded so that [`is_win`] needs no data directory.
const NON_NOUNS_TEXT: &str = include_str!("../../../data/twenty_questions_non_nouns.txt");

/// (never nouns, nouns only after a determiner) from [`NON_NOUNS_TEXT`].
fn non_nouns() -> &'static (HashSet<&'static str>, HashSet<&'static str>) {
    static SETS: std::sync::OnceLock<(HashSet<&str>, HashSet<&str>)> = std::sync::OnceLock::new();
    SETS.get_or_init(|| {
        let (mut never, mut after_det) = (HashSet::new(), HashSet::new());
        for line in NON_NOUNS_TEXT.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match line.strip_prefix('~') {
                Some(w) => after_det.insert(w),
                None => never.insert(line),
            };
        }
        (never, after_det)
    })
}

/// Determiners and possessives after which a `~word` is a noun ("my guess", "the answer").
const DETERMINERS: &[&str] = &[
    "a", "an", "the", "my", "your", "his", "her", "its", "our", "their", "this", "that", "final",
];

/// Nouns with a suffix that would otherwise make them an adverb (-ly), gerund (-ing) or
/// participle (-ed).
const SUFFIX_NOUNS: &[&str] = &[
    "family",
    "belly",
    "jelly",
    "lily",
    "ally",
    "bully",
    "supply",
    "assembly",
    "butterfly",
    "dragonfly",
    "firefly",
    "rally",
    "tally",
    "anomaly",
    "monopoly",
    "thing",
    "something",
    "anything",
    "everything",
    "nothing",
    "string",
    "spring",
    "swing",
    "sling",
    "building",
    "clothing",
    "painting",
    "ceiling",
    "evening",
    "morning",
    "pudding",
    "stuffing",
    "frosting",
    "icing",
    "filling",
    "wedding",
    "meeting",
    "feeling",
    "drawing",
    "housing",
    "bedding",
    "lighting",
    "railing",
    "earring",
    "offspring",
    "seaweed",
    "hundred",
];

/// Splits a question into lower-case words as NLTK's `word_tokenize` would for the win rule:
/// punctuation separates words but hyphens and apostrophes inside a word stay ("t-shirt" is
/// one word), and clitics are words of their own ("it's" → `it`, `'s`; "don't" → `do`, `n't`).
pub fn win_tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for piece in text
        .to_lowercase()
        .split(|c: char| !(c.is_alphanumeric() || c == '-' || c == '\''))
    {
        let w = piece.trim_matches(|c: char| c == '-' || c == '\'');
        if w.is_empty() {
            continue;
        }
        let clitic = ["n't", "'s", "'re", "'ve", "'ll", "'d", "'m"]
            .iter()
            .find(|c| w.len() > c.len() && w.ends_with(**c));
        match clitic {
            Some(c) => {
                out.push(w[..w.len() - c.len()].to_string());
                out.push(c.to_string());
            }
            None => out.push(w.to_string()),
        }
    }
    out
}

/// Whether `tokens[i]` counts as a noun for the win rule: the words of any object's names are
/// nouns (unless listed as non-nouns: "stuffed", "cooking"); listed words are not; adverbs in
/// -ly, gerunds in -ing and participles in -ed (with a list of nouns so spelled) are not;
/// numbers are not; every other word is.
fn is_noun(tokens: &[String], i: usize, object_words: &HashSet<String>) -> bool {
    let w = tokens[i].as_str();
    let (never, after_det) = non_nouns();
    if never.contains(w) {
        return false;
    }
    if after_det.contains(w) {
        return i > 0 && DETERMINERS.contains(&tokens[i - 1].as_str());
    }
    if object_words.contains(w) || SUFFIX_NOUNS.contains(&w) {
        return true;
    }
    if w.chars().all(|c| c.is_ascii_digit()) {
        return false;
    }
    let n = w.chars().count();
    let suffixed = (n >= 5 && w.ends_with("ly"))
        || (n >= 6 && w.ends_with("ing"))
        || (n >= 5 && w.ends_with("ed") && !w.ends_with("eed"));
    !suffixed
}

/// Nouns LMRL-Gym's rule ignores besides the target's own words.
const FILLER_NOUNS: &[&str] = &["object", "something", "type", "kind"];

/// The LMRL-Gym win rule (`is_done` in its `twenty_questions/env/data.py`), less the oracle's
/// "yes" that [`play`](super::play) adds. Trailing non-letters are cut; then no word may be a noun other than
/// the words of the target's names, the fillers "object", "something", "type", "kind", and a
/// noun followed by "of" ("pair of", "bottle of"); and the question must end with one of the
/// target's names, word for word (so "cats" does not name Cat, and "a ball" does not name
/// Soccer ball). "Does it have wheels, like a car?" is no win for Car ("wheels" is a noun),
/// "Is it a dog or a cat?" none for Cat. LMRL-Gym tags nouns with NLTK; we use a word list
/// (`data/twenty_questions_non_nouns.txt`, see [`is_noun`]) in which unknown words are nouns,
/// so where the two differ we deny a win LMRL-Gym would grant, never the reverse for the
/// listed words. `all` supplies the other objects' name words, which are always nouns.
pub fn is_win(question: &str, object: &Object, all: &[Object]) -> bool {
    let trimmed = question.trim_end_matches(|c: char| !c.is_alphabetic());
    let tokens = win_tokens(trimmed);
    if tokens.is_empty() {
        return false;
    }
    let names: Vec<Vec<String>> = object.variants.iter().map(|v| win_tokens(v)).collect();
    let own: HashSet<&str> = names.iter().flatten().map(String::as_str).collect();
    let object_words: HashSet<String> = all
        .iter()
        .flat_map(|o| o.variants.iter().flat_map(|v| win_tokens(v)))
        .collect();
    let extra_noun = (0..tokens.len()).any(|i| {
        let w = tokens[i].as_str();
        !own.contains(w)
            && !FILLER_NOUNS.contains(&w)
            && tokens.get(i + 1).map(String::as_str) != Some("of")
            && is_noun(&tokens, i, &object_words)
    });
    !extra_noun && names.iter().any(|n| !n.is_empty() && tokens.ends_with(n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::twenty_questions::chat::default_world;

    fn objects() -> &'static [Object] {
        &default_world().expect("bundled world").objects
    }

    fn object(name: &str) -> &'static Object {
        objects().iter().find(|o| o.name == name).expect(name)
    }

    #[test]
    fn an_exact_guess_wins_and_a_near_miss_does_not() {
        let (cat, car) = (object("Cat"), object("Car"));
        assert!(is_win("Is it a cat?", cat, objects()));
        assert!(is_win("Is the object a cat?!", cat, objects()));
        // Another noun, two objects, a plural, or the name not at the end: no win.
        assert!(!is_win("Is it a dog or a cat?", cat, objects()));
        assert!(!is_win("Does it have wheels, like a car?", car, objects()));
        assert!(!is_win("Is it cats?", cat, objects()));
        assert!(!is_win("Is it a cat toy?", cat, objects()));
        assert!(!is_win("", cat, objects()));
    }

    #[test]
    fn words_split_as_the_win_rule_and_the_names_need() {
        assert_eq!(
            win_tokens("It's a T-shirt, isn't it?"),
            ["it", "'s", "a", "t-shirt", "is", "n't", "it"]
        );
        assert_eq!(
            tokenize("Is it a T-Shirt?"),
            ["is", "it", "a", "t", "shirt"]
        );
    }

    #[test]
    fn mentions_find_whole_names_with_a_plural_on_the_last_word() {
        let cat = object("Cat").index;
        let ms = mentions(&tokenize("are they cats"), objects());
        assert!(ms.contains(&Mention {
            object: cat,
            start: 2,
            end: 3
        }));
        assert!(mentions(&tokenize("a catalogue"), objects())
            .iter()
            .all(|m| m.object != cat));
    }
}
