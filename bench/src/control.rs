//! Measurement 5: the control path at DISPATCH_LEVEL. A kernel client
//! creates and destroys CQs and QPs from DPCs, each verb a framed request
//! completed by the device's command interrupt, two ways: through the
//! access layer (the AL interface a port child answers
//! `IRP_MN_QUERY_INTERFACE` with, `AlPortInterface::submit`: the bus
//! filter's handle checks and translation, then the CI) and as a direct
//! call of the miniport's request entry (`Hca::submit_request`, where the
//! CI's `submit` lands). Create+destroy pairs per second, and the AL's
//! rate over the direct one.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Instant;

use ib_types::cq::CqAttr;
use ib_types::event::AsyncEventRecord;
use ib_types::interface::{AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE};
use ib_types::ioctl::{AllocPd, CreateCq, CreateQp, DeallocPd, DestroyCq, DestroyQp, Empty, Verb};
use ib_types::qp::QpType;
use sim_host::driver::InterfaceRef;
use sim_host::event::HostEvent;
use sim_host::request::RequestHandle;
use sim_shells::hca_miniport::SERVICE;
use sim_shells::ibal_bus::{AlClient, AlPortInterface, ClientEvents, DriverObjectReference};
use sim_shells::rc_path::rc_qp_create;

use crate::kernel;
use crate::world::World;

/// A client that ignores the AL's callbacks (it polls nothing and arms
/// nothing).
#[derive(Debug, Default)]
struct Quiet;

impl ClientEvents for Quiet {
    fn completion(&self, _cq: u64) {}
    fn async_event(&self, _event: &AsyncEventRecord) {}
}

/// How a verb reaches the miniport.
pub trait Path {
    /// Submits `V` from a DPC, without waiting.
    fn submit<V: Verb>(&self, world: &World, handle: u64, input: &V::In) -> RequestHandle;
    /// The CA handle this path's creates name.
    fn ca(&self) -> u64;

    /// `V`, waited for: the new handle.
    fn call<V: Verb>(&self, world: &World, handle: u64, input: &V::In) -> u64 {
        let done = kernel::wait(&self.submit::<V>(world, handle, input), V::ID.name());
        kernel::ok::<V>(&done).handle
    }
}

/// The direct call of HCA 0's request entry, on a CA it opened.
#[derive(Debug)]
pub struct Direct {
    ca: u64,
}

impl Path for Direct {
    fn submit<V: Verb>(&self, world: &World, handle: u64, input: &V::In) -> RequestHandle {
        kernel::submit::<V>(world, 0, handle, input)
    }
    fn ca(&self) -> u64 {
        self.ca
    }
}

/// HCA 0's port-1 child's AL interface, opened by this client.
#[derive(Debug)]
pub struct Al {
    interface: Option<InterfaceRef>,
    al: Arc<AlPortInterface>,
    client: AlClient,
}

impl Path for Al {
    fn submit<V: Verb>(&self, world: &World, handle: u64, input: &V::In) -> RequestHandle {
        let (request, issuer) = kernel::request::<V>(world, handle, input);
        let (al, client) = (self.al.clone(), self.client);
        world.host.scheduler_handle().queue_dpc(SERVICE, move || {
            al.submit(client, request);
        });
        issuer
    }
    fn ca(&self) -> u64 {
        self.client.ca_handle()
    }
}

impl Al {
    /// Queries HCA 0's port-1 child for the AL interface and opens it.
    pub fn open(world: &World) -> Self {
        let hca = world.host.hcas()[0];
        let pnp = world.host.pnp();
        for child in pnp.children(hca) {
            let Some(interface) =
                pnp.query_interface(child, &GUID_IB_AL_INTERFACE, AL_INTERFACE_VERSION.packed())
            else {
                continue;
            };
            let al = interface
                .get::<Arc<AlPortInterface>>()
                .filter(|al| al.port_data().port.get() == 1)
                .cloned();
            let Some(al) = al else {
                interface.dereference();
                continue;
            };
            let reference = Box::new(DriverObjectReference::new(Arc::new(AtomicUsize::new(0))));
            let client = al.open(reference, Arc::new(Quiet)).expect("AL open");
            return Self {
                interface: Some(interface),
                al,
                client,
            };
        }
        panic!("no port-1 child of HCA 0 answers the AL interface");
    }

    /// Closes the client and gives the interface back.
    pub fn close(mut self, world: &World) {
        let drained = Arc::new(HostEvent::new(world.host.scheduler_handle()));
        self.al.close(self.client, drained).expect("AL close");
        if let Some(interface) = self.interface.take() {
            interface.dereference();
        }
    }
}

/// `cycles` CQ create+destroy pairs through `path`: pairs per second.
pub fn cq_cycles(world: &World, path: &impl Path, cycles: usize) -> f64 {
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let started = Instant::now();
    for _ in 0..cycles {
        let cq = path.call::<CreateCq>(world, path.ca(), &attr);
        path.call::<DestroyCq>(world, cq, &Empty);
    }
    cycles as f64 / started.elapsed().as_secs_f64()
}

/// `cycles` RC QP create+destroy pairs on `pd` and `cq` through `path`:
/// pairs per second.
pub fn qp_cycles(world: &World, path: &impl Path, pd: u64, cq: u64, cycles: usize) -> f64 {
    let create = rc_qp_create(QpType::Rc, pd, cq, 16);
    let started = Instant::now();
    for _ in 0..cycles {
        let qp = path.call::<CreateQp>(world, path.ca(), &create);
        path.call::<DestroyQp>(world, qp, &Empty);
    }
    cycles as f64 / started.elapsed().as_secs_f64()
}

/// The PD and CQ a path's QPs are created on.
pub fn pd_and_cq(world: &World, path: &impl Path) -> (u64, u64) {
    let pd = path.call::<AllocPd>(world, path.ca(), &Empty);
    let attr = CqAttr {
        cqe: 256,
        comp_vector: 0,
    };
    (pd, path.call::<CreateCq>(world, path.ca(), &attr))
}

/// Destroys what [`pd_and_cq`] made.
pub fn release(world: &World, path: &impl Path, (pd, cq): (u64, u64)) {
    path.call::<DestroyCq>(world, cq, &Empty);
    path.call::<DeallocPd>(world, pd, &Empty);
}

impl Direct {
    /// Direct calls on the CA the bus filter opened on HCA 0 (the
    /// miniport takes one kernel open per HCA, and the filter holds it):
    /// its CI handle, as the AL itself calls the CI with it.
    pub fn open(world: &World) -> Self {
        Self {
            ca: world.kernel_ca(0),
        }
    }
}
