//! Simulated HCA: a software device implementing the project's PRM
//! (`docs/prm.md`), its IB transport engine, and a RoCEv2 fabric with fault
//! injection and pcap capture.
//!
//! What exists so far:
//! - [`wire`]: the RoCEv2 packet layer. Header layouts (Ethernet II, IPv4,
//!   UDP, BTH and the extended transport headers), the IBA opcode table, the
//!   invariant CRC, and [`wire::RocePacket`] / [`wire::PacketRepr`] to parse
//!   and build whole frames without allocating.
//! - [`pcap`]: a classic pcap writer for captures that open in Wireshark,
//!   and a reader for tests.
//!
//! Not written yet: the device model (BAR0 registers, command interface,
//! contexts, WQE/CQE rings, doorbells, event queues), the transport engine
//! (RC/UC/UD requester and responder), and the fabric that carries frames
//! between simulated ports.

pub mod pcap;
pub mod wire;
