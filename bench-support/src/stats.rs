//! Summaries of a run's figures.

/// The smallest, the median and the largest of `values` (not empty); the median of an even
/// count is the mean of the two middle values.
///
/// ```
/// use bench_support::stats::min_median_max;
///
/// assert_eq!(min_median_max(vec![3.0, 1.0, 2.0]), (1.0, 2.0, 3.0));
/// assert_eq!(min_median_max(vec![4.0, 1.0, 2.0, 3.0]), (1.0, 2.5, 4.0));
/// ```
pub fn min_median_max(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let half = values.len() / 2;
    let median = if values.len() % 2 == 1 {
        values[half]
    } else {
        (values[half - 1] + values[half]) / 2.0
    };
    (values[0], median, values[values.len() - 1])
}

/// The smallest, the middle and the largest of `values` (not empty); the middle of an even
/// count is the upper of the two middle values, one of the figures rather than a mean.
///
/// ```
/// use bench_support::stats::min_middle_max;
///
/// assert_eq!(min_middle_max(vec![3.0, 1.0, 2.0]), (1.0, 2.0, 3.0));
/// assert_eq!(min_middle_max(vec![4.0, 1.0, 2.0, 3.0]), (1.0, 3.0, 4.0));
/// ```
pub fn min_middle_max(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    (
        values[0],
        values[values.len() / 2],
        values[values.len() - 1],
    )
}

/// p50, p99 and the largest of `values` (not empty), by nearest rank.
///
/// ```
/// use bench_support::stats::percentiles;
///
/// let values: Vec<f64> = (1..=100).map(f64::from).collect();
/// assert_eq!(percentiles(values), (50.0, 99.0, 100.0));
/// ```
pub fn percentiles(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let at =
        |q: f64| values[((values.len() as f64 * q).ceil() as usize).clamp(1, values.len()) - 1];
    (at(0.50), at(0.99), values[values.len() - 1])
}

/// The summary the throughput examples end with: per path the min, middle and max of its
/// total and steady rates over the rounds (`rates[path][round] = (total, steady)`, msg/s),
/// then, for each comparison `(name, ours, plain)`, ours over the stronger of the `plain`
/// paths *of the same round*, min / middle / max.
///
/// ```
/// use bench_support::stats::rates_summary;
///
/// let rates = vec![vec![(100.0, 120.0)], vec![(50.0, 90.0)]];
/// let text = rates_summary(&["plain", "ours"], &rates, &[("success", 1, &[0])]);
/// assert!(text.contains("success               total 0.50 0.50 0.50   steady 0.75 0.75 0.75"));
/// ```
pub fn rates_summary(
    paths: &[&str],
    rates: &[Vec<(f64, f64)>],
    comparisons: &[(&str, usize, &[usize])],
) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n{:<21} {:>24} {:>24}",
        "msg/s min/median/max", "total", "steady"
    );
    for (path, rates) in paths.iter().zip(rates) {
        let (t0, t1, t2) = min_middle_max(rates.iter().map(|r| r.0).collect());
        let (s0, s1, s2) = min_middle_max(rates.iter().map(|r| r.1).collect());
        let _ = writeln!(
            out,
            "{path:<21} {t0:>7.0} {t1:>7.0} {t2:>7.0}  {s0:>7.0} {s1:>7.0} {s2:>7.0}"
        );
    }
    let rounds = rates.iter().map(Vec::len).min().unwrap_or(0);
    let ratios = |ours: usize, plain: &[usize], pick: fn(&(f64, f64)) -> f64| {
        (0..rounds)
            .map(|r| {
                let best = plain
                    .iter()
                    .map(|&p| pick(&rates[p][r]))
                    .fold(f64::MIN, f64::max);
                pick(&rates[ours][r]) / best
            })
            .collect::<Vec<_>>()
    };
    let _ = writeln!(
        out,
        "\nratio ours / strongest plain, same round: min/median/max"
    );
    for (name, ours, plain) in comparisons {
        if rounds == 0 {
            break;
        }
        let (t0, t1, t2) = min_middle_max(ratios(*ours, plain, |r| r.0));
        let (s0, s1, s2) = min_middle_max(ratios(*ours, plain, |r| r.1));
        let _ = writeln!(
            out,
            "{name:<21} total {t0:.2} {t1:.2} {t2:.2}   steady {s0:.2} {s1:.2} {s2:.2}"
        );
    }
    out
}
