//! Tool calls (OpenAI function calling): `tools` and `tool_choice` checked, the tools handed
//! to the chat template, and the model's text turned back into `tool_calls`.
//!
//! How each `tool_choice` is served:
//! - `auto`: the model writes freely; calls are found in its text in the format its chat
//!   template taught it ([`ToolFormat`]), the rest is `content`.
//! - `required`: the output is constrained (llguidance, like `response_format`) to a JSON array
//!   of `{"name": …, "parameters": {…}}` objects over the given functions, read back as calls.
//! - a named function: the output is constrained to that function's `parameters` schema and is
//!   its arguments.
//! - `none`: the tools are not shown to the model and nothing is parsed.

use crate::error::ApiError;
use crate::openai::protocol::{FunctionCallDelta, ToolCall, ToolCallDelta};
use serde_json::{json, Map, Value};
use tandem_core::OutputConstraint;

/// Most functions one request may offer.
pub const MAX_TOOLS: usize = 128;

/// How a chat template has its model write calls in free text (for `tool_choice: auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Hermes, Qwen, SmolLM3 and
    /// tandem's `templates/chatml-tools.jinja`).
    Hermes,
    /// Kimi K2 / Kimi-Linear: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I
    /// <|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>`.
    KimiK2,
    /// GLM-4.5 and later (GLM-4-MoE): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V
    /// </arg_value>…</tool_call>`, each value JSON where it reads as JSON, else a string.
    Glm,
}

impl ToolFormat {
    /// The format a template teaches, recognised by its markers; `None` when it is none
    /// tandem reads.
    pub fn detect(template_source: &str) -> Option<Self> {
        if template_source.contains("<|tool_call_begin|>") {
            Some(Self::KimiK2)
        } else if template_source.contains("<arg_key>") {
            Some(Self::Glm)
        } else if template_source.contains("<tool_call>") {
            Some(Self::Hermes)
        } else {
            None
        }
    }

    /// Where a call starts and ends in the text; markers that only group calls (dropped).
    fn markup(self) -> Markup {
        match self {
            Self::Hermes | Self::Glm => Markup {
                open: "<tool_call>",
                close: "</tool_call>",
                dropped: &[],
            },
            Self::KimiK2 => Markup {
                open: "<|tool_call_begin|>",
                close: "<|tool_call_end|>",
                dropped: &["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"],
            },
        }
    }

    /// A call's text between its markers → (id the model wrote, name, arguments JSON text).
    fn parse_call(self, body: &str) -> Option<(Option<String>, String, String)> {
        match self {
            Self::Hermes => {
                let call: Value = serde_json::from_str(body.trim()).ok()?;
                let name = call.get("name")?.as_str()?.to_owned();
                let arguments = call
                    .get("arguments")
                    .or_else(|| call.get("parameters"))
                    .cloned()
                    .unwrap_or_else(|| json!({}));
                let arguments = match arguments {
                    Value::String(text) => text,
                    other => other.to_string(),
                };
                Some((None, name, arguments))
            }
            Self::KimiK2 => {
                let (id, arguments) = body.split_once("<|tool_call_argument_begin|>")?;
                let id = id.trim();
                // `functions.get_weather:0`: the name sits between the namespace and the index.
                let name = id.rsplit_once(':').map_or(id, |(head, _)| head);
                let name = name.rsplit_once('.').map_or(name, |(_, tail)| tail);
                let arguments = arguments.trim();
                serde_json::from_str::<Value>(arguments).ok()?;
                (!name.is_empty())
                    .then(|| (Some(id.to_owned()), name.to_owned(), arguments.to_owned()))
            }
            Self::Glm => {
                let (name, mut rest) = body
                    .split_once("<arg_key>")
                    .map_or((body, ""), |(n, r)| (n, r));
                let name = name.trim();
                let mut arguments = Map::new();
                while !rest.is_empty() {
                    let (key, after) = rest.split_once("</arg_key>")?;
                    let (_, after) = after.split_once("<arg_value>")?;
                    let (value, after) = after.split_once("</arg_value>")?;
                    let value = value.trim();
                    let value = serde_json::from_str(value)
                        .unwrap_or_else(|_| Value::String(value.to_owned()));
                    arguments.insert(key.trim().to_owned(), value);
                    rest = after.split_once("<arg_key>").map_or("", |(_, r)| r);
                }
                let valid = !name.is_empty() && !name.contains(char::is_whitespace);
                valid.then(|| (None, name.to_owned(), Value::Object(arguments).to_string()))
            }
        }
    }
}

