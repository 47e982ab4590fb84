//! What `ibal-bus-core` needs from the platform, on WDF and WDM:
//!
//! | core | here | Windows |
//! |---|---|---|
//! | `lock_api::RawMutex` (the AL's and the shell's spin lock) | [`KernelSpinLock`] | `KSPIN_LOCK`, `KeAcquireSpinLockRaiseToDpc`/`KeReleaseSpinLock`; `try_lock`: `KeTryToAcquireSpinLockAtDpcLevel` at DISPATCH_LEVEL |
//! | `driver_platform::Registry` (`children::read_child_list`) | [`ParametersKey`] | `WdfDriverOpenParametersRegistryKey`; an entry's subkey with `WdfRegistryOpenKey`; `REG_SZ`/`REG_EXPAND_SZ`, `REG_MULTI_SZ`, `REG_DWORD`, `REG_BINARY` by `WdfRegistryQueryValue` |
//! | `driver_platform::Request` (`AccessLayer::submit`) | [`WdfRequest`] | a `WDFREQUEST` with METHOD_BUFFERED buffers, the input copied |
//! | `driver_platform::IrqlQuery` | [`KeIrql`] | `KeGetCurrentIrql` |
//! | `driver_platform::Event` (`AccessLayer::close`) | [`KernelEvent`] | a notification `KEVENT` |
//!
//! The spin lock, IRQL and event are the miniport shell's
//! (`hca-miniport/src/kmdf/platform.rs`) again: the two driver images
//! cannot share a crate of KMDF code without a third shipped crate, which
//! is not worth it for these few lines.

use alloc::boxed::Box;
use alloc::string::String;
use alloc::vec::Vec;
use core::cell::UnsafeCell;
use core::ptr;
use core::sync::atomic::{AtomicU8, Ordering};

use driver_platform::{
    Event, Irql, IrqlQuery, NtStatus, RegValue, Registry, RegistryKey, Request, RequestorMode,
};
use wdk_sys::ntddk::{
    KeAcquireSpinLockRaiseToDpc, KeClearEvent, KeGetCurrentIrql, KeInitializeEvent,
    KeReadStateEvent, KeReleaseSpinLock, KeReleaseSpinLockFromDpcLevel, KeSetEvent,
    KeTryToAcquireSpinLockAtDpcLevel, KeWaitForSingleObject,
};
use wdk_sys::{
    _EVENT_TYPE, _KWAIT_REASON, _MODE, FALSE, KEVENT, KEY_READ, KIRQL, KSPIN_LOCK, REG_BINARY,
    REG_DWORD, REG_EXPAND_SZ, REG_MULTI_SZ, REG_SZ, ULONG, UNICODE_STRING,
    WDF_NO_OBJECT_ATTRIBUTES, WDFDRIVER, WDFKEY, WDFREQUEST, call_unsafe_wdf_function_binding,
};

/// The shell's spin-locked data.
pub type SpinLock<T> = lock_api::Mutex<KernelSpinLock, T>;

// ---------------------------------------------------------------------------
// Spin lock

/// A `KSPIN_LOCK` as a `lock_api::RawMutex`: acquiring raises to
/// DISPATCH_LEVEL, releasing restores the IRQL saved at acquisition.
///
/// # Invariants
/// `old_irql` is written only by the holder, right after acquiring, and
/// read only by the holder when releasing.
#[derive(Debug)]
pub struct KernelSpinLock {
    lock: UnsafeCell<KSPIN_LOCK>,
    old_irql: AtomicU8,
}

// SAFETY: a KSPIN_LOCK is made to be shared between processors; the cell
// is only touched through the kernel's spin-lock routines.
unsafe impl Sync for KernelSpinLock {}
// SAFETY: as above; a released spin lock may move between threads.
unsafe impl Send for KernelSpinLock {}

// SAFETY: `lock` excludes other holders until `unlock`; the kernel's
// spin-lock routines give acquire/release ordering.
unsafe impl lock_api::RawMutex for KernelSpinLock {
    // A zeroed KSPIN_LOCK is a released one (`KeInitializeSpinLock` stores 0).
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: Self = Self {
        lock: UnsafeCell::new(0),
        old_irql: AtomicU8::new(0),
    };
    type GuardMarker = lock_api::GuardNoSend;

    fn lock(&self) {
        // SAFETY: `self.lock` is a valid, initialised KSPIN_LOCK; the
        // caller is at DISPATCH_LEVEL or below (the core's lock contract).
        let old = unsafe { KeAcquireSpinLockRaiseToDpc(self.lock.get()) };
        self.old_irql.store(old, Ordering::Relaxed);
    }

