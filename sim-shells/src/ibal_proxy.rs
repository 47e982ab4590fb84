//! The user-mode proxy of the IBAL bus filter on the simulated host: the
//! part of the filter's device ([`crate::ibal_bus::IbalBusDevice`]) that
//! user mode reaches through the HCA's device interface
//! (docs/ibal-bus.md, "The user-mode proxy"). The policy is
//! `ibal_bus_core::proxy`; this module only binds it to the host's
//! callbacks, which the filter's `DeviceCallbacks` delegate here.
//!
//! What each callback does (KMDF name in brackets):
//! - add-device: `GUID_IB_AL_DEVICE_INTERFACE` registered on the HCA's
//!   stack (`WdfDeviceCreateDeviceInterface`), disabled. The stack's
//!   security descriptor is not the filter's to set: `inf/hca-miniport.inf`
//!   gives it as the `.HW` section's `Security` value (equal to
//!   `ibal_bus_core::proxy::PROXY_SDDL`), which the host applies before any
//!   driver's add-device, as Windows does (a PnP filter has no name
//!   `WdfDeviceInitAssignSDDLString` could secure).
//! - self-managed I/O init: the interface enabled
//!   (`WdfDeviceSetDeviceInterfaceState`); release-hardware (stop or
//!   removal): disabled. One interface per HCA; user mode enumerates them
//!   and opens the HCA it means.
//! - `file_create` (`EvtDeviceFileCreate`): a new [`OpenTable`] as the
//!   file object's context; the create goes on down to the miniport.
//! - `io_in_caller_context` (`EvtIoInCallerContext`, in the caller's
//!   thread): a kernel-mode request passes unchanged; a user-mode one is
//!   judged by its open's table (`OpenTable::check`) and completed at
//!   once when refused; the administrator IOCTL is served here (the
//!   registry list changed, then every filter device reconciles its
//!   children); a verb gets a completion routine that gives the answer to
//!   the table (`OpenTable::complete`) and is queued. The filter's queue
//!   is not power-managed, so its `io_request` passes it down at once,
//!   still in the caller's thread: the miniport's own
//!   `EvtIoInCallerContext` prepares it in the process (locks, doorbell
//!   mapping) and its power-managed queue holds it while the HCA sleeps.
//! - `file_cleanup` (`EvtFileCleanup`): the open's table is emptied. The
//!   objects themselves are destroyed by the miniport below, which gets
//!   the same cleanup next and, at the process's last file object on the
//!   HCA, closes each of the process's CA contexts in dependency order in
//!   its context (`Hca::close_user_contexts_of`): the proxy cannot send a
//!   `CloseCa` of its own, since a request a driver builds is a kernel
//!   request and the miniport rightly refuses kernel requests that name
//!   user contexts.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use driver_platform::{RegValue, Registry, RegistryKey, Request, RequestorMode};
use ib_types::interface::GUID_IB_AL_DEVICE_INTERFACE;
use ib_types::status::NtStatus;
use ibal_bus_core::children::{ChildEntry, LIST_VALUE};
use ibal_bus_core::proxy::{Checked, ChildEntryChange, OpenTable};
use sim_host::driver::SUCCESS;
use sim_host::file::FileObject;
use sim_host::pnp::DeviceServices;
use sim_host::request::HostRequest;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The proxy's context on one file object (the `WDFFILEOBJECT` context).
#[derive(Debug, Default)]
pub struct ProxyOpen {
    table: Mutex<OpenTable>,
}

impl ProxyOpen {
    /// Objects the open created and did not destroy.
    pub fn object_count(&self) -> usize {
        lock(&self.table).len()
    }
}

/// Runs the filter's reconciliation of the child list on every filter
/// device (what a registry change notification on the Parameters key
/// does).
pub type Reconcile = Arc<dyn Fn() + Send + Sync>;

/// The proxy part of one filter device.
pub struct IbalProxy {
    host: DeviceServices,
    reconcile: Reconcile,
    /// The opens not cleaned up yet, by file object id (for inspection).
    opens: Mutex<BTreeMap<u64, Arc<ProxyOpen>>>,
}

impl std::fmt::Debug for IbalProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbalProxy")
            .field("host", &self.host)
            .finish_non_exhaustive()
    }
}

impl IbalProxy {
    /// The proxy of a new filter device (add-device): the device
    /// interface registered (disabled).
    pub fn new(host: DeviceServices, reconcile: Reconcile) -> Self {
        host.register_interface(GUID_IB_AL_DEVICE_INTERFACE);
        Self {
            host,
            reconcile,
            opens: Mutex::default(),
        }
    }

    /// The stack started: user mode may find and open it.
    pub fn started(&self) {
        self.host
            .set_interface_enabled(GUID_IB_AL_DEVICE_INTERFACE, true);
    }

    /// The stack stops or leaves: the interface goes.
    pub fn stopped(&self) {
        self.host
            .set_interface_enabled(GUID_IB_AL_DEVICE_INTERFACE, false);
    }

