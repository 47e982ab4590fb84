//! The property of the user-mode proxy's per-open policy
//! (`ibal_bus_core::proxy::OpenTable::check`) and of the administrator
//! IOCTL's parser (`ChildEntryChange::parse`) under hostile requests.
//! Shared by the bounded property test (`tests/fuzz_proxy_open.rs`) and
//! the `proxy_open` cargo-fuzz target, which includes this file by path.
//!
//! The bytes are a script: byte 0 picks the caller (bit 0: administrator)
//! and the code (bit 1: the administrator IOCTL; otherwise byte 1 picks a
//! verb and byte 2, when non-zero, flips bits of its code); bytes 3 and 4
//! are the output length; the rest is the input. The open owns one CA
//! context, [`OWNED_CA`], recorded from a well-formed `OpenCa` answer.
//!
//! - The check is total and deterministic.
//! - Nothing not owned gets through: a verb accepted with a target names
//!   [`OWNED_CA`] or an object of it (only the CA is owned, so the header
//!   handle is [`OWNED_CA`] and the verb targets a CA); an accepted verb is
//!   open to user mode, its code is exactly the verb's, and the output
//!   holds the response header and fixed output.
//! - A caller that is not an administrator never gets the child-list
//!   change; an administrator's parsed change re-encodes to the same bytes
//!   and an added entry passes every rule of the list.

use ib_types::interface::UvpName;
use ib_types::ioctl::{
    self as v, Empty, OpenCaIn, OpenCaOut, PROXY_ABI_VERSION, RESPONSE_HEADER_SIZE, Verb, VerbId,
    encode_request, encode_response, request_len, response_len,
};
use ib_types::scalars::{NodeGuid, PKey};
use ib_types::status::{IbStatus, NtStatus};
use ibal_bus_core::children::{ChildEntry, check_entry};
use ibal_bus_core::proxy::{Checked, ChildEntryChange, IOCTL_IBAL_CHILD_ENTRY, OpenTable, Refusal};

/// The CA handle the open owns.
pub(crate) const OWNED_CA: u64 = 0xCA;

/// An open owning [`OWNED_CA`], recorded through the table's own path.
fn table() -> OpenTable {
    let mut table = OpenTable::new();
    let mut request = vec![0; request_len::<v::OpenCa>(0).unwrap_or(0)];
    let code = v::OpenCa::ID.ioctl().raw();
    let out_len = response_len::<v::OpenCa>(0).unwrap_or(0);
    let _ = encode_request::<v::OpenCa>(0, &OpenCaIn::CURRENT, &[], 0, &mut request);
    let Ok(Checked::Verb(open)) = table.check(code, &request, out_len, false) else {
        return table;
    };
    let Ok(uvp_name) = UvpName::new("uvp") else {
        return table;
    };
    let answer = OpenCaOut {
        version: PROXY_ABI_VERSION,
        ca_guid: NodeGuid::new(0x0002_C900_0000_0001),
        vendor_id: 0x02C9,
        device_id: 1,
        revision: 1,
        doorbell: None,
        uvp_name,
    };
    let mut out = vec![0; out_len];
    if encode_response::<v::OpenCa>(IbStatus::Success, OWNED_CA, Some(&answer), &[], &mut out)
        .is_ok()
    {
        table.complete(&open, NtStatus::SUCCESS, &out);
    }
    table
}

/// Runs the script; true when the request was let through.
pub(crate) fn check(data: &[u8]) -> bool {
    let table = table();
    assert!(table.owns(v::ObjectKind::Ca, OWNED_CA), "the seed open");
    let [select, verb_pick, flip, out_lo, out_hi, input @ ..] = data else {
        return false;
    };
    let is_admin = select & 1 != 0;
    let verb = VerbId::ALL[usize::from(*verb_pick) % VerbId::ALL.len()];
    let code = if select & 2 != 0 {
        IOCTL_IBAL_CHILD_ENTRY.raw()
    } else {
        verb.ioctl().raw() ^ (u32::from(*flip) << 14)
    };
    let output_len = usize::from(u16::from_le_bytes([*out_lo, *out_hi]));
    let verdict = table.check(code, input, output_len, is_admin);
    assert_eq!(
        verdict,
        table.check(code, input, output_len, is_admin),
        "deterministic"
    );
    match verdict {
        Ok(Checked::Verb(forwarded)) => {
            let verb = forwarded.verb();
            assert_eq!(code, verb.ioctl().raw(), "exactly the verb's code");
            assert!(verb.user_mode_allowed());
            assert!(output_len >= RESPONSE_HEADER_SIZE + verb.out_size());
            if verb.target().is_some() {
                assert_eq!(verb.target(), Some(v::ObjectKind::Ca), "only a CA is owned");
                let handle = input.get(..8).and_then(|h| <[u8; 8]>::try_from(h).ok());
                assert_eq!(handle.map(u64::from_le_bytes), Some(OWNED_CA));
            }
            true
        }
        Ok(Checked::ChildEntry(change)) => {
            assert!(is_admin, "an administrator's only");
            assert_eq!(
                change.encode().as_deref(),
                Some(input),
                "re-encodes the same"
            );
            if let ChildEntryChange::Add(entry) = &change {
                assert_eq!(check_entry(entry), Ok(()));
            }
            true
        }
        Err(Refusal::NotAdministrator) => {
            assert!(!is_admin && code == IOCTL_IBAL_CHILD_ENTRY.raw());
            false
        }
        Err(refusal) => {
            assert!(!refusal.nt_status().is_success());
            false
        }
    }
}

/// Valid scripts: verbs on the owned CA and child-list changes.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    fn verb<V: Verb>(handle: u64, input: &V::In, room: u32) -> Vec<u8> {
        let index = VerbId::ALL.iter().position(|v| *v == V::ID).unwrap_or(0) as u8;
        let out = response_len::<V>(room as usize).unwrap_or(0) as u16;
        let mut bytes = vec![0; request_len::<V>(0).unwrap_or(0)];
        let _ = encode_request::<V>(handle, input, &[], room, &mut bytes);
        let [lo, hi] = out.to_le_bytes();
        [vec![0, index, 0, lo, hi], bytes].concat()
    }
    let entry = ChildEntry {
        name: "Storage".into(),
        device_id: "IBA\\STORAGE".into(),
        hardware_ids: vec!["IBA\\STORAGE".into()],
        compatible_ids: vec!["IBA\\PORT_CLIENT".into()],
        description: "Storage".into(),
        pkey: PKey::new(0x8001),
    };
    let mut seeds = vec![
        verb::<v::OpenCa>(0, &OpenCaIn::CURRENT, 0),
        verb::<v::AllocPd>(OWNED_CA, &Empty, 0),
        verb::<v::QueryCa>(OWNED_CA, &Empty, 4096),
        verb::<v::CloseCa>(OWNED_CA, &Empty, 0),
    ];
    for change in [
        ChildEntryChange::Add(entry),
        ChildEntryChange::Remove("Storage".into()),
    ] {
        if let Some(bytes) = change.encode() {
            seeds.push([vec![3, 0, 0, 0, 0], bytes].concat());
        }
    }
    seeds
}
