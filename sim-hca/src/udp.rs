//! The UDP fabric: every device port a real RoCEv2 endpoint, so simulated
//! HCAs in different processes reach each other as two hosts would
//! (`docs/prm.md`, "The UDP fabric").
//!
//! Each attached port owns a UDP socket bound to (its IPv4 address, 4791),
//! without `SO_REUSEADDR`/`SO_REUSEPORT`, so no two processes ever share
//! an address. The port's GID 0 becomes the address's IPv4-mapped GID
//! (`::ffff:a.b.c.d`) and its MAC is derived from it
//! ([`Device::set_port_ipv4`]). The address is given or chosen
//! ([`PortAddress`]): with none, the first of 127.0.0.1, 127.0.0.2, ...
//! that no socket holds.
//!
//! - **Out**: a frame the device sends leaves as one datagram to its IPv4
//!   destination, port 4791, carrying the UDP payload (BTH onward, ICRC
//!   included). The kernel writes the IP and UDP headers, so the frame's
//!   source address and port are rewritten to the socket's and its ICRC
//!   recomputed ([`datagram_from_frame`]): the ICRC a capture shows is the
//!   one over the headers on the wire. A destination with no listener
//!   loses the datagram, as a real network would; the transport's retries
//!   decide. Multicast and broadcast destinations are not carried
//!   (counted as unroutable).
//! - **In**: a thread per socket receives datagrams, rebuilds the
//!   Ethernet/IPv4/UDP headers from the datagram's addresses in front of
//!   it, in place ([`frame_from_datagram`]), checks the whole frame as the
//!   device would ([`RocePacket::parse`]) and hands it to the device under
//!   its lock. A datagram that is short, not RoCEv2 or fails its ICRC is
//!   dropped and counted by reason ([`UdpPortStats`]), never a panic.
//!   Each socket asks for a large receive buffer (capped by the kernel's
//!   `net.core.rmem_max`), so a window of large messages is not dropped
//!   and retransmitted.
//! - The wire path throughout: no direct placement, since the peer may be
//!   another process. Work a doorbell causes runs in the ringing thread
//!   (as in [`crate::fast::FastFabric`]); a timer thread runs the devices'
//!   retransmission and RNR timers, woken early when a device's next
//!   deadline moves before its planned wake-up. An ACK timer a
//!   transmission starts runs from when the last of that call's datagrams
//!   was sent ([`Device::set_ack_timers_at_hand_off`]), not from when the
//!   device began building them: resending a large window can take longer
//!   than the timeout, and that time is not the peer's.
//!
//! Not carried: the IPv4 TOS byte (a received frame has TOS 0 and TTL 64;
//! neither is covered by the ICRC) and IP multicast.
//!
//! Locking: one mutex per device; no device lock is held while sending,
//! while another device's lock is taken, or while the activity callback
//! ([`UdpFabric::set_on_activity`]) runs.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use crate::device::{Device, UnsentAckTimers};
use crate::wire::bth::Bth;
use crate::wire::eth::{ETHERTYPE_IPV4, EthRepr, MacAddr};
use crate::wire::icrc::{self, ICRC_LEN};
use crate::wire::ipv4::{self, Ipv4Header, Ipv4Repr, PROTOCOL_UDP};
use crate::wire::packet::ETH_LEN;
use crate::wire::udp::{self, ROCEV2_PORT, UdpRepr};
use crate::wire::{DropReason, HeaderRepr, RocePacket, WireError, split_header_mut};

/// Bytes of the Ethernet, IPv4 and UDP headers a frame has in front of the
/// datagram's payload: where [`frame_from_datagram`] expects it.
pub const FRAME_HEADROOM: usize = ETH_LEN + ipv4::HEADER_LEN + udp::HEADER_LEN;

/// The largest UDP payload an IPv4 datagram can carry.
pub const MAX_DATAGRAM: usize = ipv4::MAX_TOTAL_LEN - ipv4::HEADER_LEN - udp::HEADER_LEN;

/// The TTL a rebuilt frame carries (the received one is not visible to a
/// socket; the ICRC does not cover it).
const RECEIVED_TTL: u8 = 64;

/// The IPv4 flags field with Don't Fragment set and offset 0.
const FLAGS_DONT_FRAGMENT: [u8; 2] = [0x40, 0x00];

