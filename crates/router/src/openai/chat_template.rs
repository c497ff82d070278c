//! Hugging Face chat templates rendered with minijinja.
//!
//! The environment mirrors what `transformers` gives a template: `trim_blocks` and
//! `lstrip_blocks`, a `raise_exception(msg)` function, the `bos_token`/`eos_token` variables,
//! `add_generation_prompt`, and Python string/dict methods (`.strip()`, `.items()`, …) through
//! minijinja-contrib's pycompat layer.

use crate::error::{Error, Result};
use minijinja::{context, Environment, ErrorKind};
use serde::Serialize;

const TEMPLATE_NAME: &str = "chat";

/// Templates built into tandem, by the name `--chat-template` takes instead of a file.
pub const BUILT_IN: [(&str, &str); 1] = [(
    "chatml-tools",
    include_str!("../../../../templates/chatml-tools.jinja"),
)];

/// The source of built-in template `name`.
pub fn built_in(name: &str) -> Option<&'static str> {
    BUILT_IN.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// One chat message as the template sees it: `content` is already flattened to text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TemplateMessage {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// Text content.
    pub content: String,
    /// Optional participant name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's calls, as transformers hands them to templates:
    /// `{"id", "type": "function", "function": {"name", "arguments": {...}}}` with the
    /// arguments parsed (undefined in the template when the message has none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message: the id of the call it answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl TemplateMessage {
    /// A plain message of `role` saying `content`.
    pub fn text(role: &str, content: &str) -> Self {
        Self {
            role: role.to_owned(),
            content: content.to_owned(),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template reads a `tools` variable (it can tell the model about functions).
    reads_tools: bool,
}

/// Rendering failed; the message comes from the template (e.g. `raise_exception`) and is
/// meant for the client.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct RenderError {
    /// What the template said.
    pub message: String,
    /// The engine's error.
    #[source]
    pub source: minijinja::Error,
}

fn raise_exception(message: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are exposed to it as variables.
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(Error::ChatTemplate)?;
        let reads_tools = env
            .get_template(TEMPLATE_NAME)
            .map_err(Error::ChatTemplate)?
            .undeclared_variables(false)
            .contains("tools");
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default().to_owned(),
            eos_token: eos_token.unwrap_or_default().to_owned(),
            reads_tools,
        })
    }

    /// Whether the template can tell the model about tools (it reads `tools`).
    pub fn supports_tools(&self) -> bool {
        self.reads_tools
    }

    /// Renders `messages` with `add_generation_prompt = true` and no tools.
    pub fn render(&self, messages: &[TemplateMessage]) -> std::result::Result<String, RenderError> {
        self.render_with_tools(messages, None)
    }

    /// Renders `messages` with `add_generation_prompt = true`; `tools` (OpenAI's
    /// `{"type": "function", "function": {...}}` objects) become the template's `tools`.
    pub fn render_with_tools(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> std::result::Result<String, RenderError> {
        let to_render_error = |source: minijinja::Error| RenderError {
            message: source
                .detail()
                .map_or_else(|| source.to_string(), str::to_owned),
            source,
        };
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(to_render_error)?;
        template
            .render(context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(to_render_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> TemplateMessage {
        TemplateMessage::text(role, content)
    }

    const CHATML: &str =
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + \
        message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}\
        {{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let template = ChatTemplate::new(CHATML, None, None).expect("compiles");
        let text = template
            .render(&[msg("system", "Be brief."), msg("user", "Hi")])
            .expect("renders");
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_reaches_the_caller() {
        let source =
            "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}\
                      {% endif %}{{ bos_token }}{{ messages[0].content.strip() }}{{ eos_token }}";
        let template = ChatTemplate::new(source, Some("<s>"), Some("</s>")).expect("compiles");
        let err = template
            .render(&[msg("assistant", "x")])
            .expect_err("raises");
        assert_eq!(err.message, "first must be user");
        let text = template.render(&[msg("user", "  hi  ")]).expect("renders");
        assert_eq!(text, "<s>hi</s>");
    }

    #[test]
    fn a_template_that_reads_tools_gets_them() {
        let plain = ChatTemplate::new(CHATML, None, None).expect("compiles");
        assert!(!plain.supports_tools());
        let source =
            "{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}\
                      {% for m in messages %}{{ m.role }}:{{ m.content }}\
                      {% if m.tool_calls %}{% for c in m.tool_calls %}<{{ c.function.name }} \
                      {{ c.function.arguments.city }}>{% endfor %}{% endif %}\
                      {% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}";
        let template = ChatTemplate::new(source, None, None).expect("compiles");
        assert!(template.supports_tools());
        let tools = [serde_json::json!({"type": "function", "function": {"name": "weather"}})];
        let mut call = msg("assistant", "");
        call.tool_calls = Some(vec![serde_json::json!(
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
        )]);
        let mut result = msg("tool", "rain");
        result.tool_call_id = Some("c1".into());
        let text = template
            .render_with_tools(&[msg("user", "hi"), call, result], Some(&tools))
            .expect("renders");
        assert_eq!(
            text,
            "[weather]user:hi;assistant:<weather Oslo>;tool:rain#c1;"
        );
        assert_eq!(
            template.render(&[msg("user", "hi")]).expect("renders"),
            "user:hi;"
        );
    }

    #[test]
    fn syntax_errors_fail_at_load() {
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }
}
