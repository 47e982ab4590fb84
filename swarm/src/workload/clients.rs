//! The swarm's actors of issue 11 beside the main kernel client
//! (docs/swarm.md "AL clients, children and user opens"): extra AL clients
//! that open and close at random, often with live objects; children added
//! and removed at runtime through the filter's registry list; user-mode
//! opens through the proxy whose processes die at random; handles forged
//! across opens; and AL requests left in flight across a sleep.

use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use driver_platform::{CommonBuffer, DmaAdapter, RegValue};
use hca_prm::uverbs::CreateCqPriv;
use ib_types::access::AccessFlags;
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::event::AsyncEventRecord;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{
    AllocPd, CreateAv, CreateCq, CreateQp, DeallocPd, DestroyAv, DestroyCq, DestroyQp, Empty,
    GetAsyncEvent, ModifyQp, OpenCa, OpenCaIn, QueryCq, RegMr, RegPhysMr, Verb, decode_response,
    encode_request, request_len, response_len,
};
use ib_types::mr::{MrRegister, PhysMrRegister};
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::QKey;
use ib_types::status::IbStatus;
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RecvWr, Sge};
use sim_host::dma::HostCommonBuffer;
use sim_host::driver::InterfaceRef;
use sim_host::event::HostEvent;
use sim_host::file::FileHandle;
use sim_host::memory::Process;
use sim_host::registry::service_parameters_key;
use sim_host::request::RequestHandle;
use sim_shells::ibal_bus::{AlPortInterface, ClientEvents, DriverObjectReference};
use zerocopy::IntoBytes;

use super::Swarm;
use crate::machine::{AlOpen, HCAS, Submitted, av_to, decode, lock, port1};

/// Most extra AL clients open at once.
const MAX_EXTRA_CLIENTS: usize = 3;
/// Most live user processes (one open each).
const MAX_USER_OPENS: usize = 3;
/// The child-list entries the swarm adds and removes: name and P_Key.
const CHURN_ENTRIES: [(&str, u32); 3] =
    [("Swarm1", 0x8001), ("Swarm2", 0x8002), ("Swarm3", 0x8003)];
/// The Q_Key of the extra clients' UD QPs.
const EXTRA_QKEY: u32 = 0x5157_00E0;
/// Private output room of the user requests (`OpenCaPriv`, `CreateCqPrivOut`).
const USER_ROOM: u32 = 64;
/// The first process id of the swarm's user processes.
const FIRST_PID: u32 = 1000;

/// The callbacks of an extra client: counted, and any that starts after
/// its close returned is a breach (the AL promises none).
pub(super) struct ExtraEvents {
    name: String,
    closed: AtomicBool,
    breaches: Mutex<Vec<String>>,
    callbacks: AtomicU64,
}

impl ExtraEvents {
    fn callback(&self, what: String) {
        self.callbacks.fetch_add(1, Ordering::Relaxed);
        if self.closed.load(Ordering::SeqCst) {
            lock(&self.breaches).push(format!("{}: {what} after its AL close returned", self.name));
        }
    }
}

impl ClientEvents for ExtraEvents {
    fn completion(&self, cq: u64) {
        if sim_host::irql::current() != driver_platform::Irql::DISPATCH {
            lock(&self.breaches).push(format!(
                "{}: completion callback outside DISPATCH_LEVEL",
                self.name
            ));
        }
        self.callback(format!("completion event for CQ {cq:#x}"));
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        self.callback(format!("{:?} for {:#x}", event.code, event.handle));
    }
}

/// A CQ or QP of an extra client and the ring buffers the miniport
/// allocated for it (measured at its create; empty when not measured).
struct Ringed {
    handle: u64,
    rings: Vec<u64>,
}

/// An extra AL client on a port-1 child.
pub(super) struct ExtraClient {
    name: String,
    side: usize,
    open: Arc<AlOpen>,
    interface: Option<InterfaceRef>,
    events: Arc<ExtraEvents>,
    /// One page of the HCA's DMA adapter for its receives.
    buffer: Option<HostCommonBuffer>,
    pd: Option<u64>,
    mr: Option<(u64, u64, LKey)>,
    cqs: Vec<Ringed>,
    /// QPs, each on the CQ of the same index; whether moved to ERR.
    qps: Vec<(Ringed, bool)>,
    avs: Vec<u64>,
    /// Receive `wr_id`s posted and not yet polled.
    recvs: HashSet<u64>,
    /// Every handle it was given, and what it names (for forgeries once
    /// it is closed).
    handles: Vec<(u64, HandleKind)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HandleKind {
    Pd,
    Cq,
    Qp,
}

impl HandleKind {
    fn invalid(self) -> IbStatus {
        match self {
            HandleKind::Pd => IbStatus::InvalidPdHandle,
            HandleKind::Cq => IbStatus::InvalidCqHandle,
            HandleKind::Qp => IbStatus::InvalidQpHandle,
        }
    }
}

/// A user process with one open of an HCA through the proxy.
pub(super) struct UserOpen {
    side: usize,
    process: Process,
    file: Option<FileHandle>,
    ca: Option<u64>,
    pds: Vec<u64>,
    cqs: Vec<u64>,
    mrs: Vec<u64>,
    /// Its `GetAsyncEvent` waits, pending until it dies.
    waits: Vec<RequestHandle>,
}

impl UserOpen {
    /// Objects the proxy records for this open: its CA context and what
    /// was created on it.
    fn objects(&self) -> usize {
        usize::from(self.ca.is_some()) + self.pds.len() + self.cqs.len() + self.mrs.len()
    }
}

/// The issue-11 actors' state.
#[derive(Default)]
pub(super) struct Extras {
    clients: Vec<ExtraClient>,
    /// Closed clients' callbacks, still watched.
    closed: Vec<Arc<ExtraEvents>>,
    /// Handles of closed clients, by HCA.
    stale: Vec<(usize, u64, HandleKind)>,
    next_client: u64,
    next_wr_id: u64,
    /// The swarm's child-list entries present now.
    entries: BTreeSet<&'static str>,
    users: Vec<UserOpen>,
    next_pid: u32,
}

impl Swarm {
    /// Whether the issue-11 actors may act on `side` now: healthy, not
    /// held, no main-client request outstanding (whose completion could
    /// free or allocate rings while a create is measured).
    fn extras_ok(&self, side: usize) -> bool {
        self.sync_ok(side) && self.pending.is_empty() && self.hold.is_none()
    }

