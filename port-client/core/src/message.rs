//! The messages of the ping-pong ULP.
//!
//! **Datagrams** (UD, Q_Key [`PORT_CLIENT_QKEY`]): a fixed
//! [`WIRE_LEN`]-byte record, little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `IBPP` |
//! | 4 | 1 | version ([`VERSION`]) |
//! | 5 | 1 | kind ([`MessageKind`]) |
//! | 6 | 2 | reserved, zero |
//! | 8 | 8 | sender's port GUID |
//! | 16 | 4 | sender's RC QP number (24 bits) |
//! | 20 | 4 | sender's first send PSN (24 bits) |
//! | 24 | 4 | R_Key of the sender's buffer |
//! | 28 | 4 | length of the sender's buffer |
//! | 32 | 8 | address (IOVA) of the sender's buffer |
//!
//! A datagram comes from the fabric: [`Message::decode`] refuses anything
//! but exactly one well-formed record of a version it speaks, with a
//! [`MessageError`] saying why, and never panics.
//!
//! **RC payloads**: [`PAYLOAD_LEN`] bytes, the round's sequence number,
//! whether it is a ping or a pong, and a pattern derived from both, so
//! the receiver checks every byte ([`check_payload`]).

/// The Q_Key both peers' UD QPs use (a well-known value of this ULP; the
/// high bit clear, as for a non-privileged Q_Key).
pub const PORT_CLIENT_QKEY: u32 = 0x1B0C_0DE5;

/// The magic at the start of every datagram.
pub const MAGIC: [u8; 4] = *b"IBPP";

/// The version this core writes and reads.
pub const VERSION: u8 = 1;

/// Length of a datagram.
pub const WIRE_LEN: usize = 40;

/// Length of an RC ping or pong.
pub const PAYLOAD_LEN: usize = 64;

/// The largest 24-bit value (QP numbers, PSNs).
const MAX_24: u32 = 0x00FF_FFFF;

/// What a datagram says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    /// "Here are my RC parameters; connect to me and answer."
    Hello = 1,
    /// "I connected to you; here are mine."
    HelloAck = 2,
    /// "I am going down; tear your side down and answer."
    Goodbye = 3,
    /// "Torn down."
    GoodbyeAck = 4,
}

impl MessageKind {
    fn from_wire(byte: u8) -> Option<Self> {
        Some(match byte {
            1 => Self::Hello,
            2 => Self::HelloAck,
            3 => Self::Goodbye,
            4 => Self::GoodbyeAck,
            _ => return None,
        })
    }
}

/// One side's RC connection parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnParams {
    /// The RC QP's number (24 bits, not 0 or 1: those are special QPs).
    pub qpn: u32,
    /// The first PSN it sends with (24 bits).
    pub psn: u32,
    /// The R_Key of its registered buffer.
    pub rkey: u32,
    /// The buffer's address (IOVA).
    pub addr: u64,
    /// The buffer's length.
    pub len: u32,
}

/// A datagram of the ULP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    /// What it says.
    pub kind: MessageKind,
    /// The sender's port GUID.
    pub port_guid: u64,
    /// The sender's RC parameters.
    pub params: ConnParams,
}

/// Why a datagram was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageError {
    /// Not [`WIRE_LEN`] bytes.
    Length(usize),
    /// Not starting with [`MAGIC`].
    Magic,
    /// A version this core does not speak.
    Version(u8),
    /// An unknown kind.
    Kind(u8),
    /// Reserved bytes not zero.
    Reserved,
    /// A QP number beyond 24 bits or a special QP's.
    Qpn(u32),
    /// A PSN beyond 24 bits.
    Psn(u32),
    /// A buffer whose end overflows the address space.
    Range,
}

impl Message {
    /// The record's bytes.
    pub fn encode(&self) -> [u8; WIRE_LEN] {
        let mut out = [0; WIRE_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = self.kind as u8;
        out[8..16].copy_from_slice(&self.port_guid.to_le_bytes());
        out[16..20].copy_from_slice(&self.params.qpn.to_le_bytes());
        out[20..24].copy_from_slice(&self.params.psn.to_le_bytes());
        out[24..28].copy_from_slice(&self.params.rkey.to_le_bytes());
        out[28..32].copy_from_slice(&self.params.len.to_le_bytes());
        out[32..40].copy_from_slice(&self.params.addr.to_le_bytes());
        out
    }

    /// Parses one record from the fabric (untrusted).
    pub fn decode(bytes: &[u8]) -> Result<Self, MessageError> {
        let bytes: &[u8; WIRE_LEN] = bytes
            .try_into()
            .map_err(|_| MessageError::Length(bytes.len()))?;
        if bytes[0..4] != MAGIC {
            return Err(MessageError::Magic);
        }
        if bytes[4] != VERSION {
            return Err(MessageError::Version(bytes[4]));
        }
        let kind = MessageKind::from_wire(bytes[5]).ok_or(MessageError::Kind(bytes[5]))?;
        if bytes[6..8] != [0, 0] {
            return Err(MessageError::Reserved);
        }
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let u64_at = |at: usize| {
            let mut word = [0; 8];
            word.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(word)
        };
        let params = ConnParams {
            qpn: u32_at(16),
            psn: u32_at(20),
            rkey: u32_at(24),
            len: u32_at(28),
            addr: u64_at(32),
        };
        if !(2..=MAX_24).contains(&params.qpn) {
            return Err(MessageError::Qpn(params.qpn));
        }
        if params.psn > MAX_24 {
            return Err(MessageError::Psn(params.psn));
        }
        if params.addr.checked_add(u64::from(params.len)).is_none() {
            return Err(MessageError::Range);
        }
        Ok(Self {
            kind,
            port_guid: u64_at(8),
            params,
        })
    }
}

/// Whether a payload is a ping (sent by the initiator) or a pong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadKind {
    /// Initiator to responder.
    Ping = 0x50,
    /// Responder to initiator.
    Pong = 0x51,
}

