//! The bus filter's typed object contexts: one `ShellContext<T>`
//! (`kmdf_platform::context`, shared with the miniport's shell) per kind
//! of shell state — the filter's [`FilterShell`], a child's
//! [`ChildShell`], a file object's [`ProxyOpen`] — each with its
//! `WDF_DECLARE_CONTEXT_TYPE` record.

use core::ptr;

use kmdf_platform::context::{ContextTypeInfo, Shell, ShellContext};

use super::child::ChildShell;
use super::filter::FilterShell;
use super::proxy::ProxyOpen;

/// `WDF_DECLARE_CONTEXT_TYPE` for the filter device's context.
pub static FILTER_CONTEXT_TYPE: ContextTypeInfo = ContextTypeInfo::new(
    c"FilterContext",
    size_of::<ShellContext<FilterShell>>(),
    ptr::addr_of!(FILTER_CONTEXT_TYPE),
);

/// `WDF_DECLARE_CONTEXT_TYPE` for a child PDO's context.
pub static CHILD_CONTEXT_TYPE: ContextTypeInfo = ContextTypeInfo::new(
    c"ChildContext",
    size_of::<ShellContext<ChildShell>>(),
    ptr::addr_of!(CHILD_CONTEXT_TYPE),
);

/// `WDF_DECLARE_CONTEXT_TYPE` for a file object's context (the proxy's
/// open).
pub static PROXY_OPEN_CONTEXT_TYPE: ContextTypeInfo = ContextTypeInfo::new(
    c"ProxyOpenContext",
    size_of::<ShellContext<ProxyOpen>>(),
    ptr::addr_of!(PROXY_OPEN_CONTEXT_TYPE),
);

impl Shell for ProxyOpen {
    fn type_info() -> &'static ContextTypeInfo {
        &PROXY_OPEN_CONTEXT_TYPE
    }
}

impl Shell for FilterShell {
    fn type_info() -> &'static ContextTypeInfo {
        &FILTER_CONTEXT_TYPE
    }
}

impl Shell for ChildShell {
    fn type_info() -> &'static ContextTypeInfo {
        &CHILD_CONTEXT_TYPE
    }
}
