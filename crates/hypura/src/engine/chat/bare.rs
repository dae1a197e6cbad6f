//! Tool calls written as bare JSON, without the template's markers: reading a whole answer as
//! calls of offered tools, and telling early whether a partial answer may still become one.
use serde_json::{json, Value};

use super::{new_call_id, ToolCall};

/// The calls in an answer that is nothing but JSON calls of offered tools: one object
/// `{"name", "arguments"}` (or `"parameters"`), a list of them, or several in a row, optionally
/// in a ```json fence. None for anything else, which stays content.
pub(super) fn bare_calls(content: &str, tool_names: &[String]) -> Option<Vec<ToolCall>> {
    if tool_names.is_empty() {
        return None;
    }
    let mut text = content.trim();
    if let Some(fenced) = text.strip_prefix("```") {
        let fenced = fenced.strip_prefix("json").unwrap_or(fenced);
        text = fenced.strip_suffix("```")?.trim();
    }
    let mut values = Vec::new();
    for value in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
        match value.ok()? {
            Value::Array(items) => values.extend(items),
            other => values.push(other),
        }
    }
    let calls: Vec<ToolCall> = values.iter().map(|value| call_of(value, tool_names)).collect::<Option<_>>()?;
    (!calls.is_empty()).then_some(calls)
}

/// A JSON value read as a call of an offered tool: `{"name", "arguments" | "parameters"}`, the
/// arguments an object or a JSON string of one.
fn call_of(value: &Value, tool_names: &[String]) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_string();
    if !tool_names.contains(&name) {
        return None;
    }
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        Some(Value::String(text)) => serde_json::from_str(text).ok()?,
        Some(arguments @ Value::Object(_)) => arguments.clone(),
        None => json!({}),
        Some(_) => return None,
    };
    Some(ToolCall { id: Some(new_call_id()), name, arguments })
}

/// The most content held back while it may still become bare calls. Past it the answer streams
/// as content, so a looping answer that keeps the shape of a call (an argument string that never
/// ends) cannot keep a client waiting: on two cores a 0.5B model writes 4 KiB in about half a
/// minute. A bare call longer than this is returned as content, as the model wrote it.
pub const BARE_CALL_HOLD_BYTES: usize = 4096;

/// Whether an answer that starts with `content` may still be nothing but bare calls of
/// `tool_names` (what `bare_calls` reads once it is whole): an opening fence, then JSON whose
/// complete values are calls of offered tools and whose last value, cut short, opens with a key
/// a call has and, where the name has begun, a prefix of an offered tool's name. Content that
/// cannot become calls is released at once instead of waiting for the end of the answer.
pub(super) fn may_become_bare_calls(content: &str, tool_names: &[String]) -> bool {
    if tool_names.is_empty() || content.len() > BARE_CALL_HOLD_BYTES {
        return false;
    }
    let mut text = content.trim_start();
    if let Some(fenced) = text.strip_prefix("```") {
        if "json".starts_with(fenced) {
            return true;
        }
        text = fenced.strip_prefix("json").unwrap_or(fenced);
        // The closing fence, whole or begun.
        text = text.trim_end().trim_end_matches('`');
    } else if "```".starts_with(text) {
        // Nothing yet, or a fence begun.
        return true;
    }
    let text = text.trim();
    if text.is_empty() {
        return true;
    }
    if !text.starts_with('{') && !text.starts_with('[') {
        return false;
    }
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    loop {
        let offset = values.byte_offset();
        match values.next() {
            None => return true,
            Some(Ok(Value::Array(items))) if items.iter().all(|item| call_of(item, tool_names).is_some()) => {}
            Some(Ok(value)) if call_of(&value, tool_names).is_some() => {}
            Some(Ok(_)) => return false,
            Some(Err(error)) if error.is_eof() => return opens_like_a_call(&text[offset..], tool_names),
            Some(Err(_)) => return false,
        }
    }
}

/// Whether a JSON value cut short (`{...` or `[{...`) may still be a call: any keys (a call may
/// carry others, such as Llama 3's `"type"`), unless its top-level `"name"` has begun with a
/// value that is no offered tool's name, or is no string.
fn opens_like_a_call(partial: &str, tool_names: &[String]) -> bool {
    let rest = partial.trim_start();
    let rest = rest.strip_prefix('[').map_or(rest, str::trim_start);
    let Some(mut rest) = rest.strip_prefix('{') else { return rest.is_empty() };
    loop {
        rest = rest.trim_start();
        let Some(after_quote) = rest.strip_prefix('"') else { return true };
        let Some((key, after_key)) = json_string(after_quote) else { return true };
        let after_key = after_key.trim_start();
        let Some(value) = after_key.strip_prefix(':') else { return true };
        let value = value.trim_start();
        if key == "name" {
            if value.is_empty() {
                return true;
            }
            let Some(name) = value.strip_prefix('"') else { return false };
            return match json_string(name) {
                Some((name, _)) => tool_names.iter().any(|tool| *tool == name),
                None => tool_names.iter().any(|tool| tool.starts_with(name)),
            };
        }
        match skip_json_value(value) {
            Some(next) => match next.trim_start().strip_prefix(',') {
                Some(next) => rest = next,
                None => return true,
            },
            None => return true,
        }
    }
}

