//! JSON schemas as GBNF grammars, by llama.cpp's own converter (`common/json-schema-to-grammar.cpp`,
//! reached through the chat shim): the server turns a client's structured-output schema into the
//! grammar that the engine's grammar sampler then enforces.
//!
//! A schema is client input and the converter is recursive C++ that a stack overflow or a
//! runaway expansion would take the whole process down with, so the schema is checked in Rust
//! first against the limits below (each names the converter's code that needs it), the
//! conversion runs on its own thread with a stack sized for those limits, and the grammar is
//! parsed once by llama.cpp's grammar parser before it is returned: a schema whose grammar
//! llama.cpp cannot use (a repetition count over its 2000, such as a large `minItems`) is an
//! error here, at request time, rather than when generation starts.
use std::collections::HashMap;
use std::ffi::{c_char, CString};

use serde_json::{Map, Value};

use crate::chat::take_string;
use crate::error::SysError;
use crate::grammar::Grammar;

unsafe extern "C" {
    fn hypura_json_schema_to_grammar(schema_json: *const c_char, error: *mut *mut c_char) -> *mut c_char;
}

/// The schema's JSON text, at most. Everything the converter does is linear in it except what
/// the limits below bound.
const MAX_SCHEMA_BYTES: usize = 1 << 20;
/// Subschemas nested in one another (`properties`, `items`, `anyOf`, ..., and a `$ref` to its
/// target), at most.
const MAX_DEPTH: usize = 32;
/// Schema nodes the converter builds, at most: each `$ref` target once, and a node with a type
/// list (`"type": ["object", "null"]`) once per listed type, its whole subtree with it (the
/// converter copies it into one schema per type). This also bounds the converter's recursion,
/// whose chains of `$ref`s are as deep as the nodes they pass through.
const MAX_NODES: usize = 10_000;
/// Properties of one object, and of the objects one `allOf` merges, at most: the converter
/// builds the optional ones' rules in time cubic in their count (256 take 60 ms).
const MAX_PROPERTIES: usize = 256;
/// The cubes of those counts, summed over the schema, at most: four objects of 256.
const MAX_PROPERTY_WORK: u64 = 4 * 256 * 256 * 256;
/// Bytes of a property name or a `$ref`, at most: the converter recurses once per character of
/// a name when it excludes the listed names from `additionalProperties`, and std::regex recurses
/// once per character when it makes rule names of them.
const MAX_NAME_BYTES: usize = 256;
/// `$ref`s that lead straight to another `$ref`, in a row, at most; a loop of them is an error
/// (the converter's `allOf` merge would follow it forever).
const MAX_REF_CHAIN: usize = 16;
/// Alternatives that one value's grammar rule opens with, at most (enum values, `anyOf` and
/// `oneOf` branches, a pattern's alternations, through `$ref`s each time they are used):
/// llama.cpp's grammar keeps a parse stack for each and dedups them by linear search when the
/// grammar is built and at every token, so 60 000 take seconds.
const MAX_ALTERNATIVES: usize = 4096;
/// What a bounded integer counts among them: the converter spells a range digit by digit, in
/// about two alternatives per digit.
const INTEGER_RANGE_ALTERNATIVES: usize = 64;
/// `pattern`s, at most: the converter copies all its rules before each one (to restore them if
/// the pattern cannot be converted), so 9000 take five seconds.
const MAX_PATTERNS: usize = 128;
/// Integer bounds (`minimum`, `maximum`, and the exclusive ones) within ±10^15: the converter
/// negates and converts them as 64-bit integers, and its integers have at most 16 digits.
const MAX_INTEGER_BOUND: f64 = 1e15;
/// The conversion's own stack: MAX_NODES nested levels of the converter's recursion (about
/// 1.5 KiB each) fit four times over.
const CONVERTER_STACK_BYTES: usize = 64 << 20;

/// The types JSON Schema knows.
const TYPES: [&str; 7] = ["object", "array", "string", "number", "integer", "boolean", "null"];