/// How long a receive thread waits before it looks at the stop flag again
/// (shutdown also wakes it with an empty datagram).
const RECEIVE_POLL: Duration = Duration::from_millis(200);

/// The receive buffer each socket asks for (the kernel caps it at
/// `net.core.rmem_max`): a burst of a few hundred MTU-sized datagrams (a
/// window of large messages) fits, where the default (about 200 KiB) drops
/// most of it and leaves the transport to retransmit.
const RECEIVE_BUFFER_BYTES: usize = 16 << 20;

/// How long a receive thread waits after an unexpected socket error.
const RECEIVE_ERROR_BACKOFF: Duration = Duration::from_millis(10);

/// The longest the timer thread sleeps with no deadline due sooner.
const TIMER_IDLE_SLEEP: Duration = Duration::from_millis(50);

/// Asks for [`RECEIVE_BUFFER_BYTES`] of receive buffer (best effort: the
/// kernel caps the request at `net.core.rmem_max`; a refusal leaves the
/// default, and losses to the transport's retries).
#[cfg(target_os = "linux")]
fn enlarge_receive_buffer(socket: &UdpSocket) {
    use std::os::fd::AsRawFd;
    let bytes = libc::c_int::try_from(RECEIVE_BUFFER_BYTES).unwrap_or(libc::c_int::MAX);
    // SAFETY: the descriptor is the socket's, open for the whole call, and
    // the option value is a live `c_int` passed with its own size.
    let _ = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&raw const bytes).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

#[cfg(not(target_os = "linux"))]
fn enlarge_receive_buffer(_socket: &UdpSocket) {}

/// Where a port's socket is bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortAddress {
    /// Exactly this address; binding fails if another socket holds it.
    Fixed(Ipv4Addr),
    /// The first of `count` consecutive addresses from `first` that no
    /// socket holds at port 4791.
    FirstFree {
        /// The first candidate.
        first: Ipv4Addr,
        /// How many candidates.
        count: u32,
    },
}

impl PortAddress {
    /// With no configuration: the first free of 127.0.0.1 to 127.0.0.254.
    pub const AUTOMATIC: Self = Self::FirstFree {
        first: Ipv4Addr::new(127, 0, 0, 1),
        count: 254,
    };

    /// Binds a UDP socket at port 4791 on this address (the first free
    /// candidate for [`PortAddress::FirstFree`]).
    pub fn bind(self) -> io::Result<UdpSocket> {
        match self {
            Self::Fixed(addr) => UdpSocket::bind(SocketAddrV4::new(addr, ROCEV2_PORT)),
            Self::FirstFree { first, count } => {
                let start = u32::from(first);
                for offset in 0..count {
                    let Some(candidate) = start.checked_add(offset) else {
                        break;
                    };
                    let addr = SocketAddrV4::new(Ipv4Addr::from(candidate), ROCEV2_PORT);
                    match UdpSocket::bind(addr) {
                        Ok(socket) => return Ok(socket),
                        Err(e) if e.kind() == io::ErrorKind::AddrInUse => continue,
                        Err(e) => return Err(e),
                    }
                }
                Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!(
                        "no free address for RoCEv2 (UDP port {ROCEV2_PORT}) among the {count} from {first}"
                    ),
                ))
            }
        }
    }
}

impl Default for PortAddress {
    fn default() -> Self {
        Self::AUTOMATIC
    }
}

