//! Binding and the CA registry over a fake CI interface that records what
//! the filter did: the version is checked before anything is opened, a
//! failed port query hands the opened CA back to be closed, and CAs arrive and leave in any
//! order.

use std::sync::{Arc, Mutex};

use ib_types::cq::CqNotify;
use ib_types::event::AsyncEventRecord;
use ib_types::handle::CqHandle;
use ib_types::interface::InterfaceVersion;
use ib_types::scalars::{NodeGuid, PKey, PortGuid, PortNum};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendWr};
use ibal_bus_core::ca_registry::{
    BindError, BoundCa, CaRegistry, OpenedCa, STATUS_REVISION_MISMATCH, check_version,
};
use ibal_bus_core::ci::{CaEvents, CaIdentity, CiAccess, PortIdentity, REQUIRED_CI_VERSION};

struct FakeCi {
    version: InterfaceVersion,
    guid: u64,
    ports: Result<Vec<PortIdentity>, IbStatus>,
    calls: Mutex<Vec<&'static str>>,
}

impl FakeCi {
    fn new(guid: u64, ports: u8) -> Self {
        let ports = (1..=ports)
            .map(|n| PortIdentity {
                port_num: PortNum::new(n).unwrap(),
                port_guid: PortGuid::new(guid + u64::from(n)),
                pkeys: vec![PKey::DEFAULT],
                gids: Vec::new(),
            })
            .collect();
        Self {
            version: REQUIRED_CI_VERSION,
            guid,
            ports: Ok(ports),
            calls: Mutex::default(),
        }
    }
    fn calls(&self) -> Vec<&'static str> {
        self.calls.lock().unwrap().clone()
    }
    fn note(&self, call: &'static str) {
        self.calls.lock().unwrap().push(call);
    }
}

