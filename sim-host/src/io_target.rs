//! Remote I/O targets: a driver opens another device's stack
//! (`WdfIoTargetCreate` + `WdfIoTargetOpen`, by devnode or by an enabled
//! device interface), sends it requests (`WdfRequestSend`), and hears of
//! that device's removal through the target-device-change notifications
//! KMDF turns into `EvtIoTargetQueryRemove`, `EvtIoTargetRemoveCanceled`
//! and `EvtIoTargetRemoveComplete`
//! ([Controlling a General I/O Target's State](https://learn.microsoft.com/windows-hardware/drivers/wdf/controlling-a-general-i-o-target-s-state)).
//!
//! An open target is a handle on the target device (the file object KMDF
//! opens): while it is open the device cannot be query-removed, and after a
//! surprise removal its `IRP_MN_REMOVE_DEVICE` waits until the target is
//! closed. The PnP manager's side of this (who is notified when, what a
//! handle holds back) is here too, as `impl PnpManager`.
//!
//! Callbacks run in the opening driver's context at PASSIVE_LEVEL, with no
//! host lock held, so they may close, reopen or send.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use driver_platform::Irql;
use ib_types::interface::WinGuid;
use ib_types::status::NtStatus;

use crate::context::{self, Context};
use crate::driver::{InterfaceRef, NO_SUCH_DEVICE, SUCCESS};
use crate::irql::IrqlGuard;
use crate::pnp::{DevNodeId, DeviceServices, PnpInner, PnpManager, PnpState, Veto};
use crate::request::HostRequest;

/// `STATUS_INVALID_DEVICE_STATE`: a request sent to a target that is not
/// open (KMDF's answer for a closed or closed-for-query-remove target).
pub const INVALID_DEVICE_STATE: NtStatus = NtStatus::from_raw(0xC000_0184);
/// `STATUS_OBJECT_NAME_NOT_FOUND`: no enabled device interface by that name.
pub const OBJECT_NAME_NOT_FOUND: NtStatus = NtStatus::from_raw(0xC000_0034);

/// What a remote I/O target is opened on (`WDF_IO_TARGET_OPEN_PARAMS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoTargetName {
    /// A device by its devnode (`WdfIoTargetOpenUseExistingDevice` /
    /// opening the PDO's name).
    DevNode(DevNodeId),
    /// An enabled device interface of `class` on `device` (the symbolic
    /// link an interface-arrival notification names).
    Interface {
        /// Interface class.
        class: WinGuid,
        /// The devnode that registered it.
        device: DevNodeId,
    },
}

/// Where a remote I/O target stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoTargetState {
    /// Open: requests go through, and it holds a handle on the device.
    Opened,
    /// `WdfIoTargetCloseForQueryRemove`: closed while the device may be
    /// removed; reopened if the removal is cancelled.
    ClosedForQueryRemove,
    /// `WdfIoTargetClose`: closed for good.
    Closed,
}

/// The target-device-change callbacks of one remote I/O target. Each
/// default is what KMDF does for a driver that did not supply the callback.
pub trait IoTargetCallbacks: Send + Sync {
    /// `EvtIoTargetQueryRemove`: the target's device is about to be
    /// removed. Agreeing means closing the target for query-remove
    /// ([`RemoteIoTarget::close_for_query_remove`]) and returning
    /// `STATUS_SUCCESS`; a target left open still holds its handle, which
    /// fails the query-remove. Anything but success vetoes.
    fn query_remove(&self, target: &RemoteIoTarget) -> NtStatus {
        target.close_for_query_remove();
        SUCCESS
    }
    /// `EvtIoTargetRemoveCanceled`: the removal was vetoed; a target
    /// closed for query-remove is reopened ([`RemoteIoTarget::reopen`]).
    fn remove_canceled(&self, target: &RemoteIoTarget) {
        if target.state() == IoTargetState::ClosedForQueryRemove {
            // The device is still there: reopening cannot fail for want
            // of it, and a failure leaves the target closed, as KMDF does.
            let _ = target.reopen();
        }
    }
    /// `EvtIoTargetRemoveComplete`: the device was removed (after an
    /// agreed query-remove) or surprise-removed; the target must be closed
    /// ([`RemoteIoTarget::close`]). Until it is, a surprise-removed device
    /// is not removed.
    fn remove_complete(&self, target: &RemoteIoTarget) {
        target.close();
    }
}

/// The callbacks of a driver that supplies none.
#[derive(Debug, Default)]
pub struct DefaultTargetCallbacks;

impl IoTargetCallbacks for DefaultTargetCallbacks {}

pub(crate) struct TargetInner {
    pnp: Weak<PnpInner>,
    /// The device the target is open on.
    device: DevNodeId,
    /// The devnode of the driver that opened it (the WDF parent of the
    /// target object).
    owner: DevNodeId,
    owner_service: Arc<str>,
    callbacks: Arc<dyn IoTargetCallbacks>,
    state: Mutex<IoTargetState>,
}

/// A remote I/O target (`WDFIOTARGET`) one driver opened on another
/// device.
#[derive(Clone)]
pub struct RemoteIoTarget {
    inner: Arc<TargetInner>,
}