struct Markup {
    open: &'static str,
    close: &'static str,
    dropped: &'static [&'static str],
}

/// What a request's `tool_choice` asks of the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolMode {
    /// Calls are read from free text written in this format.
    Auto(ToolFormat),
    /// The output is a JSON array of calls (constrained).
    Required,
    /// The output is the arguments of the named function (constrained).
    Named(String),
}

/// A request's checked tools.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolRequest {
    /// How its output is read.
    pub mode: ToolMode,
    /// The tools as the chat template gets them (`{"type": "function", "function": {...}}`).
    pub template_tools: Vec<Value>,
    /// The constraint on the output (`required` and named functions).
    pub constraint: Option<OutputConstraint>,
}

/// Checks `tools`, `tool_choice` and `parallel_tool_calls`; `None` when the request uses no
/// tools (none given, or `tool_choice: none`). `format` is what the model's template teaches
/// (`auto` needs one).
pub fn check(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<&Value>,
    format: Option<ToolFormat>,
) -> Result<Option<ToolRequest>, ApiError> {
    let invalid = |message: String, param: &str| ApiError::invalid(message, Some(param));
    let parallel = match parallel {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(invalid(
                format!("`parallel_tool_calls` must be a boolean, got {other}"),
                "parallel_tool_calls",
            ))
        }
    };
    let tools = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, t)| check_tool(i, t))
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => {
            return Err(invalid(
                format!("`tools` must be a list of functions, got {other}"),
                "tools",
            ))
        }
    };
    if tools.len() > MAX_TOOLS {
        return Err(invalid(
            format!("at most {MAX_TOOLS} tools are allowed, got {}", tools.len()),
            "tools",
        ));
    }
    for (i, tool) in tools.iter().enumerate() {
        if tools[..i].iter().any(|t| t.name == tool.name) {
            return Err(invalid(
                format!("`tools[{i}]`: function `{}` is given twice", tool.name),
                "tools",
            ));
        }
    }
    enum Choice {
        None,
        Auto,
        Required,
        Named(String),
    }
    let choice = match choice {
        None | Some(Value::Null) => {
            if tools.is_empty() {
                Choice::None
            } else {
                Choice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => {
                return Err(invalid(
                    format!(
                        "`tool_choice` must be none, auto, required or a function, got {other:?}"
                    ),
                    "tool_choice",
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = match (o.get("type").and_then(Value::as_str), o.get("function")) {
                (Some("function"), Some(f)) => f.get("name").and_then(Value::as_str),
                _ => None,
            };
            let name = name.ok_or_else(|| {
                invalid(
                    "`tool_choice` as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}".to_owned(),
                    "tool_choice",
                )
            })?;
            Choice::Named(name.to_owned())
        }
        Some(other) => {
            return Err(invalid(
                format!("`tool_choice` must be a string or an object, got {other}"),
                "tool_choice",
            ))
        }
    };
    let template_tools = || tools.iter().map(|t| t.template.clone()).collect();
    let needs_tools =
        |what: &str| invalid(format!("`tool_choice` {what} needs `tools`"), "tool_choice");
    Ok(match choice {
        Choice::None => None,
        Choice::Auto if tools.is_empty() => None,
        Choice::Auto => {
            let format = format.ok_or_else(|| {
                invalid(
                    "`tool_choice` auto: this model's chat template writes tool calls in a \
                     format tandem cannot read; use `required` or a named function"
                        .to_owned(),
                    "tool_choice",
                )
            })?;
            Some(ToolRequest {
                mode: ToolMode::Auto(format),
                template_tools: template_tools(),
                constraint: None,
            })
        }
        Choice::Required => {
            if tools.is_empty() {
                return Err(needs_tools("required"));
            }
            let calls: Vec<Value> = tools
                .iter()
                .map(|t| {
                    json!({"type": "object",
                           "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                           "required": ["name", "parameters"],
                           "additionalProperties": false})
                })
                .collect();
            let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
            if !parallel {
                schema["maxItems"] = json!(1);
            }
            Some(ToolRequest {
                mode: ToolMode::Required,
                template_tools: template_tools(),
                constraint: Some(OutputConstraint::JsonSchema(schema.to_string())),
            })
        }
        Choice::Named(name) => {
            if tools.is_empty() {
                return Err(needs_tools("naming a function"));
            }
            let tool = tools.iter().find(|t| t.name == name).ok_or_else(|| {
                invalid(
                    format!("`tool_choice` names function `{name}`, which is not in `tools`"),
                    "tool_choice",
                )
            })?;
            Some(ToolRequest {
                mode: ToolMode::Named(name.clone()),
                template_tools: template_tools(),
                constraint: Some(OutputConstraint::JsonSchema(tool.parameters.to_string())),
            })
        }
    })
}

/// One checked function of `tools`.
struct Tool {
    name: String,
    /// Its arguments' schema (`{"type": "object"}` when it declares none).
    parameters: Value,
    /// As the template gets it.
    template: Value,
}

fn check_tool(i: usize, tool: &Value) -> Result<Tool, ApiError> {
    let invalid =
        |message: String| ApiError::invalid(format!("`tools[{i}]`: {message}"), Some("tools"));
    let o = tool
        .as_object()
        .ok_or_else(|| invalid(format!("a tool must be an object, got {tool}")))?;
    match o.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(invalid(format!(
                "tools of type `{other}` are not supported (only `function`)"
            )))
        }
        None => return Err(invalid("`type` must be \"function\"".to_owned())),
    }
    let f = o
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid("`function` must be an object".to_owned()))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("`function.name` must be a string".to_owned()))?;
    let name_ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(invalid(format!(
            "`function.name` must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name:?}"
        )));
    }
    if let Some(d) = f
        .get("description")
        .filter(|d| !d.is_null() && !d.is_string())
    {
        return Err(invalid(format!(
            "`function.description` must be a string, got {d}"
        )));
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object"}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(other) => {
            return Err(invalid(format!(
                "`function.parameters` must be a JSON schema object, got {other}"
            )))
        }
    };
    let mut function = Map::new();
    function.insert("name".into(), json!(name));
    if let Some(d) = f.get("description").filter(|d| d.is_string()) {
        function.insert("description".into(), d.clone());
    }
    function.insert("parameters".into(), parameters.clone());
    Ok(Tool {
        name: name.to_owned(),
        parameters,
        template: json!({"type": "function", "function": function}),
    })
}

