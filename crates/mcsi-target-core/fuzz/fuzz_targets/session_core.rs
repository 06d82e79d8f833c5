//! The target's session core driven by arbitrary PDU sequences with no runtime, no sockets and
//! no threads: each input is one session, run to its end in a few microseconds. The body (what
//! the input means, what is checked) is `crates/mcsi-target-core/tests/fuzz_body`, which
//! `cargo test` also runs on pseudo-random inputs.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/fuzz_body/mod.rs"]
mod fuzz_body;

fuzz_target!(|data: &[u8]| {
    let _ = fuzz_body::run(data);
});