/// Turns a frame a device sent into the datagram a socket bound at `from`
/// sends: checks its Ethernet, IPv4 and UDP framing (IPv4 to port 4791,
/// room for a BTH and the ICRC), writes `from` as its source address and
/// port, identification 0 and DF (what the receiver rebuilds), and
/// recomputes the ICRC. Returns the destination and where the UDP payload
/// lies in `frame`. The rest of the packet is the receiver's to check.
pub fn datagram_from_frame(
    frame: &mut [u8],
    from: SocketAddrV4,
) -> Result<(Ipv4Addr, Range<usize>), WireError> {
    let (eth, rest) = EthRepr::parse_prefix(frame)?;
    if eth.ethertype != ETHERTYPE_IPV4 {
        return Err(WireError::NotIpv4 {
            ethertype: eth.ethertype,
        });
    }
    let (ip, rest) = Ipv4Repr::parse_prefix(rest)?;
    if ip.protocol != PROTOCOL_UDP {
        return Err(WireError::NotUdp {
            protocol: ip.protocol,
        });
    }
    let ip_payload_len = usize::from(ip.payload_len);
    let ip_payload = rest.get(..ip_payload_len).ok_or(WireError::BadLength {
        field: "ipv4.total_len",
        declared: ip_payload_len + ipv4::HEADER_LEN,
        available: rest.len() + ipv4::HEADER_LEN,
    })?;
    let (udp, payload) = UdpRepr::parse_prefix(ip_payload)?;
    if usize::from(udp.payload_len) != payload.len() {
        return Err(WireError::BadLength {
            field: "udp.length",
            declared: usize::from(udp.payload_len) + udp::HEADER_LEN,
            available: ip_payload_len,
        });
    }
    if udp.dst_port != ROCEV2_PORT {
        return Err(WireError::NotRoce { port: udp.dst_port });
    }
    let least = size_of::<Bth>() + ICRC_LEN;
    if payload.len() < least {
        return Err(WireError::Truncated {
            header: "BTH and ICRC",
            needed: least,
            got: payload.len(),
        });
    }
    let end = FRAME_HEADROOM + payload.len();

    let (header, _) = split_header_mut::<Ipv4Header>(&mut frame[ETH_LEN..])?;
    header.src = from.ip().octets();
    header.identification = ib_types::abi::Be16::ZERO;
    header.flags_fragment = ib_types::abi::Be16::new(u16::from_be_bytes(FLAGS_DONT_FRAGMENT));
    header.fill_checksum();
    let udp_at = ETH_LEN + ipv4::HEADER_LEN;
    frame[udp_at..udp_at + 2].copy_from_slice(&from.port().to_be_bytes());
    let icrc_at = end - ICRC_LEN;
    let crc = icrc::compute(&frame[ETH_LEN..icrc_at])?;
    frame[icrc_at..end].copy_from_slice(&crc.to_le_bytes());
    Ok((ip.dst, FRAME_HEADROOM..end))
}

/// Rebuilds the frame of a datagram received from `from` on a socket bound
/// to `to`: the datagram's `len` bytes lie at [`FRAME_HEADROOM`] in `buf`,
/// and the Ethernet (MACs derived from the addresses), IPv4 (TOS 0, TTL
/// 64, identification 0, DF) and UDP headers are written in front of it.
/// The whole frame is then checked as a device checks it
/// ([`RocePacket::parse`]: BTH, extension headers, pad, ICRC). Returns the
/// frame's length.
pub fn frame_from_datagram(
    buf: &mut [u8],
    len: usize,
    from: SocketAddrV4,
    to: Ipv4Addr,
) -> Result<usize, WireError> {
    if len > MAX_DATAGRAM {
        return Err(WireError::TooLong {
            len: len + ipv4::HEADER_LEN + udp::HEADER_LEN,
        });
    }
    let frame_len = FRAME_HEADROOM + len;
    let got = buf.len();
    let frame = buf.get_mut(..frame_len).ok_or(WireError::BufferTooSmall {
        needed: frame_len,
        got,
    })?;
    // Bounded by MAX_DATAGRAM above.
    let udp_payload_len = len as u16;
    let rest = EthRepr {
        dst: MacAddr::for_ip_destination(to),
        src: MacAddr::for_ipv4(*from.ip()),
        ethertype: ETHERTYPE_IPV4,
    }
    .emit_prefix(frame)?;
    let rest = Ipv4Repr {
        src: *from.ip(),
        dst: to,
        tos: 0,
        identification: 0,
        dont_fragment: true,
        ttl: RECEIVED_TTL,
        protocol: PROTOCOL_UDP,
        payload_len: udp_payload_len + udp::HEADER_LEN as u16,
    }
    .emit_prefix(rest)?;
    UdpRepr {
        src_port: from.port(),
        dst_port: ROCEV2_PORT,
        payload_len: udp_payload_len,
    }
    .emit_prefix(rest)?;
    RocePacket::parse(frame)?;
    Ok(frame_len)
}

