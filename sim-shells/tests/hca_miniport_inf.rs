//! `inf/hca-miniport.inf` against what the miniport is and what the PRM
//! says: the simulated host binds the PRM's PCI hardware ID (built here
//! from `hca_prm::regs`, most specific first) to the service the shell
//! registers under, as a KMDF 1.33 function driver whose image lands in
//! the driver store, with the bus filter above it; and the `[Version]`
//! section carries what InfVerif requires (`PnpLockdown`, `CatalogFile`,
//! a non-Microsoft `Provider`).
#![cfg(not(windows))]

use hca_prm::regs::{
    PCI_DEVICE_ID, PCI_REVISION, PCI_SUBSYSTEM_ID, PCI_SUBSYSTEM_VENDOR_ID, PCI_VENDOR_ID,
};
use sim_host::inf::{InfSet, workspace_inf_dir};
use sim_shells::hca_miniport::SERVICE;

fn prm_hardware_ids() -> Vec<String> {
    let base = format!("PCI\\VEN_{PCI_VENDOR_ID:04X}&DEV_{PCI_DEVICE_ID:04X}");
    let subsys = format!("{base}&SUBSYS_{PCI_SUBSYSTEM_ID:04X}{PCI_SUBSYSTEM_VENDOR_ID:04X}");
    vec![format!("{subsys}&REV_{PCI_REVISION:02X}"), subsys, base]
}

#[test]
fn the_prm_hardware_id_binds_the_miniport_as_a_kmdf_function_driver() {
    let infs = InfSet::load_dir(workspace_inf_dir()).unwrap();
    let ids = prm_hardware_ids();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    for arch in ["NTamd64", "NTarm64"] {
        let binding = infs.bind(&refs, &[], arch).unwrap();
        assert_eq!(binding.inf_name, "hca-miniport.inf");
        assert_eq!(binding.matched_id, ids[0], "the most specific ID matches");
        assert_eq!(binding.function_service, SERVICE);
        assert_eq!(binding.upper_filters, vec!["ibalbus".to_owned()]);
        assert_eq!(binding.kmdf_version, Some((1, 33)));
        let image = format!("{SERVICE}.sys");
        assert!(
            binding.files.iter().any(|f| f.eq_ignore_ascii_case(&image)),
            "{:?}",
            binding.files
        );
        // Only the generic ID: still ours.
        let generic = infs.bind(&[ids[2].as_str()], &[], arch).unwrap();
        assert_eq!(generic.function_service, SERVICE);
    }
    let inf = infs.get("hca-miniport.inf").unwrap();
    assert_eq!(inf.version_value("PnpLockdown"), Some("1"));
    assert_eq!(inf.version_value("CatalogFile"), Some("hca-miniport.cat"));
    let provider = inf.version_value("Provider").unwrap();
    assert!(!provider.to_ascii_lowercase().contains("microsoft"));
    // The service binary is in the driver store (DIRID 13).
    let service = inf.section("HcaMiniport_ServiceInstall").unwrap();
    let binary = service
        .iter()
        .find(|l| l.key.as_deref() == Some("ServiceBinary"))
        .unwrap();
    assert_eq!(binary.fields, vec![format!("%13%\\{SERVICE}.sys")]);
    assert!(inf.warnings().is_empty(), "{:?}", inf.warnings());
}
