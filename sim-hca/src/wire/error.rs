//! Why a frame was rejected (or could not be built), and the per-reason drop
//! counters the device keeps.
//!
//! Contract: every check in this module's siblings fails with exactly one
//! [`WireError`] variant; [`WireError::reason`] maps it to a field-less
//! [`DropReason`] that indexes a fixed counter array, so counting a drop on
//! the receive path is an array increment, not a string lookup.

/// A frame that failed to parse, or a packet that could not be emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The bytes end before a header does.
    #[error("{header}: truncated, need {needed} bytes, got {got}")]
    Truncated {
        /// The header being read.
        header: &'static str,
        /// Bytes the header needs.
        needed: usize,
        /// Bytes left in the frame.
        got: usize,
    },
    /// The Ethernet type is not IPv4 (VLAN tags and IPv6 are not supported).
    #[error("ethertype {ethertype:#06x} is not IPv4")]
    NotIpv4 {
        /// The ethertype found.
        ethertype: u16,
    },
    /// The IPv4 version nibble is not 4.
    #[error("IP version {version} in an IPv4 frame")]
    BadIpVersion {
        /// The version found.
        version: u8,
    },
    /// The IPv4 header carries options (IHL != 5), which are not supported.
    #[error("IPv4 header length {ihl} words: options are not supported")]
    Ipv4Options {
        /// The IHL found, in 32-bit words.
        ihl: u8,
    },
    /// The IPv4 header checksum does not verify (RFC 1071).
    #[error("bad IPv4 header checksum")]
    BadIpChecksum,
    /// The datagram is a fragment (MF set or a non-zero fragment offset).
    #[error("IPv4 fragment (RoCEv2 is never fragmented)")]
    Fragmented,
    /// The IPv4 protocol is not UDP.
    #[error("IP protocol {protocol} is not UDP")]
    NotUdp {
        /// The protocol found.
        protocol: u8,
    },
    /// The UDP destination port is not the RoCEv2 port 4791.
    #[error("UDP destination port {port} is not RoCEv2")]
    NotRoce {
        /// The port found.
        port: u16,
    },
    /// A length field disagrees with the bytes present.
    #[error("{field}: length {declared} does not fit the {available} bytes available")]
    BadLength {
        /// The field, as `header.field`.
        field: &'static str,
        /// What the field declares.
        declared: usize,
        /// What is actually there.
        available: usize,
    },
    /// The BTH transport header version is not 0.
    #[error("BTH TVer {tver} is not 0")]
    BadTver {
        /// The version found.
        tver: u8,
    },
    /// The BTH opcode is not one this device implements.
    #[error("unknown BTH opcode {opcode:#04x}")]
    UnknownOpcode {
        /// The opcode found.
        opcode: u8,
    },
    /// The AETH syndrome is reserved.
    #[error("reserved AETH syndrome {syndrome:#04x}")]
    BadSyndrome {
        /// The syndrome found.
        syndrome: u8,
    },
    /// The pad count does not make payload + pad a multiple of 4 bytes, or is
    /// non-zero on a packet without payload.
    #[error("pad count {pad} does not fit {bytes} bytes of payload and pad")]
    BadPad {
        /// The pad count found (or asked for).
        pad: u8,
        /// Bytes between the last header and the ICRC.
        bytes: usize,
    },
    /// The opcode carries no payload but the packet does.
    #[error("{opcode} carries no payload, found {len} bytes")]
    UnexpectedPayload {
        /// The opcode's name.
        opcode: &'static str,
        /// Payload bytes found.
        len: usize,
    },
    /// The invariant CRC does not match the packet.
    #[error("bad ICRC: computed {computed:#010x}, found {found:#010x}")]
    BadIcrc {
        /// The CRC computed over the received bytes.
        computed: u32,
        /// The CRC the frame carries.
        found: u32,
    },
    /// Emit: the extension headers given do not match the opcode's layout.
    #[error("{opcode} needs extension headers {expected}, got {got}")]
    ExtMismatch {
        /// The opcode's name.
        opcode: &'static str,
        /// The layout the opcode table prescribes.
        expected: &'static str,
        /// The layout supplied.
        got: &'static str,
    },
    /// Emit: the payload slice is not as long as the repr says.
    #[error("payload is {got} bytes, the repr says {declared}")]
    PayloadMismatch {
        /// The repr's payload length.
        declared: usize,
        /// The slice's length.
        got: usize,
    },
    /// Emit: the packet would exceed the 65535-byte IPv4 datagram limit.
    #[error("packet of {len} IP bytes exceeds the IPv4 limit")]
    TooLong {
        /// The IPv4 total length it would need.
        len: usize,
    },
    /// Emit: the output buffer is shorter than the packet.
    #[error("output buffer of {got} bytes, need {needed}")]
    BufferTooSmall {
        /// Bytes the packet needs.
        needed: usize,
        /// Bytes supplied.
        got: usize,
    },
}

