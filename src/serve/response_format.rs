//! `response_format`: the server cannot constrain decoding, so it checks the finished output
//! instead. `json_object` replies must parse as a JSON object; `json_schema` replies must also
//! satisfy the schema, checked with the subset of JSON Schema below. A schema that uses any
//! other keyword is refused when the request arrives (400), so a check is never claimed that
//! is not made. A reply that fails is an error, never passed on as if it were valid.
//!
//! Checked keywords: `type` (a name or a list), `properties`, `required`,
//! `additionalProperties` (boolean or schema), `items`, `enum`, `const`, `minimum`, `maximum`,
//! `exclusiveMinimum`, `exclusiveMaximum`, `minLength`, `maxLength`, `minItems`, `maxItems`,
//! `anyOf`, `oneOf`, `allOf`, and `$ref` to `#/$defs/…` or `#/definitions/…` (what pydantic
//! writes). Annotations (`title`, `description`, `default`, `examples`, `format`, `$schema`,
//! `$id`, `$comment`) are accepted and not checked.

use std::cell::Cell;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use crate::check::clip;

/// What the client asked the reply to be.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ResponseFormat {
    #[default]
    Text,
    JsonObject,
    JsonSchema {
        name: String,
        schema: Value,
    },
}

/// Why a `response_format` cannot be accepted: the parameter at fault and a message.
#[derive(Debug, PartialEq)]
pub struct FormatError {
    pub param: String,
    pub message: String,
    /// True when the format is well-formed but asks for a check this server does not make.
    pub unsupported: bool,
}

const CHECKED: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "const",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "$defs",
    "definitions",
];
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "format",
    "$schema",
    "$id",
    "$comment",
];
const TYPES: &[&str] = &[
    "object", "array", "string", "number", "integer", "boolean", "null",
];
/// Work done at most while checking one reply, in units of one schema node visited or one
/// value compared (an `enum` of 500 costs 500), so a large list cannot multiply the cost of
/// every visit.
pub const MAX_WORK: u64 = 200_000;
/// Wall time spent at most checking one reply, whatever the schema.
pub const MAX_CHECK_TIME: Duration = Duration::from_millis(100);
/// Values in one `enum` at most.
pub const MAX_ENUM_VALUES: usize = 1_024;
/// Schema objects (and `enum`/`const` values) in one schema at most.
pub const MAX_SCHEMA_NODES: usize = 20_000;
/// Bytes of a failed check's message at most (the message goes back to the client and into
/// the log; it never echoes a whole enum or reply).
const MAX_MESSAGE_BYTES: usize = 1_000;
/// Branch errors of an `anyOf` quoted at most.
const MAX_QUOTED_BRANCHES: usize = 3;

/// Bytes of a schema or reply path (`response_format.json_schema.schema.properties.a…`) at
/// most. A path names where a check failed; built whole, each level would copy every
/// ancestor's key again (a schema of nested 200 KB property names: gigabytes), so paths keep
/// their head and their last steps.
const MAX_PATH_BYTES: usize = 200;
/// Bytes of one key in a path at most.
const MAX_PATH_KEY_BYTES: usize = 40;

/// `at` followed by `sep` and `key` (`.name`, `[3]`), at most about [`MAX_PATH_BYTES`]: a long
/// `at` keeps its first half and is marked `…`.
fn child_path(at: &str, sep: &str, key: &str) -> String {
    let key = clip(key, MAX_PATH_KEY_BYTES);
    if at.len() + sep.len() + key.len() <= MAX_PATH_BYTES {
        return format!("{at}{sep}{key}");
    }
    let head = clip(at, MAX_PATH_BYTES / 2);
    let head = head.strip_suffix('…').unwrap_or(&head);
    format!("{head}…{sep}{key}")
}

/// An error of one branch as quoted in its parent's: at most 300 bytes.
fn shorten(e: &str) -> String {
    clip(e, 300)
}