/// The GBNF grammar (root rule `root`) that llama.cpp's converter makes of `schema`, a JSON
/// schema as JSON text. A schema past the limits above, one the converter refuses (an unknown
/// type, a `$ref` that points nowhere or outside the document, an invalid `pattern`) and one
/// whose grammar llama.cpp's parser refuses are errors, never aborts. Keywords the converter
/// does not know are not enforced; patterns it cannot express accept any string.
pub fn json_schema_to_grammar(schema: &str) -> Result<String, SysError> {
    if schema.len() > MAX_SCHEMA_BYTES {
        return Err(SysError::Schema(format!("the schema has {} bytes, more than {MAX_SCHEMA_BYTES}", schema.len())));
    }
    let value: Value = serde_json::from_str(schema).map_err(|error| SysError::Schema(format!("not JSON: {error}")))?;
    Limits::new(&value).node(&value, 0)?;
    let text = CString::new(schema).map_err(|_| SysError::Schema("the schema contains a NUL byte".into()))?;
    let grammar = std::thread::Builder::new()
        .name("json-schema".into())
        .stack_size(CONVERTER_STACK_BYTES)
        .spawn(move || convert(&text))
        .map_err(|error| SysError::Schema(format!("cannot start the converter's thread: {error}")))?
        .join()
        .map_err(|_| SysError::Schema("the converter's thread panicked".into()))??;
    Grammar::check(&grammar, "root").map_err(|error| {
        let reason = match error {
            SysError::Grammar(reason) => reason,
            other => other.to_string(),
        };
        SysError::Schema(format!(
            "llama.cpp's grammar parser refuses the grammar made of it ({reason}); a repetition over its limit of 2000 (`minItems`, `minLength`, a pattern's `{{n}}`) is the usual cause"
        ))
    })?;
    Ok(grammar)
}

/// Check `schema` against the limits above without converting it: for a schema that llama.cpp
/// converts elsewhere (a tool's parameters, when the chat layer builds the tool-call grammar).
pub fn check_json_schema(schema: &Value) -> Result<(), SysError> {
    Limits::new(schema).node(schema, 0).map(|_| ())
}

fn convert(schema: &CString) -> Result<String, SysError> {
    let mut error = std::ptr::null_mut();
    // SAFETY: the text is NUL-terminated and outlives the call; `error` is a valid out pointer;
    // the shim catches every exception, and the limits checked above bound its recursion to
    // what this thread's stack holds.
    let grammar = unsafe { hypura_json_schema_to_grammar(schema.as_ptr(), &mut error) };
    take_string(grammar).ok_or_else(|| {
        let message = take_string(error).unwrap_or_else(|| "llama.cpp's converter failed without a message".into());
        // One line: "JSON schema conversion failed:\nJSON schema error at #/...: ...".
        let message =
            message.strip_prefix("JSON schema conversion failed:").unwrap_or(&message).trim().replace('\n', "; ");
        SysError::Schema(message)
    })
}

/// What the converter makes of a subschema.
#[derive(Clone, Copy)]
struct Size {
    /// Schema nodes it builds (the targets of `$ref`s met before not counted again).
    nodes: usize,
    /// Alternatives its grammar rule opens with (through every `$ref`).
    alternatives: usize,
}

/// The walk that checks the limits, visiting what llama.cpp's schema builder visits.
struct Limits<'a> {
    root: &'a Value,
    /// The alternatives of each `$ref` whose target was walked (the builder builds each once);
    /// 1 while it is being walked.
    refs: HashMap<&'a str, usize>,
    property_work: u64,
    patterns: usize,
}

impl<'a> Limits<'a> {
    fn new(root: &'a Value) -> Self {
        Limits { root, refs: HashMap::new(), property_work: 0, patterns: 0 }
    }

