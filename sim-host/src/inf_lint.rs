//! `cargo xtask inf-lint`: our INFs against the InfVerif rules that can be
//! checked without Windows, on the project's own parser ([`crate::inf`]).
//!
//! InfVerif (`infverif /w`, `/u`, `/k`) only runs on Windows. This linter
//! checks the subset of its rules that depend on the INF text alone, plus
//! the registry contract between our INFs and our drivers, so a package
//! that Windows (or the Hardware Dev Center) would refuse fails here first.
//! Every [`Rule`] names the Microsoft page it follows ([`Rule::reference`]);
//! `docs/inf-lint.md` lists them with what is not checked.
//!
//! Findings carry the file and line; [`lint_inf`] never panics, whatever
//! the bytes (a property test feeds it arbitrary input).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::path::Path;

use driver_platform::RegistryKey;

use crate::inf::{
    Inf, InfError, InfLine, LoadError, SPSVCINST_ASSOCSERVICE, is_guid, parse_u32, read_inf_dir,
};

/// One InfVerif rule (or project registry contract) the linter checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Rule {
    /// The file breaks the INF syntax rules (SetupAPI would not open it).
    Syntax,
    /// `[Version]`: `Class`, `ClassGuid`, `Provider` (not Microsoft,
    /// InfVerif 1204), `CatalogFile` (1233).
    Version,
    /// `[Version]` `PnpLockdown = 1`.
    PnpLockdown,
    /// `[Version]` `DriverVer = mm/dd/yyyy,w.x.y.z`.
    DriverVer,
    /// Sections a universal INF may not have (`ClassInstall32`,
    /// `.CoInstallers`, `.FactDef`, `.LogConfigOverride`, undecorated
    /// `DefaultInstall`, `DefaultInstall` with `Manufacturer`, models
    /// decorations with a ProductType or SuiteMask); InfVerif 1300, 1212.
    UniversalSection,
    /// Directives a universal INF may not use (`BitReg`, `DelReg`,
    /// `RegisterDlls`, `UpdateInis`, ...); InfVerif 1300-1302.
    LegacyDirective,
    /// Registry writes outside `HKR` (and the COM/MFT roots the universal
    /// rules allow), or appending to a `REG_MULTI_SZ`; InfVerif 1304,
    /// 1305, 1221.
    Registry,
    /// A co-installer registered through `AddReg` (`CoInstallers32`);
    /// InfVerif 1303.
    CoInstaller,
    /// A referenced section that does not exist (InfVerif 1203), or a
    /// device install without its `.Services` section (1296).
    SectionMissing,
    /// A `%token%` that `[Strings]` does not define; InfVerif 1235.
    StringUndefined,
    /// A file copied anywhere but DIRID 13 (the driver store), or renamed
    /// or moved to a subdirectory there; InfVerif 1100, driver package
    /// isolation.
    DestinationDir,
    /// Every copied file listed in `[SourceDisksFiles]` (InfVerif 1230)
    /// on a disk of `[SourceDisksNames]`; every listed file copied.
    SourceFiles,
    /// Service install sections: `ServiceType`, `StartType`,
    /// `ErrorControl`, `ServiceBinary = %13%\file` with the file copied,
    /// one function driver (`0x2`) per `.Services`.
    Service,
    /// The registry values our drivers read are written by the INF with
    /// the type they read ([`DRIVER_READS`]).
    DriverRegistry,
    /// A section nothing refers to (InfVerif warning 2083): usually a
    /// directive naming it wrongly, so what it holds is never installed.
    UnusedSection,
    /// A PCI device's hardware key enables MSI (`MSISupported = 1`) and
    /// bounds the messages (`MessageNumberLimit`).
    Msi,
    /// A PCI device's DMA-remapping opt-in: `DMA Management\
    /// RemappingSupported = 1` (per device) and, for builds before
    /// Windows 11 24H2, `Parameters\DmaRemappingCompatible = 1` in the
    /// function driver's service key (per driver).
    DmaRemapping,
}

impl Rule {
    /// Every rule, in report order.
    pub const ALL: [Rule; 17] = [
        Rule::Syntax,
        Rule::Version,
        Rule::PnpLockdown,
        Rule::DriverVer,
        Rule::UniversalSection,
        Rule::LegacyDirective,
        Rule::Registry,
        Rule::CoInstaller,
        Rule::SectionMissing,
        Rule::StringUndefined,
        Rule::DestinationDir,
        Rule::SourceFiles,
        Rule::Service,
        Rule::DriverRegistry,
        Rule::UnusedSection,
        Rule::Msi,
        Rule::DmaRemapping,
    ];

    /// The rule's short name, as printed.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Syntax => "syntax",
            Rule::Version => "version",
            Rule::PnpLockdown => "pnp-lockdown",
            Rule::DriverVer => "driver-ver",
            Rule::UniversalSection => "universal-section",
            Rule::LegacyDirective => "legacy-directive",
            Rule::Registry => "registry",
            Rule::CoInstaller => "co-installer",
            Rule::SectionMissing => "section-missing",
            Rule::StringUndefined => "string-undefined",
            Rule::DestinationDir => "destination-dir",
            Rule::SourceFiles => "source-files",
            Rule::Service => "service",
            Rule::DriverRegistry => "driver-registry",
            Rule::UnusedSection => "unused-section",
            Rule::Msi => "msi",
            Rule::DmaRemapping => "dma-remapping",
        }
    }

    /// The Microsoft documentation the rule follows (pages under
    /// `https://learn.microsoft.com/windows-hardware/drivers/`, with the
    /// InfVerif error codes where the rule is one).
    pub fn reference(self) -> &'static str {
        match self {
            Rule::Syntax => "install/general-syntax-rules-for-inf-files",
            Rule::Version => {
                "install/inf-version-section; devtest/inf-validation-errors-and-warnings (1204, 1233)"
            }
            Rule::PnpLockdown | Rule::DriverVer => {
                "install/inf-version-section, install/inf-driverver-directive"
            }
            Rule::UniversalSection => {
                "install/using-a-universal-inf-file; devtest/inf-validation-errors-and-warnings (1212, 1300)"
            }
            Rule::LegacyDirective => {
                "install/using-a-universal-inf-file; devtest/inf-validation-errors-and-warnings (1300-1302)"
            }
            Rule::Registry => {
                "install/using-a-universal-inf-file (AddReg); devtest/inf-validation-errors-and-warnings (1221, 1304, 1305)"
            }
            Rule::CoInstaller => "devtest/inf-validation-errors-and-warnings (1303)",
            Rule::SectionMissing => "devtest/inf-validation-errors-and-warnings (1203, 1296)",
            Rule::StringUndefined => "devtest/inf-validation-errors-and-warnings (1235)",
            Rule::DestinationDir => {
                "develop/driver-isolation, install/using-a-universal-inf-file (CopyFiles); devtest/inf-validation-errors-and-warnings (1100)"
            }
            Rule::SourceFiles => {
                "install/inf-sourcedisksfiles-section; devtest/inf-validation-errors-and-warnings (1230)"
            }
            Rule::Service => "install/inf-addservice-directive, develop/driver-isolation",
            Rule::DriverRegistry => {
                "install/inf-addreg-directive; our drivers' reads (docs/inf-lint.md)"
            }
            Rule::UnusedSection => "devtest/inf-validation-errors-and-warnings (2083)",
            Rule::Msi => "kernel/enabling-message-signaled-interrupts-in-the-registry",
            Rule::DmaRemapping => "pci/enabling-dma-remapping-for-device-drivers",
        }
    }
}

