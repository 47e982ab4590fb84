//! Driver binding by reading our `inf/*.inf` files: the host's model of what
//! Windows setup does with a driver package when a device appears.
//!
//! # Contract
//!
//! **Loading** ([`InfSet::load_dir`], [`InfSet::from_sources`],
//! [`InfSet::add`]). Every file is parsed by [`Inf::parse`], which follows
//! the INF general syntax rules: UTF-16LE (with BOM) or UTF-8 text; CRLF, LF
//! or CR line ends; `;` starts a comment outside quotes; a `\` ending a line
//! joins it to the next; `[section]` headers, with repeated sections merged;
//! `key = field, field, ...` or keyless lines; `"quoted"` fields with `""`
//! for a quote; `%token%` replaced from `[Strings]` (then `[Strings.0409]`),
//! `%%` for `%`, numeric tokens (DIRIDs such as `%13%`) kept for the
//! directives that use them. Like SetupAPI, a file with a syntax error, no
//! `[Version]` or a Signature other than `$Windows NT$`/`$Chicago$` is not
//! used at all: it is recorded in [`InfSet::rejected`] and named by
//! [`BindError::NoMatch`]. InfVerif-style defects that do not stop setup
//! (no `CatalogFile`, no `PnpLockdown=1`, an undefined string token, ...)
//! are listed by [`Inf::warnings`]. Arbitrary bytes never panic the parser.
//!
//! **Binding** ([`InfSet::bind`]), simplified from Windows driver ranking:
//! 1. Models: each `[Manufacturer]` line's models section is used with its
//!    best decoration for the target architecture (`NTamd64`,
//!    `NTamd64.10.0...18362`, ...; OS versions up to Windows 10.0 build
//!    26100, workstation). On `NTamd64`/`NTarm64` an undecorated models
//!    section is not used, as on 64-bit Windows.
//! 2. Ranking: a model line `desc = install, hwid[, compatid...]` matches
//!    when one of its IDs equals (ASCII case-insensitively) one of the
//!    device's IDs. Lower rank wins: a device hardware ID beats a device
//!    compatible ID; then the model's own hardware ID beats its compatible
//!    IDs; then an earlier ID in the device's list; then an earlier ID on
//!    the model line. Ties go to the newer `DriverVer` date, then the higher
//!    version, then the earlier INF in the set (files load in name order),
//!    then the earlier model line.
//! 3. Install: the DDInstall section is `install.NTamd64` (the target's
//!    platform extension), else `install.NT`, else `install`; its
//!    `.Services`, `.HW`, `.Filters` and `.Wdf` sections are named after
//!    the one found.
//! 4. Services: `.Services` must exist and hold exactly one `AddService`
//!    with flag `0x2` (`SPSVCINST_ASSOCSERVICE`): the function driver.
//!    Every `AddService` names a service install section, which must exist
//!    and give `ServiceType = 1`, `StartType`, `ErrorControl` and
//!    `ServiceBinary = %13%\file` (the driver store), with `file` copied by
//!    the install section's `CopyFiles` (from `[SourceDisksFiles]`, to
//!    `[DestinationDirs]` DIRID 13).
//! 5. Filters, both forms: `.Filters` `AddFilter = svc,, section` with
//!    `FilterPosition = Upper|Lower` or `FilterLevel = level` (levels from
//!    the `.HW` values `UpperFilterLevels`/`LowerFilterLevels`, default
//!    levels from `UpperFilterDefaultLevel`/`LowerFilterDefaultLevel`); and
//!    the legacy `.HW` `HKR,,"UpperFilters",0x00010000,"svc"` (or
//!    `LowerFilters`). Each filter list is in attach order, lowest first:
//!    the legacy entries in their order, then declarative filters by level
//!    (in INF order within a level). Every filter must be installed by an
//!    `AddService` of the same `.Services` section. Where Windows would
//!    silently drop a filter (an undefined level), binding fails instead.
//! 6. Registry writes: `.HW` `AddReg` (`HKR` = the device's hardware key)
//!    become [`Binding::device_values`], except the filter values above
//!    (`UpperFilters`, `LowerFilters`, the level values), which Windows
//!    keeps as device properties on the instance key, and `Security` (a
//!    `REG_SZ` SDDL at the root of `HKR`), which is the device's security
//!    property: [`Binding::security`], applied by the PnP manager to the
//!    devnode's stack before any driver's add-device; an SDDL outside
//!    [`crate::security`]'s subset fails the binding, as Windows fails the
//!    install. Each service install section's
//!    standard values (`Type`, `Start`, `ErrorControl`, `ImagePath`,
//!    `DisplayName`) and `AddReg` (`HKR` = the service key) become
//!    [`Binding::service_values`]. Only `HKR` is accepted (InfVerif's rule).
//!    Value types: `REG_SZ`, `REG_EXPAND_SZ` (stored as a string),
//!    `REG_MULTI_SZ`, `REG_DWORD`, `REG_BINARY` (and other binary types);
//!    the `FLG_ADDREG_NOCLOBBER` modifier is honoured. `.Wdf`
//!    `KmdfService = svc, section` gives `KmdfLibraryVersion`.
//!
//! A device whose INF does not resolve gets a [`BindError`] saying why.
//! Outside the model, and refused with [`BindError::Unsupported`] rather
//! than ignored: `Include`/`Needs` (sections of other INFs), `AddReg` in the
//! DDInstall section itself (the driver's software key), `AddReg` entries
//! that only create a key, and the `AddReg` modifiers `APPEND`, `DELVAL`,
//! `KEYONLY`, `OVERWRITEONLY`, `32BITKEY`.
//! Other directives (`DelReg`, `AddProperty`, `FeatureScore`, ...) have no
//! effect the host models and are ignored.
//!
//! **Applying** ([`Binding::apply`]) writes the device instance key
//! (`Service`, `UpperFilters`, `LowerFilters`, `ClassGUID`, `DeviceDesc`),
//! the hardware key and the service keys, in the layout described in
//! [`crate::registry`].
//!
//! Why not the `inf-rs` crate: its current release (0.2.0) starts with
//! `#![feature(str_from_utf16_endian)]` and does not compile on a stable
//! toolchain (E0554); it also parses only from a path, loses
//! section order, does not merge repeated sections, split fields, honour
//! `""` or strip comments on keyless lines, resolve strings, or accept bare
//! CR line ends. This parser covers what it does (UTF-8/UTF-16LE, sections,
//! keys, quotes, continuation) and the rest.

use std::cmp::{Ordering, Reverse};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use driver_platform::RegValue;

use crate::registry::{self, RegistryError, RegistryStore};
use crate::security::SecurityDescriptor;

/// The host's Windows version for decorations: 10.0, build 26100.
const HOST_OS: (u32, u32, u32) = (10, 0, 26_100);

/// `SPSVCINST_ASSOCSERVICE`: the service is the device's function driver.
pub const SPSVCINST_ASSOCSERVICE: u32 = 0x2;

/// The workspace's `inf/` directory (the driver packages the host binds).
pub fn workspace_inf_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("inf")
}

// ---------------------------------------------------------------------------
// Errors

/// Why a file is not a usable INF (SetupAPI would not open it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InfError {
    /// A line breaks the INF syntax rules.
    #[error("line {line}: {reason}")]
    Syntax {
        /// 1-based physical line number.
        line: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// There is no `[Version]` section.
    #[error("no [Version] section")]
    NoVersion,
    /// `[Version]` has no `Signature`, or not a Windows NT one.
    #[error("[Version] Signature is {found:?}, not \"$Windows NT$\" or \"$Chicago$\"")]
    BadSignature {
        /// The signature found (empty if none).
        found: String,
    },
    /// The file could not be read.
    #[error("cannot read the file: {reason}")]
    Read {
        /// The I/O error.
        reason: String,
    },
}

/// Why a directory of INFs could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The directory could not be listed.
    #[error("cannot read INF directory {}: {reason}", .path.display())]
    ReadDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        reason: String,
    },
}

/// Why a device could not be bound to a driver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BindError {
    /// The target architecture is not one the host models, or the only
    /// INFs listing the device's IDs do so for other architectures.
    #[error("architecture {arch:?}: {reason}")]
    UnsupportedArchitecture {
        /// The architecture asked for.
        arch: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// No model line of any usable INF lists one of the device's IDs.
    #[error(
        "no INF matches hardware IDs {hardware_ids:?} or compatible IDs {compatible_ids:?}{}",
        problems_suffix(.problems)
    )]
    NoMatch {
        /// The device's hardware IDs.
        hardware_ids: Vec<String>,
        /// The device's compatible IDs.
        compatible_ids: Vec<String>,
        /// INFs that were rejected and defects found in manufacturer and
        /// models sections while searching.
        problems: Vec<String>,
    },
    /// The matched model's install section does not exist.
    #[error("{inf}: model {model:?} installs with {section:?}, but none of {tried:?} exists")]
    InstallSectionMissing {
        /// The INF.
        inf: String,
        /// The model line's description.
        model: String,
        /// The install section named by the model line.
        section: String,
        /// The decorated names looked for.
        tried: Vec<String>,
    },
    /// The install section has no `.Services` section.
    #[error("{inf}: [{section}] does not exist, so the device has no function driver")]
    ServicesSectionMissing {
        /// The INF.
        inf: String,
        /// The `.Services` section looked for.
        section: String,
    },
    /// The `.Services` section names no function driver.
    #[error("{inf}: [{section}]: {reason}")]
    NoFunctionService {
        /// The INF.
        inf: String,
        /// The `.Services` section.
        section: String,
        /// Why there is no function service.
        reason: String,
    },
    /// An `AddService` names a service install section that does not exist.
    #[error(
        "{inf}: AddService {service:?} names service install section [{section}], which does not exist"
    )]
    ServiceSectionMissing {
        /// The INF.
        inf: String,
        /// The service.
        service: String,
        /// The missing section.
        section: String,
    },
    /// Another directive names a section that does not exist.
    #[error("{inf}: {directive} names section [{section}], which does not exist")]
    SectionMissing {
        /// The INF.
        inf: String,
        /// The missing section.
        section: String,
        /// The directive and where it is.
        directive: String,
    },
    /// A line the binding needs is malformed or breaks a rule.
    #[error("{inf}: [{section}]{}: {reason}", line_suffix(*.line))]
    Malformed {
        /// The INF.
        inf: String,
        /// The section.
        section: String,
        /// The line number, when one line is at fault.
        line: Option<usize>,
        /// What is wrong.
        reason: String,
    },
    /// A line uses an INF feature outside the host's model.
    #[error("{inf}: [{section}] line {line}: not supported: {reason}")]
    Unsupported {
        /// The INF.
        inf: String,
        /// The section.
        section: String,
        /// The line number.
        line: usize,
        /// What is not supported.
        reason: String,
    },
}

fn problems_suffix(problems: &[String]) -> String {
    if problems.is_empty() {
        String::new()
    } else {
        format!("; {}", problems.join("; "))
    }
}

fn line_suffix(line: Option<usize>) -> String {
    line.map(|l| format!(" line {l}")).unwrap_or_default()
}

// ---------------------------------------------------------------------------
// Parsed INF

/// One line of a section after comments, continuations, quoting and
/// `%string%` substitution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfLine {
    /// 1-based number of the (first) physical line.
    pub number: usize,
    /// The text before the first unquoted `=`, if there is one.
    pub key: Option<String>,
    /// The comma-separated fields after the `=` (or of the whole line).
    /// `[Strings]` lines have one field: the whole value.
    pub fields: Vec<String>,
}

impl InfLine {
    fn field(&self, i: usize) -> &str {
        self.fields.get(i).map_or("", String::as_str)
    }

    fn key_is(&self, name: &str) -> bool {
        self.key
            .as_deref()
            .is_some_and(|k| k.eq_ignore_ascii_case(name))
    }
}

#[derive(Debug, Clone)]
struct Section {
    name: String,
    /// 1-based line of the first `[name]` header.
    line: usize,
    lines: Vec<InfLine>,
}

/// `DriverVer`: the package's date and version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct DriverVer {
    /// Year, month, day.
    pub date: (u16, u8, u8),
    /// `w.x.y.z` (missing parts are 0).
    pub version: [u16; 4],
}

/// One parsed INF file.
#[derive(Debug, Clone)]
pub struct Inf {
    name: String,
    sections: Vec<Section>,
    /// Lower-cased section name → index.
    index: HashMap<String, usize>,
    /// Lower-cased token → value.
    strings: HashMap<String, String>,
    driver_ver: Option<DriverVer>,
    warnings: Vec<String>,
    /// Undefined `%token%`s with the line each is used on.
    undefined_strings: Vec<(usize, String)>,
}

/// A line before tokenising its value.
struct RawLine {
    number: usize,
    key: Option<String>,
    value: String,
}

struct RawSection {
    name: String,
    line: usize,
    lines: Vec<RawLine>,
}

impl Inf {
    /// Parses `bytes` (UTF-16LE with BOM, or UTF-8) as the INF `name`.
    pub fn parse(name: &str, bytes: &[u8]) -> Result<Self, InfError> {
        let text = decode(bytes);
        let raw = parse_sections(&text)?;
        let mut warnings = Vec::new();

        // [Strings], then the en-US overrides.
        let mut strings = HashMap::new();
        for wanted in ["strings", "strings.0409"] {
            for s in raw.iter().filter(|s| s.name.eq_ignore_ascii_case(wanted)) {
                for l in &s.lines {
                    match &l.key {
                        Some(k) => {
                            strings.insert(k.to_lowercase(), unquote(&l.value));
                        }
                        None => warnings.push(format!(
                            "[{}] line {}: a string needs `token = value`",
                            s.name, l.number
                        )),
                    }
                }
            }
        }

        let mut undefined: Vec<String> = Vec::new();
        let mut undefined_strings: Vec<(usize, String)> = Vec::new();
        let mut sections = Vec::with_capacity(raw.len());
        let mut index = HashMap::new();
        for s in raw {
            let folded = s.name.to_ascii_lowercase();
            let is_strings = folded == "strings" || folded.starts_with("strings.");
            let lines = s
                .lines
                .into_iter()
                .map(|l| {
                    let before = undefined.len();
                    let fields = if is_strings {
                        vec![unquote(&l.value)]
                    } else {
                        split_fields(&l.value)
                            .iter()
                            .map(|f| substitute(f, &strings, &mut undefined))
                            .collect()
                    };
                    let key = l.key.map(|k| {
                        if is_strings {
                            k
                        } else {
                            substitute(&k, &strings, &mut undefined)
                        }
                    });
                    for token in undefined.get(before..).unwrap_or_default() {
                        undefined_strings.push((l.number, token.clone()));
                    }
                    InfLine {
                        number: l.number,
                        key,
                        fields,
                    }
                })
                .collect();
            index.insert(s.name.to_lowercase(), sections.len());
            sections.push(Section {
                name: s.name,
                line: s.line,
                lines,
            });
        }
        undefined.sort_unstable_by_key(|t| t.to_lowercase());
        undefined.dedup_by(|a, b| a.eq_ignore_ascii_case(b));
        for t in undefined {
            warnings.push(format!("string token %{t}% is not defined in [Strings]"));
        }

        let mut inf = Self {
            name: name.to_owned(),
            sections,
            index,
            strings,
            driver_ver: None,
            warnings,
            undefined_strings,
        };
        inf.check_version()?;
        Ok(inf)
    }

