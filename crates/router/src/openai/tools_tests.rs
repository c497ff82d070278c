//! Tests of `tools`: call readers over split text, choices → modes, refusals.

use super::*;

fn weather() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time"}}])
}

/// Feeds `text` in pieces of `step` bytes (on char boundaries), then finishes.
fn read(mode: ToolMode, text: &str, step: usize) -> Vec<Piece> {
    let mut reader = CallReader::new(mode);
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut n = step.min(rest.len());
        while !rest.is_char_boundary(n) {
            n += 1;
        }
        out.extend(reader.push(&rest[..n]));
        rest = &rest[n..];
    }
    out.extend(reader.finish());
    out
}

fn calls_of(pieces: Vec<Piece>) -> (Option<String>, Vec<(String, Value)>) {
    let (content, calls) = gather(pieces);
    let calls = calls
        .into_iter()
        .map(|c| {
            assert!(
                c.id.starts_with("call_") || c.id.starts_with("functions."),
                "{}",
                c.id
            );
            (
                c.function.name,
                serde_json::from_str(&c.function.arguments).expect("arguments are JSON"),
            )
        })
        .collect();
    (content, calls)
}

#[test]
fn hermes_calls_are_found_in_text_however_it_is_split() {
    let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n\
                <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n";
    for step in [1, 2, 3, 7, 1000] {
        let (content, calls) = calls_of(read(ToolMode::Auto(ToolFormat::Hermes), text, step));
        assert_eq!(content.as_deref(), Some("Let me look."), "step {step}");
        assert_eq!(
            calls,
            vec![
                ("get_weather".to_owned(), json!({"city": "Oslo"})),
                ("get_time".to_owned(), json!({}))
            ],
            "step {step}"
        );
    }
}

#[test]
fn auto_text_without_calls_passes_through_untouched() {
    for text in ["Hello <b>there</b> < tool", "ends with <tool_ca", "x\n\n"] {
        for step in [1, 4, 100] {
            let pieces = read(ToolMode::Auto(ToolFormat::Hermes), text, step);
            assert_eq!(
                gather(pieces),
                (Some(text.to_owned()), vec![]),
                "{text:?} step {step}"
            );
        }
    }
}

#[test]
fn a_call_that_is_not_json_stays_text() {
    let text = "a <tool_call>not json</tool_call> b";
    assert_eq!(
        gather(read(ToolMode::Auto(ToolFormat::Hermes), text, 3)),
        (Some(text.to_owned()), vec![])
    );
    // Unclosed at the end: read if it parses, else text.
    let (content, calls) = calls_of(read(
        ToolMode::Auto(ToolFormat::Hermes),
        "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}",
        5,
    ));
    assert_eq!((content, calls.len()), (None, 1));
    let cut = "<tool_call>{\"name\": \"get_ti";
    assert_eq!(
        gather(read(ToolMode::Auto(ToolFormat::Hermes), cut, 5)),
        (Some(cut.to_owned()), vec![])
    );
}

#[test]
fn kimi_calls_keep_the_models_ids() {
    let text = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>\
                {\"city\": \"Oslo\"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1\
                <|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
    for step in [1, 5, 1000] {
        let (content, calls) = gather(read(ToolMode::Auto(ToolFormat::KimiK2), text, step));
        assert_eq!(content, None);
        let got: Vec<_> = calls
            .iter()
            .map(|c| {
                (
                    c.id.as_str(),
                    c.function.name.as_str(),
                    c.function.arguments.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "functions.get_weather:0",
                    "get_weather",
                    "{\"city\": \"Oslo\"}"
                ),
                ("functions.get_time:1", "get_time", "{}")
            ],
            "step {step}"
        );
    }
}

#[test]
fn required_arrays_become_calls_as_each_element_closes() {
    let text = "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"a}\\\"]\"}}, {\"name\": \"get_time\", \"parameters\": {}}]";
    let mut reader = CallReader::new(ToolMode::Required);
    let first_end = text.find("}},").expect("first element") + 2;
    let early = reader.push(&text[..first_end]);
    assert_eq!(
        early.len(),
        1,
        "the first call is handed on once its element closes"
    );
    let mut pieces = early;
    pieces.extend(reader.push(&text[first_end..]));
    pieces.extend(reader.finish());
    let (content, calls) = calls_of(pieces);
    assert_eq!(content, None);
    assert_eq!(
        calls,
        vec![
            ("get_weather".to_owned(), json!({"city": "a}\"]"})),
            ("get_time".to_owned(), json!({}))
        ]
    );
    // Cut off before any call closed: the text stays content.
    let cut = "[{\"name\": \"get_weather\", \"param";
    assert_eq!(
        gather(read(ToolMode::Required, cut, 4)),
        (Some(cut.to_owned()), vec![])
    );
}

#[test]
fn a_named_function_streams_its_arguments() {
    let pieces = read(
        ToolMode::Named("get_weather".into()),
        "{\"city\": \"Oslo\"}",
        4,
    );
    assert!(pieces.len() > 2);
    match &pieces[0] {
        Piece::Call(d) => {
            assert_eq!(d.function.name.as_deref(), Some("get_weather"));
            assert!(d.id.is_some());
        }
        other => panic!("{other:?}"),
    }
    assert!(pieces[1..]
        .iter()
        .all(|p| matches!(p, Piece::Call(d) if d.id.is_none() && d.index == 0)));
    let (content, calls) = calls_of(pieces);
    assert_eq!(
        (content, calls),
        (
            None,
            vec![("get_weather".to_owned(), json!({"city": "Oslo"}))]
        )
    );
}