/// One defect: where, which rule, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The INF's file name.
    pub file: String,
    /// 1-based line, when the defect is on one.
    pub line: Option<usize>,
    /// The rule broken.
    pub rule: Rule,
    /// What is wrong, in words.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: ", self.file)?,
            None => write!(f, "{}: ", self.file)?,
        }
        write!(f, "{}: {}", self.rule.name(), self.message)
    }
}

// ---------------------------------------------------------------------------
// The registry contract with our drivers

/// A registry value type, as an `AddReg` flags field gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// `REG_SZ` (flags `0x00000000`).
    String,
    /// `REG_MULTI_SZ` (flags `0x00010000`).
    MultiString,
    /// `REG_DWORD` (flags `0x00010001`).
    Dword,
}

impl ValueKind {
    fn name(self) -> &'static str {
        match self {
            ValueKind::String => "REG_SZ",
            ValueKind::MultiString => "REG_MULTI_SZ",
            ValueKind::Dword => "REG_DWORD",
        }
    }
}

/// One registry value a driver reads at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverRead {
    /// The driver's service name (as our INFs install it).
    pub service: &'static str,
    /// The key read: the device's hardware key (`.HW` `AddReg`, `HKR` =
    /// `Device Parameters`) or `Services\<service>\Parameters` (the
    /// service install section's `AddReg`, `HKR,Parameters`).
    pub key: RegistryKey,
    /// The value name; `*\` before it means "under each name of the
    /// service's `StaticChild` list" (a per-child subkey).
    pub name: &'static str,
    /// The type the driver reads it as.
    pub kind: ValueKind,
}

/// What our drivers read from the registry, so the INF that installs them
/// must write it: the bus filter's child list (`ibalbus`, the per-port
/// child enumeration; `sim_host::samples` is its stand-in) and the port
/// client's device setting. The miniport itself reads no values; what
/// Windows reads for it (MSI, DMA remapping) is [`Rule::Msi`] and
/// [`Rule::DmaRemapping`].
pub const DRIVER_READS: &[DriverRead] = &[
    DriverRead {
        service: "ibalbus",
        key: RegistryKey::ServiceParameters,
        name: "StaticChild",
        kind: ValueKind::MultiString,
    },
    DriverRead {
        service: "ibalbus",
        key: RegistryKey::ServiceParameters,
        name: "*\\DeviceId",
        kind: ValueKind::String,
    },
    DriverRead {
        service: "ibalbus",
        key: RegistryKey::ServiceParameters,
        name: "*\\HardwareId",
        kind: ValueKind::MultiString,
    },
    DriverRead {
        service: "ibalbus",
        key: RegistryKey::ServiceParameters,
        name: "*\\CompatibleId",
        kind: ValueKind::MultiString,
    },
    DriverRead {
        service: "ibalbus",
        key: RegistryKey::ServiceParameters,
        name: "*\\Description",
        kind: ValueKind::String,
    },
    DriverRead {
        service: "ibalbus",
        key: RegistryKey::ServiceParameters,
        name: "*\\PartitionKey",
        kind: ValueKind::Dword,
    },
    DriverRead {
        service: "ibportclient",
        key: RegistryKey::Device,
        name: "ReceiveDepth",
        kind: ValueKind::Dword,
    },
];

/// The subkey of the hardware key that enables MSI.
const MSI_KEY: &str = "Interrupt Management\\MessageSignaledInterruptProperties";
/// The subkey of the hardware key with the per-device DMA-remapping opt-in.
const DMA_KEY: &str = "DMA Management";
/// Windows 11 24H2: from this build the per-device opt-in replaces the
/// per-driver `DmaRemappingCompatible`.
const PER_DEVICE_DMA_BUILD: u32 = 26_100;
/// PCI 3.0 (MSI-X): at most 2048 messages.
const MAX_MESSAGES: u32 = 2048;

/// Directives a universal INF may not use (using-a-universal-inf-file).
const LEGACY_DIRECTIVES: [&str; 13] = [
    "BitReg",
    "DelFiles",
    "DelProperty",
    "DelReg",
    "DelService",
    "Ini2Reg",
    "LogConfig",
    "ProfileItems",
    "RegisterDlls",
    "RenFiles",
    "UnregisterDlls",
    "UpdateIniFields",
    "UpdateInis",
];

/// Install-section suffixes a universal INF may not have.
const LEGACY_SECTION_SUFFIXES: [&str; 3] = [".coinstallers", ".factdef", ".logconfigoverride"];

/// Architecture decorations of install and models sections.
const ARCHES: [&str; 5] = ["ntamd64", "ntarm64", "ntx86", "ntarm", "ntia64"];

// ---------------------------------------------------------------------------
// Entry points

/// Lints every `*.inf` in `dir` (file-name order). Findings name the
/// files by their file names.
pub fn lint_dir(dir: impl AsRef<Path>) -> Result<Vec<Finding>, LoadError> {
    let mut findings = Vec::new();
    for (name, read) in read_inf_dir(dir.as_ref())? {
        match read {
            Ok(bytes) => findings.extend(lint_inf(&name, &bytes)),
            Err(e) => findings.push(Finding {
                file: name,
                line: None,
                rule: Rule::Syntax,
                message: format!("cannot read the file: {e}"),
            }),
        }
    }
    Ok(findings)
}

/// Lints one INF given as bytes (UTF-8 or UTF-16 with BOM). An empty list
/// means every rule passes. Never panics.
pub fn lint_inf(name: &str, bytes: &[u8]) -> Vec<Finding> {
    match Inf::parse(name, bytes) {
        Ok(inf) => {
            let mut lint = Lint::new(&inf);
            lint.run();
            lint.findings
        }
        Err(e) => {
            let line = match &e {
                InfError::Syntax { line, .. } => Some(*line),
                _ => None,
            };
            vec![Finding {
                file: name.to_owned(),
                line,
                rule: Rule::Syntax,
                message: format!("not a usable INF: {e}"),
            }]
        }
    }
}

// ---------------------------------------------------------------------------
// The walk

