//! Structured outputs through the OpenAI API, sent by the official `openai` client to a real
//! P/D cluster (the prefill worker samples the first token under the grammar, the decode worker
//! rebuilds it from that token and samples the rest) and to an aggregated worker: every answer
//! parses and validates against its schema (checked by the `jsonschema` package), streamed and
//! not, greedy and seeded, and P/D equals one process token for token. What cannot be enforced
//! is a 400 with the reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use tandem_e2e::{python, rt, Cluster, ClusterOptions};

#[test]
fn structured_outputs_always_validate_and_pd_equals_one_process() {
    let pd = Cluster::start(ClusterOptions::default());
    let one = Cluster::start(ClusterOptions {
        pd_pair: false,
        aggregated: true,
        ..ClusterOptions::default()
    });
    let script = format!(
        r##"
import json, openai, jsonschema
S = lambda n=12: {{"type": "string", "maxLength": n}}
SCHEMAS = [
    ("a person", {{"type": "object", "properties": {{"name": S(), "age": {{"type": "integer", "minimum": 0, "maximum": 120}},
        "pet": {{"enum": ["cat", "dog", "none"]}}}}, "required": ["name", "age", "pet"], "additionalProperties": False}}),
    ("three lucky numbers", {{"type": "array", "items": {{"type": "integer", "minimum": 0, "maximum": 99}}, "minItems": 2, "maxItems": 4}}),
    ("an address", {{"type": "object", "properties": {{"address": {{"type": "object", "properties": {{"city": S(10),
        "zip": {{"type": "string", "pattern": "^[0-9]{{5}}$"}}}}, "required": ["city", "zip"], "additionalProperties": False}}}},
        "required": ["address"], "additionalProperties": False}}),
    ("a product", {{"type": "object", "properties": {{"in_stock": {{"type": "boolean"}}, "price": {{"type": "number", "minimum": 0, "maximum": 1000}}}},
        "required": ["in_stock", "price"], "additionalProperties": False}}),
    ("an id", {{"type": "object", "properties": {{"id": {{"anyOf": [S(8), {{"type": "integer", "minimum": 0, "maximum": 9999}}]}}}},
        "required": ["id"], "additionalProperties": False}}),
    ("two points", {{"$defs": {{"point": {{"type": "object", "properties": {{"x": {{"type": "integer", "minimum": -9, "maximum": 9}},
        "y": {{"type": "integer", "minimum": -9, "maximum": 9}}}}, "required": ["x", "y"], "additionalProperties": False}}}},
        "type": "object", "properties": {{"a": {{"$ref": "#/$defs/point"}}, "b": {{"$ref": "#/$defs/point"}}}},
        "required": ["a", "b"], "additionalProperties": False}}),
    ("a version", {{"type": "object", "properties": {{"version": {{"const": 2}}, "name": S(8)}}, "required": ["version", "name"],
        "additionalProperties": False}}),
    ("a team", {{"type": "object", "properties": {{"members": {{"type": "array", "maxItems": 2, "items": {{"type": "object",
        "properties": {{"name": S(8)}}, "required": ["name"], "additionalProperties": False}}}}}}, "required": ["members"],
        "additionalProperties": False}}),
    ("optional fields", {{"type": "object", "properties": {{"title": S(10), "year": {{"type": "integer", "minimum": 1900, "maximum": 2100}}}},
        "additionalProperties": False}}),
    ("a colour", {{"enum": ["red", "green", "blue"]}}),
    ("a number from 1 to 10", {{"type": "integer", "minimum": 1, "maximum": 10}}),
    ("a short word", {{"type": "string", "minLength": 3, "maxLength": 8}}),
]

def chat(url, topic, fmt, stream, **kw):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    msgs = [{{"role": "user", "content": f"Answer in JSON: give me {{topic}}."}}]
    r = c.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, response_format=fmt,
                                  max_tokens=96, stream=stream, **kw)
    if not stream:
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in r:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish

def schema_format(s):
    return {{"type": "json_schema", "json_schema": {{"name": "answer", "schema": s, "strict": True}}}}

for i, (topic, schema) in enumerate(SCHEMAS):
    fmt = schema_format(schema)
    runs = [("greedy", dict(temperature=0))]
    if i < 4:
        runs.append(("seeded", dict(temperature=0.9, seed=5 + i)))
    for name, kw in runs:
        a = chat("{pd}", topic, fmt, False, **kw)
        b = chat("{one}", topic, fmt, True, **kw)
        assert a == b, (topic, name, "P/D vs one process (streamed)", a, b)
        text, finish = a
        assert finish == "stop", (topic, name, a)
        jsonschema.validate(json.loads(text), schema)
        print("ok", topic, name, text)

# JSON mode: any object, streamed and not, P/D equal to one process.
mode = {{"type": "json_object"}}
for kw in [dict(temperature=0), dict(temperature=0.9, seed=3)]:
    a = chat("{pd}", "a small object with two keys", mode, True, **kw)
    b = chat("{one}", "a small object with two keys", mode, False, **kw)
    assert a == b, (a, b)
    if a[1] == "stop":
        assert isinstance(json.loads(a[0]), dict), a
    else:
        assert a[0].startswith("{{"), a
    print("ok json_object", a)

# What cannot be enforced is refused before anything is generated.
for bad, says in [({{"type": "object", "not": {{"type": "null"}}}}, "not"),
                  ({{"type": "object", "properties": {{"a": {{"$ref": "#/$defs/missing"}}}}}}, "missing")]:
    try:
        chat("{pd}", "x", schema_format(bad), False, temperature=0)
        raise SystemExit(f"{{bad}} was accepted")
    except openai.BadRequestError as e:
        assert says in str(e), e
        print("refused:", e)
"##,
        pd = pd.url,
        one = one.url
    );
    python(&script, &pd);
    rt().block_on(async {
        let c = reqwest::Client::new();
        for url in [&pd.url, &one.url] {
            let workers = tandem_e2e::workers_when_idle(&c, url).await;
            assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
        }
    });
}
