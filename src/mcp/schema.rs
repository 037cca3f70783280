//! Portable JSON Schemas for tool inputs and outputs. Several clients reject `$ref`/`$defs`,
//! `$schema`, `type: [T, "null"]`, top-level `anyOf`, `oneOf` and arrays without `items`, and warn on
//! `format` values JSON Schema does not define (schemars writes `uint`, `uint32`, `uint64`, `int64`,
//! `double`, ...: Gemini CLI printed a warning per field); these schemas have none of them:
//! subschemas are inlined, nullability is expressed by leaving a field out of `required`, and only
//! the formats of JSON Schema 2020-12 (section 7.3) remain (an unsigned integer keeps its
//! `minimum: 0`).

use std::sync::Arc;

use rmcp::model::JsonObject;
use schemars::JsonSchema;
use schemars::generate::SchemaSettings;
use serde_json::Value;

/// The `format` values JSON Schema 2020-12 defines (Validation, section 7.3).
pub const STANDARD_FORMATS: [&str; 19] = [
    "date-time",
    "date",
    "time",
    "duration",
    "email",
    "idn-email",
    "hostname",
    "idn-hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "iri",
    "iri-reference",
    "uuid",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
    "regex",
];

/// Remove every `format` keyword whose value JSON Schema does not define.
fn strip_formats(v: &mut Value) {
    match v {
        Value::Object(o) => {
            if o.get("format").and_then(Value::as_str).is_some_and(|f| !STANDARD_FORMATS.contains(&f)) {
                o.remove("format");
            }
            o.values_mut().for_each(strip_formats);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_formats),
        _ => {}
    }
}

/// Turn a `oneOf` whose every branch is a documented string constant (what schemars writes for a
/// unit enum with doc comments) into `type: string` with an `enum`, the branches' descriptions
/// appended to the field's (`blocking: stops the gate; ...`). `oneOf` asks a validator to prove
/// exactly one branch matches; several clients handle it poorly or not at all, and a plain `enum`
/// says the same for constants.
fn enums_of_constants(v: &mut Value) {
    match v {
        Value::Object(o) => {
            let constants: Option<Vec<(String, String)>> = o.get("oneOf").and_then(Value::as_array).and_then(|bs| {
                bs.iter()
                    .map(|b| {
                        let c = b.get("const")?.as_str()?.to_string();
                        let d = b.get("description").and_then(Value::as_str).unwrap_or("").to_string();
                        Some((c, d))
                    })
                    .collect()
            });
            if let Some(cs) = constants.filter(|cs| !cs.is_empty()) {
                o.remove("oneOf");
                o.insert("type".into(), Value::String("string".into()));
                o.insert("enum".into(), Value::Array(cs.iter().map(|(c, _)| Value::String(c.clone())).collect()));
                let each: Vec<String> = cs
                    .iter()
                    .filter(|(_, d)| !d.is_empty())
                    .map(|(c, d)| format!("`{c}`: {}", d.trim_end_matches('.')))
                    .collect();
                if !each.is_empty() {
                    let head = o.get("description").and_then(Value::as_str).unwrap_or("").trim_end().to_string();
                    let sep = if head.is_empty() { "" } else { " " };
                    o.insert("description".into(), Value::String(format!("{head}{sep}{}.", each.join("; "))));
                }
            }
            o.values_mut().for_each(enums_of_constants);
        }
        Value::Array(a) => a.iter_mut().for_each(enums_of_constants),
        _ => {}
    }
}

fn generate<T: JsonSchema>(for_output: bool) -> Value {
    let mut settings = SchemaSettings::draft2020_12();
    settings.inline_subschemas = true;
    settings.meta_schema = None;
    if for_output {
        settings = settings.for_serialize();
    }
    let schema = settings.into_generator().into_root_schema_for::<T>();
    let mut v = serde_json::to_value(schema).expect("schemas serialise");
    crate::ckb::portable(&mut v);
    strip_formats(&mut v);
    enums_of_constants(&mut v);
    if let Value::Object(o) = &mut v {
        o.remove("title");
        o.remove("description");
        o.entry("properties").or_insert_with(|| Value::Object(Default::default()));
    }
    v
}

fn object(v: Value) -> Arc<JsonObject> {
    match v {
        Value::Object(o) => Arc::new(o),
        other => panic!("tool schemas are objects, got {other}"),
    }
}

/// Portable input schema of a request type.
pub fn input<T: JsonSchema>() -> Arc<JsonObject> {
    object(generate::<T>(false))
}

/// Portable output schema of a report type (describes what `Serialize` writes).
pub fn output<T: JsonSchema>() -> Arc<JsonObject> {
    object(generate::<T>(true))
}

/// Every place a schema is not portable, as JSON pointers with the reason; empty when it is.
pub fn portability_problems(schema: &Value) -> Vec<String> {
    fn walk(v: &Value, path: String, out: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                for bad in ["$ref", "$defs", "$schema", "definitions"] {
                    if o.contains_key(bad) {
                        out.push(format!("{path}: has {bad}"));
                    }
                }
                if let Some(Value::Array(t)) = o.get("type")
                    && t.iter().any(|x| x == "null")
                {
                    out.push(format!("{path}: null in a type union"));
                }
                if let Some(f) = o.get("format").and_then(Value::as_str)
                    && !STANDARD_FORMATS.contains(&f)
                {
                    out.push(format!("{path}: non-standard format `{f}`"));
                }
                if o.get("type").and_then(Value::as_str) == Some("array") && !o.contains_key("items") {
                    out.push(format!("{path}: array without items"));
                }
                if o.contains_key("oneOf") {
                    out.push(format!("{path}: oneOf (write an enum, or anyOf)"));
                }
                for (k, child) in o {
                    walk(child, format!("{path}/{k}"), out);
                }
            }
            Value::Array(a) => {
                for (i, child) in a.iter().enumerate() {
                    walk(child, format!("{path}/{i}"), out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    if schema.get("type").and_then(Value::as_str) != Some("object") {
        out.push("/: root is not type object".into());
    }
    for bad in ["anyOf", "oneOf", "allOf"] {
        if schema.get(bad).is_some() {
            out.push(format!("/: top-level {bad}"));
        }
    }
    walk(schema, String::new(), &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(schemars::JsonSchema, serde::Serialize)]
    #[allow(dead_code)]
    struct Inner {
        x: Option<u32>,
        n: u64,
        f: f64,
    }
    #[derive(schemars::JsonSchema, serde::Serialize)]
    #[allow(dead_code)]
    struct Outer {
        inner: Inner,
        list: Vec<Inner>,
        maybe: Option<String>,
    }

    #[test]
    fn nested_optional_types_become_portable() {
        let raw = serde_json::to_value(schemars::schema_for!(Outer)).unwrap();
        assert!(!portability_problems(&raw).is_empty(), "the raw schemars output must be caught: {raw}");
        let s = Value::Object((*input::<Outer>()).clone());
        assert_eq!(portability_problems(&s), Vec::<String>::new(), "{s}");
        assert_eq!(s["properties"]["maybe"]["type"], "string");
        assert_eq!(s["properties"]["list"]["items"]["properties"]["x"]["type"], "integer");
        // schemars writes `format: uint32` / `uint64` / `double`; none may remain, the bound stays.
        assert!(raw.to_string().contains("uint64"), "{raw}");
        let n = &s["properties"]["inner"]["properties"]["n"];
        assert!(n.get("format").is_none() && n["minimum"] == 0, "{n}");
    }
}
