//! The RoCEv2 invariant CRC (IBA Annex A17, after IBA 7.8.1).
//!
//! The ICRC is the Ethernet CRC-32 (reflected polynomial 0x04C11DB7, initial
//! value all ones, final complement: the CRC of zlib and IEEE 802.3) over:
//! 1. eight bytes of 0xFF, standing in for the IB Local Route Header that
//!    RoCEv2 does not carry;
//! 2. the IPv4 header with TOS, TTL and header checksum set to all ones (the
//!    fields a router may change);
//! 3. the UDP header with its checksum set to all ones;
//! 4. the BTH with byte 4 (FECN, BECN, reserved) set to all ones;
//! 5. the rest of the IB packet: extension headers, payload and pad.
//!
//! It is appended after the pad as four bytes, least significant first.
//!
//! Contract: [`compute`] takes the IPv4 datagram up to (not including) the
//! ICRC, never allocates (the masked fields are patched in a 40-byte stack
//! copy) and fails only if the datagram is shorter than its fixed headers.
//! Only IPv4 without options is supported, as in the rest of [`wire`](super).

use super::WireError;
use super::bth::Bth;
use super::ipv4;
use super::udp;

/// Bytes of the ICRC on the wire.
pub const ICRC_LEN: usize = 4;

/// IPv4 + UDP + BTH: the part of the datagram with masked fields.
const MASKED_LEN: usize = ipv4::HEADER_LEN + udp::HEADER_LEN + size_of::<Bth>();

/// Offsets (from the IPv4 header) of the variant bytes, set to 0xFF.
const MASKED_BYTES: [usize; 7] = [
    1,                                                      // IPv4 TOS
    8,                                                      // IPv4 TTL
    10,                                                     // IPv4 header checksum, high
    11,                                                     // IPv4 header checksum, low
    ipv4::HEADER_LEN + 6,                                   // UDP checksum, high
    ipv4::HEADER_LEN + 7,                                   // UDP checksum, low
    ipv4::HEADER_LEN + udp::HEADER_LEN + Bth::VARIANT_BYTE, // BTH FECN/BECN/resv
];

/// CRC-32 of the eight 0xFF bytes that replace the LRH, precomputed so each
/// packet starts from it (checked against a fresh hash in the tests).
const LRH_PREFIX_CRC: u32 = 0x2144_DF1C;

/// The ICRC of an IPv4 datagram (IPv4 header through the pad, without the
/// ICRC itself).
pub fn compute(datagram: &[u8]) -> Result<u32, WireError> {
    let Some((head, rest)) = datagram.split_first_chunk::<MASKED_LEN>() else {
        return Err(WireError::Truncated {
            header: "ICRC coverage",
            needed: MASKED_LEN,
            got: datagram.len(),
        });
    };
    let mut masked = *head;
    for offset in MASKED_BYTES {
        masked[offset] = 0xFF;
    }
    let mut hasher = crc32fast::Hasher::new_with_initial_len(LRH_PREFIX_CRC, 8);
    hasher.update(&masked);
    hasher.update(rest);
    Ok(hasher.finalize())
}