    /// Walk `schema`, `depth` subschemas down.
    fn node(&mut self, schema: &'a Value, depth: usize) -> Result<Size, SysError> {
        if depth > MAX_DEPTH {
            return Err(SysError::Schema(format!("nested deeper than {MAX_DEPTH} levels")));
        }
        // Anything else is the converter's to refuse, with its own message.
        let Value::Object(object) = schema else { return Ok(Size { nodes: 1, alternatives: 1 }) };
        let types = match object.get("type") {
            Some(kind @ Value::String(_)) => std::slice::from_ref(kind),
            Some(Value::Array(kinds)) => kinds.as_slice(),
            _ => &[],
        };
        for kind in types {
            // The converter would expand a nested list again, multiplying the copies.
            let kind =
                kind.as_str().ok_or_else(|| SysError::Schema(format!("`type` entries must be strings, not {kind}")))?;
            if !TYPES.contains(&kind) {
                return Err(SysError::Schema(format!("unknown type {kind:?}")));
            }
        }
        let mut below = 0usize;
        let mut reference = None;
        if let Some(path) = object.get("$ref") {
            let size = self.reference(path, depth)?;
            below += size.nodes;
            reference = Some(size.alternatives);
        }
        let mut branches = 0usize;
        for keyword in ["anyOf", "oneOf", "allOf", "prefixItems"] {
            if let Some(Value::Array(schemas)) = object.get(keyword) {
                for child in schemas {
                    let size = self.node(child, depth + 1)?;
                    below += size.nodes;
                    if matches!(keyword, "anyOf" | "oneOf") {
                        branches = branches.saturating_add(size.alternatives);
                    }
                }
            }
        }
        match object.get("items") {
            Some(Value::Array(schemas)) => {
                for child in schemas {
                    below += self.node(child, depth + 1)?.nodes;
                }
            }
            Some(child) => below += self.node(child, depth + 1)?.nodes,
            None => {}
        }
        if let Some(child @ Value::Object(_)) = object.get("additionalProperties") {
            below += self.node(child, depth + 1)?.nodes;
        }
        if let Some(Value::Object(properties)) = object.get("properties") {
            if properties.len() > MAX_PROPERTIES {
                return Err(SysError::Schema(format!(
                    "an object has {} properties, more than {MAX_PROPERTIES}",
                    properties.len()
                )));
            }
            self.property_work(properties.len())?;
            for (name, child) in properties {
                if name.len() > MAX_NAME_BYTES {
                    return Err(SysError::Schema(format!(
                        "a property name has {} bytes, more than {MAX_NAME_BYTES}",
                        name.len()
                    )));
                }
                below += self.node(child, depth + 1)?.nodes;
            }
        }
        if let Some(Value::Array(parts)) = object.get("allOf") {
            let merged: usize = parts.iter().map(|part| self.merged_properties(part)).sum();
            if merged > MAX_PROPERTIES {
                return Err(SysError::Schema(format!(
                    "an `allOf` merges {merged} properties, more than {MAX_PROPERTIES}"
                )));
            }
            self.property_work(merged)?;
        }
        let integer_range = is_integer(object) && integer_bounds(object)?;
        let own = if let Some(Value::Array(values)) = object.get("enum") {
            values.len()
        } else if let Some(Value::String(pattern)) = object.get("pattern") {
            self.patterns += 1;
            if self.patterns > MAX_PATTERNS {
                return Err(SysError::Schema(format!("more than {MAX_PATTERNS} patterns")));
            }
            // Each alternation, group and optional part can open the string.
            1 + pattern.bytes().filter(|byte| matches!(byte, b'|' | b'(' | b'?' | b'*')).count()
        } else if integer_range {
            INTEGER_RANGE_ALTERNATIVES
        } else {
            1
        };
        // The builder's order: a `$ref` wins, then `oneOf`/`anyOf`, then the rest.
        let alternatives =
            reference.unwrap_or(if branches > 0 { branches } else { own.saturating_mul(copies(object)) });
        if alternatives > MAX_ALTERNATIVES {
            return Err(SysError::Schema(format!(
                "a value has more than {MAX_ALTERNATIVES} alternatives (enum values, anyOf branches, through `$ref`s)"
            )));
        }
        let nodes = below.saturating_add(1).saturating_mul(copies(object));
        if nodes > MAX_NODES {
            return Err(SysError::Schema(format!("the schema makes more than {MAX_NODES} nodes")));
        }
        Ok(Size { nodes, alternatives })
    }

