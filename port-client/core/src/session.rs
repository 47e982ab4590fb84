//! The connection with the peer, as a sans-IO state machine.
//!
//! Each method takes what happened (the device came up, a datagram or an
//! RC payload arrived, the RC QP finished connecting, the device is going
//! down, a bounded wait ran out) and returns the [`Action`]s the shell
//! carries out, in order. The shell holds the session under its lock and
//! carries the actions out after releasing it.
//!
//! The protocol (docs/port-client.md):
//! - **Discovery.** On start (D0 entry) a side that knows its peer's UD
//!   address sends `Hello` with its RC parameters. A side that receives a
//!   `Hello` connects its RC QP to the sender and, once connected,
//!   answers `HelloAck` with its own: it is the *responder*. A side that
//!   receives a `HelloAck` connects and then starts the rounds: it is the
//!   *initiator*. Should both have said hello at once, both end up
//!   connected and acknowledged, and the side with the smaller port GUID
//!   initiates.
//! - **Ping-pong.** The initiator sends ping `n`; the responder checks it
//!   and answers pong `n`; the initiator checks it, counts a round, and
//!   sends ping `n + 1` until the target is reached.
//! - **Goodbye.** In its D0 exit a connected side stops starting rounds,
//!   lets the round in flight drain, sends `Goodbye` and waits (boundedly)
//!   for `GoodbyeAck`; the peer (after the pong of its own round in flight,
//!   if any) answers, tears its side down and waits for a new `Hello`.
//!   Then the side going down tears down its own. A side that finds
//!   itself already closed by its peer has nothing to exchange.
//! - **Loss.** An error on the connection's RC QP (the peer vanished)
//!   tears the connection down; a side whose HCA vanished abandons it.

use alloc::vec::Vec;

use crate::message::{
    ConnParams, Message, MessageError, MessageKind, PayloadKind, check_payload, payload,
};

/// How long an unanswered hello waits before it is sent again (simulated
/// or real time, as the shell's timer counts it).
pub const TICK_NS: u64 = 20_000_000;

/// How many times an unanswered hello is sent again per start.
pub const HELLO_RETRIES: u32 = 20;

/// What the shell must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send this datagram to the peer's UD QP (Q_Key
    /// `message::PORT_CLIENT_QKEY`).
    SendDatagram(Message),
    /// Take the RC QP to RESET, then INIT, RTR towards `remote` and RTS
    /// sending from `local_psn`, with receives posted; report the outcome
    /// with [`Session::on_connected`]. Right after [`Action::ResetRc`] it
    /// is meant for the new QP: the shell connects once the old one is
    /// replaced.
    ConnectRc {
        /// The peer's parameters.
        remote: ConnParams,
        /// This side's first send PSN.
        local_psn: u32,
    },
    /// Send this payload on the RC QP.
    SendRc([u8; crate::message::PAYLOAD_LEN]),
    /// The connection is over: tear the RC QP down. (A shell replaces it
    /// with a new QP and reports its number with
    /// [`Session::set_local_qpn`]: a QP that was connected may not connect
    /// again before the TIME WAIT quiet period, guide 6.5.2.)
    ResetRc,
    /// The goodbye exchange is over (acknowledged, or its wait ran out):
    /// release the D0 exit's wait.
    CloseDone,
}

/// Where the session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Not started, or down (below D0).
    Down,
    /// Started; `Hello` sent or waiting for the peer's.
    Discovering,
    /// The RC QP is being connected.
    Connecting,
    /// Connected: rounds run.
    Running,
    /// `Goodbye` sent in the D0 exit; waiting for the answer.
    Closing,
    /// The peer said goodbye while this side's round was in flight: the
    /// answer waits for the round's pong.
    PeerLeaving,
    /// The peer said goodbye and its side is gone: waiting for its
    /// `Hello`.
    PeerClosed,
    /// The RC QP could not be connected.
    Failed,
}

