//! The port query both shells send (`ci::PortQuery`), the reading of its
//! answer (`ci::ports_from_answer`) and the pairing of a re-query with
//! what was known (`ci::changed_ports`).

use ib_types::ca::{Atomicity, CaAttr, CaAttrParts, CaCaps, CaLayout, CaLimits};
use ib_types::ioctl::{QueryCa, QueryCaOut, Verb, decode_request, encode_response, response_len};
use ib_types::scalars::{Gid, NodeGuid, PKey, PortGuid, PortNum, SystemImageGuid};
use ib_types::status::{IbStatus, NtStatus};
use ibal_bus_core::ci::{
    PortIdentity, PortQuery, QUERY_CA_ROOM, changed_ports, ports_from_answer, update_known_ports,
};

/// A valid attribute block of a CA with no ports.
fn portless_block() -> Vec<u8> {
    let parts = CaAttrParts {
        attr: CaAttr {
            node_guid: NodeGuid::new(0x0002_C903_0000_1000),
            system_image_guid: SystemImageGuid::new(0x0002_C903_0000_1003),
            vendor_id: 0x0002C9,
            device_id: 0x1003,
            revision: 0xA0,
            fw_version: 0x0002_0009_1000,
            limits: CaLimits::default(),
            local_ack_delay: 15,
            atomicity: Atomicity::None,
            caps: CaCaps::RC | CaCaps::UD,
            layout: CaLayout::default(),
        },
        page_sizes: &[4096],
        ports: &[],
        vendor_data: &[],
    };
    let mut block = vec![0; parts.encoded_len().unwrap()];
    assert_eq!(parts.encode(&mut block), Ok(block.len()));
    block
}

/// The response bytes a CA answers a `QueryCa` with: `block`, whose
/// size is `total_size` (more than `block` holds on an `Overflow`).
fn answer(status: IbStatus, total_size: usize, block: &[u8]) -> Vec<u8> {
    let output = QueryCaOut {
        total_size: total_size as u32,
    };
    let mut bytes = vec![0; response_len::<QueryCa>(block.len()).unwrap()];
    let len = encode_response::<QueryCa>(status, 0, Some(&output), block, &mut bytes).unwrap();
    bytes.truncate(len);
    bytes
}

fn port(num: u8, pkeys: &[u16], prefix: u64) -> PortIdentity {
    let guid = 0x0002_C903_0000_0100 + u64::from(num);
    PortIdentity {
        port_num: PortNum::new(num).unwrap(),
        port_guid: PortGuid::new(guid),
        pkeys: pkeys.iter().map(|raw| PKey::new(*raw)).collect(),
        gids: vec![Gid::from_parts(prefix, guid)],
    }
}

#[test]
fn the_port_query_is_a_query_ca_on_the_ca_with_room_for_the_block() {
    let query = PortQuery::new(0x42).unwrap();
    assert_eq!(query.ioctl, QueryCa::ID.ioctl().raw());
    let request = decode_request::<QueryCa>(&query.input).unwrap();
    assert_eq!(request.handle, 0x42);
    assert_eq!(request.private_out_max, QUERY_CA_ROOM);
    assert_eq!(
        Some(query.output_len),
        response_len::<QueryCa>(QUERY_CA_ROOM as usize)
    );
}

#[test]
fn a_good_answer_gives_the_ports_of_its_block() {
    let bytes = answer(IbStatus::Success, portless_block().len(), &portless_block());
    assert_eq!(ports_from_answer(NtStatus::SUCCESS, &bytes), Ok(vec![]));
}

#[test]
fn a_failed_request_refused_verb_or_garbage_gives_no_ports() {
    let bytes = answer(IbStatus::Success, portless_block().len(), &portless_block());
    assert_eq!(
        ports_from_answer(NtStatus::INSUFFICIENT_RESOURCES, &bytes),
        Err(IbStatus::from_ntstatus(NtStatus::INSUFFICIENT_RESOURCES))
    );
    let refused = answer(IbStatus::Overflow, portless_block().len(), &[]);
    assert_eq!(
        ports_from_answer(NtStatus::SUCCESS, &refused),
        Err(IbStatus::Overflow)
    );
    assert_eq!(
        ports_from_answer(NtStatus::SUCCESS, &[]),
        Err(IbStatus::GenericError)
    );
    assert_eq!(
        ports_from_answer(NtStatus::SUCCESS, &bytes[..bytes.len() - 1]),
        Err(IbStatus::GenericError)
    );
    // A well-framed answer whose attribute block is garbage.
    let block_len = portless_block().len();
    let mut garbage_block = bytes.clone();
    let block_start = garbage_block.len() - block_len;
    garbage_block[block_start..].fill(0xFF);
    assert_eq!(
        ports_from_answer(NtStatus::SUCCESS, &garbage_block),
        Err(IbStatus::GenericError)
    );
}

#[test]
fn changed_ports_pairs_by_number_only_ports_whose_tables_changed() {
    let old = vec![
        port(1, &[0xFFFF], 1),
        port(2, &[0xFFFF], 1),
        port(3, &[0xFFFF], 1),
    ];
    let new = vec![
        // Port 1 unchanged, port 2's P_Key table and port 3's GID table
        // changed, port 4 new (nothing to compare).
        port(1, &[0xFFFF], 1),
        port(3, &[0xFFFF], 2),
        port(2, &[0xFFFF, 0x8001], 1),
        port(4, &[0xFFFF], 1),
    ];
    assert_eq!(
        changed_ports(&old, &new),
        vec![
            (old[2].clone(), new[1].clone()),
            (old[1].clone(), new[2].clone()),
        ]
    );
    assert!(changed_ports(&old, &old).is_empty());
    assert!(changed_ports(&[], &new).is_empty());
}

#[test]
fn a_requery_replaces_the_known_ports_and_returns_the_changed_ones() {
    let mut known = vec![port(1, &[0xFFFF], 1), port(2, &[0xFFFF], 1)];
    let answered = vec![port(1, &[0xFFFF], 1), port(2, &[0xFFFF], 3)];
    let before = known.clone();
    assert_eq!(
        update_known_ports(&mut known, answered.clone()),
        vec![(before[1].clone(), answered[1].clone())]
    );
    assert_eq!(known, answered);
    assert!(update_known_ports(&mut known, answered.clone()).is_empty());
}