    /// Count an object of `count` properties against MAX_PROPERTY_WORK.
    fn property_work(&mut self, count: usize) -> Result<(), SysError> {
        self.property_work = self.property_work.saturating_add((count as u64).pow(3));
        if self.property_work > MAX_PROPERTY_WORK {
            return Err(SysError::Schema(format!(
                "the schema's objects have too many properties together (more than four objects of {MAX_PROPERTIES})"
            )));
        }
        Ok(())
    }

    /// A `$ref`: its chain of `$ref`s is checked, and its target walked the first time.
    fn reference(&mut self, reference: &'a Value, depth: usize) -> Result<Size, SysError> {
        let Value::String(path) = reference else { return Ok(Size { nodes: 0, alternatives: 1 }) };
        if path.len() > MAX_NAME_BYTES {
            return Err(SysError::Schema(format!("a `$ref` has {} bytes, more than {MAX_NAME_BYTES}", path.len())));
        }
        if let Some(&alternatives) = self.refs.get(path.as_str()) {
            return Ok(Size { nodes: 0, alternatives });
        }
        self.refs.insert(path, 1);
        self.follow(path)?;
        let Some(target) = self.resolve(path) else { return Ok(Size { nodes: 0, alternatives: 1 }) };
        let size = self.node(target, depth + 1)?;
        self.refs.insert(path, size.alternatives);
        Ok(size)
    }

    /// Follow `$ref`s that point straight at another `$ref`: a loop, or a chain longer than
    /// MAX_REF_CHAIN, is an error. Returns the schema the chain ends on (None: unresolved).
    fn follow(&self, path: &str) -> Result<Option<&'a Value>, SysError> {
        let mut seen = vec![path];
        let mut current = path;
        loop {
            let Some(target) = self.resolve(current) else { return Ok(None) };
            let Some(Value::String(next)) = target.get("$ref") else { return Ok(Some(target)) };
            if seen.contains(&next.as_str()) {
                return Err(SysError::Schema(format!("`$ref` {path:?} leads back to itself through `$ref`s only")));
            }
            if seen.len() >= MAX_REF_CHAIN {
                return Err(SysError::Schema(format!(
                    "`$ref` {path:?} starts a chain of more than {MAX_REF_CHAIN} `$ref`s"
                )));
            }
            seen.push(next);
            current = next;
        }
    }

    /// A local `$ref`'s target, found as llama.cpp finds it (`#/` then `/`-separated keys and
    /// array indices, without JSON-pointer unescaping).
    fn resolve(&self, path: &str) -> Option<&'a Value> {
        let pointer = path.strip_prefix("#/")?;
        pointer.split('/').try_fold(self.root, |target, key| match target {
            Value::Object(object) => object.get(key),
            Value::Array(items) => items.get(key.parse::<usize>().ok()?),
            _ => None,
        })
    }

    /// The properties an `allOf` part brings to the merged object, at most: its own and those
    /// of its alternatives (`anyOf`, `oneOf`), through `$ref`s, once per listed type.
    fn merged_properties(&self, part: &'a Value) -> usize {
        let count = |schema: &'a Value| {
            let schema = match schema.get("$ref") {
                Some(Value::String(path)) => self.follow(path).ok().flatten(),
                _ => Some(schema),
            };
            let Some(Value::Object(object)) = schema else { return 0 };
            let properties = object.get("properties").and_then(Value::as_object).map_or(0, Map::len);
            properties.saturating_mul(copies(object))
        };
        let alternatives: usize = ["anyOf", "oneOf"]
            .iter()
            .filter_map(|keyword| part.get(keyword).and_then(Value::as_array))
            .flatten()
            .map(count)
            .sum();
        count(part).saturating_add(alternatives)
    }
}

