//! 20 Questions (LMRL-Gym rules), the deterministic part.
//!
//! - [`World`]: the 158 objects (task order), the yes/no attribute table and the
//!   question→attribute lexicon, loaded from `data/twenty_questions_*.tsv`.
//! - [`is_win`]: the LMRL win rule, nouns told by a word list instead of NLTK's tagger.
//! - [`Oracle`] / [`TableOracle`]: answers "Yes."/"No." from the table.
//! - [`play`]: one game (≤ 20 questions) with exact information gain under the table;
//!   [`GameMetrics`] / [`AggregateMetrics`] for the numbers; [`lmrl_transcript`] for LMRL's
//!   offline schema.
//! - [`ReferenceQuestioner`] (greedy max expected information gain) and
//!   [`RandomGuessQuestioner`] (random distinct guesses) as sanity anchors;
//!   [`DemonstratorQuestioner`] (noisy halving) whose games are SFT data.
//! - [`parse`]: the grammar that reads a question as a query the table answers.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

pub mod chat;
pub mod future;
pub mod parse;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use regex::Regex;
use serde::{Deserialize, Serialize};

/// The bundled data directory.
pub const DEFAULT_DATA_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data");
/// File names inside the data directory.
pub const OBJECTS_FILE: &str = "twenty_questions_objects.tsv";
pub const ATTRIBUTES_FILE: &str = "twenty_questions_attributes.tsv";
pub const LEXICON_FILE: &str = "twenty_questions_lexicon.tsv";
/// Number of objects in the LMRL task.
pub const NUM_OBJECTS: usize = 158;
/// Question budget per game.
pub const MAX_QUESTIONS: usize = 20;

/// A data-loading error naming the file and (1-based) line.
#[derive(Debug, thiserror::Error)]
pub enum WorldDataError {
    #[error("{}: {source}", file.display())]
    Io {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{}:{line}: {msg}", file.display())]
    Parse {
        file: PathBuf,
        line: usize,
        msg: String,
    },
}

/// One object of the game.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Object {
    /// Position in the task's order (deterministic mode plays `seed % 158`).
    pub index: usize,
    pub category: String,
    /// Canonical name (= `variants[0]`).
    pub name: String,
    /// Accepted names, canonical first.
    pub variants: Vec<String>,
}

fn read_lines(file: &Path) -> Result<Vec<(usize, String)>, WorldDataError> {
    let text = std::fs::read_to_string(file).map_err(|source| WorldDataError::Io {
        file: file.to_path_buf(),
        source,
    })?;
    Ok(text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim_end_matches('\r').to_string()))
        .filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'))
        .collect())
}

fn parse_err(file: &Path, line: usize, msg: impl Into<String>) -> WorldDataError {
    WorldDataError::Parse {
        file: file.to_path_buf(),
        line,
        msg: msg.into(),
    }
}

/// The data rows of a TSV file whose first line must be exactly `header`, each split into
/// `header.len()` columns: (line number, columns).
fn read_tsv_rows(
    file: &Path,
    header: &[&str],
) -> Result<Vec<(usize, Vec<String>)>, WorldDataError> {
    let mut it = read_lines(file)?.into_iter();
    match it.next() {
        Some((_, h)) if h.split('\t').collect::<Vec<_>>() == header => {}
        Some((n, h)) => return Err(parse_err(file, n, format!("bad header {h:?}"))),
        None => return Err(parse_err(file, 1, "empty file")),
    }
    it.map(|(n, line)| {
        let cols: Vec<String> = line.split('\t').map(str::to_string).collect();
        if cols.len() == header.len() {
            Ok((n, cols))
        } else {
            Err(parse_err(
                file,
                n,
                format!("expected {} columns, got {}", header.len(), cols.len()),
            ))
        }
    })
    .collect()
}

/// Loads `twenty_questions_objects.tsv` (header `category\tname\tvariants`).
pub fn load_objects(dir: impl AsRef<Path>) -> Result<Vec<Object>, WorldDataError> {
    let file = dir.as_ref().join(OBJECTS_FILE);
    let mut objects = Vec::new();
    for (n, cols) in read_tsv_rows(&file, &["category", "name", "variants"])? {
        let variants: Vec<String> = cols[2]
            .split('|')
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect();
        if cols[1].trim().is_empty() || variants.is_empty() {
            return Err(parse_err(&file, n, "empty name or variants"));
        }
        if variants[0] != cols[1].trim() {
            return Err(parse_err(
                &file,
                n,
                "first variant must be the canonical name",
            ));
        }
        if tokenize(&variants[0]).is_empty() {
            return Err(parse_err(&file, n, "name has no words"));
        }
        objects.push(Object {
            index: objects.len(),
            category: cols[0].trim().to_string(),
            name: cols[1].trim().to_string(),
            variants,
        });
    }
    Ok(objects)
}

