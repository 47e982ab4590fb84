//! Asynchronous events: the codes a CA reports outside any work request, the
//! object each is about, and the record that carries one across the ABI.
//!
//! Contract:
//! - [`AsyncEventCode`] is a closed `u32` code (0 is not an event, so a zeroed
//!   record never parses). It covers the affiliated and unaffiliated events of
//!   IBA 11.6.3, the port-change events the stack reports, and the extended
//!   events of the implementer's guide Table 6-3 (traps and thresholds).
//! - Every code has exactly one [`EventSubject`]: affiliated events name a
//!   QP, CQ or SRQ by handle; port events name a port; the rest the CA.
//! - [`AsyncEventRecord::parse`] accepts a record only when its handle and
//!   port match the code's subject: a non-zero handle exactly for QP/CQ/SRQ
//!   events, a port exactly for port events.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Le32, Le64, Repr, ensure_zero};
use crate::scalars::PortNum;

/// The kind of object an asynchronous event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventSubject {
    /// The channel adapter as a whole (unaffiliated).
    Ca,
    /// One port of the CA (unaffiliated; the record names the port).
    Port,
    /// A queue pair (affiliated; the record carries its handle).
    Qp,
    /// A completion queue (affiliated; the record carries its handle).
    Cq,
    /// A shared receive queue (affiliated; the record carries its handle).
    Srq,
}

impl EventSubject {
    /// True for subjects named by a handle (IBA 11.6.3 affiliated events).
    pub const fn is_affiliated(self) -> bool {
        matches!(self, Self::Qp | Self::Cq | Self::Srq)
    }
}

code_enum! {
    /// An asynchronous event code. The numbering is this stack's own.
    pub enum AsyncEventCode: u32 {
        /// A send queue error moved the QP to the SQ Error state; it can be
        /// returned to RTS once the consumer has handled the failed WR.
        SqError = 1,
        /// The send queue of a QP in SQ Drain finished its outstanding
        /// requests (IBA 11.6.3 "Send Queue Drained").
        SqDrained = 2,
        /// A receive queue error moved the QP to the Error state.
        RqError = 3,
        /// Local work queue catastrophic error: the QP is in the Error state
        /// and its completions may be lost (IBA 11.6.3).
        QpFatal = 4,
        /// Communication established: the first packet arrived on a QP in RTR
        /// (IBA 11.6.3).
        QpComm = 5,
        /// Path migrated: the QP now uses its alternate path (IBA 11.6.3).
        QpApm = 6,
        /// Path migration request error: the alternate path could not be
        /// loaded; the QP keeps its current path.
        QpApmError = 7,
        /// Last WQE reached: a QP on an SRQ in the Error state will not take
        /// more receive WQEs (IBA 11.6.3).
        QpLastWqeReached = 8,
        /// Invalid request local work queue error: the responder saw an
        /// unsupported or malformed request; the QP is in the Error state.
        WqRequestError = 9,
        /// Local access violation work queue error: the responder saw a
        /// protection violation; the QP is in the Error state.
        WqAccessError = 10,
        /// CQ error: overrun or protection error; the CQ is unusable.
        CqError = 11,
        /// The SRQ's free WQEs fell below the armed limit (IBA 11.6.3).
        SrqLimitReached = 12,
        /// SRQ catastrophic error: the SRQ is unusable.
        SrqCatastrophic = 13,
        /// Local catastrophic error: the CA no longer works (IBA 11.6.3).
        LocalCatastrophic = 14,
        /// The port moved to the Active state.
        PortActive = 15,
        /// The port left the Active state (link down or error).
        PortDown = 16,
        /// The port's LID or LMC changed.
        LidChange = 17,
        /// The port's P_Key table changed.
        PkeyChange = 18,
        /// The port's GID table changed.
        GidChange = 19,
        /// The port's subnet manager LID or SL changed.
        SmChange = 20,
        /// The subnet manager asked clients to re-register their
        /// subscriptions and multicast memberships.
        ClientReregister = 21,
        /// Local HCA generating a P_Key violation trap (guide Table 6-3).
        PkeyTrap = 22,
        /// Local HCA generating a Q_Key violation trap (guide Table 6-3).
        QkeyTrap = 23,
        /// Local HCA generating an M_Key violation trap (guide Table 6-3).
        MkeyTrap = 24,
        /// Excessive buffer overrun threshold reached (guide Table 6-3).
        BufferOverrun = 25,
        /// Local link integrity threshold reached (guide Table 6-3).
        LinkIntegrity = 26,
    }
}

