//! Event queue entries (PRM 8.1) and event types and classes (PRM 8.2).
//!
//! Contract:
//! - [`Eqe`] is the 32-byte layout; every bit pattern is a layout.
//! - [`Event`] is a decoded event carrying exactly its object. The device
//!   writes `Eqe::from(event).with_owner(producer, log_entries)`; the driver
//!   checks [`Eqe::is_valid`] and calls [`Eqe::decode`]. `decode` after
//!   `from` is the identity.
//! - `decode` checks codes and values (event type, the PORT_CHANGE subtype,
//!   a port in 1..=255, a 24-bit QPN) and ignores reserved bytes, the
//!   subtype of other events, and the fields an event type does not use
//!   (PRM conventions: reserved is ignored on read). The device writes those
//!   as zero.
//! - [`EventClass`] is the `MAP_EQ` mask; completion events are not mapped
//!   by class but go to each CQ's EQ ([`EventType::class`] is `None`).

use bitflags::bitflags;
use ib_types::AbiError;
use ib_types::event::AsyncEventCode;
use ib_types::scalars::{PortNum, Qpn};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::owner;
use crate::{Le16, Le32, Le64};

prm_code! {
    /// EQE `event_type` (PRM 8.2).
    pub enum EventType: u8 {
        /// A CQ has a completion to report (object: CQN).
        Completion = 0x00,
        /// Communication established (object: QPN).
        CommEst = 0x01,
        /// The send queue drained in SQD (object: QPN).
        SqDrained = 0x02,
        /// Path migrated (object: QPN; never raised by the model).
        PathMigrated = 0x03,
        /// Local work queue catastrophic error (object: QPN).
        QpFatal = 0x04,
        /// Invalid request local work queue error (object: QPN).
        WqInvalidRequest = 0x05,
        /// Local access violation work queue error (object: QPN).
        WqAccessError = 0x06,
        /// The SRQ fell below its armed limit (object: SRQN).
        SrqLimit = 0x07,
        /// Last WQE reached on a QP using an SRQ (object: QPN).
        SrqLastWqe = 0x08,
        /// SRQ catastrophic error (object: SRQN).
        SrqCatastrophic = 0x09,
        /// CQ overflow (object: CQN).
        CqError = 0x0A,
        /// The port went active or down (object: port; subtype).
        PortChange = 0x0B,
        /// A P_Key violation was counted (object: port).
        PkeyViolation = 0x0C,
        /// A Q_Key violation was counted (object: port).
        QkeyViolation = 0x0D,
        /// A command asked for completion by event finished.
        CmdCompletion = 0x0E,
        /// The device failed (`STATUS.FATAL`).
        Catastrophic = 0x0F,
    }
}

bitflags! {
    /// Event classes, the `MAP_EQ` `in_param` mask (PRM 8.2).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct EventClass: u64 {
        /// Class bit 0: command completions.
        const CMD_COMPLETION = 1 << 0;
        /// Class bit 1: QP events.
        const QP = 1 << 1;
        /// Class bit 2: SRQ events.
        const SRQ = 1 << 2;
        /// Class bit 3: CQ errors.
        const CQ_ERROR = 1 << 3;
        /// Class bit 4: port events.
        const PORT = 1 << 4;
        /// Class bit 5: device errors.
        const DEVICE = 1 << 5;
    }
}

impl EventClass {
    /// Reads a `MAP_EQ` mask; undefined bits are an error.
    pub const fn from_mask(mask: u64) -> Result<Self, AbiError> {
        match Self::from_bits(mask) {
            Some(classes) => Ok(classes),
            None => Err(AbiError::ReservedNotZero {
                field: "MAP_EQ event class mask",
            }),
        }
    }
}

impl EventType {
    /// The class `MAP_EQ` routes the event by; `None` for completion
    /// events, which go to the EQ named in the CQ's context.
    pub const fn class(self) -> Option<EventClass> {
        Some(match self {
            Self::Completion => return None,
            Self::CommEst
            | Self::SqDrained
            | Self::PathMigrated
            | Self::QpFatal
            | Self::WqInvalidRequest
            | Self::WqAccessError => EventClass::QP,
            Self::SrqLimit | Self::SrqLastWqe | Self::SrqCatastrophic => EventClass::SRQ,
            Self::CqError => EventClass::CQ_ERROR,
            Self::PortChange | Self::PkeyViolation | Self::QkeyViolation => EventClass::PORT,
            Self::CmdCompletion => EventClass::CMD_COMPLETION,
            Self::Catastrophic => EventClass::DEVICE,
        })
    }
}