/// The schemas the converter makes of one with a type list: one per listed type.
fn copies(object: &Map<String, Value>) -> usize {
    match object.get("type") {
        Some(Value::Array(types)) => types.len().max(1),
        _ => 1,
    }
}

fn is_integer(object: &Map<String, Value>) -> bool {
    match object.get("type") {
        Some(Value::String(kind)) => kind == "integer",
        Some(Value::Array(kinds)) => kinds.iter().any(|kind| kind == "integer"),
        _ => false,
    }
}

/// Check an integer's bounds; whether it has any.
fn integer_bounds(object: &Map<String, Value>) -> Result<bool, SysError> {
    let mut bounded = false;
    for keyword in ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"] {
        if let Some(bound) = object.get(keyword).and_then(Value::as_f64) {
            if bound.abs() > MAX_INTEGER_BOUND {
                return Err(SysError::Schema(format!("the integer bound `{keyword}` {bound} is outside ±10^15")));
            }
            bounded = true;
        }
    }
    Ok(bounded)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn grammar(schema: &Value) -> Result<String, SysError> {
        json_schema_to_grammar(&schema.to_string())
    }

    fn refused(schema: &str) -> String {
        match json_schema_to_grammar(schema) {
            Err(SysError::Schema(message)) => message,
            other => panic!("{schema}: {other:?}"),
        }
    }

    #[test]
    fn an_object_schema_becomes_a_grammar_llama_cpp_parses() {
        // The grammar was parsed before it was returned; its root rule lists the properties.
        let text = r#"{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}, "required": ["name", "age"]}"#;
        let grammar = json_schema_to_grammar(text).unwrap();
        let root = grammar.lines().find(|line| line.starts_with("root ::= ")).unwrap_or_else(|| panic!("{grammar}"));
        // The converter keeps the document's order.
        assert!(root.find("name").unwrap() < root.find("age").unwrap(), "{grammar}");
        assert!(grammar.contains(r#""\"name\"" space ":" space string"#), "{grammar}");
        assert!(grammar.contains(r#""\"age\"""#), "{grammar}");
    }

    #[test]
    fn escaped_characters_stay_escaped() {
        let grammar = grammar(&json!({"enum": ["a\"b\\c\nd\u{0}"]})).unwrap();
        assert!(grammar.contains(r#"root ::= ("\"a\\\"b\\\\c\\nd\\u0000\"")"#), "{grammar}");
    }

    #[test]
    fn recursive_references_terminate() {
        let schema = json!({
            "$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"
        });
        assert!(grammar(&schema).unwrap().contains("root ::= "));
    }

    #[test]
    fn schemas_llama_cpp_refuses_are_errors() {
        for (schema, expected) in [
            ("{", "not JSON"),
            ("\"string\"", "schema must be an object"),
            ("false", "schema must be an object"),
            (r#"{"type": "thing"}"#, "unknown type \"thing\""),
            (r#"{"type": [["string"]]}"#, "`type` entries must be strings"),
            (r#"{"enum": []}"#, "enum must be a non-empty array"),
            (r#"{"$ref": "http://x"}"#, "only references into the same document"),
            (r##"{"$ref": "#/nowhere"}"##, "cannot resolve $ref"),
            (r#"{"type": "string", "pattern": "^(a$"}"#, "unbalanced parentheses"),
            // A grammar llama.cpp's parser refuses is caught here, not at generation.
            (r#"{"type": "array", "minItems": 2500}"#, "grammar parser refuses"),
        ] {
            let message = refused(schema);
            assert!(message.contains(expected), "{schema}: {message}");
        }
    }

    #[test]
    fn hostile_schemas_are_errors_not_crashes() {
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(refused(&deep.to_string()).contains("nested deeper than 32 levels"));
        // Deeper than serde_json reads (and than llama.cpp's recursion would survive).
        let deeper = format!("{}{}", "{\"items\":".repeat(100_000), "}".repeat(100_000));
        assert!(refused(&deeper).contains("not JSON"));
        // A `$ref` loop that the converter's `allOf` merge would follow forever.
        let looped = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "allOf": [{"$ref": "#/$defs/a"}]});
        assert!(refused(&looped.to_string()).contains("leads back to itself"));
        // Type lists that double the schema at every level.
        let mut doubling = json!({"type": "string"});
        for _ in 0..16 {
            doubling = json!({"type": ["object", "object"], "properties": {"x": doubling}});
        }
        assert!(refused(&doubling.to_string()).contains("nodes"));
        let many: Map<String, Value> =
            (0..300).map(|index| (format!("p{index}"), json!({"type": "integer"}))).collect();
        assert!(refused(&json!({"properties": many}).to_string()).contains("300 properties"));
        let merged: Vec<Value> = (0..2).map(|_| json!({"properties": (0..200).map(|index| (format!("p{index}"), json!({}))).collect::<Map<_, _>>()})).collect();
        assert!(refused(&json!({"allOf": [{"anyOf": merged}]}).to_string()).contains("merges 400 properties"));
        // Alternatives that multiply through `$ref`s: 3^12 parse stacks.
        let mut definitions: Map<String, Value> = (0..12)
            .map(|index| {
                (format!("a{index}"), json!({"anyOf": [{"$ref": format!("#/$defs/a{}", index + 1)}, {"$ref": format!("#/$defs/a{}", index + 1)}, {"$ref": format!("#/$defs/a{}", index + 1)}]}))
            })
            .collect();
        definitions.insert("a12".into(), json!({"type": "string"}));
        let tripling = json!({"$defs": definitions, "$ref": "#/$defs/a0"});
        assert!(refused(&tripling.to_string()).contains("alternatives"));
        assert!(refused(&json!({"enum": (0..60_000).collect::<Vec<_>>()}).to_string()).contains("alternatives"));
        let patterns: Vec<Value> =
            (0..200).map(|index| json!({"type": "string", "pattern": format!("^a{index}$")})).collect();
        assert!(
            refused(&json!({"type": "array", "prefixItems": patterns}).to_string()).contains("more than 128 patterns")
        );
        let long_name = json!({"properties": {" ".repeat(5000): {}}, "additionalProperties": true});
        assert!(refused(&long_name.to_string()).contains("property name has 5000 bytes"));
        assert!(refused(r#"{"type": "integer", "maximum": -9223372036854775808}"#).contains("outside ±10^15"));
        assert!(refused(&"x".repeat(MAX_SCHEMA_BYTES + 1)).contains("bytes, more than"));
    }

    #[test]
    fn a_long_reference_chain_runs_on_the_converters_stack() {
        // 2000 `$defs`, each referring to the next. Entry points every 12 definitions keep the
        // nesting that this walk sees (in key order) within the limit, while the converter,
        // reading the document in its order, builds the whole chain in one recursion: far
        // deeper than a 2 MiB thread stack holds, well within the converter's own.
        let count = 2000;
        let definitions: Vec<String> = (0..count)
            .map(|index| {
                let next = if index + 1 < count {
                    format!(r##"{{"type": "object", "properties": {{"x": {{"$ref": "#/$defs/d{}"}}}}}}"##, index + 1)
                } else {
                    r#"{"type": "string"}"#.to_string()
                };
                format!(r#""d{index}": {next}"#)
            })
            .collect();
        let entries: Vec<String> = (0..count)
            .step_by(12)
            .map(|index| format!(r##""e{:04}": {{"$ref": "#/$defs/d{index}"}}"##, count - index))
            .collect();
        let schema = format!(
            r#"{{"$defs": {{{}}}, "type": "object", "properties": {{{}}}}}"#,
            definitions.join(", "),
            entries.join(", ")
        );
        let grammar = json_schema_to_grammar(&schema).unwrap();
        assert!(grammar.contains("ref-defs-d1998 ::= "), "{}", &grammar[..200]);
    }
}
