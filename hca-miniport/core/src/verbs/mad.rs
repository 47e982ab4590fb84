//! Local MAD processing (guide 4 Table 4-1 "Local Mad Operation", 6.7;
//! PRM 5.1 `MAD_IFC`): the LocalMad verb hands a MAD to the device's
//! local agents on one port and answers their reply.
//!
//! Contract:
//! - Kernel only (the request surface refuses user requestors). The
//!   target is the open CA; the port must exist on the device
//!   ([`IbStatus::InvalidPort`] otherwise, nothing sent).
//! - The MAD is opaque here: the device's agents judge it. Whenever they
//!   answered, the verb succeeds with their reply, and the reply's own MAD
//!   status says what they made of it (IBA 13.4.7: e.g. `0x000C`,
//!   unsupported method/attribute, for anything but a SubnGet of
//!   NodeInfo or NodeDescription on the simulated device; `0x0004` for a
//!   bad base version). The verb fails only when the command does (a
//!   device status such as `BAD_PORT`, or a failed device).
//! - No blocking: `MAD_IFC` completes from the DPC, so the verb can be
//!   issued at DISPATCH_LEVEL straight from a completion path (DESIGN:
//!   local MAD processing must not make a busy node look dead to the SM).

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec;

use driver_platform::Platform;
use hca_prm::cmd::Opcode;
use ib_types::ioctl::{LocalMad, LocalMadOut, MAD_SIZE};
use ib_types::status::IbStatus;

use super::Accepted;
use crate::cmd::Command;
use crate::hca::Hca;

impl<P: Platform> Hca<P> {
    pub(crate) fn local_mad_request(self: &Arc<Self>, a: Accepted<LocalMad, P::Request>) {
        if let Err(status) = self.check_ca(a.handle, a.mode) {
            return a.responder.fail(status);
        }
        let port = a.input.port.get();
        let ports = self.report().map_or(0, |r| r.capabilities.num_ports);
        if port > ports {
            return a.responder.fail(IbStatus::InvalidPort);
        }
        let responder = a.responder;
        self.run_commands(
            vec![
                Command::new(Opcode::MadIfc, u32::from(port))
                    .with_mailbox(a.input.mad.to_vec())
                    .with_output(MAD_SIZE),
            ],
            Box::new(move |_, result| {
                let outputs = match result {
                    Ok(outputs) => outputs,
                    Err(error) => return responder.fail(error.ib_status()),
                };
                let reply = outputs
                    .first()
                    .and_then(|output| output.mailbox.get(..MAD_SIZE))
                    .and_then(|bytes| <[u8; MAD_SIZE]>::try_from(bytes).ok());
                match reply {
                    Some(mad) => {
                        responder.finish(IbStatus::Success, 0, Some(&LocalMadOut { mad }), &[])
                    }
                    // A short answer is a device bug, not the client's.
                    None => responder.fail(IbStatus::GenericError),
                }
            }),
        );
    }
}