#[test]
fn tool_choices_map_to_modes_and_constraints() {
    let tools = weather();
    let auto = check(Some(&tools), None, None, Some(ToolFormat::Hermes))
        .unwrap()
        .unwrap();
    assert_eq!(auto.mode, ToolMode::Auto(ToolFormat::Hermes));
    assert_eq!(auto.constraint, None);
    assert_eq!(
        auto.template_tools[1]["function"]["parameters"],
        json!({"type": "object"})
    );
    assert_eq!(
        check(Some(&tools), Some(&json!("none")), None, None).unwrap(),
        None
    );
    assert_eq!(check(None, Some(&json!("auto")), None, None).unwrap(), None);

    let required = check(
        Some(&tools),
        Some(&json!("required")),
        Some(&json!(false)),
        None,
    )
    .unwrap()
    .unwrap();
    let Some(OutputConstraint::JsonSchema(schema)) = required.constraint else {
        panic!()
    };
    let schema: Value = serde_json::from_str(&schema).unwrap();
    assert_eq!(schema["maxItems"], json!(1));
    assert_eq!(
        schema["items"]["anyOf"][0]["properties"]["name"],
        json!({"const": "get_weather"})
    );

    let named = check(
        Some(&tools),
        Some(&json!({"type": "function", "function": {"name": "get_weather"}})),
        None,
        None,
    )
    .unwrap()
    .unwrap();
    assert_eq!(named.mode, ToolMode::Named("get_weather".into()));
    let Some(OutputConstraint::JsonSchema(schema)) = named.constraint else {
        panic!()
    };
    assert_eq!(
        serde_json::from_str::<Value>(&schema).unwrap()["required"],
        json!(["city"])
    );
}

#[test]
fn bad_tools_are_400s_naming_the_field() {
    let tools = weather();
    let cases = [
        (json!("x"), None, "must be a list"),
        (json!([{"type": "retrieval"}]), None, "only `function`"),
        (
            json!([{"type": "function", "function": {"name": "a b"}}]),
            None,
            "1 to 64",
        ),
        (
            json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
            None,
            "JSON schema object",
        ),
        (
            json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
            None,
            "given twice",
        ),
        (
            tools.clone(),
            Some(json!("sometimes")),
            "must be none, auto",
        ),
        (
            tools.clone(),
            Some(json!({"type": "function", "function": {"name": "nope"}})),
            "not in `tools`",
        ),
        (json!([]), Some(json!("required")), "needs `tools`"),
        (tools.clone(), None, "format tandem cannot read"),
    ];
    for (tools, choice, want) in cases {
        let err = check(Some(&tools), choice.as_ref(), None, None).expect_err(want);
        assert!(
            err.to_string().contains(want),
            "{err} does not say {want:?}"
        );
    }
    let err = check(
        Some(&tools),
        None,
        Some(&json!("yes")),
        Some(ToolFormat::Hermes),
    )
    .expect_err("bool");
    assert!(err.to_string().contains("parallel_tool_calls"), "{err}");
}

#[test]
fn formats_are_told_by_their_markers() {
    assert_eq!(
        ToolFormat::detect("{{ '<tool_call>' }}"),
        Some(ToolFormat::Hermes)
    );
    assert_eq!(
        ToolFormat::detect("<|tool_calls_section_begin|><|tool_call_begin|>"),
        Some(ToolFormat::KimiK2)
    );
    assert_eq!(ToolFormat::detect("{% for m in messages %}"), None);
}

#[test]
fn message_calls_reach_templates_with_parsed_arguments() {
    let calls = json!([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]);
    let out = template_calls(&calls, "messages[1]").unwrap();
    assert_eq!(out[0]["function"]["arguments"], json!({"x": 1}));
    assert_eq!(out[0]["id"], json!("call_1"));
    let bad = json!([{"function": {"name": "f", "arguments": "{"}}]);
    assert!(template_calls(&bad, "messages[1]")
        .unwrap_err()
        .to_string()
        .contains("not JSON"));
}

#[test]
fn glm_calls_read_their_key_value_arguments() {
    let text = "Looking it up. <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n\
                <arg_key>days</arg_key><arg_value>3</arg_value>\n</tool_call><tool_call>get_time</tool_call>";
    for step in [1, 5, 1000] {
        let (content, calls) = gather(read(ToolMode::Auto(ToolFormat::Glm), text, step));
        assert_eq!(content.as_deref(), Some("Looking it up."), "step {step}");
        let got: Vec<(&str, Value)> = calls
            .iter()
            .map(|c| {
                (
                    c.function.name.as_str(),
                    serde_json::from_str(&c.function.arguments).expect("JSON arguments"),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("get_weather", json!({"city": "Oslo", "days": 3})),
                ("get_time", json!({}))
            ],
            "step {step}"
        );
    }
    // A body that is not a call (no name, or a broken pair) stays text.
    let broken = "<tool_call><arg_key>city</arg_key></tool_call>";
    let (content, calls) = gather(read(ToolMode::Auto(ToolFormat::Glm), broken, 1000));
    assert!(calls.is_empty(), "{calls:?}");
    assert_eq!(content.as_deref(), Some(broken));
    assert_eq!(
        ToolFormat::detect("{{ '<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key>"),
        Some(ToolFormat::Glm)
    );
}