/// A registry write of an `AddReg` line.
#[derive(Debug, Clone)]
struct Write {
    line: usize,
    /// Lower-cased subkey (no leading or trailing `\`).
    subkey: String,
    /// Lower-cased value name.
    name: String,
    /// Type bits of the flags (`FLG_ADDREG_TYPE_MASK`), `None` if the
    /// flags are not a number.
    kind: Option<u32>,
    /// The data fields.
    data: Vec<String>,
}

impl Write {
    fn dword(&self) -> Option<u32> {
        self.data.first().and_then(|v| parse_u32(v))
    }
}

/// One `AddService` line of a `.Services` section.
#[derive(Debug, Clone)]
struct AddService {
    /// The service name (empty for the null driver, `AddService = ,2`).
    name: String,
    flags: u32,
    /// The service install section named, if any.
    install: Option<String>,
    line: usize,
}

/// A DDInstall section reached from a model line.
#[derive(Debug, Clone)]
struct Install {
    /// The section's name as written in the file.
    section: String,
    /// The model line that installs it.
    model_line: usize,
    /// Whether one of the model's IDs is a PCI ID.
    pci: bool,
    /// Whether a models section using it may apply below Windows 11 24H2.
    before_per_device_dma: bool,
}

struct Lint<'a> {
    inf: &'a Inf,
    findings: Vec<Finding>,
    /// Lower-cased names of the files copied, with the line copying each.
    copied: HashMap<String, usize>,
    /// `ServiceBinary` files: (line, lower-cased file, service section).
    binaries: Vec<(usize, String, String)>,
    /// Lower-cased `AddReg` sections whose entries were already checked.
    checked_addreg: HashSet<String>,
}

const REG_FLAG_APPEND: u32 = 0x0000_0008;
const REG_TYPE_MASK: u32 = 0xFFFF_0001;
const REG_SZ: u32 = 0x0000_0000;
const REG_MULTI_SZ: u32 = 0x0001_0000;
const REG_DWORD: u32 = 0x0001_0001;

impl<'a> Lint<'a> {
    fn new(inf: &'a Inf) -> Self {
        Self {
            inf,
            findings: Vec::new(),
            copied: HashMap::new(),
            binaries: Vec::new(),
            checked_addreg: HashSet::new(),
        }
    }

    fn report(&mut self, line: Option<usize>, rule: Rule, message: String) {
        self.findings.push(Finding {
            file: self.inf.name().to_owned(),
            line,
            rule,
            message,
        });
    }