impl std::fmt::Debug for RemoteIoTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteIoTarget")
            .field("device", &self.inner.device)
            .field("owner", &self.inner.owner_service)
            .field("state", &self.state())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RemoteIoTarget {
    /// The device the target is open on.
    pub fn device(&self) -> DevNodeId {
        self.inner.device
    }

    /// Where the target stands.
    pub fn state(&self) -> IoTargetState {
        *lock(&self.inner.state)
    }

    fn pnp(&self) -> Option<PnpManager> {
        self.inner.pnp.upgrade().map(|inner| PnpManager { inner })
    }

    /// `WdfRequestSend`: delivers `req` to the top of the target device's
    /// stack; a target that is not open completes it with
    /// [`INVALID_DEVICE_STATE`].
    pub fn send(&self, req: HostRequest) {
        use driver_platform::Request;
        match (self.state(), self.pnp()) {
            (IoTargetState::Opened, Some(pnp)) => pnp.send_request(self.inner.device, req),
            _ => req.complete(INVALID_DEVICE_STATE, 0),
        }
    }

    /// `WdfIoTargetQueryForInterface` (PASSIVE_LEVEL): sends
    /// `IRP_MN_QUERY_INTERFACE` to the top of the target device's stack,
    /// how a driver outside that stack (a root-enumerated client) gets an
    /// interface from it. The consumer's reference is counted against the
    /// target's devnode, held by the opener's devnode; it must be given
    /// back before that device is removed (a target-device-change
    /// query-remove is the time). `None` when the target is not open or
    /// no layer answers.
    pub fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<InterfaceRef> {
        crate::irql::check_max("WdfIoTargetQueryForInterface", Irql::PASSIVE);
        if self.state() != IoTargetState::Opened {
            return None;
        }
        self.pnp()?.query_interface_as(
            self.inner.device,
            guid,
            version,
            Some((self.inner.owner_service.clone(), self.inner.owner)),
        )
    }

    /// `WdfIoTargetCloseForQueryRemove`: closes the handle while the
    /// device may be removed; no request goes through until
    /// [`RemoteIoTarget::reopen`].
    pub fn close_for_query_remove(&self) {
        let mut state = lock(&self.inner.state);
        if *state == IoTargetState::Opened {
            *state = IoTargetState::ClosedForQueryRemove;
        }
    }

    /// `WdfIoTargetOpen` with `WdfIoTargetOpenReopen`: opens the target
    /// again after a cancelled removal. Refused with `NO_SUCH_DEVICE` if
    /// the device is no longer started or the target was closed for good.
    pub fn reopen(&self) -> Result<(), NtStatus> {
        crate::irql::check_max("WdfIoTargetOpen", Irql::PASSIVE);
        let started = self
            .pnp()
            .and_then(|pnp| pnp.state(self.inner.device))
            .is_some_and(|s| s == PnpState::Started);
        let mut state = lock(&self.inner.state);
        match *state {
            IoTargetState::Opened => Ok(()),
            IoTargetState::ClosedForQueryRemove if started => {
                *state = IoTargetState::Opened;
                Ok(())
            }
            _ => Err(NO_SUCH_DEVICE),
        }
    }

    /// `WdfIoTargetClose`: closes the target for good. The handle it held
    /// on a surprise-removed device was what kept that device's
    /// `IRP_MN_REMOVE_DEVICE` back.
    pub fn close(&self) {
        let was = std::mem::replace(&mut *lock(&self.inner.state), IoTargetState::Closed);
        if was == IoTargetState::Opened
            && let Some(pnp) = self.pnp()
        {
            let device = self.inner.device;
            pnp.remove_when_no_handles_remain(device, pnp.io_target_handles(device));
        }
    }

    /// Runs one of the target's callbacks as KMDF does: in the opening
    /// driver's context, at PASSIVE_LEVEL on a system thread, never after
    /// that driver unloaded.
    fn call<R>(
        &self,
        callback: &'static str,
        otherwise: R,
        f: impl FnOnce(&dyn IoTargetCallbacks, &RemoteIoTarget) -> R,
    ) -> R {
        let Some(pnp) = self.inner.pnp.upgrade() else {
            return otherwise;
        };
        if !pnp
            .verifier
            .check_callback(&self.inner.owner_service, callback)
        {
            return otherwise;
        }
        let _driver = context::enter(Context::driver(
            pnp.verifier.clone(),
            self.inner.owner_service.clone(),
        ));
        let _system_thread = IrqlGuard::switched_for(Irql::PASSIVE, callback);
        f(self.inner.callbacks.as_ref(), self)
    }
}

impl DeviceServices {
    /// `IoGetDeviceInterfaces` (PASSIVE_LEVEL): the devnodes with an
    /// enabled device interface of `class` now, what a client registering
    /// for interface arrival with
    /// `PNPNOTIFY_DEVICE_INTERFACE_INCLUDE_EXISTING_INTERFACES` is told of
    /// first.
    pub fn device_interfaces(&self, class: WinGuid) -> Vec<DevNodeId> {
        crate::irql::check_max("IoGetDeviceInterfaces", Irql::PASSIVE);
        self.pnp
            .upgrade()
            .map(|inner| PnpManager { inner }.devices_with_interface(class))
            .unwrap_or_default()
    }

