//! The 32-byte address vector (PRM 6.1.1), shared by the QP context's
//! primary path and the UD address segment of send WQEs.
//!
//! Contract:
//! - [`Av`] is the byte layout: every bit pattern is a layout; [`Av::check`]
//!   is what the device applies to one read from memory (reserved bytes zero,
//!   20-bit flow label, 4-bit SL).
//! - This device is RoCEv2 only, so every address vector carries a GRH:
//!   `Av::try_from(&AvAttr)` fails for an attribute without one. The IB-only
//!   fields of [`AvAttr`] (DLID, source path bits, static rate) have no place
//!   in the layout and are dropped; `AvAttr::try_from(&Av)` returns them as
//!   zero.
//! - The DGID is kept in network order; on this device it is IPv4-mapped
//!   (PRM 10.1), which [`Av::dest_ipv4`] reads. Whether a DGID that is not
//!   IPv4-mapped is acceptable is the device's policy, not a layout rule.
//! - [`Av::for_device`] is the Create/Modify Address Handle check (IBA
//!   11.2.2) that needs no device command, with its verb status: the
//!   kernel's AV verbs and the user-mode provider's AVs both call it, so the
//!   two paths refuse the same attributes with the same status.

use ib_types::AbiError;
use ib_types::av::{AvAttr, Grh};
use ib_types::scalars::{Gid, Lid, PortNum};
use ib_types::status::IbStatus;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::Le32;

/// Address vector layout (PRM 6.1.1, 32 bytes).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct Av {
    /// The local port the packets leave from (1-based).
    pub port: u8,
    /// Service level, 0..=15.
    pub sl: u8,
    /// Index of the source GID in the port's GID table.
    pub sgid_index: u8,
    /// Hop limit (IPv4 TTL).
    pub hop_limit: u8,
    /// Traffic class (IPv4 TOS).
    pub traffic_class: u8,
    /// Reserved, zero.
    pub reserved_at_0x5: [u8; 3],
    /// Flow label, 20 bits.
    pub flow_label: Le32,
    /// Reserved, zero.
    pub reserved_at_0xc: [u8; 4],
    /// Destination GID, network order.
    pub dgid: Gid,
}

assert_layout!(
    Av,
    size = 32,
    port @ 0x00,
    sl @ 0x01,
    sgid_index @ 0x02,
    hop_limit @ 0x03,
    traffic_class @ 0x04,
    reserved_at_0x5 @ 0x05,
    flow_label @ 0x08,
    reserved_at_0xc @ 0x0C,
    dgid @ 0x10,
);

/// Why an address vector could not be converted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AvError {
    /// The attribute has no GRH; RoCEv2 addressing needs one.
    #[error("address vector without a GRH: this device is RoCEv2 only")]
    MissingGrh,
    /// A field is out of range or reserved bytes are set.
    #[error(transparent)]
    Abi(#[from] AbiError),
}

impl Av {
    /// Largest flow label (20 bits).
    pub const MAX_FLOW_LABEL: u32 = AvAttr::MAX_FLOW_LABEL;
    /// Largest service level (4 bits).
    pub const MAX_SL: u8 = AvAttr::MAX_SL;

    /// Checks what the layout itself requires: reserved bytes zero, the flow
    /// label within 20 bits and the SL within 4. The port is not checked
    /// here (a QP context's AV is zero until RTR; a UD AV's port is compared
    /// with the QP's by the device).
    pub fn check(&self) -> Result<(), AbiError> {
        ib_types::abi::ensure_zero("Av.reserved_at_0x5", &self.reserved_at_0x5)?;
        ib_types::abi::ensure_zero("Av.reserved_at_0xc", &self.reserved_at_0xc)?;
        if self.sl > Self::MAX_SL {
            return Err(AbiError::OutOfRange {
                field: "Av.sl",
                value: self.sl.into(),
            });
        }
        let flow_label = self.flow_label.get();
        if flow_label > Self::MAX_FLOW_LABEL {
            return Err(AbiError::OutOfRange {
                field: "Av.flow_label",
                value: flow_label.into(),
            });
        }
        Ok(())
    }