/// Objects × yes/no attributes (`values[object][attribute]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttributeTable {
    pub attributes: Vec<String>,
    pub values: Vec<Vec<bool>>,
}

impl AttributeTable {
    pub fn attribute_index(&self, name: &str) -> Option<usize> {
        self.attributes.iter().position(|a| a == name)
    }
    pub fn value(&self, object: usize, attribute: usize) -> bool {
        self.values[object][attribute]
    }
}

/// Loads `twenty_questions_attributes.tsv` (header `name\t<attr>...`, one row per object in the
/// objects' order, values `0`/`1`).
pub fn load_table(
    dir: impl AsRef<Path>,
    objects: &[Object],
) -> Result<AttributeTable, WorldDataError> {
    let file = dir.as_ref().join(ATTRIBUTES_FILE);
    let lines = read_lines(&file)?;
    let mut it = lines.into_iter();
    let (hn, header) = it.next().ok_or_else(|| parse_err(&file, 1, "empty file"))?;
    let cols: Vec<&str> = header.split('\t').collect();
    if cols.first() != Some(&"name") || cols.len() < 2 {
        return Err(parse_err(&file, hn, "header must be name\\t<attributes>"));
    }
    let attributes: Vec<String> = cols[1..].iter().map(|s| s.trim().to_string()).collect();
    let mut seen = HashSet::new();
    for a in &attributes {
        if a.is_empty() || a.starts_with('!') || !seen.insert(a.clone()) {
            return Err(parse_err(
                &file,
                hn,
                format!("bad or duplicate attribute {a:?}"),
            ));
        }
    }
    let mut values = Vec::new();
    for (n, line) in it {
        let cols: Vec<&str> = line.split('\t').collect();
        if cols.len() != attributes.len() + 1 {
            return Err(parse_err(
                &file,
                n,
                format!(
                    "expected {} columns, got {}",
                    attributes.len() + 1,
                    cols.len()
                ),
            ));
        }
        let k = values.len();
        match objects.get(k) {
            Some(o) if o.name == cols[0] => {}
            Some(o) => {
                return Err(parse_err(
                    &file,
                    n,
                    format!("row {k} is {:?}, expected object {:?}", cols[0], o.name),
                ))
            }
            None => return Err(parse_err(&file, n, format!("extra row {:?}", cols[0]))),
        }
        let row = cols[1..]
            .iter()
            .zip(&attributes)
            .map(|(v, a)| match *v {
                "1" => Ok(true),
                "0" => Ok(false),
                _ => Err(parse_err(&file, n, format!("{a}: value {v:?} is not 0/1"))),
            })
            .collect::<Result<Vec<bool>, _>>()?;
        values.push(row);
    }
    if values.len() != objects.len() {
        return Err(parse_err(
            &file,
            0,
            format!("{} rows for {} objects", values.len(), objects.len()),
        ));
    }
    Ok(AttributeTable { attributes, values })
}

/// One lexicon row: a case-insensitive pattern that maps a question to an attribute (negated
/// when written `!attr`). The canonical question of an attribute is the first row that has one.
#[derive(Debug, Clone)]
pub struct LexiconEntry {
    pub attribute: usize,
    pub negated: bool,
    pub question: Option<String>,
    pub pattern: Regex,
}

/// Question → attribute lexicon; the first matching row decides.
#[derive(Debug, Clone)]
pub struct Lexicon {
    pub entries: Vec<LexiconEntry>,
}

/// Loads `twenty_questions_lexicon.tsv` (header `attribute\tquestion\tpattern`).
pub fn load_lexicon(
    dir: impl AsRef<Path>,
    table: &AttributeTable,
) -> Result<Lexicon, WorldDataError> {
    let file = dir.as_ref().join(LEXICON_FILE);
    let mut entries = Vec::new();
    for (n, cols) in read_tsv_rows(&file, &["attribute", "question", "pattern"])? {
        let (negated, name) = match cols[0].strip_prefix('!') {
            Some(rest) => (true, rest),
            None => (false, cols[0].as_str()),
        };
        let attribute = table
            .attribute_index(name)
            .ok_or_else(|| parse_err(&file, n, format!("unknown attribute {name:?}")))?;
        let pattern = Regex::new(&format!("(?i){}", cols[2]))
            .map_err(|e| parse_err(&file, n, format!("bad pattern: {e}")))?;
        let question = match cols[1].trim() {
            "" | "-" => None,
            q => Some(q.to_string()),
        };
        if negated && question.is_some() {
            return Err(parse_err(
                &file,
                n,
                "a negated row cannot be canonical (use \"-\")",
            ));
        }
        entries.push(LexiconEntry {
            attribute,
            negated,
            question,
            pattern,
        });
    }
    Ok(Lexicon { entries })
}