    /// Checks `[Version]`: a missing section or a bad signature rejects the
    /// file; other InfVerif defects become warnings.
    fn check_version(&mut self) -> Result<(), InfError> {
        let version = self.section("Version").ok_or(InfError::NoVersion)?;
        let get = |k: &str| {
            version
                .iter()
                .find(|l| l.key_is(k))
                .map(|l| l.field(0).to_owned())
        };
        let signature = get("Signature").unwrap_or_default();
        if !["$windows nt$", "$chicago$"].contains(&signature.to_ascii_lowercase().as_str()) {
            return Err(InfError::BadSignature { found: signature });
        }
        let mut warnings = Vec::new();
        for k in ["Class", "ClassGuid", "Provider", "DriverVer", "CatalogFile"] {
            if get(k).is_none_or(|v| v.is_empty()) {
                warnings.push(format!("[Version] has no {k}"));
            }
        }
        if let Some(g) = get("ClassGuid").filter(|g| !g.is_empty() && !is_guid(g)) {
            warnings.push(format!("[Version] ClassGuid {g:?} is not a {{GUID}}"));
        }
        if get("Provider").is_some_and(|p| p.to_ascii_lowercase().contains("microsoft")) {
            warnings.push("[Version] Provider must not be Microsoft".to_owned());
        }
        if get("PnpLockdown").as_deref() != Some("1") {
            warnings.push("[Version] has no PnpLockdown = 1".to_owned());
        }
        let driver_ver = version
            .iter()
            .find(|l| l.key_is("DriverVer"))
            .map(|l| parse_driver_ver(l.field(0), l.field(1)));
        if let Some(None) = driver_ver {
            warnings.push("[Version] DriverVer is not `mm/dd/yyyy[,w.x.y.z]`".to_owned());
        }
        self.driver_ver = driver_ver.flatten();
        self.warnings.extend(warnings);
        Ok(())
    }

    /// The file name it was loaded as.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The lines of section `name` (case-insensitive), if it exists.
    pub fn section(&self, name: &str) -> Option<&[InfLine]> {
        self.index
            .get(&name.to_lowercase())
            .and_then(|&i| self.sections.get(i))
            .map(|s| s.lines.as_slice())
    }

    /// The line of section `name`'s first header (case-insensitive).
    pub fn section_line(&self, name: &str) -> Option<usize> {
        self.index
            .get(&name.to_lowercase())
            .and_then(|&i| self.sections.get(i))
            .map(|s| s.line)
    }

    /// Every use of a `%token%` that `[Strings]` does not define, with its
    /// line, in file order.
    pub fn undefined_strings(&self) -> &[(usize, String)] {
        &self.undefined_strings
    }

    /// Section names in the order they first appear.
    pub fn section_names(&self) -> impl Iterator<Item = &str> {
        self.sections.iter().map(|s| s.name.as_str())
    }

    /// The value of `%token%`, if `[Strings]` defines it.
    pub fn string(&self, token: &str) -> Option<&str> {
        self.strings.get(&token.to_lowercase()).map(String::as_str)
    }

    /// `[Version]` `DriverVer`, if present and well formed.
    pub fn driver_ver(&self) -> Option<DriverVer> {
        self.driver_ver
    }

    /// `[Version]` directive `key`'s first field.
    pub fn version_value(&self, key: &str) -> Option<&str> {
        self.section("Version")?
            .iter()
            .find(|l| l.key_is(key))
            .map(|l| l.field(0))
    }

    /// InfVerif-style defects that do not stop setup.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The stored name of section `name`, if it exists.
    fn section_name(&self, name: &str) -> Option<&str> {
        self.index
            .get(&name.to_lowercase())
            .and_then(|&i| self.sections.get(i))
            .map(|s| s.name.as_str())
    }
}

pub(crate) fn is_guid(s: &str) -> bool {
    let Some(inner) = s.strip_prefix('{').and_then(|s| s.strip_suffix('}')) else {
        return false;
    };
    let groups: Vec<&str> = inner.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.chars().all(|c| c.is_ascii_hexdigit()))
}

fn parse_driver_ver(date: &str, version: &str) -> Option<DriverVer> {
    let mut d = date.trim().split('/');
    let month: u8 = d.next()?.trim().parse().ok()?;
    let day: u8 = d.next()?.trim().parse().ok()?;
    let year: u16 = d.next()?.trim().parse().ok()?;
    if d.next().is_some() || !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    let mut v = [0u16; 4];
    let version = version.trim();
    if !version.is_empty() {
        let parts: Vec<&str> = version.split('.').collect();
        if parts.len() > 4 {
            return None;
        }
        for (slot, p) in v.iter_mut().zip(parts) {
            *slot = p.trim().parse().ok()?;
        }
    }
    Some(DriverVer {
        date: (year, month, day),
        version: v,
    })
}

// ---------------------------------------------------------------------------
// Lexing

/// Bytes to text: UTF-16LE/BE by BOM, else UTF-8 (a BOM is dropped;
/// invalid sequences become U+FFFD).
fn decode(bytes: &[u8]) -> String {
    let utf16 = |le: bool| {
        let units = bytes[2..].chunks_exact(2).map(|c| {
            let pair = [c[0], c[1]];
            if le {
                u16::from_le_bytes(pair)
            } else {
                u16::from_be_bytes(pair)
            }
        });
        char::decode_utf16(units)
            .map(|r| r.unwrap_or(char::REPLACEMENT_CHARACTER))
            .collect()
    };
    match bytes {
        [0xFF, 0xFE, ..] => utf16(true),
        [0xFE, 0xFF, ..] => utf16(false),
        [0xEF, 0xBB, 0xBF, rest @ ..] => String::from_utf8_lossy(rest).into_owned(),
        _ => String::from_utf8_lossy(bytes).into_owned(),
    }
}

/// Removes a `;` comment outside quotes; fails on an unterminated quote.
fn strip_comment(line: &str) -> Result<&str, &'static str> {
    let mut quoted = false;
    for (i, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ';' if !quoted => return Ok(&line[..i]),
            _ => {}
        }
    }
    if quoted {
        Err("unterminated quoted string")
    } else {
        Ok(line)
    }
}

/// Physical lines → logical lines (comment-free, continuations joined),
/// each with the number of its first physical line.
fn logical_lines(text: &str) -> Result<Vec<(usize, String)>, InfError> {
    let text = text.replace("\r\n", "\n");
    let mut out = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (i, physical) in text.split(['\n', '\r']).enumerate() {
        let number = i + 1;
        let content = strip_comment(physical).map_err(|reason| InfError::Syntax {
            line: number,
            reason,
        })?;
        let content = content.trim_end();
        let (body, continues) = match content.strip_suffix('\\') {
            Some(body) => (body, true),
            None => (content, false),
        };
        match pending.as_mut() {
            Some((_, acc)) => acc.push_str(body),
            None => pending = Some((number, body.to_owned())),
        }
        if !continues {
            out.extend(pending.take());
        }
    }
    out.extend(pending);
    Ok(out)
}

/// Splits at the first `=` outside quotes.
fn split_key(line: &str) -> (Option<&str>, &str) {
    let mut quoted = false;
    for (i, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '=' if !quoted => return (Some(line[..i].trim()), line[i + 1..].trim()),
            _ => {}
        }
    }
    (None, line)
}

/// Splits at `,` outside quotes and unquotes each field.
fn split_fields(value: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut quoted = false;
    let mut start = 0;
    for (i, c) in value.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                fields.push(unquote(&value[start..i]));
                start = i + 1;
            }
            _ => {}
        }
    }
    fields.push(unquote(&value[start..]));
    fields
}