impl CiAccess for FakeCi {
    type Request = ();
    fn version(&self) -> InterfaceVersion {
        self.version
    }
    fn identity(&self) -> Result<CaIdentity, IbStatus> {
        self.note("identity");
        Ok(CaIdentity {
            ca_guid: NodeGuid::new(self.guid),
            vendor_id: 0xF1B0,
            device_id: 1,
            revision: 1,
        })
    }
    fn open_ca(&self, _events: Arc<dyn CaEvents>) -> Result<u64, IbStatus> {
        self.note("open");
        Ok(0xCA)
    }
    fn close_ca(&self, _ca: u64) -> Result<(), IbStatus> {
        self.note("close");
        Ok(())
    }
    fn submit(&self, _request: ()) -> NtStatus {
        NtStatus::NOT_SUPPORTED
    }
    fn post_send(&self, _qp: u64, _wrs: &[SendWr<'_>]) -> (usize, IbStatus) {
        (0, IbStatus::InvalidQpHandle)
    }
    fn post_recv(&self, _qp: u64, _wrs: &[RecvWr<'_>]) -> (usize, IbStatus) {
        (0, IbStatus::InvalidQpHandle)
    }
    fn poll_cq(&self, _cq: u64, _wcs: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        Err(IbStatus::InvalidCqHandle)
    }
    fn arm_cq(&self, _cq: u64, _notify: CqNotify) -> Result<(), IbStatus> {
        Err(IbStatus::InvalidCqHandle)
    }
}

struct NoEvents;
impl CaEvents for NoEvents {
    fn completion(&self, _cq: CqHandle) {}
    fn async_event(&self, _event: &AsyncEventRecord) {}
}

/// Both steps, as the shell runs them; a failed second step closes the CA.
fn bind(ci: &Arc<FakeCi>) -> Result<BoundCa<FakeCi>, BindError> {
    let opened = OpenedCa::open(ci.clone(), Arc::new(NoEvents))?;
    assert_eq!(opened.identity().ca_guid.get(), ci.guid);
    // The port query, answered.
    ci.note("ports");
    opened
        .with_ports(ci.ports.clone())
        .map_err(|(opened, error)| {
            opened.close().unwrap();
            error
        })
}

#[test]
fn a_version_mismatch_fails_before_anything_is_opened() {
    for version in [
        InterfaceVersion::new(REQUIRED_CI_VERSION.major + 1, 0),
        InterfaceVersion::new(REQUIRED_CI_VERSION.major.wrapping_sub(1), 9),
    ] {
        let mut fake = FakeCi::new(0x100, 2);
        fake.version = version;
        let ci = Arc::new(fake);
        let error = bind(&ci).unwrap_err();
        assert_eq!(
            error,
            BindError::VersionMismatch {
                got: version,
                required: REQUIRED_CI_VERSION
            }
        );
        assert_eq!(error.nt_status(), STATUS_REVISION_MISMATCH);
        assert!(error.to_string().contains("does not satisfy"));
        assert!(ci.calls().is_empty(), "nothing asked of a mismatched CA");
        assert_eq!(check_version(version), Err(error));
    }
    // A newer minor is fine.
    let mut fake = FakeCi::new(0x100, 1);
    fake.version = InterfaceVersion::new(REQUIRED_CI_VERSION.major, REQUIRED_CI_VERSION.minor + 1);
    assert!(bind(&Arc::new(fake)).is_ok());
}

#[test]
fn a_failed_port_query_hands_the_ca_back_to_be_closed() {
    for (ports, expected) in [
        (
            Err(IbStatus::InvalidState),
            BindError::QueryPorts(IbStatus::InvalidState),
        ),
        (Ok(Vec::new()), BindError::NoPorts),
    ] {
        let mut fake = FakeCi::new(0x200, 0);
        fake.ports = ports;
        let ci = Arc::new(fake);
        assert_eq!(bind(&ci).unwrap_err(), expected);
        assert_eq!(ci.calls(), ["identity", "open", "ports", "close"]);
    }
}

#[test]
fn cas_arrive_and_leave_in_any_order() {
    let fakes: Vec<Arc<FakeCi>> = (1..=4).map(|i| Arc::new(FakeCi::new(i << 16, 2))).collect();
    let mut registry = CaRegistry::default();
    for order in [[0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]] {
        for &i in &order {
            let bound = Arc::new(bind(&fakes[i]).unwrap());
            assert_eq!(bound.ports().len(), 2);
            registry.register(bound).unwrap();
        }
        assert_eq!(registry.len(), 4);
        let guids: Vec<u64> = registry.guids().iter().map(|g| g.get()).collect();
        assert_eq!(guids, [1 << 16, 2 << 16, 3 << 16, 4 << 16]);
        // A second stack over the same CA is refused and handed back.
        let twin = Arc::new(bind(&fakes[order[0]]).unwrap());
        let (back, error) = registry.register(twin).unwrap_err();
        assert_eq!(error, BindError::AlreadyRegistered(back.identity().ca_guid));
        Arc::try_unwrap(back).unwrap().unbind().unwrap();
        // Leave in the reverse of another order.
        for &i in order.iter().rev().skip(1).chain(order.iter().rev().take(1)) {
            let guid = NodeGuid::new(fakes[i].guid);
            let bound = registry.deregister(guid).unwrap();
            assert!(registry.get(guid).is_none());
            Arc::try_unwrap(bound).unwrap().unbind().unwrap();
        }
        assert!(registry.is_empty());
    }
    for fake in &fakes {
        let calls = fake.calls();
        let opens = calls.iter().filter(|c| **c == "open").count();
        let closes = calls.iter().filter(|c| **c == "close").count();
        assert_eq!(opens, closes, "every open CA was closed");
    }
}

#[test]
fn ports_come_from_the_ca_attribute_block_and_garbage_is_refused() {
    use ibal_bus_core::ci::ports_from_attributes;
    assert_eq!(ports_from_attributes(&[]), Err(IbStatus::GenericError));
    assert_eq!(
        ports_from_attributes(&[0xFF; 64]),
        Err(IbStatus::GenericError)
    );
}