/// What the session counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Rounds completed (pong checked) as initiator.
    pub rounds: u64,
    /// Pings answered as responder.
    pub pongs_sent: u64,
    /// RC payloads whose bytes were not what the round says.
    pub bad_payloads: u64,
    /// Datagrams refused by the parser.
    pub bad_datagrams: u64,
    /// Connections made.
    pub connections: u64,
    /// `Goodbye`s this side sent and saw acknowledged over the fabric.
    pub goodbyes_acknowledged: u64,
    /// `Goodbye`s of the peer this side answered.
    pub goodbyes_answered: u64,
    /// Goodbye waits that ran out without an answer.
    pub goodbye_timeouts: u64,
    /// Connections that ended in an error on the RC QP (the peer vanished
    /// without a goodbye).
    pub connections_lost: u64,
    /// Hellos sent again because no answer came.
    pub hellos_resent: u64,
    /// The peer's hello received again on a live connection (answered
    /// again).
    pub duplicates: u64,
}

/// One side's connection with its peer.
#[derive(Debug)]
pub struct Session {
    port_guid: u64,
    local: ConnParams,
    rounds_per_connection: u32,
    phase: Phase,
    remote: Option<(u64, ConnParams)>,
    /// Answer `HelloAck` once connected.
    ack_when_connected: bool,
    /// Start the rounds once connected.
    initiate_when_connected: bool,
    initiator: bool,
    next_seq: u32,
    rounds_this_connection: u32,
    /// Rounds allowed on this connection.
    budget: u32,
    /// The initiator's ping is out and its pong not back.
    round_in_flight: bool,
    /// The goodbye waits for the round in flight.
    goodbye_deferred: bool,
    /// Times the hello may still be sent again.
    hellos_left: u32,
    counters: Counters,
}

impl Session {
    /// A session for the port `port_guid` whose RC side is `local`,
    /// running `rounds_per_connection` rounds each time it connects as
    /// initiator.
    pub fn new(port_guid: u64, local: ConnParams, rounds_per_connection: u32) -> Self {
        Self {
            port_guid,
            local,
            rounds_per_connection,
            phase: Phase::Down,
            remote: None,
            ack_when_connected: false,
            initiate_when_connected: false,
            initiator: false,
            next_seq: 0,
            rounds_this_connection: 0,
            budget: 0,
            round_in_flight: false,
            goodbye_deferred: false,
            hellos_left: 0,
            counters: Counters::default(),
        }
    }

    /// Where it is.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// What it counted.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Whether this side runs the rounds on the current connection.
    pub fn is_initiator(&self) -> bool {
        self.initiator
    }

    /// This side's RC parameters, as its messages carry them.
    pub fn local(&self) -> ConnParams {
        self.local
    }

    fn message(&self, kind: MessageKind) -> Message {
        Message {
            kind,
            port_guid: self.port_guid,
            params: self.local,
        }
    }

    /// The device is in D0 (first start or resume): say hello if the
    /// peer's UD address is known (`peer_known`), else wait for its.
    pub fn start(&mut self, peer_known: bool) -> Vec<Action> {
        self.phase = Phase::Discovering;
        self.remote = None;
        self.ack_when_connected = false;
        self.initiate_when_connected = false;
        self.initiator = false;
        self.round_in_flight = false;
        self.goodbye_deferred = false;
        // A new first PSN per start, so nothing of an old connection
        // matches the new one.
        self.local.psn = (self.local.psn + 0x1000) & 0x00FF_FFFF;
        self.hellos_left = if peer_known { HELLO_RETRIES } else { 0 };
        if peer_known {
            alloc::vec![Action::SendDatagram(self.message(MessageKind::Hello))]
        } else {
            Vec::new()
        }
    }

    /// A datagram arrived (its bytes after the GRH). A malformed one is
    /// counted and refused; nothing changes.
    pub fn on_datagram(&mut self, bytes: &[u8]) -> Result<Vec<Action>, MessageError> {
        let message = Message::decode(bytes).inspect_err(|_| self.counters.bad_datagrams += 1)?;
        Ok(self.on_message(message))
    }

