//! Reading a questioner's line as a query the attribute table can answer.
//!
//! The grammar (everything else is *unread*: the table oracle answers "No.", LMRL-Gym's rule,
//! and the game counts it as `unparsed`):
//!
//! ```text
//! question  := filler* lead body "?"          one line, one "?" (the last character),
//!                                             at most MAX_QUESTION_WORDS words
//! filler    := so | ok | okay | well | then | hmm | alright | and | next | now
//! lead      := auxiliary [subject] ["not"]    auxiliary: is, are, does, do, can, could,
//!                                             would, will, has, have, was, might, may,
//!                                             should, or a negated form (isn't, doesn't, …)
//! body      := guess | attribute
//! guess     := (after "is it", "could it be", "are they", "is the object", …)
//!              [a | an | the | some] [kind of | type of | sort of | pair of]
//!              NAME ("or" NAME)*              each NAME exactly an accepted object name
//! attribute := text in which one lexicon attribute is named (below)
//! ```
//!
//! - **Negation** is read only in the lead ("Is it not …", "Isn't it …", "Does it not …",
//!   "Doesn't it …") and flips the attribute; a negated guess, and any negative word elsewhere
//!   ("no", "never", "without", a second "not"), leaves the question unread.
//! - **One attribute**: the first lexicon row that matches decides. Any other row that
//!   matches outside the decisive row's match must name the same attribute, or one the
//!   decisive attribute implies on every object of the table ("Is it a wild animal?": every
//!   wild object is an animal), and the question has no "or". Otherwise it asks two things
//!   ("Is it a big animal?", "Is it red or yellow?", keyword lists) and is unread.
//! - **Objects named in an attribute question** must lie inside the decisive match ("Is it
//!   a big cat?", "Does it grow on trees?"); "Is it bigger than a dog?" and "Does it have
//!   wheels, like a car?" are unread, never guesses of Dog or Car.
//! - **Every word is accounted for**: each word of an attribute question lies in a lexicon
//!   match, or is one of [`FUNCTION_WORDS`] (articles, prepositions, pronouns, "thing",
//!   "used", "have", …). A keyword padded with other words ("Is it sports equipment
//!   available?", "Is it natural interesting?") is unread: a policy trained against the
//!   table learned to pad its questions so.

use regex::Regex;

use super::{tokenize, Object, Query, World};

/// Longest question read (in words, fillers included).
pub const MAX_QUESTION_WORDS: usize = 15;

/// Why a line is not read as a query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unread {
    /// Not one line ending in its only "?".
    NotAQuestion,
    /// More than [`MAX_QUESTION_WORDS`] words.
    TooLong,
    /// Does not open with an auxiliary verb ("Is", "Does", "Can", …).
    NoLead,
    /// "Is it not a cat?": a negated guess.
    NegatedGuess,
    /// A negative word outside the lead.
    Negation,
    /// Two attributes, neither implying the other.
    TwoAttributes,
    /// An object named outside a guess and outside the attribute's own words.
    ObjectInAttribute,
    /// A word neither in a lexicon match nor a function word.
    UnexplainedWord,
    /// No lexicon row and no object name fits.
    Unknown,
}

const FILLERS: &[&str] = &[
    "so", "ok", "okay", "well", "then", "hmm", "alright", "and", "next", "now",
];
const AUXILIARIES: &[&str] = &[
    "is", "are", "was", "were", "does", "do", "did", "can", "could", "would", "will", "has",
    "have", "had", "might", "may", "should", "shall", "must",
];
const NEGATED_AUXILIARIES: &[&str] = &[
    "isn't",
    "aren't",
    "wasn't",
    "weren't",
    "doesn't",
    "don't",
    "didn't",
    "can't",
    "cannot",
    "couldn't",
    "wouldn't",
    "won't",
    "hasn't",
    "haven't",
    "shouldn't",
];
/// Auxiliaries that need "be" before a guess ("could it be a cat").
const MODALS: &[&str] = &[
    "could", "would", "might", "may", "can", "will", "must", "should",
];
/// Auxiliaries whose question can be a guess ("is it a cat", "could it be a cat").
const COPULAS: &[&str] = &["is", "are", "was", "isn't", "aren't", "wasn't"];
const SUBJECTS: &[&[&str]] = &[
    &["it"],
    &["this"],
    &["that"],
    &["they"],
    &["these"],
    &["you"],
    &["the", "object"],
    &["your", "object"],
    &["the", "hidden", "object"],
    &["the", "answer"],
    &["the", "word"],
    &["your", "word"],
    &["the", "thing"],
];
const NEGATIVES: &[&str] = &[
    "not", "no", "never", "without", "nothing", "none", "neither", "nor", "cannot",
];
/// Words that may precede a guessed name.
const GUESS_LEAD_INS: &[&[&str]] = &[
    &["kind", "of"],
    &["type", "of"],
    &["sort", "of"],
    &["pair", "of"],
    &["maybe"],
    &["perhaps"],
    &["possibly"],
    &["actually"],
    &["a"],
    &["an"],
    &["the"],
    &["some"],
    &["one"],
];