    /// The checks of Create and Modify Address Handle (IBA 11.2.2) that need
    /// no device command, on a device with `num_ports` ports, in this order:
    /// the port must be one of the device's ([`IbStatus::InvalidPort`]; port
    /// 0 has no [`PortNum`]); the static rate must be 0, the port's full
    /// rate, since the layout has no rate field to honour another
    /// ([`IbStatus::InvalidSetting`]); then the layout's own rules: a GRH,
    /// SL and flow label in range ([`IbStatus::InvalidParameter`]). Returns
    /// the encoding. The source GID entry is checked against the port's
    /// table only by the kernel, which reads it with `QUERY_PORT`.
    pub fn for_device(attr: &AvAttr, num_ports: u8) -> Result<Self, IbStatus> {
        if attr.port.get() > num_ports {
            return Err(IbStatus::InvalidPort);
        }
        if attr.static_rate != 0 {
            return Err(IbStatus::InvalidSetting);
        }
        Self::try_from(attr).map_err(|_| IbStatus::InvalidParameter)
    }

    /// The destination's IPv4 address, if the DGID is IPv4-mapped.
    pub const fn dest_ipv4(&self) -> Option<[u8; 4]> {
        self.dgid.ipv4()
    }
}

impl TryFrom<&AvAttr> for Av {
    type Error = AvError;

    /// Encodes a RoCEv2 address vector; fails without a GRH, or with a flow
    /// label over 20 bits or an SL over 15.
    fn try_from(attr: &AvAttr) -> Result<Self, AvError> {
        let grh = attr.grh.ok_or(AvError::MissingGrh)?;
        let av = Self {
            port: attr.port.get(),
            sl: attr.sl,
            sgid_index: grh.sgid_index,
            hop_limit: grh.hop_limit,
            traffic_class: grh.traffic_class,
            flow_label: Le32::new(grh.flow_label),
            dgid: grh.dgid,
            ..Self::default()
        };
        av.check()?;
        Ok(av)
    }
}

impl TryFrom<&Av> for AvAttr {
    type Error = AvError;

