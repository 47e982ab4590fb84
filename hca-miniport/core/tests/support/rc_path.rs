//! The RESET -> INIT -> RTR -> RTS path of a kernel or user RC QP aimed
//! at a port addressed by its IPv4 GID, as the data-moving tests take it:
//! the sample clients' path (`sim_shells::rc_path`), with the port and
//! destination given as the tests name them.

use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::qp::QpModify;
use ib_types::scalars::{Gid, PortNum, Qpn};
use sim_shells::rc_path;

/// An address vector out of `port` to the GID of `dest_ip` (GRH, hop
/// limit 64, SGID index 0).
pub(crate) fn grh_av(port: u8, dest_ip: [u8; 4]) -> AvAttr {
    rc_path::grh_av(PortNum::new(port).unwrap(), Gid::from_ipv4(dest_ip))
}

/// The three modifies taking an RC QP on `port` from RESET to RTS towards
/// QP `dest` at `dest_ip`: remote `access` at INIT, 1024-byte MTU, PSN 100
/// both ways, `rd_atomic` reads in flight each way.
pub(crate) fn rc_to_rts_steps(
    port: u8,
    access: AccessFlags,
    dest: u32,
    dest_ip: [u8; 4],
    rd_atomic: u8,
) -> [QpModify; 3] {
    rc_path::rc_to_rts_steps(
        PortNum::new(port).unwrap(),
        access,
        Qpn::new(dest).unwrap(),
        Gid::from_ipv4(dest_ip),
        rd_atomic,
    )
}
