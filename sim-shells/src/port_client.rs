//! `ibportclient`, the sample kernel client of the access layer, on the
//! simulated Windows host: the shell of `ib-port-client-core`
//! (docs/port-client.md). It is the function driver of the IBAL bus
//! filter's port children (`inf/ib-port-client.inf`), so it is powered
//! down before its HCA and up after it.
//!
//! What each callback does (KMDF name in brackets):
//! - `prepare_hardware` (`EvtDevicePrepareHardware`, PASSIVE_LEVEL): the
//!   settings read from the hardware key (`ReceiveDepth`; a malformed
//!   value refused with its reason, the default used) and the buffer laid
//!   out for them; `GUID_IB_AL_INTERFACE` queried from its PDO at `AL_INTERFACE_VERSION`
//!   (`WdfFdoQueryForInterface`) and its version checked (one that does
//!   not satisfy it, another major or an older minor:
//!   `STATUS_REVISION_MISMATCH`, the reference given back); the port data
//!   taken from it; `GUID_BUS_INTERFACE_STANDARD` queried from the PDO,
//!   whose parent forwards it to the HCA's PCI PDO, and its
//!   `IoGetDmaAdapter` gives the HCA's own adapter (the bus interface's
//!   reference is given back at once); a common buffer allocated from it;
//!   the AL opened with a reference on the driver object. Then a DPC
//!   creates the resources at DISPATCH_LEVEL, each verb a request whose
//!   completion routine sends the next: `QueryCa` (the port's GID),
//!   `AllocPd`, `CreateCq`, a UD QP and an RC QP, `RegPhysMr` of the
//!   buffer (its bus addresses, as mapped through the adapter), the UD QP
//!   to RTS with the ULP's Q_Key and its receives posted. The callback
//!   waits for the chain, boundedly ([`CREATE_WAIT_NS`]): a chain that
//!   failed or did not finish fails the start, what was made undone.
//! - `d0_entry` (`EvtDeviceD0Entry`, first start and resume): the UD
//!   address published in the [`Rendezvous`], the peer looked up there,
//!   the session started (`Session::start`: hello to a known peer), the
//!   driver's timer armed to send an unanswered hello again
//!   (`Session::on_tick`), and the CQ polled and re-armed (a DPC that ran
//!   while the HCA was below D0 could not arm it).
//! - the AL's completion callback (DISPATCH_LEVEL): queues the client's
//!   DPC, which polls the CQ, feeds datagrams (after their 40-byte GRH,
//!   whose source GID and the completion's source QP are the sender's UD
//!   address) and RC payloads to the session (an error completion of the
//!   connection's RC QP as a lost connection), reposts the receives, re-arms
//!   and carries out the session's actions: datagrams through an AV made
//!   on first use for each peer GID, RC sends, and the RC QP's connect
//!   (RESET, INIT, receives posted, RTR, RTS) and the replacement of a
//!   finished connection's RC QP, as requests chained by their completion
//!   routines.
//! - `d0_exit` (`EvtDeviceD0Exit`, PASSIVE_LEVEL, the HCA still in D0):
//!   the timer cancelled, the UD address withdrawn; `Session::begin_close`:
//!   a connected side lets its round in flight drain, sends `Goodbye` and
//!   waits on an event for the peer's `GoodbyeAck`, at most
//!   [`GOODBYE_WAIT_NS`] (a timer sets it otherwise). The
//!   connection's RC QP is replaced (destroyed, a new one created: a QP
//!   that was connected waits out TIME WAIT before it may connect again)
//!   and the exit waits, boundedly, for those requests; the other objects
//!   stay across sleep (the miniport keeps them).
//! - `surprise_removal` (`EvtDeviceSurpriseRemoval`, before the HCA's): no
//!   fabric any more; the D0 exit that follows abandons the session
//!   without a goodbye or a wait.
//! - `release_hardware` (`EvtDeviceReleaseHardware`, removal): the
//!   session's requests finished (bounded by [`DRAIN_WAIT_NS`]), the
//!   objects destroyed in dependency order, each call waited for boundedly (a
//!   destroy the dying device failed is sent once more), the client's DPCs
//!   drained, the buffer freed, the AL closed, the AL interface
//!   dereferenced.
//!
//! **Discovery.** The first `Hello` needs the peer's UD QP number, which
//! only the peer's HCA knows. In InfiniBand that is what service ID
//! resolution (SIDR, over QP1 through the communication manager) answers;
//! this stack has neither yet, so the shell resolves it through a
//! [`Rendezvous`] shared by the driver's devices: each publishes its port's
//! GID and UD QP number while in D0, and a client's peer is the endpoint
//! on the same port number of another CA, or with a pairing plan
//! ([`PortClientDriver::pair_cas`]) CA 2k's port p with CA 2k + 1's and an
//! odd last CA's ports with each other. Everything after the first
//! hello (the RC parameters, the goodbye) goes over the fabric, and
//! answers go to the sender's address as the datagram carried it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use driver_platform::{CommonBuffer, DevicePowerState, DmaAdapter, Event, RequestorMode};
use ib_port_client_core::config::{Config, DEFAULT_RECEIVE_DEPTH, read_config};
use ib_port_client_core::message::{ConnParams, PAYLOAD_LEN, PORT_CLIENT_QKEY, WIRE_LEN};
use ib_port_client_core::session::{Action, Counters, Phase, Session, TICK_NS};
use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::ca::CaAttrView;
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::event::AsyncEventRecord;
use ib_types::handle::{AvHandle, CqHandle, PdHandle};
use ib_types::interface::{
    AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE, InterfaceVersion, PortInterfaceData,
};
use ib_types::ioctl::{
    AllocPd, CreateAv, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyAv, DestroyCq, DestroyQp,
    Empty, ModifyQp, QueryCa, RegPhysMr, Verb, decode_response, encode_request, request_len,
    response_len,
};
use ib_types::mr::PhysMrRegister;
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, Mtu, PortNum, Psn, QKey, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest};
use ibal_bus_core::al::ClientEvents;
use ibal_bus_core::ca_registry::STATUS_REVISION_MISMATCH;
use sim_host::context::{self, Context};
use sim_host::dma::{HostCommonBuffer, HostDmaAdapter};
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, InterfaceRef, SUCCESS};
use sim_host::event::HostEvent;
use sim_host::host::Host;
use sim_host::pci::{
    BUS_INTERFACE_STANDARD_VERSION, BusInterfaceStandard, GUID_BUS_INTERFACE_STANDARD,
};
use sim_host::pnp::DeviceServices;
use sim_host::request::HostRequest;
use sim_host::sched::{SchedulerHandle, TimerId};
use sim_host::verifier::Verifier;

use crate::ibal_bus::{AlClient, AlPortInterface, DriverObjectReference};

/// The service `inf/ib-port-client.inf` installs.
pub const SERVICE: &str = "ibportclient";

/// The longest prepare-hardware waits for its resources (simulated time).
pub const CREATE_WAIT_NS: u64 = 1_000_000_000;

/// The longest a D0 exit waits for the peer's `GoodbyeAck`.
pub const GOODBYE_WAIT_NS: u64 = 200_000_000;

/// The longest a D0 exit or the teardown waits for the client's requests
/// in flight: above the miniport's command timeout, so a command to a
/// device that vanished has ended (with an error) by then.
pub const DRAIN_WAIT_NS: u64 = 5_000_000_000;

