//! Lenient parsing of LLM output: judge / extractor JSON, fenced code and documents.
//!
//! Judges are asked for one JSON object, but models wrap it in prose or Markdown fences, use
//! Python literals or single quotes, leave trailing commas, forget a comma, or get cut off.
//! [`parse_json_object`] accepts all of that; when nothing usable is found it returns `None`
//! and the caller counts a judge failure (never a silent 0).

use serde_json::{Map, Value};

/// The JSON object in a model's answer.
///
/// Tries, in order, and returns the first that yields an object:
/// 1. the text from the first `{` to the last `}` as strict JSON;
/// 2. the same span after [`repair_json`] (single quotes, trailing commas, Python
///    `True/False/None`, unquoted keys, comments, missing commas, raw newlines in strings);
/// 3. each top-level balanced `{...}` span of the text, strict then repaired (prose with its own
///    braces around the object, or several objects);
/// 4. a truncated answer (no closing brace) closed automatically.
pub fn parse_json_object(raw: &str) -> Option<Map<String, Value>> {
    let start = raw.find('{')?;
    if let Some(end) = raw.rfind('}').filter(|&e| e > start) {
        let span = &raw[start..=end];
        if let Some(obj) = strict_object(span).or_else(|| strict_object(&repair_json(span))) {
            return Some(obj);
        }
    }
    for span in balanced_spans(raw) {
        if let Some(obj) = strict_object(span).or_else(|| strict_object(&repair_json(span))) {
            return Some(obj);
        }
    }
    strict_object(&close_truncated(&repair_json(&raw[start..]))).filter(|m| !m.is_empty())
}

/// A numeric score under `key` (exact key, else the first key equal ignoring ASCII case),
/// accepted only inside `range` (inclusive) and finite. Accepts a JSON number, a numeric string
/// (`"0.8"`), a boolean (`true` = 1, `false` = 0), or an object holding such a value under
/// `"score"` (`{"accuracy": {"thought": "...", "score": 1}}`).
pub fn score_field(obj: &Map<String, Value>, key: &str, range: (f64, f64)) -> Option<f64> {
    let value = obj.get(key).or_else(|| {
        obj.iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v)
    })?;
    let x = value_as_f64(value)?;
    (x.is_finite() && range.0 <= x && x <= range.1).then_some(x)
}

fn value_as_f64(value: &Value) -> Option<f64> {
    match value {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok().filter(|x| x.is_finite()),
        Value::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
        Value::Object(inner) => inner
            .get("score")
            .filter(|v| !v.is_object())
            .and_then(value_as_f64),
        _ => None,
    }
}

/// The body of the last fenced code block that is Python (info string `python`, `py`,
/// `python3`, `py3`) or untagged. An unclosed final fence (a cut-off answer) counts up to the end
/// of the text. `None` when there is no such block or it is blank.
pub fn extract_code(text: &str) -> Option<String> {
    fenced_blocks(text)
        .into_iter()
        .rev()
        .find(|b| {
            let lang = b.info.split_whitespace().next().unwrap_or("");
            let lang = lang.trim_start_matches(['{', '.']).trim_end_matches('}');
            matches!(
                lang.to_ascii_lowercase().as_str(),
                "" | "python" | "py" | "python3" | "py3"
            )
        })
        .map(|b| b.body)
        .filter(|body| !body.trim().is_empty())
}

/// A document extracted from a model's answer: the body of the last fenced block of any language
/// if there is one, else the whole text trimmed.
pub fn extract_fenced_or_all(text: &str) -> String {
    fenced_blocks(text)
        .into_iter()
        .rev()
        .find(|b| !b.body.trim().is_empty())
        .map(|b| b.body)
        .unwrap_or_else(|| text.trim().to_owned())
}

/// A Markdown fenced block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FencedBlock {
    /// The info string after the opening fence (`python`, `json`, ...), trimmed.
    pub info: String,
    /// The lines between the fences, with the fence's own indentation removed.
    pub body: String,
}