/// An assistant message's `tool_calls` as the template gets them (arguments parsed from
/// their JSON text, as transformers expects); `param` names the message in errors.
pub fn template_calls(calls: &Value, param: &str) -> Result<Vec<Value>, ApiError> {
    let invalid =
        |message: String| ApiError::invalid(format!("{param}: {message}"), Some("messages"));
    let calls = calls
        .as_array()
        .ok_or_else(|| invalid("`tool_calls` must be a list".to_owned()))?;
    calls
        .iter()
        .enumerate()
        .map(|(j, call)| {
            let f = call
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| invalid(format!("`tool_calls[{j}].function` must be an object")))?;
            let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                invalid(format!("`tool_calls[{j}].function.name` must be a string"))
            })?;
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => json!({}),
                Some(Value::String(text)) => serde_json::from_str(text).map_err(|e| {
                    invalid(format!(
                        "`tool_calls[{j}].function.arguments` is not JSON: {e}"
                    ))
                })?,
                Some(other) => other.clone(),
            };
            let mut out =
                json!({"type": "function", "function": {"name": name, "arguments": arguments}});
            if let Some(id) = call.get("id").and_then(Value::as_str) {
                out["id"] = json!(id);
            }
            Ok(out)
        })
        .collect()
}

/// What the output reader hands on: text for `content`, or a part of a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// More `content`.
    Content(String),
    /// A call's first part (id, name, maybe arguments) or more of its arguments.
    Call(ToolCallDelta),
}

