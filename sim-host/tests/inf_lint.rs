//! `sim_host::inf_lint`: each rule catches a deliberately broken copy of
//! our own INFs (one defect each), our `inf/*.inf` pass clean, and no
//! input panics the linter.

use proptest::prelude::*;
use sim_hca::device::DeviceConfig;
use sim_host::host::{Host, HostConfig};
use sim_host::inf::workspace_inf_dir;
use sim_host::inf_lint::{DRIVER_READS, Finding, Rule, lint_dir, lint_inf};
use sim_host::samples::register_stand_ins;

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

const HCA: &str = include_str!("../../inf/hca-miniport.inf");
const CLIENT: &str = include_str!("../../inf/ib-port-client.inf");

/// `text` with `from` replaced by `to` (which must occur exactly once, so
/// a test cannot silently stop breaking what it means to break).
fn edit(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "{from:?} must occur once");
    text.replacen(from, to, 1)
}

/// The 1-based line of the only line (not a comment) containing `needle`.
fn line_of(text: &str, needle: &str) -> usize {
    let lines: Vec<usize> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with(';') && l.contains(needle))
        .map(|(i, _)| i + 1)
        .collect();
    assert_eq!(lines.len(), 1, "{needle:?} must be on one line");
    lines[0]
}

fn lint(name: &str, text: &str) -> Vec<Finding> {
    lint_inf(name, text.as_bytes())
}

/// Every finding is of `rule`, and there is at least one; returns them.
fn only(findings: Vec<Finding>, rule: Rule) -> Vec<Finding> {
    assert!(!findings.is_empty(), "expected a {} finding", rule.name());
    assert!(
        findings.iter().all(|f| f.rule == rule),
        "expected only {}: {findings:#?}",
        rule.name()
    );
    findings
}

fn has(findings: &[Finding], rule: Rule, line: usize) {
    assert!(
        findings
            .iter()
            .any(|f| f.rule == rule && f.line == Some(line)),
        "expected {} at line {line}: {findings:#?}",
        rule.name()
    );
}

#[test]
fn workspace_infs_pass_every_rule() {
    let findings = lint_dir(workspace_inf_dir()).unwrap();
    let printed: Vec<String> = findings.iter().map(ToString::to_string).collect();
    assert!(findings.is_empty(), "{printed:#?}");
    assert!(lint("hca-miniport.inf", HCA).is_empty());
    assert!(lint("ib-port-client.inf", CLIENT).is_empty());
}

#[test]
fn utf16_infs_are_linted_like_utf8() {
    // Windows tools often write INFs as UTF-16LE with a BOM.
    let mut bytes = vec![0xFF, 0xFE];
    bytes.extend(HCA.encode_utf16().flat_map(u16::to_le_bytes));
    assert!(lint_inf("hca-miniport.inf", &bytes).is_empty());
    let broken = edit(HCA, "PnpLockdown = 1", "PnpLockdown = 0");
    let mut bytes = vec![0xFF, 0xFE];
    bytes.extend(broken.encode_utf16().flat_map(u16::to_le_bytes));
    let findings = only(lint_inf("hca-miniport.inf", &bytes), Rule::PnpLockdown);
    has(
        &findings,
        Rule::PnpLockdown,
        line_of(&broken, "PnpLockdown = 0"),
    );
}

#[test]
fn findings_print_file_line_rule_and_message() {
    let text = edit(HCA, "PnpLockdown = 1", "PnpLockdown = 0");
    let findings = only(lint("hca-miniport.inf", &text), Rule::PnpLockdown);
    let line = line_of(&text, "PnpLockdown = 0");
    assert_eq!(
        findings[0]
            .to_string()
            .split(": ")
            .take(2)
            .collect::<Vec<_>>(),
        [
            format!("hca-miniport.inf:{line}"),
            "pnp-lockdown".to_owned()
        ]
    );
    for rule in Rule::ALL {
        assert!(!rule.reference().is_empty() && !rule.name().is_empty());
    }
}

#[test]
fn syntax_error_is_reported_with_its_line() {
    let text = edit(HCA, "[Strings]", "[Strings");
    let findings = only(lint("hca-miniport.inf", &text), Rule::Syntax);
    assert_eq!(findings[0].line, Some(line_of(&text, "[Strings")));
}

