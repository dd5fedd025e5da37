//! Programmatic answer checking for math tasks: pull the final answer out of a conversation
//! (the last `\boxed{...}`, else the last number) and compare it numerically with the reference.
//!
//! Every function returns `None` rather than guessing when a side is not a plain number
//! (an expression, an interval, a word answer): the caller then relies on the LLM judge alone
//! (metric `accuracy`).

use std::sync::LazyLock;

use regex::Regex;

/// Relative tolerance of [`answers_match`].
pub const RELATIVE_TOLERANCE: f64 = 1e-6;
/// Absolute tolerance used when both values are (nearly) zero.
pub const ABSOLUTE_TOLERANCE: f64 = 1e-12;

/// A number inside free text: thousands-separated, fraction, decimal or integer, optionally
/// signed and followed by `%`. The thousands alternative must end on a word boundary so that
/// `1,2345` is not read as `1,234`.
static NUMBER_IN_TEXT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"[-−]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?\b|\d+\s*/\s*\d+|\d+(?:\.\d+)?|\.\d+)(?:\s*\\?%)?",
    )
    .expect("static number pattern compiles")
});

/// Thousands separators in a bare number: `1,234` or `-12,345,678.9`.
static THOUSANDS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?$").expect("static thousands pattern compiles")
});

/// The contents of the last `\boxed{...}` (or `\fbox{...}`) with balanced braces, trimmed.
/// `\boxed 5` (no braces) yields the following token. `None` when there is no complete box.
pub fn last_boxed(text: &str) -> Option<String> {
    let mut best: Option<String> = None;
    let mut search_from = 0;
    while let Some(pos) = find_box_command(text, search_from) {
        let (cmd_end, content) = pos;
        search_from = cmd_end;
        if let Some(c) = content {
            best = Some(c);
        }
    }
    best
}

/// Finds the next `\boxed` / `\fbox` at or after `from`; returns the index after the command
/// name and the box contents if they are complete.
fn find_box_command(text: &str, from: usize) -> Option<(usize, Option<String>)> {
    let rest = text.get(from..)?;
    let (rel, name_len) = ["\\boxed", "\\fbox"]
        .iter()
        .filter_map(|name| rest.find(name).map(|i| (i, name.len())))
        .min_by_key(|&(i, _)| i)?;
    let cmd_end = from + rel + name_len;
    let after = &text[cmd_end..];
    let trimmed = after.trim_start();
    if let Some(inner) = trimmed.strip_prefix('{') {
        let mut depth = 1usize;
        for (i, ch) in inner.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some((cmd_end, Some(inner[..i].trim().to_owned())));
                    }
                }
                _ => {}
            }
        }
        Some((cmd_end, None))
    } else if after.starts_with(' ') {
        // `\boxed 5`: the next whitespace-delimited token, without a trailing `$` or `.`.
        let token = trimmed
            .split(|c: char| c.is_whitespace() || c == '$')
            .next()
            .unwrap_or("")
            .trim_end_matches('.');
        Some((cmd_end, (!token.is_empty()).then(|| token.to_owned())))
    } else {
        // `\boxedfoo` or a box at the very end: not an answer.
        Some((cmd_end, None))
    }
}

/// The last number written in `text`, as written (`"1,234"`, `"-2.5"`, `"3/4"`, `"45%"`).
/// A `-` directly after a letter, digit or closing bracket is a hyphen or minus operator, not a
/// sign (`"pages 3-4"` → `"4"`).
pub fn last_number(text: &str) -> Option<String> {
    let m = NUMBER_IN_TEXT.find_iter(text).last()?;
    let mut s = m.as_str();
    if s.starts_with(['-', '−']) {
        let prev = text[..m.start()].chars().next_back();
        if prev.is_some_and(|p| p.is_alphanumeric() || matches!(p, ')' | ']' | '}')) {
            s = s.trim_start_matches(['-', '−']);
        }
    }
    Some(s.replace('−', "-"))
}

/// The final answer of a solution or conversation: the contents of the last `\boxed{...}`
/// (balanced braces, so `\boxed{\frac{3}{4}}` gives `\frac{3}{4}`) if there is one, else the
/// last number in the text (integers, decimals, negatives, thousands separators, simple
/// fractions, percentages). `None` when neither exists.
pub fn extract_final_answer(text: &str) -> Option<String> {
    last_boxed(text).or_else(|| last_number(text))
}