impl Lexicon {
    /// The canonical question of an attribute.
    pub fn question_for(&self, attribute: usize) -> Option<&str> {
        self.entries
            .iter()
            .find(|e| e.attribute == attribute && e.question.is_some())
            .and_then(|e| e.question.as_deref())
    }
}

// ---------------------------------------------------------------------------------------------
// Names and the win rule.

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
struct Mention {
    object: usize,
    start: usize,
    end: usize,
}

/// Every whole-word mention of any variant of any object (a trailing plural "s"/"es" allowed).
fn mentions(tokens: &[String], objects: &[Object]) -> Vec<Mention> {
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
const NON_NOUNS_TEXT: &str = include_str!("../../data/twenty_questions_non_nouns.txt");

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
/// "yes" that [`play`] adds. Trailing non-letters are cut; then no word may be a noun other than
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

// ---------------------------------------------------------------------------------------------
// The world: objects + table + lexicon, and question parsing.

/// What a question asks under the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Query {
    /// "Is it <attribute>?" (negated: "Is it smaller than a person?").
    Attribute { index: usize, negated: bool },
    /// "Is it X (or Y)?": true exactly for the named objects.
    Guess(Vec<usize>),
}

/// Objects, attribute table and lexicon.
#[derive(Debug, Clone)]
pub struct World {
    pub objects: Vec<Object>,
    pub table: AttributeTable,
    pub lexicon: Lexicon,
    /// One pattern per accepted object name (for [`World::parse`]).
    name_patterns: Vec<Regex>,
}

impl World {
    /// Loads the three files from `dir` and checks that they agree.
    pub fn load(dir: impl AsRef<Path>) -> Result<World, WorldDataError> {
        let objects = load_objects(&dir)?;
        let table = load_table(&dir, &objects)?;
        let lexicon = load_lexicon(&dir, &table)?;
        let name_patterns = parse::name_patterns(&objects);
        Ok(World {
            objects,
            table,
            lexicon,
            name_patterns,
        })
    }

    /// [`World::load`] of [`DEFAULT_DATA_DIR`].
    pub fn load_default() -> Result<World, WorldDataError> {
        World::load(DEFAULT_DATA_DIR)
    }

    /// The deterministic-mode object for a seed.
    pub fn object_for_seed(&self, seed: u64) -> &Object {
        &self.objects[(seed % self.objects.len() as u64) as usize]
    }

    /// Finds an object by any accepted name (case-insensitive).
    pub fn find(&self, name: &str) -> Option<&Object> {
        let t = tokenize(name);
        self.objects
            .iter()
            .find(|o| o.variants.iter().any(|v| tokenize(v) == t))
    }

    /// The object whose accepted name is exactly `words` (plural tolerated on the last word).
    pub(crate) fn exact_object(&self, words: &[String]) -> Option<usize> {
        let ms = mentions(words, &self.objects);
        ms.iter()
            .find(|m| m.start == 0 && m.end == words.len())
            .map(|m| m.object)
    }

    /// The truth of a query for an object under the table.
    pub fn eval(&self, query: &Query, object: usize) -> bool {
        match query {
            Query::Attribute { index, negated } => self.table.value(object, *index) != *negated,
            Query::Guess(objs) => objs.contains(&object),
        }
    }

    /// Stable text key of a query: `attr`, `!attr`, or `guess:<Name>[|<Name>...]`.
    pub fn query_key(&self, query: &Query) -> String {
        match query {
            Query::Attribute { index, negated } => {
                format!(
                    "{}{}",
                    if *negated { "!" } else { "" },
                    self.table.attributes[*index]
                )
            }
            Query::Guess(objs) => format!(
                "guess:{}",
                objs.iter()
                    .map(|&o| self.objects[o].name.as_str())
                    .collect::<Vec<_>>()
                    .join("|")
            ),
        }
    }

    /// Inverse of [`World::query_key`].
    pub fn query_from_key(&self, key: &str) -> Option<Query> {
        if let Some(names) = key.strip_prefix("guess:") {
            let objs = names
                .split('|')
                .map(|n| self.objects.iter().find(|o| o.name == n).map(|o| o.index))
                .collect::<Option<Vec<_>>>()?;
            return Some(Query::Guess(objs));
        }
        let (negated, name) = match key.strip_prefix('!') {
            Some(r) => (true, r),
            None => (false, key),
        };
        self.table
            .attribute_index(name)
            .map(|index| Query::Attribute { index, negated })
    }

