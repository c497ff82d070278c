//! Tests of `validation`: defaults, ranges, refusals, tools and prompts.

use super::*;
use std::path::Path;

fn model() -> ModelAssets {
    ModelAssets::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-chatml"))
        .expect("fixture loads")
}

fn chat_with(model: &ModelAssets, body: serde_json::Value) -> Result<Prepared, ApiError> {
    let request = serde_json::from_value(body).expect("parses");
    prepare_chat(model, "tiny", RequestId("chatcmpl-1".into()), request)
}

#[test]
fn tools_need_a_template_that_reads_them_and_set_the_mode() {
    use crate::openai::tools::{ToolFormat, ToolMode};
    use serde_json::json;
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let msgs = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    let err = chat_with(&model(), json!({"messages": msgs, "tools": tools})).expect_err("no tools");
    assert!(err.to_string().contains("does not support tools"), "{err}");
    assert_eq!(err.body().error.param.as_deref(), Some("tools"));
    // tool_choice none needs no tool support (the tools are not shown).
    let none = chat_with(
        &model(),
        json!({"messages": msgs, "tools": tools, "tool_choice": "none"}),
    )
    .expect("none is fine");
    assert_eq!(none.tools, None);

    // The fixture with room for the tools' system prompt (its tokenizer spends a token
    // on nearly every character).
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-chatml");
    let tmp = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture.join(f), tmp.path().join(f)).unwrap();
    }
    let config = std::fs::read_to_string(fixture.join("config.json")).unwrap();
    std::fs::write(
        tmp.path().join("config.json"),
        config.replace(
            "\"max_position_embeddings\": 256",
            "\"max_position_embeddings\": 8192",
        ),
    )
    .unwrap();
    let dir = tmp.path().to_owned();
    let with_tools =
        ModelAssets::load_with_template(&dir, Some(Path::new("chatml-tools"))).expect("built-in");
    assert_eq!(with_tools.tool_format(), Some(ToolFormat::Hermes));
    let auto = chat_with(&with_tools, json!({"messages": msgs, "tools": tools})).expect("auto");
    assert_eq!(auto.tools, Some(ToolMode::Auto(ToolFormat::Hermes)));
    assert_eq!(auto.request.sampling.constraint, None);
    let plain = chat_with(&with_tools, json!({"messages": msgs})).expect("no tools");
    assert!(
        auto.request.prompt_token_ids.len() > plain.request.prompt_token_ids.len(),
        "the tools are in the prompt"
    );
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let p = chat_with(
        &with_tools,
        json!({"messages": msgs, "tools": tools, "tool_choice": named}),
    )
    .expect("named");
    assert_eq!(p.tools, Some(ToolMode::Named("get_weather".into())));
    assert!(matches!(
        p.request.sampling.constraint,
        Some(OutputConstraint::JsonSchema(_))
    ));
    let err = chat_with(
        &with_tools,
        json!({"messages": msgs, "tools": tools, "tool_choice": named,
               "response_format": {"type": "json_object"}}),
    )
    .expect_err("two constraints");
    assert_eq!(err.body().error.param.as_deref(), Some("response_format"));

    // A tool-result round trip: the assistant's call and the tool's answer.
    let round = json!([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]);
    chat_with(&with_tools, json!({"messages": round, "tools": tools})).expect("round trip");
    let mut no_id = round.clone();
    no_id[2].as_object_mut().unwrap().remove("tool_call_id");
    let err = chat_with(&with_tools, json!({"messages": no_id, "tools": tools})).expect_err("id");
    assert!(err.to_string().contains("tool_call_id"), "{err}");
    let err = ModelAssets::load_with_template(&dir, Some(Path::new("no-such-template")))
        .expect_err("unknown");
    assert!(err.to_string().contains("chatml-tools"), "{err}");
}

fn completion(body: serde_json::Value) -> Result<Prepared, ApiError> {
    let request = serde_json::from_value(body).expect("parses");
    prepare_completion(&model(), "tiny", RequestId("cmpl-1".into()), request)
}

#[test]
fn defaults_fill_in() {
    let prepared = completion(serde_json::json!({"prompt": "hello", "seed": 7})).expect("valid");
    let sampling = &prepared.request.sampling;
    assert_eq!(prepared.request.prompt_token_ids.len(), 1);
    assert_eq!(sampling.max_tokens, 255, "min(256, context - prompt)");
    assert_eq!(
        (sampling.temperature, sampling.top_p, sampling.top_k),
        (1.0, 1.0, 0)
    );
    assert_eq!(sampling.seed, 7);
    assert!(sampling.stop_token_ids.is_empty());
    assert!(!prepared.stream);
}