    fn is_from_peer(&self, message: &Message) -> bool {
        self.remote.is_some_and(|(guid, params)| {
            guid == message.port_guid && params.qpn == message.params.qpn
        })
    }

    fn connect(&mut self, message: &Message) -> Action {
        self.remote = Some((message.port_guid, message.params));
        self.round_in_flight = false;
        self.phase = Phase::Connecting;
        Action::ConnectRc {
            remote: message.params,
            local_psn: self.local.psn,
        }
    }

    fn on_message(&mut self, message: Message) -> Vec<Action> {
        let mut actions = Vec::new();
        match (message.kind, self.phase) {
            // Going down or down: no new connection.
            (_, Phase::Down) => {}
            (MessageKind::Hello, Phase::Closing) => {}
            // Connected: only the peer itself may restart the connection
            // (a stranger's hello would hijack it).
            (MessageKind::Hello, Phase::Connecting | Phase::Running | Phase::PeerLeaving)
                if self
                    .remote
                    .is_some_and(|(guid, _)| guid != message.port_guid) => {}
            // The peer's hello again, the same parameters: our answer was
            // lost (UD is unreliable) — answer again, keep the connection.
            (MessageKind::Hello, Phase::Connecting | Phase::Running | Phase::PeerLeaving)
                if self.remote == Some((message.port_guid, message.params)) =>
            {
                self.counters.duplicates += 1;
                if self.phase != Phase::Connecting {
                    actions.push(Action::SendDatagram(self.message(MessageKind::HelloAck)));
                }
            }
            // The peer restarted (new parameters) while a connect is
            // under way: ignored; its hello comes again once we are
            // connected (it resends until answered).
            (MessageKind::Hello, Phase::Connecting) if self.remote.is_some() => {}
            (MessageKind::Hello, _) => {
                // A new peer, or the peer restarted: (re)connect and
                // answer once connected. A QP that was connected is torn
                // down first (it may not connect again before TIME WAIT).
                if matches!(self.phase, Phase::Running | Phase::PeerLeaving) {
                    actions.push(Action::ResetRc);
                }
                self.ack_when_connected = true;
                self.initiate_when_connected = false;
                self.initiator = false;
                actions.push(self.connect(&message));
            }
            (MessageKind::HelloAck, Phase::Discovering) => {
                self.initiate_when_connected = true;
                actions.push(self.connect(&message));
            }
            // Both said hello at once: the smaller port GUID initiates.
            (MessageKind::HelloAck, Phase::Connecting | Phase::Running)
                if self.is_from_peer(&message)
                    && self.port_guid < message.port_guid
                    && !self.initiator
                    && !self.initiate_when_connected =>
            {
                if self.phase == Phase::Running {
                    actions.extend(self.initiate());
                } else {
                    self.initiate_when_connected = true;
                }
            }
            // The peer goes down with our round in flight: its pong
            // first, then the answer (the peer's wait is bounded).
            (MessageKind::Goodbye, Phase::Running)
                if self.is_from_peer(&message) && self.round_in_flight =>
            {
                self.phase = Phase::PeerLeaving;
            }
            (MessageKind::Goodbye, Phase::Connecting | Phase::Running | Phase::Closing)
                if self.is_from_peer(&message) =>
            {
                // The peer goes down: answer, tear down, wait for its
                // hello. (Both closing at once: each answers the other.)
                actions = self.answer_goodbye();
            }
            (MessageKind::GoodbyeAck, Phase::Closing) if self.is_from_peer(&message) => {
                self.counters.goodbyes_acknowledged += 1;
                self.remote = None;
                self.phase = Phase::Down;
                actions.push(Action::ResetRc);
                actions.push(Action::CloseDone);
            }
            // Stale or unsolicited: ignored.
            _ => {}
        }
        actions
    }