    /// "Is it a basketball?" — the guess question for an object (canonical name).
    pub fn guess_question(&self, object: usize) -> String {
        let name = self.objects[object].name.to_lowercase();
        let plural = name.ends_with('s') && !name.ends_with("ss") && !name.ends_with("us");
        let article = if plural {
            ""
        } else if name.starts_with(['a', 'e', 'i', 'o', 'u']) {
            "an "
        } else {
            "a "
        };
        format!("Is it {article}{name}?")
    }

    /// The canonical question of an attribute.
    pub fn attribute_question(&self, attribute: usize) -> Option<&str> {
        self.lexicon.question_for(attribute)
    }

    /// Objects of `among` for which the query is true.
    pub fn yes_count(&self, query: &Query, among: &[usize]) -> usize {
        among.iter().filter(|&&o| self.eval(query, o)).count()
    }
}

// ---------------------------------------------------------------------------------------------
// Information gain.

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

// ---------------------------------------------------------------------------------------------
// Oracles.

/// An oracle's answer: yes/no plus what it understood (`attr`, `!attr`, `guess:<Name>`), `None`
/// for a question it could not parse.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OracleAnswer {
    pub yes: bool,
    pub parsed: Option<String>,
}

impl OracleAnswer {
    /// "Yes." or "No.".
    pub fn text(&self) -> &'static str {
        if self.yes {
            "Yes."
        } else {
            "No."
        }
    }
}

/// Answers questions about a hidden object.
pub trait Oracle {
    fn answer(&mut self, object: &Object, question: &str) -> OracleAnswer;
}

/// The deterministic table oracle: guesses by name, attribute questions by the lexicon; an
/// unparsable question is answered "No." and counted in `unparsed`.
#[derive(Debug, Clone)]
pub struct TableOracle<'a> {
    pub world: &'a World,
    pub unparsed: usize,
}

impl<'a> TableOracle<'a> {
    pub fn new(world: &'a World) -> Self {
        TableOracle { world, unparsed: 0 }
    }
}

impl Oracle for TableOracle<'_> {
    fn answer(&mut self, object: &Object, question: &str) -> OracleAnswer {
        let (yes, parsed) = chat::table_answer(self.world, object, question);
        if parsed.is_none() {
            self.unparsed += 1;
        }
        OracleAnswer { yes, parsed }
    }
}

// ---------------------------------------------------------------------------------------------
// Game loop.

/// Asks the next question given the (question, answer-was-yes) history.
pub trait Questioner {
    fn next_question(&mut self, history: &[(String, bool)]) -> String;
}

/// One question of a game.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    pub question: String,
    /// "Yes." / "No.".
    pub answer: String,
    pub yes: bool,
    /// What the oracle understood (`attr`, `!attr`, `guess:<Name>`).
    pub parsed: Option<String>,
    /// Binary entropy of the yes-fraction among the consistent objects before the question.
    pub expected_gain: f64,
    /// log2(consistent_before / consistent_after).
    pub realised_gain: f64,
    pub consistent_before: usize,
    pub consistent_after: usize,
    pub unparsed: bool,
    /// Same (normalised) question, or same parsed query, as an earlier turn.
    pub repeated: bool,
    /// A guess naming an object already ruled out by earlier answers.
    pub inconsistent_guess: bool,
    /// The answer contradicts every still-consistent object (possible only with a non-table
    /// oracle); the consistent set is then left unchanged.
    pub contradicts_table: bool,
    pub win: bool,
}

/// A finished game.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GameRecord {
    pub object_index: usize,
    pub object: String,
    pub max_questions: usize,
    pub won: bool,
    pub turns: Vec<Turn>,
}