    // ----- extra AL clients ----------------------------------------------

    pub(super) fn al_client_op(&mut self) -> Result<(), String> {
        let open_new = self.extra.clients.is_empty()
            || (self.extra.clients.len() < MAX_EXTRA_CLIENTS && self.rng.below(4) == 0);
        if open_new {
            let side = self.rng.below(2) as usize;
            if self.extras_ok(side) {
                self.open_extra(side)?;
            }
            return Ok(());
        }
        let at = self.rng.below(self.extra.clients.len() as u64) as usize;
        let side = self.extra.clients[at].side;
        if !self.extras_ok(side) {
            return Ok(());
        }
        if self.extra.clients[at].pd.is_none() {
            let (open, ca) = {
                let c = &self.extra.clients[at];
                (c.open.clone(), c.open.client.ca_handle())
            };
            let pd = self.extra_create::<AllocPd>(at, &open, ca, &Empty, &[], false)?;
            self.extra.clients[at].pd = Some(pd.handle);
            self.extra.clients[at]
                .handles
                .push((pd.handle, HandleKind::Pd));
            return Ok(());
        }
        match self.rng.below(16) {
            0 | 1 => self.extra_register(at),
            2..=4 => self.extra_cq(at),
            5..=7 => self.extra_qp(at),
            8 | 9 => self.extra_flush(at),
            10 => self.extra_av(at),
            11..=13 => self.extra_destroy(at),
            _ => {
                let client = self.extra.clients.swap_remove(at);
                self.close_extra(client)
            }
        }
    }

    /// Opens an extra client on HCA `side`'s port-1 child: its own
    /// reference to the child's AL interface, its own driver-object
    /// reference held by the AL.
    fn open_extra(&mut self, side: usize) -> Result<(), String> {
        let node = self.m.sides[side].device.node();
        let (_, interface) = self.m.port1_child(node)?;
        let al = interface
            .get::<Arc<AlPortInterface>>()
            .ok_or("the AL interface is not an AlPortInterface")?
            .clone();
        self.extra.next_client += 1;
        let name = format!("AL client {} on HCA {side}", self.extra.next_client);
        let events = Arc::new(ExtraEvents {
            name: name.clone(),
            closed: AtomicBool::new(false),
            breaches: Mutex::default(),
            callbacks: AtomicU64::new(0),
        });
        let reference = Box::new(DriverObjectReference::new(self.m.client_references.clone()));
        let client = al
            .open(reference, events.clone())
            .map_err(|s| format!("{name}: AL open: {s:?}"))?;
        self.note(format!("{name} opened"));
        self.count("AL client opened");
        self.extra.clients.push(ExtraClient {
            name,
            side,
            open: Arc::new(AlOpen { al, client }),
            interface: Some(interface),
            events,
            buffer: None,
            pd: None,
            mr: None,
            cqs: Vec::new(),
            qps: Vec::new(),
            avs: Vec::new(),
            recvs: HashSet::new(),
            handles: Vec::new(),
        });
        Ok(())
    }

    /// Creates with `V` for extra client `at`, measuring the ring buffers
    /// the miniport allocated for it when `rings`; a refusal is an error.
    fn extra_create<V: Verb>(
        &mut self,
        at: usize,
        open: &Arc<AlOpen>,
        target: u64,
        input: &V::In,
        private: &[u8],
        rings: bool,
    ) -> Result<Ringed, String> {
        let side = self.extra.clients[at].side;
        let before = self.m.live_buffers(side);
        let (status, handle, _) = self.m.call_on::<V>(open, target, input, private)?;
        if status != IbStatus::Success || handle == 0 {
            return Err(format!(
                "{}: {}: {status:?}",
                self.extra.clients[at].name,
                V::ID.name()
            ));
        }
        let rings = if rings {
            self.m
                .live_buffers(side)
                .difference(&before)
                .copied()
                .collect()
        } else {
            Vec::new()
        };
        self.count("AL client object created");
        Ok(Ringed { handle, rings })
    }

    fn extra_register(&mut self, at: usize) -> Result<(), String> {
        let (side, pd) = (self.extra.clients[at].side, self.extra.clients[at].pd);
        let (Some(pd), None) = (pd, &self.extra.clients[at].mr) else {
            return Ok(());
        };
        let adapter = self.m.sides[side].adapter.clone();
        let buffer = adapter
            .alloc_common(4096)
            .map_err(|s| format!("common buffer: {s:?}"))?;
        let bus = buffer.bus_address();
        self.extra.clients[at].buffer = Some(buffer);
        let input = PhysMrRegister {
            iova: bus,
            length: 4096,
            first_byte_offset: 0,
            page_shift: 12,
            num_pages: 1,
            access: AccessFlags::LOCAL_WRITE,
        };
        let open = self.extra.clients[at].open.clone();
        let (status, mr, out) =
            self.m
                .call_on::<RegPhysMr>(&open, pd, &input, &bus.to_le_bytes())?;
        let out = match (status, out) {
            (IbStatus::Success, Some(out)) => out,
            (status, _) => {
                return Err(format!(
                    "{}: RegPhysMr: {status:?}",
                    self.extra.clients[at].name
                ));
            }
        };
        self.extra.clients[at].mr = Some((mr, out.iova, out.keys.lkey));
        self.count("AL client object created");
        Ok(())
    }