/// All fenced blocks (``` or ~~~, three or more) in order. A closing fence is a line of the
/// same character at least as long as the opening one; a code line ending in the fence also
/// closes the block (`print(1)```); an unclosed block runs to the end of the text.
pub fn fenced_blocks(text: &str) -> Vec<FencedBlock> {
    struct Open {
        ch: char,
        len: usize,
        indent: usize,
        info: String,
        lines: Vec<String>,
    }
    fn fence_run(s: &str) -> Option<(char, usize)> {
        let ch = s.chars().next().filter(|&c| c == '`' || c == '~')?;
        let len = s.chars().take_while(|&c| c == ch).count();
        (len >= 3).then_some((ch, len))
    }
    fn dedent(line: &str, indent: usize) -> String {
        let strip = line.chars().take(indent).take_while(|&c| c == ' ').count();
        line[strip..].to_owned()
    }
    fn finish(open: Open) -> FencedBlock {
        FencedBlock {
            info: open.info,
            body: open.lines.join("\n"),
        }
    }

    let mut blocks = Vec::new();
    let mut cur: Option<Open> = None;
    for raw_line in text.split('\n') {
        let line = raw_line.strip_suffix('\r').unwrap_or(raw_line);
        let t = line.trim_start();
        let indent = line.len() - t.len();
        match cur.take() {
            None => {
                if let Some((ch, len)) = fence_run(t) {
                    let info = t[len..].trim();
                    // A backtick fence's info string may not contain backticks; such a line is
                    // inline code (```x```), not a fence.
                    if !(ch == '`' && info.contains('`')) {
                        cur = Some(Open {
                            ch,
                            len,
                            indent,
                            info: info.to_owned(),
                            lines: Vec::new(),
                        });
                    }
                }
            }
            Some(mut open) => {
                let body = t.trim_end();
                let closes = fence_run(body).is_some_and(|(ch, len)| {
                    ch == open.ch && len >= open.len && body.chars().all(|c| c == ch)
                });
                if closes {
                    blocks.push(finish(open));
                    continue;
                }
                let fence: String = std::iter::repeat_n(open.ch, open.len).collect();
                let trimmed_end = line.trim_end();
                if open.ch == '`' && trimmed_end.ends_with(&fence) {
                    let code = &trimmed_end[..trimmed_end.len() - fence.len()];
                    let dedented = dedent(code, open.indent);
                    open.lines.push(dedented);
                    blocks.push(finish(open));
                    continue;
                }
                let dedented = dedent(line, open.indent);
                open.lines.push(dedented);
                cur = Some(open);
            }
        }
    }
    if let Some(open) = cur {
        blocks.push(finish(open));
    }
    blocks
}

fn strict_object(s: &str) -> Option<Map<String, Value>> {
    match serde_json::from_str::<Value>(s) {
        Ok(Value::Object(map)) => Some(map),
        _ => None,
    }
}

/// Top-level balanced `{...}` spans, tracking double-quoted strings.
fn balanced_spans(raw: &str) -> Vec<&str> {
    let mut spans = Vec::new();
    let mut depth = 0usize;
    let mut start = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, c) in raw.char_indices() {
        if depth > 0 && in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match c {
            '"' if depth > 0 => in_string = true,
            '{' => {
                if depth == 0 {
                    start = i;
                }
                depth += 1;
            }
            '}' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    spans.push(&raw[start..=i]);
                }
            }
            _ => {}
        }
    }
    spans
}

/// Closes what a cut-off (already repaired) JSON text left open: drops a dangling `,`, gives a
/// dangling key the value `null`, and appends the missing `]` / `}`.
fn close_truncated(s: &str) -> String {
    let mut stack = Vec::new();
    let mut in_string = false;
    let mut escaped = false;
    for c in s.chars() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' => stack.push('}'),
            '[' => stack.push(']'),
            '}' | ']' => {
                stack.pop();
            }
            _ => {}
        }
    }
    let mut out = s.trim_end().to_owned();
    if in_string {
        out.push('"');
    }
    while out.ends_with(',') {
        out.pop();
        out.truncate(out.trim_end().len());
    }
    if out.ends_with(':') {
        out.push_str(" null");
    }
    while let Some(closer) = stack.pop() {
        out.push(closer);
    }
    out
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Last {
    Nothing,
    Open,
    Colon,
    Comma,
    Value,
}