/// Plays one game: at most `max_questions` questions; a win is a "yes" to a question that
/// satisfies [`is_win`]. Information gain is computed under the world's table from the
/// oracle's `parsed` key.
pub fn play(
    world: &World,
    object: &Object,
    questioner: &mut dyn Questioner,
    oracle: &mut dyn Oracle,
    max_questions: usize,
) -> GameRecord {
    let mut consistent: Vec<usize> = (0..world.objects.len()).collect();
    let mut history: Vec<(String, bool)> = Vec::new();
    let mut seen_text: HashSet<String> = HashSet::new();
    let mut seen_key: HashSet<String> = HashSet::new();
    let mut turns = Vec::new();
    let mut won = false;
    for _ in 0..max_questions {
        let question = questioner.next_question(&history);
        let norm = tokenize(&question).join(" ");
        let ans = oracle.answer(object, &question);
        let query = ans.parsed.as_deref().and_then(|k| world.query_from_key(k));
        let repeated = !seen_text.insert(norm)
            | ans
                .parsed
                .as_ref()
                .is_some_and(|k| !seen_key.insert(k.clone()));
        let before = consistent.len();
        let (mut expected, mut after, mut inconsistent_guess, mut contradicts) =
            (0.0, before, false, false);
        if let Some(q) = &query {
            expected = expected_gain(world, q, &consistent);
            if let Query::Guess(objs) = q {
                inconsistent_guess = objs.iter().any(|o| !consistent.contains(o));
            }
            let next: Vec<usize> = consistent
                .iter()
                .copied()
                .filter(|&o| world.eval(q, o) == ans.yes)
                .collect();
            if next.is_empty() {
                contradicts = true;
            } else {
                consistent = next;
                after = consistent.len();
            }
        }
        let win = ans.yes && is_win(&question, object, &world.objects);
        turns.push(Turn {
            answer: ans.text().to_string(),
            yes: ans.yes,
            unparsed: ans.parsed.is_none(),
            parsed: ans.parsed,
            expected_gain: expected,
            realised_gain: realised_gain(before, after),
            consistent_before: before,
            consistent_after: after,
            repeated,
            inconsistent_guess,
            contradicts_table: contradicts,
            win,
            question: question.clone(),
        });
        history.push((question, ans.yes));
        if win {
            won = true;
            break;
        }
    }
    GameRecord {
        object_index: object.index,
        object: object.name.clone(),
        max_questions,
        won,
        turns,
    }
}

/// LMRL-Gym's offline transcript: `{"lines": ["<question> <answer>", ...], "correct": bool,
/// "word": [accepted names]}`.
pub fn lmrl_transcript(record: &GameRecord, object: &Object) -> serde_json::Value {
    serde_json::json!({
        "lines": record
            .turns
            .iter()
            .map(|t| format!("{} {}", t.question.trim(), t.answer))
            .collect::<Vec<_>>(),
        "correct": record.won,
        "word": object.variants,
    })
}

// ---------------------------------------------------------------------------------------------
// Metrics.

/// Per-game numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GameMetrics {
    pub success: bool,
    /// −T + 1[win] (serialized as `return`).
    #[serde(rename = "return")]
    pub return_: f64,
    /// Questions asked on a win; `max_questions` on a failure.
    pub turns: usize,
    pub turns_on_win: Option<usize>,
    /// 1 − 0.02·max(T−5, 0) on a win, else 0.
    pub eda_score: f64,
    pub yes_answers: usize,
    /// Sum of realised gains (bits).
    pub info_gain: f64,
    /// Mean realised gain per question asked.
    pub info_gain_per_question: f64,
    /// Mean expected gain per question asked.
    pub expected_gain_per_question: f64,
    pub questions_asked: usize,
    pub unparsed: usize,
    pub repeated: usize,
    pub inconsistent_guesses: usize,
}

impl GameMetrics {
    pub fn of(record: &GameRecord) -> GameMetrics {
        let asked = record.turns.len();
        let t = if record.won {
            asked
        } else {
            record.max_questions
        };
        let info: f64 = record.turns.iter().map(|x| x.realised_gain).sum();
        let exp: f64 = record.turns.iter().map(|x| x.expected_gain).sum();
        let per = |v: f64| if asked == 0 { 0.0 } else { v / asked as f64 };
        GameMetrics {
            success: record.won,
            return_: -(t as f64) + if record.won { 1.0 } else { 0.0 },
            turns: t,
            turns_on_win: record.won.then_some(t),
            eda_score: if record.won {
                1.0 - 0.02 * (t.saturating_sub(5) as f64)
            } else {
                0.0
            },
            yes_answers: record.turns.iter().filter(|x| x.yes).count(),
            info_gain: info,
            info_gain_per_question: per(info),
            expected_gain_per_question: per(exp),
            questions_asked: asked,
            unparsed: record.turns.iter().filter(|x| x.unparsed).count(),
            repeated: record.turns.iter().filter(|x| x.repeated).count(),
            inconsistent_guesses: record.turns.iter().filter(|x| x.inconsistent_guess).count(),
        }
    }
}

/// Mean, standard error (sample sd / √n) and count.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    pub mean: f64,
    pub stderr: f64,
    pub n: usize,
}

impl Stat {
    pub fn of(values: &[f64]) -> Stat {
        let n = values.len();
        if n == 0 {
            return Stat {
                mean: 0.0,
                stderr: 0.0,
                n,
            };
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        let stderr = if n < 2 {
            0.0
        } else {
            let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            (var / n as f64).sqrt()
        };
        Stat { mean, stderr, n }
    }
}

impl fmt::Display for Stat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.4} ± {:.4} (n={})", self.mean, self.stderr, self.n)
    }
}