/// One port's traffic on the UDP fabric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpPortStats {
    /// Datagrams sent (counted as each is handed to the socket, so never
    /// fewer than a peer has received).
    pub tx_datagrams: u64,
    /// UDP payload bytes sent.
    pub tx_bytes: u64,
    /// Frames not sent: malformed, or to a multicast or broadcast address.
    pub tx_unroutable: u64,
    /// Frames dropped by the test hook ([`UdpFabric::drop_next_datagrams`]).
    pub tx_dropped: u64,
    /// Sends the socket refused.
    pub tx_errors: u64,
    /// Datagrams received (handed to the device or dropped).
    pub rx_datagrams: u64,
    /// UDP payload bytes of the datagrams handed to the device.
    pub rx_bytes: u64,
    /// Datagrams dropped, per reason ([`DropReason::index`]).
    pub rx_dropped_by_reason: [u64; DropReason::COUNT],
}

impl UdpPortStats {
    /// Datagrams dropped for `reason`.
    pub fn rx_dropped(&self, reason: DropReason) -> u64 {
        self.rx_dropped_by_reason[reason.index()]
    }

    /// Datagrams dropped for any reason.
    pub fn rx_dropped_total(&self) -> u64 {
        self.rx_dropped_by_reason.iter().sum()
    }
}

#[derive(Debug, Default)]
struct Counters {
    tx_datagrams: AtomicU64,
    tx_bytes: AtomicU64,
    tx_unroutable: AtomicU64,
    tx_dropped: AtomicU64,
    tx_errors: AtomicU64,
    rx_datagrams: AtomicU64,
    rx_bytes: AtomicU64,
    rx_dropped: [AtomicU64; DropReason::COUNT],
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// A device port bound to its socket.
#[derive(Debug)]
struct Endpoint {
    node: usize,
    port: u8,
    addr: SocketAddrV4,
    socket: UdpSocket,
    counters: Counters,
}

/// Frames a device produced, copied out under its lock and sent after:
/// (port, frame), spent buffers for the next ones, and the ACK timers that
/// start once the frames are sent.
#[derive(Debug, Default)]
struct Outbox {
    frames: Vec<(u8, Vec<u8>)>,
    spare: Vec<Vec<u8>>,
    timers: UnsentAckTimers,
}

/// Called (with no device lock held) after a receive or timer thread ran a
/// device: interrupts it raised can be delivered.
pub type ActivityHook = Arc<dyn Fn() + Send + Sync>;

struct Shared {
    nodes: Vec<Mutex<Device>>,
    endpoints: Vec<Endpoint>,
    epoch: Instant,
    stop: AtomicBool,
    on_activity: RwLock<Option<ActivityHook>>,
    timer_thread: OnceLock<Thread>,
    /// When the timer thread plans to wake (ns since `epoch`); `u64::MAX`
    /// while it scans, so any deadline set meanwhile wakes it again.
    timer_wake_ns: AtomicU64,
    /// Outgoing datagrams still to drop (test hook).
    drop_next: AtomicU64,
    spare: Mutex<Vec<Outbox>>,
}

/// Locks a device; a poisoned lock (a panicking thread) still yields it.
fn lock(dev: &Mutex<Device>) -> MutexGuard<'_, Device> {
    dev.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn endpoint_of(&self, node: usize, port: u8) -> Option<&Endpoint> {
        self.endpoints
            .iter()
            .find(|e| e.node == node && e.port == port)
    }

    /// Runs `f` on device `node` at the current time, then sends what it
    /// produced, starts the ACK timers those frames started (from when the
    /// last has gone: sending a long window takes time the peer must not be
    /// charged with), and wakes the timer thread if a deadline moved
    /// earlier.
    fn run<R>(&self, node: usize, f: impl FnOnce(&mut Device) -> R) -> R {
        let mut outbox = self
            .spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        let (result, mut due) = {
            let mut dev = lock(&self.nodes[node]);
            dev.set_time(self.now_ns());
            let result = f(&mut dev);
            let Outbox {
                frames,
                spare,
                timers,
            } = &mut outbox;
            dev.drain_tx(|port, frame| {
                let mut buf = spare.pop().unwrap_or_default();
                buf.clear();
                buf.extend_from_slice(frame);
                frames.push((port, buf));
            });
            dev.take_unsent_ack_timers(timers);
            (result, dev.poll_timeout())
        };
        for (port, mut frame) in outbox.frames.drain(..) {
            self.transmit(node, port, &mut frame);
            outbox.spare.push(frame);
        }
        if !outbox.timers.is_empty() {
            let mut dev = lock(&self.nodes[node]);
            dev.start_ack_timers(&mut outbox.timers, self.now_ns());
            due = dev.poll_timeout();
        }
        self.spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(outbox);
        if due.is_some_and(|t| t < self.timer_wake_ns.load(Ordering::Acquire))
            && let Some(timer) = self.timer_thread.get()
        {
            timer.unpark();
        }
        result
    }

