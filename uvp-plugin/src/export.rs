//! The DLL form of the provider (`ib_types::uvp`'s table): the exported
//! [`uvp_get_interface`] entry point, the table over any
//! [`UserVerbsProvider`] ([`interface_for`]), and its inverse
//! ([`Table`]), which turns a table back into a `UserVerbsProvider`, as
//! the access library does after it loaded the DLL.
//!
//! Contract:
//! - Every table entry point checks its pointers and lengths (null with a
//!   non-zero length, a length the verb's layout does not have, an unknown
//!   verb or status code) and answers `InvalidParameter` for them, never
//!   panicking; then it runs the provider's trait method.
//! - The table's `context` owns the provider; `release` drops it, once.
//! - On Linux the exported entry point serves the platform the simulated
//!   host installed ([`set_platform`]): its doorbell hook and process
//!   memory. Without one it answers `STATUS_INVALID_DEVICE_STATE`. On
//!   Windows it allocates rings with `VirtualAlloc` and writes the page the
//!   kernel mapped (not compiled by any check yet, as `UarPage::mapped`).
//! - A library that loaded this crate as a shared library on Linux has its
//!   own copy of that static: the host hands its platform over with the
//!   exported [`uvp_set_platform`], as a C record of function pointers
//!   ([`PlatformAbi`], built with [`PlatformAbi::new`]), right before
//!   [`uvp_get_interface`]. Only Linux has it: on Windows the plug-in
//!   allocates and rings the mapped page itself.

use core::ffi::c_void;
use std::sync::Mutex;

use ib_types::cq::CqNotify;
use ib_types::interface::InterfaceVersion;
use ib_types::ioctl::VerbId;
use ib_types::status::{IbStatus, NtStatus};
use ib_types::uvp::{
    PostCall, PostRefused, PreCall, PreOutcome, UVP_HOOK_SLOTS, UVP_INTERFACE_VERSION, UserSend,
    UserVerbsProvider, UvpCallAbi, UvpInterface, UvpVerbHooks, hook_slot,
};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendFlags, SendWr, Sge};
use ib_types::wr_desc::{RecvWrDesc, SendWrDesc};

use crate::provider::{Platform, Provider};

type Boxed = Box<dyn UserVerbsProvider>;

static PLATFORM: Mutex<Option<Platform>> = Mutex::new(None);

/// Sets (or clears) the platform the next [`uvp_get_interface`] calls
/// serve: on the simulated host, the process's memory and doorbell hook.
pub fn set_platform(platform: Option<Platform>) {
    *PLATFORM.lock().unwrap_or_else(|p| p.into_inner()) = platform;
}

/// The symbol of [`uvp_set_platform`], NUL-terminated for the loader.
#[cfg(not(windows))]
pub const UVP_SET_PLATFORM_SYMBOL: &[u8] = b"uvp_set_platform\0";

/// The type of [`uvp_set_platform`].
#[cfg(not(windows))]
pub type UvpSetPlatformFn = unsafe extern "system" fn(platform: *const PlatformAbi) -> NtStatus;

/// A host's [`Platform`] as a C record, for a plug-in loaded as a shared
/// library (which has its own copies of this crate's statics and types):
/// `context` and four functions taking it. `alloc` returns the address of
/// `len` zero-filled, page-aligned bytes of the process, or 0; `free`
/// frees one; `write64` delivers a doorbell store (`address`, `value`) to
/// the device in the calling thread; `release` ends the record. Every
/// function may be called from any thread until `release`, which the
/// plug-in calls once when it holds the record no more.
#[cfg(not(windows))]
#[derive(Debug)]
#[repr(C)]
pub struct PlatformAbi {
    /// The host's; passed back to every function.
    pub context: *mut c_void,
    /// Allocates.
    pub alloc: Option<unsafe extern "system" fn(context: *mut c_void, len: u64) -> u64>,
    /// Frees.
    pub free: Option<unsafe extern "system" fn(context: *mut c_void, va: u64)>,
    /// The doorbell store.
    pub write64: Option<unsafe extern "system" fn(context: *mut c_void, address: u64, value: u64)>,
    /// Ends the record.
    pub release: Option<unsafe extern "system" fn(context: *mut c_void)>,
}