#[test]
fn version_needs_catalog_file_and_a_provider_not_microsoft() {
    let text = edit(HCA, "CatalogFile = hca-miniport.cat\n", "");
    only(lint("hca-miniport.inf", &text), Rule::Version);
    let text = edit(
        HCA,
        "ProviderName             = \"Rust InfiniBand Stack\"",
        "ProviderName             = \"Microsoft\"",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::Version);
    has(&findings, Rule::Version, line_of(&text, "Provider    ="));
}

#[test]
fn pnp_lockdown_must_be_1() {
    let text = edit(HCA, "PnpLockdown = 1\n", "");
    only(lint("hca-miniport.inf", &text), Rule::PnpLockdown);
    let text = edit(CLIENT, "PnpLockdown = 1", "PnpLockdown = 0");
    let findings = only(lint("ib-port-client.inf", &text), Rule::PnpLockdown);
    has(&findings, Rule::PnpLockdown, line_of(&text, "PnpLockdown"));
}

#[test]
fn driver_ver_is_mm_dd_yyyy_and_w_x_y_z() {
    for bad in [
        "11/22/2026",             // no version
        "11/22/26,0.1.0.0",       // two-digit year
        "1/22/2026,0.1.0.0",      // one-digit month
        "02/30/2026,0.1.0.0",     // no such day
        "13/01/2026,0.1.0.0",     // no such month
        "11/22/2026,0.1.0",       // three parts
        "11/22/2026,0.1.0.65535", // a part too large
        "11/22/2026,0.1.x.0",
    ] {
        let text = edit(HCA, "11/22/2026,0.1.0.0", bad);
        let findings = only(lint("hca-miniport.inf", &text), Rule::DriverVer);
        has(&findings, Rule::DriverVer, line_of(&text, "DriverVer"));
    }
    // Hyphens may separate the date; 29 February of a leap year exists.
    let text = edit(HCA, "11/22/2026,0.1.0.0", "02-29-2028,1.2.3.4");
    assert!(lint("hca-miniport.inf", &text).is_empty());
    let text = edit(HCA, "DriverVer   = 11/22/2026,0.1.0.0\n", "");
    only(lint("hca-miniport.inf", &text), Rule::DriverVer);
}

#[test]
fn universal_inf_forbids_class_installers_and_legacy_sections() {
    let text =
        format!("{HCA}\n[ClassInstall32]\nAddReg = Class_AddReg\n\n[Class_AddReg]\nHKR,,,,\"x\"\n");
    let findings = only(lint("hca-miniport.inf", &text), Rule::UniversalSection);
    has(
        &findings,
        Rule::UniversalSection,
        line_of(&text, "[ClassInstall32]"),
    );

    for section in [
        "Hca_Install.NT.CoInstallers",
        "Hca_Install.NT.FactDef",
        "Hca_Install.NT.LogConfigOverride",
        "DefaultInstall.NTamd64", // with [Manufacturer] (1212)
    ] {
        let text = format!("{HCA}\n[{section}]\n");
        let findings = only(lint("hca-miniport.inf", &text), Rule::UniversalSection);
        has(
            &findings,
            Rule::UniversalSection,
            line_of(&text, &format!("[{section}]")),
        );
    }

    // Without [Manufacturer], an undecorated [DefaultInstall] is refused
    // and a decorated one is not; a section merely named like it is not.
    let primitive =
        "[Version]\nSignature = \"$Windows NT$\"\n[DefaultInstall]\n[DefaultInstallHelpers]\n";
    let findings = lint("primitive.inf", primitive);
    let universal: Vec<_> = findings
        .iter()
        .filter(|f| f.rule == Rule::UniversalSection)
        .collect();
    assert_eq!(universal.len(), 1, "{findings:#?}");
    assert_eq!(universal[0].line, Some(3));
    let decorated = primitive.replace("[DefaultInstall]", "[DefaultInstall.NTamd64]");
    assert!(
        lint("primitive.inf", &decorated)
            .iter()
            .all(|f| f.rule != Rule::UniversalSection)
    );

    // A models decoration with a ProductType.
    let text = HCA.replace("NTamd64.10.0...18362", "NTamd64.10.0.1..18362");
    let findings = lint("hca-miniport.inf", &text);
    has(
        &findings,
        Rule::UniversalSection,
        line_of(&text, "%ManufacturerName% ="),
    );
}

