//! The QP state machine as data (IBA 11.2.5.2, Table 91 "QP State Transition
//! Properties"): for each QP type and each transition a Modify QP may request,
//! the attributes it must carry and the attributes it may carry.
//!
//! [`check_modify`] is the single judge used by the miniport, the simulated
//! device and the user-mode library. It rejects, each with its own error, a
//! transition the table does not list, a missing required attribute, an
//! attribute outside required-or-optional, and a `CUR_STATE` that disagrees
//! with the QP's real state. `STATE` itself is not part of the table: a modify
//! without it asks to stay in the current state (RTS->RTS and the like).

use crate::qp::{QpAttrMask, QpModify, QpState, QpType};
use crate::status::IbStatus;

/// Required and optional attributes of one transition for one QP type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttrRule {
    /// Attributes the modify must carry.
    pub required: QpAttrMask,
    /// Attributes the modify may carry.
    pub optional: QpAttrMask,
}

/// The rule of one transition for each QP type; `None` = illegal for it.
#[derive(Debug, Clone, Copy)]
struct Row {
    from: QpState,
    to: QpState,
    rc: Option<AttrRule>,
    uc: Option<AttrRule>,
    ud: Option<AttrRule>,
    /// SMI and GSI (QP0/QP1) share a column.
    special: Option<AttrRule>,
}

const fn rule(required: QpAttrMask, optional: QpAttrMask) -> Option<AttrRule> {
    Some(AttrRule { required, optional })
}

const NONE: QpAttrMask = QpAttrMask::empty();

/// Shorthand for building masks in the const table.
macro_rules! m {
    () => { QpAttrMask::empty() };
    ($($bit:ident)|+) => { QpAttrMask::empty()$(.union(QpAttrMask::$bit))+ };
}

/// A transition every QP type may take with no attributes (to Reset or Error).
const fn always(from: QpState, to: QpState) -> Row {
    let r = rule(NONE, NONE);
    Row {
        from,
        to,
        rc: r,
        uc: r,
        ud: r,
        special: r,
    }
}

use QpState::{Err as Error, Init, Reset, Rtr, Rts, Sqd, Sqe};