/// Trims unquoted edge whitespace, removes quotes, turns `""` inside quotes
/// into `"`.
fn unquote(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut chars = field.trim().chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        if c == '"' {
            if quoted && chars.peek() == Some(&'"') {
                out.push('"');
                chars.next();
            } else {
                quoted = !quoted;
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Replaces `%token%` from `strings`, `%%` with `%`. Unknown tokens stay as
/// they are; non-numeric ones are reported in `undefined`.
fn substitute(s: &str, strings: &HashMap<String, String>, undefined: &mut Vec<String>) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        match after.find('%') {
            Some(0) => {
                out.push('%');
                rest = &after[1..];
            }
            Some(j) => {
                let token = &after[..j];
                match strings.get(&token.to_lowercase()) {
                    Some(v) => out.push_str(v),
                    None => {
                        if !token.bytes().all(|b| b.is_ascii_digit()) {
                            undefined.push(token.to_owned());
                        }
                        out.push('%');
                        out.push_str(token);
                        out.push('%');
                    }
                }
                rest = &after[j + 1..];
            }
            None => {
                out.push_str(&rest[i..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

fn parse_sections(text: &str) -> Result<Vec<RawSection>, InfError> {
    let mut sections: Vec<RawSection> = Vec::new();
    let mut by_name: HashMap<String, usize> = HashMap::new();
    let mut current: Option<usize> = None;
    for (number, line) in logical_lines(text)? {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let syntax = |reason| InfError::Syntax {
            line: number,
            reason,
        };
        if let Some(rest) = line.strip_prefix('[') {
            let end = rest
                .find(']')
                .ok_or_else(|| syntax("section header without `]`"))?;
            if !rest[end + 1..].trim().is_empty() {
                return Err(syntax("text after a section header"));
            }
            let name = unquote(&rest[..end]);
            if name.is_empty() {
                return Err(syntax("empty section name"));
            }
            let folded = name.to_lowercase();
            let i = *by_name.entry(folded).or_insert_with(|| {
                sections.push(RawSection {
                    name,
                    line: number,
                    lines: Vec::new(),
                });
                sections.len() - 1
            });
            current = Some(i);
            continue;
        }
        let i = current.ok_or_else(|| syntax("line outside any section"))?;
        let (key, value) = split_key(line);
        if let Some(section) = sections.get_mut(i) {
            section.lines.push(RawLine {
                number,
                key: key.map(unquote),
                value: value.to_owned(),
            });
        }
    }
    Ok(sections)
}

/// A decimal or `0x` hexadecimal number, as INF fields write them.
pub(crate) fn parse_u32(s: &str) -> Option<u32> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// A file of an INF directory: its file name and its bytes, or why they
/// could not be read.
pub(crate) type InfFile = (String, std::io::Result<Vec<u8>>);

/// Every `*.inf` (any case) file in `dir`, in file-name order.
pub(crate) fn read_inf_dir(dir: &Path) -> Result<Vec<InfFile>, LoadError> {
    let read_dir_error = |e: std::io::Error| LoadError::ReadDir {
        path: dir.to_owned(),
        reason: e.to_string(),
    };
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_dir_error)? {
        let path = entry.map_err(read_dir_error)?.path();
        let is_inf = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("inf"));
        if is_inf && path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    Ok(paths
        .into_iter()
        .map(|path| {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let bytes = std::fs::read(&path);
            (name, bytes)
        })
        .collect())
}

// ---------------------------------------------------------------------------
// The set and binding

/// Every INF the host knows, and the files it could not use.
#[derive(Debug, Clone, Default)]
pub struct InfSet {
    infs: Vec<Inf>,
    rejected: Vec<(String, InfError)>,
}

impl InfSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Loads every `*.inf` (any case) in `dir`, in file-name order. Files
    /// that are not usable INFs are recorded in [`Self::rejected`].
    pub fn load_dir(dir: impl AsRef<Path>) -> Result<Self, LoadError> {
        let mut set = Self::new();
        for (name, read) in read_inf_dir(dir.as_ref())? {
            match read {
                Ok(bytes) => {
                    // A rejection is recorded in the set.
                    let _ = set.add(&name, &bytes);
                }
                Err(e) => set.rejected.push((
                    name,
                    InfError::Read {
                        reason: e.to_string(),
                    },
                )),
            }
        }
        Ok(set)
    }

    /// A set from in-memory `(file name, text)` pairs, in the order given.
    pub fn from_sources(sources: &[(&str, &str)]) -> Self {
        let mut set = Self::new();
        for (name, text) in sources {
            // A rejection is recorded in the set.
            let _ = set.add(name, text.as_bytes());
        }
        set
    }

    /// Parses and adds one INF, replacing one of the same name. A file that
    /// is not a usable INF is recorded in [`Self::rejected`] and returned
    /// as the error.
    pub fn add(&mut self, name: &str, bytes: &[u8]) -> Result<(), InfError> {
        self.infs.retain(|i| !i.name.eq_ignore_ascii_case(name));
        self.rejected.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        match Inf::parse(name, bytes) {
            Ok(inf) => {
                self.infs.push(inf);
                Ok(())
            }
            Err(e) => {
                self.rejected.push((name.to_owned(), e.clone()));
                Err(e)
            }
        }
    }

    /// The usable INFs, in load order.
    pub fn infs(&self) -> &[Inf] {
        &self.infs
    }

    /// The INF loaded as `name`.
    pub fn get(&self, name: &str) -> Option<&Inf> {
        self.infs.iter().find(|i| i.name.eq_ignore_ascii_case(name))
    }

    /// Files that are not usable INFs, with the reason.
    pub fn rejected(&self) -> &[(String, InfError)] {
        &self.rejected
    }

    /// Finds the driver for a device with these IDs on `arch` (`NTamd64`,
    /// `NTarm64` or `NTx86`) and resolves everything its installation
    /// does; see the module documentation for the rules.
    pub fn bind(
        &self,
        hardware_ids: &[&str],
        compatible_ids: &[&str],
        arch: &str,
    ) -> Result<Binding, BindError> {
        let target = Arch::parse(arch).ok_or_else(|| BindError::UnsupportedArchitecture {
            arch: arch.to_owned(),
            reason: "the host models NTamd64, NTarm64 and NTx86".to_owned(),
        })?;
        let ids = DeviceIds {
            hardware: hardware_ids,
            compatible: compatible_ids,
        };
        let mut best: Option<Candidate<'_>> = None;
        let mut problems: Vec<String> = self
            .rejected
            .iter()
            .map(|(n, e)| format!("{n} was rejected: {e}"))
            .collect();
        let mut other_arch: Vec<String> = Vec::new();
        for (inf_index, inf) in self.infs.iter().enumerate() {
            search(
                inf,
                inf_index,
                &ids,
                target,
                &mut best,
                &mut problems,
                &mut other_arch,
            );
        }
        match best {
            Some(c) => install(c, target),
            None if !other_arch.is_empty() => Err(BindError::UnsupportedArchitecture {
                arch: target.name().to_owned(),
                reason: format!(
                    "the device's IDs are listed only for other platforms ({})",
                    other_arch.join(", ")
                ),
            }),
            None => Err(BindError::NoMatch {
                hardware_ids: hardware_ids.iter().map(|s| (*s).to_owned()).collect(),
                compatible_ids: compatible_ids.iter().map(|s| (*s).to_owned()).collect(),
                problems,
            }),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arch {
    X86,
    Amd64,
    Arm64,
}

impl Arch {
    fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "ntx86" => Some(Self::X86),
            "ntamd64" => Some(Self::Amd64),
            "ntarm64" => Some(Self::Arm64),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::X86 => "NTx86",
            Self::Amd64 => "NTamd64",
            Self::Arm64 => "NTarm64",
        }
    }

    /// Short name used in `[SourceDisksFiles.<arch>]` and the driver
    /// store folder.
    fn short(self) -> &'static str {
        match self {
            Self::X86 => "x86",
            Self::Amd64 => "amd64",
            Self::Arm64 => "arm64",
        }
    }

    /// Whether a decoration's platform part (after `NT`) targets us.
    fn accepts(self, platform: &str) -> bool {
        match self {
            Self::X86 => platform.is_empty() || platform.eq_ignore_ascii_case("x86"),
            _ => platform.eq_ignore_ascii_case(self.short()),
        }
    }
}

/// How well a models decoration fits the host: `None` if it does not
/// apply; otherwise higher is more specific.
fn decoration_score(decoration: &str, arch: Arch) -> Option<(u32, u32, u32, bool)> {
    let mut parts = decoration.trim().split('.');
    let first = parts.next()?;
    let platform = first.get(..2).filter(|p| p.eq_ignore_ascii_case("nt"))?;
    let platform = &first[platform.len()..];
    if !arch.accepts(platform) {
        return None;
    }
    let num = |p: Option<&str>| -> Option<Option<u32>> {
        match p.map(str::trim) {
            None | Some("") => Some(None),
            Some(s) => parse_u32(s).map(Some),
        }
    };
    let major = num(parts.next())?;
    let minor = num(parts.next())?;
    let product = num(parts.next())?;
    let _suite = num(parts.next())?;
    let build = num(parts.next())?;
    let version = (major.unwrap_or(0), minor.unwrap_or(0));
    if version > (HOST_OS.0, HOST_OS.1) {
        return None;
    }
    if build.is_some_and(|b| b > HOST_OS.2) {
        return None;
    }
    // The host is a workstation (VER_NT_WORKSTATION = 1).
    if product.is_some_and(|p| p != 1) {
        return None;
    }
    Some((version.0, version.1, build.unwrap_or(0), product.is_some()))
}

struct DeviceIds<'a> {
    hardware: &'a [&'a str],
    compatible: &'a [&'a str],
}

impl DeviceIds<'_> {
    /// The rank of a model line's IDs against the device's; lower is
    /// better.
    fn rank(&self, model_ids: &[String]) -> Option<(Rank, String)> {
        let mut best: Option<(Rank, String)> = None;
        for (j, id) in model_ids.iter().enumerate() {
            let id = id.trim();
            if id.is_empty() {
                continue;
            }
            let model_side = u8::from(j != 0);
            for (kind, list) in [(0u8, self.hardware), (1u8, self.compatible)] {
                for (i, device_id) in list.iter().enumerate() {
                    if device_id.trim().eq_ignore_ascii_case(id) {
                        let rank = Rank {
                            device_side: kind,
                            model_side,
                            device_index: i,
                            model_index: j,
                        };
                        if best.as_ref().is_none_or(|(r, _)| rank < *r) {
                            best = Some((rank, id.to_owned()));
                        }
                    }
                }
            }
        }
        best
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    device_side: u8,
    model_side: u8,
    device_index: usize,
    model_index: usize,
}

struct Candidate<'a> {
    inf: &'a Inf,
    inf_index: usize,
    rank: Rank,
    position: (usize, usize),
    models_section: String,
    line: &'a InfLine,
    matched_id: String,
}

impl Candidate<'_> {
    fn order(&self, other: &Self) -> Ordering {
        let key = |c: &Self| {
            let dv = c.inf.driver_ver.map(|d| (d.date, d.version));
            (c.rank, Reverse(dv), c.inf_index, c.position)
        };
        key(self).cmp(&key(other))
    }
}

/// Offers every model line of `inf` that matches the device.
fn search<'a>(
    inf: &'a Inf,
    inf_index: usize,
    ids: &DeviceIds<'_>,
    arch: Arch,
    best: &mut Option<Candidate<'a>>,
    problems: &mut Vec<String>,
    other_arch: &mut Vec<String>,
) {
    let Some(manufacturer) = inf.section("Manufacturer") else {
        return;
    };
    for (mfg_pos, mfg) in manufacturer.iter().enumerate() {
        let base = mfg.field(0).trim();
        if mfg.key.is_none() || base.is_empty() {
            problems.push(format!(
                "{}: [Manufacturer] line {} names no models section",
                inf.name, mfg.number
            ));
            continue;
        }
        let decorations: Vec<&str> = mfg.fields.iter().skip(1).map(|d| d.trim()).collect();
        let chosen = decorations
            .iter()
            .filter_map(|d| decoration_score(d, arch).map(|s| (s, *d)))
            .max_by(|a, b| a.0.cmp(&b.0))
            .map(|(_, d)| d);
        let models_name = match chosen {
            Some(d) => Some(format!("{base}.{d}")),
            // x86 falls back to the undecorated section; 64-bit Windows
            // never does.
            None if arch == Arch::X86 && inf.section(base).is_some() => Some(base.to_owned()),
            None => None,
        };
        let Some(models_name) = models_name else {
            // Not for us; note it if it would have matched elsewhere.
            let others = std::iter::once(base.to_owned())
                .chain(decorations.iter().map(|d| format!("{base}.{d}")));
            for other in others {
                let lines = inf.section(&other).unwrap_or_default();
                if lines
                    .iter()
                    .any(|l| ids.rank(l.fields.get(1..).unwrap_or_default()).is_some())
                {
                    other_arch.push(format!("{} [{other}]", inf.name));
                }
            }
            continue;
        };
        let Some(models) = inf.section(&models_name) else {
            problems.push(format!(
                "{}: [Manufacturer] line {} names [{models_name}], which does not exist",
                inf.name, mfg.number
            ));
            continue;
        };
        for (model_pos, line) in models.iter().enumerate() {
            let Some((rank, matched_id)) = ids.rank(line.fields.get(1..).unwrap_or_default())
            else {
                continue;
            };
            let candidate = Candidate {
                inf,
                inf_index,
                rank,
                position: (mfg_pos, model_pos),
                models_section: models_name.clone(),
                line,
                matched_id,
            };
            if best
                .as_ref()
                .is_none_or(|b| candidate.order(b) == Ordering::Less)
            {
                *best = Some(candidate);
            }
        }
    }
}

/// One registry write from an INF `AddReg` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegWrite {
    /// Path below the `HKR` key (`""` for the key itself).
    pub subkey: String,
    /// The value name (`""` for the default value).
    pub name: String,
    /// The value.
    pub value: RegValue,
    /// `FLG_ADDREG_NOCLOBBER`: leave an existing value alone.
    pub no_clobber: bool,
}

/// Everything the installation of a driver on one device does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The INF's file name.
    pub inf_name: String,
    /// The models section the match came from (decorated).
    pub models_section: String,
    /// The model line's description (`DeviceDesc`).
    pub model: String,
    /// The ID that matched.
    pub matched_id: String,
    /// The DDInstall section used, with its decoration.
    pub install_section: String,
    /// `[Version]` `ClassGuid`.
    pub class_guid: Option<String>,
    /// The service with `SPSVCINST_ASSOCSERVICE`: the function driver.
    pub function_service: String,
    /// Every service the `.Services` section adds, in order.
    pub services: Vec<String>,
    /// Upper filters in attach order (the first sits just above the
    /// function driver).
    pub upper_filters: Vec<String>,
    /// Lower filters in attach order (the first sits just above the bus
    /// driver).
    pub lower_filters: Vec<String>,
    /// `KmdfLibraryVersion` of the function driver's `KmdfService`.
    pub kmdf_version: Option<(u8, u8)>,
    /// Files the install section copies to the driver store.
    pub files: Vec<String>,
    /// Values for the device's hardware key (`.HW` `AddReg`, `HKR`).
    pub device_values: Vec<RegWrite>,
    /// The devnode's security descriptor: the `.HW` `AddReg` `Security`
    /// value at the root of `HKR`, which Windows applies as the device's
    /// security property (every device object of its stack), not as a
    /// registry value.
    pub security: Option<SecurityDescriptor>,
    /// Values for service keys: `(service, write)`, `HKR` = the service
    /// key `Services\<service>`.
    pub service_values: Vec<(String, RegWrite)>,
}

impl Binding {
    /// Writes the binding's registry state for device
    /// `device_instance_path` (layout in [`crate::registry`]).
    pub fn apply(
        &self,
        registry: &RegistryStore,
        device_instance_path: &str,
    ) -> Result<(), RegistryError> {
        let instance = registry::device_instance_key(device_instance_path);
        registry.set_value(
            &instance,
            "Service",
            RegValue::String(self.function_service.clone()),
        )?;
        registry.set_value(
            &instance,
            "DeviceDesc",
            RegValue::String(self.model.clone()),
        )?;
        if let Some(g) = &self.class_guid {
            registry.set_value(&instance, "ClassGUID", RegValue::String(g.clone()))?;
        }
        for (name, list) in [
            ("UpperFilters", &self.upper_filters),
            ("LowerFilters", &self.lower_filters),
        ] {
            if list.is_empty() {
                match registry.delete_value(&instance, name) {
                    Ok(()) | Err(RegistryError::ValueNotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            } else {
                registry.set_value(&instance, name, RegValue::MultiString(list.clone()))?;
            }
        }
        let hardware = registry::device_parameters_key(device_instance_path);
        registry.create_key(&hardware)?;
        for w in &self.device_values {
            write(registry, &hardware, w)?;
        }
        for (service, w) in &self.service_values {
            write(registry, &registry::service_key(service), w)?;
        }
        Ok(())
    }
}

fn write(registry: &RegistryStore, base: &str, w: &RegWrite) -> Result<(), RegistryError> {
    let path = if w.subkey.is_empty() {
        base.to_owned()
    } else {
        format!("{base}\\{}", w.subkey)
    };
    if w.no_clobber && registry.get_value(&path, &w.name).is_some() {
        return Ok(());
    }
    registry.set_value(&path, &w.name, w.value.clone())
}

// ---------------------------------------------------------------------------
// Installation

/// Error constructors bound to one INF.
struct Ctx<'a> {
    inf: &'a Inf,
}

impl Ctx<'_> {
    fn malformed(
        &self,
        section: &str,
        line: Option<usize>,
        reason: impl Into<String>,
    ) -> BindError {
        BindError::Malformed {
            inf: self.inf.name.clone(),
            section: section.to_owned(),
            line,
            reason: reason.into(),
        }
    }

    fn unsupported(&self, section: &str, line: usize, reason: impl Into<String>) -> BindError {
        BindError::Unsupported {
            inf: self.inf.name.clone(),
            section: section.to_owned(),
            line,
            reason: reason.into(),
        }
    }

    fn missing(&self, section: &str, directive: String) -> BindError {
        BindError::SectionMissing {
            inf: self.inf.name.clone(),
            section: section.to_owned(),
            directive,
        }
    }

    /// A section a directive names; `SectionMissing` if absent.
    fn referenced(&self, name: &str, directive: &str, from: &str) -> Result<&[InfLine], BindError> {
        self.inf
            .section(name)
            .ok_or_else(|| self.missing(name, format!("{directive} in [{from}]")))
    }

    /// The directive every line of a directive-only section must have.
    fn directive(&self, section: &str, line: &InfLine) -> Result<String, BindError> {
        line.key
            .as_deref()
            .map(str::to_ascii_lowercase)
            .ok_or_else(|| {
                self.malformed(section, Some(line.number), "expected `directive = value`")
            })
    }

    fn refuse_include(
        &self,
        section: &str,
        line: &InfLine,
        directive: &str,
    ) -> Result<(), BindError> {
        if directive == "include" || directive == "needs" {
            return Err(self.unsupported(
                section,
                line.number,
                "Include/Needs pull in sections of other INFs, which the host does not model",
            ));
        }
        Ok(())
    }
}

/// A declarative filter's placement.
enum Placement {
    Upper,
    Lower,
    Level(String),
}

struct DeclaredFilter {
    service: String,
    placement: Placement,
    section: String,
    line: usize,
}

