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
    // Vectorized element-wise kernels (exp, the ISA dispatch) of training ops and attention.
    ("simd", &[]),
    // Task types, task files (read with the parquet helpers of `dataset`, which never
    // imports task) and the prompt templates of each task type.
    ("task", &["check", "dataset", "llm", "run"]),
    ("llm", &["check", "run", "simd"]),
    ("serve", &["check", "llm", "run", "task"]),
    ("reward", &["check", "llm", "run", "task"]),
    ("rollout", &["check", "llm", "reward", "run", "task"]),
    ("dataset", &["check", "llm", "run"]),
    ("hub", &["check", "dataset", "llm", "reward", "run", "task"]),
    (
        "generate",
        &[
            "check", "dataset", "hub", "llm", "reward", "rollout", "run", "task",
        ],
    ),
    // rl_train validates its rollout half through generate_conv's config (one definition of
    // the roles, futures and judge settings); nothing else in train touches generate.
    (
        "train",
        &[
            "check", "dataset", "generate", "hub", "llm", "reward", "rollout", "run", "simd",
            "task",
        ],
    ),
    (
        "eval",
        &[
            "check", "dataset", "llm", "reward", "rollout", "run", "task",
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
