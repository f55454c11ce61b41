//! [`Verdict`]: how a scenario ended, for the scenarios, their building blocks and the
//! harnesses that run them.

/// How a scenario ended, when it did not fail. A failing scenario panics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every check held; the notes say what was observed (waits, counts).
    Passed {
        /// What was observed, for the test's output.
        notes: Vec<String>,
    },
    /// The harness lacks something the scenario needs.
    Skipped {
        /// Why, for the test's output.
        reason: String,
    },
}

impl Verdict {
    /// A pass with notes.
    pub fn passed(notes: impl IntoIterator<Item = String>) -> Self {
        Verdict::Passed {
            notes: notes.into_iter().collect(),
        }
    }
}
