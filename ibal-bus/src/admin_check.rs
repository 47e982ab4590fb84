//! The security descriptor the proxy's administrator check is made
//! against (`kmdf::proxy`, docs/ibal-bus.md "The KMDF shell"): built by
//! hand, since the kernel has no public SDDL parser, and compiled on every
//! host so that its layout is tested where tests run.
//!
//! `O:BAG:BAD:(A;;0x1;;;BA)` in self-relative form: owner and group
//! `BUILTIN\Administrators` (S-1-5-32-544), and a DACL with one ACE that
//! allows [`CHANGE_CHILD_LIST`] to that group. An access check for that
//! right succeeds only for a token in which the group is enabled (an
//! elevated administrator, SYSTEM); a deny-only group (UAC's filtered
//! token) does not count.

/// The one private right the descriptor grants.
pub const CHANGE_CHILD_LIST: u32 = 0x0001;

/// `S-1-5-32-544`: revision 1, two sub-authorities, the NT authority (5),
/// `SECURITY_BUILTIN_DOMAIN_RID` (32), `DOMAIN_ALIAS_RID_ADMINS` (544),
/// sub-authorities little-endian.
const ADMINISTRATORS_SID: [u8; SID_LEN] = [1, 2, 0, 0, 0, 0, 0, 5, 32, 0, 0, 0, 0x20, 2, 0, 0];
const SID_LEN: usize = 16;

/// `SECURITY_DESCRIPTOR_RELATIVE` is 20 bytes; then owner, group, DACL.
const HEADER_LEN: usize = 20;
const OWNER_AT: usize = HEADER_LEN;
const GROUP_AT: usize = OWNER_AT + SID_LEN;
const DACL_AT: usize = GROUP_AT + SID_LEN;
/// `ACL` header.
const ACL_HEADER_LEN: usize = 8;
/// `ACCESS_ALLOWED_ACE`: header (4), mask (4), SID.
const ACE_LEN: usize = 8 + SID_LEN;
const ACL_LEN: usize = ACL_HEADER_LEN + ACE_LEN;
/// The descriptor's length.
pub const DESCRIPTOR_LEN: usize = DACL_AT + ACL_LEN;

/// `SE_DACL_PRESENT | SE_SELF_RELATIVE`.
const CONTROL: u16 = 0x0004 | 0x8000;
const SECURITY_DESCRIPTOR_REVISION: u8 = 1;
const ACL_REVISION: u8 = 2;
const ACCESS_ALLOWED_ACE_TYPE: u8 = 0;

/// The descriptor's bytes, aligned as the kernel reads a
/// `SECURITY_DESCRIPTOR_RELATIVE`.
#[derive(Debug)]
#[repr(C, align(4))]
pub struct SelfRelativeDescriptor([u8; DESCRIPTOR_LEN]);

impl SelfRelativeDescriptor {
    /// The first byte, for the kernel's `PSECURITY_DESCRIPTOR`.
    pub fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8; DESCRIPTOR_LEN] {
        &self.0
    }
}

const fn put(bytes: &mut [u8; DESCRIPTOR_LEN], at: usize, part: &[u8]) {
    let mut i = 0;
    while i < part.len() {
        bytes[at + i] = part[i];
        i += 1;
    }
}

