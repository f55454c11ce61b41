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