#[test]
fn universal_inf_forbids_legacy_directives() {
    for directive in [
        "RegisterDlls",
        "BitReg",
        "DelReg",
        "UpdateInis",
        "DelService",
    ] {
        let text = edit(
            HCA,
            "CopyFiles = Hca_Install_CopyFiles\n",
            &format!("CopyFiles = Hca_Install_CopyFiles\n{directive} = Legacy_Section\n"),
        );
        let findings = only(lint("hca-miniport.inf", &text), Rule::LegacyDirective);
        has(&findings, Rule::LegacyDirective, line_of(&text, directive));
    }
}

#[test]
fn registry_writes_stay_under_hkr() {
    let text = edit(
        HCA,
        "[Hca_Install_HW_AddReg]\n",
        "[Hca_Install_HW_AddReg]\nHKLM,\"SOFTWARE\\Vendor\",Setting,0x00010001,1\n",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::Registry);
    has(&findings, Rule::Registry, line_of(&text, "HKLM"));

    let text = edit(
        HCA,
        "[Hca_Install_HW_AddReg]\n",
        "[Hca_Install_HW_AddReg]\nHKLM,\"SYSTEM\\CurrentControlSet\\Services\\hcaminiport\",X,0x00010001,1\n",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::Registry);
    assert!(findings[0].message.contains("1221"), "{findings:?}");

    // COM registration under HKCR is allowed.
    let text = edit(
        HCA,
        "[Hca_Install_HW_AddReg]\n",
        "[Hca_Install_HW_AddReg]\nHKCR,\"CLSID\\{af7b7b99-5a8f-401a-a032-ace7d11d30fb}\",,0x00000000,\"x\"\n",
    );
    assert!(lint("hca-miniport.inf", &text).is_empty());

    // Appending to a REG_MULTI_SZ.
    let text = edit(
        HCA,
        "HKR,Parameters,StaticChild,0x00010000,\"IPoIB\"",
        "HKR,Parameters,StaticChild,0x00010008,\"IPoIB\"",
    );
    let findings = lint("hca-miniport.inf", &text);
    has(&findings, Rule::Registry, line_of(&text, "0x00010008"));
}

#[test]
fn co_installers_are_refused() {
    let text = edit(
        HCA,
        "[Hca_Install_HW_AddReg]\n",
        "[Hca_Install_HW_AddReg]\nHKR,,CoInstallers32,0x00010000,\"coinst.dll,Entry\"\n",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::CoInstaller);
    has(
        &findings,
        Rule::CoInstaller,
        line_of(&text, "CoInstallers32"),
    );
}

#[test]
fn every_referenced_section_exists() {
    // An AddReg section that is not there.
    let text = edit(
        HCA,
        "AddReg = Hca_Install_HW_AddReg",
        "AddReg = Hca_Install_HW_AddReg, No_Such_AddReg",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::SectionMissing);
    has(
        &findings,
        Rule::SectionMissing,
        line_of(&text, "No_Such_AddReg"),
    );

    // A service install section, a filter section, a KMDF section.
    for (from, to) in [
        (
            "AddService = ibalbus,, IbalBus_ServiceInstall",
            "AddService = ibalbus,, IbalBus_Missing",
        ),
        (
            "AddFilter = ibalbus,, IbalBus_FilterInstall",
            "AddFilter = ibalbus,, IbalBus_NoFilter",
        ),
        (
            "KmdfService = ibalbus, Hca_WdfSection",
            "KmdfService = ibalbus, No_WdfSection",
        ),
    ] {
        let text = edit(HCA, from, to);
        let findings = lint("hca-miniport.inf", &text);
        has(&findings, Rule::SectionMissing, line_of(&text, to));
    }

    // A models section, and an install section a model line names.
    let text = edit(
        CLIENT,
        "[PortClientModels.NTarm64]",
        "[OtherModels.NTarm64]",
    );
    let findings = lint("ib-port-client.inf", &text);
    has(
        &findings,
        Rule::SectionMissing,
        line_of(&text, "%ManufacturerName% ="),
    );

    // The device install without its .Services section (1296).
    let text = edit(
        CLIENT,
        "[PortClient_Install.NT.Services]",
        "[PortClient_Install.NT.Other]",
    );
    let findings = lint("ib-port-client.inf", &text);
    has(
        &findings,
        Rule::SectionMissing,
        line_of(&text, "[PortClient_Install.NT]"),
    );
}

