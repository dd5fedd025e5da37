//! The module layering of ARCHITECTURE.md, checked: every `crate::<module>` path in a module's
//! sources must name a module it may depend on, and the graph has no circle. A new import
//! that runs against the one-way flow fails here, naming the file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module and what it may import (the data flows one way: backends →
/// rollouts → rewards → pairs → datasets → training → evaluation → plots).
const ALLOWED: &[(&str, &[&str])] = &[
    ("check", &[]),
    ("run", &[]),
    // The local inference engine: kernels, the llama-family forward pass, tokenizers and
    // templates, the runtime, the prefix cache and the scheduler.
    ("engine", &["check", "run"]),
    // Task types and their facts, task files and sources (read with the parquet helpers of
    // `dataset`, which never imports task; a Hub dataset downloaded by `hub::download`) and
    // the prompt templates of each task type.
    ("task", &["check", "dataset", "hub", "llm", "run"]),
    ("llm", &["check", "engine", "run"]),
    ("serve", &["check", "engine", "llm", "run", "task"]),
    ("reward", &["check", "llm", "run", "task"]),
    ("rollout", &["check", "llm", "reward", "run", "task"]),
    ("dataset", &["check", "llm", "run"]),
    // The Hub client: uploads, cards and dataset downloads; what the files mean is not its
    // business.
    ("hub", &["check", "engine", "llm", "run"]),
    (
        "generate",
        &[
            "check", "dataset", "llm", "reward", "rollout", "run", "task",
        ],
    ),
    // rl_train checks its rollout half and reads its tasks with `rollout::config`, as
    // generate_conv does; train never imports generate, and none of the three imports hub.
    (
        "train",
        &[
            "check", "dataset", "engine", "llm", "reward", "rollout", "run", "task",
        ],
    ),
    (
        "eval",
        &[
            "check", "dataset", "engine", "llm", "reward", "rollout", "run", "task",
        ],
    ),
    ("plot", &["check", "dataset", "reward", "rollout", "run"]),
    ("cli", &["check", "llm", "reward", "run", "task"]),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Every file under `dir`, build outputs aside.
fn project_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            project_files(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// A `YYYY-MM-DD` date anywhere in `line`.
fn has_iso_date(line: &str) -> bool {
    let b = line.as_bytes();
    b.windows(10).any(|w| {
        let digits = |r: std::ops::Range<usize>| w[r].iter().all(u8::is_ascii_digit);
        digits(0..4) && w[4] == b'-' && digits(5..7) && w[7] == b'-' && digits(8..10)
    })
}

/// module → (imported module → first file that imports it).
fn import_graph(src: &Path) -> BTreeMap<String, BTreeMap<String, PathBuf>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph: BTreeMap<String, BTreeMap<String, PathBuf>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let edges = graph.entry(module.clone()).or_default();
        for (i, _) in text.match_indices("crate::") {
            let name: String = text[i + 7..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() && name != module {
                edges.entry(name).or_insert_with(|| f.clone());
            }
        }
    }
    graph
}

#[test]
fn every_import_follows_the_layering() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = import_graph(&src);
    let allowed: BTreeMap<&str, BTreeSet<&str>> = ALLOWED
        .iter()
        .map(|(m, deps)| (*m, deps.iter().copied().collect()))
        .collect();
    let mut wrong = Vec::new();
    for (module, edges) in &graph {
        let Some(ok) = allowed.get(module.as_str()) else {
            wrong.push(format!(
                "module `{module}` is not in the layering table: add it here and to ARCHITECTURE.md"
            ));
            continue;
        };
        for (dep, file) in edges {
            if !ok.contains(dep.as_str()) {
                wrong.push(format!(
                    "{} imports crate::{dep}: `{module}` may import only {:?}",
                    file.display(),
                    ok
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
}

#[test]
fn the_layering_table_has_no_circle() {
    let deps: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    // Depth-first search with colours: 1 = on the current path, 2 = done.
    fn visit<'a>(
        m: &'a str,
        deps: &BTreeMap<&'a str, &'a [&'a str]>,
        colour: &mut BTreeMap<&'a str, u8>,
        path: &mut Vec<&'a str>,
    ) {
        match colour.get(m) {
            Some(2) => return,
            Some(1) => panic!("circle: {} -> {m}", path.join(" -> ")),
            _ => {}
        }
        colour.insert(m, 1);
        path.push(m);
        for d in deps.get(m).copied().unwrap_or_default() {
            visit(d, deps, colour, path);
        }
        path.pop();
        colour.insert(m, 2);
    }
    let mut colour = BTreeMap::new();
    for m in deps.keys() {
        visit(m, &deps, &mut colour, &mut Vec::new());
    }
}

/// The text with comments, string and char literals blanked, so braces and paths in them
/// do not count.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').map_or(b.len(), |n| i + n);
            i = end;
        } else if rest.starts_with("/*") {
            let end = rest.find("*/").map_or(b.len(), |n| i + n + 2);
            i = end;
        } else if rest.starts_with("r#\"") || rest.starts_with("r\"") {
            let hashes = rest[1..].chars().take_while(|c| *c == '#').count();
            let close = format!("\"{}", "#".repeat(hashes));
            let start = i + 2 + hashes;
            i = text[start..]
                .find(&close)
                .map_or(b.len(), |n| start + n + close.len());
            out.push(' ');
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else if b[i] == b'\'' && (rest.get(2..3) == Some("'") || rest.starts_with("'\\")) {
            // A char literal ('x', '\n', '\u{..}'); a lifetime has no closing quote here.
            let end = rest[1..].find('\'').map_or(b.len(), |n| i + n + 2);
            i = end;
            out.push(' ');
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

fn tokens(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = code.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c.is_alphanumeric() || c == '_' {
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = chars.peek() {
                if d.is_alphanumeric() || d == '_' {
                    end = j + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            out.push(code[i..end].to_string());
        } else if c == ':' && chars.peek().is_some_and(|&(_, d)| d == ':') {
            chars.next();
            out.push("::".into());
        } else if !c.is_whitespace() {
            out.push(c.to_string());
        }
    }
    out
}

/// The paths of a `use` tree or path expression starting at `toks[i]` (an identifier),
/// each as its identifiers; returns them and the index after the tree.
fn path_tree(
    toks: &[String],
    mut i: usize,
    prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    let mut path = prefix;
    loop {
        let Some(t) = toks.get(i) else {
            out.push(path);
            return i;
        };
        if t == "{" {
            i += 1;
            while toks.get(i).is_some_and(|t| t != "}") {
                if toks[i] == "," {
                    i += 1;
                    continue;
                }
                i = path_tree(toks, i, path.clone(), out);
                // Skip `as name` and anything else up to the next element.
                while toks.get(i).is_some_and(|t| t != "," && t != "}") {
                    i += 1;
                }
            }
            return i + 1;
        }
        if t == "*" {
            out.push(path);
            return i + 1;
        }
        if !(t.chars().all(|c| c.is_alphanumeric() || c == '_')) {
            out.push(path);
            return i;
        }
        if t != "self" || path.is_empty() {
            path.push(t.clone());
        }
        if toks.get(i + 1).is_some_and(|t| t == "::") {
            i += 2;
        } else {
            out.push(path);
            return i + 1;
        }
    }
}

/// A file's module path: src/train/rl/loss.rs → [train, rl, loss]; a mod.rs names its folder.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// The file holding the longest module prefix of `path`.
fn file_of(src: &Path, path: &[String]) -> Option<PathBuf> {
    (0..=path.len()).rev().find_map(|n| {
        let rel: PathBuf = path[..n].iter().collect();
        let candidates = if n == 0 {
            vec![src.join("lib.rs")]
        } else {
            vec![
                src.join(&rel).with_extension("rs"),
                src.join(&rel).join("mod.rs"),
            ]
        };
        candidates.into_iter().find(|p| p.is_file())
    })
}

/// file → (imported file → nothing), over every `crate::`, `super::` and `self::` path,
/// inline modules (`mod tests { use super::*; }`) resolved where they stand. A folder's
/// `mod.rs` is its face: its `mod` declarations and re-exports of its own files are not
/// edges.
fn file_graph(src: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph = BTreeMap::new();
    for f in &files {
        let toks = tokens(&code_only(&std::fs::read_to_string(f).unwrap()));
        let base = module_of(src, f);
        let is_face = f.ends_with("mod.rs") || f.ends_with("lib.rs");
        let face_dir = f.parent().unwrap();
        let mut inline: Vec<(String, usize)> = Vec::new();
        let mut depth = 0usize;
        let mut edges = BTreeSet::new();
        let mut i = 0;
        while i < toks.len() {
            let t = toks[i].as_str();
            match t {
                "{" => depth += 1,
                "}" => {
                    if inline.last().is_some_and(|(_, d)| *d == depth) {
                        inline.pop();
                    }
                    depth = depth.saturating_sub(1);
                }
                "mod" if toks.get(i + 2).is_some_and(|t| t == "{") => {
                    inline.push((toks[i + 1].clone(), depth + 1));
                }
                "crate" | "super" | "self"
                    if toks.get(i + 1).is_some_and(|t| t == "::")
                        && !(i > 0 && toks[i - 1] == "::") =>
                {
                    let mut here: Vec<String> = base.clone();
                    here.extend(inline.iter().map(|(m, _)| m.clone()));
                    let mut j = i;
                    let mut root = if t == "crate" { Vec::new() } else { here };
                    while toks
                        .get(j)
                        .is_some_and(|t| t == "super" || t == "self" || t == "crate")
                    {
                        if toks[j] == "super" {
                            root.pop();
                        }
                        j += 2;
                        if toks.get(j - 1).is_none_or(|t| t != "::") {
                            break;
                        }
                    }
                    let mut paths = Vec::new();
                    let end = path_tree(&toks, j, root, &mut paths);
                    for p in paths {
                        if let Some(target) = file_of(src, &p) {
                            let own_file = is_face && target.starts_with(face_dir);
                            if target != *f && !own_file {
                                edges.insert(target);
                            }
                        }
                    }
                    i = end;
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
        graph.insert(f.clone(), edges);
    }
    graph
}

#[test]
fn no_file_imports_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = file_graph(&src);
    let name = |p: &PathBuf| p.strip_prefix(&src).unwrap().display().to_string();
    let mut colour: BTreeMap<&PathBuf, u8> = BTreeMap::new();
    let mut circles = Vec::new();
    fn visit<'a>(
        f: &'a PathBuf,
        graph: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        colour: &mut BTreeMap<&'a PathBuf, u8>,
        path: &mut Vec<&'a PathBuf>,
        circles: &mut Vec<Vec<&'a PathBuf>>,
    ) {
        match colour.get(f) {
            Some(2) => return,
            Some(1) => {
                let start = path.iter().position(|p| *p == f).unwrap();
                let mut circle = path[start..].to_vec();
                circle.push(f);
                circles.push(circle);
                return;
            }
            _ => {}
        }
        colour.insert(f, 1);
        path.push(f);
        for d in graph.get(f).into_iter().flatten() {
            visit(d, graph, colour, path, circles);
        }
        path.pop();
        colour.insert(f, 2);
    }
    for f in graph.keys() {
        visit(f, &graph, &mut colour, &mut Vec::new(), &mut circles);
    }
    let text: Vec<String> = circles
        .iter()
        .map(|c| c.iter().map(|p| name(p)).collect::<Vec<_>>().join(" → "))
        .collect();
    assert!(
        text.is_empty(),
        "files import in a circle:\n{}",
        text.join("\n")
    );
}

#[test]
fn the_file_graph_sees_real_imports() {
    // The parser finds what it must: a `use super::{..}` group, an inline test module's
    // `super::`, and a `crate::` path.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = file_graph(&src);
    let edges = |f: &str| graph[&src.join(f)].clone();
    assert!(edges("engine/runtime.rs").contains(&src.join("engine/llama.rs")));
    assert!(edges("engine/runtime.rs").contains(&src.join("engine/test_util.rs")));
    assert!(edges("llm/local.rs").contains(&src.join("engine/scheduler.rs")));
}

#[test]
fn at_most_two_loose_files_beside_lib() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let loose: Vec<String> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && !p.ends_with("lib.rs"))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(loose.len() <= 2, "loose files in src/: {loose:?}");
}

/// The module order ARCHITECTURE.md and lib.rs state ("`a` → `b` → …") is the order of the
/// table above: each module imports only modules before it in the stated order (or the leaf
/// utilities), so the map a newcomer reads is the one this test enforces.
#[test]
fn the_stated_layer_order_is_the_enforced_one() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let leaves = ["check", "run", "cli", "serve"];
    for doc in ["ARCHITECTURE.md", "src/lib.rs"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        let flat = text.replace("//!", " ").replace('\n', " ");
        let start = flat.find("`engine`").expect("the order starts at `engine`");
        let order: Vec<&str> = flat[start..]
            .split('→')
            .map_while(|part| {
                let part = part.trim_start();
                let name = part.strip_prefix('`')?.split('`').next()?;
                Some(name)
            })
            .collect();
        let stated: BTreeSet<&str> = order.iter().copied().collect();
        for (module, deps) in ALLOWED {
            if leaves.contains(module) {
                continue;
            }
            let pos = order.iter().position(|m| m == module).unwrap_or_else(|| {
                panic!("{doc}: `{module}` is missing from the stated order {order:?}")
            });
            for dep in deps.iter().filter(|d| !leaves.contains(d)) {
                let before = order.iter().position(|m| m == dep);
                assert!(
                    before.is_some_and(|b| b < pos),
                    "{doc}: `{module}` imports `{dep}`, which the stated order {order:?} does \
                     not put before it"
                );
            }
        }
        assert!(stated.len() >= 10, "{doc}: {order:?}");
    }
}

/// Code comments and docs say why, in words: no file of the library, the binaries, the tests,
/// the scripts or the docs points a reader at an issue number (the tracker is not part of the
/// product), and no doc is a dated diary (git history keeps when things happened).
#[test]
fn no_source_file_names_an_issue_number() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "bin", "tests", "scripts", "docs"] {
        project_files(&root.join(dir), &mut files);
    }
    for doc in ["README.md", "ARCHITECTURE.md", "BENCHMARKS.md"] {
        files.push(root.join(doc));
    }
    let mut found = Vec::new();
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue; // figures and other binary files
        };
        for (n, line) in text.lines().enumerate() {
            let lower = line.to_lowercase();
            let mut rest = lower.as_str();
            while let Some(i) = rest.find("issue") {
                let after = rest[i + 5..].trim_start_matches(['s', ' ', '#']);
                if after.starts_with(|c: char| c.is_ascii_digit()) {
                    found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                    break;
                }
                rest = &rest[i + 5..];
            }
            if f.extension().is_some_and(|e| e == "md") && has_iso_date(line) {
                found.push(format!("{}:{}: dated: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "issue numbers or dated diary lines:\n{}",
        found.join("\n")
    );
}

/// The docs stay a map a reader can hold: the README and BENCHMARKS within their sizes (one
/// current table per benchmark, history in git), ARCHITECTURE one page of recipes.
#[test]
fn the_docs_stay_within_their_sizes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (doc, most) in [
        ("README.md", 250),
        ("BENCHMARKS.md", 300),
        ("ARCHITECTURE.md", 160),
    ] {
        let lines = std::fs::read_to_string(root.join(doc))
            .unwrap()
            .lines()
            .count();
        assert!(lines <= most, "{doc} has {lines} lines (at most {most})");
    }
    let architecture = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    for recipe in [
        "A model family",
        "A task type",
        "A metric",
        "An RL loss",
        "A setting",
        "A binary flag",
    ] {
        assert!(
            architecture.contains(&format!("**{recipe}")),
            "ARCHITECTURE.md lacks the recipe `{recipe}`"
        );
    }
}

/// A task type is a row of facts in `task/kind.rs`, not a branch in every stage: outside their
/// tests, at most 8 files of the library and binaries name a `TaskType` variant.
#[test]
fn few_files_branch_on_a_task_type() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    rust_files(&root.join("bin"), &mut files);
    let variants = ["Math", "DocEdit", "Code", "TwentyQuestions", "Clarify"];
    let naming: Vec<String> = files
        .iter()
        .filter(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            variants.iter().any(|v| {
                code.match_indices(&format!("TaskType::{v}"))
                    .any(|(i, m)| !code[i + m.len()..].starts_with(char::is_alphanumeric))
            })
        })
        .map(|f| f.strip_prefix(root).unwrap_or(f).display().to_string())
        .collect();
    assert!(naming.len() <= 8, "{} files: {naming:?}", naming.len());
}