/// Removes `\cmd{...}` wrappers whose argument is text (units, words): `\text{ cm}` → ``, but
/// `\text{5}` → `5`.
fn strip_text_commands(s: &str) -> String {
    let mut out = s.to_owned();
    for cmd in [
        "\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\mbox", "\\textrm",
    ] {
        while let Some(start) = find_command(&out, cmd) {
            let open = start + cmd.len();
            let Some(close) = matching_brace(&out, open) else {
                break;
            };
            let inner = out[open + 1..close].trim().to_owned();
            let keep = if inner.chars().any(|c| c.is_ascii_digit()) {
                inner
            } else {
                String::new()
            };
            out.replace_range(start..=close, &keep);
        }
    }
    out
}

/// Position of `cmd` followed by `{` (so `\text` does not match `\textbf{`).
fn find_command(s: &str, cmd: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(rel) = s.get(from..)?.find(cmd) {
        let at = from + rel;
        if s[at + cmd.len()..].starts_with('{') {
            return Some(at);
        }
        from = at + cmd.len();
    }
    None
}

/// Index of the `}` matching the `{` at byte `open`.
fn matching_brace(s: &str, open: usize) -> Option<usize> {
    if !s[open..].starts_with('{') {
        return None;
    }
    let mut depth = 0usize;
    for (i, ch) in s[open..].char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i);
                }
            }
            _ => {}
        }
    }
    None
}

