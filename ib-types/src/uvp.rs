//! The user-mode verbs provider (UVP) interface: what the access library
//! (`ibal-user`) calls in the HCA vendor's plug-in (guide 6.2.2, 10).
//!
//! # Two forms of one contract
//!
//! - **The DLL's table** ([`UvpInterface`]): the plug-in exports
//!   [`UVP_GET_INTERFACE_SYMBOL`] ([`UvpGetInterfaceFn`]); the library asks
//!   for [`UVP_INTERFACE_VERSION`] and gets a `#[repr(C)]` table with one
//!   pre/post hook pair per verb (indexed by the verb's registry position,
//!   [`hook_slot`]) and the fast-path entry points. This is what crosses a
//!   DLL boundary on Windows.
//! - **The Rust trait** ([`UserVerbsProvider`]): the same hooks and entry
//!   points with borrowed slices instead of pointers. On Linux (the
//!   simulated platform) the library links the plug-in crate directly and
//!   holds it as a `dyn UserVerbsProvider`; the plug-in builds its exported
//!   table from its trait implementation, so both forms run the same code.
//!
//! # One call (guide Table 10-1)
//!
//! For a verb `V` the library builds `V::In` (its ABI bytes) and the target
//! handle, then:
//! 1. **pre** ([`PreCall`]): the plug-in may write private input bytes
//!    (the guide's `umv_buf`: ring layouts, PRM 13) and answers
//!    [`PreOutcome::Ioctl`] (send the IOCTL with that many private bytes,
//!    accept that many private output bytes, and hand `cookie` back to
//!    post) or [`PreOutcome::Done`] (`VERBS_PROCESSING_DONE`: the plug-in
//!    completed the call in user mode, e.g. user address vectors; it wrote
//!    `V::Out` and names the created handle; no IOCTL, no post). A failed
//!    pre (`Err(status)`) stops the call: no IOCTL, no post (row 4).
//! 2. The proxy IOCTL.
//! 3. **post** ([`PostCall`]) runs whenever the IOCTL ran, with its status,
//!    the response's handle, `V::Out` and private output. When the IOCTL
//!    failed, post releases what pre allocated and must answer `Err` (row
//!    3: the library treats `Ok` there as a plug-in bug). When the IOCTL
//!    succeeded and post fails, the library destroys the created object
//!    and returns post's status (row 2).
//!
//! The private bytes' layouts belong to the HCA's PRM (`hca_prm::uverbs`);
//! this module keeps them opaque.

use core::ffi::c_void;

use crate::interface::InterfaceVersion;
use crate::ioctl::{FUNCTION_BASE, VerbId};
use crate::status::{IbStatus, NtStatus};
use crate::wc::WorkCompletion;
use crate::wr::{RecvWr, SendWr};
use crate::wr_desc::{RecvWrDesc, SendWrDesc};

/// Version of the UVP interface this module describes. A table of another
/// major version, or of an older minor, is refused by the library.
pub const UVP_INTERFACE_VERSION: InterfaceVersion = InterfaceVersion::new(1, 0);

/// The exported name of the plug-in's [`UvpGetInterfaceFn`].
pub const UVP_GET_INTERFACE_SYMBOL: &str = "uvp_get_interface";

/// Hook slots in [`UvpInterface::hooks`]: one per verb of the registry.
pub const UVP_HOOK_SLOTS: usize = VerbId::ALL.len();

/// The slot of `verb`'s hooks in [`UvpInterface::hooks`].
pub const fn hook_slot(verb: VerbId) -> usize {
    (verb.code() - FUNCTION_BASE) as usize
}

/// What a pre hook decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreOutcome {
    /// Send the IOCTL with the first `private_in_len` bytes of
    /// [`PreCall::private_in`] and room for `private_out_max` bytes of
    /// private output; post receives `cookie`.
    Ioctl {
        /// Private input bytes written.
        private_in_len: usize,
        /// Private output bytes the plug-in accepts.
        private_out_max: usize,
        /// The plug-in's note to its post hook (what pre allocated).
        cookie: u64,
    },
    /// `VERBS_PROCESSING_DONE`: the call completed in user mode. `handle`
    /// is the created object's handle (for a create; else 0) and
    /// [`PreCall::output`] holds `V::Out`. No IOCTL and no post follow.
    Done {
        /// The created object's handle, or 0.
        handle: u64,
    },
}