/// What the `.HW` section says about filters.
#[derive(Default)]
struct FilterValues {
    upper: Vec<String>,
    lower: Vec<String>,
    upper_levels: Vec<String>,
    lower_levels: Vec<String>,
    upper_default: Option<String>,
    lower_default: Option<String>,
}

struct ServiceInstall {
    name: String,
    values: Vec<RegWrite>,
    binary_file: String,
    section: String,
    binary_line: usize,
}

fn install(c: Candidate<'_>, arch: Arch) -> Result<Binding, BindError> {
    let inf = c.inf;
    let ctx = Ctx { inf };
    let model = c.line.key.clone().unwrap_or_default();
    let base = c.line.field(0).trim();
    if base.is_empty() {
        return Err(ctx.malformed(
            &c.models_section,
            Some(c.line.number),
            "the model line names no install section",
        ));
    }

    // 3. The DDInstall section and its decoration.
    let tried: Vec<String> = [
        format!("{base}.{}", arch.name()),
        format!("{base}.NT"),
        base.to_owned(),
    ]
    .into_iter()
    .collect();
    let install_section = tried
        .iter()
        .find_map(|n| inf.section_name(n))
        .map(str::to_owned)
        .ok_or_else(|| BindError::InstallSectionMissing {
            inf: inf.name.clone(),
            model: model.clone(),
            section: base.to_owned(),
            tried: tried.clone(),
        })?;

    let files = install_files(&ctx, &install_section, arch)?;

    // 5a. `.HW`: device values and legacy filters.
    let hw_name = format!("{install_section}.HW");
    let mut device_values = Vec::new();
    let mut security = None;
    let mut filter_values = FilterValues::default();
    if let Some(hw) = inf.section(&hw_name) {
        for line in hw {
            let directive = ctx.directive(&hw_name, line)?;
            ctx.refuse_include(&hw_name, line, &directive)?;
            if directive != "addreg" {
                continue;
            }
            for name in line
                .fields
                .iter()
                .map(|f| f.trim())
                .filter(|f| !f.is_empty())
            {
                for reg_line in ctx.referenced(name, "AddReg", &hw_name)? {
                    let w = parse_addreg(&ctx, name, reg_line)?;
                    if !take_filter_value(&ctx, name, reg_line, &w, &mut filter_values)?
                        && !take_security_value(&ctx, name, reg_line, &w, &mut security)?
                    {
                        device_values.push(w);
                    }
                }
            }
        }
    }

    // 4. `.Services`.
    let services_name = format!("{install_section}.Services");
    let services_lines =
        inf.section(&services_name)
            .ok_or_else(|| BindError::ServicesSectionMissing {
                inf: inf.name.clone(),
                section: services_name.clone(),
            })?;
    let mut function_service: Option<String> = None;
    let mut services: Vec<ServiceInstall> = Vec::new();
    for line in services_lines {
        let directive = ctx.directive(&services_name, line)?;
        ctx.refuse_include(&services_name, line, &directive)?;
        if directive != "addservice" {
            continue;
        }
        let name = line.field(0).trim();
        let flags_text = line.field(1).trim();
        let flags = if flags_text.is_empty() {
            0
        } else {
            parse_u32(flags_text).ok_or_else(|| {
                ctx.malformed(
                    &services_name,
                    Some(line.number),
                    format!("AddService flags {flags_text:?} are not a number"),
                )
            })?
        };
        if flags & SPSVCINST_ASSOCSERVICE != 0 {
            if name.is_empty() {
                return Err(BindError::NoFunctionService {
                    inf: inf.name.clone(),
                    section: services_name.clone(),
                    reason: "the 0x2 AddService names no service (a raw device's null driver), which the host cannot start".to_owned(),
                });
            }
            if let Some(first) = &function_service {
                return Err(ctx.malformed(
                    &services_name,
                    Some(line.number),
                    format!("a second function service {name:?} (flag 0x2) after {first:?}"),
                ));
            }
            function_service = Some(name.to_owned());
        }
        if name.is_empty() {
            return Err(ctx.malformed(
                &services_name,
                Some(line.number),
                "AddService names no service",
            ));
        }
        if services.iter().any(|s| s.name.eq_ignore_ascii_case(name)) {
            return Err(ctx.malformed(
                &services_name,
                Some(line.number),
                format!("service {name:?} is added twice"),
            ));
        }
        let section = line.field(2).trim();
        if section.is_empty() {
            return Err(ctx.malformed(
                &services_name,
                Some(line.number),
                format!("AddService {name:?} names no service install section"),
            ));
        }
        let lines = inf
            .section(section)
            .ok_or_else(|| BindError::ServiceSectionMissing {
                inf: inf.name.clone(),
                service: name.to_owned(),
                section: section.to_owned(),
            })?;
        services.push(service_install(&ctx, name, section, lines, arch)?);
    }
    let function_service = function_service.ok_or_else(|| BindError::NoFunctionService {
        inf: inf.name.clone(),
        section: services_name.clone(),
        reason: "no AddService has flag 0x2 (SPSVCINST_ASSOCSERVICE)".to_owned(),
    })?;
    for s in &services {
        if !files.iter().any(|f| f.eq_ignore_ascii_case(&s.binary_file)) {
            return Err(ctx.malformed(
                &s.section,
                Some(s.binary_line),
                format!(
                    "ServiceBinary {:?} is not copied by [{install_section}] CopyFiles",
                    s.binary_file
                ),
            ));
        }
    }
    let find_service = |name: &str| services.iter().find(|s| s.name.eq_ignore_ascii_case(name));

    // 5b. `.Filters`.
    let filters_name = format!("{install_section}.Filters");
    let mut declared = Vec::new();
    if let Some(lines) = inf.section(&filters_name) {
        for line in lines {
            let directive = ctx.directive(&filters_name, line)?;
            ctx.refuse_include(&filters_name, line, &directive)?;
            if directive != "addfilter" {
                continue;
            }
            declared.push(add_filter(&ctx, &filters_name, line)?);
        }
    }
    let (upper_filters, lower_filters) = assemble_filters(&ctx, &hw_name, filter_values, declared)?;
    for f in upper_filters.iter().chain(&lower_filters) {
        if f.eq_ignore_ascii_case(&function_service) {
            return Err(ctx.malformed(
                &services_name,
                None,
                format!("{f:?} is both the function driver and a filter"),
            ));
        }
        if find_service(f).is_none() {
            return Err(ctx.malformed(
                &services_name,
                None,
                format!("filter {f:?} has no AddService here"),
            ));
        }
    }

    // `.Wdf`.
    let wdf_name = format!("{install_section}.Wdf");
    let mut kmdf_version = None;
    if let Some(lines) = inf.section(&wdf_name) {
        for line in lines {
            let directive = ctx.directive(&wdf_name, line)?;
            ctx.refuse_include(&wdf_name, line, &directive)?;
            if directive != "kmdfservice" {
                continue;
            }
            let service = line.field(0).trim();
            let section = line.field(1).trim();
            if service.is_empty() || section.is_empty() {
                return Err(ctx.malformed(
                    &wdf_name,
                    Some(line.number),
                    "KmdfService needs `service, wdf-install-section`",
                ));
            }
            if find_service(service).is_none() {
                return Err(ctx.malformed(
                    &wdf_name,
                    Some(line.number),
                    format!("KmdfService {service:?} has no AddService in [{services_name}]"),
                ));
            }
            let version = kmdf_library_version(
                &ctx,
                ctx.referenced(section, "KmdfService", &wdf_name)?,
                section,
            )?;
            if service.eq_ignore_ascii_case(&function_service) {
                kmdf_version = Some(version);
            }
        }
    }

    let service_values = services
        .iter()
        .flat_map(|s| s.values.iter().map(|w| (s.name.clone(), w.clone())))
        .collect();
    Ok(Binding {
        inf_name: inf.name.clone(),
        models_section: c.models_section,
        model,
        matched_id: c.matched_id,
        install_section,
        class_guid: inf
            .version_value("ClassGuid")
            .filter(|g| !g.is_empty())
            .map(str::to_owned),
        function_service,
        services: services.iter().map(|s| s.name.clone()).collect(),
        upper_filters,
        lower_filters,
        kmdf_version,
        files,
        device_values,
        security,
        service_values,
    })
}

/// The DDInstall section's directives: `CopyFiles` (checked against
/// `[SourceDisksFiles]` and `[DestinationDirs]`); `AddReg` and
/// `Include`/`Needs` are refused.
fn install_files(
    ctx: &Ctx<'_>,
    install_section: &str,
    arch: Arch,
) -> Result<Vec<String>, BindError> {
    let inf = ctx.inf;
    let lines = inf.section(install_section).unwrap_or_default();
    let source_files: Vec<&str> = [
        "SourceDisksFiles".to_owned(),
        format!("SourceDisksFiles.{}", arch.short()),
    ]
    .iter()
    .filter_map(|s| inf.section(s))
    .flatten()
    .filter_map(|l| l.key.as_deref())
    .collect();
    let dest_dir = |copy_section: &str| {
        let dirs = inf.section("DestinationDirs").unwrap_or_default();
        dirs.iter()
            .find(|l| l.key_is(copy_section))
            .or_else(|| dirs.iter().find(|l| l.key_is("DefaultDestDir")))
            .map(|l| l.field(0).trim().to_owned())
    };
    let mut files = Vec::new();
    for line in lines {
        let directive = ctx.directive(install_section, line)?;
        ctx.refuse_include(install_section, line, &directive)?;
        match directive.as_str() {
            "addreg" => {
                return Err(ctx.unsupported(
                    install_section,
                    line.number,
                    format!(
                        "AddReg in the DDInstall section writes the driver's software key, which the host does not model; put device settings in [{install_section}.HW]"
                    ),
                ));
            }
            "copyfiles" => {}
            _ => continue,
        }
        for entry in line
            .fields
            .iter()
            .map(|f| f.trim())
            .filter(|f| !f.is_empty())
        {
            // (installed name, source name, line)
            let (copied, dest_key): (Vec<(String, String, usize)>, &str) =
                match entry.strip_prefix('@') {
                    Some(file) => {
                        let file = file.trim().to_owned();
                        (vec![(file.clone(), file, line.number)], "DefaultDestDir")
                    }
                    None => {
                        let copy = ctx.referenced(entry, "CopyFiles", install_section)?;
                        let mut list = Vec::new();
                        for l in copy {
                            let dest = l.field(0).trim();
                            if l.key.is_some() || dest.is_empty() {
                                return Err(ctx.malformed(
                                    entry,
                                    Some(l.number),
                                    "a file-list line is `destination-file[, source-file]`",
                                ));
                            }
                            let source = Some(l.field(1).trim())
                                .filter(|s| !s.is_empty())
                                .unwrap_or(dest);
                            list.push((dest.to_owned(), source.to_owned(), l.number));
                        }
                        (list, entry)
                    }
                };
            match dest_dir(dest_key).as_deref() {
                Some("13") => {}
                Some(other) => {
                    return Err(ctx.malformed(
                        "DestinationDirs",
                        None,
                        format!("{entry} goes to DIRID {other}; driver files must go to the driver store (13)"),
                    ));
                }
                None => {
                    return Err(ctx.malformed(
                        "DestinationDirs",
                        None,
                        format!("no destination for {entry} and no DefaultDestDir"),
                    ));
                }
            }
            for (dest, source, number) in copied {
                if !source_files
                    .iter()
                    .any(|s| s.trim().eq_ignore_ascii_case(&source))
                {
                    return Err(ctx.malformed(
                        install_section,
                        Some(number),
                        format!("{source:?} is not listed in [SourceDisksFiles]"),
                    ));
                }
                files.push(dest);
            }
        }
    }
    Ok(files)
}

/// One service install section: the standard service values and its
/// `AddReg` writes.
fn service_install(
    ctx: &Ctx<'_>,
    name: &str,
    section: &str,
    lines: &[InfLine],
    arch: Arch,
) -> Result<ServiceInstall, BindError> {
    let mut service_type = None;
    let mut start = None;
    let mut error_control = None;
    let mut binary: Option<(String, usize)> = None;
    let mut display_name = None;
    let mut extra = Vec::new();
    for line in lines {
        let directive = ctx.directive(section, line)?;
        ctx.refuse_include(section, line, &directive)?;
        let number = |max: u32, what: &str| {
            parse_u32(line.field(0))
                .filter(|v| *v <= max)
                .ok_or_else(|| {
                    ctx.malformed(
                        section,
                        Some(line.number),
                        format!("{what} {:?} is not a number in 0..={max}", line.field(0)),
                    )
                })
        };
        match directive.as_str() {
            "servicetype" => {
                let t = number(u32::MAX, "ServiceType")?;
                if t != 1 {
                    return Err(ctx.malformed(
                        section,
                        Some(line.number),
                        format!("ServiceType {t} is not 1 (SERVICE_KERNEL_DRIVER)"),
                    ));
                }
                service_type = Some(t);
            }
            "starttype" => start = Some(number(4, "StartType")?),
            "errorcontrol" => error_control = Some(number(3, "ErrorControl")?),
            "servicebinary" => binary = Some((line.field(0).trim().to_owned(), line.number)),
            "displayname" => display_name = Some(line.field(0).to_owned()),
            "addreg" => {
                for reg in line
                    .fields
                    .iter()
                    .map(|f| f.trim())
                    .filter(|f| !f.is_empty())
                {
                    for reg_line in ctx.referenced(reg, "AddReg", section)? {
                        extra.push(parse_addreg(ctx, reg, reg_line)?);
                    }
                }
            }
            _ => {}
        }
    }
    let missing = |what: &str| ctx.malformed(section, None, format!("no {what}"));
    let service_type = service_type.ok_or_else(|| missing("ServiceType"))?;
    let start = start.ok_or_else(|| missing("StartType"))?;
    let error_control = error_control.ok_or_else(|| missing("ErrorControl"))?;
    let (binary, binary_line) = binary.ok_or_else(|| missing("ServiceBinary"))?;
    let binary_file = binary
        .strip_prefix("%13%\\")
        .filter(|f| !f.is_empty() && !f.contains('\\'))
        .ok_or_else(|| {
            ctx.malformed(
                section,
                Some(binary_line),
                format!("ServiceBinary {binary:?} is not `%13%\\file` (the driver store)"),
            )
        })?
        .to_owned();
    let image_path = format!(
        "\\SystemRoot\\System32\\DriverStore\\FileRepository\\{}_{}\\{binary_file}",
        ctx.inf.name.to_lowercase(),
        arch.short()
    );
    let dword = |n: &str, v: u32| RegWrite {
        subkey: String::new(),
        name: n.to_owned(),
        value: RegValue::Dword(v),
        no_clobber: false,
    };
    let mut values = vec![
        dword("Type", service_type),
        dword("Start", start),
        dword("ErrorControl", error_control),
        RegWrite {
            subkey: String::new(),
            name: "ImagePath".to_owned(),
            value: RegValue::String(image_path),
            no_clobber: false,
        },
    ];
    if let Some(d) = display_name {
        values.push(RegWrite {
            subkey: String::new(),
            name: "DisplayName".to_owned(),
            value: RegValue::String(d),
            no_clobber: false,
        });
    }
    values.extend(extra);
    Ok(ServiceInstall {
        name: name.to_owned(),
        values,
        binary_file,
        section: section.to_owned(),
        binary_line,
    })
}

