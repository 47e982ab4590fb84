//! One verb, called as the guide's Table 10-1 prescribes: the plugin's
//! pre hook, the proxy IOCTL (framed as `ib_types::ioctl` says, sent with
//! the seam's `DeviceIoControl`), the plugin's post hook seeing the
//! IOCTL's status, and the release of an object whose post failed.
//!
//! | row | pre | IOCTL | post | the library |
//! |---|---|---|---|---|
//! | 1 | ok | ok | ok | returns the answer |
//! | 2 | ok | ok | fails | destroys the created object (through the hooks), returns post's status ([`Error::PostCall`]) |
//! | 3 | ok | fails | fails | returns the IOCTL's status; a post answering success here is a plugin bug ([`Error::PluginBug`]) |
//! | 4 | fails | — | — | returns pre's status ([`Error::PreCall`]) |
//!
//! `PreOutcome::Done` (`VERBS_PROCESSING_DONE`) completes the call in user
//! mode: no IOCTL, no post. Without a plugin the IOCTL is sent alone.

use ib_types::abi::Repr;
use ib_types::ioctl::{
    self as v, Empty, RESPONSE_HEADER_SIZE, ResponseHeaderAbi, Verb, VerbId, decode_response,
    encode_request, request_len, response_len,
};
use ib_types::status::IbStatus;
use ib_types::uvp::{PostCall, PreCall, PreOutcome, UserVerbsProvider};
use zerocopy::{FromBytes, IntoBytes};

use crate::device::{DeviceFile, OsStatus};
use crate::error::{Error, Result};

/// Private input room offered to the plugin's pre hook, and the private
/// output room of a call with no plugin whose answer carries a layout.
pub(crate) const ROOM: u32 = 256;

/// A successful answer, owned.
#[derive(Debug)]
pub(crate) struct Answer<V: Verb> {
    /// The created object's handle, or 0.
    pub(crate) handle: u64,
    /// The verb's fixed output.
    pub(crate) output: V::Out,
    /// The private output.
    pub(crate) private: Vec<u8>,
}

/// The error of an OS-level failure of verb `V`: the verb's IB status when
/// the NTSTATUS carries one, else the OS status.
pub(crate) fn os_failure<V: Verb>(status: OsStatus) -> Error {
    match status {
        OsStatus::Nt(nt) => Error::Verb {
            verb: V::ID,
            status: IbStatus::from_ntstatus(nt),
        },
        OsStatus::Win32(_) => Error::Os {
            what: "DeviceIoControl",
            status,
        },
    }
}

/// The IB status a post hook sees for an IOCTL that failed with `status`.
fn ioctl_status(status: OsStatus) -> IbStatus {
    match status {
        OsStatus::Nt(nt) => IbStatus::from_ntstatus(nt),
        OsStatus::Win32(_) => IbStatus::GenericError,
    }
}

/// Why a call failed, with what the callers that look closer need.
#[derive(Debug)]
pub(crate) enum Failure<V: Verb> {
    /// The IOCTL failed at the OS level (post saw its status).
    Os(OsStatus),
    /// The kernel answered the verb's failure (post saw it); `output` for
    /// a verb that reports a size with `Overflow`.
    Status {
        /// The verb's status.
        status: IbStatus,
        /// Its fixed output, when the failure carries one.
        output: Option<V::Out>,
    },
    /// The answer does not decode (post saw `InvalidParameter`; an object
    /// the header names as created was released): the bytes received.
    Malformed {
        /// What is wrong.
        error: Error,
        /// The answer.
        bytes: Vec<u8>,
    },
    /// Any other refusal (a hook's, the library's).
    Other(Error),
}

impl<V: Verb> Failure<V> {
    /// The error a caller sees.
    pub(crate) fn into_error(self) -> Error {
        match self {
            Self::Os(status) => os_failure::<V>(status),
            Self::Status { status, .. } => Error::Verb {
                verb: V::ID,
                status,
            },
            Self::Malformed { error, .. } | Self::Other(error) => error,
        }
    }
}

impl<V: Verb> From<Error> for Failure<V> {
    fn from(e: Error) -> Self {
        Self::Other(e)
    }
}

/// What one IOCTL came back with, as post sees it.
struct Ioctl<V: Verb> {
    status: IbStatus,
    created: u64,
    output: Vec<u8>,
    private: Vec<u8>,
    /// Why the call fails when `status` is not success.
    failure: Option<Failure<V>>,
    /// An object the kernel created whose answer the library refuses.
    orphan: u64,
}