    /// Answers the peer's goodbye and tears this side down.
    fn answer_goodbye(&mut self) -> Vec<Action> {
        self.counters.goodbyes_answered += 1;
        let mut actions = alloc::vec![
            Action::SendDatagram(self.message(MessageKind::GoodbyeAck)),
            Action::ResetRc,
        ];
        if self.phase == Phase::Closing {
            actions.push(Action::CloseDone);
            self.phase = Phase::Down;
        } else {
            self.phase = Phase::PeerClosed;
        }
        self.remote = None;
        self.round_in_flight = false;
        self.goodbye_deferred = false;
        actions
    }

    fn initiate(&mut self) -> Vec<Action> {
        self.initiator = true;
        self.initiate_when_connected = false;
        self.rounds_this_connection = 0;
        self.budget = self.rounds_per_connection;
        self.ping()
    }

    fn ping(&mut self) -> Vec<Action> {
        if self.phase != Phase::Running
            || self.round_in_flight
            || self.rounds_this_connection >= self.budget
        {
            return Vec::new();
        }
        self.round_in_flight = true;
        alloc::vec![Action::SendRc(payload(self.next_seq, PayloadKind::Ping))]
    }

    /// The shell replaced the RC QP (a connection's QP is not reused: its
    /// number waits out TIME WAIT): later messages carry the new number.
    pub fn set_local_qpn(&mut self, qpn: u32) {
        self.local.qpn = qpn;
    }

    /// Whether the shell should call [`Session::on_tick`] after
    /// [`TICK_NS`]: a hello is out, unanswered, with retries left.
    pub fn wants_tick(&self) -> bool {
        self.phase == Phase::Discovering && self.hellos_left > 0
    }

    /// [`TICK_NS`] passed: an unanswered hello is sent again (UD loses
    /// datagrams), at most [`HELLO_RETRIES`] times per start.
    pub fn on_tick(&mut self) -> Vec<Action> {
        if !self.wants_tick() {
            return Vec::new();
        }
        self.hellos_left -= 1;
        self.counters.hellos_resent += 1;
        alloc::vec![Action::SendDatagram(self.message(MessageKind::Hello))]
    }

    /// Allows `rounds` more round trips on the current connection (as
    /// initiator; a responder answers whatever comes). Starts the next
    /// round if the connection was idle.
    pub fn run_more(&mut self, rounds: u32) -> Vec<Action> {
        let idle = self.rounds_this_connection >= self.budget;
        self.budget = self.budget.saturating_add(rounds);
        if self.initiator && idle {
            self.ping()
        } else {
            Vec::new()
        }
    }

    /// The RC QP finished connecting (`ok`) or failed to.
    pub fn on_connected(&mut self, ok: bool) -> Vec<Action> {
        if self.phase != Phase::Connecting {
            return Vec::new();
        }
        if !ok {
            self.phase = Phase::Failed;
            return alloc::vec![Action::ResetRc];
        }
        self.phase = Phase::Running;
        self.counters.connections += 1;
        let mut actions = Vec::new();
        if core::mem::take(&mut self.ack_when_connected) {
            actions.push(Action::SendDatagram(self.message(MessageKind::HelloAck)));
        }
        if self.initiate_when_connected {
            actions.extend(self.initiate());
        }
        actions
    }

    /// An RC payload arrived.
    pub fn on_rc_received(&mut self, bytes: &[u8]) -> Vec<Action> {
        let Some((seq, kind)) = check_payload(bytes) else {
            self.counters.bad_payloads += 1;
            return Vec::new();
        };
        match kind {
            PayloadKind::Ping if !self.initiator => {
                self.counters.pongs_sent += 1;
                alloc::vec![Action::SendRc(payload(seq, PayloadKind::Pong))]
            }
            PayloadKind::Pong if self.initiator && self.round_in_flight && seq == self.next_seq => {
                self.counters.rounds += 1;
                self.rounds_this_connection += 1;
                self.next_seq = self.next_seq.wrapping_add(1);
                self.round_in_flight = false;
                match self.phase {
                    // Drained: the goodbye deferred for this round goes now.
                    Phase::Closing if core::mem::take(&mut self.goodbye_deferred) => {
                        alloc::vec![Action::SendDatagram(self.message(MessageKind::Goodbye))]
                    }
                    // Drained: the peer's goodbye is answered now.
                    Phase::PeerLeaving => self.answer_goodbye(),
                    // In `Closing` no new round starts.
                    _ => self.ping(),
                }
            }
            _ => {
                self.counters.bad_payloads += 1;
                Vec::new()
            }
        }
    }

