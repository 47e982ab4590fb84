//! The drivers' shells for the simulated Windows host (`sim-host`): the
//! simulator's side of each driver. Every module here is the Linux
//! counterpart of one driver's KMDF shell, doing for the host's driver
//! model (`sim_host::driver`) what that shell does for WDF, callback for
//! callback and in the same order, so that the path Windows runs is the
//! path the tests run.
//!
//! The shipped driver crates (`hca-miniport`, `ibal-bus`) hold only their
//! KMDF shells and never depend on the simulator; this crate depends on
//! their portable cores and on `sim-host`.
//!
//! - [`embedded`]: one machine (host, one HCA, the real drivers, one user
//!   process) embedded in a program: what `libibverbs.so.1` boots.
//! - [`hca_miniport`]: the HCA miniport (`hca-miniport/src/kmdf`).
//! - [`ibal_bus`]: the IBAL bus filter (`ibal-bus/src/kmdf`).
//! - [`ibal_proxy`]: the filter's user-mode proxy (device interface,
//!   security descriptor, per-open handle tables, hostile-input checks).
//! - [`legacy_client`]: a root-enumerated kernel client of the access
//!   layer, the old way (a sample; no KMDF shell).
//! - [`port_client`]: `ibportclient`, the sample kernel client on the
//!   filter's port children (its portable core is `ib-port-client-core`;
//!   no KMDF shell yet).
//! - [`rc_path`]: the RESET -> RTS modifies of an RC QP, shared by the
//!   sample clients and the scenario tests.
//! - [`user_io`]: the access library's OS seam over a simulated process
//!   (the counterpart of `ibal_user::windows`).

pub mod embedded;
pub mod hca_miniport;
pub mod ibal_bus;
pub mod ibal_proxy;
pub mod legacy_client;
pub mod port_client;
pub mod rc_path;
pub mod user_io;