/// A pre hook's view of one call.
#[derive(Debug)]
pub struct PreCall<'a> {
    /// The verb.
    pub verb: VerbId,
    /// The request header's handle (the target, or a create's parent).
    pub handle: u64,
    /// `V::In`, its ABI bytes.
    pub input: &'a [u8],
    /// Room for the private input bytes (the library's buffer).
    pub private_in: &'a mut [u8],
    /// `V::Out`'s ABI bytes (zeroed), written by a pre that answers
    /// [`PreOutcome::Done`].
    pub output: &'a mut [u8],
}

/// A post hook's view of one call whose IOCTL ran.
#[derive(Debug)]
pub struct PostCall<'a> {
    /// The verb.
    pub verb: VerbId,
    /// The request header's handle.
    pub handle: u64,
    /// `V::In`, its ABI bytes.
    pub input: &'a [u8],
    /// The private input pre wrote.
    pub private_in: &'a [u8],
    /// Pre's cookie.
    pub cookie: u64,
    /// The IOCTL's status.
    pub status: IbStatus,
    /// The response header's handle (the created object on success).
    pub created: u64,
    /// `V::Out`'s ABI bytes (all zero on failure).
    pub output: &'a [u8],
    /// The private output bytes (none on failure).
    pub private_out: &'a [u8],
}

/// A refused post of work requests: `posted` went before it, none after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostRefused {
    /// Requests posted (and announced to the device) before the refused one.
    pub posted: usize,
    /// Why the next one was refused.
    pub status: IbStatus,
}

/// A send work request as the Rust form posts it: the request, and for an
/// inline send (`SendFlags::INLINE`) the bytes its SGEs hold, which the
/// plug-in copies into the WQE (the DLL form reads them from the SGEs'
/// addresses instead).
#[derive(Debug, Clone, Copy)]
pub struct UserSend<'a> {
    /// The work request.
    pub wr: SendWr<'a>,
    /// The inline data, exactly for an inline send.
    pub inline: Option<&'a [u8]>,
}