/// Rewrites near-JSON into JSON: single-quoted strings (apostrophes inside words stay), unescaped
/// inner double quotes, raw control characters and invalid escapes inside strings, Python
/// `True`/`False`/`None`, `NaN`/`Infinity` (→ `null`), unquoted keys and bare-word values,
/// `//` and `/* */` comments, trailing and doubled commas, missing commas between members,
/// numbers like `+1`, `.5`, `5.`. The result is not guaranteed to be valid JSON.
pub fn repair_json(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let n = chars.len();
    let mut out = String::with_capacity(s.len() + 16);
    let mut last = Last::Nothing;
    let mut i = 0;

    fn before_value(out: &mut String, last: &mut Last) {
        if *last == Last::Value {
            out.push(',');
        }
        *last = Last::Value;
    }

    while i < n {
        let c = chars[i];
        match c {
            '"' | '\'' => {
                before_value(&mut out, &mut last);
                i = copy_string(&chars, i, &mut out);
            }
            '{' | '[' => {
                before_value(&mut out, &mut last);
                out.push(c);
                last = Last::Open;
                i += 1;
            }
            '}' | ']' => {
                let kept = out.trim_end().len();
                if out[..kept].ends_with(',') {
                    out.truncate(kept - 1);
                }
                out.push(c);
                last = Last::Value;
                i += 1;
            }
            ':' => {
                out.push(':');
                last = Last::Colon;
                i += 1;
            }
            ',' => {
                if !matches!(last, Last::Comma | Last::Open | Last::Nothing) {
                    out.push(',');
                }
                last = Last::Comma;
                i += 1;
            }
            '/' if chars.get(i + 1) == Some(&'/') => {
                while i < n && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if chars.get(i + 1) == Some(&'*') => {
                i += 2;
                while i < n && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                    i += 1;
                }
                i = (i + 2).min(n);
            }
            c if c.is_whitespace() => {
                out.push(c);
                i += 1;
            }
            c if c.is_ascii_digit() || matches!(c, '-' | '+' | '.') => {
                let begin = i;
                while i < n
                    && (chars[i].is_ascii_digit()
                        || matches!(chars[i], '-' | '+' | '.' | 'e' | 'E'))
                {
                    i += 1;
                }
                let token: String = chars[begin..i].iter().collect();
                before_value(&mut out, &mut last);
                if serde_json::from_str::<serde_json::Number>(&token).is_ok() {
                    out.push_str(&token);
                } else if let Some(x) = token.parse::<f64>().ok().filter(|x| x.is_finite()) {
                    out.push_str(&Value::from(x).to_string());
                } else {
                    out.push_str(&Value::String(token).to_string());
                }
            }
            c if c.is_alphabetic() || c == '_' => {
                let begin = i;
                while i < n && (chars[i].is_alphanumeric() || matches!(chars[i], '_' | '-')) {
                    i += 1;
                }
                let word: String = chars[begin..i].iter().collect();
                let mut j = i;
                while j < n && chars[j].is_whitespace() {
                    j += 1;
                }
                let next = chars.get(j).copied();
                before_value(&mut out, &mut last);
                if next == Some(':') {
                    out.push_str(&Value::String(word).to_string());
                    continue;
                }
                let literal = match word.as_str() {
                    "true" | "True" | "TRUE" => Some("true"),
                    "false" | "False" | "FALSE" => Some("false"),
                    "null" | "None" | "none" | "NULL" | "Null" | "NaN" | "nan" | "Infinity" => {
                        Some("null")
                    }
                    _ => None,
                };
                let ends_value =
                    matches!(next, None | Some(',' | '}' | ']')) || chars[i..j].contains(&'\n');
                match literal {
                    Some(lit) if ends_value => out.push_str(lit),
                    _ => {
                        // A bare-word value: everything up to the next delimiter or line end.
                        let mut k = i;
                        while k < n && !matches!(chars[k], ',' | '}' | ']' | '\n') {
                            k += 1;
                        }
                        let text: String = chars[begin..k].iter().collect();
                        out.push_str(&Value::String(text.trim().to_owned()).to_string());
                        i = k;
                    }
                }
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// Copies the string starting at `chars[start]` (a `"` or `'`) to `out` as a JSON string and
/// returns the index after its closing quote.
///
/// A quote character closes the string only when what follows it (after spaces) can follow a
/// string in JSON: `:`, `}`, `]`, the end, or a `,` / newline that is followed by something
/// that can start a member or value. Other quotes are content: `"he said "hi" there"`,
/// `'it's'`.
fn copy_string(chars: &[char], start: usize, out: &mut String) -> usize {
    let quote = chars[start];
    let n = chars.len();
    let mut text = String::new();
    let mut i = start + 1;
    while i < n {
        let c = chars[i];
        if c == '\\' && i + 1 < n {
            let e = chars[i + 1];
            match e {
                '"' | '\\' | '/' | 'b' | 'f' | 'n' | 'r' | 't' => {
                    text.push(match e {
                        'b' => '\u{8}',
                        'f' => '\u{c}',
                        'n' => '\n',
                        'r' => '\r',
                        't' => '\t',
                        other => other,
                    });
                    i += 2;
                }
                '\'' => {
                    text.push('\'');
                    i += 2;
                }
                'u' => {
                    let hex: String = chars[i + 2..(i + 6).min(n)].iter().collect();
                    match u32::from_str_radix(&hex, 16)
                        .ok()
                        .filter(|_| hex.len() == 4)
                    {
                        Some(code) => {
                            // Surrogate halves cannot be chars; keep them as replacement chars.
                            text.push(char::from_u32(code).unwrap_or('\u{fffd}'));
                            i += 6;
                        }
                        None => {
                            text.push('\\');
                            i += 1;
                        }
                    }
                }
                _ => {
                    // Invalid escape (LaTeX `\frac` would be valid, `\d`, `\(` are not): keep
                    // the backslash literally.
                    text.push('\\');
                    i += 1;
                }
            }
            continue;
        }
        if c == quote && closes_string(chars, i + 1) {
            out.push_str(&Value::String(text).to_string());
            return i + 1;
        }
        text.push(c);
        i += 1;
    }
    // Unterminated: close it at the end.
    out.push_str(&Value::String(text).to_string());
    n
}

fn closes_string(chars: &[char], after: usize) -> bool {
    let j = skip_space_and_comments(chars, after);
    let saw_newline = chars[after.min(j)..j].contains(&'\n');
    let Some(&next) = chars.get(j) else {
        return true;
    };
    match next {
        ':' | '}' | ']' => true,
        ',' => {
            let k = skip_space_and_comments(chars, j + 1);
            match chars.get(k) {
                None => true,
                Some(&c) => starts_member_or_value(chars, k, c),
            }
        }
        // A missing comma before the next member on a new line.
        c if saw_newline => starts_member_or_value(chars, j, c),
        _ => false,
    }
}

/// The index of the first character at or after `k` that is neither whitespace nor inside a
/// `//` or `/* */` comment.
fn skip_space_and_comments(chars: &[char], mut k: usize) -> usize {
    let n = chars.len();
    loop {
        while k < n && chars[k].is_whitespace() {
            k += 1;
        }
        if chars.get(k) == Some(&'/') && chars.get(k + 1) == Some(&'/') {
            while k < n && chars[k] != '\n' {
                k += 1;
            }
        } else if chars.get(k) == Some(&'/') && chars.get(k + 1) == Some(&'*') {
            k += 2;
            while k < n && !(chars[k] == '*' && chars.get(k + 1) == Some(&'/')) {
                k += 1;
            }
            k = (k + 2).min(n);
        } else {
            return k;
        }
    }
}

fn starts_member_or_value(chars: &[char], k: usize, c: char) -> bool {
    if matches!(c, '"' | '\'' | '{' | '[' | '}' | ']' | '-') || c.is_ascii_digit() {
        return true;
    }
    // An unquoted key (`score:`) or a literal.
    if c.is_alphabetic() || c == '_' {
        let mut m = k;
        while m < chars.len() && (chars[m].is_alphanumeric() || chars[m] == '_') {
            m += 1;
        }
        let word: String = chars[k..m].iter().collect();
        while m < chars.len() && chars[m].is_whitespace() {
            m += 1;
        }
        return chars.get(m) == Some(&':')
            || matches!(
                word.as_str(),
                "true" | "false" | "null" | "True" | "False" | "None"
            );
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(raw: &str) -> Map<String, Value> {
        parse_json_object(raw).unwrap_or_else(|| panic!("no object in {raw:?}"))
    }

    #[test]
    fn strict_json_inside_prose_and_fences() {
        let o = obj("Sure! Here is my evaluation:\n```json\n{\"thought\": \"Good.\", \"interactivity\": 0.8}\n```\nHope it helps.");
        assert_eq!(o["thought"], "Good.");
        assert_eq!(score_field(&o, "interactivity", (0.0, 1.0)), Some(0.8));
    }

    #[test]
    fn python_dict_style() {
        let o = obj("{'thought': 'The assistant didn't ask any clarifying question.', 'accuracy': True, 'extra': None}");
        assert_eq!(
            o["thought"],
            "The assistant didn't ask any clarifying question."
        );
        assert_eq!(o["accuracy"], Value::Bool(true));
        assert_eq!(o["extra"], Value::Null);
        assert_eq!(score_field(&o, "accuracy", (0.0, 1.0)), Some(1.0));
    }

    #[test]
    fn trailing_commas_comments_unquoted_keys() {
        let o = obj("{\n  thought: \"ok\", // reasoning\n  score: 1,\n  tags: [\"a\", \"b\",],\n}");
        assert_eq!(o["thought"], "ok");
        assert_eq!(o["score"], 1);
        assert_eq!(o["tags"], serde_json::json!(["a", "b"]));
        let o = obj("{\"a\": 1,, \"b\": 2 /* note */}");
        assert_eq!(o["b"], 2);
        let o = obj("{'thought': 'x' // why\n 'score': 0.25}");
        assert_eq!(score_field(&o, "score", (0.0, 1.0)), Some(0.25));
    }

    #[test]
    fn messy_strings() {
        // Unescaped inner quotes, a raw newline and a LaTeX backslash inside a string.
        let o = obj("{\"thought\": \"The user said \"make it shorter\" and the\nassistant used \\(x^2\\)\", \"score\": 0.5}");
        assert_eq!(
            o["thought"],
            "The user said \"make it shorter\" and the\nassistant used \\(x^2\\)"
        );
        assert_eq!(score_field(&o, "score", (0.0, 1.0)), Some(0.5));
        // Apostrophes in single-quoted strings, with a comma in the text.
        let o = obj("{'thought': 'It's fine, but the user's goal wasn't met', 'accuracy': 0}");
        assert_eq!(o["thought"], "It's fine, but the user's goal wasn't met");
        assert_eq!(o["accuracy"], 0);
    }

    #[test]
    fn missing_commas_and_numbers() {
        let o = obj("{\n\"thought\": \"fine\"\n\"score\": .5\n\"n\": +3\n}");
        assert_eq!(score_field(&o, "score", (0.0, 1.0)), Some(0.5));
        assert_eq!(score_field(&o, "n", (0.0, 10.0)), Some(3.0));
    }

    #[test]
    fn braces_in_prose_and_several_objects() {
        let o = obj(
            "I think the set {1, 2} is right. {\"thought\": \"t\", \"accuracy\": 1} Also {bad}",
        );
        assert_eq!(score_field(&o, "accuracy", (0.0, 1.0)), Some(1.0));
        let o = obj("{\"accuracy\": 1} and then {\"accuracy\": 0}");
        assert_eq!(o["accuracy"], 1);
    }

    #[test]
    fn truncated_output_is_closed() {
        let o = obj("{\"thought\": \"The assistant asks, then\", \"interactivity\": 0.7, \"notes\": \"cut off he");
        assert_eq!(score_field(&o, "interactivity", (0.0, 1.0)), Some(0.7));
        let o = obj("{\"score\": 1, \"more\":");
        assert_eq!(o["more"], Value::Null);
    }

    #[test]
    fn bare_word_values() {
        let o = obj("{thought: it's good, score: 0.9}");
        assert_eq!(o["thought"], "it's good");
        assert_eq!(score_field(&o, "score", (0.0, 1.0)), Some(0.9));
    }

    #[test]
    fn no_object() {
        assert!(parse_json_object("I cannot evaluate this.").is_none());
        assert!(parse_json_object("").is_none());
        assert!(parse_json_object("[1, 2, 3]").is_none());
        assert!(parse_json_object("} {").is_none());
    }

    #[test]
    fn score_field_rules() {
        let o = obj(
            r#"{"a": "0.75", "b": 3, "c": "high", "d": null, "Accuracy": 1, "e": {"thought": "x", "score": 0}, "f": false, "g": "nan", "h": "inf"}"#,
        );
        assert_eq!(score_field(&o, "a", (0.0, 1.0)), Some(0.75));
        assert_eq!(score_field(&o, "b", (0.0, 1.0)), None); // out of range
        assert_eq!(score_field(&o, "b", (1.0, 5.0)), Some(3.0));
        assert_eq!(score_field(&o, "c", (0.0, 1.0)), None);
        assert_eq!(score_field(&o, "d", (0.0, 1.0)), None);
        assert_eq!(score_field(&o, "accuracy", (0.0, 1.0)), Some(1.0));
        assert_eq!(score_field(&o, "e", (0.0, 1.0)), Some(0.0));
        assert_eq!(score_field(&o, "f", (0.0, 1.0)), Some(0.0));
        assert_eq!(score_field(&o, "g", (0.0, 1.0)), None);
        assert_eq!(
            score_field(&o, "h", (f64::NEG_INFINITY, f64::INFINITY)),
            None
        );
        assert_eq!(score_field(&o, "missing", (0.0, 1.0)), None);
    }

    #[test]
    fn extract_code_picks_last_python_block() {
        let text = "Here's a first try:\n```python\ndef f():\n    return 1\n```\nAnd the fix:\n```py\ndef f():\n    return 2\n```\nRun it with:\n```bash\npython f.py\n```\n";
        assert_eq!(
            extract_code(text).as_deref(),
            Some("def f():\n    return 2")
        );
        let bare = "```\nprint('hi')\n```";
        assert_eq!(extract_code(bare).as_deref(), Some("print('hi')"));
        assert_eq!(extract_code("no code here"), None);
        assert_eq!(extract_code("```bash\nls\n```"), None);
        assert_eq!(extract_code("```python\n\n```"), None);
    }

    #[test]
    fn extract_code_edge_cases() {
        // Indented fence inside a list item: the fence's indentation is removed.
        let listed = "1. Define it:\n   ```python\n   def g(x):\n       return x\n   ```\n";
        assert_eq!(
            extract_code(listed).as_deref(),
            Some("def g(x):\n    return x")
        );
        // Cut-off answer: the unclosed block runs to the end.
        let cut = "```python\nimport math\nprint(math.pi)";
        assert_eq!(
            extract_code(cut).as_deref(),
            Some("import math\nprint(math.pi)")
        );
        // Closing fence glued to the last line; CRLF line ends; `Python` tag.
        assert_eq!(
            extract_code("```Python\r\nx = 1\r\nprint(x)```\r\n").as_deref(),
            Some("x = 1\nprint(x)")
        );
        // Longer fences contain shorter ones.
        let nested = "````python\ns = '''\n```\n'''\n````";
        assert_eq!(extract_code(nested).as_deref(), Some("s = '''\n```\n'''"));
        // Inline triple backticks are not fences.
        assert_eq!(extract_code("use ```x``` here"), None);
    }

    #[test]
    fn extract_fenced_or_all_for_documents() {
        let doc = "Here is the revised email:\n\n```markdown\nDear Bob,\n\nSee you soon.\n```\nLet me know!";
        assert_eq!(extract_fenced_or_all(doc), "Dear Bob,\n\nSee you soon.");
        assert_eq!(
            extract_fenced_or_all("  Dear Bob,\nthanks.  \n"),
            "Dear Bob,\nthanks."
        );
        assert_eq!(
            extract_fenced_or_all("```\n```\n plain "),
            "```\n```\n plain"
        );
    }
}
