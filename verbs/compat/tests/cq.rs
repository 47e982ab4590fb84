//! Completion queues and completion channels, called in-process as a C
//! program calls them, on the embedded simulated machine: the `ibv_cq`
//! and `ibv_comp_channel` filled, the context's `ops.poll_cq` and
//! `ops.req_notify_cq` set and answering, the channel's `fd` a real
//! eventfd that a non-blocking `ibv_get_cq_event` finds empty (`EAGAIN`),
//! every refusal in rdma-core's convention, the destroy order (`EBUSY`)
//! and a clean shutdown.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use ibverbs_abi::{IbvCompChannel, IbvContext, IbvCq, IbvWc};
use ibverbs_compat::{self as verbs};

mod support;
use support::*;

fn create_cq(
    context: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut IbvCompChannel,
    comp_vector: c_int,
) -> *mut IbvCq {
    // SAFETY: the pointers are checked against the live objects.
    unsafe { verbs::ibv_create_cq(context, cqe, cq_context, channel, comp_vector) }
}

fn destroy_cq(cq: *mut IbvCq) -> c_int {
    // SAFETY: checked against the live CQs.
    unsafe { verbs::ibv_destroy_cq(cq) }
}

fn destroy_channel(channel: *mut IbvCompChannel) -> c_int {
    // SAFETY: checked against the live channels.
    unsafe { verbs::ibv_destroy_comp_channel(channel) }
}

/// `ibv_poll_cq`, as verbs.h's inline: through the CQ's context's ops.
fn poll(cq: *mut IbvCq, wc: &mut [IbvWc]) -> c_int {
    // SAFETY: a live CQ of ours.
    let context = unsafe { (*cq).context };
    // SAFETY: its context is the open context.
    let poll_cq = unsafe { (*context).ops.poll_cq }.expect("ops.poll_cq set");
    // SAFETY: `wc` holds `wc.len()` entries.
    unsafe { poll_cq(cq, wc.len() as c_int, wc.as_mut_ptr()) }
}

#[test]
fn completion_queues_and_channels() {
    let (list, context) = open_the_device(boot);
    let machine = MACHINE.get().unwrap();

    // A channel: a real descriptor, of this context.
    // SAFETY: checked against the open contexts.
    let channel = unsafe { verbs::ibv_create_comp_channel(context) };
    assert!(!channel.is_null(), "errno {}", errno());
    // SAFETY: a live channel of ours.
    let raw_channel = unsafe { &*channel };
    let (fd, channel_context) = (raw_channel.fd, raw_channel.context);
    assert_eq!(channel_context, context);
    // SAFETY: plain fcntl on the channel's descriptor.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    assert!(flags >= 0, "a real descriptor");
    assert_eq!(
        // SAFETY: as above.
        unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) },
        0
    );
    // SAFETY: checked against the open contexts.
    assert!(unsafe { verbs::ibv_create_comp_channel(null_mut()) }.is_null());
    assert_eq!(errno(), libc::EINVAL);

    // A CQ on it: the ibv_cq as verbs.h reads it.
    let mut tag = 7u32;
    let tag_ptr = std::ptr::from_mut(&mut tag).cast::<c_void>();
    let cq = create_cq(context, 100, tag_ptr, channel, 0);
    assert!(!cq.is_null(), "errno {}", errno());
    // SAFETY: a live CQ of ours.
    let raw = unsafe { &*cq };
    assert_eq!(
        (raw.context, raw.channel, raw.cq_context),
        (context, channel, tag_ptr)
    );
    assert!(raw.cqe >= 100, "at least the entries asked: {}", raw.cqe);
    let mut wc = [IbvWc::default(); 4];
    assert_eq!(poll(cq, &mut wc), 0, "nothing completed");
    assert_eq!(poll(cq, &mut wc[..0]), 0);
    // SAFETY: a live CQ: its context's ops.
    let req_notify = unsafe { (*context).ops.req_notify_cq }.expect("ops.req_notify_cq set");
    // SAFETY: checked against the live CQs.
    assert_eq!(unsafe { req_notify(cq, 0) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { req_notify(cq, 1) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { req_notify(context.cast(), 0) }, libc::EINVAL);

    // No event: a non-blocking channel says EAGAIN.
    let (mut got_cq, mut got_context) = (null_mut(), null_mut());
    // SAFETY: the out-pointers are valid.
    let got = unsafe { verbs::ibv_get_cq_event(channel, &mut got_cq, &mut got_context) };
    assert_eq!((got, errno()), (-1, libc::EAGAIN));
    // SAFETY: as above.
    let got = unsafe { verbs::ibv_get_cq_event(null_mut(), &mut got_cq, &mut got_context) };
    assert_eq!((got, errno()), (-1, libc::EINVAL));
    // SAFETY: a CQ that is not ours is ignored.
    unsafe { verbs::ibv_ack_cq_events(context.cast(), 1) };

    // A CQ with no channel; refusals.
    let plain = create_cq(context, 1, null_mut(), null_mut(), 0);
    assert!(!plain.is_null(), "errno {}", errno());
    let refused = |cq: *mut IbvCq, what: &str| {
        assert!(cq.is_null(), "{what}");
        assert_eq!(errno(), libc::EINVAL, "{what}");
    };
    refused(
        create_cq(context, 0, null_mut(), null_mut(), 0),
        "no entries",
    );
    refused(
        create_cq(context, -1, null_mut(), null_mut(), 0),
        "negative entries",
    );
    refused(
        create_cq(context, 4, null_mut(), null_mut(), 1),
        "comp_vector 1",
    );
    refused(
        create_cq(context, 4, null_mut(), context.cast(), 0),
        "a foreign channel",
    );
    refused(
        create_cq(null_mut(), 4, null_mut(), null_mut(), 0),
        "no context",
    );

    // Destroys: a channel with a CQ is busy; each once.
    assert_eq!(destroy_channel(channel), libc::EBUSY);
    assert_eq!(destroy_cq(cq), 0);
    assert_eq!(destroy_cq(cq), libc::EINVAL, "a second destroy");
    assert_eq!(destroy_cq(null_mut()), libc::EINVAL);
    assert_eq!(poll(plain, &mut wc), 0);
    assert_eq!(destroy_cq(plain), 0);
    assert_eq!(destroy_channel(channel), 0);
    assert_eq!(destroy_channel(channel), libc::EINVAL, "a second destroy");
    // SAFETY: plain fcntl: the descriptor is closed.
    assert_eq!(unsafe { libc::fcntl(fd, libc::F_GETFL) }, -1);

    close_the_device(context, list);
    shut_down_cleanly(machine);
}