impl AsyncEventCode {
    /// The object the event is about.
    ///
    /// Traps and thresholds (guide Table 6-3) are reported against the port
    /// whose agent raised them.
    pub const fn subject(self) -> EventSubject {
        match self {
            Self::SqError
            | Self::SqDrained
            | Self::RqError
            | Self::QpFatal
            | Self::QpComm
            | Self::QpApm
            | Self::QpApmError
            | Self::QpLastWqeReached
            | Self::WqRequestError
            | Self::WqAccessError => EventSubject::Qp,
            Self::CqError => EventSubject::Cq,
            Self::SrqLimitReached | Self::SrqCatastrophic => EventSubject::Srq,
            Self::LocalCatastrophic => EventSubject::Ca,
            Self::PortActive
            | Self::PortDown
            | Self::LidChange
            | Self::PkeyChange
            | Self::GidChange
            | Self::SmChange
            | Self::ClientReregister
            | Self::PkeyTrap
            | Self::QkeyTrap
            | Self::MkeyTrap
            | Self::BufferOverrun
            | Self::LinkIntegrity => EventSubject::Port,
        }
    }

    /// True when the subject has failed for good: the QP is in the Error
    /// state, or the CQ, SRQ or whole CA is unusable, and the consumer must
    /// reset or destroy it. `SqError` (recoverable back to RTS),
    /// `QpApmError` (the current path still works) and port events are not
    /// fatal.
    pub const fn is_fatal(self) -> bool {
        matches!(
            self,
            Self::RqError
                | Self::QpFatal
                | Self::WqRequestError
                | Self::WqAccessError
                | Self::CqError
                | Self::SrqCatastrophic
                | Self::LocalCatastrophic
        )
    }
}

/// ABI layout of an asynchronous event record (24 bytes).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct AsyncEventRecordAbi {
    /// [`AsyncEventCode`].
    pub code: Le32,
    /// Port number for port events, 0 otherwise.
    pub port_num: u8,
    /// Zero.
    pub reserved_at_0x5: [u8; 3],
    /// Handle of the QP, CQ or SRQ for affiliated events, 0 otherwise.
    pub handle: Le64,
    /// Device-specific detail, opaque to the stack.
    pub vendor_code: Le64,
}

assert_layout!(
    AsyncEventRecordAbi,
    size = 24,
    code @ 0,
    port_num @ 4,
    reserved_at_0x5 @ 5,
    handle @ 8,
    vendor_code @ 16,
);

/// An asynchronous event as delivered to a consumer.
///
/// Values built with [`new`](Self::new) (or read with `parse`) are
/// consistent; a value assembled field by field that is not emits a layout
/// `parse` rejects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AsyncEventRecord {
    /// What happened.
    pub code: AsyncEventCode,
    /// The raw handle of the QP, CQ or SRQ the event is about (see
    /// [`AsyncEventCode::subject`]); 0 for CA and port events.
    pub handle: u64,
    /// The port, present exactly for port events.
    pub port: Option<PortNum>,
    /// Device-specific detail, opaque to the stack.
    pub vendor_code: u64,
}

impl AsyncEventRecord {
    /// A record, checked against the code's subject.
    pub const fn new(
        code: AsyncEventCode,
        handle: u64,
        port: Option<PortNum>,
        vendor_code: u64,
    ) -> Result<Self, AbiError> {
        let record = Self {
            code,
            handle,
            port,
            vendor_code,
        };
        match record.check() {
            Ok(()) => Ok(record),
            Err(e) => Err(e),
        }
    }