const FLG_ADDREG_BINVALUETYPE: u32 = 0x0000_0001;
const FLG_ADDREG_NOCLOBBER: u32 = 0x0000_0002;
const FLG_ADDREG_64BITKEY: u32 = 0x0000_1000;
const FLG_ADDREG_TYPE_MASK: u32 = 0xFFFF_0000 | FLG_ADDREG_BINVALUETYPE;
const FLG_ADDREG_TYPE_SZ: u32 = 0x0000_0000;
const FLG_ADDREG_TYPE_MULTI_SZ: u32 = 0x0001_0000;
const FLG_ADDREG_TYPE_EXPAND_SZ: u32 = 0x0002_0000;
const FLG_ADDREG_TYPE_DWORD: u32 = 0x0001_0001;

/// One `AddReg` line: `HKR, [subkey], [name], [flags], [value...]`.
fn parse_addreg(ctx: &Ctx<'_>, section: &str, line: &InfLine) -> Result<RegWrite, BindError> {
    let bad = |reason: String| ctx.malformed(section, Some(line.number), reason);
    if line.key.is_some() {
        return Err(bad(
            "an AddReg line has no `key =` (quote values that contain `=`)".to_owned(),
        ));
    }
    let root = line.field(0).trim();
    if !root.eq_ignore_ascii_case("HKR") {
        return Err(bad(format!(
            "registry root {root:?}: only HKR is allowed (InfVerif)"
        )));
    }
    if line.fields.len() < 3 {
        return Err(ctx.unsupported(
            section,
            line.number,
            "an AddReg entry without a value name (key creation only)",
        ));
    }
    let subkey = line.field(1).trim().to_owned();
    if !subkey.is_empty() && registry::check_path(&subkey).is_err() {
        return Err(bad(format!("subkey {subkey:?} is not a valid key path")));
    }
    let name = line.field(2).to_owned();
    if registry::check_value_name(&name).is_err() {
        return Err(bad("the value name is too long".to_owned()));
    }
    let flags_text = line.field(3).trim();
    let flags = if flags_text.is_empty() {
        0
    } else {
        parse_u32(flags_text)
            .ok_or_else(|| bad(format!("flags {flags_text:?} are not a number")))?
    };
    let modifiers = flags & !FLG_ADDREG_TYPE_MASK & !FLG_ADDREG_NOCLOBBER & !FLG_ADDREG_64BITKEY;
    if modifiers != 0 {
        return Err(ctx.unsupported(
            section,
            line.number,
            format!(
                "AddReg flags {modifiers:#x} (APPEND 0x8, DELVAL 0x4, KEYONLY 0x10, OVERWRITEONLY 0x20, 32BITKEY 0x4000, ...)"
            ),
        ));
    }
    let data: Vec<&str> = line.fields.iter().skip(4).map(String::as_str).collect();
    let value = match flags & FLG_ADDREG_TYPE_MASK {
        FLG_ADDREG_TYPE_SZ | FLG_ADDREG_TYPE_EXPAND_SZ => {
            RegValue::String(data.first().copied().unwrap_or_default().to_owned())
        }
        FLG_ADDREG_TYPE_MULTI_SZ => RegValue::MultiString(
            data.iter()
                .filter(|s| !s.is_empty())
                .map(|s| (*s).to_owned())
                .collect(),
        ),
        FLG_ADDREG_TYPE_DWORD => match data.as_slice() {
            [v] => RegValue::Dword(
                parse_u32(v).ok_or_else(|| bad(format!("DWORD value {v:?} is not a number")))?,
            ),
            [_, _, _, _] => {
                let b =
                    parse_bytes(&data).ok_or_else(|| bad("DWORD bytes are not hex".to_owned()))?;
                RegValue::Dword(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            _ => return Err(bad("a DWORD needs one number or four bytes".to_owned())),
        },
        t if t & FLG_ADDREG_BINVALUETYPE != 0 => RegValue::Binary(
            parse_bytes(&data).ok_or_else(|| bad("binary data are not hex bytes".to_owned()))?,
        ),
        t => {
            return Err(bad(format!(
                "value type flags {t:#x} are not a registry type"
            )));
        }
    };
    Ok(RegWrite {
        subkey,
        name,
        value,
        no_clobber: flags & FLG_ADDREG_NOCLOBBER != 0,
    })
}

fn parse_bytes(fields: &[&str]) -> Option<Vec<u8>> {
    fields
        .iter()
        .map(|f| {
            let f = f.trim();
            let f = f
                .strip_prefix("0x")
                .or_else(|| f.strip_prefix("0X"))
                .unwrap_or(f);
            if f.is_empty() || f.len() > 2 {
                return None;
            }
            u8::from_str_radix(f, 16).ok()
        })
        .collect()
}

/// Takes the filter values out of `.HW` writes; `true` if `w` was one.
fn take_filter_value(
    ctx: &Ctx<'_>,
    section: &str,
    line: &InfLine,
    w: &RegWrite,
    into: &mut FilterValues,
) -> Result<bool, BindError> {
    if !w.subkey.is_empty() {
        return Ok(false);
    }
    let name = w.name.to_ascii_lowercase();
    let (list, single): (Option<&mut Vec<String>>, Option<&mut Option<String>>) =
        match name.as_str() {
            "upperfilters" => (Some(&mut into.upper), None),
            "lowerfilters" => (Some(&mut into.lower), None),
            "upperfilterlevels" => (Some(&mut into.upper_levels), None),
            "lowerfilterlevels" => (Some(&mut into.lower_levels), None),
            "upperfilterdefaultlevel" => (None, Some(&mut into.upper_default)),
            "lowerfilterdefaultlevel" => (None, Some(&mut into.lower_default)),
            _ => return Ok(false),
        };
    match (list, single, &w.value) {
        (Some(list), _, RegValue::MultiString(v)) => *list = v.clone(),
        (_, Some(single), RegValue::String(s)) => *single = Some(s.clone()),
        (Some(_), _, _) => {
            return Err(ctx.malformed(
                section,
                Some(line.number),
                format!("{} must be REG_MULTI_SZ (0x00010000)", w.name),
            ));
        }
        _ => {
            return Err(ctx.malformed(
                section,
                Some(line.number),
                format!("{} must be REG_SZ", w.name),
            ));
        }
    }
    Ok(true)
}

/// Takes the `Security` value out of `.HW` writes into `into`; `true` if
/// `w` was it. The SDDL must be a `REG_SZ` the host's security model
/// parses: Windows fails the installation of a descriptor it cannot
/// convert, so a malformed one fails the binding here.
fn take_security_value(
    ctx: &Ctx<'_>,
    section: &str,
    line: &InfLine,
    w: &RegWrite,
    into: &mut Option<SecurityDescriptor>,
) -> Result<bool, BindError> {
    if !w.subkey.is_empty() || !w.name.eq_ignore_ascii_case("Security") {
        return Ok(false);
    }
    let bad = |reason: String| ctx.malformed(section, Some(line.number), reason);
    let RegValue::String(sddl) = &w.value else {
        return Err(bad("Security must be a REG_SZ SDDL string".to_owned()));
    };
    let descriptor = SecurityDescriptor::from_sddl(sddl)
        .map_err(|e| bad(format!("Security is not a usable descriptor: {e}")))?;
    // NOCLOBBER keeps a descriptor an earlier line set.
    if !(w.no_clobber && into.is_some()) {
        *into = Some(descriptor);
    }
    Ok(true)
}

fn add_filter(
    ctx: &Ctx<'_>,
    filters_name: &str,
    line: &InfLine,
) -> Result<DeclaredFilter, BindError> {
    let bad = |reason: String| ctx.malformed(filters_name, Some(line.number), reason);
    let service = line.field(0).trim();
    if service.is_empty() {
        return Err(bad("AddFilter names no service".to_owned()));
    }
    let flags = line.field(1).trim();
    if !flags.is_empty() && parse_u32(flags) != Some(0) {
        return Err(bad(format!("AddFilter flags {flags:?} must be 0")));
    }
    let section = line.field(2).trim();
    if section.is_empty() {
        return Err(bad(format!(
            "AddFilter {service:?} names no filter install section"
        )));
    }
    let lines = ctx.referenced(section, "AddFilter", filters_name)?;
    let mut placement = None;
    let mut number = line.number;
    for l in lines {
        let directive = ctx.directive(section, l)?;
        let p = match directive.as_str() {
            "filterposition" => match l.field(0).trim() {
                p if p.eq_ignore_ascii_case("upper") => Placement::Upper,
                p if p.eq_ignore_ascii_case("lower") => Placement::Lower,
                other => {
                    return Err(ctx.malformed(
                        section,
                        Some(l.number),
                        format!("FilterPosition {other:?} is not Upper or Lower"),
                    ));
                }
            },
            "filterlevel" => Placement::Level(l.field(0).trim().to_owned()),
            _ => continue,
        };
        if placement.is_some() {
            return Err(ctx.malformed(
                section,
                Some(l.number),
                "give FilterPosition or FilterLevel, once",
            ));
        }
        placement = Some(p);
        number = l.number;
    }
    let placement = placement.ok_or_else(|| {
        ctx.malformed(
            section,
            None,
            "a filter install section needs FilterPosition or FilterLevel",
        )
    })?;
    Ok(DeclaredFilter {
        service: service.to_owned(),
        placement,
        section: section.to_owned(),
        line: number,
    })
}

/// Legacy lists first, then declarative filters ordered by level.
fn assemble_filters(
    ctx: &Ctx<'_>,
    hw_name: &str,
    values: FilterValues,
    declared: Vec<DeclaredFilter>,
) -> Result<(Vec<String>, Vec<String>), BindError> {
    let level_index =
        |levels: &[String], name: &str| levels.iter().position(|l| l.eq_ignore_ascii_case(name));
    for (default, levels, what) in [
        (
            &values.upper_default,
            &values.upper_levels,
            "UpperFilterDefaultLevel",
        ),
        (
            &values.lower_default,
            &values.lower_levels,
            "LowerFilterDefaultLevel",
        ),
    ] {
        if let Some(d) = default
            && level_index(levels, d).is_none()
        {
            return Err(ctx.malformed(
                hw_name,
                None,
                format!("{what} {d:?} is not one of the levels"),
            ));
        }
    }
    // (upper?, level index, INF order, service)
    let mut placed: Vec<(bool, usize, usize, String)> = Vec::new();
    for (order, f) in declared.into_iter().enumerate() {
        let default_index = |default: &Option<String>, levels: &[String]| {
            default
                .as_deref()
                .and_then(|d| level_index(levels, d))
                .unwrap_or(usize::MAX)
        };
        let (upper, index) = match &f.placement {
            Placement::Upper => (
                true,
                default_index(&values.upper_default, &values.upper_levels),
            ),
            Placement::Lower => (
                false,
                default_index(&values.lower_default, &values.lower_levels),
            ),
            Placement::Level(level) => match (
                level_index(&values.upper_levels, level),
                level_index(&values.lower_levels, level),
            ) {
                (Some(i), _) => (true, i),
                (None, Some(i)) => (false, i),
                (None, None) => {
                    return Err(ctx.malformed(
                        &f.section,
                        Some(f.line),
                        format!(
                            "FilterLevel {level:?} is not in UpperFilterLevels or LowerFilterLevels of [{hw_name}] (Windows would silently leave {:?} out)",
                            f.service
                        ),
                    ));
                }
            },
        };
        placed.push((upper, index, order, f.service));
    }
    placed.sort_by_key(|(upper, index, order, _)| (!*upper, *index, *order));
    let mut upper = values.upper;
    let mut lower = values.lower;
    for (is_upper, _, _, service) in placed {
        if is_upper {
            upper.push(service);
        } else {
            lower.push(service);
        }
    }
    let all: Vec<&String> = upper.iter().chain(&lower).collect();
    for (i, a) in all.iter().enumerate() {
        if all[..i].iter().any(|b| b.eq_ignore_ascii_case(a)) {
            return Err(ctx.malformed(hw_name, None, format!("filter {a:?} is listed twice")));
        }
    }
    Ok((upper, lower))
}

fn kmdf_library_version(
    ctx: &Ctx<'_>,
    lines: &[InfLine],
    section: &str,
) -> Result<(u8, u8), BindError> {
    let line = lines
        .iter()
        .find(|l| l.key_is("KmdfLibraryVersion"))
        .ok_or_else(|| ctx.malformed(section, None, "no KmdfLibraryVersion"))?;
    let text = line.field(0).trim();
    let parsed = text
        .split_once('.')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
    parsed.ok_or_else(|| {
        ctx.malformed(
            section,
            Some(line.number),
            format!("KmdfLibraryVersion {text:?} is not `major.minor` (an unstamped INX?)"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use driver_platform::{Registry, RegistryKey};
    use proptest::prelude::*;

    const HCA_FULL: &str = "PCI\\VEN_F1B0&DEV_0001&SUBSYS_0001F1B0&REV_01";
    /// The IDs Windows' PCI bus reports for our HCA.
    const HCA_HW: [&str; 4] = [
        HCA_FULL,
        "PCI\\VEN_F1B0&DEV_0001&SUBSYS_0001F1B0",
        "PCI\\VEN_F1B0&DEV_0001&REV_01",
        "PCI\\VEN_F1B0&DEV_0001",
    ];
    const HCA_COMPAT: [&str; 3] = [
        "PCI\\VEN_F1B0&DEV_0001&REV_01",
        "PCI\\VEN_F1B0&CC_020700",
        "PCI\\CC_0207",
    ];
    const HCA_INSTANCE: &str = "PCI\\VEN_F1B0&DEV_0001&SUBSYS_0001F1B0&REV_01\\3&11583659&0&10";

    fn workspace() -> InfSet {
        InfSet::load_dir(workspace_inf_dir()).expect("inf/ is readable")
    }

    /// A test package: boilerplate Version, files, Manufacturer
    /// (`Models.NTamd64` holding `models`), then `rest`.
    fn pkg(models: &str, rest: &str) -> String {
        format!(
            r#"[Version]
Signature = "$Windows NT$"
Class = System
ClassGuid = {{4d36e97d-e325-11ce-bfc1-08002be10318}}
Provider = %P%
DriverVer = 01/01/2026,1.0.0.0
CatalogFile = t.cat
PnpLockdown = 1
[SourceDisksNames]
1 = %P%
[SourceDisksFiles]
svc.sys = 1
flt.sys = 1
[DestinationDirs]
DefaultDestDir = 13
[Manufacturer]
%P% = Models, NTamd64
[Models.NTamd64]
{models}
{rest}
[Strings]
P = "Test"
"#
        )
    }

    /// A complete, valid install of service `svc` from section `Inst`.
    const INSTALL: &str = r"
[Inst.NT]
CopyFiles = @svc.sys
[Inst.NT.Services]
AddService = svc, 0x2, Svc_Inst
[Svc_Inst]
ServiceType = 1
StartType = 3
ErrorControl = 1
ServiceBinary = %13%\svc.sys
";

    fn bind_one(text: &str, hw: &[&str]) -> Result<Binding, BindError> {
        let set = InfSet::from_sources(&[("t.inf", text)]);
        assert!(set.rejected().is_empty(), "{:?}", set.rejected());
        set.bind(hw, &[], "NTamd64")
    }

    // ---- our INFs ---------------------------------------------------------

    #[test]
    fn workspace_infs_load_without_warnings() {
        let set = workspace();
        assert!(set.rejected().is_empty(), "{:?}", set.rejected());
        let names: Vec<&str> = set.infs().iter().map(Inf::name).collect();
        assert_eq!(
            names,
            [
                "hca-miniport.inf",
                "ib-legacy-client.inf",
                "ib-port-client.inf"
            ]
        );
        for inf in set.infs() {
            assert!(
                inf.warnings().is_empty(),
                "{}: {:?}",
                inf.name(),
                inf.warnings()
            );
            assert_eq!(inf.version_value("PnpLockdown"), Some("1"));
            assert_eq!(
                inf.driver_ver(),
                Some(DriverVer {
                    date: (2026, 11, 22),
                    version: [0, 1, 0, 0]
                })
            );
        }
        let hca = set.get("HCA-MINIPORT.INF").unwrap();
        assert_eq!(
            hca.string("hca.devicedesc"),
            Some("Simulated InfiniBand HCA (PRM 1.0)")
        );
        assert!(hca.section_names().any(|s| s == "Hca_Install.NT.Filters"));
    }

    #[test]
    fn hca_binds_to_miniport_with_bus_filter_and_child_list() {
        let b = workspace().bind(&HCA_HW, &HCA_COMPAT, "NTamd64").unwrap();
        assert_eq!(b.inf_name, "hca-miniport.inf");
        assert_eq!(b.models_section, "HcaModels.NTamd64.10.0...18362");
        assert_eq!(b.matched_id, HCA_FULL);
        assert_eq!(b.model, "Simulated InfiniBand HCA (PRM 1.0)");
        assert_eq!(b.install_section, "Hca_Install.NT");
        assert_eq!(b.function_service, "hcaminiport");
        assert_eq!(b.services, ["hcaminiport", "ibalbus"]);
        assert_eq!(b.upper_filters, ["ibalbus"]);
        assert!(b.lower_filters.is_empty());
        assert_eq!(b.kmdf_version, Some((1, 33)));
        assert_eq!(b.files, ["hcaminiport.sys", "ibalbus.sys"]);
        // System: a universal INF installs no setup class of its own.
        assert_eq!(
            b.class_guid.as_deref(),
            Some("{4d36e97d-e325-11ce-bfc1-08002be10318}")
        );
        let msi = "Interrupt Management\\MessageSignaledInterruptProperties";
        let hw = |subkey: &str, name: &str, v: u32| RegWrite {
            subkey: subkey.into(),
            name: name.into(),
            value: RegValue::Dword(v),
            no_clobber: false,
        };
        assert_eq!(
            b.device_values,
            [
                hw(msi, "MSISupported", 1),
                hw(msi, "MessageNumberLimit", 32),
                hw("DMA Management", "RemappingSupported", 1),
            ]
        );
        // The `.HW` `Security` value is the devnode's security property,
        // not a value under Device Parameters.
        assert_eq!(
            b.security.as_ref().map(SecurityDescriptor::sddl),
            Some("D:P(A;;GA;;;SY)(A;;GA;;;BA)(A;;GRGW;;;AU)")
        );
        let ibal = |subkey: &str, name: &str| {
            b.service_values
                .iter()
                .find(|(s, w)| s == "ibalbus" && w.subkey == subkey && w.name == name)
                .map(|(_, w)| w.value.clone())
        };
        assert_eq!(
            ibal("Parameters", "StaticChild"),
            Some(RegValue::MultiString(vec!["IPoIB".into()]))
        );
        assert_eq!(
            ibal("Parameters\\IPoIB", "HardwareId"),
            Some(RegValue::MultiString(vec!["IBA\\IPOIB".into()]))
        );
        assert_eq!(
            ibal("Parameters\\IPoIB", "CompatibleId"),
            Some(RegValue::MultiString(vec!["IBA\\PORT_CLIENT".into()]))
        );
        assert_eq!(
            ibal("Parameters\\IPoIB", "DeviceId"),
            Some(RegValue::String("IBA\\IPOIB".into()))
        );
        assert_eq!(
            ibal("Parameters\\IPoIB", "Description"),
            Some(RegValue::String("InfiniBand port client".into()))
        );
        assert_eq!(
            ibal("Parameters\\IPoIB", "PartitionKey"),
            Some(RegValue::Dword(0xFFFF))
        );
        assert_eq!(ibal("", "Start"), Some(RegValue::Dword(3)));
        assert!(b.service_values.iter().any(|(s, w)| s == "hcaminiport"
            && w.subkey == "Parameters"
            && w.name == "DmaRemappingCompatible"
            && w.value == RegValue::Dword(1)));

        // Fewer IDs still bind (the plain VEN&DEV model line), and arm64 too.
        let plain = workspace()
            .bind(&["PCI\\VEN_F1B0&DEV_0001"], &[], "NTarm64")
            .unwrap();
        assert_eq!(plain.models_section, "HcaModels.NTarm64.10.0...18362");
        assert_eq!(plain.matched_id, "PCI\\VEN_F1B0&DEV_0001");
        assert_eq!(plain.upper_filters, ["ibalbus"]);
    }

    #[test]
    fn applied_binding_is_what_drivers_read() {
        let reg = RegistryStore::new();
        let b = workspace().bind(&HCA_HW, &HCA_COMPAT, "NTamd64").unwrap();
        b.apply(&reg, HCA_INSTANCE).unwrap();

        let bus = reg.view("ibalbus", HCA_INSTANCE);
        assert_eq!(
            bus.read_multi_string(RegistryKey::ServiceParameters, "StaticChild"),
            Some(vec!["IPoIB".to_owned()])
        );
        assert_eq!(
            bus.read_multi_string(RegistryKey::ServiceParameters, "IPoIB\\HardwareId"),
            Some(vec!["IBA\\IPOIB".to_owned()])
        );
        assert_eq!(
            bus.read_dword(RegistryKey::ServiceParameters, "IPoIB\\PartitionKey"),
            Some(0xFFFF)
        );
        let miniport = reg.view("hcaminiport", HCA_INSTANCE);
        assert_eq!(
            miniport.read_dword(
                RegistryKey::Device,
                "Interrupt Management\\MessageSignaledInterruptProperties\\MSISupported"
            ),
            Some(1)
        );
        let instance = registry::device_instance_key(HCA_INSTANCE);
        assert_eq!(
            reg.get_value(&instance, "Service"),
            Some(RegValue::String("hcaminiport".into()))
        );
        assert_eq!(
            reg.get_value(&instance, "UpperFilters"),
            Some(RegValue::MultiString(vec!["ibalbus".into()]))
        );
        assert_eq!(reg.get_value(&instance, "LowerFilters"), None);
        assert_eq!(
            reg.get_value("Services\\hcaminiport", "ImagePath"),
            Some(RegValue::String(
                "\\SystemRoot\\System32\\DriverStore\\FileRepository\\hca-miniport.inf_amd64\\hcaminiport.sys"
                    .into()
            ))
        );
        for (name, v) in [("Type", 1), ("Start", 3), ("ErrorControl", 1)] {
            assert_eq!(
                reg.get_value("Services\\ibalbus", name),
                Some(RegValue::Dword(v))
            );
        }
    }

    #[test]
    fn child_binds_to_port_client_and_noclobber_keeps_admin_values() {
        let set = workspace();
        let b = set
            .bind(&["IBA\\IPOIB"], &["IBA\\PORT_CLIENT"], "NTamd64")
            .unwrap();
        assert_eq!(b.inf_name, "ib-port-client.inf");
        assert_eq!(b.function_service, "ibportclient");
        assert_eq!(b.install_section, "PortClient_Install.NT");
        assert!(b.upper_filters.is_empty() && b.lower_filters.is_empty());
        assert_eq!(b.kmdf_version, Some((1, 33)));
        assert_eq!(b.files, ["ibportclient.sys"]);
        assert_eq!(
            b.class_guid.as_deref(),
            Some("{4d36e97d-e325-11ce-bfc1-08002be10318}")
        );
        assert_eq!(
            b.device_values,
            [RegWrite {
                subkey: String::new(),
                name: "ReceiveDepth".into(),
                value: RegValue::Dword(256),
                no_clobber: true,
            }]
        );
        let reg = RegistryStore::new();
        let child = "IBA\\IPOIB\\0002c90300001234_ffff_ipoib";
        b.apply(&reg, child).unwrap();
        let view = reg.view("ibportclient", child);
        assert_eq!(
            view.read_dword(RegistryKey::Device, "ReceiveDepth"),
            Some(256)
        );
        reg.set_value(
            &registry::device_parameters_key(child),
            "ReceiveDepth",
            RegValue::Dword(64),
        )
        .unwrap();
        b.apply(&reg, child).unwrap();
        assert_eq!(
            view.read_dword(RegistryKey::Device, "ReceiveDepth"),
            Some(64)
        );

        // A child that is only a generic port client binds at a
        // compatible-ID rank.
        let generic = set
            .bind(&["IBA\\OTHER"], &["IBA\\PORT_CLIENT"], "NTamd64")
            .unwrap();
        assert_eq!(generic.function_service, "ibportclient");
        assert_eq!(generic.matched_id, "IBA\\PORT_CLIENT");
    }

    // ---- ranking ----------------------------------------------------------

    #[test]
    fn compatible_id_match_works_but_loses_to_a_hardware_id_match() {
        // Newer, and first in the set: neither beats a better rank.
        let generic = pkg("%P% = Inst, IBA\\PORT_CLIENT", INSTALL)
            .replace("01/01/2026,1.0.0.0", "01/01/2030,9.0.0.0");
        let alone = InfSet::from_sources(&[("a-generic.inf", &generic)]);
        let b = alone
            .bind(&["IBA\\IPOIB"], &["IBA\\PORT_CLIENT"], "NTamd64")
            .unwrap();
        assert_eq!(
            (b.inf_name.as_str(), b.function_service.as_str()),
            ("a-generic.inf", "svc")
        );

        let client =
            std::fs::read_to_string(workspace_inf_dir().join("ib-port-client.inf")).unwrap();
        let both =
            InfSet::from_sources(&[("a-generic.inf", &generic), ("ib-port-client.inf", &client)]);
        let b = both
            .bind(&["IBA\\IPOIB"], &["IBA\\PORT_CLIENT"], "NTamd64")
            .unwrap();
        assert_eq!(b.inf_name, "ib-port-client.inf");
        assert_eq!(b.matched_id, "IBA\\IPOIB");
    }

    #[test]
    fn earlier_device_ids_and_earlier_model_lines_win() {
        let vendor = pkg("%P% = Inst, PCI\\VEN_1&DEV_2", INSTALL);
        let exact = pkg(
            "%P% = Inst, PCI\\VEN_1&DEV_2&REV_3",
            &INSTALL.replace("svc,", "exact,"),
        );
        let set = InfSet::from_sources(&[("a.inf", &vendor), ("b.inf", &exact)]);
        let b = set
            .bind(
                &["PCI\\VEN_1&DEV_2&REV_3", "PCI\\VEN_1&DEV_2"],
                &[],
                "NTamd64",
            )
            .unwrap();
        assert_eq!(b.inf_name, "b.inf");
        assert_eq!(b.function_service, "exact");

        // Within one INF, equal ranks go to the first model line.
        let two_lines = pkg(
            "%P% = Second, X\\Y\n%P% = Inst, X\\Y",
            &format!(
                "{INSTALL}\n[Second.NT]\n[Second.NT.Services]\nAddService = svc, 2, Svc_Inst\n"
            ),
        );
        let b = bind_one(&two_lines, &["X\\Y"]);
        // `Second` copies nothing, so its ServiceBinary is not copied.
        assert!(
            matches!(&b, Err(BindError::Malformed { reason, .. }) if reason.contains("not copied")),
            "{b:?}"
        );
        // A model's hardware ID beats its compatible IDs for the same
        // device ID.
        let sides = pkg("%P% = Second, A\\B, X\\Y\n%P% = Inst, X\\Y", INSTALL);
        assert_eq!(
            bind_one(&sides, &["X\\Y"]).unwrap().install_section,
            "Inst.NT"
        );
        // Equal rank across INFs: the newer DriverVer wins.
        let newer = pkg("%P% = Inst, X\\Y", &INSTALL.replace("svc,", "newer,"))
            .replace("01/01/2026", "02/01/2026");
        let older = pkg("%P% = Inst, X\\Y", INSTALL);
        let set = InfSet::from_sources(&[("a.inf", &older), ("b.inf", &newer)]);
        assert_eq!(
            set.bind(&["X\\Y"], &[], "NTamd64").unwrap().inf_name,
            "b.inf"
        );
    }

    #[test]
    fn install_section_decoration_prefers_the_platform() {
        let text = pkg(
            "%P% = Inst, X\\Y",
            &format!(
                "{INSTALL}\n[Inst.NTamd64]\nCopyFiles = @svc.sys\n[Inst.NTamd64.Services]\nAddService = svc, 2, Svc_Inst\n"
            ),
        );
        assert_eq!(
            bind_one(&text, &["x\\y"]).unwrap().install_section,
            "Inst.NTamd64"
        );
        let undecorated = pkg("%P% = Inst, X\\Y", &INSTALL.replace("[Inst.NT", "[Inst"));
        assert_eq!(
            bind_one(&undecorated, &["X\\Y"]).unwrap().install_section,
            "Inst"
        );
    }

    #[test]
    fn models_decorations_follow_the_host_version() {
        let text = pkg("", INSTALL).replace(
            "%P% = Models, NTamd64",
            "%P% = Models, NTamd64, NTamd64.10.0...19041, NTamd64.10.0...99999, NTamd64.6.3, NTamd64.10.0.3",
        ) + "[Models.NTamd64.10.0...19041]\n%P% = Inst, X\\Y\n";
        let b = bind_one(&text, &["X\\Y"]).unwrap();
        assert_eq!(b.models_section, "Models.NTamd64.10.0...19041");
    }

    // ---- filters ----------------------------------------------------------

    const FILTER_SERVICE: &str = r"
AddService = flt,, Flt_Inst
[Flt_Inst]
ServiceType = 1
StartType = 3
ErrorControl = 1
ServiceBinary = %13%\flt.sys
";

    fn with_filter(extra: &str) -> String {
        let install = INSTALL
            .replace("CopyFiles = @svc.sys", "CopyFiles = @svc.sys, @flt.sys")
            .replace("[Svc_Inst]", &format!("{FILTER_SERVICE}\n[Svc_Inst]"));
        pkg("%P% = Inst, X\\Y", &format!("{install}\n{extra}"))
    }

    #[test]
    fn legacy_upper_and_lower_filters_from_hw_addreg() {
        let text = with_filter(
            "[Inst.NT.HW]\nAddReg = Hw\n[Hw]\nHKR,,\"UpperFilters\",0x00010000,\"flt\"\nHKR,,Other,,x\n",
        );
        let b = bind_one(&text, &["X\\Y"]).unwrap();
        assert_eq!(b.upper_filters, ["flt"]);
        assert_eq!(
            b.device_values.len(),
            1,
            "UpperFilters is not a hardware-key value"
        );
        let lower = text.replace("UpperFilters", "LowerFilters");
        let b = bind_one(&lower, &["X\\Y"]).unwrap();
        assert!(b.upper_filters.is_empty());
        assert_eq!(b.lower_filters, ["flt"]);
    }

    #[test]
    fn declarative_filters_by_position_and_level() {
        let lower =
            with_filter("[Inst.NT.Filters]\nAddFilter = flt, 0, F\n[F]\nFilterPosition = Lower\n");
        assert_eq!(bind_one(&lower, &["X\\Y"]).unwrap().lower_filters, ["flt"]);

        // Two filters in levels: "crypto" below "stats", whatever the
        // AddFilter order; the legacy entry comes first.
        let text = with_filter(
            r#"
[Inst.NT.HW]
AddReg = Hw
[Hw]
HKR,,UpperFilterLevels,0x00010000,"crypto","stats"
HKR,,UpperFilterDefaultLevel,,"stats"
HKR,,UpperFilters,0x00010000,"legacy"
[Inst.NT.Filters]
AddFilter = flt,, F1
AddFilter = flt2,, F2
[F1]
FilterPosition = Upper
[F2]
FilterLevel = crypto
"#,
        )
        .replace(
            "AddService = flt,, Flt_Inst",
            "AddService = flt,, Flt_Inst\nAddService = flt2,, Flt_Inst\nAddService = legacy,, Flt_Inst",
        );
        let b = bind_one(&text, &["X\\Y"]).unwrap();
        assert_eq!(b.upper_filters, ["legacy", "flt2", "flt"]);
        assert_eq!(b.services, ["svc", "flt", "flt2", "legacy"]);
    }

    #[test]
    fn filter_rule_breaches_are_malformed() {
        let cases = [
            // A level nobody defined (Windows would silently drop it).
            (
                "[Inst.NT.Filters]\nAddFilter = flt,, F\n[F]\nFilterLevel = nowhere\n",
                "nowhere",
            ),
            // Both forms for one filter.
            (
                "[Inst.NT.HW]\nAddReg = Hw\n[Hw]\nHKR,,UpperFilters,0x00010000,flt\n[Inst.NT.Filters]\nAddFilter = flt,, F\n[F]\nFilterPosition = Upper\n",
                "twice",
            ),
            // A filter no AddService installs.
            (
                "[Inst.NT.Filters]\nAddFilter = ghost,, F\n[F]\nFilterPosition = Upper\n",
                "no AddService",
            ),
            // Neither position nor level.
            (
                "[Inst.NT.Filters]\nAddFilter = flt,, F\n[F]\n",
                "FilterPosition or FilterLevel",
            ),
            (
                "[Inst.NT.Filters]\nAddFilter = flt, 1, F\n[F]\nFilterPosition = Upper\n",
                "must be 0",
            ),
            (
                "[Inst.NT.Filters]\nAddFilter = flt,, F\n[F]\nFilterPosition = Middle\n",
                "Middle",
            ),
            (
                "[Inst.NT.HW]\nAddReg = Hw\n[Hw]\nHKR,,UpperFilters,,flt\n",
                "REG_MULTI_SZ",
            ),
            (
                "[Inst.NT.HW]\nAddReg = Hw\n[Hw]\nHKR,,UpperFilters,0x00010000,svc\n",
                "both the function driver",
            ),
        ];
        for (extra, needle) in cases {
            match bind_one(&with_filter(extra), &["X\\Y"]) {
                Err(BindError::Malformed { reason, .. }) if reason.contains(needle) => {}
                other => panic!("{extra}: expected Malformed mentioning {needle:?}, got {other:?}"),
            }
        }
    }

    // ---- every BindError --------------------------------------------------

    #[test]
    fn unsupported_architecture() {
        let set = workspace();
        let e = set.bind(&HCA_HW, &[], "NTmips").unwrap_err();
        assert!(
            matches!(&e, BindError::UnsupportedArchitecture { arch, .. } if arch == "NTmips"),
            "{e}"
        );
        // Our INFs list amd64 and arm64 only.
        let e = set.bind(&HCA_HW, &[], "NTx86").unwrap_err();
        match &e {
            BindError::UnsupportedArchitecture { reason, .. } => {
                assert!(reason.contains("hca-miniport.inf"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        // An undecorated models section serves x86 only.
        let text = pkg("", INSTALL).replace("%P% = Models, NTamd64", "%P% = Models")
            + "[Models]\n%P% = Inst, X\\Y\n";
        let set = InfSet::from_sources(&[("t.inf", &text)]);
        assert!(matches!(
            set.bind(&["X\\Y"], &[], "NTamd64"),
            Err(BindError::UnsupportedArchitecture { .. })
        ));
        assert_eq!(
            set.bind(&["X\\Y"], &[], "NTx86").unwrap().function_service,
            "svc"
        );
    }

    #[test]
    fn no_match_names_the_rejected_files() {
        let set = InfSet::from_sources(&[
            ("good.inf", &pkg("%P% = Inst, X\\Y", INSTALL)),
            ("broken.inf", "[Version]\nSignature = \"$Windows NT$\n"),
        ]);
        assert_eq!(set.rejected().len(), 1);
        let e = set
            .bind(&["NOT\\THERE"], &["NOR\\THIS"], "NTamd64")
            .unwrap_err();
        match &e {
            BindError::NoMatch {
                hardware_ids,
                compatible_ids,
                problems,
            } => {
                assert_eq!(hardware_ids, &["NOT\\THERE"]);
                assert_eq!(compatible_ids, &["NOR\\THIS"]);
                assert!(problems[0].contains("broken.inf"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("unterminated quoted string"), "{e}");
    }

    #[test]
    fn install_section_missing() {
        let text = pkg("%P% = Nowhere, X\\Y", INSTALL);
        match bind_one(&text, &["X\\Y"]) {
            Err(BindError::InstallSectionMissing { section, tried, .. }) => {
                assert_eq!(section, "Nowhere");
                assert_eq!(tried, ["Nowhere.NTamd64", "Nowhere.NT", "Nowhere"]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn services_section_missing() {
        let text = pkg(
            "%P% = Inst, X\\Y",
            &INSTALL.replace("[Inst.NT.Services]", "[Inst.NT.Servicez]"),
        );
        assert!(matches!(
            bind_one(&text, &["X\\Y"]),
            Err(BindError::ServicesSectionMissing { section, .. }) if section == "Inst.NT.Services"
        ));
    }

    #[test]
    fn no_function_service() {
        let text = pkg(
            "%P% = Inst, X\\Y",
            &INSTALL.replace("svc, 0x2,", "svc, 0x0,"),
        );
        assert!(matches!(
            bind_one(&text, &["X\\Y"]),
            Err(BindError::NoFunctionService { reason, .. }) if reason.contains("0x2")
        ));
        let null = pkg(
            "%P% = Inst, X\\Y",
            &INSTALL.replace("svc, 0x2, Svc_Inst", ", 0x2"),
        );
        assert!(matches!(
            bind_one(&null, &["X\\Y"]),
            Err(BindError::NoFunctionService { reason, .. }) if reason.contains("null driver")
        ));
    }

    #[test]
    fn service_section_missing() {
        let text = pkg(
            "%P% = Inst, X\\Y",
            &INSTALL.replace("[Svc_Inst]", "[Svc_Install]"),
        );
        assert!(matches!(
            bind_one(&text, &["X\\Y"]),
            Err(BindError::ServiceSectionMissing { service, section, .. })
                if service == "svc" && section == "Svc_Inst"
        ));
    }

    #[test]
    fn referenced_section_missing() {
        for (extra, directive) in [
            ("[Inst.NT.HW]\nAddReg = Gone\n", "AddReg"),
            ("[Inst.NT.Wdf]\nKmdfService = svc, Gone\n", "KmdfService"),
            ("[Inst.NT.Filters]\nAddFilter = svc,, Gone\n", "AddFilter"),
        ] {
            let text = pkg("%P% = Inst, X\\Y", &format!("{INSTALL}{extra}"));
            match bind_one(&text, &["X\\Y"]) {
                Err(BindError::SectionMissing {
                    section,
                    directive: d,
                    ..
                }) => {
                    assert_eq!(section, "Gone");
                    assert!(d.starts_with(directive), "{d}");
                }
                other => panic!("{extra}: {other:?}"),
            }
        }
        let copy = pkg(
            "%P% = Inst, X\\Y",
            &INSTALL.replace("@svc.sys", "Files_Gone"),
        );
        assert!(matches!(
            bind_one(&copy, &["X\\Y"]),
            Err(BindError::SectionMissing { .. })
        ));
    }

    #[test]
    fn malformed_lines() {
        let cases: [(&str, &str, &str); 12] = [
            ("svc, 0x2, Svc_Inst", "svc, 0xZZ, Svc_Inst", "not a number"),
            (
                "ServiceType = 1",
                "ServiceType = 2",
                "SERVICE_KERNEL_DRIVER",
            ),
            ("StartType = 3", "StartType = 9", "StartType"),
            ("ErrorControl = 1\n", "", "no ErrorControl"),
            ("%13%\\svc.sys", "%12%\\svc.sys", "driver store"),
            (
                "CopyFiles = @svc.sys",
                "CopyFiles = @other.sys",
                "SourceDisksFiles",
            ),
            ("CopyFiles = @svc.sys", "", "not copied"),
            (
                "ServiceBinary = %13%\\svc.sys",
                "ServiceBinary = %13%\\svc.sys\nAddReg = R\n[R]\nHKLM,Software\\X,V,,1",
                "only HKR",
            ),
            (
                "ServiceBinary = %13%\\svc.sys",
                "ServiceBinary = %13%\\svc.sys\nAddReg = R\n[R]\nHKR,,V,0x00010001,0xFFFFFFFFF",
                "DWORD",
            ),
            (
                "ServiceBinary = %13%\\svc.sys",
                "ServiceBinary = %13%\\svc.sys\nAddReg = R\n[R]\nHKR,,V,0x00030000,x",
                "not a registry type",
            ),
            (
                "[Inst.NT.Services]",
                "[Inst.NT.Services]\nAddService = svc, 0, Svc_Inst",
                "added twice",
            ),
            (
                "[Svc_Inst]",
                "[Inst.NT.Wdf]\nKmdfService = svc, W\n[W]\nKmdfLibraryVersion = $KMDFVERSION$\n[Svc_Inst]",
                "unstamped",
            ),
        ];
        for (from, to, needle) in cases {
            let text = pkg("%P% = Inst, X\\Y", &INSTALL.replacen(from, to, 1));
            match bind_one(&text, &["X\\Y"]) {
                Err(e @ BindError::Malformed { .. }) if e.to_string().contains(needle) => {}
                other => panic!(
                    "{from:?} -> {to:?}: expected Malformed mentioning {needle:?}, got {other:?}"
                ),
            }
        }
        // DestinationDirs other than the driver store.
        let text =
            pkg("%P% = Inst, X\\Y", INSTALL).replace("DefaultDestDir = 13", "DefaultDestDir = 12");
        assert!(
            matches!(bind_one(&text, &["X\\Y"]), Err(BindError::Malformed { section, .. }) if section == "DestinationDirs")
        );
        // A model line with no install section.
        let text = pkg("%P% = , X\\Y", INSTALL);
        assert!(matches!(
            bind_one(&text, &["X\\Y"]),
            Err(BindError::Malformed { line: Some(_), .. })
        ));
    }

    /// The `.HW` `Security` value is the binding's descriptor (not a
    /// device value); one the security model cannot parse, or not a
    /// string, fails the binding as Windows fails the install.
    #[test]
    fn hw_security_value_is_the_bindings_descriptor_and_a_malformed_one_fails() {
        let with = |line: &str| {
            let hw = format!("[Inst.NT.HW]\nAddReg = R\n[R]\n{line}\n[Inst.NT.Services]");
            pkg(
                "%P% = Inst, X\\Y",
                &INSTALL.replace("[Inst.NT.Services]", &hw),
            )
        };
        let good = "D:P(A;;GA;;;SY)(A;;GR;;;WD)";
        let b = bind_one(&with(&format!("HKR,,Security,,\"{good}\"")), &["X\\Y"]).unwrap();
        assert_eq!(
            b.security.as_ref().map(SecurityDescriptor::sddl),
            Some(good)
        );
        assert!(b.device_values.is_empty(), "{:?}", b.device_values);
        // Under a subkey it is an ordinary value.
        let b = bind_one(&with(&format!("HKR,Sub,Security,,\"{good}\"")), &["X\\Y"]).unwrap();
        assert!(b.security.is_none());
        assert_eq!(b.device_values.len(), 1);

        for (line, needle) in [
            (
                "HKR,,Security,,\"D:P(A;;GA;;;S-1-5-18)\"",
                "unknown SID alias",
            ),
            ("HKR,,security,,\"O:BA\"", "no DACL"),
            ("HKR,,Security,0x00010001,1", "REG_SZ"),
        ] {
            match bind_one(&with(line), &["X\\Y"]) {
                Err(e @ BindError::Malformed { line: Some(_), .. })
                    if e.to_string().contains(needle) => {}
                other => panic!("{line}: expected Malformed mentioning {needle:?}, got {other:?}"),
            }
        }
    }

    #[test]
    fn copy_sections_install_under_the_destination_name() {
        let renamed = INSTALL.replace(
            "CopyFiles = @svc.sys",
            "CopyFiles = Files\n[Files]\nrenamed.sys, svc.sys",
        );
        let text = pkg("%P% = Inst, X\\Y", &renamed);
        // The binary is installed as renamed.sys, not svc.sys.
        assert!(matches!(
            bind_one(&text, &["X\\Y"]),
            Err(BindError::Malformed { reason, .. }) if reason.contains("not copied")
        ));
        let text = text.replace("%13%\\svc.sys", "%13%\\renamed.sys");
        assert_eq!(bind_one(&text, &["X\\Y"]).unwrap().files, ["renamed.sys"]);
    }

    #[test]
    fn unsupported_features_are_refused() {
        let cases = [
            (
                "CopyFiles = @svc.sys",
                "CopyFiles = @svc.sys\nInclude = machine.inf\nNeeds = PCI.Install",
            ),
            (
                "CopyFiles = @svc.sys",
                "CopyFiles = @svc.sys\nAddReg = R\n[R]\nHKR,,V,,x",
            ),
            (
                "ServiceBinary = %13%\\svc.sys",
                "ServiceBinary = %13%\\svc.sys\nAddReg = R\n[R]\nHKR,,V,0x00010008,x",
            ),
        ];
        for (from, to) in cases {
            let text = pkg("%P% = Inst, X\\Y", &INSTALL.replacen(from, to, 1));
            assert!(
                matches!(
                    bind_one(&text, &["X\\Y"]),
                    Err(BindError::Unsupported { .. })
                ),
                "{to}"
            );
        }
    }

    #[test]
    fn addreg_value_types() {
        let text = pkg(
            "%P% = Inst, X\\Y",
            &INSTALL.replace(
                "[Inst.NT.Services]",
                r#"[Inst.NT.HW]
AddReg = R
[R]
HKR,,Sz,,"a, ""quoted"" b"
HKR,,Def,0,plain
HKR,,Expand,0x00020000,%%SystemRoot%%\x
HKR,,Multi,0x00010000,one,"two",,three
HKR,,Dword,0x00010001,42
HKR,,DwordBytes,0x00010001,01,02,00,00
HKR,,Bin,0x00000001,de,AD,0xbe
HKR,,Custom,0x00070001,01
HKR,Sub\Key,,,"default"
[Inst.NT.Services]"#,
            ),
        );
        let b = bind_one(&text, &["X\\Y"]).unwrap();
        let got: Vec<(&str, &str, &RegValue)> = b
            .device_values
            .iter()
            .map(|w| (w.subkey.as_str(), w.name.as_str(), &w.value))
            .collect();
        let s = |v: &str| RegValue::String(v.into());
        assert_eq!(
            got,
            [
                ("", "Sz", &s("a, \"quoted\" b")),
                ("", "Def", &s("plain")),
                ("", "Expand", &s("%SystemRoot%\\x")),
                (
                    "",
                    "Multi",
                    &RegValue::MultiString(vec!["one".into(), "two".into(), "three".into()])
                ),
                ("", "Dword", &RegValue::Dword(42)),
                ("", "DwordBytes", &RegValue::Dword(0x0201)),
                ("", "Bin", &RegValue::Binary(vec![0xde, 0xad, 0xbe])),
                ("", "Custom", &RegValue::Binary(vec![1])),
                ("Sub\\Key", "", &s("default")),
            ]
        );
    }

    // ---- the parser -------------------------------------------------------

    const MINIMAL: &str = "[Version]\nSignature = \"$Windows NT$\"\n";

    fn parse(text: &str) -> Result<Inf, InfError> {
        Inf::parse("t.inf", text.as_bytes())
    }

    #[test]
    fn syntax_rules() {
        let text = format!(
            "; leading comment\r\n{MINIMAL}[S]\r\nkey = a , \"b, c\" ; comment\rk2 = \"x;y\"\"z\"\nlong = one, \\\n   two\n\
             \"quoted key\" = v\nno key line, f2\n[s]\nmerged = 1\n[Strings]\nT = \" padded \"\nU = a, b ; c\n[Use]\nx = %T%|%U%|%%|%13%|%nope%|50%\n"
        );
        let inf = parse(&text).unwrap();
        let s = inf.section("S").unwrap();
        let line = |i: usize| (s[i].key.as_deref(), s[i].fields.clone());
        assert_eq!(line(0), (Some("key"), vec!["a".into(), "b, c".into()]));
        assert_eq!(line(1), (Some("k2"), vec!["x;y\"z".into()]));
        assert_eq!(line(2), (Some("long"), vec!["one".into(), "two".into()]));
        assert_eq!(line(3), (Some("quoted key"), vec!["v".into()]));
        assert_eq!(line(4), (None, vec!["no key line".into(), "f2".into()]));
        assert_eq!(
            line(5),
            (Some("merged"), vec!["1".into()]),
            "repeated sections merge"
        );
        assert_eq!(s[0].number, 5, "line numbers count CRLF, LF and CR alike");
        assert_eq!(s[1].number, 6);
        assert_eq!(s[2].number, 7);
        assert_eq!(s[3].number, 9, "a continued line counts its physical lines");
        assert_eq!(inf.string("t"), Some(" padded "));
        assert_eq!(inf.string("U"), Some("a, b"));
        let used = &inf.section("use").unwrap()[0].fields[0];
        assert_eq!(used, " padded |a, b|%|%13%|%nope%|50%");
        assert!(
            inf.warnings().iter().any(|w| w.contains("%nope%")),
            "{:?}",
            inf.warnings()
        );
        assert!(inf.warnings().iter().any(|w| w.contains("CatalogFile")));
    }

    #[test]
    fn utf16_and_bom_encodings() {
        let text = format!("{MINIMAL}[S]\nk = \u{e9}t\u{e9}\n");
        let mut utf16 = vec![0xFF, 0xFE];
        utf16.extend(text.encode_utf16().flat_map(u16::to_le_bytes));
        let inf = Inf::parse("u.inf", &utf16).unwrap();
        assert_eq!(inf.section("S").unwrap()[0].fields, ["\u{e9}t\u{e9}"]);
        let mut utf8_bom = vec![0xEF, 0xBB, 0xBF];
        utf8_bom.extend(text.as_bytes());
        assert!(Inf::parse("b.inf", &utf8_bom).is_ok());
    }

    #[test]
    fn files_setup_would_refuse_are_rejected() {
        let syntax = |text: &str| match parse(text) {
            Err(InfError::Syntax { line, reason }) => (line, reason),
            other => panic!("{text:?}: {other:?}"),
        };
        assert_eq!(
            syntax("stray line\n[Version]\n"),
            (1, "line outside any section")
        );
        assert_eq!(
            syntax(&format!("{MINIMAL}[Broken\n")).1,
            "section header without `]`"
        );
        assert_eq!(
            syntax(&format!("{MINIMAL}[A] x\n")).1,
            "text after a section header"
        );
        assert_eq!(syntax(&format!("{MINIMAL}[]\n")).1, "empty section name");
        assert_eq!(
            syntax(&format!("{MINIMAL}[A]\nk = \"open\n")),
            (4, "unterminated quoted string")
        );
        assert_eq!(parse("[Strings]\n").unwrap_err(), InfError::NoVersion);
        assert_eq!(
            parse("[Version]\nSignature = \"$Windows 95$\"\n").unwrap_err(),
            InfError::BadSignature {
                found: "$Windows 95$".into()
            }
        );
        assert!(parse("[version]\nsignature=$CHICAGO$\n").is_ok());
        let mut set = InfSet::new();
        assert!(set.add("bad.inf", b"[Version]\n").is_err());
        assert_eq!(set.rejected().len(), 1);
        // Re-adding a good file of that name replaces the rejection.
        set.add("bad.inf", MINIMAL.as_bytes()).unwrap();
        assert!(set.rejected().is_empty());
        assert_eq!(set.infs().len(), 1);
    }

    #[test]
    fn load_dir_errors_and_reads() {
        assert!(matches!(
            InfSet::load_dir("/nonexistent/inf-dir"),
            Err(LoadError::ReadDir { .. })
        ));
    }

    #[test]
    fn decorations() {
        let s = |d| decoration_score(d, Arch::Amd64);
        assert_eq!(s("NTamd64"), Some((0, 0, 0, false)));
        assert_eq!(s("ntAMD64.10.0...18362"), Some((10, 0, 18362, false)));
        assert_eq!(s("NTamd64.10.0.1"), Some((10, 0, 0, true)));
        assert_eq!(s("NTamd64.10.0.3"), None, "server only");
        assert_eq!(s("NTamd64.10.1"), None);
        assert_eq!(s("NTamd64.10.0...99999"), None);
        assert_eq!(s("NTarm64"), None);
        assert_eq!(s("NT"), None);
        assert_eq!(s("NTamd64.x"), None);
        assert_eq!(s(""), None);
        assert_eq!(decoration_score("NT", Arch::X86), Some((0, 0, 0, false)));
        assert_eq!(
            decoration_score("NTx86.6.1", Arch::X86),
            Some((6, 1, 0, false))
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = Inf::parse("fuzz.inf", &bytes);
            let mut utf16 = vec![0xFF, 0xFE];
            utf16.extend(&bytes);
            let _ = Inf::parse("fuzz16.inf", &utf16);
        }

        /// INF-shaped input: lines drawn from the grammar's pieces, bound
        /// against IDs they may or may not list.
        #[test]
        fn arbitrary_inf_lines_never_panic_the_binder(
            lines in proptest::collection::vec(
                prop_oneof![
                    Just("[Version]".to_owned()),
                    Just("Signature = \"$Windows NT$\"".to_owned()),
                    Just("[Manufacturer]".to_owned()),
                    Just("%M% = Models, NTamd64, NTamd64.10.0...1".to_owned()),
                    Just("[Models.NTamd64]".to_owned()),
                    Just("%D% = Inst, X\\Y, C\\D".to_owned()),
                    Just("[Inst.NT]".to_owned()),
                    Just("CopyFiles = @a.sys, Files".to_owned()),
                    Just("[Files]".to_owned()),
                    Just("[SourceDisksFiles]".to_owned()),
                    Just("a.sys = 1".to_owned()),
                    Just("[DestinationDirs]".to_owned()),
                    Just("DefaultDestDir = 13".to_owned()),
                    Just("[Inst.NT.Services]".to_owned()),
                    Just("AddService = a, 2, S".to_owned()),
                    Just("AddService = b,, S".to_owned()),
                    Just("[S]".to_owned()),
                    Just("ServiceType = 1".to_owned()),
                    Just("StartType = 3".to_owned()),
                    Just("ErrorControl = 1".to_owned()),
                    Just("ServiceBinary = %13%\\a.sys".to_owned()),
                    Just("AddReg = R".to_owned()),
                    Just("[R]".to_owned()),
                    Just("[Inst.NT.HW]".to_owned()),
                    Just("[Inst.NT.Filters]".to_owned()),
                    Just("AddFilter = b,, F".to_owned()),
                    Just("[F]".to_owned()),
                    Just("FilterPosition = Upper".to_owned()),
                    Just("FilterLevel = L".to_owned()),
                    Just("[Inst.NT.Wdf]".to_owned()),
                    Just("KmdfService = a, W".to_owned()),
                    Just("[W]".to_owned()),
                    Just("KmdfLibraryVersion = 1.33".to_owned()),
                    Just("[Strings]".to_owned()),
                    (0u32..0x0004_0010, "[ -~]{0,12}", "[ -~]{0,12}")
                        .prop_map(|(f, n, v)| format!("HKR,{n},{v},{f:#x},{v},{n}")),
                    "[ -~\\\\%\";,=]{0,24}",
                ],
                0..40,
            ),
            hw in proptest::sample::select(vec!["X\\Y", "C\\D", "Z"]),
        ) {
            let text = lines.join("\n");
            let set = InfSet::from_sources(&[("f.inf", &text)]);
            if let Ok(b) = set.bind(&[hw], &["C\\D"], "NTamd64") {
                let reg = RegistryStore::new();
                let _ = b.apply(&reg, "ROOT\\X\\0000");
            }
        }
    }
}
