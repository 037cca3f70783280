//! Expressions of a family graph's parameters and weight shapes: a small typed language over
//! config roles, parsed into a tree (bounded in bytes and depth, so a hostile contract cannot
//! overflow the stack) and evaluated lazily (`if` evaluates one branch).
//!
//! Grammar, loosest binding first:
//!
//! ```text
//! expr    := and ( "||" and )*
//! and     := cmp ( "&&" cmp )*
//! cmp     := sum [ ("==" | "!=" | "<" | "<=" | ">" | ">=") sum ]
//! sum     := product ( ("+" | "-") product )*
//! product := unary ( ("*" | "/" | "%") unary )*
//! unary   := ("-" | "!") unary | postfix
//! postfix := atom ( "[" expr "]" | "." name )*
//! atom    := number | string | name | name "(" expr ("," expr)* ")" | "(" expr ")"
//! ```
//!
//! Values are typed as config.json types them ([`Val`]): numbers, booleans, strings (`"..."` or
//! `'...'`), lists and objects (config values, indexed by `[i]` or `["key"]` / `.key`), and null.
//! Names are config roles (`hidden`, `layer_types`, `rope_parameters`, ...), `layer` (the layer
//! index, in layer nodes), `true`, `false` and `null`. Functions: `sqrt(x)`, `f32(x)` (round to
//! the nearest f32), `floor(x)`, `min(a, b)`, `max(a, b)`, `len(list)` and `if(cond, a, b)`.
//! Every mistake is an error naming it, never a NaN: arithmetic on a non-number, a division or
//! remainder by zero, an index past a list or a key an object lacks, a comparison of different
//! types (any value may be compared with `null`), a non-finite result.

use std::collections::BTreeMap;

use serde_json::Value;

/// Longest expression [`parse`] reads, bytes: the longest in the shipped contracts is under 100.
pub const MAX_EXPR_BYTES: usize = 1024;

/// Deepest nesting [`parse`] reads (parentheses, unary operators, indexing and function calls,
/// each a level): the parser recurses once per level, so a bound here keeps a hostile contract
/// from overflowing the server's stack. The shipped contracts nest at most 4 deep.
pub const MAX_EXPR_DEPTH: usize = 32;

/// A value: config.json's types, with numbers as f64.
#[derive(Debug, Clone, PartialEq)]
pub enum Val {
    /// JSON null (an absent optional value).
    Null,
    /// A number.
    Num(f64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(String),
    /// A list.
    List(Vec<Val>),
    /// An object.
    Obj(BTreeMap<String, Val>),
}

impl Val {
    /// A JSON value as typed.
    pub fn from_json(v: &Value) -> Val {
        match v {
            Value::Null => Val::Null,
            Value::Bool(b) => Val::Bool(*b),
            Value::Number(n) => n.as_f64().map_or(Val::Null, Val::Num),
            Value::String(s) => Val::Str(s.clone()),
            Value::Array(a) => Val::List(a.iter().map(Val::from_json).collect()),
            Value::Object(o) => Val::Obj(o.iter().map(|(k, v)| (k.clone(), Val::from_json(v))).collect()),
        }
    }

    /// The type in words, with the value when short, for messages.
    pub fn describe(&self) -> String {
        match self {
            Val::Null => "null".into(),
            Val::Num(x) => format!("the number {x}"),
            Val::Bool(b) => format!("the boolean {b}"),
            Val::Str(s) => format!("the string {s:?}"),
            Val::List(l) => format!("a list of {} entries", l.len()),
            Val::Obj(o) => format!("an object (keys {})", o.keys().cloned().collect::<Vec<_>>().join(", ")),
        }
    }
}

/// Looks up a name (a config role or `layer`); None when unknown.
pub type Roles<'a> = dyn Fn(&str) -> Option<Val> + 'a;

/// A parsed expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// A number literal.
    Num(f64),
    /// A string literal.
    Str(String),
    /// `true`, `false`.
    Bool(bool),
    /// `null`.
    Null,
    /// A config role or `layer`.
    Name(String),
    /// `base[index]`.
    Index(Box<Expr>, Box<Expr>),
    /// `base.key`.
    Field(Box<Expr>, String),
    /// `-x`.
    Neg(Box<Expr>),
    /// `!x`.
    Not(Box<Expr>),
    /// A binary operator (`+ - * / % == != < <= > >= && ||`).
    Bin(&'static str, Box<Expr>, Box<Expr>),
    /// A function call.
    Call(String, Vec<Expr>),
}

impl std::fmt::Display for Expr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Expr::Num(x) => write!(f, "{x}"),
            Expr::Str(s) => write!(f, "{s:?}"),
            Expr::Bool(b) => write!(f, "{b}"),
            Expr::Null => write!(f, "null"),
            Expr::Name(n) => write!(f, "{n}"),
            Expr::Index(b, i) => write!(f, "{b}[{i}]"),
            Expr::Field(b, k) => write!(f, "{b}.{k}"),
            Expr::Neg(x) => write!(f, "-{x}"),
            Expr::Not(x) => write!(f, "!{x}"),
            Expr::Bin(op, a, b) => write!(f, "({a} {op} {b})"),
            Expr::Call(n, args) => {
                write!(f, "{n}(")?;
                for (i, a) in args.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{a}")?;
                }
                write!(f, ")")
            }
        }
    }
}

