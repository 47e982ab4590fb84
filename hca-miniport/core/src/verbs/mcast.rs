//! Multicast memberships (guide 5.5, 6.9, Table 4-1; PRM 5.1
//! `ATTACH_MCG`/`DETACH_MCG`, 11): AttachMcast and DetachMcast for UD QPs.
//!
//! Contract:
//! - **Attach** (target: the QP): only a UD QP joins a group (IBA 10.5;
//!   anything else is [`IbStatus::InvalidServiceType`], nothing sent). The
//!   membership (QP, group GID) gets its own generation-checked handle of
//!   kind MCAST, the object DetachMcast names. It is recorded (busy) and
//!   counted on the QP ([`Qp::mcast_attachments`](super::qp::Qp::mcast_attachments))
//!   before `ATTACH_MCG` is sent, so a destroy of the QP meanwhile is
//!   [`IbStatus::ResourceBusy`]; a refusal by the device removes it again.
//!   Device statuses: the QP already in the group `BAD_RES_STATE` →
//!   [`IbStatus::InvalidState`]; too many groups or members `EXCEED_LIMIT`
//!   → [`IbStatus::MaxMcastQpsReached`].
//! - **Detach**: `DETACH_MCG`; the handle goes stale and the QP's count
//!   drops when it completes. A detach in flight makes other verbs on the
//!   membership [`IbStatus::ResourceBusy`].
//! - **Destroying the QP** detaches every membership first (the QP module's
//!   destroy, guide 6.5.5 item 6); their handles go stale with it.
//! - The group's MLID is kept by the caller: RoCEv2 ports route by the
//!   group GID alone (PRM 10.1), and `ATTACH_MCG` takes only the GID.

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec;
use alloc::vec::Vec;

use driver_platform::Platform;
use hca_prm::cmd::{CmdStatus, Opcode};
use ib_types::ioctl::{AttachMcast, DetachMcast, Empty};
use ib_types::qp::QpType;
use ib_types::scalars::Gid;
use ib_types::status::IbStatus;
use zerocopy::IntoBytes;

use super::Accepted;
use super::qp::Qp;
use crate::cmd::{Command, CommandError};
use crate::hca::Hca;
use crate::resources::{Handle, kind};

/// Most memberships the core tracks (bounds the table's memory; the device
/// bounds groups and members per group itself).
pub const MAX_MEMBERSHIPS: u32 = 1 << 14;

/// One UD QP's membership in one group.
pub(crate) struct Membership<P: Platform> {
    pub(super) qp: Arc<Qp<P>>,
    pub(super) gid: Gid,
    /// An attach, a detach, or the QP's destroy is under way.
    busy: bool,
}

impl<P: Platform> Membership<P> {
    /// The member QP's number.
    pub(crate) fn qpn(&self) -> u32 {
        self.qp.qpn()
    }
}

/// `DETACH_MCG` of QP `qpn` from group `gid`.
pub(crate) fn detach_command(qpn: u32, gid: &Gid) -> Command {
    Command::new(Opcode::DetachMcg, qpn).with_mailbox(gid.as_bytes().to_vec())
}

/// The status a failed attach or detach answers.
fn status_of(error: &CommandError) -> IbStatus {
    match error {
        CommandError::Status {
            status: CmdStatus::ExceedLimit,
            ..
        } => IbStatus::MaxMcastQpsReached,
        other => other.ib_status(),
    }
}

impl<P: Platform> Hca<P> {
    pub(crate) fn attach_mcast_request(self: &Arc<Self>, a: Accepted<AttachMcast, P::Request>) {
        let qp = match self.find_qp(a.handle, a.mode) {
            Ok(qp) => qp,
            Err(status) => return a.responder.fail(status),
        };
        if qp.qp_type() != QpType::Ud {
            return a.responder.fail(IbStatus::InvalidServiceType);
        }
        if let Err(status) = qp.begin_mcast_attach() {
            return a.responder.fail(status);
        }
        let gid = a.input.mgid;
        let membership = Membership {
            qp: qp.clone(),
            gid,
            busy: true,
        };
        let recorded =
            self.with_objects_mut(|o| o.mcasts.insert_with(|_| membership).map_err(IbStatus::from));
        let handle = match recorded.and_then(|r| r) {
            Ok(handle) => handle,
            Err(status) => {
                qp.end_mcast_attach();
                return a.responder.fail(status);
            }
        };
        let responder = a.responder;
        self.run_commands(
            vec![Command::new(Opcode::AttachMcg, qp.qpn()).with_mailbox(gid.as_bytes().to_vec())],
            Box::new(move |hca, result| match result {
                Ok(_) => {
                    let _ = hca.with_objects_mut(|o| {
                        if let Some(m) = o.mcasts.get_mut(handle) {
                            m.busy = false;
                        }
                    });
                    responder.finish(IbStatus::Success, handle.raw(), Some(&Empty), &[]);
                }
                Err(error) => {
                    let _ = hca.with_objects_mut(|o| o.mcasts.remove(handle));
                    qp.end_mcast_attach();
                    responder.fail(status_of(&error));
                }
            }),
        );
    }