/// Reads a choice's text as it streams and splits it into content and calls.
#[derive(Debug)]
pub struct CallReader {
    mode: ToolMode,
    /// Text not handed on yet (a possible marker's start, a call not closed, or, for
    /// `required`, the array read so far).
    held: String,
    /// Inside a call (`auto`): `held` is its body.
    in_call: bool,
    /// Whitespace withheld after a call (emitted only if more content follows).
    pending_space: String,
    calls: u32,
    /// `required`: how far `held` has been scanned, and the scanner's state there.
    scan: JsonScan,
}

/// Enough JSON lexing to find where each element of a top-level array ends.
#[derive(Debug, Default)]
struct JsonScan {
    at: usize,
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// Byte offset in `held` where the current element began.
    element: Option<usize>,
}

impl CallReader {
    /// A reader for a request's mode.
    pub fn new(mode: ToolMode) -> Self {
        Self {
            mode,
            held: String::new(),
            in_call: false,
            pending_space: String::new(),
            calls: 0,
            scan: JsonScan::default(),
        }
    }

    /// Whether the answer held a call (its finish reason becomes `tool_calls` unless the
    /// function was named).
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// Whether the mode names the function (OpenAI ends such answers with `stop`).
    pub fn named(&self) -> bool {
        matches!(self.mode, ToolMode::Named(_))
    }