/// The functions an expression may call, with their arity.
pub const FUNCTIONS: &[(&str, usize, &str)] = &[
    ("sqrt", 1, "square root of a non-negative number"),
    ("f32", 1, "the number rounded to the nearest f32 (as an engine computing in f32 holds it)"),
    ("floor", 1, "the largest integer not above the number"),
    ("min", 2, "the smaller of two numbers"),
    ("max", 2, "the larger of two numbers"),
    ("len", 1, "entries of a list or object, characters of a string"),
    ("if", 3, "if(cond, a, b): a when the boolean cond is true, else b (only that branch is evaluated)"),
];

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Num(f64),
    Str(String),
    Name(String),
    Op(&'static str),
}

const OPS: &[&str] =
    &["==", "!=", "<=", ">=", "&&", "||", "<", ">", "+", "-", "*", "/", "%", "!", "(", ")", "[", "]", ".", ","];

fn lex(expr: &str) -> Result<Vec<Tok>, String> {
    let s: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut at = 0;
    while at < s.len() {
        let c = s[at];
        if c.is_whitespace() {
            at += 1;
        } else if c.is_ascii_digit() || (c == '.' && s.get(at + 1).is_some_and(char::is_ascii_digit)) {
            let start = at;
            while at < s.len()
                && (s[at].is_ascii_alphanumeric()
                    || s[at] == '.'
                    || (matches!(s[at], '+' | '-') && matches!(s[at - 1], 'e' | 'E')))
            {
                at += 1;
            }
            let text: String = s[start..at].iter().collect();
            out.push(Tok::Num(text.parse::<f64>().map_err(|_| format!("`{text}` is not a number"))?));
        } else if c == '"' || c == '\'' {
            let start = at + 1;
            at += 1;
            while at < s.len() && s[at] != c {
                at += 1;
            }
            if at == s.len() {
                return Err(format!("a string opened at {} is not closed", start - 1));
            }
            out.push(Tok::Str(s[start..at].iter().collect()));
            at += 1;
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = at;
            while at < s.len() && (s[at].is_ascii_alphanumeric() || s[at] == '_') {
                at += 1;
            }
            out.push(Tok::Name(s[start..at].iter().collect()));
        } else if let Some(op) = OPS.iter().find(|op| op.chars().enumerate().all(|(k, oc)| s.get(at + k) == Some(&oc)))
        {
            out.push(Tok::Op(op));
            at += op.len();
        } else {
            return Err(format!("unexpected `{c}` at {at}"));
        }
    }
    Ok(out)
}

/// Parse an expression (grammar in the module doc).
///
/// # Errors
/// A message naming what does not parse, an expression over [`MAX_EXPR_BYTES`] or nested deeper
/// than [`MAX_EXPR_DEPTH`], an unknown function or a wrong argument count.
pub fn parse(expr: &str) -> Result<Expr, String> {
    if expr.len() > MAX_EXPR_BYTES {
        return Err(format!(
            "an expression of {} bytes; at most {MAX_EXPR_BYTES} (write it shorter, or add a config role)",
            expr.len()
        ));
    }
    let toks = lex(expr)?;
    let mut p = Parser { t: &toks, at: 0, depth: 0 };
    let e = p.or()?;
    if let Some(t) = p.t.get(p.at) {
        return Err(format!("`{expr}`: unexpected {} after a complete expression", show(t)));
    }
    Ok(e)
}

