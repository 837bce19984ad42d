//! Key templates: `"order:{order_id}"`, `"user:{req.user.id}"`, `"{{raw}}"`.

/// One piece of a key template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Part {
    /// Text taken as it is.
    Text(String),
    /// `{root.field.field}`: a parameter, then fields, formatted with Display.
    Field { root: String, fields: Vec<String> },
}

/// Splits `template` into parts, or says what is wrong with it.
pub(crate) fn parse(template: &str) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let mut text = String::new();
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                text.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                text.push('}');
            }
            '}' => {
                return Err("unmatched `}` in the key: write `}}` for a literal brace".to_owned())
            }
            '{' => {
                let mut inner = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) => inner.push(c),
                        None => {
                            return Err(
                                "unclosed `{` in the key: close the placeholder, or write `{{` for a literal brace"
                                    .to_owned(),
                            )
                        }
                    }
                }
                if !text.is_empty() {
                    parts.push(Part::Text(std::mem::take(&mut text)));
                }
                parts.push(placeholder(&inner)?);
            }
            c => text.push(c),
        }
    }
    if !text.is_empty() {
        parts.push(Part::Text(text));
    }
    Ok(parts)
}

fn placeholder(inner: &str) -> Result<Part, String> {
    if inner.trim().is_empty() {
        return Err(
            "empty placeholder `{}` in the key: name a parameter, as in `{order_id}`".to_owned(),
        );
    }
    if let Some((name, _)) = inner.split_once(':') {
        return Err(format!(
            "format specs are not supported in key placeholders: `{{{inner}}}`; keys use Display, write `{{{name}}}`"
        ));
    }
    let mut path = inner.split('.');
    let root = path.next().unwrap_or_default().to_owned();
    let fields: Vec<String> = path.map(str::to_owned).collect();
    if !is_ident(&root) {
        return Err(format!(
            "`{{{inner}}}` in the key does not name a parameter: write `{{param}}` or `{{param.field}}`"
        ));
    }
    if let Some(bad) = fields.iter().find(|f| !is_ident(f) && !is_index(f)) {
        return Err(format!("`{bad}` in `{{{inner}}}` is not a field name"));
    }
    Ok(Part::Field { root, fields })
}

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_alphabetic())
        && chars.all(|c| c == '_' || c.is_alphanumeric())
}

fn is_index(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(root: &str, fields: &[&str]) -> Part {
        Part::Field {
            root: root.to_owned(),
            fields: fields.iter().map(|f| (*f).to_owned()).collect(),
        }
    }

    #[test]
    fn splits_text_and_placeholders() {
        assert_eq!(
            parse("order:{order_id}/{req.user.id}:{pair.0}").unwrap(),
            vec![
                Part::Text("order:".into()),
                field("order_id", &[]),
                Part::Text("/".into()),
                field("req", &["user", "id"]),
                Part::Text(":".into()),
                field("pair", &["0"]),
            ]
        );
        assert_eq!(parse("plain").unwrap(), vec![Part::Text("plain".into())]);
        assert_eq!(parse("{self.id}").unwrap(), vec![field("self", &["id"])]);
    }

    #[test]
    fn doubled_braces_are_literal() {
        assert_eq!(
            parse("{{a}}:{b}").unwrap(),
            vec![Part::Text("{a}:".into()), field("b", &[])]
        );
    }

    #[test]
    fn malformed_templates_say_what_to_write() {
        for (bad, says) in [
            ("a{b", "unclosed `{`"),
            ("a}b", "unmatched `}`"),
            ("{}", "empty placeholder"),
            ("{id:?}", "write `{id}`"),
            ("{1x}", "does not name a parameter"),
            ("{a.}", "is not a field name"),
            ("{a b}", "does not name a parameter"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
