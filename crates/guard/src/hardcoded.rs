//! Rule `hardcoded-output`: an engine that carries its answers instead of computing them. Flags
//! long literal integer arrays (token ids) and long prose string literals (generated text) in Rust
//! sources. verify_generation's random prompts make such code fail anyway; this names it early.

use super::{Finding, Tree, line_of};

/// Integer literals in one array literal from which it is flagged as a token-id table.
pub const MAX_INT_ARRAY: usize = 32;
/// Characters of a prose string literal from which it is flagged (words separated by spaces).
pub const MAX_PROSE: usize = 80;

/// Lengths of runs of comma-separated integer literals inside `[...]`, with their start byte.
fn int_arrays(text: &str) -> Vec<(usize, usize)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'[' {
            i += 1;
            continue;
        }
        let start = i;
        let mut j = i + 1;
        let mut count = 0;
        loop {
            while j < bytes.len() && (bytes[j] as char).is_whitespace() {
                j += 1;
            }
            let num_start = j;
            while j < bytes.len() && (bytes[j].is_ascii_digit() || bytes[j] == b'_') {
                j += 1;
            }
            if j == num_start {
                break;
            }
            // Integer suffixes such as u32.
            while j < bytes.len() && bytes[j].is_ascii_alphanumeric() {
                j += 1;
            }
            count += 1;
            while j < bytes.len() && (bytes[j] as char).is_whitespace() {
                j += 1;
            }
            if j < bytes.len() && bytes[j] == b',' {
                j += 1;
            } else {
                break;
            }
        }
        if count > 0 {
            out.push((start, count));
        }
        i = start + 1;
    }
    out
}

/// Check sources for carried answers.
pub fn check(tree: &Tree) -> Vec<Finding> {
    let mut out = Vec::new();
    for f in tree.files.iter().filter(|f| f.rust) {
        for (at, n) in int_arrays(&f.text) {
            if n >= MAX_INT_ARRAY {
                out.push(Finding::blocking(
                    "hardcoded-output",
                    &f.rel,
                    line_of(&f.text, at),
                    format!("array literal of {n} integers (a token-id table?); engines compute their outputs, they do not carry them"),
                ));
            }
        }
        let mut rest = 0;
        while let Some(i) = f.text[rest..].find('"') {
            let start = rest + i + 1;
            let Some(len) = f.text[start..].find('"') else { break };
            let lit = &f.text[start..start + len];
            rest = start + len + 1;
            let words = lit.split(' ').filter(|w| !w.is_empty()).count();
            // Format strings (with `{`) are messages, not carried output.
            if lit.chars().count() >= MAX_PROSE
                && words >= 12
                && !lit.contains('{')
                && lit.chars().all(|c| !c.is_control() || c == '\n')
            {
                out.push(Finding::warning(
                    "hardcoded-output",
                    &f.rel,
                    line_of(&f.text, start),
                    format!(
                        "prose string literal of {} characters; if it is expected output, remove it",
                        lit.chars().count()
                    ),
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_integer_arrays() {
        let ids: Vec<String> = (0..40).map(|i| i.to_string()).collect();
        let text = format!("let a = [1, 2];\nconst IDS: [u32; 40] = [{}];", ids.join(", "));
        let arrays = int_arrays(&text);
        assert_eq!(arrays.iter().map(|a| a.1).collect::<Vec<_>>(), vec![2, 40]);
        assert_eq!(int_arrays("x[i] + y[0]").iter().map(|a| a.1).collect::<Vec<_>>(), vec![1]);
    }
}
