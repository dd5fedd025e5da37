//! The model's own Jinja chat template, rendered with minijinja exactly as HF `transformers`
//! renders it (`trim_blocks` and `lstrip_blocks` on, Python string methods available,
//! `raise_exception`), never a hand-written imitation.

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::Serialize;

use super::ChatMessage;

const TEMPLATE_NAME: &str = "chat_template";

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(
        "{source_name}: the model has no chat template (a base model): give one \
         (`serve --chat-template FILE`) or send raw text to /v1/completions"
    )]
    Missing { source_name: String },
    #[error("{source_name}: {message}")]
    Invalid {
        source_name: String,
        message: String,
    },
    #[error("chat template of {source_name} failed to render: {message}")]
    Render {
        source_name: String,
        message: String,
    },
}

/// Template instructions one render may execute: real templates spend about a hundred per
/// message, so this bounds only a template that loops without end (nested `range` loops
/// would otherwise hold a request for hours); it runs out in well under a second.
pub const MAX_RENDER_FUEL: u64 = 10_000_000;

/// Bytes a render may write beyond [`RENDER_BYTES_PER_MESSAGE_BYTE`] times the messages' own:
/// the system prompt and role markers of real templates are well under this.
pub const RENDER_OVERHEAD_BYTES: usize = 1 << 20;
/// How many times its messages' bytes a render may write (real templates write each once).
pub const RENDER_BYTES_PER_MESSAGE_BYTE: usize = 4;

/// Bytes of a chat template at most: real ones are 1–20 KB (Qwen3's 4 KB, Gemma 3's 1.5 KB);
/// a larger file (`--chat-template /dev/zero`) is refused after reading this much, never read
/// until memory runs out.
pub const MAX_TEMPLATE_BYTES: usize = 1 << 20;

/// Reads a template file, at most [`MAX_TEMPLATE_BYTES`] of it (more is refused by name).
pub fn read_template_file(path: &Path) -> Result<String, TemplateError> {
    use std::io::Read;
    let name = path.display().to_string();
    let invalid = |message: String| TemplateError::Invalid {
        source_name: name.clone(),
        message,
    };
    let file = std::fs::File::open(path).map_err(|e| invalid(e.to_string()))?;
    let mut bytes = Vec::new();
    file.take(MAX_TEMPLATE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| invalid(e.to_string()))?;
    if bytes.len() > MAX_TEMPLATE_BYTES {
        return Err(invalid(format!(
            "the chat template is larger than {MAX_TEMPLATE_BYTES} bytes (1 MiB); no real \
             template is"
        )));
    }
    String::from_utf8(bytes).map_err(|_| invalid("the chat template is not UTF-8 text".into()))
}

/// A compiled chat template plus the special tokens it may refer to.
#[derive(Clone)]
pub struct ChatTemplate {
    /// `None` for a model whose files carry no template: it renders nothing, it refuses.
    env: Option<Environment<'static>>,
    source: String,
    source_name: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_name", &self.source_name)
            .finish_non_exhaustive()
    }
}