    fn section(&self, name: &str) -> &'a [InfLine] {
        self.inf.section(name).unwrap_or_default()
    }

    fn exists(&self, name: &str) -> bool {
        self.inf.section(name).is_some()
    }

    fn directive(&self, section: &str, key: &str) -> Option<&'a InfLine> {
        self.section(section).iter().find(|l| key_is(l, key))
    }

    /// Every section named by `key` directives of `section` (comma lists),
    /// with the directive's line.
    fn named_sections(&self, section: &str, key: &str) -> Vec<(usize, String)> {
        self.section(section)
            .iter()
            .filter(|l| key_is(l, key))
            .flat_map(|l| {
                l.fields
                    .iter()
                    .filter(|f| !f.is_empty())
                    .map(move |f| (l.number, f.clone()))
            })
            .collect()
    }

    /// Reports `section` if it does not exist; true if it does.
    fn require_section(&mut self, line: usize, section: &str, what: &str) -> bool {
        if self.exists(section) {
            return true;
        }
        self.report(
            Some(line),
            Rule::SectionMissing,
            format!("{what} names section [{section}], which does not exist"),
        );
        false
    }

    fn run(&mut self) {
        self.version();
        self.universal_sections();
        self.legacy_directives();
        self.strings();
        let installs = self.models();
        let mut seen = HashSet::new();
        for install in &installs {
            if seen.insert(install.section.to_ascii_lowercase()) {
                self.install(install);
            }
        }
        self.source_files();
        self.unused_sections();
    }

    // ---- unused sections --------------------------------------------------

    /// Reports sections no reached section refers to. Reachability starts
    /// at the sections Windows reads by name and follows every field that
    /// names a section; reaching `X` also reaches `X.<anything>` (install
    /// sections' decorations and `.HW`, `.Services`, ...; `.security`
    /// sections). Lenient by design: a field that happens to equal a
    /// section name counts as a use.
    fn unused_sections(&mut self) {
        let names: Vec<&str> = self.inf.section_names().collect();
        let folded: Vec<String> = names.iter().map(|n| n.to_ascii_lowercase()).collect();
        let is_root = |n: &str| {
            [
                "version",
                "manufacturer",
                "destinationdirs",
                "sourcedisksnames",
                "sourcedisksfiles",
                "strings",
                "defaultinstall",
                "classinstall32",
            ]
            .iter()
            .any(|r| n == *r || n.strip_prefix(r).is_some_and(|rest| rest.starts_with('.')))
        };
        // Models sections and their architecture: a model line reaches the
        // install section setup would use, not every decoration of it.
        let mut models_arch: HashMap<String, String> = HashMap::new();
        for l in self.section("Manufacturer") {
            let models = l
                .fields
                .first()
                .map_or("", |f| f.trim())
                .to_ascii_lowercase();
            if l.fields.len() < 2 {
                models_arch.insert(models.clone(), String::new());
            }
            for d in l.fields.iter().skip(1) {
                let d = d.trim().to_ascii_lowercase();
                let arch = d.split('.').next().unwrap_or("").to_owned();
                models_arch.insert(format!("{models}.{d}"), arch);
            }
        }
        let mut reached: Vec<bool> = folded.iter().map(|n| is_root(n)).collect();
        let mut queue: Vec<usize> = (0..names.len()).filter(|&i| reached[i]).collect();
        while let Some(i) = queue.pop() {
            let Some(name) = names.get(i) else { continue };
            let mut targets: Vec<String> = Vec::new();
            let manufacturer = name.eq_ignore_ascii_case("manufacturer");
            let arch = models_arch.get(&name.to_ascii_lowercase());
            for l in self.section(name) {
                let first = l.fields.first().map_or("", |f| f.trim());
                if let Some(arch) = arch {
                    let base = first.to_ascii_lowercase();
                    let tried = [format!("{base}.{arch}"), format!("{base}.nt"), base.clone()];
                    if let Some(found) = tried
                        .into_iter()
                        .filter(|t| !t.ends_with('.'))
                        .find(|t| self.exists(t))
                    {
                        targets.push(found);
                    }
                    continue;
                }
                for (k, f) in l.fields.iter().enumerate() {
                    let f = f.trim().to_ascii_lowercase();
                    if manufacturer && k > 0 {
                        targets.push(format!("{}.{f}", first.to_ascii_lowercase()));
                    } else if !f.is_empty() {
                        targets.push(f);
                    }
                }
            }
            for target in targets {
                for (j, n) in folded.iter().enumerate() {
                    let hit = *n == target
                        || n.strip_prefix(target.as_str())
                            .is_some_and(|rest| rest.starts_with('.'));
                    if hit && !reached[j] {
                        reached[j] = true;
                        queue.push(j);
                    }
                }
            }
        }
        for (i, name) in names.iter().enumerate() {
            if !reached[i] {
                let line = self.inf.section_line(name);
                self.report(
                    line,
                    Rule::UnusedSection,
                    format!(
                        "[{name}] is not used: no model line or directive refers to it (2083), \
                         so nothing in it is installed"
                    ),
                );
            }
        }
    }

    // ---- [Version] --------------------------------------------------------

    fn version(&mut self) {
        let version_line = self.inf.section_line("Version");
        let inf = self.inf;
        let line_of = |key: &str| {
            inf.section("Version")
                .and_then(|lines| lines.iter().find(|l| key_is(l, key)))
                .map(|l| l.number)
                .or(version_line)
        };
        for key in ["Class", "ClassGuid", "Provider", "CatalogFile"] {
            if self.inf.version_value(key).is_none_or(str::is_empty) {
                let line = version_line;
                self.report(line, Rule::Version, format!("[Version] has no {key}"));
            }
        }
        if let Some(guid) = self.inf.version_value("ClassGuid")
            && !guid.is_empty()
            && !is_guid(guid)
        {
            let line = line_of("ClassGuid");
            self.report(
                line,
                Rule::Version,
                format!("ClassGuid {guid:?} is not a {{GUID}}"),
            );
        }
        if self
            .inf
            .version_value("Provider")
            .is_some_and(|p| p.to_ascii_lowercase().contains("microsoft"))
        {
            let line = line_of("Provider");
            self.report(line, Rule::Version, "Provider cannot be Microsoft".into());
        }

        match self.inf.version_value("PnpLockdown") {
            Some("1") => {}
            found => {
                let line = line_of("PnpLockdown");
                let found = found.map_or("missing".to_owned(), |v| format!("{v:?}"));
                self.report(
                    line,
                    Rule::PnpLockdown,
                    format!(
                        "[Version] needs PnpLockdown = 1 (found {found}): without it, \
                         applications can modify or replace the installed driver files"
                    ),
                );
            }
        }

        match self.directive("Version", "DriverVer") {
            None => self.report(
                version_line,
                Rule::DriverVer,
                "[Version] has no DriverVer = mm/dd/yyyy,w.x.y.z".into(),
            ),
            Some(l) => {
                let date = l.fields.first().map_or("", String::as_str);
                let version = l.fields.get(1).map_or("", String::as_str);
                if let Err(why) = check_driver_ver(date, version, l.fields.len()) {
                    self.report(
                        Some(l.number),
                        Rule::DriverVer,
                        format!("DriverVer = {}: {why}", l.fields.join(",")),
                    );
                }
            }
        }
    }

    // ---- universal sections and directives --------------------------------

    fn universal_sections(&mut self) {
        let names: Vec<(String, Option<usize>)> = self
            .inf
            .section_names()
            .map(|n| (n.to_owned(), self.inf.section_line(n)))
            .collect();
        let has_manufacturer = self.exists("Manufacturer");
        for (name, line) in names {
            let folded = name.to_ascii_lowercase();
            let why = if folded == "classinstall32" || folded.starts_with("classinstall32.") {
                Some("a universal INF cannot install a setup class: use a system-defined class")
            } else if LEGACY_SECTION_SUFFIXES.iter().any(|s| folded.ends_with(s)) {
                Some(
                    "a universal INF cannot have this section (co-installers, legacy configuration)",
                )
            } else if let Some(rest) = folded
                .strip_prefix("defaultinstall")
                .filter(|rest| rest.is_empty() || rest.starts_with('.'))
            {
                let arch = rest
                    .strip_prefix('.')
                    .and_then(|r| r.split('.').next())
                    .is_some_and(|a| ARCHES.contains(&a));
                if has_manufacturer {
                    Some("an INF cannot have both [DefaultInstall] and [Manufacturer] (1212)")
                } else if !arch {
                    Some("[DefaultInstall] in a universal INF needs an architecture decoration")
                } else {
                    None
                }
            } else {
                None
            };
            if let Some(why) = why {
                self.report(line, Rule::UniversalSection, format!("[{name}]: {why}"));
            }
        }
        for l in self.section("Manufacturer") {
            for decoration in l.fields.iter().skip(1) {
                // NTarch.major.minor.ProductType.SuiteMask.build
                let parts: Vec<&str> = decoration.split('.').collect();
                let product_or_suite = parts.get(3).is_some_and(|p| !p.trim().is_empty())
                    || parts.get(4).is_some_and(|p| !p.trim().is_empty());
                if product_or_suite {
                    self.report(
                        Some(l.number),
                        Rule::UniversalSection,
                        format!(
                            "models decoration {decoration:?} has a ProductType or SuiteMask, \
                             which a universal INF cannot use"
                        ),
                    );
                }
            }
        }
    }

    fn legacy_directives(&mut self) {
        let mut found = Vec::new();
        for name in self.inf.section_names() {
            if is_strings_section(name) {
                continue;
            }
            for l in self.section(name) {
                if let Some(d) = LEGACY_DIRECTIVES.iter().find(|d| key_is(l, d)) {
                    found.push((
                        l.number,
                        format!(
                            "[{name}] uses {d}, which a universal INF cannot use: a legacy \
                         operation whose result InfVerif cannot predict from the INF (1300-1302)"
                        ),
                    ));
                }
            }
        }
        for (line, message) in found {
            self.report(Some(line), Rule::LegacyDirective, message);
        }
    }

    fn strings(&mut self) {
        for (line, token) in self.inf.undefined_strings() {
            self.report(
                Some(*line),
                Rule::StringUndefined,
                format!("%{token}% is not defined in [Strings] (write %% for a literal %)"),
            );
        }
    }

    // ---- models -----------------------------------------------------------

    /// Checks `[Manufacturer]` and its models sections; returns the install
    /// sections the model lines name that exist.
    fn models(&mut self) -> Vec<Install> {
        let mut installs = Vec::new();
        for m in self.section("Manufacturer") {
            let Some(models) = m.fields.first().filter(|f| !f.is_empty()) else {
                self.report(
                    Some(m.number),
                    Rule::SectionMissing,
                    "a [Manufacturer] line names no models section".into(),
                );
                continue;
            };
            let decorations: Vec<&str> = m.fields.iter().skip(1).map(String::as_str).collect();
            let sections: Vec<(String, &str)> = if decorations.is_empty() {
                vec![(models.clone(), "")]
            } else {
                decorations
                    .iter()
                    .map(|d| (format!("{models}.{d}"), *d))
                    .collect()
            };
            for (section, decoration) in sections {
                if !self.require_section(m.number, &section, "[Manufacturer]") {
                    continue;
                }
                let mut parts = decoration.split('.');
                let arch = parts.next().unwrap_or("").to_ascii_lowercase();
                let build = parts.nth(4).and_then(|b| b.trim().parse::<u32>().ok());
                let before_per_device_dma = build.is_none_or(|b| b < PER_DEVICE_DMA_BUILD);
                for l in self.section(&section) {
                    let Some(base) = l.fields.first().filter(|f| !f.is_empty()) else {
                        self.report(
                            Some(l.number),
                            Rule::SectionMissing,
                            format!("model line in [{section}] names no install section"),
                        );
                        continue;
                    };
                    let mut tried =
                        vec![format!("{base}.{arch}"), format!("{base}.nt"), base.clone()];
                    if arch.is_empty() {
                        tried.remove(0);
                    }
                    let found = tried
                        .iter()
                        .find(|t| self.exists(t))
                        .map(|t| self.canonical(t));
                    match found {
                        Some(section) => installs.push(Install {
                            section,
                            model_line: l.number,
                            pci: l
                                .fields
                                .iter()
                                .skip(1)
                                .any(|id| starts_with_ci(id.trim(), "PCI\\")),
                            before_per_device_dma,
                        }),
                        None => self.report(
                            Some(l.number),
                            Rule::SectionMissing,
                            format!(
                                "model {:?} installs with {base:?}, but none of [{}] exists",
                                l.key.as_deref().unwrap_or(""),
                                tried.join("], [")
                            ),
                        ),
                    }
                }
            }
        }
        // The same install section from several models: PCI if any is,
        // pre-24H2 if any is.
        let mut merged: Vec<Install> = Vec::new();
        for i in installs {
            match merged
                .iter_mut()
                .find(|m| m.section.eq_ignore_ascii_case(&i.section))
            {
                Some(m) => {
                    m.pci |= i.pci;
                    m.before_per_device_dma |= i.before_per_device_dma;
                }
                None => merged.push(i),
            }
        }
        merged
    }

    /// The section's name as stored (sections are case-insensitive).
    fn canonical(&self, name: &str) -> String {
        self.inf
            .section_names()
            .find(|n| n.eq_ignore_ascii_case(name))
            .unwrap_or(name)
            .to_owned()
    }

    // ---- one DDInstall ----------------------------------------------------

    fn install(&mut self, install: &Install) {
        let ddinstall = install.section.clone();
        let ddinstall_line = self
            .inf
            .section_line(&ddinstall)
            .unwrap_or(install.model_line);

        // Files.
        for (line, target) in self.named_sections(&ddinstall, "CopyFiles") {
            self.copy_files(line, &target);
        }
        // The software key (HKR in DDInstall): only its roots are checked.
        for (line, section) in self.named_sections(&ddinstall, "AddReg") {
            if self.require_section(line, &section, "AddReg") {
                self.writes(&section);
            }
        }

        // Hardware key.
        let hw = format!("{ddinstall}.HW");
        let mut hw_writes = Vec::new();
        for (line, section) in self.named_sections(&hw, "AddReg") {
            if self.require_section(line, &section, "AddReg") {
                hw_writes.extend(self.writes(&section));
            }
        }

        // Services.
        let services_section = format!("{ddinstall}.Services");
        let mut services: Vec<AddService> = Vec::new();
        if self.exists(&services_section) {
            services = self.services(&services_section);
        } else {
            self.report(
                Some(ddinstall_line),
                Rule::SectionMissing,
                format!(
                    "[{ddinstall}] has no [{services_section}]: every device install \
                     names its function driver (AddService with flag 0x2, or `AddService = ,2`)"
                ),
            );
        }

        // Filters and KMDF.
        let filters = format!("{ddinstall}.Filters");
        for l in self.section(&filters) {
            if key_is(l, "AddFilter")
                && let Some(s) = l.fields.get(2).filter(|s| !s.is_empty())
            {
                self.require_section(l.number, s, "AddFilter");
            }
        }
        let wdf = format!("{ddinstall}.Wdf");
        for l in self.section(&wdf) {
            if key_is(l, "KmdfService")
                && let Some(s) = l.fields.get(1).filter(|s| !s.is_empty())
            {
                self.require_section(l.number, s, "KmdfService");
            }
        }

        // Service writes, per service.
        let mut service_writes: HashMap<String, Vec<Write>> = HashMap::new();
        for service in &services {
            let Some(section) = &service.install else {
                continue;
            };
            let mut writes = Vec::new();
            for (l, s) in self.named_sections(section, "AddReg") {
                if self.require_section(l, &s, "AddReg") {
                    writes.extend(self.writes(&s));
                }
            }
            service_writes
                .entry(service.name.to_ascii_lowercase())
                .or_default()
                .extend(writes);
        }

        self.driver_reads(
            &ddinstall,
            ddinstall_line,
            &services,
            &hw_writes,
            &service_writes,
        );
        if install.pci {
            let hw_line = self.inf.section_line(&hw).unwrap_or(ddinstall_line);
            self.msi(&ddinstall, hw_line, &hw_writes);
            let function = services
                .iter()
                .find(|s| s.flags & SPSVCINST_ASSOCSERVICE != 0 && !s.name.is_empty())
                .map(|s| (s.name.clone(), s.install.clone()));
            self.dma(
                &ddinstall,
                hw_line,
                install.before_per_device_dma,
                &hw_writes,
                function,
                &service_writes,
            );
        }
    }

    /// Checks a `CopyFiles` target: `@file` (to `DefaultDestDir`) or a
    /// file-list section.
    fn copy_files(&mut self, line: usize, target: &str) {
        if let Some(file) = target.strip_prefix('@') {
            self.destination(line, None);
            self.copied
                .entry(file.trim().to_ascii_lowercase())
                .or_insert(line);
            return;
        }
        if !self.require_section(line, target, "CopyFiles") {
            return;
        }
        self.destination(line, Some(target));
        for l in self.section(target) {
            // dest[, source[, temp[, flags]]]; a key would be a typo.
            let dest = l.fields.first().map_or("", |f| f.trim());
            let source = l.fields.get(1).map_or("", |f| f.trim());
            if l.key.is_some() || dest.is_empty() {
                self.report(
                    Some(l.number),
                    Rule::SourceFiles,
                    format!("[{target}] line is not `file[,source]`"),
                );
                continue;
            }
            if !source.is_empty() && !source.eq_ignore_ascii_case(dest) {
                self.report(
                    Some(l.number),
                    Rule::DestinationDir,
                    format!(
                        "[{target}] renames {source} to {dest}: a file in the driver store \
                         (DIRID 13) keeps its name (1100)"
                    ),
                );
            }
            let file = if source.is_empty() { dest } else { source };
            self.copied
                .entry(file.to_ascii_lowercase())
                .or_insert(l.number);
        }
    }

    /// Checks that files copied by `section` (or `@file`, `None`) go to
    /// DIRID 13 with no subdirectory.
    fn destination(&mut self, line: usize, section: Option<&str>) {
        let entry = section
            .and_then(|s| self.directive("DestinationDirs", s))
            .or_else(|| self.directive("DestinationDirs", "DefaultDestDir"));
        let Some(entry) = entry else {
            self.report(
                Some(line),
                Rule::DestinationDir,
                format!(
                    "[DestinationDirs] gives no directory for {}: add `{} = 13`",
                    section.map_or("CopyFiles=@file".to_owned(), |s| format!("[{s}]")),
                    section.unwrap_or("DefaultDestDir")
                ),
            );
            return;
        };
        let dirid = entry.fields.first().map_or("", |f| f.trim());
        let subdir = entry.fields.get(1).map_or("", |f| f.trim());
        if dirid != "13" || !subdir.is_empty() {
            let target = entry.fields.join(",");
            self.report(
                Some(entry.number),
                Rule::DestinationDir,
                format!(
                    "{} = {target}: driver files go to DIRID 13 (the driver store) with no \
                     subdirectory, so the driver runs from the store",
                    entry.key.as_deref().unwrap_or("")
                ),
            );
        }
    }

    /// Checks a `.Services` section; returns each `AddService` as (name,
    /// flags, install section, line).
    fn services(&mut self, services_section: &str) -> Vec<AddService> {
        let mut out = Vec::new();
        let mut functions = 0;
        let section_line = self.inf.section_line(services_section);
        for l in self.section(services_section) {
            if !key_is(l, "AddService") {
                continue;
            }
            let name = l.fields.first().map_or("", |f| f.trim()).to_owned();
            let flags_text = l.fields.get(1).map_or("", |f| f.trim());
            let flags = if flags_text.is_empty() {
                Some(0)
            } else {
                parse_u32(flags_text)
            };
            let Some(flags) = flags else {
                self.report(
                    Some(l.number),
                    Rule::Service,
                    format!("AddService {name}: flags {flags_text:?} are not a number"),
                );
                continue;
            };
            if flags & SPSVCINST_ASSOCSERVICE != 0 {
                functions += 1;
            }
            let install = l
                .fields
                .get(2)
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty());
            if let Some(log) = l.fields.get(3).map(|s| s.trim()).filter(|s| !s.is_empty()) {
                self.require_section(l.number, log, "AddService (event log)");
            }
            match (&install, name.is_empty()) {
                (Some(s), false) => {
                    if self.require_section(l.number, s, "AddService") {
                        self.service_install(s);
                    }
                }
                (None, false) => self.report(
                    Some(l.number),
                    Rule::SectionMissing,
                    format!("AddService {name} names no service install section"),
                ),
                (_, true) => {}
            }
            out.push(AddService {
                name,
                flags,
                install,
                line: l.number,
            });
        }
        if functions != 1 {
            self.report(
                section_line,
                Rule::Service,
                format!(
                    "[{services_section}] has {functions} AddService with flag 0x2 \
                     (SPSVCINST_ASSOCSERVICE); a device has exactly one function driver"
                ),
            );
        }
        out
    }

    fn service_install(&mut self, section: &str) {
        let header = self.inf.section_line(section);
        let number = |this: &Self, key: &str| {
            this.directive(section, key)
                .map(|l| (l.number, l.fields.first().and_then(|v| parse_u32(v))))
        };
        let check =
            |this: &mut Self, key: &str, allowed: &[u32], meaning: &str| match number(this, key) {
                None => this.report(header, Rule::Service, format!("[{section}] has no {key}")),
                Some((line, Some(v))) if allowed.contains(&v) => {
                    let _ = line;
                }
                Some((line, v)) => this.report(
                    Some(line),
                    Rule::Service,
                    format!(
                        "[{section}] {key} = {}: {meaning}",
                        v.map_or("not a number".to_owned(), |v| format!("{v:#x}"))
                    ),
                ),
            };
        check(
            self,
            "ServiceType",
            &[0x1],
            "a KMDF device driver is SERVICE_KERNEL_DRIVER (1)",
        );
        check(
            self,
            "StartType",
            &[0, 1, 3, 4],
            "must be 0, 1, 3 or 4; SERVICE_AUTO_START (2) is never used for a PnP device driver \
             (SERVICE_DEMAND_START, 3, lets PnP load it)",
        );
        check(
            self,
            "ErrorControl",
            &[0, 1, 2, 3],
            "must be 0-3 (SERVICE_ERROR_IGNORE..CRITICAL)",
        );
        match self.directive(section, "ServiceBinary") {
            None => self.report(
                header,
                Rule::Service,
                format!("[{section}] has no ServiceBinary"),
            ),
            Some(l) => {
                let binary = l.fields.first().map_or("", |f| f.trim());
                match strip_prefix_ci(binary, "%13%\\") {
                    Some(file) if !file.is_empty() && !file.contains('\\') => {
                        self.binaries.push((
                            l.number,
                            file.to_ascii_lowercase(),
                            section.to_owned(),
                        ));
                    }
                    _ => self.report(
                        Some(l.number),
                        Rule::Service,
                        format!(
                            "[{section}] ServiceBinary = {binary}: a driver runs from the driver \
                             store, `%13%\\file.sys`"
                        ),
                    ),
                }
            }
        }
    }
}