/// `PORT_CHANGE` subtype: the port became active.
pub const PORT_CHANGE_ACTIVE: u8 = 1;
/// `PORT_CHANGE` subtype: the port went down.
pub const PORT_CHANGE_DOWN: u8 = 2;

/// EQE layout (PRM 8.1, 32 bytes).
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
pub struct Eqe {
    /// [`EventType`].
    pub event_type: u8,
    /// Subtype ([`PORT_CHANGE_ACTIVE`] / [`PORT_CHANGE_DOWN`]; else 0).
    pub subtype: u8,
    /// Reserved.
    pub reserved_at_0x2: [u8; 2],
    /// CQN, QPN, SRQN or port, by type.
    pub object: Le32,
    /// Command token (command completions).
    pub token: Le16,
    /// Command status (command completions).
    pub status: u8,
    /// Reserved.
    pub reserved_at_0xb: u8,
    /// Reserved.
    pub reserved_at_0xc: [u8; 4],
    /// Command immediate output (command completions).
    pub out_imm: Le64,
    /// Reserved.
    pub reserved_at_0x18: [u8; 7],
    /// Bit 0: the owner (phase) bit.
    pub owner: u8,
}

assert_layout!(
    Eqe,
    size = 32,
    event_type @ 0x00,
    subtype @ 0x01,
    reserved_at_0x2 @ 0x02,
    object @ 0x04,
    token @ 0x08,
    status @ 0x0A,
    reserved_at_0xb @ 0x0B,
    reserved_at_0xc @ 0x0C,
    out_imm @ 0x10,
    reserved_at_0x18 @ 0x18,
    owner @ 0x1F,
);

/// A decoded event with its object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// A CQ has a completion to report.
    Completion {
        /// The CQ.
        cqn: u32,
    },
    /// Communication established.
    CommEst {
        /// The QP.
        qpn: Qpn,
    },
    /// The send queue drained.
    SqDrained {
        /// The QP.
        qpn: Qpn,
    },
    /// Path migrated.
    PathMigrated {
        /// The QP.
        qpn: Qpn,
    },
    /// Local work queue catastrophic error.
    QpFatal {
        /// The QP.
        qpn: Qpn,
    },
    /// Invalid request local work queue error.
    WqInvalidRequest {
        /// The QP.
        qpn: Qpn,
    },
    /// Local access violation work queue error.
    WqAccessError {
        /// The QP.
        qpn: Qpn,
    },
    /// SRQ limit reached.
    SrqLimit {
        /// The SRQ.
        srqn: u32,
    },
    /// Last WQE reached.
    SrqLastWqe {
        /// The QP.
        qpn: Qpn,
    },
    /// SRQ catastrophic error.
    SrqCatastrophic {
        /// The SRQ.
        srqn: u32,
    },
    /// CQ overflow.
    CqError {
        /// The CQ.
        cqn: u32,
    },
    /// The port went active or down.
    PortChange {
        /// The port.
        port: PortNum,
        /// True when the port became active.
        active: bool,
    },
    /// A P_Key violation was counted.
    PkeyViolation {
        /// The port.
        port: PortNum,
    },
    /// A Q_Key violation was counted.
    QkeyViolation {
        /// The port.
        port: PortNum,
    },
    /// A command completed by event.
    CmdCompletion {
        /// The command's token.
        token: u16,
        /// The command status (PRM 4.4).
        status: u8,
        /// The immediate output.
        out_imm: u64,
    },
    /// The device failed.
    Catastrophic,
}

