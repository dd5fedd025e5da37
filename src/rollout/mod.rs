//! Multi-turn rollouts: the simulated user and the futures it plays out.

pub mod futures;
pub mod user;
