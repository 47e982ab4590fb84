//! KMDF shell of the HCA miniport: the PCI function driver for the project's
//! HCA. It translates WDF callbacks (DriverEntry, EvtDeviceAdd,
//! EvtDevicePrepareHardware, D0 entry/exit, interrupt and DPC, query
//! interface) into calls on `hca-miniport-core`, and implements that core's
//! platform traits with WDF objects.
//!
//! Status: not written yet (issue 5), and never compiled here: `wdk-sys`
//! cannot build on a non-Windows host. On Linux this crate is empty.

#![cfg_attr(windows, no_std)]