    fn extra_cq(&mut self, at: usize) -> Result<(), String> {
        if self.extra.clients[at].cqs.len() >= 2 {
            return Ok(());
        }
        let attr = CqAttr {
            cqe: 16 + self.rng.below(48) as u32,
            comp_vector: 0,
        };
        let (open, ca) = {
            let c = &self.extra.clients[at];
            (c.open.clone(), c.open.client.ca_handle())
        };
        let cq = self.extra_create::<CreateCq>(at, &open, ca, &attr, &[], true)?;
        let handle = cq.handle;
        self.extra.clients[at].cqs.push(cq);
        self.extra.clients[at]
            .handles
            .push((handle, HandleKind::Cq));
        let armed = self
            .m
            .in_dpc(move || open.arm_cq(handle, CqNotify::NextCompletion))?;
        armed.map_err(|s| format!("arm of an extra client's CQ: {s:?}"))
    }

    fn extra_qp(&mut self, at: usize) -> Result<(), String> {
        let c = &self.extra.clients[at];
        let (Some(pd), n) = (c.pd, c.qps.len()) else {
            return Ok(());
        };
        if n >= c.cqs.len() {
            return Ok(());
        }
        let cq = c.cqs[n].handle;
        let (open, ca) = (c.open.clone(), c.open.client.ca_handle());
        let create = QpCreate {
            qp_type: QpType::Ud,
            pd: PdHandle::from_raw(pd),
            send_cq: CqHandle::from_raw(cq),
            recv_cq: CqHandle::from_raw(cq),
            srq: None,
            caps: QpCaps {
                max_send_wr: 4,
                max_recv_wr: 4,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
            port: None,
        };
        let qp = self.extra_create::<CreateQp>(at, &open, ca, &create, &[], true)?;
        let handle = qp.handle;
        self.extra.clients[at].qps.push((qp, false));
        self.extra.clients[at]
            .handles
            .push((handle, HandleKind::Qp));
        let init = QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(port1()?),
            qkey: Some(QKey::new(EXTRA_QKEY)),
            ..QpModify::default()
        };
        let (status, _, _) = self.m.call_on::<ModifyQp>(&open, handle, &init, &[])?;
        if status != IbStatus::Success {
            return Err(format!(
                "{}: INIT of its UD QP: {status:?}",
                self.extra.clients[at].name
            ));
        }
        // Receives in the client's own region, if it has one: a move to
        // ERR flushes them to its CQ (a completion event, since armed).
        let Some((_, iova, lkey)) = self.extra.clients[at].mr else {
            return Ok(());
        };
        let count = 1 + self.rng.below(3);
        let ids: Vec<u64> = (0..count)
            .map(|_| {
                self.extra.next_wr_id += 1;
                0xE000_0000_0000 + self.extra.next_wr_id
            })
            .collect();
        let wr_ids = ids.clone();
        let posted = self.m.in_dpc(move || {
            let sges: Vec<[Sge; 1]> = (0..wr_ids.len() as u64)
                .map(|i| [Sge::new(iova + i * 1024, 1024, lkey)])
                .collect();
            let wrs: Vec<RecvWr<'_>> = wr_ids
                .iter()
                .zip(&sges)
                .map(|(wr_id, sge)| RecvWr {
                    wr_id: *wr_id,
                    sg_list: sge,
                })
                .collect();
            open.post_recv(handle, &wrs)
        })?;
        if posted != (ids.len(), IbStatus::Success) {
            return Err(format!(
                "{}: post_recv on its QP in INIT: {posted:?}",
                self.extra.clients[at].name
            ));
        }
        self.extra.clients[at].recvs.extend(ids);
        Ok(())
    }

    /// Moves an extra client's QP to ERR and polls its CQ: each receive
    /// it posted comes back flushed, exactly once.
    fn extra_flush(&mut self, at: usize) -> Result<(), String> {
        let Some(i) = self.extra.clients[at].qps.iter().position(|(_, err)| !err) else {
            return Ok(());
        };
        let open = self.extra.clients[at].open.clone();
        let qp = self.extra.clients[at].qps[i].0.handle;
        let cq = self.extra.clients[at].cqs[i].handle;
        let (status, _, _) =
            self.m
                .call_on::<ModifyQp>(&open, qp, &QpModify::to_state(QpState::Err), &[])?;
        if status != IbStatus::Success {
            return Err(format!(
                "{}: its QP to ERR: {status:?}",
                self.extra.clients[at].name
            ));
        }
        self.extra.clients[at].qps[i].1 = true;
        self.m.run_for(50_000, 1_000_000)?;
        let polled = self.m.in_dpc(move || {
            let mut all = Vec::new();
            let mut wcs = [WorkCompletion::EMPTY; 4];
            loop {
                match open.poll_cq(cq, &mut wcs) {
                    Ok(0) => break Ok(all),
                    Ok(n) => all.extend_from_slice(&wcs[..n]),
                    Err(status) => break Err(status),
                }
            }
        })?;
        let wcs = polled.map_err(|s| format!("poll of an extra client's CQ: {s:?}"))?;
        let client = &mut self.extra.clients[at];
        for wc in wcs {
            if !client.recvs.remove(&wc.wr_id) || wc.status != WcStatus::WrFlushErr {
                return Err(format!(
                    "{}: completion {:#x} ({:?}) is not one of its outstanding receives flushed",
                    client.name, wc.wr_id, wc.status
                ));
            }
        }
        self.count("AL client QP flushed");
        Ok(())
    }

    fn extra_av(&mut self, at: usize) -> Result<(), String> {
        let c = &self.extra.clients[at];
        let Some(pd) = c.pd else {
            return Ok(());
        };
        if c.avs.len() >= 2 {
            return Ok(());
        }
        let open = c.open.clone();
        let peer_ip = HCAS[1 - c.side].1;
        let av = self.extra_create::<CreateAv>(at, &open, pd, &av_to(peer_ip)?, &[], false)?;
        self.extra.clients[at].avs.push(av.handle);
        Ok(())
    }