#[cfg(not(windows))]
impl PlatformAbi {
    /// `platform` as the record: its context owns `platform` until
    /// `release`. Give it to [`uvp_set_platform`] (which takes it on
    /// success), or release it with [`PlatformAbi::release_unused`].
    pub fn new(platform: Platform) -> Self {
        unsafe extern "system" fn alloc(context: *mut c_void, len: u64) -> u64 {
            // SAFETY: `context` is the `Box<Platform>` of `new`, not
            // released (the record's contract).
            let platform = unsafe { &*context.cast::<Platform>() };
            usize::try_from(len)
                .ok()
                .and_then(|len| platform.memory.alloc(len))
                .unwrap_or(0)
        }
        unsafe extern "system" fn free(context: *mut c_void, va: u64) {
            // SAFETY: as for `alloc`.
            unsafe { &*context.cast::<Platform>() }.memory.free(va);
        }
        unsafe extern "system" fn write64(context: *mut c_void, address: u64, value: u64) {
            // SAFETY: as for `alloc`.
            (unsafe { &*context.cast::<Platform>() }.mmio)(address, value);
        }
        unsafe extern "system" fn release(context: *mut c_void) {
            // SAFETY: `context` came from `Box::into_raw` in `new` and is
            // released once (the record's contract).
            drop(unsafe { Box::from_raw(context.cast::<Platform>()) });
        }
        Self {
            context: Box::into_raw(Box::new(platform)).cast(),
            alloc: Some(alloc),
            free: Some(free),
            write64: Some(write64),
            release: Some(release),
        }
    }

    /// Releases a record no plug-in took.
    pub fn release_unused(self) {
        if let Some(release) = self.release {
            // SAFETY: nothing took the record, so this is its one release.
            unsafe { release(self.context) };
        }
    }
}

/// A host's record as this plug-in's platform: released when the last
/// provider holding it is gone.
#[cfg(not(windows))]
struct ForeignPlatform {
    context: *mut c_void,
    alloc: unsafe extern "system" fn(*mut c_void, u64) -> u64,
    free: unsafe extern "system" fn(*mut c_void, u64),
    write64: unsafe extern "system" fn(*mut c_void, u64, u64),
    release: unsafe extern "system" fn(*mut c_void),
}

// SAFETY: the record's functions may be called from any thread until
// `release` (`PlatformAbi`'s contract); `context` is only passed to them.
#[cfg(not(windows))]
unsafe impl Send for ForeignPlatform {}
// SAFETY: as for `Send`: shared calls are the record's contract.
#[cfg(not(windows))]
unsafe impl Sync for ForeignPlatform {}

#[cfg(not(windows))]
impl crate::provider::UserMemory for ForeignPlatform {
    fn alloc(&self, len: usize) -> Option<u64> {
        // SAFETY: the record is live until `release` (in `drop`).
        let va = unsafe { (self.alloc)(self.context, len as u64) };
        (va != 0).then_some(va)
    }

    fn free(&self, va: u64) {
        // SAFETY: as above.
        unsafe { (self.free)(self.context, va) };
    }
}

#[cfg(not(windows))]
impl Drop for ForeignPlatform {
    fn drop(&mut self) {
        // SAFETY: the one release of a record this plug-in took.
        unsafe { (self.release)(self.context) };
    }
}

/// The plug-in's exported platform entry point (Linux only,
/// [`UvpSetPlatformFn`]): `platform` becomes what the next
/// [`uvp_get_interface`] calls serve, as [`set_platform`]; null clears it.
/// On success the plug-in owns the record (it calls `release` once it
/// holds it no more, a later call replacing it included); a record with a
/// missing function is refused with `STATUS_INVALID_PARAMETER` and stays
/// the caller's.
///
/// # Safety
/// `platform` is null or points to a [`PlatformAbi`] keeping its contract.
#[cfg(not(windows))]
#[unsafe(no_mangle)]
pub unsafe extern "system" fn uvp_set_platform(platform: *const PlatformAbi) -> NtStatus {
    // SAFETY: null or a readable record (the caller's contract).
    let Some(abi) = (unsafe { platform.as_ref() }) else {
        set_platform(None);
        return NtStatus::SUCCESS;
    };
    let (Some(alloc), Some(free), Some(write64), Some(release)) =
        (abi.alloc, abi.free, abi.write64, abi.release)
    else {
        return NtStatus::INVALID_PARAMETER;
    };
    let foreign = std::sync::Arc::new(ForeignPlatform {
        context: abi.context,
        alloc,
        free,
        write64,
        release,
    });
    let doorbell = std::sync::Arc::clone(&foreign);
    set_platform(Some(Platform {
        memory: foreign,
        mmio: std::sync::Arc::new(move |address, value| {
            // SAFETY: the record is live while `doorbell` holds it.
            unsafe { (doorbell.write64)(doorbell.context, address, value) };
        }),
    }));
    NtStatus::SUCCESS
}