#[test]
fn sections_nothing_refers_to_are_reported() {
    let text = format!("{HCA}\n[Orphan_AddReg]\nHKR,,Setting,0x00010001,1\n");
    let findings = only(lint("hca-miniport.inf", &text), Rule::UnusedSection);
    has(
        &findings,
        Rule::UnusedSection,
        line_of(&text, "[Orphan_AddReg]"),
    );
    // A misspelt reference: the section is missing and the real one unused.
    let text = edit(
        HCA,
        "AddReg = Hca_Install_HW_AddReg",
        "AddReg = Hca_Install_HW_AddRg",
    );
    let findings = lint("hca-miniport.inf", &text);
    has(
        &findings,
        Rule::SectionMissing,
        line_of(&text, "Hca_Install_HW_AddRg"),
    );
    has(
        &findings,
        Rule::UnusedSection,
        line_of(&text, "[Hca_Install_HW_AddReg]"),
    );
    // An install section for an architecture no models section lists.
    let text = format!("{CLIENT}\n[PortClient_Install.NTx86]\nCopyFiles = @ibportclient.sys\n");
    let findings = only(lint("ib-port-client.inf", &text), Rule::UnusedSection);
    has(
        &findings,
        Rule::UnusedSection,
        line_of(&text, "[PortClient_Install.NTx86]"),
    );
}

#[test]
fn every_string_token_is_defined() {
    let text = edit(HCA, "1 = %DiskName%,,,\"\"", "1 = %NoSuchDisk%,,,\"\"");
    let findings = lint("hca-miniport.inf", &text);
    // The unused [Strings] entry is not a finding; the undefined token is.
    let findings = only(findings, Rule::StringUndefined);
    has(
        &findings,
        Rule::StringUndefined,
        line_of(&text, "%NoSuchDisk%"),
    );
    assert!(findings[0].message.contains("%NoSuchDisk%"));
}

#[test]
fn files_go_to_dirid_13_unrenamed() {
    for (from, to) in [
        ("Hca_Install_CopyFiles = 13", "Hca_Install_CopyFiles = 12"),
        (
            "Hca_Install_CopyFiles = 13",
            "Hca_Install_CopyFiles = 13,Drivers",
        ),
        (
            "Hca_Install_CopyFiles = 13",
            "Hca_Install_CopyFiles = 10,Vendor",
        ),
    ] {
        let text = edit(HCA, from, to);
        let findings = only(lint("hca-miniport.inf", &text), Rule::DestinationDir);
        has(&findings, Rule::DestinationDir, line_of(&text, to));
    }
    // CopyFiles=@file goes to DefaultDestDir.
    let text = edit(CLIENT, "DefaultDestDir = 13", "DefaultDestDir = 11");
    only(lint("ib-port-client.inf", &text), Rule::DestinationDir);
    // No destination at all.
    let text = edit(CLIENT, "DefaultDestDir = 13\n", "");
    only(lint("ib-port-client.inf", &text), Rule::DestinationDir);
    // A rename inside the driver store (1100).
    let text = edit(HCA, "\nibalbus.sys\n", "\nibalbus2.sys,ibalbus.sys\n");
    let findings = only(lint("hca-miniport.inf", &text), Rule::DestinationDir);
    has(
        &findings,
        Rule::DestinationDir,
        line_of(&text, "ibalbus2.sys"),
    );
}

#[test]
fn every_source_file_is_listed_and_installed() {
    // Copied but not listed (1230).
    let text = edit(HCA, "ibalbus.sys     = 1,,\n", "");
    let findings = only(lint("hca-miniport.inf", &text), Rule::SourceFiles);
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert!(findings[0].message.contains("ibalbus.sys"));
    // Listed but never copied.
    let text = edit(
        HCA,
        "ibalbus.sys     = 1,,\n",
        "ibalbus.sys     = 1,,\nstale.sys = 1,,\n",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::SourceFiles);
    has(&findings, Rule::SourceFiles, line_of(&text, "stale.sys"));
    // On a disk that is not defined.
    let text = edit(CLIENT, "ibportclient.sys = 1,,", "ibportclient.sys = 2,,");
    let findings = only(lint("ib-port-client.inf", &text), Rule::SourceFiles);
    has(
        &findings,
        Rule::SourceFiles,
        line_of(&text, "ibportclient.sys = 2"),
    );
}