    /// Reads more text.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        match self.mode.clone() {
            ToolMode::Named(name) => {
                if self.calls == 0 {
                    out.push(self.start_call(None, name, text.to_owned()));
                } else if !text.is_empty() {
                    out.push(Piece::Call(ToolCallDelta {
                        index: 0,
                        id: None,
                        kind: None,
                        function: FunctionCallDelta {
                            name: None,
                            arguments: Some(text.to_owned()),
                        },
                    }));
                }
            }
            ToolMode::Required => {
                self.held.push_str(text);
                self.scan_required(&mut out);
            }
            ToolMode::Auto(format) => {
                self.held.push_str(text);
                self.read_auto(format, &mut out, false);
            }
        }
        out
    }

    /// The text has ended: hands on what was held.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        match self.mode.clone() {
            ToolMode::Named(name) => {
                if self.calls == 0 {
                    out.push(self.start_call(None, name, String::new()));
                }
            }
            ToolMode::Required => {
                // A cut-off array (max_tokens): what did not make a whole call stays text.
                if self.calls == 0 && !self.held.trim().is_empty() {
                    out.push(Piece::Content(std::mem::take(&mut self.held)));
                }
            }
            ToolMode::Auto(format) => {
                self.read_auto(format, &mut out, true);
                if self.in_call {
                    // An unclosed call: read it if it parses, else it stays text.
                    let body = std::mem::take(&mut self.held);
                    self.in_call = false;
                    match format.parse_call(&body) {
                        Some((id, name, arguments)) => {
                            out.push(self.start_call(id, name, arguments))
                        }
                        None => self.content(format!("{}{body}", format.markup().open), &mut out),
                    }
                }
            }
        }
        out
    }

    fn start_call(&mut self, id: Option<String>, name: String, arguments: String) -> Piece {
        let index = self.calls;
        self.calls += 1;
        self.pending_space.clear();
        Piece::Call(ToolCallDelta {
            index,
            id: Some(id.unwrap_or_else(new_call_id)),
            kind: Some("function"),
            function: FunctionCallDelta {
                name: Some(name),
                arguments: Some(arguments),
            },
        })
    }

    /// Content text; after a call, whitespace waits until something else follows.
    fn content(&mut self, text: String, out: &mut Vec<Piece>) {
        if text.is_empty() {
            return;
        }
        if self.calls > 0 && text.trim().is_empty() {
            self.pending_space.push_str(&text);
            return;
        }
        let text = std::mem::take(&mut self.pending_space) + &text;
        match out.last_mut() {
            Some(Piece::Content(last)) => last.push_str(&text),
            _ => out.push(Piece::Content(text)),
        }
    }

    fn read_auto(&mut self, format: ToolFormat, out: &mut Vec<Piece>, at_end: bool) {
        let markup = format.markup();
        loop {
            if self.in_call {
                let Some(end) = self.held.find(markup.close) else {
                    return;
                };
                let body = self.held[..end].to_owned();
                self.held.drain(..end + markup.close.len());
                self.in_call = false;
                match format.parse_call(&body) {
                    Some((id, name, arguments)) => {
                        let call = self.start_call(id, name, arguments);
                        out.push(call);
                    }
                    // Not a call after all: it stays text, markers included.
                    None => self.content(format!("{}{body}{}", markup.open, markup.close), out),
                }
                continue;
            }
            // Markers that only group calls vanish.
            for dropped in markup.dropped {
                while let Some(at) = self.held.find(dropped) {
                    self.held.replace_range(at..at + dropped.len(), "");
                }
            }
            if let Some(start) = self.held.find(markup.open) {
                let before = self.held[..start].to_owned();
                self.held.drain(..start + markup.open.len());
                self.content(before, out);
                self.in_call = true;
                continue;
            }
            // Hold back a tail that could still become a marker.
            let keep = if at_end {
                0
            } else {
                std::iter::once(markup.open)
                    .chain(markup.dropped.iter().copied())
                    .map(|m| partial_suffix(&self.held, m))
                    .max()
                    .unwrap_or(0)
            };
            let emit_to = self.held.len() - keep;
            let text: String = self.held.drain(..emit_to).collect();
            self.content(text, out);
            return;
        }
    }

    fn scan_required(&mut self, out: &mut Vec<Piece>) {
        let bytes = self.held.as_bytes();
        let mut s = std::mem::take(&mut self.scan);
        let mut done = Vec::new();
        while s.at < bytes.len() {
            let b = bytes[s.at];
            if s.in_string {
                if s.escaped {
                    s.escaped = false;
                } else if b == b'\\' {
                    s.escaped = true;
                } else if b == b'"' {
                    s.in_string = false;
                }
            } else {
                match b {
                    b'"' => s.in_string = true,
                    b'{' | b'[' => {
                        s.depth += 1;
                        if s.depth == 2 {
                            s.element = Some(s.at);
                        }
                    }
                    b'}' | b']' => {
                        if s.depth == 2 {
                            if let Some(from) = s.element.take() {
                                done.push((from, s.at + 1));
                            }
                        }
                        s.depth = s.depth.saturating_sub(1);
                    }
                    _ => {}
                }
            }
            s.at += 1;
        }
        self.scan = s;
        for (from, to) in done {
            let element: Option<Value> = serde_json::from_str(&self.held[from..to]).ok();
            let call = element.and_then(|e| {
                let name = e.get("name")?.as_str()?.to_owned();
                let parameters = e.get("parameters").cloned().unwrap_or_else(|| json!({}));
                Some((name, parameters.to_string()))
            });
            if let Some((name, arguments)) = call {
                let piece = self.start_call(None, name, arguments);
                out.push(piece);
            }
        }
    }
}

/// The length of the longest proper prefix of `marker` that `text` ends with.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&n| text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

fn new_call_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let tail: String = (0..24)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("call_{tail}")
}

/// A whole answer's pieces gathered: `content` (`None` when only calls and whitespace) and
/// the calls.
pub fn gather(pieces: Vec<Piece>) -> (Option<String>, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Content(text) => content.push_str(&text),
            Piece::Call(delta) => match delta.id {
                Some(id) => calls.push(ToolCall {
                    id,
                    kind: "function",
                    function: crate::openai::protocol::FunctionCall {
                        name: delta.function.name.unwrap_or_default(),
                        arguments: delta.function.arguments.unwrap_or_default(),
                    },
                }),
                None => {
                    if let Some(call) = calls.get_mut(delta.index as usize) {
                        call.function
                            .arguments
                            .push_str(&delta.function.arguments.unwrap_or_default());
                    }
                }
            },
        }
    }
    let content = if calls.is_empty() {
        Some(content)
    } else {
        Some(content.trim().to_owned()).filter(|c| !c.is_empty())
    };
    (content, calls)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "tools_tests.rs"]
mod tests;
