//! Address vectors (IBA 11.2.2.1): where a datagram goes, or where a connected
//! QP's path leads. On RoCEv2 ports the GRH is mandatory and the DGID is the
//! peer's IP address in GID form.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Le32, Repr, ensure_zero, parse_bool};
use crate::scalars::{Gid, Lid, PortNum};

/// Global routing header fields of an address vector (IBA 8.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Grh {
    /// Destination GID.
    pub dgid: Gid,
    /// 20-bit flow label.
    pub flow_label: u32,
    /// Hop limit (IPv4 TTL on RoCEv2).
    pub hop_limit: u8,
    /// Traffic class (IPv4 TOS on RoCEv2).
    pub traffic_class: u8,
    /// Index of the source GID in the port's GID table.
    pub sgid_index: u8,
}

/// An address vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AvAttr {
    /// The local port the packets leave from.
    pub port: PortNum,
    /// Service level, 0..=15.
    pub sl: u8,
    /// Destination LID (unused on RoCEv2 ports).
    pub dlid: Lid,
    /// Source path bits, 0..=127 (the low LMC bits of the source LID).
    pub path_bits: u8,
    /// Static rate code; 0 means the port's full rate.
    pub static_rate: u8,
    /// The GRH, required on RoCEv2 ports and for off-subnet destinations.
    pub grh: Option<Grh>,
}

impl AvAttr {
    /// Largest service level.
    pub const MAX_SL: u8 = 15;
    /// Largest source path bits value (7-bit LMC).
    pub const MAX_PATH_BITS: u8 = 127;
    /// Largest flow label (20 bits).
    pub const MAX_FLOW_LABEL: u32 = 0x000F_FFFF;

    /// A RoCEv2 address vector: port, destination GID and source GID index,
    /// with default hop limit and class.
    pub const fn roce(port: PortNum, dgid: Gid, sgid_index: u8) -> Self {
        Self {
            port,
            sl: 0,
            dlid: Lid::UNASSIGNED,
            path_bits: 0,
            static_rate: 0,
            grh: Some(Grh {
                dgid,
                flow_label: 0,
                hop_limit: 64,
                traffic_class: 0,
                sgid_index,
            }),
        }
    }
}

/// ABI layout of [`AvAttr`]: 32 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct AvAbi {
    /// Port number, 1-based.
    pub port_num: u8,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub path_bits: u8,
    /// Static rate code.
    pub static_rate: u8,
    /// Destination LID.
    pub dlid: Lid,
    /// 1 when the GRH fields are valid, else 0 (and they must be zero).
    pub grh_valid: u8,
    /// Source GID index.
    pub sgid_index: u8,
    /// Destination GID.
    pub dgid: Gid,
    /// Flow label, low 20 bits.
    pub flow_label: Le32,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Reserved, zero.
    pub reserved_at_0x1e: [u8; 2],
}

assert_layout!(AvAbi, size = 32,
    port_num @ 0, sl @ 1, path_bits @ 2, static_rate @ 3, dlid @ 4,
    grh_valid @ 6, sgid_index @ 7, dgid @ 8, flow_label @ 24, hop_limit @ 28,
    traffic_class @ 29, reserved_at_0x1e @ 30);

fn check_max(field: &'static str, value: u64, max: u64) -> Result<(), AbiError> {
    if value <= max {
        Ok(())
    } else {
        Err(AbiError::OutOfRange { field, value })
    }
}

impl Repr for AvAttr {
    type Abi = AvAbi;

    fn parse(abi: &AvAbi) -> Result<Self, AbiError> {
        ensure_zero("AvAbi.reserved_at_0x1e", &abi.reserved_at_0x1e)?;
        check_max("AvAbi.sl", abi.sl.into(), Self::MAX_SL.into())?;
        check_max(
            "AvAbi.path_bits",
            abi.path_bits.into(),
            Self::MAX_PATH_BITS.into(),
        )?;
        let grh = if parse_bool("AvAbi.grh_valid", abi.grh_valid)? {
            check_max(
                "AvAbi.flow_label",
                abi.flow_label.get().into(),
                Self::MAX_FLOW_LABEL.into(),
            )?;
            Some(Grh {
                dgid: abi.dgid,
                flow_label: abi.flow_label.get(),
                hop_limit: abi.hop_limit,
                traffic_class: abi.traffic_class,
                sgid_index: abi.sgid_index,
            })
        } else {
            let unused_grh = [abi.sgid_index, abi.hop_limit, abi.traffic_class];
            ensure_zero("AvAbi (GRH fields without grh_valid)", &unused_grh)?;
            ensure_zero("AvAbi.dgid (without grh_valid)", abi.dgid.as_bytes())?;
            ensure_zero(
                "AvAbi.flow_label (without grh_valid)",
                abi.flow_label.as_bytes(),
            )?;
            None
        };
        Ok(Self {
            port: PortNum::new(abi.port_num)?,
            sl: abi.sl,
            dlid: abi.dlid,
            path_bits: abi.path_bits,
            static_rate: abi.static_rate,
            grh,
        })
    }