#[test]
fn service_install_flags_and_binary() {
    for (from, to) in [
        (
            "StartType     = 3               ; SERVICE_DEMAND_START\nErrorControl  = 1               ; SERVICE_ERROR_NORMAL\nServiceBinary = %13%\\ibportclient.sys",
            "StartType     = 2\nErrorControl  = 1\nServiceBinary = %13%\\ibportclient.sys",
        ),
        (
            "ServiceType   = 1               ; SERVICE_KERNEL_DRIVER",
            "ServiceType   = 0x10",
        ),
        (
            "ErrorControl  = 1               ; SERVICE_ERROR_NORMAL",
            "ErrorControl  = 7",
        ),
        (
            "ServiceBinary = %13%\\ibportclient.sys",
            "ServiceBinary = %12%\\ibportclient.sys",
        ),
    ] {
        let text = edit(CLIENT, from, to);
        let findings = only(lint("ib-port-client.inf", &text), Rule::Service);
        let changed = to.lines().find(|l| !from.contains(l)).unwrap();
        has(&findings, Rule::Service, line_of(&text, changed));
    }
    // A missing ErrorControl.
    let text = edit(
        CLIENT,
        "ErrorControl  = 1               ; SERVICE_ERROR_NORMAL\n",
        "",
    );
    only(lint("ib-port-client.inf", &text), Rule::Service);
    // A binary no install section copies.
    let text = edit(
        HCA,
        "ServiceBinary = %13%\\ibalbus.sys",
        "ServiceBinary = %13%\\other.sys",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::Service);
    has(&findings, Rule::Service, line_of(&text, "other.sys"));
    // Two function drivers.
    let text = edit(
        HCA,
        "AddService = ibalbus,, IbalBus_ServiceInstall",
        "AddService = ibalbus, 0x00000002, IbalBus_ServiceInstall",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::Service);
    has(
        &findings,
        Rule::Service,
        line_of(&text, "[Hca_Install.NT.Services]"),
    );
}

#[test]
fn values_the_drivers_read_are_written_with_their_types() {
    // The bus filter reads each child's PartitionKey as a DWORD.
    let text = edit(
        HCA,
        "HKR,Parameters\\IPoIB,PartitionKey,0x00010001,0xFFFF\n",
        "",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::DriverRegistry);
    assert!(
        findings[0].message.contains("IPoIB\\PartitionKey"),
        "{findings:?}"
    );
    // ... and the child list as a REG_MULTI_SZ.
    let text = edit(
        HCA,
        "HKR,Parameters,StaticChild,0x00010000,\"IPoIB\"",
        "HKR,Parameters,StaticChild,0x00000000,\"IPoIB\"",
    );
    let findings = lint("hca-miniport.inf", &text);
    has(
        &findings,
        Rule::DriverRegistry,
        line_of(&text, "StaticChild,0x00000000"),
    );
    // A second child must have its own subkey.
    let text = edit(
        HCA,
        "HKR,Parameters,StaticChild,0x00010000,\"IPoIB\"",
        "HKR,Parameters,StaticChild,0x00010000,\"IPoIB\",\"SRP\"",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::DriverRegistry);
    assert_eq!(findings.len(), 5, "{findings:#?}");
    assert!(findings.iter().all(|f| f.message.contains("SRP\\")));
    // The port client reads ReceiveDepth from its hardware key.
    let text = edit(
        CLIENT,
        "HKR,,ReceiveDepth,0x00010003,256",
        "HKR,,ReceiveDepth,0x00000002,256",
    );
    let findings = only(lint("ib-port-client.inf", &text), Rule::DriverRegistry);
    has(
        &findings,
        Rule::DriverRegistry,
        line_of(&text, "ReceiveDepth,0x00000002"),
    );
    let text = edit(CLIENT, "HKR,,ReceiveDepth,0x00010003,256\n", "");
    only(lint("ib-port-client.inf", &text), Rule::DriverRegistry);
}