/// The GRH a UD receive starts with.
const GRH_BYTES: usize = 40;
/// Send slots per QP (the session has at most a few messages out).
const SEND_SLOTS: usize = 8;

/// Slots of one kind in the buffer: (offset of the first, slot size,
/// count).
type Slots = (usize, usize, usize);

/// The client's buffer, sized by its receive depth (`ReceiveDepth`):
/// UD receives (GRH and datagram), UD sends, RC receives, RC sends.
#[derive(Debug, Clone, Copy)]
struct Layout {
    ud_recv: Slots,
    ud_send: Slots,
    rc_recv: Slots,
    rc_send: Slots,
    /// Whole pages.
    bytes: usize,
}

impl Layout {
    fn new(depth: usize) -> Self {
        let ud_recv = (0, 128, depth);
        let ud_send = (depth * 128, 64, SEND_SLOTS);
        let rc_recv = (ud_send.0 + SEND_SLOTS * 64, 64, depth);
        let rc_send = (rc_recv.0 + depth * 64, 64, SEND_SLOTS);
        let end = rc_send.0 + SEND_SLOTS * 64;
        Self {
            ud_recv,
            ud_send,
            rc_recv,
            rc_send,
            bytes: end.div_ceil(4096) * 4096,
        }
    }
}

/// `wr_id`: the slot kind in the high half, the slot in the low.
const KIND_UD_RECV: u64 = 1;
const KIND_UD_SEND: u64 = 2;
const KIND_RC_RECV: u64 = 3;
const KIND_RC_SEND: u64 = 4;

/// Room for the `QueryCa` answer.
const QUERY_CA_ROOM: u32 = 16 * 1024;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What follows a QP's creation.
#[derive(Debug, Clone, Copy)]
enum Then {
    /// The next step of the creation chain.
    Chain,
    /// It replaced a finished connection's RC QP.
    Replaced,
}

/// The RC QP's replacement, while one is under way, and the connect that
/// waits for the new QP.
#[derive(Debug, Default)]
struct Replacement {
    under_way: bool,
    /// The peer's parameters and this side's first PSN.
    then_connect: Option<(ConnParams, u32)>,
}

/// A verb's answer: the created handle (or 0), the fixed output, the
/// private output bytes.
type Answer<V> = Result<(u64, Option<<V as Verb>::Out>, Vec<u8>), IbStatus>;

/// The creation chain's outcome, and the event prepare-hardware waits on.
type Creation = (Option<Result<(), IbStatus>>, Option<HostEvent>);

/// How many of something are in flight, and the event a waiter for none
/// left set.
type InFlight = Mutex<(usize, Option<HostEvent>)>;

fn enter(slot: &InFlight) {
    lock(slot).0 += 1;
}

fn leave(slot: &InFlight) {
    let mut slot = lock(slot);
    slot.0 -= 1;
    if slot.0 == 0
        && let Some(event) = slot.1.take()
    {
        event.set();
    }
}

/// A port's UD address as published: where its first hello is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// The CA the port belongs to.
    pub ca_guid: u64,
    /// The port number.
    pub port: u8,
    /// The port's GID (index 0).
    pub gid: Gid,
    /// The client's UD QP on it.
    pub ud_qpn: u32,
}

/// The stand-in for service ID resolution (see the module doc): the UD
/// addresses of the clients in D0.
///
/// With a pairing plan ([`PortClientDriver::pair_cas`]: the machine's CA
/// GUIDs in order) the CAs pair deterministically: CA 2k with CA 2k + 1,
/// port p with port p; an odd last CA pairs its own ports, 1 with 2, 3
/// with 4 (a last odd port has no peer). Without a plan a port's peer is
/// the same port of any other CA, which pairs exactly two CAs.
#[derive(Debug, Default)]
pub struct Rendezvous {
    endpoints: Mutex<Vec<Endpoint>>,
    plan: Mutex<Vec<u64>>,
}

impl Rendezvous {
    fn publish(&self, endpoint: Endpoint) {
        let mut endpoints = lock(&self.endpoints);
        endpoints.retain(|e| (e.ca_guid, e.port) != (endpoint.ca_guid, endpoint.port));
        endpoints.push(endpoint);
    }

    fn withdraw(&self, ca_guid: u64, port: u8) {
        lock(&self.endpoints).retain(|e| (e.ca_guid, e.port) != (ca_guid, port));
    }

    /// The (CA, port) a port pairs with under the plan, if the plan names
    /// its CA and it has a partner.
    pub fn planned_peer(&self, ca_guid: u64, port: u8) -> Option<(u64, u8)> {
        let plan = lock(&self.plan);
        let rank = plan.iter().position(|&g| g == ca_guid)?;
        match plan.get(rank ^ 1) {
            Some(&partner) => Some((partner, port)),
            // The odd last CA: its ports in pairs (1, 2), (3, 4), ...
            None if port % 2 == 1 => Some((ca_guid, port.checked_add(1)?)),
            None => Some((ca_guid, port - 1)),
        }
    }

    /// The peer of a port, if it is published: the planned peer, or
    /// without a plan the endpoint on the same port number of another CA.
    pub fn peer_of(&self, ca_guid: u64, port: u8) -> Option<Endpoint> {
        if !lock(&self.plan).is_empty() {
            let (peer_ca, peer_port) = self.planned_peer(ca_guid, port)?;
            return lock(&self.endpoints)
                .iter()
                .find(|e| (e.ca_guid, e.port) == (peer_ca, peer_port))
                .copied();
        }
        lock(&self.endpoints)
            .iter()
            .find(|e| e.ca_guid != ca_guid && e.port == port)
            .copied()
    }

    /// The endpoints published now.
    pub fn endpoints(&self) -> Vec<Endpoint> {
        lock(&self.endpoints).clone()
    }
}

/// The driver: its devices, the rendezvous they share, the rounds each
/// connection runs.
pub struct PortClientDriver {
    sched: SchedulerHandle,
    rounds: u32,
    rendezvous: Arc<Rendezvous>,
    references: OnceLock<Arc<AtomicUsize>>,
    devices: Mutex<Vec<Arc<PortClientDevice>>>,
}

impl std::fmt::Debug for PortClientDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortClientDriver")
            .field("rounds", &self.rounds)
            .finish_non_exhaustive()
    }
}

impl PortClientDriver {
    /// Registers the client on `host` under [`SERVICE`]; each connection
    /// its devices make as initiator runs `rounds` round trips.
    pub fn register(host: &Host, rounds: u32) -> Arc<Self> {
        let driver = Arc::new(Self {
            sched: host.scheduler_handle(),
            rounds,
            rendezvous: Arc::default(),
            references: OnceLock::new(),
            devices: Mutex::default(),
        });
        host.register_driver(SERVICE, driver.clone());
        if let Some(references) = host.pnp().driver_references(SERVICE) {
            let _ = driver.references.set(references);
        }
        driver
    }

    /// The devices added so far, in order.
    pub fn devices(&self) -> Vec<Arc<PortClientDevice>> {
        lock(&self.devices).clone()
    }

    /// The rendezvous the devices share.
    pub fn rendezvous(&self) -> &Rendezvous {
        &self.rendezvous
    }