    fn try_lock(&self) -> bool {
        // SAFETY: a valid, initialised KSPIN_LOCK, tried at DISPATCH_LEVEL
        // as the routine requires (`try_at_dispatch` raised there).
        let acquired =
            try_at_dispatch(|| unsafe { KeTryToAcquireSpinLockAtDpcLevel(self.lock.get()) != 0 });
        match acquired {
            Some(old) => {
                self.old_irql.store(old, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    unsafe fn unlock(&self) {
        let old: KIRQL = self.old_irql.load(Ordering::Relaxed);
        // SAFETY: the caller holds the lock (lock_api contract) and `old`
        // is the IRQL it was acquired from (type invariants).
        unsafe { KeReleaseSpinLock(self.lock.get(), old) };
    }
}

/// Runs the try-acquire `attempt` at DISPATCH_LEVEL (where the kernel's
/// `…AtDpcLevel` routines must be called), raising with a private spin
/// lock nothing else takes. If `attempt` acquired its lock, the IRQL stays
/// at DISPATCH_LEVEL and the IRQL to return to comes back; otherwise the
/// IRQL is restored and `None` comes back.
fn try_at_dispatch(attempt: impl FnOnce() -> bool) -> Option<KIRQL> {
    let mut raise: KSPIN_LOCK = 0;
    // SAFETY: a released spin lock on this stack that nothing else can
    // reach: acquiring it only raises to DISPATCH_LEVEL.
    let old = unsafe { KeAcquireSpinLockRaiseToDpc(&mut raise) };
    if attempt() {
        // SAFETY: acquired just above; releasing it from DISPATCH_LEVEL
        // keeps the IRQL there for the lock `attempt` took.
        unsafe { KeReleaseSpinLockFromDpcLevel(&mut raise) };
        Some(old)
    } else {
        // SAFETY: acquired just above at `old`; lowers back to it.
        unsafe { KeReleaseSpinLock(&mut raise, old) };
        None
    }
}

// ---------------------------------------------------------------------------
// IRQL and events

/// `KeGetCurrentIrql`.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeIrql;

impl IrqlQuery for KeIrql {
    fn current_irql(&self) -> Irql {
        // SAFETY: callable at any IRQL.
        let level = unsafe { KeGetCurrentIrql() };
        match level {
            0 => Irql::PASSIVE,
            1 => Irql::APC,
            2 => Irql::DISPATCH,
            n => Irql::device(n),
        }
    }
}

/// A notification `KEVENT` in non-paged pool (boxed: a KEVENT must not
/// move once initialised).
pub struct KernelEvent {
    event: Box<UnsafeCell<KEVENT>>,
}

// SAFETY: a KEVENT is made to be signalled and waited on from any thread;
// it is only touched through the kernel's event routines.
unsafe impl Send for KernelEvent {}
// SAFETY: as above.
unsafe impl Sync for KernelEvent {}

impl core::fmt::Debug for KernelEvent {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("KernelEvent")
            .field("set", &self.is_set())
            .finish()
    }
}

impl Default for KernelEvent {
    fn default() -> Self {
        let event = Box::new(UnsafeCell::new(KEVENT::default()));
        // SAFETY: `event` is non-paged (wdk-alloc), pinned in its box for
        // the event's life.
        unsafe { KeInitializeEvent(event.get(), _EVENT_TYPE::NotificationEvent, FALSE as u8) };
        Self { event }
    }
}

impl Event for KernelEvent {
    fn set(&self) {
        // SAFETY: an initialised event; DISPATCH_LEVEL or below.
        unsafe { KeSetEvent(self.event.get(), 0, FALSE as u8) };
    }

    fn clear(&self) {
        // SAFETY: as above.
        unsafe { KeClearEvent(self.event.get()) };
    }

    fn is_set(&self) -> bool {
        // SAFETY: as above.
        let state = unsafe { KeReadStateEvent(self.event.get()) };
        state != 0
    }

    fn wait(&self) {
        // SAFETY: an initialised event; PASSIVE_LEVEL (the trait's
        // contract), no timeout.
        let _ = unsafe {
            KeWaitForSingleObject(
                self.event.get().cast(),
                _KWAIT_REASON::Executive,
                _MODE::KernelMode as i8,
                FALSE as u8,
                ptr::null_mut(),
            )
        };
    }
}

// ---------------------------------------------------------------------------
// Strings

/// A counted UTF-16 string for the kernel's `UNICODE_STRING` arguments; the
/// buffer lives as long as this value.
#[derive(Debug)]
pub struct WideString {
    units: Vec<u16>,
}

impl WideString {
    /// `text` in UTF-16 (no terminator: a `UNICODE_STRING` is counted).
    /// `None` when longer than a `UNICODE_STRING` can describe.
    pub fn new(text: &str) -> Option<Self> {
        let units: Vec<u16> = text.encode_utf16().collect();
        u16::try_from(units.len() * 2).ok()?;
        Some(Self { units })
    }

    /// The `UNICODE_STRING` over the buffer, valid while `self` lives and
    /// is not moved.
    pub fn unicode(&mut self) -> UNICODE_STRING {
        let bytes = (self.units.len() * 2) as u16;
        UNICODE_STRING {
            Length: bytes,
            MaximumLength: bytes,
            Buffer: self.units.as_mut_ptr(),
        }
    }
}

/// The strings of UTF-16 `units` split at NULs (a `REG_MULTI_SZ`: the
/// empty string ends the list), invalid units replaced.
fn multi_string(units: &[u16]) -> Vec<String> {
    units
        .split(|unit| *unit == 0)
        .take_while(|s| !s.is_empty())
        .map(|s| {
            char::decode_utf16(s.iter().copied())
                .map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER))
                .collect()
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Registry

/// The largest registry value read (the child list's values are short; a
/// larger one is refused rather than allocated).
const MAX_VALUE_BYTES: usize = 16 * 1024;

/// The driver's `Parameters` key (`Services\ibalbus\Parameters`), opened
/// with `WdfDriverOpenParametersRegistryKey` and closed on drop. A name
/// `entry\value` reads `value` of the subkey `entry` (the child list's
/// layout, `ibal_bus_core::children`). PASSIVE_LEVEL.
#[derive(Debug)]
pub struct ParametersKey {
    key: WDFKEY,
}

// SAFETY: a WDFKEY may be used from any thread (reads are PASSIVE_LEVEL);
// it is closed once, by its owner, on drop.
unsafe impl Send for ParametersKey {}
// SAFETY: reads through a shared reference do not mutate the handle.
unsafe impl Sync for ParametersKey {}

impl ParametersKey {
    /// Opens the Parameters key of `driver` for reading.
    ///
    /// # Safety
    /// `driver` is the live driver object; PASSIVE_LEVEL.
    pub unsafe fn open(driver: WDFDRIVER) -> Result<Self, NtStatus> {
        let mut key: WDFKEY = ptr::null_mut();
        // SAFETY: the live driver object; out pointer valid; PASSIVE_LEVEL
        // (the caller's contract).
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfDriverOpenParametersRegistryKey,
                driver,
                KEY_READ,
                WDF_NO_OBJECT_ATTRIBUTES,
                &mut key
            )
        };
        if status < 0 {
            return Err(NtStatus::from_raw(status as u32));
        }
        Ok(Self { key })
    }

    /// The value `name` of the open key `key`, decoded by its type.
    fn query(key: WDFKEY, name: &str) -> Option<RegValue> {
        let mut name = WideString::new(name)?;
        let unicode = name.unicode();
        let mut needed: ULONG = 0;
        let mut kind: ULONG = 0;
        // Sizing call: no buffer, the framework answers the length.
        // SAFETY: an open key; `unicode` describes `name`, alive for the
        // call; out pointers valid.
        let _ = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRegistryQueryValue,
                key,
                &unicode,
                0,
                ptr::null_mut(),
                &mut needed,
                &mut kind
            )
        };
        let len = needed as usize;
        if len == 0 || len > MAX_VALUE_BYTES {
            return None;
        }
        let mut data: Vec<u8> = Vec::new();
        data.try_reserve_exact(len).ok()?;
        data.resize(len, 0);
        // SAFETY: as above; `data` holds `needed` writable bytes.
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRegistryQueryValue,
                key,
                &unicode,
                needed,
                data.as_mut_ptr().cast(),
                &mut needed,
                &mut kind
            )
        };
        if status < 0 {
            return None;
        }
        data.truncate(needed as usize);
        let units: Vec<u16> = data
            .chunks_exact(2)
            .map(|pair| u16::from_le_bytes([pair[0], pair[1]]))
            .collect();
        match kind {
            REG_SZ | REG_EXPAND_SZ => Some(RegValue::String(
                multi_string(&units).into_iter().next().unwrap_or_default(),
            )),
            REG_MULTI_SZ => Some(RegValue::MultiString(multi_string(&units))),
            REG_DWORD => {
                let bytes: [u8; 4] = data.get(..4)?.try_into().ok()?;
                Some(RegValue::Dword(u32::from_le_bytes(bytes)))
            }
            REG_BINARY => Some(RegValue::Binary(data)),
            _ => None,
        }
    }
}

