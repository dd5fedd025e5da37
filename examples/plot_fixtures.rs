//! Writes the fixture directories the README gallery is drawn from:
//! `<out>/twenty_questions` (reference vs random questioners over all 158 objects, table
//! oracle, 20 questions), in eval_multiturn's format.
//!
//! `cargo run --release --example plot_fixtures -- <out>`

#[path = "../tests/common/plot_fixtures.rs"]
mod plot_fixtures;

fn main() {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "outputs/plot_fixtures".into());
    let dir = std::path::Path::new(&out).join("twenty_questions");
    plot_fixtures::write_twenty_questions_eval(&dir, None, 20);
    println!("{}", dir.display());
}