/// The transitions of IBA Table 91 for RC, UC, UD and the special QPs.
const TABLE: &[Row] = &[
    always(Reset, Reset),
    always(Reset, Error),
    Row {
        from: Reset,
        to: Init,
        rc: rule(m!(PKEY_INDEX | PORT | ACCESS_FLAGS), NONE),
        uc: rule(m!(PKEY_INDEX | PORT | ACCESS_FLAGS), NONE),
        ud: rule(m!(PKEY_INDEX | PORT | QKEY), NONE),
        special: rule(m!(PKEY_INDEX | QKEY), NONE),
    },
    always(Init, Reset),
    always(Init, Error),
    Row {
        from: Init,
        to: Init,
        rc: rule(NONE, m!(PKEY_INDEX | PORT | ACCESS_FLAGS)),
        uc: rule(NONE, m!(PKEY_INDEX | PORT | ACCESS_FLAGS)),
        ud: rule(NONE, m!(PKEY_INDEX | PORT | QKEY)),
        special: rule(NONE, m!(PKEY_INDEX | QKEY)),
    },
    Row {
        from: Init,
        to: Rtr,
        rc: rule(
            m!(AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER),
            m!(ALT_PATH | ACCESS_FLAGS | PKEY_INDEX),
        ),
        uc: rule(
            m!(AV | PATH_MTU | DEST_QPN | RQ_PSN),
            m!(ALT_PATH | ACCESS_FLAGS | PKEY_INDEX),
        ),
        ud: rule(NONE, m!(PKEY_INDEX | QKEY)),
        special: rule(NONE, m!(PKEY_INDEX | QKEY)),
    },
    always(Rtr, Reset),
    always(Rtr, Error),
    Row {
        from: Rtr,
        to: Rts,
        rc: rule(
            m!(TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC),
            m!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE),
        ),
        uc: rule(
            m!(SQ_PSN),
            m!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE),
        ),
        ud: rule(m!(SQ_PSN), m!(CUR_STATE | QKEY)),
        special: rule(m!(SQ_PSN), m!(CUR_STATE | QKEY)),
    },
    always(Rts, Reset),
    always(Rts, Error),
    Row {
        from: Rts,
        to: Rts,
        rc: rule(
            NONE,
            m!(CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE | MIN_RNR_TIMER),
        ),
        uc: rule(
            NONE,
            m!(CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE),
        ),
        ud: rule(NONE, m!(CUR_STATE | QKEY)),
        special: rule(NONE, m!(CUR_STATE | QKEY)),
    },
    Row {
        from: Rts,
        to: Sqd,
        rc: rule(NONE, m!(EN_SQD_ASYNC_NOTIFY)),
        uc: rule(NONE, m!(EN_SQD_ASYNC_NOTIFY)),
        ud: rule(NONE, m!(EN_SQD_ASYNC_NOTIFY)),
        special: rule(NONE, m!(EN_SQD_ASYNC_NOTIFY)),
    },
    always(Sqd, Reset),
    always(Sqd, Error),
    Row {
        from: Sqd,
        to: Rts,
        rc: rule(
            NONE,
            m!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE),
        ),
        uc: rule(
            NONE,
            m!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE),
        ),
        ud: rule(NONE, m!(CUR_STATE | QKEY)),
        special: rule(NONE, m!(CUR_STATE | QKEY)),
    },
    Row {
        from: Sqd,
        to: Sqd,
        rc: rule(
            NONE,
            m!(PORT
                | AV
                | TIMEOUT
                | RETRY_CNT
                | RNR_RETRY
                | MAX_QP_RD_ATOMIC
                | MAX_DEST_RD_ATOMIC
                | ALT_PATH
                | ACCESS_FLAGS
                | PKEY_INDEX
                | MIN_RNR_TIMER
                | PATH_MIG_STATE),
        ),
        uc: rule(
            NONE,
            m!(AV | ALT_PATH | ACCESS_FLAGS | PKEY_INDEX | PATH_MIG_STATE),
        ),
        ud: rule(NONE, m!(PKEY_INDEX | QKEY)),
        special: rule(NONE, m!(PKEY_INDEX | QKEY)),
    },
    // An RC QP never enters SQE (a send error takes it to Error), so it has
    // no SQE row; only the Reset and Error exits exist for the others.
    Row {
        from: Sqe,
        to: Reset,
        rc: None,
        uc: rule(NONE, NONE),
        ud: rule(NONE, NONE),
        special: rule(NONE, NONE),
    },
    Row {
        from: Sqe,
        to: Error,
        rc: None,
        uc: rule(NONE, NONE),
        ud: rule(NONE, NONE),
        special: rule(NONE, NONE),
    },
    Row {
        from: Sqe,
        to: Rts,
        rc: None,
        uc: rule(NONE, m!(CUR_STATE | ACCESS_FLAGS)),
        ud: rule(NONE, m!(CUR_STATE | QKEY)),
        special: rule(NONE, m!(CUR_STATE | QKEY)),
    },
    always(Error, Reset),
    always(Error, Error),
];

/// The attribute rule of `from -> to` for `qp_type`, or `None` when a Modify
/// QP may not request that transition.
pub fn attr_rule(qp_type: QpType, from: QpState, to: QpState) -> Option<AttrRule> {
    let row = TABLE.iter().find(|row| row.from == from && row.to == to)?;
    match qp_type {
        QpType::Rc => row.rc,
        QpType::Uc => row.uc,
        QpType::Ud => row.ud,
        QpType::Smi | QpType::Gsi => row.special,
    }
}

/// Why a Modify QP was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransitionError {
    /// The table has no such transition for this QP type.
    #[error("a {qp_type:?} QP cannot move from {from:?} to {to:?}")]
    Illegal {
        /// QP type.
        qp_type: QpType,
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// Required attributes are absent.
    #[error("{from:?} -> {to:?} requires {missing:?}")]
    MissingRequired {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
        /// The required attributes not supplied.
        missing: QpAttrMask,
    },
    /// Attributes outside required-or-optional were supplied.
    #[error("{from:?} -> {to:?} does not accept {unexpected:?}")]
    NotAllowed {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
        /// The attributes that may not be supplied.
        unexpected: QpAttrMask,
    },
    /// `CUR_STATE` names a state the QP is not in.
    #[error("the consumer believes the QP is {claimed:?}, but it is {actual:?}")]
    CurrentStateMismatch {
        /// What `CUR_STATE` said.
        claimed: QpState,
        /// The real state.
        actual: QpState,
    },
}

