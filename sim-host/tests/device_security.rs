//! Device security descriptors (`sim_host::security`): a sample function
//! driver assigns its stack an SDDL at add-device; `CreateFile` by a
//! caller whose token the descriptor does not grant read and write fails
//! with `STATUS_ACCESS_DENIED` before any driver of the stack sees the
//! create, while granted callers open. A deliberately broken sample
//! assigns SDDL outside the modelled subset: it is refused with
//! `STATUS_INVALID_PARAMETER` and the stack stays open to everyone (no
//! half-parsed descriptor).

use std::sync::{Arc, Mutex};

use ib_types::status::NtStatus;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, INVALID_PARAMETER, SUCCESS};
use sim_host::file::FileObject;
use sim_host::memory::Process;
use sim_host::pnp::{Binder, DevNodeId, DeviceServices, PnpManager, StackPlan};
use sim_host::security::Token;
use sim_host::verifier::Verifier;

const SERVICE: &str = "samplesecure";
/// System and administrators all access, authenticated users read/write.
const SDDL: &str = "D:P(A;;GA;;;SY)(A;;GA;;;BA)(A;;GRGW;;;AU)";
/// A SID string the model does not parse (not an alias).
const BROKEN_SDDL: &str = "D:P(A;;GA;;;S-1-5-18)";

struct OneDevice;

impl Binder for OneDevice {
    fn bind(&self, _path: &str, _hw: &[String], _compat: &[String]) -> Result<StackPlan, String> {
        Ok(StackPlan {
            function: SERVICE.into(),
            upper_filters: vec![],
            lower_filters: vec![],
        })
    }
}

struct Sample {
    sddl: &'static str,
    assigned: Mutex<Option<NtStatus>>,
    creates: Arc<Mutex<Vec<u32>>>,
}

struct SampleDevice(Arc<Mutex<Vec<u32>>>);

impl DeviceCallbacks for SampleDevice {
    fn file_create(&self, file: &FileObject) -> NtStatus {
        self.0.lock().unwrap().push(file.process().pid());
        SUCCESS
    }
}

impl DriverEntry for Sample {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        let status = host.assign_security(self.sddl).err().unwrap_or(SUCCESS);
        *self.assigned.lock().unwrap() = Some(status);
        Ok(Arc::new(SampleDevice(self.creates.clone())))
    }
}

struct NoPdo;
impl DeviceCallbacks for NoPdo {}

fn world(sddl: &'static str) -> (PnpManager, Verifier, DevNodeId, Arc<Sample>) {
    let verifier = Verifier::new();
    let pnp = PnpManager::new(verifier.clone(), Box::new(OneDevice));
    let sample = Arc::new(Sample {
        sddl,
        assigned: Mutex::default(),
        creates: Arc::default(),
    });
    pnp.register_driver(SERVICE, sample.clone());
    let node = pnp.add_device(
        None,
        "ROOT\\SECURE\\0000",
        vec!["TEST\\SECURE".into()],
        vec![],
        Arc::new(NoPdo),
    );
    (pnp, verifier, node, sample)
}

#[test]
fn a_caller_the_descriptor_does_not_grant_is_denied_before_any_driver_sees_the_open() {
    let (pnp, verifier, node, sample) = world(SDDL);
    assert_eq!(*sample.assigned.lock().unwrap(), Some(SUCCESS));
    assert_eq!(
        pnp.security(node).map(|sd| sd.sddl().to_owned()),
        Some(SDDL.into())
    );

    let anonymous = Process::with_token(1, Token::anonymous());
    assert_eq!(
        pnp.open_file(&anonymous, node).unwrap_err(),
        NtStatus::ACCESS_DENIED
    );
    assert!(
        sample.creates.lock().unwrap().is_empty(),
        "no driver saw it"
    );
    assert_eq!(pnp.process_handle_count(&anonymous), 0);

    for (pid, token) in [
        (2, Token::standard_user()),
        (3, Token::administrator()),
        (4, Token::system()),
    ] {
        let process = Process::with_token(pid, token);
        let handle = pnp.open_file(&process, node).expect("granted");
        handle.close();
    }
    assert_eq!(*sample.creates.lock().unwrap(), [2, 3, 4]);
    verifier.assert_clean();
}

#[test]
fn a_broken_driver_assigning_sddl_outside_the_subset_is_refused_and_changes_nothing() {
    let (pnp, verifier, node, sample) = world(BROKEN_SDDL);
    assert_eq!(*sample.assigned.lock().unwrap(), Some(INVALID_PARAMETER));
    assert!(pnp.security(node).is_none());
    let anonymous = Process::with_token(1, Token::anonymous());
    pnp.open_file(&anonymous, node)
        .expect("no descriptor")
        .close();
    verifier.assert_clean();
}
