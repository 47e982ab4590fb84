//! Scenario tests live in `tests/tests/`; this library holds what they share.