impl WireError {
    /// The counter this error is tallied under.
    pub const fn reason(&self) -> DropReason {
        match self {
            Self::Truncated { .. } => DropReason::Truncated,
            Self::NotIpv4 { .. } => DropReason::NotIpv4,
            Self::BadIpVersion { .. } => DropReason::BadIpVersion,
            Self::Ipv4Options { .. } => DropReason::Ipv4Options,
            Self::BadIpChecksum => DropReason::BadIpChecksum,
            Self::Fragmented => DropReason::Fragmented,
            Self::NotUdp { .. } => DropReason::NotUdp,
            Self::NotRoce { .. } => DropReason::NotRoce,
            Self::BadLength { .. } => DropReason::BadLength,
            Self::BadTver { .. } => DropReason::BadTver,
            Self::UnknownOpcode { .. } => DropReason::UnknownOpcode,
            Self::BadSyndrome { .. } => DropReason::BadSyndrome,
            Self::BadPad { .. } => DropReason::BadPad,
            Self::UnexpectedPayload { .. } => DropReason::UnexpectedPayload,
            Self::BadIcrc { .. } => DropReason::BadIcrc,
            Self::ExtMismatch { .. } => DropReason::ExtMismatch,
            Self::PayloadMismatch { .. } => DropReason::PayloadMismatch,
            Self::TooLong { .. } => DropReason::TooLong,
            Self::BufferTooSmall { .. } => DropReason::BufferTooSmall,
        }
    }

    /// The stable snake_case name of this error's drop counter.
    pub const fn counter_name(&self) -> &'static str {
        self.reason().name()
    }
}

/// Declares [`DropReason`] with its counter names in one list.
macro_rules! drop_reasons {
    ($($(#[$meta:meta])* $variant:ident => $name:literal,)+) => {
        /// A [`WireError`] without its details: the index of a drop counter.
        ///
        /// `as usize` (or [`DropReason::index`]) is dense from 0, so a device
        /// keeps `[u64; DropReason::COUNT]` and bumps one slot per drop.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u8)]
        pub enum DropReason {
            $($(#[$meta])* $variant,)+
        }

        impl DropReason {
            /// Every reason, in counter-index order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];
            /// How many reasons (the length of a counter array).
            pub const COUNT: usize = Self::ALL.len();

            /// The stable snake_case counter name (for statistics output).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                }
            }

            /// The counter-array index, `0..COUNT`.
            pub const fn index(self) -> usize {
                self as usize
            }
        }
    };
}

drop_reasons! {
    /// [`WireError::Truncated`].
    Truncated => "truncated",
    /// [`WireError::NotIpv4`].
    NotIpv4 => "not_ipv4",
    /// [`WireError::BadIpVersion`].
    BadIpVersion => "bad_ip_version",
    /// [`WireError::Ipv4Options`].
    Ipv4Options => "ipv4_options",
    /// [`WireError::BadIpChecksum`].
    BadIpChecksum => "bad_ip_checksum",
    /// [`WireError::Fragmented`].
    Fragmented => "fragmented",
    /// [`WireError::NotUdp`].
    NotUdp => "not_udp",
    /// [`WireError::NotRoce`].
    NotRoce => "not_roce",
    /// [`WireError::BadLength`].
    BadLength => "bad_length",
    /// [`WireError::BadTver`].
    BadTver => "bad_tver",
    /// [`WireError::UnknownOpcode`].
    UnknownOpcode => "unknown_opcode",
    /// [`WireError::BadSyndrome`].
    BadSyndrome => "bad_syndrome",
    /// [`WireError::BadPad`].
    BadPad => "bad_pad",
    /// [`WireError::UnexpectedPayload`].
    UnexpectedPayload => "unexpected_payload",
    /// [`WireError::BadIcrc`].
    BadIcrc => "bad_icrc",
    /// [`WireError::ExtMismatch`] (emit only).
    ExtMismatch => "ext_mismatch",
    /// [`WireError::PayloadMismatch`] (emit only).
    PayloadMismatch => "payload_mismatch",
    /// [`WireError::TooLong`] (emit only).
    TooLong => "too_long",
    /// [`WireError::BufferTooSmall`] (emit only).
    BufferTooSmall => "buffer_too_small",
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_dense_and_names_unique() {
        for (i, reason) in DropReason::ALL.iter().enumerate() {
            assert_eq!(reason.index(), i);
        }
        let mut names: Vec<_> = DropReason::ALL.iter().map(|r| r.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), DropReason::COUNT);
        assert!(names.iter().all(|n| {
            n.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        }));
    }

    #[test]
    fn errors_map_to_their_counter() {
        assert_eq!(WireError::BadIpChecksum.counter_name(), "bad_ip_checksum");
        let e = WireError::BadIcrc {
            computed: 1,
            found: 2,
        };
        assert_eq!(e.reason(), DropReason::BadIcrc);
        assert_eq!(e.counter_name(), "bad_icrc");
        assert_eq!(
            WireError::NotRoce { port: 53 }.to_string(),
            "UDP destination port 53 is not RoCEv2"
        );
    }
}