    /// Destroys one of an extra client's objects, leaves first; or tries
    /// its PD while others depend on it, which the AL refuses.
    fn extra_destroy(&mut self, at: usize) -> Result<(), String> {
        let open = self.extra.clients[at].open.clone();
        let c = &self.extra.clients[at];
        let Some(pd) = c.pd else {
            return Ok(());
        };
        let dependents = c.qps.len() + c.avs.len() + usize::from(c.mr.is_some());
        if dependents > 0 && self.rng.below(4) == 0 {
            let (status, _, _) = self.m.call_on::<DeallocPd>(&open, pd, &Empty, &[])?;
            if status != IbStatus::ResourceBusy {
                return Err(format!(
                    "{}: DeallocPd with {dependents} dependents: {status:?}, not ResourceBusy",
                    self.extra.clients[at].name
                ));
            }
            self.count("AL refused: PD with dependents");
            return Ok(());
        }
        let c = &mut self.extra.clients[at];
        let (status, what) = if let Some(av) = c.avs.pop() {
            (self.m.call_on::<DestroyAv>(&open, av, &Empty, &[])?.0, "AV")
        } else if c.qps.len() == c.cqs.len() && !c.qps.is_empty() {
            let (qp, _) = c.qps.pop().ok_or("no QP")?;
            // Its receives go with it (flushed into the CQ, unpolled).
            (
                self.m
                    .call_on::<DestroyQp>(&open, qp.handle, &Empty, &[])?
                    .0,
                "QP",
            )
        } else if c.cqs.len() > c.qps.len() {
            let cq = c.cqs.pop().ok_or("no CQ")?;
            (
                self.m
                    .call_on::<DestroyCq>(&open, cq.handle, &Empty, &[])?
                    .0,
                "CQ",
            )
        } else {
            return Ok(());
        };
        if status != IbStatus::Success {
            return Err(format!(
                "{}: destroy of its {what}: {status:?}",
                self.extra.clients[at].name
            ));
        }
        self.count("AL client object destroyed");
        Ok(())
    }

    /// Closes an extra client with whatever it still owns, and checks the
    /// AL's promises: `Ok`; its reference on the driver object released;
    /// no orphan left; every ring of its CQs and QPs given back by the
    /// miniport (the objects are gone at the CA); no callback afterwards
    /// (watched from now on); its calls refused from now on.
    fn close_extra(&mut self, mut client: ExtraClient) -> Result<(), String> {
        let side = client.side;
        let live = client.cqs.len() + client.qps.len() + client.avs.len();
        let live = live + usize::from(client.pd.is_some()) + usize::from(client.mr.is_some());
        let references = self.m.client_references.load(Ordering::SeqCst);
        let drained = Arc::new(HostEvent::new(self.m.host.scheduler_handle()));
        client
            .open
            .al
            .close(client.open.client, drained)
            .map_err(|s| format!("{}: AL close with {live} live objects: {s:?}", client.name))?;
        client.events.closed.store(true, Ordering::SeqCst);
        self.m.settle()?;
        if self.m.client_references.load(Ordering::SeqCst) + 1 != references {
            return Err(format!(
                "{}: its driver-object reference not released by the AL close",
                client.name
            ));
        }
        if !self.m.sides[side].failed() {
            if let Some(al) = self.m.access_layer(side)
                && !al.orphans().is_empty()
            {
                return Err(format!(
                    "{}: AL close left orphans {:?}",
                    client.name,
                    al.orphans()
                ));
            }
            let buffers = self.m.live_buffers(side);
            let rings: u64 = client
                .cqs
                .iter()
                .chain(client.qps.iter().map(|(q, _)| q))
                .map(|o| o.rings.len() as u64)
                .sum();
            *self
                .report
                .ops
                .entry("AL client rings checked given back at close")
                .or_default() += rings;
            let kept: Vec<u64> = client
                .cqs
                .iter()
                .chain(client.qps.iter().map(|(q, _)| q))
                .flat_map(|o| o.rings.iter().copied())
                .filter(|bus| buffers.contains(bus))
                .collect();
            if !kept.is_empty() {
                return Err(format!(
                    "{}: after its close the CA still holds rings {kept:#x?} of its CQs/QPs",
                    client.name
                ));
            }
        }
        if let Some(cq) = client.cqs.first() {
            let (open, handle) = (client.open.clone(), cq.handle);
            let polled = self.m.in_dpc(move || {
                let mut wcs = [WorkCompletion::EMPTY; 1];
                open.poll_cq(handle, &mut wcs)
            })?;
            if polled.is_ok() {
                return Err(format!(
                    "{}: a poll of its CQ accepted after its close",
                    client.name
                ));
            }
        }
        if let Some(buffer) = client.buffer.take() {
            self.m.sides[side].adapter.free_common(buffer);
        }
        if let Some(interface) = client.interface.take() {
            interface.dereference();
        }
        for (handle, kind) in &client.handles {
            self.extra.stale.push((side, *handle, *kind));
        }
        *self
            .report
            .ops
            .entry("AL client callbacks before close")
            .or_default() += client.events.callbacks.load(Ordering::Relaxed);
        self.extra.closed.push(client.events.clone());
        self.note(format!("{} closed with {live} live objects", client.name));
        self.count("AL client closed");
        if live > 0 {
            self.count("AL client closed with live objects");
        }
        Ok(())
    }

    /// Closes the extra clients on `side` (all with `None`).
    pub(super) fn close_extras(&mut self, side: Option<usize>) -> Result<(), String> {
        let (closing, kept): (Vec<ExtraClient>, Vec<ExtraClient>) =
            std::mem::take(&mut self.extra.clients)
                .into_iter()
                .partition(|c| side.is_none_or(|s| s == c.side));
        self.extra.clients = kept;
        for client in closing {
            self.close_extra(client)?;
        }
        Ok(())
    }

