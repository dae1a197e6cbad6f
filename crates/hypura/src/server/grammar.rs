//! Structured output: `format: "json"` and JSON-Schema formats as GBNF grammars for llama.cpp's
//! grammar sampler.
//!
//! llama.cpp's own schema converter is C++ in `common/`, which Hypura does not build, so this is
//! a compact converter for the subset clients use: `object` with `properties` (every listed
//! property is emitted: one the schema lists is always valid to include, which keeps the grammar
//! free of optional-comma bookkeeping; they come in the order of `required`, then the rest in
//! key order, since `serde_json` objects forget the client's order), `array` with `items`, `string`,
//! `number`, `integer`, `boolean`, `null`, `enum`, `const`, `anyOf`/`oneOf`, type lists such as
//! `["string", "null"]`, and local `$ref`s (`#/$defs/...`, `#/definitions/...`). Keywords it
//! does not know (lengths, patterns, formats, bounds) are not enforced. Whitespace between
//! tokens is bounded, because an unconstrained small model will otherwise emit newlines forever.
use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

/// Shared rules: any JSON value, with bounded whitespace (llama.cpp's `json.gbnf`). An
/// integer is never `-0`, which parsers read back as a float.
const JSON_RULES: &str = r#"value ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws
array ::= "[" ws ( value ( "," ws value )* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\"" ws
number ::= "-"? ( [0-9] | [1-9] [0-9]{1,15} ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )? ws
integer ::= ( "0" | "-"? [1-9] [0-9]{0,15} ) ws
boolean ::= ( "true" | "false" ) ws
null ::= "null" ws
ws ::= | " " | "\n" [ \t]{0,20}
"#;

/// The grammar for `format: "json"`: any JSON object, as Ollama does.
pub fn json_object_grammar() -> String {
    format!("root ::= object\n{JSON_RULES}")
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("JSON schema: {0}")]
pub struct SchemaError(pub String);

/// Convert a JSON schema into a GBNF grammar whose root rule is `root`.
pub fn schema_grammar(schema: &Value) -> Result<String, SchemaError> {
    let mut converter = Converter { root: schema, rules: BTreeMap::new(), refs_in_progress: Vec::new() };
    let root = converter.visit(schema, "root-value", 0)?;
    let mut grammar = format!("root ::= {root}\n");
    for (name, body) in &converter.rules {
        let _ = writeln!(grammar, "{name} ::= {body}");
    }
    grammar.push_str(JSON_RULES);
    Ok(grammar)
}

struct Converter<'a> {
    root: &'a Value,
    rules: BTreeMap<String, String>,
    /// `$ref` rules being built, for recursive schemas.
    refs_in_progress: Vec<String>,
}

/// Nesting deeper than this is refused (a schema is client input).
const MAX_DEPTH: usize = 32;

