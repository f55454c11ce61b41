#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| transport_amqp10::fuzzing::tap(data));
