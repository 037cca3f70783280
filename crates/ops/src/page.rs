//! Pages of list results that fit the output bound: clients hand the model a tool's structured
//! content whole (Claude Code and Codex do), so every list a tool returns is cut to what fits in
//! `--max-output` characters of JSON, and continues from a keyset cursor (the key of the last item
//! returned), which stays valid while new items arrive.

use serde::Serialize;

/// Characters of JSON one value serialises to.
pub fn json_len<T: Serialize>(v: &T) -> usize {
    serde_json::to_string(v).map(|s| s.chars().count()).unwrap_or(0)
}

/// The longest prefix of `items` whose JSON fits in `budget` characters (at least one item, so a
/// page always makes progress), and whether items were left out.
pub fn fit<T: Serialize>(mut items: Vec<T>, budget: usize) -> (Vec<T>, bool) {
    let mut used = 2;
    let mut keep = 0;
    for it in &items {
        let n = json_len(it) + 1;
        if keep > 0 && used + n > budget {
            break;
        }
        used += n;
        keep += 1;
    }
    let cut = keep < items.len();
    items.truncate(keep);
    (items, cut)
}

/// Items after the keyset `cursor` (the key of the last item of the previous page), in order.
///
/// # Errors
/// A cursor that names no item (the list changed under it, or it was mistyped): the message says
/// to start again without a cursor.
pub fn after<T>(items: Vec<T>, cursor: Option<&str>, key: impl Fn(&T) -> String) -> base::error::Result<Vec<T>> {
    let Some(c) = cursor else { return Ok(items) };
    let pos = items.iter().position(|i| key(i) == c).ok_or_else(|| {
        base::error::Error::usage(format!(
            "cursor `{c}` names no item of this list any more; call again without a cursor"
        ))
    })?;
    Ok(items.into_iter().skip(pos + 1).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_fit_the_budget_and_always_make_progress() {
        let items: Vec<String> = (0..100).map(|i| format!("item-{i:03}")).collect();
        let (page, cut) = fit(items.clone(), 60);
        assert!(cut && json_len(&page) <= 60, "{page:?}");
        assert_eq!(page.len(), 5); // 2 + 5 * 11 = 57
        let (one, cut) = fit(vec!["x".repeat(100)], 10);
        assert_eq!((one.len(), cut), (1, false));
        let rest = after(items, Some("item-004"), |s| s.clone()).unwrap();
        assert_eq!(rest[0], "item-005");
        assert!(
            after(vec!["a".to_string()], Some("zz"), |s| s.clone()).unwrap_err().message.contains("without a cursor")
        );
    }
}
