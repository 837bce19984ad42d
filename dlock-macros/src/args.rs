//! Parsing `#[distributed_lock(...)]`'s arguments into `Args`.

use proc_macro2::Span;
use syn::{
    ext::IdentExt,
    parse::{Parse, ParseStream},
    Expr, ExprLit, Ident, Lit, LitStr, Path, Token,
};

use crate::duration::parse_millis;

const EXPECTED: &str =
    "`key`, `keys`, `locker`, `wait`, `lease`, `hold_at_least`, `lock_delay`, `fair`, `guard`, `abort_on_lost`, `crate`";

/// The shortest and longest fixed lease dlock-core accepts
/// (`dlock_core::MIN_LEASE`, `MAX_LEASE`; a test keeps them equal), checked
/// here so that the mistake is a compile error.
pub(crate) const MIN_LEASE_MILLIS: u64 = 10;
pub(crate) const MAX_LEASE_MILLIS: u64 = 30 * 24 * 3_600_000;
/// The longest lock delay (`dlock_core::MAX_LOCK_DELAY`).
pub(crate) const MAX_LOCK_DELAY_MILLIS: u64 = 60_000;

/// How long to wait for the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// One attempt, then `LockError::WouldBlock`.
    None,
    /// No limit.
    Forever,
    /// At most this many milliseconds.
    Millis(u64),
}

/// The parsed arguments, and the mistakes found in them: parsing goes on
/// past a bad argument, so that every mistake is reported at once.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) key: Option<LitStr>,
    /// `keys = ["a:{x}", "b:{y}"]`: several keys, taken all or none.
    pub(crate) keys: Option<Vec<LitStr>>,
    pub(crate) locker: Option<Expr>,
    pub(crate) wait: Option<Wait>,
    pub(crate) lease: Option<u64>,
    /// `hold_at_least = "5m"`, in milliseconds.
    pub(crate) hold_at_least: Option<u64>,
    /// `lock_delay = "15s"`, in milliseconds.
    pub(crate) lock_delay: Option<u64>,
    /// `fair = false`.
    pub(crate) fair: Option<bool>,
    /// The name the body sees the lock's guard by (`&LockGuard`).
    pub(crate) guard: Option<Ident>,
    pub(crate) abort_on_lost: bool,
    pub(crate) krate: Option<Path>,
    pub(crate) errors: Option<syn::Error>,
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        let mut seen: Vec<String> = Vec::new();
        while !input.is_empty() {
            // `crate` is a keyword; accept it as a name like the others.
            let name = input.call(Ident::parse_any)?;
            let text = name.to_string();
            let set = if seen.contains(&text) {
                skip_value(input).and(Err(syn::Error::new(
                    name.span(),
                    format!("duplicate argument `{text}`: give each argument once (the arguments are {EXPECTED})"),
                )))
            } else {
                args.set(&name, input)
            };
            if let Err(e) = set {
                args.report(e);
            }
            seen.push(text);
            if input.is_empty() {
                break;
            }
            if let Err(e) = input.parse::<Token![,]>() {
                // Past a malformed argument nothing more can be read safely.
                args.report(e);
                break;
            }
        }
        if let (Some(lease), Some(at_least)) = (args.lease, args.hold_at_least) {
            if at_least > lease {
                args.report(syn::Error::new(
                    Span::call_site(),
                    "`hold_at_least` is longer than the fixed `lease`: the lock would expire first",
                ));
            }
        }
        Ok(args)
    }
}

impl Args {
    fn report(&mut self, e: syn::Error) {
        match &mut self.errors {
            Some(all) => all.combine(e),
            None => self.errors = Some(e),
        }
    }

