//! Code generation: wraps the fn body so it runs under the lock.

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{quote, quote_spanned, ToTokens};
use syn::{
    parse::{Parse, ParseStream, Parser},
    spanned::Spanned,
    AttrStyle, FnArg, Ident, ItemFn, LitStr, Member, Pat, ReturnType,
};

use crate::{
    args::{Args, Wait},
    template::{self, Part},
};

/// The whole expansion. On any error, the function is still emitted (with
/// the errors beside it), so that IDEs and later diagnostics keep working.
pub(crate) fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(e) => match fn_without_body(item.clone()) {
            // A fn whose body does not parse: syn's own message points at
            // the mistake inside the body; the fn is emitted without it, so
            // the mistake is reported once and callers still resolve.
            Some(stub) => {
                let e = e.to_compile_error();
                return quote! { #e #stub };
            }
            None => {
                let e = syn::Error::new(
                    e.span(),
                    "#[distributed_lock] goes on an `async fn` with a body",
                );
                return with_item(e, item);
            }
        },
    };
    let parse_args = |input: ParseStream<'_>| {
        let args = Args::parse(input)?;
        // Whatever follows a malformed argument was reported with it.
        input.parse::<TokenStream>()?;
        Ok(args)
    };
    let args = match parse_args.parse2(args) {
        Ok(args) => args,
        Err(e) => return with_func(e, func),
    };
    match expand(args, func.clone()) {
        Ok(tokens) => tokens,
        Err(e) => with_func(e, func),
    }
}

/// If `item` is a fn (attributes, visibility, signature) followed by a
/// `{ ... }` body, whatever the body holds: that fn with a body that only
/// panics.
fn fn_without_body(item: TokenStream) -> Option<TokenStream> {
    let parser = |input: ParseStream<'_>| {
        let attrs = input.call(syn::Attribute::parse_outer)?;
        let vis = input.parse::<syn::Visibility>()?;
        let sig = input.parse::<syn::Signature>()?;
        let body = input.parse::<proc_macro2::Group>()?;
        let is_fn = body.delimiter() == proc_macro2::Delimiter::Brace && input.is_empty();
        Ok(is_fn.then(|| {
            quote! {
                #(#attrs)*
                #[allow(unused_variables, unreachable_code)]
                #vis #sig { ::core::panic!("this fn's body did not compile") }
            }
        }))
    };
    parser.parse2(item).ok().flatten()
}