/// A plain decimal literal: optional sign, digits with at most one point, optional exponent.
/// Rejects `inf`, `nan`, hex and anything else Rust's float parser would accept.
fn parse_plain(s: &str) -> Option<f64> {
    let body = s.strip_prefix(['+', '-']).unwrap_or(s);
    let (mantissa, exponent) = match body.find(['e', 'E']) {
        Some(i) => (&body[..i], Some(&body[i + 1..])),
        None => (body, None),
    };
    let digits = mantissa.chars().filter(char::is_ascii_digit).count();
    let points = mantissa.chars().filter(|&c| c == '.').count();
    if digits == 0 || points > 1 || digits + points != mantissa.len() {
        return None;
    }
    if let Some(e) = exponent {
        let e = e.strip_prefix(['+', '-']).unwrap_or(e);
        if e.is_empty() || !e.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
    }
    s.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// `\frac{a}{b}`, `\dfrac{a}{b}`, `\tfrac{a}{b}` and the shorthand `\frac34`, optionally signed.
fn parse_latex_frac(s: &str) -> Option<f64> {
    let (sign, body) = match s.strip_prefix('-') {
        Some(rest) => (-1.0, rest),
        None => (1.0, s.strip_prefix('+').unwrap_or(s)),
    };
    let rest = ["\\dfrac", "\\tfrac", "\\frac"]
        .iter()
        .find_map(|cmd| body.strip_prefix(cmd))?;
    let (num, after_num) = latex_arg(rest)?;
    let (den, after_den) = latex_arg(after_num)?;
    if !after_den.is_empty() {
        return None;
    }
    let n = parse_number(num)?;
    let d = parse_number(den)?;
    (d != 0.0)
        .then(|| sign * n / d)
        .filter(|v: &f64| v.is_finite())
}

/// One LaTeX macro argument: `{...}` (balanced) or a single character. Returns it and the rest.
fn latex_arg(s: &str) -> Option<(&str, &str)> {
    if s.starts_with('{') {
        let close = matching_brace(s, 0)?;
        Some((&s[1..close], &s[close + 1..]))
    } else {
        let c = s.chars().next()?;
        Some(s.split_at(c.len_utf8()))
    }
}

/// Parses an answer string as a number after normalisation: math delimiters (`$`, `\(`, `\[`),
/// a leading `x =`, currency `$`/`\$`, `%`/`\%`, degree marks, LaTeX spacing, unit text in
/// `\text{...}`, thousands separators (`1,234`, `1{,}234`), a trailing period, one pair of
/// enclosing braces; then a plain decimal, `a/b`, or `\frac{a}{b}` / `\dfrac` / `\tfrac`.
/// A percentage is compared by its number (`45%` → 45). `None` when the result is not a number.
pub fn parse_number(answer: &str) -> Option<f64> {
    let mut s = strip_text_commands(answer.trim());
    // Math delimiters and LaTeX spacing / sizing commands.
    for token in [
        "\\(",
        "\\)",
        "\\[",
        "\\]",
        "\\left",
        "\\right",
        "\\!",
        "\\,",
        "\\;",
        "\\:",
        "\\ ",
        "{,}",
        "\\$",
        "$",
        "\\%",
        "%",
        "^{\\circ}",
        "^\\circ",
        "\\circ",
        "°",
        "\\displaystyle",
    ] {
        if token == "{,}" {
            s = s.replace(token, ",");
        } else {
            s = s.replace(token, "");
        }
    }
    s = s.replace('−', "-");
    // `x = 5` → `5` (the last side of a chain of equalities).
    // A comma on the left means several assignments (`x=1, y=2`): not one number.
    if let Some(i) = s.rfind('=') {
        if s[..i].contains(',') {
            return None;
        }
        s = s[i + 1..].to_owned();
    }
    let mut s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    while s.ends_with('.') {
        s.pop();
    }
    // One pair of enclosing braces: `{5}`.
    if s.starts_with('{') && matching_brace(&s, 0) == Some(s.len() - 1) {
        s = s[1..s.len() - 1].to_owned();
    }
    if s.is_empty() {
        return None;
    }
    if THOUSANDS.is_match(&s) {
        s = s.replace(',', "");
    }
    if s.contains('\\') {
        return parse_latex_frac(&s);
    }
    if let Some((num, den)) = s.split_once('/') {
        let n = parse_plain(num)?;
        let d = parse_plain(den)?;
        return (d != 0.0).then(|| n / d).filter(|v| v.is_finite());
    }
    parse_plain(&s)
}

/// Whether two answers are the same number: both are normalised with [`parse_number`] and
/// compared with relative tolerance [`RELATIVE_TOLERANCE`] (absolute [`ABSOLUTE_TOLERANCE`]
/// near zero). `None` when either side does not parse as a number.
pub fn answers_match(candidate: &str, reference: &str) -> Option<bool> {
    let a = parse_number(candidate)?;
    let b = parse_number(reference)?;
    let scale = a.abs().max(b.abs());
    Some((a - b).abs() <= (RELATIVE_TOLERANCE * scale).max(ABSOLUTE_TOLERANCE))
}

/// Programmatic accuracy check of a math conversation: the final answer extracted from
/// `conversation_final_text` (see [`extract_final_answer`]) against `reference`, which may be a
/// bare answer (`"42"`, `"\frac{3}{4}"`) or a worked solution ending in `\boxed{...}` or
/// `#### 42`. `None` when either answer is missing or not numeric (use the LLM judge then).
pub fn check_math(conversation_final_text: &str, reference: &str) -> Option<bool> {
    let candidate = extract_final_answer(conversation_final_text)?;
    let reference_answer = if parse_number(reference).is_some() {
        reference.to_owned()
    } else {
        extract_final_answer(reference)?
    };
    answers_match(&candidate, &reference_answer)
}

/// A stated final answer: "final answer" or "the answer is", then the rest of the line.
static STATED_ANSWER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(?:\bfinal answer\b|\bthe answer is\b)[ \t]*(?:is\b|:|=)?[ \t]*([^\n]*)")
        .expect("static stated-answer pattern compiles")
});

/// The answer written after a stated-answer phrase: a box inside it, the whole clause when it
/// is one number (`$\frac{3}{4}$.`), else its first number (`42 apples`).
fn stated_answer(rest: &str) -> Option<String> {
    if let Some(b) = last_boxed(rest) {
        return Some(b);
    }
    let clause = rest.trim().trim_end_matches(['.', '!']).trim();
    if parse_number(clause).is_some() {
        return Some(clause.to_owned());
    }
    NUMBER_IN_TEXT
        .find(rest)
        .map(|m| m.as_str().replace('−', "-"))
}

/// The explicit final answer of one message: whichever comes last of its last complete
/// `\boxed{…}` and its last stated answer ("… final answer is 42", "The answer is: 7").
/// A bare number is not an explicit answer (`None`): in a conversation the last number is
/// often a follow-up ("want two more examples?").
pub fn explicit_answer(text: &str) -> Option<String> {
    let mut best: Option<(usize, String)> = None;
    let mut from = 0;
    while let Some((cmd_end, content)) = find_box_command(text, from) {
        from = cmd_end;
        if let Some(c) = content {
            best = Some((cmd_end, c));
        }
    }
    for caps in STATED_ANSWER.captures_iter(text) {
        let (Some(whole), Some(rest)) = (caps.get(0), caps.get(1)) else {
            continue;
        };
        if best.as_ref().is_some_and(|(at, _)| *at > whole.start()) {
            continue;
        }
        if let Some(a) = stated_answer(rest.as_str()) {
            best = Some((whole.start(), a));
        }
    }
    best.map(|(_, a)| a)
}

