//! A request is completed only by its owner (issue 10 item 10): a driver
//! that hands its request across an interface to another driver's routine,
//! which completes it there, is caught; the provider that sends the
//! request to its own device instead (making it its own) is clean.

use std::sync::{Arc, Mutex};

use driver_platform::{Request, RequestorMode};
use ib_types::interface::WinGuid;
use ib_types::status::NtStatus;
use sim_host::driver::{
    DeviceCallbacks, DeviceInit, DriverEntry, Forward, ProvidedInterface, SUCCESS,
};
use sim_host::pnp::{Binder, DevNodeId, DeviceServices, PnpManager, StackPlan};
use sim_host::request::HostRequest;
use sim_host::verifier::{Verifier, ViolationKind};

const SUBMIT_INTERFACE: WinGuid = WinGuid::from_u128(0x5AB0_0000_0000_0000_0000_0000_0000_0001);
const IOCTL_WORK: u32 = 0x0022_3000;
const PROVIDER: &str = "sampleprovider";
const CONSUMER: &str = "sampleconsumer";
/// An upper filter on the provider's stack: a request the provider sends
/// to its own device object (`IoCallDriver` on its FDO) never passes it.
const UPPER: &str = "sampleupper";

/// Requests the upper filter saw.
static UPPER_SAW: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

struct TwoDevices;

impl Binder for TwoDevices {
    fn bind(&self, _path: &str, hw: &[String], _compat: &[String]) -> Result<StackPlan, String> {
        let (function, upper_filters) = match hw.first().map(String::as_str) {
            Some("TEST\\PROVIDER") => (PROVIDER, vec![UPPER.into()]),
            Some("TEST\\CONSUMER") => (CONSUMER, vec![]),
            other => return Err(format!("no INF matches {other:?}")),
        };
        Ok(StackPlan {
            function: function.into(),
            upper_filters,
            lower_filters: vec![],
            security: None,
        })
    }
}

/// The provider's interface: one routine taking a request.
struct Submit {
    services: DeviceServices,
    /// Broken: completes the caller's request in the routine.
    completes_foreign: bool,
}

impl Submit {
    fn submit(&self, req: HostRequest) {
        if self.completes_foreign {
            req.complete(SUCCESS, 1);
        } else {
            // Send it to this driver's own device: the host delivers it,
            // the provider owns it, and its io_request completes it.
            self.services.send_to_own_device(req);
        }
    }
}

struct ProviderDevice(Arc<Submit>);

impl DeviceCallbacks for ProviderDevice {
    fn query_interface(&self, guid: &WinGuid, _version: u16) -> Option<ProvidedInterface> {
        (*guid == SUBMIT_INTERFACE).then(|| ProvidedInterface {
            version: 0x0100,
            object: self.0.clone(),
        })
    }
    fn io_request(&self, _lower: &dyn Forward, req: HostRequest) {
        req.complete(SUCCESS, 2);
    }
    fn power_managed_queue(&self) -> bool {
        false
    }
}

/// Hands every request it gets to the provider's routine.
struct ConsumerDevice(Arc<Mutex<Option<sim_host::driver::InterfaceRef>>>);

impl DeviceCallbacks for ConsumerDevice {
    fn io_request(&self, _lower: &dyn Forward, req: HostRequest) {
        let iface = self.0.lock().unwrap();
        let Some(iface) = iface.as_ref() else {
            return req.complete(NtStatus::from_raw(0xC000_0001), 0);
        };
        iface.call(|submit: &Submit| submit.submit(req));
    }
    fn power_managed_queue(&self) -> bool {
        false
    }
}

struct Drivers {
    completes_foreign: bool,
    iface: Arc<Mutex<Option<sim_host::driver::InterfaceRef>>>,
}

impl DriverEntry for Drivers {
    fn add_device(
        &self,
        init: &DeviceInit,
        services: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        if init.hardware_ids[0] == "TEST\\PROVIDER" {
            return Ok(Arc::new(ProviderDevice(Arc::new(Submit {
                services: services.clone(),
                completes_foreign: self.completes_foreign,
            }))));
        }
        Ok(Arc::new(ConsumerDevice(self.iface.clone())))
    }
}

