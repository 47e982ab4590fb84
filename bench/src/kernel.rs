//! A kernel caller of the miniport on the threaded host: control verbs as
//! framed requests submitted from a DPC (DISPATCH_LEVEL) to the miniport's
//! request entry (`Hca::submit_request`, what the CI interface's `submit`
//! reaches), completed by the device's command interrupt; and the direct
//! post and poll calls, made at DISPATCH_LEVEL inside the miniport's
//! context as a kernel client's DPC makes them.

use std::time::{Duration, Instant};

use driver_platform::{Irql, RequestorMode};
use ib_types::ioctl::{Response, Verb, decode_response, encode_request, request_len, response_len};
use ib_types::status::IbStatus;
use sim_host::context::{self, Context};
use sim_host::irql::IrqlGuard;
use sim_host::request::{Completion, HostRequest, RequestHandle};
use sim_shells::hca_miniport::SERVICE;

use crate::spin;
use crate::world::World;

/// How long a request may take before the run fails.
const TIMEOUT: Duration = Duration::from_secs(20);

/// A kernel-mode request of verb `V` on `handle` and its issuer's side.
pub fn request<V: Verb>(world: &World, handle: u64, input: &V::In) -> (HostRequest, RequestHandle) {
    let mut bytes = vec![0; request_len::<V>(0).expect("a request length")];
    encode_request::<V>(handle, input, &[], 0, &mut bytes).expect("encodable");
    let out = response_len::<V>(0).expect("a response length");
    HostRequest::new(
        world.host.verifier(),
        V::ID.ioctl().raw(),
        RequestorMode::Kernel,
        bytes,
        out,
    )
}

/// Submits `V` to HCA `at` from a DPC, without waiting.
pub fn submit<V: Verb>(world: &World, at: usize, handle: u64, input: &V::In) -> RequestHandle {
    let (request, issuer) = request::<V>(world, handle, input);
    let hca = world.hca(at);
    world
        .host
        .scheduler_handle()
        .queue_dpc(SERVICE, move || hca.submit_request(request));
    issuer
}

/// Waits for `issuer`'s completion.
pub fn wait(issuer: &RequestHandle, what: &str) -> Completion {
    let deadline = Instant::now() + TIMEOUT;
    spin::until(|| issuer.is_done() || Instant::now() >= deadline);
    issuer
        .completion()
        .unwrap_or_else(|| panic!("{what} did not complete"))
}

/// The decoded response of a completed `V`, which must have succeeded.
pub fn ok<V: Verb>(completion: &Completion) -> Response<'_, V> {
    // No private output is asked for, so the whole output is the response
    // (the AL puts a create's new handle in Information, the miniport the
    // length).
    let response = decode_response::<V>(&completion.output).expect("a valid response");
    assert_eq!(
        response.status,
        IbStatus::Success,
        "{}: {:?}",
        V::ID.name(),
        response.status
    );
    response
}

/// `V` on HCA `at`, from a DPC, waited for: the new handle and the output.
pub fn call<V: Verb>(
    world: &World,
    at: usize,
    handle: u64,
    input: &V::In,
) -> (u64, Option<V::Out>) {
    let done = wait(&submit::<V>(world, at, handle, input), V::ID.name());
    let response = ok::<V>(&done);
    (response.handle, response.output)
}

/// Runs `f` on this thread as a kernel client's DPC runs: inside the
/// miniport's context, at DISPATCH_LEVEL.
pub fn at_dispatch<R>(world: &World, f: impl FnOnce() -> R) -> R {
    let _context = context::enter(Context::driver(world.host.verifier().clone(), SERVICE));
    let _irql = IrqlGuard::at(Irql::DISPATCH);
    f()
}
