//! Seeded dropout.