/// Aggregated metrics over games.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AggregateMetrics {
    pub games: usize,
    pub success_rate: Stat,
    pub mean_return: Stat,
    pub mean_turns: Stat,
    /// Over won games only.
    pub turns_on_win: Stat,
    pub eda_score: Stat,
    pub yes_answers: Stat,
    pub info_gain_per_game: Stat,
    pub info_gain_per_question: Stat,
    pub expected_gain_per_question: Stat,
    pub unparsed: Stat,
    /// Per game: unparsed questions / questions asked (0 for a game with no question).
    pub unparsed_rate: Stat,
    pub repeated: Stat,
    pub inconsistent_guesses: Stat,
}

impl AggregateMetrics {
    pub fn of(games: &[GameMetrics]) -> AggregateMetrics {
        let s =
            |f: &dyn Fn(&GameMetrics) -> f64| Stat::of(&games.iter().map(f).collect::<Vec<_>>());
        let wins: Vec<f64> = games
            .iter()
            .filter_map(|g| g.turns_on_win.map(|t| t as f64))
            .collect();
        AggregateMetrics {
            games: games.len(),
            success_rate: s(&|g| if g.success { 1.0 } else { 0.0 }),
            mean_return: s(&|g| g.return_),
            mean_turns: s(&|g| g.turns as f64),
            turns_on_win: Stat::of(&wins),
            eda_score: s(&|g| g.eda_score),
            yes_answers: s(&|g| g.yes_answers as f64),
            info_gain_per_game: s(&|g| g.info_gain),
            info_gain_per_question: s(&|g| g.info_gain_per_question),
            expected_gain_per_question: s(&|g| g.expected_gain_per_question),
            unparsed: s(&|g| g.unparsed as f64),
            unparsed_rate: s(&|g| {
                if g.questions_asked == 0 {
                    0.0
                } else {
                    g.unparsed as f64 / g.questions_asked as f64
                }
            }),
            repeated: s(&|g| g.repeated as f64),
            inconsistent_guesses: s(&|g| g.inconsistent_guesses as f64),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rewards of a future, exact under the table.

/// The exact rewards of a 20 Questions future: the questions asked after a history (the
/// candidate question first), with the oracle's answers, up to a win or the future's end.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FutureRewards {
    /// Expected information gain (bits, in [0, 1]) of the first question (the candidate's)
    /// under the objects still consistent after the history: the binary entropy of its
    /// yes-fraction. It depends on the question, not on the hidden object; an unread,
    /// repeated or already answered question, and a guess of a ruled-out object, gain 0.
    pub expected_gain: f64,
    /// Bits gathered: log2(|consistent before the future| / |consistent after it|), the sum of
    /// the realised gains of its questions (unparsed questions and answers that contradict
    /// every consistent object gather none).
    pub info_gain_bits: f64,
    /// `info_gain_bits / log2(|consistent before the future|)`: the share of the uncertainty
    /// left at the candidate that the future removes, in [0, 1] (0 when one object was left).
    pub info_gain: f64,
    /// 1 when the game is won within the future, else 0.
    pub success: f64,
    /// Questions asked in the future, the winning one included.
    pub questions: f64,
    /// LMRL-Gym's return over the future: −1 per question, 0 for the winning one.
    pub lmrl_return: f64,
}

/// Objects consistent with a history of (question, answer-was-yes) under the table; an
/// unparsed question, or an answer no consistent object agrees with, changes nothing (as in
/// [`play`]).
pub fn consistent_after(world: &World, history: &[(String, bool)]) -> Vec<usize> {
    let mut consistent: Vec<usize> = (0..world.objects.len()).collect();
    for (q, yes) in history {
        if let Some(query) = world.parse(q) {
            let next: Vec<usize> = consistent
                .iter()
                .copied()
                .filter(|&o| world.eval(&query, o) == *yes)
                .collect();
            if !next.is_empty() {
                consistent = next;
            }
        }
    }
    consistent
}

/// Rewards of `future` for the hidden `object` after `history`. The future stops at its first
/// win (a "yes" to a question that [`is_win`]); later turns are not counted.
pub fn future_rewards(
    world: &World,
    object: &Object,
    history: &[(String, bool)],
    future: &[(String, bool)],
) -> FutureRewards {
    let before = consistent_after(world, history);
    let mut played: Vec<(String, bool)> = history.to_vec();
    let (mut questions, mut won) = (0usize, false);
    for (q, yes) in future {
        questions += 1;
        played.push((q.clone(), *yes));
        if *yes && is_win(q, object, &world.objects) {
            won = true;
            break;
        }
    }
    let after = consistent_after(world, &played);
    let bits = realised_gain(before.len(), after.len());
    let max_bits = (before.len() as f64).log2();
    let expected_gain = future
        .first()
        .and_then(|(q, _)| world.parse(q))
        .map_or(0.0, |q| expected_gain(world, &q, &before));
    FutureRewards {
        expected_gain,
        info_gain_bits: bits,
        info_gain: if max_bits > 0.0 {
            (bits / max_bits).clamp(0.0, 1.0)
        } else {
            0.0
        },
        success: if won { 1.0 } else { 0.0 },
        questions: questions as f64,
        lmrl_return: -(questions as f64) + if won { 1.0 } else { 0.0 },
    }
}

/// The 20 Questions study's two reward variants as metric weights (`--metric-preset`): its
/// generation used task weight 1, LLM-reward weight 1 and a cost of 5e-4 per token (= −0.5
/// per thousand tokens); the task metric is `success`, the LLM reward the judged
/// `interactivity` or the exact `info_gain` (the study judged it by LLM; ours is the
/// question's expected gain under the table). The token cost counts the candidate question
/// only (`reply_tokens`): counting the future's questions too made best-vs-worst pairs
/// mostly "shorter vs longer future".
pub const METRIC_PRESETS: &[(&str, &[(&str, f64)])] = &[
    (
        "20q-interactive",
        &[
            ("success", 1.0),
            ("interactivity", 1.0),
            ("reply_tokens", -0.5),
        ],
    ),
    ("20q-infogain", DEFAULT_WEIGHTS),
    (GAME_PRESET, GAME_WEIGHTS),
];

/// The preset whose futures play the game out: besides its weights it makes the window the
/// whole game and the demonstrator the future questioner, unless those are given.
pub const GAME_PRESET: &str = "20q-game";

/// `20q-game`: the game the candidate leads to. `success` (won within the budget) dominates;
/// `lmrl_return` (−1 per question, +1 for a win) at 0.04 ranks wins by questions used and
/// can never outweigh a win (20 questions × 0.04 < 1); the candidate's own tokens cost as in
/// the other presets.
pub const GAME_WEIGHTS: &[(&str, f64)] = &[
    ("success", 1.0),
    ("lmrl_return", 0.04),
    ("reply_tokens", -0.5),
];

/// The default weights of 20 Questions tasks: the `20q-infogain` preset (no judge needed).
pub const DEFAULT_WEIGHTS: &[(&str, f64)] =
    &[("success", 1.0), ("info_gain", 1.0), ("reply_tokens", -0.5)];

/// The weights of a preset by name.
pub fn metric_preset(name: &str) -> Option<&'static [(&'static str, f64)]> {
    METRIC_PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, w)| *w)
}