/// A value as quoted in an error: at most 80 bytes of its JSON.
fn quote(v: &Value) -> String {
    clip(&v.to_string(), 80)
}

/// What one reply's check may still spend: work units and a deadline.
struct Budget {
    work: Cell<u64>,
    deadline: Instant,
}

impl Budget {
    fn new() -> Self {
        Self {
            work: Cell::new(0),
            deadline: Instant::now() + MAX_CHECK_TIME,
        }
    }

    /// Spends `units`; an error names the limit that ran out.
    fn spend(&self, units: u64, at: &str) -> Result<(), String> {
        let before = self.work.get();
        let after = before.saturating_add(units);
        self.work.set(after);
        if after > MAX_WORK {
            return Err(format!(
                "{at}: checking the reply against this schema takes more than {MAX_WORK} steps \
                 (recursive anyOf/oneOf/allOf or large enums); simplify the schema"
            ));
        }
        // Reading the clock every 1,024 units keeps its cost out of the check.
        if before / 1024 != after / 1024 && Instant::now() > self.deadline {
            return Err(format!(
                "{at}: checking the reply against this schema took more than {} ms; simplify \
                 the schema",
                MAX_CHECK_TIME.as_millis()
            ));
        }
        Ok(())
    }
}

/// `$ref` hops and nesting followed at most (a schema that refers to itself without
/// descending into the value would otherwise never end).
const MAX_DEPTH: usize = 128;

impl ResponseFormat {
    /// Parses the request's `response_format` object.
    pub fn parse(v: &Value) -> Result<Self, FormatError> {
        let bad = |param: &str, message: String| FormatError {
            param: param.to_string(),
            message,
            unsupported: false,
        };
        let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
            bad(
                "response_format",
                "`response_format` must be an object with a string `type`".into(),
            )
        })?;
        match kind {
            "text" => Ok(Self::Text),
            "json_object" => Ok(Self::JsonObject),
            "json_schema" => {
                let spec = v
                    .get("json_schema")
                    .and_then(Value::as_object)
                    .ok_or_else(|| {
                        bad(
                        "response_format.json_schema",
                        "`response_format.json_schema` must be an object with `name` and `schema`"
                            .into(),
                    )
                    })?;
                let name = match spec.get("name") {
                    Some(Value::String(n)) if !n.is_empty() => n.clone(),
                    _ => {
                        return Err(bad(
                            "response_format.json_schema.name",
                            "`response_format.json_schema.name` must be a non-empty string".into(),
                        ))
                    }
                };
                let schema = spec
                    .get("schema")
                    .cloned()
                    .unwrap_or(Value::Object(Map::new()));
                check_schema_size(&schema)?;
                check_schema(&schema, &schema, "response_format.json_schema.schema", 0)?;
                Ok(Self::JsonSchema { name, schema })
            }
            other => Err(bad(
                "response_format",
                format!(
                    "unknown `response_format.type` `{other}` (expected text, json_object or \
                     json_schema)"
                ),
            )),
        }
    }

    pub fn wants_json(&self) -> bool {
        !matches!(self, Self::Text)
    }

    /// The reply to return when `content` satisfies the format (for JSON formats: the JSON
    /// text, without the Markdown fence a model may put around it), or why it does not.
    pub fn check(&self, content: &str) -> Result<String, String> {
        if let Self::Text = self {
            return Ok(content.to_string());
        }
        let json = unfence(content);
        let value: Value =
            serde_json::from_str(json).map_err(|e| format!("the reply is not valid JSON ({e})"))?;
        match self {
            Self::Text => {}
            Self::JsonObject => {
                if !value.is_object() {
                    return Err(format!(
                        "the reply is JSON but not an object (it is {})",
                        type_name(&value)
                    ));
                }
            }
            Self::JsonSchema { schema, .. } => {
                validate(&value, schema, schema, "$", 0, &Budget::new())
                    .map_err(|e| clip(&e, MAX_MESSAGE_BYTES))?
            }
        }
        Ok(json.to_string())
    }
}

