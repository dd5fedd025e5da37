//! Helpers shared by the integration test suites.
#![allow(dead_code)]

pub mod collab_script;
pub mod fault_server;