    /// HCA `side` failed: its access layer goes with its stack, and the
    /// restarted stack's AL hands out handles afresh (its client tags
    /// start again), so the closed clients' handles of the old one may
    /// name a new client's objects: no longer forgeries.
    pub(super) fn forget_stale_handles(&mut self, side: usize) {
        self.extra.stale.retain(|(s, ..)| *s != side);
    }

    /// The extra clients' callbacks: none after a close returned.
    pub(super) fn check_extras(&mut self) -> Result<(), String> {
        for events in self
            .extra
            .clients
            .iter()
            .map(|c| &c.events)
            .chain(&self.extra.closed)
        {
            if let Some(breach) = lock(&events.breaches).first() {
                return Err(breach.clone());
            }
        }
        for side in 0..2 {
            if !self.side_ok(side) || self.restart_due.is_some_and(|(s, _)| s == side) {
                continue;
            }
            let Some(filter) = self.m.filter_device(side) else {
                continue;
            };
            let want: usize = self
                .extra
                .users
                .iter()
                .filter(|u| u.side == side)
                .map(UserOpen::objects)
                .sum();
            let got = filter.proxy().object_count();
            if got != want {
                return Err(format!(
                    "HCA {side}'s proxy records {got} user objects, the processes hold {want}"
                ));
            }
        }
        Ok(())
    }

    // ----- children at runtime ---------------------------------------------

    /// Adds or removes one of the swarm's entries of the filter's child
    /// list, as an administrator's tool would, and tells the filter
    /// (`registry_changed`); every healthy HCA's started children are then
    /// exactly the list's, one per port (one port each), and the main
    /// client's IPoIB child is the same devnode, still started.
    pub(super) fn child_churn(&mut self) -> Result<(), String> {
        // The PnP pass settles the machine, which would let virtual time
        // run into the command timeout of a device holding its
        // completions (the miniport then reports the device failed).
        if self.restart_due.is_some() || self.hold.is_some() || !(0..2).all(|s| self.side_ok(s)) {
            return Ok(());
        }
        let (name, pkey) = CHURN_ENTRIES[self.rng.below(CHURN_ENTRIES.len() as u64) as usize];
        let params = service_parameters_key(sim_shells::ibal_bus::SERVICE);
        let key = format!("{params}\\{name}");
        let registry = self.m.host.registry();
        let error = |e: sim_host::registry::RegistryError| format!("registry: {e:?}");
        let adding = !self.extra.entries.contains(name);
        if adding {
            registry.create_key(&key).map_err(error)?;
            let id = format!("IBA\\SWARM_{name}");
            registry
                .set_value(&key, "DeviceId", RegValue::String(id.clone()))
                .map_err(error)?;
            registry
                .set_value(&key, "HardwareId", RegValue::MultiString(vec![id]))
                .map_err(error)?;
            registry
                .set_value(
                    &key,
                    "CompatibleId",
                    RegValue::MultiString(vec!["IBA\\PORT_CLIENT".into()]),
                )
                .map_err(error)?;
            registry
                .set_value(&key, "PartitionKey", RegValue::Dword(pkey))
                .map_err(error)?;
            self.extra.entries.insert(name);
        } else {
            self.extra.entries.remove(name);
        }
        let list: Vec<String> = std::iter::once("IPoIB")
            .chain(self.extra.entries.iter().copied())
            .map(str::to_owned)
            .collect();
        registry
            .set_value(&params, "StaticChild", RegValue::MultiString(list))
            .map_err(error)?;
        if !adding {
            registry.delete_tree(&key).map_err(error)?;
        }
        self.note(format!(
            "child list: {} {name}",
            if adding { "add" } else { "remove" }
        ));
        self.count(if adding {
            "child entry added"
        } else {
            "child entry removed"
        });
        self.m.filter.registry_changed();
        self.m.settle_tree()?;
        let mut want: Vec<String> = std::iter::once("IPoIB")
            .chain(self.extra.entries.iter().copied())
            .map(str::to_owned)
            .collect();
        want.sort();
        for side in 0..2 {
            let node = self.m.sides[side].device.node();
            let pnp = self.m.host.pnp();
            let mut got: Vec<String> = pnp
                .children(node)
                .into_iter()
                .filter(|c| pnp.state(*c) == Some(sim_host::pnp::PnpState::Started))
                .filter_map(|c| pnp.instance_path(c))
                .filter_map(|path| path.rsplit('_').next().map(str::to_owned))
                .collect();
            got.sort();
            if got != want {
                let all: Vec<String> = pnp
                    .children(node)
                    .into_iter()
                    .map(|c| format!("{:?} {:?}", pnp.instance_path(c), pnp.state(c)))
                    .collect();
                return Err(format!(
                    "HCA {side}'s started children {got:?} after the list became {want:?} (children: {all:?}; HCA {:?})",
                    pnp.state(node)
                ));
            }
            let child = self.m.sides[side].child;
            if pnp.state(child) != Some(sim_host::pnp::PnpState::Started) {
                return Err(format!(
                    "HCA {side}'s IPoIB child {child:?} is {:?} after a change of other entries",
                    pnp.state(child)
                ));
            }
        }
        Ok(())
    }

    // ----- user-mode opens ----------------------------------------------------

    pub(super) fn user_op(&mut self) -> Result<(), String> {
        let open_new = self.extra.users.is_empty()
            || (self.extra.users.len() < MAX_USER_OPENS && self.rng.below(4) == 0);
        if open_new {
            let side = self.rng.below(2) as usize;
            if self.extras_ok(side) {
                self.user_open(side)?;
            }
            return Ok(());
        }
        let at = self.rng.below(self.extra.users.len() as u64) as usize;
        if !self.extras_ok(self.extra.users[at].side) {
            return Ok(());
        }
        match self.rng.below(8) {
            0 | 1 => self.user_create_pd(at),
            2 | 3 => self.user_create_cq(at),
            4 => self.user_register(at),
            5 => self.user_wait(at),
            _ => {
                let user = self.extra.users.swap_remove(at);
                self.user_dies(user)
            }
        }
    }

