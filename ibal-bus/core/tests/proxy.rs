//! The proxy's per-open table and its administrator IOCTL layout
//! (`ibal_bus_core::proxy`), without a host: creates recorded from
//! answers, destroys and `CloseCa` forgetting what went with them, an
//! answer that does not decode recording nothing, and the child-entry
//! layout parsed as hostile and round-tripping.

use ib_types::ioctl::{
    self as v, Empty, OpenCaIn, OpenCaOut, Verb, encode_request, encode_response, request_len,
    response_len,
};
use ib_types::status::{IbStatus, NtStatus};
use ibal_bus_core::children::{ChildEntry, EntryError};
use ibal_bus_core::proxy::{
    Checked, ChildEntryChange, ChildEntryError, Forwarded, OpenTable, Refusal,
};

fn request<V: Verb>(handle: u64, input: &V::In) -> (u32, Vec<u8>, usize) {
    let mut bytes = vec![0; request_len::<V>(0).unwrap()];
    encode_request::<V>(handle, input, &[], 0, &mut bytes).unwrap();
    (V::ID.ioctl().raw(), bytes, response_len::<V>(0).unwrap())
}

fn forward<V: Verb>(table: &OpenTable, handle: u64, input: &V::In) -> Result<Forwarded, Refusal> {
    let (code, bytes, out) = request::<V>(handle, input);
    match table.check(code, &bytes, out, false)? {
        Checked::Verb(f) => Ok(f),
        other => panic!("{other:?}"),
    }
}

fn answer<V: Verb>(handle: u64, output: Option<&V::Out>) -> Vec<u8> {
    let mut out = vec![0; response_len::<V>(0).unwrap()];
    encode_response::<V>(IbStatus::Success, handle, output, &[], &mut out).unwrap();
    out
}

#[test]
fn nothing_is_recorded_from_a_foreign_handle_a_failure_or_an_answer_that_does_not_decode() {
    let mut table = OpenTable::new();
    // Nothing is known yet: every handle is foreign.
    assert_eq!(
        forward::<v::AllocPd>(&table, 7, &Empty),
        Err(Refusal::ForeignHandle(ib_types::ioctl::ObjectKind::Ca))
    );
    let open = forward::<v::OpenCa>(&table, 0, &OpenCaIn::CURRENT).unwrap();
    // An answer that does not decode records nothing.
    assert_eq!(
        table.complete(&open, NtStatus::SUCCESS, &[0xFF; 8]),
        NtStatus::INVALID_DEVICE_STATE
    );
    assert!(table.is_empty());
    // A failure from below is passed on, nothing recorded.
    assert_eq!(
        table.complete(&open, NtStatus::ACCESS_DENIED, &[]),
        NtStatus::ACCESS_DENIED
    );
    assert!(table.is_empty());
}

#[test]
fn a_pd_is_recorded_under_its_ca_and_close_ca_forgets_both() {
    let mut table = OpenTable::new();
    let open = forward::<v::OpenCa>(&table, 0, &OpenCaIn::CURRENT).unwrap();
    let out = open_answer(0xCA, v::PROXY_ABI_VERSION);
    assert_eq!(
        table.complete(&open, NtStatus::SUCCESS, &out),
        NtStatus::SUCCESS
    );
    assert!(table.owns(v::ObjectKind::Ca, 0xCA));
    let alloc = forward::<v::AllocPd>(&table, 0xCA, &Empty).unwrap();
    let pd_answer = answer::<v::AllocPd>(0x10, Some(&Empty));
    assert_eq!(
        table.complete(&alloc, NtStatus::SUCCESS, &pd_answer),
        NtStatus::SUCCESS
    );
    assert!(table.owns(v::ObjectKind::Pd, 0x10));
    let close = forward::<v::CloseCa>(&table, 0xCA, &Empty).unwrap();
    let closed = answer::<v::CloseCa>(0, Some(&Empty));
    table.complete(&close, NtStatus::SUCCESS, &closed);
    assert!(table.is_empty(), "the CA context and its PD are gone");
}