impl TransitionError {
    /// The IB status a Modify QP verb returns for this refusal.
    pub const fn status(&self) -> IbStatus {
        match self {
            Self::Illegal { .. } => IbStatus::InvalidState,
            Self::MissingRequired { .. } => IbStatus::InvalidParameter,
            Self::NotAllowed { .. } => IbStatus::InvalidSetting,
            Self::CurrentStateMismatch { .. } => IbStatus::InvalidQpState,
        }
    }
}

/// Checks a modify given as a mask (with `STATE` set when `to` is a state
/// change request) against the table. Returns the state the QP moves to.
pub fn check_mask(
    qp_type: QpType,
    current: QpState,
    mask: QpAttrMask,
    to: Option<QpState>,
    cur_state: Option<QpState>,
) -> Result<QpState, TransitionError> {
    let to = to.unwrap_or(current);
    let rule = attr_rule(qp_type, current, to).ok_or(TransitionError::Illegal {
        qp_type,
        from: current,
        to,
    })?;
    let attrs = mask.difference(QpAttrMask::STATE);
    let missing = rule.required.difference(attrs);
    if !missing.is_empty() {
        return Err(TransitionError::MissingRequired {
            from: current,
            to,
            missing,
        });
    }
    let unexpected = attrs.difference(rule.required.union(rule.optional));
    if !unexpected.is_empty() {
        return Err(TransitionError::NotAllowed {
            from: current,
            to,
            unexpected,
        });
    }
    match cur_state {
        Some(claimed) if claimed != current => Err(TransitionError::CurrentStateMismatch {
            claimed,
            actual: current,
        }),
        _ => Ok(to),
    }
}