    /// Pairs the CAs `ca_guids` in this order (see [`Rendezvous`]): any
    /// number of them, deterministically. Call before the devices start.
    pub fn pair_cas(&self, ca_guids: &[u64]) {
        *lock(&self.rendezvous.plan) = ca_guids.to_vec();
    }
}

impl DriverEntry for PortClientDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        let verifier = host.verifier().ok_or(NtStatus::INVALID_DEVICE_STATE)?;
        let device = Arc::new_cyclic(|me| PortClientDevice {
            me: me.clone(),
            host: host.clone(),
            sched: self.sched.clone(),
            verifier,
            rendezvous: self.rendezvous.clone(),
            rounds: self.rounds,
            references: self.references.get().cloned().unwrap_or_default(),
            link: Mutex::default(),
            port: OnceLock::new(),
            config: Mutex::default(),
            layout: Mutex::new(Layout::new(DEFAULT_RECEIVE_DEPTH as usize)),
            buffer: Mutex::default(),
            objects: Mutex::default(),
            session: Mutex::default(),
            final_counters: Mutex::default(),
            peer: Mutex::default(),
            av: Mutex::default(),
            created: Mutex::default(),
            close_wait: Mutex::default(),
            dpcs: Mutex::default(),
            requests: Mutex::default(),
            ud_send_slot: AtomicUsize::new(0),
            rc_send_slot: AtomicUsize::new(0),
            stats: Stats::default(),
            closed: Mutex::default(),
            surprise_removed: AtomicBool::new(false),
            tick_timer: self.sched.new_timer(),
            replacement: Mutex::default(),
        });
        lock(&self.devices).push(device.clone());
        Ok(device)
    }
}

/// What the AL handed the client, held from prepare- to release-hardware.
struct Link {
    interface: InterfaceRef,
    al: Arc<AlPortInterface>,
    client: AlClient,
    port: PortInterfaceData,
    adapter: HostDmaAdapter,
}

/// The client's objects (its handles in the AL); 0 where none.
#[derive(Debug, Clone, Copy, Default)]
struct Objects {
    gid: Option<Gid>,
    pd: u64,
    cq: u64,
    ud_qp: u64,
    ud_qpn: u32,
    rc_qp: u64,
    rc_qpn: u32,
    mr: u64,
    iova: u64,
    lkey: u32,
    rkey: u32,
}

/// Counts of what happened on the fabric (for tests and the report).
#[derive(Debug, Default)]
pub struct Stats {
    /// Datagrams posted.
    pub datagrams_sent: AtomicU64,
    /// Datagrams received.
    pub datagrams_received: AtomicU64,
    /// Datagrams with no peer address to go to.
    pub datagrams_unroutable: AtomicU64,
    /// RC messages posted.
    pub rc_sent: AtomicU64,
    /// Work completions with an error status (flushes included).
    pub error_completions: AtomicU64,
    /// Posts or requests the AL refused.
    pub refused: AtomicU64,
}

/// The client's device on one port child.
pub struct PortClientDevice {
    me: Weak<PortClientDevice>,
    host: DeviceServices,
    sched: SchedulerHandle,
    verifier: Verifier,
    rendezvous: Arc<Rendezvous>,
    rounds: u32,
    references: Arc<AtomicUsize>,
    link: Mutex<Option<Arc<Link>>>,
    port: OnceLock<PortInterfaceData>,
    /// The settings read at the last start.
    config: Mutex<Config>,
    layout: Mutex<Layout>,
    buffer: Mutex<Option<HostCommonBuffer>>,
    objects: Mutex<Objects>,
    session: Mutex<Option<Session>>,
    final_counters: Mutex<Counters>,
    /// The peer's UD address: (GID, UD QPN).
    peer: Mutex<Option<(Gid, u32)>>,
    /// The AV to the peer's GID: (GID, handle).
    av: Mutex<Option<(Gid, u64)>>,
    /// The creation chain's outcome and the event prepare-hardware waits on.
    created: Mutex<Creation>,
    /// The event a D0 exit waits on for the goodbye exchange.
    close_wait: Mutex<Option<HostEvent>>,
    /// DPCs queued and not finished, and the event teardown waits on.
    dpcs: InFlight,
    /// Requests sent and not completed, and the event a D0 exit or the
    /// teardown waits on.
    requests: InFlight,
    ud_send_slot: AtomicUsize,
    rc_send_slot: AtomicUsize,
    stats: Stats,
    closed: Mutex<Option<Result<(), IbStatus>>>,
    /// The HCA is gone (surprise removal): nothing to say on the fabric.
    surprise_removed: AtomicBool,
    /// The timer of the session's ticks (an unanswered hello sent again).
    tick_timer: TimerId,
    /// The RC QP's replacement under way, and the connect waiting for it.
    replacement: Mutex<Replacement>,
}

impl std::fmt::Debug for PortClientDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortClientDevice")
            .field("host", &self.host)
            .finish_non_exhaustive()
    }
}

/// The AL's callbacks for one client: a completion queues its DPC.
struct Callbacks(Weak<PortClientDevice>);

impl ClientEvents for Callbacks {
    fn completion(&self, _cq: u64) {
        if let Some(device) = self.0.upgrade() {
            device.queue_drain();
        }
    }

    fn async_event(&self, _event: &AsyncEventRecord) {}
}

impl PortClientDevice {
    /// The port data its AL interface gave, once it got it (kept after
    /// release).
    pub fn port_data(&self) -> Option<PortInterfaceData> {
        self.port.get().copied()
    }

    /// The session's phase (`Down` before the start).
    pub fn phase(&self) -> Phase {
        lock(&self.session)
            .as_ref()
            .map_or(Phase::Down, Session::phase)
    }

    /// The settings it read at its last start (and what it refused).
    pub fn config(&self) -> Config {
        *lock(&self.config)
    }

    /// Whether it runs the rounds on its current connection.
    pub fn is_initiator(&self) -> bool {
        lock(&self.session)
            .as_ref()
            .is_some_and(Session::is_initiator)
    }

    /// What the session counted (what it had counted at its end, after
    /// release-hardware).
    pub fn counters(&self) -> Counters {
        lock(&self.session)
            .as_ref()
            .map_or_else(|| *lock(&self.final_counters), Session::counters)
    }

    /// What the shell counted.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// What closing the AL at release-hardware returned (`None` before).
    pub fn closed(&self) -> Option<Result<(), IbStatus>> {
        *lock(&self.closed)
    }

    /// The references the client holds on its driver object now.
    pub fn driver_references(&self) -> usize {
        self.references.load(Ordering::Acquire)
    }

    /// The node of its child.
    pub fn node(&self) -> sim_host::pnp::DevNodeId {
        self.host.node()
    }

    /// Allows `rounds` more round trips on the current connection (see
    /// `Session::run_more`); the next ping is posted at once if the
    /// connection was idle. DISPATCH_LEVEL or below.
    pub fn run_more(&self, rounds: u32) {
        let actions = lock(&self.session).as_mut().map(|s| s.run_more(rounds));
        if let Some(actions) = actions {
            self.carry_out(actions);
        }
    }

    fn me(&self) -> Option<Arc<Self>> {
        self.me.upgrade()
    }