fn show(t: &Tok) -> String {
    match t {
        Tok::Num(x) => format!("number `{x}`"),
        Tok::Str(s) => format!("string {s:?}"),
        Tok::Name(n) => format!("`{n}`"),
        Tok::Op(o) => format!("`{o}`"),
    }
}

struct Parser<'a> {
    t: &'a [Tok],
    at: usize,
    depth: usize,
}

impl Parser<'_> {
    fn peek_op(&self) -> Option<&'static str> {
        match self.t.get(self.at) {
            Some(Tok::Op(o)) => Some(o),
            _ => None,
        }
    }
    fn eat(&mut self, op: &str) -> bool {
        if self.peek_op() == Some(op) {
            self.at += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, op: &str) -> Result<(), String> {
        if self.eat(op) {
            Ok(())
        } else {
            Err(match self.t.get(self.at) {
                Some(t) => format!("expected `{op}`, found {}", show(t)),
                None => format!("expected `{op}`, the expression ends early"),
            })
        }
    }
    fn nest<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T, String>) -> Result<T, String> {
        self.depth += 1;
        if self.depth > MAX_EXPR_DEPTH {
            return Err(format!("nested more than {MAX_EXPR_DEPTH} deep"));
        }
        let v = f(self);
        self.depth -= 1;
        v
    }
    fn chain(
        &mut self,
        ops: &[&'static str],
        next: fn(&mut Self) -> Result<Expr, String>,
        assoc: bool,
    ) -> Result<Expr, String> {
        let mut v = next(self)?;
        while let Some(op) = self.peek_op().filter(|o| ops.contains(o)) {
            self.at += 1;
            let r = next(self)?;
            v = Expr::Bin(op, Box::new(v), Box::new(r));
            if !assoc {
                if let Some(o) = self.peek_op().filter(|o| ops.contains(o)) {
                    return Err(format!("`{o}` after a comparison: compare two values at a time (use && or ||)"));
                }
                break;
            }
        }
        Ok(v)
    }
    fn or(&mut self) -> Result<Expr, String> {
        self.chain(&["||"], Self::and, true)
    }
    fn and(&mut self) -> Result<Expr, String> {
        self.chain(&["&&"], Self::cmp, true)
    }
    fn cmp(&mut self) -> Result<Expr, String> {
        self.chain(&["==", "!=", "<", "<=", ">", ">="], Self::sum, false)
    }
    fn sum(&mut self) -> Result<Expr, String> {
        self.chain(&["+", "-"], Self::product, true)
    }
    fn product(&mut self) -> Result<Expr, String> {
        self.chain(&["*", "/", "%"], Self::unary, true)
    }
    fn unary(&mut self) -> Result<Expr, String> {
        if self.eat("-") {
            return self.nest(|p| Ok(Expr::Neg(Box::new(p.unary()?))));
        }
        if self.eat("!") {
            return self.nest(|p| Ok(Expr::Not(Box::new(p.unary()?))));
        }
        self.postfix()
    }
    fn postfix(&mut self) -> Result<Expr, String> {
        let mut v = self.atom()?;
        loop {
            if self.eat("[") {
                let i = self.nest(Self::or)?;
                self.expect("]")?;
                v = Expr::Index(Box::new(v), Box::new(i));
            } else if self.eat(".") {
                match self.t.get(self.at) {
                    Some(Tok::Name(k)) => {
                        v = Expr::Field(Box::new(v), k.clone());
                        self.at += 1;
                    }
                    _ => return Err("`.` must be followed by a key name".into()),
                }
            } else {
                return Ok(v);
            }
        }
    }
    fn atom(&mut self) -> Result<Expr, String> {
        let Some(t) = self.t.get(self.at).cloned() else { return Err("expression ends early".into()) };
        self.at += 1;
        match t {
            Tok::Num(x) => Ok(Expr::Num(x)),
            Tok::Str(s) => Ok(Expr::Str(s)),
            Tok::Op("(") => {
                let v = self.nest(Self::or)?;
                self.expect(")")?;
                Ok(v)
            }
            Tok::Op(o) => Err(format!("unexpected `{o}`")),
            Tok::Name(n) if self.peek_op() == Some("(") => {
                self.at += 1;
                let Some(&(_, arity, _)) = FUNCTIONS.iter().find(|f| f.0 == n) else {
                    return Err(format!(
                        "unknown function `{n}` (known: {})",
                        FUNCTIONS.iter().map(|f| f.0).collect::<Vec<_>>().join(", ")
                    ));
                };
                let mut args = Vec::new();
                self.nest(|p| {
                    if !p.eat(")") {
                        loop {
                            args.push(p.or()?);
                            if p.eat(")") {
                                break;
                            }
                            p.expect(",")?;
                        }
                    }
                    Ok(())
                })?;
                if args.len() != arity {
                    return Err(format!("`{n}` takes {arity} argument(s), got {}", args.len()));
                }
                Ok(Expr::Call(n, args))
            }
            Tok::Name(n) => Ok(match n.as_str() {
                "true" => Expr::Bool(true),
                "false" => Expr::Bool(false),
                "null" => Expr::Null,
                _ => Expr::Name(n),
            }),
        }
    }
}