impl<'a> Converter<'a> {
    /// Return a GBNF expression (usually a rule name) for `schema`; `name` seeds new rule names.
    fn visit(&mut self, schema: &'a Value, name: &str, depth: usize) -> Result<String, SchemaError> {
        if depth > MAX_DEPTH {
            return Err(SchemaError(format!("nested deeper than {MAX_DEPTH} levels")));
        }
        let object = match schema {
            Value::Bool(true) => return Ok("value".into()),
            Value::Bool(false) => return Err(SchemaError("a `false` schema allows nothing".into())),
            Value::Object(object) => object,
            _ => return Err(SchemaError(format!("a schema must be an object, not {schema}"))),
        };
        if let Some(reference) = object.get("$ref") {
            return self.reference(reference, depth);
        }
        if let Some(constant) = object.get("const") {
            return Ok(format!("{} ws", literal(&constant.to_string())));
        }
        if let Some(choices) = object.get("enum") {
            let choices = choices.as_array().filter(|choices| !choices.is_empty()).ok_or_else(|| SchemaError("`enum` must be a non-empty array".into()))?;
            let alternatives: Vec<String> = choices.iter().map(|choice| literal(&choice.to_string())).collect();
            return Ok(format!("( {} ) ws", alternatives.join(" | ")));
        }
        for keyword in ["anyOf", "oneOf"] {
            if let Some(choices) = object.get(keyword) {
                let choices = choices.as_array().filter(|choices| !choices.is_empty()).ok_or_else(|| SchemaError(format!("`{keyword}` must be a non-empty array")))?;
                let mut alternatives = Vec::new();
                for (index, choice) in choices.iter().enumerate() {
                    alternatives.push(self.visit(choice, &format!("{name}-{index}"), depth + 1)?);
                }
                return Ok(self.rule(name, format!("( {} )", alternatives.join(" | "))));
            }
        }
        match object.get("type") {
            None if object.contains_key("properties") => self.object(object, name, depth),
            None if object.contains_key("items") => self.array(object, name, depth),
            None => Ok("value".into()),
            Some(Value::String(kind)) => self.typed(kind, object, name, depth),
            Some(Value::Array(kinds)) if !kinds.is_empty() => {
                let mut alternatives = Vec::new();
                for (index, kind) in kinds.iter().enumerate() {
                    let kind = kind.as_str().ok_or_else(|| SchemaError(format!("`type` entries must be strings, not {kind}")))?;
                    alternatives.push(self.typed(kind, object, &format!("{name}-{index}"), depth)?);
                }
                Ok(self.rule(name, format!("( {} )", alternatives.join(" | "))))
            }
            Some(other) => Err(SchemaError(format!("`type` must be a string or a list of strings, not {other}"))),
        }
    }

    fn typed(&mut self, kind: &str, object: &'a serde_json::Map<String, Value>, name: &str, depth: usize) -> Result<String, SchemaError> {
        match kind {
            "object" => self.object(object, name, depth),
            "array" => self.array(object, name, depth),
            "string" => Ok("string".into()),
            "number" => Ok("number".into()),
            "integer" => Ok("integer".into()),
            "boolean" => Ok("boolean".into()),
            "null" => Ok("null".into()),
            other => Err(SchemaError(format!("unknown type {other:?}"))),
        }
    }

