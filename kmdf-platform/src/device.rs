//! Device initialisation steps every shell's add-device takes.

use wdk_sys::{
    PWDFDEVICE_INIT, ULONG, WDF_PNPPOWER_EVENT_CALLBACKS, call_unsafe_wdf_function_binding,
};

/// `WDF_PNPPOWER_EVENT_CALLBACKS_INIT`: the size set, no callback; the
/// caller sets its own.
pub fn pnp_power_callbacks() -> WDF_PNPPOWER_EVENT_CALLBACKS {
    WDF_PNPPOWER_EVENT_CALLBACKS {
        Size: size_of::<WDF_PNPPOWER_EVENT_CALLBACKS>() as ULONG,
        ..WDF_PNPPOWER_EVENT_CALLBACKS::default()
    }
}

/// `WdfDeviceInitSetPnpPowerEventCallbacks` of `callbacks` (the framework
/// copies them).
///
/// # Safety
/// `device_init` is the framework's live init structure, in
/// `EvtDriverDeviceAdd` before `WdfDeviceCreate`.
pub unsafe fn set_pnp_power_callbacks(
    device_init: PWDFDEVICE_INIT,
    mut callbacks: WDF_PNPPOWER_EVENT_CALLBACKS,
) {
    // SAFETY: the framework's live init structure, before WdfDeviceCreate
    // (caller); `callbacks` is valid for the call.
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfDeviceInitSetPnpPowerEventCallbacks,
            device_init,
            &mut callbacks
        )
    };
}