fn with_item(error: syn::Error, item: TokenStream) -> TokenStream {
    let error = error.to_compile_error();
    quote! { #error #item }
}

/// The errors, and the fn as written. Parameters used only in the key look
/// unused in it, which would add a warning to every error; allow that.
fn with_func(error: syn::Error, func: ItemFn) -> TokenStream {
    let error = error.to_compile_error();
    quote! {
        #error
        #[allow(unused_variables)]
        #func
    }
}

fn expand(mut args: Args, func: ItemFn) -> syn::Result<TokenStream> {
    let mut errors = args.errors.take();
    let mut report = |e: syn::Error| match &mut errors {
        Some(all) => all.combine(e),
        None => errors = Some(e),
    };
    if func.sig.asyncness.is_none() {
        report(syn::Error::new(
            func.sig.fn_token.span(),
            "#[distributed_lock] goes on `async fn`s: the lock is taken with `.await`; write `async fn`",
        ));
    }
    if let ReturnType::Default = func.sig.output {
        // Other return types are checked by the compiler, through the
        // `FromLockError` bound, whose message says the same.
        report(syn::Error::new(
            func.sig.paren_token.span.close(),
            "#[distributed_lock] needs the fn to return `Result<T, E>` with `E: From<dlock_core::LockError>`, \
             because taking the lock can fail; write `-> Result<(), E>`",
        ));
    }
    let several = args.keys.is_some();
    let key = match args.keys().and_then(|lits| {
        lits.into_iter()
            .map(|lit| key_expr(lit, &func))
            .collect::<syn::Result<Vec<_>>>()
    }) {
        Ok(keys) if several => Some(quote!(::std::vec![#(#keys),*])),
        Ok(mut keys) => keys.pop(),
        Err(e) => {
            report(e);
            None
        }
    };
    if let Some(errors) = errors {
        return Err(errors);
    }
    let key = key.unwrap_or_default();

    let default_crate = default_crate();
    let krate = |span: Span| match &args.krate {
        Some(path) => path.to_token_stream(),
        None => quote_spanned!(span=> ::#default_crate),
    };
    let private = {
        let krate = krate(Span::call_site());
        quote!(#krate::__private)
    };
    let locker = match &args.locker {
        // A method call, so that auto-deref accepts `Locker`, `&Locker`,
        // `Arc<Locker>`, `&Arc<Locker>`, ...
        Some(expr) => quote! {
            ::core::result::Result::Ok({
                use #private::AsLocker as _;
                (#expr).__dlock_as_locker()
            })
        },
        None => quote! { #private::default_locker() },
    };
    let mut options = quote!(#private::LockOptions::new());
    let mut once = false;
    match args.wait {
        Some(Wait::None) => once = true,
        Some(Wait::Forever) => options.extend(quote!(.wait_forever())),
        Some(Wait::Millis(ms)) => {
            options.extend(quote!(.wait(#private::Duration::from_millis(#ms))))
        }
        None => {}
    }
    if let Some(ms) = args.lease {
        options.extend(quote!(.lease(#private::Duration::from_millis(#ms))));
    }
    if let Some(ms) = args.hold_at_least {
        options.extend(quote!(.hold_at_least(#private::Duration::from_millis(#ms))));
    }
    if let Some(ms) = args.lock_delay {
        options.extend(quote!(.lock_delay(#private::Duration::from_millis(#ms))));
    }
    if let Some(fair) = args.fair {
        options.extend(quote!(.fair(#fair)));
    }

    // Local names the body cannot see or shadow.
    let guard = Ident::new("__dlock_guard", Span::mixed_site());
    let error = Ident::new("__dlock_error", Span::mixed_site());
    let output_span = match &func.sig.output {
        ReturnType::Type(_, ty) => ty.span(),
        ReturnType::Default => func.sig.span(),
    };
    // Spanned at the return type, so that a return type that cannot carry
    // a `LockError` is reported there.
    let convert = {
        let krate = krate(output_span);
        quote_spanned! {output_span=> #krate::__private::lock_error(#error) }
    };
    let acquire_fn = if several {
        quote!(acquire_all)
    } else {
        quote!(acquire)
    };
    let acquire = quote! {
        let #guard = match #private::#acquire_fn(#locker, #key, #options, #once).await {
            ::core::result::Result::Ok(guard) => guard,
            ::core::result::Result::Err(#error) => return #convert,
        };
    };

    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = func;
    // Inner attributes (`#![allow(..)]` at the top of the body) stay at the
    // top of the body.
    let (inner, outer): (Vec<_>, Vec<_>) = attrs
        .into_iter()
        .partition(|a| matches!(a.style, AttrStyle::Inner(_)));
    let stmts = &block.stmts;
    let body = Ident::new("__dlock_body", Span::mixed_site());
    // A `return` of the declared type first fixes the async block's output
    // type, so the body's values coerce (and its `?`s convert) as they would
    // in the fn. `impl Trait` cannot be written there; inference does without.
    let typed = match &sig.output {
        ReturnType::Type(_, ty) if !mentions_impl(ty) => {
            let fake = Ident::new("__dlock_fake_return", Span::mixed_site());
            quote! {
                #[allow(
                    unreachable_code,
                    clippy::diverging_sub_expression,
                    clippy::empty_loop,
                    clippy::let_unit_value,
                    clippy::needless_return
                )]
                if false {
                    let #fake: #ty = loop {};
                    return #fake;
                }
            }
        }
        _ => quote!(),
    };
    // The body sees the guard by the name it asked for, as `&LockGuard`.
    let named_guard = args
        .guard
        .as_ref()
        .map(|name| quote! { let #name = &#guard; });
    // The body runs inside the lock's scope: locks of the same key through
    // the same locker, at any depth in it, re-enter.
    let scoped = quote! { #private::scoped(&#guard, #body) };
    let run = if args.abort_on_lost {
        quote! { #private::run_until_lost(&#guard, #scoped).await }
    } else {
        quote! { #private::run_then_check(&#guard, #scoped).await }
    };
    let body = quote! {
        #acquire
        #named_guard
        let #body = async move {
            #typed
            #(#stmts)*
        };
        #run
    };
    Ok(quote! {
        #(#outer)*
        #vis #sig {
            #(#inner)*
            #body
        }
    })
}

/// Whether `ty` contains `impl Trait`, which a `let` cannot name.
fn mentions_impl(ty: &syn::Type) -> bool {
    fn walk(tokens: TokenStream) -> bool {
        tokens.into_iter().any(|t| match t {
            TokenTree::Ident(i) => i == "impl",
            TokenTree::Group(g) => walk(g.stream()),
            _ => false,
        })
    }
    walk(ty.to_token_stream())
}

/// The expression that builds the key: a `String` from the template, with
/// each placeholder checked against the fn's parameters.
fn key_expr(lit: &LitStr, func: &ItemFn) -> syn::Result<TokenStream> {
    let span = lit.span();
    let parts = template::parse(&lit.value()).map_err(|e| syn::Error::new(span, e))?;
    let params = param_names(func);
    let mut format = String::new();
    let mut values = Vec::new();
    for part in parts {
        match part {
            Part::Text(text) => format.push_str(&text.replace('{', "{{").replace('}', "}}")),
            Part::Field { root, fields } => {
                let written = std::iter::once(root.as_str())
                    .chain(fields.iter().map(String::as_str))
                    .collect::<Vec<_>>()
                    .join(".");
                if !params.contains(&root) {
                    let known = if params.is_empty() {
                        "it has no named parameters".to_owned()
                    } else {
                        let names: Vec<String> = params.iter().map(|p| format!("`{p}`")).collect();
                        format!("its parameters are {}", names.join(", "))
                    };
                    return Err(syn::Error::new(
                        span,
                        format!(
                            "`{{{written}}}` in the key names no parameter of `{}`; {known}",
                            func.sig.ident
                        ),
                    ));
                }
                let root = if root == "self" {
                    quote_spanned!(span=> self)
                } else {
                    Ident::new(&root, span).to_token_stream()
                };
                let fields = fields
                    .iter()
                    .map(|field| field_tokens(field, span, &written))
                    .collect::<syn::Result<Vec<_>>>()?;
                format.push_str("{}");
                values.push(quote_spanned! {span=> &(#root #(.#fields)*) });
            }
        }
    }
    Ok(if values.is_empty() {
        // No placeholders: the text, with `{{` and `}}` already undone.
        let text = LitStr::new(&format.replace("{{", "{").replace("}}", "}"), span);
        quote! { ::std::string::String::from(#text) }
    } else {
        let format = LitStr::new(&format, span);
        quote! { ::std::format!(#format, #(#values),*) }
    })
}

/// One `.field` or `.0` of a placeholder, spanned at the key.
fn field_tokens(field: &str, span: Span, written: &str) -> syn::Result<TokenStream> {
    let member = syn::parse_str::<Member>(field).map_err(|_| {
        syn::Error::new(
            span,
            format!("`{field}` in `{{{written}}}` is not a field name or tuple index"),
        )
    })?;
    Ok(match member {
        Member::Named(mut ident) => {
            ident.set_span(span);
            ident.to_token_stream()
        }
        Member::Unnamed(mut index) => {
            index.span = span;
            index.to_token_stream()
        }
    })
}

/// The names a key placeholder can refer to: `self`, and every name a
/// parameter's pattern binds (`id`, `mut id`, `(a, b)`, `Point { x, y }`).
fn param_names(func: &ItemFn) -> Vec<String> {
    let mut names = Vec::new();
    for input in &func.sig.inputs {
        match input {
            FnArg::Receiver(_) => names.push("self".to_owned()),
            FnArg::Typed(typed) => bound_names(&typed.pat, &mut names),
        }
    }
    names
}

fn bound_names(pat: &Pat, names: &mut Vec<String>) {
    match pat {
        Pat::Ident(p) => {
            names.push(p.ident.to_string());
            if let Some((_, sub)) = &p.subpat {
                bound_names(sub, names);
            }
        }
        Pat::Tuple(p) => p.elems.iter().for_each(|p| bound_names(p, names)),
        Pat::TupleStruct(p) => p.elems.iter().for_each(|p| bound_names(p, names)),
        Pat::Struct(p) => p.fields.iter().for_each(|f| bound_names(&f.pat, names)),
        Pat::Slice(p) => p.elems.iter().for_each(|p| bound_names(p, names)),
        Pat::Reference(p) => bound_names(&p.pat, names),
        Pat::Type(p) => bound_names(&p.pat, names),
        Pat::Paren(p) => bound_names(&p.pat, names),
        _ => {}
    }
}

/// Where the runtime is when `crate = ...` does not say: `dlock` (which
/// re-exports `dlock_core`) if the calling crate depends on it, under
/// whatever name; else `dlock_core`, under whatever name it has there.
fn default_crate() -> syn::Ident {
    use proc_macro_crate::{crate_name, FoundCrate};
    let found = |package| match crate_name(package) {
        Ok(FoundCrate::Name(name)) => Some(name),
        // A package's own tests and doctests link it by its name.
        Ok(FoundCrate::Itself) => Some(package.replace('-', "_")),
        Err(_) => None,
    };
    let name = found("dlock")
        .or_else(|| found("dlock-core"))
        .unwrap_or_else(|| "dlock_core".to_owned());
    syn::Ident::new(&name, Span::call_site())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_impl_trait_anywhere_in_a_type() {
        let ty = |s: &str| syn::parse_str::<syn::Type>(s).unwrap();
        assert!(mentions_impl(&ty("Result<impl Display, E>")));
        assert!(mentions_impl(&ty("Result<(u8, impl Display), E>")));
        assert!(!mentions_impl(&ty("Result<Box<dyn Display>, E>")));
        assert!(!mentions_impl(&ty("Result<Implementation, E>")));
    }

    #[test]
    fn lease_bounds_match_dlock_core() {
        use crate::args::{MAX_LEASE_MILLIS, MAX_LOCK_DELAY_MILLIS, MIN_LEASE_MILLIS};
        assert_eq!(
            u128::from(MIN_LEASE_MILLIS),
            dlock_core::MIN_LEASE.as_millis()
        );
        assert_eq!(
            u128::from(MAX_LEASE_MILLIS),
            dlock_core::MAX_LEASE.as_millis()
        );
        assert_eq!(
            u128::from(MAX_LOCK_DELAY_MILLIS),
            dlock_core::MAX_LOCK_DELAY.as_millis()
        );
    }
}
