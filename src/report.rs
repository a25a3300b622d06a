//! Human-readable reports (the `bespoke plan` tables).
