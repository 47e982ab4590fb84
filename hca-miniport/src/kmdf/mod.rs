//! The KMDF shell (Windows only; never compiled here). Being written.