    /// The device leaves D0 (the shell's D0 exit, PASSIVE_LEVEL). Returns
    /// the actions and whether the shell must wait (boundedly) for
    /// [`Action::CloseDone`].
    pub fn begin_close(&mut self) -> (Vec<Action>, bool) {
        match self.phase {
            // A round in flight drains first: the goodbye follows its pong.
            Phase::Running if self.remote.is_some() && self.round_in_flight => {
                self.phase = Phase::Closing;
                self.goodbye_deferred = true;
                (Vec::new(), true)
            }
            Phase::Connecting | Phase::Running if self.remote.is_some() => {
                self.phase = Phase::Closing;
                (
                    alloc::vec![Action::SendDatagram(self.message(MessageKind::Goodbye))],
                    true,
                )
            }
            // Going down while the peer's goodbye waits for our pong: answer
            // it now (the pong will not come back to a QP being torn down).
            Phase::PeerLeaving => {
                let actions = self.answer_goodbye();
                self.phase = Phase::Down;
                (actions, false)
            }
            Phase::Closing => (Vec::new(), true),
            Phase::Down => (Vec::new(), false),
            // A failed connect leaves the RC QP to reset.
            Phase::Failed => {
                self.phase = Phase::Down;
                (alloc::vec![Action::ResetRc], false)
            }
            // Already closed (and reset) by the peer, or never connected:
            // nothing to exchange or tear down.
            _ => {
                self.phase = Phase::Down;
                self.remote = None;
                (Vec::new(), false)
            }
        }
    }

    /// The RC QP reported an error on the connection (retries exhausted:
    /// the peer vanished without a goodbye). Tears the connection down
    /// and waits for a hello; nothing once it is already down.
    pub fn on_connection_lost(&mut self) -> Vec<Action> {
        match self.phase {
            Phase::Connecting | Phase::Running | Phase::PeerLeaving => {
                self.counters.connections_lost += 1;
                self.round_in_flight = false;
                self.phase = Phase::PeerClosed;
                self.remote = None;
                alloc::vec![Action::ResetRc]
            }
            Phase::Closing => {
                self.counters.connections_lost += 1;
                self.round_in_flight = false;
                self.goodbye_deferred = false;
                self.phase = Phase::Down;
                self.remote = None;
                alloc::vec![Action::ResetRc, Action::CloseDone]
            }
            _ => Vec::new(),
        }
    }

    /// The HCA is gone (surprise removal): no exchange is possible and
    /// nothing on the fabric is torn down; the session is down.
    pub fn abandon(&mut self) {
        self.phase = Phase::Down;
        self.remote = None;
    }