    fn emit(&self) -> AvAbi {
        let mut abi = AvAbi {
            port_num: self.port.get(),
            sl: self.sl,
            path_bits: self.path_bits,
            static_rate: self.static_rate,
            dlid: self.dlid,
            ..AvAbi::default()
        };
        if let Some(grh) = self.grh {
            abi.grh_valid = 1;
            abi.sgid_index = grh.sgid_index;
            abi.dgid = grh.dgid;
            abi.flow_label = Le32::new(grh.flow_label);
            abi.hop_limit = grh.hop_limit;
            abi.traffic_class = grh.traffic_class;
        }
        abi
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::abi::testing::{
        Corruption, assert_corruptions_rejected, assert_decode_total, assert_round_trip,
    };
    use proptest::prelude::*;

    /// Any valid address vector (shared with the QP tests).
    pub(crate) fn any_av() -> impl Strategy<Value = AvAttr> {
        let grh = (
            any::<[u8; 16]>(),
            0..=AvAttr::MAX_FLOW_LABEL,
            any::<u8>(),
            any::<u8>(),
            any::<u8>(),
        )
            .prop_map(
                |(g, flow_label, hop_limit, traffic_class, sgid_index)| Grh {
                    dgid: Gid::from_octets(g),
                    flow_label,
                    hop_limit,
                    traffic_class,
                    sgid_index,
                },
            );
        (
            1u8..,
            0..=AvAttr::MAX_SL,
            any::<u16>(),
            0..=AvAttr::MAX_PATH_BITS,
            any::<u8>(),
            proptest::option::of(grh),
        )
            .prop_map(|(port, sl, dlid, path_bits, static_rate, grh)| AvAttr {
                port: PortNum::new(port).unwrap(),
                sl,
                dlid: Lid::new(dlid),
                path_bits,
                static_rate,
                grh,
            })
    }

    #[test]
    fn roce_av_bytes() {
        let av = AvAttr::roce(PortNum::FIRST, Gid::from_ipv4([10, 0, 0, 2]), 3);
        let abi = av.emit();
        let mut expected = [0u8; 32];
        expected[0] = 1; // port
        expected[6] = 1; // grh_valid
        expected[7] = 3; // sgid_index
        expected[8 + 10] = 0xFF;
        expected[8 + 11] = 0xFF;
        expected[8 + 12..8 + 16].copy_from_slice(&[10, 0, 0, 2]);
        expected[28] = 64; // hop limit
        assert_eq!(abi.as_bytes(), &expected);
        assert_round_trip(&av);
    }

    #[test]
    fn rejects_out_of_range_fields() {
        let good = AvAttr::roce(PortNum::FIRST, Gid::from_ipv4([1, 2, 3, 4]), 0).emit();
        let cases: &[Corruption<AvAbi>] = &[
            (|a| a.port_num = 0, "port 0"),
            (|a| a.sl = 16, "sl"),
            (|a| a.path_bits = 128, "path bits"),
            (|a| a.flow_label = Le32::new(1 << 20), "flow label"),
            (|a| a.grh_valid = 2, "grh flag"),
            (|a| a.reserved_at_0x1e = [0, 1], "reserved"),
            (|a| a.grh_valid = 0, "GRH fields without the flag"),
        ];
        assert_corruptions_rejected::<AvAttr>(&good, cases);
    }

    proptest! {
        #[test]
        fn any_av_round_trips(av in any_av()) {
            assert_round_trip(&av);
        }

        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            assert_decode_total::<AvAttr>(&bytes);
        }
    }
}
