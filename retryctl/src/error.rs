//! What a command that fails hands back: the error, and whether it is the user's input
//! (exit 2) or a failure (exit 1).

use std::error::Error;
use std::fmt;

/// Exit code of a failure, a mismatch found by `verify` included.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code of bad usage or bad input, as clap uses for its own usage errors.
pub const EXIT_USAGE: u8 = 2;

/// A command's error, with the exit code it calls for.
#[derive(Debug)]
pub struct CliError {
    code: u8,
    error: Box<dyn Error + Send + Sync>,
}

impl CliError {
    /// The user gave input that cannot be used: exit 2.
    pub fn usage(error: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        CliError {
            code: EXIT_USAGE,
            error: error.into(),
        }
    }

    /// Something failed, or a check found a mismatch: exit 1.
    pub fn failure(error: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        CliError {
            code: EXIT_FAILURE,
            error: error.into(),
        }
    }

    /// A failure while doing `context`, with `source` kept as its cause.
    pub fn failure_from(
        context: impl Into<String>,
        source: impl Into<Box<dyn Error + Send + Sync>>,
    ) -> Self {
        CliError::failure(Context {
            context: context.into(),
            source: source.into(),
        })
    }

    /// A usage error about `context`, with `source` kept as its cause.
    pub fn usage_from(
        context: impl Into<String>,
        source: impl Into<Box<dyn Error + Send + Sync>>,
    ) -> Self {
        CliError::usage(Context {
            context: context.into(),
            source: source.into(),
        })
    }

    /// The process exit code.
    pub fn exit_code(&self) -> u8 {
        self.code
    }

    /// The error and its chain of causes, joined by `": "`. A cause whose text its parent
    /// already shows is not repeated.
    pub fn chain(&self) -> String {
        let mut text = self.error.to_string();
        let mut cause = self.error.source();
        while let Some(e) = cause {
            let line = e.to_string();
            if !text.contains(&line) {
                text.push_str(": ");
                text.push_str(&line);
            }
            cause = e.source();
        }
        text
    }
}

impl CliError {
    /// A transport's error while doing `context`: what the transport does not support is
    /// the user's to change (exit 2); anything else is a failure (exit 1).
    pub fn from_transport(context: impl Into<String>, e: retry_core::TransportError) -> Self {
        match e {
            e @ retry_core::TransportError::Unsupported { .. } => CliError::usage(e),
            e => CliError::failure_from(context, e),
        }
    }
}

impl From<retry_core::TransportError> for CliError {
    fn from(e: retry_core::TransportError) -> Self {
        CliError::failure(e)
    }
}

/// An error with what was being done when it happened.
#[derive(Debug)]
struct Context {
    context: String,
    source: Box<dyn Error + Send + Sync>,
}

impl fmt::Display for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)
    }
}

impl Error for Context {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.source)
    }
}
