//! Tool calls through the OpenAI API, sent by the official `openai` client to a real P/D
//! cluster and to an aggregated worker, both routers serving SmolLM2 with the built-in
//! `chatml-tools` template (SmolLM2's own has no tools): `required` and a named function give
//! calls whose arguments validate against the function's schema (checked by `jsonschema`),
//! streamed deltas add up to the whole answer, a tool result round-trips, `auto` answers in
//! OpenAI's shape, and P/D equals one process. Bad tools are 400s naming the field.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use tandem_e2e::{python, rt, Cluster, ClusterOptions};

#[test]
fn tool_calls_validate_stream_round_trip_and_pd_equals_one_process() {
    let template = vec!["--chat-template".to_string(), "chatml-tools".to_string()];
    let pd = Cluster::start(ClusterOptions {
        router_args: template.clone(),
        ..ClusterOptions::default()
    });
    let one = Cluster::start(ClusterOptions {
        pd_pair: false,
        aggregated: true,
        router_args: template,
        ..ClusterOptions::default()
    });
    python(&script(&pd.url, &one.url, 64), &pd);
    // SmolLM2's own template has no tools: said so, not ignored.
    let plain = Cluster::start(ClusterOptions {
        pd_pair: false,
        aggregated: true,
        ..ClusterOptions::default()
    });
    rt().block_on(async {
        let c = reqwest::Client::new();
        for url in [&pd.url, &one.url] {
            let workers = tandem_e2e::workers_when_idle(&c, url).await;
            assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
        }
        let r = c
            .post(format!("{}/v1/chat/completions", plain.url))
            .json(
                &serde_json::json!({"messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f"}}]}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let body: serde_json::Value = r.json().await.unwrap();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("does not support tools"),
            "{body}"
        );
    });
}

/// A KDA-hybrid checkpoint (the public tiny Kimi-Linear one) whose chat template speaks Kimi
/// K2's tool-call markers: the same checks as SmolLM2's, through KDA state handoffs.
#[test]
fn kda_hybrid_tool_calls_with_a_kimi_template_validate_and_pd_equals_one_process() {
    kda_hybrid_tool_calls("kimi_tiny", KIMI_TEMPLATE);
}

/// The same checkpoint with a template in GLM-4.5's `<arg_key>`/`<arg_value>` call shape.
/// (The tiny GLM-5-style reference serves 256 tokens, its indexer's exact top-k, too few for
/// these prompts at a byte a token.)
#[test]
fn kda_hybrid_tool_calls_with_a_glm_template_validate_and_pd_equals_one_process() {
    kda_hybrid_tool_calls("kimi_tiny", GLM_TEMPLATE);
}

fn kda_hybrid_tool_calls(reference: &str, template: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(format!("{reference}-tools"));
    kda_tiny_with_byte_tokenizer(reference, template, &dir);
    let options = ClusterOptions {
        kv_blocks: 256,
        model: Some(dir),
        ..ClusterOptions::default()
    };
    let pd = Cluster::start(options.clone());
    let one = Cluster::start(ClusterOptions {
        pd_pair: false,
        aggregated: true,
        ..options
    });
    python(&script(&pd.url, &one.url, 320), &pd);
    rt().block_on(async {
        let c = reqwest::Client::new();
        for url in [&pd.url, &one.url] {
            let workers = tandem_e2e::workers_when_idle(&c, url).await;
            assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
        }
    });
}

/// A chat template in Kimi K2's shape: tools declared in a system turn, calls as
/// `<|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS
/// <|tool_call_end|>…<|tool_calls_section_end|>`, results in `tool` turns.
const KIMI_TEMPLATE: &str = r#"
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
<|im_system|>tool<|im_middle|>## Return of {{ message.tool_call_id }}
{{ message.content }}<|im_end|>
{%- elif message.role == 'assistant' -%}
<|im_assistant|>assistant<|im_middle|>{{ message.content or '' }}
{%- if message.tool_calls -%}
<|tool_calls_section_begin|>
{%- for call in message.tool_calls -%}
<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>{{ call.function.arguments | tojson }}<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- else -%}
<|im_{{ message.role }}|>{{ message.role }}<|im_middle|>{{ message.content }}<|im_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"#;