#[test]
fn ranges_are_checked() {
    for (body, param) in [
        (
            serde_json::json!({"prompt": "x", "temperature": 2.5}),
            "temperature",
        ),
        (serde_json::json!({"prompt": "x", "top_p": 0}), "top_p"),
        (serde_json::json!({"prompt": "x", "top_k": -2}), "top_k"),
        (
            serde_json::json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            serde_json::json!({"prompt": "x", "max_tokens": 256}),
            "max_tokens",
        ),
        (serde_json::json!({"prompt": "x", "n": 17}), "n"),
        (serde_json::json!({"prompt": "x", "best_of": 17}), "best_of"),
        (serde_json::json!({"prompt": "x", "best_of": 0}), "best_of"),
        (
            serde_json::json!({"prompt": "x", "n": 3, "best_of": 2}),
            "best_of",
        ),
        (
            serde_json::json!({"prompt": "x", "n": 1, "best_of": 2, "stream": true}),
            "best_of",
        ),
        (
            serde_json::json!({"prompt": "x", "stop_token_ids": [999]}),
            "stop_token_ids",
        ),
        (serde_json::json!({"prompt": [1, 100000]}), "prompt"),
        (serde_json::json!({"prompt": ["a", "b"]}), "prompt"),
        (serde_json::json!({}), "prompt"),
    ] {
        let err = completion(body.clone()).expect_err("invalid");
        assert_eq!(err.body().error.param.as_deref(), Some(param), "{body}");
        assert_eq!(err.status().as_u16(), 400);
    }
}

#[test]
fn fields_the_server_cannot_honour_are_refused_not_ignored() {
    use serde_json::json;
    let base = json!({"prompt": "hi", "max_tokens": 4});
    let with = |k: &str, v: serde_json::Value| {
        let mut b = base.clone();
        b[k] = v;
        completion(b)
    };
    for (field, value, says) in [
        (
            "response_format",
            json!({"type": "json_schema"}),
            "needs a `json_schema` object",
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"schema": 3}}),
            "must be a JSON schema object",
        ),
        ("response_format", json!("bogus"), "must be an object"),
        (
            "response_format",
            json!({"type": "xml"}),
            "must be text, json_object",
        ),
        ("logit_bias", json!({"x": 5}), "must be token ids"),
        ("logit_bias", json!({"42": 101}), "must be in [-100, 100]"),
        (
            "logit_bias",
            json!({"99999999": 1}),
            "outside the vocabulary",
        ),
        ("logit_bias", json!([1]), "must be an object"),
        ("presence_penalty", json!(2.5), "must be in [-2, 2]"),
        ("frequency_penalty", json!("x"), "must be a number"),
        ("repetition_penalty", json!(0), "greater than 0"),
        ("repetition_penalty", json!(-1), "must be in [0, 2]"),
        ("min_p", json!(1.5), "must be in [0, 1]"),
        ("min_tokens", json!(-3), "non-negative integer"),
        ("min_tokens", json!(9), "must not exceed"),
        ("stream_options", json!([]), "must be an object"),
    ] {
        let err = with(field, value.clone()).expect_err(field);
        let body = err.body();
        assert_eq!(body.error.param.as_deref(), Some(field), "{field} {value}");
        assert!(
            body.error.message.contains(says),
            "{field} {value}: {}",
            body.error.message
        );
    }
    // Neutral values are what SDKs send by default: accepted.
    for (field, value) in [
        ("response_format", json!({"type": "text"})),
        ("logit_bias", json!({})),
        ("presence_penalty", json!(0)),
        ("frequency_penalty", json!(0.0)),
        ("repetition_penalty", json!(1)),
        ("min_p", json!(0)),
        ("min_tokens", json!(0)),
        ("stream_options", json!({"include_usage": true})),
    ] {
        assert!(with(field, value.clone()).is_ok(), "{field} {value}");
    }
}

#[test]
fn unknown_fields_are_refused_by_name_and_caller_fields_accepted() {
    use serde_json::json;
    let err = completion(json!({"prompt": "x", "temprature": 0.5})).expect_err("typo");
    assert_eq!(err.body().error.param.as_deref(), Some("temprature"));
    assert!(err
        .body()
        .error
        .message
        .contains("Unrecognized request argument"));
    let ok = completion(json!({"prompt": "x", "user": "u1", "metadata": {"a": "b"},
                                "max_tokens": 3, "presence_penalty": 0.1}));
    assert!(ok.is_ok(), "{:?}", ok.err());
    let chat = |body: serde_json::Value| {
        let request = serde_json::from_value(body).expect("parses");
        prepare_chat(&model(), "tiny", RequestId("chatcmpl-1".into()), request)
    };
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let err = chat(json!({"messages": msgs, "prompt": "x"})).expect_err("a completion field");
    assert_eq!(err.body().error.param.as_deref(), Some("prompt"));
    assert!(chat(json!({"messages": msgs, "max_completion_tokens": 3, "store": false})).is_ok());
}

