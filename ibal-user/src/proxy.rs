//! One verb through the proxy: the request framed as `ib_types::ioctl`
//! says, sent with the seam's `DeviceIoControl`, the answer decoded.

use ib_types::ioctl::{Verb, decode_response, encode_request, request_len, response_len};
use ib_types::status::IbStatus;

use crate::device::{DeviceFile, OsStatus};
use crate::error::{Error, Result};

/// Private output room offered to verbs whose answer carries a layout.
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
    /// The library refused before or after the call.
    Library(Error),
}

impl From<Error> for ExchangeError {
    fn from(e: Error) -> Self {
        Self::Library(e)
    }
}

/// Decodes an answer of `V`: its success, or the verb's status.
pub(crate) fn decode<V: Verb>(bytes: &[u8]) -> Result<Answer<V>> {
    let abi = |error| Error::Abi { verb: V::ID, error };
    let response = decode_response::<V>(bytes).map_err(abi)?;
    if !response.status.is_success() {
        return Err(Error::Verb {
            verb: V::ID,
            status: response.status,
        });
    }
    let output = response.output.ok_or(Error::Verb {
        verb: V::ID,
        status: IbStatus::InvalidParameter,
    })?;
    Ok(Answer {
        handle: response.handle,
        output,
        private: response.private.to_vec(),
    })
}

/// Sends `V` on `target` and decodes its answer.
pub(crate) fn call<V: Verb>(
    file: &dyn DeviceFile,
    target: u64,
    input: &V::In,
    private: &[u8],
    room: u32,
) -> Result<Answer<V>> {
    match exchange::<V>(file, target, input, private, room) {
        Ok(bytes) => decode::<V>(&bytes),
        Err(ExchangeError::Os(status)) => Err(os_failure::<V>(status)),
        Err(ExchangeError::Library(e)) => Err(e),
    }
}