/// The text inside one surrounding ``` fence (with or without a language tag), trimmed.
fn unfence(content: &str) -> &str {
    let t = content.trim();
    let Some(rest) = t.strip_prefix("```") else {
        return t;
    };
    let Some(body) = rest.strip_suffix("```") else {
        return t;
    };
    // The first line is the language tag (`json`) or empty.
    match body.split_once('\n') {
        Some((tag, inner)) if !tag.trim().contains(char::is_whitespace) => inner.trim(),
        _ => t,
    }
}

fn unsupported(param: &str, message: String) -> FormatError {
    FormatError {
        param: param.to_string(),
        message,
        unsupported: true,
    }
}

/// `Ok` when `ok`, else the error that `here` must be `what`.
fn require(ok: bool, here: &str, what: &str) -> Result<(), FormatError> {
    if ok {
        Ok(())
    } else {
        Err(invalid(here, format!("`{here}` must be {what}")))
    }
}

fn invalid(param: &str, message: String) -> FormatError {
    FormatError {
        param: param.to_string(),
        message,
        unsupported: false,
    }
}

/// Refuses a schema that uses a keyword this module does not check, or is malformed.
fn check_schema(schema: &Value, root: &Value, at: &str, depth: usize) -> Result<(), FormatError> {
    if depth > MAX_DEPTH {
        return Err(unsupported(
            at,
            format!("`{at}` nests deeper than {MAX_DEPTH}"),
        ));
    }
    let obj = match schema {
        Value::Bool(_) => return Ok(()),
        Value::Object(o) => o,
        _ => return Err(invalid(at, format!("`{at}` must be a schema object"))),
    };
    for (key, v) in obj {
        let here = child_path(at, ".", key);
        if ANNOTATIONS.contains(&key.as_str()) {
            continue;
        }
        if !CHECKED.contains(&key.as_str()) {
            return Err(unsupported(
                &here,
                format!(
                    "JSON Schema keyword `{key}` (at `{at}`) is not checked by this server; it \
                     checks {}",
                    CHECKED.join(", ")
                ),
            ));
        }
        match key.as_str() {
            "type" => {
                let names: Vec<&Value> = match v {
                    Value::Array(a) => a.iter().collect(),
                    one => vec![one],
                };
                for n in names {
                    if !n.as_str().is_some_and(|n| TYPES.contains(&n)) {
                        return Err(invalid(&here, format!("`{here}`: unknown type {n}")));
                    }
                }
            }
            "properties" | "$defs" | "definitions" => {
                let props = v
                    .as_object()
                    .ok_or_else(|| invalid(&here, format!("`{here}` must be an object")))?;
                for (name, sub) in props {
                    check_schema(sub, root, &child_path(&here, ".", name), depth + 1)?;
                }
            }
            "required" => require(
                v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
                &here,
                "an array of strings",
            )?,
            "additionalProperties" | "items" => check_schema(v, root, &here, depth + 1)?,
            "anyOf" | "oneOf" | "allOf" => {
                let subs = v
                    .as_array()
                    .filter(|a| !a.is_empty())
                    .ok_or_else(|| invalid(&here, format!("`{here}` must be a non-empty array")))?;
                for (i, sub) in subs.iter().enumerate() {
                    check_schema(
                        sub,
                        root,
                        &child_path(&here, "", &format!("[{i}]")),
                        depth + 1,
                    )?;
                }
            }
            "enum" => require(v.is_array(), &here, "an array")?,
            "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" => {
                require(v.is_number(), &here, "a number")?
            }
            "minLength" | "maxLength" | "minItems" | "maxItems" => {
                require(v.as_u64().is_some(), &here, "a non-negative integer")?
            }
            "$ref" => {
                let target = v
                    .as_str()
                    .ok_or_else(|| invalid(&here, format!("`{here}` must be a string")))?;
                if resolve_ref(root, target).is_none() {
                    return Err(unsupported(
                        &here,
                        format!(
                            "`{here}`: only references to `#/$defs/<name>` or \
                             `#/definitions/<name>` in the same schema are followed, not \
                             `{target}`"
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn resolve_ref<'a>(root: &'a Value, target: &str) -> Option<&'a Value> {
    let (section, name) = target
        .strip_prefix("#/$defs/")
        .map(|n| ("$defs", n))
        .or_else(|| {
            target
                .strip_prefix("#/definitions/")
                .map(|n| ("definitions", n))
        })?;
    root.get(section)?.get(name)
}

/// The error for a value outside an enum: the first few allowed values, never the whole list.
fn enum_error(at: &str, value: &Value, options: &[Value]) -> String {
    const SHOWN: usize = 5;
    let shown: Vec<String> = options.iter().take(SHOWN).map(quote).collect();
    let rest = match options.len().saturating_sub(SHOWN) {
        0 => String::new(),
        n => format!(", … and {n} more"),
    };
    format!(
        "{at}: {} is not one of [{}{rest}]",
        quote(value),
        shown.join(", ")
    )
}

/// Refuses a schema too large to check within the budget: more than [`MAX_SCHEMA_NODES`]
/// objects and values in all, or an `enum` of more than [`MAX_ENUM_VALUES`].
fn check_schema_size(schema: &Value) -> Result<(), FormatError> {
    let at = "response_format.json_schema.schema";
    let mut nodes = 0usize;
    let mut stack = vec![schema];
    while let Some(v) = stack.pop() {
        nodes += 1;
        if nodes > MAX_SCHEMA_NODES {
            return Err(unsupported(
                at,
                format!(
                    "`{at}` has more than {MAX_SCHEMA_NODES} objects and values; this server \
                     checks schemas up to that size"
                ),
            ));
        }
        match v {
            Value::Object(o) => {
                if let Some(Value::Array(options)) = o.get("enum") {
                    if options.len() > MAX_ENUM_VALUES {
                        return Err(unsupported(
                            at,
                            format!(
                                "an `enum` in `{at}` lists {} values; this server checks \
                                 enums of at most {MAX_ENUM_VALUES}",
                                options.len()
                            ),
                        ));
                    }
                }
                stack.extend(o.values());
            }
            Value::Array(a) => stack.extend(a.iter()),
            _ => {}
        }
    }
    Ok(())
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn has_type(v: &Value, name: &str) -> bool {
    match name {
        "integer" => v
            .as_f64()
            .is_some_and(|x| x.fract() == 0.0 && x.is_finite()),
        "number" => v.is_number(),
        other => type_name(v) == other,
    }
}

fn count_chars(s: &str) -> u64 {
    s.chars().count() as u64
}

/// Checks `value` (at JSON path `at`) against a schema already accepted by [`check_schema`].
fn validate(
    value: &Value,
    schema: &Value,
    root: &Value,
    at: &str,
    depth: usize,
    steps: &Budget,
) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!("{at}: the schema nests deeper than {MAX_DEPTH}"));
    }
    // A schema whose anyOf/oneOf branches refer back to it makes the checks exponential in
    // the depth; a budget keeps a hostile schema to milliseconds.
    steps.spend(1, at)?;
    let obj = match schema {
        Value::Bool(true) => return Ok(()),
        Value::Bool(false) => return Err(format!("{at}: no value is allowed here")),
        Value::Object(o) => o,
        _ => return Ok(()),
    };
    if let Some(target) = obj.get("$ref").and_then(Value::as_str) {
        if let Some(sub) = resolve_ref(root, target) {
            validate(value, sub, root, at, depth + 1, steps)?;
        }
    }
    if let Some(t) = obj.get("type") {
        let names: Vec<&str> = match t {
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            one => one.as_str().into_iter().collect(),
        };
        if !names.iter().any(|n| has_type(value, n)) {
            return Err(format!(
                "{at}: expected {}, got {}",
                names.join(" or "),
                type_name(value)
            ));
        }
    }
    if let Some(options) = obj.get("enum").and_then(Value::as_array) {
        steps.spend(options.len() as u64, at)?;
        if !options.contains(value) {
            return Err(enum_error(at, value, options));
        }
    }
    if let Some(c) = obj.get("const") {
        if c != value {
            return Err(format!("{at}: expected {}, got {}", quote(c), quote(value)));
        }
    }
    check_bounds(value, obj, at)?;
    if let Value::Object(fields) = value {
        check_object(fields, obj, root, at, depth, steps)?;
    }
    if let (Value::Array(items), Some(item_schema)) = (value, obj.get("items")) {
        for (i, item) in items.iter().enumerate() {
            validate(
                item,
                item_schema,
                root,
                &child_path(at, "", &format!("[{i}]")),
                depth + 1,
                steps,
            )?;
        }
    }
    check_combinators(value, obj, root, at, depth, steps)
}

fn check_bounds(value: &Value, obj: &Map<String, Value>, at: &str) -> Result<(), String> {
    let num = |k: &str| obj.get(k).and_then(Value::as_f64);
    let int = |k: &str| obj.get(k).and_then(Value::as_u64);
    if let Some(x) = value.as_f64() {
        if let Some(m) = num("minimum").filter(|m| x < *m) {
            return Err(format!("{at}: {x} is below the minimum {m}"));
        }
        if let Some(m) = num("maximum").filter(|m| x > *m) {
            return Err(format!("{at}: {x} is above the maximum {m}"));
        }
        if let Some(m) = num("exclusiveMinimum").filter(|m| x <= *m) {
            return Err(format!("{at}: {x} is not above {m}"));
        }
        if let Some(m) = num("exclusiveMaximum").filter(|m| x >= *m) {
            return Err(format!("{at}: {x} is not below {m}"));
        }
    }
    if let Value::String(s) = value {
        let n = count_chars(s);
        if let Some(m) = int("minLength").filter(|m| n < *m) {
            return Err(format!("{at}: {n} characters, fewer than minLength {m}"));
        }
        if let Some(m) = int("maxLength").filter(|m| n > *m) {
            return Err(format!("{at}: {n} characters, more than maxLength {m}"));
        }
    }
    if let Value::Array(a) = value {
        let n = a.len() as u64;
        if let Some(m) = int("minItems").filter(|m| n < *m) {
            return Err(format!("{at}: {n} items, fewer than minItems {m}"));
        }
        if let Some(m) = int("maxItems").filter(|m| n > *m) {
            return Err(format!("{at}: {n} items, more than maxItems {m}"));
        }
    }
    Ok(())
}

fn check_object(
    fields: &Map<String, Value>,
    obj: &Map<String, Value>,
    root: &Value,
    at: &str,
    depth: usize,
    steps: &Budget,
) -> Result<(), String> {
    for key in obj
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        if !fields.contains_key(key) {
            return Err(format!("{at}: required key `{key}` is missing"));
        }
    }
    let props = obj.get("properties").and_then(Value::as_object);
    for (key, v) in fields {
        let here = child_path(at, ".", key);
        match props.and_then(|p| p.get(key)) {
            Some(sub) => validate(v, sub, root, &here, depth + 1, steps)?,
            None => match obj.get("additionalProperties") {
                Some(Value::Bool(false)) => {
                    return Err(format!("{at}: key `{key}` is not allowed by the schema"))
                }
                Some(extra) => validate(v, extra, root, &here, depth + 1, steps)?,
                None => {}
            },
        }
    }
    Ok(())
}

fn check_combinators(
    value: &Value,
    obj: &Map<String, Value>,
    root: &Value,
    at: &str,
    depth: usize,
    steps: &Budget,
) -> Result<(), String> {
    let subs = |k: &str| obj.get(k).and_then(Value::as_array);
    if let Some(all) = subs("allOf") {
        for s in all {
            validate(value, s, root, at, depth + 1, steps)?;
        }
    }
    if let Some(any) = subs("anyOf") {
        let mut quoted = Vec::new();
        let mut failed = 0;
        for s in any {
            match validate(value, s, root, at, depth + 1, steps) {
                Ok(()) => break,
                // An exhausted budget is the answer, not one branch's failure.
                Err(e) if steps.work.get() > MAX_WORK => return Err(e),
                Err(e) => {
                    failed += 1;
                    if quoted.len() < MAX_QUOTED_BRANCHES {
                        quoted.push(shorten(&e));
                    }
                }
            }
        }
        if failed == any.len() {
            let more = failed - quoted.len();
            let tail = if more > 0 {
                format!("; and {more} more")
            } else {
                String::new()
            };
            return Err(format!(
                "{at}: matches none of anyOf ({}{tail})",
                quoted.join("; ")
            ));
        }
    }
    if let Some(one) = subs("oneOf") {
        let mut matching = 0;
        for s in one {
            match validate(value, s, root, at, depth + 1, steps) {
                Ok(()) => matching += 1,
                Err(e) if steps.work.get() > MAX_WORK => return Err(e),
                Err(_) => {}
            }
        }
        if matching != 1 {
            return Err(format!(
                "{at}: matches {matching} of the oneOf schemas, not exactly one"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema_format(schema: Value) -> Result<ResponseFormat, FormatError> {
        ResponseFormat::parse(&json!({
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": true}
        }))
    }

    /// A schema of 60 nested 200 KB property names (12 MB, about the deepest a request's JSON
    /// can nest) is checked with paths of bounded size: built whole, each level copied every
    /// ancestor's name again (360 MB here, gigabytes for the server at once). Its error names
    /// the place in under 2 KB.
    #[test]
    fn nested_long_names_build_bounded_paths() {
        let mut schema = json!({"type": "object", "patternProperties": {}});
        for d in 0..60 {
            let name = format!("{d}{}", "n".repeat(200_000));
            schema = json!({"type": "object", "properties": {name: schema}});
        }
        let started = std::time::Instant::now();
        let e = schema_format(schema).unwrap_err();
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        assert!(e.param.len() <= 2 * MAX_PATH_BYTES, "{}", e.param.len());
        assert!(e.message.len() < 2_000, "{}", e.message.len());
        assert!(e
            .param
            .starts_with("response_format.json_schema.schema.properties.59n"));
        assert!(e.param.ends_with(".patternProperties"), "{}", e.param);
        assert_eq!(child_path("a", ".", "b"), "a.b");
        let long = child_path(&"x".repeat(300), "", "[7]");
        assert!(
            long.ends_with("…[7]") && long.len() < MAX_PATH_BYTES,
            "{long}"
        );
    }

    #[test]
    fn json_object_needs_an_object_and_drops_a_fence() {
        let f = ResponseFormat::JsonObject;
        assert_eq!(f.check(" {\"a\": 1}\n").unwrap(), "{\"a\": 1}");
        assert_eq!(f.check("```json\n{\"a\": 1}\n```").unwrap(), "{\"a\": 1}");
        assert_eq!(f.check("```\n{}\n```").unwrap(), "{}");
        assert!(f.check("[1, 2]").unwrap_err().contains("not an object"));
        assert!(f
            .check("Sure! {\"a\": 1}")
            .unwrap_err()
            .contains("not valid JSON"));
        assert!(f.check("{\"a\": ").is_err());
        assert_eq!(ResponseFormat::Text.check("anything").unwrap(), "anything");
    }

    #[test]
    fn schema_checks_types_required_and_nesting() {
        let f = schema_format(json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "age": {"type": "integer", "minimum": 0},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                "pet": {"$ref": "#/$defs/Pet"},
                "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]}
            },
            "required": ["name", "age"],
            "additionalProperties": false,
            "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                               "required": ["kind"], "title": "Pet"}}
        }))
        .unwrap();
        assert!(f
            .check(
                r#"{"name": "Ada", "age": 36, "tags": ["x"], "pet": {"kind": "cat"}, "nick": null}"#
            )
            .is_ok());
        let cases = [
            (r#"{"name": "Ada"}"#, "required key `age`"),
            (
                r#"{"name": "Ada", "age": "36"}"#,
                "$.age: expected integer, got string",
            ),
            (r#"{"name": "Ada", "age": 3.5}"#, "$.age: expected integer"),
            (r#"{"name": "Ada", "age": -1}"#, "below the minimum"),
            (r#"{"name": "", "age": 1}"#, "minLength"),
            (
                r#"{"name": "A", "age": 1, "tags": ["a", 2]}"#,
                "$.tags[1]: expected string",
            ),
            (
                r#"{"name": "A", "age": 1, "tags": ["a", "b", "c"]}"#,
                "maxItems",
            ),
            (
                r#"{"name": "A", "age": 1, "pet": {"kind": "cow"}}"#,
                "$.pet.kind",
            ),
            (r#"{"name": "A", "age": 1, "nick": 5}"#, "anyOf"),
            (
                r#"{"name": "A", "age": 1, "extra": 1}"#,
                "`extra` is not allowed",
            ),
            (r#"["name"]"#, "expected object, got array"),
        ];
        for (reply, want) in cases {
            let err = f.check(reply).expect_err(reply);
            assert!(err.contains(want), "{reply}: {err}");
        }
    }

    /// An anyOf that refers to its own definition twice made the check exponential in the
    /// nesting depth (a request that never answered and grew to gigabytes): it now ends
    /// within a step budget, quickly, with a bounded message.
    #[test]
    fn a_self_referring_any_of_is_checked_within_a_budget() {
        let f = schema_format(json!({
            "$ref": "#/$defs/n",
            "$defs": {"n": {"anyOf": [{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/n"}, {"type": "integer"}]}}
        }))
        .unwrap();
        let started = std::time::Instant::now();
        let e = f.check("\"not an integer\"").unwrap_err();
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert!(
            e.contains("steps") && e.len() < 100_000,
            "{}",
            &e[..e.len().min(500)]
        );
    }

    #[test]
    fn unchecked_keywords_and_bad_schemas_are_refused() {
        let e = schema_format(json!({"type": "string", "pattern": "^a"})).unwrap_err();
        assert!(e.unsupported, "{e:?}");
        assert_eq!(e.param, "response_format.json_schema.schema.pattern");
        let e = schema_format(json!({"properties": {"a": {"if": {}}}})).unwrap_err();
        assert_eq!(
            e.param,
            "response_format.json_schema.schema.properties.a.if"
        );
        let e = schema_format(json!({"$ref": "https://example.com/s.json"})).unwrap_err();
        assert!(e.unsupported);
        let e = schema_format(json!({"type": "text"})).unwrap_err();
        assert!(!e.unsupported);
        let e = ResponseFormat::parse(&json!({"type": "json_schema"})).unwrap_err();
        assert_eq!(e.param, "response_format.json_schema");
        let e = ResponseFormat::parse(&json!({"type": "yaml"})).unwrap_err();
        assert_eq!(e.param, "response_format");
        // A schema that refers to itself without descending ends with an error, not a hang.
        let f = schema_format(json!({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}))
            .unwrap();
        assert!(f.check("{}").unwrap_err().contains("deeper"));
        // Annotations are accepted.
        assert!(
            schema_format(json!({"type": "object", "title": "T", "description": "d",
                                     "properties": {"d": {"type": "string", "format": "date"}}}))
            .is_ok()
        );
    }
}