    /// The goodbye wait ran out (the peer or the fabric is gone).
    pub fn close_timed_out(&mut self) -> Vec<Action> {
        if self.phase != Phase::Closing {
            return Vec::new();
        }
        self.round_in_flight = false;
        self.goodbye_deferred = false;
        self.counters.goodbye_timeouts += 1;
        self.phase = Phase::Down;
        self.remote = None;
        alloc::vec![Action::ResetRc, Action::CloseDone]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    fn params(qpn: u32) -> ConnParams {
        ConnParams {
            qpn,
            psn: 100,
            rkey: 0x100 + qpn,
            addr: 0x10_0000,
            len: 8192,
        }
    }

    /// Two sessions wired through a perfect fabric: datagrams and RC
    /// payloads delivered in order, connects succeeding at once.
    struct Pair {
        s: [Session; 2],
        /// (to, what)
        wire: VecDeque<(usize, Delivery)>,
        resets: [u32; 2],
        close_done: [u32; 2],
    }

    enum Delivery {
        Datagram([u8; crate::message::WIRE_LEN]),
        Rc([u8; crate::message::PAYLOAD_LEN]),
        Connected,
    }

    impl Pair {
        fn new(rounds: u32) -> Self {
            Self {
                s: [
                    Session::new(0xA, params(0x40), rounds),
                    Session::new(0xB, params(0x41), rounds),
                ],
                wire: VecDeque::new(),
                resets: [0; 2],
                close_done: [0; 2],
            }
        }
        /// A pair started as [`Self::start_both`] does.
        fn started(rounds: u32) -> Self {
            let mut pair = Self::new(rounds);
            pair.start_both();
            pair
        }
        /// A starts first (its peer not known), then B, which knows A and
        /// says hello; everything is delivered.
        fn start_both(&mut self) {
            self.start(0, false);
            self.start(1, true);
            self.run();
        }
        /// Starts side `side` (`peer_known`: it says hello) and sends
        /// what it asks for.
        fn start(&mut self, side: usize, peer_known: bool) {
            let actions = self.s[side].start(peer_known);
            self.act(side, actions);
        }
        fn act(&mut self, from: usize, actions: Vec<Action>) {
            for action in actions {
                match action {
                    Action::SendDatagram(m) => self
                        .wire
                        .push_back((1 - from, Delivery::Datagram(m.encode()))),
                    Action::SendRc(p) => self.wire.push_back((1 - from, Delivery::Rc(p))),
                    Action::ConnectRc { .. } => self.wire.push_back((from, Delivery::Connected)),
                    Action::ResetRc => self.resets[from] += 1,
                    Action::CloseDone => self.close_done[from] += 1,
                }
            }
        }
        fn run(&mut self) {
            while let Some((to, what)) = self.wire.pop_front() {
                let actions = match what {
                    Delivery::Datagram(bytes) => self.s[to].on_datagram(&bytes).unwrap(),
                    Delivery::Rc(bytes) => self.s[to].on_rc_received(&bytes),
                    Delivery::Connected => self.s[to].on_connected(true),
                };
                self.act(to, actions);
            }
        }
    }

    #[test]
    fn the_later_side_says_hello_and_the_other_initiates_the_rounds() {
        let p = Pair::started(5);
        assert!(p.s[0].phase() == Phase::Running && p.s[1].phase() == Phase::Running);
        // B said hello, A answered: B initiates.
        assert!(p.s[1].is_initiator() && !p.s[0].is_initiator());
        assert_eq!(p.s[1].counters().rounds, 5);
        assert_eq!(p.s[0].counters().pongs_sent, 5);
        assert_eq!(
            p.s[0].counters().bad_payloads + p.s[1].counters().bad_payloads,
            0
        );
    }

    #[test]
    fn more_rounds_restart_an_idle_connection() {
        let mut p = Pair::started(2);
        assert_eq!(p.s[1].counters().rounds, 2);
        let more = p.s[1].run_more(3);
        assert_eq!(more.len(), 1, "the next ping");
        p.act(1, more);
        p.run();
        assert_eq!(p.s[1].counters().rounds, 5);
        // The responder does not start rounds.
        assert!(p.s[0].run_more(3).is_empty());
    }

    #[test]
    fn simultaneous_hellos_give_one_initiator() {
        let mut p = Pair::new(3);
        let (a, b) = (p.s[0].start(true), p.s[1].start(true));
        p.act(0, a);
        p.act(1, b);
        p.run();
        assert!(p.s[0].is_initiator() ^ p.s[1].is_initiator());
        assert!(p.s[0].is_initiator(), "the smaller port GUID");
        assert_eq!(p.s[0].counters().rounds, 3);
    }

    #[test]
    fn goodbye_is_answered_by_the_peer_and_the_other_finds_it_closed() {
        let mut p = Pair::started(2);
        let (actions, wait) = p.s[1].begin_close();
        assert!(wait);
        p.act(1, actions);
        p.run();
        assert_eq!(p.close_done, [0, 1]);
        assert_eq!(p.s[1].counters().goodbyes_acknowledged, 1);
        assert_eq!(p.s[0].counters().goodbyes_answered, 1);
        assert_eq!(p.s[0].phase(), Phase::PeerClosed);
        assert_eq!(p.resets, [1, 1]);
        // A goes down later: nothing to exchange.
        let (actions, wait) = p.s[0].begin_close();
        assert!(!wait);
        assert!(actions.is_empty(), "reset when the peer said goodbye");
        // Both resume: they reconnect and run rounds again.
        p.start_both();
        assert_eq!(p.s[1].counters().rounds, 4);
        assert_eq!(p.s[1].counters().connections, 2);
    }

    /// A connected pair with no rounds run yet: (pair, initiator index).
    fn connected_idle() -> (Pair, usize) {
        let p = Pair::started(0);
        assert!(p.s[1].is_initiator());
        (p, 1)
    }

    #[test]
    fn an_initiator_going_down_drains_its_round_before_the_goodbye() {
        let (mut p, i) = connected_idle();
        let ping = p.s[i].run_more(1);
        p.act(i, ping);
        // The ping is on the wire: the goodbye waits for its pong.
        let (actions, wait) = p.s[i].begin_close();
        assert!(wait && actions.is_empty());
        p.run();
        assert_eq!(p.s[i].counters().rounds, 1, "the round completed");
        assert_eq!(p.s[i].counters().goodbyes_acknowledged, 1);
        assert_eq!(p.close_done[i], 1);
        assert_eq!(p.s[1 - i].phase(), Phase::PeerClosed);
    }

    #[test]
    fn a_responder_going_down_gets_its_answer_after_the_round_in_flight() {
        let (mut p, i) = connected_idle();
        let r = 1 - i;
        let ping = p.s[i].run_more(1);
        p.act(i, ping);
        let (goodbye, wait) = p.s[r].begin_close();
        assert!(wait);
        p.act(r, goodbye);
        // The responder answers the ping while closing; the initiator
        // holds its answer to the goodbye until the pong is back.
        p.run();
        assert_eq!(p.s[i].counters().rounds, 1);
        assert_eq!(p.s[i].counters().goodbyes_answered, 1);
        assert_eq!(p.s[r].counters().goodbyes_acknowledged, 1);
        assert_eq!(p.close_done[r], 1);
        assert_eq!(p.s[i].phase(), Phase::PeerClosed);
    }

    #[test]
    fn a_lost_hello_or_answer_is_sent_again_and_a_duplicate_keeps_the_connection() {
        let mut p = Pair::new(2);
        p.start(0, false);
        assert!(!p.s[0].wants_tick(), "no hello out");
        // B's hello is lost.
        let _lost = p.s[1].start(true);
        assert!(p.s[1].wants_tick());
        let again = p.s[1].on_tick();
        p.act(1, again);
        // A answers, but the answer is lost: A is connected, B still asks.
        let (to, hello) = p.wire.pop_front().unwrap();
        assert_eq!(to, 0);
        let Delivery::Datagram(hello) = hello else {
            panic!("a datagram")
        };
        let connect = p.s[0].on_datagram(&hello).unwrap();
        let _lost_ack = p.s[0].on_connected(matches!(connect[..], [Action::ConnectRc { .. }]));
        assert_eq!(p.s[0].phase(), Phase::Running);
        let again = p.s[1].on_tick();
        p.act(1, again);
        p.run();
        assert_eq!(p.s[0].counters().duplicates, 1, "answered again");
        assert_eq!(p.s[0].counters().connections, 1, "not reconnected");
        assert_eq!(p.s[1].counters().hellos_resent, 2);
        assert_eq!(p.s[1].counters().rounds, 2);
        assert!(!p.s[1].wants_tick());
        // A duplicate answer does not start the rounds again.
        let ack = Message {
            kind: MessageKind::HelloAck,
            port_guid: 0xA,
            params: p.s[0].local(),
        };
        assert!(p.s[1].on_datagram(&ack.encode()).unwrap().is_empty());
    }

    #[test]
    fn hellos_are_resent_a_bounded_number_of_times() {
        let mut s = Session::new(0xA, params(0x40), 1);
        let _ = s.start(true);
        let mut resent = 0;
        while s.wants_tick() {
            assert_eq!(s.on_tick().len(), 1);
            resent += 1;
        }
        assert_eq!(resent, HELLO_RETRIES);
        assert!(s.on_tick().is_empty());
    }

    #[test]
    fn a_goodbye_wait_that_runs_out_closes_anyway() {
        let mut p = Pair::started(1);
        let (_lost, wait) = p.s[0].begin_close();
        assert!(wait);
        assert_eq!(
            p.s[0].close_timed_out(),
            [Action::ResetRc, Action::CloseDone]
        );
        assert_eq!(p.s[0].counters().goodbye_timeouts, 1);
        assert_eq!(p.s[0].phase(), Phase::Down);
        assert!(p.s[0].close_timed_out().is_empty(), "once");
    }

    #[test]
    fn a_lost_connection_is_torn_down_once_and_the_pair_reconnects() {
        let mut p = Pair::started(1);
        assert_eq!(p.s[1].on_connection_lost(), [Action::ResetRc]);
        assert!(p.s[1].on_connection_lost().is_empty(), "once");
        assert_eq!(p.s[1].phase(), Phase::PeerClosed);
        assert_eq!(p.s[1].counters().connections_lost, 1);
        // The peer comes back with a hello: connected again.
        p.start(0, true);
        p.run();
        assert_eq!(p.s[1].phase(), Phase::Running);
        assert_eq!(p.s[1].counters().connections, 2);
        p.s[0].abandon();
        assert_eq!(p.s[0].phase(), Phase::Down);
        assert_eq!(p.s[0].begin_close(), (Vec::new(), false));
    }

    #[test]
    fn a_strangers_hello_does_not_take_over_a_connection_but_the_peers_restarts_it() {
        let (mut p, i) = connected_idle();
        let r = 1 - i;
        let stranger = Message {
            kind: MessageKind::Hello,
            port_guid: 0xC,
            params: params(0x77),
        };
        assert_eq!(p.s[r].on_datagram(&stranger.encode()), Ok(Vec::new()));
        assert_eq!(p.s[r].phase(), Phase::Running);
        // The peer itself restarted (a new QP): reconnect to it.
        let restarted = Message {
            kind: MessageKind::Hello,
            port_guid: 0xB,
            params: params(0x99),
        };
        let actions = p.s[r].on_datagram(&restarted.encode()).unwrap();
        assert!(
            matches!(actions[..], [Action::ResetRc, Action::ConnectRc { remote, .. }] if remote.qpn == 0x99),
            "the connected QP torn down, then a connect: {actions:?}"
        );
    }

    #[test]
    fn garbage_and_strangers_change_nothing() {
        let mut s = Session::new(0xA, params(0x40), 1);
        let _ = s.start(false);
        assert!(s.on_datagram(&[0; 7]).is_err());
        assert_eq!(s.counters().bad_datagrams, 1);
        // A goodbye from a port that is not the peer: ignored.
        let stranger = Message {
            kind: MessageKind::Goodbye,
            port_guid: 0xC,
            params: params(0x77),
        };
        assert_eq!(s.on_datagram(&stranger.encode()), Ok(Vec::new()));
        assert_eq!(s.phase(), Phase::Discovering);
        // A pong nobody asked for is counted as bad.
        assert!(s.on_rc_received(&payload(0, PayloadKind::Pong)).is_empty());
        assert_eq!(s.counters().bad_payloads, 1);
    }
}
