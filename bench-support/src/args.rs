//! Command-line arguments: `--flag value` pairs and positional values, with the example's
//! usage line in every error about them, and numbers from the environment.

use std::str::FromStr;

use crate::BoxError;

/// The arguments after the program's name, read one at a time.
///
/// ```
/// use bench_support::args::Args;
///
/// let mut args = Args::from(["--n", "500", "7"], "usage: bench [--n N] [ROUNDS]");
/// let mut n = 2_000u64;
/// let mut rounds = 3usize;
/// while let Some(arg) = args.next() {
///     match arg.as_str() {
///         "--n" => n = args.value(&arg)?,
///         other => {
///             rounds = other.parse()?;
///         }
///     }
/// }
/// assert_eq!((n, rounds), (500, 7));
/// # Ok::<(), bench_support::BoxError>(())
/// ```
pub struct Args {
    rest: std::vec::IntoIter<String>,
    usage: &'static str,
}

impl Args {
    /// This process's arguments (without the program's name); `usage` is quoted in errors.
    pub fn new(usage: &'static str) -> Self {
        Args::from(std::env::args().skip(1), usage)
    }

    /// `args` instead of the process's.
    pub fn from<S: Into<String>>(args: impl IntoIterator<Item = S>, usage: &'static str) -> Self {
        let rest: Vec<String> = args.into_iter().map(Into::into).collect();
        Args {
            rest: rest.into_iter(),
            usage,
        }
    }

    /// The next argument, if any is left.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Option<String> {
        self.rest.next()
    }

    /// The value after `flag`, parsed; an error saying that `flag` needs a value, with the
    /// usage, if none is left.
    pub fn value<T>(&mut self, flag: &str) -> Result<T, BoxError>
    where
        T: FromStr,
        T::Err: Into<BoxError>,
    {
        let value = self
            .rest
            .next()
            .ok_or(format!("{flag} needs a value; {}", self.usage))?;
        value.parse().map_err(Into::into)
    }

    /// The next positional argument parsed, or `default` if none is left.
    pub fn positional<T>(&mut self, default: T) -> Result<T, BoxError>
    where
        T: FromStr,
        T::Err: Into<BoxError>,
    {
        match self.rest.next() {
            Some(value) => value.parse().map_err(Into::into),
            None => Ok(default),
        }
    }

    /// The error for an argument the example does not know, with the usage.
    pub fn unknown(&self, arg: &str) -> BoxError {
        format!("unknown argument {arg:?}; {}", self.usage).into()
    }
}

/// The environment variable `name` parsed, or `default` if it is unset (or not Unicode).
///
/// ```
/// let rounds: u32 = bench_support::args::env_or("BENCH_SUPPORT_UNSET_VARIABLE", 3)?;
/// assert_eq!(rounds, 3);
/// # Ok::<(), bench_support::BoxError>(())
/// ```
pub fn env_or<T>(name: &str, default: T) -> Result<T, BoxError>
where
    T: FromStr,
    T::Err: Into<BoxError>,
{
    match std::env::var(name) {
        Ok(value) => value.parse().map_err(Into::into),
        Err(_) => Ok(default),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_quote_the_flag_and_the_usage() {
        let mut args = Args::from(["--n"], "usage: x [--n N]");
        let flag = args.next().unwrap();
        let missing = args.value::<u64>(&flag).unwrap_err();
        assert_eq!(missing.to_string(), "--n needs a value; usage: x [--n N]");
        assert_eq!(
            args.unknown("--m").to_string(),
            "unknown argument \"--m\"; usage: x [--n N]"
        );
    }

    #[test]
    fn a_positional_value_falls_back_to_its_default() {
        let mut args = Args::from(["5"], "");
        assert_eq!(args.positional(20_000u64).unwrap(), 5);
        assert_eq!(args.positional(3usize).unwrap(), 3);
        let mut bad = Args::from(["x"], "");
        assert!(bad.positional(1u64).is_err());
    }
}
