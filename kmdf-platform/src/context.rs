//! Typed object contexts: the framework allocates one (zeroed) with an
//! object and hands it back by handle. A [`ShellContext<T>`] holds one
//! strong reference to the object's shell state `T`, given back in the
//! object's cleanup callback (or earlier, by [`take`]).
//!
//! WDF's `WDF_DECLARE_CONTEXT_TYPE` is a C macro; windows-drivers-rs does
//! not generate it, so each shell declares one static [`ContextTypeInfo`]
//! per context type with [`ContextTypeInfo::new`], its `UniqueType`
//! pointing at itself.
//!
//! # Invariants
//! `ShellContext::shell` is null or the pointer of an `Arc<T>` made by
//! `Arc::into_raw`, owned by the context until cleanup.

use alloc::sync::Arc;
use core::ffi::CStr;
use core::ptr;

use wdk_sys::{
    _WDF_EXECUTION_LEVEL, _WDF_SYNCHRONIZATION_SCOPE, WDF_OBJECT_ATTRIBUTES,
    WDF_OBJECT_CONTEXT_TYPE_INFO, WDFOBJECT, call_unsafe_wdf_function_binding,
};

/// The context of an object that carries shell state.
#[derive(Debug)]
#[repr(C)]
pub struct ShellContext<T> {
    /// The shell state (see the module's invariants).
    pub shell: *const T,
}

/// A context type's type-info record (`WDF_DECLARE_CONTEXT_TYPE`).
#[derive(Debug)]
#[repr(transparent)]
pub struct ContextTypeInfo(WDF_OBJECT_CONTEXT_TYPE_INFO);

// SAFETY: the record is immutable after its static initialisation; the
// raw pointers in it point at static data.
unsafe impl Sync for ContextTypeInfo {}

impl ContextTypeInfo {
    /// The record of a context named `name` of `size` bytes; `this` is the
    /// address of the static being initialised (`ptr::addr_of!` of it),
    /// which the framework compares to find the context again.
    pub const fn new(name: &'static CStr, size: usize, this: *const ContextTypeInfo) -> Self {
        Self(WDF_OBJECT_CONTEXT_TYPE_INFO {
            Size: size_of::<WDF_OBJECT_CONTEXT_TYPE_INFO>() as u32,
            ContextName: name.as_ptr(),
            ContextSize: size,
            // `repr(transparent)`: the record's address is the wrapper's.
            UniqueType: this.cast::<WDF_OBJECT_CONTEXT_TYPE_INFO>(),
            EvtDriverGetUniqueContextType: None,
        })
    }

    /// The record, for `WDF_OBJECT_ATTRIBUTES::ContextTypeInfo`.
    pub fn as_raw(&'static self) -> *const WDF_OBJECT_CONTEXT_TYPE_INFO {
        &self.0
    }
}

/// Shell state kept in an object's [`ShellContext`].
pub trait Shell: Send + Sync + Sized + 'static {
    /// The type-info record of `ShellContext<Self>`.
    fn type_info() -> &'static ContextTypeInfo;
}

/// `WDF_OBJECT_ATTRIBUTES_INIT`: the size set, execution level and
/// synchronization scope inherited from the parent, everything else zero.
/// A zeroed structure is not this: its level and scope are the *invalid*
/// enumerators (0), and the framework refuses to create the object.
/// Every attribute structure of the shells starts here.
pub fn object_attributes() -> WDF_OBJECT_ATTRIBUTES {
    WDF_OBJECT_ATTRIBUTES {
        Size: size_of::<WDF_OBJECT_ATTRIBUTES>() as u32,
        ExecutionLevel: _WDF_EXECUTION_LEVEL::WdfExecutionLevelInheritFromParent,
        SynchronizationScope: _WDF_SYNCHRONIZATION_SCOPE::WdfSynchronizationScopeInheritFromParent,
        ..WDF_OBJECT_ATTRIBUTES::default()
    }
}

/// Object attributes that give an object a `ShellContext<T>` and the
/// cleanup callback that releases it.
pub fn shell_attributes<T: Shell>() -> WDF_OBJECT_ATTRIBUTES {
    WDF_OBJECT_ATTRIBUTES {
        ContextTypeInfo: T::type_info().as_raw(),
        EvtCleanupCallback: Some(evt_cleanup::<T>),
        ..object_attributes()
    }
}

/// The context of type `info` of `object` (`WdfObjectGetTypedContext`),
/// or null if it has none. Any IRQL.
///
/// # Safety
/// `object` is a live framework object; `C` is the type `info` declares.
pub unsafe fn typed_context<C>(object: WDFOBJECT, info: &'static ContextTypeInfo) -> *mut C {
    // SAFETY: the caller guarantees `object` is live; the type info is a
    // static record.
    let raw = unsafe {
        call_unsafe_wdf_function_binding!(WdfObjectGetTypedContextWorker, object, info.0.UniqueType)
    };
    raw.cast::<C>()
}

/// The `ShellContext<T>` of `object`, or null if it has none. Any IRQL.
///
/// # Safety
/// `object` is a live framework object.
pub unsafe fn context_of<T: Shell>(object: WDFOBJECT) -> *mut ShellContext<T> {
    // SAFETY: forwarded from the caller; `ShellContext<T>` is the type
    // `T::type_info` declares.
    unsafe { typed_context::<ShellContext<T>>(object, T::type_info()) }
}

/// Gives `shell` to the zeroed context of `object`, which owns it from now
/// on (released by the cleanup callback). False when the object has no
/// such context (the shell is dropped).
///
/// # Safety
/// `object` is a live object created with [`shell_attributes`] for `T`,
/// whose context was not installed yet.
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

/// Takes the context's reference to `object`'s shell state out (the
/// context holds nothing afterwards); `None` if it held none.
///
/// # Safety
/// `object` is a live framework object created with [`shell_attributes`]
/// for `T`, in a callback that runs once per object (its close or its
/// cleanup), so no other thread takes the same reference.
pub unsafe fn take<T: Shell>(object: WDFOBJECT) -> Option<Arc<T>> {
    // SAFETY: forwarded from the caller.
    let context = unsafe { context_of::<T>(object) };
    if context.is_null() {
        return None;
    }
    // SAFETY: the framework keeps the context with the live object; the
    // caller's callback is the only one touching it now.
    let shell = unsafe { core::mem::replace(&mut (*context).shell, ptr::null()) };
    if shell.is_null() {
        return None;
    }
    // SAFETY: the reference the context owned (module invariants), now
    // this `Arc`'s.
    Some(unsafe { Arc::from_raw(shell) })
}

/// `EvtCleanupCallback` of an object: gives the context's reference back.
unsafe extern "C" fn evt_cleanup<T: Shell>(object: WDFOBJECT) {
    // SAFETY: the framework calls cleanup once, after every other callback
    // on an object created with [`shell_attributes`] for `T`, before
    // freeing its context.
    drop(unsafe { take::<T>(object) });
}
