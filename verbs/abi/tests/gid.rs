//! `union ibv_gid`'s two views over one byte array.

use ibverbs_abi::IbvGid;

#[test]
fn an_ipv4_mapped_gid_has_a_zero_prefix_and_a_non_zero_interface_id() {
    let gid = IbvGid::from_ipv4_mapped([127, 0, 0, 2]);
    assert_eq!(
        gid.raw,
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 2]
    );
    assert_eq!(gid.subnet_prefix(), 0);
    // ibv_rc_pingpong uses the GRH exactly when this is non-zero.
    assert_eq!(gid.interface_id(), 0x0000_ffff_7f00_0002);
}

#[test]
fn the_halves_are_read_in_network_order() {
    let mut raw = [0; 16];
    raw[..8].copy_from_slice(&0xfe80_0000_0000_0000_u64.to_be_bytes());
    raw[8..].copy_from_slice(&0x0002_c903_0000_1234_u64.to_be_bytes());
    let gid = IbvGid { raw };
    assert_eq!(gid.subnet_prefix(), 0xfe80_0000_0000_0000);
    assert_eq!(gid.interface_id(), 0x0002_c903_0000_1234);
}