    /// A process opens HCA `side` through its device interface and opens
    /// the CA (ABI version checked by the proxy and the miniport).
    fn user_open(&mut self, side: usize) -> Result<(), String> {
        let node = self.m.sides[side].device.node();
        let interfaces = self
            .m
            .host
            .pnp()
            .devices_with_interface(ib_types::interface::GUID_IB_AL_DEVICE_INTERFACE);
        if !interfaces.contains(&node) {
            return Err(format!("HCA {side} has no enabled proxy interface"));
        }
        self.extra.next_pid += 1;
        let process = Process::new(FIRST_PID + self.extra.next_pid);
        let file = self
            .m
            .host
            .pnp()
            .open_file(&process, node)
            .map_err(|s| format!("user open of HCA {side}: {s:?}"))?;
        let mut user = UserOpen {
            side,
            process,
            file: Some(file),
            ca: None,
            pds: Vec::new(),
            cqs: Vec::new(),
            mrs: Vec::new(),
            waits: Vec::new(),
        };
        let (status, ca) = self.user_call::<OpenCa>(&user, 0, &OpenCaIn::CURRENT, &[])?;
        if status != IbStatus::Success {
            return Err(format!("user OpenCa on HCA {side}: {status:?}"));
        }
        user.ca = Some(ca);
        self.note(format!(
            "process {} opened HCA {side} through the proxy",
            user.process.pid()
        ));
        self.count("user open");
        self.extra.users.push(user);
        Ok(())
    }

    /// Sends `V` on a user open and settles: its status and handle.
    fn user_call<V: Verb>(
        &self,
        user: &UserOpen,
        handle: u64,
        input: &V::In,
        private: &[u8],
    ) -> Result<(IbStatus, u64), String> {
        let issuer = self.user_send::<V>(user, handle, input, private)?;
        self.m
            .run_until(V::ID.name(), 2_000_000, || issuer.is_done())?;
        let done = issuer.completion().ok_or("user request not completed")?;
        if !done.status.is_success() && done.information == 0 {
            return Ok((IbStatus::from_ntstatus(done.status), 0));
        }
        let len = usize::try_from(done.information).unwrap_or(usize::MAX);
        let bytes = done.output.get(..len).ok_or("information too large")?;
        let response = decode_response::<V>(bytes)
            .map_err(|e| format!("user {}: {:?}: {e}", V::ID.name(), done.status))?;
        Ok((response.status, response.handle))
    }

    fn user_send<V: Verb>(
        &self,
        user: &UserOpen,
        handle: u64,
        input: &V::In,
        private: &[u8],
    ) -> Result<RequestHandle, String> {
        let file = user.file.as_ref().ok_or("the process's handle is closed")?;
        let mut bytes = vec![0; request_len::<V>(private.len()).ok_or("request size")?];
        encode_request::<V>(handle, input, private, USER_ROOM, &mut bytes)
            .map_err(|e| e.to_string())?;
        let out = response_len::<V>(USER_ROOM as usize).ok_or("response size")?;
        Ok(file.send(V::ID.ioctl().raw(), bytes, out))
    }

    fn user_create_pd(&mut self, at: usize) -> Result<(), String> {
        let user = &self.extra.users[at];
        let Some(ca) = user.ca else { return Ok(()) };
        if user.pds.len() >= 3 {
            return Ok(());
        }
        let (status, pd) = self.user_call::<AllocPd>(user, ca, &Empty, &[])?;
        if status != IbStatus::Success {
            return Err(format!("user AllocPd: {status:?}"));
        }
        self.extra.users[at].pds.push(pd);
        self.count("user object created");
        Ok(())
    }

    /// A CQ whose ring and doorbell record are the process's own memory
    /// (the UVP's layout, `hca_prm::uverbs::CreateCqPriv`).
    fn user_create_cq(&mut self, at: usize) -> Result<(), String> {
        let user = &self.extra.users[at];
        let Some(ca) = user.ca else { return Ok(()) };
        if user.cqs.len() >= 2 {
            return Ok(());
        }
        let log = 4 + self.rng.below(3) as u8;
        let alloc = |len: usize| {
            user.process
                .alloc(len)
                .map_err(|e| format!("process memory: {e:?}"))
        };
        let (ring, dbr) = (alloc(32 << log)?, alloc(64)?);
        let layout = CreateCqPriv::new(log, ring, dbr).map_err(|e| format!("{e:?}"))?;
        let attr = CqAttr {
            cqe: 1 << log,
            comp_vector: 0,
        };
        let private = layout.emit();
        let (status, cq) = self.user_call::<CreateCq>(user, ca, &attr, private.as_bytes())?;
        if status != IbStatus::Success {
            return Err(format!("user CreateCq of {} entries: {status:?}", 1 << log));
        }
        self.extra.users[at].cqs.push(cq);
        self.count("user object created");
        Ok(())
    }

    fn user_register(&mut self, at: usize) -> Result<(), String> {
        let user = &self.extra.users[at];
        let Some(&pd) = user.pds.first() else {
            return Ok(());
        };
        if user.mrs.len() >= 2 {
            return Ok(());
        }
        let va = user
            .process
            .alloc(2 * 4096)
            .map_err(|e| format!("process memory: {e:?}"))?;
        let region = MrRegister {
            vaddr: va,
            length: 2 * 4096,
            access: AccessFlags::LOCAL_WRITE,
        };
        let (status, mr) = self.user_call::<RegMr>(user, pd, &region, &[])?;
        if status != IbStatus::Success {
            return Err(format!("user RegMr: {status:?}"));
        }
        self.extra.users[at].mrs.push(mr);
        self.count("user object created");
        Ok(())
    }

