#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| transport_nats::fuzzing::header_block(data));