/// Checks the ICRC at the end of `datagram_with_icrc` (the IPv4 datagram
/// including its last four bytes).
pub fn verify(datagram_with_icrc: &[u8]) -> Result<(), WireError> {
    let Some((covered, trailer)) = datagram_with_icrc.split_last_chunk::<ICRC_LEN>() else {
        return Err(WireError::Truncated {
            header: "ICRC",
            needed: ICRC_LEN,
            got: datagram_with_icrc.len(),
        });
    };
    let found = u32::from_le_bytes(*trailer);
    let computed = compute(covered)?;
    if computed == found {
        Ok(())
    } else {
        Err(WireError::BadIcrc { computed, found })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An RC SEND ONLY WITH IMMEDIATE datagram written out by hand from the
    /// layouts: IPv4 10.0.0.1 -> 10.0.0.2 (TOS 0x6a, TTL 64, checksum
    /// 0x2649), UDP 0xc123 -> 4791 length 36, BTH opcode 0x05 with SE and
    /// PadCnt 3, P_Key 0xffff, DestQP 0x12, AckReq, PSN 1, ImmDt 0xdeadbeef,
    /// payload "hello", three pad bytes.
    const DATAGRAM: [u8; 52] = [
        0x45, 0x6A, 0x00, 0x38, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x26, 0x49, // IPv4
        0x0A, 0x00, 0x00, 0x01, 0x0A, 0x00, 0x00, 0x02, //
        0xC1, 0x23, 0x12, 0xB7, 0x00, 0x24, 0x00, 0x00, // UDP
        0x05, 0xB0, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x12, 0x80, 0x00, 0x00, 0x01, // BTH
        0xDE, 0xAD, 0xBE, 0xEF, // ImmDt
        b'h', b'e', b'l', b'l', b'o', 0x00, 0x00, 0x00, // payload, pad
    ];

    /// Computed independently with Python's zlib over the masked bytes:
    /// python3 -c "import zlib; print(hex(zlib.crc32(bytes.fromhex('ff'*8 +
    ///   '45ff003800004000ff11ffff0a0000010a000002' 'c12312b70024ffff'
    ///   '05b0ffffff00001280000001' 'deadbeef68656c6c6f000000'))))"
    /// -> 0xb16961b3
    const DATAGRAM_ICRC: u32 = 0xB169_61B3;

    #[test]
    fn known_answer() {
        assert_eq!(compute(&DATAGRAM), Ok(DATAGRAM_ICRC));
        let mut with_icrc = DATAGRAM.to_vec();
        with_icrc.extend_from_slice(&[0xB3, 0x61, 0x69, 0xB1]); // little-endian
        assert_eq!(verify(&with_icrc), Ok(()));
    }

    #[test]
    fn variant_fields_do_not_matter() {
        for offset in MASKED_BYTES {
            let mut d = DATAGRAM;
            d[offset] ^= 0x5A;
            assert_eq!(compute(&d), Ok(DATAGRAM_ICRC), "offset {offset}");
        }
        // Every other byte is covered.
        for offset in (0..DATAGRAM.len()).filter(|o| !MASKED_BYTES.contains(o)) {
            let mut d = DATAGRAM;
            d[offset] ^= 0x01;
            assert_ne!(compute(&d), Ok(DATAGRAM_ICRC), "offset {offset}");
        }
    }

    #[test]
    fn prefix_constant_is_the_crc_of_eight_ff() {
        assert_eq!(crc32fast::hash(&[0xFF; 8]), LRH_PREFIX_CRC);
    }

    #[test]
    fn short_inputs_are_errors() {
        assert!(matches!(
            compute(&DATAGRAM[..39]),
            Err(WireError::Truncated { .. })
        ));
        assert!(matches!(
            verify(&DATAGRAM[..3]),
            Err(WireError::Truncated { .. })
        ));
        let mut bad = DATAGRAM.to_vec();
        bad.extend_from_slice(&[0, 0, 0, 0]);
        assert_eq!(
            verify(&bad),
            Err(WireError::BadIcrc {
                computed: DATAGRAM_ICRC,
                found: 0
            })
        );
    }

    /// An independent oracle: the bit-at-a-time reflected CRC-32.
    fn bitwise_crc32(chunks: &[&[u8]]) -> u32 {
        let mut crc = 0xFFFF_FFFFu32;
        for byte in chunks.iter().flat_map(|c| c.iter()) {
            crc ^= u32::from(*byte);
            for _ in 0..8 {
                let lsb = crc & 1;
                crc >>= 1;
                if lsb != 0 {
                    crc ^= 0xEDB8_8320; // 0x04C11DB7 bit-reversed
                }
            }
        }
        !crc
    }

    #[test]
    fn oracle_agrees_with_zlib() {
        // The classic check value of CRC-32: "123456789" -> 0xcbf43926.
        assert_eq!(bitwise_crc32(&[b"123456789"]), 0xCBF4_3926);
    }

    proptest! {
        #[test]
        fn matches_the_bitwise_oracle(datagram in proptest::collection::vec(any::<u8>(), 40..300)) {
            let mut masked = datagram.clone();
            for offset in MASKED_BYTES {
                masked[offset] = 0xFF;
            }
            let expected = bitwise_crc32(&[&[0xFF; 8], &masked]);
            prop_assert_eq!(compute(&datagram), Ok(expected));
        }
    }
}