    fn object(&mut self, object: &'a serde_json::Map<String, Value>, name: &str, depth: usize) -> Result<String, SchemaError> {
        let Some(properties) = object.get("properties") else { return Ok("object".into()) };
        let properties = properties.as_object().ok_or_else(|| SchemaError("`properties` must be an object".into()))?;
        if properties.is_empty() {
            return Ok("object".into());
        }
        // `required` is an array, so it keeps the client's order; the other properties follow
        // in key order.
        let required: Vec<&str> = object.get("required").and_then(Value::as_array).map(|names| names.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        let mut ordered: Vec<(&String, &'a Value)> = required.iter().filter_map(|name| properties.get_key_value(*name)).collect();
        ordered.extend(properties.iter().filter(|(name, _)| !required.contains(&name.as_str())));
        let mut members = Vec::new();
        for (property, schema) in ordered {
            let value = self.visit(schema, &format!("{name}-{}", rule_word(property)), depth + 1)?;
            members.push(format!("{} ws \":\" ws {value}", literal(&Value::String(property.clone()).to_string())));
        }
        Ok(self.rule(name, format!("\"{{\" ws {} \"}}\" ws", members.join(" \",\" ws "))))
    }

    fn array(&mut self, object: &'a serde_json::Map<String, Value>, name: &str, depth: usize) -> Result<String, SchemaError> {
        let item = match object.get("items") {
            Some(items) => self.visit(items, &format!("{name}-item"), depth + 1)?,
            None => "value".into(),
        };
        Ok(self.rule(name, format!("\"[\" ws ( {item} ( \",\" ws {item} )* )? \"]\" ws")))
    }

    fn reference(&mut self, reference: &Value, depth: usize) -> Result<String, SchemaError> {
        let path = reference.as_str().ok_or_else(|| SchemaError("`$ref` must be a string".into()))?;
        let pointer = path.strip_prefix('#').ok_or_else(|| SchemaError(format!("only local references (#/...) are supported, not {path:?}")))?;
        let rule_name = format!("ref-{}", rule_word(pointer));
        if self.rules.contains_key(&rule_name) || self.refs_in_progress.contains(&rule_name) {
            return Ok(rule_name);
        }
        let target = self.root.pointer(pointer).ok_or_else(|| SchemaError(format!("reference {path:?} points nowhere")))?;
        self.refs_in_progress.push(rule_name.clone());
        let body = self.visit(target, &format!("{rule_name}-value"), depth + 1);
        self.refs_in_progress.pop();
        self.rules.insert(rule_name.clone(), body?);
        Ok(rule_name)
    }

    /// Add a rule with a fresh name built from `name` and return the name.
    fn rule(&mut self, name: &str, body: String) -> String {
        let base = rule_word(name);
        let mut candidate = base.clone();
        let mut counter = 1;
        while self.rules.contains_key(&candidate) || ["root", "value", "object", "array", "string", "number", "integer", "boolean", "null", "ws"].contains(&candidate.as_str()) {
            candidate = format!("{base}{counter}");
            counter += 1;
        }
        self.rules.insert(candidate.clone(), body);
        candidate
    }
}

/// A rule-name word: letters, digits and dashes only.
fn rule_word(text: &str) -> String {
    let word: String = text.chars().map(|character| if character.is_ascii_alphanumeric() { character.to_ascii_lowercase() } else { '-' }).collect();
    let word = word.trim_matches('-').to_string();
    if word.is_empty() {
        "x".into()
    } else {
        word
    }
}

/// A GBNF string literal matching `text` exactly.
fn literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for character in text.chars() {
        match character {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            character if (character as u32) < 0x20 => {
                let _ = write!(out, "\\x{:02X}", character as u32);
            }
            character => out.push(character),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_json_grammar_has_an_object_root() {
        let grammar = json_object_grammar();
        assert!(grammar.starts_with("root ::= object\n"));
        assert!(grammar.contains("ws ::= "));
    }

    #[test]
    fn object_schema_lists_properties_in_order() {
        let schema = json!({
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "age"]
        });
        // Required first, in the client's order (serde_json sorts the properties themselves).
        let grammar = schema_grammar(&schema).unwrap();
        let root = grammar.lines().next().unwrap();
        assert_eq!(root, "root ::= root-value");
        let object = grammar.lines().find(|line| line.starts_with("root-value ::=")).unwrap();
        assert!(object.contains(r#""\"name\"" ws ":" ws string"#), "{object}");
        assert!(object.contains(r#""\"age\"" ws ":" ws integer"#), "{object}");
        assert!(object.find("name").unwrap() < object.find("age").unwrap(), "{object}");
        assert!(grammar.contains("root-value-tags ::= \"[\" ws ( string ( \",\" ws string )* )? \"]\" ws"), "{grammar}");
    }

    #[test]
    fn enums_consts_unions_and_refs() {
        let schema = json!({
            "$defs": {"color": {"enum": ["red", "green"]}},
            "type": "object",
            "properties": {
                "color": {"$ref": "#/$defs/color"},
                "maybe": {"type": ["number", "null"]},
                "either": {"anyOf": [{"type": "boolean"}, {"const": 3}]}
            }
        });
        let grammar = schema_grammar(&schema).unwrap();
        assert!(grammar.contains(r#"ref-defs-color ::= ( "\"red\"" | "\"green\"" ) ws"#), "{grammar}");
        assert!(grammar.contains("( number | null )"), "{grammar}");
        assert!(grammar.contains(r#"( boolean | "3" ws )"#), "{grammar}");
    }

    #[test]
    fn recursive_references_terminate() {
        let schema = json!({
            "$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"
        });
        let grammar = schema_grammar(&schema).unwrap();
        assert!(grammar.contains("ref-defs-node ::= "), "{grammar}");
    }

    #[test]
    fn bad_schemas_are_errors() {
        for bad in [json!("string"), json!({"type": "thing"}), json!({"enum": []}), json!({"$ref": "http://x"}), json!({"$ref": "#/nowhere"}), json!(false)] {
            assert!(schema_grammar(&bad).is_err(), "{bad}");
        }
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(schema_grammar(&deep).is_err());
    }

    #[test]
    fn literals_escape_quotes_and_control_characters() {
        assert_eq!(literal("a\"b\\c\nd\u{1}"), r#""a\"b\\c\nd\x01""#);
    }
}
