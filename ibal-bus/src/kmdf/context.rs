//! Typed object contexts: the framework allocates one (zeroed) with a
//! device object and hands it back by handle; it holds one strong
//! reference to the device's shell state (the filter's [`FilterShell`] or
//! a child's [`ChildShell`]), given back in the device's cleanup callback.
//!
//! WDF's `WDF_DECLARE_CONTEXT_TYPE` is a C macro; windows-drivers-rs does
//! not generate it, so each type-info record is declared by hand here
//! (one static per context type, its `UniqueType` pointing at itself), as
//! in the miniport's shell.
//!
//! # Invariants
//! `ShellContext::shell` is null or the pointer of an `Arc<T>` made by
//! `Arc::into_raw`, owned by the context until cleanup.

use alloc::sync::Arc;
use core::ptr;

use wdk_sys::{
    _WDF_EXECUTION_LEVEL, _WDF_SYNCHRONIZATION_SCOPE, WDF_OBJECT_ATTRIBUTES,
    WDF_OBJECT_CONTEXT_TYPE_INFO, WDFOBJECT, call_unsafe_wdf_function_binding,
};

use super::child::ChildShell;
use super::filter::FilterShell;

/// The context of a device object: its shell state.
#[derive(Debug)]
#[repr(C)]
pub struct ShellContext<T> {
    /// The shell state (see the module's invariants).
    pub shell: *const T,
}

/// A type-info record.
#[derive(Debug)]
#[repr(transparent)]
pub struct ContextTypeInfo(WDF_OBJECT_CONTEXT_TYPE_INFO);

// SAFETY: the record is immutable after its static initialisation; the
// raw pointers in it point at static data.
unsafe impl Sync for ContextTypeInfo {}

/// Shell state kept in a device object's context.
pub trait Shell: Send + Sync + Sized + 'static {
    /// The type-info record of `ShellContext<Self>`.
    fn type_info() -> &'static ContextTypeInfo;
}

/// `WDF_DECLARE_CONTEXT_TYPE` for the filter device's context.
pub static FILTER_CONTEXT_TYPE: ContextTypeInfo = ContextTypeInfo(WDF_OBJECT_CONTEXT_TYPE_INFO {
    Size: size_of::<WDF_OBJECT_CONTEXT_TYPE_INFO>() as u32,
    ContextName: c"FilterContext".as_ptr(),
    ContextSize: size_of::<ShellContext<FilterShell>>(),
    UniqueType: ptr::addr_of!(FILTER_CONTEXT_TYPE).cast::<WDF_OBJECT_CONTEXT_TYPE_INFO>(),
    EvtDriverGetUniqueContextType: None,
});

/// `WDF_DECLARE_CONTEXT_TYPE` for a child PDO's context.
pub static CHILD_CONTEXT_TYPE: ContextTypeInfo = ContextTypeInfo(WDF_OBJECT_CONTEXT_TYPE_INFO {
    Size: size_of::<WDF_OBJECT_CONTEXT_TYPE_INFO>() as u32,
    ContextName: c"ChildContext".as_ptr(),
    ContextSize: size_of::<ShellContext<ChildShell>>(),
    UniqueType: ptr::addr_of!(CHILD_CONTEXT_TYPE).cast::<WDF_OBJECT_CONTEXT_TYPE_INFO>(),
    EvtDriverGetUniqueContextType: None,
});

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

/// `WDF_OBJECT_ATTRIBUTES_INIT`: the size set, execution level and
/// synchronization scope inherited from the parent, everything else zero
/// (a zeroed structure has the *invalid* enumerators, which the framework
/// refuses).
pub fn object_attributes() -> WDF_OBJECT_ATTRIBUTES {
    WDF_OBJECT_ATTRIBUTES {
        Size: size_of::<WDF_OBJECT_ATTRIBUTES>() as u32,
        ExecutionLevel: _WDF_EXECUTION_LEVEL::WdfExecutionLevelInheritFromParent,
        SynchronizationScope: _WDF_SYNCHRONIZATION_SCOPE::WdfSynchronizationScopeInheritFromParent,
        ..WDF_OBJECT_ATTRIBUTES::default()
    }
}

/// Object attributes that give a device object a `ShellContext<T>` and the
/// cleanup callback that releases it.
pub fn shell_attributes<T: Shell>() -> WDF_OBJECT_ATTRIBUTES {
    WDF_OBJECT_ATTRIBUTES {
        ContextTypeInfo: &T::type_info().0,
        EvtCleanupCallback: Some(evt_cleanup::<T>),
        ..object_attributes()
    }
}

/// The `ShellContext<T>` of `object`, or null if it has none.
///
/// # Safety
/// `object` is a live framework object.
unsafe fn context_of<T: Shell>(object: WDFOBJECT) -> *mut ShellContext<T> {
    // SAFETY: the caller guarantees `object` is live; the type info is the
    // static the object was created with.
    let raw = unsafe {
        call_unsafe_wdf_function_binding!(
            WdfObjectGetTypedContextWorker,
            object,
            T::type_info().0.UniqueType
        )
    };
    raw.cast::<ShellContext<T>>()
}

/// Gives `shell` to the zeroed context of `object`, which owns it from now
/// on (released by the cleanup callback). False when the object has no
/// such context (the shell is dropped).
///
/// # Safety
/// `object` is a live device object created with [`shell_attributes`]
/// for `T`, whose context was not installed yet.
pub unsafe fn install<T: Shell>(object: WDFOBJECT, shell: Arc<T>) -> bool {
    // SAFETY: forwarded from the caller.
    let context = unsafe { context_of::<T>(object) };
    if context.is_null() {
        return false;
    }
    // SAFETY: the framework's zeroed context of the live object; nothing
    // else reads it before this returns (the caller just created it).
    unsafe { (*context).shell = Arc::into_raw(shell) };
    true
}

/// A strong reference to `object`'s shell state, if it has one.
///
/// # Safety
/// `object` is a live framework object created with [`shell_attributes`]
/// for `T`.
pub unsafe fn shell_of<T: Shell>(object: WDFOBJECT) -> Option<Arc<T>> {
    // SAFETY: forwarded from the caller.
    let context = unsafe { context_of::<T>(object) };
    if context.is_null() {
        return None;
    }
    // SAFETY: the framework keeps the context with the object, which
    // cannot be deleted during a callback on it.
    let shell = unsafe { (*context).shell };
    if shell.is_null() {
        return None;
    }
    // SAFETY: per the module's invariants `shell` came from `Arc::into_raw`
    // and the context still owns that reference; this takes one more.
    unsafe { Arc::increment_strong_count(shell) };
    // SAFETY: the count taken just above is the one this `Arc` owns.
    Some(unsafe { Arc::from_raw(shell) })
}

/// `EvtCleanupCallback` of a device object: gives the context's reference
/// back.
unsafe extern "C" fn evt_cleanup<T: Shell>(object: WDFOBJECT) {
    // SAFETY: the framework calls cleanup on an object created with
    // [`shell_attributes`] for `T`, before freeing its context.
    let context = unsafe { context_of::<T>(object) };
    if context.is_null() {
        return;
    }
    // SAFETY: cleanup runs once, after every other callback on the object.
    let shell = unsafe { core::mem::replace(&mut (*context).shell, ptr::null()) };
    if !shell.is_null() {
        // SAFETY: the reference the context owned (module invariants).
        drop(unsafe { Arc::from_raw(shell) });
    }
}