/// Evaluate a parsed expression with names looked up by `roles`.
///
/// # Errors
/// A message naming the mistake (module doc): an unknown role, a type mismatch, a division by
/// zero, an index past a list, a key an object lacks, a non-finite result.
pub fn eval(e: &Expr, roles: &Roles<'_>) -> Result<Val, String> {
    let num = |x: &Expr, v: Val| match v {
        Val::Num(n) => Ok(n),
        other => Err(format!("`{x}` is {}, where a number is needed", other.describe())),
    };
    let boolean = |x: &Expr, v: Val| match v {
        Val::Bool(b) => Ok(b),
        other => Err(format!("`{x}` is {}, where a boolean is needed", other.describe())),
    };
    let finite = |x: f64, e: &Expr| {
        if x.is_finite() { Ok(Val::Num(x)) } else { Err(format!("`{e}` is not a finite number ({x})")) }
    };
    match e {
        Expr::Num(x) => finite(*x, e),
        Expr::Str(s) => Ok(Val::Str(s.clone())),
        Expr::Bool(b) => Ok(Val::Bool(*b)),
        Expr::Null => Ok(Val::Null),
        Expr::Name(n) => roles(n).ok_or_else(|| format!("unknown config role `{n}`")),
        Expr::Neg(x) => finite(-num(x, eval(x, roles)?)?, e),
        Expr::Not(x) => Ok(Val::Bool(!boolean(x, eval(x, roles)?)?)),
        Expr::Field(b, k) => index(b, eval(b, roles)?, &Val::Str(k.clone())),
        Expr::Index(b, i) => {
            let base = eval(b, roles)?;
            index(b, base, &eval(i, roles)?)
        }
        Expr::Bin(op @ ("&&" | "||"), a, b) => {
            let l = boolean(a, eval(a, roles)?)?;
            if (*op == "&&" && !l) || (*op == "||" && l) {
                return Ok(Val::Bool(l));
            }
            Ok(Val::Bool(boolean(b, eval(b, roles)?)?))
        }
        Expr::Bin(op @ ("==" | "!="), a, b) => {
            let (l, r) = (eval(a, roles)?, eval(b, roles)?);
            let same = std::mem::discriminant(&l) == std::mem::discriminant(&r);
            if !same && l != Val::Null && r != Val::Null {
                return Err(format!("`{e}` compares {} with {}", l.describe(), r.describe()));
            }
            Ok(Val::Bool((l == r) == (*op == "==")))
        }
        Expr::Bin(op, a, b) => {
            let (l, r) = (num(a, eval(a, roles)?)?, num(b, eval(b, roles)?)?);
            if matches!(*op, "/" | "%") && r == 0.0 {
                return Err(format!("`{e}` divides by zero (`{b}` is 0)"));
            }
            match *op {
                "<" => Ok(Val::Bool(l < r)),
                "<=" => Ok(Val::Bool(l <= r)),
                ">" => Ok(Val::Bool(l > r)),
                ">=" => Ok(Val::Bool(l >= r)),
                "+" => finite(l + r, e),
                "-" => finite(l - r, e),
                "*" => finite(l * r, e),
                "/" => finite(l / r, e),
                _ => finite(l % r, e),
            }
        }
        Expr::Call(f, args) => match f.as_str() {
            "if" => {
                if boolean(&args[0], eval(&args[0], roles)?)? {
                    eval(&args[1], roles)
                } else {
                    eval(&args[2], roles)
                }
            }
            "len" => match eval(&args[0], roles)? {
                Val::List(l) => Ok(Val::Num(l.len() as f64)),
                Val::Obj(o) => Ok(Val::Num(o.len() as f64)),
                Val::Str(s) => Ok(Val::Num(s.chars().count() as f64)),
                other => Err(format!("`{e}`: len of {}", other.describe())),
            },
            "min" | "max" => {
                let (a, b) = (num(&args[0], eval(&args[0], roles)?)?, num(&args[1], eval(&args[1], roles)?)?);
                Ok(Val::Num(if f == "min" { a.min(b) } else { a.max(b) }))
            }
            _ => {
                let x = num(&args[0], eval(&args[0], roles)?)?;
                match f.as_str() {
                    "sqrt" if x < 0.0 => Err(format!("`{e}`: the square root of the negative {x}")),
                    "sqrt" => Ok(Val::Num(x.sqrt())),
                    "f32" => finite(x as f32 as f64, e),
                    _ => Ok(Val::Num(x.floor())),
                }
            }
        },
    }
}