    /// Opens not cleaned up yet.
    pub fn open_count(&self) -> usize {
        lock(&self.opens).len()
    }

    /// Objects recorded across every open not cleaned up.
    pub fn object_count(&self) -> usize {
        lock(&self.opens)
            .values()
            .map(|open| open.object_count())
            .sum()
    }

    /// `EvtDeviceFileCreate`.
    pub fn file_create(&self, file: &FileObject) -> NtStatus {
        let open = Arc::new(ProxyOpen::default());
        file.set_context(open.clone());
        lock(&self.opens).insert(file.id(), open);
        SUCCESS
    }

    /// `EvtFileCleanup`: the open's table is emptied (see the module doc
    /// for who destroys the objects).
    pub fn file_cleanup(&self, file: &FileObject) {
        if let Some(open) = lock(&self.opens).remove(&file.id()) {
            lock(&open.table).clear();
        }
    }

    /// `EvtIoInCallerContext` (see the module doc).
    pub fn in_caller_context(&self, mut req: HostRequest) -> Option<HostRequest> {
        if req.requestor_mode() == RequestorMode::Kernel {
            return Some(req);
        }
        let Some(open) = req
            .file()
            .and_then(|file| file.context::<Arc<ProxyOpen>>())
            .map(|open| (*open).clone())
        else {
            // A user request not sent on one of our opens.
            req.complete(NtStatus::INVALID_DEVICE_REQUEST, 0);
            return None;
        };
        let is_admin = req.process().is_some_and(|p| p.token().is_admin());
        let output_len = req.output().len();
        let checked = lock(&open.table).check(req.ioctl_code(), req.input(), output_len, is_admin);
        match checked {
            Err(refusal) => {
                req.complete(refusal.nt_status(), 0);
                None
            }
            Ok(Checked::ChildEntry(change)) => {
                let status = self.apply_child_entry(&change);
                req.complete(status, 0);
                None
            }
            Ok(Checked::Verb(forwarded)) => {
                req.set_completion_routine(Box::new(move |status, _information, output| {
                    *status = lock(&open.table).complete(&forwarded, *status, output);
                }));
                Some(req)
            }
        }
    }

    /// The administrator IOCTL: writes the change into the filter's
    /// Parameters key, then reconciles every device's children.
    /// PASSIVE_LEVEL (registry writes).
    fn apply_child_entry(&self, change: &ChildEntryChange) -> NtStatus {
        let Some(registry) = self.host.registry() else {
            return NtStatus::INVALID_DEVICE_STATE;
        };
        let key = RegistryKey::ServiceParameters;
        // No list means the default one: it becomes explicit first.
        let mut names = match registry.read(key, LIST_VALUE) {
            Some(RegValue::MultiString(names)) => names,
            None => {
                let ipoib = ChildEntry::ipoib();
                if write_entry(&registry, &ipoib).is_err() {
                    return NtStatus::INSUFFICIENT_RESOURCES;
                }
                vec![ipoib.name]
            }
            // A list of the wrong type is the administrator's to repair.
            Some(_) => return NtStatus::INVALID_DEVICE_STATE,
        };
        let position =
            |names: &[String], name: &str| names.iter().position(|n| n.eq_ignore_ascii_case(name));
        let written = match change {
            ChildEntryChange::Add(entry) => {
                if position(&names, &entry.name).is_none() {
                    names.push(entry.name.clone());
                }
                write_entry(&registry, entry)
            }
            ChildEntryChange::Remove(name) => {
                let Some(at) = position(&names, name) else {
                    return NtStatus::NOT_FOUND;
                };
                let removed = names.remove(at);
                registry.delete_subkey(key, &removed)
            }
        };
        if written.is_err()
            || registry
                .write(key, LIST_VALUE, RegValue::MultiString(names))
                .is_err()
        {
            return NtStatus::INSUFFICIENT_RESOURCES;
        }
        (self.reconcile)();
        SUCCESS
    }
}

/// Writes one entry's subkey under the Parameters key.
fn write_entry(
    registry: &sim_host::registry::RegistryView,
    entry: &ChildEntry,
) -> Result<(), sim_host::registry::RegistryError> {
    let key = RegistryKey::ServiceParameters;
    let name = &entry.name;
    registry.write(
        key,
        &format!("{name}\\DeviceId"),
        RegValue::String(entry.device_id.clone()),
    )?;
    registry.write(
        key,
        &format!("{name}\\HardwareId"),
        RegValue::MultiString(entry.hardware_ids.clone()),
    )?;
    registry.write(
        key,
        &format!("{name}\\CompatibleId"),
        RegValue::MultiString(entry.compatible_ids.clone()),
    )?;
    registry.write(
        key,
        &format!("{name}\\Description"),
        RegValue::String(entry.description.clone()),
    )?;
    registry.write(
        key,
        &format!("{name}\\PartitionKey"),
        RegValue::Dword(entry.pkey.get().into()),
    )
}
