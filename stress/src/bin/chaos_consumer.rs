//! A chaos consumer process: the real `Consumer` on transport-amqp091 or transport-amqp10,
//! journaling every delivery, handler run, publish, settlement and terminal; see
//! `stress::chaos::consumer`. Started by the chaos driver with `key=value` arguments;
//! stops gracefully when its standard input closes.

fn main() -> std::process::ExitCode {
    stress::chaos::consumer::main(std::env::args().skip(1))
}
