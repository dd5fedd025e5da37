//! The world's data files: the objects, the object × attribute table and the question →
//! attribute lexicon, read from `data/twenty_questions_*.tsv` with errors naming file and line.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use regex::Regex;
use serde::{Deserialize, Serialize};

use super::tokenize;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::twenty_questions::DEFAULT_DATA_DIR;

    #[test]
    fn the_bundled_files_load_and_agree() {
        let objects = load_objects(DEFAULT_DATA_DIR).expect("objects");
        assert_eq!(objects.len(), NUM_OBJECTS);
        for (i, o) in objects.iter().enumerate() {
            assert_eq!(o.index, i);
            assert_eq!(o.variants[0], o.name);
        }
        let table = load_table(DEFAULT_DATA_DIR, &objects).expect("table");
        assert_eq!(table.values.len(), objects.len());
        let animal = table.attribute_index("is_animal").expect("is_animal");
        let find = |n: &str| objects.iter().position(|o| o.name == n).unwrap();
        assert!(table.value(find("Cat"), animal));
        assert!(!table.value(find("Basketball"), animal));
        let lexicon = load_lexicon(DEFAULT_DATA_DIR, &table).expect("lexicon");
        assert_eq!(lexicon.question_for(animal), Some("Is it an animal?"));
    }

    #[test]
    fn a_bad_file_is_named_with_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(OBJECTS_FILE);
        std::fs::write(&file, "# comment\ncategory\tname\tvariants\nAnimals\tCat\n").unwrap();
        match load_objects(dir.path()) {
            Err(WorldDataError::Parse { line, msg, .. }) => {
                assert_eq!(line, 3);
                assert!(msg.contains("expected 3 columns, got 2"), "{msg}");
            }
            other => panic!("expected a parse error, got {other:?}"),
        }
        std::fs::write(&file, "category\tname\tvariants\nAnimals\tCat\tKitty|Cat\n").unwrap();
        let err = load_objects(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("first variant must be the canonical name"),
            "{err}"
        );
        assert!(matches!(
            load_objects(dir.path().join("missing")),
            Err(WorldDataError::Io { .. })
        ));
    }
}
