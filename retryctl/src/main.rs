//! The `retryctl` command: see the library's documentation (`cargo doc -p retryctl`).

fn main() -> std::process::ExitCode {
    retryctl::main()
}