/// A chat template in GLM-4.5's shape: calls as `<tool_call>NAME<arg_key>K</arg_key>
/// <arg_value>V</arg_value>…</tool_call>`, results as observations.
const GLM_TEMPLATE: &str = r#"
{%- if tools -%}
<|system|>
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call a function as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>.
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
<|observation|><tool_response>{{ message.content }}</tool_response>
{%- elif message.role == 'assistant' -%}
<|assistant|>{{ message.content or '' }}
{%- for call in message.tool_calls or [] -%}
<tool_call>{{ call.function.name }}
{%- for key, value in call.function.arguments.items() -%}
<arg_key>{{ key }}</arg_key><arg_value>{{ value if value is string else value | tojson }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- else -%}
<|{{ message.role }}|>{{ message.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"#;

/// Reference checkpoint `reference` (a tiny KDA hybrid, vocabulary 512, EOS 2) with a
/// byte-level tokenizer (ids 0..255 are the bytes, so any text, JSON included, has tokens)
/// and chat template `template`.
fn kda_tiny_with_byte_tokenizer(reference: &str, template: &str, dir: &std::path::Path) {
    let reference = tandem_testkit::shared_dir()
        .join("reference")
        .join(reference);
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(reference.join(f), dir.join(f)).unwrap();
    }
    // Byte-level BPE without merges: each byte is the printable character GPT-2's byte map
    // gives it (printable ASCII and Latin-1 stand for themselves, the rest from U+0100 on).
    let mut next = 256u32;
    let vocab: serde_json::Map<String, serde_json::Value> = (0u32..256)
        .map(|b| {
            let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
            let c = if printable {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            };
            (c.to_string(), serde_json::json!(b))
        })
        .collect();
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": true, "use_regex": true});
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = serde_json::json!({"chat_template": template, "eos_token": "\u{0102}",
        "bos_token": "\u{0101}", "add_bos_token": false, "model_max_length": 4096});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// The official client's checks against a P/D cluster (`pd`) and a one-process one (`one`)
/// serving the same model with a template that knows tools; answers of up to `max_tokens`.
fn script(pd: &str, one: &str, max_tokens: u32) -> String {
    format!(
        r##"
import json, openai, jsonschema
MODEL = openai.OpenAI(base_url="{pd}/v1", api_key="unused").models.list().data[0].id
WEATHER = {{"type": "object", "properties": {{"city": {{"type": "string", "maxLength": 16}},
    "unit": {{"enum": ["celsius", "fahrenheit"]}}}}, "required": ["city", "unit"], "additionalProperties": False}}
TIME = {{"type": "object", "properties": {{"zone": {{"type": "string", "maxLength": 12}}}}, "required": ["zone"],
    "additionalProperties": False}}
TOOLS = [{{"type": "function", "function": {{"name": "get_weather", "description": "The weather in a city now",
             "parameters": WEATHER}}}},
         {{"type": "function", "function": {{"name": "get_time", "description": "The time in a zone",
             "parameters": TIME}}}}]
SCHEMA = {{"get_weather": WEATHER, "get_time": TIME}}
ASK = [{{"role": "user", "content": "What is the weather in Paris right now?"}}]

def ask(url, stream, messages=ASK, **kw):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                  max_tokens={max_tokens}, stream=stream, **kw)
    if not stream:
        m = r.choices[0].message
        calls = [(t.function.name, t.function.arguments, t.id) for t in (m.tool_calls or [])]
        return m.content, calls, r.choices[0].finish_reason
    content, calls, finish = None, {{}}, None
    for chunk in r:
        for ch in chunk.choices:
            if ch.delta.content:
                content = (content or "") + ch.delta.content
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", "", None])
                if d.id:
                    assert call[2] is None, ("a call's id came twice", d)
                    call[2] = d.id
                if d.function and d.function.name:
                    call[0] += d.function.name
                if d.function and d.function.arguments:
                    call[1] += d.function.arguments
            finish = ch.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish

def same(a, b):
    # Call ids are fresh per answer; everything else must match.
    strip = lambda r: (r[0], [(n, json.loads(args)) for n, args, _ in r[1]], r[2])
    return strip(a) == strip(b)

def check_calls(calls):
    assert calls, "no calls"
    for name, args, cid in calls:
        assert cid, (name, "no id")
        jsonschema.validate(json.loads(args), SCHEMA[name])

# required: at least one call of a given function, finish_reason tool_calls.
for kw in [dict(temperature=0), dict(temperature=0.9, seed=11)]:
    a = ask("{pd}", False, tool_choice="required", **kw)
    b = ask("{one}", True, tool_choice="required", **kw)
    assert same(a, b), ("required: P/D whole vs one process streamed", a, b)
    content, calls, finish = a
    assert finish == "tool_calls", a
    assert content is None, a
    check_calls(calls)
    print("ok required", kw, calls)
one_call = ask("{pd}", False, tool_choice="required", parallel_tool_calls=False, temperature=0.9, seed=2)
assert len(one_call[1]) == 1, one_call
check_calls(one_call[1])

# A named function: its arguments, finish_reason stop (as OpenAI answers a forced call).
named = {{"type": "function", "function": {{"name": "get_time"}}}}
a = ask("{pd}", True, tool_choice=named, temperature=0)
b = ask("{one}", False, tool_choice=named, temperature=0)
assert same(a, b), ("named", a, b)
assert a[2] == "stop" and [c[0] for c in a[1]] == ["get_time"], a
check_calls(a[1])
print("ok named", a)

# The call and its result go back to the model: an answer in text.
name, args, cid = ask("{pd}", False, tool_choice="required", temperature=0)[1][0]
history = ASK + [
    {{"role": "assistant", "content": None,
     "tool_calls": [{{"id": cid, "type": "function", "function": {{"name": name, "arguments": args}}}}]}},
    {{"role": "tool", "tool_call_id": cid, "content": json.dumps({{"temperature": 18, "sky": "clear"}})}}]
a = ask("{pd}", False, history, tool_choice="none", temperature=0)
b = ask("{one}", True, history, tool_choice="none", temperature=0)
assert same(a, b), ("round trip", a, b)
assert isinstance(a[0], str) and a[0] and not a[1] and a[2] in ("stop", "length"), a
print("ok round trip", a)

# auto: text or calls, in OpenAI's shape either way.
for kw in [dict(temperature=0), dict(temperature=1.0, seed=4)]:
    a = ask("{pd}", False, **kw)
    b = ask("{one}", True, **kw)
    assert same(a, b), ("auto", a, b)
    content, calls, finish = a
    if calls:
        assert finish in ("tool_calls", "length"), a
        for name, args, _ in calls:
            assert name, a
            json.loads(args)
    else:
        assert isinstance(content, str) and finish in ("stop", "length"), a
    print("ok auto", kw, a)

# Bad tools are refused before anything is generated.
c = openai.OpenAI(base_url="{pd}/v1", api_key="unused")
for tools, choice, says in [
        ([{{"type": "function", "function": {{"name": "has space"}}}}], "auto", "tools"),
        (TOOLS, {{"type": "function", "function": {{"name": "nope"}}}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice")]:
    try:
        c.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice)
        raise SystemExit(f"{{tools}} {{choice}} was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == says, e.body
        print("refused:", e.body["message"])
"##
    )
}
