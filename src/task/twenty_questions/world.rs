//! The world: objects, attribute table and lexicon together ([`World`]), and what a question
//! asks under the table ([`Query`]) with its truth, key and canonical wording.

use std::path::Path;

use regex::Regex;

use super::win::mentions;
use super::{
    load_lexicon, load_objects, load_table, tokenize, AttributeTable, Lexicon, Object,
    WorldDataError, DEFAULT_DATA_DIR,
};

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
    pub(super) name_patterns: Vec<Regex>,
}

impl World {
    /// Loads the three files from `dir` and checks that they agree.
    pub fn load(dir: impl AsRef<Path>) -> Result<World, WorldDataError> {
        let objects = load_objects(&dir)?;
        let table = load_table(&dir, &objects)?;
        let lexicon = load_lexicon(&dir, &table)?;
        let name_patterns = super::parse::name_patterns(&objects);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::twenty_questions::chat::default_world;

    #[test]
    fn query_keys_round_trip_and_evaluate_under_the_table() {
        let w = default_world().expect("bundled world");
        let cat = w.find("cat").expect("Cat").index;
        let animal = w.table.attribute_index("is_animal").unwrap();
        for q in [
            Query::Attribute {
                index: animal,
                negated: false,
            },
            Query::Attribute {
                index: animal,
                negated: true,
            },
            Query::Guess(vec![cat]),
        ] {
            assert_eq!(w.query_from_key(&w.query_key(&q)), Some(q.clone()));
        }
        assert_eq!(w.query_key(&Query::Guess(vec![cat])), "guess:Cat");
        let negated = Query::Attribute {
            index: animal,
            negated: true,
        };
        assert_eq!(w.query_key(&negated), "!is_animal");
        assert!(!w.eval(&negated, cat));
        assert!(w.eval(&Query::Guess(vec![cat]), cat));
        assert_eq!(w.query_from_key("no_such_attribute"), None);
    }

    #[test]
    fn objects_are_found_by_name_and_seed_and_guessed_in_words() {
        let w = default_world().expect("bundled world");
        assert_eq!(w.object_for_seed(w.objects.len() as u64).index, 0);
        let cat = w.find("CAT").expect("Cat");
        assert_eq!(w.guess_question(cat.index), "Is it a cat?");
        assert_eq!(w.exact_object(&tokenize("cats")), Some(cat.index));
        assert_eq!(w.exact_object(&tokenize("a cat")), None);
        let vowel = w
            .objects
            .iter()
            .find(|o| o.name.to_lowercase().starts_with('a') && !o.name.ends_with('s'))
            .expect("a name starting with a");
        assert!(w.guess_question(vowel.index).starts_with("Is it an "));
    }
}
