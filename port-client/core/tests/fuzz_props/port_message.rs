//! The property of the port client's fabric parsers
//! (`ib_port_client_core::message::Message::decode` for datagrams,
//! `check_payload` for RC payloads) and of the session fed with them.
//! Shared by the bounded property test (`tests/fuzz_port_message.rs`) and
//! the `port_message` cargo-fuzz target, which includes this file by path.
//!
//! - A datagram that decodes re-encodes to exactly its bytes and obeys
//!   every rule (a 24-bit QP number that is no special QP's, a 24-bit
//!   PSN, a buffer whose end does not overflow).
//! - Fed to a connected session: one that does not decode is counted as
//!   bad and changes nothing; one from a port that is not the peer changes
//!   nothing; none panics.
//! - An RC payload accepted by `check_payload` is exactly what `payload`
//!   writes for its round and direction; one refused is counted as bad
//!   and answered with nothing.

use ib_port_client_core::message::{
    ConnParams, Message, MessageKind, PayloadKind, check_payload, payload,
};
use ib_port_client_core::session::{Action, Phase, Session};

const RESPONDER: u64 = 0x0002_C900_0000_1001;
const INITIATOR: u64 = 0x0002_C900_0000_2001;

fn params(qpn: u32) -> ConnParams {
    ConnParams {
        qpn,
        psn: 0x10,
        rkey: 0x2000 + qpn,
        addr: 0x10_0000,
        len: 8192,
    }
}

fn datagram(actions: &[Action]) -> Vec<u8> {
    actions
        .iter()
        .find_map(|a| match a {
            Action::SendDatagram(m) => Some(m.encode().to_vec()),
            _ => None,
        })
        .expect("a datagram")
}

/// A connected pair (responder, initiator), through their own messages.
fn connected() -> (Session, Session) {
    let mut responder = Session::new(RESPONDER, params(0x40), 4);
    let mut initiator = Session::new(INITIATOR, params(0x41), 4);
    let _ = responder.start(false);
    let hello = datagram(&initiator.start(true));
    let _ = responder.on_datagram(&hello).expect("a valid hello");
    let ack = datagram(&responder.on_connected(true));
    let _ = initiator.on_datagram(&ack).expect("a valid ack");
    let _ = initiator.on_connected(true);
    assert_eq!(responder.phase(), Phase::Running);
    (responder, initiator)
}

/// Valid inputs: every kind of datagram and both payloads.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    let mut seeds: Vec<Vec<u8>> = [
        MessageKind::Hello,
        MessageKind::HelloAck,
        MessageKind::Goodbye,
        MessageKind::GoodbyeAck,
    ]
    .into_iter()
    .map(|kind| {
        Message {
            kind,
            port_guid: INITIATOR,
            params: params(0x41),
        }
        .encode()
        .to_vec()
    })
    .collect();
    seeds.push(payload(3, PayloadKind::Ping).to_vec());
    seeds.push(payload(3, PayloadKind::Pong).to_vec());
    seeds
}

/// Checks the property on `data`; returns whether it was accepted as a
/// datagram or a payload.
pub(crate) fn check(data: &[u8]) -> bool {
    let decoded = Message::decode(data);
    if let Ok(m) = &decoded {
        assert_eq!(&m.encode()[..], data, "re-encodes to its bytes");
        assert!((2..=0x00FF_FFFF).contains(&m.params.qpn));
        assert!(m.params.psn <= 0x00FF_FFFF);
        assert!(m.params.addr.checked_add(u64::from(m.params.len)).is_some());
    }

    let (mut responder, _initiator) = connected();
    let before = responder.counters();
    match responder.on_datagram(data) {
        Err(_) => {
            assert!(decoded.is_err());
            assert_eq!(responder.counters().bad_datagrams, before.bad_datagrams + 1);
            assert_eq!(responder.phase(), Phase::Running, "nothing changed");
        }
        Ok(actions) => {
            let m = decoded.as_ref().expect("decoded");
            if m.port_guid != INITIATOR {
                assert!(actions.is_empty(), "a stranger gets nothing");
                assert_eq!(responder.phase(), Phase::Running);
            }
        }
    }

    let checked = check_payload(data);
    if let Some((seq, kind)) = checked {
        assert_eq!(&payload(seq, kind)[..], data, "exactly the round's bytes");
    }
    let (mut responder, _initiator) = connected();
    let actions = responder.on_rc_received(data);
    if checked.is_none() {
        assert!(actions.is_empty());
        assert_eq!(responder.counters().bad_payloads, 1);
    }
    decoded.is_ok() || checked.is_some()
}