/// The programmatic second opinion on a math conversation: the explicit final answer of the
/// latest assistant message that has one (see [`explicit_answer`]), compared with
/// `reference`. `None` when no message states an answer or either side is not a number.
/// Returns the answer found and whether it matches.
pub fn check_explicit_answer<'a>(
    assistant_messages: impl DoubleEndedIterator<Item = &'a str>,
    reference: &str,
) -> Option<(String, bool)> {
    let answer = assistant_messages.rev().find_map(explicit_answer)?;
    let reference_answer = if parse_number(reference).is_some() {
        reference.to_owned()
    } else {
        extract_final_answer(reference)?
    };
    let ok = answers_match(&answer, &reference_answer)?;
    Some((answer, ok))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_answers_only() {
        assert_eq!(explicit_answer("So x = 3. Want two more examples?"), None);
        assert_eq!(
            explicit_answer("Thus \\boxed{42}. Want 2 more?"),
            Some("42".into())
        );
        assert_eq!(
            explicit_answer("The final answer is 12 apples. Shall I explain step 3?"),
            Some("12".into())
        );
        assert_eq!(
            explicit_answer("Final answer: $\\frac{3}{4}$."),
            Some("$\\frac{3}{4}$".into())
        );
        // The later of a box and a stated answer wins.
        assert_eq!(
            explicit_answer("First \\boxed{5}, but the answer is 6 after all."),
            Some("6".into())
        );
        assert_eq!(
            explicit_answer("The answer is 6? No: \\boxed{7}"),
            Some("7".into())
        );
        // A follow-up message after the answer does not hide it; the latest answer wins.
        let msgs = [
            "The answer is 4.",
            "\\boxed{5}",
            "Would you like two more examples?",
        ];
        assert_eq!(
            check_explicit_answer(msgs.iter().copied(), "5"),
            Some(("5".into(), true))
        );
        assert_eq!(
            check_explicit_answer(["Let me know if 7 helps."].into_iter(), "7"),
            None
        );
    }

    fn ans(s: &str) -> Option<String> {
        extract_final_answer(s)
    }

    #[test]
    fn boxed_takes_the_last_box_with_balanced_braces() {
        assert_eq!(ans("So \\boxed{42}."), Some("42".into()));
        assert_eq!(
            ans("first \\boxed{1} then \\boxed{2} and 3"),
            Some("2".into())
        );
        assert_eq!(ans("$\\boxed{\\frac{3}{4}}$"), Some("\\frac{3}{4}".into()));
        assert_eq!(
            ans("\\boxed{ {1,2} \\cup \\{3\\} }"),
            Some("{1,2} \\cup \\{3\\}".into())
        );
        assert_eq!(ans("The answer is $\\boxed 7$."), Some("7".into()));
        assert_eq!(ans("\\fbox{12}"), Some("12".into()));
        // An unclosed box is ignored: fall back to the last number.
        assert_eq!(ans("\\boxed{5} and then \\boxed{6"), Some("5".into()));
        assert_eq!(ans("x = 3 \\boxed{"), Some("3".into()));
    }

    #[test]
    fn last_number_forms() {
        assert_eq!(ans("There are 12 apples and 30 pears."), Some("30".into()));
        assert_eq!(ans("It costs $1,234.50 in total."), Some("1,234.50".into()));
        assert_eq!(ans("The temperature is -5 degrees"), Some("-5".into()));
        assert_eq!(ans("about −2.5 now"), Some("-2.5".into()));
        assert_eq!(ans("Read pages 3-4"), Some("4".into()));
        assert_eq!(ans("x-1"), Some("1".into()));
        assert_eq!(ans("She ate 3/4 of the pie"), Some("3/4".into()));
        assert_eq!(ans("a 45% increase"), Some("45%".into()));
        assert_eq!(ans("the list 1,2,3"), Some("3".into()));
        assert_eq!(ans("1,2345"), Some("2345".into()));
        assert_eq!(ans("value .5 only"), Some(".5".into()));
        assert_eq!(ans("#### 72"), Some("72".into()));
        assert_eq!(ans("The answer is 42."), Some("42".into()));
        assert_eq!(ans("no numbers here"), None);
        assert_eq!(ans(""), None);
    }

    #[test]
    fn parse_number_normalises() {
        let cases: &[(&str, f64)] = &[
            ("42", 42.0),
            ("-42", -42.0),
            ("+3", 3.0),
            ("3.", 3.0),
            ("1,234", 1234.0),
            ("1,234,567.25", 1_234_567.25),
            ("1{,}234", 1234.0),
            ("$5", 5.0),
            ("\\$5.00", 5.0),
            ("45%", 45.0),
            ("45\\%", 45.0),
            ("3/4", 0.75),
            ("\\frac{3}{4}", 0.75),
            ("\\dfrac{3}{4}", 0.75),
            ("\\tfrac12", 0.5),
            ("-\\frac{1}{2}", -0.5),
            ("\\frac{-1}{2}", -0.5),
            ("\\frac{1,000}{4}", 250.0),
            ("x = 5", 5.0),
            ("$x=\\frac{7}{2}$", 3.5),
            ("\\(12\\)", 12.0),
            ("90^\\circ", 90.0),
            ("90°", 90.0),
            ("5\\text{ cm}", 5.0),
            ("\\text{5}", 5.0),
            ("{18}", 18.0),
            ("1e3", 1000.0),
            ("1 000", 1000.0),
        ];
        for &(s, v) in cases {
            let got = parse_number(s);
            assert!(
                got.is_some_and(|g| (g - v).abs() < 1e-12),
                "{s:?}: got {got:?}, expected {v}"
            );
        }
        for s in [
            "",
            "abc",
            "x+1",
            "inf",
            "NaN",
            "infinity",
            "1,2",
            "1/0",
            "\\frac{1}{0}",
            "\\sqrt{2}",
            "3x",
            "(1, 2)",
            "2^{10}",
            "1.2.3",
            "--5",
            "0x10",
            "\\frac{1}{2}x",
            "five",
            "x=1, y=2",
        ] {
            assert_eq!(parse_number(s), None, "{s:?} should not parse");
        }
    }

    #[test]
    fn answers_match_tolerance_and_none() {
        assert_eq!(answers_match("0.75", "\\frac{3}{4}"), Some(true));
        assert_eq!(answers_match("1,000", "1000"), Some(true));
        assert_eq!(answers_match("$1,000.00", "1000"), Some(true));
        assert_eq!(answers_match("50%", "50"), Some(true));
        assert_eq!(answers_match("42.", "42"), Some(true));
        assert_eq!(answers_match("0.3333333333", "1/3"), Some(true));
        assert_eq!(answers_match("0.33", "1/3"), Some(false));
        assert_eq!(answers_match("1000000.5", "1000000"), Some(true)); // within 1e-6 relative
        assert_eq!(answers_match("1000002", "1000000"), Some(false));
        assert_eq!(answers_match("0", "-0"), Some(true));
        assert_eq!(answers_match("0", "1e-9"), Some(false));
        assert_eq!(answers_match("-3", "3"), Some(false));
        assert_eq!(answers_match("x+1", "2"), None);
        assert_eq!(answers_match("2", "\\sqrt{4}"), None);
        assert_eq!(answers_match("", ""), None);
    }

    #[test]
    fn check_math_end_to_end() {
        let conv = "Assistant: Let me compute. 3 + 4 = 7, so doubling gives 14.\nThe answer is \\boxed{14}.";
        assert_eq!(check_math(conv, "14"), Some(true));
        assert_eq!(check_math(conv, "15"), Some(false));
        // Reference is a worked solution with a box or GSM8K's `####`.
        assert_eq!(
            check_math(conv, "We add and double: \\boxed{14}"),
            Some(true)
        );
        assert_eq!(check_math(conv, "3+4=7\n7*2=14\n#### 14"), Some(true));
        // No box: the last number of the conversation counts.
        assert_eq!(
            check_math("So she has 1,250 dollars left.", "1250"),
            Some(true)
        );
        assert_eq!(
            check_math("That is \\boxed{\\dfrac{1}{4}} of the cake", "0.25"),
            Some(true)
        );
        // Non-numeric answers or missing ones are left to the judge.
        assert_eq!(check_math("\\boxed{x^2+1}", "x^2+1"), None);
        assert_eq!(check_math("I'm not sure.", "12"), None);
        assert_eq!(check_math("It is 12", "twelve"), None);
    }
}