    fn al(&self) -> Option<(Arc<AlPortInterface>, AlClient)> {
        lock(&self.link).as_ref().map(|l| (l.al.clone(), l.client))
    }

    fn write_slot(&self, offset: usize, bytes: &[u8]) -> bool {
        lock(&self.buffer)
            .as_ref()
            .is_some_and(|b| b.write(offset, bytes))
    }

    fn read_slot(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        let mut out = vec![0; len];
        lock(&self.buffer)
            .as_ref()
            .is_some_and(|b| b.read(offset, &mut out))
            .then_some(out)
    }

    // ---- requests --------------------------------------------------

    /// Sends verb `V` through the AL with a completion routine that runs
    /// `done` as this driver's code (up to DISPATCH_LEVEL). Never blocks.
    fn submit<V: Verb>(
        &self,
        handle: u64,
        input: &V::In,
        private: &[u8],
        room: u32,
        done: impl FnOnce(&Arc<Self>, Answer<V>) + Send + 'static,
    ) where
        V::Out: Send,
    {
        let Some(me) = self.me() else { return };
        let Some((al, client)) = self.al() else {
            done(&me, Err(IbStatus::InvalidState));
            return;
        };
        let (Some(in_len), Some(out_len)) = (
            request_len::<V>(private.len()),
            response_len::<V>(room as usize),
        ) else {
            done(&me, Err(IbStatus::InvalidParameter));
            return;
        };
        let mut bytes = vec![0; in_len];
        if encode_request::<V>(handle, input, private, room, &mut bytes).is_err() {
            done(&me, Err(IbStatus::InvalidParameter));
            return;
        }
        let (mut request, _issuer) = HostRequest::new(
            &self.verifier,
            V::ID.ioctl().raw(),
            RequestorMode::Kernel,
            bytes,
            out_len,
        );
        let verifier = self.verifier.clone();
        enter(&self.requests);
        request.set_completion_routine(Box::new(move |status, information, output| {
            let _client = context::enter(Context::driver(verifier, SERVICE));
            // A chain sends its next request from `done`: counted before
            // this one leaves, so "none in flight" means the chain ended.
            done(&me, answer::<V>(*status, *information, output));
            leave(&me.requests);
        }));
        // The completion routine reports the outcome, now or later.
        let _ = al.submit(client, request);
    }

    /// Verb `V` through the AL, waiting for its completion at most
    /// [`DRAIN_WAIT_NS`] (PASSIVE_LEVEL).
    fn call<V: Verb>(&self, handle: u64, input: &V::In) -> Result<u64, IbStatus> {
        let (al, client) = self.al().ok_or(IbStatus::InvalidState)?;
        let mut bytes = vec![0; request_len::<V>(0).ok_or(IbStatus::InvalidParameter)?];
        encode_request::<V>(handle, input, &[], 0, &mut bytes)
            .map_err(|_| IbStatus::InvalidParameter)?;
        let out_len = response_len::<V>(0).ok_or(IbStatus::InvalidParameter)?;
        let (mut request, issuer) = HostRequest::new(
            &self.verifier,
            V::ID.ioctl().raw(),
            RequestorMode::Kernel,
            bytes,
            out_len,
        );
        let event = HostEvent::new(self.sched.clone());
        request.set_completion_event(event.clone());
        let _ = al.submit(client, request);
        // Bounded: a request the HCA holds (below D0) or never answers
        // ends the call as a timeout; its completion still comes later.
        self.wait_bounded(&event, DRAIN_WAIT_NS);
        let done = issuer.completion().ok_or(IbStatus::Timeout)?;
        answer::<V>(done.status, done.information, &done.output).map(|(handle, _, _)| handle)
    }

    /// Waits on `event` until it is set or `ns` of simulated time passed
    /// (a timer of this driver sets it then). PASSIVE_LEVEL.
    fn wait_bounded(&self, event: &HostEvent, ns: u64) {
        let timer = self.sched.new_timer();
        let expiry = event.clone();
        self.sched.set_timer(
            timer,
            SERVICE,
            self.sched.now_ns().saturating_add(ns),
            move || expiry.set(),
        );
        event.wait();
        self.sched.cancel_timer(timer);
    }

    // ---- creation (DISPATCH_LEVEL chain) ----------------------------

    fn created(&self, outcome: Result<(), IbStatus>) {
        let mut created = lock(&self.created);
        if created.0.is_none() {
            created.0 = Some(outcome);
        }
        if let Some(event) = &created.1 {
            event.set();
        }
    }

    /// Step 1, in the client's DPC: the port's GID from `QueryCa`.
    fn create_resources(&self) {
        let Some(link) = lock(&self.link).clone() else {
            return;
        };
        let port = link.port.port;
        self.submit::<QueryCa>(
            link.client.ca_handle(),
            &Empty,
            &[],
            QUERY_CA_ROOM,
            move |me, answer| {
                let gid = answer.and_then(|(_, _, private)| {
                    let view = CaAttrView::parse(&private).map_err(|_| IbStatus::GenericError)?;
                    let port = view.port(port).ok_or(IbStatus::InvalidPort)?;
                    port.gids().first().copied().ok_or(IbStatus::GenericError)
                });
                match gid {
                    Ok(gid) => {
                        lock(&me.objects).gid = Some(gid);
                        me.create_pd();
                    }
                    Err(status) => me.created(Err(status)),
                }
            },
        );
    }

    fn create_pd(&self) {
        let Some((_, client)) = self.al() else { return };
        self.submit::<AllocPd>(
            client.ca_handle(),
            &Empty,
            &[],
            0,
            |me, answer| match answer {
                Ok((pd, _, _)) => {
                    lock(&me.objects).pd = pd;
                    me.create_cq();
                }
                Err(status) => me.created(Err(status)),
            },
        );
    }

    fn create_cq(&self) {
        let Some((_, client)) = self.al() else { return };
        let attr = CqAttr {
            // Every receive and send slot may hold a completion.
            cqe: (2 * (lock(&self.layout).ud_recv.2 + SEND_SLOTS)) as u32,
            comp_vector: 0,
        };
        self.submit::<CreateCq>(
            client.ca_handle(),
            &attr,
            &[],
            0,
            |me, answer| match answer {
                Ok((cq, _, _)) => {
                    lock(&me.objects).cq = cq;
                    me.create_qp(QpType::Ud, Then::Chain);
                }
                Err(status) => me.created(Err(status)),
            },
        );
    }