/// Checks `modify` for a `qp_type` QP now in `current`; returns the next state.
pub fn check_modify(
    qp_type: QpType,
    current: QpState,
    modify: &QpModify,
) -> Result<QpState, TransitionError> {
    check_mask(
        qp_type,
        current,
        modify.mask(),
        modify.state,
        modify.cur_state,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use QpAttrMask as M;
    use proptest::prelude::*;

    /// The legal (type, from, to) triples, written out independently of
    /// `TABLE` from the spec's state diagram: Reset and Error are reachable
    /// from everywhere; SQE exists only for non-RC QPs.
    fn spec_legal(t: QpType, from: QpState, to: QpState) -> bool {
        let rc = t == QpType::Rc;
        match (from, to) {
            (Sqe, _) if rc => false,
            (_, Reset | Error) => true,
            (Reset, Init) | (Init, Init) | (Init, Rtr) | (Rtr, Rts) => true,
            (Rts, Rts) | (Rts, Sqd) | (Sqd, Rts) | (Sqd, Sqd) => true,
            (Sqe, Rts) => true,
            _ => false,
        }
    }

    /// Every attribute bit except STATE.
    fn attribute_bits() -> impl Iterator<Item = QpAttrMask> {
        M::all().difference(M::STATE).iter()
    }

    #[test]
    fn table_has_one_row_per_transition() {
        for (i, a) in TABLE.iter().enumerate() {
            for b in &TABLE[i + 1..] {
                assert!(
                    (a.from, a.to) != (b.from, b.to),
                    "duplicate row {:?}->{:?}",
                    a.from,
                    a.to
                );
            }
        }
    }

    #[test]
    fn required_and_optional_are_disjoint_and_exclude_state() {
        for &t in QpType::ALL {
            for &from in QpState::ALL {
                for &to in QpState::ALL {
                    if let Some(r) = attr_rule(t, from, to) {
                        assert!(r.required.intersection(r.optional).is_empty());
                        assert!(!r.required.union(r.optional).contains(M::STATE));
                        // CUR_STATE is only ever optional, and only from
                        // RTR, RTS, SQD or SQE.
                        if r.optional.contains(M::CUR_STATE) {
                            assert!(matches!(from, Rtr | Rts | Sqd | Sqe));
                        }
                        assert!(!r.required.contains(M::CUR_STATE));
                    }
                }
            }
        }
    }

    /// Every (type, from, to): a legal transition accepts its required set
    /// plus any one optional attribute, rejects each missing required
    /// attribute and each attribute outside the rule; an illegal one rejects
    /// every mask.
    #[test]
    fn every_transition_legal_and_illegal() {
        let mut legal_count = 0;
        for &t in QpType::ALL {
            for &from in QpState::ALL {
                for &to in QpState::ALL {
                    let rule = attr_rule(t, from, to);
                    assert_eq!(
                        rule.is_some(),
                        spec_legal(t, from, to),
                        "{t:?} {from:?}->{to:?} legality"
                    );
                    let Some(rule) = rule else {
                        for mask in [M::STATE, M::STATE | M::QKEY, M::all()] {
                            assert_eq!(
                                check_mask(t, from, mask, Some(to), None),
                                Err(TransitionError::Illegal {
                                    qp_type: t,
                                    from,
                                    to
                                })
                            );
                        }
                        continue;
                    };
                    legal_count += 1;
                    let base = rule.required | M::STATE;
                    assert_eq!(check_mask(t, from, base, Some(to), None), Ok(to));
                    assert_eq!(
                        check_mask(t, from, base | rule.optional, Some(to), None),
                        Ok(to),
                        "{t:?} {from:?}->{to:?} with every optional attribute"
                    );
                    for bit in rule.optional.iter() {
                        assert_eq!(check_mask(t, from, base | bit, Some(to), None), Ok(to));
                    }
                    for bit in rule.required.iter() {
                        assert_eq!(
                            check_mask(t, from, base.difference(bit), Some(to), None),
                            Err(TransitionError::MissingRequired {
                                from,
                                to,
                                missing: bit
                            }),
                            "{t:?} {from:?}->{to:?} without {bit:?}"
                        );
                    }
                    for bit in attribute_bits() {
                        if rule.required.union(rule.optional).contains(bit) {
                            continue;
                        }
                        assert_eq!(
                            check_mask(t, from, base | bit, Some(to), None),
                            Err(TransitionError::NotAllowed {
                                from,
                                to,
                                unexpected: bit
                            }),
                            "{t:?} {from:?}->{to:?} with {bit:?}"
                        );
                    }
                }
            }
        }
        // 5 QP types; RC lacks the three SQE rows.
        assert_eq!(legal_count, 5 * TABLE.len() - 3);
    }

    #[test]
    fn spec_examples() {
        use QpType::*;
        let req = |t, f, to| attr_rule(t, f, to).unwrap().required;
        assert_eq!(req(Ud, Reset, Init), M::PKEY_INDEX | M::PORT | M::QKEY);
        assert_eq!(
            req(Rc, Reset, Init),
            M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS
        );
        assert_eq!(
            req(Rc, Init, Rtr),
            M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER
        );
        assert_eq!(
            req(Rc, Rtr, Rts),
            M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC
        );
        assert_eq!(req(Ud, Init, Rtr), M::empty());
        assert!(attr_rule(Rc, Sqe, Rts).is_none(), "SQE->RTS is not for RC");
        assert!(attr_rule(Uc, Sqe, Rts).is_some());
        assert!(attr_rule(Rc, Init, Rts).is_none(), "no skipping RTR");
        assert!(
            attr_rule(Ud, Rts, Sqe).is_none(),
            "SQE is entered by the CI only"
        );
    }

    #[test]
    fn modify_without_state_stays() {
        let m = QpModify {
            qkey: Some(crate::scalars::QKey::new(7)),
            ..QpModify::default()
        };
        assert_eq!(check_modify(QpType::Ud, Rts, &m), Ok(Rts));
        assert_eq!(
            check_modify(QpType::Rc, Rts, &m),
            Err(TransitionError::NotAllowed {
                from: Rts,
                to: Rts,
                unexpected: M::QKEY
            })
        );
        // RTR -> RTR is not a transition the table lists.
        assert!(matches!(
            check_modify(QpType::Ud, Rtr, &m),
            Err(TransitionError::Illegal { .. })
        ));
    }

    #[test]
    fn each_refusal_has_its_own_status() {
        let errors = [
            TransitionError::Illegal {
                qp_type: QpType::Rc,
                from: Reset,
                to: Rts,
            },
            TransitionError::MissingRequired {
                from: Reset,
                to: Init,
                missing: M::PORT,
            },
            TransitionError::NotAllowed {
                from: Rts,
                to: Rts,
                unexpected: M::QKEY,
            },
            TransitionError::CurrentStateMismatch {
                claimed: Rts,
                actual: Sqd,
            },
        ];
        for (i, a) in errors.iter().enumerate() {
            assert!(a.status().is_error());
            for b in &errors[i + 1..] {
                assert_ne!(a.status(), b.status());
            }
        }
    }

    /// IBA Table 91 lists "current QP state" as an optional attribute only
    /// in the rows that end in RTS (RTR->RTS, RTS->RTS, SQD->RTS, SQE->RTS:
    /// the consumer may assert where it believes the QP is when it resumes
    /// sending); no other row, RESET->INIT included, takes it. (Linux's
    /// `ib_modify_qp_is_ok` encodes the same rows.) So a RESET->INIT with
    /// CUR_STATE is refused as an attribute the transition does not accept,
    /// even when it names RESET truly.
    #[test]
    fn cur_state_is_optional_exactly_on_the_rows_into_rts() {
        for &t in QpType::ALL {
            for &from in QpState::ALL {
                for &to in QpState::ALL {
                    let Some(r) = attr_rule(t, from, to) else {
                        continue;
                    };
                    let into_rts = to == Rts && matches!(from, Rtr | Rts | Sqd | Sqe);
                    assert_eq!(
                        r.optional.contains(M::CUR_STATE),
                        into_rts,
                        "{t:?} {from:?}->{to:?}"
                    );
                }
            }
        }
        let to_init = QpModify {
            state: Some(Init),
            cur_state: Some(Reset),
            pkey_index: Some(0),
            port: Some(crate::scalars::PortNum::FIRST),
            access: Some(crate::access::AccessFlags::REMOTE_WRITE),
            ..QpModify::default()
        };
        assert_eq!(
            check_modify(QpType::Rc, Reset, &to_init),
            Err(TransitionError::NotAllowed {
                from: Reset,
                to: Init,
                unexpected: M::CUR_STATE
            })
        );
    }

    #[test]
    fn cur_state_must_match() {
        let m = QpModify {
            state: Some(Rts),
            cur_state: Some(Sqd),
            ..QpModify::default()
        };
        assert_eq!(check_modify(QpType::Uc, Sqd, &m), Ok(Rts));
        assert_eq!(
            check_modify(QpType::Uc, Sqe, &m),
            Err(TransitionError::CurrentStateMismatch {
                claimed: Sqd,
                actual: Sqe
            })
        );
    }

    #[test]
    fn a_full_rc_bring_up() {
        let to_init = QpModify {
            state: Some(Init),
            pkey_index: Some(0),
            port: Some(crate::scalars::PortNum::FIRST),
            access: Some(crate::access::AccessFlags::REMOTE_WRITE),
            ..QpModify::default()
        };
        let to_rtr = crate::qp::tests::rc_to_rtr();
        let to_rts = QpModify {
            state: Some(Rts),
            timeout: Some(14),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            sq_psn: Some(crate::scalars::Psn::new(0).unwrap()),
            max_rd_atomic: Some(4),
            ..QpModify::default()
        };
        let mut state = Reset;
        for m in [to_init, to_rtr, to_rts] {
            state = check_modify(QpType::Rc, state, &m).unwrap();
        }
        assert_eq!(state, Rts);
    }

    proptest! {
        /// For any mask, the verdict is exactly what the rule says, and the
        /// checks come in a fixed order: legality, required, allowed.
        #[test]
        fn verdict_matches_rule(
            t in proptest::sample::select(QpType::ALL),
            from in proptest::sample::select(QpState::ALL),
            to in proptest::sample::select(QpState::ALL),
            bits in any::<u32>(),
        ) {
            let mask = M::from_bits_truncate(bits) | M::STATE;
            let verdict = check_mask(t, from, mask, Some(to), None);
            match attr_rule(t, from, to) {
                None => prop_assert!(
                    matches!(verdict, Err(TransitionError::Illegal { .. })),
                    "expected illegal"
                ),
                Some(r) => {
                    let attrs = mask - M::STATE;
                    if !r.required.difference(attrs).is_empty() {
                        prop_assert!(
                            matches!(verdict, Err(TransitionError::MissingRequired { .. })),
                            "expected missing-required"
                        );
                    } else if !attrs.difference(r.required | r.optional).is_empty() {
                        prop_assert!(
                            matches!(verdict, Err(TransitionError::NotAllowed { .. })),
                            "expected not-allowed"
                        );
                    } else {
                        prop_assert_eq!(verdict, Ok(to));
                    }
                }
            }
        }
    }
}