    /// Sends one frame from (node, port) as a datagram.
    fn transmit(&self, node: usize, port: u8, frame: &mut [u8]) {
        let Some(ep) = self.endpoint_of(node, port) else {
            return;
        };
        let c = &ep.counters;
        let Ok((dst, payload)) = datagram_from_frame(frame, ep.addr) else {
            bump(&c.tx_unroutable, 1);
            return;
        };
        if dst.is_multicast() || dst.is_broadcast() || dst.is_unspecified() {
            bump(&c.tx_unroutable, 1);
            return;
        }
        let dropped = self
            .drop_next
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if dropped {
            bump(&c.tx_dropped, 1);
            return;
        }
        let len = payload.len() as u64;
        // Counted before the send: once `send_to` returns the peer may have
        // received and counted the datagram already, and a reader of both
        // counters must never see more received than sent. A failed send
        // takes its count back.
        bump(&c.tx_datagrams, 1);
        bump(&c.tx_bytes, len);
        if ep
            .socket
            .send_to(&frame[payload], SocketAddrV4::new(dst, ROCEV2_PORT))
            .is_err()
        {
            c.tx_datagrams.fetch_sub(1, Ordering::Relaxed);
            c.tx_bytes.fetch_sub(len, Ordering::Relaxed);
            bump(&c.tx_errors, 1);
        }
    }

    /// A datagram of `len` bytes at [`FRAME_HEADROOM`] in `buf` arrived at
    /// endpoint `index`.
    fn receive(&self, index: usize, buf: &mut [u8], len: usize, from: SocketAddrV4) {
        let ep = &self.endpoints[index];
        let c = &ep.counters;
        bump(&c.rx_datagrams, 1);
        match frame_from_datagram(buf, len, from, *ep.addr.ip()) {
            Ok(frame_len) => {
                bump(&c.rx_bytes, len as u64);
                let port = ep.port;
                self.run(ep.node, |dev| dev.receive(port, &buf[..frame_len]));
                self.activity();
            }
            Err(e) => bump(&c.rx_dropped[e.reason().index()], 1),
        }
    }

    fn activity(&self) {
        let hook = self
            .on_activity
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(hook) = hook {
            hook();
        }
    }

    /// Runs every timer that is due; returns the earliest next deadline.
    fn run_timers(&self) -> Option<u64> {
        let mut next: Option<u64> = None;
        let mut ran = false;
        for node in 0..self.nodes.len() {
            let now = self.now_ns();
            let due = lock(&self.nodes[node]).poll_timeout();
            if due.is_some_and(|t| t <= now) {
                self.run(node, |d| d.handle_timeout(now));
                ran = true;
            }
            if let Some(after) = lock(&self.nodes[node]).poll_timeout() {
                next = Some(next.map_or(after, |n| n.min(after)));
            }
        }
        if ran {
            self.activity();
        }
        next
    }