    /// Creates the UD QP (then the RC QP) in the creation chain, or a
    /// replacement RC QP.
    fn create_qp(&self, qp_type: QpType, then: Then) {
        let Some((_, client)) = self.al() else { return };
        let objects = *lock(&self.objects);
        let create = QpCreate {
            qp_type,
            pd: PdHandle::from_raw(objects.pd),
            send_cq: CqHandle::from_raw(objects.cq),
            recv_cq: CqHandle::from_raw(objects.cq),
            srq: None,
            caps: QpCaps {
                max_send_wr: 16,
                max_recv_wr: lock(&self.layout).ud_recv.2 as u32,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
            port: None,
        };
        self.submit::<CreateQp>(client.ca_handle(), &create, &[], 0, move |me, answer| {
            let created = answer
                .and_then(|(qp, out, _)| Ok((qp, out.ok_or(IbStatus::GenericError)?.qpn.get())));
            match (created, qp_type) {
                (Ok((qp, qpn)), QpType::Ud) => {
                    let mut objects = lock(&me.objects);
                    (objects.ud_qp, objects.ud_qpn) = (qp, qpn);
                    drop(objects);
                    me.create_qp(QpType::Rc, Then::Chain);
                }
                (Ok((qp, qpn)), _) => {
                    let mut objects = lock(&me.objects);
                    (objects.rc_qp, objects.rc_qpn) = (qp, qpn);
                    drop(objects);
                    match then {
                        Then::Chain => me.register_buffer(),
                        Then::Replaced => {
                            if let Some(session) = lock(&me.session).as_mut() {
                                session.set_local_qpn(qpn);
                            }
                            if let Some((remote, local_psn)) = me.replaced() {
                                me.connect_rc(remote, local_psn, 0);
                            }
                        }
                    }
                }
                (Err(status), _) => match then {
                    Then::Chain => me.created(Err(status)),
                    Then::Replaced => {
                        me.note(Err(status));
                        if me.replaced().is_some() {
                            me.connected(false);
                        }
                    }
                },
            }
        });
    }

    /// The buffer registered by its bus addresses (mapped through the
    /// HCA's adapter, the one the client got from its PDO).
    fn register_buffer(&self) {
        let Some(base) = lock(&self.buffer).as_ref().map(CommonBuffer::bus_address) else {
            self.created(Err(IbStatus::InvalidState));
            return;
        };
        let bytes = lock(&self.layout).bytes;
        let pages = bytes / 4096;
        let input = PhysMrRegister {
            iova: base,
            length: bytes as u64,
            first_byte_offset: 0,
            page_shift: 12,
            num_pages: pages as u32,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        };
        let list: Vec<u8> = (0..pages as u64)
            .flat_map(|i| (base + i * 4096).to_le_bytes())
            .collect();
        let pd = lock(&self.objects).pd;
        self.submit::<RegPhysMr>(pd, &input, &list, 0, |me, answer| {
            let registered =
                answer.and_then(|(mr, out, _)| Ok((mr, out.ok_or(IbStatus::GenericError)?)));
            match registered {
                Ok((mr, out)) => {
                    let mut objects = lock(&me.objects);
                    objects.mr = mr;
                    objects.iova = out.iova;
                    objects.lkey = out.keys.lkey.get();
                    objects.rkey = out.keys.rkey.get();
                    drop(objects);
                    me.ud_to_rts(0);
                }
                Err(status) => me.created(Err(status)),
            }
        });
    }

    /// The UD QP to INIT (Q_Key, port), RTR, RTS; then its receives.
    fn ud_to_rts(&self, step: usize) {
        let Some(link) = lock(&self.link).clone() else {
            return;
        };
        let ud_qp = lock(&self.objects).ud_qp;
        let layout = *lock(&self.layout);
        let modify = match step {
            0 => QpModify {
                state: Some(QpState::Init),
                pkey_index: Some(0),
                port: Some(link.port.port),
                qkey: Some(QKey::new(PORT_CLIENT_QKEY)),
                ..QpModify::default()
            },
            1 => QpModify::to_state(QpState::Rtr),
            2 => QpModify {
                state: Some(QpState::Rts),
                sq_psn: Psn::new(1).ok(),
                ..QpModify::default()
            },
            _ => {
                let posted = (0..layout.ud_recv.2)
                    .all(|slot| self.post_recv(ud_qp, KIND_UD_RECV, layout.ud_recv, slot));
                let cq = lock(&self.objects).cq;
                let armed = link.al.arm_cq(link.client, cq, CqNotify::NextCompletion);
                self.created(if posted && armed.is_ok() {
                    Ok(())
                } else {
                    Err(IbStatus::GenericError)
                });
                return;
            }
        };
        self.submit::<ModifyQp>(ud_qp, &modify, &[], 0, move |me, answer| match answer {
            Ok(_) => me.ud_to_rts(step + 1),
            Err(status) => me.created(Err(status)),
        });
    }

    // ---- the fast path ----------------------------------------------

    fn post_recv(
        &self,
        qp: u64,
        kind: u64,
        (first, size, _): (usize, usize, usize),
        slot: usize,
    ) -> bool {
        let Some((al, client)) = self.al() else {
            return false;
        };
        let objects = *lock(&self.objects);
        let sge = [Sge::new(
            objects.iova + (first + slot * size) as u64,
            size as u32,
            LKey::new(objects.lkey),
        )];
        let wr = [RecvWr {
            wr_id: kind << 32 | slot as u64,
            sg_list: &sge,
        }];
        let posted = al.post_recv(client, qp, &wr) == (1, IbStatus::Success);
        if !posted {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
        }
        posted
    }

    fn post_send(
        &self,
        qp: u64,
        kind: u64,
        slots: (usize, usize, usize),
        slot: usize,
        len: usize,
        ud: Option<UdDest>,
    ) {
        let Some((al, client)) = self.al() else {
            return;
        };
        let objects = *lock(&self.objects);
        let sge = [Sge::new(
            objects.iova + (slots.0 + slot * slots.1) as u64,
            len as u32,
            LKey::new(objects.lkey),
        )];
        let wr = [SendWr {
            wr_id: kind << 32 | slot as u64,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: &sge,
            ud,
        }];
        if al.post_send(client, qp, &wr) != (1, IbStatus::Success) {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn queue_drain(&self) {
        let Some(me) = self.me() else { return };
        enter(&self.dpcs);
        self.sched.queue_dpc(SERVICE, move || {
            me.drain();
            leave(&me.dpcs);
        });
    }

    /// Arms the client's timer for the session's next tick if it wants one
    /// (an unanswered hello). The routine counts as a DPC in flight, so
    /// the teardown waits for it. DISPATCH_LEVEL or below.
    fn arm_tick(&self) {
        let wants = lock(&self.session)
            .as_ref()
            .is_some_and(Session::wants_tick);
        let Some(me) = self.me().filter(|_| wants) else {
            return;
        };
        enter(&self.dpcs);
        let due = self.sched.now_ns().saturating_add(TICK_NS);
        let replaced = self
            .sched
            .set_timer(self.tick_timer, SERVICE, due, move || {
                let actions = lock(&me.session).as_mut().map(Session::on_tick);
                if let Some(actions) = actions {
                    me.carry_out(actions);
                }
                me.arm_tick();
                leave(&me.dpcs);
            });
        if replaced {
            // The replaced expiry will never run.
            leave(&self.dpcs);
        }
    }

    fn cancel_tick(&self) {
        if self.sched.cancel_timer(self.tick_timer) {
            leave(&self.dpcs);
        }
    }

    /// Waits until nothing counted in `slot` is in flight, at most `ns`
    /// (PASSIVE_LEVEL). Returns whether it drained.
    fn wait_drained(&self, slot: &InFlight, ns: u64) -> bool {
        let idle = HostEvent::new(self.sched.clone());
        {
            let mut slot = lock(slot);
            if slot.0 == 0 {
                return true;
            }
            slot.1 = Some(idle.clone());
        }
        self.wait_bounded(&idle, ns);
        let mut slot = lock(slot);
        slot.1 = None;
        slot.0 == 0
    }

    /// The connection is over: its RC QP is destroyed and a new one made
    /// (a QP that was connected may not connect again before the TIME
    /// WAIT quiet period, guide 6.5.2); the session learns its number.
    /// Requests chained by their completions, up to DISPATCH_LEVEL.
    /// Then, `connect`: connect the new QP (a reconnect). One replacement
    /// at a time: a second one asked meanwhile only keeps its connect (the
    /// QP will be new anyway).
    fn replace_rc(&self, connect: Option<(ConnParams, u32)>) {
        {
            let mut replacement = lock(&self.replacement);
            if connect.is_some() {
                replacement.then_connect = connect;
            }
            if replacement.under_way {
                return;
            }
            replacement.under_way = true;
        }
        // The old QP's number goes too: its flushes are no loss of the
        // connection that follows on the new one.
        let (old, old_qpn) = {
            let mut objects = lock(&self.objects);
            (
                std::mem::take(&mut objects.rc_qp),
                std::mem::take(&mut objects.rc_qpn),
            )
        };
        if old == 0 {
            if self.replaced().is_some() {
                self.connected(false);
            }
            return;
        }
        self.submit::<DestroyQp>(old, &Empty, &[], 0, move |me, answer| {
            if answer.is_ok() {
                me.create_qp(QpType::Rc, Then::Replaced);
            } else {
                // Still ours (the device failed under the command, say):
                // the teardown destroys it again.
                me.note(answer.map(|_| 0));
                let mut objects = lock(&me.objects);
                (objects.rc_qp, objects.rc_qpn) = (old, old_qpn);
                drop(objects);
                if me.replaced().is_some() {
                    me.connected(false);
                }
            }
        });
    }

    /// The replacement ended: the connect that waited for it, if any.
    fn replaced(&self) -> Option<(ConnParams, u32)> {
        let mut replacement = lock(&self.replacement);
        replacement.under_way = false;
        replacement.then_connect.take()
    }

    /// The client's DPC: polls everything, re-arms, polls again (a
    /// completion between the last poll and the arm raises no event).
    fn drain(&self) {
        let Some((al, client)) = self.al() else {
            return;
        };
        let cq = lock(&self.objects).cq;
        if cq == 0 {
            return;
        }
        let mut wcs = [WorkCompletion::EMPTY; 8];
        for rearmed in [false, true] {
            loop {
                match al.poll_cq(client, cq, &mut wcs) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        for wc in &wcs[..n] {
                            self.completed(wc);
                        }
                    }
                }
            }
            if !rearmed && al.arm_cq(client, cq, CqNotify::NextCompletion).is_err() {
                break;
            }
        }
    }

    fn completed(&self, wc: &WorkCompletion) {
        let (kind, slot) = (wc.wr_id >> 32, (wc.wr_id & 0xFFFF_FFFF) as usize);
        let objects = *lock(&self.objects);
        let layout = *lock(&self.layout);
        if wc.status != WcStatus::Success {
            self.stats.error_completions.fetch_add(1, Ordering::Relaxed);
            // An error on the connection's own QP (not the flushes of a
            // replaced one): the peer vanished without a goodbye.
            let rc = matches!(kind, KIND_RC_SEND | KIND_RC_RECV);
            if rc && wc.qp_num.get() == objects.rc_qpn {
                let actions = lock(&self.session)
                    .as_mut()
                    .map(Session::on_connection_lost);
                if let Some(actions) = actions {
                    self.carry_out(actions);
                }
            }
            return;
        }
        match kind {
            KIND_UD_RECV => {
                self.stats
                    .datagrams_received
                    .fetch_add(1, Ordering::Relaxed);
                let (first, size, _) = layout.ud_recv;
                let offset = first + slot * size;
                let len = (wc.byte_len as usize).min(size);
                let received = self.read_slot(offset, len);
                self.post_recv(objects.ud_qp, KIND_UD_RECV, layout.ud_recv, slot);
                let Some(bytes) = received.filter(|b| b.len() >= GRH_BYTES) else {
                    return;
                };
                // The sender's address: the GRH's source GID, the source QP.
                let sender = (source_gid(&bytes[..GRH_BYTES]), wc.src_qp.get());
                let actions = lock(&self.session)
                    .as_mut()
                    .and_then(|s| s.on_datagram(&bytes[GRH_BYTES..]).ok());
                if let Some(actions) = actions {
                    *lock(&self.peer) = Some(sender);
                    self.carry_out(actions);
                }
            }
            KIND_RC_RECV => {
                let (first, size, _) = layout.rc_recv;
                let received =
                    self.read_slot(first + slot * size, (wc.byte_len as usize).min(size));
                self.post_recv(objects.rc_qp, KIND_RC_RECV, layout.rc_recv, slot);
                let actions = received.and_then(|bytes| {
                    lock(&self.session)
                        .as_mut()
                        .map(|s| s.on_rc_received(&bytes))
                });
                if let Some(actions) = actions {
                    self.carry_out(actions);
                }
            }
            _ => {}
        }
    }

    // ---- the session's actions --------------------------------------

    fn carry_out(&self, actions: Vec<Action>) {
        let mut actions = actions.into_iter().peekable();
        while let Some(action) = actions.next() {
            match action {
                // A reconnect: the new QP first, then the connect on it.
                Action::ResetRc if matches!(actions.peek(), Some(Action::ConnectRc { .. })) => {
                    if let Some(Action::ConnectRc { remote, local_psn }) = actions.next() {
                        self.replace_rc(Some((remote, local_psn)));
                    }
                }
                Action::SendDatagram(message) => self.send_datagram(message.encode()),
                Action::SendRc(payload) => self.send_rc(payload),
                Action::ConnectRc { remote, local_psn } => self.connect_rc(remote, local_psn, 0),
                Action::ResetRc => self.replace_rc(None),
                Action::CloseDone => {
                    if let Some(event) = lock(&self.close_wait).as_ref() {
                        event.set();
                    }
                }
            }
        }
    }

    fn send_rc(&self, payload: [u8; PAYLOAD_LEN]) {
        let rc_send = lock(&self.layout).rc_send;
        let slot = self.rc_send_slot.fetch_add(1, Ordering::Relaxed) % rc_send.2;
        if !self.write_slot(rc_send.0 + slot * rc_send.1, &payload) {
            return;
        }
        let rc_qp = lock(&self.objects).rc_qp;
        self.stats.rc_sent.fetch_add(1, Ordering::Relaxed);
        self.post_send(rc_qp, KIND_RC_SEND, rc_send, slot, PAYLOAD_LEN, None);
    }

    /// A datagram to the peer's UD address, through the AV to its GID
    /// (made on first use, the send following in its completion).
    fn send_datagram(&self, bytes: [u8; WIRE_LEN]) {
        let Some((gid, qpn)) = *lock(&self.peer) else {
            self.stats
                .datagrams_unroutable
                .fetch_add(1, Ordering::Relaxed);
            return;
        };
        let av = *lock(&self.av);
        match av {
            Some((av_gid, av)) if av_gid == gid => self.post_datagram(av, qpn, bytes),
            _ => {
                let Some(port) = self.port_data().map(|p| p.port) else {
                    return;
                };
                let pd = lock(&self.objects).pd;
                self.submit::<CreateAv>(pd, &av_to(port, gid), &[], 0, move |me, answer| {
                    match answer {
                        Ok((av, _, _)) => {
                            let old = lock(&me.av).replace((gid, av));
                            if let Some((_, old)) = old {
                                me.submit::<DestroyAv>(old, &Empty, &[], 0, |_, _| {});
                            }
                            me.post_datagram(av, qpn, bytes);
                        }
                        Err(_) => {
                            me.stats.refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        }
    }

    fn post_datagram(&self, av: u64, qpn: u32, bytes: [u8; WIRE_LEN]) {
        let Ok(remote_qpn) = Qpn::new(qpn) else {
            return;
        };
        let ud_send = lock(&self.layout).ud_send;
        let slot = self.ud_send_slot.fetch_add(1, Ordering::Relaxed) % ud_send.2;
        if !self.write_slot(ud_send.0 + slot * ud_send.1, &bytes) {
            return;
        }
        let ud_qp = lock(&self.objects).ud_qp;
        self.stats.datagrams_sent.fetch_add(1, Ordering::Relaxed);
        let dest = UdDest {
            av: AvHandle::from_raw(av),
            remote_qpn,
            remote_qkey: QKey::new(PORT_CLIENT_QKEY),
        };
        self.post_send(ud_qp, KIND_UD_SEND, ud_send, slot, WIRE_LEN, Some(dest));
    }

    /// RESET, INIT, receives posted, RTR towards `remote` on the peer's
    /// GID, RTS from `local_psn`; then the session hears the outcome.
    fn connect_rc(&self, remote: ConnParams, local_psn: u32, step: usize) {
        if step == 0 {
            // The QP is being replaced (the last connection ended): the
            // connect goes to the new one, once it exists.
            let mut replacement = lock(&self.replacement);
            if replacement.under_way {
                replacement.then_connect = Some((remote, local_psn));
                return;
            }
        }
        let Some(port) = self.port_data().map(|p| p.port) else {
            return;
        };
        let objects = *lock(&self.objects);
        let Some((gid, _)) = *lock(&self.peer) else {
            self.connected(false);
            return;
        };
        let modify = match step {
            0 => QpModify::to_state(QpState::Reset),
            1 => QpModify {
                state: Some(QpState::Init),
                pkey_index: Some(0),
                port: Some(port),
                access: Some(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ),
                ..QpModify::default()
            },
            2 => {
                let rc_recv = lock(&self.layout).rc_recv;
                let posted = (0..rc_recv.2)
                    .all(|slot| self.post_recv(objects.rc_qp, KIND_RC_RECV, rc_recv, slot));
                let (Ok(dest_qpn), Ok(rq_psn)) = (Qpn::new(remote.qpn), Psn::new(remote.psn))
                else {
                    self.connected(false);
                    return;
                };
                if !posted {
                    self.connected(false);
                    return;
                }
                QpModify {
                    state: Some(QpState::Rtr),
                    av: Some(av_to(port, gid)),
                    path_mtu: Some(Mtu::Mtu1024),
                    dest_qpn: Some(dest_qpn),
                    rq_psn: Some(rq_psn),
                    max_dest_rd_atomic: Some(1),
                    min_rnr_timer: Some(12),
                    ..QpModify::default()
                }
            }
            3 => QpModify {
                state: Some(QpState::Rts),
                sq_psn: Psn::new(local_psn).ok(),
                timeout: Some(14),
                retry_cnt: Some(7),
                rnr_retry: Some(7),
                max_rd_atomic: Some(1),
                ..QpModify::default()
            },
            _ => {
                self.connected(true);
                return;
            }
        };
        self.submit::<ModifyQp>(
            objects.rc_qp,
            &modify,
            &[],
            0,
            move |me, answer| match answer {
                Ok(_) => me.connect_rc(remote, local_psn, step + 1),
                Err(status) => {
                    me.note(Err(status));
                    me.connected(false)
                }
            },
        );
    }

    fn connected(&self, ok: bool) {
        let actions = lock(&self.session).as_mut().map(|s| s.on_connected(ok));
        if let Some(actions) = actions {
            self.carry_out(actions);
        }
    }

    // ---- teardown ---------------------------------------------------

    /// Destroys what exists in dependency order (PASSIVE_LEVEL), waits
    /// for the client's DPCs, frees the buffer, closes the AL and gives
    /// the interface back.
    fn teardown(&self) {
        self.cancel_tick();
        // What the session started (a QP's replacement) finishes first.
        self.wait_drained(&self.requests, DRAIN_WAIT_NS);
        let objects = std::mem::take(&mut *lock(&self.objects));
        let av = lock(&self.av).take();
        for qp in [objects.rc_qp, objects.ud_qp] {
            if qp != 0 {
                self.destroy::<DestroyQp>(qp);
            }
        }
        if let Some((_, av)) = av {
            self.destroy::<DestroyAv>(av);
        }
        if objects.mr != 0 {
            self.destroy::<DeregMr>(objects.mr);
        }
        if objects.cq != 0 {
            self.destroy::<DestroyCq>(objects.cq);
        }
        if objects.pd != 0 {
            self.destroy::<DeallocPd>(objects.pd);
        }
        // No completion event can come now; wait for DPCs already queued.
        self.wait_drained(&self.dpcs, DRAIN_WAIT_NS);
        if let Some(session) = lock(&self.session).take() {
            *lock(&self.final_counters) = session.counters();
        }
        let Some(link) = lock(&self.link).take() else {
            return;
        };
        if let Some(buffer) = lock(&self.buffer).take() {
            link.adapter.free_common(buffer);
        }
        let drained = Arc::new(HostEvent::new(self.sched.clone()));
        let closed = link.al.close(link.client, drained);
        *lock(&self.closed) = Some(closed);
        if let Ok(link) = Arc::try_unwrap(link) {
            link.interface.dereference();
        }
    }

    /// Destroys one object (PASSIVE_LEVEL). A destroy that failed because
    /// the device failed under its command (the HCA vanished) is sent once
    /// more: once the miniport knows, a destroy frees in software.
    fn destroy<V: Verb<In = Empty>>(&self, handle: u64) {
        let first = self.call::<V>(handle, &Empty);
        if first.is_err() {
            self.note(first);
            self.note(self.call::<V>(handle, &Empty));
        }
    }

    fn note(&self, result: Result<u64, IbStatus>) {
        if result.is_err() {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Gets the AL interface, the DMA adapter and the buffer, opens the AL.
    fn acquire(&self) -> Result<(), NtStatus> {
        let interface = self
            .host
            .query_interface(&GUID_IB_AL_INTERFACE, AL_INTERFACE_VERSION.packed())
            .ok_or(NtStatus::NOT_SUPPORTED)?;
        let answered = InterfaceVersion::from_packed(interface.version());
        if !answered.satisfies(AL_INTERFACE_VERSION) {
            interface.dereference();
            return Err(STATUS_REVISION_MISMATCH);
        }
        let Some(al) = interface.get::<Arc<AlPortInterface>>().cloned() else {
            interface.dereference();
            return Err(NtStatus::INVALID_DEVICE_STATE);
        };
        let adapter = self
            .host
            .query_interface(&GUID_BUS_INTERFACE_STANDARD, BUS_INTERFACE_STANDARD_VERSION)
            .and_then(|bus| {
                let adapter = bus.call(|b: &BusInterfaceStandard| b.get_dma_adapter());
                bus.dereference();
                adapter?.ok()
            });
        let Some(adapter) = adapter else {
            interface.dereference();
            return Err(NtStatus::NOT_SUPPORTED);
        };
        let buffer = match adapter.alloc_common(lock(&self.layout).bytes) {
            Ok(buffer) => buffer,
            Err(status) => {
                interface.dereference();
                return Err(status);
            }
        };
        let reference = Box::new(DriverObjectReference::new(self.references.clone()));
        let events = Arc::new(Callbacks(self.me.clone()));
        let client = match al.open(reference, events) {
            Ok(client) => client,
            Err(status) => {
                adapter.free_common(buffer);
                interface.dereference();
                return Err(status.to_ntstatus());
            }
        };
        let port = al.port_data();
        let _ = self.port.set(port);
        *lock(&self.buffer) = Some(buffer);
        *lock(&self.link) = Some(Arc::new(Link {
            interface,
            al,
            client,
            port,
            adapter,
        }));
        Ok(())
    }
}

impl DeviceCallbacks for PortClientDevice {
    fn prepare_hardware(&self) -> NtStatus {
        // The settings from the hardware key (the INF's, or an
        // administrator's): a malformed value is refused, the default used.
        let config = self
            .host
            .registry()
            .map(|view| read_config(&view))
            .unwrap_or_default();
        *lock(&self.config) = config;
        *lock(&self.layout) = Layout::new(config.receive_depth as usize);
        if let Err(status) = self.acquire() {
            return status;
        }
        let Some(me) = self.me() else {
            return NtStatus::INVALID_DEVICE_STATE;
        };
        let event = HostEvent::new(self.sched.clone());
        *lock(&self.created) = (None, Some(event.clone()));
        // The resources are made at DISPATCH_LEVEL: from the DPC, each
        // verb's completion routine sending the next.
        self.sched.queue_dpc(SERVICE, move || me.create_resources());
        self.wait_bounded(&event, CREATE_WAIT_NS);
        let outcome = {
            let mut created = lock(&self.created);
            created.1 = None;
            // Ran out: what completes later is undone by the teardown.
            *created.0.get_or_insert(Err(IbStatus::Timeout))
        };
        match outcome {
            Ok(()) => {
                let objects = *lock(&self.objects);
                let local = ConnParams {
                    qpn: objects.rc_qpn,
                    psn: 0x10,
                    rkey: objects.rkey,
                    addr: objects.iova,
                    len: lock(&self.layout).bytes as u32,
                };
                let guid = self.port_data().map_or(0, |p| p.port_guid.get());
                *lock(&self.session) = Some(Session::new(guid, local, self.rounds));
                SUCCESS
            }
            Err(status) => {
                self.teardown();
                status.to_ntstatus()
            }
        }
    }

    fn d0_entry(&self, _from: DevicePowerState) -> NtStatus {
        let (Some(port), objects) = (self.port_data(), *lock(&self.objects)) else {
            return SUCCESS;
        };
        let Some(gid) = objects.gid else {
            return SUCCESS;
        };
        let (ca, port_num) = (port.ca_guid.get(), port.port.get());
        self.rendezvous.publish(Endpoint {
            ca_guid: ca,
            port: port_num,
            gid,
            ud_qpn: objects.ud_qpn,
        });
        let peer = self.rendezvous.peer_of(ca, port_num);
        *lock(&self.peer) = peer.map(|p| (p.gid, p.ud_qpn));
        let actions = lock(&self.session)
            .as_mut()
            .map(|s| s.start(peer.is_some()));
        if let Some(actions) = actions {
            self.carry_out(actions);
        }
        self.arm_tick();
        // A DPC of ours that ran while the HCA was below D0 could neither
        // poll nor re-arm the CQ: poll and arm now, the HCA being in D0.
        self.queue_drain();
        SUCCESS
    }

    fn d0_exit(&self, _to: DevicePowerState) -> NtStatus {
        self.cancel_tick();
        if let Some(port) = self.port_data() {
            self.rendezvous
                .withdraw(port.ca_guid.get(), port.port.get());
        }
        if self.surprise_removed.load(Ordering::Acquire) {
            // The HCA is gone: no goodbye can reach the peer (it finds out
            // from its RC QP), and the teardown destroys what is left.
            if let Some(session) = lock(&self.session).as_mut() {
                session.abandon();
            }
            return SUCCESS;
        }
        let event = HostEvent::new(self.sched.clone());
        *lock(&self.close_wait) = Some(event.clone());
        let closing = lock(&self.session).as_mut().map(Session::begin_close);
        if let Some((actions, wait)) = closing {
            self.carry_out(actions);
            if wait {
                self.wait_bounded(&event, GOODBYE_WAIT_NS);
                let late = lock(&self.session).as_mut().map(Session::close_timed_out);
                if let Some(actions) = late {
                    self.carry_out(actions);
                }
            }
        }
        *lock(&self.close_wait) = None;
        // The HCA is still in D0: let the teardown of the connection (the
        // RC QP's replacement) finish before it leaves, boundedly.
        self.wait_drained(&self.requests, DRAIN_WAIT_NS);
        SUCCESS
    }

    /// `EvtDeviceSurpriseRemoval`: the HCA (and so this child) is gone;
    /// D0 exit and release-hardware follow.
    fn surprise_removal(&self) {
        self.surprise_removed.store(true, Ordering::Release);
    }

    fn release_hardware(&self) -> NtStatus {
        self.teardown();
        SUCCESS
    }
}

/// The created handle, fixed output and private bytes of a completed verb.
fn answer<V: Verb>(status: NtStatus, information: u64, output: &[u8]) -> Answer<V> {
    if !status.is_success() {
        return Err(IbStatus::from_ntstatus(status));
    }
    let len = usize::try_from(information)
        .unwrap_or(usize::MAX)
        .min(output.len());
    // A create puts the handle in Information: the response is the whole
    // buffer then.
    let bytes = if V::ID.creates().is_some() {
        output
    } else {
        &output[..len]
    };
    let response = decode_response::<V>(bytes).map_err(|_| IbStatus::GenericError)?;
    if response.status != IbStatus::Success {
        return Err(response.status);
    }
    Ok((response.handle, response.output, response.private.to_vec()))
}

/// The source GID of a received datagram's 40-byte GRH area. RoCEv2
/// over IPv4 puts 20 zero bytes and the IPv4 header there (the source
/// address at offset 12 of the header); otherwise it is a GRH with the
/// source GID at offset 8.
fn source_gid(grh: &[u8]) -> Gid {
    let mut octets = [0; 16];
    if grh[..20].iter().all(|&b| b == 0) && grh[20] >> 4 == 4 {
        let mut ipv4 = [0; 4];
        ipv4.copy_from_slice(&grh[32..36]);
        return Gid::from_ipv4(ipv4);
    }
    octets.copy_from_slice(&grh[8..24]);
    Gid::from_octets(octets)
}

/// An address vector to `gid` from `port` (GID index 0, RoCE: no LID).
fn av_to(port: PortNum, gid: Gid) -> AvAttr {
    AvAttr {
        port,
        sl: 0,
        dlid: Lid::default(),
        path_bits: 0,
        static_rate: 0,
        grh: Some(Grh {
            dgid: gid,
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
            sgid_index: 0,
        }),
    }
}