    /// Checks that the handle and port agree with the code's subject.
    pub const fn check(&self) -> Result<(), AbiError> {
        let subject = self.code.subject();
        if subject.is_affiliated() == (self.handle == 0) {
            return Err(AbiError::OutOfRange {
                field: "AsyncEventRecord.handle",
                value: self.handle,
            });
        }
        if matches!(subject, EventSubject::Port) != self.port.is_some() {
            return Err(AbiError::OutOfRange {
                field: "AsyncEventRecord.port_num",
                value: match self.port {
                    Some(port) => port.get() as u64,
                    None => 0,
                },
            });
        }
        Ok(())
    }
}

impl Repr for AsyncEventRecord {
    type Abi = AsyncEventRecordAbi;

    fn parse(abi: &Self::Abi) -> Result<Self, AbiError> {
        ensure_zero("AsyncEventRecord.reserved_at_0x5", &abi.reserved_at_0x5)?;
        let code = AsyncEventCode::from_code(abi.code.get())?;
        let port = match abi.port_num {
            0 => None,
            n => Some(PortNum::new(n)?),
        };
        Self::new(code, abi.handle.get(), port, abi.vendor_code.get())
    }

    fn emit(&self) -> Self::Abi {
        AsyncEventRecordAbi {
            code: Le32::new(self.code.code()),
            port_num: match self.port {
                Some(port) => port.get(),
                None => 0,
            },
            reserved_at_0x5: [0; 3],
            handle: Le64::new(self.handle),
            vendor_code: Le64::new(self.vendor_code),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::testing::{assert_decode_total, assert_round_trip};
    use proptest::prelude::*;
    use zerocopy::IntoBytes;

    use AsyncEventCode as E;
    use EventSubject as S;

    /// Every code with its subject and fatality.
    const TABLE: &[(AsyncEventCode, EventSubject, bool)] = &[
        (E::SqError, S::Qp, false),
        (E::SqDrained, S::Qp, false),
        (E::RqError, S::Qp, true),
        (E::QpFatal, S::Qp, true),
        (E::QpComm, S::Qp, false),
        (E::QpApm, S::Qp, false),
        (E::QpApmError, S::Qp, false),
        (E::QpLastWqeReached, S::Qp, false),
        (E::WqRequestError, S::Qp, true),
        (E::WqAccessError, S::Qp, true),
        (E::CqError, S::Cq, true),
        (E::SrqLimitReached, S::Srq, false),
        (E::SrqCatastrophic, S::Srq, true),
        (E::LocalCatastrophic, S::Ca, true),
        (E::PortActive, S::Port, false),
        (E::PortDown, S::Port, false),
        (E::LidChange, S::Port, false),
        (E::PkeyChange, S::Port, false),
        (E::GidChange, S::Port, false),
        (E::SmChange, S::Port, false),
        (E::ClientReregister, S::Port, false),
        (E::PkeyTrap, S::Port, false),
        (E::QkeyTrap, S::Port, false),
        (E::MkeyTrap, S::Port, false),
        (E::BufferOverrun, S::Port, false),
        (E::LinkIntegrity, S::Port, false),
    ];

    /// A consistent record for `code`.
    fn sample(code: AsyncEventCode) -> AsyncEventRecord {
        let (handle, port) = match code.subject() {
            S::Port => (0, Some(PortNum::new(2).unwrap())),
            S::Ca => (0, None),
            _ => (0x1234_5678_9ABC_DEF0, None),
        };
        AsyncEventRecord::new(code, handle, port, 0xFEED).unwrap()
    }

    #[test]
    fn subjects_and_fatality() {
        assert_eq!(TABLE.len(), E::ALL.len());
        for (&(code, subject, fatal), &all) in TABLE.iter().zip(E::ALL) {
            assert_eq!(code, all, "table out of order");
            assert_eq!(code.subject(), subject, "{code:?}");
            assert_eq!(code.is_fatal(), fatal, "{code:?}");
            assert_eq!(E::from_code(code.code()), Ok(code));
        }
        assert!(E::from_code(0).is_err());
        assert!(E::from_code(27).is_err());
        assert!(S::Qp.is_affiliated() && S::Cq.is_affiliated() && S::Srq.is_affiliated());
        assert!(!S::Ca.is_affiliated() && !S::Port.is_affiliated());
    }

    #[test]
    fn records_round_trip() {
        for &code in E::ALL {
            assert_round_trip(&sample(code));
        }
    }

    #[test]
    fn layout_bytes() {
        let rec = sample(E::QpFatal);
        let abi = rec.emit();
        assert_eq!(
            abi.as_bytes(),
            &[
                4, 0, 0, 0, 0, 0, 0, 0, // code, port, reserved
                0xF0, 0xDE, 0xBC, 0x9A, 0x78, 0x56, 0x34, 0x12, // handle
                0xED, 0xFE, 0, 0, 0, 0, 0, 0, // vendor code
            ]
        );
        let port = sample(E::PortActive).emit();
        assert_eq!(port.port_num, 2);
    }

    #[test]
    fn inconsistent_records_rejected() {
        let port = Some(PortNum::FIRST);
        // (code, handle, port, rejected field)
        let table: &[(AsyncEventCode, u64, Option<PortNum>, &str)] = &[
            (E::QpFatal, 0, None, "AsyncEventRecord.handle"),
            (E::CqError, 0, None, "AsyncEventRecord.handle"),
            (E::SrqLimitReached, 0, None, "AsyncEventRecord.handle"),
            (E::QpComm, 7, port, "AsyncEventRecord.port_num"),
            (E::PortActive, 0, None, "AsyncEventRecord.port_num"),
            (E::PortActive, 7, port, "AsyncEventRecord.handle"),
            (E::LocalCatastrophic, 0, port, "AsyncEventRecord.port_num"),
            (E::LocalCatastrophic, 7, None, "AsyncEventRecord.handle"),
        ];
        for &(code, handle, port, field) in table {
            let err = AsyncEventRecord::new(code, handle, port, 0).unwrap_err();
            assert!(
                matches!(err, AbiError::OutOfRange { field: f, .. } if f == field),
                "{code:?}: {err:?}"
            );
            // The same record from bytes is rejected the same way.
            let bad = AsyncEventRecord {
                code,
                handle,
                port,
                vendor_code: 0,
            };
            assert_eq!(AsyncEventRecord::decode(bad.emit().as_bytes()), Err(err));
        }
    }

    #[test]
    fn bad_codes_and_reserved_rejected() {
        let mut abi = sample(E::PortDown).emit();
        abi.reserved_at_0x5[1] = 1;
        assert_eq!(
            AsyncEventRecord::parse(&abi),
            Err(AbiError::ReservedNotZero {
                field: "AsyncEventRecord.reserved_at_0x5"
            })
        );
        let mut abi = sample(E::PortDown).emit();
        abi.code = Le32::new(0xDEAD);
        assert_eq!(
            AsyncEventRecord::parse(&abi),
            Err(AbiError::InvalidCode {
                type_name: "AsyncEventCode",
                value: 0xDEAD
            })
        );
        assert!(AsyncEventRecord::decode(&[0; 24]).is_err(), "zeroed record");
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..48)) {
            assert_decode_total::<AsyncEventRecord>(&bytes);
        }

        #[test]
        fn valid_records_round_trip(
            idx in 0..E::ALL.len(),
            handle in 1u64..,
            port in 1u8..,
            vendor: u64,
        ) {
            let code = E::ALL[idx];
            let (handle, port) = match code.subject() {
                S::Port => (0, Some(PortNum::new(port).unwrap())),
                S::Ca => (0, None),
                _ => (handle, None),
            };
            assert_round_trip(&AsyncEventRecord::new(code, handle, port, vendor).unwrap());
        }
    }
}