impl Registry for ParametersKey {
    fn read(&self, key: RegistryKey, name: &str) -> Option<RegValue> {
        if !matches!(key, RegistryKey::ServiceParameters) {
            return None;
        }
        let Some((subkey, value)) = name.rsplit_once('\\') else {
            return Self::query(self.key, name);
        };
        let mut path = WideString::new(subkey)?;
        let unicode = path.unicode();
        let mut child: WDFKEY = ptr::null_mut();
        // SAFETY: an open parent key; `unicode` describes `path`, alive for
        // the call; out pointer valid; PASSIVE_LEVEL (the trait's contract).
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRegistryOpenKey,
                self.key,
                &unicode,
                KEY_READ,
                WDF_NO_OBJECT_ATTRIBUTES,
                &mut child
            )
        };
        if status < 0 {
            return None;
        }
        let found = Self::query(child, value);
        // SAFETY: opened just above, closed once.
        unsafe { call_unsafe_wdf_function_binding!(WdfRegistryClose, child) };
        found
    }
}

impl Drop for ParametersKey {
    fn drop(&mut self) {
        // SAFETY: the key opened in `open`, closed once (drop).
        unsafe { call_unsafe_wdf_function_binding!(WdfRegistryClose, self.key) };
    }
}

// ---------------------------------------------------------------------------
// Requests

