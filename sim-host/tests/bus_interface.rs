//! `GUID_BUS_INTERFACE_STANDARD` on a PCI function's PDO
//! (docs/host-model.md "The bus interface and IoGetDmaAdapter"): the PDO
//! answers it at version 1 (not below), and its `GetDmaAdapter` is the
//! function's own adapter, the one its function driver took.

use driver_platform::{CommonBuffer, DmaAdapter};
use sim_hca::device::DeviceConfig;
use sim_hca::host::HostMemory;
use sim_host::host::{Host, HostConfig};
use sim_host::pci::{
    BUS_INTERFACE_STANDARD_VERSION, BusInterfaceStandard, GUID_BUS_INTERFACE_STANDARD,
};

#[test]
fn the_bus_interface_gives_the_functions_own_dma_adapter() {
    let cfg = DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1]]);
    let host = Host::new(HostConfig::deterministic(5, vec![cfg])).unwrap();
    let _log = sim_host::samples::register_stand_ins(&host);
    host.boot();
    host.scheduler().run_until_idle(100_000).unwrap();
    let hca = host.hcas()[0];

    assert!(
        host.pnp()
            .query_interface(hca, &GUID_BUS_INTERFACE_STANDARD, 0)
            .is_none(),
        "no version below 1"
    );
    let bus = host
        .pnp()
        .query_interface(hca, &GUID_BUS_INTERFACE_STANDARD, 3)
        .expect("the PCI PDO answers");
    assert_eq!(bus.version(), BUS_INTERFACE_STANDARD_VERSION);
    assert_eq!(bus.provider(), Some("pci"), "the PCI bus driver answers");
    let adapter = bus
        .call(|b: &BusInterfaceStandard| b.get_dma_adapter())
        .unwrap()
        .unwrap();
    let again = bus
        .call(|b: &BusInterfaceStandard| b.get_dma_adapter())
        .unwrap()
        .unwrap();
    bus.dereference();
    // The adapter the stand-in miniport took at start.
    assert_eq!(adapter.driver(), "hcaminiport");
    assert_eq!(adapter.index(), again.index());
    // What is mapped through it, the device reaches.
    let buffer = adapter.alloc_common(4096).unwrap();
    assert!(buffer.write(0, b"through the function's adapter"));
    let mut seen = [0u8; 30];
    again
        .device_view()
        .read(buffer.bus_address(), &mut seen)
        .unwrap();
    assert_eq!(&seen, b"through the function's adapter");
    adapter.free_common(buffer);
    assert_eq!(host.pnp().interface_references(hca), 0);
    host.shut_down();
    host.verifier().assert_clean();
}