// ---------------------------------------------------------------------------------------------
// Built-in questioners.

/// The objects still consistent with a game's history, kept up to date as the history grows
/// (a history that shrank, a new game, starts over).
#[derive(Debug, Clone)]
struct Tracker<'a> {
    world: &'a World,
    consistent: Vec<usize>,
    processed: usize,
}

impl<'a> Tracker<'a> {
    fn new(world: &'a World) -> Self {
        Tracker {
            world,
            consistent: (0..world.objects.len()).collect(),
            processed: 0,
        }
    }

    fn update(&mut self, history: &[(String, bool)]) -> &[usize] {
        if history.len() < self.processed {
            *self = Tracker::new(self.world);
        }
        for (q, yes) in &history[self.processed..] {
            if let Some(query) = self.world.parse(q) {
                let next: Vec<usize> = self
                    .consistent
                    .iter()
                    .copied()
                    .filter(|&o| self.world.eval(&query, o) == *yes)
                    .collect();
                if !next.is_empty() {
                    self.consistent = next;
                }
            }
        }
        self.processed = history.len();
        &self.consistent
    }
}

/// Every attribute with a canonical question, by expected gain among `consistent` (highest
/// first; ties in attribute order), leaving out those that gain nothing.
fn ranked_attributes(world: &World, consistent: &[usize]) -> Vec<(f64, usize)> {
    let mut ranked: Vec<(f64, usize)> = (0..world.table.attributes.len())
        .filter(|&a| world.attribute_question(a).is_some())
        .map(|a| {
            let q = Query::Attribute {
                index: a,
                negated: false,
            };
            (expected_gain(world, &q, consistent), a)
        })
        .filter(|(g, _)| *g > 0.0)
        .collect();
    // Stable: equal gains keep attribute order.
    ranked.sort_by(|x, y| y.0.total_cmp(&x.0));
    ranked
}

