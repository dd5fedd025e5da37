//! vLLM's tokenizer endpoints, at the root as vLLM serves them: `POST /tokenize` (`prompt`
//! or `messages`) → `count`, `max_model_len`, `tokens`, `token_strs`; `POST /detokenize`
//! (`tokens`) → `prompt`; `GET /tokenizer_info` → the model's `tokenizer_config.json` fields
//! (`bos_token`, `eos_token`, `pad_token`, `chat_template`, `model_max_length`, …).
//!
//! lm-evaluation-harness's `local-completions` looks for `/tokenizer_info` and `/tokenize`
//! and, when both answer, tokenizes through the server instead of downloading the model's
//! tokenizer from the Hub: with them a harness needs nothing but the URL. A text's tokens
//! are the ones `/v1/completions` reads for it, so a harness that tokenizes here and sends
//! ids scores exactly what a text prompt would.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::request::{
    json_object, param_and_shape, parse_messages, type_error, type_error_at, unsupported, Messages,
};
use super::{json_body, ApiError, AppState};
use crate::llm::{TokenizeInput, Tokenized, TokenizerInfo};

/// The body of `POST /tokenize` as sent: `prompt` (vLLM's completion form) or `messages`
/// (its chat form); `null` counts as absent and unknown fields are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TokenizeBody {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Messages>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    return_token_strs: Option<bool>,
    /// Refused when given: the model's own template is the one served.
    chat_template: Option<Value>,
    chat_template_kwargs: Option<Map<String, Value>>,
    tools: Option<Value>,
}

/// The body of `POST /detokenize` as sent.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct DetokenizeBody {
    model: Option<String>,
    tokens: Option<Vec<u32>>,
}

/// A parsed `/tokenize` request.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedTokenize {
    pub input: TokenizeInput,
    pub model: Option<String>,
    pub return_token_strs: bool,
}

/// Parses a `/tokenize` body, every field checked by name before any work.
pub fn parse_tokenize(body: &[u8]) -> Result<ParsedTokenize, ApiError> {
    let value = json_object(body)?;
    let body: TokenizeBody = serde_path_to_error::deserialize(value).map_err(|e| {
        let (param, shape) = param_and_shape(e.path());
        match shape.as_str() {
            "model" | "prompt" => type_error(&param, "a string"),
            "add_special_tokens"
            | "add_generation_prompt"
            | "continue_final_message"
            | "return_token_strs" => type_error(&param, "a boolean"),
            "chat_template_kwargs" => type_error(&param, "an object"),
            // `messages` and its parts: the chat endpoint's table.
            _ => type_error_at(e.path()),
        }
    })?;
    let special = body.add_special_tokens;
    let input = match (body.prompt, body.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "give either `prompt` or `messages`, not both",
                Some("messages"),
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "missing required parameter: `prompt` (text) or `messages` (a conversation)",
                Some("prompt"),
            ))
        }
        (Some(text), None) => {
            for (name, given) in [
                (
                    "add_generation_prompt",
                    body.add_generation_prompt.is_some(),
                ),
                (
                    "continue_final_message",
                    body.continue_final_message.is_some(),
                ),
                ("chat_template", body.chat_template.is_some()),
            ] {
                if given {
                    return Err(ApiError::invalid(
                        format!("`{name}` applies to `messages`, not to a `prompt`"),
                        Some(name),
                    ));
                }
            }
            TokenizeInput::Text {
                text,
                add_special_tokens: special.unwrap_or(true),
            }
        }
        (None, Some(messages)) => {
            if body.continue_final_message == Some(true) {
                return Err(unsupported(
                    "continue_final_message",
                    "`continue_final_message` is not supported by this server",
                ));
            }
            if body.chat_template.is_some() {
                return Err(unsupported(
                    "chat_template",
                    "`chat_template` is not supported by this server (the model's own \
                     template is used; `serve --chat-template FILE` replaces it)",
                ));
            }
            if body
                .chat_template_kwargs
                .as_ref()
                .is_some_and(|m| !m.is_empty())
            {
                return Err(unsupported(
                    "chat_template_kwargs",
                    "`chat_template_kwargs` is not supported by this server",
                ));
            }
            if body
                .tools
                .as_ref()
                .and_then(Value::as_array)
                .is_some_and(|t| !t.is_empty())
            {
                return Err(unsupported(
                    "tools",
                    "tool calling is not supported by this server",
                ));
            }
            TokenizeInput::Chat {
                messages: parse_messages(messages)?,
                add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
                add_special_tokens: special.unwrap_or(false),
            }
        }
    };
    Ok(ParsedTokenize {
        input,
        model: body.model,
        return_token_strs: body.return_token_strs.unwrap_or(false),
    })
}

