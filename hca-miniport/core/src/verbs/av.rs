//! Address vectors (guide 5.3, 6.4.1; PRM 6.1.1, 10.2): CreateAv,
//! QueryAv, ModifyAv and DestroyAv for kernel clients.
//!
//! Contract:
//! - **Kernel AVs are software objects** (guide 5.3's "AVT in system
//!   memory managed by the kernel mode driver"): this device has no AV
//!   table; a UD send WQE carries the 32-byte PRM 6.1.1 address vector
//!   inline. An AV holds the client's [`AvAttr`] (answered by QueryAv
//!   exactly as given) and its [`hca_prm::av::Av`] encoding, which the UD
//!   post path reads through `Hca::av_for_post` (crate-private).
//! - **Validation** (guide 6.4.2's port check done at create time for
//!   kernel AVs): the port must be `1..=num_ports`
//!   ([`IbStatus::InvalidPort`]); the device is RoCEv2 only, so the GRH is
//!   required and the layout's SL and flow-label limits apply
//!   ([`IbStatus::InvalidParameter`]); the static rate must be 0 (full
//!   rate: the PRM 6.1.1 layout has no rate field, so any other code could
//!   not be honoured — [`IbStatus::InvalidSetting`]); the source GID index
//!   must name a set entry of the port's GID table, read with `QUERY_PORT`
//!   when the verb runs ([`IbStatus::InvalidGid`]). An AV carries no MTU
//!   (IBA 11.2.2.1; the path MTU is a QP attribute), so there is none to
//!   check. A refused create or modify changes nothing.
//! - **PD use.** An AV takes a use of its PD ([`Hca::reference_pd`]) from
//!   the moment its create is accepted until it is destroyed (or the
//!   create fails), so DeallocPd answers [`IbStatus::ResourceBusy`] while
//!   an AV lives in the PD.
//! - **User mode.** A user-mode request answers [`IbStatus::Unsupported`]:
//!   user AVs (guide 6.4.2) are the provider's, which refuses what
//!   `check_static` refuses with the same status (it calls the same
//!   [`hca_prm::av::Av::for_device`], with the port count from `OpenCa`).
//! - Every verb may be issued at DISPATCH_LEVEL; create and modify
//!   complete from the DPC after their `QUERY_PORT`.

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec;

use driver_platform::{Platform, Request, RequestorMode};
use hca_prm::cmd::{Opcode, PortInfo};
use ib_types::av::AvAttr;
use ib_types::handle::PdHandle;
use ib_types::ioctl::{CreateAv, DestroyAv, Empty, ModifyAv, QueryAv, QueryAvOut};
use ib_types::status::IbStatus;
use zerocopy::FromBytes;

use super::Accepted;
use crate::cmd::{Command, CommandOutput};
use crate::hca::Hca;
use crate::resources::{Handle, kind};

/// Address vectors the core hands out (software objects; this bounds the
/// table's memory).
pub const MAX_AVS: u32 = 1 << 14;

/// Bytes of a `QUERY_PORT` answer (the largest mailbox).
const QUERY_PORT_BYTES: usize = hca_prm::cmd::MAX_MAILBOX_BYTES;

/// A kernel address vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Av {
    /// The raw handle of the PD it lives in (one use of it held).
    pd: u64,
    /// The attributes as the client gave them.
    attr: AvAttr,
    /// The PRM 6.1.1 encoding a UD WQE carries.
    encoded: hca_prm::av::Av,
}

/// The checks that need no device command (the same the user-mode
/// provider applies, [`hca_prm::av::Av::for_device`]); returns the
/// encoding.
fn check_static(attr: &AvAttr, num_ports: u8) -> Result<hca_prm::av::Av, IbStatus> {
    hca_prm::av::Av::for_device(attr, num_ports)
}

/// The check against the port's GID table, from its `QUERY_PORT` answer:
/// the source GID index names an entry that is set (non-zero).
fn check_gid(attr: &AvAttr, answer: &CommandOutput) -> Result<(), IbStatus> {
    let Some(grh) = attr.grh else {
        return Err(IbStatus::InvalidParameter);
    };
    let (info, tables) =
        PortInfo::read_from_prefix(&answer.mailbox).map_err(|_| IbStatus::GenericError)?;
    let index = usize::from(grh.sgid_index);
    if index >= usize::from(info.gid_table_len.get()) {
        return Err(IbStatus::InvalidGid);
    }
    let entry = tables
        .get(16 * index..16 * index + 16)
        .ok_or(IbStatus::GenericError)?;
    if entry.iter().all(|&b| b == 0) {
        return Err(IbStatus::InvalidGid);
    }
    Ok(())
}

impl<P: Platform> Hca<P> {
    /// The encoded address vector of the kernel AV `av` (raw handle), for
    /// the UD post path: the 32 bytes a UD send WQE's address segment
    /// carries (PRM 10.2). `None` for a stale or wrong-kind handle.
    /// Callable at DISPATCH_LEVEL; takes the object-table lock briefly.
    pub(crate) fn av_for_post(&self, av: u64) -> Option<hca_prm::av::Av> {
        self.with_objects(|o| {
            o.avs
                .get(Handle::<kind::Av>::from_raw(av))
                .map(|a| a.encoded)
        })
        .ok()
        .flatten()
    }

    /// The number of ports, or `InvalidState` before bring-up.
    fn num_ports(&self) -> Result<u8, IbStatus> {
        self.report()
            .map(|r| r.capabilities.num_ports)
            .ok_or(IbStatus::InvalidState)
    }