impl Lint<'_> {
    // ---- registry ---------------------------------------------------------

    /// The writes of an add-registry section; checks its roots, flags and
    /// co-installers once per section.
    fn writes(&mut self, section: &str) -> Vec<Write> {
        let first_time = self.checked_addreg.insert(section.to_ascii_lowercase());
        let mut out = Vec::new();
        let mut problems = Vec::new();
        for l in self.section(section) {
            let field = |i: usize| l.fields.get(i).map_or("", |f| f.trim());
            let (root, subkey, name, flags_text) = (field(0), field(1), field(2), field(3));
            let flags = if flags_text.is_empty() {
                Some(0)
            } else {
                parse_u32(flags_text)
            };
            if !root.eq_ignore_ascii_case("HKR") && !allowed_absolute_root(root, subkey) {
                let services_key = root.eq_ignore_ascii_case("HKLM")
                    && starts_with_ci(subkey, "SYSTEM\\CurrentControlSet\\Services");
                problems.push((
                    l.number,
                    Rule::Registry,
                    if services_key {
                        format!("[{section}] writes {root}\\{subkey}: the services key is written through HKR in a service install section (1221)")
                    } else {
                        format!("[{section}] writes under {root:?}: a universal INF writes only HKR (relative to the device, service or driver key), apart from COM and MFT registration (1304)")
                    },
                ));
            }
            if name.eq_ignore_ascii_case("CoInstallers32") {
                problems.push((
                    l.number,
                    Rule::CoInstaller,
                    format!("[{section}] registers co-installers (CoInstallers32): a universal INF runs no installer code (1303)"),
                ));
            }
            match flags {
                None => problems.push((
                    l.number,
                    Rule::Registry,
                    format!("[{section}] flags {flags_text:?} are not a number"),
                )),
                Some(f) if f & REG_FLAG_APPEND != 0 => problems.push((
                    l.number,
                    Rule::Registry,
                    format!("[{section}] appends to a REG_MULTI_SZ (FLG_ADDREG_APPEND): a universal INF writes whole values (1305)"),
                )),
                Some(_) => {}
            }
            out.push(Write {
                line: l.number,
                subkey: subkey.trim_matches('\\').to_ascii_lowercase(),
                name: name.to_ascii_lowercase(),
                kind: flags.map(|f| f & REG_TYPE_MASK),
                data: l
                    .fields
                    .iter()
                    .skip(4)
                    .map(|f| f.trim().to_owned())
                    .collect(),
            });
        }
        if first_time {
            for (line, rule, message) in problems {
                self.report(Some(line), rule, message);
            }
        }
        out
    }

    /// The values our drivers read ([`DRIVER_READS`]) for every service
    /// this install section installs.
    fn driver_reads(
        &mut self,
        ddinstall: &str,
        ddinstall_line: usize,
        services: &[AddService],
        hw_writes: &[Write],
        service_writes: &HashMap<String, Vec<Write>>,
    ) {
        for AddService {
            name: service,
            install: section,
            line,
            ..
        } in services
        {
            let reads: Vec<&DriverRead> = DRIVER_READS
                .iter()
                .filter(|r| r.service.eq_ignore_ascii_case(service))
                .collect();
            if reads.is_empty() {
                continue;
            }
            let no_writes = Vec::new();
            let own = service_writes
                .get(&service.to_ascii_lowercase())
                .unwrap_or(&no_writes);
            // The per-child names come from the service's StaticChild list.
            let children: Vec<String> = own
                .iter()
                .find(|w| w.subkey == "parameters" && w.name == "staticchild")
                .map(|w| w.data.iter().filter(|c| !c.is_empty()).cloned().collect())
                .unwrap_or_default();
            for read in reads {
                let (writes, where_, at) = match read.key {
                    RegistryKey::Device => (
                        hw_writes,
                        format!("[{ddinstall}.HW] AddReg"),
                        ddinstall_line,
                    ),
                    RegistryKey::ServiceParameters => (
                        own.as_slice(),
                        format!(
                            "[{}] AddReg (HKR,Parameters)",
                            section.as_deref().unwrap_or("its service install section")
                        ),
                        *line,
                    ),
                };
                let names: Vec<String> = match read.name.strip_prefix("*\\") {
                    Some(value) => children.iter().map(|c| format!("{c}\\{value}")).collect(),
                    None => vec![read.name.to_owned()],
                };
                for full in names {
                    let (sub, value) = match full.rsplit_once('\\') {
                        Some((sub, value)) => (sub.to_owned(), value.to_owned()),
                        None => (String::new(), full.clone()),
                    };
                    let subkey = match read.key {
                        RegistryKey::Device => sub.to_ascii_lowercase(),
                        RegistryKey::ServiceParameters if sub.is_empty() => "parameters".to_owned(),
                        RegistryKey::ServiceParameters => {
                            format!("parameters\\{}", sub.to_ascii_lowercase())
                        }
                    };
                    let write = writes
                        .iter()
                        .find(|w| w.subkey == subkey && w.name.eq_ignore_ascii_case(&value));
                    match write {
                        None => self.report(
                            Some(at),
                            Rule::DriverRegistry,
                            format!(
                                "{service} reads {} \"{full}\" ({}), but {where_} does not write it",
                                key_name(read.key),
                                read.kind.name()
                            ),
                        ),
                        Some(w) if w.kind != Some(kind_bits(read.kind)) => self.report(
                            Some(w.line),
                            Rule::DriverRegistry,
                            format!(
                                "{service} reads \"{full}\" as {}, but the INF writes another type \
                                 (flags {})",
                                read.kind.name(),
                                w.kind.map_or("not a number".to_owned(), |k| format!("{k:#010x}"))
                            ),
                        ),
                        Some(_) => {}
                    }
                }
            }
        }
    }

    /// MSI: the PCI device's hardware key says the device supports MSI and
    /// how many messages to allocate.
    fn msi(&mut self, ddinstall: &str, ddinstall_line: usize, hw_writes: &[Write]) {
        let key = MSI_KEY.to_ascii_lowercase();
        let find = |name: &str| {
            hw_writes
                .iter()
                .find(|w| w.subkey == key && w.name.eq_ignore_ascii_case(name))
        };
        match find("MSISupported") {
            Some(w) if w.kind == Some(REG_DWORD) && w.dword() == Some(1) => {}
            found => self.report(
                Some(found.map_or(ddinstall_line, |w| w.line)),
                Rule::Msi,
                format!(
                    "[{ddinstall}.HW] must set HKR,\"{MSI_KEY}\",MSISupported,0x00010001,1: \
                     the HCA interrupts only with MSI-X (no INTx)"
                ),
            ),
        }
        match find("MessageNumberLimit") {
            Some(w)
                if w.kind == Some(REG_DWORD)
                    && w.dword().is_some_and(|n| (1..=MAX_MESSAGES).contains(&n)) => {}
            found => self.report(
                Some(found.map_or(ddinstall_line, |w| w.line)),
                Rule::Msi,
                format!(
                    "[{ddinstall}.HW] must set HKR,\"{MSI_KEY}\",MessageNumberLimit,0x00010001,n \
                     with 1 <= n <= {MAX_MESSAGES} (PCI 3.0)"
                ),
            ),
        }
    }

    /// DMA remapping: the per-device opt-in, and the per-driver one while
    /// the INF may install on a build before Windows 11 24H2.
    fn dma(
        &mut self,
        ddinstall: &str,
        ddinstall_line: usize,
        before_per_device: bool,
        hw_writes: &[Write],
        function: Option<(String, Option<String>)>,
        service_writes: &HashMap<String, Vec<Write>>,
    ) {
        let key = DMA_KEY.to_ascii_lowercase();
        let per_device = hw_writes
            .iter()
            .find(|w| w.subkey == key && w.name == "remappingsupported");
        match per_device {
            Some(w) if w.kind == Some(REG_DWORD) && w.dword() == Some(1) => {}
            found => self.report(
                Some(found.map_or(ddinstall_line, |w| w.line)),
                Rule::DmaRemapping,
                format!(
                    "[{ddinstall}.HW] must opt in to DMA remapping: \
                     HKR,\"{DMA_KEY}\",RemappingSupported,0x00010001,1 (the miniport reaches \
                     memory only through its DMA adapter)"
                ),
            ),
        }
        if !before_per_device {
            return;
        }
        let Some((service, section)) = function else {
            return;
        };
        let per_driver = service_writes
            .get(&service.to_ascii_lowercase())
            .and_then(|ws| {
                ws.iter()
                    .find(|w| w.subkey == "parameters" && w.name == "dmaremappingcompatible")
            });
        match per_driver {
            Some(w) if w.kind == Some(REG_DWORD) && w.dword() == Some(1) => {}
            found => {
                let line = found
                    .map(|w| w.line)
                    .or_else(|| section.as_deref().and_then(|s| self.inf.section_line(s)))
                    .unwrap_or(ddinstall_line);
                self.report(
                    Some(line),
                    Rule::DmaRemapping,
                    format!(
                        "{service}'s service install section must opt in to DMA remapping on \
                         builds before 24H2 ({PER_DEVICE_DMA_BUILD}), which this INF's models \
                         reach: HKR,Parameters,DmaRemappingCompatible,0x00010001,1"
                    ),
                );
            }
        }
    }

    // ---- source files -----------------------------------------------------

    fn source_files(&mut self) {
        let mut disks = HashSet::new();
        let mut listed: Vec<(usize, String)> = Vec::new();
        let mut problems = Vec::new();
        for name in self.inf.section_names() {
            let folded = name.to_ascii_lowercase();
            if folded == "sourcedisksnames" || folded.starts_with("sourcedisksnames.") {
                for l in self.section(name) {
                    if let Some(k) = &l.key {
                        disks.insert(k.trim().to_ascii_lowercase());
                    }
                }
            }
        }
        for name in self.inf.section_names() {
            let folded = name.to_ascii_lowercase();
            if folded == "sourcedisksfiles" || folded.starts_with("sourcedisksfiles.") {
                for l in self.section(name) {
                    let Some(file) = l.key.as_deref().map(str::trim).filter(|f| !f.is_empty())
                    else {
                        problems.push((
                            l.number,
                            format!("[{name}] line is not `file = disk-id[,subdir]`"),
                        ));
                        continue;
                    };
                    let disk = l.fields.first().map_or("", |f| f.trim());
                    if !disks.contains(&disk.to_ascii_lowercase()) {
                        problems.push((l.number, format!("{file} is on disk {disk:?}, which [SourceDisksNames] does not define")));
                    }
                    listed.push((l.number, file.to_ascii_lowercase()));
                }
            }
        }
        let listed_names: BTreeSet<&str> = listed.iter().map(|(_, f)| f.as_str()).collect();
        let mut copied: Vec<(&String, &usize)> = self.copied.iter().collect();
        copied.sort_by_key(|(_, line)| **line);
        for (file, line) in copied {
            if !listed_names.contains(file.as_str()) {
                problems.push((
                    *line,
                    format!("{file} is copied but not listed in [SourceDisksFiles] (1230)"),
                ));
            }
        }
        for (line, file) in &listed {
            if !self.copied.contains_key(file) {
                problems.push((
                    *line,
                    format!("{file} is in [SourceDisksFiles] but no install section copies it"),
                ));
            }
        }
        let binaries = std::mem::take(&mut self.binaries);
        for (line, file, section) in &binaries {
            if !self.copied.contains_key(file) {
                self.report(
                    Some(*line),
                    Rule::Service,
                    format!(
                        "[{section}] ServiceBinary {file} is not copied by any install section"
                    ),
                );
            }
        }
        for (line, message) in problems {
            self.report(Some(line), Rule::SourceFiles, message);
        }
    }
}

