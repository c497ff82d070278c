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

/// One chat message as the template sees it: `content` is already flattened to text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TemplateMessage {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// Text content.
    pub content: String,
    /// Optional participant name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
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
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default().to_owned(),
            eos_token: eos_token.unwrap_or_default().to_owned(),
        })
    }

    /// Renders `messages` with `add_generation_prompt = true`.
    pub fn render(&self, messages: &[TemplateMessage]) -> std::result::Result<String, RenderError> {
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
        TemplateMessage {
            role: role.to_owned(),
            content: content.to_owned(),
            name: None,
        }
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
    fn syntax_errors_fail_at_load() {
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }
}