/// A `WDFREQUEST` with METHOD_BUFFERED buffers. The input is copied when
/// the request is wrapped: with METHOD_BUFFERED the input and output share
/// one system buffer, and the core holds the input while it writes the
/// output.
///
/// # Invariants
/// `request` is owned by the driver until `complete`; `output` points at
/// `output_len` bytes of its system buffer until then.
#[derive(Debug)]
pub struct WdfRequest {
    request: WDFREQUEST,
    code: u32,
    mode: RequestorMode,
    input: Vec<u8>,
    output: *mut u8,
    output_len: usize,
}

// SAFETY: a request may be completed from any thread at DISPATCH_LEVEL or
// below; the buffers are non-paged system buffers.
unsafe impl Send for WdfRequest {}

impl WdfRequest {
    /// Wraps a request a queue delivered, copying its input; hands the
    /// request back when the copy cannot be allocated.
    ///
    /// # Safety
    /// `request` is a live request the driver owns, whose buffers are
    /// METHOD_BUFFERED.
    pub unsafe fn new(
        request: WDFREQUEST,
        code: u32,
        mode: RequestorMode,
    ) -> Result<Self, WDFREQUEST> {
        let mut input_ptr: *mut core::ffi::c_void = ptr::null_mut();
        let mut input_len: usize = 0;
        // SAFETY: `request` is live (caller); out pointers are valid.
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRequestRetrieveInputBuffer,
                request,
                0,
                &mut input_ptr,
                &mut input_len
            )
        };
        let mut input = Vec::new();
        if status >= 0 && !input_ptr.is_null() {
            if input.try_reserve_exact(input_len).is_err() {
                return Err(request);
            }
            // SAFETY: the framework returned `input_len` readable bytes.
            let bytes = unsafe { core::slice::from_raw_parts(input_ptr.cast::<u8>(), input_len) };
            input.extend_from_slice(bytes);
        }
        let mut output_ptr: *mut core::ffi::c_void = ptr::null_mut();
        let mut output_len: usize = 0;
        // SAFETY: as above.
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRequestRetrieveOutputBuffer,
                request,
                0,
                &mut output_ptr,
                &mut output_len
            )
        };
        if status < 0 || output_ptr.is_null() {
            output_len = 0;
        }
        Ok(Self {
            request,
            code,
            mode,
            input,
            output: output_ptr.cast::<u8>(),
            output_len,
        })
    }

    /// Completes a request that was not wrapped (or could not be).
    ///
    /// # Safety
    /// `request` is a live request this driver owns; it is consumed.
    pub unsafe fn complete_raw(request: WDFREQUEST, status: NtStatus, information: u64) {
        // SAFETY: the caller owned `request` (contract); this consumes it.
        unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRequestCompleteWithInformation,
                request,
                status.raw() as i32,
                information
            )
        };
    }
}

impl Request for WdfRequest {
    fn ioctl_code(&self) -> u32 {
        self.code
    }

    fn requestor_mode(&self) -> RequestorMode {
        self.mode
    }

    fn input(&self) -> &[u8] {
        &self.input
    }

    fn output(&mut self) -> &mut [u8] {
        if self.output.is_null() {
            return &mut [];
        }
        // SAFETY: `output` points at `output_len` bytes of the request's
        // system buffer while the driver owns it (type invariants); the
        // input was copied out, so nothing else aliases it.
        unsafe { core::slice::from_raw_parts_mut(self.output, self.output_len) }
    }

    fn complete(self, status: NtStatus, information: u64) {
        // SAFETY: the driver owns the request until now (type invariants);
        // the wrapper is consumed.
        unsafe { Self::complete_raw(self.request, status, information) };
    }

    fn is_canceled(&self) -> bool {
        // SAFETY: the driver owns the live request.
        let canceled =
            unsafe { call_unsafe_wdf_function_binding!(WdfRequestIsCanceled, self.request) };
        canceled != 0
    }
}