/// Words an attribute question may hold besides the lexicon's: the grammar's glue.
pub const FUNCTION_WORDS: &[&str] = &[
    // articles, determiners, quantifiers
    "a",
    "an",
    "the",
    "some",
    "any",
    "one",
    "this",
    "that",
    "these",
    "those",
    "many",
    "much",
    "most",
    "all",
    "each",
    "every",
    "other",
    // prepositions and conjunctions
    "of",
    "for",
    "in",
    "on",
    "at",
    "to",
    "by",
    "with",
    "from",
    "into",
    "onto",
    "inside",
    "about",
    "around",
    "before",
    "after",
    "when",
    "while",
    "during",
    "or",
    "and",
    "than",
    "as",
    "up",
    // pronouns
    "it",
    "its",
    "it's",
    "you",
    "your",
    "we",
    "our",
    "they",
    "them",
    "their",
    "people",
    "someone",
    "somebody",
    "anyone",
    "i",
    "me",
    "my",
    // nouns that name nothing
    "something",
    "thing",
    "things",
    "object",
    "objects",
    "item",
    "items",
    "kind",
    "type",
    "sort",
    "piece",
    "part",
    "device",
    "equipment",
    "stuff",
    // auxiliaries and common verbs
    "is",
    "are",
    "be",
    "been",
    "being",
    "was",
    "were",
    "can",
    "could",
    "would",
    "will",
    "should",
    "might",
    "may",
    "do",
    "does",
    "did",
    "have",
    "has",
    "had",
    "use",
    "used",
    "uses",
    "using",
    "find",
    "found",
    "make",
    "made",
    "makes",
    "keep",
    "keeps",
    "kept",
    "give",
    "gives",
    "get",
    "gets",
    "come",
    "comes",
    "go",
    "goes",
    "take",
    "takes",
    "need",
    "needs",
    "run",
    "runs",
    "open",
    "opens",
    "tell",
    "tells",
    "contain",
    "contains",
    "see",
    "seen",
    "play",
    "played",
    "grow",
    "grows",
    "grown",
    "growing",
    "live",
    "lives",
    "typically",
    "usually",
    "often",
    "mostly",
    "generally",
    "commonly",
    "normally",
    "mainly",
    "primarily",
    "really",
    "very",
    "also",
    "ever",
    "always",
    "sometimes",
    "there",
];

fn starts_with(words: &[String], prefix: &[&str]) -> bool {
    words.len() >= prefix.len() && words.iter().zip(prefix).all(|(w, p)| w == p)
}

fn is_negative(word: &str) -> bool {
    NEGATIVES.contains(&word) || word.ends_with("n't")
}

/// The question's lead, read off its words.
struct Lead {
    /// Words consumed by fillers, auxiliary, subject, "be" and "not".
    len: usize,
    negated: bool,
    /// The body may be a guess ("is it", "could it be").
    may_guess: bool,
}

fn read_lead(words: &[String]) -> Result<Lead, Unread> {
    let mut i = words
        .iter()
        .take_while(|w| FILLERS.contains(&w.as_str()))
        .count();
    let aux = words.get(i).map(String::as_str).ok_or(Unread::NoLead)?;
    let mut negated = NEGATED_AUXILIARIES.contains(&aux);
    if !negated && !AUXILIARIES.contains(&aux) {
        return Err(Unread::NoLead);
    }
    i += 1;
    let subject = SUBJECTS
        .iter()
        .find(|s| starts_with(&words[i..], s))
        .map_or(0, |s| s.len());
    i += subject;
    if words.get(i).is_some_and(|w| w == "not") {
        negated = true;
        i += 1;
    }
    let modal = MODALS.iter().any(|m| aux.starts_with(m));
    let mut may_guess = subject > 0 && COPULAS.contains(&aux);
    if subject > 0 && modal && words.get(i).is_some_and(|w| w == "be") {
        may_guess = true;
        i += 1;
    }
    Ok(Lead {
        len: i,
        negated,
        may_guess,
    })
}

impl World {
    /// Reads a question (see the module's grammar); `None` when it is unread.
    pub fn parse(&self, question: &str) -> Option<Query> {
        self.read(question).ok()
    }

    /// [`World::parse`] with the reason a question is unread.
    pub fn read(&self, question: &str) -> Result<Query, Unread> {
        let text = question.trim().replace(['\u{2019}', '\u{2018}'], "'");
        let Some(stem) = text.strip_suffix('?') else {
            return Err(Unread::NotAQuestion);
        };
        if stem.contains(['?', '\n', '\r']) {
            return Err(Unread::NotAQuestion);
        }
        let words = tokenize(stem);
        if words.len() > MAX_QUESTION_WORDS {
            return Err(Unread::TooLong);
        }
        let lead = read_lead(&words)?;
        let body = &words[lead.len..];
        if body.is_empty() {
            return Err(Unread::Unknown);
        }
        if body.iter().any(|w| is_negative(w)) {
            return Err(Unread::Negation);
        }
        if lead.may_guess {
            if let Some(objects) = self.guessed(body) {
                return if lead.negated {
                    Err(Unread::NegatedGuess)
                } else {
                    Ok(Query::Guess(objects))
                };
            }
        }
        let (index, negated) = self.attribute_of(&normalise(stem), lead.len)?;
        Ok(Query::Attribute {
            index,
            negated: negated != lead.negated,
        })
    }

