//! The simulated host as a [`driver_platform::Platform`]: the types a driver
//! core is instantiated with when it runs here.

use driver_platform::Platform;

use crate::caller::HostCaller;
use crate::dma::{HostDmaAdapter, HostLocker};
use crate::event::HostEvent;
use crate::irql::{HostSpinLock, IrqlTracker};
use crate::pci::Bar0;
use crate::registry::RegistryView;
use crate::request::HostRequest;
use crate::rw_spin_lock::HostRwSpinLock;
use crate::sched::DeviceDeferred;

/// The simulated Windows host's implementation of the platform traits.
#[derive(Debug, Clone, Copy, Default)]
pub struct SimPlatform;

impl Platform for SimPlatform {
    type RawSpinLock = HostSpinLock;
    type RawRwSpinLock = HostRwSpinLock;
    type Mmio = Bar0;
    type Dma = HostDmaAdapter;
    type Locker = HostLocker;
    type Deferred = DeviceDeferred;
    type Registry = RegistryView;
    type Request = HostRequest;
    type Irql = IrqlTracker;
    type Caller = HostCaller;
    type Event = HostEvent;
}