/// Greedy maximum expected information gain over the table's attributes and single-object
/// guesses. Ties: a guess beats an attribute (it can end the game now); then attribute order,
/// then object order. With one object left it guesses it.
#[derive(Debug, Clone)]
pub struct ReferenceQuestioner<'a> {
    tracker: Tracker<'a>,
}

impl<'a> ReferenceQuestioner<'a> {
    pub fn new(world: &'a World) -> Self {
        ReferenceQuestioner {
            tracker: Tracker::new(world),
        }
    }
}

impl Questioner for ReferenceQuestioner<'_> {
    fn next_question(&mut self, history: &[(String, bool)]) -> String {
        let w = self.tracker.world;
        let consistent = self.tracker.update(history);
        let n = consistent.len();
        if n <= 1 {
            return w.guess_question(consistent.first().copied().unwrap_or(0));
        }
        const EPS: f64 = 1e-12;
        // A guess of any consistent object: entropy of 1/n; the first in object order.
        let guess_gain = binary_entropy(1.0 / n as f64);
        match ranked_attributes(w, consistent).first() {
            Some(&(g, a)) if g > guess_gain + EPS => w
                .attribute_question(a)
                .map_or_else(|| w.guess_question(consistent[0]), str::to_string),
            _ => w.guess_question(consistent[0]),
        }
    }
}

/// The SFT demonstrator: a *noisy* halving questioner. While more than `guess_at` objects are
/// consistent it asks one of the `top_k` attribute questions of highest expected gain, drawn
/// uniformly (so games of the same object differ and a model sees many good questions, not
/// one fixed path); then it guesses the consistent objects in random order. It asks the
/// canonical wording of each attribute and "Is it a <name>?", all of which the table reads.
#[derive(Debug, Clone)]
pub struct DemonstratorQuestioner<'a> {
    tracker: Tracker<'a>,
    rng: StdRng,
    top_k: usize,
    guess_at: usize,
}

/// The demonstrator's defaults: a draw among the 3 best questions; guesses from 4 objects.
/// Guessing from 4 (not 1) costs nothing (8.4 questions a game against 8.7 from 2, the
/// reference's 8.3) and puts every object's name into training games as a guess, held-out
/// objects' included: a model that has never seen a name cannot guess it.
pub const DEMONSTRATOR_TOP_K: usize = 3;
pub const DEMONSTRATOR_GUESS_AT: usize = 4;

impl<'a> DemonstratorQuestioner<'a> {
    pub fn new(world: &'a World, seed: u64) -> Self {
        Self::with(world, seed, DEMONSTRATOR_TOP_K, DEMONSTRATOR_GUESS_AT)
    }

    /// `top_k` ≥ 1 questions to draw among; guess once at most `guess_at` ≥ 1 objects remain.
    pub fn with(world: &'a World, seed: u64, top_k: usize, guess_at: usize) -> Self {
        DemonstratorQuestioner {
            tracker: Tracker::new(world),
            rng: StdRng::seed_from_u64(seed),
            top_k: top_k.max(1),
            guess_at: guess_at.max(1),
        }
    }
}

impl Questioner for DemonstratorQuestioner<'_> {
    fn next_question(&mut self, history: &[(String, bool)]) -> String {
        let w = self.tracker.world;
        let consistent = self.tracker.update(history).to_vec();
        let ranked = ranked_attributes(w, &consistent);
        if consistent.len() <= self.guess_at || ranked.is_empty() {
            let k = self.rng.random_range(0..consistent.len().max(1));
            return w.guess_question(consistent.get(k).copied().unwrap_or(0));
        }
        let k = self.rng.random_range(0..ranked.len().min(self.top_k));
        let a = ranked[k].1;
        w.attribute_question(a)
            .map_or_else(|| w.guess_question(consistent[0]), str::to_string)
    }
}

/// Guesses distinct objects uniformly at random: "Is it a <name>?".
#[derive(Debug, Clone)]
pub struct RandomGuessQuestioner<'a> {
    world: &'a World,
    rng: StdRng,
    remaining: Vec<usize>,
}

impl<'a> RandomGuessQuestioner<'a> {
    pub fn new(world: &'a World, seed: u64) -> Self {
        RandomGuessQuestioner {
            world,
            rng: StdRng::seed_from_u64(seed),
            remaining: (0..world.objects.len()).collect(),
        }
    }
}

impl Questioner for RandomGuessQuestioner<'_> {
    fn next_question(&mut self, _history: &[(String, bool)]) -> String {
        if self.remaining.is_empty() {
            self.remaining = (0..self.world.objects.len()).collect();
        }
        let k = self.rng.random_range(0..self.remaining.len());
        let o = self.remaining.swap_remove(k);
        self.world.guess_question(o)
    }
}