/// The lint's table of what drivers read is what they read: boot a machine
/// from our INFs with the stand-in drivers (bus filter with its child list,
/// port client on the child) and hold every registry read to the table.
#[test]
fn driver_reads_table_covers_every_read_the_drivers_make() {
    let cfg = DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1]]);
    let host = Host::new(HostConfig::deterministic(5, vec![cfg])).unwrap();
    let _log = register_stand_ins(&host);
    host.boot();
    let reads = host.registry().driver_reads();
    let services: Vec<&str> = reads.iter().map(|(s, _, _)| s.as_str()).collect();
    assert!(
        services.contains(&"ibalbus") && services.contains(&"ibportclient"),
        "{reads:?}"
    );
    for (service, key, name) in &reads {
        let covered = DRIVER_READS.iter().any(|r| {
            r.service.eq_ignore_ascii_case(service)
                && r.key == *key
                && match r.name.strip_prefix("*\\") {
                    // A per-child value: "<child>\value".
                    Some(value) => name
                        .rsplit_once('\\')
                        .is_some_and(|(_, n)| n.eq_ignore_ascii_case(value)),
                    None => r.name.eq_ignore_ascii_case(name),
                }
        });
        assert!(
            covered,
            "{service} reads {key:?} {name:?}, which inf_lint::DRIVER_READS does not list"
        );
    }
}

#[test]
fn pci_device_enables_msi_with_a_message_limit() {
    let text = edit(
        HCA,
        "HKR,\"Interrupt Management\\MessageSignaledInterruptProperties\",MSISupported,0x00010001,1\n",
        "",
    );
    only(lint("hca-miniport.inf", &text), Rule::Msi);
    let text = edit(
        HCA,
        "MSISupported,0x00010001,1",
        "MSISupported,0x00010001,0",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::Msi);
    has(&findings, Rule::Msi, line_of(&text, "MSISupported"));
    for limit in ["0", "4096"] {
        let text = edit(
            HCA,
            "MessageNumberLimit,0x00010001,32",
            &format!("MessageNumberLimit,0x00010001,{limit}"),
        );
        let findings = only(lint("hca-miniport.inf", &text), Rule::Msi);
        has(&findings, Rule::Msi, line_of(&text, "MessageNumberLimit"));
    }
    // The port client's devices are not PCI functions: no MSI rule.
    assert!(lint("ib-port-client.inf", CLIENT).is_empty());
}

#[test]
fn pci_device_opts_in_to_dma_remapping() {
    let text = edit(
        HCA,
        "HKR,\"DMA Management\",RemappingSupported,0x00010001,1\n",
        "",
    );
    only(lint("hca-miniport.inf", &text), Rule::DmaRemapping);
    let text = edit(
        HCA,
        "HKR,Parameters,DmaRemappingCompatible,0x00010001,1\n",
        "",
    );
    only(lint("hca-miniport.inf", &text), Rule::DmaRemapping);
    let text = edit(
        HCA,
        "DmaRemappingCompatible,0x00010001,1",
        "DmaRemappingCompatible,0x00010001,0",
    );
    let findings = only(lint("hca-miniport.inf", &text), Rule::DmaRemapping);
    has(
        &findings,
        Rule::DmaRemapping,
        line_of(&text, "DmaRemappingCompatible"),
    );
    // Models for 24H2 and later only need the per-device opt-in.
    let text = edit(
        HCA,
        "HKR,Parameters,DmaRemappingCompatible,0x00010001,1\n",
        "",
    )
    .replace("10.0...18362", "10.0...26100");
    assert!(lint("hca-miniport.inf", &text).is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = lint_inf("fuzz.inf", &bytes);
    }

    #[test]
    fn mutilated_infs_never_panic(
        cut in proptest::collection::vec(any::<bool>(), 200),
        noise in "[\\[\\]%,=@\\\\;\"a-z0-9 ]{0,40}",
        at in 0usize..200,
    ) {
        // Drop some lines of our INF and splice noise into one: broken
        // references, half sections, odd tokens.
        let mut lines: Vec<String> = HCA
            .lines()
            .enumerate()
            .filter(|(i, _)| !cut.get(*i).copied().unwrap_or(false))
            .map(|(_, l)| l.to_owned())
            .collect();
        if let Some(line) = lines.get_mut(at) {
            line.push_str(&noise);
        }
        let text = lines.join("\n");
        for f in lint_inf("mutilated.inf", text.as_bytes()) {
            prop_assert!(!f.message.is_empty());
        }
    }
}