impl Event {
    /// The event's type code.
    pub const fn event_type(&self) -> EventType {
        match self {
            Self::Completion { .. } => EventType::Completion,
            Self::CommEst { .. } => EventType::CommEst,
            Self::SqDrained { .. } => EventType::SqDrained,
            Self::PathMigrated { .. } => EventType::PathMigrated,
            Self::QpFatal { .. } => EventType::QpFatal,
            Self::WqInvalidRequest { .. } => EventType::WqInvalidRequest,
            Self::WqAccessError { .. } => EventType::WqAccessError,
            Self::SrqLimit { .. } => EventType::SrqLimit,
            Self::SrqLastWqe { .. } => EventType::SrqLastWqe,
            Self::SrqCatastrophic { .. } => EventType::SrqCatastrophic,
            Self::CqError { .. } => EventType::CqError,
            Self::PortChange { .. } => EventType::PortChange,
            Self::PkeyViolation { .. } => EventType::PkeyViolation,
            Self::QkeyViolation { .. } => EventType::QkeyViolation,
            Self::CmdCompletion { .. } => EventType::CmdCompletion,
            Self::Catastrophic => EventType::Catastrophic,
        }
    }

    /// The asynchronous event the stack reports for this one, if any:
    /// completions and command completions are not asynchronous events; a
    /// P_Key or Q_Key violation is reported as the "local HCA generating a
    /// violation trap" event.
    pub const fn async_code(&self) -> Option<AsyncEventCode> {
        Some(match self {
            Self::Completion { .. } | Self::CmdCompletion { .. } => return None,
            Self::CommEst { .. } => AsyncEventCode::QpComm,
            Self::SqDrained { .. } => AsyncEventCode::SqDrained,
            Self::PathMigrated { .. } => AsyncEventCode::QpApm,
            Self::QpFatal { .. } => AsyncEventCode::QpFatal,
            Self::WqInvalidRequest { .. } => AsyncEventCode::WqRequestError,
            Self::WqAccessError { .. } => AsyncEventCode::WqAccessError,
            Self::SrqLimit { .. } => AsyncEventCode::SrqLimitReached,
            Self::SrqLastWqe { .. } => AsyncEventCode::QpLastWqeReached,
            Self::SrqCatastrophic { .. } => AsyncEventCode::SrqCatastrophic,
            Self::CqError { .. } => AsyncEventCode::CqError,
            Self::PortChange { active: true, .. } => AsyncEventCode::PortActive,
            Self::PortChange { active: false, .. } => AsyncEventCode::PortDown,
            Self::PkeyViolation { .. } => AsyncEventCode::PkeyTrap,
            Self::QkeyViolation { .. } => AsyncEventCode::QkeyTrap,
            Self::Catastrophic => AsyncEventCode::LocalCatastrophic,
        })
    }
}

impl From<Event> for Eqe {
    fn from(event: Event) -> Self {
        Self::new(event)
    }
}

impl Eqe {
    /// The entry for `event` (owner bit clear; see [`with_owner`](Self::with_owner)).
    pub const fn new(event: Event) -> Self {
        let mut eqe = Self {
            event_type: event.event_type().code(),
            subtype: 0,
            reserved_at_0x2: [0; 2],
            object: Le32::new(0),
            token: Le16::new(0),
            status: 0,
            reserved_at_0xb: 0,
            reserved_at_0xc: [0; 4],
            out_imm: Le64::new(0),
            reserved_at_0x18: [0; 7],
            owner: 0,
        };
        let object = match event {
            Event::Completion { cqn } | Event::CqError { cqn } => cqn,
            Event::SrqLimit { srqn } | Event::SrqCatastrophic { srqn } => srqn,
            Event::CommEst { qpn }
            | Event::SqDrained { qpn }
            | Event::PathMigrated { qpn }
            | Event::QpFatal { qpn }
            | Event::WqInvalidRequest { qpn }
            | Event::WqAccessError { qpn }
            | Event::SrqLastWqe { qpn } => qpn.get(),
            Event::PortChange { port, active } => {
                eqe.subtype = if active {
                    PORT_CHANGE_ACTIVE
                } else {
                    PORT_CHANGE_DOWN
                };
                port.get() as u32
            }
            Event::PkeyViolation { port } | Event::QkeyViolation { port } => port.get() as u32,
            Event::CmdCompletion {
                token,
                status,
                out_imm,
            } => {
                eqe.token = Le16::new(token);
                eqe.status = status;
                eqe.out_imm = Le64::new(out_imm);
                0
            }
            Event::Catastrophic => 0,
        };
        eqe.object = Le32::new(object);
        eqe
    }

    /// Sets the owner bit for the entry written at producer counter
    /// `counter` of a ring of `2^log_entries` entries.
    pub const fn with_owner(mut self, counter: u32, log_entries: u8) -> Self {
        self.owner = owner::phase_for(counter, log_entries);
        self
    }

