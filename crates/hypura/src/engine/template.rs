//! Chat templates. The model's own `tokenizer.chat_template` comes first: llama.cpp's built-in
//! matcher renders the templates it recognises exactly as llama.cpp does; any other Jinja
//! template is rendered with MiniJinja (with Python string methods, as Hugging Face templates
//! expect). A file without a template gets one chosen by architecture.
use hypura_sys::{apply_builtin_template, ChatTurn};
use minijinja::{context, Environment, ErrorKind};

use super::prompt::ChatMessage;

/// How a model's chat turns become a prompt.
#[derive(Clone, Debug)]
pub enum ChatTemplate {
    /// A template llama.cpp's built-in matcher knows (a name like "gemma", or template text).
    Builtin(String),
    /// A Jinja template text.
    Jinja { source: String, bos_token: String, eos_token: String },
}

/// The built-in template for an architecture whose file carries none.
pub fn template_for_architecture(arch: &str) -> &'static str {
    match arch {
        arch if arch.starts_with("gemma") => "gemma",
        "llama4" => "llama4",
        "phi3" => "phi3",
        "mistral3" => "mistral-v7",
        "deepseek2" | "deepseek3" => "deepseek3",
        "command-r" | "cohere2" => "command-r",
        "gpt-oss" => "gpt-oss",
        _ => "chatml",
    }
}

impl ChatTemplate {
    /// Pick the template: the file's own, checked once against llama.cpp's matcher, or one by
    /// architecture.
    pub fn resolve(file_template: Option<String>, arch: &str, bos_token: String, eos_token: String) -> ChatTemplate {
        let Some(source) = file_template.filter(|text| !text.trim().is_empty()) else {
            return ChatTemplate::Builtin(template_for_architecture(arch).to_string());
        };
        let probe = [ChatTurn { role: "user".into(), content: "hi".into() }];
        if apply_builtin_template(&source, &probe, true).is_some() {
            ChatTemplate::Builtin(source)
        } else {
            ChatTemplate::Jinja { source, bos_token, eos_token }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            ChatTemplate::Builtin(name) if name.len() < 32 => format!("built-in \"{name}\""),
            ChatTemplate::Builtin(_) => "the file's template (llama.cpp built-in match)".into(),
            ChatTemplate::Jinja { .. } => "the file's Jinja template".into(),
        }
    }

    /// Render the conversation, ending with the assistant's turn opened when `add_assistant`.
    pub fn render(&self, messages: &[ChatMessage], add_assistant: bool) -> Result<String, String> {
        match self {
            ChatTemplate::Builtin(template) => {
                let turns: Vec<ChatTurn> = messages.iter().map(|message| ChatTurn { role: message.role.clone(), content: message.content.clone() }).collect();
                apply_builtin_template(template, &turns, add_assistant).ok_or_else(|| "llama.cpp could not apply its built-in template (a NUL byte in a message?)".to_string())
            }
            ChatTemplate::Jinja { source, bos_token, eos_token } => {
                let mut environment = Environment::new();
                environment.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
                environment.add_function("raise_exception", |message: String| -> Result<String, minijinja::Error> { Err(minijinja::Error::new(ErrorKind::InvalidOperation, message)) });
                environment.add_function("strftime_now", |_format: String| -> String { String::new() });
                environment.add_template("chat", source).map_err(|error| error.to_string())?;
                let template = environment.get_template("chat").map_err(|error| error.to_string())?;
                let messages: Vec<_> = messages.iter().map(|message| context! { role => message.role, content => message.content }).collect();
                template
                    .render(context! {
                        messages => messages,
                        add_generation_prompt => add_assistant,
                        bos_token => bos_token,
                        eos_token => eos_token,
                    })
                    .map_err(|error| error.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation() -> Vec<ChatMessage> {
        vec![ChatMessage::new("system", "You are terse."), ChatMessage::new("user", "Hi"), ChatMessage::new("assistant", "Hello."), ChatMessage::new("user", "Capital of France?")]
    }

    #[test]
    fn gemma_builtin_renders_every_turn() {
        let template = ChatTemplate::resolve(None, "gemma3", "<bos>".into(), "<eos>".into());
        let text = template.render(&conversation(), true).unwrap();
        // Gemma has no system role: llama.cpp folds the system prompt into the first user turn.
        assert!(text.starts_with("<start_of_turn>user\nYou are terse."), "{text}");
        assert!(text.contains("<start_of_turn>model\nHello.<end_of_turn>"), "{text}");
        assert!(text.ends_with("<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n"), "{text}");
    }

    #[test]
    fn chatml_is_the_default_and_keeps_the_system_turn() {
        let template = ChatTemplate::resolve(None, "llama", String::new(), String::new());
        let text = template.render(&conversation(), true).unwrap();
        assert!(text.starts_with("<|im_start|>system\nYou are terse.<|im_end|>\n"), "{text}");
        assert!(text.contains("<|im_start|>assistant\nHello.<|im_end|>\n"), "{text}");
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
        let without = template.render(&conversation(), false).unwrap();
        assert!(without.ends_with("Capital of France?<|im_end|>\n"), "{without}");
    }

    #[test]
    fn unknown_jinja_template_renders_with_minijinja() {
        let source = "{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content.strip() }}\n{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}";
        let template = ChatTemplate::resolve(Some(source.into()), "llama", "<s>".into(), "</s>".into());
        assert!(matches!(template, ChatTemplate::Jinja { .. }), "{template:?}");
        let text = template.render(&[ChatMessage::new("user", "  hello  ")], true).unwrap();
        assert_eq!(text, "<s>[USER] hello\n[ASSISTANT]");
    }

    #[test]
    fn template_errors_are_reported_not_panicked() {
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}ok";
        let template = ChatTemplate::resolve(Some(source.into()), "llama", String::new(), String::new());
        let error = template.render(&[ChatMessage::new("system", "x")], true).unwrap_err();
        assert!(error.contains("first turn must be user"), "{error}");
    }
}
