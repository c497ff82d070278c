#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    unused_imports,
    rust_2018_idioms,
    unnecessary_transmutes,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used
)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
