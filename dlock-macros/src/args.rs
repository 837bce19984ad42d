//! Parsing `#[distributed_lock(...)]`'s arguments into `Args`.

use proc_macro2::Span;
use syn::{
    ext::IdentExt,
    parse::{Parse, ParseStream},
    Expr, ExprLit, Ident, Lit, LitStr, Path, Token,
};

use crate::duration::parse_millis;

const EXPECTED: &str = "`key`, `locker`, `wait`, `lease`, `abort_on_lost`, `crate`";

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

/// The parsed arguments.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) key: Option<LitStr>,
    pub(crate) locker: Option<Expr>,
    pub(crate) wait: Option<Wait>,
    pub(crate) lease: Option<u64>,
    pub(crate) abort_on_lost: bool,
    pub(crate) krate: Option<Path>,
}

/// The shortest fixed lease dlock-core accepts, checked here so that the
/// mistake is a compile error.
const MIN_LEASE_MILLIS: u64 = 10;

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        let mut seen: Vec<String> = Vec::new();
        while !input.is_empty() {
            // `crate` is a keyword; accept it as a name like the others.
            let name = input.call(Ident::parse_any)?;
            let text = name.to_string();
            if seen.contains(&text) {
                return Err(syn::Error::new(
                    name.span(),
                    format!("duplicate argument `{text}`: give each argument once"),
                ));
            }
            match text.as_str() {
                "key" => args.key = Some(string_value(input, &name, "key = \"order:{order_id}\"")?),
                "locker" => {
                    equals(input, &name, "locker = self.locker")?;
                    args.locker = Some(input.parse()?);
                }
                "wait" => {
                    let lit = string_value(input, &name, "wait = \"5s\"")?;
                    args.wait = Some(match lit.value().as_str() {
                        "none" => Wait::None,
                        "forever" => Wait::Forever,
                        text => Wait::Millis(parse_millis(text).map_err(|e| {
                            syn::Error::new(lit.span(), format!("{e}, or \"none\" or \"forever\""))
                        })?),
                    });
                }
                "lease" => {
                    let lit = string_value(input, &name, "lease = \"30s\"")?;
                    let millis =
                        parse_millis(&lit.value()).map_err(|e| syn::Error::new(lit.span(), e))?;
                    if millis < MIN_LEASE_MILLIS {
                        return Err(syn::Error::new(
                            lit.span(),
                            format!("a lease must be at least {MIN_LEASE_MILLIS}ms; leave `lease` out to keep the lock alive with the watchdog"),
                        ));
                    }
                    args.lease = Some(millis);
                }
                "abort_on_lost" => {
                    if input.peek(Token![=]) {
                        return Err(syn::Error::new(
                            name.span(),
                            "`abort_on_lost` is a flag and takes no value: write `abort_on_lost`",
                        ));
                    }
                    args.abort_on_lost = true;
                }
                "crate" => {
                    let lit = string_value(input, &name, "crate = \"my_reexport::dlock_core\"")?;
                    args.krate = Some(lit.parse().map_err(|_| {
                        syn::Error::new(lit.span(), "`crate` takes the path dlock_core is reachable at, such as \"my_reexport::dlock_core\"")
                    })?);
                }
                _ => {
                    return Err(syn::Error::new(
                        name.span(),
                        format!("unknown argument `{text}`; expected one of {EXPECTED}"),
                    ))
                }
            }
            seen.push(text);
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        Ok(args)
    }
}

impl Args {
    /// The key, or an error that says how to give one.
    pub(crate) fn key(&self) -> syn::Result<&LitStr> {
        self.key.as_ref().ok_or_else(|| {
            syn::Error::new(
                Span::call_site(),
                "missing `key`: write `#[distributed_lock(key = \"order:{order_id}\")]`",
            )
        })
    }
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