    /// An asynchronous-event wait, pending until the process dies.
    fn user_wait(&mut self, at: usize) -> Result<(), String> {
        let user = &self.extra.users[at];
        let Some(ca) = user.ca else { return Ok(()) };
        if user.waits.len() >= 2 {
            return Ok(());
        }
        let wait = self.user_send::<GetAsyncEvent>(user, ca, &Empty, &[])?;
        self.m.settle()?;
        self.extra.users[at].waits.push(wait);
        Ok(())
    }

    /// The process exits without cleaning up: its handle closes, and
    /// everything it created is destroyed; nothing stays locked, mapped,
    /// pending or alive at the proxy or the miniport.
    fn user_dies(&mut self, mut user: UserOpen) -> Result<(), String> {
        let side = user.side;
        let objects = user.objects();
        // The process's handle is closed by the exit, not by the process.
        let file = user.file.take();
        let locked = self.m.host.pnp().exit_process(&user.process);
        drop(file);
        self.m.settle()?;
        let pid = user.process.pid();
        if locked != 0 || user.process.space().locked_pages() != 0 {
            return Err(format!("process {pid} died with pages locked"));
        }
        if user.process.space().device_mapping_count() != 0 {
            return Err(format!("process {pid} died with a device page mapped"));
        }
        if !user.waits.iter().all(RequestHandle::is_done) {
            return Err(format!("process {pid} died with a wait still pending"));
        }
        if !self.m.sides[side].failed() {
            let contexts = self.m.sides[side]
                .device
                .hca()
                .map(|hca| hca.user_context_count())
                .unwrap_or_default();
            let want = self
                .extra
                .users
                .iter()
                .filter(|u| u.side == side && u.ca.is_some())
                .count();
            if contexts != want {
                return Err(format!(
                    "process {pid} died: HCA {side} has {contexts} user contexts, {want} processes hold one"
                ));
            }
        }
        self.note(format!(
            "process {pid} on HCA {side} died with {objects} objects"
        ));
        self.count("user process died");
        Ok(())
    }

    /// The processes with opens on `side` (all with `None`) die.
    pub(super) fn kill_users(&mut self, side: Option<usize>) -> Result<(), String> {
        // One at a time: the model of the others stays whole while each
        // death is checked against it.
        while let Some(at) = self
            .extra
            .users
            .iter()
            .position(|u| side.is_none_or(|s| s == u.side))
        {
            let user = self.extra.users.remove(at);
            self.user_dies(user)?;
        }
        Ok(())
    }

    // ----- forged handles -------------------------------------------------------

    /// A handle used where it does not belong: another client's (the main
    /// client's, an extra client's, a closed client's) through the AL, or
    /// another process's open's through the proxy. Each must be refused
    /// with its kind's invalid-handle status, before it reaches the CA.
    pub(super) fn forge_handle(&mut self) -> Result<(), String> {
        let side = self.rng.below(2) as usize;
        if !self.extras_ok(side) {
            return Ok(());
        }
        match self.rng.below(4) {
            0 => self.forge_main_into_extra(side),
            1 => self.forge_extra_into_main(side),
            2 => self.forge_stale(side),
            _ => self.forge_across_processes(side),
        }
    }

    fn expect_refused(
        &mut self,
        what: String,
        status: IbStatus,
        want: IbStatus,
    ) -> Result<(), String> {
        if status != want {
            return Err(format!("forged handle: {what}: {status:?}, not {want:?}"));
        }
        self.note(format!("forged handle refused: {what}"));
        self.count("forged handle refused");
        Ok(())
    }

    /// An extra client names the main client's CQ (destroy, query, poll)
    /// or PD.
    fn forge_main_into_extra(&mut self, side: usize) -> Result<(), String> {
        let Some(extra) = self.extra.clients.iter().find(|c| c.side == side) else {
            return Ok(());
        };
        let open = extra.open.clone();
        let cq = self
            .cqs
            .iter()
            .find(|c| c.alive && !c.busy && c.side == side)
            .map(|c| c.handle);
        match (cq, self.rng.below(3)) {
            (Some(cq), 0) => {
                let (status, _, _) = self.m.call_on::<DestroyCq>(&open, cq, &Empty, &[])?;
                self.expect_refused(
                    format!("the main client's CQ {cq:#x} destroyed by another client"),
                    status,
                    IbStatus::InvalidCqHandle,
                )
            }
            (Some(cq), 1) => {
                let polled = self.m.in_dpc(move || {
                    let mut wcs = [WorkCompletion::EMPTY; 4];
                    open.poll_cq(cq, &mut wcs)
                })?;
                let status = polled.err().unwrap_or(IbStatus::Success);
                self.expect_refused(
                    format!("the main client's CQ {cq:#x} polled by another client"),
                    status,
                    IbStatus::InvalidCqHandle,
                )
            }
            (Some(cq), _) => {
                let (status, _, _) = self.m.call_on::<QueryCq>(&open, cq, &Empty, &[])?;
                self.expect_refused(
                    format!("the main client's CQ {cq:#x} queried by another client"),
                    status,
                    IbStatus::InvalidCqHandle,
                )
            }
            (None, _) => {
                let pd = self.m.sides[side].pd;
                let (status, _, _) = self.m.call_on::<DeallocPd>(&open, pd, &Empty, &[])?;
                self.expect_refused(
                    format!("the main client's PD {pd:#x} freed by another client"),
                    status,
                    IbStatus::InvalidPdHandle,
                )
            }
        }
    }