    fn receive_loop(&self, index: usize) {
        let socket = &self.endpoints[index].socket;
        let mut buf = vec![0u8; FRAME_HEADROOM + MAX_DATAGRAM];
        while !self.stop.load(Ordering::Acquire) {
            match socket.recv_from(&mut buf[FRAME_HEADROOM..]) {
                Ok((len, from)) => {
                    if self.stop.load(Ordering::Acquire) {
                        break;
                    }
                    match from {
                        SocketAddr::V4(from) => self.receive(index, &mut buf, len, from),
                        SocketAddr::V6(_) => {
                            let c = &self.endpoints[index].counters;
                            bump(&c.rx_datagrams, 1);
                            bump(&c.rx_dropped[DropReason::NotIpv4.index()], 1);
                        }
                    }
                }
                // A timeout to look at the stop flag, a signal, or an
                // error the network reported for an earlier send.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                            | io::ErrorKind::ConnectionRefused
                    ) => {}
                // Anything else: try again shortly, without spinning.
                Err(_) => std::thread::sleep(RECEIVE_ERROR_BACKOFF),
            }
        }
    }

    fn timer_loop(&self) {
        while !self.stop.load(Ordering::Acquire) {
            self.timer_wake_ns.store(u64::MAX, Ordering::Release);
            let next = self.run_timers();
            let now = self.now_ns();
            let idle = now.saturating_add(TIMER_IDLE_SLEEP.as_nanos() as u64);
            let wake = next.map_or(idle, |t| t.min(idle));
            self.timer_wake_ns.store(wake, Ordering::Release);
            if wake > now {
                std::thread::park_timeout(Duration::from_nanos(wake - now));
            }
        }
    }
}