#[test]
fn an_answer_from_a_kernel_speaking_another_abi_version_records_no_open() {
    let mut table = OpenTable::new();
    let open = forward::<v::OpenCa>(&table, 0, &OpenCaIn::CURRENT).unwrap();
    let out = open_answer(0xCA, ib_types::interface::InterfaceVersion::new(2, 0));
    assert_eq!(
        table.complete(&open, NtStatus::SUCCESS, &out),
        NtStatus::INVALID_DEVICE_STATE
    );
    assert!(table.is_empty());
}

/// A successful `OpenCa` answer with handle `ca` from a kernel speaking
/// `version` (encoded by hand: the encoder refuses versions it cannot
/// serve).
fn open_answer(ca: u64, version: ib_types::interface::InterfaceVersion) -> Vec<u8> {
    let out = OpenCaOut {
        version: v::PROXY_ABI_VERSION,
        ca_guid: ib_types::scalars::NodeGuid::new(0x0002_C900_0000_0001),
        vendor_id: 0x02C9,
        device_id: 1,
        revision: 1,
        doorbell: None,
        uvp_name: ib_types::interface::UvpName::new("uvp").unwrap(),
    };
    let mut bytes = vec![0; response_len::<v::OpenCa>(0).unwrap()];
    encode_response::<v::OpenCa>(IbStatus::Success, ca, Some(&out), &[], &mut bytes).unwrap();
    // OpenCaOutAbi.abi_version, just after the response header.
    bytes[16..18].copy_from_slice(&version.packed().to_le_bytes());
    bytes
}

#[test]
fn the_child_entry_layout_round_trips_and_refuses_hostile_input() {
    let entry = ChildEntry {
        name: "Storage".into(),
        device_id: "IBA\\STORAGE".into(),
        hardware_ids: vec!["IBA\\STORAGE".into()],
        compatible_ids: vec![],
        description: "Storage".into(),
        pkey: ib_types::scalars::PKey::new(0x8001),
    };
    for change in [
        ChildEntryChange::Add(entry.clone()),
        ChildEntryChange::Remove("Storage".into()),
    ] {
        let bytes = change.encode().unwrap();
        assert_eq!(ChildEntryChange::parse(&bytes), Ok(change));
    }
    let good = ChildEntryChange::Add(entry.clone()).encode().unwrap();
    let cases: Vec<(Vec<u8>, ChildEntryError)> = vec![
        (vec![], ChildEntryError::BadLength),
        (good[..good.len() - 1].to_vec(), ChildEntryError::BadLength),
        ([&good[..], &[0]].concat(), ChildEntryError::BadLength),
        (
            {
                let mut b = good.clone();
                b[0] = 3;
                b
            },
            ChildEntryError::BadOperation(3),
        ),
        (
            {
                let mut b = good.clone();
                b[5] = 1;
                b
            },
            ChildEntryError::ReservedNotZero,
        ),
        (
            {
                let mut b = good.clone();
                b[8] = 0xC3;
                b
            },
            ChildEntryError::NotAscii,
        ),
        (
            {
                let mut b = good.clone();
                b[6..8].copy_from_slice(&0x8000u16.to_le_bytes());
                b
            },
            ChildEntryError::Entry(EntryError::BadPartitionKey(0x8000)),
        ),
        (
            {
                let mut b = good.clone();
                b[8] = b' ';
                b
            },
            ChildEntryError::Entry(EntryError::BadName),
        ),
        (
            // A removal carrying a device ID.
            vec![2, 1, 1, 0, 0, 0, 0, 0, b'a', b'b'],
            ChildEntryError::ReservedNotZero,
        ),
    ];
    for (bytes, want) in cases {
        assert_eq!(ChildEntryChange::parse(&bytes), Err(want), "{bytes:?}");
    }
}

#[test]
fn the_admin_ioctl_needs_an_administrator_before_its_input_is_read() {
    let table = OpenTable::new();
    let code = ibal_bus_core::proxy::IOCTL_IBAL_CHILD_ENTRY.raw();
    assert_eq!(
        table.check(code, &[], 0, false),
        Err(Refusal::NotAdministrator)
    );
    assert_eq!(
        table.check(code, &[], 0, true),
        Err(Refusal::BadChildEntry(ChildEntryError::BadLength))
    );
}