/// Sends `V` and reads its answer, never failing: a failure is a status
/// for post, with its reason kept.
fn ioctl<V: Verb>(
    file: &dyn DeviceFile,
    target: u64,
    input: &V::In,
    private: &[u8],
    room: u32,
) -> Ioctl<V> {
    let failed = |status, failure| Ioctl {
        status,
        created: 0,
        output: vec![0; V::ID.out_size()],
        private: Vec::new(),
        failure: Some(failure),
        orphan: 0,
    };
    let bytes = match exchange::<V>(file, target, input, private, room) {
        Ok(bytes) => bytes,
        Err(ExchangeError::Os(status)) => {
            return failed(ioctl_status(status), Failure::Os(status));
        }
        Err(ExchangeError::Library(e)) => return failed(IbStatus::InvalidParameter, e.into()),
    };
    match decode_response::<V>(&bytes) {
        Ok(response) if response.status == IbStatus::Success => Ioctl {
            status: response.status,
            created: response.handle,
            output: bytes[RESPONSE_HEADER_SIZE..RESPONSE_HEADER_SIZE + V::ID.out_size()].to_vec(),
            private: response.private.to_vec(),
            failure: None,
            orphan: 0,
        },
        Ok(response) => failed(
            response.status,
            Failure::Status {
                status: response.status,
                output: response.output,
            },
        ),
        Err(error) => {
            // The kernel may have created an object whose answer we
            // refuse: it is released, so nothing stays open.
            let orphan = match ResponseHeaderAbi::read_from_prefix(&bytes) {
                Ok((header, _)) if header.status.get() == IbStatus::Success.code() => {
                    header.handle.get()
                }
                _ => 0,
            };
            let error = Error::Abi { verb: V::ID, error };
            Ioctl {
                orphan,
                ..failed(
                    IbStatus::InvalidParameter,
                    Failure::Malformed { error, bytes },
                )
            }
        }
    }
}

/// Calls `V` on `target` through `uvp`'s hooks (Table 10-1, module docs),
/// or alone without a plugin. `room` is private output room the library
/// itself needs (its own answer, as `QueryCa`'s attributes), offered on
/// top of what the plugin accepts.
pub(crate) fn run<V: Verb>(
    file: &dyn DeviceFile,
    uvp: Option<&dyn UserVerbsProvider>,
    target: u64,
    input: &V::In,
    room: u32,
) -> core::result::Result<Answer<V>, Failure<V>> {
    let in_abi = input.emit();
    let in_bytes = in_abi.as_bytes();
    let mut private_in = vec![0u8; if uvp.is_some() { ROOM as usize } else { 0 }];
    let mut output = vec![0u8; V::ID.out_size()];
    let abi = |error| Error::Abi { verb: V::ID, error };
    let Some(uvp) = uvp else {
        return finish(file, None, ioctl::<V>(file, target, input, &[], room));
    };
    let mut pre = PreCall {
        verb: V::ID,
        handle: target,
        input: in_bytes,
        private_in: &mut private_in,
        output: &mut output,
    };
    let (private_in_len, private_out_max, cookie) = match uvp.pre(&mut pre) {
        Err(status) => {
            return Err(Error::PreCall {
                verb: V::ID,
                status,
            }
            .into());
        }
        Ok(PreOutcome::Done { handle }) => {
            let (output, _) = V::Out::decode(&output).map_err(abi)?;
            return Ok(Answer {
                handle,
                output,
                private: Vec::new(),
            });
        }
        Ok(PreOutcome::Ioctl {
            private_in_len,
            private_out_max,
            cookie,
        }) => (private_in_len, private_out_max, cookie),
    };
    let private = &private_in[..private_in_len.min(private_in.len())];
    let answer = match u32::try_from(private_out_max) {
        Ok(out_max) if private_in_len <= ROOM as usize => {
            ioctl::<V>(file, target, input, private, out_max.max(room))
        }
        // A pre that overran its buffer or asked for more than an IOCTL
        // can carry: no IOCTL, and post releases what pre allocated.
        _ => Ioctl {
            status: IbStatus::InvalidParameter,
            created: 0,
            output: vec![0; V::ID.out_size()],
            private: Vec::new(),
            failure: Some(
                Error::PluginBug {
                    verb: V::ID,
                    status: IbStatus::InvalidParameter,
                }
                .into(),
            ),
            orphan: 0,
        },
    };
    let post = PostCall {
        verb: V::ID,
        handle: target,
        input: in_bytes,
        private_in: private,
        cookie,
        status: answer.status,
        created: answer.created,
        output: &answer.output,
        private_out: &answer.private,
    };
    let posted = uvp.post(&post);
    match (answer.status == IbStatus::Success, posted) {
        (true, Ok(())) | (false, Err(_)) => finish(file, Some(uvp), answer),
        (true, Err(status)) => {
            // Row 2: the kernel created it, the plugin refused it.
            release(file, Some(uvp), V::ID, answer.created);
            Err(Error::PostCall {
                verb: V::ID,
                status,
            }
            .into())
        }
        (false, Ok(())) => {
            release(file, Some(uvp), V::ID, answer.orphan);
            Err(Error::PluginBug {
                verb: V::ID,
                status: answer.status,
            }
            .into())
        }
    }
}