    /// `WdfIoTargetCreate` + `WdfIoTargetOpen`: opens a remote I/O target
    /// on another device, by devnode or by an enabled device interface,
    /// with `callbacks` for its removal (PASSIVE_LEVEL only). Refused with
    /// `NO_SUCH_DEVICE` if the device is not started, or
    /// [`OBJECT_NAME_NOT_FOUND`] if the interface is not enabled.
    pub fn open_io_target(
        &self,
        name: IoTargetName,
        callbacks: Arc<dyn IoTargetCallbacks>,
    ) -> Result<RemoteIoTarget, NtStatus> {
        crate::irql::check_max("WdfIoTargetOpen", Irql::PASSIVE);
        let pnp = PnpManager {
            inner: self.pnp.upgrade().ok_or(NO_SUCH_DEVICE)?,
        };
        let device = match name {
            IoTargetName::DevNode(device) => device,
            IoTargetName::Interface { class, device } => {
                if !pnp.interface_enabled(device, class) {
                    return Err(OBJECT_NAME_NOT_FOUND);
                }
                device
            }
        };
        if pnp.state(device) != Some(PnpState::Started) {
            return Err(NO_SUCH_DEVICE);
        }
        let target = RemoteIoTarget {
            inner: Arc::new(TargetInner {
                pnp: self.pnp.clone(),
                device,
                owner: self.node(),
                owner_service: Arc::from(self.service()),
                callbacks,
                state: Mutex::new(IoTargetState::Opened),
            }),
        };
        lock(&pnp.inner.io_targets).push(target.inner.clone());
        Ok(target)
    }
}

impl PnpManager {
    /// The targets open or closed-for-query-remove on `device`, or
    /// opened by a driver of `owner` (closed ones are forgotten).
    fn targets(&self, pick: impl Fn(&TargetInner) -> bool) -> Vec<RemoteIoTarget> {
        let mut all = lock(&self.inner.io_targets);
        all.retain(|t| *lock(&t.state) != IoTargetState::Closed);
        all.iter()
            .filter(|t| pick(t))
            .map(|t| RemoteIoTarget { inner: t.clone() })
            .collect()
    }

    /// Handles remote I/O targets hold on `device`: the open ones.
    pub(crate) fn io_target_handles(&self, device: DevNodeId) -> usize {
        self.targets(|t| t.device == device && *lock(&t.state) == IoTargetState::Opened)
            .len()
    }

    /// `GUID_TARGET_DEVICE_QUERY_REMOVE` for `device`: every open target on
    /// it hears `EvtIoTargetQueryRemove`, which may veto. The targets
    /// notified (all of them, on success; those before the veto and the
    /// vetoing one, on failure) go into `notified` so that a cancelled
    /// removal reaches each of them.
    pub(crate) fn notify_target_query_remove(
        &self,
        device: DevNodeId,
        notified: &mut Vec<RemoteIoTarget>,
    ) -> Result<(), Veto> {
        for target in self.targets(|t| t.device == device) {
            if target.state() != IoTargetState::Opened {
                continue;
            }
            notified.push(target.clone());
            let status = target.call("EvtIoTargetQueryRemove", SUCCESS, |callbacks, target| {
                callbacks.query_remove(target)
            });
            if status != SUCCESS {
                return Err(Veto {
                    what: "query-remove",
                    instance_path: self.instance_path(device).unwrap_or_default(),
                    service: format!("{} (EvtIoTargetQueryRemove)", target.inner.owner_service),
                    status,
                });
            }
        }
        Ok(())
    }

    /// `GUID_TARGET_DEVICE_REMOVE_CANCELLED`: `EvtIoTargetRemoveCanceled`
    /// for every target notified of the query-remove.
    pub(crate) fn notify_target_remove_canceled(&self, notified: Vec<RemoteIoTarget>) {
        for target in notified {
            if target.state() != IoTargetState::Closed {
                target.call("EvtIoTargetRemoveCanceled", (), |callbacks, target| {
                    callbacks.remove_canceled(target)
                });
            }
        }
    }

    /// `GUID_TARGET_DEVICE_REMOVE_COMPLETE`: `device` was removed or
    /// surprise-removed; every target still on it hears
    /// `EvtIoTargetRemoveComplete`.
    pub(crate) fn notify_target_remove_complete(&self, device: DevNodeId) {
        for target in self.targets(|t| t.device == device) {
            target.call("EvtIoTargetRemoveComplete", (), |callbacks, target| {
                callbacks.remove_complete(target)
            });
        }
    }

    /// The device objects of `owner` are deleted: the targets its drivers
    /// opened go with them (a WDF target is a child object of its device),
    /// closing their handles.
    pub(crate) fn close_targets_opened_by(&self, owner: DevNodeId) {
        for target in self.targets(|t| t.owner == owner) {
            target.close();
        }
    }
}