    /// Whether the entry holds the event for consumer counter `counter`.
    pub const fn is_valid(&self, counter: u32, log_entries: u8) -> bool {
        owner::is_valid(self.owner, counter, log_entries)
    }

    /// Decodes the event.
    pub fn decode(&self) -> Result<Event, AbiError> {
        let object = self.object.get();
        let qpn = || Qpn::new(object);
        let port = || match u8::try_from(object) {
            Ok(port) => PortNum::new(port),
            Err(_) => Err(AbiError::OutOfRange {
                field: "Eqe.object (port)",
                value: object.into(),
            }),
        };
        Ok(match EventType::from_code(self.event_type)? {
            EventType::Completion => Event::Completion { cqn: object },
            EventType::CommEst => Event::CommEst { qpn: qpn()? },
            EventType::SqDrained => Event::SqDrained { qpn: qpn()? },
            EventType::PathMigrated => Event::PathMigrated { qpn: qpn()? },
            EventType::QpFatal => Event::QpFatal { qpn: qpn()? },
            EventType::WqInvalidRequest => Event::WqInvalidRequest { qpn: qpn()? },
            EventType::WqAccessError => Event::WqAccessError { qpn: qpn()? },
            EventType::SrqLimit => Event::SrqLimit { srqn: object },
            EventType::SrqLastWqe => Event::SrqLastWqe { qpn: qpn()? },
            EventType::SrqCatastrophic => Event::SrqCatastrophic { srqn: object },
            EventType::CqError => Event::CqError { cqn: object },
            EventType::PortChange => Event::PortChange {
                port: port()?,
                active: match self.subtype {
                    PORT_CHANGE_ACTIVE => true,
                    PORT_CHANGE_DOWN => false,
                    other => {
                        return Err(AbiError::InvalidCode {
                            type_name: "PORT_CHANGE subtype",
                            value: other.into(),
                        });
                    }
                },
            },
            EventType::PkeyViolation => Event::PkeyViolation { port: port()? },
            EventType::QkeyViolation => Event::QkeyViolation { port: port()? },
            EventType::CmdCompletion => Event::CmdCompletion {
                token: self.token.get(),
                status: self.status,
                out_imm: self.out_imm.get(),
            },
            EventType::Catastrophic => Event::Catastrophic,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn class_table() {
        use EventClass as C;
        use EventType as T;
        // PRM 8.2, row by row.
        let table: &[(EventType, Option<EventClass>, u8)] = &[
            (T::Completion, None, 0x00),
            (T::CommEst, Some(C::QP), 0x01),
            (T::SqDrained, Some(C::QP), 0x02),
            (T::PathMigrated, Some(C::QP), 0x03),
            (T::QpFatal, Some(C::QP), 0x04),
            (T::WqInvalidRequest, Some(C::QP), 0x05),
            (T::WqAccessError, Some(C::QP), 0x06),
            (T::SrqLimit, Some(C::SRQ), 0x07),
            (T::SrqLastWqe, Some(C::SRQ), 0x08),
            (T::SrqCatastrophic, Some(C::SRQ), 0x09),
            (T::CqError, Some(C::CQ_ERROR), 0x0A),
            (T::PortChange, Some(C::PORT), 0x0B),
            (T::PkeyViolation, Some(C::PORT), 0x0C),
            (T::QkeyViolation, Some(C::PORT), 0x0D),
            (T::CmdCompletion, Some(C::CMD_COMPLETION), 0x0E),
            (T::Catastrophic, Some(C::DEVICE), 0x0F),
        ];
        assert_eq!(table.len(), EventType::ALL.len());
        for &(t, class, code) in table {
            assert_eq!((t.class(), t.code()), (class, code), "{t:?}");
            assert_eq!(EventType::from_code(code), Ok(t));
        }
        assert!(EventType::from_code(0x10).is_err());
        let bits: Vec<u64> = [
            C::CMD_COMPLETION,
            C::QP,
            C::SRQ,
            C::CQ_ERROR,
            C::PORT,
            C::DEVICE,
        ]
        .iter()
        .map(|c| c.bits())
        .collect();
        assert_eq!(bits, [1, 2, 4, 8, 16, 32]);
        assert_eq!(EventClass::from_mask(0x3F), Ok(EventClass::all()));
        assert!(EventClass::from_mask(0x40).is_err());
    }

    #[test]
    fn images() {
        let cmd = Eqe::from(Event::CmdCompletion {
            token: 0x1234,
            status: 0x03,
            out_imm: 0x0102_0304_0506_0708,
        })
        .with_owner(0, 3);
        #[rustfmt::skip]
        let expected: [u8; 32] = [
            0x0E, 0x00, 0, 0,   0, 0, 0, 0,
            0x34, 0x12, 0x03, 0,   0, 0, 0, 0,
            0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,
            0, 0, 0, 0, 0, 0, 0,   0x01,
        ];
        assert_eq!(cmd.as_bytes(), &expected);

        let port = Eqe::new(Event::PortChange {
            port: PortNum::new(2).unwrap(),
            active: false,
        })
        .with_owner(8, 3);
        let mut expected = [0u8; 32];
        expected[..5].copy_from_slice(&[0x0B, 0x02, 0, 0, 0x02]);
        assert_eq!(port.as_bytes(), &expected);

        let qp = Eqe::new(Event::QpFatal {
            qpn: Qpn::new(0xAB_CDEF).unwrap(),
        });
        assert_eq!(&qp.as_bytes()[..8], &[0x04, 0, 0, 0, 0xEF, 0xCD, 0xAB, 0]);
    }

    #[test]
    fn garbage_is_rejected() {
        let port_eqe = |subtype: u8, object: u32| Eqe {
            event_type: EventType::PortChange.code(),
            subtype,
            object: Le32::new(object),
            ..Eqe::default()
        };
        assert!(port_eqe(1, 1).decode().is_ok());
        for (eqe, what) in [
            (port_eqe(0, 1), "subtype 0"),
            (port_eqe(3, 1), "subtype 3"),
            (port_eqe(1, 0), "port 0"),
            (port_eqe(1, 0x101), "port over 255"),
            (
                Eqe {
                    event_type: 0x10,
                    ..Eqe::default()
                },
                "unknown type",
            ),
            (
                Eqe {
                    event_type: EventType::CommEst.code(),
                    object: Le32::new(0x0100_0000),
                    ..Eqe::default()
                },
                "QPN over 24 bits",
            ),
        ] {
            assert!(eqe.decode().is_err(), "{what}");
        }
        // Reserved bytes and unused fields are ignored.
        let mut cq = Eqe::new(Event::CqError { cqn: 5 });
        cq.reserved_at_0x18 = [0xFF; 7];
        cq.token = Le16::new(9);
        cq.subtype = 7;
        assert_eq!(cq.decode(), Ok(Event::CqError { cqn: 5 }));
    }

    #[test]
    fn async_codes() {
        let q = Qpn::new(3).unwrap();
        let p = PortNum::FIRST;
        let table: &[(Event, Option<AsyncEventCode>)] = &[
            (Event::Completion { cqn: 1 }, None),
            (Event::CommEst { qpn: q }, Some(AsyncEventCode::QpComm)),
            (Event::SqDrained { qpn: q }, Some(AsyncEventCode::SqDrained)),
            (Event::PathMigrated { qpn: q }, Some(AsyncEventCode::QpApm)),
            (Event::QpFatal { qpn: q }, Some(AsyncEventCode::QpFatal)),
            (
                Event::WqInvalidRequest { qpn: q },
                Some(AsyncEventCode::WqRequestError),
            ),
            (
                Event::WqAccessError { qpn: q },
                Some(AsyncEventCode::WqAccessError),
            ),
            (
                Event::SrqLimit { srqn: 1 },
                Some(AsyncEventCode::SrqLimitReached),
            ),
            (
                Event::SrqLastWqe { qpn: q },
                Some(AsyncEventCode::QpLastWqeReached),
            ),
            (
                Event::SrqCatastrophic { srqn: 1 },
                Some(AsyncEventCode::SrqCatastrophic),
            ),
            (Event::CqError { cqn: 1 }, Some(AsyncEventCode::CqError)),
            (
                Event::PortChange {
                    port: p,
                    active: true,
                },
                Some(AsyncEventCode::PortActive),
            ),
            (
                Event::PortChange {
                    port: p,
                    active: false,
                },
                Some(AsyncEventCode::PortDown),
            ),
            (
                Event::PkeyViolation { port: p },
                Some(AsyncEventCode::PkeyTrap),
            ),
            (
                Event::QkeyViolation { port: p },
                Some(AsyncEventCode::QkeyTrap),
            ),
            (
                Event::CmdCompletion {
                    token: 0,
                    status: 0,
                    out_imm: 0,
                },
                None,
            ),
            (Event::Catastrophic, Some(AsyncEventCode::LocalCatastrophic)),
        ];
        for (event, code) in table {
            assert_eq!(event.async_code(), *code, "{event:?}");
            if let Some(code) = code {
                // The subject kinds agree (QP, CQ, SRQ, port, CA).
                let subject = code.subject();
                let kind = match event.event_type().class() {
                    Some(EventClass::QP) => ib_types::event::EventSubject::Qp,
                    Some(EventClass::SRQ) if matches!(event, Event::SrqLastWqe { .. }) => {
                        ib_types::event::EventSubject::Qp
                    }
                    Some(EventClass::SRQ) => ib_types::event::EventSubject::Srq,
                    Some(EventClass::CQ_ERROR) => ib_types::event::EventSubject::Cq,
                    Some(EventClass::PORT) => ib_types::event::EventSubject::Port,
                    _ => ib_types::event::EventSubject::Ca,
                };
                assert_eq!(subject, kind, "{event:?}");
            }
        }
    }

    #[test]
    fn owner_over_wraps() {
        let log = 1;
        let mut ring = [Eqe::default(); 2];
        for counter in 0..10u32 {
            let slot = owner::slot(counter, log) as usize;
            assert!(!ring[slot].is_valid(counter, log));
            ring[slot] = Eqe::new(Event::Catastrophic).with_owner(counter, log);
            assert!(ring[slot].is_valid(counter, log));
        }
    }

    fn any_event() -> impl Strategy<Value = Event> {
        let qpn = || (0..=Qpn::MAX.get()).prop_map(|q| Qpn::new(q).unwrap());
        let port = || (1u8..).prop_map(|p| PortNum::new(p).unwrap());
        prop_oneof![
            any::<u32>().prop_map(|cqn| Event::Completion { cqn }),
            qpn().prop_map(|qpn| Event::CommEst { qpn }),
            qpn().prop_map(|qpn| Event::SqDrained { qpn }),
            qpn().prop_map(|qpn| Event::PathMigrated { qpn }),
            qpn().prop_map(|qpn| Event::QpFatal { qpn }),
            qpn().prop_map(|qpn| Event::WqInvalidRequest { qpn }),
            qpn().prop_map(|qpn| Event::WqAccessError { qpn }),
            any::<u32>().prop_map(|srqn| Event::SrqLimit { srqn }),
            qpn().prop_map(|qpn| Event::SrqLastWqe { qpn }),
            any::<u32>().prop_map(|srqn| Event::SrqCatastrophic { srqn }),
            any::<u32>().prop_map(|cqn| Event::CqError { cqn }),
            (port(), any::<bool>()).prop_map(|(port, active)| Event::PortChange { port, active }),
            port().prop_map(|port| Event::PkeyViolation { port }),
            port().prop_map(|port| Event::QkeyViolation { port }),
            (any::<u16>(), any::<u8>(), any::<u64>()).prop_map(|(token, status, out_imm)| {
                Event::CmdCompletion {
                    token,
                    status,
                    out_imm,
                }
            }),
            Just(Event::Catastrophic),
        ]
    }

    proptest! {
        #[test]
        fn encode_then_decode(event in any_event(), counter: u32, log in 0u8..24) {
            let eqe = Eqe::from(event).with_owner(counter, log);
            prop_assert!(eqe.is_valid(counter, log));
            prop_assert_eq!(eqe.decode(), Ok(event));
            prop_assert_eq!(eqe.event_type, event.event_type().code());
        }

        #[test]
        fn decode_is_total(bytes: [u8; 32]) {
            let eqe = Eqe::read_from_bytes(&bytes).unwrap();
            if let Ok(event) = eqe.decode() {
                // Re-encoding reproduces every field the event uses.
                let again = Eqe::new(event);
                prop_assert_eq!(again.event_type, eqe.event_type);
                prop_assert_eq!(Eqe::new(again.decode().unwrap()), again);
            }
        }
    }
}
