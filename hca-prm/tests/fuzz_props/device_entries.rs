//! The property of the event and completion entries the driver core reads
//! from device memory (`hca_prm::eqe`, `hca_prm::cqe`, PRM 10.4 and 11):
//! device memory is untrusted for a driver too. Shared by the bounded
//! property test (`tests/fuzz_device_entries.rs`) and the
//! `device_entries` cargo-fuzz target, which includes this file by path.
//!
//! The input is cut into 32-byte entries; each is read both as an EQE and
//! as a CQE. Whatever decodes re-encodes, through the encoders the device
//! model uses, into an entry that decodes to the same event or work
//! completion and that carries the same bytes in every field the decoded
//! value uses. The owner bit an encoder writes is the one the reader
//! accepts.

use hca_prm::cqe::{Cqe, CqeFlags, CqeOp};
use hca_prm::eqe::{Eqe, Event, PORT_CHANGE_ACTIVE, PORT_CHANGE_DOWN};
use zerocopy::FromBytes;

/// Checks the property on one input; panics on a violation. Returns how
/// many entries decoded (as an EQE or a CQE).
pub(crate) fn check(bytes: &[u8]) -> usize {
    let mut decoded = 0;
    for (n, entry) in bytes.chunks_exact(32).enumerate() {
        let eqe = Eqe::read_from_bytes(entry).expect("32 bytes");
        let cqe = Cqe::read_from_bytes(entry).expect("32 bytes");
        decoded += usize::from(check_eqe(&eqe));
        // The entry's position stands for the driver's wr_id lookup.
        decoded += usize::from(check_cqe(&cqe, n as u64));
        // Owner bits: what an encoder writes for a counter is what the
        // reader expects there, and never what it expects a lap later.
        let counter = u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]);
        let log = entry[4] % 24;
        let lap = counter.wrapping_add(1 << log);
        assert!(eqe.with_owner(counter, log).is_valid(counter, log));
        assert!(!eqe.with_owner(counter, log).is_valid(lap, log));
        assert!(cqe.with_owner(counter, log).is_valid(counter, log));
        assert!(!cqe.with_owner(counter, log).is_valid(lap, log));
    }
    decoded
}

fn check_eqe(raw: &Eqe) -> bool {
    let Ok(event) = raw.decode() else {
        return false;
    };
    let again = Eqe::new(event);
    assert_eq!(
        again.decode(),
        Ok(event),
        "EQE re-encodes to the same event"
    );
    assert_eq!(again.event_type, raw.event_type, "{event:?} type");
    match event {
        Event::CmdCompletion { .. } => {
            assert_eq!(
                (again.token, again.status, again.out_imm),
                (raw.token, raw.status, raw.out_imm),
                "{event:?} command fields"
            );
        }
        Event::Catastrophic => {}
        Event::PortChange { .. } => {
            assert!(matches!(raw.subtype, PORT_CHANGE_ACTIVE | PORT_CHANGE_DOWN));
            assert_eq!(again.subtype, raw.subtype, "{event:?} subtype");
            assert_eq!(again.object, raw.object, "{event:?} port");
        }
        _ => assert_eq!(again.object, raw.object, "{event:?} object"),
    }
    true
}

fn check_cqe(raw: &Cqe, wr_id: u64) -> bool {
    let Ok(wc) = raw.to_work_completion(wr_id) else {
        return false;
    };
    assert_eq!(wc.wr_id, wr_id);
    assert_eq!(wc.status.code(), raw.status, "status");
    assert_eq!(wc.qp_num.get(), raw.qpn.get(), "QPN");
    assert_eq!(wc.byte_len, raw.byte_count.get(), "byte count");
    let op = raw.op().expect("a completion's op decodes");
    let (qpn, src_qp) = (wc.qp_num, wc.src_qp);
    let again = match op {
        CqeOp::Send(opcode) => {
            assert!(raw.flags().is_empty(), "a send completion has no flags");
            Cqe::new_send(qpn, raw.wqe_index(), opcode, wc.status)
        }
        CqeOp::Recv(recv) => Cqe::new_recv(qpn, raw.wqe_index(), recv, wc.status, wc.byte_len)
            .with_details(raw.flags().intersection(CqeFlags::DETAILS)),
    }
    .with_byte_count(wc.byte_len)
    .with_vendor_err(raw.vendor_err)
    .with_source(src_qp, raw.pkey_index.get(), raw.slid.get(), raw.sl);
    assert_eq!(again.op(), Ok(op), "CQE re-encodes to the same op");
    assert_eq!(
        again.to_work_completion(wr_id),
        Ok(wc),
        "CQE re-encodes to the same work completion"
    );
    assert_eq!(again.wqe_index(), raw.wqe_index(), "WQE index");
    true
}

/// Entries the encoders write: seeds for the fuzzer's corpus and the
/// property test's mutations.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    use hca_prm::cqe::RecvOp;
    use hca_prm::wqe::WqeOpcode;
    use ib_types::scalars::{PortNum, Qpn};
    use ib_types::wc::WcStatus;
    use zerocopy::IntoBytes;

    let qpn = Qpn::new(0x12).expect("24 bits");
    let entries = [
        Eqe::new(Event::Completion { cqn: 3 }).as_bytes().to_vec(),
        Eqe::new(Event::PortChange {
            port: PortNum::FIRST,
            active: true,
        })
        .with_owner(1 << 8, 8)
        .as_bytes()
        .to_vec(),
        Eqe::new(Event::CmdCompletion {
            token: 7,
            status: 0,
            out_imm: 0x1234,
        })
        .as_bytes()
        .to_vec(),
        Eqe::new(Event::QpFatal { qpn }).as_bytes().to_vec(),
        Cqe::new_send(qpn, 5, WqeOpcode::RdmaWrite, WcStatus::Success)
            .as_bytes()
            .to_vec(),
        Cqe::new_recv(
            qpn,
            9,
            RecvOp::SendImm(ib_types::abi::Be32::new(0xABCD)),
            WcStatus::Success,
            100,
        )
        .with_details(CqeFlags::GRH)
        .with_owner(3, 4)
        .as_bytes()
        .to_vec(),
    ];
    let mut seeds: Vec<Vec<u8>> = entries.to_vec();
    seeds.push(entries.concat());
    seeds
}
