//! Device-object security: a security descriptor in SDDL on a devnode's
//! stack, a caller's access token, and the access check `IRP_MJ_CREATE`
//! makes before any driver sees the open.
//!
//! Contract (`docs/host-model.md`, "Device security descriptors and the
//! caller's token"):
//! - The INF sets the stack's descriptor: the `Security` value at the root
//!   of the device's hardware `AddReg` section is the device's security
//!   property ([`crate::inf::Binding::security`], carried by
//!   [`crate::pnp::StackPlan::security`]), which the PnP manager applies to
//!   every device object of the stack before any driver's add-device; no
//!   driver of a PnP stack assigns it (a PnP filter has no name of its own,
//!   so `WdfDeviceInitAssignSDDLString` is not for it). An SDDL string
//!   outside the subset modelled fails the binding (the device does not
//!   start), as Windows fails the install.
//! - [`crate::pnp::PnpManager::open_file`] asks for read and write access
//!   (what `CreateFile(GENERIC_READ | GENERIC_WRITE)` on a device asks):
//!   a caller whose token the descriptor does not grant both gets
//!   `STATUS_ACCESS_DENIED` and no layer of the stack sees the create. A
//!   stack without a descriptor is open to everyone (the default
//!   descriptor Windows gives a device object is not modelled).
//! - The subset: a DACL (`D:`, optional `P` flag) of allow (`A`) and deny
//!   (`D`) ACEs with no flags, object or inherit GUIDs, generic rights
//!   (`GA`, `GR`, `GW`, `GX`, concatenated) or a hex mask, and well-known
//!   SID aliases (`SY`, `BA`, `BU`, `AU`, `IU`, `WD`, `AN`, `BG`, `LS`,
//!   `NS`). ACEs are checked in order, as `SeAccessCheck` does: a deny ACE
//!   matching the token refuses any right still wanted, allow ACEs grant.

use std::fmt;

use ib_types::status::NtStatus;

/// `STATUS_ACCESS_DENIED`.
pub const ACCESS_DENIED: NtStatus = NtStatus::ACCESS_DENIED;

/// Generic rights (`GENERIC_*`), the part of an access mask the model
/// checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AccessMask(u32);

impl AccessMask {
    /// `GENERIC_READ`.
    pub const READ: Self = Self(0x8000_0000);
    /// `GENERIC_WRITE`.
    pub const WRITE: Self = Self(0x4000_0000);
    /// `GENERIC_EXECUTE`.
    pub const EXECUTE: Self = Self(0x2000_0000);
    /// `GENERIC_ALL`.
    pub const ALL: Self = Self(0x1000_0000);
    /// What `CreateFile(GENERIC_READ | GENERIC_WRITE)` asks.
    pub const READ_WRITE: Self = Self(Self::READ.0 | Self::WRITE.0);

    /// The generic bits with `GENERIC_ALL` expanded.
    fn expanded(self) -> u32 {
        if self.0 & Self::ALL.0 != 0 {
            self.0 | Self::READ.0 | Self::WRITE.0 | Self::EXECUTE.0
        } else {
            self.0
        }
    }
}

/// Well-known SIDs the model knows, by their SDDL aliases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WellKnownSid {
    /// `SY`: LocalSystem.
    LocalSystem,
    /// `BA`: BUILTIN\Administrators (an elevated administrator's token).
    Administrators,
    /// `BU`: BUILTIN\Users.
    Users,
    /// `AU`: Authenticated Users.
    AuthenticatedUsers,
    /// `IU`: Interactive.
    Interactive,
    /// `WD`: Everyone.
    Everyone,
    /// `AN`: Anonymous logon.
    Anonymous,
    /// `BG`: BUILTIN\Guests.
    Guests,
    /// `LS`: LocalService.
    LocalService,
    /// `NS`: NetworkService.
    NetworkService,
}