/// A JSON string's text up to its closing quote (escapes kept as written), and what follows; None
/// when it does not close yet.
fn json_string(text: &str) -> Option<(&str, &str)> {
    let mut escaped = false;
    for (index, character) in text.char_indices() {
        match character {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some((&text[..index], &text[index + 1..])),
            _ => {}
        }
    }
    None
}

/// What follows one whole JSON value at the start of `text` (strings and nesting followed), or
/// None when the value does not end in `text`.
fn skip_json_value(text: &str) -> Option<&str> {
    let mut depth = 0usize;
    let mut rest = text;
    loop {
        let character = rest.chars().next()?;
        match character {
            '"' => rest = json_string(&rest[1..])?.1,
            '{' | '[' => {
                depth += 1;
                rest = &rest[1..];
            }
            '}' | ']' => {
                depth = depth.checked_sub(1)?;
                rest = &rest[1..];
            }
            ',' if depth == 0 => return Some(rest),
            _ => rest = &rest[character.len_utf8()..],
        }
        if depth == 0 && matches!(character, '"' | '}' | ']') {
            return Some(rest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_json_calls_of_offered_tools_are_calls() {
        let names = vec!["get_weather".to_string()];
        let calls = bare_calls("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}", &names).unwrap();
        assert_eq!((calls[0].name.as_str(), calls[0].arguments["city"].as_str()), ("get_weather", Some("Paris")));
        assert!(calls[0].id.as_deref().is_some_and(|id| id.starts_with("call_") && id.len() == 29));
        let fenced =
            bare_calls("```json\n[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}]\n```", &names)
                .unwrap();
        assert_eq!(fenced[0].arguments["city"], "Oslo");
        assert_eq!(
            bare_calls(
                "{\"name\": \"get_weather\", \"arguments\": {}}\n{\"name\": \"get_weather\", \"arguments\": {}}",
                &names
            )
            .unwrap()
            .len(),
            2
        );
        // Anything else stays content: an unknown tool, prose, JSON that is not a call.
        assert!(bare_calls("{\"name\": \"delete_everything\", \"arguments\": {}}", &names).is_none());
        assert!(bare_calls("It is sunny in Paris.", &names).is_none());
        assert!(bare_calls("{\"city\": \"Paris\"}", &names).is_none());
        assert!(bare_calls("{\"name\": \"get_weather\"} and more", &names).is_none());
        assert!(
            bare_calls("{\"name\": \"get_weather\", \"arguments\": {}}", &[]).is_none(),
            "no tools offered: no calls"
        );
    }

    /// An answer is held back only while it may still become bare calls: released as soon as
    /// its JSON cannot be a call of an offered tool, or once it is longer than the bound.
    #[test]
    fn content_is_held_back_only_while_it_may_become_a_call() {
        let names = vec!["get_weather".to_string(), "read".to_string()];
        let held = |content: &str| may_become_bare_calls(content, &names);
        // May still become calls: nothing yet, a fence begun, a call or list of calls cut short.
        for content in [
            "",
            "  \n",
            "`",
            "``",
            "```js",
            "```json\n",
            "{",
            "{\"na",
            "{\"name\": \"get_w",
            "{\"name\": \"read\", \"arguments\": {\"path\": \"notes",
            "[{\"name\": \"read\", \"arguments\": {}}, {\"name\": \"get",
            "{\"arguments\": {\"city\": \"Oslo\"}, \"na",
            "{\"type\": \"function\", \"name\": \"get_weather\", \"parameters\": {\"city",
            "{\"id\": 7, \"arguments\": {\"name\": \"Bob\"}, \"name\": \"re",
            "{\"name\": \"read\", \"arguments\": {}}\n{\"name\": \"re",
            "```json\n{\"name\": \"read\", \"arguments\": {}}\n``",
        ] {
            assert!(held(content), "{content:?} may still become a call");
        }
        // Cannot: prose, another first key, a tool not offered, a whole value that is no call,
        // text after a call, anything past the bound.
        for content in [
            "The weather",
            "{\"type\": \"function\", \"name\": \"delete",
            "{\"name\": 3",
            "{\"name\": \"delete",
            "{\"name\": \"read_all\"",
            "{\"city\": \"Paris\"}",
            "[1, 2",
            "{\"name\": \"read\", \"arguments\": {}} and then",
            "```python\n",
        ] {
            assert!(!held(content), "{content:?} cannot become a call");
        }
        let looping =
            format!("{{\"name\": \"read\", \"arguments\": {{\"path\": \"{}", "a".repeat(BARE_CALL_HOLD_BYTES));
        assert!(!held(&looping), "a looping call is released past the bound");
        assert!(!may_become_bare_calls("{", &[]), "no tools offered: nothing is held");
        // Whatever is held until the end is read by `bare_calls` as the same calls.
        for whole in
            ["{\"name\": \"read\", \"arguments\": {\"path\": \"a\"}}", "```json\n[{\"name\": \"get_weather\"}]\n```"]
        {
            assert!(held(whole) && bare_calls(whole, &names).is_some(), "{whole:?}");
        }
    }
}
