//! Code generation: wraps the fn body so it runs under the lock.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use syn::{spanned::Spanned, FnArg, Ident, ItemFn, LitStr, Pat, ReturnType, Type};

use crate::{
    args::{Args, Wait},
    template::{self, Part},
};

/// The whole expansion. On any error, the function is still emitted (with
/// the errors beside it), so that IDEs and later diagnostics keep working.
pub(crate) fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(e) => {
            let e = syn::Error::new(
                e.span(),
                "#[distributed_lock] goes on an `async fn` with a body",
            );
            return with_item(e, item);
        }
    };
    let args = match syn::parse2::<Args>(args) {
        Ok(args) => args,
        Err(e) => return with_item(e, item),
    };
    match expand(&args, func) {
        Ok(tokens) => tokens,
        Err(e) => with_item(e, item),
    }
}

fn with_item(error: syn::Error, item: TokenStream) -> TokenStream {
    let error = error.to_compile_error();
    quote! { #error #item }
}

fn expand(args: &Args, func: ItemFn) -> syn::Result<TokenStream> {
    let mut errors: Option<syn::Error> = None;
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
    if let Err(e) = check_returns_result(&func) {
        report(e);
    }
    let key = match args.key().and_then(|lit| key_expr(lit, &func)) {
        Ok(key) => Some(key),
        Err(e) => {
            report(e);
            None
        }
    };
    if let Some(errors) = errors {
        return Err(errors);
    }
    let key = key.unwrap_or_default();

    let krate = |span: Span| match &args.krate {
        Some(path) => path.to_token_stream(),
        None => quote_spanned!(span=> ::dlock_core),
    };
    let private = {
        let krate = krate(Span::call_site());
        quote!(#krate::__private)
    };
    let locker = match &args.locker {
        Some(expr) => quote! { ::core::result::Result::Ok(#private::as_locker(&(#expr))) },
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

    // Local names the body cannot see or shadow.
    let guard = Ident::new("__dlock_guard", Span::mixed_site());
    let error = Ident::new("__dlock_error", Span::mixed_site());
    let output_span = match &func.sig.output {
        ReturnType::Type(_, ty) => ty.span(),
        ReturnType::Default => func.sig.span(),
    };
    // Spanned at the return type, so a missing `From<LockError>` points there.
    let convert = {
        let krate = krate(output_span);
        quote_spanned! {output_span=> #krate::__private::lock_error(#error) }
    };
    let acquire = quote! {
        let #guard = match #private::acquire(#locker, #key, #options, #once).await {
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
    let body = if args.abort_on_lost {
        let body = Ident::new("__dlock_body", Span::mixed_site());
        quote! {
            #acquire
            let #body = async move #block;
            #private::run_until_lost(&#guard, #body).await
        }
    } else {
        let stmts = &block.stmts;
        quote! {
            #acquire
            #(#stmts)*
        }
    };
    Ok(quote! {
        #(#attrs)*
        #vis #sig {
            #body
        }
    })
}

/// Checks, by its spelling, that the fn returns a `Result` (or an alias
/// named `...Result`, such as `io::Result<T>`): the lock error has to go
/// somewhere.
fn check_returns_result(func: &ItemFn) -> syn::Result<()> {
    const WHAT: &str = "#[distributed_lock] needs the fn to return `Result<T, E>` with `E: From<dlock_core::LockError>`, because taking the lock can fail";
    match &func.sig.output {
        ReturnType::Default => Err(syn::Error::new(
            func.sig.paren_token.span.close(),
            format!("{WHAT}; write `-> Result<(), E>`"),
        )),
        ReturnType::Type(_, ty) => {
            let is_result = match &**ty {
                Type::Path(path) => path
                    .path
                    .segments
                    .last()
                    .is_some_and(|s| s.ident.to_string().ends_with("Result")),
                _ => false,
            };
            if is_result {
                Ok(())
            } else {
                Err(syn::Error::new_spanned(
                    ty,
                    format!("{WHAT}; write `-> Result<{}, E>`", ty.to_token_stream()),
                ))
            }
        }
    }
}

/// The expression that builds the key: a `String` from the template, with
/// each placeholder checked against the fn's parameters.
fn key_expr(lit: &LitStr, func: &ItemFn) -> syn::Result<TokenStream> {
    let parts = template::parse(&lit.value()).map_err(|e| syn::Error::new(lit.span(), e))?;
    let params = param_names(func);
    let mut format = String::new();
    let mut values = Vec::new();
    for part in parts {
        match part {
            Part::Text(text) => format.push_str(&text.replace('{', "{{").replace('}', "}}")),
            Part::Field { root, fields } => {
                if !params.contains(&root) {
                    let written = std::iter::once(root.as_str())
                        .chain(fields.iter().map(String::as_str))
                        .collect::<Vec<_>>()
                        .join(".");
                    let known = if params.is_empty() {
                        "it has no named parameters".to_owned()
                    } else {
                        format!(
                            "its parameters are {}",
                            params
                                .iter()
                                .map(|p| format!("`{p}`"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    };
                    return Err(syn::Error::new(
                        lit.span(),
                        format!(
                            "`{{{written}}}` in the key names no parameter of `{}`; {known}",
                            func.sig.ident
                        ),
                    ));
                }
                format.push_str("{}");
                let root = Ident::new(&root, lit.span());
                let fields = fields.iter().map(|f| match f.parse::<u32>() {
                    Ok(index) => syn::Index {
                        index,
                        span: lit.span(),
                    }
                    .to_token_stream(),
                    Err(_) => Ident::new(f, lit.span()).to_token_stream(),
                });
                values.push(quote_spanned! {lit.span()=> &(#root #(.#fields)*) });
            }
        }
    }
    let format = LitStr::new(&format, lit.span());
    Ok(if values.is_empty() {
        quote! { ::std::string::String::from(#format) }
    } else {
        quote! { ::std::format!(#format, #(#values),*) }
    })
}

/// The names a key placeholder can refer to: `self` and plain parameters.
fn param_names(func: &ItemFn) -> Vec<String> {
    func.sig
        .inputs
        .iter()
        .filter_map(|input| match input {
            FnArg::Receiver(_) => Some("self".to_owned()),
            FnArg::Typed(typed) => match &*typed.pat {
                Pat::Ident(ident) => Some(ident.ident.to_string()),
                _ => None,
            },
        })
        .collect()
}