// ---------------------------------------------------------------------------
// Helpers

fn key_is(line: &InfLine, name: &str) -> bool {
    line.key
        .as_deref()
        .is_some_and(|k| k.trim().eq_ignore_ascii_case(name))
}

fn key_name(key: RegistryKey) -> &'static str {
    match key {
        RegistryKey::Device => "the hardware key's",
        RegistryKey::ServiceParameters => "Parameters",
    }
}

fn kind_bits(kind: ValueKind) -> u32 {
    match kind {
        ValueKind::String => REG_SZ,
        ValueKind::MultiString => REG_MULTI_SZ,
        ValueKind::Dword => REG_DWORD,
    }
}

fn is_strings_section(name: &str) -> bool {
    let folded = name.to_ascii_lowercase();
    folded == "strings" || folded.starts_with("strings.")
}

/// `s` starts with `prefix`, ASCII case-insensitively (never splits a
/// character).
fn starts_with_ci(s: &str, prefix: &str) -> bool {
    strip_prefix_ci(s, prefix).is_some()
}

fn strip_prefix_ci<'s>(s: &'s str, prefix: &str) -> Option<&'s str> {
    let head = s.get(..prefix.len())?;
    if head.eq_ignore_ascii_case(prefix) {
        s.get(prefix.len()..)
    } else {
        None
    }
}