    /// The objects a guess body names ("a dog or a cat"), when every part is exactly a name.
    fn guessed(&self, body: &[String]) -> Option<Vec<usize>> {
        let mut objects = Vec::new();
        for part in body.split(|w| w == "or") {
            let mut p = part;
            while let Some(skip) = GUESS_LEAD_INS.iter().find(|l| starts_with(p, l)) {
                p = &p[skip.len()..];
            }
            let o = (!p.is_empty()).then(|| self.exact_object(p)).flatten()?;
            if !objects.contains(&o) {
                objects.push(o);
            }
        }
        (!objects.is_empty()).then_some(objects)
    }

    /// The one attribute `text` (normalised; its first `lead` words are the lead) names,
    /// under the rules of the module's doc.
    fn attribute_of(&self, text: &str, lead: usize) -> Result<(usize, bool), Unread> {
        let matches: Vec<(usize, Vec<(usize, usize)>)> = self
            .lexicon
            .entries
            .iter()
            .enumerate()
            .filter_map(|(row, e)| {
                let spans: Vec<_> = e
                    .pattern
                    .find_iter(text)
                    .map(|m| (m.start(), m.end()))
                    .collect();
                (!spans.is_empty()).then_some((row, spans))
            })
            .collect();
        let Some((first, decisive)) = matches.first() else {
            return Err(Unread::Unknown);
        };
        let winner = &self.lexicon.entries[*first];
        let inside = |(s, e): (usize, usize)| decisive.iter().any(|&(ds, de)| ds <= s && e <= de);
        // "A or B" is no conjunction: implication says nothing about it.
        let disjunction = text.split(' ').any(|w| w == "or");
        for (row, spans) in &matches[1..] {
            let other = &self.lexicon.entries[*row];
            let same = other.attribute == winner.attribute && other.negated == winner.negated;
            if same || spans.iter().all(|&s| inside(s)) {
                continue;
            }
            let implied = self.implies(
                (winner.attribute, winner.negated),
                (other.attribute, other.negated),
            );
            if disjunction || !implied {
                return Err(Unread::TwoAttributes);
            }
        }
        if self
            .object_mentions(text)
            .into_iter()
            .any(|span| !inside(span))
        {
            return Err(Unread::ObjectInAttribute);
        }
        // Every word of the body is glue or inside some lexicon match (rows that passed the
        // checks above name the winner's attribute or one it implies).
        let matched: Vec<(usize, usize)> = matches
            .iter()
            .flat_map(|(_, s)| s.iter().copied())
            .collect();
        let mut at = 0;
        for (i, word) in text.split(' ').enumerate() {
            let span = (at, at + word.len());
            at += word.len() + 1;
            if i < lead {
                continue;
            }
            let bare = word.trim_matches(|c: char| c == '\'' || c == '-');
            let covered = matched.iter().any(|&(s, e)| s <= span.0 && span.1 <= e);
            if !covered && !FUNCTION_WORDS.contains(&bare) && !bare.is_empty() {
                return Err(Unread::UnexplainedWord);
            }
        }
        Ok((winner.attribute, winner.negated))
    }

    /// Whether `a` true implies `b` true on every object of the table.
    fn implies(&self, (a, na): (usize, bool), (b, nb): (usize, bool)) -> bool {
        (0..self.objects.len())
            .all(|o| self.table.value(o, a) == na || self.table.value(o, b) != nb)
    }

    /// Byte spans in `text` (normalised) of every accepted name of every object.
    fn object_mentions(&self, text: &str) -> Vec<(usize, usize)> {
        self.name_patterns
            .iter()
            .flat_map(|p| p.find_iter(text).map(|m| (m.start(), m.end())))
            .collect()
    }
}

/// Lower case, curly quotes straightened, every character but letters, digits, apostrophes
/// and hyphens a space, spaces collapsed: the text lexicon patterns and names are matched in.
pub(crate) fn normalise(text: &str) -> String {
    let lower: String = text
        .to_lowercase()
        .chars()
        .map(|c| match c {
            '\u{2019}' | '\u{2018}' => '\'',
            c if c.is_alphanumeric() || c == '\'' || c == '-' => c,
            _ => ' ',
        })
        .collect();
    lower.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// One pattern per accepted name: the name's words, a plural on the last one allowed.
pub(crate) fn name_patterns(objects: &[Object]) -> Vec<Regex> {
    objects
        .iter()
        .flat_map(|o| &o.variants)
        .filter_map(|v| {
            let words: Vec<String> = tokenize(v).iter().map(|w| regex::escape(w)).collect();
            (!words.is_empty())
                .then(|| Regex::new(&format!(r"\b{}(?:s|es)?\b", words.join(r"[\s-]+"))).ok())
                .flatten()
        })
        .collect()
}