impl WellKnownSid {
    fn from_alias(alias: &str) -> Option<Self> {
        Some(match alias {
            "SY" => Self::LocalSystem,
            "BA" => Self::Administrators,
            "BU" => Self::Users,
            "AU" => Self::AuthenticatedUsers,
            "IU" => Self::Interactive,
            "WD" => Self::Everyone,
            "AN" => Self::Anonymous,
            "BG" => Self::Guests,
            "LS" => Self::LocalService,
            "NS" => Self::NetworkService,
            _ => return None,
        })
    }
}

/// A caller's access token: the SIDs it holds (user and groups).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    sids: Vec<WellKnownSid>,
}

impl Token {
    /// An interactive standard user (not elevated): Everyone,
    /// Authenticated Users, Users, Interactive.
    pub fn standard_user() -> Self {
        Self {
            sids: vec![
                WellKnownSid::Everyone,
                WellKnownSid::AuthenticatedUsers,
                WellKnownSid::Users,
                WellKnownSid::Interactive,
            ],
        }
    }

    /// An elevated administrator: a standard user's groups plus
    /// Administrators.
    pub fn administrator() -> Self {
        let mut token = Self::standard_user();
        token.sids.push(WellKnownSid::Administrators);
        token
    }

    /// An anonymous logon: Everyone and Anonymous only (not
    /// authenticated).
    pub fn anonymous() -> Self {
        Self {
            sids: vec![WellKnownSid::Everyone, WellKnownSid::Anonymous],
        }
    }

    /// LocalSystem (a service running as SYSTEM).
    pub fn system() -> Self {
        Self {
            sids: vec![
                WellKnownSid::LocalSystem,
                WellKnownSid::Everyone,
                WellKnownSid::AuthenticatedUsers,
                WellKnownSid::Administrators,
            ],
        }
    }

    /// Whether the token holds `sid`.
    pub fn has(&self, sid: WellKnownSid) -> bool {
        self.sids.contains(&sid)
    }

    /// An elevated administrator or SYSTEM (what an administrator-only
    /// IOCTL checks, as `SeTokenIsAdmin` does).
    pub fn is_admin(&self) -> bool {
        self.has(WellKnownSid::Administrators)
    }
}

impl Default for Token {
    fn default() -> Self {
        Self::standard_user()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AceType {
    Allow,
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ace {
    kind: AceType,
    mask: AccessMask,
    sid: WellKnownSid,
}

/// Why an SDDL string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("SDDL {sddl:?} refused: {reason}")]
pub struct SddlError {
    sddl: String,
    reason: &'static str,
}

/// A security descriptor: its DACL, parsed from SDDL.
#[derive(Clone, PartialEq, Eq)]
pub struct SecurityDescriptor {
    sddl: String,
    aces: Vec<Ace>,
}

impl fmt::Debug for SecurityDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SecurityDescriptor")
            .field(&self.sddl)
            .finish()
    }
}

fn parse_rights(text: &str) -> Option<AccessMask> {
    if let Some(hex) = text.strip_prefix("0x") {
        return u32::from_str_radix(hex, 16).ok().map(AccessMask);
    }
    if text.is_empty() || !text.len().is_multiple_of(2) {
        return None;
    }
    let mut mask = 0;
    for pair in text.as_bytes().chunks(2) {
        mask |= match pair {
            b"GA" => AccessMask::ALL.0,
            b"GR" => AccessMask::READ.0,
            b"GW" => AccessMask::WRITE.0,
            b"GX" => AccessMask::EXECUTE.0,
            _ => return None,
        };
    }
    Some(AccessMask(mask))
}

impl SecurityDescriptor {
    /// Parses the SDDL subset of the module doc.
    pub fn from_sddl(sddl: &str) -> Result<Self, SddlError> {
        let refuse = |reason| SddlError {
            sddl: sddl.to_owned(),
            reason,
        };
        let dacl = sddl.strip_prefix("D:").ok_or(refuse("no DACL (D:)"))?;
        let mut rest = dacl.strip_prefix('P').unwrap_or(dacl);
        let mut aces = Vec::new();
        while !rest.is_empty() {
            let body = rest
                .strip_prefix('(')
                .ok_or(refuse("ACE not in parentheses"))?;
            let end = body.find(')').ok_or(refuse("unterminated ACE"))?;
            let fields: Vec<&str> = body[..end].split(';').collect();
            rest = &body[end + 1..];
            let [kind, flags, rights, object, inherit, sid] = fields[..] else {
                return Err(refuse("an ACE has six fields"));
            };
            let kind = match kind {
                "A" => AceType::Allow,
                "D" => AceType::Deny,
                _ => return Err(refuse("ACE type other than A or D")),
            };
            if !flags.is_empty() || !object.is_empty() || !inherit.is_empty() {
                return Err(refuse("ACE flags and object GUIDs are not modelled"));
            }
            let mask = parse_rights(rights).ok_or(refuse("unknown rights"))?;
            let sid = WellKnownSid::from_alias(sid).ok_or(refuse("unknown SID alias"))?;
            aces.push(Ace { kind, mask, sid });
        }
        Ok(Self {
            sddl: sddl.to_owned(),
            aces,
        })
    }