/// The absolute roots a universal INF may write: COM registration
/// (`HKCR`, `HKLM\SOFTWARE\Classes`) and hardware MFTs.
fn allowed_absolute_root(root: &str, subkey: &str) -> bool {
    let subkey = subkey.trim_start_matches('\\');
    root.eq_ignore_ascii_case("HKCR")
        || (root.eq_ignore_ascii_case("HKLM")
            && [
                "SOFTWARE\\Classes",
                "SOFTWARE\\Microsoft\\Windows Media Foundation",
                "SOFTWARE\\WOW6432Node\\Microsoft\\Windows Media Foundation",
                "SOFTWARE\\WOW3232Node\\Microsoft\\Windows Media Foundation",
            ]
            .iter()
            .any(|allowed| {
                strip_prefix_ci(subkey, allowed)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('\\'))
            }))
}

/// `DriverVer = mm/dd/yyyy,w.x.y.z`: two-digit month and day, four-digit
/// year (`-` may separate them), a real date; four version parts, each
/// below 65535.
fn check_driver_ver(date: &str, version: &str, fields: usize) -> Result<(), String> {
    let date = date.trim();
    let parts: Vec<&str> = date.split(['/', '-']).collect();
    let [month, day, year] = parts.as_slice() else {
        return Err(format!("the date {date:?} is not mm/dd/yyyy"));
    };
    let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(month, 2) || !digits(day, 2) || !digits(year, 4) {
        return Err(format!(
            "the date {date:?} is not mm/dd/yyyy (two-digit month and day, four-digit year)"
        ));
    }
    let (month, day, year): (u32, u32, u32) = (
        month.parse().unwrap_or(0),
        day.parse().unwrap_or(0),
        year.parse().unwrap_or(0),
    );
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return Err(format!("month {month} does not exist")),
    };
    if !(1..=days).contains(&day) {
        return Err(format!(
            "day {day} does not exist in month {month} of {year}"
        ));
    }
    let version = version.trim();
    if version.is_empty() {
        return Err("no version: DriverVer needs w.x.y.z after the date".into());
    }
    if fields > 2 {
        return Err("extra fields after the version".into());
    }
    let parts: Vec<&str> = version.split('.').collect();
    let valid = parts.len() == 4
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_digit())
                && p.parse::<u32>().is_ok_and(|v| v < 65_535)
        });
    if !valid {
        return Err(format!(
            "the version {version:?} is not w.x.y.z (four numbers, each below 65535)"
        ));
    }
    Ok(())
}