const fn administrators_only() -> [u8; DESCRIPTOR_LEN] {
    let mut sd = [0u8; DESCRIPTOR_LEN];
    // Revision, Sbz1, Control, then the offsets of owner, group, SACL
    // (none) and DACL, little-endian.
    sd[0] = SECURITY_DESCRIPTOR_REVISION;
    put(&mut sd, 2, &CONTROL.to_le_bytes());
    put(&mut sd, 4, &(OWNER_AT as u32).to_le_bytes());
    put(&mut sd, 8, &(GROUP_AT as u32).to_le_bytes());
    put(&mut sd, 16, &(DACL_AT as u32).to_le_bytes());
    put(&mut sd, OWNER_AT, &ADMINISTRATORS_SID);
    put(&mut sd, GROUP_AT, &ADMINISTRATORS_SID);
    // ACL: AclRevision, Sbz1, AclSize, AceCount, Sbz2.
    sd[DACL_AT] = ACL_REVISION;
    put(&mut sd, DACL_AT + 2, &(ACL_LEN as u16).to_le_bytes());
    put(&mut sd, DACL_AT + 4, &1u16.to_le_bytes());
    // ACE: AceType, AceFlags, AceSize, Mask, SID.
    let ace = DACL_AT + ACL_HEADER_LEN;
    sd[ace] = ACCESS_ALLOWED_ACE_TYPE;
    put(&mut sd, ace + 2, &(ACE_LEN as u16).to_le_bytes());
    put(&mut sd, ace + 4, &CHANGE_CHILD_LIST.to_le_bytes());
    put(&mut sd, ace + 8, &ADMINISTRATORS_SID);
    sd
}

/// `O:BAG:BAD:(A;;0x1;;;BA)` (see the module doc).
pub static ADMINISTRATORS_ONLY: SelfRelativeDescriptor =
    SelfRelativeDescriptor(administrators_only());

#[cfg(test)]
mod tests {
    use super::*;

    fn u16_at(b: &[u8], at: usize) -> usize {
        usize::from(u16::from_le_bytes([b[at], b[at + 1]]))
    }

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
    }

    /// A SID in its string form, read as the kernel reads one: revision,
    /// count, 48-bit big-endian authority, little-endian sub-authorities.
    fn sid_at(b: &[u8], at: usize) -> (String, usize) {
        assert_eq!(b[at], 1, "SID revision");
        let count = usize::from(b[at + 1]);
        let authority = b[at + 2..at + 8]
            .iter()
            .fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte));
        let mut text = format!("S-1-{authority}");
        for i in 0..count {
            text.push_str(&format!("-{}", u32_at(b, at + 8 + 4 * i)));
        }
        (text, 8 + 4 * count)
    }

    #[test]
    fn the_descriptor_is_administrators_only_in_self_relative_form() {
        let b = ADMINISTRATORS_ONLY.bytes();
        assert_eq!(b[0], 1, "revision");
        assert_eq!(b[1], 0, "Sbz1");
        assert_eq!(u16_at(b, 2), 0x8004, "SE_SELF_RELATIVE | SE_DACL_PRESENT");
        let (owner, group, sacl, dacl) = (
            u32_at(b, 4) as usize,
            u32_at(b, 8) as usize,
            u32_at(b, 12),
            u32_at(b, 16) as usize,
        );
        assert_eq!(sacl, 0, "no SACL");
        assert_eq!(sid_at(b, owner).0, "S-1-5-32-544");
        assert_eq!(sid_at(b, group).0, "S-1-5-32-544");

        // The DACL: revision 2, its size covering exactly its one ACE and
        // ending at the end of the descriptor.
        assert_eq!(b[dacl], 2);
        let acl_size = u16_at(b, dacl + 2);
        assert_eq!(u16_at(b, dacl + 4), 1, "one ACE");
        assert_eq!(dacl + acl_size, b.len());
        let ace = dacl + 8;
        assert_eq!(b[ace], 0, "ACCESS_ALLOWED_ACE_TYPE");
        assert_eq!(b[ace + 1], 0, "no inheritance flags");
        let ace_size = u16_at(b, ace + 2);
        assert_eq!(u32_at(b, ace + 4), CHANGE_CHILD_LIST);
        let (trustee, sid_len) = sid_at(b, ace + 8);
        assert_eq!(trustee, "S-1-5-32-544");
        assert_eq!(
            ace_size,
            8 + sid_len,
            "the ACE's size is its header, mask and SID"
        );
        assert_eq!(ace + ace_size, dacl + acl_size);
        // Every ACE must be DWORD-aligned, as the descriptor itself.
        assert_eq!(ace % 4, 0);
        assert_eq!(ADMINISTRATORS_ONLY.as_ptr() as usize % 4, 0);
    }
}
