//! Simulated HCA: a software device implementing the project's PRM
//! (`docs/prm.md`), its IB transport engine, and a RoCEv2 fabric with fault
//! injection and pcap capture.
//!
//! - [`wire`]: the RoCEv2 packet layer. Header layouts (Ethernet II, IPv4,
//!   UDP, BTH and the extended transport headers), the IBA opcode table, the
//!   invariant CRC, and [`wire::RocePacket`] / [`wire::PacketRepr`] to parse
//!   and build whole frames without allocating.
//! - [`pcap`]: a classic pcap writer for captures that open in Wireshark,
//!   and a reader for tests.
//! - [`fabric`]: a deterministic simulated Ethernet switch with seeded fault
//!   injection and a capture tap; [`rng`] is its seedable generator.
//! - [`fast`]: the fast mode — devices on a lossless zero-latency fabric,
//!   with work run in the threads that ring doorbells.
//! - [`host`]: the device's door to host memory (bus addresses only) and
//!   interrupts, with a self-contained IOMMU-style memory for tests.
//! - [`capture`]: the scripted traffic mix `cargo xtask capture` records.
//! - [`testkit`]: a small test-side driver that programs a device through
//!   the PRM alone (the device's tests and the capture tool use it).
//! - [`device`]: the HCA itself — BAR0, the command interface, contexts,
//!   event and completion queues, doorbells — and the IB transport engine
//!   it runs (RC, UC, UD).
//! - [`udp`]: the UDP fabric — each device port a real RoCEv2 endpoint
//!   (a UDP socket at port 4791), so devices in different processes talk
//!   over real datagrams.
//! - [`cluster`]: the simulation harness — several devices on one fabric,
//!   stepped deterministically in virtual time from one seed, with pcap
//!   capture.

pub mod capture;
pub mod cluster;
pub mod device;
pub mod fabric;
pub mod fast;
pub mod host;
pub mod pcap;
pub mod rng;
pub mod testkit;
pub(crate) mod transport;
pub mod udp;
pub mod wire;