fn pattern_byte(seq: u32, kind: PayloadKind, i: usize) -> u8 {
    // Every byte depends on one byte of the round, the direction and its
    // position, so a stale, reflected or shifted payload is caught.
    seq.to_le_bytes()[i % 4] ^ (kind as u8) ^ (i as u8).wrapping_mul(31)
}

/// The payload of round `seq` in direction `kind`.
pub fn payload(seq: u32, kind: PayloadKind) -> [u8; PAYLOAD_LEN] {
    let mut out = [0; PAYLOAD_LEN];
    out[0..4].copy_from_slice(&seq.to_le_bytes());
    out[4] = kind as u8;
    for (i, byte) in out.iter_mut().enumerate().skip(5) {
        *byte = pattern_byte(seq, kind, i);
    }
    out
}

/// The round and direction of a received payload, if every byte is what
/// [`payload`] writes for them.
pub fn check_payload(bytes: &[u8]) -> Option<(u32, PayloadKind)> {
    if bytes.len() != PAYLOAD_LEN {
        return None;
    }
    let seq = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let kind = match bytes[4] {
        0x50 => PayloadKind::Ping,
        0x51 => PayloadKind::Pong,
        _ => return None,
    };
    (payload(seq, kind)[..] == *bytes).then_some((seq, kind))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello() -> Message {
        Message {
            kind: MessageKind::Hello,
            port_guid: 0x0002_C900_0000_1001,
            params: ConnParams {
                qpn: 0x48,
                psn: 0x12_3456,
                rkey: 0xAABB_CC01,
                addr: 0x1_0000,
                len: 8192,
            },
        }
    }

    #[test]
    fn a_message_round_trips_and_each_rule_refuses_alone() {
        let m = hello();
        assert_eq!(Message::decode(&m.encode()), Ok(m));
        let bad = |edit: fn(&mut [u8; WIRE_LEN])| {
            let mut bytes = m.encode();
            edit(&mut bytes);
            Message::decode(&bytes)
        };
        assert_eq!(bad(|b| b[0] = b'X'), Err(MessageError::Magic));
        assert_eq!(bad(|b| b[4] = 2), Err(MessageError::Version(2)));
        assert_eq!(bad(|b| b[5] = 9), Err(MessageError::Kind(9)));
        assert_eq!(bad(|b| b[7] = 1), Err(MessageError::Reserved));
        assert_eq!(bad(|b| b[19] = 1), Err(MessageError::Qpn(0x0100_0048)));
        assert_eq!(
            bad(|b| b[16..20].copy_from_slice(&1u32.to_le_bytes())),
            Err(MessageError::Qpn(1))
        );
        assert_eq!(bad(|b| b[23] = 1), Err(MessageError::Psn(0x0112_3456)));
        assert_eq!(
            bad(|b| b[32..40].copy_from_slice(&u64::MAX.to_le_bytes())),
            Err(MessageError::Range)
        );
        assert_eq!(
            Message::decode(&m.encode()[..39]),
            Err(MessageError::Length(39))
        );
        let mut long = m.encode().to_vec();
        long.push(0);
        assert_eq!(Message::decode(&long), Err(MessageError::Length(41)));
    }

    #[test]
    fn payloads_are_checked_byte_for_byte() {
        let p = payload(7, PayloadKind::Ping);
        assert_eq!(check_payload(&p), Some((7, PayloadKind::Ping)));
        assert_eq!(
            check_payload(&payload(7, PayloadKind::Pong)),
            Some((7, PayloadKind::Pong))
        );
        for i in 0..PAYLOAD_LEN {
            let mut q = p;
            q[i] ^= 0x01;
            // Flipping the kind byte to another valid kind still fails the
            // pattern; any other flip fails the pattern or the kind.
            assert_eq!(check_payload(&q), None, "byte {i}");
        }
        assert_eq!(check_payload(&p[..63]), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Arbitrary bytes: never a panic; whatever decodes re-encodes to
        /// the same bytes (nothing accepted is lost or invented).
        #[test]
        fn arbitrary_bytes_decode_to_a_record_that_re_encodes_the_same(
            bytes in proptest::collection::vec(any::<u8>(), 0..96)
        ) {
            if let Ok(m) = Message::decode(&bytes) {
                prop_assert_eq!(&m.encode()[..], &bytes[..]);
            }
        }

        /// Mutations of a valid record: accepted exactly when every rule
        /// holds, and then with the fields the bytes say.
        #[test]
        fn mutated_records_are_accepted_only_when_valid(
            at in 0..WIRE_LEN, value in any::<u8>()
        ) {
            let mut bytes = hello().encode();
            bytes[at] = value;
            match Message::decode(&bytes) {
                Ok(m) => prop_assert_eq!(m.encode(), bytes),
                Err(MessageError::Magic) => prop_assert!(at < 4),
                Err(MessageError::Version(_)) => prop_assert_eq!(at, 4),
                Err(MessageError::Kind(_)) => prop_assert_eq!(at, 5),
                Err(MessageError::Reserved) => prop_assert!(at == 6 || at == 7),
                Err(MessageError::Qpn(_)) => prop_assert!((16..20).contains(&at)),
                Err(MessageError::Psn(_)) => prop_assert!((20..24).contains(&at)),
                Err(MessageError::Range) => prop_assert!(at >= 28),
                Err(MessageError::Length(_)) => prop_assert!(false),
            }
        }
    }
}
