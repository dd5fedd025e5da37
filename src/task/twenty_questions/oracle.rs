//! Oracles: what answers the questioner ([`Oracle`]), and the deterministic table oracle
//! ([`TableOracle`]) that answers from the attribute table.

use serde::{Deserialize, Serialize};

use super::{Object, World};

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
        let (yes, parsed) = super::chat::table_answer(self.world, object, question);
        if parsed.is_none() {
            self.unparsed += 1;
        }
        OracleAnswer { yes, parsed }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::twenty_questions::chat::default_world;

    #[test]
    fn the_table_oracle_answers_from_the_table_and_counts_what_it_cannot_read() {
        let w = default_world().expect("bundled world");
        let cat = w.find("Cat").expect("Cat");
        let mut oracle = TableOracle::new(w);
        let a = oracle.answer(cat, "Is it an animal?");
        assert_eq!(
            (a.yes, a.parsed.as_deref(), a.text()),
            (true, Some("is_animal"), "Yes.")
        );
        let a = oracle.answer(cat, "Is it a cat?");
        assert_eq!((a.yes, a.parsed.as_deref()), (true, Some("guess:Cat")));
        let a = oracle.answer(cat, "Is it a dog?");
        assert_eq!((a.yes, a.text()), (false, "No."));
        assert_eq!(oracle.unparsed, 0);
        let a = oracle.answer(cat, "Blorp zzyzx?");
        assert_eq!((a.yes, a.parsed), (false, None));
        assert_eq!(oracle.unparsed, 1);
    }
}
