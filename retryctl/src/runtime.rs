//! The plumbing every command shares: printing to a closed pipe, and running a command's
//! future.

use crate::error::CliError;

/// `println!` that does not panic when standard output is closed (`retryctl ... | head`).
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}
pub(crate) use outln;

/// Runs `future` to completion on a single-threaded runtime: the commands talk to one
/// broker, one request at a time.
pub(crate) fn block_on<T>(
    future: impl Future<Output = Result<T, CliError>>,
) -> Result<T, CliError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::failure_from("cannot start the async runtime", e))?
        .block_on(future)
}
