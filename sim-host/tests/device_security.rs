//! Device security descriptors (`sim_host::security`): the INF's `.HW`
//! `Security` value is the devnode's descriptor, set on the stack before
//! any driver's add-device (no driver assigns it, as on Windows for a PnP
//! stack). `CreateFile` by a caller whose token the descriptor does not
//! grant read and write fails with `STATUS_ACCESS_DENIED` before any
//! driver of the stack sees the create, while granted callers open. A
//! deliberately broken INF gives SDDL outside the modelled subset: its
//! binding fails, so the device never starts and no driver is added (no
//! stack left open to everyone by a half-parsed descriptor).

use std::sync::{Arc, Mutex};

use ib_types::status::NtStatus;
use sim_host::binder::InfBinder;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, SUCCESS};
use sim_host::file::FileObject;
use sim_host::inf::InfSet;
use sim_host::memory::Process;
use sim_host::pnp::{DevNodeId, DeviceServices, PnpManager, PnpState};
use sim_host::registry::RegistryStore;
use sim_host::security::Token;
use sim_host::verifier::Verifier;

const SERVICE: &str = "samplesecure";
/// System and administrators all access, authenticated users read/write.
const SDDL: &str = "D:P(A;;GA;;;SY)(A;;GA;;;BA)(A;;GRGW;;;AU)";
/// A SID string the model does not parse (not an alias).
const BROKEN_SDDL: &str = "D:P(A;;GA;;;S-1-5-18)";

/// The sample's driver package, its `.HW` section giving `sddl`.
fn inf(sddl: &str) -> String {
    format!(
        r#"[Version]
Signature = "$Windows NT$"
Class = System
ClassGuid = {{4d36e97d-e325-11ce-bfc1-08002be10318}}
Provider = Test
DriverVer = 01/01/2026,1.0.0.0
CatalogFile = secure.cat
PnpLockdown = 1
[Manufacturer]
Test = Models, NTamd64
[Models.NTamd64]
Secure = Inst, TEST\SECURE
[SourceDisksNames]
1 = disk
[SourceDisksFiles]
{SERVICE}.sys = 1
[DestinationDirs]
DefaultDestDir = 13
[Inst.NT]
CopyFiles = @{SERVICE}.sys
[Inst.NT.HW]
AddReg = Security_AddReg
[Security_AddReg]
HKR,,Security,,"{sddl}"
[Inst.NT.Services]
AddService = {SERVICE}, 0x2, Svc_Inst
[Svc_Inst]
ServiceType = 1
StartType = 3
ErrorControl = 1
ServiceBinary = %13%\{SERVICE}.sys
"#
    )
}

#[derive(Default)]
struct Sample {
    added: Mutex<usize>,
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
        _host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        *self.added.lock().unwrap() += 1;
        Ok(Arc::new(SampleDevice(self.creates.clone())))
    }
}

struct NoPdo;
impl DeviceCallbacks for NoPdo {}

fn world(sddl: &str) -> (PnpManager, Verifier, DevNodeId, Arc<Sample>) {
    let verifier = Verifier::new();
    let text = inf(sddl);
    let infs = InfSet::from_sources(&[("secure.inf", &text)]);
    assert!(infs.rejected().is_empty(), "{:?}", infs.rejected());
    let binder = InfBinder::new(infs, RegistryStore::new());
    let pnp = PnpManager::new(verifier.clone(), Box::new(binder));
    let sample = Arc::new(Sample::default());
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
    assert_eq!(pnp.state(node), Some(PnpState::Started));
    assert_eq!(*sample.added.lock().unwrap(), 1);
    assert_eq!(
        pnp.security(node).map(|sd| sd.sddl().to_owned()),
        Some(SDDL.into()),
        "the INF's descriptor is the stack's"
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
fn a_broken_inf_with_sddl_outside_the_subset_fails_the_binding_and_starts_nothing() {
    let (pnp, verifier, node, sample) = world(BROKEN_SDDL);
    match pnp.state(node) {
        Some(PnpState::FailedStart(reason)) => {
            assert!(reason.contains("Security"), "{reason}");
        }
        other => panic!("expected a failed start, got {other:?}"),
    }
    assert_eq!(*sample.added.lock().unwrap(), 0, "no driver was added");
    assert!(pnp.security(node).is_none());
    verifier.assert_clean();
}