/// A render's output, refusing writes past `limit` bytes (the render then stops with an error).
struct BoundedOutput {
    bytes: Vec<u8>,
    limit: usize,
    over: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > self.limit {
            self.over = true;
            return Err(std::io::Error::other("the rendered text is over its bound"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Serialize)]
struct RenderContext<'a> {
    messages: &'a [ChatMessage],
    add_generation_prompt: bool,
    bos_token: &'a str,
    eos_token: &'a str,
}

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compiles `source`; `source_name` (a file) is named in every error.
    pub fn new(
        source: &str,
        source_name: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, TemplateError> {
        if source.len() > MAX_TEMPLATE_BYTES {
            return Err(TemplateError::Invalid {
                source_name: source_name.into(),
                message: format!(
                    "the chat template is {} bytes, more than {MAX_TEMPLATE_BYTES} (1 MiB); no \
                     real template is",
                    source.len()
                ),
            });
        }
        if source.trim().is_empty() {
            return Err(TemplateError::Invalid {
                source_name: source_name.into(),
                message: "the chat template is empty (it would render every conversation as \
                          no text); give a template, or none for a base model"
                    .into(),
            });
        }
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.set_fuel(Some(MAX_RENDER_FUEL));
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TemplateError::Invalid {
                source_name: source_name.into(),
                message: format!("chat template does not compile: {e}"),
            })?;
        Ok(Self {
            env: Some(env),
            source: source.to_string(),
            source_name: source_name.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template of a model whose files (`source_name`) carry none: every render is a
    /// [`TemplateError::Missing`] naming them, never a guessed format.
    pub fn absent(source_name: &str, bos_token: &str, eos_token: &str) -> Self {
        Self {
            env: None,
            source: String::new(),
            source_name: source_name.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        }
    }

    /// Whether the model's files carried a template.
    pub fn is_present(&self) -> bool {
        self.env.is_some()
    }

    /// What a render of a missing template says (naming the model's files).
    pub fn missing_reason(&self) -> String {
        TemplateError::Missing {
            source_name: self.source_name.clone(),
        }
        .to_string()
    }

    /// This template's special tokens with another template source (`--chat-template FILE`).
    pub fn replaced(&self, source: &str, source_name: &str) -> Result<Self, TemplateError> {
        Self::new(source, source_name, &self.bos_token, &self.eos_token)
    }

    /// Reads `chat_template`, `bos_token` and `eos_token` from an HF `tokenizer_config.json`
    /// (a `chat_template.jinja` file beside it wins, as in recent `transformers`).
    pub fn from_tokenizer_config(path: &Path) -> Result<Self, TemplateError> {
        let name = path.display().to_string();
        let invalid = |message: String| TemplateError::Invalid {
            source_name: name.clone(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| invalid(e.to_string()))?;
        let cfg: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
        let token = |key: &str| -> String {
            match &cfg[key] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .unwrap_or_default()
                    .to_string(),
                _ => String::new(),
            }
        };
        let jinja_file = path.with_file_name("chat_template.jinja");
        if jinja_file.is_file() {
            let src = read_template_file(&jinja_file)?;
            return Self::new(
                &src,
                &jinja_file.display().to_string(),
                &token("bos_token"),
                &token("eos_token"),
            );
        }
        let source = match &cfg["chat_template"] {
            serde_json::Value::String(s) => s.clone(),
            // A list of named templates: take the one called "default".
            serde_json::Value::Array(items) => items
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(String::from)
                .ok_or_else(|| TemplateError::Missing {
                    source_name: name.clone(),
                })?,
            serde_json::Value::Null => {
                return Ok(Self::absent(
                    &name,
                    &token("bos_token"),
                    &token("eos_token"),
                ))
            }
            _ => {
                return Err(TemplateError::Invalid {
                    source_name: name.clone(),
                    message: "the chat template (`chat_template`) must be a string or a list of named templates".into(),
                })
            }
        };
        Self::new(&source, &name, &token("bos_token"), &token("eos_token"))
    }

    /// Renders a conversation; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let env = self.env.as_ref().ok_or_else(|| TemplateError::Missing {
            source_name: self.source_name.clone(),
        })?;
        let tmpl = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| self.render_error(e))?;
        // The output is bounded as it is written: a template that writes a message a million
        // times stops at the bound instead of filling memory.
        let limit = messages
            .iter()
            .map(|m| m.content.len() + m.role.len())
            .fold(0usize, usize::saturating_add)
            .saturating_mul(RENDER_BYTES_PER_MESSAGE_BYTE)
            .saturating_add(RENDER_OVERHEAD_BYTES);
        let mut out = BoundedOutput {
            bytes: Vec::new(),
            limit,
            over: false,
        };
        let rendered = tmpl.render_captured_to(
            RenderContext {
                messages,
                add_generation_prompt,
                bos_token: &self.bos_token,
                eos_token: &self.eos_token,
            },
            &mut out,
        );
        if out.over {
            return Err(TemplateError::Render {
                source_name: self.source_name.clone(),
                message: format!(
                    "rendering the chat template wrote more than {limit} bytes ({}× the \
                     messages' bytes + 1 MiB) and was stopped",
                    RENDER_BYTES_PER_MESSAGE_BYTE
                ),
            });
        }
        rendered.map_err(|e| self.render_error(e))?;
        String::from_utf8(out.bytes).map_err(|_| TemplateError::Render {
            source_name: self.source_name.clone(),
            message: "the chat template rendered text that is not UTF-8".into(),
        })
    }

    fn render_error(&self, e: minijinja::Error) -> TemplateError {
        // (Output over the bound is reported by `render` itself.)
        let message = if e.kind() == ErrorKind::OutOfFuel {
            format!(
                "rendering the chat template took more than {MAX_RENDER_FUEL} template \
                 instructions and was stopped (a loop over a large range?)"
            )
        } else {
            e.to_string()
        };
        TemplateError::Render {
            source_name: self.source_name.clone(),
            message,
        }
    }

    pub fn source(&self) -> &str {
        &self.source
    }
    pub fn source_name(&self) -> &str {
        &self.source_name
    }
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's template, as stored in its GGUF and tokenizer_config.json.
    pub const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// A template that writes a message over and over stops at the output bound (4× the
    /// messages' bytes + 1 MiB), naming the file, instead of writing 100 MB; a real template
    /// on the same 100 KB message renders.
    #[test]
    fn a_template_that_writes_without_end_is_stopped() {
        let repeating = "{% for i in range(1000) %}{{ messages[0].content }}{% endfor %}";
        let t = ChatTemplate::new(repeating, "repeating.jinja", "", "").unwrap();
        let long = [ChatMessage::user("x".repeat(100_000))];
        let e = t.render(&long, true).unwrap_err().to_string();
        assert!(
            e.contains("repeating.jinja") && e.contains("wrote more than 1448592 bytes"),
            "{e}"
        );
        let real = ChatTemplate::new(SMOLLM2, "smollm2.jinja", "", "").unwrap();
        assert!(real.render(&long, true).unwrap().len() > 100_000);
    }

    /// Nested loops over large ranges would render for hours: the fuel stops them quickly,
    /// with an error naming the file, while a long real conversation renders. (They write
    /// nothing: one that writes meets the output bound first.)
    #[test]
    fn a_template_that_loops_without_end_is_stopped() {
        let looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% set k = i %}\
                       {% endfor %}{% endfor %}";
        let t = ChatTemplate::new(looping, "looping.jinja", "", "").unwrap();
        let started = std::time::Instant::now();
        let e = t.render(&[ChatMessage::user("hi")], true).unwrap_err();
        assert!(started.elapsed() < std::time::Duration::from_secs(3));
        let e = e.to_string();
        assert!(
            e.contains("looping.jinja") && e.contains("instructions"),
            "{e}"
        );
        let t = ChatTemplate::new(SMOLLM2, "smollm2", "", "").unwrap();
        let long: Vec<ChatMessage> = (0..5_000)
            .map(|i| ChatMessage::user(format!("message {i}")))
            .collect();
        assert!(t.render(&long, true).is_ok());
    }

    #[test]
    fn renders_smollm2_like_transformers() {
        let t = ChatTemplate::new(SMOLLM2, "test", "", "<|im_end|>").unwrap();
        let out = t
            .render(&[ChatMessage::user("What is 12345 + 678?")], true)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_gen = t
            .render(&[ChatMessage::system("S"), ChatMessage::user("U")], false)
            .unwrap();
        assert_eq!(
            no_gen,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
    }

    #[test]
    fn python_methods_and_raise_exception_work() {
        let src = "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('roles must alternate') }}{% endif %}{{ messages[0]['content'].strip() | upper }}";
        let t = ChatTemplate::new(src, "t", "", "").unwrap();
        assert_eq!(
            t.render(&[ChatMessage::user("  hi ")], false).unwrap(),
            "HI"
        );
        let err = t
            .render(&[ChatMessage::new("bad", "x")], false)
            .unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn missing_template_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokenizer_config.json");
        std::fs::write(&p, r#"{"eos_token": "</s>"}"#).unwrap();
        // A base model loads; it refuses to chat, naming its files and the way out.
        let t = ChatTemplate::from_tokenizer_config(&p).unwrap();
        assert!(!t.is_present());
        let err = t.render(&[ChatMessage::user("hi")], true).unwrap_err();
        assert!(matches!(err, TemplateError::Missing { .. }));
        assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
        assert!(err.to_string().contains("--chat-template"), "{err}");
        let given = t.replaced("{{ messages[0].content }}!", "t.jinja").unwrap();
        assert_eq!(
            given.render(&[ChatMessage::user("hi")], true).unwrap(),
            "hi!"
        );
        assert_eq!(given.eos_token(), "</s>");
        // A file larger than any template is refused after 1 MiB of it.
        let big = dir.path().join("big.jinja");
        std::fs::write(&big, vec![b'x'; MAX_TEMPLATE_BYTES + 1]).unwrap();
        let err = read_template_file(&big).unwrap_err().to_string();
        assert!(err.contains("big.jinja") && err.contains("1 MiB"), "{err}");
        // An empty template (`--chat-template` of an empty file) is refused, naming it.
        for empty in ["", " \n\t"] {
            let err = t.replaced(empty, "empty.jinja").unwrap_err().to_string();
            assert!(
                err.contains("empty.jinja") && err.contains("empty"),
                "{err}"
            );
        }
    }
}