    /// The main client names an extra client's object.
    fn forge_extra_into_main(&mut self, side: usize) -> Result<(), String> {
        let Some(&(handle, kind)) = self
            .extra
            .clients
            .iter()
            .filter(|c| c.side == side)
            .flat_map(|c| c.handles.last())
            .next()
        else {
            return Ok(());
        };
        let open = self.m.sides[side].ci.clone();
        let status = self.destroy_as(&open, handle, kind)?;
        self.expect_refused(
            format!("an extra client's {kind:?} {handle:#x} destroyed by the main client"),
            status,
            kind.invalid(),
        )
    }

    /// A closed client's handle, named by the main client or by an open
    /// extra client (a new client never inherits a closed one's handles).
    fn forge_stale(&mut self, side: usize) -> Result<(), String> {
        let stale: Vec<(u64, HandleKind)> = self
            .extra
            .stale
            .iter()
            .filter(|(s, ..)| *s == side)
            .map(|(_, h, k)| (*h, *k))
            .collect();
        if stale.is_empty() {
            return Ok(());
        }
        let (handle, kind) = stale[self.rng.below(stale.len() as u64) as usize];
        let open = match self.extra.clients.iter().find(|c| c.side == side) {
            Some(extra) if self.rng.below(2) == 0 => extra.open.clone(),
            _ => self.m.sides[side].ci.clone(),
        };
        let status = self.destroy_as(&open, handle, kind)?;
        self.expect_refused(
            format!("a closed client's {kind:?} {handle:#x}"),
            status,
            kind.invalid(),
        )
    }

    /// One process's open names another process's PD on the same HCA.
    fn forge_across_processes(&mut self, side: usize) -> Result<(), String> {
        let owners: Vec<usize> = (0..self.extra.users.len())
            .filter(|&i| self.extra.users[i].side == side && !self.extra.users[i].pds.is_empty())
            .collect();
        let Some(&owner) = owners.first() else {
            return Ok(());
        };
        let Some(other) = (0..self.extra.users.len()).find(|&i| {
            i != owner && self.extra.users[i].side == side && self.extra.users[i].ca.is_some()
        }) else {
            return Ok(());
        };
        let pd = self.extra.users[owner].pds[0];
        let before = self.m.filter_device(side).map(|f| f.proxy().object_count());
        let (status, _) = self.user_call::<DeallocPd>(&self.extra.users[other], pd, &Empty, &[])?;
        let after = self.m.filter_device(side).map(|f| f.proxy().object_count());
        if before != after {
            return Err(format!(
                "a PD of another process's open freed: the proxy's objects went from {before:?} to {after:?}"
            ));
        }
        self.expect_refused(
            format!("process {}'s PD {pd:#x} freed by another process", {
                self.extra.users[owner].process.pid()
            }),
            status,
            IbStatus::InvalidPdHandle,
        )
    }

    /// Destroys `handle` as `open`: the status.
    fn destroy_as(
        &self,
        open: &Arc<AlOpen>,
        handle: u64,
        kind: HandleKind,
    ) -> Result<IbStatus, String> {
        Ok(match kind {
            HandleKind::Pd => self.m.call_on::<DeallocPd>(open, handle, &Empty, &[])?.0,
            HandleKind::Cq => self.m.call_on::<DestroyCq>(open, handle, &Empty, &[])?.0,
            HandleKind::Qp => self.m.call_on::<DestroyQp>(open, handle, &Empty, &[])?.0,
        })
    }

    // ----- sleep with AL requests in flight ---------------------------------

    /// Before a sleep (knob `sleep-al-requests`): each extra client on a
    /// healthy HCA sends a `CreateCq` or `AllocPd`, some reaching the
    /// miniport's power-managed queue before the sleep, some still in
    /// their DPC (sent while asleep).
    pub(super) fn sleep_requests(&mut self) -> Result<Vec<(usize, Submitted)>, String> {
        let mut sent = Vec::new();
        if !self.knobs.sleep_al_requests {
            return Ok(sent);
        }
        for at in 0..self.extra.clients.len() {
            let c = &self.extra.clients[at];
            if !self.side_ok(c.side) {
                continue;
            }
            let (open, ca) = (c.open.clone(), c.open.client.ca_handle());
            let submitted = if self.rng.below(2) == 0 {
                let attr = CqAttr {
                    cqe: 16,
                    comp_vector: 0,
                };
                self.m.submit_on::<CreateCq>(&open, ca, &attr, &[])?
            } else {
                self.m.submit_on::<AllocPd>(&open, ca, &Empty, &[])?
            };
            sent.push((at, submitted));
        }
        Ok(sent)
    }

    /// After the resume: every request sent around the sleep completed,
    /// exactly once (the verifier catches a second completion), with
    /// success; what it created is the client's.
    pub(super) fn after_sleep_requests(
        &mut self,
        sent: Vec<(usize, Submitted)>,
    ) -> Result<(), String> {
        for (at, submitted) in sent {
            self.m.wait(&submitted)?;
            let (status, handle, _) = if submitted.verb == CreateCq::ID.name() {
                decode::<CreateCq>(&submitted).map(|(s, h, _)| (s, h, ()))?
            } else {
                decode::<AllocPd>(&submitted).map(|(s, h, _)| (s, h, ()))?
            };
            let client = &mut self.extra.clients[at];
            if status != IbStatus::Success {
                return Err(format!(
                    "{}: {} sent around a sleep: {status:?}",
                    client.name, submitted.verb
                ));
            }
            // Not measured (other requests ran meanwhile): its rings are
            // not checked at close, its destroy is.
            if submitted.verb == CreateCq::ID.name() && client.cqs.len() < 2 {
                client.cqs.push(Ringed {
                    handle,
                    rings: Vec::new(),
                });
                client.handles.push((handle, HandleKind::Cq));
            } else if submitted.verb == AllocPd::ID.name() && client.pd.is_none() {
                client.pd = Some(handle);
                client.handles.push((handle, HandleKind::Pd));
            }
            // Anything else stays for the close to destroy: the AL
            // records it as the client's.
            self.count("AL request completed across a sleep");
        }
        Ok(())
    }
}