/// `base[key]`: a list by a whole number in range, an object by a string key.
fn index(b: &Expr, base: Val, key: &Val) -> Result<Val, String> {
    match (base, key) {
        (Val::List(l), Val::Num(i)) => {
            if i.fract() != 0.0 || *i < 0.0 {
                return Err(format!("`{b}` indexed by {i}: an index is a whole number from 0"));
            }
            let n = l.len();
            l.into_iter().nth(*i as usize).ok_or_else(|| {
                format!("index {i} past the end of `{b}` ({n} entries): the list is shorter than the graph reads")
            })
        }
        (Val::Obj(mut o), Val::Str(k)) => o.remove(k).ok_or_else(|| {
            format!(
                "`{b}` has no key {k:?} (keys: {}): a value the graph does not name",
                o.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        }),
        (base, key) => Err(format!("`{b}` is {}, which cannot be indexed by {}", base.describe(), key.describe())),
    }
}

/// Parse and evaluate `expr` to a number: a parameter's or a shape's value. A boolean is 1 or 0.
///
/// # Errors
/// As [`parse`] and [`eval`]; a value that is not a number or a boolean.
pub fn eval_number(expr: &str, roles: &Roles<'_>) -> Result<f64, String> {
    match eval(&parse(expr)?, roles)? {
        Val::Num(x) => Ok(x),
        Val::Bool(b) => Ok(if b { 1.0 } else { 0.0 }),
        other => Err(format!("`{expr}` is {}; a parameter needs a number", other.describe())),
    }
}

/// Names an expression reads (config roles and `layer`), in order of appearance.
pub fn names(e: &Expr) -> Vec<String> {
    let mut out = Vec::new();
    fn walk(e: &Expr, out: &mut Vec<String>) {
        match e {
            Expr::Name(n) if !out.contains(n) => out.push(n.clone()),
            Expr::Index(a, b) | Expr::Bin(_, a, b) => {
                walk(a, out);
                walk(b, out);
            }
            Expr::Field(a, _) | Expr::Neg(a) | Expr::Not(a) => walk(a, out),
            Expr::Call(_, args) => args.iter().for_each(|a| walk(a, out)),
            _ => {}
        }
    }
    walk(e, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(n: &str) -> Option<Val> {
        let cfg = serde_json::json!({
            "hidden": 64, "layer": 5, "sliding_window": 4,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {"full_attention": {"rope_theta": 1000000.0}, "sliding_attention": {"rope_theta": 10000.0}},
            "no_rope_layers": [1, 1, 1, 0], "flag": true, "nothing": null
        });
        cfg.get(n).map(Val::from_json)
    }

    fn num(e: &str) -> f64 {
        eval_number(e, &roles).unwrap_or_else(|m| panic!("{e}: {m}"))
    }

    fn err(e: &str) -> String {
        eval_number(e, &roles).expect_err(e)
    }

    #[test]
    fn arithmetic_keeps_its_precedence() {
        assert_eq!(num("1 + 2 * 3"), 7.0);
        assert_eq!(num("(1 + 2) * 3"), 9.0);
        assert_eq!(num("-2 * -3"), 6.0);
        assert_eq!(num("7 % 4 - 1"), 2.0);
        assert_eq!(num("1e-5 * 2"), 2e-5);
        assert_eq!(num("sqrt(hidden) / 2"), 4.0);
        assert_eq!(num("f32(0.1)"), 0.1f32 as f64);
        assert_eq!(num("sliding_window * (1 - layer % 2)"), 0.0);
        assert_eq!(num("min(3, max(1, 2))"), 2.0);
        assert_eq!(num("floor(16 * 0.25)"), 4.0);
    }

    #[test]
    fn config_lists_and_objects_are_indexed_by_the_layer() {
        assert_eq!(num("layer_types[layer] == \"full_attention\""), 1.0);
        assert_eq!(num("layer_types[0] == 'full_attention'"), 0.0);
        assert_eq!(num("if(layer_types[layer] == 'sliding_attention', sliding_window, 0)"), 0.0);
        assert_eq!(num("if(layer_types[2] == 'sliding_attention', sliding_window, 0)"), 4.0);
        assert_eq!(num("rope_parameters[layer_types[layer]].rope_theta"), 1e6);
        assert_eq!(num("rope_parameters['sliding_attention']['rope_theta']"), 1e4);
        assert_eq!(num("no_rope_layers[3]"), 0.0);
        assert_eq!(num("len(layer_types)"), 6.0);
        assert_eq!(num("flag && !(layer < 2) || false"), 1.0);
        assert_eq!(num("nothing == null"), 1.0);
        assert_eq!(num("hidden != null"), 1.0);
    }

    #[test]
    fn if_evaluates_one_branch() {
        // The other branch divides by zero and indexes past the list: never evaluated.
        assert_eq!(num("if(layer >= 5, 1, 1 / 0)"), 1.0);
        assert_eq!(num("if(layer < 5, layer_types[99], 2)"), 2.0);
    }

    #[test]
    fn mistakes_are_named_never_nan() {
        assert!(err("1 / (layer - 5)").contains("divides by zero"), "{}", err("1 / (layer - 5)"));
        assert!(err("layer % 0").contains("divides by zero"));
        assert!(err("no_rope_layers[layer]").contains("index 5 past the end of `no_rope_layers` (4 entries)"));
        assert!(err("rope_parameters['chunked_attention'].rope_theta").contains("no key \"chunked_attention\""));
        assert!(err("layer_types[layer] == 1").contains("compares the string"));
        assert!(err("layer_types[layer] + 1").contains("where a number is needed"));
        assert!(err("if(1, 2, 3)").contains("where a boolean is needed"));
        assert!(err("sqrt(-1)").contains("negative"));
        assert!(err("layer_types[1.5]").contains("whole number"));
        assert!(err("unknown_role").contains("unknown config role `unknown_role`"));
        assert!(err("layer_types").contains("a parameter needs a number"));
        assert!(err("1e308 * 10").contains("not a finite number"));
        assert!(err("'open").contains("not closed"));
        assert!(err("frob(1)").contains("unknown function"));
        assert!(err("if(true, 1)").contains("takes 3 argument"));
        assert!(err("1 < 2 < 3").contains("two values at a time"));
        assert!(err("1 2").contains("after a complete expression"));
    }

    #[test]
    fn hostile_expressions_are_bounded() {
        let deep = format!("{}1{}", "(".repeat(40), ")".repeat(40));
        assert!(err(&deep).contains("nested more than"));
        let negs = format!("{}1", "-".repeat(40));
        assert!(err(&negs).contains("nested more than"));
        let idx = format!("layer_types{}", "[0]".repeat(40));
        assert!(eval_number(&idx, &roles).is_err());
        let long = "1+".repeat(600) + "1";
        assert!(err(&long).contains("at most"));
        // Long flat chains are fine within the byte bound.
        assert_eq!(num(&("1+".repeat(300) + "1")), 301.0);
    }

    #[test]
    fn names_lists_the_roles_read() {
        let e = parse("rope_parameters[layer_types[layer]].rope_theta").unwrap();
        assert_eq!(names(&e), vec!["rope_parameters", "layer_types", "layer"]);
    }
}