/// The answer of a call whose hooks agreed with the IOCTL.
fn finish<V: Verb>(
    file: &dyn DeviceFile,
    uvp: Option<&dyn UserVerbsProvider>,
    answer: Ioctl<V>,
) -> core::result::Result<Answer<V>, Failure<V>> {
    if let Some(failure) = answer.failure {
        release(file, uvp, V::ID, answer.orphan);
        return Err(failure);
    }
    let (output, _) =
        V::Out::decode(&answer.output).map_err(|error| Error::Abi { verb: V::ID, error })?;
    Ok(Answer {
        handle: answer.created,
        output,
        private: answer.private,
    })
}

/// Destroys object `handle` that `created_by` made (through the hooks);
/// nothing for 0 or a verb that creates nothing.
pub(crate) fn release(
    file: &dyn DeviceFile,
    uvp: Option<&dyn UserVerbsProvider>,
    created_by: VerbId,
    handle: u64,
) {
    if handle == 0 {
        return;
    }
    let _ = match created_by {
        VerbId::OpenCa => call::<v::CloseCa>(file, uvp, handle, &Empty).map(drop),
        VerbId::AllocPd => call::<v::DeallocPd>(file, uvp, handle, &Empty).map(drop),
        VerbId::CreateAv => call::<v::DestroyAv>(file, uvp, handle, &Empty).map(drop),
        VerbId::CreateCq => call::<v::DestroyCq>(file, uvp, handle, &Empty).map(drop),
        VerbId::CreateQp => call::<v::DestroyQp>(file, uvp, handle, &Empty).map(drop),
        VerbId::CreateSrq => call::<v::DestroySrq>(file, uvp, handle, &Empty).map(drop),
        VerbId::RegMr | VerbId::RegSharedMr | VerbId::RegPhysMr => {
            call::<v::DeregMr>(file, uvp, handle, &Empty).map(drop)
        }
        VerbId::AllocMw => call::<v::DeallocMw>(file, uvp, handle, &Empty).map(drop),
        VerbId::AttachMcast => call::<v::DetachMcast>(file, uvp, handle, &Empty).map(drop),
        _ => Ok(()),
    };
}

/// Sends `V` and returns the raw answer bytes (`out[..returned]`).
pub(crate) fn exchange<V: Verb>(
    file: &dyn DeviceFile,
    target: u64,
    input: &V::In,
    private: &[u8],
    room: u32,
) -> core::result::Result<Vec<u8>, ExchangeError> {
    let abi = |error| Error::Abi { verb: V::ID, error };
    let len =
        request_len::<V>(private.len()).ok_or(Error::InvalidArgument("private input too long"))?;
    let mut request = vec![0; len];
    encode_request::<V>(target, input, private, room, &mut request).map_err(abi)?;
    let out_len = response_len::<V>(room as usize)
        .ok_or(Error::InvalidArgument("private output room too large"))?;
    let mut out = vec![0; out_len];
    let returned = file
        .ioctl(V::ID.ioctl().raw(), &request, &mut out)
        .map_err(ExchangeError::Os)?;
    out.truncate(returned.min(out_len));
    Ok(out)
}

/// Why an exchange failed: the OS status (kept raw for the callers that
/// look at it) or a library error.
#[derive(Debug)]
pub(crate) enum ExchangeError {
    /// The request failed with this status.
    Os(OsStatus),
    /// The library refused before the call.
    Library(Error),
}

impl From<Error> for ExchangeError {
    fn from(e: Error) -> Self {
        Self::Library(e)
    }
}

/// Calls `V` on `target` (through the hooks when `uvp` is a plugin).
pub(crate) fn call<V: Verb>(
    file: &dyn DeviceFile,
    uvp: Option<&dyn UserVerbsProvider>,
    target: u64,
    input: &V::In,
) -> Result<Answer<V>> {
    run::<V>(file, uvp, target, input, 0).map_err(Failure::into_error)
}
