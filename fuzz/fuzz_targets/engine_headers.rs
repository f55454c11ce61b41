#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| retry_core::fuzzing::engine_headers(data));
