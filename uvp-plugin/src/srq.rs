//! A user SRQ's fast path: receive WQEs into its ring and one record store
//! per batch (PRM 6.4, 9.2, 10.3). [`Srq::post`] takes `&mut self`: one
//! poster at a time, with no lock shared with the pollers of the CQs its
//! QPs complete on.

use std::sync::Arc;

use ib_types::wr::{RecvWr, WrLimits};

use crate::dma::{DmaBuffer, Record};
use crate::error::PostError;
use crate::qp::write_recv_wqe;
use crate::queue::SrqShared;

/// A user shared receive queue.
#[derive(Debug)]
pub struct Srq {
    srqn: u32,
    ring: DmaBuffer,
    record: Record,
    limits: WrLimits,
    producer: u32,
    shared: Arc<SrqShared>,
    scratch: Box<[u8]>,
}

impl Srq {
    pub(crate) fn new(
        srqn: u32,
        ring: DmaBuffer,
        record: Record,
        max_sge: u32,
        log_entries: u8,
        stride: usize,
    ) -> Self {
        Self {
            srqn,
            ring,
            record,
            limits: WrLimits {
                max_sge,
                max_inline: 0,
            },
            producer: 0,
            shared: Arc::new(SrqShared::new(1 << log_entries)),
            scratch: vec![0; stride].into_boxed_slice(),
        }
    }

    pub(crate) fn shared(&self) -> &Arc<SrqShared> {
        &self.shared
    }

    /// The SRQ number.
    pub fn srqn(&self) -> u32 {
        self.srqn
    }

    /// Posts `wrs` in order, then stores the producer record once. A slot
    /// whose earlier WQE has not completed yet makes the queue full.
    /// Failure as for [`crate::SendQueue::post`].
    pub fn post(&mut self, wrs: &[RecvWr<'_>]) -> Result<usize, PostError> {
        let mut posted = 0;
        let mut failure = None;
        for wr in wrs {
            let counter = self.producer;
            let shared = &self.shared;
            match write_recv_wqe(
                &self.ring,
                &mut self.scratch,
                &self.limits,
                wr,
                counter,
                || shared.claim(counter, wr.wr_id),
            ) {
                Ok(()) => {
                    self.producer = self.producer.wrapping_add(1);
                    posted += 1;
                }
                Err(kind) => {
                    failure = Some(kind);
                    break;
                }
            }
        }
        if posted > 0 {
            self.record.store_release(self.producer);
        }
        match failure {
            None => Ok(posted),
            Some(kind) => Err(PostError { posted, kind }),
        }
    }
}