    /// The SDDL it was parsed from.
    pub fn sddl(&self) -> &str {
        &self.sddl
    }

    /// `SeAccessCheck` for the generic rights `desired`: every one must be
    /// granted by an allow ACE before a deny ACE refuses it.
    pub fn access_check(&self, token: &Token, desired: AccessMask) -> Result<(), NtStatus> {
        let wanted = desired.expanded();
        let mut granted = 0;
        for ace in self.aces.iter().filter(|ace| token.has(ace.sid)) {
            let bits = ace.mask.expanded() & wanted & !granted;
            match ace.kind {
                AceType::Deny if bits != 0 => return Err(ACCESS_DENIED),
                AceType::Deny => {}
                AceType::Allow => granted |= bits,
            }
            if granted == wanted {
                return Ok(());
            }
        }
        Err(ACCESS_DENIED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proxy_descriptor_grants_system_admins_and_authenticated_users() {
        let sd =
            SecurityDescriptor::from_sddl("D:P(A;;GA;;;SY)(A;;GA;;;BA)(A;;GRGW;;;AU)").unwrap();
        for token in [
            Token::system(),
            Token::administrator(),
            Token::standard_user(),
        ] {
            assert_eq!(sd.access_check(&token, AccessMask::READ_WRITE), Ok(()));
        }
        assert_eq!(
            sd.access_check(&Token::anonymous(), AccessMask::READ_WRITE),
            Err(ACCESS_DENIED)
        );
    }

    #[test]
    fn a_deny_ace_before_the_grant_refuses() {
        let sd = SecurityDescriptor::from_sddl("D:(D;;GW;;;IU)(A;;GA;;;WD)").unwrap();
        assert_eq!(
            sd.access_check(&Token::standard_user(), AccessMask::READ_WRITE),
            Err(ACCESS_DENIED)
        );
        assert_eq!(
            sd.access_check(&Token::standard_user(), AccessMask::READ),
            Ok(())
        );
        assert_eq!(
            sd.access_check(&Token::anonymous(), AccessMask::READ_WRITE),
            Ok(())
        );
    }

    #[test]
    fn sddl_outside_the_subset_is_refused() {
        for bad in [
            "",
            "O:BA",
            "D:P(A;;GA;;;SY",
            "D:(X;;GA;;;SY)",
            "D:(A;CI;GA;;;SY)",
            "D:(A;;ZZ;;;SY)",
            "D:(A;;GA;;;S-1-5-32-544)",
            "D:(A;;GA;;SY)",
        ] {
            assert!(SecurityDescriptor::from_sddl(bad).is_err(), "{bad:?}");
        }
    }
}