/// The plug-in as the access library holds it in Rust (linked directly on
/// Linux). Every method may be called from any thread; a queue's posts and
/// a CQ's polls are serialized by the plug-in per object.
pub trait UserVerbsProvider: Send + Sync {
    /// The pre hook of every verb (step 1 above).
    fn pre(&self, call: &mut PreCall<'_>) -> Result<PreOutcome, IbStatus>;

    /// The post hook of every verb whose IOCTL ran (step 3 above).
    fn post(&self, call: &PostCall<'_>) -> Result<(), IbStatus>;

    /// Posts send work requests to the QP `qp` with no kernel call.
    fn post_send(&self, qp: u64, wrs: &[UserSend<'_>]) -> Result<usize, PostRefused>;

    /// Posts receive work requests to the QP `qp`'s receive queue.
    fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused>;

    /// Posts receive work requests to the SRQ `srq`.
    fn post_srq_recv(&self, srq: u64, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused>;

    /// Polls up to `out.len()` completions of the CQ `cq` into `out`.
    fn poll_cq(&self, cq: u64, out: &mut [WorkCompletion]) -> Result<usize, IbStatus>;

    /// Arms the CQ `cq` for its next (or next solicited) completion.
    fn arm_cq(&self, cq: u64, notify: crate::cq::CqNotify) -> Result<(), IbStatus>;
}

/// One call as the DLL table carries it, shared by pre and post. The
/// library owns every buffer; the plug-in writes only the fields marked
/// "pre writes".
#[derive(Debug)]
#[repr(C)]
pub struct UvpCallAbi {
    /// [`VerbId`] code.
    pub verb: u16,
    /// Reserved, zero.
    pub reserved_at_0x2: u16,
    /// Post: the IOCTL's [`IbStatus`] code.
    pub status: u32,
    /// The request header's handle.
    pub handle: u64,
    /// `V::In` bytes.
    pub input: *const u8,
    /// Bytes at `input` (`V::In`'s size).
    pub input_len: u64,
    /// The library's private input buffer.
    pub private_in: *mut u8,
    /// Bytes of room at `private_in`.
    pub private_in_capacity: u64,
    /// Pre writes: private input bytes written.
    pub private_in_len: u64,
    /// Pre writes: private output bytes accepted.
    pub private_out_max: u64,
    /// Pre writes: its note to post.
    pub cookie: u64,
    /// `V::Out` bytes: pre writes them when it answers
    /// `VerbsProcessingDone`; the library fills them before post.
    pub output: *mut u8,
    /// Bytes at `output` (`V::Out`'s size).
    pub output_len: u64,
    /// Post: the response's handle. Pre writes it with
    /// `VerbsProcessingDone` (a create's handle).
    pub created: u64,
    /// Post: the private output bytes.
    pub private_out: *const u8,
    /// Post: bytes at `private_out`.
    pub private_out_len: u64,
}

#[cfg(target_pointer_width = "64")]
assert_layout!(UvpCallAbi, size = 112, verb @ 0, reserved_at_0x2 @ 2, status @ 4, handle @ 8,
    input @ 16, input_len @ 24, private_in @ 32, private_in_capacity @ 40,
    private_in_len @ 48, private_out_max @ 56, cookie @ 64, output @ 72, output_len @ 80,
    created @ 88, private_out @ 96, private_out_len @ 104);

/// A pre hook: returns an [`IbStatus`] code; `Success` means "send the
/// IOCTL", `VerbsProcessingDone` "completed in user mode", anything else
/// stops the call.
pub type UvpPreFn = unsafe extern "system" fn(context: *mut c_void, call: *mut UvpCallAbi) -> u32;

/// A post hook: returns an [`IbStatus`] code.
pub type UvpPostFn =
    unsafe extern "system" fn(context: *mut c_void, call: *const UvpCallAbi) -> u32;

/// One verb's hooks; a verb whose hooks are `None` is sent as is.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct UvpVerbHooks {
    /// Before the IOCTL.
    pub pre: Option<UvpPreFn>,
    /// After it.
    pub post: Option<UvpPostFn>,
}

#[cfg(target_pointer_width = "64")]
assert_layout!(UvpVerbHooks, size = 16, pre @ 0, post @ 8);

/// Posts `count` send descriptors to the QP handle `qp`; `posted` receives
/// how many went before the first refusal. Returns an [`IbStatus`] code.
/// For an inline request the plug-in copies the bytes its SGEs name: they
/// must be the caller's readable memory for the call.
pub type UvpPostSendFn = unsafe extern "system" fn(
    context: *mut c_void,
    qp: u64,
    wrs: *const SendWrDesc,
    count: u32,
    posted: *mut u32,
) -> u32;

/// Posts `count` receive descriptors to a QP or SRQ handle.
pub type UvpPostRecvFn = unsafe extern "system" fn(
    context: *mut c_void,
    queue: u64,
    wrs: *const RecvWrDesc,
    count: u32,
    posted: *mut u32,
) -> u32;

/// Polls up to `capacity` completions of the CQ handle `cq` into `wcs`.
pub type UvpPollCqFn = unsafe extern "system" fn(
    context: *mut c_void,
    cq: u64,
    wcs: *mut WorkCompletion,
    capacity: u32,
    polled: *mut u32,
) -> u32;

/// Arms the CQ handle `cq`; `notify` is a [`crate::cq::CqNotify`] code.
pub type UvpArmCqFn = unsafe extern "system" fn(context: *mut c_void, cq: u64, notify: u8) -> u32;

/// Drops the plug-in instance the table's `context` names; the table is
/// unusable afterwards.
pub type UvpReleaseFn = unsafe extern "system" fn(context: *mut c_void);

/// The plug-in's table, filled by [`UvpGetInterfaceFn`].
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct UvpInterface {
    /// Bytes of the table the plug-in filled.
    pub size: u32,
    /// [`InterfaceVersion::packed`] of the plug-in's table.
    pub version: u16,
    /// Reserved, zero.
    pub reserved_at_0x6: u16,
    /// The plug-in instance, passed back to every entry point.
    pub context: *mut c_void,
    /// Drops the instance.
    pub release: Option<UvpReleaseFn>,
    /// Per verb, at [`hook_slot`].
    pub hooks: [UvpVerbHooks; UVP_HOOK_SLOTS],
    /// Fast path: post send.
    pub post_send: Option<UvpPostSendFn>,
    /// Fast path: post to a QP's receive queue.
    pub post_recv: Option<UvpPostRecvFn>,
    /// Fast path: post to an SRQ.
    pub post_srq_recv: Option<UvpPostRecvFn>,
    /// Fast path: poll a CQ.
    pub poll_cq: Option<UvpPollCqFn>,
    /// Fast path: arm a CQ.
    pub arm_cq: Option<UvpArmCqFn>,
}

#[cfg(target_pointer_width = "64")]
assert_layout!(UvpInterface, size = 656, size @ 0, version @ 4, reserved_at_0x6 @ 6,
    context @ 8, release @ 16, hooks @ 24, post_send @ 616, post_recv @ 624,
    post_srq_recv @ 632, poll_cq @ 640, arm_cq @ 648);

impl UvpInterface {
    /// Checks what a plug-in filled against what the library needs: at
    /// least this table's size, a version satisfying `required`, a release
    /// entry point and every fast-path entry point.
    pub fn check(&self, required: InterfaceVersion) -> Result<(), crate::AbiError> {
        let min = core::mem::size_of::<Self>();
        if (self.size as usize) < min {
            return Err(crate::AbiError::BadLength {
                field: "UvpInterface.size",
                declared: self.size.into(),
                available: min as u64,
            });
        }
        InterfaceVersion::from_packed(self.version).check(required)?;
        let complete = self.release.is_some()
            && self.post_send.is_some()
            && self.post_recv.is_some()
            && self.post_srq_recv.is_some()
            && self.poll_cq.is_some()
            && self.arm_cq.is_some();
        if !complete {
            return Err(crate::AbiError::OutOfRange {
                field: "UvpInterface (a missing entry point)",
                value: 0,
            });
        }
        Ok(())
    }
}

/// The plug-in's exported entry point: fills `table` with a new instance's
/// table for the library's `version` ([`InterfaceVersion::packed`]).
/// Returns `STATUS_SUCCESS`, or an error (a version it cannot serve, a
/// null table) with `table` untouched.
pub type UvpGetInterfaceFn =
    unsafe extern "system" fn(version: u16, table: *mut UvpInterface) -> NtStatus;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_slots_cover_the_registry() {
        assert_eq!(hook_slot(VerbId::OpenCa), 0);
        for (i, &verb) in VerbId::ALL.iter().enumerate() {
            assert_eq!(hook_slot(verb), i, "{verb:?}");
        }
        assert_eq!(UVP_HOOK_SLOTS, 37);
    }

    #[test]
    fn table_check() {
        extern "system" fn release(_: *mut c_void) {}
        extern "system" fn post(
            _: *mut c_void,
            _: u64,
            _: *const RecvWrDesc,
            _: u32,
            _: *mut u32,
        ) -> u32 {
            0
        }
        extern "system" fn send(
            _: *mut c_void,
            _: u64,
            _: *const SendWrDesc,
            _: u32,
            _: *mut u32,
        ) -> u32 {
            0
        }
        extern "system" fn poll(
            _: *mut c_void,
            _: u64,
            _: *mut WorkCompletion,
            _: u32,
            _: *mut u32,
        ) -> u32 {
            0
        }
        extern "system" fn arm(_: *mut c_void, _: u64, _: u8) -> u32 {
            0
        }
        let full = UvpInterface {
            size: core::mem::size_of::<UvpInterface>() as u32,
            version: InterfaceVersion::new(1, 2).packed(),
            reserved_at_0x6: 0,
            context: core::ptr::null_mut(),
            release: Some(release),
            hooks: [UvpVerbHooks {
                pre: None,
                post: None,
            }; UVP_HOOK_SLOTS],
            post_send: Some(send),
            post_recv: Some(post),
            post_srq_recv: Some(post),
            poll_cq: Some(poll),
            arm_cq: Some(arm),
        };
        assert_eq!(full.check(UVP_INTERFACE_VERSION), Ok(()));
        let mut small = full;
        small.size -= 8;
        assert!(small.check(UVP_INTERFACE_VERSION).is_err(), "too small");
        let mut other = full;
        other.version = InterfaceVersion::new(2, 0).packed();
        assert!(other.check(UVP_INTERFACE_VERSION).is_err(), "other major");
        let mut partial = full;
        partial.arm_cq = None;
        assert!(partial.check(UVP_INTERFACE_VERSION).is_err(), "no arm");
    }
}
