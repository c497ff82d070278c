//! `GET /openapi.json`: the router's OpenAPI 3.1 document (`api/openapi.json`, written by
//! hand). The tests below hold its request fields to the code's; the schemathesis run in
//! `tests/tests/api_fuzz.rs` holds the running router's answers to it.

use crate::state::RouterState;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

/// The document's text.
pub const DOCUMENT: &str = include_str!("../../api/openapi.json");

/// The document for a router serving `served_name`: requests' `model` is that name (or absent).
pub fn document(served_name: &str) -> Value {
    let mut doc: Value = serde_json::from_str(DOCUMENT).unwrap_or_else(|_| json!({}));
    for schema in ["ChatCompletionRequest", "CompletionRequest"] {
        let model = &mut doc["components"]["schemas"][schema]["properties"]["model"];
        if model.is_object() {
            *model = json!({"anyOf": [{"const": served_name}, {"type": "null"}]});
        }
    }
    doc
}

/// `GET /openapi.json`
pub(crate) async fn openapi(State(state): State<RouterState>) -> Json<Value> {
    Json(document(state.served_name()))
}

#[cfg(test)]
#[allow(clippy::expect_used)]
mod tests {
    use super::DOCUMENT;
    use crate::openai::protocol::{CHAT_FIELDS, COMPLETION_FIELDS, IGNORED_FIELDS, SHARED_FIELDS};
    use serde_json::Value;
    use std::collections::BTreeSet;

    fn document() -> Value {
        serde_json::from_str(DOCUMENT).expect("api/openapi.json is JSON")
    }

    #[test]
    fn the_served_document_names_the_served_model() {
        let doc = super::document("smol");
        assert_eq!(
            doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["anyOf"][0],
            serde_json::json!({"const": "smol"})
        );
        assert_eq!(doc["paths"], document()["paths"]);
    }

    fn properties(doc: &Value, schema: &str) -> BTreeSet<String> {
        doc["components"]["schemas"][schema]["properties"]
            .as_object()
            .expect("request schema has properties")
            .keys()
            .cloned()
            .collect()
    }

    #[test]
    fn request_fields_are_the_ones_the_code_reads() {
        let doc = document();
        for (schema, own) in [
            ("ChatCompletionRequest", &CHAT_FIELDS[..]),
            ("CompletionRequest", &COMPLETION_FIELDS[..]),
        ] {
            let code: BTreeSet<String> = own
                .iter()
                .chain(&SHARED_FIELDS)
                .chain(&IGNORED_FIELDS)
                .map(|f| (*f).to_owned())
                .collect();
            assert_eq!(properties(&doc, schema), code, "{schema} vs protocol.rs");
            assert_eq!(
                doc["components"]["schemas"][schema]["additionalProperties"],
                Value::Bool(false),
                "{schema}: unknown fields are refused"
            );
        }
    }

    #[test]
    fn every_reference_resolves() {
        let doc = document();
        fn walk(v: &Value, doc: &Value) {
            match v {
                Value::Object(o) => {
                    if let Some(Value::String(r)) = o.get("$ref") {
                        let name = r
                            .strip_prefix("#/components/schemas/")
                            .expect("local schema reference");
                        assert!(
                            doc["components"]["schemas"].get(name).is_some(),
                            "{r} is not defined"
                        );
                    }
                    o.values().for_each(|v| walk(v, doc));
                }
                Value::Array(a) => a.iter().for_each(|v| walk(v, doc)),
                _ => {}
            }
        }
        walk(&doc, &doc);
        assert_eq!(doc["openapi"], "3.1.0");
    }
}