#[cfg(windows)]
fn current_platform() -> Option<Platform> {
    Some(
        PLATFORM
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| Platform {
                memory: std::sync::Arc::new(os::VirtualMemory),
            }),
    )
}

#[cfg(not(windows))]
fn current_platform() -> Option<Platform> {
    PLATFORM.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The plug-in's exported entry point (`ib_types::uvp::UvpGetInterfaceFn`):
/// a new provider's table for a library speaking `version`.
///
/// # Safety
/// `table` is null or points to writable memory for one [`UvpInterface`].
#[unsafe(no_mangle)]
pub unsafe extern "system" fn uvp_get_interface(
    version: u16,
    table: *mut UvpInterface,
) -> NtStatus {
    if table.is_null() {
        return NtStatus::INVALID_PARAMETER;
    }
    if !UVP_INTERFACE_VERSION.satisfies(InterfaceVersion::from_packed(version)) {
        return NtStatus::NOT_SUPPORTED;
    }
    let Some(platform) = current_platform() else {
        return NtStatus::INVALID_DEVICE_STATE;
    };
    let filled = interface_for(Box::new(Provider::new(platform)));
    // SAFETY: `table` is non-null and writable for one table (the
    // caller's contract); a write, not an assignment, since it may be
    // uninitialized.
    unsafe { table.write(filled) };
    NtStatus::SUCCESS
}

/// The table over `provider`; the table's `context` owns it until
/// `release`.
pub fn interface_for(provider: Boxed) -> UvpInterface {
    let context = Box::into_raw(Box::new(provider)).cast::<c_void>();
    let hooks = UvpVerbHooks {
        pre: Some(pre_hook),
        post: Some(post_hook),
    };
    UvpInterface {
        size: core::mem::size_of::<UvpInterface>() as u32,
        version: UVP_INTERFACE_VERSION.packed(),
        reserved_at_0x6: 0,
        context,
        release: Some(release),
        hooks: [hooks; UVP_HOOK_SLOTS],
        post_send: Some(post_send),
        post_recv: Some(post_recv),
        post_srq_recv: Some(post_srq_recv),
        poll_cq: Some(poll_cq),
        arm_cq: Some(arm_cq),
    }
}

/// The provider behind a table's context.
///
/// # Safety
/// `context` is a table's context from [`interface_for`], not released.
unsafe fn provider<'a>(context: *mut c_void) -> &'a dyn UserVerbsProvider {
    // SAFETY: `interface_for` made `context` from a `Box<Boxed>` that lives
    // until `release` (the caller's contract).
    unsafe { &**context.cast::<Boxed>() }
}

/// `len` bytes at `ptr` (null only with 0).
///
/// # Safety
/// A non-null `ptr` is readable for `len` bytes for `'a`.
unsafe fn bytes<'a>(ptr: *const u8, len: u64) -> Option<&'a [u8]> {
    let len = usize::try_from(len)
        .ok()
        .filter(|&l| l <= isize::MAX as usize)?;
    match (ptr.is_null(), len) {
        (true, 0) => Some(&[]),
        (true, _) => None,
        // SAFETY: the caller's contract.
        (false, _) => Some(unsafe { core::slice::from_raw_parts(ptr, len) }),
    }
}

/// As [`bytes`], writable.
///
/// # Safety
/// A non-null `ptr` is writable for `len` bytes for `'a`, and nothing else
/// accesses them meanwhile.
unsafe fn bytes_mut<'a>(ptr: *mut u8, len: u64) -> Option<&'a mut [u8]> {
    let len = usize::try_from(len)
        .ok()
        .filter(|&l| l <= isize::MAX as usize)?;
    match (ptr.is_null(), len) {
        (true, 0) => Some(&mut []),
        (true, _) => None,
        // SAFETY: the caller's contract.
        (false, _) => Some(unsafe { core::slice::from_raw_parts_mut(ptr, len) }),
    }
}

/// `count` `T`s at `ptr` (null only with 0).
///
/// # Safety
/// A non-null `ptr` points to `count` initialized `T`s for `'a`.
unsafe fn items<'a, T>(ptr: *const T, count: u32) -> Option<&'a [T]> {
    match (ptr.is_null(), count) {
        (true, 0) => Some(&[]),
        (true, _) => None,
        // SAFETY: the caller's contract.
        (false, _) => Some(unsafe { core::slice::from_raw_parts(ptr, count as usize) }),
    }
}

const INVALID: u32 = IbStatus::InvalidParameter as u32;

fn code(status: IbStatus) -> u32 {
    status.code()
}

unsafe extern "system" fn release(context: *mut c_void) {
    if !context.is_null() {
        // SAFETY: `context` came from `Box::into_raw` in `interface_for`
        // and is released once (the table's contract).
        drop(unsafe { Box::from_raw(context.cast::<Boxed>()) });
    }
}

unsafe extern "system" fn pre_hook(context: *mut c_void, call: *mut UvpCallAbi) -> u32 {
    // SAFETY: a table's entry point gets its context and a call record
    // whose buffers are the library's, valid for the call.
    let Some(call) = (unsafe { call.as_mut() }) else {
        return INVALID;
    };
    let Ok(verb) = VerbId::from_code(call.verb) else {
        return INVALID;
    };
    // SAFETY: the call record's pointers and lengths (the contract above);
    // the three buffers are distinct.
    let input = unsafe { bytes(call.input, call.input_len) };
    // SAFETY: as above.
    let private_in = unsafe { bytes_mut(call.private_in, call.private_in_capacity) };
    // SAFETY: as above.
    let output = unsafe { bytes_mut(call.output, call.output_len) };
    let (Some(input), Some(private_in), Some(output)) = (input, private_in, output) else {
        return INVALID;
    };
    if input.len() != verb.in_size() || output.len() != verb.out_size() {
        return INVALID;
    }
    let mut pre = PreCall {
        verb,
        handle: call.handle,
        input,
        private_in,
        output,
    };
    // SAFETY: as above, for the context.
    match unsafe { provider(context) }.pre(&mut pre) {
        Ok(PreOutcome::Ioctl {
            private_in_len,
            private_out_max,
            cookie,
        }) => {
            call.private_in_len = private_in_len as u64;
            call.private_out_max = private_out_max as u64;
            call.cookie = cookie;
            code(IbStatus::Success)
        }
        Ok(PreOutcome::Done { handle }) => {
            call.created = handle;
            code(IbStatus::VerbsProcessingDone)
        }
        Err(status) => code(status),
    }
}

unsafe extern "system" fn post_hook(context: *mut c_void, call: *const UvpCallAbi) -> u32 {
    // SAFETY: as for `pre_hook`.
    let Some(call) = (unsafe { call.as_ref() }) else {
        return INVALID;
    };
    let (Ok(verb), Ok(status)) = (
        VerbId::from_code(call.verb),
        IbStatus::from_code(call.status),
    ) else {
        return INVALID;
    };
    if call.private_in_len > call.private_in_capacity {
        return INVALID;
    }
    // SAFETY: the call record's pointers and lengths, for the call.
    let input = unsafe { bytes(call.input, call.input_len) };
    // SAFETY: as above.
    let private_in = unsafe { bytes(call.private_in, call.private_in_len) };
    // SAFETY: as above.
    let output = unsafe { bytes(call.output, call.output_len) };
    // SAFETY: as above.
    let private_out = unsafe { bytes(call.private_out, call.private_out_len) };
    let (Some(input), Some(private_in), Some(output), Some(private_out)) =
        (input, private_in, output, private_out)
    else {
        return INVALID;
    };
    let post = PostCall {
        verb,
        handle: call.handle,
        input,
        private_in,
        cookie: call.cookie,
        status,
        created: call.created,
        output,
        private_out,
    };
    // SAFETY: as above, for the context.
    match unsafe { provider(context) }.post(&post) {
        Ok(()) => code(IbStatus::Success),
        Err(status) => code(status),
    }
}

/// Writes the count of a post's result and returns its status code.
///
/// # Safety
/// `posted` is null or writable.
unsafe fn posted_status(result: Result<usize, PostRefused>, posted: *mut u32) -> u32 {
    let (count, status) = match result {
        Ok(n) => (n, IbStatus::Success),
        Err(refused) => (refused.posted, refused.status),
    };
    if !posted.is_null() {
        // SAFETY: the caller's contract.
        unsafe { posted.write(count as u32) };
    }
    code(status)
}

/// The bytes an inline send's SGEs name, concatenated.
///
/// # Safety
/// Each SGE names memory of this process readable for the call.
unsafe fn inline_bytes(sges: &[Sge]) -> Vec<u8> {
    let mut data = Vec::new();
    for sge in sges {
        let len = sge.length.get() as usize;
        let ptr = sge.addr.get() as usize as *const u8;
        if len > 0 && !ptr.is_null() {
            // SAFETY: the caller's contract (`UvpPostSendFn`'s: an inline
            // request's SGEs are the caller's readable memory).
            data.extend_from_slice(unsafe { core::slice::from_raw_parts(ptr, len) });
        }
    }
    data
}

unsafe extern "system" fn post_send(
    context: *mut c_void,
    qp: u64,
    wrs: *const SendWrDesc,
    count: u32,
    posted: *mut u32,
) -> u32 {
    // SAFETY: the entry point's contract: `count` descriptors at `wrs`.
    let Some(descs) = (unsafe { items(wrs, count) }) else {
        // SAFETY: as above, for `posted`.
        return unsafe { posted_status(Err(refused_at(0, IbStatus::InvalidParameter)), posted) };
    };
    // Decode up to the first bad descriptor; the ones before it are posted.
    let mut decoded: Vec<(SendWr<'_>, Option<Vec<u8>>)> = Vec::with_capacity(descs.len());
    let mut bad = false;
    for desc in descs {
        // SAFETY: each descriptor's list is `num_sge` SGEs (the contract).
        let Some(sges) = (unsafe { items(desc.sg_list, desc.num_sge) }) else {
            bad = true;
            break;
        };
        let Ok(wr) = desc.decode(sges) else {
            bad = true;
            break;
        };
        let inline = wr
            .flags
            .contains(SendFlags::INLINE)
            // SAFETY: the contract: an inline request's SGEs are readable.
            .then(|| unsafe { inline_bytes(sges) });
        decoded.push((wr, inline));
    }
    let sends: Vec<UserSend<'_>> = decoded
        .iter()
        .map(|(wr, inline)| UserSend {
            wr: *wr,
            inline: inline.as_deref(),
        })
        .collect();
    // SAFETY: as above, for the context.
    let result = match unsafe { provider(context) }.post_send(qp, &sends) {
        Ok(n) if bad => Err(refused_at(n, IbStatus::InvalidParameter)),
        other => other,
    };
    // SAFETY: as above, for `posted`.
    unsafe { posted_status(result, posted) }
}

fn refused_at(posted: usize, status: IbStatus) -> PostRefused {
    PostRefused { posted, status }
}

/// Receive descriptors decoded up to the first bad one (and whether one
/// was bad).
///
/// # Safety
/// `count` descriptors at `wrs`, each with its SGE list, valid for `'a`.
unsafe fn recv_wrs<'a>(wrs: *const RecvWrDesc, count: u32) -> (Vec<RecvWr<'a>>, bool) {
    // SAFETY: the caller's contract.
    let Some(descs) = (unsafe { items(wrs, count) }) else {
        return (Vec::new(), true);
    };
    let mut out = Vec::with_capacity(descs.len());
    for desc in descs {
        // SAFETY: the caller's contract.
        let Some(sges) = (unsafe { items(desc.sg_list, desc.num_sge) }) else {
            return (out, true);
        };
        match desc.decode(sges) {
            Ok(wr) => out.push(wr),
            Err(_) => return (out, true),
        }
    }
    (out, false)
}

/// A receive post's result, refusing the first bad descriptor after the
/// good ones before it were posted.
fn receives_result(result: Result<usize, PostRefused>, bad: bool) -> Result<usize, PostRefused> {
    match result {
        Ok(n) if bad => Err(refused_at(n, IbStatus::InvalidParameter)),
        other => other,
    }
}

unsafe extern "system" fn post_recv(
    context: *mut c_void,
    qp: u64,
    wrs: *const RecvWrDesc,
    count: u32,
    posted: *mut u32,
) -> u32 {
    // SAFETY: the entry point's contract for the descriptors.
    let (wrs, bad) = unsafe { recv_wrs(wrs, count) };
    // SAFETY: the context's contract.
    let result = unsafe { provider(context) }.post_recv(qp, &wrs);
    // SAFETY: the entry point's contract for `posted`.
    unsafe { posted_status(receives_result(result, bad), posted) }
}

unsafe extern "system" fn post_srq_recv(
    context: *mut c_void,
    srq: u64,
    wrs: *const RecvWrDesc,
    count: u32,
    posted: *mut u32,
) -> u32 {
    // SAFETY: the entry point's contract for the descriptors.
    let (wrs, bad) = unsafe { recv_wrs(wrs, count) };
    // SAFETY: the context's contract.
    let result = unsafe { provider(context) }.post_srq_recv(srq, &wrs);
    // SAFETY: the entry point's contract for `posted`.
    unsafe { posted_status(receives_result(result, bad), posted) }
}

unsafe extern "system" fn poll_cq(
    context: *mut c_void,
    cq: u64,
    wcs: *mut WorkCompletion,
    capacity: u32,
    polled: *mut u32,
) -> u32 {
    let out: &mut [WorkCompletion] = match (wcs.is_null(), capacity) {
        (true, 0) => &mut [],
        (true, _) => return INVALID,
        // SAFETY: the entry point's contract: `capacity` completions at
        // `wcs`, the caller's, for the call.
        (false, _) => unsafe { core::slice::from_raw_parts_mut(wcs, capacity as usize) },
    };
    // SAFETY: the context's contract.
    let result = unsafe { provider(context) }.poll_cq(cq, out);
    let (n, status) = match result {
        Ok(n) => (n, IbStatus::Success),
        Err(status) => (0, status),
    };
    if !polled.is_null() {
        // SAFETY: the entry point's contract.
        unsafe { polled.write(n as u32) };
    }
    code(status)
}

unsafe extern "system" fn arm_cq(context: *mut c_void, cq: u64, notify: u8) -> u32 {
    let Ok(notify) = CqNotify::from_code(notify) else {
        return INVALID;
    };
    // SAFETY: the context's contract.
    match unsafe { provider(context) }.arm_cq(cq, notify) {
        Ok(()) => code(IbStatus::Success),
        Err(status) => code(status),
    }
}

/// A plug-in's table as a [`UserVerbsProvider`]: what the access library
/// holds after loading the DLL. Releases the table when dropped.
#[derive(Debug)]
pub struct Table {
    table: UvpInterface,
}

// SAFETY: a table's entry points may be called from any thread (the
// `UserVerbsProvider` contract the table form shares), and its context is
// only passed back to them.
unsafe impl Send for Table {}
// SAFETY: as above.
unsafe impl Sync for Table {}

impl Table {
    /// The table a plug-in filled, checked ([`UvpInterface::check`]).
    ///
    /// # Safety
    /// `table` was filled by a plug-in's get-interface entry point, its
    /// entry points honour `ib_types::uvp`'s contracts, and it is released
    /// only by the returned value.
    pub unsafe fn new(table: UvpInterface) -> Result<Self, ib_types::AbiError> {
        table.check(UVP_INTERFACE_VERSION)?;
        Ok(Self { table })
    }

    fn call_abi(verb: VerbId, handle: u64, input: &[u8]) -> UvpCallAbi {
        UvpCallAbi {
            verb: verb.code(),
            reserved_at_0x2: 0,
            status: 0,
            handle,
            input: input.as_ptr(),
            input_len: input.len() as u64,
            private_in: core::ptr::null_mut(),
            private_in_capacity: 0,
            private_in_len: 0,
            private_out_max: 0,
            cookie: 0,
            output: core::ptr::null_mut(),
            output_len: 0,
            created: 0,
            private_out: core::ptr::null(),
            private_out_len: 0,
        }
    }

    fn status(code: u32) -> IbStatus {
        IbStatus::from_code(code).unwrap_or(IbStatus::GenericError)
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        if let Some(release) = self.table.release {
            // SAFETY: the table's context, released once (`new`'s contract).
            unsafe { release(self.table.context) };
        }
    }
}

impl UserVerbsProvider for Table {
    fn pre(&self, call: &mut PreCall<'_>) -> Result<PreOutcome, IbStatus> {
        let Some(pre) = self.table.hooks[hook_slot(call.verb)].pre else {
            return Ok(PreOutcome::Ioctl {
                private_in_len: 0,
                private_out_max: 0,
                cookie: 0,
            });
        };
        let mut abi = Self::call_abi(call.verb, call.handle, call.input);
        abi.private_in = call.private_in.as_mut_ptr();
        abi.private_in_capacity = call.private_in.len() as u64;
        abi.output = call.output.as_mut_ptr();
        abi.output_len = call.output.len() as u64;
        // SAFETY: the record's buffers are `call`'s, valid for the call;
        // the entry point honours the table's contract (`new`'s).
        let status = Self::status(unsafe { pre(self.table.context, &mut abi) });
        match status {
            IbStatus::Success => {
                let private_in_len = usize::try_from(abi.private_in_len)
                    .ok()
                    .filter(|&n| n <= call.private_in.len())
                    .ok_or(IbStatus::InvalidParameter)?;
                Ok(PreOutcome::Ioctl {
                    private_in_len,
                    private_out_max: usize::try_from(abi.private_out_max)
                        .map_err(|_| IbStatus::InvalidParameter)?,
                    cookie: abi.cookie,
                })
            }
            IbStatus::VerbsProcessingDone => Ok(PreOutcome::Done {
                handle: abi.created,
            }),
            failed => Err(failed),
        }
    }

    fn post(&self, call: &PostCall<'_>) -> Result<(), IbStatus> {
        let Some(post) = self.table.hooks[hook_slot(call.verb)].post else {
            return match call.status {
                IbStatus::Success => Ok(()),
                failed => Err(failed),
            };
        };
        let mut abi = Self::call_abi(call.verb, call.handle, call.input);
        abi.status = call.status.code();
        // The post reads the private input only: the capacity is its length.
        abi.private_in = call.private_in.as_ptr().cast_mut();
        abi.private_in_capacity = call.private_in.len() as u64;
        abi.private_in_len = call.private_in.len() as u64;
        abi.cookie = call.cookie;
        abi.output = call.output.as_ptr().cast_mut();
        abi.output_len = call.output.len() as u64;
        abi.created = call.created;
        abi.private_out = call.private_out.as_ptr();
        abi.private_out_len = call.private_out.len() as u64;
        // SAFETY: as for `pre`; a post only reads the record's buffers.
        match Self::status(unsafe { post(self.table.context, &abi) }) {
            IbStatus::Success => Ok(()),
            failed => Err(failed),
        }
    }

    fn post_send(&self, qp: u64, wrs: &[UserSend<'_>]) -> Result<usize, PostRefused> {
        let descs: Vec<SendWrDesc> = wrs.iter().map(|s| SendWrDesc::encode(&s.wr)).collect();
        let entry = self
            .table
            .post_send
            .ok_or(refused_at(0, IbStatus::Unsupported))?;
        let mut posted = 0u32;
        // SAFETY: the descriptors and their SGE lists (borrowed from
        // `wrs`) live across the call; an inline request's SGEs name the
        // caller's memory, which the table form reads (its contract).
        let status = Self::status(unsafe {
            entry(
                self.table.context,
                qp,
                descs.as_ptr(),
                descs.len() as u32,
                &mut posted,
            )
        });
        match status {
            IbStatus::Success => Ok(posted as usize),
            failed => Err(refused_at(posted as usize, failed)),
        }
    }

    fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused> {
        self.receives(self.table.post_recv, qp, wrs)
    }

    fn post_srq_recv(&self, srq: u64, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused> {
        self.receives(self.table.post_srq_recv, srq, wrs)
    }

    fn poll_cq(&self, cq: u64, out: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        let entry = self.table.poll_cq.ok_or(IbStatus::Unsupported)?;
        let mut polled = 0u32;
        let capacity = u32::try_from(out.len()).unwrap_or(u32::MAX);
        // SAFETY: `out` is the caller's, for the call.
        let status = Self::status(unsafe {
            entry(
                self.table.context,
                cq,
                out.as_mut_ptr(),
                capacity,
                &mut polled,
            )
        });
        match status {
            IbStatus::Success => Ok((polled as usize).min(out.len())),
            failed => Err(failed),
        }
    }

    fn arm_cq(&self, cq: u64, notify: CqNotify) -> Result<(), IbStatus> {
        let entry = self.table.arm_cq.ok_or(IbStatus::Unsupported)?;
        // SAFETY: plain values; the table's contract.
        match Self::status(unsafe { entry(self.table.context, cq, notify.code()) }) {
            IbStatus::Success => Ok(()),
            failed => Err(failed),
        }
    }
}

impl Table {
    fn receives(
        &self,
        entry: Option<ib_types::uvp::UvpPostRecvFn>,
        queue: u64,
        wrs: &[RecvWr<'_>],
    ) -> Result<usize, PostRefused> {
        let entry = entry.ok_or(refused_at(0, IbStatus::Unsupported))?;
        let descs: Vec<RecvWrDesc> = wrs.iter().map(RecvWrDesc::encode).collect();
        let mut posted = 0u32;
        // SAFETY: the descriptors and their SGE lists live across the call.
        let status = Self::status(unsafe {
            entry(
                self.table.context,
                queue,
                descs.as_ptr(),
                descs.len() as u32,
                &mut posted,
            )
        });
        match status {
            IbStatus::Success => Ok(posted as usize),
            failed => Err(refused_at(posted as usize, failed)),
        }
    }
}

#[cfg(windows)]
mod os {
    //! Ring memory from `VirtualAlloc` (committed, zero-filled pages).

    use core::ffi::c_void;

    use crate::provider::UserMemory;

    const MEM_COMMIT: u32 = 0x1000;
    const MEM_RESERVE: u32 = 0x2000;
    const MEM_RELEASE: u32 = 0x8000;
    const PAGE_READWRITE: u32 = 0x04;

    #[link(name = "kernel32")]
    unsafe extern "system" {
        fn VirtualAlloc(address: *mut c_void, size: usize, kind: u32, protect: u32) -> *mut c_void;
        fn VirtualFree(address: *mut c_void, size: usize, kind: u32) -> i32;
    }

    /// The process's virtual memory.
    pub(super) struct VirtualMemory;

    impl UserMemory for VirtualMemory {
        fn alloc(&self, len: usize) -> Option<u64> {
            // SAFETY: a fresh reservation; no existing memory is touched.
            let va = unsafe {
                VirtualAlloc(
                    core::ptr::null_mut(),
                    len,
                    MEM_COMMIT | MEM_RESERVE,
                    PAGE_READWRITE,
                )
            };
            (!va.is_null()).then_some(va as u64)
        }

        fn free(&self, va: u64) {
            // SAFETY: `va` is an allocation of `alloc` no object uses any
            // more (the provider frees after dropping its object).
            unsafe { VirtualFree(va as usize as *mut c_void, 0, MEM_RELEASE) };
        }
    }
}

#[cfg(all(test, not(windows)))]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::provider::UserMemory;

    /// Memory with none to give.
    struct NoMemory;

    impl UserMemory for NoMemory {
        fn alloc(&self, _: usize) -> Option<u64> {
            None
        }

        fn free(&self, _: u64) {}
    }

    /// The handover through the C record: a record missing a function is
    /// refused and stays the caller's; a whole one serves the next
    /// `uvp_get_interface` (its stores reach the host's hook) and is
    /// released once the platform is cleared and the instance released.
    #[test]
    fn the_platform_record_is_taken_whole_and_released_once() {
        let memory: Arc<dyn UserMemory> = Arc::new(NoMemory);
        let stores = Arc::new(Mutex::new(Vec::new()));
        let platform = || Platform {
            memory: Arc::clone(&memory),
            mmio: {
                let stores = Arc::clone(&stores);
                Arc::new(move |address, value| {
                    stores.lock().unwrap().push((address, value));
                })
            },
        };
        let mut partial = PlatformAbi::new(platform());
        let write64 = partial.write64.take();
        // SAFETY: a record of `PlatformAbi::new`, one function removed.
        let status = unsafe { uvp_set_platform(&partial) };
        assert_eq!(status, NtStatus::INVALID_PARAMETER);
        partial.write64 = write64;
        partial.release_unused();
        assert_eq!(Arc::strong_count(&memory), 1, "the refused record released");

        let whole = PlatformAbi::new(platform());
        // SAFETY: a whole record; the plug-in owns it from now on.
        let status = unsafe { uvp_set_platform(&whole) };
        assert_eq!(status, NtStatus::SUCCESS);
        let served = current_platform().expect("the record's platform");
        (served.mmio)(0x1000, 7);
        assert_eq!(served.memory.alloc(64), None);
        assert_eq!(*stores.lock().unwrap(), [(0x1000, 7)]);
        // SAFETY: null clears the platform.
        let status = unsafe { uvp_set_platform(core::ptr::null()) };
        assert_eq!(status, NtStatus::SUCCESS);
        assert_eq!(Arc::strong_count(&memory), 2, "held by `served` only");
        drop(served);
        assert_eq!(Arc::strong_count(&memory), 1, "released once");
    }
}