/// Parses a `/detokenize` body: `tokens`, an array of token ids.
pub fn parse_detokenize(body: &[u8]) -> Result<(Vec<u32>, Option<String>), ApiError> {
    let value = json_object(body)?;
    let body: DetokenizeBody = serde_path_to_error::deserialize(value).map_err(|e| {
        let (param, shape) = param_and_shape(e.path());
        match shape.as_str() {
            "model" => type_error(&param, "a string"),
            _ => type_error("tokens", "an array of token ids (non-negative integers)"),
        }
    })?;
    let tokens = body
        .tokens
        .ok_or_else(|| ApiError::invalid("missing required parameter: `tokens`", Some("tokens")))?;
    Ok((tokens, body.model))
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(name) if !state.names.accepts(name) => Err(ApiError::model_not_found(name)),
        _ => Ok(()),
    }
}

/// `POST /tokenize`.
pub(super) async fn tokenize(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body = json_body(&headers, body)?;
    let parsed = parse_tokenize(&body)?;
    check_model(&state, parsed.model.as_deref())?;
    let info = tokenizer_info_of(&state)?;
    let Tokenized { ids, token_strs } = state
        .backend
        .tokenize(&parsed.input)
        .await
        .map_err(|e| ApiError::from_llm(&e))?;
    Ok(Json(json!({
        "count": ids.len(),
        "max_model_len": info.model_max_length,
        "tokens": ids,
        "token_strs": parsed.return_token_strs.then_some(token_strs),
    })))
}

/// `POST /detokenize`.
pub(super) async fn detokenize(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body = json_body(&headers, body)?;
    let (tokens, model) = parse_detokenize(&body)?;
    check_model(&state, model.as_deref())?;
    let prompt = state
        .backend
        .detokenize(&tokens)
        .await
        .map_err(|e| ApiError::from_llm(&e))?;
    Ok(Json(json!({ "prompt": prompt })))
}

/// `GET /tokenizer_info`: the keys of an HF `tokenizer_config.json` that vLLM reports; a
/// token the model does not declare is `null`, a missing chat template is left out.
pub(super) async fn tokenizer_info(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let info = tokenizer_info_of(&state)?;
    let mut out = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": info.bos_token,
        "eos_token": info.eos_token,
        "pad_token": info.pad_token,
        "unk_token": info.unk_token,
        "model_max_length": info.model_max_length,
        "add_bos_token": info.add_bos_token,
        "add_eos_token": false,
    });
    if let Some(template) = info.chat_template {
        out["chat_template"] = json!(template);
    }
    Ok(Json(out))
}

fn tokenizer_info_of(state: &AppState) -> Result<TokenizerInfo, ApiError> {
    state.backend.tokenizer_info().ok_or_else(|| {
        ApiError::from_llm(&crate::llm::LlmError::Unsupported {
            backend: state.backend.id().to_string(),
            what: "tokenizer endpoints".into(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::ChatMessage;

    fn parse(v: Value) -> Result<ParsedTokenize, ApiError> {
        parse_tokenize(v.to_string().as_bytes())
    }

    #[test]
    fn tokenize_bodies_take_vllms_defaults() {
        let p = parse(json!({"prompt": "hi"})).unwrap();
        assert_eq!(
            p.input,
            TokenizeInput::Text {
                text: "hi".into(),
                add_special_tokens: true
            }
        );
        assert!(!p.return_token_strs && p.model.is_none());
        let p = parse(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "return_token_strs": true, "unknown_field": 1}),
        )
        .unwrap();
        assert_eq!(
            p.input,
            TokenizeInput::Chat {
                messages: vec![ChatMessage::user("hi")],
                add_generation_prompt: true,
                add_special_tokens: false
            }
        );
        assert!(p.return_token_strs);
        assert_eq!(p.model.as_deref(), Some("m"));
    }

    #[test]
    fn bad_tokenize_and_detokenize_bodies_name_the_field() {
        let user = json!([{"role": "user", "content": "hi"}]);
        for (body, param) in [
            (json!({}), "prompt"),
            (json!({"prompt": 3}), "prompt"),
            (json!({"prompt": "a", "messages": user}), "messages"),
            (
                json!({"prompt": "a", "add_special_tokens": "yes"}),
                "add_special_tokens",
            ),
            (
                json!({"prompt": "a", "add_generation_prompt": true}),
                "add_generation_prompt",
            ),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "robot", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": user, "continue_final_message": true}),
                "continue_final_message",
            ),
            (
                json!({"messages": user, "chat_template": "{{ x }}"}),
                "chat_template",
            ),
            (
                json!({"messages": user, "tools": [{"type": "function"}]}),
                "tools",
            ),
        ] {
            let e = parse(body.clone()).expect_err(&body.to_string());
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        for body in [
            json!({}),
            json!({"tokens": [1, -2]}),
            json!({"tokens": "12"}),
        ] {
            let e = parse_detokenize(body.to_string().as_bytes()).expect_err(&body.to_string());
            assert_eq!(e.param.as_deref(), Some("tokens"), "{body}: {}", e.message);
        }
        let (tokens, model) = parse_detokenize(br#"{"tokens": [1, 2], "model": "m"}"#).unwrap();
        assert_eq!((tokens, model.as_deref()), (vec![1, 2], Some("m")));
    }
}