    pub(crate) fn detach_mcast_request(self: &Arc<Self>, a: Accepted<DetachMcast, P::Request>) {
        let mode = a.mode;
        let handle = Handle::<kind::Mcast>::from_raw(a.handle);
        let claimed = self.with_objects_mut(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidMcastHandle);
            }
            let m = o
                .mcasts
                .get_mut(handle)
                .ok_or(IbStatus::InvalidMcastHandle)?;
            if m.busy {
                return Err(IbStatus::ResourceBusy);
            }
            m.busy = true;
            Ok((m.qp.clone(), m.gid))
        });
        let (qp, gid) = match claimed.and_then(|r| r) {
            Ok(claimed) => claimed,
            Err(status) => return a.responder.fail(status),
        };
        let responder = a.responder;
        self.run_commands(
            vec![detach_command(qp.qpn(), &gid)],
            Box::new(move |hca, result| match hca.forgive_when_failed(result) {
                Ok(_) => {
                    let _ = hca.with_objects_mut(|o| o.mcasts.remove(handle));
                    qp.end_mcast_attach();
                    responder.finish(IbStatus::Success, 0, Some(&Empty), &[]);
                }
                Err(error) => {
                    let _ = hca.with_objects_mut(|o| {
                        if let Some(m) = o.mcasts.get_mut(handle) {
                            m.busy = false;
                        }
                    });
                    responder.fail(status_of(&error));
                }
            }),
        );
    }

    /// Marks every membership of QP `qpn` busy for its destroy and returns
    /// them; [`IbStatus::ResourceBusy`] (nothing marked) if one is busy
    /// already (an attach or detach in flight).
    pub(crate) fn claim_memberships(
        &self,
        qpn: u32,
    ) -> Result<Vec<(Handle<kind::Mcast>, Gid)>, IbStatus> {
        self.with_objects_mut(|o| {
            if o.mcasts.is_empty() {
                return Ok(Vec::new());
            }
            let mine: Vec<(Handle<kind::Mcast>, Gid, bool)> = o
                .mcasts
                .iter()
                .filter(|(_, m)| m.qp.qpn() == qpn)
                .map(|(h, m)| (h, m.gid, m.busy))
                .collect();
            if mine.iter().any(|(_, _, busy)| *busy) {
                return Err(IbStatus::ResourceBusy);
            }
            for (h, _, _) in &mine {
                if let Some(m) = o.mcasts.get_mut(*h) {
                    m.busy = true;
                }
            }
            Ok(mine.into_iter().map(|(h, gid, _)| (h, gid)).collect())
        })?
    }

    /// Detaches QP `qpn` from the groups of `memberships` (claimed by
    /// [`claim_memberships`](Self::claim_memberships) for the QP's
    /// destroy), one `DETACH_MCG` after the other, forgetting each
    /// membership and dropping it from the QP's count when its command
    /// completes, whatever the outcome: the QP leaves the group in any
    /// case, since `HW2SW_QP` drops attachments too (PRM 6.1.4). Then
    /// runs `done`.
    pub(crate) fn leave_groups(
        self: &Arc<Self>,
        qpn: u32,
        mut memberships: Vec<(Handle<kind::Mcast>, Gid)>,
        done: super::Job<P>,
    ) {
        let Some((handle, gid)) = memberships.pop() else {
            return done(self);
        };
        self.run_commands(
            vec![detach_command(qpn, &gid)],
            Box::new(move |hca, _| {
                let qp = hca
                    .with_objects_mut(|o| o.mcasts.remove(handle).ok().map(|m| m.qp))
                    .ok()
                    .flatten();
                if let Some(qp) = qp {
                    qp.end_mcast_attach();
                }
                hca.leave_groups(qpn, memberships, done);
            }),
        );
    }

    /// Gives back memberships claimed by
    /// [`claim_memberships`](Self::claim_memberships) (the destroy did not
    /// happen).
    pub(crate) fn unclaim_memberships(&self, memberships: &[(Handle<kind::Mcast>, Gid)]) {
        let _ = self.with_objects_mut(|o| {
            for (h, _) in memberships {
                if let Some(m) = o.mcasts.get_mut(*h) {
                    m.busy = false;
                }
            }
        });
    }
}