    /// Reads the value of argument `name`.
    fn set(&mut self, name: &Ident, input: ParseStream<'_>) -> syn::Result<()> {
        match name.to_string().as_str() {
            "key" => {
                let lit = string_value(input, name, "key = \"order:{order_id}\"")?;
                let empty = lit.value().is_empty().then(|| lit.span());
                self.key = Some(lit);
                if let Some(span) = empty {
                    return Err(syn::Error::new(span, "the key must not be empty"));
                }
            }
            "keys" => {
                // Given, even if malformed: no "missing key" besides its error.
                self.keys = Some(Vec::new());
                let example = "keys = [\"account:{from}\", \"account:{to}\"]";
                equals(input, name, example)?;
                let list = match input.parse::<Expr>()? {
                    Expr::Array(array) => array,
                    other => {
                        return Err(syn::Error::new_spanned(
                            other,
                            format!("`keys` takes a list of string literals: write `{example}`"),
                        ))
                    }
                };
                let mut keys = Vec::new();
                for element in &list.elems {
                    match element {
                        Expr::Lit(ExprLit {
                            lit: Lit::Str(s), ..
                        }) if !s.value().is_empty() => keys.push(s.clone()),
                        other => {
                            return Err(syn::Error::new_spanned(
                                other,
                                format!(
                                "each of `keys` is a non-empty string literal: write `{example}`"
                            ),
                            ))
                        }
                    }
                }
                if keys.is_empty() {
                    return Err(syn::Error::new_spanned(
                        list,
                        format!("`keys` needs at least one key: write `{example}`"),
                    ));
                }
                self.keys = Some(keys);
            }
            "locker" => {
                equals(input, name, "locker = self.locker")?;
                self.locker = Some(input.parse()?);
            }
            "wait" => {
                let lit = string_value(input, name, "wait = \"5s\"")?;
                self.wait = Some(match lit.value().as_str() {
                    "none" => Wait::None,
                    "forever" => Wait::Forever,
                    text => Wait::Millis(parse_millis(text).map_err(|e| {
                        syn::Error::new(lit.span(), format!("{e}, or \"none\" or \"forever\""))
                    })?),
                });
            }
            "lease" => {
                let watchdog = "leave `lease` out to keep the lock alive with the watchdog";
                let lease = duration_value(input, name, "lease = \"30s\"")?
                    .at_least(
                        MIN_LEASE_MILLIS,
                        &format!("a lease must be at least {MIN_LEASE_MILLIS}ms; {watchdog}"),
                    )?
                    .at_most(
                        MAX_LEASE_MILLIS,
                        &format!("a lease must be at most 30 days (\"720h\"); {watchdog}"),
                    )?;
                self.lease = Some(lease.0);
            }
            "hold_at_least" => {
                let at_least = duration_value(input, name, "hold_at_least = \"5m\"")?.at_most(
                    MAX_LEASE_MILLIS,
                    "`hold_at_least` must be at most 30 days (\"720h\")",
                )?;
                self.hold_at_least = Some(at_least.0);
            }
            "lock_delay" => {
                let delay = duration_value(input, name, "lock_delay = \"15s\"")?.at_most(
                    MAX_LOCK_DELAY_MILLIS,
                    "`lock_delay` must be at most a minute (\"1m\")",
                )?;
                self.lock_delay = Some(delay.0);
            }
            "fair" => {
                equals(input, name, "fair = false")?;
                let fair = input.parse::<syn::LitBool>().map_err(|e| {
                    syn::Error::new(
                        e.span(),
                        "`fair` takes `true` or `false`: write `fair = false`",
                    )
                })?;
                self.fair = Some(fair.value);
            }
            "guard" => {
                equals(input, name, "guard = lock")?;
                let value = input.parse::<Expr>()?;
                let ident = match &value {
                    Expr::Path(path) if path.attrs.is_empty() && path.qself.is_none() => {
                        path.path.get_ident().filter(|i| *i != "self").cloned()
                    }
                    _ => None,
                };
                match ident {
                    Some(ident) => self.guard = Some(ident),
                    None => {
                        return Err(syn::Error::new_spanned(
                            value,
                            "`guard` takes the name the body reads the lock's guard by: write `guard = lock`",
                        ))
                    }
                }
            }
            "abort_on_lost" => {
                if input.peek(Token![=]) {
                    skip_value(input)?;
                    return Err(syn::Error::new(
                        name.span(),
                        "`abort_on_lost` is a flag and takes no value: write `abort_on_lost`",
                    ));
                }
                self.abort_on_lost = true;
            }
            "crate" => {
                let lit = string_value(input, name, "crate = \"my_reexport::dlock_core\"")?;
                self.krate = Some(lit.parse().map_err(|_| {
                    syn::Error::new(
                        lit.span(),
                        "`crate` takes the path dlock_core is reachable at, such as \"my_reexport::dlock_core\"",
                    )
                })?);
            }
            other => {
                skip_value(input)?;
                return Err(syn::Error::new(
                    name.span(),
                    format!("unknown argument `{other}`; expected one of {EXPECTED}"),
                ));
            }
        }
        Ok(())
    }

    /// The key templates: one for `key`, several for `keys`; or an error
    /// that says how to give them.
    pub(crate) fn keys(&self) -> syn::Result<Vec<&LitStr>> {
        match (&self.key, &self.keys) {
            (Some(key), None) => Ok(vec![key]),
            (None, Some(keys)) => Ok(keys.iter().collect()),
            (Some(key), Some(_)) => Err(syn::Error::new(
                key.span(),
                "give `key` for one lock or `keys` for several, not both",
            )),
            (None, None) => Err(syn::Error::new(
                Span::call_site(),
                "missing `key`: write `#[distributed_lock(key = \"order:{order_id}\")]` \
                 (or `keys = [\"a:{x}\", \"b:{y}\"]` for several)",
            )),
        }
    }
}

/// Skips `= <expr>` after a name that is in error, to go on parsing.
fn skip_value(input: ParseStream<'_>) -> syn::Result<()> {
    if input.peek(Token![=]) {
        input.parse::<Token![=]>()?;
        input.parse::<Expr>()?;
    }
    Ok(())
}

fn equals(input: ParseStream<'_>, name: &Ident, example: &str) -> syn::Result<()> {
    if input.peek(Token![=]) {
        input.parse::<Token![=]>()?;
        Ok(())
    } else {
        Err(syn::Error::new(
            name.span(),
            format!("`{name}` needs a value: write `{example}`"),
        ))
    }
}

/// A duration argument's value in milliseconds, with its literal for
/// errors that point at it.
struct Millis(u64, LitStr);

impl Millis {
    /// The value, or an error at the literal below `min`.
    fn at_least(self, min: u64, why: &str) -> syn::Result<Millis> {
        if self.0 < min {
            return Err(syn::Error::new(self.1.span(), why));
        }
        Ok(self)
    }

    /// The value, or an error at the literal past `max`.
    fn at_most(self, max: u64, why: &str) -> syn::Result<Millis> {
        if self.0 > max {
            return Err(syn::Error::new(self.1.span(), why));
        }
        Ok(self)
    }
}

fn duration_value(input: ParseStream<'_>, name: &Ident, example: &str) -> syn::Result<Millis> {
    let lit = string_value(input, name, example)?;
    let millis = parse_millis(&lit.value()).map_err(|e| syn::Error::new(lit.span(), e))?;
    Ok(Millis(millis, lit))
}

fn string_value(input: ParseStream<'_>, name: &Ident, example: &str) -> syn::Result<LitStr> {
    equals(input, name, example)?;
    match input.parse::<Expr>()? {
        Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) => Ok(s),
        other => Err(syn::Error::new_spanned(
            other,
            format!("`{name}` takes a string literal: write `{example}`"),
        )),
    }
}