struct NoCallbacks;
impl DeviceCallbacks for NoCallbacks {}

/// The upper filter: counts what reaches it and passes it down.
struct UpperFilter;

impl DeviceCallbacks for UpperFilter {
    fn io_request(&self, lower: &dyn Forward, req: HostRequest) {
        UPPER_SAW.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        lower.forward(req);
    }
    fn power_managed_queue(&self) -> bool {
        false
    }
}

impl DriverEntry for UpperFilter {
    fn add_device(
        &self,
        _init: &DeviceInit,
        _services: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(UpperFilter))
    }
}

fn send_through_consumer(completes_foreign: bool) -> (Verifier, u64) {
    let verifier = Verifier::new();
    let pnp = PnpManager::new(verifier.clone(), Box::new(TwoDevices));
    let iface = Arc::default();
    let drivers = Arc::new(Drivers {
        completes_foreign,
        iface: Arc::clone(&iface),
    });
    pnp.register_driver(PROVIDER, drivers.clone());
    pnp.register_driver(CONSUMER, drivers);
    pnp.register_driver(UPPER, Arc::new(UpperFilter));
    let add = |path: &str, id: &str| -> DevNodeId {
        pnp.add_device(None, path, vec![id.into()], vec![], Arc::new(NoCallbacks))
    };
    let provider = add("ROOT\\PROVIDER\\0000", "TEST\\PROVIDER");
    let consumer = add("ROOT\\CONSUMER\\0000", "TEST\\CONSUMER");
    let reference = pnp
        .query_interface(provider, &SUBMIT_INTERFACE, 0x0100)
        .unwrap();
    assert_eq!(reference.provider(), Some(PROVIDER));
    *iface.lock().unwrap() = Some(reference);

    let (req, issuer) = HostRequest::new(&verifier, IOCTL_WORK, RequestorMode::Kernel, vec![], 0);
    pnp.send_request(consumer, req);
    let information = issuer.completion().expect("completed").information;
    if let Some(reference) = iface.lock().unwrap().take() {
        reference.dereference();
    }
    (verifier, information)
}

#[test]
fn completing_a_request_handed_over_an_interface_is_caught() {
    let (verifier, information) = send_through_consumer(true);
    assert_eq!(information, 1, "completed in the provider's routine");
    let v = verifier.take();
    assert!(
        matches!(&v[..], [x] if x.driver.as_deref() == Some(PROVIDER)
        && x.kind == ViolationKind::RequestCompletedByNonOwner {
            ioctl: IOCTL_WORK,
            by: PROVIDER.into(),
        }),
        "{v:?}"
    );
}

#[test]
fn sending_the_handed_over_request_to_the_providers_own_device_is_clean() {
    let (verifier, information) = send_through_consumer(false);
    assert_eq!(information, 2, "completed by the provider's io_request");
    assert_eq!(
        UPPER_SAW.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "IoCallDriver on the provider's own device object skips the filter above it"
    );
    verifier.assert_clean();
}

#[test]
fn a_request_a_driver_builds_is_its_own_until_it_sends_it() {
    let verifier = Verifier::new();
    let (req, _issuer) = {
        let _builder = sim_host::context::enter(sim_host::context::Context::driver(
            verifier.clone(),
            CONSUMER,
        ));
        HostRequest::new(&verifier, IOCTL_WORK, RequestorMode::Kernel, vec![], 0)
    };
    assert_eq!(req.owner(), Some(CONSUMER));
    let _other = sim_host::context::enter(sim_host::context::Context::driver(
        verifier.clone(),
        PROVIDER,
    ));
    req.complete(SUCCESS, 0);
    let v = verifier.take();
    assert!(
        matches!(&v[..], [x] if matches!(&x.kind,
            ViolationKind::RequestCompletedByNonOwner { by, .. } if by == PROVIDER)),
        "{v:?}"
    );
}