    pub(crate) fn query_av_request<R: Request>(&self, a: Accepted<QueryAv, R>) {
        match self.find_object::<kind::Av>(a.handle, a.mode) {
            Ok(av) => {
                let out = QueryAvOut {
                    pd: PdHandle::from_raw(av.pd),
                    av: av.attr,
                };
                a.responder.finish(IbStatus::Success, 0, Some(&out), &[]);
            }
            Err(status) => a.responder.fail(status),
        }
    }

    pub(crate) fn destroy_av_request<R: Request>(&self, a: Accepted<DestroyAv, R>) {
        let mode = a.mode;
        let removed = self.with_objects_mut(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidAvHandle);
            }
            let av = o
                .avs
                .remove(Handle::<kind::Av>::from_raw(a.handle))
                .map_err(IbStatus::from)?;
            let _ = o.pds.release(Handle::<kind::Pd>::from_raw(av.pd));
            Ok(())
        });
        match removed.and_then(|r| r) {
            Ok(()) => a.responder.finish(IbStatus::Success, 0, Some(&Empty), &[]),
            Err(status) => a.responder.fail(status),
        }
    }
}

impl<P: Platform> Hca<P>
where
    P::Request: 'static,
{
    pub(crate) fn create_av_request(self: &Arc<Self>, a: Accepted<CreateAv, P::Request>) {
        if a.mode == RequestorMode::User {
            a.responder.fail(IbStatus::Unsupported);
            return;
        }
        let attr = a.input;
        let encoded = match self.num_ports().and_then(|n| check_static(&attr, n)) {
            Ok(encoded) => encoded,
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        let pd = a.handle;
        let mode = a.mode;
        let referenced = self.with_objects_mut(|o| {
            // A user context's PD takes the provider's AVs, never a kernel one.
            if !Self::ca_visible(o, mode) || o.user.holds(pd) {
                return Err(IbStatus::InvalidPdHandle);
            }
            o.pds
                .acquire(Handle::<kind::Pd>::from_raw(pd))
                .map_err(|_| IbStatus::InvalidPdHandle)
        });
        if let Err(status) = referenced.and_then(|r| r) {
            a.responder.fail(status);
            return;
        }
        let responder = a.responder;
        self.run_commands(
            vec![
                Command::new(Opcode::QueryPort, u32::from(attr.port.get()))
                    .with_output(QUERY_PORT_BYTES),
            ],
            Box::new(move |hca, result| {
                let checked = match result {
                    Ok(outputs) => outputs
                        .first()
                        .ok_or(IbStatus::GenericError)
                        .and_then(|answer| check_gid(&attr, answer)),
                    Err(error) => Err(error.ib_status()),
                };
                let made = checked.and_then(|()| {
                    hca.with_objects_mut(|o| {
                        o.avs
                            .insert_with(|_| Av { pd, attr, encoded })
                            .map_err(IbStatus::from)
                    })?
                });
                match made {
                    Ok(handle) => {
                        responder.finish(IbStatus::Success, handle.raw(), Some(&Empty), &[])
                    }
                    Err(status) => {
                        let _ = hca.release_pd(pd);
                        responder.fail(status);
                    }
                }
            }),
        );
    }

    pub(crate) fn modify_av_request(self: &Arc<Self>, a: Accepted<ModifyAv, P::Request>) {
        let mode = a.mode;
        let handle = Handle::<kind::Av>::from_raw(a.handle);
        let exists = self.with_objects(|o| Self::ca_visible(o, mode) && o.avs.contains(handle));
        match exists {
            Ok(true) => {}
            Ok(false) => {
                a.responder.fail(IbStatus::InvalidAvHandle);
                return;
            }
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        }
        let attr = a.input;
        let encoded = match self.num_ports().and_then(|n| check_static(&attr, n)) {
            Ok(encoded) => encoded,
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        let responder = a.responder;
        self.run_commands(
            vec![
                Command::new(Opcode::QueryPort, u32::from(attr.port.get()))
                    .with_output(QUERY_PORT_BYTES),
            ],
            Box::new(move |hca, result| {
                let checked = match result {
                    Ok(outputs) => outputs
                        .first()
                        .ok_or(IbStatus::GenericError)
                        .and_then(|answer| check_gid(&attr, answer)),
                    Err(error) => Err(error.ib_status()),
                };
                // The AV may have been destroyed while QUERY_PORT ran.
                let applied = checked.and_then(|()| {
                    hca.with_objects_mut(|o| match o.avs.get_mut(handle) {
                        Some(av) => {
                            av.attr = attr;
                            av.encoded = encoded;
                            Ok(())
                        }
                        None => Err(IbStatus::InvalidAvHandle),
                    })?
                });
                match applied {
                    Ok(()) => responder.finish(IbStatus::Success, 0, Some(&Empty), &[]),
                    Err(status) => responder.fail(status),
                }
            }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ib_types::scalars::{Gid, PortNum};

    #[test]
    fn static_checks_refuse_port_rate_and_missing_grh() {
        let good = AvAttr::roce(PortNum::new(2).unwrap(), Gid::from_ipv4([10, 0, 0, 9]), 0);
        let encoded = check_static(&good, 2).unwrap();
        assert_eq!(encoded.port, 2);
        assert_eq!(encoded.dest_ipv4(), Some([10, 0, 0, 9]));
        assert_eq!(check_static(&good, 1), Err(IbStatus::InvalidPort));
        let rated = AvAttr {
            static_rate: 3,
            ..good
        };
        assert_eq!(check_static(&rated, 2), Err(IbStatus::InvalidSetting));
        let no_grh = AvAttr { grh: None, ..good };
        assert_eq!(check_static(&no_grh, 2), Err(IbStatus::InvalidParameter));
    }
}
