//! Structured output: `format: "json"` and JSON-Schema formats (Ollama's `format`, OpenAI's
//! `response_format`) as GBNF grammars for the engine's grammar sampler.
//!
//! A schema becomes a grammar by llama.cpp's own converter, through the engine
//! (`engine::json_schema_to_grammar`, which checks a hostile schema's size first and makes what
//! it cannot convert an error). Two things are settled here before: serde_json forgets the order
//! of a client's properties and the converter keeps the order it is given (the order the model
//! writes them in), so the schema is written out again with its `required` properties first, in
//! the client's order, then the rest in key order; and a `true` subschema (anything) is written
//! as `{}`, which the converter reads, while `false` (nothing) is an error. `format: "json"` has
//! its own grammar, any JSON object as Ollama does. Whitespace between tokens is bounded in both,
//! because an unconstrained small model will otherwise emit newlines forever.
use std::collections::HashSet;

use serde_json::{Map, Value};

use crate::engine::{json_schema_to_grammar, SysError};

/// Any JSON value, with bounded whitespace (llama.cpp's `json.gbnf`).
const JSON_RULES: &str = r#"value ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws
array ::= "[" ws ( value ( "," ws value )* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\"" ws
number ::= "-"? ( [0-9] | [1-9] [0-9]{1,15} ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )? ws
ws ::= | " " | "\n" [ \t]{0,20}
"#;

/// The grammar for `format: "json"`: any JSON object, as Ollama does.
pub fn json_object_grammar() -> String {
    format!("root ::= object\n{JSON_RULES}")
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("JSON schema: {0}")]
pub struct SchemaError(pub String);

impl From<SysError> for SchemaError {
    fn from(error: SysError) -> Self {
        match error {
            SysError::Schema(message) => SchemaError(message),
            other => SchemaError(other.to_string()),
        }
    }
}

/// Convert a JSON schema into a GBNF grammar whose root rule is `root`.
pub fn schema_grammar(schema: &Value) -> Result<String, SchemaError> {
    let mut text = String::new();
    write_schema(schema, &mut text)?;
    Ok(json_schema_to_grammar(&text)?)
}

/// Write `schema` as JSON text for the converter, with its properties (and those of every
/// subschema) ordered and `true` subschemas as `{}`.
fn write_schema(schema: &Value, out: &mut String) -> Result<(), SchemaError> {
    let object = match schema {
        Value::Bool(true) => {
            out.push_str("{}");
            return Ok(());
        }
        Value::Bool(false) => return Err(SchemaError("a `false` schema allows nothing".into())),
        Value::Object(object) => object,
        // Not a schema: the converter refuses it, with its own message.
        other => {
            out.push_str(&other.to_string());
            return Ok(());
        }
    };
    out.push('{');
    for (index, (key, value)) in object.iter().enumerate() {
        if index > 0 {
            out.push(',');
        }
        out.push_str(&Value::from(key.as_str()).to_string());
        out.push(':');
        match (key.as_str(), value) {
            ("properties", Value::Object(properties)) => write_properties(properties, object.get("required"), out)?,
            ("$defs" | "definitions", Value::Object(schemas)) => write_map(schemas.iter(), out)?,
            ("items" | "prefixItems" | "anyOf" | "oneOf" | "allOf", Value::Array(schemas)) => {
                out.push('[');
                for (index, schema) in schemas.iter().enumerate() {
                    if index > 0 {
                        out.push(',');
                    }
                    write_schema(schema, out)?;
                }
                out.push(']');
            }
            // `additionalProperties` keeps its booleans, which the converter reads.
            ("items", _) | ("additionalProperties", Value::Object(_)) => write_schema(value, out)?,
            _ => out.push_str(&value.to_string()),
        }
    }
    out.push('}');
    Ok(())
}

/// `properties`: the `required` ones first, in the client's order (`required` is an array, so
/// it keeps it), then the others in key order.
fn write_properties(
    properties: &Map<String, Value>,
    required: Option<&Value>,
    out: &mut String,
) -> Result<(), SchemaError> {
    let required: Vec<&str> = required
        .and_then(Value::as_array)
        .map(|names| names.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut listed = HashSet::new();
    let first = required
        .iter()
        .filter_map(|name| properties.get_key_value(*name))
        .filter(|(name, _)| listed.insert(name.as_str()));
    let first: Vec<_> = first.collect();
    let rest = properties.iter().filter(|(name, _)| !listed.contains(name.as_str()));
    write_map(first.into_iter().chain(rest), out)
}

/// A JSON object of subschemas, in the iterator's order.
fn write_map<'a>(schemas: impl Iterator<Item = (&'a String, &'a Value)>, out: &mut String) -> Result<(), SchemaError> {
    out.push('{');
    for (index, (name, schema)) in schemas.enumerate() {
        if index > 0 {
            out.push(',');
        }
        out.push_str(&Value::from(name.as_str()).to_string());
        out.push(':');
        write_schema(schema, out)?;
    }
    out.push('}');
    Ok(())
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

    /// The rule `name` of `grammar`, in one line.
    fn rule<'a>(grammar: &'a str, name: &str) -> &'a str {
        grammar
            .lines()
            .find(|line| line.starts_with(&format!("{name} ::= ")))
            .unwrap_or_else(|| panic!("no rule {name}: {grammar}"))
    }

    #[test]
    fn object_schema_lists_properties_in_order() {
        let schema = json!({
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "age"]
        });
        // Required first, in the client's order (serde_json sorts the properties themselves);
        // llama.cpp's converter checked the schema and its parser the grammar.
        let grammar = schema_grammar(&schema).unwrap();
        let root = rule(&grammar, "root");
        assert!(
            root.find("name").unwrap() < root.find("age").unwrap()
                && root.find("age").unwrap() < root.find("tags").unwrap(),
            "{root}"
        );
        assert!(rule(&grammar, "name-kv").contains(r#""\"name\"" space ":" space string"#), "{grammar}");
        assert!(rule(&grammar, "age-kv").contains(r#""\"age\"" space ":" space integer"#), "{grammar}");
        // The optional one may be left out, the required ones may not.
        assert!(root.contains(r#""{" space name-kv "," space age-kv ( "," space ( tags-kv ) )? space "}""#), "{root}");
        assert_eq!(rule(&grammar, "tags"), r#"tags ::= "[" space (string ("," space string)*)? space "]""#);
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
        assert_eq!(rule(&grammar, "ref-defs-color"), r#"ref-defs-color ::= ("\"red\"" | "\"green\"")"#);
        assert_eq!(rule(&grammar, "maybe"), "maybe ::= number | null");
        assert_eq!(rule(&grammar, "either"), "either ::= boolean | either-1");
        assert_eq!(rule(&grammar, "either-1"), r#"either-1 ::= "3""#);
    }

    #[test]
    fn recursive_references_terminate() {
        let schema = json!({
            "$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"
        });
        let grammar = schema_grammar(&schema).unwrap();
        assert!(rule(&grammar, "ref-defs-node-children-item").ends_with("::= ref-defs-node"), "{grammar}");
    }

    #[test]
    fn true_subschemas_allow_anything() {
        let grammar = schema_grammar(&json!({"type": "object", "properties": {"a": true, "b": {"type": "array", "items": true}}, "required": ["a", "b"]})).unwrap();
        assert_eq!(rule(&grammar, "a"), "a ::= value");
        assert!(rule(&grammar, "b-kv").ends_with("space array"), "{grammar}");
    }

    #[test]
    fn bad_schemas_are_errors() {
        for bad in [
            json!("string"),
            json!({"type": "thing"}),
            json!({"enum": []}),
            json!({"$ref": "http://x"}),
            json!({"$ref": "#/nowhere"}),
            json!(false),
        ] {
            assert!(schema_grammar(&bad).is_err(), "{bad}");
        }
        assert_eq!(
            schema_grammar(&json!({"type": "thing"})).unwrap_err().to_string(),
            "JSON schema: unknown type \"thing\""
        );
        assert_eq!(
            schema_grammar(&json!({"properties": {"a": false}})).unwrap_err().to_string(),
            "JSON schema: a `false` schema allows nothing"
        );
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(schema_grammar(&deep).is_err());
    }

    #[test]
    fn literals_escape_quotes_and_control_characters() {
        let grammar = schema_grammar(
            &json!({"properties": {"a\"b\\c\nd\u{1}": {"const": "x\"y"}}, "required": ["a\"b\\c\nd\u{1}"]}),
        )
        .unwrap();
        assert!(grammar.contains(r#""\"a\\\"b\\\\c\\nd\\u0001\"" space ":" space"#), "{grammar}");
        assert!(grammar.contains(r#""\"x\\\"y\"""#), "{grammar}");
    }
}
