//! The property of the proxy request framing (`ib_types::ioctl`) under
//! hostile bytes, shared by the bounded property test
//! (`tests/fuzz_proxy.rs`) and the `proxy` cargo-fuzz target
//! (`fuzz/fuzz_targets/proxy.rs`), which includes this file by path.
//!
//! For every verb of the registry, the bytes are read both as a request
//! (what the kernel sees from user mode) and as a response (what the
//! library sees from the kernel). Whatever decodes must re-encode to
//! exactly the same bytes, agree with the framing rules (the handle is
//! present exactly when the verb has a target, or for a successful
//! create; the private bytes are the tail), and refuse to encode into a
//! buffer one byte short without touching it. The first four bytes also
//! go through the IOCTL code decoder, which must round-trip.

use ib_types::AbiError;
use ib_types::ioctl::*;
use ib_types::status::IbStatus;

/// Checks the property on one input; panics on a violation. Returns how
/// many (verb, direction) decoders accepted the bytes.
pub(crate) fn check(bytes: &[u8]) -> usize {
    let accepted = every_verb(bytes);
    if let Some(code) = bytes.first_chunk::<4>() {
        let code = IoctlCode::from_raw(u32::from_le_bytes(*code));
        let rebuilt = IoctlCode::new(
            code.device_type(),
            code.function(),
            code.method(),
            code.access(),
        );
        assert_eq!(rebuilt, Some(code), "IOCTL code fields round trip");
        if let Ok(verb) = VerbId::from_ioctl(code) {
            assert_eq!(verb.ioctl(), code, "an accepted code is the verb's own");
        }
    }
    accepted
}

/// Re-encodes into a buffer of exactly `len` bytes and into one a byte
/// short (which must be refused and left untouched).
fn reencode(len: usize, encode: impl Fn(&mut [u8]) -> Result<usize, AbiError>) -> Vec<u8> {
    let mut again = vec![0xA5; len];
    assert_eq!(encode(&mut again), Ok(len), "re-encoded length");
    if len > 0 {
        let mut short = vec![0x5A; len - 1];
        assert!(
            matches!(encode(&mut short), Err(AbiError::Truncated { .. })),
            "a short buffer is refused"
        );
        assert!(
            short.iter().all(|&b| b == 0x5A),
            "a refused encode writes nothing"
        );
    }
    again
}

fn request<V: Verb>(bytes: &[u8]) -> bool {
    let Ok(req) = decode_request::<V>(bytes) else {
        return false;
    };
    let what = V::ID.name();
    assert_eq!(
        reencode(bytes.len(), |out| req.encode(out)),
        bytes,
        "{what}"
    );
    assert_eq!(req.handle != 0, V::ID.target().is_some(), "{what} handle");
    assert_eq!(
        request_len::<V>(req.private.len()),
        Some(bytes.len()),
        "{what} framing"
    );
    assert!(
        bytes.ends_with(req.private),
        "{what} private bytes are the tail"
    );
    true
}

fn response<V: Verb>(bytes: &[u8]) -> bool {
    let Ok(resp) = decode_response::<V>(bytes) else {
        return false;
    };
    let what = V::ID.name();
    assert_eq!(
        reencode(bytes.len(), |out| resp.encode(out)),
        bytes,
        "{what}"
    );
    assert_ne!(
        resp.status,
        IbStatus::Pending,
        "{what}: a response is final"
    );
    let creates = V::ID.creates().is_some() && resp.status.is_success();
    assert_eq!(resp.handle != 0, creates, "{what} handle");
    assert!(
        resp.status.is_success() || resp.private.is_empty(),
        "{what}: a failure carries no private bytes"
    );
    if resp.status.is_success() {
        assert!(
            resp.output.is_some(),
            "{what}: a success carries its output"
        );
    }
    assert_eq!(
        response_len::<V>(resp.private.len()),
        Some(bytes.len()),
        "{what} framing"
    );
    true
}

/// Runs `request` and `response` for each listed verb, and checks the
/// list is the whole registry in order.
macro_rules! every_verb {
    ($($verb:ident),+ $(,)?) => {
        fn every_verb(bytes: &[u8]) -> usize {
            let mut accepted = 0;
            $(
                accepted += usize::from(request::<$verb>(bytes));
                accepted += usize::from(response::<$verb>(bytes));
            )+
            accepted
        }

        /// The verbs this property covers, in registry order.
        pub(crate) const COVERED: &[VerbId] = &[$(<$verb as Verb>::ID),+];
    };
}

every_verb!(
    OpenCa,
    CloseCa,
    QueryCa,
    ModifyCa,
    AllocPd,
    DeallocPd,
    CreateAv,
    QueryAv,
    ModifyAv,
    DestroyAv,
    CreateQp,
    QueryQp,
    ModifyQp,
    DestroyQp,
    CreateCq,
    QueryCq,
    ResizeCq,
    DestroyCq,
    CreateSrq,
    QuerySrq,
    ModifySrq,
    DestroySrq,
    RegMr,
    RegSharedMr,
    ReregMr,
    QueryMr,
    DeregMr,
    AllocMw,
    QueryMw,
    DeallocMw,
    AttachMcast,
    DetachMcast,
    WaitCqEvent,
    GetAsyncEvent,
    RegPhysMr,
    LocalMad,
    ReregPhysMr,
);

/// A request of `V` with the given handle, input and private bytes.
fn request_bytes<V: Verb>(handle: u64, input: &V::In, private: &[u8]) -> Vec<u8> {
    let len = request_len::<V>(private.len()).expect("small private");
    let mut out = vec![0; len];
    encode_request::<V>(handle, input, private, 64, &mut out).expect("a valid seed request");
    out
}

/// A failed response of `V` (no output, no private bytes).
fn failed_response<V: Verb>(status: IbStatus) -> Vec<u8> {
    let mut out = vec![0; response_len::<V>(0).expect("no private")];
    encode_response::<V>(status, 0, None, &[], &mut out).expect("a valid seed response");
    out
}

/// Valid inputs made by the encoders: seeds for the fuzzer's corpus and
/// the starting points of the property test's mutations.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    use ib_types::cq::CqAttr;
    use ib_types::scalars::PortNum;

    let mut mad = [0u8; MAD_SIZE];
    mad[..4].copy_from_slice(&[1, 1, 1, 1]);
    vec![
        request_bytes::<OpenCa>(0, &OpenCaIn::CURRENT, &[]),
        request_bytes::<CloseCa>(1, &Empty, b"vendor"),
        request_bytes::<AllocPd>(2, &Empty, &[]),
        request_bytes::<CreateCq>(
            3,
            &CqAttr {
                cqe: 256,
                comp_vector: 0,
            },
            &[0; 32],
        ),
        request_bytes::<LocalMad>(
            4,
            &LocalMadIn {
                port: PortNum::FIRST,
                mad,
            },
            &[],
        ),
        failed_response::<CreateQp>(IbStatus::InvalidParameter),
        failed_response::<CreateCq>(IbStatus::InsufficientResources),
    ]
}