    /// Decodes a layout (after [`Av::check`]); port 0 is an error. The
    /// result always has a GRH; DLID, path bits and static rate are zero.
    fn try_from(av: &Av) -> Result<Self, AvError> {
        av.check()?;
        Ok(Self {
            port: PortNum::new(av.port)?,
            sl: av.sl,
            dlid: Lid::UNASSIGNED,
            path_bits: 0,
            static_rate: 0,
            grh: Some(Grh {
                dgid: av.dgid,
                flow_label: av.flow_label.get(),
                hop_limit: av.hop_limit,
                traffic_class: av.traffic_class,
                sgid_index: av.sgid_index,
            }),
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A way to damage a valid value, and what the damage is.
    type Corruption<T> = (fn(&mut T), &'static str);

    /// Any valid address vector layout (shared with the WQE tests).
    pub(crate) fn any_av() -> impl Strategy<Value = Av> {
        (
            1u8..,
            0..=Av::MAX_SL,
            any::<[u8; 3]>(),
            0..=Av::MAX_FLOW_LABEL,
            any::<[u8; 16]>(),
        )
            .prop_map(
                |(port, sl, [sgid_index, hop_limit, traffic_class], fl, g)| Av {
                    port,
                    sl,
                    sgid_index,
                    hop_limit,
                    traffic_class,
                    flow_label: Le32::new(fl),
                    dgid: Gid::from_octets(g),
                    ..Av::default()
                },
            )
    }

    #[test]
    fn byte_image() {
        let attr = AvAttr {
            sl: 5,
            grh: Some(Grh {
                dgid: Gid::from_ipv4([10, 0, 0, 2]),
                flow_label: 0xA_BCDE,
                hop_limit: 64,
                traffic_class: 0x20,
                sgid_index: 3,
            }),
            ..AvAttr::roce(PortNum::new(2).unwrap(), Gid::ZERO, 0)
        };
        let av = Av::try_from(&attr).unwrap();
        #[rustfmt::skip]
        let expected: [u8; 32] = [
            2, 5, 3, 64, 0x20, 0, 0, 0,           // port, sl, sgid, hop, tclass, rsvd
            0xDE, 0xBC, 0x0A, 0x00, 0, 0, 0, 0,   // flow label LE, rsvd
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 10, 0, 0, 2, // dgid
        ];
        assert_eq!(av.as_bytes(), &expected);
        assert_eq!(av.dest_ipv4(), Some([10, 0, 0, 2]));
        assert_eq!(AvAttr::try_from(&av), Ok(attr));
    }

    #[test]
    fn conversion_failures() {
        let mut attr = AvAttr::roce(PortNum::FIRST, Gid::from_ipv4([1, 2, 3, 4]), 0);
        attr.grh = None;
        assert_eq!(Av::try_from(&attr), Err(AvError::MissingGrh));

        let mut attr = AvAttr::roce(PortNum::FIRST, Gid::ZERO, 0);
        if let Some(grh) = attr.grh.as_mut() {
            grh.flow_label = 1 << 20;
        }
        assert!(matches!(
            Av::try_from(&attr),
            Err(AvError::Abi(AbiError::OutOfRange {
                field: "Av.flow_label",
                ..
            }))
        ));
        attr = AvAttr::roce(PortNum::FIRST, Gid::ZERO, 0);
        attr.sl = 16;
        assert!(Av::try_from(&attr).is_err());

        // IB-only fields are dropped, not errors.
        attr = AvAttr::roce(PortNum::FIRST, Gid::ZERO, 0);
        attr.dlid = Lid::new(7);
        attr.static_rate = 3;
        let back = AvAttr::try_from(&Av::try_from(&attr).unwrap()).unwrap();
        assert_eq!((back.dlid, back.static_rate), (Lid::UNASSIGNED, 0));
    }

    #[test]
    fn device_checks_refuse_port_rate_then_layout() {
        let good = AvAttr::roce(PortNum::new(2).unwrap(), Gid::from_ipv4([10, 0, 0, 9]), 0);
        assert_eq!(Av::for_device(&good, 2), Ok(Av::try_from(&good).unwrap()));
        assert_eq!(Av::for_device(&good, 1), Err(IbStatus::InvalidPort));
        let rated = AvAttr {
            static_rate: 3,
            ..good
        };
        assert_eq!(Av::for_device(&rated, 2), Err(IbStatus::InvalidSetting));
        assert_eq!(Av::for_device(&rated, 1), Err(IbStatus::InvalidPort));
        let no_grh = AvAttr { grh: None, ..good };
        assert_eq!(Av::for_device(&no_grh, 2), Err(IbStatus::InvalidParameter));
        let rated_no_grh = AvAttr { grh: None, ..rated };
        assert_eq!(
            Av::for_device(&rated_no_grh, 2),
            Err(IbStatus::InvalidSetting)
        );
        let sl = AvAttr { sl: 16, ..good };
        assert_eq!(Av::for_device(&sl, 2), Err(IbStatus::InvalidParameter));
    }

    #[test]
    fn check_rejects_bad_layouts() {
        let good = Av {
            port: 1,
            ..Av::default()
        };
        assert_eq!(good.check(), Ok(()));
        let cases: &[Corruption<Av>] = &[
            (|a| a.reserved_at_0x5[2] = 1, "reserved 0x5"),
            (|a| a.reserved_at_0xc[0] = 1, "reserved 0xc"),
            (|a| a.sl = 16, "sl"),
            (|a| a.flow_label = Le32::new(0x10_0000), "flow label"),
        ];
        for (corrupt, what) in cases {
            let mut av = good;
            corrupt(&mut av);
            assert!(av.check().is_err(), "{what}");
        }
        let port0 = Av::default();
        assert_eq!(port0.check(), Ok(()));
        assert!(AvAttr::try_from(&port0).is_err());
    }

    proptest! {
        #[test]
        fn round_trips(av in any_av()) {
            let attr = AvAttr::try_from(&av).unwrap();
            prop_assert_eq!(Av::try_from(&attr).unwrap(), av);
        }

        #[test]
        fn decoding_arbitrary_bytes_is_total(bytes in any::<[u8; 32]>()) {
            let av = Av::read_from_bytes(&bytes).unwrap();
            if let Ok(attr) = AvAttr::try_from(&av) {
                let again = Av::try_from(&attr).unwrap();
                prop_assert_eq!(again.as_bytes(), &bytes);
            }
        }
    }
}
