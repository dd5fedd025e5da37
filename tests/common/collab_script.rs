//! Deterministic stand-ins for every role of a generate_conv run, keyed on what the prompt
//! asks for: the user simulator (JSON), the judges (JSON), the extractors and the policy.
//! Scores vary with the sample so that candidates differ and pairs form.
#![allow(dead_code)]

use serde_json::Value;

fn hash(s: &str) -> u64 {
    s.bytes().fold(1469598103934665603u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(1099511628211)
    })
}

/// Reply for one sample of a chat request whose last user message is `prompt`.
pub fn reply(prompt: &str, seed: u64, sample: usize) -> String {
    let k = seed.wrapping_add(sample as u64);
    if prompt.contains("role-playing a USER") {
        let turns = prompt.matches("Assistant:").count();
        let response = if turns >= 2 && k.is_multiple_of(3) {
            "[[TERMINATE CHAT]]".to_string()
        } else {
            format!("Could you help with part {}?", k % 5)
        };
        return serde_json::json!({"current_answer": "", "thought": "t", "response": response})
            .to_string();
    }
    if prompt.contains("grading whether") {
        return format!(
            "{{\"thought\": \"checked\", \"accuracy\": {}}}",
            hash(prompt) % 2
        );
    }
    if prompt.contains("rating how well") {
        // Answer on the scale the prompt asks for (judge_interactivity.j2's `scale`).
        let h = hash(prompt);
        if prompt.contains("\"understanding\": <") {
            let level = |x: u64| [0.0, 0.3, 0.7, 1.0][(x % 4) as usize];
            return format!(
                "{{\"thought\": \"ok\", \"understanding\": {}, \"clarification\": {}, \"suggestion\": {}}}",
                level(h),
                level(h / 4),
                level(h / 16)
            );
        }
        let rating = if prompt.contains("<1, 2 or 3>") {
            (1 + h % 3).to_string()
        } else if prompt.contains("<integer from 1 to 5>") {
            (1 + h % 5).to_string()
        } else {
            ["0", "0.5", "1"][(h % 3) as usize].to_string()
        };
        return format!("Sure: {{'thought': 'fine', 'interactivity': {rating},}}");
    }
    if prompt.contains("Extract the final") {
        return "```\nThe final document.\n```".into();
    }
    let reply = format!(
        "Let me think ({k}). Is this about {}? The answer is {}.",
        k % 3,
        k % 7
    );
    if prompt.contains("\"current_problem\"") {
        // The proactive JSON instruction (assistant_proactive_json.j2): the reply is the
        // `response` field.
        return serde_json::json!({"current_problem": "p", "thought": "t", "response": reply})
            .to_string();
    }
    reply
}

/// The same for an OpenAI request body (the fault server's responder).
pub fn reply_to_body(body: &Value, sample: usize) -> String {
    let prompt = body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|x| x["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or("");
    let seed = body["seed"].as_u64().unwrap_or(0);
    reply(prompt, seed, sample)
}