/// Devices whose ports are real UDP endpoints.
pub struct UdpFabric {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for UdpFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpFabric")
            .field("nodes", &self.shared.nodes.len())
            .field(
                "endpoints",
                &self
                    .shared
                    .endpoints
                    .iter()
                    .map(|e| (e.node, e.port, e.addr))
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl UdpFabric {
    /// Binds every port of `devices` to its socket and starts the receive
    /// threads and the timer thread. `addresses` are taken in port order
    /// (device 0's port 1, its port 2, ..., then device 1's); ports beyond
    /// them choose automatically ([`PortAddress::AUTOMATIC`]). Each port
    /// gets its socket's address ([`Device::set_port_ipv4`]) and its link
    /// up; the devices keep the wire path (no direct placement) and start
    /// their ACK timers when the fabric has sent the frames
    /// ([`Device::set_ack_timers_at_hand_off`]).
    pub fn new(devices: Vec<Device>, addresses: &[PortAddress]) -> io::Result<Self> {
        let mut wanted = addresses.iter().copied();
        let mut endpoints = Vec::new();
        let mut nodes = Vec::with_capacity(devices.len());
        for (node, mut dev) in devices.into_iter().enumerate() {
            dev.set_direct_placement(false);
            dev.set_ack_timers_at_hand_off(true);
            for port in 1..=dev.num_ports() {
                let socket = wanted.next().unwrap_or_default().bind()?;
                let SocketAddr::V4(addr) = socket.local_addr()? else {
                    return Err(io::Error::other("an IPv4 socket reports an IPv6 address"));
                };
                socket.set_read_timeout(Some(RECEIVE_POLL))?;
                enlarge_receive_buffer(&socket);
                dev.set_port_ipv4(port, addr.ip().octets());
                dev.set_link(port, true);
                endpoints.push(Endpoint {
                    node,
                    port,
                    addr,
                    socket,
                    counters: Counters::default(),
                });
            }
            nodes.push(Mutex::new(dev));
        }
        let shared = Arc::new(Shared {
            nodes,
            endpoints,
            epoch: Instant::now(),
            stop: AtomicBool::new(false),
            on_activity: RwLock::new(None),
            timer_thread: OnceLock::new(),
            timer_wake_ns: AtomicU64::new(u64::MAX),
            drop_next: AtomicU64::new(0),
            spare: Mutex::new(Vec::new()),
        });
        let mut fabric = Self {
            shared,
            threads: Vec::new(),
        };
        for index in 0..fabric.shared.endpoints.len() {
            let shared = Arc::clone(&fabric.shared);
            let addr = shared.endpoints[index].addr;
            let thread = std::thread::Builder::new()
                .name(format!("roce-udp-{}", addr.ip()))
                .spawn(move || shared.receive_loop(index))?;
            fabric.threads.push(thread);
        }
        let shared = Arc::clone(&fabric.shared);
        let timer = std::thread::Builder::new()
            .name("roce-udp-timers".into())
            .spawn(move || shared.timer_loop())?;
        let _ = fabric.shared.timer_thread.set(timer.thread().clone());
        fabric.threads.push(timer);
        Ok(fabric)
    }

    /// Nanoseconds since the fabric was built (the devices' clock).
    pub fn now_ns(&self) -> u64 {
        self.shared.now_ns()
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.shared.nodes.len()
    }

    /// True when there are no devices.
    pub fn is_empty(&self) -> bool {
        self.shared.nodes.is_empty()
    }

    /// The address port `port` (1-based) of device `node` is bound to.
    pub fn address(&self, node: usize, port: u8) -> Option<Ipv4Addr> {
        self.shared.endpoint_of(node, port).map(|e| *e.addr.ip())
    }

    /// Port `port` (1-based) of device `node`'s traffic so far.
    pub fn stats(&self, node: usize, port: u8) -> Option<UdpPortStats> {
        let c = &self.shared.endpoint_of(node, port)?.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Some(UdpPortStats {
            tx_datagrams: get(&c.tx_datagrams),
            tx_bytes: get(&c.tx_bytes),
            tx_unroutable: get(&c.tx_unroutable),
            tx_dropped: get(&c.tx_dropped),
            tx_errors: get(&c.tx_errors),
            rx_datagrams: get(&c.rx_datagrams),
            rx_bytes: get(&c.rx_bytes),
            rx_dropped_by_reason: std::array::from_fn(|i| get(&c.rx_dropped[i])),
        })
    }

    /// Sets what runs after a receive or timer thread ran a device (with
    /// no device lock held): a host delivers the interrupts it raised.
    pub fn set_on_activity(&self, hook: ActivityHook) {
        *self
            .shared
            .on_activity
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    /// Tests: the next `count` datagrams any port would send are dropped
    /// instead (counted in [`UdpPortStats::tx_dropped`]).
    pub fn drop_next_datagrams(&self, count: u64) {
        self.shared.drop_next.store(count, Ordering::Release);
    }

    /// Runs `f` on device `node` at the current time (in this thread), then
    /// sends every frame it produced.
    pub fn with_device<R>(&self, node: usize, f: impl FnOnce(&mut Device) -> R) -> R {
        self.shared.run(node, f)
    }

    /// A 32-bit register write to device `node`'s BAR0.
    pub fn mmio_write32(&self, node: usize, offset: u64, value: u32) {
        self.with_device(node, |d| d.mmio_write32(offset, value));
    }

    /// A 64-bit write (a doorbell in a UAR page) to device `node`'s BAR0.
    pub fn mmio_write64(&self, node: usize, offset: u64, value: u64) {
        self.with_device(node, |d| d.mmio_write64(offset, value));
    }

    /// A 32-bit register read of device `node`'s BAR0.
    pub fn mmio_read32(&self, node: usize, offset: u64) -> u32 {
        self.with_device(node, |d| d.mmio_read32(offset))
    }
}

impl Drop for UdpFabric {
    fn drop(&mut self) {
        let shared = &self.shared;
        shared.stop.store(true, Ordering::Release);
        for ep in &shared.endpoints {
            // Wakes the receive thread at once (its read timeout is the
            // fallback).
            let _ = ep.socket.send_to(&[], ep.addr);
        }
        if let Some(timer) = shared.timer_thread.get() {
            timer.unpark();
        }
        let me = std::thread::current().id();
        for thread in self.threads.drain(..) {
            // A hook may drop the last owner from a fabric thread itself.
            if thread.thread().id() != me {
                let _ = thread.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn automatic_choice_starts_at_localhost() {
        assert_eq!(
            PortAddress::default(),
            PortAddress::FirstFree {
                first: Ipv4Addr::LOCALHOST,
                count: 254
            }
        );
    }

    #[test]
    fn a_datagram_too_short_for_a_bth_is_refused() {
        let mut buf = vec![0u8; FRAME_HEADROOM + 8];
        let from = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 9), ROCEV2_PORT);
        let err = frame_from_datagram(&mut buf, 8, from, Ipv4Addr::LOCALHOST).unwrap_err();
        assert_eq!(err.reason(), DropReason::Truncated);
        assert!(matches!(
            frame_from_datagram(&mut buf, 9, from, Ipv4Addr::LOCALHOST),
            Err(WireError::BufferTooSmall { .. })
        ));
    }
}