#[test]
fn logprobs_are_checked_per_endpoint() {
    use serde_json::json;
    let chat = |extra: serde_json::Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        let request = serde_json::from_value(body).expect("parses");
        prepare_chat(&model(), "tiny", RequestId("chatcmpl-1".into()), request)
    };
    let lp = |r: Result<Prepared, ApiError>| r.expect("valid").request.sampling.logprobs;
    assert_eq!(lp(chat(json!({}))), None);
    assert_eq!(lp(chat(json!({"logprobs": true}))), Some(0));
    assert_eq!(
        lp(chat(json!({"logprobs": true, "top_logprobs": 5}))),
        Some(5)
    );
    assert_eq!(
        lp(chat(json!({"logprobs": false, "top_logprobs": 0}))),
        None
    );
    for (body, says) in [
        (json!({"logprobs": 2}), "must be a boolean"),
        (json!({"top_logprobs": 3}), "needs `logprobs: true`"),
        (json!({"logprobs": true, "top_logprobs": 21}), "[0, 20]"),
    ] {
        let err = chat(body.clone()).expect_err("refused");
        assert!(
            err.body().error.message.contains(says),
            "{body}: {}",
            err.body().error.message
        );
    }
    let c =
        |v: serde_json::Value| completion(json!({"prompt": "hi", "max_tokens": 4, "logprobs": v}));
    assert_eq!(lp(c(json!(3))), Some(3));
    assert_eq!(lp(c(json!(null))), None);
    assert!(c(json!(true)).is_err(), "completions take a count");
    assert!(c(json!(-1)).is_err());
}

#[test]
fn sampling_controls_reach_the_parameters() {
    let prepared = completion(serde_json::json!({
        "prompt": [5, 6], "max_tokens": 8, "presence_penalty": 0.5,
        "frequency_penalty": -1, "repetition_penalty": 1.3, "min_p": 0.05,
        "min_tokens": 4, "logit_bias": {"7": 100, "3": -100}
    }))
    .expect("valid");
    let s = &prepared.request.sampling;
    assert_eq!(
        (
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty
        ),
        (0.5, -1.0, 1.3)
    );
    assert_eq!((s.min_p, s.min_tokens), (0.05, 4));
    assert_eq!(s.logit_bias, vec![(3, -100.0), (7, 100.0)]);
}

#[test]
fn response_formats_become_constraints() {
    use serde_json::json;
    let constraint = |format: serde_json::Value| {
        completion(json!({"prompt": "hi", "max_tokens": 4, "response_format": format}))
            .expect("valid")
            .request
            .sampling
            .constraint
    };
    assert_eq!(constraint(json!({"type": "text"})), None);
    assert_eq!(
        constraint(json!({"type": "json_object"})),
        Some(OutputConstraint::JsonObject)
    );
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let Some(OutputConstraint::JsonSchema(text)) = constraint(
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}),
    ) else {
        panic!("a schema constraint")
    };
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&text).expect("JSON"),
        schema
    );
    assert_eq!(
        constraint(json!({"type": "json_schema", "json_schema": {"name": "any"}})),
        Some(OutputConstraint::JsonSchema("{}".into())),
        "no schema: any JSON value"
    );
}

#[test]
fn top_k_minus_one_disables() {
    let prepared =
        completion(serde_json::json!({"prompt": [5, 6], "top_k": -1, "max_tokens": 254}))
            .expect("valid");
    assert_eq!(prepared.request.sampling.top_k, 0);
    assert_eq!(prepared.request.sampling.max_tokens, 254);
}

#[test]
fn best_of_generates_more_choices_than_it_answers() {
    let p = completion(serde_json::json!({"prompt": "x", "n": 2, "best_of": 5})).expect("valid");
    assert_eq!((p.choices, p.kept), (5, 2));
    let p = completion(serde_json::json!({"prompt": "x", "n": 3})).expect("valid");
    assert_eq!((p.choices, p.kept), (3, 3));
    let p = completion(serde_json::json!({"prompt": "x", "best_of": 2, "n": 2, "stream": true}))
        .expect("best_of = n streams");
    assert_eq!((p.choices, p.kept), (2, 2));
}

#[test]
fn integral_floats_are_read_as_integers_and_fractions_are_refused() {
    let body = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7.0,
        "top_logprobs": 2.0, "logprobs": true, "seed": -3.0, "temperature": 1}"#;
    let request: ChatCompletionRequest = parse_body(body).expect("integral floats parse");
    let prepared =
        prepare_chat(&model(), "tiny", RequestId("chatcmpl-1".into()), request).expect("valid");
    assert_eq!(prepared.request.sampling.max_tokens, 7);
    assert_eq!(prepared.request.sampling.logprobs, Some(2));
    assert_eq!(prepared.request.sampling.seed, u64::MAX - 2);
    assert!((prepared.request.sampling.temperature - 1.0).abs() < 1e-6);

    let err = parse_body::<ChatCompletionRequest>(
        br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7.5}"#,
    )
    .expect_err("a fraction is not a token count");
    assert!(err.to_string().contains("invalid request body"), "{err}");
    let err = parse_body::<ChatCompletionRequest>(b"{\"messages\": [").expect_err("cut short");
    assert!(err.to_string().contains("malformed JSON"), "{err}");
}
